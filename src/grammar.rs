//! Constrained decoding: the output a request asks for (`response_format` json_object /
//! json_schema, a forced tool call) as a grammar that masks each sampled row.
//!
//! The grammar engine is [`llguidance`] (an Earley parser over a lexer, walking a token trie
//! to find every allowed id). Two pieces live here:
//!
//! - [`Vocabulary`]: the token table (id → bytes, special tokens, EOS ids) built once from our
//!   [`Tokenizer`] when the server starts, with llguidance's parser factory over it. Shared in
//!   an `Arc` by every constraint.
//! - [`Constraint`]: one per sequence (a request's `n` choices clone it), built from the
//!   request by [`Constraint::build`]: a Lark grammar written here (reasoning prefix, JSON
//!   through llguidance's JSON-schema compiler, Qwen3.5's tool-call XML as
//!   [`crate::server::parse`] reads it), then EOS only.
//!
//! The runtime applies [`Constraint::mask`] to a copy of the row after `logit_bias` and
//! before the sequence's sampler, and [`Constraint::advance`]s it with the sampled id; the
//! logits themselves, and every other row, are untouched (docs/numerics.md). The mask of the
//! next position depends only on the ids advanced so far, so the runtime computes it
//! ([`Constraint::prepare`]) on a helper thread while the model step runs.

use std::sync::Arc;

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};
use toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};

use crate::server::parse::{resolve_ref, ToolSchemas};
use crate::server::{OutputFormat, ToolChoice};
use crate::tokenizer::{TokenBytes, Tokenizer};

/// What goes wrong building or running a constraint. Messages carry llguidance's own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer cannot give a token table (no EOS id, or llguidance rejects it).
    #[error("constrained decoding is unavailable for this tokenizer: {0}")]
    Vocabulary(String),
    /// The output format's schema is not a schema llguidance can enforce.
    #[error("the JSON schema cannot be enforced: {0}")]
    Schema(String),
    /// A tool's `parameters` cannot be enforced for a forced call; `path` is where in the
    /// schema (`properties.days.minLength`; empty: the schema as a whole).
    #[error("the parameters of tool {name:?} cannot be enforced{}: {message}", at(path))]
    Tool { name: String, path: String, message: String },
    /// A forced call cannot carry this tool's name in its XML (nor the parser read it back).
    #[error("tool {0:?} cannot be called by a forced call: its name must be 1 to 64 letters, digits, `_`, `-` or `.`")]
    ToolName(String),
    /// The grammar of a forced call does not compile (a property schema llguidance rejects).
    #[error("the tools' parameters cannot be enforced: {0}")]
    Tools(String),
    /// `tool_choice` names a function that is not among the tools.
    #[error("no tool named {0:?} in `tools`")]
    UnknownTool(String),
    /// `tool_choice` forces a call and there are no tools.
    #[error("a tool call is required but `tools` is empty")]
    NoTools,
    /// The grammar failed while generating (an llguidance error on a sampled id).
    #[error("constrained decoding failed: {0}")]
    Runtime(String),
}

/// ` at `PATH`` for a non-empty schema path.
fn at(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!(" at `{path}`")
    }
}

/// The token table of one tokenizer and llguidance's parser factory over it. Build once per
/// tokenizer ([`Vocabulary::of`]); every [`Constraint`] shares it.
pub struct Vocabulary {
    factory: ParserFactory,
    /// Ids the table has (`Tokenizer::vocab_size`): the mask's length.
    size: usize,
    eos_ids: Vec<u32>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary").field("size", &self.size).field("eos_ids", &self.eos_ids).finish_non_exhaustive()
    }
}

