//! `tensorfold chat`: a conversation kept in one session. Each turn renders the whole
//! conversation with the model's chat template and feeds only the tokens past the longest
//! prefix the session (or a snapshot) has already processed.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use tensorfold::config::GenerationConfig;
use tensorfold::engine::{Engine, DEFAULT_CHUNK};
use tensorfold::model::{HostModel, Model};
use tensorfold::runtime::{Event, FinishReason, Request, Runtime, RuntimeConfig, Saved, StopRules};
use tensorfold::sampling::SamplingParams;
use tensorfold::session::{ModelIdentity, SessionData};
use tensorfold::tokenizer::{ChatMessage, Tokenizer};

use super::run::{checkpoint_params, SamplingArgs};

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Model directory (config.json, *.safetensors, tokenizer.json with a chat template).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// A system message opening the conversation.
    #[arg(long = "system")]
    pub system: Option<String>,
    /// Tokens per reply at most (-1: until an end-of-sequence token or the context is full).
    /// The default bounds a reply that never ends (llama.cpp's -n -1 does not).
    #[arg(short = 'n', long = "n-predict", default_value_t = DEFAULT_REPLY_TOKENS, allow_hyphen_values = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Tokens per prompt-processing step.
    #[arg(long = "chunk", default_value_t = DEFAULT_CHUNK)]
    pub chunk: usize,
    #[command(flatten)]
    pub snapshots: super::SnapshotArgs,
    /// cpu, cuda, cuda:N or auto (a GPU when one is present).
    #[arg(long = "device", default_value = "auto")]
    pub device: super::Device,
    #[command(flatten)]
    pub products: super::ProductsArgs,
    /// CPU threads (default: one per core, or TENSORFOLD_THREADS); the CPU backend only.
    #[arg(short = 't', long = "threads", value_name = "N")]
    pub threads: Option<usize>,
    /// Extra chat template variables as a JSON object, e.g. '{"enable_thinking": false}'
    /// (llama.cpp's spelling).
    #[arg(long = "chat-template-kwargs", value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
}

const HELP: &str = "commands: /save FILE, /load FILE, /reset, /quit (anything else is your message; end a line with \\ to continue it on the next)";

/// `-n` of `chat` unless given: tokens per reply at most.
pub const DEFAULT_REPLY_TOKENS: i64 = 4096;

/// Where messages come from: a line editor with history at a terminal, else stdin's lines.
enum Input {
    Tty(rustyline::DefaultEditor),
    Pipe(std::io::Lines<std::io::StdinLock<'static>>),
}

impl Input {
    /// One message: lines ending in `\` continue on the next (joined by a newline). `None` at
    /// the end of input. At a terminal, Ctrl-C clears the line; on an empty line it asks for a
    /// second press, which exits.
    fn message(&mut self) -> Result<Option<String>> {
        let mut text = String::new();
        let mut armed = false;
        loop {
            let prompt = if text.is_empty() { "> " } else { "... " };
            let line = match self {
                Input::Pipe(lines) => match lines.next() {
                    None => return Ok((!text.is_empty()).then_some(text)),
                    Some(l) => l.context("reading stdin")?,
                },
                Input::Tty(ed) => match ed.readline(prompt) {
                    Ok(l) => l,
                    Err(rustyline::error::ReadlineError::Interrupted) => {
                        if armed {
                            std::process::exit(130);
                        }
                        if text.is_empty() {
                            armed = true;
                            eprintln!("(Ctrl-C again to exit, /quit or Ctrl-D to end)");
                        } else {
                            text.clear();
                        }
                        continue;
                    }
                    Err(rustyline::error::ReadlineError::Eof) => return Ok(None),
                    Err(e) => return Err(e).context("reading the terminal"),
                },
            };
            armed = false;
            let line = line.trim_end_matches(['\r', '\n']);
            match line.strip_suffix('\\') {
                Some(head) => {
                    text.push_str(head);
                    text.push('\n');
                }
                None => {
                    text.push_str(line);
                    if let Input::Tty(ed) = self {
                        if !text.trim().is_empty() {
                            let _ = ed.add_history_entry(text.as_str());
                        }
                    }
                    return Ok(Some(text));
                }
            }
        }
    }
}

/// The conversation as stored in a session's meta.
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct Meta {
    messages: Vec<ChatMessage>,
}

pub fn chat(a: ChatArgs) -> Result<()> {
    let products = a.products.resolve()?;
    let dir = super::model_dir(a.model.as_deref())?;
    let host = HostModel::open(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).with_context(|| format!("loading the tokenizer in {}", dir.display()))?);
    let Some(template) = tokenizer.chat_template() else {
        bail!(
            "{}: the model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja); `tensorfold chat` needs one (use `tensorfold run` for plain completion)",
            dir.display()
        );
    };
    super::run::check_threads(a.threads)?;
    let kwargs = super::run::template_kwargs(a.chat_template_kwargs.as_deref())?;
    let gc = GenerationConfig::from_dir(&dir)?;
    let params = a.sampling.apply(checkpoint_params(&gc, dir.join("generation_config.json").exists()));
    params.validate()?;

