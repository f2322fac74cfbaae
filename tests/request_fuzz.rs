//! Property tests of the server's request layer: arbitrary JSON bodies, and valid requests with
//! one field replaced by an arbitrary value, go through parsing, validation, rendering with a
//! Qwen3.5-format chat template, and the output parser without a panic; each refusal names a
//! field or the body, and each accepted chat request renders or fails with an error.

use proptest::prelude::*;
use serde_json::{json, Value};

use tensorfold::grammar::{Constraint, Spec, Vocabulary};
use tensorfold::server::anthropic::{CountTokensRequest, MessagesRequest};
use tensorfold::server::error::{from_json, RequestError};
use tensorfold::server::openai::{ChatCompletionRequest, CompletionRequest, ResponsesRequest};
use tensorfold::server::parse::{OutputParser, ParserOptions, ToolSchemas};
use tensorfold::server::{ChatPrompt, OutputFormat, ToolChoice};
use tensorfold::tokenizer::{ChatTemplate, Tokenizer};

fn template() -> ChatTemplate {
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/qwen35_style.jinja")).expect("read tests/data/qwen35_style.jinja");
    ChatTemplate::new(source, "tests/data/qwen35_style.jinja").expect("compile the template")
}

/// Any JSON value, a few levels deep, with the strings requests use most.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-1e6f64..1e6).prop_map(|x| json!(x)),
        prop_oneof![
            Just("user".to_string()),
            Just("assistant".to_string()),
            Just("tool".to_string()),
            Just("function".to_string()),
            Just("text".to_string()),
            Just("<tool_call>".to_string()),
            ".{0,12}".prop_map(String::from)
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec(
                (prop_oneof![Just("role"), Just("content"), Just("type"), Just("text"), Just("name"), Just("arguments"), Just("function"), Just("tool_calls"), Just("id")], inner),
                0..5
            )
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// JSON-schema-like values: schema keywords with arbitrary, often wrong, values.
fn any_schema() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        prop_oneof![Just("object"), Just("string"), Just("integer"), Just("number"), Just("array"), Just("boolean"), Just("null"), Just("nonsense")]
            .prop_map(|t| json!({ "type": t })),
        any::<i64>().prop_map(|n| json!(n)),
        any::<bool>().prop_map(Value::Bool),
        "[a-z#/$^.*+?()\\[\\]]{0,8}".prop_map(Value::String),
        Just(Value::Null),
    ];
    let keys = prop_oneof![
        Just("type"),
        Just("properties"),
        Just("items"),
        Just("enum"),
        Just("const"),
        Just("required"),
        Just("minimum"),
        Just("maximum"),
        Just("maxLength"),
        Just("minLength"),
        Just("pattern"),
        Just("format"),
        Just("anyOf"),
        Just("oneOf"),
        Just("allOf"),
        Just("$ref"),
        Just("$defs"),
        Just("additionalProperties"),
        Just("minItems"),
        Just("maxItems"),
        Just("a"),
        Just("b")
    ];
    leaf.prop_recursive(4, 40, 5, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..5).prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// The constraint token table of the tiny fixture's tokenizer (2k ids: quick to build).
fn vocabulary() -> &'static std::sync::Arc<Vocabulary> {
    static V: std::sync::OnceLock<std::sync::Arc<Vocabulary>> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        let t = Tokenizer::from_dir(&tensorfold::testutil::shared("fixtures/tiny/mlx-q4")).expect("the tiny fixture's tokenizer");
        std::sync::Arc::new(Vocabulary::of(&t).expect("its token table"))
    })
}

