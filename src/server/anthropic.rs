//! The Anthropic Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.
//!
//! Content blocks convert into the template's OpenAI-style messages: `tool_use` blocks become
//! an assistant message's `tool_calls`, each `tool_result` block a `tool` message, `thinking`
//! blocks the assistant's `reasoning_content`; the top-level `system` becomes the system
//! message, and `thinking.type` with `output_config.effort` the `enable_thinking` switch.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use super::error::RequestError;
use super::parse::{Delta, ParsedOutput};
use super::{push_message, set_thinking, stop_strings, ChatPrompt, ChatRequest, OutputFormat, SamplingOptions, ToolChoice, ToolSet};

/// A message's content, or `system`: a string or content blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content blocks.
    Blocks(Vec<ContentBlock>),
}

/// A content block of a request. One struct for every type (`text`, `thinking`,
/// `redacted_thinking`, `tool_use`, `tool_result`, `image`, ...) so validation can name the
/// field at fault.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ContentBlock {
    /// The block type.
    #[serde(rename = "type")]
    pub kind: String,
    /// A text block's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// A thinking block's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
    /// A thinking block's signature (ignored).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
    /// A tool_use block's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// A tool_use block's function name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A tool_use block's arguments (an object).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<Json>,
    /// The tool_use a tool_result answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_use_id: Option<String>,
    /// A tool_result's content: a string or text blocks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// The tool failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub is_error: Option<bool>,
    /// Prompt-caching hint (ignored: the prefix cache is automatic).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_control: Option<Json>,
}

/// A message of the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `user` or `assistant`.
    pub role: String,
    /// Its content.
    pub content: Content,
}

/// A tool definition: a custom tool (`type` absent or `custom`) with `input_schema`; server
/// tools (`web_search_…`, `bash_…`, ...) are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    /// `custom`, absent, or a server tool type.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The tool's name.
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its input's JSON schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Json>,
}

/// `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name"?, ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolChoiceParam {
    /// `auto`, `any`, `tool` or `none`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The tool, with `type: tool`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// At most one call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_parallel_tool_use: Option<bool>,
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}`, `{"type": "adaptive"}`,
/// `{"type": "between_tools"}` or `{"type": "disabled"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThinkingParam {
    /// `enabled`, `adaptive`, `between_tools` or `disabled` (what each does: [`thinking_switch`]).
    #[serde(rename = "type")]
    pub kind: String,
    /// Thinking budget (not enforced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u32>,
}

/// `POST /v1/messages`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagesRequest {
    /// The model's name.
    #[serde(default)]
    pub model: Option<String>,
    /// Most tokens to generate (required).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// The conversation.
    pub messages: Vec<Message>,
    /// The system prompt.
    #[serde(default)]
    pub system: Option<Content>,
    /// Stop strings.
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    /// Stream events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Sampling temperature, 0–1.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Top-k.
    #[serde(default)]
    pub top_k: Option<u32>,
    /// Tools.
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    /// Whether and which tool to call.
    #[serde(default)]
    pub tool_choice: Option<ToolChoiceParam>,
    /// Extended thinking.
    #[serde(default)]
    pub thinking: Option<ThinkingParam>,
    /// Sampler seed (extension; -1: a fresh one).
    #[serde(default)]
    pub seed: Option<i64>,
    /// Generate past end-of-sequence tokens (extension, for benchmarks).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Client metadata (unused).
    #[serde(default)]
    pub metadata: Option<Json>,
    /// Extra template variables (extension).
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Json>>,
    /// Output settings: `format` asks for structured output.
    #[serde(default)]
    pub output_config: Option<OutputConfig>,
    /// Structured output as the beta API named it, before `output_config.format`.
    #[serde(default)]
    pub output_format: Option<OutputFormatParam>,
}

/// `output_config`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct OutputConfig {
    /// The output's format (structured outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<OutputFormatParam>,
    /// How much effort the model should spend: `low`, `medium`, `high`, `xhigh` or `max`
    /// (what it does: [`thinking_switch`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<Json>,
}

