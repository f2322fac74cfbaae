//! The OpenAI chat and text completions endpoints, and vLLM's `/tokenize` and `/detokenize`.
//!
//! Requests are read into [`crate::server::openai`]'s types and checked there; the chat's
//! generated text goes through [`crate::server::parse::OutputParser`], so reasoning arrives as
//! `reasoning_content` (and `reasoning`), tool calls as `tool_calls`, and only the answer as
//! `content`, whole and in streamed deltas alike. Text completions return the raw text.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::generate::{check_model, collect, job, parse_body, submit, Choice, Fields, Job, Parsed, RequestLog, TurnEnd};
use super::{unix_now, ApiError, AppState};
use crate::grammar::{Constraint, GrammarError, Spec};
use crate::runtime::{Event, FinishReason, Finished, TokenLogprobs};
use crate::server::openai::{ChatCompletionRequest, ChunkDelta, CompletionRequest, Prompt, ResponseMessage};
use crate::server::parse::{Delta, OutputParser, ParserOptions};
use crate::server::{ChatPrompt, OutputFormat, ToolChoice};

/// `/tokenize`'s body (vLLM's shape): a prompt, or chat messages rendered by the template.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct TokenizeBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub add_special_tokens: Option<bool>,
    pub messages: Option<Vec<crate::server::openai::ChatMessage>>,
    pub tools: Option<Vec<crate::server::openai::Tool>>,
    pub add_generation_prompt: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// `/detokenize`'s body.
#[derive(Deserialize, Debug, Default)]
pub struct DetokenizeBody {
    pub model: Option<String>,
    pub tokens: Option<Vec<u32>>,
}

/// A rendered and encoded chat prompt.
pub(super) struct Rendered {
    pub text: String,
    pub ids: Vec<u32>,
}

/// Renders `prompt` with the model's chat template and encodes it; errors name `field`.
pub(super) fn render(st: &AppState, prompt: &ChatPrompt, field: &str) -> Result<Rendered, ApiError> {
    let Some(template) = st.tokenizer.chat_template() else {
        return Err(ApiError::invalid("the model has no chat template; use /v1/completions", Some(field)));
    };
    let text = prompt.render(template).map_err(|e| ApiError::invalid(format!("the chat template could not render `{field}`: {e}"), Some(field)))?;
    // Templates write their own special tokens, so none are added (as transformers does).
    let ids = st.tokenizer.encode_with(&text, false).map_err(|e| ApiError::internal(format!("encoding the rendered prompt: {e}")))?;
    Ok(Rendered { text, ids })
}

/// The grammar a chat request's output must follow (its output format, or a forced tool call),
/// `None` when the output is free. `rendered` is the prompt's text: whether generation starts
/// inside reasoning is read from its tail. `schema_field` names the format's schema in errors
/// (`response_format.json_schema.schema`, `text.format.schema`). The grammar is compiled on
/// tokio's blocking pool: a large schema takes a while (llguidance's limits allow about half a
/// second), which must not hold up an async worker and every request it serves.
///
/// # Errors
/// 400s: a schema llguidance cannot enforce (naming `schema_field`, with its message), a forced
/// tool whose parameters cannot be enforced (naming the part of the tool's schema at fault),
/// `tool_choice` naming no tool or forcing a call without tools (`tool_choice`), a tokenizer
/// without a token table.
pub(super) async fn constraint(st: &Arc<AppState>, format: &OutputFormat, prompt: &ChatPrompt, rendered: &str, schema_field: &'static str) -> Result<Option<Constraint>, ApiError> {
    let forced = matches!(prompt.tool_choice, ToolChoice::Required | ToolChoice::Function(_));
    if !forced && *format == OutputFormat::Text {
        return Ok(None);
    }
    let (st, format, tools, tool_choice) = (st.clone(), format.clone(), prompt.tools.clone(), prompt.tool_choice.clone());
    let (parallel_tool_calls, starts_in_reasoning) = (prompt.parallel_tool_calls, crate::server::parse::prompt_ends_in_reasoning(rendered));
    let build = move || {
        let vocab = st.vocabulary().map_err(|e| ApiError::invalid(e.to_string(), Some(if forced { "tool_choice" } else { schema_field })).with_code("unsupported_value"))?;
        let spec = Spec { format: &format, tools: &tools, tool_choice: &tool_choice, parallel_tool_calls, starts_in_reasoning };
        Constraint::build(vocab, &spec).map_err(|e| grammar_error(&e, &tools, schema_field))
    };
    tokio::task::spawn_blocking(build).await.map_err(|e| ApiError::internal(format!("compiling the output grammar: {e}")))?
}

