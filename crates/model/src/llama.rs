//! The Llama family of decoders: Llama (with Llama 3.1 rope scaling),
//! Mistral (dense), Qwen2 and Qwen3, with grouped-query attention throughout.
//!
//! The four architectures share one layer structure and one set of checkpoint
//! names; what differs is carried by `ModelConfig` and read here in one place:
//! - Qwen2: Q, K and V projections have a bias (`attention_bias`);
//! - Qwen3: Q and K are RMS-normalized per head before RoPE (`qk_norm`), and
//!   `head_dim` is explicit (it need not be hidden / heads);
//! - Llama 3.1: `rope_scaling` of type `llama3` (see `rope.rs`);
//! - tied embeddings (small Qwen2, SmolLM2): the output projection is the
//!   embedding table (`tie_word_embeddings`).
//!
//! The forward pass is written once against [`Backend`] and reads top to
//! bottom: embed → layers (norm → attention → residual → norm → MLP →
//! residual) → final norm → logits for the rows that need them.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::LoadError;
use crate::rope::rope_table;
use corridor_backend::{ActShape, Backend, BackendError, HostTensor, KvGeometry, RopeTable, SeqStep};

/// Errors from building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{0}")]
    Step(String),
}

/// One decoder layer's weights, named as in the checkpoint.
struct Layer<B: Backend> {
    input_layernorm: B::Weight,          // [hidden]
    q_proj: B::Weight,                   // [heads * head_dim, hidden]
    k_proj: B::Weight,                   // [kv_heads * head_dim, hidden]
    v_proj: B::Weight,                   // [kv_heads * head_dim, hidden]
    qkv_bias: Option<[B::Weight; 3]>,    // Qwen2: [q_out], [kv_out], [kv_out]
    qk_norm: Option<[B::Weight; 2]>,     // Qwen3: [head_dim] each
    o_proj: B::Weight,                   // [hidden, heads * head_dim]
    post_attention_layernorm: B::Weight, // [hidden]
    gate_proj: B::Weight,                // [intermediate, hidden]
    up_proj: B::Weight,                  // [intermediate, hidden]
    down_proj: B::Weight,                // [hidden, intermediate]
}

/// A loaded model on one backend.
pub struct Model<B: Backend> {
    config: ModelConfig,
    rope: RopeTable,
    embed_tokens: B::Weight, // [vocab, hidden]
    layers: Vec<Layer<B>>,
    norm: B::Weight,             // [hidden]
    lm_head: Option<B::Weight>, // [vocab, hidden]; None when tied to the embedding
}

/// Scratch activations for one forward pass, allocated once at the largest
/// step the scheduler may form, so a forward pass allocates nothing.
pub struct Workspace<B: Backend> {
    max_rows: usize,
    max_logit_rows: usize,
    x: B::Act,      // [max_rows, hidden]     the residual stream
    h: B::Act,      // [max_rows, hidden]     normalized input of a block
    q: B::Act,      // [max_rows, heads * head_dim]
    k: B::Act,      // [max_rows, kv_heads * head_dim]
    v: B::Act,      // [max_rows, kv_heads * head_dim]
    attn: B::Act,   // [max_rows, heads * head_dim]
    proj: B::Act,   // [max_rows, hidden]     output of o_proj / down_proj
    gate: B::Act,   // [max_rows, intermediate]
    up: B::Act,     // [max_rows, intermediate]
    act: B::Act,    // [max_rows, intermediate] silu(gate) * up
    last: B::Act,   // [max_logit_rows, hidden]
    last_n: B::Act, // [max_logit_rows, hidden]
    logits: B::Act, // [max_logit_rows, vocab]
}

/// The paged KV cache of every layer.
pub struct KvCache<B: Backend> {
    geometry: KvGeometry,
    layers: Vec<B::Kv>,
}

impl<B: Backend> KvCache<B> {
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    pub fn copy_page(&mut self, backend: &B, from: corridor_units::PageId, to: corridor_units::PageId) {
        for l in &mut self.layers {
            backend.copy_page(l, from, to);
        }
    }
}

/// One batched step: the new tokens of every scheduled sequence.
pub struct StepInput<'a> {
    /// Token ids, sequences concatenated: `[rows]`.
    pub tokens: &'a [u32],
    /// The position of each token: `[rows]`.
    pub positions: &'a [u32],
    /// Each sequence's slice of the rows and its page table.
    pub seqs: &'a [SeqStep<'a>],
    /// Rows whose logits are wanted (usually each sequence's last row).
    pub logit_rows: &'a [usize],
}

