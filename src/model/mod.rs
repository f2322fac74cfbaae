//! The Qwen3.5 text model: its weights and its forward pass, written once for every backend.
//!
//! [`forward`] reads like qwen35-spec.md §3, top to bottom: embedding, then per layer an RMSNorm,
//! the token mixer (Gated DeltaNet or gated attention), a residual add, an RMSNorm, the SwiGLU
//! MLP (or, in a `qwen3_5_moe` model, the routed experts and the shared expert) and a residual add; then the final norm and the LM head. Each norm is one operation with
//! the projections that read it, each residual add one with the product that ends its block, so
//! a device can fuse them. Each line is one [`Backend`]
//! operation; the arithmetic inside them is fixed by docs/numerics.md.

pub mod cost;
pub mod rope;
pub mod weights;

use std::path::Path;

use crate::backend::{Backend, BackendError, Batch};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{ConfigError, LayerType, ModelConfig};
use weights::{Ffn, Loaded, Mixer, Weights, WeightsError};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// A checkpoint read from disk and checked against its config (host side, memory-mapped).
pub struct HostModel {
    pub config: ModelConfig,
    pub checkpoint: Checkpoint,
    pub loaded: Loaded,
}

impl HostModel {
    /// Reads `config.json`, maps the safetensors shards and checks every tensor.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::from_dir(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        let loaded = weights::load(&checkpoint, &config)?;
        Ok(Self { config, checkpoint, loaded })
    }
}

/// A model resident on a backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub backend: B,
    pub weights: Weights<B::Matrix, B::Vector>,
    /// For each layer, its index among the layers of its kind (GDN state / KV cache number).
    kind_index: Vec<usize>,
}

impl<B: Backend> Model<B> {
    /// Uploads host weights to `backend`.
    pub fn new(host: &HostModel, backend: B) -> Result<Self, BackendError> {
        backend.check_model(&host.config)?;
        let weights = host.loaded.weights.map(&mut |m| backend.upload_matrix(m), &mut |v| backend.upload_vector(v))?;
        backend.prepare_model(&weights)?;
        let (mut lin, mut full) = (0, 0);
        let kind_index = host
            .config
            .layer_types
            .iter()
            .map(|t| {
                let c = if *t == LayerType::LinearAttention { &mut lin } else { &mut full };
                *c += 1;
                *c - 1
            })
            .collect();
        Ok(Self { config: host.config.clone(), backend, weights, kind_index })
    }

    /// Activation buffers for steps of up to `max_rows` tokens and `max_logit_rows` logits rows.
    pub fn scratch(&self, max_rows: usize, max_logit_rows: usize) -> Result<Scratch<B>, BackendError> {
        let c = &self.config;
        let b = &self.backend;
        let (d, n) = (c.hidden_size, max_rows);
        let attn_width = c.num_attention_heads * c.head_dim;
        Ok(Scratch {
            max_rows,
            max_logit_rows,
            x: b.tensor(n, d)?,
            u: b.tensor(n, d)?,
            y: b.tensor(n, d)?,
            qkv: b.tensor(n, c.conv_dim())?,
            z: b.tensor(n, c.value_dim())?,
            beta: b.tensor(n, c.linear_num_value_heads)?,
            alpha: b.tensor(n, c.linear_num_value_heads)?,
            gdn_out: b.tensor(n, c.value_dim())?,
            q_gate: b.tensor(n, 2 * attn_width)?,
            k: b.tensor(n, c.num_key_value_heads * c.head_dim)?,
            v: b.tensor(n, c.num_key_value_heads * c.head_dim)?,
            attn_out: b.tensor(n, attn_width)?,
            gate: b.tensor(n, c.intermediate_size)?,
            up: b.tensor(n, c.intermediate_size)?,
            act: b.tensor(n, c.intermediate_size)?,
            last: b.tensor(max_logit_rows, d)?,
            last_norm: b.tensor(max_logit_rows, d)?,
            logits: b.tensor(max_logit_rows, c.vocab_size)?,
        })
    }

    /// Runs one step: checks and prepares the states, runs [`forward`], advances the states.
    /// The logits of `batch.logit_rows` are then in `scratch.logits`.
    pub fn step(&self, batch: &Batch, states: &mut B::States, scratch: &mut Scratch<B>) -> Result<(), BackendError> {
        check_fits(batch, scratch)?;
        self.backend.begin_step_within(states, batch, scratch.max_rows, scratch.max_logit_rows)?;
        forward(self, batch, states, scratch);
        self.backend.end_step(states, batch)
    }

