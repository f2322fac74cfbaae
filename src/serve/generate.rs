//! What every generating endpoint shares: a checked request's [`SamplingOptions`] and prompts
//! become a [`Job`] (sampling settings over the checkpoint's defaults, stop rules, limits checked
//! against the context), the job's sequences are submitted to the runtime as [`Choice`]s, and
//! each request writes one log line ([`RequestLog`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::Response;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{ApiError, AppState};
use crate::grammar::Constraint;
use crate::runtime::{Event, FinishReason, Finished, Handle, Request, StopRules, SubmitError};
use crate::sampling::SamplingParams;
use crate::server::parse::{Delta, OutputParser, ParsedOutput};
use crate::server::SamplingOptions;

/// Most stop strings one request may give.
const MAX_STOP_STRINGS: usize = 64;

/// What an untagged field accepts, for the error when none matched (serde only says "did not
/// match any variant").
fn shape_hint(path: &str) -> Option<&'static str> {
    match path {
        "prompt" => Some("must be a string, an array of strings, an array of token ids or an array of token-id arrays"),
        "stop" => Some("must be a string or an array of strings"),
        "input" => Some("must be a string or an array of input items"),
        "tool_choice" => Some("must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}"),
        p if p.ends_with(".content") || p == "system" => Some("must be a string or an array of content parts"),
        _ => None,
    }
}

/// Parses a JSON object body into `T`; errors name the field at fault (`param`), a missing
/// field by its own path (`messages[0].role`).
pub(super) fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| ApiError { status: r.status(), message: format!("reading the request body: {}", r.body_text()), ..ApiError::invalid("", None) })?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None).with_code("invalid_json"))?;
    if !v.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    serde_path_to_error::deserialize(v).map_err(|e| {
        let mut path = e.path().to_string();
        let inner = e.inner().to_string();
        if let Some(name) = inner.strip_prefix("missing field `").and_then(|r| r.split('`').next()) {
            path = if path == "." { name.to_string() } else { format!("{path}.{name}") };
            return ApiError::invalid(format!("`{path}` is required"), Some(&path)).with_code("missing_required_parameter");
        }
        let msg = match shape_hint(&path) {
            Some(h) if inner.contains("did not match any variant") => h.to_string(),
            _ => inner,
        };
        if path == "." {
            ApiError::invalid(msg, None)
        } else {
            ApiError::invalid(format!("`{path}`: {msg}"), Some(&path)).with_code("invalid_type")
        }
    })
}

/// Refuses a model name other than the one served.
pub(super) fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !st.config.serves(m) => {
            Err(ApiError::invalid(format!("the model `{m}` is not served here; this server serves `{}` (GET /v1/models)", st.config.model_id), Some("model"))
                .with_code("model_not_found"))
        }
        _ => Ok(()),
    }
}

/// The names of the request's fields that errors about the prompt and the length name.
#[derive(Clone, Copy)]
pub(super) struct Fields {
    /// `messages`, `prompt`, `input`.
    pub prompt: &'static str,
    /// `max_tokens`, `max_completion_tokens`, `max_output_tokens`.
    pub max_tokens: &'static str,
}

/// A checked generation: the sequences to submit.
pub(super) struct Job {
    /// Each prompt's ids; each is generated `n` times.
    pub prompts: Vec<Vec<u32>>,
    pub n: usize,
    pub params: SamplingParams,
    pub eos_ids: Vec<u32>,
    pub stop: Vec<String>,
    /// Most tokens per choice; `None`: up to the context.
    pub max_tokens: Option<usize>,
    pub logprobs: Option<usize>,
    pub logit_bias: Vec<(u32, f32)>,
    /// The output's grammar (a forced tool call, a JSON format); each choice gets a clone.
    pub constraint: Option<Constraint>,
}

