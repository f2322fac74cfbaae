//! The OpenAI endpoints: request bodies (minimal serde types of their own: what this server
//! implements), their checks, the runtime requests they become, and the responses (one JSON
//! body, or SSE chunks).
//!
//! Content is the raw generated text: no tool-call parsing, no reasoning split.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{unix_now, ApiError, AppState};
use crate::runtime::{Event, FinishReason, Finished, Handle, Request, StopRules, SubmitError, TokenLogprobs};
use crate::sampling::SamplingParams;

/// Most entries of `top_logprobs` (OpenAI's limit).
const MAX_TOP_LOGPROBS: u64 = 20;
/// Most stop strings one request may give.
const MAX_STOP_STRINGS: usize = 64;

/// The body of `/v1/chat/completions` and `/v1/completions` (the fields this server reads;
/// others are ignored, as OpenAI clients send many).
#[derive(Deserialize, Debug, Default)]
pub struct GenerateBody {
    pub model: Option<String>,
    /// Chat: the conversation, passed to the chat template as given (role/content objects).
    pub messages: Option<Vec<Value>>,
    /// Completions: the prompt.
    pub prompt: Option<PromptInput>,
    /// Extra chat template variables (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// vLLM's extension: end the rendered chat with the assistant's opening (default true).
    pub add_generation_prompt: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// llama.cpp's extension: the penalties' window in tokens (-1: everything).
    pub repeat_last_n: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    pub n: Option<u64>,
    /// Chat: a boolean (with `top_logprobs`); completions: the number of top entries.
    pub logprobs: Option<LogprobsInput>,
    pub top_logprobs: Option<u64>,
    pub logit_bias: Option<Map<String, Value>>,
    pub ignore_eos: Option<bool>,
    pub echo: Option<bool>,
}

/// `stream_options`.
#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// A completion prompt: text, texts, token ids, or lists of token ids.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// `logprobs`: a boolean (chat) or a count (completions).
#[derive(Deserialize, Debug, Clone, Copy)]
#[serde(untagged)]
pub enum LogprobsInput {
    Bool(bool),
    Count(u64),
}

/// `/tokenize`'s body (vLLM's shape).
#[derive(Deserialize, Debug, Default)]
pub struct TokenizeBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub add_special_tokens: Option<bool>,
    pub messages: Option<Vec<Value>>,
    pub add_generation_prompt: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// `/detokenize`'s body.
#[derive(Deserialize, Debug, Default)]
pub struct DetokenizeBody {
    pub model: Option<String>,
    pub tokens: Option<Vec<u32>>,
}

/// What an untagged field accepts, for the error when none matched (serde only says "did not
/// match any variant").
fn shape_hint(path: &str) -> Option<&'static str> {
    match path {
        "prompt" => Some("must be a string, an array of strings, an array of token ids or an array of token-id arrays"),
        "stop" => Some("must be a string or an array of strings"),
        "logprobs" => Some("must be a boolean (chat) or a non-negative integer (completions)"),
        _ => None,
    }
}

/// Parses a JSON object body into `T`; errors name the field at fault (`param`).
fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| ApiError { status: r.status(), message: format!("reading the request body: {}", r.body_text()), ..ApiError::invalid("", None) })?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None).with_code("invalid_json"))?;
    if !v.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.inner().to_string();
        let msg = match shape_hint(&path) {
            Some(h) if inner.contains("did not match any variant") => h.to_string(),
            _ => inner,
        };
        if path == "." {
            ApiError::invalid(msg, None)
        } else {
            ApiError::invalid(format!("`{path}`: {msg}"), Some(&path))
        }
    })
}

/// Which endpoint a generation came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Completion => "completion",
        }
    }
}

/// A checked generation request: what to submit, and how to answer.
struct Plan {
    prompts: Vec<Vec<u32>>,
    n: usize,
    params: SamplingParams,
    eos_ids: Vec<u32>,
    stop: Vec<String>,
    max_tokens: Option<usize>,
    logprobs: Option<usize>,
    logit_bias: Vec<(u32, f32)>,
    stream: bool,
    include_usage: bool,
}

fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.config.model_id => {
            Err(ApiError::invalid(format!("the model `{m}` is not served here; this server serves `{}` (GET /v1/models)", st.config.model_id), Some("model"))
                .with_code("model_not_found"))
        }
        _ => Ok(()),
    }
}

/// Renders `messages` with the model's chat template and encodes them.
fn render_chat(st: &AppState, messages: Option<&[Value]>, add_generation_prompt: bool, kwargs: Option<&Map<String, Value>>) -> Result<Vec<u32>, ApiError> {
    let Some(messages) = messages else {
        return Err(ApiError::invalid("`messages` is required", Some("messages")));
    };
    if messages.is_empty() {
        return Err(ApiError::invalid("`messages` must hold at least one message", Some("messages")));
    }
    for (i, m) in messages.iter().enumerate() {
        let Some(o) = m.as_object() else {
            return Err(ApiError::invalid(format!("`messages[{i}]` must be an object with `role` and `content`"), Some(&format!("messages[{i}]"))));
        };
        if !o.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(format!("`messages[{i}].role` must be a string"), Some(&format!("messages[{i}].role"))));
        }
        if !matches!(o.get("content"), None | Some(Value::Null | Value::String(_) | Value::Array(_))) {
            return Err(ApiError::invalid(format!("`messages[{i}].content` must be a string, an array of content parts, or null"), Some(&format!("messages[{i}].content"))));
        }
    }
    let Some(template) = st.tokenizer.chat_template() else {
        return Err(ApiError::invalid("the model has no chat template; use /v1/completions", Some("messages")));
    };
    let empty = Map::new();
    let text = template
        .render_json(messages, add_generation_prompt, kwargs.unwrap_or(&empty))
        .map_err(|e| ApiError::invalid(format!("the chat template could not render `messages`: {e}"), Some("messages")))?;
    // Templates write their own special tokens, so none are added (as transformers does).
    st.tokenizer.encode_with(&text, false).map_err(|e| ApiError::internal(format!("encoding the rendered prompt: {e}")))
}

fn encode_text(st: &AppState, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
    st.tokenizer.encode_with(text, add_special).map_err(|e| ApiError::invalid(format!("`prompt` could not be encoded: {e}"), Some("prompt")))
}

/// A range check naming the field.
fn check_f32(name: &str, v: Option<f32>, ok: impl Fn(f32) -> bool, requirement: &str) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !ok(x) => Err(ApiError::invalid(format!("`{name}` = {x} is invalid: it must be {requirement}"), Some(name))),
        v => Ok(v),
    }
}