/// A structured-output format: `{"type": "json_schema", "schema": {...}}`, the output being
/// JSON matching the schema (enforced by constrained decoding).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputFormatParam {
    /// `json_schema`, the one type there is.
    #[serde(rename = "type")]
    pub kind: String,
    /// The JSON schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Json>,
}

impl OutputFormatParam {
    /// The format as the output constraint reads it; `field` names it in errors.
    fn output_format(&self, field: &str) -> Result<OutputFormat, RequestError> {
        if self.kind != "json_schema" {
            return Err(RequestError::unsupported(format!("{field}.type"), format!("{:?} is not an output format; the one there is is \"json_schema\"", self.kind)));
        }
        let schema = self.schema.clone().ok_or_else(|| RequestError::missing(format!("{field}.schema")))?;
        if !schema.is_object() {
            return Err(RequestError::invalid(format!("{field}.schema"), "must be a JSON schema object"));
        }
        Ok(OutputFormat::JsonSchema { name: "output".into(), schema: Some(schema), strict: true })
    }
}

/// `POST /v1/messages/count_tokens`: what the prompt of a messages request would hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CountTokensRequest {
    /// The model's name.
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<Message>,
    /// The system prompt.
    #[serde(default)]
    pub system: Option<Content>,
    /// Tools.
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    /// Tool choice.
    #[serde(default)]
    pub tool_choice: Option<ToolChoiceParam>,
    /// Extended thinking.
    #[serde(default)]
    pub thinking: Option<ThinkingParam>,
    /// Output settings: `effort` switches thinking as in a messages request (`format` does not
    /// change the prompt).
    #[serde(default)]
    pub output_config: Option<OutputConfig>,
    /// Extra template variables (extension).
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Json>>,
}

/// `count_tokens`' answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountTokensResponse {
    /// Tokens of the rendered prompt.
    pub input_tokens: u32,
}

impl MessagesRequest {
    /// Checks the request and converts it.
    pub fn validate(&self) -> Result<ChatRequest, RequestError> {
        let max_tokens = self.max_tokens.ok_or_else(|| RequestError::missing("max_tokens"))?;
        if max_tokens == 0 {
            return Err(RequestError::invalid("max_tokens", "must be at least 1"));
        }
        super::check_range("temperature", self.temperature, 0.0, 1.0)?;
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(RequestError::invalid("top_p", format!("must be in (0, 1], got {p}")));
            }
        }
        let sampling = SamplingOptions {
            max_tokens: Some(max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k.filter(|&k| k > 0),
            stop: stop_strings("stop_sequences", self.stop_sequences.clone().unwrap_or_default())?,
            seed: self.seed.filter(|&s| s != -1).map(|s| s as u64),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            n: 1,
            ..SamplingOptions::default()
        };
        let effort = self.output_config.as_ref().and_then(|c| c.effort.as_ref());
        let prompt = prompt(
            &self.messages,
            self.system.as_ref(),
            self.tools.as_deref(),
            self.tool_choice.as_ref(),
            thinking_switch(self.thinking.as_ref(), effort)?,
            self.chat_template_kwargs.as_ref(),
        )?;
        let output_format = match (self.output_config.as_ref().and_then(|c| c.format.as_ref()), &self.output_format) {
            (Some(_), Some(_)) => return Err(RequestError::invalid("output_format", "give `output_config.format` or `output_format`, not both")),
            (Some(f), None) => f.output_format("output_config.format")?,
            (None, Some(f)) => f.output_format("output_format")?,
            (None, None) => OutputFormat::Text,
        };
        Ok(ChatRequest { model: self.model.clone(), prompt, sampling, stream: self.stream.unwrap_or(false), include_usage: true, output_format })
    }

    /// The field of the request's output schema (`output_config.format.schema`, or the beta
    /// `output_format.schema`), for errors about the schema.
    pub fn output_schema_field(&self) -> &'static str {
        if self.output_format.is_some() {
            "output_format.schema"
        } else {
            "output_config.format.schema"
        }
    }
}

