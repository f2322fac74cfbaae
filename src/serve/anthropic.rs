//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, as
//! Claude Code and the `anthropic` SDK speak it. The model's reasoning becomes a `thinking`
//! block, its answer a `text` block and its calls `tool_use` blocks, in the order written;
//! a stream sends Anthropic's event sequence (`message_start` … `message_stop`), and errors
//! come in Anthropic's shape (`{"type": "error", "error": {...}}`).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::generate::{check_model, job, parse_body, run_turn, stream_turn, submit, Fields, Parsed, RequestLog, Turn, TurnEnd};
use super::openai::{constraint, render};
use super::{ApiError, AppState};
use crate::runtime::Finished;
use crate::server::anthropic::{BlockDelta, CountTokensRequest, DeltaUsage, MessageDelta, MessageResponse, MessagesRequest, ResponseBlock, StopReason, StreamEvent, Usage};
use crate::server::error::AnthropicError;
use crate::server::parse::{Delta, OutputParser};

/// A message as it is written, and its stream events.
struct MessageTurn {
    message: MessageResponse,
    prompt_tokens: usize,
    /// The block being written (its index is the last of `message.content`).
    open: bool,
    started: bool,
    /// The open tool call's input JSON text so far.
    partial_json: String,
    events: Vec<SseEvent>,
}

impl MessageTurn {
    fn new(message: MessageResponse, prompt_tokens: usize) -> Self {
        Self { message, prompt_tokens, open: false, started: false, partial_json: String::new(), events: Vec::new() }
    }

    fn emit(&mut self, e: StreamEvent) {
        let data = serde_json::to_string(&e).unwrap_or_default();
        self.events.push(SseEvent::default().event(e.event_type()).data(data));
    }

    fn close(&mut self) {
        if std::mem::take(&mut self.open) {
            let index = self.message.content.len() as u32 - 1;
            self.emit(StreamEvent::ContentBlockStop { index });
        }
    }

    /// Opens `block` (closing the one before) and announces it.
    fn open(&mut self, block: ResponseBlock) {
        self.close();
        let index = self.message.content.len() as u32;
        self.message.content.push(block.clone());
        self.open = true;
        self.emit(StreamEvent::ContentBlockStart { index, content_block: block });
    }

    fn delta(&mut self, delta: BlockDelta) {
        let index = self.message.content.len() as u32 - 1;
        self.emit(StreamEvent::ContentBlockDelta { index, delta });
    }
}

