//! The OpenAI API: `POST /v1/chat/completions`, `/v1/completions` and `/v1/responses`
//! (stateless: no stored responses, no `previous_response_id`).
//!
//! Request types accept what clients send (unknown fields are ignored; extensions such as
//! `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` and `chat_template_kwargs` are read as
//! vLLM reads them); `validate` checks them and converts the messages into the JSON the chat
//! template renders. Response and stream-chunk types serialize to OpenAI's shapes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use super::error::RequestError;
use super::parse::{Delta, ParsedToolCall};
use super::{check_range, push_message, set_thinking, stop_strings, top_k, ChatPrompt, ChatRequest, OutputFormat, SamplingOptions, ToolChoice, ToolSet};

// ---------------------------------------------------------------------------------------------
// Shared request pieces

/// A string or a list of strings (`stop`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    /// One string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StringOrList {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `usage: null` before it).
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A function tool definition (`tools[].function`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDefinition {
    /// The function's name.
    pub name: String,
    /// What it does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its arguments' JSON schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Json>,
    /// Strict schema adherence (not enforced here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A chat completions tool: `{"type": "function", "function": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    /// `function` (the only type served).
    #[serde(rename = "type")]
    pub kind: String,
    /// The function.
    #[serde(default)]
    pub function: Option<FunctionDefinition>,
}

/// `tool_choice`: `"auto"`, `"none"`, `"required"`, or a named function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceParam {
    /// `auto`, `none` or `required`.
    Mode(String),
    /// `{"type": "function", "function": {"name": ...}}` (chat) or
    /// `{"type": "function", "name": ...}` (Responses).
    Named {
        /// `function`.
        #[serde(rename = "type")]
        kind: String,
        /// The function (chat completions).
        #[serde(default)]
        function: Option<NamedFunction>,
        /// The function's name (Responses).
        #[serde(default)]
        name: Option<String>,
    },
}

/// A function named by `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedFunction {
    /// Its name.
    pub name: String,
}

impl ToolChoiceParam {
    fn resolve(&self, field: &str) -> Result<ToolChoice, RequestError> {
        match self {
            Self::Mode(m) => match m.as_str() {
                "auto" => Ok(ToolChoice::Auto),
                "none" => Ok(ToolChoice::None),
                "required" => Ok(ToolChoice::Required),
                other => Err(RequestError::invalid(field, format!("must be \"auto\", \"none\", \"required\" or a named function, got {other:?}"))),
            },
            Self::Named { kind, function, name } => {
                if kind != "function" {
                    return Err(RequestError::unsupported(format!("{field}.type"), format!("only function tools are served, got {kind:?}")));
                }
                match (function, name) {
                    (Some(f), _) => Ok(ToolChoice::Function(f.name.clone())),
                    (None, Some(n)) => Ok(ToolChoice::Function(n.clone())),
                    (None, None) => Err(RequestError::missing(format!("{field}.function.name"))),
                }
            }
        }
    }
}

/// `response_format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON following a schema.
    JsonSchema {
        /// The schema.
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonSchemaFormat {
    /// The schema's name.
    pub name: String,
    /// What the output is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Json>,
    /// Follow the schema exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl From<&ResponseFormat> for OutputFormat {
    fn from(f: &ResponseFormat) -> Self {
        match f {
            ResponseFormat::Text => Self::Text,
            ResponseFormat::JsonObject => Self::JsonObject,
            ResponseFormat::JsonSchema { json_schema } => {
                Self::JsonSchema { name: json_schema.name.clone(), schema: json_schema.schema.clone(), strict: json_schema.strict.unwrap_or(false) }
            }
        }
    }
}

/// Sampling fields common to the three endpoints, checked.
#[allow(clippy::too_many_arguments)]
fn sampling(
    max_tokens: Option<u32>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k_value: Option<i64>,
    min_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    seed: Option<i64>,
    n: Option<u32>,
) -> Result<SamplingOptions, RequestError> {
    if max_tokens == Some(0) {
        return Err(RequestError::invalid("max_tokens", "must be at least 1"));
    }
    check_range("temperature", temperature, 0.0, 2.0)?;
    if top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(RequestError::invalid("top_p", format!("must be in (0, 1], got {}", top_p.unwrap_or_default())));
    }
    check_range("min_p", min_p, 0.0, 1.0)?;
    check_range("presence_penalty", presence_penalty, -2.0, 2.0)?;
    check_range("frequency_penalty", frequency_penalty, -2.0, 2.0)?;
    if let Some(r) = repetition_penalty {
        if r <= 0.0 {
            return Err(RequestError::invalid("repetition_penalty", format!("must be greater than 0, got {r}")));
        }
    }
    // -1 asks for a fresh seed, as in llama.cpp; any other value is used as its 64 bits.
    let seed = seed.filter(|&s| s != -1).map(|s| s as u64);
    if n == Some(0) {
        return Err(RequestError::invalid("n", "must be at least 1"));
    }
    Ok(SamplingOptions {
        max_tokens,
        temperature,
        top_p,
        top_k: top_k("top_k", top_k_value)?,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        seed,
        n: n.unwrap_or(1),
        ..SamplingOptions::default()
    })
}

/// `repeat_last_n`: -1 (everything), 0 (off) or a window in tokens.
fn repeat_last_n(value: Option<i64>) -> Result<Option<i64>, RequestError> {
    match value {
        Some(n) if n < -1 => Err(RequestError::invalid("repeat_last_n", format!("must be -1 (everything), 0 (off) or a positive count, got {n}"))),
        v => Ok(v),
    }
}

/// `logit_bias`: token id (a decimal string) → bias in [-100, 100].
fn logit_bias(bias: Option<&BTreeMap<String, f64>>, vocab_size: usize) -> Result<Vec<(u32, f32)>, RequestError> {
    let Some(bias) = bias else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(bias.len());
    for (key, &value) in bias {
        let field = format!("logit_bias.{key}");
        let id: u32 = key.parse().map_err(|_| RequestError::invalid(&field, "keys must be token ids"))?;
        if id as usize >= vocab_size {
            return Err(RequestError::invalid(&field, format!("token id {id} is outside the vocabulary ({vocab_size} ids)")));
        }
        check_range(&field, Some(value), -100.0, 100.0)?;
        out.push((id, value as f32));
    }
    Ok(out)
}

/// `chat_template_kwargs`, less the variables the server sets itself.
fn template_kwargs(kwargs: Option<&Map<String, Json>>) -> Result<Map<String, Json>, RequestError> {
    let kwargs = kwargs.cloned().unwrap_or_default();
    for reserved in ["messages", "tools", "add_generation_prompt"] {
        if kwargs.contains_key(reserved) {
            return Err(RequestError::invalid(format!("chat_template_kwargs.{reserved}"), "is set by the server"));
        }
    }
    Ok(kwargs)
}

/// The thinking switch of `reasoning_effort` / `reasoning.effort` (`field`): Qwen3.5's template
/// has only `enable_thinking`, so `none` and `minimal` (OpenAI's "no or almost no reasoning")
/// turn it off and `low` to `xhigh` (and `max`, which other servers take) turn it on, as ollama
/// maps efforts for models whose thinking is on or off. Any other value is refused, as OpenAI
/// refuses it. The request's own `chat_template_kwargs.enable_thinking` wins ([`set_thinking`]).
fn thinking_of_effort(field: &str, effort: Option<&str>) -> Result<Option<bool>, RequestError> {
    match effort {
        None => Ok(None),
        Some("none" | "minimal") => Ok(Some(false)),
        Some("low" | "medium" | "high" | "xhigh" | "max") => Ok(Some(true)),
        Some(other) => Err(RequestError::invalid(field, format!("must be one of \"none\", \"minimal\", \"low\", \"medium\", \"high\", \"xhigh\", \"max\", got {other:?}"))),
    }
}

