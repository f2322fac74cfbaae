//! `tensorfold chat`: a conversation kept in one session. Each turn renders the whole
//! conversation with the model's chat template and feeds only the tokens past the longest
//! prefix the session (or a snapshot) has already processed.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use tensorfold::backend::cpu::Cpu;
use tensorfold::config::GenerationConfig;
use tensorfold::engine::{Engine, DEFAULT_CHUNK};
use tensorfold::model::{HostModel, Model};
use tensorfold::sampling::Sampler;
use tensorfold::session::{Session, SnapshotConfig, DEFAULT_SNAPSHOT_EVERY};
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
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_hyphen_values = true)]
    pub n_predict: i64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Tokens per prompt-processing step.
    #[arg(long = "chunk", default_value_t = DEFAULT_CHUNK)]
    pub chunk: usize,
    /// Keep a snapshot of the state every N tokens (and at the end of every prompt), so a
    /// later prompt sharing the prefix resumes there; 0: only at the end of prompts.
    #[arg(long = "snapshot-every", value_name = "N", default_value_t = DEFAULT_SNAPSHOT_EVERY)]
    pub snapshot_every: usize,
    /// Memory all snapshots may hold, in MiB (least recently used go first); 0 turns them off.
    #[arg(long = "snapshot-budget", value_name = "MiB", default_value_t = 1024)]
    pub snapshot_budget: u64,
}

const HELP: &str = "commands: /save FILE, /load FILE, /reset, /quit (anything else is your message)";

/// The conversation as stored in a session's meta.
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct Meta {
    messages: Vec<ChatMessage>,
}

pub fn chat(a: ChatArgs) -> Result<()> {
    let dir = super::model_dir(a.model.as_deref())?;
    let host = HostModel::open(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    let tokenizer = Tokenizer::from_dir(&dir).with_context(|| format!("loading the tokenizer in {}", dir.display()))?;
    let Some(template) = tokenizer.chat_template() else {
        bail!(
            "{}: the model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja); `tensorfold chat` needs one (use `tensorfold run` for plain completion)",
            dir.display()
        );
    };
    let gc = GenerationConfig::from_dir(&dir)?;
    let params = a.sampling.apply(checkpoint_params(&gc, dir.join("generation_config.json").exists()));
    params.validate()?;

    let backend = Cpu::new();
    let describe = tensorfold::backend::Backend::describe(&backend);
    let model = Model::new(&host, backend)?;
    let mut engine = Engine::new(model, a.chunk)?.with_model_dir(&dir);
    engine.set_snapshots(SnapshotConfig { every: a.snapshot_every, budget_bytes: a.snapshot_budget.saturating_mul(1 << 20) });
    let mut s = engine.new_session(params)?;
    let interactive = std::io::stdin().is_terminal();
    eprintln!("model: {} ({describe}); {HELP}", dir.display());

    let system: Vec<ChatMessage> = a.system.iter().map(|t| ChatMessage::new("system", t.clone())).collect();
    let mut messages = system.clone();
    let n_ids = tokenizer.vocab_size().min(host.config.vocab_size);
    let max_new = if a.n_predict < 0 { usize::MAX } else { a.n_predict as usize };
    let max_pos = host.config.max_position_embeddings;
    let mut sampler = Sampler::new();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        let line = line.trim_end_matches(['\r', '\n']);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = line.strip_prefix('/') {
            let (name, arg) = cmd.split_once(char::is_whitespace).map_or((cmd, ""), |(n, r)| (n, r.trim()));
            match name {
                "quit" | "exit" => break,
                "reset" => {
                    engine.reset(&mut s)?;
                    messages = system.clone();
                    eprintln!("(conversation reset)");
                }
                "save" if !arg.is_empty() => {
                    s.meta = serde_json::to_string(&Meta { messages: messages.clone() })?;
                    match engine.save_session(&s, Path::new(arg)) {
                        Ok(()) => eprintln!("(session saved to {arg}: {} tokens, {} messages)", s.tokens().len(), messages.len()),
                        Err(e) => eprintln!("error: {e}"),
                    }
                }
                "load" if !arg.is_empty() => match engine.load_session(Path::new(arg)) {
                    Ok(loaded) => {
                        let old = std::mem::replace(&mut s, loaded);
                        engine.free_session(old)?;
                        messages = match serde_json::from_str::<Meta>(&s.meta) {
                            Ok(m) => m.messages,
                            Err(_) => {
                                eprintln!("(the session holds no conversation; the next message starts one)");
                                system.clone()
                            }
                        };
                        eprintln!("(session loaded from {arg}: {} tokens, {} messages)", s.tokens().len(), messages.len());
                    }
                    Err(e) => eprintln!("error: {e}"),
                },
                _ => eprintln!("{HELP}"),
            }
            continue;
        }
        messages.push(ChatMessage::new("user", line));
        match turn(&mut engine, &mut s, &tokenizer, template, &messages, &mut sampler, n_ids, max_new, max_pos) {
            Ok(reply) => messages.push(ChatMessage::new("assistant", reply)),
            Err(e) => {
                messages.pop();
                eprintln!("error: {}", super::error_text(&e));
            }
        }
    }
    engine.free_session(s)?;
    Ok(())
}

/// One exchange: renders `messages`, feeds what the session lacks, streams the reply to stdout
/// and returns its text.
#[allow(clippy::too_many_arguments)]
fn turn(
    engine: &mut Engine<Cpu>,
    s: &mut Session,
    tokenizer: &Tokenizer,
    template: &tensorfold::tokenizer::ChatTemplate,
    messages: &[ChatMessage],
    sampler: &mut Sampler,
    n_ids: usize,
    max_new: usize,
    max_pos: usize,
) -> Result<String> {
    // Templates write their own special tokens, so none are added (as transformers).
    let ids = tokenizer.encode_with(&template.render(messages, true, &Default::default())?, false)?;
    let (reuse, logits) = engine.prompt(s, &ids, &mut |_, _| {})?;
    let mut logits = logits.to_vec();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut stream = tokenizer.stream();
    let mut reply = String::new();
    let mut generated = 0;
    let mut stop = "length";
    while generated < max_new {
        let next = s.sample(sampler, &logits[..n_ids]);
        s.push(next);
        generated += 1;
        if tokenizer.is_eos(next) {
            stop = "eos";
            break;
        }
        if let Some(t) = stream.push(next)? {
            write!(out, "{t}")?;
            out.flush()?;
            reply.push_str(&t);
        }
        if generated == max_new || s.tokens().len() >= max_pos {
            stop = if generated == max_new { "length" } else { "context" };
            break;
        }
        logits = engine.feed(s, &[], false, &mut |_, _| {})?.to_vec();
    }
    let rest = stream.finish();
    reply.push_str(&rest);
    writeln!(out, "{rest}")?;
    out.flush()?;
    eprintln!(
        "[prompt {} tokens: {} reused{}, {} processed | reply {} tokens, stopped by {} | {} snapshots, {:.1} MiB]",
        ids.len(),
        reuse.reused,
        if reuse.from_snapshot { " from a snapshot" } else { "" },
        reuse.processed,
        generated,
        stop,
        engine.snapshots().len(),
        engine.snapshots().bytes() as f64 / (1 << 20) as f64
    );
    Ok(reply)
}
