//! The batched runtime: one thread that owns the model and every running sequence, and
//! advances them together, one model step per tick. Every command and the server are its
//! clients: they [`Runtime::submit`] a [`Request`] and read its [`Event`]s from a channel
//! (blocking or async), and cancel it by dropping the [`Handle`].
//!
//! A tick: take new requests and cancels; admit waiting requests while slots and the state
//! memory budget allow (each resumes from the longest prefix snapshot of its prompt); preempt
//! the newest sequences (state swapped to host memory) when the running ones outgrow the
//! budget; plan the rows ([`scheduler`]: decode rows first, then prompt chunks, under a token
//! budget); run one [`Engine::step_sessions`] (which also takes the snapshots due after it,
//! while the device runs it); sample every row with its own settings (on the device where it
//! can: greedy, or the device sampler); apply the stop rules ([`stop`]); emit the events.
//!
//! Exactness: a sequence's logits and ids do not depend on what else shares its steps, how its
//! prompt was split, or whether it was preempted or resumed from a snapshot
//! (docs/numerics.md; the sampler's draw is keyed by seed and position), so a request gives the
//! bits of a solo run whatever the load.

mod masks;
pub mod scheduler;
pub mod stop;

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, RowSampling, SequenceState};
use crate::config::ModelConfig;
use crate::engine::{Choose, Chosen, Engine, StepRows};
use crate::grammar::Constraint;
use crate::sampling::{Sampler, SamplingParams};
use crate::session::{self, PrefixStats, Session, SnapshotConfig};
use crate::tokenizer::Tokenizer;

pub use stop::{FinishReason, StopRules};

/// How long the runtime waits idle before it moves snapshots out of the slot tier. Copying one
/// state to host memory takes milliseconds and a request that arrives meanwhile waits for it;
/// clients often send the next request at once (a load test's next wave, an agent's next turn),
/// so the copies wait for a quiet spell instead.
pub const SPILL_AFTER_IDLE: Duration = Duration::from_millis(200);

/// Limits and settings of a runtime.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Sequences resident at once (backend state slots; `--max-seqs`).
    pub max_seqs: usize,
    /// Rows (tokens) one step may hold (`--max-batch-tokens`).
    pub max_batch_tokens: usize,
    /// Prompt tokens one sequence feeds per step at most.
    pub chunk: usize,
    /// Requests waiting for a slot at most; past it [`Runtime::submit`] answers
    /// [`SubmitError::QueueFull`].
    pub max_waiting: usize,
    /// Bytes the resident sequences' states may hold together (conv windows, recurrent states,
    /// KV caches: [`session::state_bytes`]).
    pub state_budget: u64,
    /// Prefix snapshots: stride and memory budget.
    pub snapshots: SnapshotConfig,
    /// A snapshot is also taken before each of these ids in a prompt (`<|im_start|>`: chat turn
    /// boundaries, so the next turn of a conversation resumes there).
    pub boundary_ids: Vec<u32>,
    /// Compute the grammar masks of a tick's constrained rows on helper threads while its
    /// model step runs (the same masks: each depends only on the ids before the row); off,
    /// the runtime's thread computes them after the step.
    pub overlap_masks: bool,
}

impl Default for RuntimeConfig {
    /// 64 sequences, 512-token steps, prompt chunks of 256, 256 waiting, 8 GiB of state,
    /// snapshots off, masks overlapped with the step.
    fn default() -> Self {
        Self {
            max_seqs: 64,
            max_batch_tokens: 512,
            chunk: crate::engine::DEFAULT_CHUNK,
            max_waiting: 256,
            state_budget: 8 << 30,
            snapshots: SnapshotConfig::disabled(),
            boundary_ids: Vec::new(),
            overlap_masks: true,
        }
    }
}

/// A sequence's state and history, to resume (a loaded session file) or as a request left it.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    /// Every id: the `state.position` consumed ones, then pending ones (a sampled id not yet
    /// fed).
    pub tokens: Vec<u32>,
    pub state: SequenceState,
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt ids (with a `resume`, its tokens then the new ones).
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stop: StopRules,
    /// Added to the logits before sampling (OpenAI's `logit_bias`): `(id, bias)`.
    pub logit_bias: Vec<(u32, f32)>,
    /// Log-probabilities of each sampled id and of the `n` most likely ids (of the raw logits).
    pub logprobs: Option<usize>,
    /// Each [`Token`] carries the logits row it was sampled from.
    pub return_logits: bool,
    /// The logits of every prompt position fed come as [`Event::PromptLogits`] (no prefix
    /// reuse then, so every position is fed).
    pub prompt_logits: bool,
    /// Continue this state when its consumed tokens prefix the prompt.
    pub resume: Option<Saved>,
    /// [`Finished`] carries the sequence's final state.
    pub return_state: bool,
    /// [`Event::Progress`] after each prompt step.
    pub progress: bool,
    /// Constrained decoding: the grammar masks each sampled row (a copy, after `logit_bias`;
    /// reported logits and logprobs stay the raw row's) and advances with the sampled id. An
    /// EOS id that completes the grammar ends the sequence ([`FinishReason::Eos`]) even when
    /// `stop.eos_ids` is empty; an error of the grammar ends it with [`FinishReason::Error`].
    pub constraint: Option<Constraint>,
}

