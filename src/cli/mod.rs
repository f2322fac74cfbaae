//! Command-line definitions (flags spelled as llama.cpp spells them) and dispatch.

mod bench;
mod chat;
mod convert;
mod info;
mod kernels;
mod run;
mod serve;
mod synth;
mod verify;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use tensorfold::backend::Products;

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
    /// Talk with a model: each line on stdin is a message (end a line with \ to continue it on the
    /// next; at a terminal, line editing and history); the conversation lives in one session
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
    /// Convert a Hugging Face bf16 checkpoint to MLX affine 4/8-bit, as mlx_lm.convert writes it.
    Convert(convert::ConvertArgs),
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
        Command::Convert(a) => convert::convert(a),
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

/// `--products`: the arithmetic of the products with quantized weights (every command that
/// loads a model for inference).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct ProductsArgs {
    /// Arithmetic of the products with quantized (affine) weights: f32, decoded weights times
    /// f32 activations (docs/numerics.md §2), or int, integer-exact (§2.2: faster in batches on
    /// a GPU, other bits than f32; the CUDA backend has no expert kernels for it yet). Default:
    /// TENSORFOLD_PRODUCTS (f32 or int) when set, else f32.
    #[arg(long = "products", value_enum, value_name = "f32|int")]
    pub products: Option<ProductsFlag>,
}

/// The values of `--products` ([`tensorfold::backend::Products`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProductsFlag {
    /// Decoded weights times f32 activations (docs/numerics.md §2).
    F32,
    /// Integer-exact products (docs/numerics.md §2.2).
    Int,
}

impl ProductsArgs {
    /// The mode of this run: the flag, else `TENSORFOLD_PRODUCTS`, else f32.
    ///
    /// # Errors
    /// `TENSORFOLD_PRODUCTS` set (and no flag) to something other than f32 or int.
    pub fn resolve(&self) -> Result<Products> {
        Ok(match self.products {
            Some(ProductsFlag::F32) => Products::F32,
            Some(ProductsFlag::Int) => Products::Int,
            None => Products::from_env()?.unwrap_or_default(),
        })
    }
}

/// Prefix snapshots (`chat`, `serve`): a later prompt sharing a prefix resumes from the state
/// after it.
#[derive(clap::Args, Debug)]
pub struct SnapshotArgs {
    /// Keep a snapshot of the state every N tokens (and at the end of every prompt and chat
    /// turn); 0: only at the end of prompts and turns.
    #[arg(long = "snapshot-every", value_name = "N", default_value_t = tensorfold::session::DEFAULT_SNAPSHOT_EVERY)]
    pub every: usize,
    /// Host memory the snapshots may hold, in MiB (least recently used go first); 0 with
    /// --snapshot-device-budget 0 turns them off.
    #[arg(long = "snapshot-budget", value_name = "MiB", default_value_t = 1024)]
    pub budget: u64,
    /// Device memory the snapshots may hold on a GPU, in MiB: taking and resuming one is then a
    /// copy on the device; past it the least recently used are dropped, and while nothing runs
    /// the oldest move to host memory. (On the CPU the states already are in host memory:
    /// --snapshot-budget alone applies.)
    #[arg(long = "snapshot-device-budget", value_name = "MiB", default_value_t = 4096)]
    pub device_budget: u64,
}

impl SnapshotArgs {
    /// The snapshot settings on `device`.
    pub fn config(&self, device: Device) -> tensorfold::session::SnapshotConfig {
        let mib = |m: u64| m.saturating_mul(1 << 20);
        let device_budget_bytes = match device {
            Device::Cpu => 0,
            Device::Cuda(_) => mib(self.device_budget),
        };
        tensorfold::session::SnapshotConfig { every: self.every, budget_bytes: mib(self.budget), device_budget_bytes }
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

/// The model directory: `-m DIR` (or `-m ORG/NAME[@REV]`, see [`resolve_model`]), else
/// `$TENSORFOLD_MODEL` (the same), else the demo model shipped in the repository (looked up
/// beside the executable's build tree, then in the source tree this binary was built from).
pub fn model_dir(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(resolve_model(p)?.0);
    }
    if let Some(p) = std::env::var_os("TENSORFOLD_MODEL") {
        return Ok(resolve_model(Path::new(&p))?.0);
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

/// A model argument as a directory, and the Hub repo it came from: an existing local directory
/// always wins; else a Hugging Face repo id (`Qwen/Qwen3.5-0.8B`, `ORG/NAME@REV`) resolves from
/// the Hub cache, downloading into it unless `HF_HUB_OFFLINE` is set; anything else is returned
/// as given, for the loader to name what is missing.
pub fn resolve_model(arg: &Path) -> Result<(PathBuf, Option<String>)> {
    use tensorfold::hub;
    if arg.is_dir() {
        return Ok((arg.to_path_buf(), None));
    }
    match arg.to_str().and_then(hub::RepoSpec::parse) {
        Some(spec) => {
            let dir = hub::resolve(&spec, &hub::HubOptions::from_env())
                .with_context(|| format!("{} is not a local directory, so it was taken as a Hugging Face repo id", arg.display()))?;
            Ok((dir, Some(spec.repo_id)))
        }
        None => Ok((arg.to_path_buf(), None)),
    }
}

/// What Ctrl-C does while a command streams a reply: the first press cancels the request being
/// generated (the command then finishes as usual: summary, files), a second exits at once.
pub mod interrupt {
    use std::sync::{Mutex, OnceLock};
    use tensorfold::runtime::Canceller;

    /// The request a press cancels, and whether a press is pending for it.
    static CURRENT: Mutex<(Option<Canceller>, bool)> = Mutex::new((None, false));
    static INSTALLED: OnceLock<bool> = OnceLock::new();

    /// Installs the handler (once per process; harmless to call again).
    pub fn install() {
        INSTALLED.get_or_init(|| {
            ctrlc::set_handler(|| {
                let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
                match (&cur.0, cur.1) {
                    (Some(c), false) => {
                        c.cancel();
                        cur.1 = true;
                        eprintln!("\n(interrupted: stopping the reply; Ctrl-C again to exit)");
                    }
                    _ => std::process::exit(130),
                }
            })
            .is_ok()
        });
    }

    /// Makes `c` the request a press cancels (`None`: a press exits).
    pub fn set(c: Option<Canceller>) {
        let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        *cur = (c, false);
    }
}