impl Vocabulary {
    /// The table of `tokenizer`: each id's bytes ([`Tokenizer::token_bytes`]), special tokens
    /// under llguidance's 0xFF marker (so no text grammar allows them), the tokenizer's EOS
    /// ids as the ids allowed once the grammar is complete. Takes a while on a large vocabulary
    /// (bench/results/2026-12-02-grammar-mask.md): build it at start, not per request.
    ///
    /// # Errors
    /// [`GrammarError::Vocabulary`] when the tokenizer has no EOS id or llguidance rejects the
    /// table.
    pub fn of(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let eos_ids = tokenizer.eos_ids().to_vec();
        let Some(&first_eos) = eos_ids.first() else {
            return Err(GrammarError::Vocabulary("the tokenizer declares no end-of-sequence id".into()));
        };
        let words: Vec<Vec<u8>> = tokenizer
            .token_bytes()
            .into_iter()
            .map(|t| match t {
                TokenBytes::Text(b) => b,
                TokenBytes::Special(s) => {
                    let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    b.extend_from_slice(s.as_bytes());
                    b
                }
                TokenBytes::None => Vec::new(),
            })
            .collect();
        let size = words.len();
        if eos_ids.iter().any(|&id| id as usize >= size) {
            return Err(GrammarError::Vocabulary(format!("an end-of-sequence id of {eos_ids:?} is outside the vocabulary ({size} ids)")));
        }
        let mut info = TokRxInfo::new(size as u32, first_eos);
        info.tok_end_of_turn = Some(first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos_ids);
        // Greedy tokenization is llguidance's fallback for forcing text; masks never use it.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory, size, eos_ids })
    }

    /// Ids in the table.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The ids allowed once a grammar is complete.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }
}

/// What a request asks of its output, as far as constraining goes.
#[derive(Debug, Clone, Copy)]
pub struct Spec<'a> {
    /// `response_format` / `text.format`.
    pub format: &'a OutputFormat,
    /// The request's tools (names and `parameters` schemas).
    pub tools: &'a ToolSchemas,
    /// The request's tool choice: `required` or a named function force a call.
    pub tool_choice: &'a ToolChoice,
    /// Whether a forced turn may hold several calls.
    pub parallel_tool_calls: bool,
    /// The prompt leaves the model inside `<think>` (read from the rendered prompt's tail):
    /// free text runs until `</think>`, the constraint applies after it.
    pub starts_in_reasoning: bool,
}

/// The grammar state of one sequence: which ids may come next. `Clone` gives an independent
/// copy at the same state (one per choice of a request).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// Ids the mask covers; ids past it (padding of the logits row) are never allowed.
    size: usize,
    /// The ids that end a complete grammar (the vocabulary's EOS ids, which llguidance's
    /// token table holds too).
    eos_ids: Arc<[u32]>,
    /// The allowed ids at the current state, computed ahead ([`Constraint::prepare`]); taken
    /// by [`Constraint::mask`], dropped by [`Constraint::advance`].
    ready: Option<Result<SimpleVob, GrammarError>>,
    /// A fault a test injects into the code that computes masks.
    #[cfg(test)]
    fault: Option<TestFault>,
}

/// A fault a test injects into the computation of a constraint's masks.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TestFault {
    /// [`Constraint::prepare`] panics when it computes a mask.
    PanicInPrepare,
    /// The runtime's mask helper panics outside its catch, its thread dying, after preparing.
    KillHelper,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("size", &self.size).field("stopped", &self.matcher.is_stopped()).field("prepared", &self.ready.is_some()).finish_non_exhaustive()
    }
}

/// The JSON encoding the template's `tojson` writes (Python's separators), without free
/// whitespace between tokens, so a constrained value cannot run on as blank space.
fn json_layout() -> Json {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with the layout above, unless it sets its own (`x-guidance`).
fn with_layout(schema: &Json) -> Result<Json, String> {
    match schema {
        Json::Object(o) => {
            let mut o = o.clone();
            o.entry("x-guidance").or_insert_with(json_layout);
            Ok(Json::Object(o))
        }
        Json::Bool(true) => Ok(json!({"x-guidance": json_layout()})),
        _ => Err("a JSON schema must be an object (or `true`)".into()),
    }
}

/// A Lark string literal of `s` (JSON's escapes are Lark's).
fn literal(s: &str) -> String {
    Json::String(s.to_string()).to_string()
}

/// Where in a parameters schema a problem is, and what it is.
type SchemaFault = (String, String);

/// The Lark rule of a call of `name` with `parameters`: its header, then each property of the
/// schema in its order (required ones present, others optional), then `</function>`.
fn call_rule(rule: &str, name: &str, parameters: Option<&Json>, out: &mut String) -> Result<(), SchemaFault> {
    let props = parameters.and_then(|p| p.get("properties")).and_then(Json::as_object);
    let required: Vec<&str> = parameters.and_then(|p| p.get("required")).and_then(Json::as_array).map(|r| r.iter().filter_map(Json::as_str).collect()).unwrap_or_default();
    if let Some(missing) = required.iter().find(|r| !props.is_some_and(|p| p.contains_key(**r))) {
        return Err(("required".into(), format!("required parameter {missing:?} is not among `properties`")));
    }
    let mut body = format!("{rule}: {}", literal(&format!("<function={name}>\n")));
    for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
        let param = format!("{rule}_{j}");
        let path = format!("properties.{key}");
        let value = if ToolSchemas::is_text_param(schema, parameters) {
            text_value(&param, schema, parameters, out).map_err(|(p, m)| (join(&path, &p), m))?
        } else {
            format!("%json {} {END_PARAM}", json_value(schema, parameters).map_err(|m| (path.clone(), m))?)
        };
        out.push_str(&format!("{param}: {} {value}\n", literal(&format!("<parameter={key}>\n"))));
        body.push(' ');
        body.push_str(&param);
        if !required.contains(&key.as_str()) {
            body.push('?');
        }
    }
    out.push_str(&body);
    out.push('\n');
    Ok(())
}

