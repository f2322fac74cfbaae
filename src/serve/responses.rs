//! `POST /v1/responses`: OpenAI's Responses API, stateless (`store` is never honoured, and
//! `previous_response_id` is refused): the client sends the whole conversation each turn, as
//! Codex CLI does with `store: false`. The output is a reasoning item, a message and function
//! calls, in the order the model wrote them; a stream sends the Responses event sequence
//! (`response.created` … `response.completed`).

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
use crate::server::openai::{IncompleteDetails, OutputContent, OutputItem, ReasoningPart, ResponseObject, ResponseStreamEvent, ResponseUsage, ResponsesRequest};
use crate::server::parse::{Delta, OutputParser};

/// The item being written.
enum Open {
    Reasoning { text: String },
    Message { text: String },
    Call { call_id: String, name: String, arguments: String },
}

/// A response as it is written, and its stream events.
struct ResponseTurn {
    /// Ids are this plus a kind prefix and the item's position.
    tag: String,
    response: ResponseObject,
    open: Option<(u32, String, Open)>,
    seq: u64,
    events: Vec<SseEvent>,
}

impl ResponseTurn {
    fn new(tag: String, response: ResponseObject) -> Self {
        let mut t = Self { tag, response, open: None, seq: 0, events: Vec::new() };
        let r = Box::new(t.response.clone());
        t.emit(|sequence_number| ResponseStreamEvent::Created { sequence_number, response: r });
        t
    }

    fn emit(&mut self, event: impl FnOnce(u64) -> ResponseStreamEvent) {
        let e = event(self.seq);
        self.seq += 1;
        let data = serde_json::to_string(&e).unwrap_or_default();
        self.events.push(SseEvent::default().event(e.event_type()).data(data));
    }

    /// The open item's final form.
    fn item(&self, id: &str, open: &Open, status: &str) -> OutputItem {
        match open {
            Open::Reasoning { text } => {
                OutputItem::Reasoning { id: id.to_string(), summary: Vec::new(), content: vec![ReasoningPart { kind: "reasoning_text".into(), text: text.clone() }] }
            }
            Open::Message { text } => OutputItem::Message {
                id: id.to_string(),
                status: status.into(),
                role: "assistant".into(),
                content: vec![OutputContent::OutputText { text: text.clone(), annotations: Vec::new() }],
            },
            Open::Call { call_id, name, arguments } => {
                OutputItem::FunctionCall { id: id.to_string(), call_id: call_id.clone(), name: name.clone(), arguments: arguments.clone(), status: status.into() }
            }
        }
    }

    /// Opens a new item of `open`'s kind (closing the one before) and announces it.
    fn open(&mut self, open: Open) {
        self.close("completed");
        let output_index = self.response.output.len() as u32;
        let prefix = match open {
            Open::Reasoning { .. } => "rs",
            Open::Message { .. } => "msg",
            Open::Call { .. } => "fc",
        };
        let id = format!("{prefix}_{}_{output_index}", self.tag);
        let mut item = self.item(&id, &open, "in_progress");
        // Announced empty: the text comes in deltas.
        match &mut item {
            OutputItem::Reasoning { content, .. } => content.clear(),
            OutputItem::Message { content, .. } => content.clear(),
            OutputItem::FunctionCall { .. } => {}
        }
        self.emit(|sequence_number| ResponseStreamEvent::OutputItemAdded { sequence_number, output_index, item });
        if matches!(open, Open::Message { .. }) {
            let item_id = id.clone();
            self.emit(|sequence_number| ResponseStreamEvent::ContentPartAdded {
                sequence_number,
                item_id,
                output_index,
                content_index: 0,
                part: OutputContent::OutputText { text: String::new(), annotations: Vec::new() },
            });
        }
        // A placeholder keeps `output_index` counting while the item is open.
        self.response.output.push(self.item(&id, &open, "in_progress"));
        self.open = Some((output_index, id, open));
    }

    /// Closes the open item: its `done` events, and its final form in the response.
    fn close(&mut self, status: &str) {
        let Some((output_index, id, open)) = self.open.take() else { return };
        let item_id = id.clone();
        match &open {
            Open::Reasoning { text } => {
                let text = text.clone();
                self.emit(|sequence_number| ResponseStreamEvent::ReasoningTextDone { sequence_number, item_id, output_index, content_index: 0, text });
            }
            Open::Message { text } => {
                let (t1, t2, id2) = (text.clone(), text.clone(), item_id.clone());
                self.emit(|sequence_number| ResponseStreamEvent::OutputTextDone { sequence_number, item_id, output_index, content_index: 0, text: t1 });
                self.emit(|sequence_number| ResponseStreamEvent::ContentPartDone {
                    sequence_number,
                    item_id: id2,
                    output_index,
                    content_index: 0,
                    part: OutputContent::OutputText { text: t2, annotations: Vec::new() },
                });
            }
            Open::Call { arguments, .. } => {
                let arguments = arguments.clone();
                self.emit(|sequence_number| ResponseStreamEvent::FunctionCallArgumentsDone { sequence_number, item_id, output_index, arguments });
            }
        }
        let item = self.item(&id, &open, status);
        self.response.output[output_index as usize] = item.clone();
        self.emit(|sequence_number| ResponseStreamEvent::OutputItemDone { sequence_number, output_index, item });
    }
}

