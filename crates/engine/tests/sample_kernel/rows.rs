//! Random logit rows for the sampling kernel's checks, shared by the
//! host-compiled test (`tests/sample_kernel.rs`) and the GPU check
//! (`examples/device_sampling_check.rs`), so both draw from the same inputs.
#![allow(dead_code)] // each includer uses its own part of it

/// xorshift64*: deterministic inputs without a dependency.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545f4914f6cdd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn normal(&mut self) -> f32 {
        (self.f() + self.f() + self.f() + self.f()) * 0.87
    }
}

#[derive(Clone, Copy, Debug)]
pub enum Rows {
    /// Spread over a few units, a few tokens well above, padded slots at -inf.
    Model,
    /// Nearly flat: nuclei of most of the vocabulary.
    Flat,
    /// NaN and +inf among the logits.
    Broken,
    /// Nothing finite.
    Empty,
    /// Two tiers of 3,000 tokens with one logit each, far above the rest:
    /// a nucleus that ends inside a tie, with more tokens above than the
    /// kernel sorts.
    Tiers,
}

pub fn fill(rng: &mut Rng, vocab: usize, rows: Rows) -> Vec<f32> {
    let mut row: Vec<f32> = match rows {
        Rows::Flat => (0..vocab).map(|_| rng.f() * 0.3).collect(),
        _ => (0..vocab).map(|_| rng.normal() * 2.5).collect(),
    };
    match rows {
        Rows::Model => {
            for _ in 0..1 + rng.below(6) {
                let t = rng.below(vocab);
                row[t] += 6.0 + rng.f().abs() * 8.0;
            }
            for v in row.iter_mut().rev().take(vocab / 50) {
                *v = f32::NEG_INFINITY;
            }
        }
        Rows::Broken => {
            for _ in 0..3 {
                let t = rng.below(vocab);
                row[t] = f32::NAN;
            }
            let t = rng.below(vocab);
            row[t] = f32::INFINITY;
        }
        Rows::Empty => row.fill(f32::NEG_INFINITY),
        Rows::Tiers => {
            row.iter_mut().for_each(|v| *v -= 12.0);
            for tier in [5.0, 4.99] {
                for _ in 0..3000 {
                    let t = rng.below(vocab);
                    row[t] = tier;
                }
            }
        }
        Rows::Flat => {}
    }
    row
}
