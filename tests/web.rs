//! The chat page of `tensorfold serve` (`/`, src/serve/web/) as a person uses it: a real headless
//! Chromium (Debian's `chromium`), driven by playwright-core (tests/web/chat.test.mjs, run by
//! node's test runner), against the built binary on the vocab fixture: a default server, and one
//! with `--api-key` and a 64-token context. `.ci/run` installs chromium, runs `npm ci` in
//! tests/web and sets TENSORFOLD_REQUIRE_BROWSER=1, so there a missing browser fails the test;
//! elsewhere it is skipped with the reason printed.
//!
//! `TENSORFOLD_SCREENSHOTS=docs cargo test --release --test web` also writes the README's
//! screenshots (docs/webchat-wide.png, docs/webchat-narrow.png).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::Server;
use tensorfold::testutil::shared;

const KEY: &str = "web-test-key-41c9";

/// Why the browser tests cannot run here, if they cannot.
fn missing(chromium: &Path, dir: &Path) -> Option<String> {
    if !chromium.exists() {
        return Some(format!("{} is not installed (apt-get install chromium)", chromium.display()));
    }
    if !dir.join("node_modules/playwright-core").exists() {
        return Some(format!("playwright-core is not installed (cd {} && npm ci)", dir.display()));
    }
    match Command::new("node").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("node is not installed (apt-get install nodejs npm)".into()),
    }
}

#[test]
fn chat_page_in_headless_chromium() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/web");
    let chromium = std::env::var_os("TENSORFOLD_CHROMIUM").map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    if let Some(why) = missing(&chromium, &dir) {
        assert!(std::env::var("TENSORFOLD_REQUIRE_BROWSER").as_deref() != Ok("1"), "the browser tests must run (TENSORFOLD_REQUIRE_BROWSER=1) but {why}");
        println!("skipped: {why}");
        return;
    }
    let vocab = shared("fixtures/vocab/mlx-q4");
    let open = Server::start_on(&vocab, &[]);
    let limited = Server::start_on(&vocab, &["--api-key", KEY, "--max-model-len", "64"]);
    let mut cmd = Command::new("node");
    cmd.current_dir(&dir)
        .args(["--test", "--test-reporter=spec", "chat.test.mjs"])
        .env("TF_BASE", open.base())
        .env("TF_LIMITED_BASE", limited.base())
        .env("TF_KEY", KEY)
        .env("TF_CHROMIUM", &chromium)
        .env_remove("TF_WEB_DIR");
    if let Some(shots) = std::env::var_os("TENSORFOLD_SCREENSHOTS") {
        cmd.env("TF_SHOTS", Path::new(env!("CARGO_MANIFEST_DIR")).join(shots));
    }
    let out = cmd.output().expect("run node");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    let logs = || format!("default server's log:\n{}\nkeyed server's log:\n{}", open.log(), limited.log());
    assert!(out.status.success(), "the browser tests failed:\n{text}\n{}", logs());
    // node's runner prints its totals; a file that ran nothing must not pass.
    let passed = text.lines().find_map(|l| l.trim_start_matches(['ℹ', ' ']).strip_prefix("pass ")).and_then(|n| n.trim().parse::<u32>().ok());
    assert!(passed.is_some_and(|n| n >= 7), "fewer browser tests passed than written:\n{text}");
}