    /// [`Model::step`], then greedy sampling of every logits row over ids `< v_eff`, on the
    /// device where the backend has one (and recorded into the same graph as the step).
    pub fn step_greedy(&self, batch: &Batch, states: &mut B::States, scratch: &mut Scratch<B>, v_eff: usize) -> Result<Vec<u32>, BackendError> {
        self.launch_greedy(batch, states, scratch, v_eff)?;
        self.backend.argmax_read(&scratch.logits, batch.logit_rows.len(), v_eff)
    }

    /// [`Model::step_greedy`] without reading the ids ([`Backend::argmax_read`] does): on a
    /// device the step and the choice are enqueued, and what the host does before the read
    /// overlaps them.
    pub fn launch_greedy(&self, batch: &Batch, states: &mut B::States, scratch: &mut Scratch<B>, v_eff: usize) -> Result<(), BackendError> {
        check_fits(batch, scratch)?;
        self.backend.begin_step_within(states, batch, scratch.max_rows, scratch.max_logit_rows)?;
        forward(self, batch, states, scratch);
        self.backend.argmax_enqueue(&scratch.logits, batch.logit_rows.len(), v_eff);
        self.backend.end_step(states, batch)
    }

    /// [`Model::step`], then sampling on the device as [`Backend::set_sampling`] prepared (which
    /// the caller ran first and which returned `true`).
    pub fn step_sample(&self, batch: &Batch, states: &mut B::States, scratch: &mut Scratch<B>, v_eff: usize) -> Result<Vec<u32>, BackendError> {
        self.launch_sample(batch, states, scratch, v_eff)?;
        self.backend.sample_read(&scratch.logits, batch.logit_rows.len(), v_eff)
    }

    /// [`Model::step_sample`] without reading the ids ([`Backend::sample_read`] does), as
    /// [`Model::launch_greedy`].
    pub fn launch_sample(&self, batch: &Batch, states: &mut B::States, scratch: &mut Scratch<B>, v_eff: usize) -> Result<(), BackendError> {
        check_fits(batch, scratch)?;
        self.backend.begin_step_within(states, batch, scratch.max_rows, scratch.max_logit_rows)?;
        forward(self, batch, states, scratch);
        self.backend.sample_enqueue(&scratch.logits, batch.logit_rows.len(), v_eff);
        self.backend.end_step(states, batch)
    }
}

/// Refuses a step larger than the buffers it would run on.
fn check_fits<B: Backend>(batch: &Batch, scratch: &Scratch<B>) -> Result<(), BackendError> {
    if batch.rows() > scratch.max_rows || batch.logit_rows.len() > scratch.max_logit_rows {
        return Err(BackendError::Batch(format!(
            "{} rows / {} logits rows exceed the scratch buffers ({} / {})",
            batch.rows(),
            batch.logit_rows.len(),
            scratch.max_rows,
            scratch.max_logit_rows
        )));
    }
    Ok(())
}

/// Activation buffers of one step (sized for the largest step they serve).
pub struct Scratch<B: Backend> {
    pub max_rows: usize,
    pub max_logit_rows: usize,
    /// Residual stream `[rows, D]`.
    pub x: B::Tensor,
    /// Normalised residual, the input of every projection `[rows, D]`.
    pub u: B::Tensor,
    /// Mixer or MLP output before the residual add `[rows, D]`.
    pub y: B::Tensor,
    pub qkv: B::Tensor,
    pub z: B::Tensor,
    pub beta: B::Tensor,
    pub alpha: B::Tensor,
    pub gdn_out: B::Tensor,
    pub q_gate: B::Tensor,
    pub k: B::Tensor,
    pub v: B::Tensor,
    pub attn_out: B::Tensor,
    pub gate: B::Tensor,
    pub up: B::Tensor,
    pub act: B::Tensor,
    /// Residual rows whose logits are wanted `[logit rows, D]`.
    pub last: B::Tensor,
    /// Those rows after the final norm `[logit rows, D]`.
    pub last_norm: B::Tensor,
    /// `[logit rows, V]`.
    pub logits: B::Tensor,
}

/// The forward pass of qwen35-spec.md §3.1 over the rows of `batch`.
pub fn forward<B: Backend>(m: &Model<B>, batch: &Batch, states: &mut B::States, s: &mut Scratch<B>) {
    forward_probed(m, batch, states, s, &mut |_, _, _| {});
}

