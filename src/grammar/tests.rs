//! Constraints on the real Qwen3.5 tokenizer: what they accept, what they reject, and the
//! tool-call text they accept parsing back through the server's output parser.

use std::sync::{Arc, OnceLock};

use serde_json::json;

use super::*;
use crate::server::parse::{OutputParser, ParserOptions};
use crate::testutil::shared;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_dir(&shared("tokenizers/qwen3.5")).expect("the Qwen3.5 tokenizer loads"))
}

fn vocab() -> &'static Arc<Vocabulary> {
    static V: OnceLock<Arc<Vocabulary>> = OnceLock::new();
    V.get_or_init(|| Arc::new(Vocabulary::of(tokenizer()).expect("the token table builds")))
}

fn ids(text: &str) -> Vec<u32> {
    tokenizer().encode_with(text, false).expect("encodes")
}

fn im_end() -> u32 {
    tokenizer().token_to_id("<|im_end|>").expect("<|im_end|> is a token")
}

fn tools() -> ToolSchemas {
    let mut t = ToolSchemas::new();
    t.insert(
        "get_weather",
        Some(&json!({"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1},
            "metric": {"type": "boolean"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "code": {"type": "string", "maxLength": 3}
        }, "required": ["city", "days"]})),
    );
    t.insert("now", Some(&json!({"type": "object", "properties": {}})));
    t
}

fn spec<'a>(format: &'a OutputFormat, tools: &'a ToolSchemas, choice: &'a ToolChoice, reasoning: bool) -> Spec<'a> {
    Spec { format, tools, tool_choice: choice, parallel_tool_calls: false, starts_in_reasoning: reasoning }
}

