//! `tensorfold info`: what a checkpoint is and what it costs to run.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tensorfold::config::LayerType;
use tensorfold::model::cost::Costs;
use tensorfold::model::weights::MatrixData;
use tensorfold::model::HostModel;

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Model directory; default: the demo model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
}

fn mib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

pub fn info(a: InfoArgs) -> Result<()> {
    let dir = super::model_dir(a.model.as_deref())?;
    let host = HostModel::open(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    let c = &host.config;
    let w = &host.loaded.weights;
    let costs = Costs::of(c, w);
    let full: Vec<usize> = (0..c.num_hidden_layers).filter(|&i| c.layer_types[i] == LayerType::FullAttention).collect();
    println!("model            {}", dir.display());
    let layout = match host.loaded.layout {
        tensorfold::model::weights::Layout::HfNested => "Hugging Face (model.language_model.*)",
        tensorfold::model::weights::Layout::Mlx => "MLX (language_model.model.*)",
        tensorfold::model::weights::Layout::Flat => "flat (model.*)",
    };
    println!("layout           {layout} (norms stored as {})", if host.loaded.norm_offsets { "zero-centred offsets, used as 1 + w" } else { "1 + w" });
    println!("layers           {} ({} Gated DeltaNet, {} full attention at {:?})", c.num_hidden_layers, c.num_linear_layers(), c.num_full_layers(), full);
    match &c.moe {
        None => println!("hidden_size      {}   intermediate_size {}   vocab_size {}", c.hidden_size, c.intermediate_size, c.vocab_size),
        Some(m) => {
            println!("hidden_size      {}   vocab_size {}", c.hidden_size, c.vocab_size);
            println!(
                "experts          {} per layer, {} per token{}, moe_intermediate_size {}, shared expert {} (sigmoid-gated)",
                m.num_experts,
                m.num_experts_per_tok,
                if m.norm_topk_prob { " (weights renormalised)" } else { "" },
                m.moe_intermediate_size,
                m.shared_expert_intermediate_size
            );
        }
    }
    println!(
        "attention        {} q heads, {} kv heads, head_dim {}, rotary dim {} (theta {})",
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.rotary_dim(),
        c.rope_theta
    );
    println!(
        "gated deltanet   {} k heads, {} v heads, dk {}, dv {}, conv kernel {}",
        c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    );
    println!("lm_head          {}", if c.tie_word_embeddings { "tied to embed_tokens" } else { "separate" });
    println!("max positions    {}", c.max_position_embeddings);
    let quant = match &w.embed_tokens.data {
        MatrixData::Affine { bits, group_size, .. } => {
            format!("MLX affine {bits}-bit, group_size {group_size}{}", if c.quantization.overrides.is_empty() { "" } else { " (with per-module overrides)" })
        }
        MatrixData::Float { dtype, .. } => format!("none ({dtype:?} weights)"),
    };
    println!("quantization     {quant}");
    println!("parameters       {} ({:.3} B)", costs.parameters, costs.parameters as f64 / 1e9);
    if c.moe.is_some() {
        println!("active params    {} ({:.3} B) per token", costs.active_parameters, costs.active_parameters as f64 / 1e9);
    }
    println!("checkpoint files {}", mib(host.checkpoint.file_bytes()));
    println!(
        "decode token     {} at context 0 ({} weights incl. LM head {}, state r+w {}), + {} per context token (KV read)",
        mib(costs.decode_bytes(0)),
        mib(costs.active_matrix_bytes + costs.embedding_row_bytes + costs.vector_bytes),
        mib(costs.lm_head_bytes),
        mib(2 * (costs.conv_state_bytes + costs.recurrent_state_bytes)),
        mib(costs.kv_bytes_per_token)
    );
    println!(
        "session state    {} conv + {} recurrent (f32) + {:.1} KiB KV cache per token (f32) = {} at 4096 tokens",
        mib(costs.conv_state_bytes),
        mib(costs.recurrent_state_bytes),
        costs.kv_bytes_per_token as f64 / 1024.0,
        mib(costs.state_bytes(4096))
    );
    println!("state bytes      {} + {} + {}·tokens (exact, f32 conv + recurrent + KV per token)", costs.conv_state_bytes, costs.recurrent_state_bytes, costs.kv_bytes_per_token);
    let every = tensorfold::session::DEFAULT_SNAPSHOT_EVERY;
    println!(
        "snapshot         the session state + 4 B of ids per token: {} at {every} tokens ({} bytes), {} at 4096; chat takes one every {every} tokens within 1 GiB by default",
        mib(costs.snapshot_bytes(every)),
        costs.snapshot_bytes(every),
        mib(costs.snapshot_bytes(4096))
    );
    Ok(())
}