    let boundary_ids: Vec<u32> = tokenizer.token_to_id("<|im_start|>").into_iter().collect();
    let cfg = RuntimeConfig {
        max_seqs: 1,
        max_batch_tokens: a.chunk,
        chunk: a.chunk,
        max_waiting: 1,
        state_budget: u64::MAX,
        snapshots: a.snapshots.config(a.device),
        boundary_ids,
        ..RuntimeConfig::default()
    };
    let (chunk, model_dir) = (a.chunk, dir.clone());
    let host = Arc::new(host);
    let h = host.clone();
    let runtime = match a.device {
        super::Device::Cpu => {
            let threads = a.threads;
            Runtime::start(cfg, Some(tokenizer.clone()), move || -> Result<_> {
                Ok(Engine::new(Model::new(&h, super::run::cpu_backend(threads, products))?, chunk)?.with_model_dir(model_dir))
            })
        }
        super::Device::Cuda(n) => Runtime::start(cfg, Some(tokenizer.clone()), move || -> Result<_> {
            Ok(Engine::new(Model::new(&h, super::run::cuda_backend(n, products)?)?, chunk)?.with_model_dir(model_dir))
        }),
    }?;
    let interactive = std::io::stdin().is_terminal();
    eprintln!("model: {} ({}); {HELP}", dir.display(), runtime.info().backend);
    let identity = || ModelIdentity::of_dir(&dir);
    // The conversation's state after the last reply (what /save writes; the next turn resumes it).
    let mut last: Option<Saved> = None;
    let mut params = params;

    let system: Vec<ChatMessage> = a.system.iter().map(|t| ChatMessage::new("system", t.clone())).collect();
    let mut messages = system.clone();
    let max_new = if a.n_predict < 0 { None } else { Some(a.n_predict as usize) };
    let mut input =
        if interactive { Input::Tty(rustyline::DefaultEditor::new().context("opening the terminal for line editing")?) } else { Input::Pipe(std::io::stdin().lock().lines()) };
    loop {
        let Some(line) = input.message()? else { break };
        let line = line.as_str();
        if line.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = line.strip_prefix('/') {
            let (name, arg) = cmd.split_once(char::is_whitespace).map_or((cmd, ""), |(n, r)| (n, r.trim()));
            match name {
                "quit" | "exit" => break,
                "reset" => {
                    last = None;
                    messages = system.clone();
                    eprintln!("(conversation reset)");
                }
                "save" if !arg.is_empty() => {
                    let Some(st) = &last else {
                        eprintln!("(nothing to save yet: the conversation is empty)");
                        continue;
                    };
                    let data = SessionData {
                        tokens: st.tokens.clone(),
                        params,
                        meta: serde_json::to_string(&Meta { messages: messages.clone() })?,
                        state: st.state.clone(),
                        products: runtime.info().products,
                    };
                    match identity().and_then(|id| data.save(Path::new(arg), id, &host.config)) {
                        Ok(()) => eprintln!("(session saved to {arg}: {} tokens, {} messages)", data.tokens.len(), messages.len()),
                        Err(e) => eprintln!("error: {e}"),
                    }
                }
                "load" if !arg.is_empty() => match identity().and_then(|id| SessionData::load(Path::new(arg), &host.config, id, runtime.info().products)) {
                    Ok(data) => {
                        messages = match serde_json::from_str::<Meta>(&data.meta) {
                            Ok(m) => m.messages,
                            Err(_) => {
                                eprintln!("(the session holds no conversation; the next message starts one)");
                                system.clone()
                            }
                        };
                        params = a.sampling.apply(data.params);
                        eprintln!("(session loaded from {arg}: {} tokens, {} messages)", data.tokens.len(), messages.len());
                        last = Some(Saved { tokens: data.tokens, state: data.state });
                    }
                    Err(e) => eprintln!("error: {e}"),
                },
                _ => eprintln!("{HELP}"),
            }
            continue;
        }
        messages.push(ChatMessage::new("user", line));
        match turn(&runtime, &tokenizer, template, &kwargs, &messages, params, max_new, &mut last) {
            Ok(reply) => messages.push(ChatMessage::new("assistant", reply)),
            Err(e) => {
                messages.pop();
                eprintln!("error: {}", super::error_text(&e));
            }
        }
    }
    Ok(())
}