/// `a.b` of two schema paths, either of which may be empty.
fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (_, true) => a.to_string(),
        (true, false) => b.to_string(),
        (false, false) => format!("{a}.{b}"),
    }
}

/// The schema a non-text parameter's JSON value follows: the property's own (its `$ref`
/// followed), with the tool's `$defs` and `definitions` beside it so the references inside
/// it resolve, and the template's JSON layout.
fn json_value(schema: &Json, root: Option<&Json>) -> Result<Json, String> {
    let target = resolve_ref(schema, root)?;
    let mut value = with_layout(target)?;
    if let (Json::Object(v), Some(Json::Object(r))) = (&mut value, root) {
        for key in ["$defs", "definitions"] {
            if let Some(defs) = r.get(key) {
                v.entry(key).or_insert_with(|| defs.clone());
            }
        }
    }
    Ok(value)
}

/// A schema keyword's value as a string length: a non-negative integer.
fn length_bound(schema: &Json, key: &str) -> Result<Option<u64>, SchemaFault> {
    match schema.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| (key.to_string(), format!("`{key}` must be a non-negative integer, got {v}"))),
    }
}

/// The string alternative of a text parameter's schema (the parser reads its value as a
/// string, so only that alternative can hold), with its path; `None`: any text.
fn string_branch<'a>(schema: &'a Json, root: Option<&'a Json>) -> Result<Option<(String, &'a Json)>, SchemaFault> {
    let s = resolve_ref(schema, root).map_err(|m| (String::new(), m))?;
    let is_string = |t: &Json| t.as_str() == Some("string");
    match s.get("type") {
        Some(Json::String(t)) if t == "string" => return Ok(Some((String::new(), s))),
        Some(Json::Array(ts)) if ts.iter().any(is_string) => return Ok(Some((String::new(), s))),
        Some(t) => return Err(("type".into(), format!("type {t} is not a JSON-schema type the call's text can hold"))),
        None => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = s.get(key) {
            let options = options.as_array().ok_or_else(|| (key.to_string(), format!("`{key}` must be an array")))?;
            for (j, o) in options.iter().enumerate() {
                let o = resolve_ref(o, root).map_err(|m| (format!("{key}[{j}]"), m))?;
                if o.get("type").is_some_and(|t| is_string(t) || t.as_array().is_some_and(|ts| ts.iter().any(is_string))) {
                    return Ok(Some((format!("{key}[{j}]"), o)));
                }
            }
            return Err((key.to_string(), format!("no alternative of `{key}` is a typed string or another JSON type, so the value's type is unknown")));
        }
    }
    if s.get("allOf").is_some() || s.get("not").is_some() {
        return Err((String::new(), "`allOf` and `not` without a `type` cannot be enforced for a text value".into()));
    }
    // No type: every value is allowed, unless `enum`/`const` list them.
    if s.get("enum").is_some() || s.get("const").is_some() {
        return Ok(Some((String::new(), s)));
    }
    Ok(None)
}

