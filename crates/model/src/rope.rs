//! Rotary position embedding frequencies, with the scalings real checkpoints use.

use crate::config::{ModelConfig, RopeScaling};
use corridor_backend::RopeTable;

/// Inverse frequencies for one head, as transformers computes them
/// (`1 / theta^(2i/d)`), then adjusted by the checkpoint's scaling.
pub fn rope_table(cfg: &ModelConfig) -> RopeTable {
    let dim = cfg.head_dim;
    let base: Vec<f64> =
        (0..dim / 2).map(|i| 1.0 / (cfg.rope_theta as f64).powf((2 * i) as f64 / dim as f64)).collect();
    let inv_freq = match &cfg.rope_scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / *factor as f64).collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            // Llama 3.1: wavelengths longer than the original context / low
            // factor are slowed by `factor`; shorter than original / high are
            // kept; a linear blend in between.
            let (factor, low, high) = (*factor as f64, *low_freq_factor as f64, *high_freq_factor as f64);
            let old = *original_max_position_embeddings as f64;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    RopeTable {
        style: cfg.rope_style,
        rot_dim: dim,
        inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
    }
}