/// Decodes a tool call's `arguments` (a JSON string, as OpenAI clients send it, or an object)
/// into the object the template iterates.
fn decode_arguments(field: &str, arguments: Option<&Json>) -> Result<Json, RequestError> {
    let object = match arguments {
        None | Some(Json::Null) => return Ok(Json::Object(Map::new())),
        Some(Json::String(s)) if s.trim().is_empty() => return Ok(Json::Object(Map::new())),
        Some(Json::String(s)) => serde_json::from_str::<Json>(s).map_err(|e| RequestError::invalid(field, format!("is not valid JSON: {e}")))?,
        Some(other) => other.clone(),
    };
    if !object.is_object() {
        return Err(RequestError::invalid(field, "must be a JSON object"));
    }
    Ok(object)
}

fn template_tool_call(id: Option<&str>, name: &str, arguments: Json) -> Json {
    let mut call = Map::new();
    if let Some(id) = id {
        call.insert("id".into(), Json::String(id.to_string()));
    }
    call.insert("type".into(), Json::String("function".into()));
    call.insert("function".into(), serde_json::json!({"name": name, "arguments": arguments}));
    Json::Object(call)
}

fn message(role: &str, content: String) -> Map<String, Json> {
    let mut m = Map::new();
    m.insert("role".into(), Json::String(role.to_string()));
    m.insert("content".into(), Json::String(content));
    m
}

// ---------------------------------------------------------------------------------------------
// POST /v1/chat/completions

/// Message content: a string or an array of parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts (`{"type": "text", "text": ...}`).
    Parts(Vec<ContentPart>),
}

/// One content part. Only text is served; other types are refused by validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentPart {
    /// `text` (chat), `input_text` / `output_text` (Responses), `image_url`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a text part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// Joins text parts as Qwen3.5's template renders a list of them (no separator); refuses
/// others.
fn content_text(field: &str, content: Option<&MessageContent>, text_kinds: &[&str]) -> Result<String, RequestError> {
    match content {
        None => Ok(String::new()),
        Some(MessageContent::Text(s)) => Ok(s.clone()),
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                if !text_kinds.contains(&part.kind.as_str()) {
                    return Err(RequestError::unsupported(format!("{field}[{j}].type"), format!("{:?} content is not supported: the model reads text only", part.kind)));
                }
                match &part.text {
                    Some(t) => text.push_str(t),
                    None => return Err(RequestError::missing(format!("{field}[{j}].text"))),
                }
            }
            Ok(text)
        }
    }
}

/// A tool call in an assistant message of the request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageToolCall {
    /// The call's id.
    #[serde(default)]
    pub id: Option<String>,
    /// `function`.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// The call.
    pub function: MessageFunctionCall,
}

/// The function of a [`MessageToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageFunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments: a JSON string (OpenAI), or an object (accepted too).
    #[serde(default)]
    pub arguments: Option<Json>,
}

/// A message of a chat completions request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (null for an assistant message that only calls tools).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// A participant name (not rendered by the template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant message's reasoning (llama.cpp, mistral.rs, OpenCode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// An assistant message's reasoning (vLLM's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ChatCompletionRequest {
    /// The model's name (any name is served by the one model).
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Most tokens to generate (deprecated by OpenAI for `max_completion_tokens`).
    pub max_tokens: Option<u32>,
    /// Most tokens to generate; wins over `max_tokens`.
    pub max_completion_tokens: Option<u32>,
    /// Sampling temperature, 0–2.
    pub temperature: Option<f64>,
    /// Nucleus sampling mass.
    pub top_p: Option<f64>,
    /// Top-k sampling (-1 or 0: off).
    pub top_k: Option<i64>,
    /// Min-p sampling.
    pub min_p: Option<f64>,
    /// Presence penalty, -2–2.
    pub presence_penalty: Option<f64>,
    /// Frequency penalty, -2–2.
    pub frequency_penalty: Option<f64>,
    /// Repetition penalty (> 0, 1: off).
    pub repetition_penalty: Option<f64>,
    /// The penalties' window in tokens (llama.cpp's extension; -1: everything, 0: off).
    pub repeat_last_n: Option<i64>,
    /// Sampler seed (-1: a fresh one).
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StringOrList>,
    /// Number of choices.
    pub n: Option<u32>,
    /// Return log-probabilities of the chosen tokens.
    pub logprobs: Option<bool>,
    /// With `logprobs`, this many alternatives per token (0–20).
    pub top_logprobs: Option<u32>,
    /// Token id → bias.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// Stream chunks.
    pub stream: Option<bool>,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Extra variables for the chat template (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<Map<String, Json>>,
    /// End the prompt with the assistant's opening (vLLM's extension; default true).
    pub add_generation_prompt: Option<bool>,
    /// Reasoning effort: `none` / `minimal` turn thinking off, `low` to `xhigh` and `max` on
    /// (`thinking_of_effort`).
    pub reasoning_effort: Option<String>,
    /// Output format.
    pub response_format: Option<ResponseFormat>,
    /// Tools the model may call.
    pub tools: Option<Vec<Tool>>,
    /// Whether and which tool to call.
    pub tool_choice: Option<ToolChoiceParam>,
    /// Several calls per turn.
    pub parallel_tool_calls: Option<bool>,
    /// End-user id (unused).
    pub user: Option<String>,
}

impl ChatCompletionRequest {
    /// Checks the request and converts it; `vocab_size` bounds `logit_bias` keys.
    pub fn validate(&self, vocab_size: usize) -> Result<ChatRequest, RequestError> {
        let mut sampling = sampling(
            self.max_completion_tokens.or(self.max_tokens),
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.seed,
            self.n,
        )
        .map_err(|e| rename_max_tokens(e, self.max_completion_tokens.is_some()))?;
        sampling.stop = stop_strings("stop", self.stop.clone().map_or(Vec::new(), StringOrList::into_vec))?;
        sampling.logit_bias = logit_bias(self.logit_bias.as_ref(), vocab_size)?;
        sampling.ignore_eos = self.ignore_eos.unwrap_or(false);
        sampling.repeat_last_n = repeat_last_n(self.repeat_last_n)?;
        sampling.logprobs = chat_logprobs(self.logprobs, self.top_logprobs)?;

        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(RequestError::invalid("stream_options", "is only allowed with `stream: true`"));
        }

        let mut prompt = ChatPrompt {
            messages: chat_messages(&self.messages)?,
            kwargs: template_kwargs(self.chat_template_kwargs.as_ref())?,
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            add_generation_prompt: self.add_generation_prompt,
            ..ChatPrompt::default()
        };
        set_thinking(&mut prompt.kwargs, thinking_of_effort("reasoning_effort", self.reasoning_effort.as_deref())?);
        let mut tools = ToolSet::default();
        for (i, tool) in self.tools.iter().flatten().enumerate() {
            if tool.kind != "function" {
                return Err(RequestError::unsupported(format!("tools[{i}].type"), format!("only function tools are served, got {:?}", tool.kind)));
            }
            let Some(f) = &tool.function else {
                return Err(RequestError::missing(format!("tools[{i}].function")));
            };
            tools.add(&format!("tools[{i}].function"), "parameters", &f.name, f.description.as_deref(), f.parameters.as_ref())?;
        }
        if let Some(choice) = &self.tool_choice {
            prompt.tool_choice = choice.resolve("tool_choice")?;
            tools.check_choice(&prompt.tool_choice, "tool_choice")?;
        }
        tools.into_prompt(&mut prompt);

        Ok(ChatRequest {
            model: self.model.clone(),
            prompt,
            sampling,
            stream,
            include_usage: self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
            output_format: self.response_format.as_ref().map(Into::into).unwrap_or_default(),
        })
    }
}

/// A `max_tokens` error names the field the client used.
fn rename_max_tokens(e: RequestError, completion_field: bool) -> RequestError {
    match e {
        RequestError::Invalid { field, message } if field == "max_tokens" && completion_field => RequestError::Invalid { field: "max_completion_tokens".into(), message },
        e => e,
    }
}