/// The grammar of a text (string-typed) parameter's value, written raw as the template writes
/// it: one of its `enum` strings (or its `const`); a string of its `format` where we know the
/// format ([`StringFormat`]), within `minLength`..`maxLength`, or one of the words the parser
/// reads as `null` where the schema admits null; `minLength`..`maxLength` characters with a
/// `maxLength` (no newline or `<`, so the value's end is never in doubt); otherwise text of at
/// least `minLength` characters up to the first `\n</parameter>`. Rules it needs are added to
/// `out` under `rule`'s name.
fn text_value(rule: &str, schema: &Json, root: Option<&Json>, out: &mut String) -> Result<String, SchemaFault> {
    let Some((at, s)) = string_branch(schema, root)? else {
        // The lazy lexeme takes its own end.
        return Ok("text_value".into());
    };
    let fault = |p: &str, m: String| (join(&at, p), m);
    if let Some(c) = s.get("const") {
        let c = c.as_str().ok_or_else(|| fault("const", format!("`const` {c} is not a string, and the value is read as text")))?;
        return Ok(format!("{} {END_PARAM}", literal(c)));
    }
    if let Some(options) = s.get("enum") {
        let options = options.as_array().ok_or_else(|| fault("enum", "`enum` must be an array".into()))?;
        let alts: Vec<String> = options.iter().filter_map(Json::as_str).map(literal).collect();
        if alts.is_empty() {
            return Err(fault("enum", "`enum` holds no string, and the value is read as text".into()));
        }
        return Ok(format!("({}) {END_PARAM}", alts.join(" | ")));
    }
    if s.get("pattern").is_some() {
        return Err(fault("pattern", "a `pattern` on a text parameter cannot be enforced in a forced call".into()));
    }
    let min = length_bound(s, "minLength").map_err(|(p, m)| fault(&p, m))?;
    let max = length_bound(s, "maxLength").map_err(|(p, m)| fault(&p, m))?;
    if let (Some(lo), Some(hi)) = (min, max) {
        if lo > hi {
            return Err(fault("minLength", format!("`minLength` {lo} is greater than `maxLength` {hi}")));
        }
    }
    let format = match s.get("format") {
        None => None,
        // A format we have no regex for stays free text, as JSON Schema makes formats optional
        // to check.
        Some(Json::String(f)) => StringFormat::of(f),
        Some(v) => return Err(fault("format", format!("`format` must be a string, got {v}"))),
    };
    if let Some(f) = format {
        let (lo, hi) = f.bounds(min, max).map_err(|(p, m)| fault(p, m))?;
        // No format's text holds `<` or a newline, so the value's end is never in doubt.
        let value = if lo.is_none() && hi.is_none() {
            format!("/{}/", f.regex)
        } else {
            let lexeme = format!("{}_FORMAT", rule.to_uppercase());
            let hi = hi.map(|h| h.to_string()).unwrap_or_default();
            out.push_str(&format!("{lexeme}: /{}/ & /[^<\\n]{{{},{hi}}}/\n", f.regex, lo.unwrap_or(0)));
            lexeme
        };
        // A nullable parameter may be null: the parser reads these words as JSON null there
        // (as it did when a formatted value was free text).
        if ToolSchemas::is_nullable_text_param(schema, root) {
            return Ok(format!("({value} | /{}/) {END_PARAM}", null_regex()));
        }
        return Ok(format!("{value} {END_PARAM}"));
    }
    // llguidance's regex parser takes counts up to u32::MAX: a longer `maxLength` is the same
    // bound for any output (none comes near 4 GiB), a longer `minLength` can never be met.
    if let Some(lo) = min.filter(|&lo| lo > MAX_COUNT) {
        return Err(fault("minLength", format!("`minLength` {lo} is more than any output can hold (at most {MAX_COUNT})")));
    }
    match (min, max.map(|h| h.min(MAX_COUNT))) {
        (lo, Some(hi)) => Ok(format!("/[^<\\n]{{{},{hi}}}/ {END_PARAM}", lo.unwrap_or(0))),
        (Some(lo), None) if lo > 0 => {
            let lexeme = format!("{rule}_text");
            out.push_str(&format!("{lexeme}[lazy]: /(.|\\n){{{lo},}}\\n<\\/parameter>\\n/\n"));
            Ok(lexeme)
        }
        _ => Ok("text_value".into()),
    }
}

/// The largest repetition count llguidance's regex parser takes.
const MAX_COUNT: u64 = u32::MAX as u64;

/// The most characters a `minLength` or `maxLength` of a formatted value may count and be
/// enforced. The bound is intersected with the format's regex, and llguidance's lexer states
/// for that grow with the count: at 5000 an `email` or `hostname` runs out of lexer fuel within
/// a few tokens. Above it a `minLength` is refused and a `maxLength` is not enforced (values of
/// these formats are far shorter in use: RFC 5321 mailboxes 254, DNS names 253 characters).
pub const FORMAT_LENGTH_LIMIT: u64 = 2048;