impl Request {
    /// Greedy decoding of `prompt`, ending on `stop`.
    pub fn new(prompt: Vec<u32>, params: SamplingParams, stop: StopRules) -> Self {
        Self {
            prompt,
            params,
            stop,
            logit_bias: Vec::new(),
            logprobs: None,
            return_logits: false,
            prompt_logits: false,
            resume: None,
            return_state: false,
            progress: false,
            constraint: None,
        }
    }
}

/// Log-probabilities at one generated position (natural log, of the raw logits' softmax).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// Of the sampled id.
    pub logprob: f32,
    /// The most likely ids, most likely first (ties: smaller id first).
    pub top: Vec<(u32, f32)>,
}

/// A generated id.
#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    pub id: u32,
    /// Text this id completes (valid UTF-8; held back while it may start a stop string; empty
    /// for an end-of-sequence id).
    pub text: String,
    /// The logits row it was sampled from (with [`Request::return_logits`]).
    pub logits: Option<Vec<f32>>,
    pub logprobs: Option<TokenLogprobs>,
    /// When the model step that computed it returned, on the runtime's thread: one instant for
    /// every token of a tick, so a client can time ticks without reading each event as it comes
    /// (`bench --concurrency` does, to keep its own thread off the cores the step uses).
    pub at: Instant,
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Leading prompt tokens whose state was reused (a snapshot or the resumed state).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    /// The final state (with [`Request::return_state`], when it ended by a stop rule or a
    /// cancel).
    pub saved: Option<Saved>,
}

/// What a request's channel carries, in order: `Started`, then `Progress`/`PromptLogits`,
/// `Token`s, and last `Finished` (always, unless the runtime itself stopped).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Admitted: this many prompt tokens are reused, the rest will be fed.
    Started {
        cached_tokens: usize,
    },
    /// Prompt tokens fed so far (of the prompt's length).
    Progress {
        done: usize,
        total: usize,
    },
    /// `[rows, V]` logits of the prompt positions one step fed (with
    /// [`Request::prompt_logits`]).
    PromptLogits(Vec<f32>),
    Token(Token),
    Finished(Finished),
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt holds {prompt} tokens; the model's context is {max} (max_position_embeddings)")]
    PromptTooLong { prompt: usize, max: usize },
    #[error("prompt id {id} is outside the model's vocabulary (vocab_size {vocab_size})")]
    TokenId { id: u32, vocab_size: usize },
    #[error("the state of a {prompt}-token prompt ({bytes} bytes) exceeds the runtime's state budget ({budget} bytes)")]
    OverBudget { prompt: usize, bytes: u64, budget: u64 },
    #[error("stop strings need the model's tokenizer, and this runtime has none")]
    NoTokenizer,
    #[error("the resumed state does not fit this model")]
    BadResume,
    #[error("{0} requests are waiting already; try again later")]
    QueueFull(usize),
    #[error("the runtime has stopped")]
    Stopped,
}

/// Why a runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("starting the runtime: {0}")]
    Start(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// What the runtime's thread reports of itself (read by `/metrics`, `bench`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub running: usize,
    pub waiting: usize,
    /// Sequences swapped out to host memory to make room, so far.
    pub preemptions: u64,
    pub prefix: PrefixStats,
    pub snapshots: usize,
    /// Bytes the snapshots hold, and of those the ones kept in backend slots.
    pub snapshot_bytes: u64,
    pub snapshot_slot_bytes: u64,
    /// Bytes of the resident sequences' states.
    pub state_bytes: u64,
    pub ticks: u64,
    /// Prompt tokens fed and tokens generated, so far.
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Time inside model steps ([`Engine::step_sessions`], the batch's host-side assembly, the
    /// snapshots due after the step and the read of its ids or logits included), and every other
    /// moment the runtime's thread is busy: commands, admission, preemption, planning, sampling,
    /// stop rules, snapshots at a request's end, events, publishing these stats. Not counted:
    /// waiting for a command while idle (and the snapshot spilling done then), and the pause
    /// when nothing can run.
    pub step_time: Duration,
    pub host_time: Duration,
    /// Requests finished, by reason: stop rule, cancelled, error.
    pub finished: u64,
    pub cancelled: u64,
    pub errors: u64,
}

/// What clients may know of the model a runtime serves.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub config: ModelConfig,
    /// The backend's description (`cpu (avx2, 2 threads)`).
    pub backend: String,
    /// The arithmetic of the backend's products (what session files record).
    pub products: crate::backend::Products,
    /// Ids sampling chooses among (the tokenizer's, within the logits row).
    pub v_eff: usize,
}

enum Command {
    Submit(Box<Pending>),
    Cancel(u64),
    Shutdown,
}

struct Pending {
    id: u64,
    req: Request,
    events: tokio::sync::mpsc::UnboundedSender<Event>,
}

struct Shared {
    stats: Mutex<Stats>,
    /// Submitted and not yet admitted.
    waiting: AtomicUsize,
    next_id: AtomicU64,
}