/// Checks a request's sampling settings and prompts against the server's limits and the
/// context, and fills in what it left out: the checkpoint's sampling defaults, and a fresh seed
/// when none is given (so repeated requests differ, as OpenAI's do; a given seed repeats).
pub(super) fn job(st: &AppState, s: &SamplingOptions, prompts: Vec<Vec<u32>>, fields: Fields) -> Result<Job, ApiError> {
    let cfg = &st.config;
    let mut p = cfg.defaults;
    let f32_of = |x: f64| x as f32;
    if let Some(t) = s.temperature {
        p.temperature = f32_of(t);
    }
    if let Some(x) = s.top_p {
        p.top_p = f32_of(x);
    }
    if let Some(x) = s.min_p {
        p.min_p = f32_of(x);
    }
    if let Some(x) = s.top_k {
        p.top_k = x as usize;
    }
    if let Some(x) = s.repetition_penalty {
        p.repetition_penalty = f32_of(x);
    }
    if let Some(x) = s.presence_penalty {
        p.presence_penalty = f32_of(x);
    }
    if let Some(x) = s.frequency_penalty {
        p.frequency_penalty = f32_of(x);
    }
    if let Some(x) = s.repeat_last_n {
        p.repeat_last_n = x;
    }
    p.seed = match s.seed {
        Some(seed) => seed,
        None => st.fresh().1,
    };
    if let Err(e) = p.validate() {
        return Err(ApiError::invalid(format!("sampling settings: {e}"), None));
    }
    let n = s.n as usize;
    if n == 0 || n > cfg.max_n {
        return Err(ApiError::invalid(format!("`n` = {n} is invalid: it must be between 1 and {} (the server's limit)", cfg.max_n), Some("n")));
    }
    if s.stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(format!("`stop` holds {} strings; at most {MAX_STOP_STRINGS} are accepted", s.stop.len()), Some("stop")));
    }
    let v_eff = st.runtime.info().v_eff;
    if let Some(&(id, _)) = s.logit_bias.iter().find(|(id, _)| *id as usize >= v_eff) {
        return Err(ApiError::invalid(format!("`logit_bias` token id {id} is outside the vocabulary ({v_eff} ids)"), Some(&format!("logit_bias.{id}"))));
    }
    if prompts.is_empty() {
        return Err(ApiError::invalid(format!("`{}` holds no prompt", fields.prompt), Some(fields.prompt)));
    }
    if prompts.len() * n > cfg.max_n {
        return Err(ApiError::invalid(
            format!("{} prompts times n = {n} make {} sequences; the server's limit is {}", prompts.len(), prompts.len() * n, cfg.max_n),
            Some(fields.prompt),
        ));
    }
    let max_tokens = s.max_tokens.map(|m| m as usize);
    let max_len = cfg.max_model_len;
    for prompt in &prompts {
        if prompt.is_empty() {
            return Err(ApiError::invalid(format!("`{}` encodes to no tokens", fields.prompt), Some(fields.prompt)));
        }
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= v_eff) {
            return Err(ApiError::invalid(format!("`{}` token id {id} is outside the vocabulary ({v_eff} ids)", fields.prompt), Some(fields.prompt)));
        }
        if prompt.len() >= max_len {
            return Err(ApiError::invalid(
                format!("this model's maximum context length is {max_len} tokens, and the prompt holds {} tokens, which leaves no room to generate", prompt.len()),
                Some(fields.prompt),
            )
            .with_code("context_length_exceeded"));
        }
        if let Some(m) = max_tokens {
            if prompt.len().saturating_add(m) > max_len {
                return Err(ApiError::invalid(
                    format!(
                        "this model's maximum context length is {max_len} tokens, but the request asks for {} ({} in the prompt, {m} in the completion: `{}`)",
                        prompt.len().saturating_add(m),
                        prompt.len(),
                        fields.max_tokens
                    ),
                    Some(fields.max_tokens),
                )
                .with_code("context_length_exceeded"));
            }
        }
    }
    let eos_ids = if s.ignore_eos { Vec::new() } else { st.tokenizer.eos_ids().to_vec() };
    Ok(Job { prompts, n, params: p, eos_ids, stop: s.stop.clone(), max_tokens, logprobs: s.logprobs.map(|k| k as usize), logit_bias: s.logit_bias.clone(), constraint: None })
}

/// A runtime refusal as an HTTP error.
pub(super) fn submit_error(st: &AppState, e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(_) => {
            st.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            ApiError::unavailable(format!("the server is busy: {e} (--max-waiting {})", st.runtime.config().max_waiting), "queue_full")
        }
        SubmitError::Stopped => ApiError::unavailable("the server is shutting down", "shutting_down"),
        SubmitError::PromptTooLong { .. } | SubmitError::OverBudget { .. } => ApiError::invalid(e.to_string(), Some("prompt")).with_code("context_length_exceeded"),
        SubmitError::EmptyPrompt | SubmitError::TokenId { .. } => ApiError::invalid(e.to_string(), Some("prompt")),
        SubmitError::NoTokenizer | SubmitError::BadResume => ApiError::internal(e.to_string()),
    }
}