fn chat_logprobs(logprobs: Option<bool>, top: Option<u32>) -> Result<Option<u32>, RequestError> {
    if top.is_some_and(|k| k > 20) {
        return Err(RequestError::invalid("top_logprobs", format!("must be between 0 and 20, got {}", top.unwrap_or_default())));
    }
    match (logprobs.unwrap_or(false), top) {
        (true, k) => Ok(Some(k.unwrap_or(0))),
        (false, Some(_)) => Err(RequestError::invalid("top_logprobs", "requires `logprobs: true`")),
        (false, None) => Ok(None),
    }
}

/// Converts chat messages into the template's messages.
fn chat_messages(messages: &[ChatMessage]) -> Result<Vec<Json>, RequestError> {
    if messages.is_empty() {
        return Err(RequestError::invalid("messages", "must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let content_field = format!("{field}.content");
        let template_message = match m.role.as_str() {
            "system" | "developer" => message("system", content_text(&content_field, m.content.as_ref(), &["text"])?),
            "user" => {
                if m.content.is_none() {
                    return Err(RequestError::missing(content_field));
                }
                message("user", content_text(&content_field, m.content.as_ref(), &["text"])?)
            }
            "assistant" => {
                let text = content_text(&content_field, m.content.as_ref(), &["text", "refusal"])?;
                let mut a = message("assistant", text);
                if let Some(r) = m.reasoning_content.as_ref().or(m.reasoning.as_ref()) {
                    a.insert("reasoning_content".into(), Json::String(r.clone()));
                }
                if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    let mut list = Vec::with_capacity(calls.len());
                    for (j, call) in calls.iter().enumerate() {
                        let call_field = format!("{field}.tool_calls[{j}]");
                        if call.kind.as_deref().is_some_and(|k| k != "function") {
                            return Err(RequestError::unsupported(format!("{call_field}.type"), "only function calls are served"));
                        }
                        let args = decode_arguments(&format!("{call_field}.function.arguments"), call.function.arguments.as_ref())?;
                        list.push(template_tool_call(call.id.as_deref(), &call.function.name, args));
                    }
                    a.insert("tool_calls".into(), Json::Array(list));
                }
                a
            }
            "tool" => {
                let mut t = message("tool", content_text(&content_field, m.content.as_ref(), &["text"])?);
                if let Some(id) = &m.tool_call_id {
                    t.insert("tool_call_id".into(), Json::String(id.clone()));
                }
                t
            }
            "function" => return Err(RequestError::unsupported(format!("{field}.role"), "the legacy \"function\" role is not supported; use \"tool\"")),
            other => return Err(RequestError::invalid(format!("{field}.role"), format!("unknown role {other:?}"))),
        };
        push_message(&mut out, Json::Object(template_message));
    }
    Ok(out)
}

/// Why generation stopped (OpenAI `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
    /// The model called tools.
    ToolCalls,
    /// Refused by a content filter.
    ContentFilter,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens reused from the prefix cache.
    pub cached_tokens: u32,
}

/// `usage.completion_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CompletionTokensDetails {
    /// Generated tokens spent on reasoning.
    pub reasoning_tokens: u32,
}

/// Token counts of a chat or text completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Their sum.
    pub total_tokens: u32,
    /// Cached prompt tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// Reasoning tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

impl Usage {
    /// Usage with the total filled in and the cached count given.
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
            completion_tokens_details: None,
        }
    }
}

/// A tool call of a response message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The call.
    pub function: FunctionCall,
}

/// The function of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text.
    pub arguments: String,
}

impl From<&ParsedToolCall> for ToolCall {
    fn from(c: &ParsedToolCall) -> Self {
        Self { id: c.id.clone(), kind: "function".into(), function: FunctionCall { name: c.name.clone(), arguments: c.arguments.clone() } }
    }
}

/// The assistant message of a chat completion choice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseMessage {
    /// `assistant`.
    pub role: String,
    /// The answer (null when the model only called tools).
    pub content: Option<String>,
    /// The reasoning, under llama.cpp's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The reasoning, under vLLM's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

impl ResponseMessage {
    /// The message of a parsed completion: empty reasoning and content become absent/null,
    /// reasoning is given under both names.
    pub fn from_parsed(parsed: &super::parse::ParsedOutput) -> Self {
        let reasoning = (!parsed.reasoning.is_empty()).then(|| parsed.reasoning.clone());
        Self {
            role: "assistant".into(),
            content: (!parsed.content.is_empty() || parsed.tool_calls.is_empty()).then(|| parsed.content.clone()),
            reasoning_content: reasoning.clone(),
            reasoning,
            tool_calls: parsed.tool_calls.iter().map(ToolCall::from).collect(),
        }
    }
}

/// One choice of a chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Its index.
    pub index: u32,
    /// The message.
    pub message: ResponseMessage,
    /// Log-probabilities (`{"content": [...]}`), when asked for.
    pub logprobs: Option<Json>,
    /// Why generation stopped.
    pub finish_reason: Option<FinishReason>,
}

/// A `chat.completion` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion {
    /// The completion's id (`chatcmpl-...`).
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix time of creation.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// The choices.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Option<Usage>,
}

impl ChatCompletion {
    /// A completion with `object` set.
    pub fn new(id: String, created: u64, model: String, choices: Vec<ChatChoice>, usage: Usage) -> Self {
        Self { id, object: "chat.completion".into(), created, model, choices, usage: Some(usage) }
    }
}

/// The function part of a streamed tool-call delta.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FunctionCallDelta {
    /// The name (first delta of a call only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next fragment of the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// A streamed tool-call delta: the first carries id, type and name, later ones arguments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// Which call.
    pub index: u32,
    /// The call's id (first delta only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (first delta only).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name and arguments.
    pub function: FunctionCallDelta,
}

/// The `delta` of a chunk choice.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ChunkDelta {
    /// `assistant` in the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// More answer text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// More reasoning (llama.cpp's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// More reasoning (vLLM's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Tool-call deltas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

impl From<&Delta> for ChunkDelta {
    fn from(d: &Delta) -> Self {
        match d {
            Delta::Reasoning(t) => Self { reasoning_content: Some(t.clone()), reasoning: Some(t.clone()), ..Self::default() },
            Delta::Content(t) => Self { content: Some(t.clone()), ..Self::default() },
            Delta::ToolCallStart { index, id, name } => Self {
                tool_calls: Some(vec![ToolCallDelta {
                    index: *index as u32,
                    id: Some(id.clone()),
                    kind: Some("function".into()),
                    function: FunctionCallDelta { name: Some(name.clone()), arguments: Some(String::new()) },
                }]),
                ..Self::default()
            },
            Delta::ToolCallArguments { index, arguments } => Self {
                tool_calls: Some(vec![ToolCallDelta {
                    index: *index as u32,
                    id: None,
                    kind: None,
                    function: FunctionCallDelta { name: None, arguments: Some(arguments.clone()) },
                }]),
                ..Self::default()
            },
        }
    }
}

/// One choice of a chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChunkChoice {
    /// Which choice.
    pub index: u32,
    /// What is new.
    pub delta: ChunkDelta,
    /// Log-probabilities of this chunk's tokens.
    pub logprobs: Option<Json>,
    /// Set in the choice's last chunk.
    pub finish_reason: Option<FinishReason>,
}

/// A `chat.completion.chunk` stream event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// The completion's id (the same in every chunk).
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: String,
    /// Unix time of creation.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// The choices (empty in the usage chunk).
    pub choices: Vec<ChunkChoice>,
    /// Null in every chunk but the last when `include_usage` is set; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

impl ChatCompletionChunk {
    /// A chunk with `object` set.
    pub fn new(id: String, created: u64, model: String, choices: Vec<ChunkChoice>) -> Self {
        Self { id, object: "chat.completion.chunk".into(), created, model, choices, usage: None }
    }
}

// ---------------------------------------------------------------------------------------------
// POST /v1/completions

