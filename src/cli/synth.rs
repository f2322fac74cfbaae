//! `tensorfold synth`: a random-weight checkpoint with the real config of a Qwen3.5 size.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tensorfold::synth::{self, Preset, SynthLayout, SynthOptions};

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b, qwen3.5-9b, qwen3.5-27b, or the mixture-of-experts
    /// qwen3.5-35b-a3b and qwen3.5-122b-a10b.
    #[arg(long)]
    pub preset: Preset,
    /// mlx (affine 4-bit, as mlx-lm writes it) or hf (bf16, as Qwen releases it).
    #[arg(long, default_value = "mlx")]
    pub layout: SynthLayout,
    /// Seed of every weight: the same seed writes byte-identical files.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A tokenizer.json to copy in (e.g. ../shared/tokenizers/qwen3.5/tokenizer.json).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Write only this many layers (small tests).
    #[arg(long)]
    pub layers: Option<usize>,
    /// The directory to create (must not exist, or be empty).
    pub out_dir: PathBuf,
}

pub fn synth(a: SynthArgs) -> Result<()> {
    let opts = SynthOptions { preset: a.preset, layout: a.layout, seed: a.seed, tokenizer: a.tokenizer.clone(), out_dir: a.out_dir.clone(), num_hidden_layers: a.layers };
    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(indicatif::ProgressStyle::with_template("writing {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})").unwrap());
        Some(b)
    } else {
        None
    };
    let t = std::time::Instant::now();
    let summary = synth::write_checkpoint(&opts, &mut |done, total| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    })
    .with_context(|| format!("writing a {} checkpoint to {}", a.preset, a.out_dir.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    eprintln!(
        "wrote {} ({} parameters, {:.2} GB) in {:.1} s: {}",
        summary.out_dir.display(),
        summary.parameters,
        summary.bytes_written as f64 / 1e9,
        t.elapsed().as_secs_f64(),
        summary.files.join(", ")
    );
    Ok(())
}