/// A refusal of [`Constraint::build`] as a 400 naming the request field at fault.
fn grammar_error(e: &GrammarError, tools: &crate::server::parse::ToolSchemas, schema_field: &str) -> ApiError {
    // OpenAI's codes for these refusals (its Responses API answers a bad schema with
    // `invalid_json_schema`, a bad function schema with `invalid_function_parameters`).
    let code = match e {
        GrammarError::Schema(_) => "invalid_json_schema",
        GrammarError::Tool { .. } | GrammarError::Tools(_) => "invalid_function_parameters",
        _ => "invalid_value",
    };
    let field = match e {
        GrammarError::Schema(_) => schema_field.to_string(),
        // The part of the tool's schema at fault, by its path in the request.
        GrammarError::Tool { name, path, .. } => match tools.field(name) {
            Some(f) if path.is_empty() => f,
            Some(f) => format!("{f}.{path}"),
            None => "tools".into(),
        },
        GrammarError::ToolName(name) => tools.name_field(name).unwrap_or_else(|| "tools".into()),
        GrammarError::Tools(_) => "tools".into(),
        GrammarError::UnknownTool(_) | GrammarError::NoTools | GrammarError::Vocabulary(_) => "tool_choice".into(),
        GrammarError::Runtime(_) => return ApiError::internal(e.to_string()),
    };
    ApiError::invalid(format!("`{field}`: {e}"), Some(&field)).with_code(code)
}

fn encode_text(st: &AppState, text: &str, add_special: bool, field: &str) -> Result<Vec<u32>, ApiError> {
    st.tokenizer.encode_with(text, add_special).map_err(|e| ApiError::invalid(format!("`{field}` could not be encoded: {e}"), Some(field)))
}

/// Which endpoint a generation came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
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
    /// Chat: how each choice's text is parsed (the call ids get the choice's index appended).
    parser: Option<ParserOptions>,
    /// Completions with `echo`: each prompt's text, by prompt.
    echo: Option<Vec<String>>,
    /// Choices per prompt.
    n: usize,
    st: Arc<AppState>,
}

