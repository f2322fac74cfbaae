//! A short soak of `tensorfold serve` (bench/soak.py with 200 requests on the tiny fixture, 16
//! at a time, a fifth cancelled by the client, streamed and whole, chat and completions): what
//! tests/serve.rs does not check: whole (non-streamed) requests abandoned by their client end as
//! aborts, and under that mixed load `/metrics` (sequences by finish reason, prompt and
//! generation tokens) agrees with what the clients saw, every response is valid, every repeat of
//! a seeded request gives the same text, and every slot is free afterwards. The resident-memory
//! check is left to the full run (2,000 requests against the RSS after the first hundred,
//! bench/results/2026-12-03-cpu-soak-reuse.md): over 200 requests it would compare two samples
//! of the running sequences' memory a moment apart.

use std::process::Command;

use tensorfold::testutil::shared;

#[test]
fn short_soak_ends_every_request_cleanly_and_metrics_agree() {
    let out = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/bench/soak.py"))
        .args(["--binary", env!("CARGO_BIN_EXE_tensorfold"), "-m"])
        .arg(shared("fixtures/tiny/mlx-q4"))
        .args(["--requests", "200", "--concurrency", "16", "--rss-tolerance", "1e9"])
        .output()
        .expect("run python3 bench/soak.py (it needs httpx, which the openai package .ci/run installs brings)");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "bench/soak.py failed:\n{text}");
    assert!(text.contains("\nPASS  metrics: finish reasons:"), "no metrics check ran:\n{text}");
    assert!(!text.contains("FAIL "), "{text}");
}
