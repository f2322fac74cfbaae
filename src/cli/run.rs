//! `tensorfold run`: prompt in, streamed text out, speeds at the end.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use tensorfold::backend::cpu::Cpu;
use tensorfold::backend::Products;
use tensorfold::config::GenerationConfig;
use tensorfold::engine::{Engine, DEFAULT_CHUNK};
use tensorfold::model::{HostModel, Model};
use tensorfold::runtime::{Event, FinishReason, Request, Runtime, RuntimeConfig, Saved, StopRules};
use tensorfold::sampling::SamplingParams;
use tensorfold::session::{ModelIdentity, SessionData};
use tensorfold::tokenizer::{ChatMessage, Tokenizer};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Model directory (config.json, *.safetensors, tokenizer.json); default: the demo model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The prompt text.
    #[arg(short = 'p', long = "prompt", conflicts_with_all = ["file", "prompt_ids"])]
    pub prompt: Option<String>,
    /// Read the prompt from a file (`-` for standard input; without -p, -f or --prompt-ids a
    /// piped standard input is the prompt).
    #[arg(short = 'f', long = "file", conflicts_with = "prompt_ids")]
    pub file: Option<PathBuf>,
    /// The prompt as token ids, comma-separated (no tokenization, no template).
    #[arg(long = "prompt-ids", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt in the model's chat template as one user message.
    #[arg(long)]
    pub chat: bool,
    /// Extra chat template variables as a JSON object, e.g. '{"enable_thinking": false}'
    /// (llama.cpp's spelling).
    #[arg(long = "chat-template-kwargs", value_name = "JSON", requires = "chat")]
    pub chat_template_kwargs: Option<String>,
    /// Tokens to generate at most (-1: until an end-of-sequence token or the context is full).
    #[arg(short = 'n', long = "n-predict", default_value_t = 256, allow_hyphen_values = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Print generated token ids, one per line, instead of text.
    #[arg(long = "print-ids")]
    pub print_ids: bool,
    /// Write the logits of every processed position (`logits` f32 [T, V], `ids` i32 [T]) to a
    /// safetensors file.
    #[arg(long = "dump-logits")]
    pub dump_logits: Option<PathBuf>,
    /// Tokens per prompt-processing step.
    #[arg(long = "chunk", default_value_t = DEFAULT_CHUNK)]
    pub chunk: usize,
    /// After generating, save the session (tokens, sampling settings, state) to FILE.
    #[arg(long = "save-session", value_name = "FILE")]
    pub save_session: Option<PathBuf>,
    /// cpu, cuda, cuda:N or auto (a GPU when one is present).
    #[arg(long = "device", default_value = "auto")]
    pub device: super::Device,
    #[command(flatten)]
    pub products: super::ProductsArgs,
    /// CPU threads (default: one per core, or TENSORFOLD_THREADS); the CPU backend only.
    #[arg(short = 't', long = "threads", value_name = "N")]
    pub threads: Option<usize>,
    /// Context size in tokens: a prompt plus -n that cannot fit is refused, and with -n -1
    /// generation stops when it is full (default and upper bound: the model's
    /// max_position_embeddings).
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    pub ctx_size: Option<usize>,
    /// Stop where this text first appears in the output (not printed); may be given again.
    #[arg(long = "stop", value_name = "STRING")]
    pub stop: Vec<String>,
    /// Continue a session saved by --save-session (or chat's /save): the prompt, if any, is
    /// appended to it, and generation continues exactly where it stopped. Its sampling settings
    /// apply unless flags override them.
    #[arg(long = "load-session", value_name = "FILE", conflicts_with = "chat")]
    pub load_session: Option<PathBuf>,
}