/// One choice in flight: its runtime handle, and what its events feed into the metrics.
/// Dropped before its `Finished` (the client went away): the handle's drop cancels the
/// sequence, counted as aborted here.
pub(super) struct Choice {
    pub index: usize,
    /// Which of its prompt's `n` it is.
    pub nth: usize,
    handle: Handle,
    st: Arc<AppState>,
    start: Instant,
    prompt_len: usize,
    pub first: Option<Instant>,
    last: Option<Instant>,
    generated: usize,
    pub done: bool,
}

impl Choice {
    /// The next event, after counting it.
    pub async fn next(&mut self) -> Option<Event> {
        let e = self.handle.next().await;
        let m = &self.st.metrics;
        match &e {
            Some(Event::Started { cached_tokens }) => {
                m.prefix_queries.fetch_add(self.prompt_len as u64, Ordering::Relaxed);
                m.prefix_hits.fetch_add(*cached_tokens as u64, Ordering::Relaxed);
            }
            Some(Event::Token(_)) => {
                let now = Instant::now();
                match self.last {
                    None => {
                        m.ttft.observe((now - self.start).as_secs_f64());
                        self.first = Some(now);
                    }
                    Some(l) => m.itl.observe((now - l).as_secs_f64()),
                }
                self.last = Some(now);
                self.generated += 1;
            }
            Some(Event::Finished(f)) => {
                self.done = true;
                m.finished(&f.reason, f.usage.prompt_tokens, f.usage.completion_tokens);
                m.e2e.observe(self.start.elapsed().as_secs_f64());
            }
            None => {}
            Some(_) => {}
        }
        e
    }
}

impl Drop for Choice {
    fn drop(&mut self) {
        if !self.done {
            self.st.metrics.finished(&FinishReason::Cancelled, self.prompt_len, self.generated);
        }
    }
}

/// Submits every choice of `job` (seeds `seed`, `seed + 1`, … for the `n` of a prompt).
pub(super) fn submit(st: &Arc<AppState>, job: &Job, start: Instant) -> Result<Vec<Choice>, ApiError> {
    if st.draining.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down", "shutting_down"));
    }
    let mut out = Vec::with_capacity(job.prompts.len() * job.n);
    for prompt in &job.prompts {
        for j in 0..job.n {
            let mut params = job.params;
            params.seed = params.seed.wrapping_add(j as u64);
            let max_tokens = job.max_tokens.unwrap_or(st.config.max_model_len - prompt.len());
            let mut req = Request::new(prompt.clone(), params, StopRules { eos_ids: job.eos_ids.clone(), strings: job.stop.clone(), max_tokens: Some(max_tokens) });
            req.logprobs = job.logprobs;
            req.logit_bias = job.logit_bias.clone();
            req.constraint = job.constraint.clone();
            // An error drops the handles made so far, which cancels them.
            let handle = st.runtime.submit(req).map_err(|e| submit_error(st, e))?;
            out.push(Choice { index: out.len(), nth: j, handle, st: st.clone(), start, prompt_len: prompt.len(), first: None, last: None, generated: 0, done: false });
        }
    }
    Ok(out)
}

/// A choice's text parsed as it comes: reasoning, content and tool calls.
pub(super) struct Parsed {
    pub parser: OutputParser,
    pub whole: ParsedOutput,
}

impl Parsed {
    pub fn new(parser: OutputParser) -> Self {
        Self { parser, whole: ParsedOutput::default() }
    }

    /// Feeds generated text; returns the deltas that became certain (also added to `whole`).
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let d = self.parser.push(text);
        d.iter().for_each(|d| self.whole.apply(d));
        d
    }

    /// Ends the text as `reason` ended generation; returns what was held back.
    pub fn finish(&mut self, reason: &FinishReason) -> Vec<Delta> {
        let d = self.parser.finish(reason.cut());
        d.iter().for_each(|d| self.whole.apply(d));
        d
    }
}

/// How a chat turn ended, in the terms every API maps from: a natural end, a stop string, the
/// length limit, or tool calls (a natural end after the model called tools).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum TurnEnd {
    Stop,
    StopString(String),
    Length,
    ToolCalls,
}

