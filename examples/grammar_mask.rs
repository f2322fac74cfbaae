//! What constrained decoding costs on the host: building the token table once, building a
//! request's constraint, and masking one row per generated token.
//! `cargo run --release --example grammar_mask -- TOKENIZER_DIR [repeats]` (a directory with
//! `tokenizer.json`, e.g. ../shared/tokenizers/qwen3.5). Each constraint follows a valid output
//! token by token (mask a row the width of the vocabulary, then advance), so the per-token
//! figure is the mask cost along a real path through the grammar. Results: bench/results/2026-12-02-grammar-mask.md.

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use tensorfold::grammar::{Constraint, Spec, Vocabulary};
use tensorfold::server::parse::ToolSchemas;
use tensorfold::server::{OutputFormat, ToolChoice};
use tensorfold::tokenizer::Tokenizer;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::PathBuf::from(args.first().expect("usage: grammar_mask TOKENIZER_DIR [repeats]"));
    let repeats: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(5);
    let tokenizer = Tokenizer::from_dir(&dir).expect("load the tokenizer");
    let t = Instant::now();
    let vocab = Arc::new(Vocabulary::of(&tokenizer).expect("token table"));
    println!("token table: {} ids in {:.0} ms", vocab.len(), t.elapsed().as_secs_f64() * 1e3);

    let schema = OutputFormat::JsonSchema {
        name: "person".into(),
        schema: Some(json!({"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city"]}
        }, "required": ["name", "age"], "additionalProperties": false})),
        strict: true,
    };
    let json_text = r#"{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "address": {"city": "London", "zip": "12345"}}"#;
    let mut tools = ToolSchemas::new();
    tools.insert("get_weather", Some(&json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})));
    tools.insert("search", Some(&json!({"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}})));
    let call_text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, California\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let none = ToolSchemas::new();
    let cases = [
        ("json_schema", Spec { format: &schema, tools: &none, tool_choice: &ToolChoice::Auto, parallel_tool_calls: false, starts_in_reasoning: false }, json_text),
        (
            "json_object",
            Spec { format: &OutputFormat::JsonObject, tools: &none, tool_choice: &ToolChoice::Auto, parallel_tool_calls: false, starts_in_reasoning: false },
            json_text,
        ),
        (
            "tool_choice required",
            Spec { format: &OutputFormat::Text, tools: &tools, tool_choice: &ToolChoice::Required, parallel_tool_calls: true, starts_in_reasoning: false },
            call_text,
        ),
    ];
    let mut row = vec![0.0f32; vocab.len()];
    for (label, spec, text) in cases {
        let ids = tokenizer.encode_with(text, false).expect("encode");
        let (mut build, mut per_token, mut worst) = (0.0f64, 0.0f64, 0.0f64);
        for _ in 0..repeats {
            let t = Instant::now();
            let mut c = Constraint::build(&vocab, &spec).expect("builds").expect("constrains");
            build += t.elapsed().as_secs_f64();
            for &id in &ids {
                row.iter_mut().for_each(|x| *x = 0.0);
                let t = Instant::now();
                c.mask(&mut row).expect("mask");
                c.advance(id).expect("the text follows the grammar");
                let dt = t.elapsed().as_secs_f64();
                per_token += dt;
                worst = worst.max(dt);
                assert!(row[id as usize] == 0.0, "{label}: the path's id was masked");
            }
        }
        let n = (repeats * ids.len()) as f64;
        println!(
            "{label}: build {:.2} ms; mask + advance per token: mean {:.0} µs, max {:.0} µs ({} tokens × {repeats})",
            build / repeats as f64 * 1e3,
            per_token / n * 1e6,
            worst * 1e6,
            ids.len()
        );
    }
}
