//! Command-line definitions (flags spelled as llama.cpp spells them) and dispatch.

mod bench;
mod chat;
mod info;
mod kernels;
mod run;
mod serve;
mod synth;
mod verify;

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

/// An exact, fast inference engine for Qwen3.5 models.
#[derive(Parser, Debug)]
#[command(name = "tensorfold", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate text from a prompt (the embedded demo model when no -m is given).
    Run(run::RunArgs),
    /// Talk with a model: each line on stdin is a message; the conversation lives in one session
    /// that only ever processes new tokens (/save FILE, /load FILE, /reset, /quit).
    Chat(chat::ChatArgs),
    /// Print a checkpoint's architecture, sizes, quantization and per-token costs.
    Info(info::InfoArgs),
    /// Time prompt processing and decode against this machine's measured memory bandwidth and
    /// FMA peak.
    Bench(bench::BenchArgs),
    /// Compile the CUDA kernels with NVRTC (`--check`: CI's kernel gate; no GPU needed).
    Kernels(kernels::KernelsArgs),
    /// Run the CPU reference and a GPU side by side; compare logits bit for bit every step.
    Verify(verify::VerifyArgs),
    /// Serve a model over HTTP: OpenAI-compatible chat and completions (streaming or not),
    /// models, tokenize/detokenize, health and Prometheus metrics.
    Serve(serve::ServeArgs),
    /// Write a random-weight checkpoint with the real config of a Qwen3.5 size.
    Synth(synth::SynthArgs),
}

pub fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => chat::chat(a),
        Command::Info(a) => info::info(a),
        Command::Bench(a) => bench::bench(a),
        Command::Kernels(a) => kernels::kernels(a),
        Command::Verify(a) => verify::verify(a),
        Command::Synth(a) => synth::synth(a),
        Command::Serve(a) => serve::serve(a),
    }
}

/// Where to run: `cpu`, `cuda` or `cuda:N`; `auto` (the default) picks the first GPU when a
/// CUDA driver, NVRTC and a device are present, else the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            "auto" => Ok(auto_device()),
            _ => match s.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => Ok(Device::Cuda(n)),
                None => Err(format!("unknown device `{s}` (expected cpu, cuda, cuda:N or auto)")),
            },
        }
    }
}

fn auto_device() -> Device {
    use tensorfold::backend::cuda;
    if cuda::compile::nvrtc_available() && cuda::device_count() > 0 {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// An error and its causes, outermost first, joined by ": ". A cause whose text the message
/// already ends with is left out: the library's errors name their source in their own text
/// (`cannot read FILE: No such file or directory`), so anyhow's chain would print it twice.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !text.ends_with(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}

/// The directory name of the model that ships with the repository.
const DEMO: &str = "models/tensorfold-demo-py28m";

/// The model directory: `-m DIR`, else `$TENSORFOLD_MODEL`, else the demo model shipped in the
/// repository (looked up beside the executable's build tree, then in the source tree this binary
/// was built from).
pub fn model_dir(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("TENSORFOLD_MODEL") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // target/{release,debug}/tensorfold → the repository root two levels up.
        for up in exe.ancestors().skip(1).take(4) {
            candidates.push(up.join(DEMO));
        }
    }
    candidates.push(Path::new(env!("CARGO_MANIFEST_DIR")).join(DEMO));
    for c in &candidates {
        if c.join("config.json").is_file() {
            return Ok(c.clone());
        }
    }
    bail!(
        "no model given, and the demo model that ships with tensorfold was not found (looked in {}); pass -m DIR, a directory holding config.json, *.safetensors and tokenizer.json",
        candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}