/// [`forward`], calling `probe(layer, op, output)` after each operation (`tensorfold verify`
/// uses it to find the first operation where two backends differ; `layer` is `usize::MAX`
/// outside the layers). The first operation is always `embed`: a device backend may decide
/// there how to run the step.
pub fn forward_probed<B: Backend>(m: &Model<B>, batch: &Batch, states: &mut B::States, s: &mut Scratch<B>, probe: &mut dyn FnMut(usize, &str, &B::Tensor)) {
    let (b, w, cfg) = (&m.backend, &m.weights, &m.config);
    let (n, eps) = (batch.rows(), cfg.rms_norm_eps);
    const NONE: usize = usize::MAX;

    // (E1) x = E[token]
    b.embed(&w.embed_tokens, batch, &mut s.x);
    probe(NONE, "embed", &s.x);

    for (l, layer) in w.layers.iter().enumerate() {
        // (E2) u = RMSNorm(x; input_layernorm), (E3) h = x + Mixer(u)
        match &layer.mixer {
            Mixer::GatedDeltaNet(g) => {
                // (G1) m = W_qkv·u, z = W_z·u, b = W_b·u, a = W_a·u
                b.rms_norm_matmul(
                    &s.x,
                    &layer.input_layernorm,
                    eps,
                    n,
                    &mut s.u,
                    &mut [(&g.in_proj_qkv, &mut s.qkv), (&g.in_proj_z, &mut s.z), (&g.in_proj_b, &mut s.beta), (&g.in_proj_a, &mut s.alpha)],
                );
                probe(l, "input_layernorm", &s.u);
                probe(l, "linear_attn.in_proj_qkv", &s.qkv);
                probe(l, "linear_attn.in_proj_z", &s.z);
                // (G2)–(G12) conv, SiLU, q/k L2 norm, gates, delta rule, gated RMSNorm
                b.gated_delta_net(g, m.kind_index[l], cfg, batch, states, &s.qkv, &s.z, &s.beta, &s.alpha, &mut s.gdn_out);
                probe(l, "linear_attn (conv, delta rule, gated norm)", &s.gdn_out);
                // (G13) y = W_out · o; h = x + y
                b.matmul_residual(&s.gdn_out, n, &g.out_proj, &mut s.y, &mut s.x);
                probe(l, "linear_attn.out_proj", &s.y);
            }
            Mixer::Attention(a) => {
                // (A1)/(A2) q|gate, k, v projections
                b.rms_norm_matmul(&s.x, &layer.input_layernorm, eps, n, &mut s.u, &mut [(&a.q_proj, &mut s.q_gate), (&a.k_proj, &mut s.k), (&a.v_proj, &mut s.v)]);
                probe(l, "input_layernorm", &s.u);
                probe(l, "self_attn.q_proj", &s.q_gate);
                probe(l, "self_attn.k_proj", &s.k);
                // (A3)–(A7) q/k norm, RoPE, KV cache, causal attention, sigmoid gate
                b.gated_attention(a, m.kind_index[l], cfg, batch, states, &s.q_gate, &s.k, &s.v, &mut s.attn_out);
                probe(l, "self_attn (norms, RoPE, attention, gate)", &s.attn_out);
                // (A8) y = W_o · o; h = x + y
                b.matmul_residual(&s.attn_out, n, &a.o_proj, &mut s.y, &mut s.x);
                probe(l, "self_attn.o_proj", &s.y);
            }
        }
        probe(l, "residual (mixer)", &s.x);
        match &layer.mlp {
            Ffn::Dense(mlp) => {
                // (E4) u = RMSNorm(h; post_attention_layernorm); (M1) act = silu(W_gate·u) ⊙ (W_up·u)
                b.rms_norm_matmul_swiglu(&s.x, &layer.post_attention_layernorm, eps, n, &mut s.u, &mlp.gate_proj, &mlp.up_proj, &mut s.gate, &mut s.up, &mut s.act);
                probe(l, "post_attention_layernorm", &s.u);
                probe(l, "mlp.gate_proj", &s.gate);
                probe(l, "mlp (swiglu)", &s.act);
                // (M1) y = W_down · act; (E4) x = h + y
                b.matmul_residual(&s.act, n, &mlp.down_proj, &mut s.y, &mut s.x);
                probe(l, "mlp.down_proj", &s.y);
            }
            Ffn::Moe(moe) => {
                // (E4) u = RMSNorm(h; post_attention_layernorm); router, top-k experts and the
                // gated shared expert (numerics §7.1); x = h + y
                b.rms_norm(&s.x, &layer.post_attention_layernorm, eps, n, &mut s.u);
                probe(l, "post_attention_layernorm", &s.u);
                b.moe(moe, cfg, n, &s.u, &mut s.y, &mut s.x);
                probe(l, "mlp (experts)", &s.y);
            }
        }
        probe(l, "residual (mlp)", &s.x);
    }

    // (E5) x̄ = RMSNorm(x; norm) and (E6) logits = W_lm · x̄, for the rows that want them (the
    // norm is per row, so gathering first gives the same bits)
    let k = batch.logit_rows.len();
    b.gather_rows(&s.x, batch, &mut s.last);
    b.rms_norm_matmul(&s.last, &w.norm, eps, k, &mut s.last_norm, &mut [(w.lm_head(), &mut s.logits)]);
    probe(NONE, "final norm", &s.last_norm);
    probe(NONE, "lm_head", &s.logits);
}
