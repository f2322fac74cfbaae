//! Splits a Qwen3.5 completion into reasoning, content and tool calls as its text arrives.
//!
//! The model writes reasoning as `<think>…</think>` (the prompt usually opens the block, so
//! generation starts inside it; see [`prompt_ends_in_reasoning`]) and tool calls as
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=KEY>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! [`OutputParser`] is fed text deltas (as [`crate::tokenizer::TokenStream`] yields them) and
//! returns [`Delta`]s as soon as they are certain: it holds back only text that may be the start
//! of a tag, and whitespace at the edges of reasoning and content (both are trimmed, as the chat
//! template trims them when it renders the turn back). Feeding a text whole or in pieces gives
//! the same result.
//!
//! Tool arguments are typed by the tool's JSON schema as vLLM's `qwen3_coder` parser types them:
//! a parameter declared `integer`, `number`, `boolean`, `null`, `object` or `array` is converted
//! from its text, anything else (a string, an undeclared parameter, an unknown type) stays a
//! string. A value that does not convert as its type is read as JSON when it is JSON (an
//! `anyOf` of several types, written as JSON: what a forced call's grammar writes), and stays
//! the string otherwise. A property that is a `$ref` is typed by what it refers to (in the
//! tool's `$defs` or `definitions`). Unlike vLLM, a boolean that is neither `true` nor `false`
//! stays a string instead of becoming `false`, and containers are read as JSON only (no Python
//! literals).
//!
//! A call the model never closes (generation stopped by `max_tokens` or a stop string) is still
//! returned, with the parameters written so far and the last value as far as it got, as vLLM
//! does; llama.cpp's parser rejects it and returns the text as content instead. Returning it
//! keeps the streamed and the whole result equal (the start of the call has already been sent
//! to a streaming client), and the finish reason tells the client it was cut. A call cut before
//! its `<function=NAME>` is whole (`<tool_call>\n<func`, or `<tool_c` alone when generation was
//! cut rather than ended by the model) is dropped: it was held back, so nothing of it was sent,
//! and it is not text the model meant as an answer; so is a `</tool_call>` cut short after a
//! call's `</function>`. A `<` or `<tool` the model ends its answer on is content. Every API reports a cut turn
//! from these same calls and text. A `<tool_call>` that is not followed by `<function=NAME>`
//! is not a call: its text is content.

use std::collections::HashMap;

use serde_json::Value as Json;

/// A piece of the parsed completion, in the order the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    /// Reasoning text (the inside of `<think>…</think>`).
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A tool call begins: OpenAI's first streamed tool-call delta (id, type, function.name).
    ToolCallStart {
        /// Position of the call among this completion's calls, from 0.
        index: usize,
        /// The call's id (`call_id_prefix` + index).
        id: String,
        /// The function's name.
        name: String,
    },
    /// More of a call's `arguments` JSON text; the fragments of one call concatenate to a JSON
    /// object.
    ToolCallArguments {
        /// Which call ([`Delta::ToolCallStart::index`]).
        index: usize,
        /// The next fragment.
        arguments: String,
    },
}

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    /// The call's id.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text (an object), as OpenAI's `function.arguments` carries them.
    pub arguments: String,
}

impl ParsedToolCall {
    /// The arguments as a JSON value, as Anthropic's `tool_use.input` carries them. The parser
    /// always writes a valid object; an empty object stands in should it ever not parse.
    pub fn input(&self) -> Json {
        serde_json::from_str(&self.arguments).unwrap_or_else(|_| Json::Object(Default::default()))
    }
}

/// A whole parsed completion: what the [`Delta`]s of a stream add up to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    /// All reasoning text (empty when the model did not reason).
    pub reasoning: String,
    /// All answer text.
    pub content: String,
    /// The tool calls, in order.
    pub tool_calls: Vec<ParsedToolCall>,
}

impl ParsedOutput {
    /// Adds one delta.
    pub fn apply(&mut self, delta: &Delta) {
        match delta {
            Delta::Reasoning(t) => self.reasoning.push_str(t),
            Delta::Content(t) => self.content.push_str(t),
            Delta::ToolCallStart { id, name, .. } => self.tool_calls.push(ParsedToolCall { id: id.clone(), name: name.clone(), arguments: String::new() }),
            Delta::ToolCallArguments { index, arguments } => {
                if let Some(call) = self.tool_calls.get_mut(*index) {
                    call.arguments.push_str(arguments);
                }
            }
        }
    }
}

/// Whether generation after `prompt` starts inside reasoning: the rendered prompt ends with an
/// open `<think>` (Qwen3.5 with thinking on) rather than a closed `<think>\n\n</think>` block
/// (thinking off) or no block at all.
pub fn prompt_ends_in_reasoning(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

/// The declared JSON-schema types of the request's tools' parameters, which the parser uses to
/// type argument values.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    /// Function name → parameter name → declared type.
    functions: HashMap<String, HashMap<String, ParamType>>,
    /// The functions in the request's order with their `parameters` schemas, for the
    /// grammar of a forced call ([`crate::grammar`]).
    declared: Vec<(String, Option<Json>)>,
    /// Function name → the request field of its tool (`tools[2].function`) and the name of its
    /// schema field there (`parameters`, `input_schema`), for errors that name a part of them.
    fields: HashMap<String, (String, String)>,
}

impl ToolSchemas {
    /// No tools.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a function with its `parameters` JSON schema (`{"type": "object", "properties":
    /// {...}}`); a schema without `properties` declares no parameter types.
    pub fn insert(&mut self, name: &str, parameters: Option<&Json>) {
        let types = parameters
            .and_then(|p| p.get("properties"))
            .and_then(Json::as_object)
            .map(|props| props.iter().map(|(k, v)| (k.clone(), ParamType::of(v, parameters))).collect())
            .unwrap_or_default();
        self.functions.insert(name.to_string(), types);
        self.declared.retain(|(n, _)| n != name);
        self.declared.push((name.to_string(), parameters.cloned()));
    }