/// A running runtime: a handle to its thread. Dropping it stops the thread (requests in flight
/// end without a `Finished`).
pub struct Runtime {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    info: ModelInfo,
    config: RuntimeConfig,
    has_tokenizer: bool,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// One submitted request: its events, and a cancel on drop.
pub struct Handle {
    id: u64,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    tx: mpsc::Sender<Command>,
    done: bool,
}

impl Handle {
    /// The request's id (unique in this runtime).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event, waiting for it; `None` once the request has finished (or the runtime
    /// stopped). Not for async contexts: use [`Handle::next`] there.
    pub fn blocking_next(&mut self) -> Option<Event> {
        let e = self.rx.blocking_recv();
        self.note(&e);
        e
    }

    /// The next event (async).
    pub async fn next(&mut self) -> Option<Event> {
        let e = self.rx.recv().await;
        self.note(&e);
        e
    }

    /// The next event if one is there now.
    pub fn try_next(&mut self) -> Option<Event> {
        let e = self.rx.try_recv().ok();
        self.note(&e);
        e
    }

    fn note(&mut self, e: &Option<Event>) {
        if matches!(e, None | Some(Event::Finished(_))) {
            self.done = true;
        }
    }

    /// Asks the runtime to end the request; its `Finished` (reason `Cancelled`) follows unless
    /// it had finished already.
    pub fn cancel(&self) {
        let _ = self.tx.send(Command::Cancel(self.id));
    }

    /// A handle that cancels this request from anywhere (a signal handler, another thread).
    pub fn canceller(&self) -> Canceller {
        Canceller { id: self.id, tx: Mutex::new(self.tx.clone()) }
    }
}

/// Cancels one request ([`Handle::canceller`]); `Send` and `Sync`.
pub struct Canceller {
    id: u64,
    tx: Mutex<mpsc::Sender<Command>>,
}

impl Canceller {
    /// As [`Handle::cancel`].
    pub fn cancel(&self) {
        if let Ok(tx) = self.tx.lock() {
            let _ = tx.send(Command::Cancel(self.id));
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if !self.done {
            self.cancel();
        }
    }
}

impl Runtime {
    /// Starts the runtime's thread, which builds its engine with `make` (so a backend that is
    /// not `Send`, such as CUDA's, is made where it runs) and returns once it is ready.
    ///
    /// # Errors
    /// [`RuntimeError::Start`] with `make`'s error.
    pub fn start<B, F, E>(config: RuntimeConfig, tokenizer: Option<Arc<Tokenizer>>, make: F) -> Result<Self, RuntimeError>
    where
        B: Backend + 'static,
        F: FnOnce() -> Result<Engine<B>, E> + Send + 'static,
        E: std::fmt::Display,
    {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let shared = Arc::new(Shared { stats: Mutex::new(Stats::default()), waiting: AtomicUsize::new(0), next_id: AtomicU64::new(1) });
        let sh = shared.clone();
        let cfg = config.clone();
        let has_tokenizer = tokenizer.is_some();
        let thread = std::thread::Builder::new()
            .name("tensorfold-runtime".into())
            .spawn(move || {
                let mut engine = match make() {
                    Ok(e) => e,
                    Err(e) => {
                        // `{:#}`: an anyhow error's causes too ("opening CUDA device 0: no driver").
                        let _ = ready_tx.send(Err(format!("{e:#}")));
                        return;
                    }
                };
                let mut cfg = cfg;
                // A backend may hold fewer slots than asked for; admission then queues.
                cfg.max_seqs = cfg.max_seqs.clamp(1, engine.model.backend.max_slots());
                engine.set_snapshots(cfg.snapshots);
                engine.set_batch_capacity(cfg.max_seqs);
                engine.reserve_state_memory(cfg.max_seqs);
                let mc = engine.model.config.clone();
                let v_eff = tokenizer.as_ref().map_or(mc.vocab_size, |t| t.vocab_size().min(mc.vocab_size));
                let info = ModelInfo { config: mc, backend: engine.model.backend.describe(), products: engine.model.backend.products(), v_eff };
                let _ = ready_tx.send(Ok(info));
                Worker::new(engine, cfg, tokenizer, v_eff, rx, sh).run();
            })
            .map_err(|e| RuntimeError::Start(e.to_string()))?;
        let info = match ready_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(RuntimeError::Start(e));
            }
            Err(_) => {
                let _ = thread.join();
                return Err(RuntimeError::Start("the runtime's thread ended while starting".into()));
            }
        };
        Ok(Self { tx, shared, info, config, has_tokenizer, thread: Some(thread) })
    }