/// A regex of the words the parser reads as `null` ([`crate::server::parse::NULL_WORDS`], any
/// ASCII case), for a Lark `/.../` literal.
fn null_regex() -> String {
    let word = |w: &str| w.chars().map(|c| format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase())).collect::<String>();
    crate::server::parse::NULL_WORDS.iter().map(|w| word(w)).collect::<Vec<_>>().join("|")
}

/// A `minLength` and a `maxLength`, where given.
type Bounds = (Option<u64>, Option<u64>);

/// Lengths in characters, as ascending spans `lo..=hi` (`None`: unbounded).
type Lengths = &'static [(u64, Option<u64>)];

/// A JSON-schema string `format` we enforce: the regex of its strings and the lengths (in
/// characters) those strings can have.
struct StringFormat {
    name: &'static str,
    /// For a Lark `/.../` literal.
    regex: String,
    /// The lengths of the regex's strings.
    lengths: Lengths,
}

impl StringFormat {
    /// The format `format`, for the formats clients put on tool parameters; `None` for others.
    /// The regexes are written from the RFCs the JSON Schema validation spec names (3339 dates
    /// and times, 4122 UUIDs, 5321 mailboxes in their dot-atom form, 1123 host names, 3986
    /// URIs as a scheme and URI characters), as plain text without `<` or newlines.
    fn of(format: &str) -> Option<Self> {
        const DATE: &str = "[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-9]))";
        const TIME: &str = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
        const LABEL: &str = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
        const ATOM: &str = "[A-Za-z0-9!#$%&'*+=?^_`{|}~\\/-]+";
        const OCTET: &str = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
        let hex = |n: u32| format!("[0-9A-Fa-f]{{{n}}}");
        // Lengths from the regexes: a time is HH:MM:SS then `Z` (9) or `.` and digits and `Z`
        // (11 on) or an offset (14 on), so never 10; a date-time is a date, `T` and a time.
        let (name, regex, lengths): (&'static str, String, Lengths) = match format {
            "date" => ("date", DATE.to_string(), &[(10, Some(10))]),
            "time" => ("time", TIME.to_string(), &[(9, Some(9)), (11, None)]),
            "date-time" => ("date-time", format!("{DATE}[Tt]{TIME}"), &[(20, Some(20)), (22, None)]),
            "uuid" => ("uuid", format!("{}-{}-{}-{}-{}", hex(8), hex(4), hex(4), hex(4), hex(12)), &[(36, Some(36))]),
            // Labels of up to 63 characters, as many as the text holds: RFC 1123's 253 in all
            // is not in the regex, so not in its lengths either.
            "hostname" => ("hostname", format!("{LABEL}(?:\\.{LABEL})*"), &[(1, None)]),
            "email" => ("email", format!("{ATOM}(?:\\.{ATOM})*@{LABEL}(?:\\.{LABEL})*"), &[(3, None)]),
            "ipv4" => ("ipv4", format!("{OCTET}(?:\\.{OCTET}){{3}}"), &[(7, Some(15))]),
            "uri" => ("uri", "[A-Za-z][A-Za-z0-9+.-]*:(?:[A-Za-z0-9._~:\\/?#\\[\\]@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*".to_string(), &[(2, None)]),
            _ => return None,
        };
        Some(Self { name, regex, lengths })
    }

    /// The lengths, in words (`36 characters`, `9 characters, or at least 11 characters`).
    fn describe(&self) -> String {
        let unit = |n: u64| if n == 1 { "character" } else { "characters" };
        let span = |&(lo, hi): &(u64, Option<u64>)| match hi {
            Some(hi) if hi == lo => format!("{lo} {}", unit(lo)),
            Some(hi) => format!("{lo} to {hi} {}", unit(hi)),
            None => format!("at least {lo} {}", unit(lo)),
        };
        self.lengths.iter().map(span).collect::<Vec<_>>().join(", or ")
    }