    /// [`insert`](Self::insert), recording where the tool is in the request (`tool_field`:
    /// `tools[2].function`) and its schema's key there (`parameters`), for errors that name a
    /// part of them.
    pub fn insert_from(&mut self, name: &str, parameters: Option<&Json>, tool_field: &str, schema_key: &str) {
        self.insert(name, parameters);
        self.fields.insert(name.to_string(), (tool_field.to_string(), schema_key.to_string()));
    }

    /// The request field the schema of `name` came from (`tools[2].function.parameters`), when
    /// recorded.
    pub fn field(&self, name: &str) -> Option<String> {
        self.fields.get(name).map(|(tool, key)| format!("{tool}.{key}"))
    }

    /// The request field of the name of `name`'s tool (`tools[2].function.name`), when recorded.
    pub fn name_field(&self, name: &str) -> Option<String> {
        self.fields.get(name).map(|(tool, _)| format!("{tool}.name"))
    }

    /// The functions in the order they were added, with their `parameters` schemas.
    pub fn functions(&self) -> impl Iterator<Item = (&str, Option<&Json>)> {
        self.declared.iter().map(|(n, p)| (n.as_str(), p.as_ref()))
    }

    /// Whether the parser reads a value of the property schema `schema` of the parameters
    /// schema `root` as raw text (a string, or a schema without a type it knows) rather than
    /// as JSON.
    pub fn is_text_param(schema: &Json, root: Option<&Json>) -> bool {
        ParamType::of(schema, root).kind == Kind::String
    }

    /// Whether the parser reads one of the [`NULL_WORDS`] as JSON `null` for a text parameter
    /// (see [`ToolSchemas::is_text_param`]) of the property schema `schema`: its schema admits
    /// `null` beside the string (`"type": ["string", "null"]`, an `anyOf` with a null type).
    pub fn is_nullable_text_param(schema: &Json, root: Option<&Json>) -> bool {
        let t = ParamType::of(schema, root);
        t.kind == Kind::String && t.nullable
    }

    /// Number of functions.
    pub fn len(&self) -> usize {
        self.functions.len()
    }

    /// Whether there are no functions.
    pub fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }

    fn param_type(&self, function: &str, param: &str) -> ParamType {
        self.functions.get(function).and_then(|f| f.get(param)).copied().unwrap_or(ParamType::STRING)
    }
}

/// The values the parser reads as JSON `null` where a parameter's schema admits null (or its
/// type is not a string), compared without regard to ASCII case after trimming whitespace:
/// JSON's `null`, and the `None` the template writes for Python's None (`| string`).
pub const NULL_WORDS: [&str; 2] = ["null", "none"];

/// Most `$ref` hops followed from one schema (a cycle of references ends there).
const MAX_REF_HOPS: usize = 32;

/// `schema` with its `$ref`s followed within `root` (a local JSON pointer: `#/$defs/NAME`,
/// `#/definitions/NAME`, `#`, ...), as the JSON-schema compilers resolve them.
///
/// # Errors
/// A reference that is not local, points at nothing, or loops; the message names it.
pub fn resolve_ref<'a>(schema: &'a Json, root: Option<&'a Json>) -> Result<&'a Json, String> {
    let mut s = schema;
    for _ in 0..MAX_REF_HOPS {
        let Some(r) = s.get("$ref") else { return Ok(s) };
        let Some(r) = r.as_str() else { return Err("`$ref` must be a string".into()) };
        let Some(pointer) = r.strip_prefix('#') else {
            return Err(format!("`$ref` {r:?} is not a reference inside the schema (`#/$defs/NAME`)"));
        };
        // JSON pointer escapes in the fragment (`~1` is `/`, `~0` is `~`) are the pointer's own.
        s = root.and_then(|root| root.pointer(pointer)).ok_or_else(|| format!("`$ref` {r:?} refers to nothing in the schema"))?;
    }
    Err(format!("`$ref`s of more than {MAX_REF_HOPS} hops (a cycle?)"))
}

/// What a parameter's schema declares, as far as converting its text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ParamType {
    kind: Kind,
    /// The schema admits `null` (`"type": ["integer", "null"]`, or an `anyOf` with null).
    nullable: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    String,
    Integer,
    Number,
    Boolean,
    Null,
    Container,
}

impl ParamType {
    const STRING: Self = Self { kind: Kind::String, nullable: false };