/// Checks `b` and turns it into a [`Plan`].
fn plan(st: &AppState, b: &GenerateBody, kind: Kind) -> Result<Plan, ApiError> {
    let cfg = &st.config;
    check_model(st, b.model.as_deref())?;
    let prompt_field = match kind {
        Kind::Chat => "messages",
        Kind::Completion => "prompt",
    };
    // Sampling: the checkpoint's defaults, each field given over them.
    let mut p = cfg.defaults;
    if let Some(t) = check_f32("temperature", b.temperature, |x| x.is_finite() && x >= 0.0, "a finite number >= 0")? {
        p.temperature = t;
    }
    if let Some(x) = check_f32("top_p", b.top_p, |x| x > 0.0 && x <= 1.0, "in (0, 1]")? {
        p.top_p = x;
    }
    if let Some(x) = check_f32("min_p", b.min_p, |x| (0.0..=1.0).contains(&x), "in [0, 1]")? {
        p.min_p = x;
    }
    if let Some(x) = check_f32("repetition_penalty", b.repetition_penalty, |x| x.is_finite() && x > 0.0, "a finite number > 0")? {
        p.repetition_penalty = x;
    }
    if let Some(x) = check_f32("presence_penalty", b.presence_penalty, f32::is_finite, "finite")? {
        p.presence_penalty = x;
    }
    if let Some(x) = check_f32("frequency_penalty", b.frequency_penalty, f32::is_finite, "finite")? {
        p.frequency_penalty = x;
    }
    match b.top_k {
        // vLLM spells "off" -1, llama.cpp 0.
        Some(-1 | 0) => p.top_k = 0,
        Some(k) if k > 0 => p.top_k = k as usize,
        Some(k) => return Err(ApiError::invalid(format!("`top_k` = {k} is invalid: it must be -1 or 0 (off) or a positive count"), Some("top_k"))),
        None => {}
    }
    match b.repeat_last_n {
        Some(n) if n < -1 => {
            return Err(ApiError::invalid(format!("`repeat_last_n` = {n} is invalid: it must be -1 (everything), 0 (off) or a positive count"), Some("repeat_last_n")))
        }
        Some(n) => p.repeat_last_n = n,
        None => {}
    }
    // No seed: a fresh one, so repeated requests sample differently (as OpenAI); a seed repeats.
    p.seed = match b.seed {
        Some(s) => s as u64,
        None => st.fresh().1,
    };
    if let Err(e) = p.validate() {
        return Err(ApiError::invalid(format!("sampling settings: {e}"), None));
    }

    let n = b.n.unwrap_or(1);
    if n == 0 || n > cfg.max_n as u64 {
        return Err(ApiError::invalid(format!("`n` = {n} is invalid: it must be between 1 and {} (the server's limit)", cfg.max_n), Some("n")));
    }
    let (max_tokens, max_field) = match (b.max_completion_tokens, b.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    if max_tokens == Some(0) {
        return Err(ApiError::invalid(format!("`{max_field}` must be at least 1"), Some(max_field)));
    }
    let max_tokens = max_tokens.map(|m| usize::try_from(m).unwrap_or(usize::MAX));

    let stop = match &b.stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s.clone()],
        Some(StopInput::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(format!("`stop` holds {} strings; at most {MAX_STOP_STRINGS} are accepted", stop.len()), Some("stop")));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid(format!("`stop[{i}]` is empty; a stop string needs at least one character"), Some("stop")));
    }

    let logprobs = match (kind, b.logprobs, b.top_logprobs) {
        (_, _, Some(k)) if k > MAX_TOP_LOGPROBS => return Err(ApiError::invalid(format!("`top_logprobs` = {k} is invalid: at most {MAX_TOP_LOGPROBS}"), Some("top_logprobs"))),
        (Kind::Chat, Some(LogprobsInput::Bool(true)), k) => Some(k.unwrap_or(0) as usize),
        (Kind::Chat, None | Some(LogprobsInput::Bool(false)), Some(_)) => return Err(ApiError::invalid("`top_logprobs` needs `logprobs: true`", Some("top_logprobs"))),
        (Kind::Chat, None | Some(LogprobsInput::Bool(false)), None) => None,
        (Kind::Chat, Some(LogprobsInput::Count(_)), _) => {
            return Err(ApiError::invalid("`logprobs` must be a boolean for chat completions (the count goes in `top_logprobs`)", Some("logprobs")))
        }
        (Kind::Completion, Some(LogprobsInput::Count(k)), _) if k > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(format!("`logprobs` = {k} is invalid: at most {MAX_TOP_LOGPROBS}"), Some("logprobs")))
        }
        (Kind::Completion, Some(LogprobsInput::Count(k)), _) => Some(k as usize),
        (Kind::Completion, Some(LogprobsInput::Bool(_)), _) => {
            return Err(ApiError::invalid("`logprobs` must be an integer for completions (how many top entries)", Some("logprobs")))
        }
        (Kind::Completion, None, _) => None,
    };

    let v_eff = st.runtime.info().v_eff;
    let mut logit_bias = Vec::new();
    for (k, v) in b.logit_bias.iter().flatten() {
        let param = format!("logit_bias.{k}");
        let id: u32 = k.parse().map_err(|_| ApiError::invalid(format!("`logit_bias` key `{k}` is not a token id"), Some(&param)))?;
        if id as usize >= v_eff {
            return Err(ApiError::invalid(format!("`logit_bias` token id {id} is outside the vocabulary ({v_eff} ids)"), Some(&param)));
        }
        let bias = match v.as_f64() {
            Some(x) if (-100.0..=100.0).contains(&x) => x as f32,
            _ => return Err(ApiError::invalid(format!("`logit_bias.{k}` must be a number in [-100, 100]"), Some(&param))),
        };
        logit_bias.push((id, bias));
    }
    if b.echo == Some(true) {
        return Err(ApiError::invalid("`echo` is not supported", Some("echo")));
    }

    let prompts = match kind {
        Kind::Chat => vec![render_chat(st, b.messages.as_deref(), b.add_generation_prompt.unwrap_or(true), b.chat_template_kwargs.as_ref())?],
        Kind::Completion => match &b.prompt {
            None => return Err(ApiError::invalid("`prompt` is required", Some("prompt"))),
            Some(PromptInput::Text(t)) => vec![encode_text(st, t, true)?],
            Some(PromptInput::Texts(ts)) => ts.iter().map(|t| encode_text(st, t, true)).collect::<Result<_, _>>()?,
            Some(PromptInput::Ids(ids)) => vec![ids.clone()],
            Some(PromptInput::IdLists(l)) => l.clone(),
        },
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("`prompt` holds no prompt", Some("prompt")));
    }
    if prompts.len() * n as usize > cfg.max_n {
        return Err(ApiError::invalid(
            format!("{} prompts times n = {n} make {} sequences; the server's limit is {}", prompts.len(), prompts.len() * n as usize, cfg.max_n),
            Some("prompt"),
        ));
    }
    let max_len = cfg.max_model_len;
    for p in &prompts {
        if p.is_empty() {
            return Err(ApiError::invalid(format!("`{prompt_field}` encodes to no tokens"), Some(prompt_field)));
        }
        if let Some(&id) = p.iter().find(|&&id| id as usize >= v_eff) {
            return Err(ApiError::invalid(format!("`prompt` token id {id} is outside the vocabulary ({v_eff} ids)"), Some("prompt")));
        }
        if p.len() >= max_len {
            return Err(ApiError::invalid(
                format!("this model's maximum context length is {max_len} tokens, and the prompt holds {} tokens, which leaves no room to generate", p.len()),
                Some(prompt_field),
            )
            .with_code("context_length_exceeded"));
        }
        if let Some(m) = max_tokens {
            if p.len().saturating_add(m) > max_len {
                return Err(ApiError::invalid(
                    format!(
                        "this model's maximum context length is {max_len} tokens, but the request asks for {} ({} in the prompt, {m} in the completion: `{max_field}`)",
                        p.len().saturating_add(m),
                        p.len()
                    ),
                    Some(max_field),
                )
                .with_code("context_length_exceeded"));
            }
        }
    }
    let stream = b.stream.unwrap_or(false);
    let include_usage = stream && b.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    let eos_ids = if b.ignore_eos.unwrap_or(false) { Vec::new() } else { st.tokenizer.eos_ids().to_vec() };
    Ok(Plan { prompts, n: n as usize, params: p, eos_ids, stop, max_tokens, logprobs, logit_bias, stream, include_usage })
}