    /// The model served.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The settings it runs with.
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Queues a request.
    ///
    /// # Errors
    /// A request that can never run (empty or too long a prompt, ids outside the vocabulary, a
    /// state larger than the whole budget, stop strings without a tokenizer, a resumed state of
    /// another shape) or a full queue.
    pub fn submit(&self, req: Request) -> Result<Handle, SubmitError> {
        let c = &self.info.config;
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.prompt.len() > c.max_position_embeddings {
            return Err(SubmitError::PromptTooLong { prompt: req.prompt.len(), max: c.max_position_embeddings });
        }
        if let Some(&id) = req.prompt.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(SubmitError::TokenId { id, vocab_size: c.vocab_size });
        }
        let bytes = session::state_bytes(c, req.prompt.len() + 1);
        if bytes > self.config.state_budget {
            return Err(SubmitError::OverBudget { prompt: req.prompt.len(), bytes, budget: self.config.state_budget });
        }
        if !req.stop.strings.is_empty() && !self.has_tokenizer {
            return Err(SubmitError::NoTokenizer);
        }
        if let Some(r) = &req.resume {
            if r.state.check(c).is_err() || r.state.position > r.tokens.len() {
                return Err(SubmitError::BadResume);
            }
        }
        let waiting = self.shared.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.config.max_waiting {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(waiting));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        if self.tx.send(Command::Submit(Box::new(Pending { id, req, events: etx }))).is_err() {
            self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(Handle { id, rx: erx, tx: self.tx.clone(), done: false })
    }

    /// The runtime's counters now.
    pub fn stats(&self) -> Stats {
        let mut s = self.shared.stats.lock().map(|s| s.clone()).unwrap_or_default();
        s.waiting = self.shared.waiting.load(Ordering::SeqCst);
        s
    }

    /// Stops the thread after the current tick; requests in flight end without `Finished`.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A request inside the runtime.
struct Seq {
    id: u64,
    req: Request,
    events: tokio::sync::mpsc::UnboundedSender<Event>,
    /// `None` until first admitted.
    session: Option<Session>,
    output: stop::Output,
    usage: Usage,
    /// Prompt positions before which a snapshot is due (chat turn boundaries), ascending.
    boundaries: Vec<usize>,
    prompt_len: usize,
}

impl Seq {
    fn session(&self) -> &Session {
        self.session.as_ref().expect("admitted")
    }
    fn decoding(&self) -> bool {
        self.output.generated() > 0
    }
    /// Whether the state after a step feeding `take` tokens (sampling the next when `samples`)
    /// is kept as a snapshot: at a multiple of the stride `every` (0: none), at a turn
    /// boundary, and at the end of the prompt when the step samples the first token. Not for a
    /// request that keeps every prompt logit (it wants them, not reuse). Decided before the
    /// step, so a row whose grammar then fails still leaves its snapshot (a valid prefix state).
    fn snapshot_due(&self, take: usize, samples: bool, every: usize) -> bool {
        let pos = self.session().position() + take;
        let first = samples && self.output.generated() == 0 && self.req.stop.max_tokens != Some(0);
        !self.req.prompt_logits && ((every > 0 && pos.is_multiple_of(every)) || self.boundaries.contains(&pos) || (pos == self.prompt_len && first))
    }
    fn send(&self, e: Event) {
        let _ = self.events.send(e);
    }
}

struct Worker<B: Backend> {
    engine: Engine<B>,
    cfg: RuntimeConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    v_eff: usize,
    rx: mpsc::Receiver<Command>,
    shared: Arc<Shared>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    sampler: Sampler,
    /// Per-row host buffers kept across ticks (a logits row is 1 MiB at Qwen3.5's vocabulary):
    /// the biased or masked copy of a sampled row, and the ids [`logprobs`] ranks.
    biased: Vec<f32>,
    ids: Vec<u32>,
    /// A tick's token events, sent together once every row is sampled: a client task waiting on
    /// its channel is woken by each send, and wakes sent back to back find a woken worker of the
    /// server's async runtime instead of waking one per row.
    outbox: Vec<(usize, Event)>,
    stats: Stats,
    stopping: bool,
    /// Start of the busy time not yet counted (host time is busy time less step time).
    busy_since: Instant,
    /// `TENSORFOLD_TICK_LOG=FILE`: one line per tick, times from the worker's start.
    tick_log: Option<(Instant, std::io::BufWriter<std::fs::File>)>,
    /// Time of this tick so far in admission, events (host) and snapshots (during the step),
    /// for the tick log.
    phases: [Duration; 3],
    /// The helper threads that prepare grammar masks during steps (started by the first
    /// constrained tick, with [`RuntimeConfig::overlap_masks`]).
    masker: Option<masks::Masker>,
}

/// What one tick ran, for the tick log.
#[derive(Clone, Copy, Default)]
struct TickRows {
    rows: usize,
    decode: usize,
    seqs: usize,
}

impl<B: Backend> Worker<B> {
    fn new(engine: Engine<B>, cfg: RuntimeConfig, tokenizer: Option<Arc<Tokenizer>>, v_eff: usize, rx: mpsc::Receiver<Command>, shared: Arc<Shared>) -> Self {
        let tick_log = std::env::var_os("TENSORFOLD_TICK_LOG").and_then(|p| match std::fs::File::create(&p) {
            Ok(f) => {
                let mut w = std::io::BufWriter::new(f);
                let _ = writeln!(w, "# tick end_us rows decode_rows seqs step_us host_us admit_us events_us snapshots_us (host: busy time since the previous tick's end less the step; of it, admission with cancels and preemption, sending events with finishing; snapshots_us: taking the step's snapshots, inside step_us; on CUDA's slot tier it overlaps the device)");
                Some((Instant::now(), w))
            }
            Err(e) => {
                eprintln!("TENSORFOLD_TICK_LOG: {}: {e}", std::path::Path::new(&p).display());
                None
            }
        });
        Self {
            engine,
            cfg,
            tokenizer,
            v_eff,
            rx,
            shared,
            waiting: VecDeque::new(),
            running: Vec::new(),
            sampler: Sampler::new(),
            biased: Vec::new(),
            ids: Vec::new(),
            outbox: Vec::new(),
            stats: Stats::default(),
            stopping: false,
            busy_since: Instant::now(),
            tick_log,
            phases: [Duration::ZERO; 3],
            masker: None,
        }
    }