impl CountTokensRequest {
    /// Checks the request and converts it into the prompt to render and count.
    pub fn validate(&self) -> Result<ChatPrompt, RequestError> {
        let effort = self.output_config.as_ref().and_then(|c| c.effort.as_ref());
        prompt(
            &self.messages,
            self.system.as_ref(),
            self.tools.as_deref(),
            self.tool_choice.as_ref(),
            thinking_switch(self.thinking.as_ref(), effort)?,
            self.chat_template_kwargs.as_ref(),
        )
    }
}

/// Qwen3.5's one reasoning switch (`enable_thinking`) from Anthropic's `thinking.type` and
/// `output_config.effort`. An explicit type decides: `enabled` and `between_tools` turn
/// thinking on, `disabled` off. `adaptive` leaves it to the effort: `low` (spend as little as
/// the task allows) turns it off, any other effort, or none (Anthropic's default is `high`),
/// on. Without `thinking` the client asked for no reasoning, so an effort never turns it on:
/// `low` turns it off (a model whose template thinks by default answers directly), others
/// leave the template's default. The request's own `chat_template_kwargs.enable_thinking`
/// wins over all of these ([`set_thinking`]).
fn thinking_switch(thinking: Option<&ThinkingParam>, effort: Option<&Json>) -> Result<Option<bool>, RequestError> {
    let low = match effort {
        None | Some(Json::Null) => false,
        Some(Json::String(e)) if matches!(e.as_str(), "low" | "medium" | "high" | "xhigh" | "max") => e == "low",
        Some(other) => return Err(RequestError::invalid("output_config.effort", format!("must be \"low\", \"medium\", \"high\", \"xhigh\" or \"max\", got {other}"))),
    };
    match thinking.map(|t| t.kind.as_str()) {
        Some("enabled" | "between_tools") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        Some("adaptive") => Ok(Some(!low)),
        Some(other) => Err(RequestError::invalid("thinking.type", format!("must be \"enabled\", \"adaptive\", \"between_tools\" or \"disabled\", got {other:?}"))),
        None => Ok(low.then_some(false)),
    }
}

fn template_message(role: &str, content: String) -> Map<String, Json> {
    let mut m = Map::new();
    m.insert("role".into(), Json::String(role.to_string()));
    m.insert("content".into(), Json::String(content));
    m
}

/// The text of a string or of text blocks (joined with newlines); other blocks are refused.
fn text_of(field: &str, content: &Content) -> Result<String, RequestError> {
    match content {
        Content::Text(t) => Ok(t.clone()),
        Content::Blocks(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                if b.kind != "text" {
                    return Err(RequestError::unsupported(format!("{field}[{j}].type"), format!("{:?} blocks are not supported here: the model reads text only", b.kind)));
                }
                parts.push(b.text.clone().ok_or_else(|| RequestError::missing(format!("{field}[{j}].text")))?);
            }
            Ok(parts.join("\n"))
        }
    }
}