/// `prompt` of a completions request: text(s) or token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    /// One text.
    Text(String),
    /// Several texts (one completion each).
    Texts(Vec<String>),
    /// One prompt as token ids.
    Ids(Vec<u32>),
    /// Several prompts as token ids.
    IdLists(Vec<Vec<u32>>),
}

/// One prompt of a completions request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text, to be encoded.
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The model's name.
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt(s).
    pub prompt: CompletionPrompt,
    /// Most tokens to generate (OpenAI's default: 16).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Top-k (-1 or 0: off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Min-p.
    #[serde(default)]
    pub min_p: Option<f64>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    /// Repetition penalty.
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// The penalties' window (llama.cpp's extension; -1: everything, 0: off).
    #[serde(default)]
    pub repeat_last_n: Option<i64>,
    /// Sampler seed (-1: a fresh one).
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StringOrList>,
    /// Completions per prompt.
    #[serde(default)]
    pub n: Option<u32>,
    /// Log-probabilities with this many alternatives per token (0–5).
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Prepend the prompt to the text.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Text after the completion (not supported).
    #[serde(default)]
    pub suffix: Option<String>,
    /// Server-side candidates (only 1 supported).
    #[serde(default)]
    pub best_of: Option<u32>,
    /// Token id → bias.
    #[serde(default)]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Generate past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// json_object or json_schema: the completion is constrained to it (vLLM and llama.cpp
    /// accept it here too).
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// Stream chunks.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Stream options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// End-user id (unused).
    #[serde(default)]
    pub user: Option<String>,
}

/// A checked completions request.
#[derive(Debug, Clone, PartialEq)]
pub struct TextCompletionJob {
    /// The model the client named.
    pub model: Option<String>,
    /// The prompts, each completed `sampling.n` times.
    pub prompts: Vec<Prompt>,
    /// Sampling settings (`max_tokens` defaults to 16 as in OpenAI and vLLM).
    pub sampling: SamplingOptions,
    /// Prepend each prompt to its text.
    pub echo: bool,
    /// What each completion must be (`response_format`).
    pub output_format: OutputFormat,
    /// Stream chunks.
    pub stream: bool,
    /// Send usage in the stream.
    pub include_usage: bool,
}

impl CompletionRequest {
    /// Checks the request; `vocab_size` bounds token ids and `logit_bias` keys.
    pub fn validate(&self, vocab_size: usize) -> Result<TextCompletionJob, RequestError> {
        let mut sampling = sampling(
            Some(self.max_tokens.unwrap_or(16)),
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.seed,
            self.n,
        )?;
        sampling.stop = stop_strings("stop", self.stop.clone().map_or(Vec::new(), StringOrList::into_vec))?;
        sampling.logit_bias = logit_bias(self.logit_bias.as_ref(), vocab_size)?;
        sampling.ignore_eos = self.ignore_eos.unwrap_or(false);
        sampling.repeat_last_n = repeat_last_n(self.repeat_last_n)?;
        if let Some(k) = self.logprobs {
            if k > 5 {
                return Err(RequestError::invalid("logprobs", format!("must be between 0 and 5, got {k}")));
            }
            sampling.logprobs = Some(k);
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(RequestError::unsupported("suffix", "insertion after a suffix is not supported"));
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(RequestError::unsupported("best_of", "only best_of = 1 is supported"));
        }
        let prompts = match &self.prompt {
            CompletionPrompt::Text(t) => vec![Prompt::Text(t.clone())],
            CompletionPrompt::Texts(ts) => ts.iter().cloned().map(Prompt::Text).collect(),
            CompletionPrompt::Ids(ids) => vec![Prompt::Ids(ids.clone())],
            CompletionPrompt::IdLists(l) => l.iter().cloned().map(Prompt::Ids).collect(),
        };
        if prompts.is_empty() {
            return Err(RequestError::invalid("prompt", "must not be empty"));
        }
        let single = prompts.len() == 1;
        for (i, p) in prompts.iter().enumerate() {
            let field = if single { "prompt".to_string() } else { format!("prompt[{i}]") };
            match p {
                Prompt::Ids(ids) if ids.is_empty() => return Err(RequestError::invalid(field, "must not be empty")),
                Prompt::Ids(ids) => {
                    if let Some(j) = ids.iter().position(|&id| id as usize >= vocab_size) {
                        return Err(RequestError::invalid(format!("{field}[{j}]"), format!("token id {} is outside the vocabulary ({vocab_size} ids)", ids[j])));
                    }
                }
                Prompt::Text(_) => {}
            }
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(RequestError::invalid("stream_options", "is only allowed with `stream: true`"));
        }
        Ok(TextCompletionJob {
            model: self.model.clone(),
            prompts,
            sampling,
            echo: self.echo.unwrap_or(false),
            output_format: self.response_format.as_ref().map(Into::into).unwrap_or_default(),
            stream,
            include_usage: self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        })
    }
}

/// One choice of a text completion (or of one of its stream chunks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// The text (a chunk's new text when streaming).
    pub text: String,
    /// Which choice (prompt index × n + sample index).
    pub index: u32,
    /// Legacy log-probabilities object, when asked for.
    pub logprobs: Option<Json>,
    /// Why generation stopped (in the last chunk).
    pub finish_reason: Option<FinishReason>,
}

/// A `text_completion` response, or one stream chunk of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextCompletion {
    /// The completion's id (`cmpl-...`).
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix time of creation.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// The choices.
    pub choices: Vec<CompletionChoice>,
    /// Token counts (in the response; in the last chunk with `include_usage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl TextCompletion {
    /// A completion or chunk with `object` set.
    pub fn new(id: String, created: u64, model: String, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Self {
        Self { id, object: "text_completion".into(), created, model, choices, usage }
    }
}

// ---------------------------------------------------------------------------------------------
// POST /v1/responses (stateless)

/// `input` of a Responses request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ResponsesInput {
    /// One user message.
    Text(String),
    /// Input items.
    Items(Vec<InputItem>),
}

/// An input item: a message (`type` `message` or absent), `function_call`,
/// `function_call_output` or `reasoning`. One struct for all, so validation can name the
/// field at fault.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct InputItem {
    /// The item type; absent for a plain `{role, content}` message.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// A message's role: `user`, `assistant`, `system`, `developer`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// A message's content: a string or parts (`input_text`, `output_text`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// The item's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// A function call's (or its output's) call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub call_id: Option<String>,
    /// A function call's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A function call's arguments (JSON text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<Json>,
    /// A function call output: a string or content parts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<MessageContent>,
    /// A reasoning item's summary parts (`summary_text`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<Vec<ContentPart>>,
    /// A reasoning item's encrypted content (cannot be read here; ignored).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encrypted_content: Option<String>,
    /// The item's status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// A Responses tool: `{"type": "function", "name", "description", "parameters", "strict"}`;
/// other types (web search, custom, ...) are ignored, as Codex sends them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponsesTool {
    /// `function`; others are skipped.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function's name.
    #[serde(default)]
    pub name: Option<String>,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its arguments' JSON schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Json>,
    /// Strict schema adherence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `reasoning` of a Responses request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ReasoningParam {
    /// `none` / `minimal` (thinking off), `low`, `medium`, `high`, `xhigh`, `max` (on).
    pub effort: Option<String>,
    /// Summary style (no summaries are produced; the reasoning text is returned).
    pub summary: Option<String>,
}

/// `text` of a Responses request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TextParam {
    /// The output format.
    pub format: Option<TextFormat>,
}

/// `text.format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON following a schema.
    JsonSchema {
        /// The schema's name.
        name: String,
        /// The schema.
        #[serde(default)]
        schema: Option<Json>,
        /// Follow exactly.
        #[serde(default)]
        strict: Option<bool>,
    },
}