impl Turn for ResponseTurn {
    fn started(&mut self, _cached_tokens: usize) {
        let r = Box::new(self.response.clone());
        self.emit(|sequence_number| ResponseStreamEvent::InProgress { sequence_number, response: r });
    }

    fn deltas(&mut self, deltas: &[Delta]) {
        for d in deltas {
            match d {
                Delta::Reasoning(t) => {
                    if !matches!(self.open, Some((_, _, Open::Reasoning { .. }))) {
                        self.open(Open::Reasoning { text: String::new() });
                    }
                    let Some((output_index, id, Open::Reasoning { text })) = &mut self.open else { unreachable!() };
                    text.push_str(t);
                    let (output_index, item_id, delta) = (*output_index, id.clone(), t.clone());
                    self.emit(|sequence_number| ResponseStreamEvent::ReasoningTextDelta { sequence_number, item_id, output_index, content_index: 0, delta });
                }
                Delta::Content(t) => {
                    if !matches!(self.open, Some((_, _, Open::Message { .. }))) {
                        self.open(Open::Message { text: String::new() });
                    }
                    let Some((output_index, id, Open::Message { text })) = &mut self.open else { unreachable!() };
                    text.push_str(t);
                    let (output_index, item_id, delta) = (*output_index, id.clone(), t.clone());
                    self.emit(|sequence_number| ResponseStreamEvent::OutputTextDelta { sequence_number, item_id, output_index, content_index: 0, delta });
                }
                Delta::ToolCallStart { id, name, .. } => self.open(Open::Call { call_id: id.clone(), name: name.clone(), arguments: String::new() }),
                Delta::ToolCallArguments { arguments: a, .. } => {
                    let Some((output_index, id, Open::Call { arguments, .. })) = &mut self.open else { continue };
                    arguments.push_str(a);
                    let (output_index, item_id, delta) = (*output_index, id.clone(), a.clone());
                    self.emit(|sequence_number| ResponseStreamEvent::FunctionCallArgumentsDelta { sequence_number, item_id, output_index, delta });
                }
            }
        }
    }

    fn finished(&mut self, f: &Finished, end: &TurnEnd) {
        let cut = *end == TurnEnd::Length;
        self.close(if cut { "incomplete" } else { "completed" });
        self.response.usage = Some(ResponseUsage::new(f.usage.prompt_tokens as u32, f.usage.completion_tokens as u32, f.usage.cached_tokens as u32, 0));
        if cut {
            self.response.status = "incomplete".into();
            self.response.incomplete_details = Some(IncompleteDetails { reason: "max_output_tokens".into() });
            let response = Box::new(self.response.clone());
            self.emit(|sequence_number| ResponseStreamEvent::Incomplete { sequence_number, response });
        } else {
            self.response.status = "completed".into();
            let response = Box::new(self.response.clone());
            self.emit(|sequence_number| ResponseStreamEvent::Completed { sequence_number, response });
        }
    }

    fn failed(&mut self, e: &ApiError) {
        self.close("incomplete");
        self.response.status = "failed".into();
        self.response.error = Some(serde_json::json!({"code": e.code.unwrap_or("server_error"), "message": e.message}));
        let response = Box::new(self.response.clone());
        self.emit(|sequence_number| ResponseStreamEvent::Failed { sequence_number, response });
    }

    fn take_events(&mut self) -> Vec<SseEvent> {
        std::mem::take(&mut self.events)
    }
}