/// A valid request of each endpoint.
fn valid_bodies() -> Vec<(&'static str, Value)> {
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]);
    vec![
        (
            "chat",
            json!({"model": "m", "max_tokens": 4, "temperature": 0.5, "seed": 3, "stop": ["x"], "tools": tools, "tool_choice": "auto",
                "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                    {"role": "tool", "tool_call_id": "c", "content": "ok"}]}),
        ),
        ("completion", json!({"prompt": "hello", "max_tokens": 3, "logprobs": 2, "stop": "x"})),
        (
            "responses",
            json!({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c", "output": "ok"}],
                "instructions": "be brief", "max_output_tokens": 5, "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
        ),
        (
            "messages",
            json!({"max_tokens": 5, "system": "s", "messages": [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}],
                "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
        ),
    ]
}

/// Parses and validates `body` as endpoint `kind`; renders the prompt of an accepted chat-like
/// request. Returns the refusal, if any.
fn check(kind: &str, body: &[u8], t: &ChatTemplate) -> Option<RequestError> {
    let prompt: Result<ChatPrompt, RequestError> = match kind {
        "chat" => from_json::<ChatCompletionRequest>(body).and_then(|r| r.validate(1000)).map(|r| r.prompt),
        "completion" => return from_json::<CompletionRequest>(body).and_then(|r| r.validate(1000)).err(),
        "responses" => from_json::<ResponsesRequest>(body).and_then(|r| r.validate()).map(|r| r.prompt),
        "messages" => from_json::<MessagesRequest>(body).and_then(|r| r.validate()).map(|r| r.prompt),
        _ => from_json::<CountTokensRequest>(body).and_then(|r| r.validate()),
    };
    match prompt {
        Ok(p) => {
            // Rendering may fail (the template raises on some shapes) but must not panic.
            let _ = p.render(t);
            None
        }
        Err(e) => Some(e),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bodies_are_refused_or_accepted_without_a_panic(body in any_json()) {
        let t = template();
        let bytes = body.to_string();
        for kind in ["chat", "completion", "responses", "messages", "count_tokens"] {
            if let Some(e) = check(kind, bytes.as_bytes(), &t) {
                // The message says what is wrong; a wrong shape names its field unless the body
                // as a whole is at fault.
                prop_assert!(!e.to_string().is_empty());
            }
        }
    }

    #[test]
    fn one_field_replaced_is_refused_naming_it_or_accepted(which in 0usize..4, key_index in 0usize..16, value in any_json()) {
        let t = template();
        let (kind, mut body) = valid_bodies().swap_remove(which);
        prop_assert!(check(kind, body.to_string().as_bytes(), &t).is_none(), "the valid {} body was refused", kind);
        let keys: Vec<String> = body.as_object().unwrap().keys().cloned().collect();
        let key = keys[key_index % keys.len()].clone();
        body[&key] = value;
        if let Some(e) = check(kind, body.to_string().as_bytes(), &t) {
            let field = e.field().unwrap_or("");
            // The refusal names the replaced field (or a path inside it), or the body.
            prop_assert!(field.is_empty() || field.starts_with(key.as_str()) || e.to_string().contains(key.as_str()), "{kind}.{key}: {e}");
        }
    }

    #[test]
    fn any_schema_or_tool_parameters_build_a_constraint_or_an_error(schema in any_schema(), reasoning in any::<bool>()) {
        // As a response format and as a forced tool's parameters: compiled or refused, never a panic.
        let format = OutputFormat::JsonSchema { name: "s".into(), schema: Some(schema.clone()), strict: true };
        let none = ToolSchemas::new();
        let spec = Spec { format: &format, tools: &none, tool_choice: &ToolChoice::Auto, parallel_tool_calls: true, starts_in_reasoning: reasoning };
        if let Err(e) = Constraint::build(vocabulary(), &spec) {
            prop_assert!(!e.to_string().is_empty());
        }
        let mut tools = ToolSchemas::new();
        tools.insert("f", Some(&schema));
        let spec = Spec { format: &OutputFormat::Text, tools: &tools, tool_choice: &ToolChoice::Required, parallel_tool_calls: false, starts_in_reasoning: reasoning };
        if let Ok(Some(mut c)) = Constraint::build(vocabulary(), &spec) {
            let mut row = vec![0.0f32; vocabulary().len()];
            prop_assert!(c.mask(&mut row).is_ok());
        }
    }

    #[test]
    fn the_output_parser_takes_any_text_in_any_pieces(text in "(<think>|</think>|<tool_call>|</tool_call>|<function=f>|</function>|<parameter=a>|</parameter>|\n|[a-z0-9 {}\":]{0,6}){0,24}", cuts in prop::collection::vec(0usize..64, 0..8), reasoning in any::<bool>()) {
        let mut tools = ToolSchemas::new();
        tools.insert("f", Some(&json!({"type": "object", "properties": {"a": {"type": "integer"}}})));
        let options = ParserOptions { starts_in_reasoning: reasoning, tools: Some(tools), call_id_prefix: "call_".into() };
        let whole = OutputParser::parse(&text, options.clone(), true);
        let mut p = OutputParser::new(options);
        let mut parsed = tensorfold::server::parse::ParsedOutput::default();
        let mut at = 0;
        let mut cuts = cuts;
        cuts.sort_unstable();
        for c in cuts {
            let mut c = c.min(text.len());
            while !text.is_char_boundary(c) {
                c += 1;
            }
            if c > at {
                p.push(&text[at..c]).iter().for_each(|d| parsed.apply(d));
                at = c;
            }
        }
        p.push(&text[at..]).iter().for_each(|d| parsed.apply(d));
        p.finish(true).iter().for_each(|d| parsed.apply(d));
        prop_assert_eq!(&parsed, &whole);
        for call in &whole.tool_calls {
            prop_assert!(serde_json::from_str::<Value>(&call.arguments).is_ok_and(|v| v.is_object()), "{}", call.arguments);
        }
    }
}