fn schema_format() -> OutputFormat {
    OutputFormat::JsonSchema {
        name: "n".into(),
        schema: Some(json!({"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}}, "required": ["n"], "additionalProperties": false})),
        strict: true,
    }
}

fn build(spec: &Spec<'_>) -> Constraint {
    Constraint::build(vocab(), spec).expect("builds").expect("constrains")
}

/// Whether the constraint accepts all of `text` and is complete after it, then takes EOS.
fn accepts_whole(c: &Constraint, text: &str) -> bool {
    let mut c = c.clone();
    let t = ids(text);
    if c.accepts_prefix(&t) != t.len() {
        return false;
    }
    for &id in &t {
        c.advance(id).expect("accepted ids advance");
    }
    let mut row = vec![0.0f32; vocab().len()];
    c.mask(&mut row).expect("masks");
    c.is_complete() && row[im_end() as usize] == 0.0
}

#[test]
fn the_table_marks_special_tokens_and_keeps_text_tokens() {
    let v = vocab();
    assert_eq!(v.len(), tokenizer().vocab_size());
    assert_eq!(v.eos_ids(), tokenizer().eos_ids());
    assert!(v.eos_ids().contains(&im_end()));
    // Byte-level pieces map back to bytes: " the" is one token whose bytes start with a space.
    let the = ids(" the");
    assert_eq!(the.len(), 1);
    match &tokenizer().token_bytes()[the[0] as usize] {
        TokenBytes::Text(b) => assert_eq!(b, b" the"),
        other => panic!("{other:?}"),
    }
    match &tokenizer().token_bytes()[im_end() as usize] {
        TokenBytes::Special(s) => assert_eq!(s, "<|im_end|>"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn free_output_has_no_constraint() {
    let t = tools();
    assert!(Constraint::build(vocab(), &spec(&OutputFormat::Text, &t, &ToolChoice::Auto, false)).unwrap().is_none());
    assert!(Constraint::build(vocab(), &spec(&OutputFormat::Text, &t, &ToolChoice::None, true)).unwrap().is_none());
}

#[test]
fn a_json_schema_accepts_matching_json_and_rejects_the_rest() {
    let (f, t) = (schema_format(), ToolSchemas::new());
    let c = build(&spec(&f, &t, &ToolChoice::Auto, false));
    assert!(accepts_whole(&c, r#"{"n": 42}"#));
    assert!(accepts_whole(&c, r#"{"n": -7, "tag": "b"}"#));
    assert!(!accepts_whole(&c, r#"{"m": 42}"#), "unknown key");
    assert!(!accepts_whole(&c, r#"{"n": "42"}"#), "wrong type");
    assert!(!accepts_whole(&c, r#"{"tag": "a"}"#), "missing required key");
    assert!(!accepts_whole(&c, r#"{"n": 1, "tag": "c"}"#), "not in the enum");
    assert!(!accepts_whole(&c, r#"{"n": 42"#), "incomplete");
    assert!(!accepts_whole(&c, r#"Sure: {"n": 42}"#), "text before the JSON");
}

#[test]
fn json_object_is_any_object() {
    let t = ToolSchemas::new();
    let c = build(&spec(&OutputFormat::JsonObject, &t, &ToolChoice::Auto, false));
    assert!(accepts_whole(&c, r#"{"a": [1, 2.5, null], "b": {"c": "d"}}"#));
    assert!(accepts_whole(&c, "{}"));
    assert!(!accepts_whole(&c, "[1, 2]"));
    assert!(!accepts_whole(&c, "\"text\""));
}

#[test]
fn the_mask_keeps_allowed_bits_and_ends_on_eos_only() {
    let (f, t) = (schema_format(), ToolSchemas::new());
    let mut c = build(&spec(&f, &t, &ToolChoice::Auto, false));
    let v = vocab().len();
    // A row wider than the vocabulary, as the model's padded logits are.
    let row: Vec<f32> = (0..v + 100).map(|i| (i % 97) as f32 * 0.25 - 3.0).collect();
    let mut masked = row.clone();
    c.mask(&mut masked).unwrap();
    let open = ids("{")[0] as usize;
    assert_eq!(masked[open].to_bits(), row[open].to_bits(), "`{{` is allowed and keeps its bits");
    assert_eq!(masked[ids("hello")[0] as usize], f32::NEG_INFINITY);
    assert_eq!(masked[im_end() as usize], f32::NEG_INFINITY, "EOS before the JSON");
    assert!(masked[v..].iter().all(|&x| x == f32::NEG_INFINITY), "padding ids");
    for id in ids(r#"{"n": 5}"#) {
        c.advance(id).unwrap();
    }
    let mut masked = row.clone();
    c.mask(&mut masked).unwrap();
    let finite: Vec<usize> = (0..masked.len()).filter(|&i| masked[i].is_finite()).collect();
    let eos: Vec<usize> = vocab().eos_ids().iter().map(|&i| i as usize).collect();
    assert_eq!(finite, eos, "a complete object allows only EOS");
    assert!(c.advance(ids("x")[0]).is_err(), "text after the end is an error");
}

#[test]
fn reasoning_runs_free_until_think_closes() {
    let (f, t) = (schema_format(), ToolSchemas::new());
    let c = build(&spec(&f, &t, &ToolChoice::Auto, true));
    assert!(accepts_whole(&c, "The user wants n.\nSo {\"n\": 1} maybe.\n</think>\n\n{\"n\": 3}"));
    assert!(accepts_whole(&c, "</think>{\"n\": 3}"));
    assert!(!accepts_whole(&c, "{\"n\": 3}"), "the JSON alone is still reasoning: no end yet");
    assert!(!accepts_whole(&c, "ok\n</think>\n\nnot json"));
}

const CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José </parameter> stays\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

#[test]
fn a_forced_call_accepts_what_the_output_parser_reads() {
    let t = tools();
    let c = build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, false));
    assert!(accepts_whole(&c, CALL));
    assert!(accepts_whole(&c, "<tool_call>\n<function=now>\n</function>\n</tool_call>"));
    assert!(accepts_whole(&c, &CALL.replace("<parameter=days>\n3\n</parameter>\n", "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n")));
    let unit = |u: &str| CALL.replace("</function>", &format!("<parameter=unit>\n{u}\n</parameter>\n</function>"));
    assert!(accepts_whole(&c, &unit("fahrenheit")));
    assert!(!accepts_whole(&c, &unit("kelvin")), "not in the enum");
    let code = |v: &str| CALL.replace("</function>", &format!("<parameter=code>\n{v}\n</parameter>\n</function>"));
    assert!(accepts_whole(&c, &code("AB1")));
    assert!(!accepts_whole(&c, &code("ABCD")), "over maxLength");
    let parsed = OutputParser::parse(CALL, ParserOptions { starts_in_reasoning: false, tools: Some(t.clone()), call_id_prefix: "c".into() }, false);
    assert_eq!(parsed.tool_calls.len(), 1);
    assert_eq!(parsed.tool_calls[0].name, "get_weather");
    let args: Json = serde_json::from_str(&parsed.tool_calls[0].arguments).unwrap();
    assert_eq!(args, json!({"city": "San José </parameter> stays", "days": 3}));
    assert!(parsed.content.is_empty());
}

#[test]
fn a_forced_call_rejects_unknown_names_keys_and_bad_values() {
    let t = tools();
    let c = build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, false));
    assert!(!accepts_whole(&c, &CALL.replace("get_weather", "get_time")), "unknown function");
    assert!(!accepts_whole(&c, &CALL.replace("<parameter=city>", "<parameter=town>")), "unknown key");
    assert!(!accepts_whole(&c, &CALL.replace("\n3\n", "\nthree\n")), "an integer parameter takes JSON");
    assert!(!accepts_whole(&c, &CALL.replace("\n3\n", "\n0\n")), "below the schema's minimum");
    assert!(!accepts_whole(&c, &CALL.replace("<parameter=days>\n3\n</parameter>\n", "")), "a required key is missing");
    assert!(!accepts_whole(&c, &format!("Let me check.\n\n{CALL}")), "text before the call");
    assert!(!accepts_whole(&c, &format!("{CALL}\n{CALL}")), "one call when parallel_tool_calls is false");
    let mut parallel = spec(&OutputFormat::Text, &t, &ToolChoice::Required, false);
    parallel.parallel_tool_calls = true;
    assert!(accepts_whole(&build(&parallel), &format!("{CALL}\n{CALL}")));
}

#[test]
fn a_named_function_allows_only_that_function() {
    let t = tools();
    let named = ToolChoice::Function("now".into());
    let c = build(&spec(&OutputFormat::Text, &t, &named, false));
    assert!(accepts_whole(&c, "<tool_call>\n<function=now>\n</function>\n</tool_call>"));
    assert!(!accepts_whole(&c, CALL));
    let c = build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, true));
    assert!(accepts_whole(&c, &format!("I need the weather.\n</think>\n\n{CALL}")));
}

#[test]
fn bad_requests_are_errors_naming_the_cause() {
    let t = tools();
    let none = ToolSchemas::new();
    let err = |f: &OutputFormat, t: &ToolSchemas, c: &ToolChoice| Constraint::build(vocab(), &spec(f, t, c, false)).unwrap_err();
    assert_eq!(err(&OutputFormat::Text, &t, &ToolChoice::Function("nope".into())), GrammarError::UnknownTool("nope".into()));
    assert_eq!(err(&OutputFormat::Text, &none, &ToolChoice::Required), GrammarError::NoTools);
    let bad = OutputFormat::JsonSchema { name: "x".into(), schema: Some(json!({"type": "object", "properties": {"a": {"type": "nonsense"}}})), strict: true };
    match err(&bad, &none, &ToolChoice::Auto) {
        GrammarError::Schema(m) => assert_eq!(m, "failed to compile JSON schema: Invalid type: nonsense"),
        other => panic!("{other:?}"),
    }
    let not_object = OutputFormat::JsonSchema { name: "x".into(), schema: Some(json!([1, 2])), strict: true };
    assert!(matches!(err(&not_object, &none, &ToolChoice::Auto), GrammarError::Schema(_)));
    let mut broken = ToolSchemas::new();
    broken.insert("f", Some(&json!({"type": "object", "properties": {}, "required": ["x"]})));
    assert!(matches!(err(&OutputFormat::Text, &broken, &ToolChoice::Required), GrammarError::Tool { .. }));
    let mut bad_param = ToolSchemas::new();
    bad_param.insert("g", Some(&json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}})));
    match err(&OutputFormat::Text, &bad_param, &ToolChoice::Required) {
        GrammarError::Tool { name, path, message } => {
            assert_eq!((name.as_str(), path.as_str()), ("g", "properties.n"));
            assert!(!message.contains('\n'), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Compiles, but allows no first token: refused when built, not at the first mask.
    let self_ref = OutputFormat::JsonSchema { name: "c".into(), schema: Some(json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})), strict: true };
    match err(&self_ref, &none, &ToolChoice::Auto) {
        GrammarError::Schema(m) => assert!(m.starts_with("it allows no first token") && !m.contains('\n'), "{m}"),
        other => panic!("{other:?}"),
    }
    // A name the call's XML could not carry back.
    let mut odd = ToolSchemas::new();
    odd.insert("we\"ird>\nname", Some(&json!({"type": "object", "properties": {}})));
    assert_eq!(err(&OutputFormat::Text, &odd, &ToolChoice::Required), GrammarError::ToolName("we\"ird>\nname".into()));
}

#[test]
fn eos_after_a_complete_output_ends_the_grammar() {
    // A closed object: nothing can follow, and llguidance has stopped its parser after `}`
    // (a stopped parser refuses every id); the EOS its mask allows still ends the grammar.
    let (f, t) = (schema_format(), ToolSchemas::new());
    let mut c = build(&spec(&f, &t, &ToolChoice::Auto, false));
    for id in ids(r#"{"n": 5}"#) {
        assert_eq!(c.advance(id), Ok(false));
    }
    for &eos in vocab().eos_ids() {
        assert_eq!(c.clone().advance(eos), Ok(true), "EOS {eos}");
    }
    assert_eq!(c.advance(im_end()), Ok(true));
    // Parallel calls: complete after one call, though another could follow; EOS ends it too.
    let tools = tools();
    let mut parallel = spec(&OutputFormat::Text, &tools, &ToolChoice::Required, false);
    parallel.parallel_tool_calls = true;
    let mut c = build(&parallel);
    for id in ids(CALL) {
        assert_eq!(c.advance(id), Ok(false));
    }
    assert!(c.is_complete());
    assert_eq!(c.advance(im_end()), Ok(true));
    // EOS before the output is complete is no end.
    let mut c = build(&spec(&f, &t, &ToolChoice::Auto, false));
    assert_eq!(c.advance(ids("{")[0]), Ok(false));
    assert!(c.advance(im_end()).is_err());
}

fn call_of(name: &str, params: &[(&str, &str)]) -> String {
    let params: String = params.iter().map(|(k, v)| format!("<parameter={k}>\n{v}\n</parameter>\n")).collect();
    format!("<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
}

#[test]
fn refs_and_alternatives_in_a_forced_call_are_enforced() {
    let mut t = ToolSchemas::new();
    let stop = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "nights": {"type": "integer", "minimum": 1}}, "required": ["city", "nights"], "additionalProperties": false});
    t.insert(
        "plan",
        Some(&json!({"type": "object", "$defs": {"Stop": stop}, "properties": {
            "first": {"$ref": "#/$defs/Stop"},
            "stops": {"type": "array", "items": {"$ref": "#/$defs/Stop"}},
            "budget": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "tag": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
            "mode": {"oneOf": [{"type": "string", "enum": ["car", "train"]}, {"type": "integer"}]},
            "note": {"type": "string", "minLength": 3}
        }, "required": ["first"]})),
    );
    let c = build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, false));
    let first = ("first", r#"{"city": "Oslo", "nights": 2}"#);
    let ok = |extra: &[(&str, &str)]| accepts_whole(&c, &call_of("plan", &[&[first], extra].concat()));
    assert!(ok(&[]));
    assert!(!accepts_whole(&c, &call_of("plan", &[("first", "Oslo")])), "a $ref to an object takes its JSON, not text");
    assert!(!accepts_whole(&c, &call_of("plan", &[("first", r#"{"city": "Oslo", "nights": 0}"#)])), "the referenced schema's minimum");
    assert!(ok(&[("stops", r#"[{"city": "Rome", "nights": 1}]"#)]));
    assert!(!ok(&[("stops", r#"[{"town": "Rome", "nights": 1}]"#)]), "a $ref inside a property resolves in the tool's $defs");
    assert!(ok(&[("budget", "null")]) && ok(&[("budget", "120")]));
    assert!(!ok(&[("budget", "lots")]));
    assert!(ok(&[("tag", "7")]) && ok(&[("tag", r#""abc""#)]));
    assert!(!ok(&[("tag", "abc")]), "a typed alternative is written as JSON");
    assert!(!ok(&[("tag", r#""abcd""#)]), "the string alternative's maxLength");
    // Read as text (its first alternative is a string): that alternative is what holds.
    assert!(ok(&[("mode", "train")]));
    assert!(!ok(&[("mode", "bus")]));
    assert!(ok(&[("note", "a longer\nnote")]));
    assert!(!ok(&[("note", "ab")]), "under minLength");
    // What the grammar accepts, the output parser reads back as the schema's values.
    let text = call_of("plan", &[first, ("budget", "null"), ("tag", r#""ab""#), ("mode", "car")]);
    assert!(accepts_whole(&c, &text));
    let parsed = OutputParser::parse(&text, ParserOptions { starts_in_reasoning: false, tools: Some(t.clone()), call_id_prefix: "c".into() }, false);
    assert_eq!(parsed.tool_calls[0].input(), json!({"first": {"city": "Oslo", "nights": 2}, "budget": null, "tag": "ab", "mode": "car"}));
}

#[test]
fn unenforceable_parameters_are_refused_naming_their_place_in_the_schema() {
    let fault = |props: Json| -> (String, String) {
        let mut t = ToolSchemas::new();
        t.insert("f", Some(&json!({"type": "object", "properties": props})));
        match Constraint::build(vocab(), &spec(&OutputFormat::Text, &t, &ToolChoice::Required, false)).unwrap_err() {
            GrammarError::Tool { path, message, .. } => (path, message),
            other => panic!("{other:?}"),
        }
    };
    let (path, message) = fault(json!({"s": {"type": "string", "minLength": 5, "maxLength": 2}}));
    assert_eq!((path.as_str(), message.as_str()), ("properties.s.minLength", "`minLength` 5 is greater than `maxLength` 2"));
    assert_eq!(fault(json!({"s": {"type": "string", "maxLength": -1}})).0, "properties.s.maxLength");
    assert_eq!(fault(json!({"s": {"type": "string", "minLength": 1.5}})).0, "properties.s.minLength");
    assert_eq!(fault(json!({"s": {"type": "nonsense"}})).0, "properties.s.type");
    assert_eq!(fault(json!({"s": {"$ref": "#/$defs/missing"}})).0, "properties.s");
    assert_eq!(fault(json!({"s": {"$ref": "https://example.com/s.json"}})).0, "properties.s");
    assert_eq!(fault(json!({"s": {"type": "string", "pattern": "^a+$"}})).0, "properties.s.pattern");
    assert_eq!(fault(json!({"s": {"oneOf": [{"type": "string", "minLength": 3, "maxLength": 1}]}})).0, "properties.s.oneOf[0].minLength");
    assert_eq!(fault(json!({"s": {"type": "string", "enum": [1, 2]}})).0, "properties.s.enum");
    // A JSON value's schema that llguidance refuses is found among the others and named.
    assert_eq!(fault(json!({"ok": {"type": "integer"}, "n": {"type": "integer", "minimum": 5, "maximum": 1}})).0, "properties.n");
}

#[test]
fn a_prepared_mask_is_the_mask_computed_in_place() {
    // Along a forced call (free text, then JSON), the runtime's overlapped path (prepare during
    // the step, then mask) gives every row the bits of the serial one (mask alone).
    let t = tools();
    let c = build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, false));
    let row: Vec<f32> = (0..vocab().len() + 7).map(|i| (i % 89) as f32 * 0.5 - 9.0).collect();
    let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let (mut serial, mut ahead) = (c.clone(), c);
    assert!(ahead.is_prepared(), "building computes the first mask, and keeps it");
    for (k, id) in ids(CALL).into_iter().enumerate() {
        let (mut a, mut b) = (row.clone(), row.clone());
        if k % 3 != 2 {
            ahead.prepare();
            assert!(ahead.is_prepared());
            ahead.prepare(); // a second call keeps the mask it has
        }
        serial.mask(&mut a).unwrap();
        ahead.mask(&mut b).unwrap();
        assert!(bits(&a) == bits(&b), "token {k}: the masks differ");
        assert!(a[id as usize].is_finite(), "token {k}: the path's id was masked");
        assert_eq!(serial.advance(id), ahead.advance(id));
        assert!(!ahead.is_prepared(), "advancing drops the mask of the state left");
    }
    // A prepared failure is the same failure: a complete call allows only EOS, and text
    // after it is refused by advance in both.
    ahead.prepare();
    let (mut a, mut b) = (row.clone(), row.clone());
    serial.mask(&mut a).unwrap();
    ahead.mask(&mut b).unwrap();
    assert!(bits(&a) == bits(&b));
    assert!(a[im_end() as usize].is_finite());
}

#[test]
fn a_text_parameter_with_a_known_format_takes_only_strings_of_it() {
    let mut t = ToolSchemas::new();
    let string = |format: &str| json!({"type": "string", "format": format});
    t.insert(
        "book",
        Some(&json!({"type": "object", "properties": {
            "when": string("date-time"), "day": string("date"), "at": string("time"), "mail": string("email"),
            "id": string("uuid"), "link": string("uri"), "host": string("hostname"), "ip": string("ipv4"),
            "short": {"type": "string", "format": "uri", "minLength": 10, "maxLength": 12},
            "color": string("x-colour"), "either": {"anyOf": [{"type": "string", "format": "uuid"}, {"type": "null"}]}
        }})),
    );
    let c = build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, false));
    let one = |key: &str, value: &str| accepts_whole(&c, &call_of("book", &[(key, value)]));
    let cases: &[(&str, &[&str], &[&str])] = &[
        (
            "when",
            &["2026-12-03T17:05:00Z", "2024-02-29t23:59:60.125+05:30"],
            &["2026-12-03 17:05:00Z", "2026-13-01T00:00:00Z", "2026-04-31T00:00:00Z", "2026-12-03T17:05:00", "tomorrow"],
        ),
        ("day", &["2026-12-03", "1999-01-31"], &["2026-12-3", "2026-02-30", "03/12/2026", "2026-12-03T10:00:00Z"]),
        ("at", &["17:05:00Z", "00:00:00.5-01:00"], &["17:05", "24:00:00Z", "5pm"]),
        ("mail", &["ada@example.com", "first.last+tag@mail.example.org"], &["ada", "ada@", "@example.com", "a b@example.com", "ada@-bad.com"]),
        ("id", &["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000"], &["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"]),
        ("link", &["https://example.com/a/b?q=1&r=%20#top", "mailto:ada@example.com", "urn:isbn:0451450523"], &["example.com/a", "https://exa mple.com", "1http://x"]),
        ("host", &["example.com", "localhost", "a-1.b-2.c"], &["-a.com", "a..b", "a_b.com"]),
        ("ip", &["192.168.0.1", "0.0.0.0", "255.255.255.255"], &["256.1.1.1", "1.2.3", "01.2.3.4"]),
        // A length bound applies together with the format.
        ("short", &["https://a.io", "ftp://a.io"], &["https://ab.io", "a:b", "https:/ a.io"]),
        // A format we have no regex for is free text, not a refusal.
        ("color", &["teal-ish, like the sea\nat dusk"], &[]),
        ("either", &["123e4567-e89b-12d3-a456-426614174000"], &["not a uuid"]),
    ];
    for (key, good, bad) in cases {
        for v in good.iter() {
            assert!(one(key, v), "{key}: {v:?} should be accepted");
        }
        for v in bad.iter() {
            assert!(!one(key, v), "{key}: {v:?} should be refused");
        }
    }
    // The parser reads a formatted value back as the string it is.
    let text = call_of("book", &[("when", "2026-12-03T17:05:00Z"), ("mail", "ada@example.com")]);
    let parsed = OutputParser::parse(&text, ParserOptions { starts_in_reasoning: false, tools: Some(t.clone()), call_id_prefix: "c".into() }, false);
    assert_eq!(parsed.tool_calls[0].input(), json!({"when": "2026-12-03T17:05:00Z", "mail": "ada@example.com"}));
    // A `format` that is not a string is a schema error naming it.
    let mut bad = ToolSchemas::new();
    bad.insert("f", Some(&json!({"type": "object", "properties": {"d": {"type": "string", "format": 7}}})));
    match Constraint::build(vocab(), &spec(&OutputFormat::Text, &bad, &ToolChoice::Required, false)).unwrap_err() {
        GrammarError::Tool { path, .. } => assert_eq!(path, "properties.d.format"),
        other => panic!("{other:?}"),
    }
}

/// The fault of a forced call of `f` with the single property `s` of schema `schema`.
fn fault_of_param(schema: Json) -> (String, String) {
    let mut t = ToolSchemas::new();
    t.insert("f", Some(&json!({"type": "object", "properties": {"s": schema}})));
    match Constraint::build(vocab(), &spec(&OutputFormat::Text, &t, &ToolChoice::Required, false)) {
        Err(GrammarError::Tool { path, message, .. }) => (path, message),
        other => panic!("{other:?}"),
    }
}

/// The constraint of a forced call of `f` with the single property `s` of schema `schema`.
fn one_param(schema: Json) -> Constraint {
    let mut t = ToolSchemas::new();
    t.insert("f", Some(&json!({"type": "object", "properties": {"s": schema}, "required": ["s"]})));
    build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, false))
}

#[test]
fn format_lengths_no_value_meets_are_refused_naming_the_bound() {
    let string = |format: &str, bounds: Json| {
        let mut s = json!({"type": "string", "format": format});
        s.as_object_mut().unwrap().extend(bounds.as_object().unwrap().clone());
        s
    };
    let cases: &[(&str, Json, &str, &str)] = &[
        ("uuid", json!({"maxLength": 10}), "maxLength", "a `uuid` is 36 characters; `maxLength` 10 leaves none"),
        ("uuid", json!({"minLength": 37}), "minLength", "a `uuid` is 36 characters; `minLength` 37 leaves none"),
        ("date", json!({"minLength": 11}), "minLength", "a `date` is 10 characters; `minLength` 11 leaves none"),
        ("date-time", json!({"maxLength": 19}), "maxLength", "a `date-time` is 20 characters, or at least 22 characters; `maxLength` 19 leaves none"),
        // Between the lengths a format has: HH:MM:SSZ is 9, with a fraction 11 on.
        ("time", json!({"minLength": 10, "maxLength": 10}), "minLength", "a `time` is 9 characters, or at least 11 characters; `minLength` 10 and `maxLength` 10 leave none"),
        ("ipv4", json!({"minLength": 16}), "minLength", "an `ipv4` is 7 to 15 characters; `minLength` 16 leaves none"),
        ("ipv4", json!({"maxLength": 6}), "maxLength", "an `ipv4` is 7 to 15 characters; `maxLength` 6 leaves none"),
        ("email", json!({"maxLength": 2}), "maxLength", "an `email` is at least 3 characters; `maxLength` 2 leaves none"),
        ("uri", json!({"maxLength": 1}), "maxLength", "a `uri` is at least 2 characters; `maxLength` 1 leaves none"),
        ("hostname", json!({"maxLength": 0}), "maxLength", "a `hostname` is at least 1 character; `maxLength` 0 leaves none"),
        // More than llguidance can intersect with a format (it would fail mid-generation).
        ("uri", json!({"minLength": 100000}), "minLength", "`minLength` 100000 cannot be enforced with a `format`: at most 2048 characters"),
        ("date", json!({"minLength": 5_000_000_000u64}), "minLength", "a `date` is 10 characters; `minLength` 5000000000 leaves none"),
    ];
    for (format, bounds, key, message) in cases {
        let (path, got) = fault_of_param(string(format, bounds.clone()));
        assert_eq!((path.as_str(), got.as_str()), (format!("properties.s.{key}").as_str(), *message), "{format} {bounds}");
    }
    // In an alternative, the path goes through it.
    let (path, _) = fault_of_param(json!({"anyOf": [{"type": "null"}, {"type": "string", "format": "uuid", "maxLength": 10}]}));
    assert_eq!(path, "properties.s.anyOf[1].maxLength");
    // A plain string's `minLength` past what llguidance counts is refused by name too.
    let (path, message) = fault_of_param(json!({"type": "string", "minLength": 5_000_000_000u64}));
    assert_eq!((path.as_str(), message.as_str()), ("properties.s.minLength", "`minLength` 5000000000 is more than any output can hold (at most 4294967295)"));

    // Bounds some value meets build, and hold.
    let value = |c: &Constraint, v: &str| accepts_whole(c, &call_of("f", &[("s", v)]));
    let c = one_param(string("time", json!({"minLength": 9, "maxLength": 9})));
    assert!(value(&c, "17:05:00Z") && !value(&c, "17:05:00.5Z"));
    let c = one_param(string("ipv4", json!({"maxLength": 9})));
    assert!(value(&c, "1.2.3.4") && value(&c, "10.20.3.4") && !value(&c, "10.20.30.4"));
    let c = one_param(string("uuid", json!({"minLength": 36, "maxLength": 5_000_000_000u64})));
    assert!(value(&c, "123e4567-e89b-12d3-a456-426614174000"));
    // A `maxLength` past the limit is left to the format.
    let c = one_param(string("uri", json!({"maxLength": 100000})));
    assert!(value(&c, "https://example.com/a") && !value(&c, "example.com"));
    // A plain `maxLength` past u32::MAX is u32::MAX: the same for any output.
    let c = one_param(json!({"type": "string", "maxLength": 5_000_000_000u64}));
    assert!(value(&c, "any text at all") && !value(&c, "two\nlines"));
}

#[test]
fn formatted_lengths_at_the_limit_give_a_mask_at_every_token() {
    // The limit is where llguidance's intersection of a format and a length still computes
    // every mask: past it (5000) an email runs out of lexer fuel a few tokens in.
    let limit = FORMAT_LENGTH_LIMIT as usize;
    let local = "ab.c".repeat(limit);
    let email = format!("{}@example.com", &local[..limit - 12]);
    let mut c = one_param(json!({"type": "string", "format": "email", "minLength": FORMAT_LENGTH_LIMIT, "maxLength": FORMAT_LENGTH_LIMIT}));
    let mut row = vec![0.0f32; vocab().len()];
    for (k, id) in ids(&call_of("f", &[("s", &email)])).into_iter().enumerate() {
        row.fill(0.0);
        c.mask(&mut row).unwrap_or_else(|e| panic!("token {k}: {e}"));
        assert!(row[id as usize].is_finite(), "token {k} is masked");
        c.advance(id).unwrap_or_else(|e| panic!("token {k}: {e}"));
    }
    assert!(c.is_complete());
}

#[test]
fn a_nullable_formatted_parameter_may_be_null() {
    let mut t = ToolSchemas::new();
    t.insert(
        "f",
        Some(&json!({"type": "object", "properties": {
            "any_of": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]},
            "null_first": {"anyOf": [{"type": "null"}, {"type": "string", "format": "uuid"}]},
            "types": {"type": ["string", "null"], "format": "date-time"},
            "bounded": {"type": ["string", "null"], "format": "date-time", "maxLength": 25},
            "host": {"type": ["string", "null"], "format": "hostname"},
            "plain": {"type": "string", "format": "date-time"}
        }})),
    );
    let c = build(&spec(&OutputFormat::Text, &t, &ToolChoice::Required, false));
    let one = |key: &str, v: &str| accepts_whole(&c, &call_of("f", &[(key, v)]));
    for key in ["any_of", "null_first", "types", "bounded", "host"] {
        for v in ["null", "None", "NULL", "none"] {
            assert!(one(key, v), "{key}: {v:?} should be accepted");
        }
        for v in ["null!", "null null", "(none)"] {
            assert!(!one(key, v), "{key}: {v:?} should be refused");
        }
    }
    assert!(one("any_of", "2026-12-03T17:05:00Z") && one("bounded", "2026-12-03T17:05:00Z") && one("null_first", "123e4567-e89b-12d3-a456-426614174000"));
    assert!(!one("bounded", "2026-12-03T17:05:00.123456Z"), "the string's maxLength still holds");
    // Not nullable: `null` is no date-time (the parser would read it as the string "null").
    assert!(!one("plain", "null") && !one("plain", "None"));
    // What the grammar accepts as null, the parser reads back as null.
    let text = call_of("f", &[("any_of", "None"), ("null_first", "null"), ("types", "NULL"), ("host", "null"), ("plain", "2026-12-03T17:05:00Z")]);
    assert!(accepts_whole(&c, &text));
    let parsed = OutputParser::parse(&text, ParserOptions { starts_in_reasoning: false, tools: Some(t.clone()), call_id_prefix: "c".into() }, false);
    assert_eq!(parsed.tool_calls[0].input(), json!({"any_of": null, "null_first": null, "types": null, "host": null, "plain": "2026-12-03T17:05:00Z"}));
}