impl Turn for MessageTurn {
    fn started(&mut self, cached_tokens: usize) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        self.message.usage = Usage::new(self.prompt_tokens as u32, 0, cached_tokens as u32);
        self.emit(StreamEvent::MessageStart { message: Box::new(self.message.clone()) });
    }

    fn deltas(&mut self, deltas: &[Delta]) {
        // `message_start` comes first, even should the start not have been reported.
        self.started(0);
        for d in deltas {
            let last = if self.open { self.message.content.last_mut() } else { None };
            match (d, last) {
                (Delta::Reasoning(t), Some(ResponseBlock::Thinking { thinking, .. })) => {
                    thinking.push_str(t);
                    self.delta(BlockDelta::ThinkingDelta { thinking: t.clone() });
                }
                (Delta::Reasoning(t), _) => {
                    self.open(ResponseBlock::Thinking { thinking: String::new(), signature: String::new() });
                    self.deltas(&[Delta::Reasoning(t.clone())]);
                }
                (Delta::Content(t), Some(ResponseBlock::Text { text })) => {
                    text.push_str(t);
                    self.delta(BlockDelta::TextDelta { text: t.clone() });
                }
                (Delta::Content(t), _) => {
                    self.open(ResponseBlock::Text { text: String::new() });
                    self.deltas(&[Delta::Content(t.clone())]);
                }
                (Delta::ToolCallStart { id, name, .. }, _) => {
                    self.open(ResponseBlock::ToolUse { id: id.clone(), name: name.clone(), input: serde_json::json!({}) });
                    // The input JSON text, until the call is complete and parsed.
                    self.partial_json.clear();
                }
                (Delta::ToolCallArguments { arguments, .. }, Some(ResponseBlock::ToolUse { input, .. })) => {
                    self.partial_json.push_str(arguments);
                    if let Ok(v) = serde_json::from_str(&self.partial_json) {
                        *input = v;
                    }
                    self.delta(BlockDelta::InputJsonDelta { partial_json: arguments.clone() });
                }
                (Delta::ToolCallArguments { .. }, _) => {}
            }
        }
    }

    fn finished(&mut self, f: &Finished, end: &TurnEnd) {
        self.started(f.usage.cached_tokens);
        self.close();
        let (stop_reason, stop_sequence) = match end {
            TurnEnd::Stop => (StopReason::EndTurn, None),
            TurnEnd::StopString(s) => (StopReason::StopSequence, Some(s.clone())),
            TurnEnd::Length => (StopReason::MaxTokens, None),
            TurnEnd::ToolCalls => (StopReason::ToolUse, None),
        };
        self.message.stop_reason = Some(stop_reason);
        self.message.stop_sequence = stop_sequence.clone();
        self.message.usage = Usage::new(f.usage.prompt_tokens as u32, f.usage.completion_tokens as u32, f.usage.cached_tokens as u32);
        let output_tokens = f.usage.completion_tokens as u32;
        self.emit(StreamEvent::MessageDelta { delta: MessageDelta { stop_reason: Some(stop_reason), stop_sequence }, usage: DeltaUsage { output_tokens } });
        self.emit(StreamEvent::MessageStop);
    }

    fn failed(&mut self, e: &ApiError) {
        self.emit(StreamEvent::Error { error: AnthropicError { kind: anthropic_kind(e).into(), message: e.message.clone() } });
    }

    fn take_events(&mut self) -> Vec<SseEvent> {
        std::mem::take(&mut self.events)
    }
}