/// A runtime refusal as an HTTP error.
fn submit_error(st: &AppState, e: SubmitError) -> ApiError {
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
struct Choice {
    index: usize,
    /// Which of its prompt's `n` it is.
    nth: usize,
    handle: Handle,
    st: Arc<AppState>,
    start: Instant,
    prompt_len: usize,
    first: Option<Instant>,
    last: Option<Instant>,
    generated: usize,
    done: bool,
}

impl Choice {
    /// The next event, after counting it.
    async fn next(&mut self) -> Option<Event> {
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

/// Submits every choice of `plan` (seeds `seed`, `seed + 1`, … for the `n` of a prompt).
fn submit(st: &Arc<AppState>, plan: &Plan, start: Instant) -> Result<Vec<Choice>, ApiError> {
    if st.draining.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down", "shutting_down"));
    }
    let mut out = Vec::with_capacity(plan.prompts.len() * plan.n);
    for prompt in &plan.prompts {
        for j in 0..plan.n {
            let mut params = plan.params;
            params.seed = params.seed.wrapping_add(j as u64);
            let max_tokens = plan.max_tokens.unwrap_or(st.config.max_model_len - prompt.len());
            let mut req = Request::new(prompt.clone(), params, StopRules { eos_ids: plan.eos_ids.clone(), strings: plan.stop.clone(), max_tokens: Some(max_tokens) });
            req.logprobs = plan.logprobs;
            req.logit_bias = plan.logit_bias.clone();
            // An error drops the handles made so far, which cancels them.
            let handle = st.runtime.submit(req).map_err(|e| submit_error(st, e))?;
            out.push(Choice { index: out.len(), nth: j, handle, st: st.clone(), start, prompt_len: prompt.len(), first: None, last: None, generated: 0, done: false });
        }
    }
    Ok(out)
}

/// The one log line of a request, written when it is dropped (answered, streamed to the end,
/// or abandoned by its client).
struct RequestLog {
    id: String,
    endpoint: &'static str,
    start: Instant,
    status: u16,
    outcome: String,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    ttft: Option<Duration>,
}

impl RequestLog {
    fn new(id: String, endpoint: &'static str, start: Instant) -> Self {
        Self { id, endpoint, start, status: 200, outcome: "cancelled".into(), prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0, ttft: None }
    }

    /// Records the error and answers with it.
    fn fail(mut self, st: &AppState, e: ApiError) -> Response {
        self.status = e.status.as_u16();
        self.outcome = e.message.clone();
        st.metrics.errors.fetch_add(1, Ordering::Relaxed);
        e.into_response()
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

/// What the response's envelope holds in common.
#[derive(Clone)]
struct Ctx {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    include_usage: bool,
    logprobs: bool,
    st: Arc<AppState>,
}

impl Ctx {
    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint, "choices": choices})
    }

    /// The text of one token, for logprobs.
    fn token_text(&self, id: u32) -> String {
        self.st.tokenizer.decode(&[id]).unwrap_or_default()
    }

    /// Logprobs of `tokens`, `offset` the text offset of the first (completions' `text_offset`).
    fn logprobs(&self, tokens: &[(u32, TokenLogprobs)], mut offset: usize) -> Value {
        match self.kind {
            Kind::Chat => {
                let entry = |id: u32, lp: f32| {
                    let t = self.token_text(id);
                    json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
                };
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|(id, l)| {
                        let mut e = entry(*id, l.logprob);
                        e["top_logprobs"] = Value::Array(l.top.iter().map(|&(t, lp)| entry(t, lp)).collect());
                        e
                    })
                    .collect();
                json!({"content": content})
            }
            Kind::Completion => {
                let (mut toks, mut lps, mut tops, mut offs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for (id, l) in tokens {
                    let t = self.token_text(*id);
                    offs.push(offset);
                    offset += t.len();
                    toks.push(t);
                    lps.push(json!(l.logprob));
                    tops.push(Value::Object(l.top.iter().map(|&(t, lp)| (self.token_text(t), json!(lp))).collect()));
                }
                json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
            }
        }
    }

    /// One choice of a non-streamed response.
    fn choice(&self, index: usize, text: &str, tokens: &[(u32, TokenLogprobs)], f: &Finished) -> Value {
        let lp = if self.logprobs { self.logprobs(tokens, 0) } else { Value::Null };
        let mut c = match self.kind {
            Kind::Chat => json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": f.reason.openai()}),
            Kind::Completion => json!({"index": index, "text": text, "logprobs": lp, "finish_reason": f.reason.openai()}),
        };
        c["stop_reason"] = stop_reason(&f.reason);
        c
    }

    /// A streamed chunk of one choice: new text, its logprobs, maybe the finish.
    fn chunk(&self, index: usize, delta: Value, logprobs: Value, finish: Option<&FinishReason>) -> Value {
        let finish_reason = finish.and_then(FinishReason::openai);
        let mut c = match self.kind {
            Kind::Chat => json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}),
            Kind::Completion => json!({"index": index, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": logprobs, "finish_reason": finish_reason}),
        };
        if let Some(f) = finish {
            c["stop_reason"] = stop_reason(f);
        }
        let mut v = self.envelope(self.chunk_object(), json!([c]));
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }
}

/// vLLM's `stop_reason`: the stop string or end-of-sequence id that ended the choice.
fn stop_reason(r: &FinishReason) -> Value {
    match r {
        FinishReason::Eos(id) => json!(id),
        FinishReason::StopString(s) => json!(s),
        _ => Value::Null,
    }
}

/// Token counts of a response: each prompt once (its first choice's cache reuse), every
/// choice's completion.
#[derive(Default)]
struct UsageSum {
    prompt: usize,
    cached: usize,
    completion: usize,
}

impl UsageSum {
    fn add(&mut self, c: &Choice, f: &Finished) {
        if c.nth == 0 {
            self.prompt += f.usage.prompt_tokens;
            self.cached += f.usage.cached_tokens;
        }
        self.completion += f.usage.completion_tokens;
    }
    fn json(&self) -> Value {
        json!({"prompt_tokens": self.prompt, "completion_tokens": self.completion, "total_tokens": self.prompt + self.completion, "prompt_tokens_details": {"cached_tokens": self.cached}})
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(st, Kind::Chat, body).await
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(st, Kind::Completion, body).await
}

async fn generate(st: Arc<AppState>, kind: Kind, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    let id = format!("{prefix}-{:016x}", st.fresh().1);
    let mut log = RequestLog::new(id.clone(), kind.name(), start);
    let b: GenerateBody = match parse_body(body) {
        Ok(b) => b,
        Err(e) => return log.fail(&st, e),
    };
    let plan = match plan(&st, &b, kind) {
        Ok(p) => p,
        Err(e) => return log.fail(&st, e),
    };
    log.prompt_tokens = plan.prompts.iter().map(Vec::len).sum();
    let choices = match submit(&st, &plan, start) {
        Ok(c) => c,
        Err(e) => return log.fail(&st, e),
    };
    let ctx = Ctx {
        kind,
        id,
        created: unix_now(),
        model: st.config.model_id.clone(),
        fingerprint: st.config.fingerprint.clone(),
        include_usage: plan.include_usage,
        logprobs: plan.logprobs.is_some(),
        st: st.clone(),
    };
    if plan.stream {
        stream_response(ctx, choices, log)
    } else {
        whole_response(ctx, choices, log).await
    }
}

/// Waits for every choice, then answers with one body. Dropped (the client went away), it
/// drops the choices, which cancels them.
async fn whole_response(ctx: Ctx, choices: Vec<Choice>, mut log: RequestLog) -> Response {
    let results = futures_util::future::join_all(choices.into_iter().map(|mut c| async move {
        let mut text = String::new();
        let mut tokens = Vec::new();
        while let Some(e) = c.next().await {
            match e {
                Event::Token(t) => {
                    text.push_str(&t.text);
                    if let Some(l) = t.logprobs {
                        tokens.push((t.id, l));
                    }
                }
                Event::Finished(f) => return (c, text, tokens, Some(f)),
                _ => {}
            }
        }
        (c, text, tokens, None)
    }))
    .await;
    let mut usage = UsageSum::default();
    let mut out = Vec::with_capacity(results.len());
    let mut first: Option<Instant> = None;
    for (c, text, tokens, f) in &results {
        first = match (first, c.first) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let Some(f) = f else {
            return log.fail(&ctx.st, ApiError::unavailable("the runtime stopped before the request finished", "shutting_down"));
        };
        match &f.reason {
            FinishReason::Error(e) => return log.fail(&ctx.st, ApiError::internal(format!("generation failed: {e}"))),
            FinishReason::Cancelled => return log.fail(&ctx.st, ApiError::unavailable("the request was cancelled by the server", "cancelled")),
            _ => {}
        }
        usage.add(c, f);
        out.push(ctx.choice(c.index, text, tokens, f));
    }
    log.ttft = first.map(|t| t - log.start);
    log.cached_tokens = usage.cached;
    log.completion_tokens = usage.completion;
    log.outcome = format!("finished: {}", results.iter().filter_map(|r| r.3.as_ref().and_then(|f| f.reason.openai())).collect::<Vec<_>>().join(","));
    let object = match ctx.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    let mut v = ctx.envelope(object, Value::Array(out));
    v["usage"] = usage.json();
    Json(v).into_response()
}

/// One choice's events, tagged with its index.
type ChoiceEvents = std::pin::Pin<Box<dyn futures_util::Stream<Item = (usize, Event, Finish)> + Send>>;

/// The state of an SSE response: the choices' merged events, chunks to send, the totals.
struct Streamer {
    ctx: Ctx,
    merged: stream::SelectAll<ChoiceEvents>,
    out: VecDeque<String>,
    usage: UsageSum,
    /// Per choice: text bytes sent so far (completions' `text_offset`).
    offsets: Vec<usize>,
    reasons: Vec<&'static str>,
    ended: bool,
    log: RequestLog,
}

/// What a finished choice contributes to the usage (its index into the prompts and `n`).
#[derive(Clone, Copy)]
struct Finish {
    nth: usize,
}

impl Streamer {
    fn on_event(&mut self, index: usize, e: Event, fin: Finish) {
        match e {
            Event::Token(t) => {
                if self.log.ttft.is_none() {
                    self.log.ttft = Some(self.log.start.elapsed());
                }
                let lp = match &t.logprobs {
                    Some(l) if self.ctx.logprobs => self.ctx.logprobs(&[(t.id, l.clone())], self.offsets[index]),
                    _ => Value::Null,
                };
                if t.text.is_empty() && lp.is_null() {
                    return;
                }
                self.offsets[index] += t.text.len();
                let chunk = self.ctx.chunk(index, json!({"content": t.text}), lp, None);
                self.out.push_back(chunk.to_string());
            }
            Event::Finished(f) => {
                if let FinishReason::Error(msg) = &f.reason {
                    let e = ApiError::internal(format!("generation of choice {index} failed: {msg}"));
                    self.log.status = 500;
                    self.out.push_back(e.body().to_string());
                    return;
                }
                if fin.nth == 0 {
                    self.usage.prompt += f.usage.prompt_tokens;
                    self.usage.cached += f.usage.cached_tokens;
                }
                self.usage.completion += f.usage.completion_tokens;
                self.reasons.extend(f.reason.openai());
                let chunk = self.ctx.chunk(index, json!({}), Value::Null, Some(&f.reason));
                self.out.push_back(chunk.to_string());
            }
            _ => {}
        }
    }

    /// After the last choice: the usage chunk, then `[DONE]`.
    fn end(&mut self) {
        if self.ctx.include_usage {
            let mut v = self.ctx.envelope(self.ctx.chunk_object(), json!([]));
            v["usage"] = self.usage.json();
            self.out.push_back(v.to_string());
        }
        self.out.push_back("[DONE]".into());
        self.log.cached_tokens = self.usage.cached;
        self.log.completion_tokens = self.usage.completion;
        self.log.outcome = format!("finished: {}", self.reasons.join(","));
        self.ended = true;
    }
}

/// An SSE response: a role chunk per choice (chat) at once, then chunks as tokens come,
/// keep-alive comments while nothing does (a long prompt). The body dropped (the client went
/// away) drops the choices, which cancels them.
fn stream_response(ctx: Ctx, choices: Vec<Choice>, log: RequestLog) -> Response {
    let mut out = VecDeque::new();
    if ctx.kind == Kind::Chat {
        for c in &choices {
            out.push_back(ctx.chunk(c.index, json!({"role": "assistant", "content": ""}), Value::Null, None).to_string());
        }
    }
    let n = choices.len();
    let merged = stream::select_all(choices.into_iter().map(|c| {
        let fin = Finish { nth: c.nth };
        let s = stream::unfold(c, move |mut c| async move {
            if c.done {
                return None;
            }
            let e = c.next().await?;
            Some(((c.index, e, fin), c))
        });
        Box::pin(s) as ChoiceEvents
    }));
    let keep_alive = ctx.st.config.keep_alive;
    let s = Streamer { ctx, merged, out, usage: UsageSum::default(), offsets: vec![0; n], reasons: Vec::new(), ended: false, log };
    let body = stream::unfold(s, |mut s| async move {
        loop {
            if let Some(data) = s.out.pop_front() {
                return Some((Ok::<_, Infallible>(SseEvent::default().data(data)), s));
            }
            if s.ended {
                return None;
            }
            match s.merged.next().await {
                Some((index, e, fin)) => s.on_event(index, e, fin),
                None => s.end(),
            }
        }
    });
    Sse::new(body).keep_alive(KeepAlive::new().interval(keep_alive).text("keep-alive")).into_response()
}

/// `GET /v1/models`.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [{"id": st.config.model_id, "object": "model", "created": unix_now(), "owned_by": "tensorfold", "max_model_len": st.config.max_model_len}]})).into_response()
}

/// `POST /tokenize`: `{"prompt"}` or `{"messages", ...}` → `{"tokens", "count", "max_model_len"}`.
pub async fn tokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        let b: TokenizeBody = parse_body(body)?;
        check_model(&st, b.model.as_deref())?;
        let tokens = match (&b.prompt, &b.messages) {
            (Some(_), Some(_)) => return Err(ApiError::invalid("give `prompt` or `messages`, not both", Some("messages"))),
            (Some(p), None) => encode_text(&st, p, b.add_special_tokens.unwrap_or(true))?,
            (None, Some(m)) => render_chat(&st, Some(m), b.add_generation_prompt.unwrap_or(true), b.chat_template_kwargs.as_ref())?,
            (None, None) => return Err(ApiError::invalid("`prompt` or `messages` is required", Some("prompt"))),
        };
        Ok(json!({"tokens": tokens, "count": tokens.len(), "max_model_len": st.config.max_model_len}))
    })();
    answer(&st, "tokenize", r)
}

