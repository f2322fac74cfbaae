//! What a model costs: parameters, per-sequence state bytes, and the bytes a decode token must
//! move. These definitions are the ones ARCHITECTURE.md states and `tensorfold info` and
//! `tensorfold bench` print.

use super::weights::{Ffn, Matrix, Mixer, Weights};
use crate::config::ModelConfig;

/// Sizes that do not depend on the context length, in bytes unless named otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Costs {
    /// Logical parameters (matrix elements and vector elements of the text model), every
    /// expert of a mixture-of-experts model included.
    pub parameters: u64,
    /// The parameters one token uses: [`Costs::parameters`] less the routed experts it is not
    /// sent to (`num_experts − num_experts_per_tok` per layer). Equal for a dense model.
    pub active_parameters: u64,
    /// Bytes of every projection matrix as stored (codes, scales, biases), LM head included,
    /// embedding table excluded unless it is the (tied) LM head.
    pub matrix_bytes: u64,
    /// The part of [`Costs::matrix_bytes`] one decode token reads: all but the routed experts
    /// it is not sent to (every expert of a layer has the same size).
    pub active_matrix_bytes: u64,
    /// Bytes of one embedding row as stored (what the token lookup reads).
    pub embedding_row_bytes: u64,
    /// Bytes of the LM head as stored (the whole embedding table when tied).
    pub lm_head_bytes: u64,
    /// Bytes of the f32 vectors (norm scales, conv taps, decay parameters).
    pub vector_bytes: u64,
    /// Conv windows of one sequence, f32: `L_gdn · (Kc−1) · conv_dim · 4`.
    pub conv_state_bytes: u64,
    /// Recurrent states of one sequence, f32: `L_gdn · Hv · dv · dk · 4`.
    pub recurrent_state_bytes: u64,
    /// KV cache of one sequence per token of context, f32: `L_attn · 2 · Hkv · Dh · 4`.
    pub kv_bytes_per_token: u64,
    /// Multiply-adds of every layer's projections for one token (`Σ rows · cols`, over the
    /// `num_experts_per_tok` routed experts a token uses; the LM head and the embedding excluded).
    pub layer_macs_per_token: u64,
    /// Multiply-adds of the LM head for one logits row (`vocab_size · hidden_size`).
    pub lm_head_macs: u64,
    /// FLOPs of attention per (query, key) pair, all attention layers: `L_attn · 4 · Hq · Dh`
    /// (the score dot and the value accumulation, 2 per multiply-add).
    pub attention_flops_per_pair: u64,
    /// FLOPs of the delta rule per token, all GDN layers: `L_gdn · 7 · Hv · dv · dk` (per state
    /// element: the decay multiply, two dots and the update FMA).
    pub delta_rule_flops_per_token: u64,
}