impl Ctx {
    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint, "choices": choices})
    }

    /// A parser for choice `index`, for chat.
    fn parser(&self, index: usize) -> Option<Parsed> {
        self.parser.as_ref().map(|o| {
            let mut o = o.clone();
            o.call_id_prefix = format!("{}{index}_", o.call_id_prefix);
            Parsed::new(OutputParser::new(o))
        })
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

    /// The echoed prompt of choice `index` (completions with `echo`).
    fn echo_of(&self, index: usize) -> &str {
        self.echo.as_ref().map_or("", |e| e[index / self.n].as_str())
    }

    /// OpenAI's `finish_reason` of a choice that made `calls` tool calls.
    fn finish_reason(&self, f: &Finished, calls: usize) -> Value {
        match TurnEnd::of(f, calls) {
            Some(TurnEnd::ToolCalls) => json!("tool_calls"),
            Some(TurnEnd::Length) => json!("length"),
            Some(_) => json!("stop"),
            None => Value::Null,
        }
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        }
    }

    /// A streamed chunk of one choice.
    fn chunk(&self, choice: Value) -> String {
        let mut v = self.envelope(self.chunk_object(), json!([choice]));
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v.to_string()
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
    fn add(&mut self, nth: usize, f: &Finished) {
        if nth == 0 {
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
    let start = Instant::now();
    let id = format!("chatcmpl-{:016x}", st.fresh().1);
    let log = RequestLog::new(id.clone(), "chat", start);
    let prepared = (|| {
        let r: ChatCompletionRequest = parse_body(body)?;
        check_model(&st, r.model.as_deref())?;
        let req = r.validate(st.runtime.info().v_eff)?;
        let rendered = render(&st, &req.prompt, "messages")?;
        let fields = Fields { prompt: "messages", max_tokens: if r.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" } };
        let job = job(&st, &req.sampling, vec![rendered.ids], fields)?;
        let parser = req.prompt.parser_options(&rendered.text, format!("call_{}_", &id[9..]));
        Ok::<_, ApiError>((req, job, parser, rendered.text))
    })();
    let (req, mut job, parser, text) = match prepared {
        Ok(p) => p,
        Err(e) => return log.fail(&st, e),
    };
    match constraint(&st, &req.output_format, &req.prompt, &text, "response_format.json_schema.schema").await {
        Ok(c) => job.constraint = c,
        Err(e) => return log.fail(&st, e),
    }
    let answer = Answer { kind: Kind::Chat, id, include_usage: req.include_usage, stream: req.stream, parser: Some(parser), echo: None };
    respond(&st, answer, &job, log, start).await
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let id = format!("cmpl-{:016x}", st.fresh().1);
    let log = RequestLog::new(id.clone(), "completion", start);
    let prepared = (|| {
        let r: CompletionRequest = parse_body(body)?;
        check_model(&st, r.model.as_deref())?;
        let v_eff = st.runtime.info().v_eff;
        let req = r.validate(v_eff)?;
        if req.echo && req.sampling.logprobs.is_some() {
            return Err(ApiError::invalid("`echo` with `logprobs` (the prompt's logprobs) is not supported", Some("echo")).with_code("unsupported_value"));
        }
        let single = req.prompts.len() == 1;
        let mut ids = Vec::with_capacity(req.prompts.len());
        for (i, p) in req.prompts.iter().enumerate() {
            let field = if single { "prompt".to_string() } else { format!("prompt[{i}]") };
            ids.push(match p {
                Prompt::Text(t) => encode_text(&st, t, true, &field)?,
                Prompt::Ids(v) => v.clone(),
            });
        }
        let echo = if req.echo {
            let texts = req.prompts.iter().zip(&ids).map(|(p, ids)| match p {
                Prompt::Text(t) => Ok(t.clone()),
                Prompt::Ids(_) => st.tokenizer.decode(ids).map_err(|e| ApiError::invalid(format!("`prompt`: {e}"), Some("prompt"))),
            });
            Some(texts.collect::<Result<Vec<_>, _>>()?)
        } else {
            None
        };
        let job = job(&st, &req.sampling, ids, Fields { prompt: "prompt", max_tokens: "max_tokens" })?;
        Ok::<_, ApiError>((req, job, echo))
    })();
    let (req, mut job, echo) = match prepared {
        Ok(p) => p,
        Err(e) => return log.fail(&st, e),
    };
    // A text prompt has no tools and no reasoning prefix: only the output format constrains.
    match constraint(&st, &req.output_format, &ChatPrompt::default(), "", "response_format.json_schema.schema").await {
        Ok(c) => job.constraint = c,
        Err(e) => return log.fail(&st, e),
    }
    let answer = Answer { kind: Kind::Completion, id, include_usage: req.include_usage, stream: req.stream, parser: None, echo };
    respond(&st, answer, &job, log, start).await
}

/// What differs between a chat and a text completion's answer.
struct Answer {
    kind: Kind,
    id: String,
    include_usage: bool,
    stream: bool,
    /// Chat: how each choice's text is parsed.
    parser: Option<ParserOptions>,
    /// Completions with `echo`: each prompt's text.
    echo: Option<Vec<String>>,
}

/// Submits `job`'s choices and answers them, streamed or whole: the tail both completion
/// endpoints share.
async fn respond(st: &Arc<AppState>, a: Answer, job: &Job, mut log: RequestLog, start: Instant) -> Response {
    log.prompt_tokens = job.prompts.iter().map(Vec::len).sum();
    let choices = match submit(st, job, start) {
        Ok(c) => c,
        Err(e) => return log.fail(st, e),
    };
    let ctx = Ctx {
        kind: a.kind,
        id: a.id,
        created: unix_now(),
        model: st.config.model_id.clone(),
        fingerprint: st.config.fingerprint.clone(),
        include_usage: a.include_usage,
        logprobs: job.logprobs.is_some(),
        parser: a.parser,
        echo: a.echo,
        n: job.n,
        st: st.clone(),
    };
    if a.stream {
        stream_response(ctx, choices, log)
    } else {
        whole_response(ctx, choices, log).await
    }
}

/// Waits for every choice, then answers with one body. Dropped (the client went away), it
/// drops the choices, which cancels them.
async fn whole_response(ctx: Ctx, choices: Vec<Choice>, mut log: RequestLog) -> Response {
    let results = futures_util::future::join_all(choices.into_iter().map(|c| {
        let parsed = ctx.parser(c.index);
        collect(c, parsed)
    }))
    .await;
    let mut usage = UsageSum::default();
    let mut out = Vec::with_capacity(results.len());
    let mut first: Option<Instant> = None;
    let mut reasons = Vec::new();
    for r in &results {
        first = match (first, r.choice.first) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let f = match r.outcome() {
            Ok(f) => f,
            Err(e) => return log.fail(&ctx.st, e),
        };
        usage.add(r.choice.nth, f);
        let index = r.choice.index;
        let lp = if ctx.logprobs { ctx.logprobs(&r.tokens, 0) } else { Value::Null };
        let mut c = match (&r.parsed, ctx.kind) {
            (Some(parsed), _) => {
                let message = serde_json::to_value(ResponseMessage::from_parsed(parsed)).unwrap_or_default();
                json!({"index": index, "message": message, "logprobs": lp, "finish_reason": ctx.finish_reason(f, parsed.tool_calls.len())})
            }
            (None, _) => json!({"index": index, "text": format!("{}{}", ctx.echo_of(index), r.text), "logprobs": lp, "finish_reason": ctx.finish_reason(f, 0)}),
        };
        c["stop_reason"] = stop_reason(&f.reason);
        reasons.push(c["finish_reason"].as_str().unwrap_or_default().to_string());
        out.push(c);
    }
    log.ttft = first.map(|t| t - log.start);
    log.cached_tokens = usage.cached;
    log.completion_tokens = usage.completion;
    log.answered(format!("finished: {}", reasons.join(",")));
    let object = match ctx.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    let mut v = ctx.envelope(object, Value::Array(out));
    v["usage"] = usage.json();
    Json(v).into_response()
}

/// One choice's events, tagged with its index.
type ChoiceEvents = std::pin::Pin<Box<dyn futures_util::Stream<Item = (usize, usize, Event)> + Send>>;

/// The state of an SSE response: the choices' merged events, chunks to send, the totals.
struct Streamer {
    ctx: Ctx,
    merged: stream::SelectAll<ChoiceEvents>,
    out: VecDeque<String>,
    usage: UsageSum,
    /// Per choice: text bytes sent so far (completions' `text_offset`).
    offsets: Vec<usize>,
    /// Per choice (chat): its parser.
    parsers: Vec<Option<Parsed>>,
    reasons: Vec<String>,
    ended: bool,
    log: RequestLog,
}

impl Streamer {
    /// A chat chunk per delta (the logprobs ride on the first; with none, on an empty delta).
    fn chat_chunks(&mut self, index: usize, deltas: &[Delta], mut lp: Value) {
        for d in deltas {
            let delta = serde_json::to_value(ChunkDelta::from(d)).unwrap_or_default();
            let chunk = self.ctx.chunk(json!({"index": index, "delta": delta, "logprobs": std::mem::take(&mut lp), "finish_reason": null}));
            self.out.push_back(chunk);
        }
        if !lp.is_null() {
            self.out.push_back(self.ctx.chunk(json!({"index": index, "delta": {}, "logprobs": lp, "finish_reason": null})));
        }
    }

    fn on_event(&mut self, index: usize, nth: usize, e: Event) {
        match e {
            Event::Token(t) => {
                if self.log.ttft.is_none() {
                    self.log.ttft = Some(self.log.start.elapsed());
                }
                let lp = match &t.logprobs {
                    Some(l) if self.ctx.logprobs => self.ctx.logprobs(&[(t.id, l.clone())], self.offsets[index]),
                    _ => Value::Null,
                };
                if let Some(p) = self.parsers[index].as_mut() {
                    let deltas = p.push(&t.text);
                    self.chat_chunks(index, &deltas, lp);
                    return;
                }
                if t.text.is_empty() && lp.is_null() {
                    return;
                }
                self.offsets[index] += t.text.len();
                let chunk = self.ctx.chunk(json!({"index": index, "text": t.text, "logprobs": lp, "finish_reason": null}));
                self.out.push_back(chunk);
            }
            Event::Finished(f) => {
                if let FinishReason::Error(msg) = &f.reason {
                    let e = ApiError::internal(format!("generation of choice {index} failed: {msg}"));
                    self.log.status = 500;
                    self.out.push_back(e.body().to_string());
                    return;
                }
                self.usage.add(nth, &f);
                let (deltas, calls) = match self.parsers[index].as_mut() {
                    Some(p) => (p.finish(&f.reason), p.whole.tool_calls.len()),
                    None => (Vec::new(), 0),
                };
                self.chat_chunks(index, &deltas, Value::Null);
                let finish_reason = self.ctx.finish_reason(&f, calls);
                self.reasons.push(finish_reason.as_str().unwrap_or_default().to_string());
                let mut c = match self.ctx.kind {
                    Kind::Chat => json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish_reason}),
                    Kind::Completion => json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish_reason}),
                };
                c["stop_reason"] = stop_reason(&f.reason);
                self.out.push_back(self.ctx.chunk(c));
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
        if self.log.status == 499 {
            self.log.answered(format!("finished: {}", self.reasons.join(",")));
        }
        self.ended = true;
    }
}

/// An SSE response: a role chunk per choice (chat) at once, then chunks as tokens come,
/// keep-alive comments while nothing does (a long prompt). The body dropped (the client went
/// away) drops the choices, which cancels them.
fn stream_response(ctx: Ctx, choices: Vec<Choice>, log: RequestLog) -> Response {
    let mut out = VecDeque::new();
    for c in &choices {
        match ctx.kind {
            Kind::Chat => out.push_back(ctx.chunk(json!({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))),
            Kind::Completion if ctx.echo.is_some() => out.push_back(ctx.chunk(json!({"index": c.index, "text": ctx.echo_of(c.index), "logprobs": null, "finish_reason": null}))),
            Kind::Completion => {}
        }
    }
    let n = choices.len();
    let parsers = (0..n).map(|i| ctx.parser(i)).collect();
    let merged = stream::select_all(choices.into_iter().map(|c| {
        let s = stream::unfold(c, |mut c| async move {
            if c.done {
                return None;
            }
            let e = c.next().await?;
            Some(((c.index, c.nth, e), c))
        });
        Box::pin(s) as ChoiceEvents
    }));
    let keep_alive = ctx.st.config.keep_alive;
    let s = Streamer { ctx, merged, out, usage: UsageSum::default(), offsets: vec![0; n], parsers, reasons: Vec::new(), ended: false, log };
    let body = stream::unfold(s, |mut s| async move {
        loop {
            if let Some(data) = s.out.pop_front() {
                return Some((Ok::<_, Infallible>(SseEvent::default().data(data)), s));
            }
            if s.ended {
                return None;
            }
            match s.merged.next().await {
                Some((index, nth, e)) => s.on_event(index, nth, e),
                None => s.end(),
            }
        }
    });
    Sse::new(body).keep_alive(KeepAlive::new().interval(keep_alive).text("keep-alive")).into_response()
}

/// `GET /v1/models`.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    let created = unix_now();
    let data: Vec<Value> = std::iter::once(&st.config.model_id)
        .chain(&st.config.aliases)
        .map(|id| json!({"id": id, "object": "model", "created": created, "owned_by": "tensorfold", "root": st.config.model_id, "max_model_len": st.config.max_model_len}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `POST /tokenize`: `{"prompt"}` or `{"messages", "tools", ...}` → `{"tokens", "count",
/// "max_model_len"}`.
pub async fn tokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| {
        let b: TokenizeBody = parse_body(body)?;
        check_model(&st, b.model.as_deref())?;
        let tokens = match (&b.prompt, &b.messages) {
            (Some(_), Some(_)) => return Err(ApiError::invalid("give `prompt` or `messages`, not both", Some("messages"))),
            (Some(p), None) => encode_text(&st, p, b.add_special_tokens.unwrap_or(true), "prompt")?,
            (None, Some(m)) => {
                // The chat request's own conversion, so the count is what a chat request with
                // these messages and tools is prompted with.
                let chat = ChatCompletionRequest {
                    messages: m.clone(),
                    tools: b.tools.clone(),
                    chat_template_kwargs: b.chat_template_kwargs.clone(),
                    add_generation_prompt: b.add_generation_prompt,
                    ..ChatCompletionRequest::default()
                };
                let req = chat.validate(st.runtime.info().v_eff)?;
                render(&st, &req.prompt, "messages")?.ids
            }
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
    let mut log = RequestLog::new(String::new(), endpoint, Instant::now());
    match r {
        Ok(v) => {
            log.answered("ok".into());
            Json(v).into_response()
        }
        Err(e) => log.fail(st, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// The server's state over the vocab fixture (random weights, Qwen3.5's tokenizer).
    fn state() -> AppState {
        use crate::backend::cpu::Cpu;
        use crate::model::{HostModel, Model};
        let dir = crate::testutil::shared("fixtures/vocab/mlx-q4");
        let tokenizer = Arc::new(crate::tokenizer::Tokenizer::from_dir(&dir).expect("the fixture's tokenizer"));
        let d = dir.clone();
        let runtime = crate::runtime::Runtime::start(crate::runtime::RuntimeConfig::default(), Some(tokenizer.clone()), move || {
            let host = HostModel::open(&d)?;
            Ok::<_, anyhow::Error>(crate::engine::Engine::new(Model::new(&host, Cpu::new())?, 256)?)
        })
        .expect("the runtime starts");
        let config = crate::serve::ServeConfig {
            model_id: "m".into(),
            aliases: Vec::new(),
            api_key: None,
            max_model_len: 4096,
            defaults: crate::sampling::SamplingParams::default(),
            max_n: 4,
            max_body_bytes: 1 << 20,
            fingerprint: "fp".into(),
            keep_alive: Duration::from_secs(5),
        };
        AppState::new(runtime, tokenizer, config)
    }

    #[test]
    fn grammars_compile_off_the_async_workers() {
        let st = Arc::new(state());
        st.vocabulary().expect("the token table builds");
        // 300 alternatives of 30 keys: a schema llguidance takes a noticeable while to compile.
        let alternatives: Vec<Value> = (0..300)
            .map(|i| {
                let keys: Vec<String> = (0..30).map(|j| format!("k{i}_{j}")).collect();
                let props: Map<String, Value> = keys.iter().map(|k| (k.clone(), json!({"type": "integer"}))).collect();
                json!({"type": "object", "properties": props, "required": keys})
            })
            .collect();
        let format = OutputFormat::JsonSchema { name: "big".into(), schema: Some(json!({"anyOf": alternatives})), strict: true };
        // One worker thread: a compile on it would stop the ticker until it is done.
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a tokio runtime");
        let (elapsed, ticks) = rt.block_on(async {
            let ticks = Arc::new(AtomicUsize::new(0));
            let t = ticks.clone();
            let ticker = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    t.fetch_add(1, Ordering::Relaxed);
                }
            });
            tokio::task::yield_now().await;
            let (t0, before) = (Instant::now(), ticks.load(Ordering::Relaxed));
            let built = constraint(&st, &format, &ChatPrompt::default(), "", "response_format.json_schema.schema").await;
            let during = ticks.load(Ordering::Relaxed) - before;
            ticker.abort();
            assert!(built.expect("the schema compiles").is_some());
            (t0.elapsed(), during)
        });
        assert!(elapsed > Duration::from_millis(40), "the compile took {elapsed:?}: too short to tell");
        assert!(ticks >= 5, "the async worker ran {ticks} ticks of 2 ms during a {elapsed:?} compile");
        // Refusals are still the 400s naming the field.
        let bad = OutputFormat::JsonSchema { name: "bad".into(), schema: Some(json!({"type": "nonsense"})), strict: true };
        let e = rt.block_on(constraint(&st, &bad, &ChatPrompt::default(), "", "text.format.schema")).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref(), e.code), (400, Some("text.format.schema"), Some("invalid_json_schema")));
        // A tool's fault is named where it is in the request: its name, or a schema keyword.
        let forced = |name: &str, parameters: Value| {
            let mut tools = crate::server::parse::ToolSchemas::new();
            tools.insert_from(name, Some(&parameters), "tools[1].function", "parameters");
            let prompt = ChatPrompt { tools, tool_choice: ToolChoice::Required, ..ChatPrompt::default() };
            let e = rt.block_on(constraint(&st, &OutputFormat::Text, &prompt, "", "response_format.json_schema.schema")).unwrap_err();
            (e.param.unwrap_or_default(), e.code.unwrap_or_default())
        };
        assert_eq!(forced("two words", json!({"type": "object"})), ("tools[1].function.name".to_string(), "invalid_value"));
        let bounds = json!({"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 1}}});
        assert_eq!(forced("f", bounds), ("tools[1].function.parameters.properties.s.minLength".to_string(), "invalid_function_parameters"));
        // Bounds no value of the format meets: refused before generating, naming the bound.
        let mut tools = crate::server::parse::ToolSchemas::new();
        let uuid = json!({"type": "object", "properties": {"id": {"type": "string", "format": "uuid", "maxLength": 10}}});
        tools.insert_from("f", Some(&uuid), "tools[1].function", "parameters");
        let prompt = ChatPrompt { tools, tool_choice: ToolChoice::Required, ..ChatPrompt::default() };
        let e = rt.block_on(constraint(&st, &OutputFormat::Text, &prompt, "", "response_format.json_schema.schema")).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref(), e.code), (400, Some("tools[1].function.parameters.properties.id.maxLength"), Some("invalid_function_parameters")));
        assert!(e.message.ends_with("a `uuid` is 36 characters; `maxLength` 10 leaves none"), "{}", e.message);
    }

    fn parse<T: serde::de::DeserializeOwned>(s: &str) -> Result<T, ApiError> {
        parse_body(Ok(Bytes::from(s.to_string())))
    }

    #[test]
    fn type_errors_name_the_field() {
        let e = parse::<ChatCompletionRequest>(r#"{"max_tokens": "ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("invalid type: string"), "{}", e.message);
        let e = parse::<ChatCompletionRequest>(r#"{"stop": 3}"#).unwrap_err();
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("stop"), "`stop`: must be a string or an array of strings"));
        let e = parse::<ChatCompletionRequest>(r#"{"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options.include_usage"));
        // A missing field is named by its own path, not its parent's.
        let e = parse::<ChatCompletionRequest>(r#"{"messages": [{"content": "no role"}]}"#).unwrap_err();
        assert_eq!((e.param.as_deref(), e.code), (Some("messages[0].role"), Some("missing_required_parameter")));
        let e = parse::<CompletionRequest>(r#"{"max_tokens": 3}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }

    #[test]
    fn malformed_json_and_non_objects_are_400s_without_a_param() {
        let e = parse::<ChatCompletionRequest>("{\"messages\": [").unwrap_err();
        assert_eq!((e.status.as_u16(), e.code, e.param), (400, Some("invalid_json"), None));
        let e = parse::<ChatCompletionRequest>("[1]").unwrap_err();
        assert_eq!(e.message, "the request body must be a JSON object");
    }

    #[test]
    fn untagged_prompts_name_their_shapes() {
        let e = parse::<CompletionRequest>(r#"{"prompt": [1, -2]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("an array of token ids"), "{}", e.message);
        let r = parse::<CompletionRequest>(r#"{"prompt": [[1, 2], [3]], "stop": "x"}"#).unwrap();
        assert_eq!(r.validate(10).unwrap().prompts, [Prompt::Ids(vec![1, 2]), Prompt::Ids(vec![3])]);
    }
}