    /// The `minLength` / `maxLength` (`min`, `max`) to intersect with the regex: each only
    /// where it narrows the format's own lengths, a `maxLength` over [`FORMAT_LENGTH_LIMIT`]
    /// not at all.
    ///
    /// # Errors
    /// The keyword at fault and why: bounds no length of the format meets (the value could
    /// never be finished), or a `minLength` over the limit.
    fn bounds(&self, min: Option<u64>, max: Option<u64>) -> Result<Bounds, (&'static str, String)> {
        let lo = min.unwrap_or(0);
        let meets = |&(a, b): &(u64, Option<u64>)| [b, max].into_iter().flatten().min().is_none_or(|to| a.max(lo) <= to);
        if !self.lengths.iter().any(meets) {
            let article = if matches!(self.name, "email" | "ipv4") { "an" } else { "a" };
            let is = format!("{article} `{}` is {}", self.name, self.describe());
            let shortest = self.lengths[0].0;
            return Err(match (min, max) {
                (_, Some(h)) if h < shortest => ("maxLength", format!("{is}; `maxLength` {h} leaves none")),
                (Some(l), Some(h)) if self.lengths.iter().any(|&(_, b)| b.is_none_or(|b| b >= l)) => ("minLength", format!("{is}; `minLength` {l} and `maxLength` {h} leave none")),
                (Some(l), _) => ("minLength", format!("{is}; `minLength` {l} leaves none")),
                // Unreachable: without bounds every length of the format is met.
                _ => ("minLength", is),
            });
        }
        let (own_min, own_max) = (self.lengths[0].0, self.lengths[self.lengths.len() - 1].1);
        let min = min.filter(|&m| m > own_min);
        if let Some(m) = min.filter(|&m| m > FORMAT_LENGTH_LIMIT) {
            return Err(("minLength", format!("`minLength` {m} cannot be enforced with a `format`: at most {FORMAT_LENGTH_LIMIT} characters")));
        }
        let max = max.filter(|&m| own_max.is_none_or(|o| m < o) && m <= FORMAT_LENGTH_LIMIT);
        Ok((min, max))
    }
}

/// The end of a parameter, as the template writes it.
const END_PARAM: &str = "\"\\n</parameter>\\n\"";

/// The Lark grammar of `spec`, `None` when it constrains nothing.
fn lark(spec: &Spec<'_>) -> Result<Option<String>, GrammarError> {
    let mut g = String::new();
    let forced = match spec.tool_choice {
        ToolChoice::Required => Some(None),
        ToolChoice::Function(name) => Some(Some(name.as_str())),
        ToolChoice::Auto | ToolChoice::None => None,
    };
    if let Some(only) = forced {
        if spec.tools.is_empty() {
            return Err(GrammarError::NoTools);
        }
        if let Some(name) = only {
            if !spec.tools.functions().any(|(n, _)| n == name) {
                return Err(GrammarError::UnknownTool(name.to_string()));
            }
        }
        let mut alts = Vec::new();
        for (i, (name, parameters)) in spec.tools.functions().enumerate() {
            if only.is_some_and(|o| o != name) {
                continue;
            }
            // OpenAI's rule for function names; the call's XML could not be read back otherwise.
            if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
                return Err(GrammarError::ToolName(name.to_string()));
            }
            let rule = format!("fn_{i}");
            call_rule(&rule, name, parameters, &mut g).map_err(|(path, message)| GrammarError::Tool { name: name.to_string(), path, message })?;
            alts.push(rule);
        }
        g.push_str(&format!("call: \"<tool_call>\\n\" ({}) \"</function>\\n</tool_call>\"\n", alts.join(" | ")));
        g.push_str(if spec.parallel_tool_calls { "body: call (\"\\n\" call)*\n" } else { "body: call\n" });
        g.push_str("text_value[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/\n");
    } else {
        let schema = match spec.format {
            OutputFormat::Text => return Ok(None),
            OutputFormat::JsonObject => json!({"type": "object"}),
            OutputFormat::JsonSchema { schema, .. } => schema.clone().unwrap_or(Json::Bool(true)),
        };
        let schema = with_layout(&schema).map_err(GrammarError::Schema)?;
        g.push_str(&format!("body: %json {schema}\n"));
    }
    if spec.starts_in_reasoning {
        // The reasoning is free text up to its first `</think>`; then, as the model writes it,
        // a little whitespace before the answer.
        g.push_str("start: reasoning SEP? body\nreasoning[lazy]: /(.|\\n)*<\\/think>/\nSEP: /[ \\n]{1,4}/\n");
    } else {
        g.push_str("start: body\n");
    }
    Ok(Some(g))
}

/// The first line of an llguidance runtime error (it appends a dump of the parser's state, one
/// item per line: not for a client, and not for a one-line request log).
fn runtime_message(message: &str) -> String {
    message.lines().next().unwrap_or(message).trim().to_string()
}