fn prompt(
    messages: &[Message],
    system: Option<&Content>,
    tools: Option<&[Tool]>,
    tool_choice: Option<&ToolChoiceParam>,
    thinking: Option<bool>,
    chat_template_kwargs: Option<&Map<String, Json>>,
) -> Result<ChatPrompt, RequestError> {
    if messages.is_empty() {
        return Err(RequestError::invalid("messages", "must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system {
        let text = text_of("system", system)?;
        if !text.is_empty() {
            out.push(Json::Object(template_message("system", text)));
        }
    }
    for (i, m) in messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        match m.role.as_str() {
            "user" => user_turn(&field, &m.content, &mut out)?,
            "assistant" => push_message(&mut out, Json::Object(assistant_turn(&field, &m.content)?)),
            other => {
                return Err(RequestError::invalid(
                    format!("{field}.role"),
                    format!("must be \"user\" or \"assistant\", got {other:?} (the system prompt is the top-level `system`)"),
                ))
            }
        }
    }

    let mut kwargs = chat_template_kwargs.cloned().unwrap_or_default();
    for reserved in ["messages", "tools", "add_generation_prompt"] {
        if kwargs.contains_key(reserved) {
            return Err(RequestError::invalid(format!("chat_template_kwargs.{reserved}"), "is set by the server"));
        }
    }
    set_thinking(&mut kwargs, thinking);
    let mut prompt = ChatPrompt { messages: out, kwargs, parallel_tool_calls: !tool_choice.and_then(|c| c.disable_parallel_tool_use).unwrap_or(false), ..ChatPrompt::default() };
    let mut set = ToolSet::default();
    for (i, tool) in tools.unwrap_or_default().iter().enumerate() {
        // Server tools run on Anthropic's side: nothing here can serve them.
        if tool.kind.as_deref().is_some_and(|k| k != "custom") {
            continue;
        }
        set.add(&format!("tools[{i}]"), "input_schema", &tool.name, tool.description.as_deref(), tool.input_schema.as_ref())?;
    }
    if let Some(choice) = tool_choice {
        prompt.tool_choice = match choice.kind.as_str() {
            "auto" => ToolChoice::Auto,
            "any" => ToolChoice::Required,
            "none" => ToolChoice::None,
            "tool" => ToolChoice::Function(choice.name.clone().ok_or_else(|| RequestError::missing("tool_choice.name"))?),
            other => return Err(RequestError::invalid("tool_choice.type", format!("must be \"auto\", \"any\", \"tool\" or \"none\", got {other:?}"))),
        };
        let field = if choice.kind == "tool" { "tool_choice.name" } else { "tool_choice.type" };
        set.check_choice(&prompt.tool_choice, field)?;
    }
    set.into_prompt(&mut prompt);
    Ok(prompt)
}

/// A user turn: its `tool_result` blocks become tool messages, its text a user message, in
/// the order written.
fn user_turn(field: &str, content: &Content, out: &mut Vec<Json>) -> Result<(), RequestError> {
    let blocks = match content {
        Content::Text(t) => {
            out.push(Json::Object(template_message("user", t.clone())));
            return Ok(());
        }
        Content::Blocks(b) => b,
    };
    let mut text: Vec<String> = Vec::new();
    let flush = |text: &mut Vec<String>, out: &mut Vec<Json>| {
        if !text.is_empty() {
            out.push(Json::Object(template_message("user", text.join("\n"))));
            text.clear();
        }
    };
    for (j, b) in blocks.iter().enumerate() {
        let bfield = format!("{field}.content[{j}]");
        match b.kind.as_str() {
            "text" => text.push(b.text.clone().ok_or_else(|| RequestError::missing(format!("{bfield}.text")))?),
            "tool_result" => {
                flush(&mut text, out);
                let id = b.tool_use_id.clone().ok_or_else(|| RequestError::missing(format!("{bfield}.tool_use_id")))?;
                let result = match &b.content {
                    None => String::new(),
                    Some(c) => text_of(&format!("{bfield}.content"), c)?,
                };
                let mut m = template_message("tool", result);
                m.insert("tool_call_id".into(), Json::String(id));
                out.push(Json::Object(m));
            }
            other => return Err(RequestError::unsupported(format!("{bfield}.type"), format!("{other:?} blocks are not supported in user turns: the model reads text only"))),
        }
    }
    flush(&mut text, out);
    Ok(())
}

/// An assistant turn: text blocks are the content, thinking blocks the reasoning, tool_use
/// blocks the tool calls.
fn assistant_turn(field: &str, content: &Content) -> Result<Map<String, Json>, RequestError> {
    let blocks = match content {
        Content::Text(t) => return Ok(template_message("assistant", t.clone())),
        Content::Blocks(b) => b,
    };
    let mut text = Vec::new();
    let mut reasoning = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bfield = format!("{field}.content[{j}]");
        match b.kind.as_str() {
            "text" => text.push(b.text.clone().ok_or_else(|| RequestError::missing(format!("{bfield}.text")))?),
            "thinking" => reasoning.push(b.thinking.clone().unwrap_or_default()),
            // Encrypted reasoning of another model: nothing to render.
            "redacted_thinking" => {}
            "tool_use" => {
                let name = b.name.clone().ok_or_else(|| RequestError::missing(format!("{bfield}.name")))?;
                let input = b.input.clone().unwrap_or_else(|| Json::Object(Map::new()));
                if !input.is_object() {
                    return Err(RequestError::invalid(format!("{bfield}.input"), "must be an object"));
                }
                let mut call = Map::new();
                if let Some(id) = &b.id {
                    call.insert("id".into(), Json::String(id.clone()));
                }
                call.insert("type".into(), Json::String("function".into()));
                call.insert("function".into(), serde_json::json!({"name": name, "arguments": input}));
                calls.push(Json::Object(call));
            }
            other => return Err(RequestError::unsupported(format!("{bfield}.type"), format!("{other:?} blocks are not supported in assistant turns"))),
        }
    }
    let mut m = template_message("assistant", text.join("\n"));
    if !reasoning.is_empty() {
        m.insert("reasoning_content".into(), Json::String(reasoning.join("\n")));
    }
    if !calls.is_empty() {
        m.insert("tool_calls".into(), Json::Array(calls));
    }
    Ok(m)
}