/// Sampling flags (shared by `run` and `chat`).
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy. Default: the checkpoint's generation_config.json.
    #[arg(long = "temp", allow_hyphen_values = true)]
    pub temp: Option<f32>,
    /// Keep the K most likely tokens (0: all).
    #[arg(long = "top-k")]
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches P (1: off).
    #[arg(long = "top-p", allow_hyphen_values = true)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0: off).
    #[arg(long = "min-p", allow_hyphen_values = true)]
    pub min_p: Option<f32>,
    /// Divide positive (multiply negative) logits of recent tokens by this (1: off).
    #[arg(long = "repeat-penalty", allow_hyphen_values = true)]
    pub repeat_penalty: Option<f32>,
    /// Tokens the penalties look back over (-1: all, 0: off).
    #[arg(long = "repeat-last-n", allow_hyphen_values = true)]
    pub repeat_last_n: Option<i64>,
    /// Subtract this from the logit of every token in the penalty window (0: off).
    #[arg(long = "presence-penalty", allow_hyphen_values = true)]
    pub presence_penalty: Option<f32>,
    /// Subtract this times a token's count in the penalty window (0: off).
    #[arg(long = "frequency-penalty", allow_hyphen_values = true)]
    pub frequency_penalty: Option<f32>,
    /// Random seed (a fixed default, so runs repeat).
    #[arg(short = 's', long = "seed")]
    pub seed: Option<u64>,
}

/// Sampling settings from the checkpoint: its generation_config.json as transformers and vLLM
/// read it (do_sample false → greedy; otherwise its values over neutral defaults), else
/// llama.cpp's defaults.
pub fn checkpoint_params(gc: &GenerationConfig, has_gc: bool) -> SamplingParams {
    if !has_gc {
        SamplingParams::default()
    } else if gc.do_sample == Some(false) || (gc.do_sample.is_none() && gc.temperature.is_none()) {
        SamplingParams::greedy()
    } else {
        SamplingParams {
            temperature: gc.temperature.unwrap_or(1.0),
            top_k: gc.top_k.unwrap_or(0),
            top_p: gc.top_p.unwrap_or(1.0),
            min_p: gc.min_p.unwrap_or(0.0),
            repetition_penalty: gc.repetition_penalty.unwrap_or(1.0),
            ..SamplingParams::default()
        }
    }
}

impl SamplingArgs {
    /// `p` with every flag given applied over it.
    pub fn apply(&self, mut p: SamplingParams) -> SamplingParams {
        if let Some(t) = self.temp {
            p.temperature = t;
        }
        if let Some(k) = self.top_k {
            p.top_k = k;
        }
        if let Some(x) = self.top_p {
            p.top_p = x;
        }
        if let Some(x) = self.min_p {
            p.min_p = x;
        }
        if let Some(x) = self.repeat_penalty {
            p.repetition_penalty = x;
        }
        if let Some(x) = self.repeat_last_n {
            p.repeat_last_n = x;
        }
        if let Some(x) = self.presence_penalty {
            p.presence_penalty = x;
        }
        if let Some(x) = self.frequency_penalty {
            p.frequency_penalty = x;
        }
        if let Some(s) = self.seed {
            p.seed = s;
        }
        p
    }
}

/// The CPU backend with `-t N` threads (else one per core, or `TENSORFOLD_THREADS`) and the
/// given products.
pub fn cpu_backend(threads: Option<usize>, products: Products) -> Cpu {
    match threads {
        Some(n) => Cpu::with(tensorfold::backend::cpu::simd::Isa::detect(), n),
        None => Cpu::new(),
    }
    .with_products(products)
}

/// The CUDA backend on device `n` with the given products.
pub fn cuda_backend(n: usize, products: Products) -> Result<tensorfold::backend::cuda::Cuda> {
    Ok(tensorfold::backend::cuda::Cuda::new(n).with_context(|| format!("opening CUDA device {n}"))?.with_products(products))
}

/// `-t N` checked: at least one thread.
pub fn check_threads(threads: Option<usize>) -> Result<()> {
    if threads == Some(0) {
        bail!("-t 0 is invalid: give a number of CPU threads, at least 1");
    }
    Ok(())
}