/// `POST /detokenize`: `{"tokens"}` → `{"prompt"}`.
pub async fn detokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        let b: DetokenizeBody = parse_body(body)?;
        check_model(&st, b.model.as_deref())?;
        let Some(tokens) = b.tokens else { return Err(ApiError::invalid("`tokens` is required", Some("tokens"))) };
        let text = st.tokenizer.decode(&tokens).map_err(|e| ApiError::invalid(format!("`tokens`: {e}"), Some("tokens")))?;
        Ok(json!({"prompt": text}))
    })();
    answer(&st, "detokenize", r)
}

fn answer(st: &AppState, endpoint: &'static str, r: Result<Value, ApiError>) -> Response {
    let log = RequestLog::new(String::new(), endpoint, Instant::now());
    match r {
        Ok(v) => {
            let mut log = log;
            log.outcome = "ok".into();
            Json(v).into_response()
        }
        Err(e) => log.fail(st, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<GenerateBody, ApiError> {
        parse_body(Ok(Bytes::from(s.to_string())))
    }

    #[test]
    fn type_errors_name_the_field() {
        let e = parse(r#"{"max_tokens": "ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("invalid type: string"), "{}", e.message);
        let e = parse(r#"{"stop": 3}"#).unwrap_err();
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("stop"), "`stop`: must be a string or an array of strings"));
        let e = parse(r#"{"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options.include_usage"));
    }

    #[test]
    fn malformed_json_and_non_objects_are_400s_without_a_param() {
        let e = parse("{\"messages\": [").unwrap_err();
        assert_eq!((e.status.as_u16(), e.code, e.param), (400, Some("invalid_json"), None));
        let e = parse("[1]").unwrap_err();
        assert_eq!(e.message, "the request body must be a JSON object");
    }

    #[test]
    fn untagged_inputs_take_each_shape() {
        let b = parse(r#"{"prompt": [1, 2], "stop": ["a", "b"], "logprobs": 3}"#).unwrap();
        assert!(matches!(b.prompt, Some(PromptInput::Ids(ref v)) if v == &[1, 2]));
        assert!(matches!(b.stop, Some(StopInput::Many(ref v)) if v.len() == 2));
        assert!(matches!(b.logprobs, Some(LogprobsInput::Count(3))));
        let b = parse(r#"{"prompt": "hi", "stop": "x", "logprobs": true, "seed": -1}"#).unwrap();
        assert!(matches!(b.prompt, Some(PromptInput::Text(ref t)) if t == "hi"));
        assert!(matches!(b.logprobs, Some(LogprobsInput::Bool(true))));
        assert_eq!(b.seed, Some(-1));
    }
}
