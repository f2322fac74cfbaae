//! The text layer of `tensorfold serve`: what the HTTP handlers parse, check, render and send.
//!
//! - [`openai`]: `POST /v1/chat/completions`, `/v1/completions` and `/v1/responses` (the
//!   stateless subset) — request and response types, validation, and conversion of the
//!   messages into the JSON the chat template renders.
//! - [`anthropic`]: `POST /v1/messages` and `/v1/messages/count_tokens`, the same.
//! - [`error`]: the request errors, naming the field at fault, in each API's error shape.
//! - [`parse`]: the streaming parser that splits a completion into reasoning, content and tool
//!   calls.
//!
//! Nothing here depends on the runtime: a handler validates a request into a
//! [`ChatPrompt`](openai::ChatPrompt) (template messages + kwargs + tools) and
//! [`SamplingOptions`](openai::SamplingOptions), renders and encodes the prompt with
//! [`crate::tokenizer`], runs it, and feeds the decoded text through
//! [`parse::OutputParser`] into the response types.

pub mod parse;