    /// Counts the busy time so far as host time (published with the next tick) before the
    /// thread waits.
    fn pause(&mut self) {
        self.stats.host_time += self.busy_since.elapsed();
    }

    fn resume(&mut self) {
        self.busy_since = Instant::now();
    }

    fn run(mut self) {
        while !self.stopping {
            if self.running.is_empty() && self.waiting.is_empty() {
                self.pause();
                // Idle: after SPILL_AFTER_IDLE without a command, snapshots move out of the slot
                // tier one at a time until a command comes.
                let c = match self.rx.recv_timeout(SPILL_AFTER_IDLE) {
                    Err(mpsc::RecvTimeoutError::Timeout) => loop {
                        match self.rx.try_recv() {
                            Err(mpsc::TryRecvError::Empty) if self.engine.spill_idle() => continue,
                            Err(mpsc::TryRecvError::Empty) => break self.rx.recv(),
                            r => break r.map_err(|_| mpsc::RecvError),
                        }
                    },
                    r => r.map_err(|_| mpsc::RecvError),
                };
                self.resume();
                match c {
                    Ok(c) => self.command(c),
                    Err(_) => break,
                }
            }
            while let Ok(c) = self.rx.try_recv() {
                self.command(c);
            }
            if self.stopping {
                break;
            }
            self.tick();
        }
        if let Some((_, mut w)) = self.tick_log.take() {
            let _ = w.flush();
        }
        let sessions: Vec<Session> = self.running.drain(..).chain(self.waiting.drain(..)).filter_map(|s| s.session).collect();
        for s in sessions {
            let _ = self.engine.free_session(s);
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(p) => {
                let Pending { id, req, events } = *p;
                let rules = StopRules { eos_ids: req.stop.eos_ids.clone(), strings: req.stop.strings.clone(), max_tokens: req.stop.max_tokens };
                if !rules.strings.is_empty() && self.tokenizer.is_none() {
                    self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                    let _ = events.send(Event::Finished(Finished { reason: FinishReason::Error(SubmitError::NoTokenizer.to_string()), usage: Usage::default(), saved: None }));
                    return;
                }
                let boundaries = if self.cfg.snapshots.enabled() && !req.prompt_logits {
                    req.prompt.iter().enumerate().filter(|(p, id)| *p > 0 && self.cfg.boundary_ids.contains(id)).map(|(p, _)| p).collect()
                } else {
                    Vec::new()
                };
                let usage = Usage { prompt_tokens: req.prompt.len(), ..Usage::default() };
                let prompt_len = req.prompt.len();
                let output = stop::Output::new(rules, self.tokenizer.as_ref());
                self.waiting.push_back(Seq { id, req, events, session: None, output, usage, boundaries, prompt_len });
            }
            Command::Cancel(id) => self.cancel(id),
            Command::Shutdown => self.stopping = true,
        }
    }