    /// Reads a property schema of the parameters schema `root` (`$ref`s followed in it). Type
    /// names are matched as vLLM matches them (`int…`, `num…`, `float…`, `bool`, `dict…`,
    /// `list…`, ...); unknown names, and schemas without a type, are strings.
    fn of(schema: &Json, root: Option<&Json>) -> Self {
        let schema = resolve_ref(schema, root).unwrap_or(schema);
        fn kind_of(name: &str) -> Kind {
            let t = name.trim().to_ascii_lowercase();
            let starts = |prefixes: &[&str]| prefixes.iter().any(|p| t.starts_with(p));
            if starts(&["int", "uint", "long", "short", "unsigned"]) {
                Kind::Integer
            } else if starts(&["num", "float"]) {
                Kind::Number
            } else if matches!(t.as_str(), "boolean" | "bool" | "binary") {
                Kind::Boolean
            } else if t == "null" {
                Kind::Null
            } else if matches!(t.as_str(), "object" | "array" | "arr") || starts(&["dict", "list"]) {
                Kind::Container
            } else {
                Kind::String
            }
        }
        // The first non-null type of a list, and whether null is among them.
        fn pick(names: impl Iterator<Item = Kind>) -> ParamType {
            let mut nullable = false;
            let mut kind = None;
            for k in names {
                if k == Kind::Null {
                    nullable = true;
                } else if kind.is_none() {
                    kind = Some(k);
                }
            }
            ParamType { kind: kind.unwrap_or(if nullable { Kind::Null } else { Kind::String }), nullable }
        }
        match schema.get("type") {
            Some(Json::String(t)) => {
                let kind = kind_of(t);
                return Self { kind, nullable: kind == Kind::Null };
            }
            Some(Json::Array(ts)) => return pick(ts.iter().filter_map(Json::as_str).map(kind_of)),
            _ => {}
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Json::Array(options)) = schema.get(key) {
                return pick(options.iter().filter_map(|o| resolve_ref(o, root).unwrap_or(o).get("type").and_then(Json::as_str)).map(kind_of));
            }
        }
        Self::STRING
    }

    /// The JSON value of a parameter's text: converted as its type, else read as JSON (a
    /// typed parameter's other alternatives), else the text itself.
    fn convert(self, raw: &str) -> Json {
        let text = || {
            if self.kind != Kind::String {
                if let Ok(v) = serde_json::from_str::<Json>(raw.trim()) {
                    return v;
                }
            }
            Json::String(raw.to_string())
        };
        let trimmed = raw.trim();
        let is_null = NULL_WORDS.iter().any(|w| trimmed.eq_ignore_ascii_case(w));
        // The template writes a None argument as `None` (`| string`), JSON writes `null`.
        if is_null && (self.nullable || self.kind != Kind::String) {
            return Json::Null;
        }
        match self.kind {
            Kind::String | Kind::Null => text(),
            Kind::Integer => {
                if let Ok(n) = trimmed.parse::<i64>() {
                    Json::from(n)
                } else if let Ok(n) = trimmed.parse::<u64>() {
                    Json::from(n)
                } else {
                    text()
                }
            }
            Kind::Number => match trimmed.parse::<f64>() {
                // Integral values become integers, as vLLM does (`2.0` → 2).
                Ok(x) if x.is_finite() && x.fract() == 0.0 && x.abs() < 9.0e15 => Json::from(x as i64),
                Ok(x) => serde_json::Number::from_f64(x).map_or_else(text, Json::Number),
                Err(_) => text(),
            },
            Kind::Boolean => {
                if trimmed.eq_ignore_ascii_case("true") {
                    Json::Bool(true)
                } else if trimmed.eq_ignore_ascii_case("false") {
                    Json::Bool(false)
                } else {
                    text()
                }
            }
            Kind::Container => serde_json::from_str(trimmed).unwrap_or_else(|_| text()),
        }
    }
}

/// What the parser needs to know about the request.
#[derive(Debug, Clone, Default)]
pub struct ParserOptions {
    /// Generation starts inside reasoning (see [`prompt_ends_in_reasoning`]).
    pub starts_in_reasoning: bool,
    /// The request's tools; `None` (or empty) turns tool-call parsing off, so `<tool_call>` in
    /// the text is plain text.
    pub tools: Option<ToolSchemas>,
    /// Tool call ids are this prefix followed by the call's index (e.g. `call_<request id>_`).
    pub call_id_prefix: String,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// A function or parameter name longer than this is not a name (the text is then not a call),
/// so a stray `<function=` cannot make the parser hold text back indefinitely.
const MAX_NAME_BYTES: usize = 256;

/// Where the parser is in the completion.
#[derive(Debug, Clone, PartialEq)]
enum Mode {
    Reasoning,
    Content,
    /// After `<tool_call>`, before `<function=NAME>` is complete.
    CallHeader,
    /// Inside a function, between parameters.
    Params,
    /// Inside a parameter's value.
    Value {
        ty: ParamType,
        /// The leading newline after `<parameter=NAME>` has been dealt with.
        started: bool,
        /// The text so far of a typed value (converted once whole); strings stream instead.
        raw: String,
    },
    /// After `</function>`, before `</tool_call>`.
    CallEnd,
}

/// Trimming state of reasoning or content text.
#[derive(Debug, Default)]
struct Trim {
    /// Something non-blank has been emitted.
    started: bool,
    /// Trailing whitespace held until more text shows it is not the end.
    pending: String,
}

/// The streaming parser: [`push`](Self::push) each text delta, then [`finish`](Self::finish).
#[derive(Debug)]
pub struct OutputParser {
    tools: Option<ToolSchemas>,
    call_id_prefix: String,
    mode: Mode,
    /// Text received and not yet consumed.
    buf: String,
    reasoning: Trim,
    content: Trim,
    /// A leading `<think>` may still open reasoning (nothing has been emitted).
    fresh: bool,
    calls: usize,
    /// The current call's function name and how many parameters it has written.
    function: String,
    params: usize,
    finished: bool,
    /// Set by [`OutputParser::finish`]: generation was cut rather than ended by the model.
    cut: bool,
}

impl OutputParser {
    /// A parser for one completion.
    pub fn new(options: ParserOptions) -> Self {
        let tools = options.tools.filter(|t| !t.is_empty());
        Self {
            tools,
            call_id_prefix: options.call_id_prefix,
            mode: if options.starts_in_reasoning { Mode::Reasoning } else { Mode::Content },
            buf: String::new(),
            reasoning: Trim::default(),
            content: Trim::default(),
            fresh: true,
            cut: false,
            calls: 0,
            function: String::new(),
            params: 0,
            finished: false,
        }
    }

    /// Parses a whole completion.
    pub fn parse(text: &str, options: ParserOptions, cut: bool) -> ParsedOutput {
        let mut parser = Self::new(options);
        let mut out = ParsedOutput::default();
        for d in parser.push(text).iter().chain(parser.finish(cut).iter()) {
            out.apply(d);
        }
        out
    }

    /// Feeds the next text delta; returns what became certain.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.buf.push_str(text);
        self.run(false, &mut out);
        out
    }

    /// Ends the completion: returns what was held back (a partial tag is text after all; an
    /// unclosed tool call is closed). `cut`: generation was stopped from outside (`max_tokens`,
    /// the context, a cancel) rather than ended by the model (EOS, a stop string); then a
    /// trailing start of `<tool_call>` is a call that never was and is dropped, where at the
    /// model's own end it is text it wrote (an answer ending in `<`). Later calls to `push`
    /// and `finish` return nothing.
    pub fn finish(&mut self, cut: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.cut = cut;
        self.run(true, &mut out);
        self.finished = true;
        out
    }