/// `--chat-template-kwargs JSON` as the template's extra variables (none when not given).
pub fn template_kwargs(json: Option<&str>) -> Result<serde_json::Map<String, serde_json::Value>> {
    match json {
        None => Ok(Default::default()),
        Some(j) => match serde_json::from_str::<serde_json::Value>(j) {
            Ok(serde_json::Value::Object(m)) => Ok(m),
            _ => bail!("--chat-template-kwargs must be a JSON object, e.g. '{{\"enable_thinking\": false}}'"),
        },
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    let products = a.products.resolve()?;
    let dir = super::model_dir(a.model.as_deref())?;
    let t_load = Instant::now();
    let host = HostModel::open(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    for name in host.loaded.ignored.iter().take(3) {
        eprintln!("warning: {}: tensor `{name}` is not part of the text model; ignored", dir.display());
    }
    // Exact ids in and out need no tokenizer (a synthetic checkpoint written without one).
    let ids_only = a.prompt_ids.is_some() && a.print_ids && !a.chat;
    let tokenizer = match Tokenizer::from_dir(&dir) {
        Ok(t) => Some(t),
        Err(_) if ids_only && !dir.join("tokenizer.json").exists() => None,
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "loading the tokenizer in {} (a checkpoint from `tensorfold synth` needs --tokenizer FILE; --prompt-ids with --print-ids runs without one)",
                dir.display()
            )))
        }
    };
    let gc_path = dir.join("generation_config.json");
    let gc = GenerationConfig::from_dir(&dir)?;
    let params = a.sampling.apply(checkpoint_params(&gc, gc_path.exists()));
    params.validate()?;
    if a.n_predict < -1 {
        bail!("-n {} is invalid: give a number of tokens, or -1 for no limit", a.n_predict);
    }
    if a.chunk == 0 {
        bail!("--chunk 0 is invalid: a prompt step holds at least one token");
    }
    check_threads(a.threads)?;
    if a.stop.iter().any(|s| s.is_empty()) {
        bail!("--stop needs a non-empty string");
    }
    let loading = a.load_session.is_some();
    // The prompt text as given (-p, -f, stdin), echoed before the completion as -p always was.
    let mut echo: Option<String> = None;

    let prompt_ids: Vec<u32> = match (&a.prompt_ids, &a.prompt, &a.file) {
        (Some(ids), _, _) => {
            if a.chat {
                bail!("--chat applies to text prompts, not --prompt-ids");
            }
            ids.clone()
        }
        (None, p, f) => {
            let text = match (p, f) {
                (Some(p), _) => p.clone(),
                (None, Some(f)) if f.as_os_str() == "-" => {
                    let mut s = String::new();
                    std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
                    s
                }
                (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("reading the prompt file {}", f.display()))?,
                // A loaded session continues by itself.
                (None, None) if loading => String::new(),
                (None, None) => {
                    if std::io::stdin().is_terminal() {
                        bail!("no prompt: pass -p PROMPT, -f FILE or --prompt-ids, or pipe the prompt on stdin");
                    }
                    let mut s = String::new();
                    std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
                    s
                }
            };
            let Some(tokenizer) = tokenizer.as_ref() else { unreachable!("text prompts need the tokenizer, loaded above") };
            if a.chat {
                let Some(t) = tokenizer.chat_template() else {
                    bail!("--chat: the model in {} has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja)", dir.display());
                };
                // Templates write their own special tokens, so none are added (as transformers).
                let kwargs = template_kwargs(a.chat_template_kwargs.as_deref())?;
                tokenizer.encode_with(&t.render(&[ChatMessage::new("user", text)], true, &kwargs)?, false)?
            } else if text.is_empty() {
                Vec::new()
            } else {
                let ids = tokenizer.encode(&text)?;
                if !a.print_ids {
                    echo = Some(text);
                }
                ids
            }
        }
    };
    if prompt_ids.is_empty() && !loading {
        bail!("the prompt is empty (give one with -p PROMPT, -f FILE, -f - or a pipe for standard input, or --prompt-ids)");
    }
    let vocab = host.config.vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&id| id as usize >= vocab) {
        bail!("prompt id {bad} is outside the model's vocabulary (vocab_size {vocab})");
    }

    // Fail before any work on what would fail after it.
    for (flag, path) in [("--save-session", &a.save_session), ("--dump-logits", &a.dump_logits)] {
        if let Some(p) = path {
            check_output_path(flag, p)?;
        }
    }
    let resume = match &a.load_session {
        Some(path) => {
            let identity = ModelIdentity::of_dir(&dir)?;
            let mut data = SessionData::load(path, &host.config, identity, products).context("loading the session")?;
            // The session's own settings (seed included), with the flags given over them.
            data.params = a.sampling.apply(data.params);
            data.params.validate()?;
            if data.state.position == data.tokens.len() && prompt_ids.is_empty() {
                bail!("{}: the session has consumed all its {} tokens; pass a prompt (-p, -f, --prompt-ids) to continue it", path.display(), data.state.position);
            }
            eprintln!("session: {} tokens ({} to process) from {}", data.tokens.len(), data.tokens.len() - data.state.position, path.display());
            Some(data)
        }
        None => None,
    };
    let max_pos = host.config.max_position_embeddings;
    let total_prompt = resume.as_ref().map_or(0, |d| d.tokens.len()) + prompt_ids.len();
    if total_prompt > max_pos {
        bail!("the prompt holds {total_prompt} tokens; the model's context is {max_pos} tokens (max_position_embeddings in {})", dir.join("config.json").display());
    }
    // -c N: the prompt and the generation together hold at most N tokens.
    let ctx_limit = match a.ctx_size {
        None => None,
        Some(0) => bail!("-c 0 is invalid: give a context size in tokens"),
        Some(n) if n > max_pos => {
            bail!("-c {n} is larger than the model's context of {max_pos} tokens (max_position_embeddings in {})", dir.join("config.json").display())
        }
        Some(n) => {
            if total_prompt >= n {
                bail!("the prompt holds {total_prompt} tokens; -c {n} leaves no room to generate");
            }
            if a.n_predict >= 0 && total_prompt + a.n_predict as usize > n {
                bail!("the prompt ({total_prompt} tokens) and -n {} do not fit -c {n} (lower -n, or -n -1 to stop when the context is full)", a.n_predict);
            }
            Some(n - total_prompt)
        }
    };
    let tokenizer = tokenizer.map(std::sync::Arc::new);
    let cfg = RuntimeConfig { max_seqs: 1, max_batch_tokens: a.chunk, chunk: a.chunk, max_waiting: 1, state_budget: u64::MAX, ..RuntimeConfig::default() };
    let chunk = a.chunk;
    let model_dir = dir.clone();
    let host = std::sync::Arc::new(host);
    let h = host.clone();
    let runtime = match a.device {
        super::Device::Cpu => {
            let threads = a.threads;
            Runtime::start(cfg, tokenizer.clone(), move || -> Result<_> { Ok(Engine::new(Model::new(&h, cpu_backend(threads, products))?, chunk)?.with_model_dir(model_dir)) })
        }
        super::Device::Cuda(n) => {
            Runtime::start(cfg, tokenizer.clone(), move || -> Result<_> { Ok(Engine::new(Model::new(&h, cuda_backend(n, products)?)?, chunk)?.with_model_dir(model_dir)) })
        }
    }?;
    generate(&a, &dir, &host, tokenizer.as_deref(), prompt_ids, params, resume, runtime, t_load, echo, ctx_limit)
}