/// `POST /v1/responses`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponsesRequest {
    /// The model's name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub input: ResponsesInput,
    /// A system message before the input.
    #[serde(default)]
    pub instructions: Option<String>,
    /// Tools.
    #[serde(default)]
    pub tools: Option<Vec<ResponsesTool>>,
    /// Whether and which tool to call.
    #[serde(default)]
    pub tool_choice: Option<ToolChoiceParam>,
    /// Several calls per turn.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Top-k (extension).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Sampler seed (extension; -1: a fresh one).
    #[serde(default)]
    pub seed: Option<i64>,
    /// Generate past end-of-sequence tokens (extension, for benchmarks).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Stream events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Store the response: nothing is stored here, whatever it says.
    #[serde(default)]
    pub store: Option<bool>,
    /// A stored response to continue (not supported: the server is stateless).
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Reasoning settings.
    #[serde(default)]
    pub reasoning: Option<ReasoningParam>,
    /// Output format.
    #[serde(default)]
    pub text: Option<TextParam>,
    /// Extra template variables (extension).
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Json>>,
    /// Client metadata (echoed).
    #[serde(default)]
    pub metadata: Option<Json>,
    /// End-user id (unused).
    #[serde(default)]
    pub user: Option<String>,
}

impl ResponsesRequest {
    /// Checks the request and converts its input into template messages.
    pub fn validate(&self) -> Result<ChatRequest, RequestError> {
        if let Some(id) = &self.previous_response_id {
            return Err(RequestError::unsupported("previous_response_id", format!("this server stores no responses ({id:?}); send the whole input with `store: false`")));
        }
        let mut sampling = sampling(self.max_output_tokens, self.temperature, self.top_p, self.top_k, None, None, None, None, self.seed, None).map_err(|e| match e {
            RequestError::Invalid { field, message } if field == "max_tokens" => RequestError::Invalid { field: "max_output_tokens".into(), message },
            e => e,
        })?;
        sampling.ignore_eos = self.ignore_eos.unwrap_or(false);
        let mut messages = Vec::new();
        if let Some(instructions) = &self.instructions {
            push_message(&mut messages, Json::Object(message("system", instructions.clone())));
        }
        match &self.input {
            ResponsesInput::Text(t) => push_message(&mut messages, Json::Object(message("user", t.clone()))),
            ResponsesInput::Items(items) => responses_messages(items, &mut messages)?,
        }
        if !messages.iter().any(|m| m["role"] != "system") {
            return Err(RequestError::invalid("input", "must hold at least one message"));
        }
        let mut prompt = ChatPrompt {
            messages,
            kwargs: template_kwargs(self.chat_template_kwargs.as_ref())?,
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            ..ChatPrompt::default()
        };
        set_thinking(&mut prompt.kwargs, thinking_of_effort("reasoning.effort", self.reasoning.as_ref().and_then(|r| r.effort.as_deref()))?);
        let mut tools = ToolSet::default();
        for (i, tool) in self.tools.iter().flatten().enumerate() {
            if tool.kind != "function" {
                continue;
            }
            let Some(name) = &tool.name else {
                return Err(RequestError::missing(format!("tools[{i}].name")));
            };
            tools.add(&format!("tools[{i}]"), "parameters", name, tool.description.as_deref(), tool.parameters.as_ref())?;
        }
        if let Some(choice) = &self.tool_choice {
            prompt.tool_choice = choice.resolve("tool_choice")?;
            tools.check_choice(&prompt.tool_choice, "tool_choice")?;
        }
        tools.into_prompt(&mut prompt);
        let output_format = match self.text.as_ref().and_then(|t| t.format.as_ref()) {
            None | Some(TextFormat::Text) => OutputFormat::Text,
            Some(TextFormat::JsonObject) => OutputFormat::JsonObject,
            Some(TextFormat::JsonSchema { name, schema, strict }) => OutputFormat::JsonSchema { name: name.clone(), schema: schema.clone(), strict: strict.unwrap_or(false) },
        };
        Ok(ChatRequest { model: self.model.clone(), prompt, sampling, stream: self.stream.unwrap_or(false), include_usage: true, output_format })
    }
}

/// Converts Responses input items into template messages: consecutive `function_call` items
/// become one assistant message's `tool_calls`, a `reasoning` item the `reasoning_content` of
/// the assistant turn that follows it, each `function_call_output` a tool message.
fn responses_messages(items: &[InputItem], out: &mut Vec<Json>) -> Result<(), RequestError> {
    // Reasoning waiting for its assistant turn.
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let field = format!("input[{i}]");
        let kind = item.kind.as_deref().unwrap_or("message");
        match kind {
            "message" => {
                let Some(role) = item.role.as_deref() else {
                    return Err(RequestError::missing(format!("{field}.role")));
                };
                let text = content_text(&format!("{field}.content"), item.content.as_ref(), &["input_text", "output_text", "text", "refusal"])?;
                let role = match role {
                    "user" => "user",
                    "assistant" => "assistant",
                    "system" | "developer" => "system",
                    other => return Err(RequestError::invalid(format!("{field}.role"), format!("unknown role {other:?}"))),
                };
                let mut m = message(role, text);
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m.insert("reasoning_content".into(), Json::String(r));
                    }
                }
                push_message(out, Json::Object(m));
            }
            "function_call" => {
                let Some(name) = &item.name else {
                    return Err(RequestError::missing(format!("{field}.name")));
                };
                let args = decode_arguments(&format!("{field}.arguments"), item.arguments.as_ref())?;
                let call = template_tool_call(item.call_id.as_deref().or(item.id.as_deref()), name, args);
                // Joins the assistant message just before (its text, or earlier calls).
                let last_is_assistant = out.last().is_some_and(|m| m["role"] == "assistant");
                if !last_is_assistant || reasoning.is_some() {
                    let mut m = message("assistant", String::new());
                    if let Some(r) = reasoning.take() {
                        m.insert("reasoning_content".into(), Json::String(r));
                    }
                    out.push(Json::Object(m));
                }
                if let Some(Json::Object(m)) = out.last_mut() {
                    match m.get_mut("tool_calls") {
                        Some(Json::Array(calls)) => calls.push(call),
                        _ => {
                            m.insert("tool_calls".into(), Json::Array(vec![call]));
                        }
                    }
                }
            }
            "function_call_output" => {
                let text = content_text(&format!("{field}.output"), item.output.as_ref(), &["input_text", "output_text", "text"])?;
                let mut m = message("tool", text);
                if let Some(id) = &item.call_id {
                    m.insert("tool_call_id".into(), Json::String(id.clone()));
                } else {
                    return Err(RequestError::missing(format!("{field}.call_id")));
                }
                out.push(Json::Object(m));
            }
            "reasoning" => {
                let text: Vec<&str> = item
                    .summary
                    .iter()
                    .flatten()
                    .filter_map(|p| p.text.as_deref())
                    .chain(match &item.content {
                        Some(MessageContent::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect::<Vec<_>>(),
                        Some(MessageContent::Text(t)) => vec![t.as_str()],
                        None => Vec::new(),
                    })
                    .collect();
                if !text.is_empty() {
                    reasoning = Some(text.join("\n"));
                }
            }
            other => return Err(RequestError::unsupported(format!("{field}.type"), format!("input items of type {other:?} are not supported"))),
        }
    }
    Ok(())
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Cached prompt tokens.
    pub input_tokens_details: InputTokensDetails,
    /// Generated tokens.
    pub output_tokens: u32,
    /// Reasoning tokens.
    pub output_tokens_details: OutputTokensDetails,
    /// Their sum.
    pub total_tokens: u32,
}

impl ResponseUsage {
    /// Usage with the total filled in.
    pub fn new(input_tokens: u32, output_tokens: u32, cached_tokens: u32, reasoning_tokens: u32) -> Self {
        Self {
            input_tokens,
            input_tokens_details: InputTokensDetails { cached_tokens },
            output_tokens,
            output_tokens_details: OutputTokensDetails { reasoning_tokens },
            total_tokens: input_tokens.saturating_add(output_tokens),
        }
    }
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct InputTokensDetails {
    /// Prompt tokens reused from the prefix cache.
    pub cached_tokens: u32,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct OutputTokensDetails {
    /// Generated tokens spent on reasoning.
    pub reasoning_tokens: u32,
}

/// A content part of an output message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputContent {
    /// Answer text.
    OutputText {
        /// The text.
        text: String,
        /// Citations (always empty).
        annotations: Vec<Json>,
    },
}

/// A reasoning text part (`reasoning_text`) or summary part (`summary_text`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReasoningPart {
    /// `reasoning_text` or `summary_text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: String,
}

