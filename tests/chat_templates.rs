//! Chat template rendering against Hugging Face transformers.
//!
//! `tests/data/chat_templates.json` (made by `tools/chat_template_cases.py`) holds
//! conversations rendered by transformers' `apply_chat_template` — text and token ids, or the
//! exception it raised — for each of several templates. Every case must render here to the same
//! text and encode (`encode_with(text, false)`, as transformers does) to the same ids, or fail
//! where it failed, with the same message when the template raised it itself.
//!
//! `TENSORFOLD_CHAT_TEMPLATE_CASES=FILE` checks another file made by the script (e.g. with a
//! model's real template given by `--template`).

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tensorfold::testutil::shared;
use tensorfold::tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

/// A path of the cases file: `../shared/...` is the shared folder, others are relative to the
/// repository root (or absolute).
fn resolve(path: &str) -> PathBuf {
    match path.strip_prefix("../shared/") {
        Some(rest) => shared(rest),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join(path),
    }
}

#[test]
fn chat_templates_render_as_transformers() {
    let cases_path = std::env::var_os("TENSORFOLD_CHAT_TEMPLATE_CASES").map(PathBuf::from).unwrap_or_else(|| resolve("tests/data/chat_templates.json"));
    let data: Json = serde_json::from_str(&std::fs::read_to_string(&cases_path).unwrap()).unwrap();
    let tok = Tokenizer::from_dir(&resolve(data["tokenizer"].as_str().unwrap())).unwrap();

    let mut failures = Vec::new();
    let mut checked = 0;
    for t in data["templates"].as_array().unwrap() {
        let path = t["path"].as_str().unwrap();
        let source = std::fs::read_to_string(resolve(path)).unwrap();
        let template = ChatTemplate::new(source, path).unwrap();
        for case in t["cases"].as_array().unwrap() {
            checked += 1;
            let name = format!("{path}: {}", case["name"].as_str().unwrap());
            let messages = case["messages"].as_array().unwrap();
            let mut kwargs = case["kwargs"].as_object().unwrap().clone();
            if let Some(tools) = case.get("tools") {
                kwargs.insert("tools".into(), tools.clone());
            }
            let agp = case["add_generation_prompt"].as_bool().unwrap();
            let got = template.render_json(messages, agp, &kwargs);
            match (case.get("text"), &got) {
                (Some(want), Ok(text)) => {
                    if text != want.as_str().unwrap() {
                        failures.push(format!("{name}: text\n  want {want}\n  got  {text:?}"));
                        continue;
                    }
                    let ids = tok.encode_with(text, false).unwrap();
                    let want_ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
                    if ids != want_ids {
                        failures.push(format!("{name}: ids differ"));
                    }
                }
                (Some(_), Err(e)) => failures.push(format!("{name}: failed here: {e}")),
                (None, Ok(text)) => failures.push(format!("{name}: transformers failed ({}), rendered here: {text:?}", case["error"]["message"])),
                (None, Err(e)) => {
                    let want = case["error"]["message"].as_str().unwrap();
                    if case["error"]["raised"].as_bool().unwrap() {
                        match e {
                            TokenizerError::TemplateException { message, .. } if message == want => {}
                            other => failures.push(format!("{name}: want exception {want:?}, got {other}")),
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} of {checked} cases differ:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= 60, "only {checked} cases in {}", cases_path.display());
}
