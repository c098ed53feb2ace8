//! `add_rows_scaled`, the scatter a mixture-of-experts layer adds one
//! expert's outputs with: the CPU kernel against the trait's default (which
//! goes through the host with the other ops), and its refusal of rows it
//! cannot address.

use corridor_backend::cpu::CpuBackend;
use corridor_backend::{unfused, ActShape, Backend, DType, HostTensor, TensorBytes};

/// An activation of `rows x cols` holding `values` (row-major).
fn act(b: &CpuBackend, rows: usize, cols: usize, values: &[f32]) -> <CpuBackend as Backend>::Act {
    let table = b
        .upload_weight(&HostTensor {
            name: "values".into(),
            dtype: DType::F32,
            shape: vec![rows, cols],
            data: TensorBytes::from_vec(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        })
        .unwrap();
    let mut a = b.alloc_act(ActShape { rows, cols }).unwrap();
    b.embedding(&table, &(0..rows as u32).collect::<Vec<_>>(), &mut a).unwrap();
    a
}

#[test]
fn the_cpu_kernel_adds_what_the_default_adds() {
    let b = CpuBackend::new();
    let (rows, cols) = (5, 3);
    let base: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 2.0).collect();
    let y: Vec<f32> = (0..3 * cols).map(|i| 1.0 + i as f32).collect();
    let (idx, scales) = ([4usize, 1, 2], [0.25f32, -1.0, 2.0]);
    let mut fast = act(&b, rows, cols, &base);
    let mut slow = act(&b, rows, cols, &base);
    let ya = act(&b, 3, cols, &y);
    b.add_rows_scaled(&mut fast, rows, &ya, &idx, &scales).unwrap();
    unfused::add_rows_scaled(&b, &mut slow, rows, &ya, &idx, &scales).unwrap();
    let (mut f, mut s) = (Vec::new(), Vec::new());
    b.read_rows(&fast, rows, &mut f);
    b.read_rows(&slow, rows, &mut s);
    assert_eq!(f, s);
    let mut want = base.clone();
    for (i, (&r, &k)) in idx.iter().zip(&scales).enumerate() {
        for c in 0..cols {
            want[r * cols + c] += k * y[i * cols + c];
        }
    }
    assert_eq!(f, want);
    assert_eq!(&f[..cols], &base[..cols], "a row no expert chose is left alone");
}

#[test]
fn rows_outside_the_buffer_are_refused() {
    let b = CpuBackend::new();
    let mut out = act(&b, 2, 2, &[0.0; 4]);
    let y = act(&b, 1, 2, &[1.0, 1.0]);
    assert!(b.add_rows_scaled(&mut out, 2, &y, &[2], &[1.0]).is_err());
    assert!(b.add_rows_scaled(&mut out, 2, &y, &[0], &[]).is_err());
    assert!(unfused::add_rows_scaled(&b, &mut out, 2, &y, &[2], &[1.0]).is_err());
}