impl TurnEnd {
    /// The end of a turn that `f` finished, having made `calls` tool calls; `None` for a
    /// cancelled or failed one.
    pub fn of(f: &Finished, calls: usize) -> Option<Self> {
        let natural = |e| if calls > 0 { Self::ToolCalls } else { e };
        match &f.reason {
            FinishReason::Eos(_) => Some(natural(Self::Stop)),
            FinishReason::StopString(s) => Some(natural(Self::StopString(s.clone()))),
            FinishReason::Cancelled | FinishReason::Error(_) => None,
            _ => Some(Self::Length),
        }
    }
}

/// The one log line of a request, written when it is dropped (answered, streamed to the end,
/// or abandoned by its client).
pub(super) struct RequestLog {
    pub id: String,
    endpoint: &'static str,
    pub start: Instant,
    pub status: u16,
    pub outcome: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub ttft: Option<Duration>,
}

impl RequestLog {
    pub fn new(id: String, endpoint: &'static str, start: Instant) -> Self {
        // Until an answer or the stream's end says otherwise, the client went away: 499, as
        // nginx logs a request its client closed.
        Self { id, endpoint, start, status: 499, outcome: "cancelled: the client went away".into(), prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0, ttft: None }
    }

    /// Records the error and answers with it, in the error shape of `flavor`.
    pub fn fail(mut self, st: &AppState, e: ApiError) -> Response {
        self.status = e.status.as_u16();
        self.outcome = e.message.clone();
        st.metrics.errors.fetch_add(1, Ordering::Relaxed);
        axum::response::IntoResponse::into_response(e)
    }

    /// Records a whole answer sent.
    pub fn answered(&mut self, outcome: String) {
        self.status = 200;
        self.outcome = outcome;
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
        tracing::info!(
            target: "tensorfold::serve",
            id = %self.id,
            endpoint = self.endpoint,
            status = self.status,
            prompt_tokens = self.prompt_tokens,
            cached_tokens = self.cached_tokens,
            completion_tokens = self.completion_tokens,
            ttft_ms = self.ttft.map(ms),
            duration_ms = ms(self.start.elapsed()),
            "{}",
            self.outcome
        );
    }
}

/// Runs one choice to its end, feeding its text through `parsed` (when given) and collecting
/// the logprobs; for the whole (non-streamed) answers.
pub(super) async fn collect(mut c: Choice, mut parsed: Option<Parsed>) -> Collected {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(e) = c.next().await {
        match e {
            Event::Token(t) => {
                if let Some(p) = parsed.as_mut() {
                    p.push(&t.text);
                }
                text.push_str(&t.text);
                if let Some(l) = t.logprobs {
                    tokens.push((t.id, l));
                }
            }
            Event::Finished(f) => {
                if let Some(p) = parsed.as_mut() {
                    p.finish(&f.reason);
                }
                return Collected { choice: c, text, tokens, parsed: parsed.map(|p| p.whole), finished: Some(f) };
            }
            _ => {}
        }
    }
    Collected { choice: c, text, tokens, parsed: parsed.map(|p| p.whole), finished: None }
}

/// A choice run to its end.
pub(super) struct Collected {
    pub choice: Choice,
    pub text: String,
    pub tokens: Vec<(u32, crate::runtime::TokenLogprobs)>,
    pub parsed: Option<ParsedOutput>,
    /// `None`: the runtime stopped first.
    pub finished: Option<Finished>,
}

impl Collected {
    /// The finish, or the error to answer with when the choice did not end normally.
    pub fn outcome(&self) -> Result<&Finished, ApiError> {
        match &self.finished {
            None => Err(ApiError::unavailable("the runtime stopped before the request finished", "shutting_down")),
            Some(Finished { reason: FinishReason::Error(e), .. }) => Err(ApiError::internal(format!("generation failed: {e}"))),
            Some(Finished { reason: FinishReason::Cancelled, .. }) => Err(ApiError::unavailable("the request was cancelled by the server", "cancelled")),
            Some(f) => Ok(f),
        }
    }
}