/// `POST /v1/responses`.
pub async fn responses(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let tag = format!("{:016x}", st.fresh().1);
    let mut log = RequestLog::new(format!("resp_{tag}"), "responses", start);
    let prepared = (|| {
        let r: ResponsesRequest = parse_body(body)?;
        check_model(&st, r.model.as_deref())?;
        let req = r.validate()?;
        let rendered = render(&st, &req.prompt, "input")?;
        let job = job(&st, &req.sampling, vec![rendered.ids], Fields { prompt: "input", max_tokens: "max_output_tokens" })?;
        let parser = req.prompt.parser_options(&rendered.text, format!("call_{tag}_"));
        Ok::<_, ApiError>((r, req, job, parser, rendered.text))
    })();
    let (r, req, mut job, parser, text) = match prepared {
        Ok(p) => p,
        Err(e) => return log.fail(&st, e),
    };
    match constraint(&st, &req.output_format, &req.prompt, &text, "text.format.schema").await {
        Ok(c) => job.constraint = c,
        Err(e) => return log.fail(&st, e),
    }
    log.prompt_tokens = job.prompts[0].len();
    let mut choices = match submit(&st, &job, start) {
        Ok(c) => c,
        Err(e) => return log.fail(&st, e),
    };
    let choice = choices.remove(0);
    let response = ResponseObject {
        id: log.id.clone(),
        object: "response".into(),
        created_at: super::unix_now(),
        status: "in_progress".into(),
        model: st.config.model_id.clone(),
        output: Vec::new(),
        usage: None,
        incomplete_details: None,
        error: None,
        instructions: r.instructions.clone(),
        max_output_tokens: r.max_output_tokens,
        parallel_tool_calls: req.prompt.parallel_tool_calls,
        store: false,
        temperature: r.temperature,
        top_p: r.top_p,
        metadata: r.metadata.clone(),
    };
    let mut turn = ResponseTurn::new(tag, response);
    let parsed = Parsed::new(OutputParser::new(parser));
    if req.stream {
        return stream_turn(choice, parsed, turn, log, st.config.keep_alive);
    }
    match run_turn(choice, parsed, &mut turn, &mut log).await {
        Ok(_) => {
            log.answered(format!("finished: {}", turn.response.status));
            let mut v = serde_json::to_value(&turn.response).unwrap_or_default();
            v["system_fingerprint"] = serde_json::Value::String(st.config.fingerprint.clone());
            Json(v).into_response()
        }
        Err(e) => log.fail(&st, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{FinishReason, Usage};

    fn turn() -> ResponseTurn {
        let response = ResponseObject {
            id: "resp_x".into(),
            object: "response".into(),
            created_at: 0,
            status: "in_progress".into(),
            model: "m".into(),
            output: Vec::new(),
            usage: None,
            incomplete_details: None,
            error: None,
            instructions: None,
            max_output_tokens: None,
            parallel_tool_calls: true,
            store: false,
            temperature: None,
            top_p: None,
            metadata: None,
        };
        ResponseTurn::new("t".into(), response)
    }

    fn finished(reason: FinishReason) -> Finished {
        Finished { reason, usage: Usage { prompt_tokens: 5, completion_tokens: 7, cached_tokens: 2 }, saved: None }
    }

    /// Each event's `type` and `sequence_number`, from the SSE events' debug form.
    fn types(events: &[SseEvent]) -> Vec<String> {
        events.iter().map(|e| format!("{e:?}")).map(|s| s.split("event: ").nth(1).and_then(|r| r.split(['\\', '\n']).next()).unwrap_or_default().to_string()).collect()
    }

    #[test]
    fn items_follow_the_order_the_model_wrote_them() {
        let mut t = turn();
        t.started(2);
        t.deltas(&[Delta::Reasoning("think".into()), Delta::Content("Hi".into()), Delta::Content(" there".into())]);
        t.deltas(&[Delta::ToolCallStart { index: 0, id: "call_0".into(), name: "f".into() }, Delta::ToolCallArguments { index: 0, arguments: "{\"a\": 1}".into() }]);
        t.finished(&finished(FinishReason::Eos(1)), &TurnEnd::ToolCalls);
        let r = &t.response;
        assert_eq!(r.status, "completed");
        assert_eq!(r.output.len(), 3);
        assert!(matches!(&r.output[0], OutputItem::Reasoning { id, content, .. } if id == "rs_t_0" && content[0].text == "think"));
        assert!(
            matches!(&r.output[1], OutputItem::Message { content, status, .. } if status == "completed" && content == &[OutputContent::OutputText { text: "Hi there".into(), annotations: vec![] }])
        );
        assert!(matches!(&r.output[2], OutputItem::FunctionCall { call_id, arguments, .. } if call_id == "call_0" && arguments == "{\"a\": 1}"));
        assert_eq!(r.usage.unwrap().input_tokens_details.cached_tokens, 2);
        let ev = types(&t.take_events());
        assert_eq!(ev.first().map(String::as_str), Some("response.created"));
        assert_eq!(ev.last().map(String::as_str), Some("response.completed"));
        let added = ev.iter().filter(|e| *e == "response.output_item.added").count();
        let done = ev.iter().filter(|e| *e == "response.output_item.done").count();
        assert_eq!((added, done), (3, 3));
        assert_eq!(ev.iter().filter(|e| *e == "response.output_text.delta").count(), 2);
    }

    #[test]
    fn a_length_cut_is_incomplete() {
        let mut t = turn();
        t.deltas(&[Delta::Content("partial".into())]);
        t.finished(&finished(FinishReason::Length), &TurnEnd::Length);
        assert_eq!(t.response.status, "incomplete");
        assert_eq!(t.response.incomplete_details.as_ref().unwrap().reason, "max_output_tokens");
        assert!(matches!(&t.response.output[0], OutputItem::Message { status, .. } if status == "incomplete"));
        assert_eq!(types(&t.take_events()).last().map(String::as_str), Some("response.incomplete"));
    }
}
