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
//! [`ChatPrompt`] (template messages + kwargs + tools) and
//! [`SamplingOptions`], renders and encodes the prompt with
//! [`crate::tokenizer`], runs it, and feeds the decoded text through
//! [`parse::OutputParser`] into the response types.

pub mod anthropic;
pub mod error;
pub mod openai;
pub mod parse;

use serde_json::{Map, Value as Json};

use crate::tokenizer::{ChatTemplate, TokenizerError};
use error::RequestError;
use parse::{ParserOptions, ToolSchemas};

/// Sampling and stopping settings of a request, checked (ranges as OpenAI documents them).
/// `None` leaves a setting to the server's default; the default is one completion with every
/// setting left to the server.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingOptions {
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Softmax temperature, 0 (greedy) to 2.
    pub temperature: Option<f64>,
    /// Nucleus mass, in (0, 1].
    pub top_p: Option<f64>,
    /// Keep only the k most likely tokens (`None`: off; requests write -1 or 0 for off).
    pub top_k: Option<u32>,
    /// Drop tokens less likely than `min_p` times the most likely, in [0, 1].
    pub min_p: Option<f64>,
    /// OpenAI presence penalty, in [-2, 2].
    pub presence_penalty: Option<f64>,
    /// OpenAI frequency penalty, in [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// Multiplicative repetition penalty, > 0 (1 is off).
    pub repetition_penalty: Option<f64>,
    /// The penalties' window in tokens, llama.cpp's `repeat_last_n` (-1: everything, 0: off).
    pub repeat_last_n: Option<i64>,
    /// Seed of the sampler.
    pub seed: Option<u64>,
    /// Strings that end generation (not included in the output).
    pub stop: Vec<String>,
    /// Completions to generate for the prompt (≥ 1).
    pub n: u32,
    /// Return log-probabilities: `Some(k)` with the k most likely alternatives per token.
    pub logprobs: Option<u32>,
    /// Additive logit biases, by token id.
    pub logit_bias: Vec<(u32, f32)>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        Self {
            max_tokens: None,
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: None,
            presence_penalty: None,
            frequency_penalty: None,
            repetition_penalty: None,
            repeat_last_n: None,
            seed: None,
            stop: Vec::new(),
            // One completion: a derived default of 0 would ask for none.
            n: 1,
            logprobs: None,
            logit_bias: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// What the request says about calling tools.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides (the default).
    #[default]
    Auto,
    /// No tool calls: the tools stay in the prompt, the output is not parsed for calls.
    None,
    /// At least one call (OpenAI `required`, Anthropic `any`).
    Required,
    /// A call of this function.
    Function(String),
}

/// The output format the request asks for (`response_format`, Responses `text.format`).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum OutputFormat {
    /// Free text.
    #[default]
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching `schema`.
    JsonSchema {
        /// The schema's name.
        name: String,
        /// The JSON schema (absent: any JSON).
        schema: Option<Json>,
        /// Whether the schema must be followed exactly.
        strict: bool,
    },
}

/// A conversation ready for the chat template, from any of the APIs.
#[derive(Debug, Clone, Default)]
pub struct ChatPrompt {
    /// The messages as the template reads them (`role`, `content`, `reasoning_content`,
    /// `tool_calls` with `arguments` as objects, `tool_call_id`).
    pub messages: Vec<Json>,
    /// Template variables: `tools` (OpenAI function form) when the request has tools, the
    /// request's `chat_template_kwargs`, and `enable_thinking` where the API has a switch.
    pub kwargs: Map<String, Json>,
    /// The tools' declared parameter types, for the output parser.
    pub tools: ToolSchemas,
    /// The request's tool choice.
    pub tool_choice: ToolChoice,
    /// Whether several calls may be made in one turn (default true).
    pub parallel_tool_calls: bool,
    /// End the rendering with the assistant's opening (vLLM's `add_generation_prompt`);
    /// `None` means yes. `Some(false)` continues the conversation's last message instead.
    pub add_generation_prompt: Option<bool>,
}

impl ChatPrompt {
    /// Renders the prompt text (with the generation prompt unless the request turned it off); encode it with
    /// [`crate::tokenizer::Tokenizer::encode_with`]`(text, false)`.
    pub fn render(&self, template: &ChatTemplate) -> Result<String, TokenizerError> {
        template.render_json(&self.messages, self.add_generation_prompt.unwrap_or(true), &self.kwargs)
    }

    /// Options for parsing the completion of the rendered `prompt`: where generation starts
    /// (read from the prompt's tail) and the tools, unless tool choice is `none`.
    pub fn parser_options(&self, prompt: &str, call_id_prefix: impl Into<String>) -> ParserOptions {
        ParserOptions {
            starts_in_reasoning: parse::prompt_ends_in_reasoning(prompt),
            tools: (self.tool_choice != ToolChoice::None && !self.tools.is_empty()).then(|| self.tools.clone()),
            call_id_prefix: call_id_prefix.into(),
        }
    }
}