/// Refuses an output path that cannot be written (a directory, a missing parent) before any
/// work is done.
fn check_output_path(flag: &str, p: &std::path::Path) -> Result<()> {
    if p.is_dir() {
        bail!("{flag} {}: is a directory; give a file name", p.display());
    }
    let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    if !parent.is_dir() {
        bail!("{flag} {}: the directory {} does not exist", p.display(), parent.display());
    }
    Ok(())
}

/// Prompt processing and generation through the runtime: one request, its events streamed.
#[allow(clippy::too_many_arguments)]
fn generate(
    a: &RunArgs,
    dir: &std::path::Path,
    host: &HostModel,
    tokenizer: Option<&Tokenizer>,
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    resume: Option<SessionData>,
    runtime: Runtime,
    t_load: Instant,
    echo: Option<String>,
    ctx_limit: Option<usize>,
) -> Result<()> {
    let info = runtime.info().clone();
    eprintln!("model: {} ({}), loaded in {:.2} s", dir.display(), info.backend, t_load.elapsed().as_secs_f64());
    let vocab = host.config.vocab_size;
    // End-of-sequence ids: the tokenizer's union, else config.json's and generation_config.json's.
    let eos: Vec<u32> = match tokenizer {
        Some(t) => t.eos_ids().to_vec(),
        None => {
            let mut v = host.config.eos_token_id.clone();
            v.extend(GenerationConfig::from_dir(dir)?.eos_token_id);
            v
        }
    };
    let dump = a.dump_logits.is_some();
    let meta = resume.as_ref().map(|d| d.meta.clone()).unwrap_or_default();
    let (mut prompt, params, resume) = match resume {
        Some(d) => (d.tokens.clone(), d.params, Some(Saved { tokens: d.tokens, state: d.state })),
        None => (Vec::new(), params, None),
    };
    let start = resume.as_ref().map_or(0, |r| r.state.position);
    prompt.extend_from_slice(&prompt_ids);
    // With -c N and -n -1 the limit is the room -c leaves (reported as the context filling up).
    let max_tokens = if a.n_predict < 0 { ctx_limit } else { Some(a.n_predict as usize) };
    let mut req = Request::new(prompt.clone(), params, StopRules { eos_ids: eos, strings: a.stop.clone(), max_tokens });
    req.resume = resume;
    req.return_state = a.save_session.is_some();
    req.prompt_logits = dump;
    req.return_logits = dump;
    req.progress = true;
    let t_prompt = Instant::now();
    let mut handle = runtime.submit(req)?;
    super::interrupt::install();
    super::interrupt::set(Some(handle.canceller()));

    // A progress bar when the prompt is long.
    let bar = if prompt.len() - start > a.chunk.max(1).saturating_mul(4) && std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new((prompt.len() - start) as u64);
        // indicatif's own {per_sec} prints `1,081.5814/s`: one decimal, in tokens.
        let style = indicatif::ProgressStyle::with_template("prompt {bar:40} {pos}/{len} tokens ({rate} tok/s, eta {eta})").expect("a valid template").with_key(
            "rate",
            |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = std::fmt::Write::write_fmt(w, format_args!("{:.1}", s.per_sec()));
            },
        );
        b.set_style(style);
        Some(b)
    } else {
        None
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if let Some(p) = &echo {
        write!(out, "{p}")?;
        out.flush()?;
    }
    let mut dumped: Vec<f32> = Vec::new();
    let mut dumped_ids: Vec<u32> = prompt[start..].to_vec();
    let mut prompt_time = None;
    let mut generated = 0usize;
    let mut finished = None;
    while let Some(ev) = handle.blocking_next() {
        match ev {
            Event::Started { cached_tokens } => {
                if cached_tokens > start {
                    dumped_ids.drain(..cached_tokens - start);
                }
            }
            Event::Progress { done, .. } => {
                if let Some(b) = &bar {
                    b.set_position((done - start) as u64);
                }
            }
            Event::PromptLogits(l) => dumped.extend_from_slice(&l),
            Event::Token(t) => {
                if prompt_time.is_none() {
                    prompt_time = Some(t_prompt.elapsed());
                    if let Some(b) = &bar {
                        b.finish_and_clear();
                    }
                }
                generated += 1;
                if a.print_ids {
                    writeln!(out, "{}", t.id)?;
                } else {
                    write!(out, "{}", t.text)?;
                }
                out.flush()?;
                if dump {
                    // The logits row of each generated id after the first is the row after the
                    // id before it: rows follow the ids fed.
                    dumped_ids.push(t.id);
                    if let Some(l) = t.logits {
                        if generated > 1 {
                            dumped.extend_from_slice(&l);
                        }
                    }
                }
            }
            Event::Finished(f) => {
                finished = Some(f);
                break;
            }
        }
    }
    if !a.print_ids {
        writeln!(out)?;
    }
    drop(out);
    super::interrupt::set(None);
    let Some(f) = finished else { bail!("the runtime stopped before the request finished") };
    if let FinishReason::Error(e) = &f.reason {
        bail!("generation failed: {e}");
    }
    let total = t_prompt.elapsed();
    let prompt_time = prompt_time.unwrap_or(total);
    let gen_time = total.saturating_sub(prompt_time);
    let processed = f.usage.prompt_tokens - f.usage.cached_tokens.max(start);
    let stop_reason = match &f.reason {
        FinishReason::Eos(_) | FinishReason::StopString(_) => "eos",
        FinishReason::Length if a.n_predict < 0 => "context",
        FinishReason::Length => "length",
        FinishReason::ContextFull => "context",
        FinishReason::Cancelled => "Ctrl-C",
        FinishReason::Error(_) => "error",
    };
    // The last generated id is never fed, so its row is not dumped; the dump holds one row per
    // id fed.
    if dump {
        dumped_ids.truncate(dumped.len() / vocab);
    }
    let rate = |n: usize, d: Duration| if n == 0 || d.is_zero() { "-".to_string() } else { format!("{:.1}", n as f64 / d.as_secs_f64()) };
    eprintln!(
        "prompt: {} in {:.3} s ({} tok/s) | generation: {} in {:.3} s ({} tok/s), stopped by {}",
        tokens(processed),
        prompt_time.as_secs_f64(),
        rate(processed, prompt_time),
        tokens(generated),
        gen_time.as_secs_f64(),
        rate(generated.saturating_sub(1), gen_time),
        stop_reason
    );
    if let Some(path) = &a.save_session {
        let saved = f.saved.context("the runtime returned no state to save")?;
        let data = SessionData { tokens: saved.tokens, params, meta, state: saved.state, products: info.products };
        data.save(path, ModelIdentity::of_dir(dir)?, &host.config).context("saving the session")?;
        eprintln!("session: {} tokens saved to {}", data.tokens.len(), path.display());
    }
    if let Some(path) = &a.dump_logits {
        write_logits(path, &dumped, &dumped_ids, vocab).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("logits: {} rows written to {}", dumped_ids.len(), path.display());
    }
    Ok(())
}

/// "1 token", "2 tokens".
fn tokens(n: usize) -> String {
    if n == 1 {
        "1 token".into()
    } else {
        format!("{n} tokens")
    }
}

/// Writes `logits` f32 `[T, V]` and `ids` i32 `[T]` to a safetensors file, atomically (a unique
/// temporary file beside it renamed into place, removed on error: `fsutil::write_atomic`).
fn write_logits(path: &std::path::Path, logits: &[f32], ids: &[u32], vocab: usize) -> Result<()> {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let lb: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let ib: Vec<u8> = ids.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
    let t = ids.len();
    let views = vec![("logits".to_string(), TensorView::new(Dtype::F32, vec![t, vocab], &lb)?), ("ids".to_string(), TensorView::new(Dtype::I32, vec![t], &ib)?)];
    let bytes = safetensors::serialize(views, None)?;
    tensorfold::fsutil::write_atomic(path, |f| f.write_all(&bytes))?;
    Ok(())
}