/// Why generation stopped (`stop_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model ended its turn.
    EndTurn,
    /// `max_tokens` ran out.
    MaxTokens,
    /// A stop sequence matched (`stop_sequence` says which).
    StopSequence,
    /// The model called tools.
    ToolUse,
}

/// Token counts of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens not read from the cache.
    pub input_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
    /// Prompt tokens written to the cache (always 0: caching is automatic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_creation_input_tokens: Option<u32>,
    /// Prompt tokens read from the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<u32>,
}

impl Usage {
    /// Anthropic counts cached prompt tokens apart from `input_tokens`.
    pub fn new(prompt_tokens: u32, output_tokens: u32, cached_tokens: u32) -> Self {
        Self { input_tokens: prompt_tokens.saturating_sub(cached_tokens), output_tokens, cache_creation_input_tokens: Some(0), cache_read_input_tokens: Some(cached_tokens) }
    }
}

/// A content block of a response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseBlock {
    /// Reasoning.
    Thinking {
        /// The reasoning text.
        thinking: String,
        /// Signature (empty: nothing here signs).
        signature: String,
    },
    /// Answer text.
    Text {
        /// The text.
        text: String,
    },
    /// A tool call.
    ToolUse {
        /// The call's id.
        id: String,
        /// The tool.
        name: String,
        /// Its arguments (an object).
        input: Json,
    },
}

impl ResponseBlock {
    /// The blocks of a parsed completion: thinking, text, then the tool calls.
    pub fn from_parsed(parsed: &ParsedOutput) -> Vec<Self> {
        let mut blocks = Vec::new();
        if !parsed.reasoning.is_empty() {
            blocks.push(Self::Thinking { thinking: parsed.reasoning.clone(), signature: String::new() });
        }
        if !parsed.content.is_empty() {
            blocks.push(Self::Text { text: parsed.content.clone() });
        }
        blocks.extend(parsed.tool_calls.iter().map(|c| Self::ToolUse { id: c.id.clone(), name: c.name.clone(), input: c.input() }));
        blocks
    }
}

/// A `message` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageResponse {
    /// The message's id (`msg_...`).
    pub id: String,
    /// `message`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `assistant`.
    pub role: String,
    /// The model's name.
    pub model: String,
    /// The content blocks (empty in `message_start`).
    pub content: Vec<ResponseBlock>,
    /// Why generation stopped (null in `message_start`).
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that matched.
    pub stop_sequence: Option<String>,
    /// Token counts.
    pub usage: Usage,
}

impl MessageResponse {
    /// A message with `type` and `role` set.
    pub fn new(id: String, model: String, content: Vec<ResponseBlock>, stop_reason: Option<StopReason>, usage: Usage) -> Self {
        Self { id, kind: "message".into(), role: "assistant".into(), model, content, stop_reason, stop_sequence: None, usage }
    }
}

/// The delta of a `content_block_delta` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    /// More answer text.
    TextDelta {
        /// The new text.
        text: String,
    },
    /// More reasoning.
    ThinkingDelta {
        /// The new text.
        thinking: String,
    },
    /// A thinking block's signature.
    SignatureDelta {
        /// The signature.
        signature: String,
    },
    /// More of a tool call's input JSON.
    InputJsonDelta {
        /// The next fragment.
        partial_json: String,
    },
}