    /// Number of tool calls started so far (a finish reason of `tool_calls` when non-zero).
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    fn tools_on(&self) -> bool {
        self.tools.is_some()
    }

    /// Consumes as much of `buf` as is certain; with `eof`, all of it.
    fn run(&mut self, eof: bool, out: &mut Vec<Delta>) {
        loop {
            let progressed = match self.mode.clone() {
                Mode::Reasoning => self.step_text(true, eof, out),
                Mode::Content => self.step_text(false, eof, out),
                Mode::CallHeader => self.step_header(eof, out),
                Mode::Params => self.step_params(eof, out),
                Mode::Value { ty, started, raw } => self.step_value(ty, started, raw, eof, out),
                Mode::CallEnd => self.step_call_end(eof),
            };
            if !progressed {
                break;
            }
        }
    }

    /// Reasoning or content text: emits up to the next tag (or what may be one), handles it.
    /// Returns whether the mode changed (so the loop goes on).
    fn step_text(&mut self, reasoning: bool, eof: bool, out: &mut Vec<Delta>) -> bool {
        let mut tags: Vec<&str> = Vec::with_capacity(3);
        if reasoning {
            tags.push(THINK_CLOSE);
        }
        if self.tools_on() {
            tags.push(CALL_OPEN);
        }
        // A stray `<think>` at the very start opens (or repeats the opening of) reasoning.
        if self.fresh {
            tags.push(THINK_OPEN);
        }
        let found = tags.iter().filter_map(|t| self.buf.find(t).map(|i| (i, *t))).min_by_key(|(i, _)| *i);
        let Some((i, tag)) = found else {
            // At a cut end, a cut `<tool_call>` is the start of a call that never was: dropped.
            let cut = if eof && self.cut && self.tools_on() { partial_suffix(&self.buf, &[CALL_OPEN]) } else { 0 };
            self.buf.truncate(self.buf.len() - cut);
            let hold = if eof { 0 } else { partial_suffix(&self.buf, &tags) };
            let text: String = self.buf.drain(..self.buf.len() - hold).collect();
            self.emit_text(reasoning, &text, out);
            if eof {
                // Trailing whitespace is the end of the text: trimmed.
                self.reasoning.pending.clear();
                self.content.pending.clear();
            }
            return false;
        };
        let before: String = self.buf.drain(..i).collect();
        self.buf.drain(..tag.len());
        if tag == THINK_OPEN {
            if before.trim().is_empty() {
                self.fresh = false;
                self.mode = Mode::Reasoning;
            } else {
                // Not at the start after all: plain text.
                self.emit_text(reasoning, &(before + tag), out);
            }
            return true;
        }
        self.emit_text(reasoning, &before, out);
        // Whitespace before `</think>` or a call is the end of that text.
        if reasoning {
            self.reasoning.pending.clear();
        }
        self.fresh = false;
        self.mode = if tag == CALL_OPEN { Mode::CallHeader } else { Mode::Content };
        true
    }

    /// Emits reasoning or content text, trimming it at both ends across deltas.
    fn emit_text(&mut self, reasoning: bool, text: &str, out: &mut Vec<Delta>) {
        let trim = if reasoning { &mut self.reasoning } else { &mut self.content };
        let body_end = text.trim_end().len();
        let (body, tail) = text.split_at(body_end);
        if body.is_empty() {
            if trim.started {
                trim.pending.push_str(tail);
            }
            return;
        }
        let mut piece = std::mem::take(&mut trim.pending);
        piece.push_str(if trim.started { body } else { body.trim_start() });
        trim.started = true;
        trim.pending.push_str(tail);
        self.fresh = false;
        push_delta(out, if reasoning { Delta::Reasoning(piece) } else { Delta::Content(piece) });
    }

    /// After `<tool_call>`: waits for `<function=NAME>`; anything else makes the tag text.
    fn step_header(&mut self, eof: bool, out: &mut Vec<Delta>) -> bool {
        let lead = self.buf.len() - self.buf.trim_start().len();
        let rest = &self.buf[lead..];
        let not_a_call = |parser: &mut Self, out: &mut Vec<Delta>| {
            // The tag is content, and so is what follows (looked at again as content).
            parser.mode = Mode::Content;
            parser.emit_text(false, CALL_OPEN, out);
            true
        };
        // The text ended inside what reads as the call's header: the call was cut before it
        // began, and is dropped (nothing of it was sent).
        let cut = |parser: &mut Self| {
            parser.buf.clear();
            parser.mode = Mode::Content;
            true
        };
        if rest.len() < FUNCTION_OPEN.len() {
            if FUNCTION_OPEN.starts_with(rest) {
                return if eof { cut(self) } else { false };
            }
            return not_a_call(self, out);
        }
        if !rest.starts_with(FUNCTION_OPEN) {
            return not_a_call(self, out);
        }
        let name_region = &rest[FUNCTION_OPEN.len()..];
        let Some(end) = name_region.find('>') else {
            if !plausible_name(name_region) {
                return not_a_call(self, out);
            }
            return if eof { cut(self) } else { false };
        };
        let name = &name_region[..end];
        if name.is_empty() || !plausible_name(name) {
            return not_a_call(self, out);
        }
        let name = name.to_string();
        self.buf.drain(..lead + FUNCTION_OPEN.len() + end + 1);
        // Whitespace before the call is the end of the content before it.
        self.content.pending.clear();
        let index = self.calls;
        self.calls += 1;
        out.push(Delta::ToolCallStart { index, id: format!("{}{index}", self.call_id_prefix), name: name.clone() });
        self.function = name;
        self.params = 0;
        self.mode = Mode::Params;
        true
    }