impl<B: Backend> Model<B> {
    /// Load every weight of `ckpt` onto `backend`, checking shapes; `progress`
    /// is told each time a layer is done (layer count + 2 ticks in all).
    pub fn load(backend: &B, ckpt: &Checkpoint, mut progress: impl FnMut(usize)) -> Result<Self, ModelError> {
        let cfg = ckpt.config().clone();
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let load = |name: &str, shape: &[usize]| -> Result<B::Weight, ModelError> {
            let t = ckpt.tensor(name)?;
            check_shape(ckpt, &t, shape)?;
            Ok(backend.upload_weight(&t)?)
        };
        let embed_tokens = load("model.embed_tokens.weight", &[cfg.vocab_size, hidden])?;
        progress(1);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let qkv_bias = if cfg.attention_bias {
                Some([
                    load(&p("self_attn.q_proj.bias"), &[q_out])?,
                    load(&p("self_attn.k_proj.bias"), &[kv_out])?,
                    load(&p("self_attn.v_proj.bias"), &[kv_out])?,
                ])
            } else {
                None
            };
            let qk_norm = if cfg.qk_norm {
                Some([load(&p("self_attn.q_norm.weight"), &[hd])?, load(&p("self_attn.k_norm.weight"), &[hd])?])
            } else {
                None
            };
            layers.push(Layer {
                input_layernorm: load(&p("input_layernorm.weight"), &[hidden])?,
                q_proj: load(&p("self_attn.q_proj.weight"), &[q_out, hidden])?,
                k_proj: load(&p("self_attn.k_proj.weight"), &[kv_out, hidden])?,
                v_proj: load(&p("self_attn.v_proj.weight"), &[kv_out, hidden])?,
                qkv_bias,
                qk_norm,
                o_proj: load(&p("self_attn.o_proj.weight"), &[hidden, q_out])?,
                post_attention_layernorm: load(&p("post_attention_layernorm.weight"), &[hidden])?,
                gate_proj: load(&p("mlp.gate_proj.weight"), &[cfg.intermediate_size, hidden])?,
                up_proj: load(&p("mlp.up_proj.weight"), &[cfg.intermediate_size, hidden])?,
                down_proj: load(&p("mlp.down_proj.weight"), &[hidden, cfg.intermediate_size])?,
            });
            progress(1);
        }
        let norm = load("model.norm.weight", &[hidden])?;
        // A checkpoint may say it is tied and still ship lm_head (or the reverse):
        // a present lm_head always wins, as in transformers' loading.
        let lm_head = if ckpt.has_tensor("lm_head.weight") {
            Some(load("lm_head.weight", &[cfg.vocab_size, hidden])?)
        } else {
            None
        };
        progress(1);
        Ok(Model { rope: rope_table(&cfg), config: cfg, embed_tokens, layers, norm, lm_head })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Allocate the scratch activations for steps of up to `max_rows` tokens
    /// and `max_logit_rows` logit rows.
    pub fn workspace(&self, backend: &B, max_rows: usize, max_logit_rows: usize) -> Result<Workspace<B>, ModelError> {
        let c = &self.config;
        let a = |rows: usize, cols: usize| backend.alloc_act(ActShape { rows, cols });
        let (q_out, kv_out) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        Ok(Workspace {
            max_rows,
            max_logit_rows,
            x: a(max_rows, c.hidden_size)?,
            h: a(max_rows, c.hidden_size)?,
            q: a(max_rows, q_out)?,
            k: a(max_rows, kv_out)?,
            v: a(max_rows, kv_out)?,
            attn: a(max_rows, q_out)?,
            proj: a(max_rows, c.hidden_size)?,
            gate: a(max_rows, c.intermediate_size)?,
            up: a(max_rows, c.intermediate_size)?,
            act: a(max_rows, c.intermediate_size)?,
            last: a(max_logit_rows, c.hidden_size)?,
            last_n: a(max_logit_rows, c.hidden_size)?,
            logits: a(max_logit_rows, c.vocab_size)?,
        })
    }

    /// Allocate a paged KV cache of `num_pages` pages of `page_size` tokens.
    pub fn kv_cache(&self, backend: &B, page_size: usize, num_pages: usize) -> Result<KvCache<B>, ModelError> {
        let geometry = self.kv_geometry(page_size, num_pages);
        let layers = (0..self.config.num_layers).map(|_| backend.alloc_kv(geometry)).collect::<Result<_, _>>()?;
        Ok(KvCache { geometry, layers })
    }