/// An output item of a response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The model's reasoning.
    Reasoning {
        /// Item id.
        id: String,
        /// Summaries (none are made).
        summary: Vec<ReasoningPart>,
        /// The reasoning text.
        content: Vec<ReasoningPart>,
    },
    /// An answer message.
    Message {
        /// Item id.
        id: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: String,
        /// `assistant`.
        role: String,
        /// Its parts.
        content: Vec<OutputContent>,
    },
    /// A tool call.
    FunctionCall {
        /// Item id.
        id: String,
        /// The call's id, which the `function_call_output` names.
        call_id: String,
        /// The function.
        name: String,
        /// Arguments as JSON text.
        arguments: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: String,
    },
}

/// `incomplete_details`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncompleteDetails {
    /// `max_output_tokens` or `content_filter`.
    pub reason: String,
}

/// A `response` object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseObject {
    /// The response's id (`resp_...`).
    pub id: String,
    /// `response`.
    pub object: String,
    /// Unix time of creation.
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: String,
    /// The model's name.
    pub model: String,
    /// Output items.
    pub output: Vec<OutputItem>,
    /// Token counts (once done).
    pub usage: Option<ResponseUsage>,
    /// Why the response is incomplete.
    pub incomplete_details: Option<IncompleteDetails>,
    /// The error of a failed response.
    pub error: Option<Json>,
    /// The request's instructions.
    pub instructions: Option<String>,
    /// The request's `max_output_tokens`.
    pub max_output_tokens: Option<u32>,
    /// Whether several calls per turn were allowed.
    pub parallel_tool_calls: bool,
    /// Always false: nothing is stored.
    pub store: bool,
    /// The request's temperature.
    pub temperature: Option<f64>,
    /// The request's top_p.
    pub top_p: Option<f64>,
    /// The request's metadata.
    pub metadata: Option<Json>,
}

/// A Responses stream event (`event:` name = `type`). Every event carries a
/// `sequence_number`, from 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum ResponseStreamEvent {
    /// The response exists (status `in_progress`).
    #[serde(rename = "response.created")]
    Created {
        /// Event number.
        sequence_number: u64,
        /// The response so far.
        response: Box<ResponseObject>,
    },
    /// Generation runs.
    #[serde(rename = "response.in_progress")]
    InProgress {
        /// Event number.
        sequence_number: u64,
        /// The response so far.
        response: Box<ResponseObject>,
    },
    /// An output item begins.
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        /// Event number.
        sequence_number: u64,
        /// The item's position in `output`.
        output_index: u32,
        /// The item (empty so far).
        item: OutputItem,
    },
    /// An output item is complete.
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        /// Event number.
        sequence_number: u64,
        /// The item's position.
        output_index: u32,
        /// The whole item.
        item: OutputItem,
    },
    /// A content part of a message begins.
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        /// Event number.
        sequence_number: u64,
        /// The message's id.
        item_id: String,
        /// The message's position.
        output_index: u32,
        /// The part's position in the message.
        content_index: u32,
        /// The part (empty text).
        part: OutputContent,
    },
    /// A content part is complete.
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        /// Event number.
        sequence_number: u64,
        /// The message's id.
        item_id: String,
        /// The message's position.
        output_index: u32,
        /// The part's position.
        content_index: u32,
        /// The whole part.
        part: OutputContent,
    },
    /// More answer text.
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        /// Event number.
        sequence_number: u64,
        /// The message's id.
        item_id: String,
        /// The message's position.
        output_index: u32,
        /// The part's position.
        content_index: u32,
        /// The new text.
        delta: String,
    },
    /// The answer text is complete.
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        /// Event number.
        sequence_number: u64,
        /// The message's id.
        item_id: String,
        /// The message's position.
        output_index: u32,
        /// The part's position.
        content_index: u32,
        /// All of the text.
        text: String,
    },
    /// More reasoning text.
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        /// Event number.
        sequence_number: u64,
        /// The reasoning item's id.
        item_id: String,
        /// Its position.
        output_index: u32,
        /// The part's position.
        content_index: u32,
        /// The new text.
        delta: String,
    },
    /// The reasoning text is complete.
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone {
        /// Event number.
        sequence_number: u64,
        /// The reasoning item's id.
        item_id: String,
        /// Its position.
        output_index: u32,
        /// The part's position.
        content_index: u32,
        /// All of the text.
        text: String,
    },
    /// More of a call's arguments.
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        /// Event number.
        sequence_number: u64,
        /// The call item's id.
        item_id: String,
        /// Its position.
        output_index: u32,
        /// The next fragment.
        delta: String,
    },
    /// A call's arguments are complete.
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        /// Event number.
        sequence_number: u64,
        /// The call item's id.
        item_id: String,
        /// Its position.
        output_index: u32,
        /// All of the arguments.
        arguments: String,
    },
    /// The response finished normally.
    #[serde(rename = "response.completed")]
    Completed {
        /// Event number.
        sequence_number: u64,
        /// The whole response.
        response: Box<ResponseObject>,
    },
    /// The response stopped early (`incomplete_details` says why).
    #[serde(rename = "response.incomplete")]
    Incomplete {
        /// Event number.
        sequence_number: u64,
        /// The whole response.
        response: Box<ResponseObject>,
    },
    /// The response failed.
    #[serde(rename = "response.failed")]
    Failed {
        /// Event number.
        sequence_number: u64,
        /// The response with its error.
        response: Box<ResponseObject>,
    },
    /// An error outside any response.
    #[serde(rename = "error")]
    Error {
        /// Event number.
        sequence_number: u64,
        /// Error code.
        code: Option<String>,
        /// What went wrong.
        message: String,
        /// The field at fault.
        param: Option<String>,
    },
}