    /// Between parameters: the next `<parameter=NAME>` or `</function>`.
    fn step_params(&mut self, eof: bool, out: &mut Vec<Delta>) -> bool {
        let lead = self.buf.len() - self.buf.trim_start().len();
        self.buf.drain(..lead);
        if self.buf.starts_with(FUNCTION_CLOSE) {
            self.buf.drain(..FUNCTION_CLOSE.len());
            self.close_arguments(out);
            self.mode = Mode::CallEnd;
            return true;
        }
        if let Some(name_region) = self.buf.strip_prefix(PARAM_OPEN) {
            match name_region.find('>') {
                Some(end) if plausible_name(&name_region[..end]) => {
                    let name = name_region[..end].to_string();
                    self.buf.drain(..PARAM_OPEN.len() + end + 1);
                    self.open_parameter(&name, out);
                    return true;
                }
                None if !eof && plausible_name(name_region) => return false,
                // Not a parameter tag: skipped below like other stray text.
                _ => {}
            }
        } else if !eof && (PARAM_OPEN.starts_with(self.buf.as_str()) || FUNCTION_CLOSE.starts_with(self.buf.as_str())) {
            return false;
        }
        if self.buf.is_empty() {
            if eof {
                // Never closed: the arguments end where the text does.
                self.close_arguments(out);
                self.mode = Mode::CallEnd;
                return true;
            }
            return false;
        }
        // Stray text between parameters is dropped up to the next tag.
        let first = self.buf.chars().next().map_or(0, char::len_utf8);
        let skip = self.buf[first..].find('<').map_or(self.buf.len(), |i| i + first);
        self.buf.drain(..skip);
        true
    }

    fn open_parameter(&mut self, name: &str, out: &mut Vec<Delta>) {
        let ty = self.tools.as_ref().map_or(ParamType::STRING, |t| t.param_type(&self.function, name));
        let mut fragment = String::from(if self.params == 0 { "{" } else { "," });
        fragment.push_str(&json_string(name));
        fragment.push(':');
        if ty == ParamType::STRING {
            fragment.push('"');
        }
        self.params += 1;
        self.emit_arguments(fragment, out);
        self.mode = Mode::Value { ty, started: false, raw: String::new() };
    }

    fn close_arguments(&mut self, out: &mut Vec<Delta>) {
        let end = if self.params == 0 { "{}" } else { "}" };
        self.emit_arguments(end.to_string(), out);
    }

    fn emit_arguments(&mut self, arguments: String, out: &mut Vec<Delta>) {
        if arguments.is_empty() {
            return;
        }
        push_delta(out, Delta::ToolCallArguments { index: self.calls - 1, arguments });
    }

    /// A parameter's value, up to its structural `</parameter>`.
    fn step_value(&mut self, ty: ParamType, mut started: bool, mut raw: String, eof: bool, out: &mut Vec<Delta>) -> bool {
        if !started {
            // The template writes a newline after `<parameter=NAME>`: not part of the value.
            if self.buf.starts_with('\n') {
                self.buf.drain(..1);
            } else if self.buf.starts_with("\r\n") {
                self.buf.drain(..2);
            } else if (self.buf.is_empty() || self.buf == "\r") && !eof {
                return false;
            }
            started = true;
        }
        let (value_end, consumed, done) = match find_value_end(&self.buf, eof) {
            ValueEnd::Found { value_end, resume } => (value_end, resume, true),
            ValueEnd::Partial(at) => (at, at, false),
            ValueEnd::NotYet if eof => {
                let end = self.buf.strip_suffix('\n').map_or(self.buf.len(), str::len);
                (end, self.buf.len(), true)
            }
            ValueEnd::NotYet => (self.buf.len(), self.buf.len(), false),
        };
        let piece: String = self.buf[..value_end].to_string();
        self.buf.drain(..consumed);
        let string = ty == ParamType::STRING;
        if string {
            let mut fragment = json_string_body(&piece);
            if done {
                fragment.push('"');
            }
            self.emit_arguments(fragment, out);
        } else {
            raw.push_str(&piece);
            if done {
                let value = ty.convert(&raw);
                self.emit_arguments(value.to_string(), out);
            }
        }
        if done {
            self.mode = Mode::Params;
            return true;
        }
        self.mode = Mode::Value { ty, started, raw };
        false
    }

    /// After `</function>`: drops `</tool_call>`; any other text is content again.
    fn step_call_end(&mut self, eof: bool) -> bool {
        let rest = self.buf.trim_start();
        if let Some(after) = rest.strip_prefix(CALL_CLOSE) {
            self.buf = after.to_string();
            self.mode = Mode::Content;
            return true;
        }
        if CALL_CLOSE.starts_with(rest) {
            if !eof {
                return false;
            }
            // Cut inside the closing tag: the call is complete, the fragment is no text.
            self.buf.clear();
        }
        self.mode = Mode::Content;
        true
    }
}