/// llguidance's compile error without what is ours, not the client's: the position in the
/// Lark text written here and its quoted lines (`at 1(7): failed to compile JSON schema:
/// Invalid type: nonsense\n   1 | body: ...` → `failed to compile JSON schema: Invalid type: nonsense`).
fn compile_message(message: &str) -> String {
    let first = message.lines().next().unwrap_or(message);
    let body = match first.strip_prefix("at ").and_then(|r| r.split_once(": ")) {
        Some((pos, rest)) if pos.chars().all(|c| c.is_ascii_digit() || "()".contains(c)) => rest,
        _ => first,
    };
    body.trim().to_string()
}

/// llguidance's parser of a Lark `grammar`, or its compile error's message.
fn compile(vocab: &Vocabulary, grammar: String) -> Result<llguidance::TokenParser, String> {
    // A schema is the client's: should the compiler panic on one, that is its refusal.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| vocab.factory.create_parser(TopLevelGrammar::from_lark(grammar))))
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the grammar compiler failed on it")))
        .map_err(|e| compile_message(&e.to_string()))
}

/// The first JSON-valued property of the tools a forced call may use whose schema llguidance
/// refuses on its own: a forced call's grammar failed to compile, and this names the culprit.
fn fault_of(vocab: &Vocabulary, spec: &Spec<'_>) -> Option<GrammarError> {
    let only = match spec.tool_choice {
        ToolChoice::Function(name) => Some(name.as_str()),
        _ => None,
    };
    for (name, parameters) in spec.tools.functions().filter(|(n, _)| only.is_none_or(|o| o == *n)) {
        let Some(props) = parameters.and_then(|p| p.get("properties")).and_then(Json::as_object) else { continue };
        for (key, schema) in props.iter().filter(|(_, s)| !ToolSchemas::is_text_param(s, parameters)) {
            let Ok(value) = json_value(schema, parameters) else { continue };
            if let Err(message) = compile(vocab, format!("start: %json {value}\n")) {
                return Some(GrammarError::Tool { name: name.to_string(), path: format!("properties.{key}"), message });
            }
        }
    }
    None
}

impl Constraint {
    /// The constraint `spec` asks for over `vocab`; `None` when the output is free (text, tool
    /// choice `auto`/`none`). A forced tool call wins over a JSON format (its turn has no
    /// content).
    ///
    /// # Errors
    /// [`GrammarError::Schema`] (a format schema llguidance cannot compile, with its message),
    /// [`GrammarError::Tool`] / [`GrammarError::Tools`] (a forced tool's parameters), [`GrammarError::ToolName`], [`GrammarError::UnknownTool`],
    /// [`GrammarError::NoTools`].
    pub fn build(vocab: &Arc<Vocabulary>, spec: &Spec<'_>) -> Result<Option<Self>, GrammarError> {
        let Some(grammar) = lark(spec)? else {
            return Ok(None);
        };
        let forced = matches!(spec.tool_choice, ToolChoice::Required | ToolChoice::Function(_));
        // A schema is the client's: should the compiler panic on one, that is its refusal.
        let parser = compile(vocab, grammar).map_err(|message| {
            if forced {
                // Which property it is, for an error that names it.
                fault_of(vocab, spec).unwrap_or(GrammarError::Tools(message))
            } else {
                GrammarError::Schema(message)
            }
        })?;
        let mut matcher = Matcher::new(Ok(parser));
        // Some grammars compile and then cannot give a first mask (a schema whose `$ref` only
        // refers to itself): that too is the request's to hear about, not a failed generation.
        // The mask is kept: it is the first position's.
        let first = matcher.compute_mask_or_eos().map_err(|e| {
            let message = format!("it allows no first token ({})", runtime_message(&e.to_string()));
            if forced {
                GrammarError::Tools(message)
            } else {
                GrammarError::Schema(message)
            }
        })?;
        Ok(Some(Self {
            matcher,
            size: vocab.size,
            eos_ids: vocab.eos_ids.clone().into(),
            ready: Some(Ok(first)),
            #[cfg(test)]
            fault: None,
        }))
    }

    /// A constraint that has failed with `message`: its mask, and every call after it, is
    /// [`GrammarError::Runtime`]. For a sequence whose constraint was lost where it was computed.
    pub(crate) fn failed(message: String) -> Self {
        Self {
            matcher: Matcher::new(Err(anyhow::anyhow!(message.clone()))),
            size: 0,
            eos_ids: Arc::from([]),
            ready: Some(Err(GrammarError::Runtime(message))),
            #[cfg(test)]
            fault: None,
        }
    }

