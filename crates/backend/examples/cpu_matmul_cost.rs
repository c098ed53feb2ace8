//! What a CPU matmul of a few rows costs by each path, per weight format:
//! the 8-bit dot (weights read once per four rows) against the f32 GEMM
//! (weights widened once per call), at the row counts of decode and mixed
//! steps. The crossover sets `Q8_DOT_MAX_ROWS` in `cpu/mod.rs`.
//!
//!   cargo run --release -p corridor-backend --example cpu_matmul_cost [N K]
//!
//! N × K is the weight's shape (default 1536 × 576, SmolLM2's gate); the
//! weights are random codes with a fixed scale. `ROWS=1,2,8` picks the row
//! counts. Run it on an idle machine.

use corridor_backend::cpu::{Bf16Rounding, CpuBackend, MatmulInput};
use corridor_backend::{ActShape, Backend, DType, HostTensor, TensorBytes};
use std::time::Instant;

/// Where a block's f16 scales sit, as (offset, count) from its start.
fn scales(dtype: DType) -> (usize, usize) {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => (0, 2),
        DType::Q6_K => (208, 1),
        _ => (0, 1),
    }
}

fn weight(dtype: DType, n: usize, k: usize) -> HostTensor {
    let bytes = dtype.bytes_for(n * k).expect("whole blocks");
    let mut data: Vec<u8> =
        (0..bytes as u64).map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 57) as u8).collect();
    let (at, count) = scales(dtype);
    for blk in data.chunks_exact_mut(dtype.block_bytes()) {
        for s in 0..count {
            blk[at + 2 * s..at + 2 * s + 2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
    }
    HostTensor { name: "w".into(), dtype, shape: vec![n, k], data: TensorBytes::from_vec(data) }
}

fn q8(_: DType, _: usize, _: usize, _: usize) -> MatmulInput {
    MatmulInput::Q8
}

fn f32_input(_: DType, _: usize, _: usize, _: usize) -> MatmulInput {
    MatmulInput::F32
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (n, k) = (args.first().copied().unwrap_or(1536), args.get(1).copied().unwrap_or(576));
    let paths = [("8-bit dot", q8 as fn(DType, usize, usize, usize) -> MatmulInput), ("f32 GEMM", f32_input)];
    println!("{n} x {k} weights, {} threads; ms per matmul (best of 5 rounds)", rayon::current_num_threads());
    print!("{:8} {:>5}", "format", "rows");
    for (name, _) in &paths {
        print!(" {name:>10}");
    }
    println!();
    for dtype in [DType::Q4_1, DType::Q5_0, DType::Q8_0, DType::Q4_K, DType::Q6_K] {
        if k % dtype.block_elems() != 0 {
            println!("{dtype:8} (rows of {k} are not whole blocks)");
            continue;
        }
        let t = weight(dtype, n, k);
        let row_counts: Vec<usize> = match std::env::var("ROWS") {
            Ok(list) => list.split(',').filter_map(|r| r.trim().parse().ok()).collect(),
            Err(_) => vec![4, 8, 12, 16, 24, 32, 48, 64],
        };
        for &rows in &row_counts {
            print!("{:8} {rows:>5}", dtype.to_string());
            for (_, rule) in &paths {
                let b = CpuBackend::new().with_bf16_rounding(Bf16Rounding {
                    weights: false,
                    kv: false,
                    inputs: Some(*rule),
                });
                let w = b.upload_weight(&t).expect("weight");
                let mut x = b.alloc_act(ActShape { rows, cols: k }).expect("x");
                for r in 0..rows {
                    for (i, v) in x.row_mut(r).iter_mut().enumerate() {
                        *v = ((r * 31 + i * 7) % 19) as f32 / 9.0 - 1.0;
                    }
                }
                let mut out = b.alloc_act(ActShape { rows, cols: n }).expect("out");
                let reps = if rows < 4 { 200 } else { 20 };
                let best = (0..5)
                    .map(|_| {
                        let t0 = Instant::now();
                        b.run_step(|| {
                            for _ in 0..reps {
                                b.matmul(&x, &w, None, rows, &mut out);
                            }
                        });
                        t0.elapsed().as_secs_f64() * 1e3 / reps as f64
                    })
                    .fold(f64::INFINITY, f64::min);
                print!(" {best:>10.4}");
            }
            println!();
        }
    }
}