/// An API's events for one chat turn (Responses, Anthropic Messages): fed the turn's parsed
/// deltas, it keeps the response built so far and queues the SSE events that say so. The whole
/// (non-streamed) answer is the same state at the end, so both forms agree.
pub(super) trait Turn: Send + 'static {
    /// The sequence was admitted; `cached_tokens` of its prompt came from the prefix cache.
    fn started(&mut self, cached_tokens: usize);
    /// More of the parsed output.
    fn deltas(&mut self, deltas: &[Delta]);
    /// The turn ended normally.
    fn finished(&mut self, f: &Finished, end: &TurnEnd);
    /// The turn failed (an error event in a stream).
    fn failed(&mut self, e: &ApiError);
    /// The events queued since the last call.
    fn take_events(&mut self) -> Vec<axum::response::sse::Event>;
}

/// Runs one choice through `turn` to its end (a whole answer); the error of an abnormal end.
pub(super) async fn run_turn<T: Turn>(mut c: Choice, mut parsed: Parsed, turn: &mut T, log: &mut RequestLog) -> Result<Finished, ApiError> {
    while let Some(e) = c.next().await {
        match e {
            Event::Started { cached_tokens } => {
                log.cached_tokens = cached_tokens;
                turn.started(cached_tokens);
            }
            Event::Token(t) => {
                if log.ttft.is_none() {
                    log.ttft = Some(log.start.elapsed());
                }
                turn.deltas(&parsed.push(&t.text));
            }
            Event::Finished(f) => {
                turn.deltas(&parsed.finish(&f.reason));
                let collected = Collected { choice: c, text: String::new(), tokens: Vec::new(), parsed: None, finished: Some(f) };
                let f = collected.outcome()?.clone();
                let end = TurnEnd::of(&f, parsed.whole.tool_calls.len()).unwrap_or(TurnEnd::Stop);
                log.completion_tokens = f.usage.completion_tokens;
                turn.finished(&f, &end);
                return Ok(f);
            }
            _ => {}
        }
    }
    Err(ApiError::unavailable("the runtime stopped before the request finished", "shutting_down"))
}

/// Streams one choice through `turn` as SSE, keep-alive comments while nothing comes. The body
/// dropped (the client went away) drops the choice, which cancels it.
pub(super) fn stream_turn<T: Turn>(c: Choice, parsed: Parsed, mut turn: T, log: RequestLog, keep_alive: Duration) -> Response {
    use axum::response::sse::{KeepAlive, Sse};
    use futures_util::stream;
    use std::collections::VecDeque;
    struct S<T> {
        c: Choice,
        parsed: Parsed,
        turn: T,
        log: RequestLog,
        out: VecDeque<axum::response::sse::Event>,
        ended: bool,
    }
    let out = turn.take_events().into();
    let s = S { c, parsed, turn, log, out, ended: false };
    let body = stream::unfold(s, |mut s| async move {
        loop {
            if let Some(e) = s.out.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(e), s));
            }
            if s.ended {
                return None;
            }
            match s.c.next().await {
                Some(Event::Started { cached_tokens }) => {
                    s.log.cached_tokens = cached_tokens;
                    s.turn.started(cached_tokens);
                }
                Some(Event::Token(t)) => {
                    if s.log.ttft.is_none() {
                        s.log.ttft = Some(s.log.start.elapsed());
                    }
                    let d = s.parsed.push(&t.text);
                    s.turn.deltas(&d);
                }
                Some(Event::Finished(f)) => {
                    let d = s.parsed.finish(&f.reason);
                    s.turn.deltas(&d);
                    s.ended = true;
                    s.log.completion_tokens = f.usage.completion_tokens;
                    match TurnEnd::of(&f, s.parsed.whole.tool_calls.len()) {
                        Some(end) => {
                            s.turn.finished(&f, &end);
                            s.log.answered(format!("finished: {end:?}"));
                        }
                        None => {
                            let e = ApiError::internal(format!("generation ended: {:?}", f.reason));
                            s.log.status = e.status.as_u16();
                            s.log.outcome = e.message.clone();
                            s.turn.failed(&e);
                        }
                    }
                }
                Some(_) => {}
                None => {
                    s.ended = true;
                    let e = ApiError::unavailable("the runtime stopped before the request finished", "shutting_down");
                    s.log.status = 503;
                    s.turn.failed(&e);
                }
            }
            s.out.extend(s.turn.take_events());
        }
    });
    axum::response::IntoResponse::into_response(Sse::new(body).keep_alive(KeepAlive::new().interval(keep_alive).text("keep-alive")))
}