impl BlockDelta {
    /// The block delta of a parser delta; `None` for the start of a tool call, which is a
    /// `content_block_start` instead.
    pub fn from_delta(d: &Delta) -> Option<Self> {
        match d {
            Delta::Reasoning(t) => Some(Self::ThinkingDelta { thinking: t.clone() }),
            Delta::Content(t) => Some(Self::TextDelta { text: t.clone() }),
            Delta::ToolCallArguments { arguments, .. } => Some(Self::InputJsonDelta { partial_json: arguments.clone() }),
            Delta::ToolCallStart { .. } => None,
        }
    }
}

/// `message_delta`'s delta.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageDelta {
    /// Why generation stopped.
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that matched.
    pub stop_sequence: Option<String>,
}

/// `message_delta`'s usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaUsage {
    /// Generated tokens so far.
    pub output_tokens: u32,
}

/// A stream event (`event:` name = `type`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// The message begins (empty content).
    MessageStart {
        /// The message so far.
        message: Box<MessageResponse>,
    },
    /// A content block begins.
    ContentBlockStart {
        /// The block's position.
        index: u32,
        /// The block, empty (a tool_use's `input` is `{}`).
        content_block: ResponseBlock,
    },
    /// More of a block.
    ContentBlockDelta {
        /// The block's position.
        index: u32,
        /// What is new.
        delta: BlockDelta,
    },
    /// A block is complete.
    ContentBlockStop {
        /// The block's position.
        index: u32,
    },
    /// Top-level changes (stop reason, output tokens).
    MessageDelta {
        /// Stop reason and sequence.
        delta: MessageDelta,
        /// Output tokens.
        usage: DeltaUsage,
    },
    /// The message is complete.
    MessageStop,
    /// Keep-alive.
    Ping,
    /// An error mid-stream.
    Error {
        /// The error.
        error: super::error::AnthropicError,
    },
}