/// One exchange: renders `messages`, submits them (the runtime feeds only what its state or a
/// snapshot lacks), streams the reply to stdout and returns its text; `last` becomes the state
/// after the reply.
#[allow(clippy::too_many_arguments)]
fn turn(
    runtime: &Runtime,
    tokenizer: &Tokenizer,
    template: &tensorfold::tokenizer::ChatTemplate,
    kwargs: &serde_json::Map<String, serde_json::Value>,
    messages: &[ChatMessage],
    params: SamplingParams,
    max_new: Option<usize>,
    last: &mut Option<Saved>,
) -> Result<String> {
    // Templates write their own special tokens, so none are added (as transformers).
    let ids = tokenizer.encode_with(&template.render(messages, true, kwargs)?, false)?;
    let mut req = Request::new(ids.clone(), params, StopRules { eos_ids: tokenizer.eos_ids().to_vec(), strings: Vec::new(), max_tokens: max_new });
    // Reuse past the resumed state's position came from a snapshot.
    let own = last.as_ref().filter(|l| ids.starts_with(&l.tokens[..l.state.position])).map_or(0, |l| l.state.position);
    req.resume = last.clone();
    req.return_state = true;
    let mut h = runtime.submit(req)?;
    super::interrupt::install();
    super::interrupt::set(Some(h.canceller()));
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut reply = String::new();
    let mut cached = 0;
    let mut finished = None;
    while let Some(ev) = h.blocking_next() {
        match ev {
            Event::Started { cached_tokens } => cached = cached_tokens,
            Event::Token(t) => {
                write!(out, "{}", t.text)?;
                out.flush()?;
                reply.push_str(&t.text);
            }
            Event::Finished(f) => {
                finished = Some(f);
                break;
            }
            _ => {}
        }
    }
    writeln!(out)?;
    out.flush()?;
    super::interrupt::set(None);
    let f = finished.context("the runtime stopped during the reply")?;
    if let FinishReason::Error(e) = &f.reason {
        bail!("{e}");
    }
    *last = f.saved;
    let stop = match f.reason {
        FinishReason::Eos(_) | FinishReason::StopString(_) => "eos",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "Ctrl-C",
        _ => "context",
    };
    let st = runtime.stats();
    eprintln!(
        "[prompt {} tokens: {} reused{}, {} processed | reply {} tokens, stopped by {} | {} snapshots, {:.1} MiB]",
        ids.len(),
        cached,
        if cached > own { " from a snapshot" } else { "" },
        ids.len() - cached,
        f.usage.completion_tokens,
        stop,
        st.snapshots,
        st.snapshot_bytes as f64 / (1 << 20) as f64
    );
    Ok(reply)
}