impl ResponseStreamEvent {
    /// The event's `type` (the SSE `event:` name).
    pub fn event_type(&self) -> &'static str {
        match self {
            Self::Created { .. } => "response.created",
            Self::InProgress { .. } => "response.in_progress",
            Self::OutputItemAdded { .. } => "response.output_item.added",
            Self::OutputItemDone { .. } => "response.output_item.done",
            Self::ContentPartAdded { .. } => "response.content_part.added",
            Self::ContentPartDone { .. } => "response.content_part.done",
            Self::OutputTextDelta { .. } => "response.output_text.delta",
            Self::OutputTextDone { .. } => "response.output_text.done",
            Self::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            Self::ReasoningTextDone { .. } => "response.reasoning_text.done",
            Self::FunctionCallArgumentsDelta { .. } => "response.function_call_arguments.delta",
            Self::FunctionCallArgumentsDone { .. } => "response.function_call_arguments.done",
            Self::Completed { .. } => "response.completed",
            Self::Incomplete { .. } => "response.incomplete",
            Self::Failed { .. } => "response.failed",
            Self::Error { .. } => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::error::from_json;
    use crate::server::parse::ParsedOutput;
    use crate::tokenizer::ChatTemplate;
    use serde_json::json;

    fn chat(body: Json) -> Result<ChatRequest, RequestError> {
        from_json::<ChatCompletionRequest>(body.to_string().as_bytes())?.validate(1000)
    }

    fn chat_err(body: Json) -> (Option<String>, String) {
        let e = chat(body).unwrap_err();
        (e.field().map(str::to_string), e.to_string())
    }

    #[test]
    fn chat_request_converts_to_template_messages() {
        let req = chat(json!({
            "model": "qwen", "max_tokens": 10, "max_completion_tokens": 20,
            "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.05, "seed": 7,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "stop": "END", "n": 2, "logprobs": true, "top_logprobs": 3,
            "logit_bias": {"5": -100, "17": 2.5}, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true},
            "chat_template_kwargs": {"enable_thinking": false},
            "reasoning_effort": "high",
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}}, "strict": true}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": false,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
                {"role": "assistant", "content": null, "reasoning": "Call it.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"days\": 2}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}
            ]
        }))
        .unwrap();
        let s = &req.sampling;
        assert_eq!(s.max_tokens, Some(20));
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (Some(0.7), Some(0.9), None, Some(0.05)));
        assert_eq!((s.seed, s.n, s.logprobs, s.ignore_eos), (Some(7), 2, Some(3), true));
        assert_eq!(s.stop, ["END"]);
        assert_eq!(s.logit_bias, [(17, 2.5), (5, -100.0)]);
        assert!(req.stream && req.include_usage);
        assert_eq!(req.output_format, OutputFormat::JsonSchema { name: "w".into(), schema: Some(json!({"type": "object"})), strict: false });
        let p = &req.prompt;
        assert_eq!(
            Json::Array(p.messages.clone()),
            json!([
                {"role": "system", "content": "Be brief.\n\nUse tools."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "reasoning_content": "Call it.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"days": 2}}}]},
                {"role": "tool", "content": "rain", "tool_call_id": "c1"}
            ])
        );
        // chat_template_kwargs win over reasoning_effort; tools are given without `strict`.
        assert_eq!(p.kwargs["enable_thinking"], json!(false));
        assert_eq!(
            p.kwargs["tools"],
            json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}}}}])
        );
        assert_eq!(p.tool_choice, ToolChoice::Function("get_weather".into()));
        assert!(!p.parallel_tool_calls);
        assert_eq!(p.tools.len(), 1);

        // The template sees the decoded arguments as a mapping.
        let t = ChatTemplate::new(
            "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}{% endfor %}{% endfor %}{% endfor %}|{{ enable_thinking }}",
            "inline",
        )
        .unwrap();
        assert_eq!(p.render(&t).unwrap(), "days=2|False");
        let opts = p.parser_options("<|im_start|>assistant\n<think>\n", "call_1_");
        assert!(opts.starts_in_reasoning && opts.tools.is_some());
        assert_eq!(opts.call_id_prefix, "call_1_");
    }

    #[test]
    fn chat_validation_names_the_field() {
        let user = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(chat_err(json!({"messages": user, "temperature": 3})).0.as_deref(), Some("temperature"));
        assert_eq!(chat_err(json!({"messages": user, "top_p": 0})).0.as_deref(), Some("top_p"));
        assert_eq!(chat_err(json!({"messages": user, "max_completion_tokens": 0})).0.as_deref(), Some("max_completion_tokens"));
        // -1 is llama.cpp's "a fresh seed"; other values are seeds, negative ones too.
        assert_eq!(chat(json!({"messages": user, "seed": -1})).unwrap().sampling.seed, None);
        assert_eq!(chat(json!({"messages": user, "seed": -2})).unwrap().sampling.seed, Some(u64::MAX - 1));
        assert_eq!(chat_err(json!({"messages": user, "repeat_last_n": -2})).0.as_deref(), Some("repeat_last_n"));
        assert_eq!(chat_err(json!({"messages": user, "top_k": -5})).0.as_deref(), Some("top_k"));
        assert_eq!(chat_err(json!({"messages": user, "stop": ["a", ""]})).0.as_deref(), Some("stop[1]"));
        assert_eq!(chat_err(json!({"messages": user, "top_logprobs": 2})).0.as_deref(), Some("top_logprobs"));
        assert_eq!(chat_err(json!({"messages": user, "logit_bias": {"1000": 1}})).0.as_deref(), Some("logit_bias.1000"));
        assert_eq!(chat_err(json!({"messages": user, "stream_options": {"include_usage": true}})).0.as_deref(), Some("stream_options"));
        assert_eq!(chat_err(json!({"messages": []})).0.as_deref(), Some("messages"));
        assert_eq!(chat_err(json!({"messages": user, "tool_choice": "required"})).0.as_deref(), Some("tool_choice"));
        assert_eq!(
            chat_err(json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}})),
            (Some("tool_choice".into()), "`tool_choice`: no tool named \"g\" in `tools`".into())
        );
        assert_eq!(
            chat_err(json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]})).0.as_deref(),
            Some("tools[0].function.parameters")
        );
        assert_eq!(chat_err(json!({"messages": user, "tools": [{"type": "code_interpreter"}]})).0.as_deref(), Some("tools[0].type"));
        assert_eq!(
            chat_err(json!({"messages": [{"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}))
            .0
            .as_deref(),
            Some("messages[1].content[0].type")
        );
        assert_eq!(
            chat_err(json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}))
            .0
            .as_deref(),
            Some("messages[1].tool_calls[0].function.arguments")
        );
        assert_eq!(chat_err(json!({"messages": [{"role": "robot", "content": "a"}]})).0.as_deref(), Some("messages[0].role"));
        assert_eq!(chat_err(json!({"messages": [{"role": "user"}]})).0.as_deref(), Some("messages[0].content"));
        // A type error found while parsing names its path too.
        assert_eq!(chat_err(json!({"messages": [{"role": "user", "content": 5}]})).0.as_deref(), Some("messages[0].content"));
        assert_eq!(chat_err(json!({"messages": user, "temperature": "hot"})).0.as_deref(), Some("temperature"));
        assert_eq!(chat_err(json!({"messages": user, "chat_template_kwargs": {"tools": []}})).0.as_deref(), Some("chat_template_kwargs.tools"));
    }

    #[test]
    fn completions_request_prompts_and_defaults() {
        let parse = |b: Json| from_json::<CompletionRequest>(b.to_string().as_bytes()).and_then(|r| r.validate(100));
        let job = parse(json!({"prompt": "def f(", "stop": ["\n\n"], "logprobs": 2, "echo": true})).unwrap();
        assert_eq!(job.prompts, [Prompt::Text("def f(".into())]);
        assert_eq!((job.sampling.max_tokens, job.sampling.logprobs, job.echo), (Some(16), Some(2), true));
        assert_eq!(job.sampling.n, 1);
        assert_eq!(SamplingOptions::default().n, 1);
        let job = parse(json!({"prompt": [[1, 2], [3]], "max_tokens": 4})).unwrap();
        assert_eq!(job.prompts, [Prompt::Ids(vec![1, 2]), Prompt::Ids(vec![3])]);
        let job = parse(json!({"prompt": ["a", "b"]})).unwrap();
        assert_eq!(job.prompts.len(), 2);
        let field = |b: Json| parse(b).unwrap_err().field().map(str::to_string);
        assert_eq!(field(json!({"prompt": [1, 200]})).as_deref(), Some("prompt[1]"));
        assert_eq!(field(json!({"prompt": [[1], [2, 300]]})).as_deref(), Some("prompt[1][1]"));
        assert_eq!(field(json!({"prompt": []})).as_deref(), Some("prompt"));
        assert_eq!(field(json!({"prompt": "x", "suffix": "y"})).as_deref(), Some("suffix"));
        assert_eq!(field(json!({"prompt": "x", "logprobs": 6})).as_deref(), Some("logprobs"));
        assert_eq!(field(json!({"prompt": "x", "n": 0})).as_deref(), Some("n"));
    }

    #[test]
    fn reasoning_efforts_switch_thinking_unless_the_template_kwargs_do() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let thinking = |extra: Json| -> Option<Json> {
            let mut body = json!({"messages": user});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            chat(body).unwrap().prompt.kwargs.get("enable_thinking").cloned()
        };
        for (effort, on) in [("none", false), ("minimal", false), ("low", true), ("medium", true), ("high", true), ("xhigh", true), ("max", true)] {
            assert_eq!(thinking(json!({"reasoning_effort": effort})), Some(json!(on)), "{effort}");
            let responses = from_json::<ResponsesRequest>(json!({"input": "hi", "reasoning": {"effort": effort}}).to_string().as_bytes()).unwrap().validate().unwrap();
            assert_eq!(responses.prompt.kwargs.get("enable_thinking"), Some(&json!(on)), "reasoning.effort {effort}");
        }
        // No effort: the template's default (nothing set); the request's own switch wins.
        assert_eq!(thinking(json!({})), None);
        assert_eq!(thinking(json!({"reasoning_effort": null})), None);
        assert_eq!(thinking(json!({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": false}})), Some(json!(false)));
        assert_eq!(thinking(json!({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}})), Some(json!(true)));
        let e = chat(json!({"messages": user, "reasoning_effort": "extreme"})).unwrap_err();
        assert_eq!((e.field(), e.code()), (Some("reasoning_effort"), "invalid_value"));
        assert!(e.to_string().contains("\"extreme\""), "{e}");
        // The refusal lists every accepted value.
        let listed = |e: &RequestError| ["none", "minimal", "low", "medium", "high", "xhigh", "max"].iter().all(|v| e.to_string().contains(&format!("\"{v}\"")));
        assert!(listed(&e), "{e}");
        let e = from_json::<ResponsesRequest>(br#"{"input": "hi", "reasoning": {"effort": "HIGH"}}"#).unwrap().validate().unwrap_err();
        assert_eq!(e.field(), Some("reasoning.effort"));
        assert!(listed(&e), "{e}");
    }

    #[test]
    fn responses_input_items_convert() {
        let body = json!({
            "model": "m", "instructions": "You are Codex.", "store": false, "stream": true,
            "max_output_tokens": 1, "reasoning": {"effort": "none"},
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object",
                "properties": {"cmd": {"type": "array"}}}}, {"type": "web_search"}],
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandboxed."}]},
                {"role": "user", "content": "List files."},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Run ls."}]},
                {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": "{\"cmd\": [\"ls\"]}"},
                {"type": "function_call", "call_id": "call_b", "name": "shell", "arguments": "{\"cmd\": [\"pwd\"]}"},
                {"type": "function_call_output", "call_id": "call_a", "output": "a.txt"},
                {"type": "function_call_output", "call_id": "call_b", "output": "/w"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}
            ]
        });
        let req = from_json::<ResponsesRequest>(body.to_string().as_bytes()).unwrap().validate().unwrap();
        assert_eq!(
            Json::Array(req.prompt.messages.clone()),
            json!([
                {"role": "system", "content": "You are Codex.\n\nSandboxed."},
                {"role": "user", "content": "List files."},
                {"role": "assistant", "content": "", "reasoning_content": "Run ls.", "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": {"cmd": ["ls"]}}},
                    {"id": "call_b", "type": "function", "function": {"name": "shell", "arguments": {"cmd": ["pwd"]}}}]},
                {"role": "tool", "content": "a.txt", "tool_call_id": "call_a"},
                {"role": "tool", "content": "/w", "tool_call_id": "call_b"},
                {"role": "assistant", "content": "Done."}
            ])
        );
        assert_eq!(req.sampling.max_tokens, Some(1));
        assert_eq!(req.prompt.kwargs["enable_thinking"], json!(false));
        // The web search tool is ignored, not refused.
        assert_eq!(req.prompt.kwargs["tools"].as_array().map(Vec::len), Some(1));
        assert!(req.stream && req.include_usage);

        let req = from_json::<ResponsesRequest>(br#"{"input": "Hi"}"#).unwrap().validate().unwrap();
        assert_eq!(Json::Array(req.prompt.messages), json!([{"role": "user", "content": "Hi"}]));

        let field = |b: Json| from_json::<ResponsesRequest>(b.to_string().as_bytes()).and_then(|r| r.validate()).unwrap_err().field().map(str::to_string);
        assert_eq!(field(json!({"input": "x", "previous_response_id": "resp_1"})).as_deref(), Some("previous_response_id"));
        assert_eq!(field(json!({"input": [{"type": "function_call_output", "output": "x"}]})).as_deref(), Some("input[0].call_id"));
        assert_eq!(field(json!({"input": [{"type": "local_shell_call"}]})).as_deref(), Some("input[0].type"));
        assert_eq!(field(json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})).as_deref(), Some("input[0].content[0].type"));
        assert_eq!(field(json!({"input": "x", "max_output_tokens": 0})).as_deref(), Some("max_output_tokens"));
        assert_eq!(field(json!({"input": [], "instructions": "only this"})).as_deref(), Some("input"));
    }

    #[test]
    fn responses_serialize_in_openai_shapes() {
        let parsed = ParsedOutput {
            reasoning: "r".into(),
            content: String::new(),
            tool_calls: vec![ParsedToolCall { id: "call_0".into(), name: "f".into(), arguments: "{\"a\":1}".into() }],
        };
        let completion = ChatCompletion::new(
            "chatcmpl-1".into(),
            5,
            "qwen".into(),
            vec![ChatChoice { index: 0, message: ResponseMessage::from_parsed(&parsed), logprobs: None, finish_reason: Some(FinishReason::ToolCalls) }],
            Usage::new(10, 3, 8),
        );
        assert_eq!(
            serde_json::to_value(&completion).unwrap(),
            json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "qwen",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
                    "reasoning_content": "r", "reasoning": "r",
                    "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
                    "logprobs": null, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                    "prompt_tokens_details": {"cached_tokens": 8}}})
        );

        let mut chunk = ChatCompletionChunk::new(
            "chatcmpl-1".into(),
            5,
            "qwen".into(),
            vec![ChunkChoice { index: 0, delta: ChunkDelta::from(&Delta::ToolCallStart { index: 1, id: "call_1".into(), name: "g".into() }), logprobs: None, finish_reason: None }],
        );
        chunk.usage = Some(None);
        assert_eq!(
            serde_json::to_value(&chunk).unwrap(),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "qwen",
                "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                    "function": {"name": "g", "arguments": ""}}]}, "logprobs": null, "finish_reason": null}],
                "usage": null})
        );
        assert_eq!(serde_json::to_value(ChunkDelta::from(&Delta::Reasoning("x".into()))).unwrap(), json!({"reasoning_content": "x", "reasoning": "x"}));

        let text = TextCompletion::new(
            "cmpl-1".into(),
            1,
            "m".into(),
            vec![CompletionChoice { text: "ok".into(), index: 0, logprobs: None, finish_reason: Some(FinishReason::Length) }],
            None,
        );
        assert_eq!(
            serde_json::to_value(&text).unwrap(),
            json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"text": "ok", "index": 0, "logprobs": null, "finish_reason": "length"}]})
        );

        let events = [
            ResponseStreamEvent::OutputTextDelta { sequence_number: 3, item_id: "msg_1".into(), output_index: 1, content_index: 0, delta: "Hi".into() },
            ResponseStreamEvent::OutputItemAdded {
                sequence_number: 4,
                output_index: 2,
                item: OutputItem::FunctionCall { id: "fc_1".into(), call_id: "call_0".into(), name: "f".into(), arguments: String::new(), status: "in_progress".into() },
            },
            ResponseStreamEvent::FunctionCallArgumentsDone { sequence_number: 5, item_id: "fc_1".into(), output_index: 2, arguments: "{}".into() },
        ];
        for e in &events {
            assert_eq!(serde_json::to_value(e).unwrap()["type"], e.event_type());
        }
        assert_eq!(
            serde_json::to_value(&events[1]).unwrap(),
            json!({"type": "response.output_item.added", "sequence_number": 4, "output_index": 2,
                "item": {"type": "function_call", "id": "fc_1", "call_id": "call_0", "name": "f", "arguments": "", "status": "in_progress"}})
        );
        assert_eq!(
            serde_json::to_value(ResponseUsage::new(10, 4, 6, 2)).unwrap(),
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 6}, "output_tokens": 4,
                "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 14})
        );
    }
}
