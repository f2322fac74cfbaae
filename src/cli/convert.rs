//! `tensorfold convert`: a Hugging Face bf16 checkpoint to the MLX affine layout mlx-lm writes.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tensorfold::config::QuantParams;
use tensorfold::convert::{self, ConvertOptions, QuantOverride, DEFAULT_QUANT};

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// The Hugging Face bf16 checkpoint: a directory, or ORG/NAME[@REV] from the Hub cache.
    pub src: PathBuf,
    /// The directory to create (must not exist, or be empty).
    pub out_dir: PathBuf,
    /// Bits per weight (4 or 8), as mlx_lm.convert's --q-bits.
    #[arg(long, default_value_t = DEFAULT_QUANT.bits)]
    pub q_bits: u32,
    /// Elements per scale/bias group (32, 64 or 128), as mlx_lm.convert's --q-group-size.
    #[arg(long, default_value_t = DEFAULT_QUANT.group_size)]
    pub q_group_size: usize,
    /// Per-module bits and group size, SUFFIX=BITS:GROUP_SIZE (e.g. mlp.down_proj=8:32), written
    /// to config.json's `quantization` block as mlx-lm writes a predicate's overrides; repeatable.
    #[arg(long = "q-override", value_name = "SUFFIX=BITS:GROUP_SIZE")]
    pub q_override: Vec<QuantOverride>,
}

pub fn convert(a: ConvertArgs) -> Result<()> {
    let (src_dir, base_model) = super::resolve_model(&a.src)?;
    let opts = ConvertOptions { src_dir, out_dir: a.out_dir.clone(), quant: QuantParams { group_size: a.q_group_size, bits: a.q_bits }, overrides: a.q_override, base_model };
    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(indicatif::ProgressStyle::with_template("converting {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})").unwrap());
        Some(b)
    } else {
        None
    };
    let t = std::time::Instant::now();
    let summary = convert::convert(&opts, &mut |done, total| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    })
    .with_context(|| format!("converting {} to {}", opts.src_dir.display(), a.out_dir.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let at_default = summary.quantized - summary.overridden.len();
    let mut modules = format!("{at_default} modules at {} bits, group size {}", a.q_bits, a.q_group_size);
    if !summary.overridden.is_empty() {
        modules.push_str(&format!(", {} overridden (below)", summary.overridden.len()));
    }
    eprintln!(
        "wrote {} ({modules}; {} float tensors; {:.2} GB) in {:.1} s: {}",
        summary.out_dir.display(),
        summary.floats,
        summary.tensor_bytes as f64 / 1e9,
        t.elapsed().as_secs_f64(),
        summary.files.join(", ")
    );
    for (module, q) in &summary.overridden {
        eprintln!("  {module}: {} bits, group size {}", q.bits, q.group_size);
    }
    Ok(())
}
