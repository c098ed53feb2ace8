//! The CPU backend's fused decode ops over block formats (`matmul_many` for
//! q/k/v, `gate_up_silu`: the input quantized once, every matrix's columns in
//! one parallel loop) give exactly what the plain ops give, one matmul at a
//! time, at every decode row count, with and without biases.

use corridor_backend::cpu::CpuBackend;
use corridor_backend::{unfused, ActShape, Backend, DType, HostTensor, MatmulPart, TensorBytes};
use half::f16;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Random blocks of `dtype` with small f16 scales (every scale field of the
/// formats used here is at the block's start).
fn blocks(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> HostTensor {
    let (bb, be) = (dtype.block_bytes(), dtype.block_elems());
    let mut data = Vec::new();
    for _ in 0..rows * cols / be {
        let mut b: Vec<u8> = (0..bb).map(|_| (rng.next() >> 56) as u8).collect();
        let scale_at: &[usize] = match dtype {
            DType::Q4_1 | DType::Q4_K => &[0, 2],
            DType::Q6_K => &[208],
            _ => &[0],
        };
        for &at in scale_at {
            b[at..at + 2].copy_from_slice(&f16::from_f32(0.004).to_le_bytes());
        }
        data.extend(b);
    }
    HostTensor { name: "w".into(), dtype, shape: vec![rows, cols], data: TensorBytes::from_vec(data) }
}

fn vector(rng: &mut Rng, n: usize) -> HostTensor {
    let v: Vec<u8> = (0..n).flat_map(|_| rng.unit().to_le_bytes()).collect();
    HostTensor { name: "b".into(), dtype: DType::F32, shape: vec![n], data: TensorBytes::from_vec(v) }
}

fn input(b: &CpuBackend, rng: &mut Rng, rows: usize, k: usize) -> <CpuBackend as Backend>::Act {
    let t = vector(rng, rows * k);
    let table = b.upload_weight(&HostTensor { shape: vec![rows, k], ..t }).unwrap();
    let mut a = b.alloc_act(ActShape { rows, cols: k }).unwrap();
    b.embedding(&table, &(0..rows as u32).collect::<Vec<_>>(), &mut a).unwrap();
    a
}

fn read(b: &CpuBackend, a: &<CpuBackend as Backend>::Act, rows: usize) -> Vec<u32> {
    let mut v = Vec::new();
    b.read_rows(a, rows, &mut v);
    v.iter().map(|x| x.to_bits()).collect()
}

type Weight = <CpuBackend as Backend>::Weight;
type Act = <CpuBackend as Backend>::Act;

/// The parts of a `matmul_many`: each weight into its output, with its bias or not.
fn parts<'a>(
    ws: &'a [Weight],
    bs: &'a [Weight],
    outs: &'a mut [Act],
    bias: bool,
) -> Vec<MatmulPart<'a, CpuBackend>> {
    ws.iter()
        .zip(bs)
        .zip(outs.iter_mut())
        .map(|((w, b), out)| MatmulPart { w, bias: bias.then_some(b), out })
        .collect()
}

#[test]
fn fused_q_k_v_and_gate_up_are_the_plain_ops_bit_for_bit() {
    let b = CpuBackend::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q4_K, DType::Q6_K] {
        let k = 512;
        let ns = [96usize, 32, 32];
        let ws: Vec<_> =
            ns.iter().map(|&n| b.upload_weight(&blocks(&mut rng, dtype, n, k)).unwrap()).collect();
        let bs: Vec<_> = ns.iter().map(|&n| b.upload_weight(&vector(&mut rng, n)).unwrap()).collect();
        let (gate, up) = (
            b.upload_weight(&blocks(&mut rng, dtype, 160, k)).unwrap(),
            b.upload_weight(&blocks(&mut rng, dtype, 160, k)).unwrap(),
        );
        for rows in [1usize, 2, 3, 8] {
            let x = input(&b, &mut rng, rows, k);
            for with_bias in [false, true] {
                let mut fused: Vec<_> =
                    ns.iter().map(|&n| b.alloc_act(ActShape { rows, cols: n }).unwrap()).collect();
                let mut plain: Vec<_> =
                    ns.iter().map(|&n| b.alloc_act(ActShape { rows, cols: n }).unwrap()).collect();
                b.matmul_many(&x, &mut parts(&ws, &bs, &mut fused, with_bias), rows, None);
                unfused::matmul_many(&b, &x, &mut parts(&ws, &bs, &mut plain, with_bias), rows);
                for (i, (f, p)) in fused.iter().zip(&plain).enumerate() {
                    assert_eq!(
                        read(&b, f, rows),
                        read(&b, p, rows),
                        "{dtype} {rows} rows, part {i}, bias {with_bias}"
                    );
                }
            }
            let act = |n| b.alloc_act(ActShape { rows, cols: n }).unwrap();
            let (mut g1, mut u1, mut o1, mut g2, mut u2, mut o2) =
                (act(160), act(160), act(160), act(160), act(160), act(160));
            b.gate_up_silu(&x, &gate, &up, rows, &mut g1, &mut u1, &mut o1);
            unfused::gate_up_silu(&b, &x, &gate, &up, rows, &mut g2, &mut u2, &mut o2);
            assert_eq!(read(&b, &o1, rows), read(&b, &o2, rows), "{dtype} {rows} rows: gate/up/SiLU");
            assert!(read(&b, &o1, rows).iter().any(|&v| v != 0), "{dtype}: the products are all zero");
        }
    }
}