impl StreamEvent {
    /// The event's `type` (the SSE `event:` name).
    pub fn event_type(&self) -> &'static str {
        match self {
            Self::MessageStart { .. } => "message_start",
            Self::ContentBlockStart { .. } => "content_block_start",
            Self::ContentBlockDelta { .. } => "content_block_delta",
            Self::ContentBlockStop { .. } => "content_block_stop",
            Self::MessageDelta { .. } => "message_delta",
            Self::MessageStop => "message_stop",
            Self::Ping => "ping",
            Self::Error { .. } => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::error::from_json;
    use crate::server::parse::ParsedToolCall;
    use serde_json::json;

    fn messages(body: Json) -> Result<ChatRequest, RequestError> {
        from_json::<MessagesRequest>(body.to_string().as_bytes())?.validate()
    }

    #[test]
    fn content_blocks_convert_to_template_messages() {
        let req = messages(json!({
            "model": "claude", "max_tokens": 100, "temperature": 0.5, "top_k": 20,
            "stop_sequences": ["###"], "stream": true, "thinking": {"type": "disabled"},
            "system": [{"type": "text", "text": "Header", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Be terse."}],
            "tools": [{"name": "read", "description": "Read a file", "input_schema": {"type": "object",
                "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}},
                {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Read a.txt"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use read.", "signature": "sig"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.txt", "lines": 3}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "hello"}]},
                    {"type": "text", "text": "Summarize it."}]}
            ]
        }))
        .unwrap();
        assert_eq!(
            Json::Array(req.prompt.messages.clone()),
            json!([
                {"role": "system", "content": "Header\nBe terse."},
                {"role": "user", "content": "Read a.txt"},
                {"role": "assistant", "content": "Reading.", "reasoning_content": "Use read.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": {"path": "a.txt", "lines": 3}}}]},
                {"role": "tool", "content": "hello", "tool_call_id": "toolu_1"},
                {"role": "user", "content": "Summarize it."}
            ])
        );
        let s = &req.sampling;
        assert_eq!((s.max_tokens, s.temperature, s.top_k), (Some(100), Some(0.5), Some(20)));
        assert_eq!(s.stop, ["###"]);
        let p = &req.prompt;
        assert_eq!(p.kwargs["enable_thinking"], json!(false));
        assert_eq!(
            p.kwargs["tools"],
            json!([{"type": "function", "function": {"name": "read", "description": "Read a file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}}])
        );
        assert_eq!(p.tool_choice, ToolChoice::Required);
        assert!(!p.parallel_tool_calls);
        assert!(req.stream && req.include_usage);

        let count = from_json::<CountTokensRequest>(br#"{"messages": [{"role": "user", "content": "hi"}], "system": "S"}"#).unwrap().validate().unwrap();
        assert_eq!(Json::Array(count.messages), json!([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]));
    }

    #[test]
    fn thinking_type_and_effort_make_the_thinking_switch() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let thinking = |extra: Json| -> Option<Json> {
            let mut body = json!({"messages": user, "max_tokens": 5});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let on = messages(body.clone()).unwrap().prompt.kwargs.get("enable_thinking").cloned();
            // count_tokens renders the same prompt.
            body.as_object_mut().unwrap().remove("max_tokens");
            let count = from_json::<CountTokensRequest>(body.to_string().as_bytes()).unwrap().validate().unwrap();
            assert_eq!(count.kwargs.get("enable_thinking"), on.as_ref(), "count_tokens of {body}");
            on
        };
        let effort = |e: &str| json!({"effort": e});
        // An explicit type decides, whatever the effort.
        assert_eq!(thinking(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": effort("low")})), Some(json!(true)));
        assert_eq!(thinking(json!({"thinking": {"type": "between_tools"}})), Some(json!(true)));
        assert_eq!(thinking(json!({"thinking": {"type": "disabled"}, "output_config": effort("max")})), Some(json!(false)));
        // Adaptive: low effort answers directly; any other effort, or none, thinks.
        assert_eq!(thinking(json!({"thinking": {"type": "adaptive"}, "output_config": effort("low")})), Some(json!(false)));
        for e in ["medium", "high", "xhigh", "max"] {
            assert_eq!(thinking(json!({"thinking": {"type": "adaptive"}, "output_config": effort(e)})), Some(json!(true)), "{e}");
        }
        assert_eq!(thinking(json!({"thinking": {"type": "adaptive", "display": "summarized"}})), Some(json!(true)));
        // No `thinking`: effort only ever saves reasoning.
        assert_eq!(thinking(json!({"output_config": effort("low")})), Some(json!(false)));
        assert_eq!(thinking(json!({"output_config": effort("high")})), None);
        assert_eq!(thinking(json!({"output_config": {"effort": null}})), None);
        assert_eq!(thinking(json!({})), None);
        // The request's own template switch wins.
        assert_eq!(thinking(json!({"thinking": {"type": "adaptive"}, "output_config": effort("low"), "chat_template_kwargs": {"enable_thinking": true}})), Some(json!(true)));
        assert_eq!(thinking(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}, "chat_template_kwargs": {"enable_thinking": false}})), Some(json!(false)));
        let e = messages(json!({"messages": user, "max_tokens": 5, "output_config": effort("extreme")})).unwrap_err();
        assert_eq!(e.field(), Some("output_config.effort"));
        assert!(e.to_string().contains("\"extreme\""), "{e}");
        assert_eq!(messages(json!({"messages": user, "max_tokens": 5, "output_config": {"effort": 3}})).unwrap_err().field(), Some("output_config.effort"));
        assert_eq!(messages(json!({"messages": user, "max_tokens": 5, "thinking": {"type": "sometimes"}})).unwrap_err().field(), Some("thinking.type"));
    }

    #[test]
    fn validation_names_the_field() {
        let field = |b: Json| messages(b).unwrap_err().field().map(str::to_string);
        let user = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(messages(json!({"messages": user})).unwrap_err().to_string(), "`max_tokens` is required");
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "temperature": 1.5})).as_deref(), Some("temperature"));
        assert_eq!(field(json!({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5})).as_deref(), Some("messages[0].role"));
        assert_eq!(
            field(json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "source": {}}]}], "max_tokens": 5})).as_deref(),
            Some("messages[0].content[1].type")
        );
        assert_eq!(
            field(json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}], "max_tokens": 5})).as_deref(),
            Some("messages[0].content[0].tool_use_id")
        );
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "tool_choice": {"type": "tool"}})).as_deref(), Some("tool_choice.name"));
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "tools": [{"name": "a"}], "tool_choice": {"type": "tool", "name": "b"}})).as_deref(), Some("tool_choice.name"));
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "tools": [{"name": "a"}, {"name": "a"}]})).as_deref(), Some("tools[1].name"));
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "stop_sequences": [""]})).as_deref(), Some("stop_sequences[0]"));
        assert_eq!(field(json!({"messages": [{"role": "user", "content": 3}], "max_tokens": 5})).as_deref(), Some("messages[0].content"));
    }

    #[test]
    fn output_formats_ask_for_json_of_their_schema() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}});
        let want = OutputFormat::JsonSchema { name: "output".into(), schema: Some(schema.clone()), strict: true };
        let format = json!({"type": "json_schema", "schema": schema});
        let req = messages(json!({"messages": user, "max_tokens": 5, "output_config": {"format": format, "effort": "low"}})).unwrap();
        assert_eq!(req.output_format, want);
        // The beta API's spelling.
        assert_eq!(messages(json!({"messages": user, "max_tokens": 5, "output_format": format})).unwrap().output_format, want);
        assert_eq!(messages(json!({"messages": user, "max_tokens": 5})).unwrap().output_format, OutputFormat::Text);
        let field = |b: Json| messages(b).unwrap_err().field().map(str::to_string);
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "output_config": {"format": {"type": "xml", "schema": {}}}})).as_deref(), Some("output_config.format.type"));
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "output_config": {"format": {"type": "json_schema"}}})).as_deref(), Some("output_config.format.schema"));
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "output_format": {"type": "json_schema", "schema": [1]}})).as_deref(), Some("output_format.schema"));
        assert_eq!(field(json!({"messages": user, "max_tokens": 5, "output_format": format, "output_config": {"format": format}})).as_deref(), Some("output_format"));
    }

    #[test]
    fn responses_serialize_in_anthropic_shapes() {
        let parsed = ParsedOutput {
            reasoning: "think".into(),
            content: "Hi".into(),
            tool_calls: vec![ParsedToolCall { id: "toolu_0".into(), name: "f".into(), arguments: "{\"a\":[1]}".into() }],
        };
        let msg = MessageResponse::new("msg_1".into(), "m".into(), ResponseBlock::from_parsed(&parsed), Some(StopReason::ToolUse), Usage::new(10, 4, 6));
        assert_eq!(
            serde_json::to_value(&msg).unwrap(),
            json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "thinking", "thinking": "think", "signature": ""}, {"type": "text", "text": "Hi"},
                    {"type": "tool_use", "id": "toolu_0", "name": "f", "input": {"a": [1]}}],
                "stop_reason": "tool_use", "stop_sequence": null,
                "usage": {"input_tokens": 4, "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 6}})
        );
        let delta = BlockDelta::from_delta(&Delta::ToolCallArguments { index: 0, arguments: "{\"a\"".into() }).unwrap();
        let event = StreamEvent::ContentBlockDelta { index: 2, delta };
        assert_eq!(serde_json::to_value(&event).unwrap(), json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"a\""}}));
        assert_eq!(event.event_type(), "content_block_delta");
        assert_eq!(serde_json::to_value(StreamEvent::MessageStop).unwrap(), json!({"type": "message_stop"}));
        assert_eq!(
            serde_json::to_value(StreamEvent::MessageDelta {
                delta: MessageDelta { stop_reason: Some(StopReason::MaxTokens), stop_sequence: None },
                usage: DeltaUsage { output_tokens: 9 },
            })
            .unwrap(),
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": null}, "usage": {"output_tokens": 9}})
        );
        assert!(BlockDelta::from_delta(&Delta::ToolCallStart { index: 0, id: "x".into(), name: "f".into() }).is_none());
    }
}