    pub fn kv_geometry(&self, page_size: usize, num_pages: usize) -> KvGeometry {
        KvGeometry { page_size, num_pages, kv_heads: self.config.num_kv_heads, head_dim: self.config.head_dim }
    }

    /// Bytes of KV one token occupies across all layers (K and V, f32 on the CPU).
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.config.num_layers * self.config.num_kv_heads * self.config.head_dim * elem_bytes
    }

    /// Run one step; the logits of `step.logit_rows` are copied into `logits`
    /// (`[logit_rows, vocab]`, row-major).
    pub fn forward(
        &self,
        b: &B,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let rows = step.tokens.len();
        if rows == 0 || rows > ws.max_rows || step.positions.len() != rows {
            return Err(ModelError::Step(format!("{rows} rows for a workspace of {}", ws.max_rows)));
        }
        if step.logit_rows.len() > ws.max_logit_rows {
            return Err(ModelError::Step(format!("{} logit rows for a workspace of {}", step.logit_rows.len(), ws.max_logit_rows)));
        }
        let eps = c.rms_norm_eps;
        b.embedding(&self.embed_tokens, step.tokens, &mut ws.x)?;
        for (layer, kv_layer) in self.layers.iter().zip(kv.layers.iter_mut()) {
            // Attention block.
            b.rms_norm(&ws.x, &layer.input_layernorm, eps, rows, &mut ws.h);
            let bias = layer.qkv_bias.as_ref();
            b.matmul(&ws.h, &layer.q_proj, bias.map(|x| &x[0]), rows, &mut ws.q);
            b.matmul(&ws.h, &layer.k_proj, bias.map(|x| &x[1]), rows, &mut ws.k);
            b.matmul(&ws.h, &layer.v_proj, bias.map(|x| &x[2]), rows, &mut ws.v);
            if let Some([qn, kn]) = &layer.qk_norm {
                b.head_rms_norm(&mut ws.q, qn, eps, c.head_dim, rows);
                b.head_rms_norm(&mut ws.k, kn, eps, c.head_dim, rows);
            }
            b.rope(&mut ws.q, &self.rope, c.head_dim, step.positions);
            b.rope(&mut ws.k, &self.rope, c.head_dim, step.positions);
            b.write_kv(kv_layer, &ws.k, &ws.v, step.seqs);
            b.attention(&ws.q, kv_layer, c.num_heads, step.seqs, &mut ws.attn);
            b.matmul(&ws.attn, &layer.o_proj, None, rows, &mut ws.proj);
            b.add_assign(&mut ws.x, &ws.proj, rows);
            // MLP block.
            b.rms_norm(&ws.x, &layer.post_attention_layernorm, eps, rows, &mut ws.h);
            b.matmul(&ws.h, &layer.gate_proj, None, rows, &mut ws.gate);
            b.matmul(&ws.h, &layer.up_proj, None, rows, &mut ws.up);
            b.silu_mul(&ws.gate, &ws.up, rows, &mut ws.act);
            b.matmul(&ws.act, &layer.down_proj, None, rows, &mut ws.proj);
            b.add_assign(&mut ws.x, &ws.proj, rows);
        }
        let n = step.logit_rows.len();
        if n == 0 {
            logits.clear();
            return Ok(());
        }
        b.gather_rows(&ws.x, step.logit_rows, &mut ws.last);
        b.rms_norm(&ws.last, &self.norm, eps, n, &mut ws.last_n);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        b.matmul(&ws.last_n, head, None, n, &mut ws.logits);
        b.read_rows(&ws.logits, n, logits);
        Ok(())
    }
}

fn check_shape(ckpt: &Checkpoint, t: &HostTensor, want: &[usize]) -> Result<(), LoadError> {
    // A vector may be stored as [n] or [1, n]; compare element layouts.
    let same = t.shape == want || (want.len() == 1 && t.shape.len() == 2 && t.shape[0] == 1 && t.shape[1] == want[0]);
    if same {
        Ok(())
    } else {
        Err(LoadError::BadShape {
            file: ckpt.path().to_path_buf(),
            tensor: t.name.clone(),
            expected: want.to_vec(),
            found: t.shape.clone(),
        })
    }
}