impl Costs {
    pub fn of(cfg: &ModelConfig, w: &Weights) -> Self {
        let mat = |m: &Matrix| m.storage_bytes() as u64;
        let mut matrix_bytes = 0u64;
        let mut vector_elems = (w.norm.len()) as u64;
        let mut parameters = 0u64;
        // Parameters of the embedding and a separate LM head; then every layer projection,
        // which also counts as a per-token multiply-add.
        parameters += (w.embed_tokens.rows * w.embed_tokens.cols) as u64;
        if let Some(h) = &w.lm_head {
            parameters += (h.rows * h.cols) as u64;
        }
        let mut layer_macs = 0u64;
        let (mut inactive_bytes, mut inactive_params) = (0u64, 0u64);
        let mut count = |m: &Matrix| layer_macs += (m.rows * m.cols) as u64;
        for l in &w.layers {
            vector_elems += (l.input_layernorm.len() + l.post_attention_layernorm.len()) as u64;
            match &l.mixer {
                Mixer::GatedDeltaNet(g) => {
                    for m in [&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj] {
                        matrix_bytes += mat(m);
                        count(m);
                    }
                    vector_elems += (g.conv1d.len() + g.a.len() + g.dt_bias.len() + g.norm.len()) as u64;
                }
                Mixer::Attention(a) => {
                    for m in [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj] {
                        matrix_bytes += mat(m);
                        count(m);
                    }
                    vector_elems += (a.q_norm.len() + a.k_norm.len()) as u64;
                }
            }
            match &l.mlp {
                Ffn::Dense(m) => {
                    for m in [&m.gate_proj, &m.up_proj, &m.down_proj] {
                        matrix_bytes += mat(m);
                        count(m);
                    }
                }
                Ffn::Moe(moe) => {
                    for m in [&moe.gate, &moe.shared_expert_gate, &moe.shared_expert.gate_proj, &moe.shared_expert.up_proj, &moe.shared_expert.down_proj] {
                        matrix_bytes += mat(m);
                        count(m);
                    }
                    // A token runs k of the E experts: all are stored, k are read and multiplied.
                    let k = cfg.moe.map_or(0, |c| c.num_experts_per_tok);
                    for (i, e) in moe.experts.iter().enumerate() {
                        for m in [&e.gate_proj, &e.up_proj, &e.down_proj] {
                            matrix_bytes += mat(m);
                            if i < k {
                                count(m);
                            } else {
                                inactive_bytes += mat(m);
                                inactive_params += (m.rows * m.cols) as u64;
                            }
                        }
                    }
                }
            }
        }
        let lm_head_bytes = mat(w.lm_head());
        matrix_bytes += lm_head_bytes;
        let n_lin = cfg.num_linear_layers() as u64;
        let n_full = cfg.num_full_layers() as u64;
        Self {
            parameters: parameters + layer_macs + inactive_params + vector_elems,
            active_parameters: parameters + layer_macs + vector_elems,
            matrix_bytes,
            active_matrix_bytes: matrix_bytes - inactive_bytes,
            embedding_row_bytes: w.embed_tokens.row_bytes() as u64,
            lm_head_bytes,
            vector_bytes: 4 * vector_elems,
            conv_state_bytes: n_lin * ((cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim() * 4) as u64,
            recurrent_state_bytes: n_lin * (cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim * 4) as u64,
            kv_bytes_per_token: n_full * (2 * cfg.num_key_value_heads * cfg.head_dim * 4) as u64,
            layer_macs_per_token: layer_macs,
            lm_head_macs: (w.lm_head().rows * w.lm_head().cols) as u64,
            attention_flops_per_pair: n_full * (4 * cfg.num_attention_heads * cfg.head_dim) as u64,
            delta_rule_flops_per_token: n_lin * (7 * cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim) as u64,
        }
    }

    /// FLOPs (a multiply-add counts 2) of processing `tokens` prompt tokens after `context`
    /// tokens already in the cache, with `logit_rows` rows through the LM head: every layer
    /// projection, attention over each token's causal prefix, the delta rule. Norms, the conv,
    /// activations and gates are not counted (under 1% of the total).
    pub fn prefill_flops(&self, context: usize, tokens: usize, logit_rows: usize) -> u64 {
        let (c, t) = (context as u64, tokens as u64);
        // Σ_{p = c}^{c + t − 1} (p + 1) keys per query.
        let pairs = t * c + t * (t + 1) / 2;
        2 * t * self.layer_macs_per_token + 2 * logit_rows as u64 * self.lm_head_macs + pairs * self.attention_flops_per_pair + t * self.delta_rule_flops_per_token
    }

    /// Bytes one decode token must move at `context` tokens already in the cache: every weight
    /// byte it reads (all projections but the routed experts it is not sent to, the whole LM
    /// head, one embedding row, the f32 vectors), the conv and recurrent state read and written,
    /// the KV cache read (`context` rows) and the new KV row written.
    pub fn decode_bytes(&self, context: usize) -> u64 {
        self.active_matrix_bytes
            + self.embedding_row_bytes
            + self.vector_bytes
            + 2 * (self.conv_state_bytes + self.recurrent_state_bytes)
            + self.kv_bytes_per_token * (context as u64 + 1)
    }

    /// State bytes of one sequence holding `tokens` tokens of context.
    pub fn state_bytes(&self, tokens: usize) -> u64 {
        self.conv_state_bytes + self.recurrent_state_bytes + self.kv_bytes_per_token * tokens as u64
    }

    /// Bytes of a snapshot of a session at `tokens` tokens: its state plus its token ids (u32);
    /// `crate::session::snapshot_bytes`.
    pub fn snapshot_bytes(&self, tokens: usize) -> u64 {
        self.state_bytes(tokens) + 4 * tokens as u64
    }
}