/// A checked chat request of any API: what a handler runs.
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    /// The model the client named, if any.
    pub model: Option<String>,
    /// The conversation.
    pub prompt: ChatPrompt,
    /// Sampling settings.
    pub sampling: SamplingOptions,
    /// Answer as a stream of events.
    pub stream: bool,
    /// Send usage in the stream (OpenAI `stream_options.include_usage`; always for the
    /// Responses and Anthropic APIs, whose final events carry it).
    pub include_usage: bool,
    /// The output format asked for.
    pub output_format: OutputFormat,
}

/// A tool as the chat template is given it: OpenAI's function form, whichever API it came
/// from, so the model sees one format.
fn template_tool(name: &str, description: Option<&str>, parameters: Option<&Json>) -> Json {
    let mut function = Map::new();
    function.insert("name".into(), Json::String(name.to_string()));
    if let Some(d) = description {
        function.insert("description".into(), Json::String(d.to_string()));
    }
    if let Some(p) = parameters {
        function.insert("parameters".into(), p.clone());
    }
    serde_json::json!({"type": "function", "function": function})
}

/// Tools and their schemas, collected from one request.
#[derive(Default)]
struct ToolSet {
    template: Vec<Json>,
    schemas: ToolSchemas,
    names: Vec<String>,
}

impl ToolSet {
    /// Adds a function; `field` is the path of the tool (`tools[2].function`), `schema_key` the
    /// name of its schema field (`parameters`, `input_schema`).
    fn add(&mut self, field: &str, schema_key: &str, name: &str, description: Option<&str>, parameters: Option<&Json>) -> Result<(), RequestError> {
        if name.is_empty() {
            return Err(RequestError::invalid(format!("{field}.name"), "must not be empty"));
        }
        if self.names.iter().any(|n| n == name) {
            return Err(RequestError::invalid(format!("{field}.name"), format!("two tools are named {name:?}")));
        }
        if parameters.is_some_and(|p| !p.is_object()) {
            return Err(RequestError::invalid(format!("{field}.{schema_key}"), "must be a JSON schema object"));
        }
        self.template.push(template_tool(name, description, parameters));
        self.schemas.insert_from(name, parameters, field, schema_key);
        self.names.push(name.to_string());
        Ok(())
    }

    fn check_choice(&self, choice: &ToolChoice, field: &str) -> Result<(), RequestError> {
        match choice {
            ToolChoice::Function(name) if !self.names.iter().any(|n| n == name) => Err(RequestError::invalid(field, format!("no tool named {name:?} in `tools`"))),
            ToolChoice::Required | ToolChoice::Function(_) if self.names.is_empty() => Err(RequestError::invalid(field, "a tool call is required but `tools` is empty")),
            _ => Ok(()),
        }
    }

    /// Puts the tools into the prompt.
    fn into_prompt(self, prompt: &mut ChatPrompt) {
        if !self.template.is_empty() {
            prompt.kwargs.insert("tools".into(), Json::Array(self.template));
        }
        prompt.tools = self.schemas;
    }
}

/// Checks that `value` (when given) lies in `[lo, hi]`.
fn check_range(field: &str, value: Option<f64>, lo: f64, hi: f64) -> Result<(), RequestError> {
    match value {
        Some(v) if !(lo..=hi).contains(&v) => Err(RequestError::invalid(field, format!("must be between {lo} and {hi}, got {v}"))),
        _ => Ok(()),
    }
}

/// The `top_k` setting: -1 and 0 mean off, as in vLLM and llama.cpp.
fn top_k(field: &str, value: Option<i64>) -> Result<Option<u32>, RequestError> {
    match value {
        None | Some(-1) | Some(0) => Ok(None),
        Some(k) => u32::try_from(k).map(Some).map_err(|_| RequestError::invalid(field, format!("must be -1 or 0 (off) or a positive count, got {k}"))),
    }
}

/// Stop strings: none may be empty.
fn stop_strings(field: &str, stop: Vec<String>) -> Result<Vec<String>, RequestError> {
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(RequestError::invalid(format!("{field}[{i}]"), "a stop string must not be empty"));
    }
    Ok(stop)
}

/// Merges leading system messages into one, since the template accepts a single system
/// message at the start (Responses clients send `instructions` plus `developer` items).
fn push_message(messages: &mut Vec<Json>, message: Json) {
    let is_system = |m: &Json| m.get("role").and_then(Json::as_str) == Some("system");
    if is_system(&message) && messages.iter().all(is_system) {
        if let Some(last) = messages.last_mut() {
            let joined = format!("{}\n\n{}", last["content"].as_str().unwrap_or_default(), message["content"].as_str().unwrap_or_default());
            last["content"] = Json::String(joined);
            return;
        }
    }
    messages.push(message);
}

/// The `enable_thinking` template switch from an API's reasoning setting, unless the request's
/// own `chat_template_kwargs` set it.
fn set_thinking(kwargs: &mut Map<String, Json>, on: Option<bool>) {
    if let Some(on) = on {
        kwargs.entry("enable_thinking").or_insert(Json::Bool(on));
    }
}

/// The current time in seconds since the Unix epoch (the `created` field of responses).
pub fn unix_time() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