    fn cancel(&mut self, id: u64) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("found");
            if s.session.is_none() {
                self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
            }
            self.finish(s, FinishReason::Cancelled);
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.finish(s, FinishReason::Cancelled);
        }
    }

    /// Ends a sequence: frees its slot, sends `Finished`.
    fn finish(&mut self, mut s: Seq, reason: FinishReason) {
        let stopped = matches!(reason, FinishReason::Eos(_) | FinishReason::StopString(_) | FinishReason::Length | FinishReason::ContextFull);
        // A cancelled sequence's state is whole too (every event sent matches it).
        let keep = stopped || reason == FinishReason::Cancelled;
        let mut saved = None;
        if let Some(session) = s.session.take() {
            if keep && s.req.return_state {
                if let Ok(state) = self.engine.export_state(&session) {
                    saved = Some(Saved { tokens: session.tokens().to_vec(), state });
                }
            }
            if stopped && self.cfg.snapshots.enabled() && !s.req.prompt_logits && session.is_resident() {
                // The conversation so far: the next turn resumes here when it renders the same ids.
                let _ = self.engine.snapshot(&session);
            }
            let _ = self.engine.free_session(session);
        }
        match &reason {
            FinishReason::Cancelled => self.stats.cancelled += 1,
            FinishReason::Error(_) => self.stats.errors += 1,
            _ => self.stats.finished += 1,
        }
        s.usage.completion_tokens = s.output.generated();
        s.send(Event::Finished(Finished { reason, usage: s.usage, saved }));
    }

    /// Admits waiting sequences while slots and the state budget allow.
    fn admit(&mut self) {
        let cfg = self.engine.model.config.clone();
        while let Some(s) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_seqs {
                break;
            }
            let need = session::state_bytes(&cfg, s.req.prompt.len().max(s.session.as_ref().map_or(0, |x| x.tokens().len())) + 1);
            if !self.running.is_empty() && self.resident_bytes() + need > self.cfg.state_budget {
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            let r = match s.session.take() {
                Some(mut session) => self.engine.swap_in(&mut session).map(|_| session),
                None => {
                    self.shared.waiting.fetch_sub(1, Ordering::SeqCst);
                    self.place(&mut s)
                }
            };
            match r {
                Ok(session) => {
                    s.session = Some(session);
                    self.running.push(s);
                }
                Err(e) => self.finish(s, FinishReason::Error(e.to_string())),
            }
        }
    }

    /// A new session for `s`, its prompt prepared (reusing what it can), `Started` sent.
    fn place(&mut self, s: &mut Seq) -> Result<Session, BackendError> {
        let mut session = match &s.req.resume {
            Some(r) => self.engine.session_from_saved(&r.tokens, &r.state, s.req.params)?,
            None => self.engine.new_session(s.req.params)?,
        };
        let r = if s.req.prompt_logits {
            // Every position fed, for its logits: no snapshot; a resumed state still counts.
            let keep = session.position;
            if keep > 0 && keep < s.req.prompt.len() && s.req.prompt.starts_with(&session.tokens[..keep]) {
                session.tokens.clear();
                session.tokens.extend_from_slice(&s.req.prompt);
                Ok(keep)
            } else {
                self.engine.reset(&mut session).map(|_| {
                    session.tokens.extend_from_slice(&s.req.prompt);
                    0
                })
            }
        } else {
            self.engine.prepare_prompt(&mut session, &s.req.prompt).map(|r| r.reused)
        };
        match r {
            Ok(reused) => {
                s.usage.cached_tokens = reused;
                s.send(Event::Started { cached_tokens: reused });
                Ok(session)
            }
            Err(e) => {
                let _ = self.engine.free_session(session);
                Err(e)
            }
        }
    }

    fn resident_bytes(&self) -> u64 {
        let c = &self.engine.model.config;
        self.running.iter().map(|s| session::state_bytes(c, s.session().tokens().len())).sum()
    }

    /// Swaps the newest sequences out while the running ones' states (after this tick) exceed
    /// the budget; they wait at the front of the queue.
    fn preempt(&mut self) {
        while self.running.len() > 1 && self.resident_bytes() > self.cfg.state_budget {
            let mut s = self.running.pop().expect("more than one");
            let session = s.session.as_mut().expect("admitted");
            match self.engine.swap_out(session) {
                Ok(()) => {
                    self.stats.preemptions += 1;
                    self.waiting.push_front(s);
                }
                Err(e) => self.finish(s, FinishReason::Error(e.to_string())),
            }
        }
    }

    fn tick(&mut self) {
        let t_admit = Instant::now();
        // Requests whose client went away.
        let gone: Vec<u64> = self.running.iter().chain(self.waiting.iter()).filter(|s| s.events.is_closed()).map(|s| s.id).collect();
        for id in gone {
            self.cancel(id);
        }
        self.admit();
        self.preempt();
        self.phases[0] += t_admit.elapsed();
        let views: Vec<scheduler::SeqView> = self
            .running
            .iter()
            .map(|s| {
                let se = s.session();
                let pos = se.position();
                let stride = if self.cfg.snapshots.enabled() && self.cfg.snapshots.every > 0 && !s.req.prompt_logits {
                    Some(self.cfg.snapshots.every - pos % self.cfg.snapshots.every)
                } else {
                    None
                };
                let boundary = s.boundaries.iter().find(|&&b| b > pos).map(|b| b - pos);
                let until = match (stride, boundary) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                scheduler::SeqView { pending: se.pending().len(), decoding: s.decoding(), until_boundary: until }
            })
            .collect();
        let take = scheduler::plan(&views, self.cfg.max_batch_tokens.min(self.engine.model.backend.max_rows()), self.cfg.chunk);
        let stepped: Vec<usize> = (0..self.running.len()).filter(|&i| take[i] > 0).collect();
        if stepped.is_empty() {
            self.publish(Duration::ZERO, TickRows::default());
            if self.waiting.is_empty() || !self.running.is_empty() {
                return;
            }
            // Nothing runs and the head of the queue cannot be admitted: wait for a command.
            self.pause();
            std::thread::sleep(Duration::from_millis(1));
            self.resume();
            return;
        }
        // Which rows sample, and how.
        let samples: Vec<bool> = stepped.iter().map(|&i| take[i] == views[i].pending).collect();
        let needs_host = stepped.iter().zip(&samples).any(|(&i, &smp)| {
            let r = &self.running[i].req;
            r.prompt_logits || (smp && (r.return_logits || r.logprobs.is_some() || !r.logit_bias.is_empty() || r.constraint.is_some()))
        });
        let sampled: Vec<usize> = stepped.iter().zip(&samples).filter(|(_, &smp)| smp).map(|(&i, _)| i).collect();
        let all_greedy = sampled.iter().all(|&i| is_plain_greedy(&self.running[i].session().params));
        let choose = if needs_host || sampled.is_empty() {
            Choose::Logits
        } else if all_greedy {
            Choose::Greedy { v_eff: self.v_eff }
        } else {
            // Only the device sampler reads the rows' settings and penalty windows: a greedy
            // tick builds none (a 64-id copy per row).
            let sampling_rows: Vec<RowSampling> = sampled
                .iter()
                .map(|&i| {
                    let se = self.running[i].session();
                    let p = se.params;
                    let h = se.tokens();
                    let n = match p.repeat_last_n {
                        0 => 0,
                        n if n < 0 => h.len(),
                        n => (n as usize).min(h.len()),
                    };
                    RowSampling { params: p, window: h[h.len() - n..].to_vec(), position: h.len() as u64 }
                })
                .collect();
            match self.engine.model.backend.set_sampling(&sampling_rows) {
                Ok(true) => Choose::Sample { v_eff: self.v_eff },
                _ => Choose::Logits,
            }
        };
        let all_logits: Vec<bool> = stepped.iter().map(|&i| self.running[i].req.prompt_logits && !self.running[i].decoding()).collect();
        if self.cfg.overlap_masks {
            // The masks of the constrained rows this step samples, computed while it runs.
            for (k, &i) in stepped.iter().enumerate() {
                let slot = &mut self.running[i].req.constraint;
                if samples[k] && slot.as_ref().is_some_and(|c| !c.is_prepared()) {
                    self.masker.get_or_insert_with(masks::Masker::new).send(i, slot);
                }
            }
        }
        let t_step = Instant::now();
        let result = {
            let mut rows: Vec<StepRows<'_>> = Vec::with_capacity(stepped.len());
            let mut k = 0;
            let snapshots = self.cfg.snapshots;
            for (i, s) in self.running.iter_mut().enumerate() {
                if take[i] == 0 {
                    continue;
                }
                let snapshot = snapshots.enabled() && s.snapshot_due(take[i], samples[k], snapshots.every);
                rows.push(StepRows { session: s.session.as_mut().expect("admitted"), take: take[i], logits: samples[k], all_logits: all_logits[k], snapshot });
                k += 1;
            }
            self.engine.step_sessions(&mut rows, choose)
        };
        let step_time = t_step.elapsed();
        let at = t_step + step_time;
        // Waiting for masks not ready yet counts as host time: the step is over.
        if let Some(m) = self.masker.as_mut().filter(|m| m.busy()) {
            for (i, c) in m.collect() {
                self.running[i].req.constraint = Some(c);
            }
        }
        let rows = TickRows { rows: stepped.iter().map(|&i| take[i]).sum(), decode: stepped.iter().filter(|&&i| views[i].decoding).count(), seqs: stepped.len() };
        match result {
            Ok(chosen) => {
                self.after_step(&stepped, &take, &samples, &all_logits, &chosen, at);
                self.engine.recycle(chosen);
            }
            Err(e) => {
                // The step's sequences end; the others go on.
                let msg = e.to_string();
                for i in stepped.into_iter().rev() {
                    let s = self.running.remove(i);
                    self.finish(s, FinishReason::Error(msg.clone()));
                }
            }
        }
        self.publish(step_time, rows);
    }

    /// Samples, applies stop rules and emits events after a step.
    fn after_step(&mut self, stepped: &[usize], take: &[usize], samples: &[bool], all_logits: &[bool], chosen: &Chosen, at: Instant) {
        let v = self.engine.model.config.vocab_size;
        let max_pos = self.engine.model.config.max_position_embeddings;
        let mut offset = 0; // logits row of the next sequence
        let mut id_index = 0;
        let mut done: Vec<(usize, FinishReason)> = Vec::new();
        let mut outbox = std::mem::take(&mut self.outbox);
        for (k, &i) in stepped.iter().enumerate() {
            let s = &mut self.running[i];
            let fed = take[i];
            if !s.decoding() {
                self.stats.prompt_tokens += fed as u64;
            }
            let rows_of_seq = if all_logits[k] { fed } else { usize::from(samples[k]) };
            if all_logits[k] {
                if let Chosen::Logits(l) = chosen {
                    s.send(Event::PromptLogits(l[offset * v..(offset + fed) * v].to_vec()));
                }
            }
            if s.req.progress && !s.decoding() {
                let se = s.session();
                s.send(Event::Progress { done: se.position(), total: s.prompt_len });
            }
            if samples[k] && s.req.stop.max_tokens == Some(0) {
                // Only the prompt was asked for (its logits, its state).
                done.push((i, FinishReason::Length));
            } else if samples[k] {
                let (id, row) = match chosen {
                    Chosen::Ids(ids) => {
                        id_index += 1;
                        (ids[id_index - 1], None)
                    }
                    Chosen::Logits(l) => {
                        let r = offset + rows_of_seq - 1;
                        let row = &l[r * v..(r + 1) * v];
                        let id = if s.req.logit_bias.is_empty() && s.req.constraint.is_none() {
                            s.session().sample(&mut self.sampler, &row[..self.v_eff])
                        } else {
                            // A copy: the row itself (reported logits, logprobs) stays raw.
                            let biased = &mut self.biased;
                            biased.clear();
                            biased.extend_from_slice(&row[..self.v_eff]);
                            for &(t, b) in &s.req.logit_bias {
                                if let Some(x) = biased.get_mut(t as usize) {
                                    *x += b;
                                }
                            }
                            if let Some(c) = s.req.constraint.as_mut() {
                                if let Err(e) = c.mask(biased) {
                                    done.push((i, FinishReason::Error(e.to_string())));
                                    offset += rows_of_seq;
                                    continue;
                                }
                            }
                            s.session().sample(&mut self.sampler, biased)
                        };
                        (id, Some(row))
                    }
                };
                let logprobs = match (s.req.logprobs, row) {
                    (Some(n), Some(row)) => Some(logprobs(&row[..self.v_eff], id, n, &mut self.ids)),
                    _ => None,
                };
                let grammar = s.req.constraint.as_mut().map_or(Ok(false), |c| c.advance(id));
                let session = s.session.as_mut().expect("admitted");
                session.push(id);
                let length = session.tokens().len();
                // The grammar's own end (EOS once its output is complete) ends the sequence even
                // where the stop rules would go on (`ignore_eos`).
                let step = if grammar == Ok(true) { s.output.end_of_sequence(id) } else { s.output.push(id, length, max_pos) };
                self.stats.generated_tokens += 1;
                outbox.push((i, Event::Token(Token { id, text: step.text, logits: if s.req.return_logits { row.map(<[f32]>::to_vec) } else { None }, logprobs, at })));
                if let Some(f) = step.finish {
                    done.push((i, f));
                } else if let Err(e) = grammar {
                    done.push((i, FinishReason::Error(e.to_string())));
                }
            }
            offset += rows_of_seq;
        }
        let t_send = Instant::now();
        for (i, e) in outbox.drain(..) {
            self.running[i].send(e);
        }
        self.outbox = outbox;
        for (i, reason) in done.into_iter().rev() {
            let s = self.running.remove(i);
            self.finish(s, reason);
        }
        self.phases[1] += t_send.elapsed();
        self.phases[2] += self.engine.snapshot_time();
    }

    /// Counts the tick (its step, and the busy time since the previous tick's count less the
    /// step as host time; so what follows here counts in the next tick) and shares the stats.
    fn publish(&mut self, step: Duration, rows: TickRows) {
        let now = Instant::now();
        let host = now.saturating_duration_since(self.busy_since).saturating_sub(step);
        self.busy_since = now;
        self.stats.ticks += 1;
        self.stats.step_time += step;
        self.stats.host_time += host;
        if let Some((origin, w)) = self.tick_log.as_mut() {
            let [admit, events, snapshots] = self.phases.map(|d| d.as_micros());
            let _ = writeln!(
                w,
                "{} {} {} {} {} {} {} {admit} {events} {snapshots}",
                self.stats.ticks,
                (now - *origin).as_micros(),
                rows.rows,
                rows.decode,
                rows.seqs,
                step.as_micros(),
                host.as_micros()
            );
        }
        self.phases = [Duration::ZERO; 3];
        self.stats.running = self.running.len();
        self.stats.prefix = self.engine.snapshots().stats();
        self.stats.snapshots = self.engine.snapshots().len();
        self.stats.snapshot_bytes = self.engine.snapshots().bytes();
        self.stats.snapshot_slot_bytes = self.engine.snapshots().slot_bytes();
        self.stats.state_bytes = self.resident_bytes();
        if let Ok(mut s) = self.shared.stats.lock() {
            *s = self.stats.clone();
        }
    }
}

/// Greedy with no penalties: the argmax of the raw row, which a device takes where the logits
/// are.
fn is_plain_greedy(p: &SamplingParams) -> bool {
    let greedy = p.temperature <= 0.0 || p.temperature.is_nan() || p.top_k == 1;
    let penalties = p.repeat_last_n != 0 && (p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0);
    greedy && !penalties
}

/// Log-softmax of `row` at `id` and at its `n` largest entries (max-subtracted, our own exp and
/// log, summed in id order). `idx` is scratch (its contents are replaced).
fn logprobs(row: &[f32], id: u32, n: usize, idx: &mut Vec<u32>) -> TokenLogprobs {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&x| crate::numerics::exp(x - m)).sum();
    let lse = m + crate::numerics::log(sum);
    let lp = |x: f32| x - lse;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        idx.clear();
        idx.extend(0..row.len() as u32);
        let k = n.min(idx.len());
        idx.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        top = idx.iter().map(|&i| (i, lp(row[i as usize]))).collect();
    }
    TokenLogprobs { logprob: row.get(id as usize).map_or(f32::NEG_INFINITY, |&x| lp(x)), top }
}

#[cfg(test)]
mod tests;