    /// Fails the constraint with `message`: the next [`Constraint::mask`] returns
    /// [`GrammarError::Runtime`] with it, and the grammar state is dropped so that every later
    /// call fails too. For a mask computation that panicked, which may have left the state
    /// half-updated.
    pub(crate) fn fail(&mut self, message: String) {
        self.matcher = Matcher::new(Err(anyhow::anyhow!(message.clone())));
        self.ready = Some(Err(GrammarError::Runtime(message)));
    }

    /// Injects `fault` into the computation of this constraint's masks.
    #[cfg(test)]
    pub(crate) fn inject(&mut self, fault: TestFault) {
        self.fault = Some(fault);
    }

    /// The fault injected by [`Constraint::inject`].
    #[cfg(test)]
    pub(crate) fn injected(&self) -> Option<TestFault> {
        self.fault
    }

    /// The allowed ids at the current state, llguidance's way.
    fn allowed(&mut self) -> Result<SimpleVob, GrammarError> {
        self.matcher.compute_mask_or_eos().map_err(|e| GrammarError::Runtime(runtime_message(&e.to_string())))
    }

    /// Computes the mask of the current state now, for the next [`Constraint::mask`] (which
    /// then only applies it). The same ids as `mask` would compute itself: the mask depends
    /// only on the ids advanced so far, so it may be computed while the model step that gives
    /// the row runs. Does nothing when it is computed already.
    pub fn prepare(&mut self) {
        if self.ready.is_none() {
            #[cfg(test)]
            if self.fault == Some(TestFault::PanicInPrepare) {
                panic!("a fault injected in prepare");
            }
            self.ready = Some(self.allowed());
        }
    }

    /// Whether the current state's mask is computed already ([`Constraint::prepare`]).
    pub fn is_prepared(&self) -> bool {
        self.ready.is_some()
    }

    /// Sets every id the grammar does not allow next to −∞ in `row` (a copy of a logits row,
    /// `row[id]`; ids past the vocabulary, the row's padding, too). Allowed entries keep their
    /// bits. Once the grammar is complete only the EOS ids are allowed.
    ///
    /// # Errors
    /// [`GrammarError::Runtime`] when llguidance fails (its error state, a parser limit).
    pub fn mask(&mut self, row: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = match self.ready.take() {
            Some(r) => r?,
            None => self.allowed()?,
        };
        let n = row.len().min(self.size);
        let words = allowed.as_slice();
        for (w, chunk) in row[..n].chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                continue;
            }
            for (b, x) in chunk.iter_mut().enumerate() {
                if bits >> b & 1 == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        for x in &mut row[n..] {
            *x = f32::NEG_INFINITY;
        }
        Ok(())
    }

    /// Moves the grammar past `id` (the id sampled from the masked row). Returns whether `id`
    /// ended the grammar: an EOS id once the output is complete, after which the sequence is
    /// done whatever its stop rules say (`ignore_eos` included: the constraint wins).
    ///
    /// # Errors
    /// [`GrammarError::Runtime`] when the grammar does not allow `id`.
    pub fn advance(&mut self, id: u32) -> Result<bool, GrammarError> {
        self.ready = None;
        if self.eos_ids.contains(&id) {
            // When nothing can follow the output (a closed JSON object), llguidance stops its
            // parser right after the last text token; a stopped parser refuses every id, EOS
            // included, though its mask is EOS only. That stop is the grammar's end.
            if matches!(self.matcher.stop_reason(), StopReason::NoExtension | StopReason::EndOfSentence) {
                return Ok(true);
            }
            // Complete but extendable (another parallel call could follow): the EOS is taken.
            if self.is_complete() {
                self.matcher.consume_token(id).map_err(|e| GrammarError::Runtime(runtime_message(&e.to_string())))?;
                return Ok(true);
            }
        }
        self.matcher.consume_token(id).map_err(|e| GrammarError::Runtime(runtime_message(&e.to_string())))?;
        Ok(false)
    }

    /// How many of `ids`, from the current state, the grammar accepts in a row (the state is
    /// not changed). For checks and tests.
    pub fn accepts_prefix(&mut self, ids: &[u32]) -> usize {
        self.matcher.validate_tokens(ids).unwrap_or(0)
    }

    /// Whether the output so far is a complete match (EOS may come now).
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests;