/// Adds a delta, merging it into the previous one of the same kind.
fn push_delta(out: &mut Vec<Delta>, delta: Delta) {
    match (out.last_mut(), delta) {
        (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) | (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
        (Some(Delta::ToolCallArguments { index: i, arguments: a }), Delta::ToolCallArguments { index, arguments }) if *i == index => a.push_str(&arguments),
        (_, delta) => out.push(delta),
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
fn partial_suffix(text: &str, tags: &[&str]) -> usize {
    tags.iter().map(|tag| (1..tag.len().min(text.len() + 1)).rev().find(|&k| text.ends_with(&tag[..k])).unwrap_or(0)).max().unwrap_or(0)
}

/// A function or parameter name, or the start of one: no whitespace or markup, not too long.
fn plausible_name(name: &str) -> bool {
    name.len() <= MAX_NAME_BYTES && !name.chars().any(|c| c.is_whitespace() || matches!(c, '<' | '>' | '"' | '\''))
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    Json::String(s.to_string()).to_string()
}

/// `s` escaped for the inside of a JSON string literal (escaping is per character, so the
/// escaped pieces of a string concatenate to the escaped string).
fn json_string_body(s: &str) -> String {
    let quoted = json_string(s);
    quoted[1..quoted.len() - 1].to_string()
}

/// Where a parameter value ends in the text after its opening tag.
#[derive(Debug, PartialEq, Eq)]
enum ValueEnd {
    /// The value is `text[..value_end]`; parsing resumes (between parameters) at `resume`.
    Found { value_end: usize, resume: usize },
    /// `text[..at]` is value; what follows may be its end.
    Partial(usize),
    /// All of the text is value so far.
    NotYet,
}

/// Finds the structural end of a value: `</parameter>` followed (after whitespace) by the next
/// `<parameter=` or `</function>`, or by the end of the completion. A `</parameter>` followed by
/// anything else is part of the value (code that mentions the tag), so it is not cut short.
/// The newline the template writes before `</parameter>` is not part of the value.
fn find_value_end(text: &str, eof: bool) -> ValueEnd {
    let strip_newline = |i: usize| {
        if text[..i].ends_with('\n') {
            i - 1
        } else {
            i
        }
    };
    for (i, _) in text.match_indices('<') {
        let rest = &text[i..];
        if let Some(after) = rest.strip_prefix(PARAM_CLOSE) {
            let next = after.trim_start();
            if next.starts_with(PARAM_OPEN) || next.starts_with(FUNCTION_CLOSE) {
                return ValueEnd::Found { value_end: strip_newline(i), resume: i + PARAM_CLOSE.len() };
            }
            if PARAM_OPEN.starts_with(next) || FUNCTION_CLOSE.starts_with(next) {
                if eof {
                    return ValueEnd::Found { value_end: strip_newline(i), resume: i + PARAM_CLOSE.len() };
                }
                return ValueEnd::Partial(strip_newline(i));
            }
        } else if PARAM_CLOSE.starts_with(rest) {
            if !eof {
                return ValueEnd::Partial(strip_newline(i));
            }
            // The completion stopped inside the closing tag: the tag is not value (vLLM leaked
            // such a `</parameter` into arguments).
            if rest.len() >= 2 {
                return ValueEnd::Found { value_end: strip_newline(i), resume: text.len() };
            }
        }
    }
    if !eof && text.ends_with('\n') {
        return ValueEnd::Partial(text.len() - 1);
    }
    ValueEnd::NotYet
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather_tools() -> ToolSchemas {
        let mut tools = ToolSchemas::new();
        tools.insert(
            "get_weather",
            Some(&json!({"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "ratio": {"type": "number"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "filter": {"type": "object"},
                "limit": {"type": ["integer", "null"]},
                "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}
            }})),
        );
        tools.insert("now", Some(&json!({"type": "object", "properties": {}})));
        tools.insert("write_file", None);
        tools
    }

    fn options(starts_in_reasoning: bool, tools: bool) -> ParserOptions {
        ParserOptions { starts_in_reasoning, tools: tools.then(weather_tools), call_id_prefix: "call_x_".into() }
    }

    fn call(index: usize, name: &str, arguments: Json) -> ParsedToolCall {
        ParsedToolCall { id: format!("call_x_{index}"), name: name.into(), arguments: arguments.to_string() }
    }

    /// `text` as a completion cut by `max_tokens` (what most tests here look at).
    fn parse(text: &str, starts_in_reasoning: bool, tools: bool) -> ParsedOutput {
        OutputParser::parse(text, options(starts_in_reasoning, tools), true)
    }

    fn streamed(pieces: &[&str], starts_in_reasoning: bool, tools: bool) -> ParsedOutput {
        let mut parser = OutputParser::new(options(starts_in_reasoning, tools));
        let mut out = ParsedOutput::default();
        for piece in pieces {
            for d in parser.push(piece) {
                assert_ne!(d, Delta::Content(String::new()));
                assert_ne!(d, Delta::Reasoning(String::new()));
                out.apply(&d);
            }
        }
        for d in parser.finish(true) {
            out.apply(&d);
        }
        out
    }

    /// Every split of `text` into two and three pieces (at char boundaries) parses as the whole.
    fn assert_split_invariant(text: &str, starts_in_reasoning: bool, tools: bool) {
        let whole = parse(text, starts_in_reasoning, tools);
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &a in &cuts {
            assert_eq!(streamed(&[&text[..a], &text[a..]], starts_in_reasoning, tools), whole, "split at {a} of {text:?}");
            for &b in cuts.iter().filter(|&&b| b >= a) {
                assert_eq!(streamed(&[&text[..a], &text[a..b], &text[b..]], starts_in_reasoning, tools), whole, "split at {a}, {b} of {text:?}");
            }
        }
        // And one character at a time, as a detokenizer may yield it.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(streamed(&pieces, starts_in_reasoning, tools), whole);
    }

    const PROSE_AND_CALL: &str =
        "I'll check the weather.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn reasoning_then_content() {
        let text = "Two plus two.\nIt is 4.\n</think>\n\nThe answer is **4**.\n";
        let out = parse(text, true, false);
        assert_eq!(out.reasoning, "Two plus two.\nIt is 4.");
        assert_eq!(out.content, "The answer is **4**.");
        assert!(out.tool_calls.is_empty());
        assert_split_invariant(text, true, false);
    }

    #[test]
    fn thinking_off_is_content_and_a_stray_think_block_is_reasoning() {
        let out = parse("Hello! </think> is a tag.", false, false);
        assert_eq!(out.content, "Hello! </think> is a tag.");
        assert_eq!(out.reasoning, "");

        let text = "\n<think>\nHmm.\n</think>\n\nHi.";
        let out = parse(text, false, false);
        assert_eq!((out.reasoning.as_str(), out.content.as_str()), ("Hmm.", "Hi."));
        assert_split_invariant(text, false, false);

        // A repeated `<think>` at the start of reasoning is dropped; one later is text.
        let text = "<think>\nA <think> B\n</think>\nC";
        let out = parse(text, true, false);
        assert_eq!((out.reasoning.as_str(), out.content.as_str()), ("A <think> B", "C"));
        assert_split_invariant(text, true, false);
    }

    #[test]
    fn unclosed_reasoning_stays_reasoning() {
        let out = parse("still thinking </thi", true, true);
        assert_eq!(out.reasoning, "still thinking </thi");
        assert_eq!(out.content, "");
    }

    #[test]
    fn prose_then_typed_call() {
        let out = parse(PROSE_AND_CALL, false, true);
        assert_eq!(out.content, "I'll check the weather.");
        assert_eq!(out.tool_calls, [call(0, "get_weather", json!({"city": "Paris", "days": 2}))]);
        assert_eq!(out.tool_calls[0].input()["days"], json!(2));
        assert_split_invariant(PROSE_AND_CALL, false, true);
    }

    #[test]
    fn several_calls_after_reasoning() {
        let text = "Need both.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>";
        let out = parse(text, true, true);
        assert_eq!(out.reasoning, "Need both.");
        assert_eq!(out.content, "");
        assert_eq!(out.tool_calls, [call(0, "get_weather", json!({"city": "Oslo"})), call(1, "now", json!({})),]);
        assert_eq!(out.tool_calls[1].arguments, "{}");
        assert_split_invariant(text, true, true);
    }

    #[test]
    fn a_call_inside_reasoning_ends_it() {
        let text = "I should look it up.\n<tool_call>\n<function=now>\n</function>\n</tool_call>";
        let out = parse(text, true, true);
        assert_eq!(out.reasoning, "I should look it up.");
        assert_eq!(out.content, "");
        assert_eq!(out.tool_calls, [call(0, "now", json!({}))]);
        assert_split_invariant(text, true, true);
    }

    #[test]
    fn multi_line_values_keep_their_text_and_literal_tags() {
        // A file body that itself mentions `</parameter>` and `</function>`.
        let body = "fn main() {\n    // ends with </parameter> and </function>\n    println!(\"é😀\");\n}\n";
        let text = format!("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=content>\n{body}\n</parameter>\n</function>\n</tool_call>");
        let out = parse(&text, false, true);
        assert_eq!(out.tool_calls, [call(0, "write_file", json!({"path": "src/main.rs", "content": body}))]);
        assert_split_invariant(&text, false, true);
    }

    #[test]
    fn values_are_typed_by_the_schema() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nthree\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n2.50\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=filter>\n{\"k\": [1, null]}\n</parameter>\n<parameter=limit>\nNone\n</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>";
        let out = parse(text, false, true);
        let args = out.tool_calls[0].input();
        assert_eq!(
            args,
            json!({"city": "42", "days": "three", "metric": true, "ratio": 2.5,
                   "tags": ["a", "b"], "filter": {"k": [1, null]}, "limit": null,
                   "note": null, "extra": "7"})
        );
        assert_split_invariant(text, false, true);

        let ty = |schema: Json| ParamType::of(&schema, None);
        let number = ty(json!({"type": "number"}));
        assert_eq!(number.convert("3.0"), json!(3));
        assert_eq!(number.convert("-1e-3"), json!(-0.001));
        assert_eq!(number.convert("inf"), json!("inf"));
        let boolean = ty(json!({"type": "boolean"}));
        assert_eq!(boolean.convert("FALSE"), json!(false));
        assert_eq!(boolean.convert("yes"), json!("yes"));
        let array = ty(json!({"type": "array"}));
        assert_eq!(array.convert("[1, 2"), json!("[1, 2"));
        assert_eq!(ty(json!({"type": "integer"})).convert(" 12 "), json!(12));
        assert_eq!(ty(json!({"type": "string"})).convert("null"), json!("null"));
        assert_eq!(ty(json!({"enum": ["a"]})).convert("None"), json!("None"));
    }

    #[test]
    fn an_unclosed_call_is_returned_as_far_as_it_got() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew Yo";
        let out = parse(text, false, true);
        assert_eq!(out.tool_calls, [call(0, "get_weather", json!({"city": "New Yo"}))]);
        assert_split_invariant(text, false, true);

        // Cut inside the closing tag: the partial tag is not part of the value.
        let out = parse("<tool_call>\n<function=get_weather>\n<parameter=days>\n5\n</param", false, true);
        assert_eq!(out.tool_calls[0].input(), json!({"days": 5}));

        // Cut after a parameter, or before any.
        let out = parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n", false, true);
        assert_eq!(out.tool_calls[0].input(), json!({"city": "Rome"}));
        let out = parse("<tool_call>\n<function=now>", false, true);
        assert_eq!(out.tool_calls, [call(0, "now", json!({}))]);
    }

    #[test]
    fn a_tool_call_tag_without_a_function_is_content() {
        let text = "Use <tool_call> tags.\n<tool_call> then text";
        let out = parse(text, false, true);
        assert_eq!(out.content, text);
        assert!(out.tool_calls.is_empty());
        assert_split_invariant(text, false, true);

        // A header that is not one, at the end of generation, is text too.
        let out = parse("Look: <tool_call>\n<fun ction", false, true);
        assert_eq!(out.content, "Look: <tool_call>\n<fun ction");
        assert!(out.tool_calls.is_empty());
    }

    #[test]
    fn a_call_cut_before_its_name_is_whole_is_dropped_at_every_cut() {
        // Two calls cut at every byte: the calls whose `<function=NAME>` was whole come back (the
        // last as far as it got), no fragment of the markup is ever content, and streamed a
        // character at a time the result is the same.
        let call = &PROSE_AND_CALL[PROSE_AND_CALL.find("<tool_call>").unwrap()..];
        let text = format!("{call}\n{call}");
        let header = "<tool_call>\n<function=get_weather>".len();
        for cut in 0..=text.len() {
            let part = &text[..cut];
            let out = parse(part, false, true);
            assert_eq!(out.content, "", "cut at {cut}: {part:?}");
            let want = usize::from(cut >= header) + usize::from(cut >= call.len() + 1 + header);
            assert_eq!(out.tool_calls.len(), want, "cut at {cut}: {part:?}");
            if cut >= call.len() - "</tool_call>".len() {
                assert_eq!(out.tool_calls[0].input(), json!({"city": "Paris", "days": 2}), "cut at {cut}");
            }
            let chars: Vec<String> = part.chars().map(String::from).collect();
            assert_eq!(streamed(&chars.iter().map(String::as_str).collect::<Vec<_>>(), false, true), out, "cut at {cut}");
        }
        // Reasoning before a cut call stays reasoning.
        let out = parse("<think>\nhm\n</think>\n\n<tool_call>\n<funct", true, true);
        assert_eq!((out.reasoning.as_str(), out.content.as_str(), out.tool_calls.len()), ("hm", "", 0));
    }

    #[test]
    fn a_trailing_start_of_a_call_is_text_when_the_model_ended_and_dropped_when_cut() {
        // The model ended its answer (EOS) on "<" or "<tool": what it wrote is content, whole
        // and streamed; the same text cut by max_tokens is a call that never was.
        for (text, kept) in [("Compare: a <", "Compare: a <"), ("x <tool", "x <tool"), ("see <tool_call", "see <tool_call")] {
            let ended = OutputParser::parse(text, options(false, true), false);
            assert_eq!((ended.content.as_str(), ended.tool_calls.len()), (kept, 0), "{text:?} ended");
            let mut p = OutputParser::new(options(false, true));
            let mut streamed = ParsedOutput::default();
            for c in text.chars() {
                p.push(&c.to_string()).iter().for_each(|d| streamed.apply(d));
            }
            p.finish(false).iter().for_each(|d| streamed.apply(d));
            assert_eq!(streamed, ended, "{text:?} streamed");
            let cut = OutputParser::parse(text, options(false, true), true);
            assert_eq!(cut.content, text[..text.rfind('<').unwrap()].trim_end(), "{text:?} cut");
        }
        // Without tools a "<" is never held: the same either way.
        assert_eq!(OutputParser::parse("a <", options(false, false), true).content, "a <");
    }

    #[test]
    fn without_tools_tool_call_text_is_content() {
        let out = parse(PROSE_AND_CALL, false, false);
        assert_eq!(out.content, PROSE_AND_CALL);
        assert!(out.tool_calls.is_empty());
        let out = parse("Think <tool_call> on.\n</think>\nDone", true, false);
        assert_eq!(out.reasoning, "Think <tool_call> on.");
        assert_eq!(out.content, "Done");
    }

    #[test]
    fn text_after_a_call_is_content() {
        let text = "<tool_call>\n<function=now>\n</function>\n</tool_call>\n\nDone.";
        let out = parse(text, false, true);
        assert_eq!(out.content, "Done.");
        assert_eq!(out.tool_calls.len(), 1);
        assert_split_invariant(text, false, true);
    }

    #[test]
    fn streaming_emits_what_is_certain_and_holds_only_possible_tags() {
        let mut p = OutputParser::new(options(true, true));
        assert_eq!(p.push("Let me "), [Delta::Reasoning("Let me".into())]);
        assert_eq!(p.push("see.\n</thi"), [Delta::Reasoning(" see.".into())]);
        assert_eq!(p.push("nk>\n\nSure. <tool"), [Delta::Content("Sure.".into())]);
        assert_eq!(
            p.push("_call>\n<function=get_weather>\n<parameter=city>\nPa"),
            [Delta::ToolCallStart { index: 0, id: "call_x_0".into(), name: "get_weather".into() }, Delta::ToolCallArguments { index: 0, arguments: "{\"city\":\"Pa".into() },]
        );
        assert_eq!(p.push("ris\n</parameter>\n<parameter=days>\n3"), [Delta::ToolCallArguments { index: 0, arguments: "ris\",\"days\":".into() }]);
        assert_eq!(p.push("\n</parameter>\n</function>\n</tool_call>"), [Delta::ToolCallArguments { index: 0, arguments: "3}".into() }]);
        assert_eq!(p.tool_calls(), 1);
        assert_eq!(p.finish(true), []);
        assert_eq!(p.push("more"), []);
    }

    #[test]
    fn arbitrary_tag_soup_never_panics_and_splits_agree() {
        // Texts drawn (by a fixed LCG) from pieces of the format, broken tags and multi-byte
        // characters: whatever the model writes, the parser must not panic, and streaming
        // must agree with the whole.
        const PIECES: [&str; 18] = [
            "<tool_call>",
            "</tool_call>",
            "<function=get_weather>",
            "<function=now>",
            "<parameter=days>",
            "<parameter=city>",
            "</parameter>",
            "</function>",
            "<think>",
            "</think>",
            "\n",
            " ",
            "x1",
            "é😀",
            "<",
            ">",
            "</",
            "<parameter=",
        ];
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as usize
        };
        for _ in 0..300 {
            let len = next() % 14;
            let text: String = (0..len).map(|_| PIECES[next() % PIECES.len()]).collect();
            for (reasoning, tools) in [(false, true), (true, true), (true, false)] {
                let whole = parse(&text, reasoning, tools);
                for call in &whole.tool_calls {
                    assert!(serde_json::from_str::<Json>(&call.arguments).is_ok_and(|v| v.is_object()), "{text:?}: {}", call.arguments);
                }
                for a in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                    assert_eq!(streamed(&[&text[..a], &text[a..]], reasoning, tools), whole, "{text:?} at {a}");
                }
            }
        }
    }

    #[test]
    fn prompt_tail_decides_where_generation_starts() {
        assert!(prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!prompt_ends_in_reasoning("<|im_start|>assistant\n"));
    }
}
