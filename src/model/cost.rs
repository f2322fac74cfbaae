//! What a model costs: parameters, per-sequence state bytes, and the bytes a decode token must
//! move. These definitions are the ones ARCHITECTURE.md states and `tensorfold info` and
//! `tensorfold bench` print.

use super::weights::{Matrix, Mixer, Weights};
use crate::config::ModelConfig;

/// Sizes that do not depend on the context length, in bytes unless named otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Costs {
    /// Logical parameters (matrix elements and vector elements of the text model).
    pub parameters: u64,
    /// Bytes of every projection matrix as stored (codes, scales, biases), LM head included,
    /// embedding table excluded unless it is the (tied) LM head.
    pub matrix_bytes: u64,
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
}

impl Costs {
    pub fn of(cfg: &ModelConfig, w: &Weights) -> Self {
        let mat = |m: &Matrix| m.storage_bytes() as u64;
        let mut matrix_bytes = 0u64;
        let mut vector_elems = (w.norm.len()) as u64;
        let mut parameters = 0u64;
        let mut count = |m: &Matrix| parameters += (m.rows * m.cols) as u64;
        count(&w.embed_tokens);
        if let Some(h) = &w.lm_head {
            count(h);
        }
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
            for m in [&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj] {
                matrix_bytes += mat(m);
                count(m);
            }
        }
        let lm_head_bytes = mat(w.lm_head());
        matrix_bytes += lm_head_bytes;
        let n_lin = cfg.num_linear_layers() as u64;
        let n_full = cfg.num_full_layers() as u64;
        Self {
            parameters: parameters + vector_elems,
            matrix_bytes,
            embedding_row_bytes: w.embed_tokens.row_bytes() as u64,
            lm_head_bytes,
            vector_bytes: 4 * vector_elems,
            conv_state_bytes: n_lin * ((cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim() * 4) as u64,
            recurrent_state_bytes: n_lin * (cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim * 4) as u64,
            kv_bytes_per_token: n_full * (2 * cfg.num_key_value_heads * cfg.head_dim * 4) as u64,
        }
    }

    /// Bytes one decode token must move at `context` tokens already in the cache: every weight
    /// byte it reads (all projections and the whole LM head, one embedding row, the f32
    /// vectors), the conv and recurrent state read and written, the KV cache read (`context`
    /// rows) and the new KV row written.
    pub fn decode_bytes(&self, context: usize) -> u64 {
        self.matrix_bytes
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
