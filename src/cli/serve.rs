//! `tensorfold serve`: the OpenAI-compatible HTTP server ([`tensorfold::serve`]) over the
//! batched runtime.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tensorfold::backend::cpu::Cpu;
use tensorfold::config::GenerationConfig;
use tensorfold::engine::{Engine, DEFAULT_CHUNK};
use tensorfold::model::{HostModel, Model};
use tensorfold::runtime::{Runtime, RuntimeConfig};
use tensorfold::serve::{self, AppState, ServeConfig};
use tensorfold::tokenizer::Tokenizer;

use super::run::{checkpoint_params, SamplingArgs};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model directory (config.json, *.safetensors, tokenizer.json); default: the demo model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The name clients give for the model (repeatable: the first is the one /v1/models lists
    /// first, the others are accepted too); default: the model directory's name.
    #[arg(long = "served-model-name", value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// Address to listen on (loopback by default: pass 0.0.0.0 to listen on every interface).
    #[arg(long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free one; the address is logged).
    #[arg(long = "port", default_value_t = 8080)]
    pub port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on /v1/*, /tokenize
    /// and /detokenize; /health and /metrics stay open.
    #[arg(long = "api-key", env = "TENSORFOLD_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// cpu, cuda, cuda:N or auto (a GPU when one is present).
    #[arg(long = "device", default_value = "auto")]
    pub device: super::Device,
    #[command(flatten)]
    pub products: super::ProductsArgs,
    /// Sequences resident at once.
    #[arg(long = "max-seqs", default_value_t = 64)]
    pub max_seqs: usize,
    /// Tokens one model step may hold (decode rows plus prompt chunks).
    #[arg(long = "max-batch-tokens", default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Requests waiting for a slot at most; past it requests are answered 503 with Retry-After.
    #[arg(long = "max-waiting", default_value_t = 256)]
    pub max_waiting: usize,
    /// Prompt plus completion tokens of one sequence at most (default and limit: the model's
    /// max_position_embeddings).
    #[arg(long = "max-model-len")]
    pub max_model_len: Option<usize>,
    /// Memory the resident sequences' states may hold together, in MiB.
    #[arg(long = "state-budget", value_name = "MiB", default_value_t = 8192)]
    pub state_budget: u64,
    #[command(flatten)]
    pub snapshots: super::SnapshotArgs,
    /// Choices (`n` times prompts) one request may ask for at most.
    #[arg(long = "max-n", default_value_t = 16)]
    pub max_n: usize,
    /// Largest request body accepted, in bytes.
    #[arg(long = "max-body-bytes", default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// On SIGTERM or Ctrl-C, let running requests finish for this long before exiting.
    #[arg(long = "drain-seconds", default_value_t = 30.0)]
    pub drain_seconds: f64,
    /// Sampling defaults for what requests leave out (over the checkpoint's
    /// generation_config.json).
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let products = a.products.resolve()?;
    let dir = super::model_dir(a.model.as_deref())?;
    // tracing's lines go to stderr; RUST_LOG overrides the default (info for tensorfold).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("tensorfold=info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).try_init();
    // Freed sequence states go back to the system rather than stay in the heap at their peak.
    if !tensorfold::hostmem::fix_map_threshold() {
        tracing::debug!("glibc's mmap threshold left as it is");
    }

    // A limit that no request can get under would start a server that refuses everything.
    for (flag, value, why) in [
        ("--max-seqs", a.max_seqs, "no sequence could run"),
        ("--max-batch-tokens", a.max_batch_tokens, "no step could hold a token"),
        ("--max-waiting", a.max_waiting, "every request waits in the queue before it runs, so each would be refused"),
        ("--max-n", a.max_n, "no request could ask for a choice"),
        ("--state-budget", a.state_budget as usize, "no sequence's state would fit"),
    ] {
        if value == 0 {
            bail!("{flag} 0 is invalid: {why}; give at least 1");
        }
    }
    if a.max_body_bytes < MIN_BODY_BYTES {
        bail!("--max-body-bytes {} is invalid: no request body fits in it; give at least {MIN_BODY_BYTES}", a.max_body_bytes);
    }
    if !(a.drain_seconds.is_finite() && a.drain_seconds >= 0.0) {
        bail!("--drain-seconds {} is invalid: give a number of seconds >= 0", a.drain_seconds);
    }
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).with_context(|| format!("loading the tokenizer in {}", dir.display()))?);
    let gc = GenerationConfig::from_dir(&dir)?;
    let defaults = a.sampling.apply(checkpoint_params(&gc, dir.join("generation_config.json").exists()));
    defaults.validate()?;
    let fingerprint = serve::fingerprint(&dir, products).map_err(anyhow::Error::msg).context("hashing the model for system_fingerprint")?;
    let dir_name = dir.canonicalize().unwrap_or_else(|_| dir.clone()).file_name().map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned());

    let config = RuntimeConfig {
        max_seqs: a.max_seqs,
        max_batch_tokens: a.max_batch_tokens,
        max_waiting: a.max_waiting,
        state_budget: a.state_budget.saturating_mul(1 << 20),
        snapshots: a.snapshots.config(a.device),
        // Chat turn boundaries: the next turn of a conversation resumes before its last `<|im_start|>`.
        boundary_ids: tokenizer.token_to_id("<|im_start|>").into_iter().collect(),
        ..RuntimeConfig::default()
    };
    let t0 = std::time::Instant::now();
    let d = dir.clone();
    // The engine is built on the runtime's thread (CUDA's backend is not Send).
    let runtime = match a.device {
        super::Device::Cpu => Runtime::start(config, Some(tokenizer.clone()), move || build(&d, Cpu::new().with_products(products))),
        super::Device::Cuda(n) => Runtime::start(config, Some(tokenizer.clone()), move || build(&d, super::run::cuda_backend(n, products)?)),
    }
    .with_context(|| format!("loading the model in {}", dir.display()))?;
    let max_pos = runtime.info().config.max_position_embeddings;
    let max_model_len = match a.max_model_len {
        Some(m) if m < 2 || m > max_pos => bail!("--max-model-len {m} is invalid: it must be between 2 and the model's max_position_embeddings ({max_pos})"),
        Some(m) => m,
        None => max_pos,
    };
    check_state_budget(&runtime.info().config, a.state_budget, max_model_len, a.max_model_len.is_some())?;
    tracing::info!(target: "tensorfold::serve", "model {} ({}) loaded in {:.2} s; system_fingerprint {fingerprint}", dir.display(), runtime.info().backend, t0.elapsed().as_secs_f64());
    let mut names = a.served_model_name.clone();
    if names.iter().any(String::is_empty) {
        bail!("--served-model-name must not be empty");
    }
    let model_id = if names.is_empty() { dir_name } else { names.remove(0) };
    let cfg = ServeConfig {
        model_id,
        aliases: names,
        api_key: a.api_key.filter(|k| !k.is_empty()),
        max_model_len,
        defaults,
        max_n: a.max_n,
        max_body_bytes: a.max_body_bytes,
        fingerprint,
        keep_alive: Duration::from_secs(5),
    };
    let state = Arc::new(AppState::new(runtime, tokenizer, cfg));
    // Constrained decoding's token table, once, before the first request (a second or so on a
    // 248k vocabulary: bench/results/2026-12-02-grammar-mask.md) rather than inside one.
    let t = std::time::Instant::now();
    match state.vocabulary() {
        Ok(v) => tracing::info!(target: "tensorfold::serve", "constrained decoding: token table of {} ids built in {:.0} ms", v.len(), t.elapsed().as_secs_f64() * 1e3),
        Err(e) => tracing::warn!(target: "tensorfold::serve", "{e}; requests for a JSON format or a forced tool call will be refused"),
    }

    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("tensorfold-http").build().context("starting the async runtime")?;
    let drain = Duration::from_secs_f64(a.drain_seconds);
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr().context("reading the listening address")?;
        tracing::info!(target: "tensorfold::serve", "listening on http://{local} (model `{}`)", state.config.model_id);
        serve::run(listener, state, drain).await.context("serving")
    })?;
    // Tasks still streaming past the drain deadline are dropped here, which cancels them.
    rt.shutdown_timeout(Duration::from_secs(1));
    tracing::info!(target: "tensorfold::serve", "stopped");
    Ok(())
}

/// The smallest `--max-body-bytes`: a request body shorter than this holds hardly a message.
const MIN_BODY_BYTES: usize = 1024;

/// Refuses a `--state-budget` (MiB) that cannot hold one sequence of this model, or one of
/// `max_model_len` tokens when that length was asked for (`explicit`); warns when the model's
/// own context does not fit, since longer prompts will be refused.
fn check_state_budget(c: &tensorfold::config::ModelConfig, budget_mib: u64, max_model_len: usize, explicit: bool) -> Result<()> {
    use tensorfold::session::state_bytes;
    let budget = budget_mib.saturating_mul(1 << 20);
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    // A one-token prompt and its first generated token.
    if state_bytes(c, 2) > budget {
        bail!("--state-budget {budget_mib} MiB cannot hold one sequence of this model ({:.2} MiB of state at 2 tokens); give more", mib(state_bytes(c, 2)));
    }
    if state_bytes(c, max_model_len) <= budget {
        return Ok(());
    }
    // The longest sequence that fits (state grows with every token).
    let (mut lo, mut hi) = (2, max_model_len);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if state_bytes(c, mid) <= budget {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let message = format!(
        "--state-budget {budget_mib} MiB holds one sequence of at most {lo} tokens, not the {max_model_len} of the context ({:.2} MiB of state)",
        mib(state_bytes(c, max_model_len))
    );
    if explicit {
        bail!("{message}: raise --state-budget or lower --max-model-len");
    }
    tracing::warn!(target: "tensorfold::serve", "{message}: longer prompts will be refused (--max-model-len or a larger --state-budget says otherwise)");
    Ok(())
}

/// The engine for `dir` on `backend`.
fn build<B: tensorfold::backend::Backend>(dir: &std::path::Path, backend: B) -> Result<Engine<B>> {
    let host = HostModel::open(dir)?;
    for name in host.loaded.ignored.iter().take(3) {
        tracing::warn!(target: "tensorfold::serve", "{}: tensor `{name}` is not part of the text model; ignored", dir.display());
    }
    let model = Model::new(&host, backend)?;
    Ok(Engine::new(model, DEFAULT_CHUNK)?.with_model_dir(dir))
}