/// Anthropic's error `type` for an error.
pub(super) fn anthropic_kind(e: &ApiError) -> &'static str {
    match e.status.as_u16() {
        400 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// `POST /v1/messages`.
pub async fn messages(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let tag = format!("{:016x}", st.fresh().1);
    let mut log = RequestLog::new(format!("msg_{tag}"), "messages", start);
    let prepared = (|| {
        let r: MessagesRequest = parse_body(body)?;
        check_model(&st, r.model.as_deref())?;
        let req = r.validate()?;
        let rendered = render(&st, &req.prompt, "messages")?;
        let job = job(&st, &req.sampling, vec![rendered.ids], Fields { prompt: "messages", max_tokens: "max_tokens" })?;
        let parser = req.prompt.parser_options(&rendered.text, format!("toolu_{tag}_"));
        Ok::<_, ApiError>((req, job, parser, rendered.text, r.output_schema_field()))
    })();
    let (req, mut job, parser, text, schema_field) = match prepared {
        Ok(p) => p,
        Err(e) => return log.fail(&st, e.anthropic()),
    };
    match constraint(&st, &req.output_format, &req.prompt, &text, schema_field).await {
        Ok(c) => job.constraint = c,
        Err(e) => return log.fail(&st, e.anthropic()),
    }
    log.prompt_tokens = job.prompts[0].len();
    let mut choices = match submit(&st, &job, start) {
        Ok(c) => c,
        Err(e) => return log.fail(&st, e.anthropic()),
    };
    let choice = choices.remove(0);
    let message = MessageResponse::new(log.id.clone(), st.config.model_id.clone(), Vec::new(), None, Usage::new(log.prompt_tokens as u32, 0, 0));
    let mut turn = MessageTurn::new(message, log.prompt_tokens);
    let parsed = Parsed::new(OutputParser::new(parser));
    if req.stream {
        return stream_turn(choice, parsed, turn, log, st.config.keep_alive);
    }
    match run_turn(choice, parsed, &mut turn, &mut log).await {
        Ok(_) => {
            log.answered(format!("finished: {:?}", turn.message.stop_reason));
            Json(&turn.message).into_response()
        }
        Err(e) => log.fail(&st, e.anthropic()),
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens"}`, the prompt a messages request with
/// this conversation, system prompt and tools is given.
pub async fn count_tokens(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let mut log = RequestLog::new(String::new(), "count_tokens", Instant::now());
    let r = (|| {
        let r: CountTokensRequest = parse_body(body)?;
        check_model(&st, r.model.as_deref())?;
        let prompt = r.validate()?;
        Ok::<_, ApiError>(render(&st, &prompt, "messages")?.ids.len())
    })();
    match r {
        Ok(n) => {
            log.answered("ok".into());
            Json(serde_json::json!({"input_tokens": n})).into_response()
        }
        Err(e) => log.fail(&st, e.anthropic()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{FinishReason, Usage as RtUsage};

    fn turn() -> MessageTurn {
        MessageTurn::new(MessageResponse::new("msg_x".into(), "m".into(), Vec::new(), None, Usage::new(5, 0, 0)), 5)
    }

    fn finished(reason: FinishReason) -> Finished {
        Finished { reason, usage: RtUsage { prompt_tokens: 5, completion_tokens: 7, cached_tokens: 2 }, saved: None }
    }

    fn names(events: &[SseEvent]) -> Vec<String> {
        events.iter().map(|e| format!("{e:?}")).map(|s| s.split("event: ").nth(1).and_then(|r| r.split(['\\', '\n']).next()).unwrap_or_default().to_string()).collect()
    }

    #[test]
    fn blocks_follow_the_order_the_model_wrote_them() {
        let mut t = turn();
        t.started(2);
        t.deltas(&[Delta::Reasoning("hmm".into()), Delta::Reasoning(" ok".into()), Delta::Content("Calling.".into())]);
        t.deltas(&[Delta::ToolCallStart { index: 0, id: "toolu_0".into(), name: "f".into() }, Delta::ToolCallArguments { index: 0, arguments: "{\"a\": ".into() }]);
        t.deltas(&[Delta::ToolCallArguments { index: 0, arguments: "1}".into() }]);
        t.finished(&finished(FinishReason::Eos(1)), &TurnEnd::ToolCalls);
        let m = &t.message;
        assert_eq!(
            m.content,
            vec![
                ResponseBlock::Thinking { thinking: "hmm ok".into(), signature: String::new() },
                ResponseBlock::Text { text: "Calling.".into() },
                ResponseBlock::ToolUse { id: "toolu_0".into(), name: "f".into(), input: serde_json::json!({"a": 1}) },
            ]
        );
        assert_eq!(m.stop_reason, Some(StopReason::ToolUse));
        assert_eq!((m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens), (3, Some(2), 7));
        let ev = names(&t.take_events());
        assert_eq!(ev.first().map(String::as_str), Some("message_start"));
        assert_eq!(ev.iter().filter(|e| *e == "content_block_start").count(), 3);
        assert_eq!(ev.iter().filter(|e| *e == "content_block_stop").count(), 3);
        assert_eq!(ev[ev.len() - 2..], ["message_delta".to_string(), "message_stop".to_string()]);
    }

    #[test]
    fn a_stop_sequence_is_named() {
        let mut t = turn();
        t.deltas(&[Delta::Content("a".into())]);
        t.finished(&finished(FinishReason::StopString("END".into())), &TurnEnd::StopString("END".into()));
        assert_eq!((t.message.stop_reason, t.message.stop_sequence.as_deref()), (Some(StopReason::StopSequence), Some("END")));
        // message_start comes even when the sequence never reported its start.
        assert_eq!(names(&t.take_events())[0], "message_start");
    }
}
