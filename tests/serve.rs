//! `tensorfold serve` as clients see it: the built binary on a free loopback port on the vocab
//! fixture (random weights, Qwen3.5's tokenizer and chat template), driven by the official
//! `openai` Python package (tests/serve/test_openai.py; `.ci/run` installs it), then stopped by
//! SIGTERM while a request is streaming, which must finish before the process exits.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::Server;
use tensorfold::testutil::shared;

const KEY: &str = "test-key-7f3a";

impl Server {
    /// Starts `tensorfold serve` on the vocab fixture on port 0 and waits for its address.
    fn start(extra: &[&str]) -> Self {
        Self::start_on(&shared("fixtures/vocab/mlx-q4"), extra)
    }

    /// Runs one class of the Python suite `tests/serve/test_openai.py` against this server.
    fn python(&self, class: &str) {
        self.python_file("test_openai.py", class);
    }

    /// Runs one class of the Python suite `tests/serve/FILE` against this server.
    fn python_file(&self, file: &str, class: &str) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve").join(file);
        let out = Command::new("python3")
            .arg(&script)
            .arg(class)
            .env("TF_BASE", self.base())
            .env("TF_KEY", KEY)
            .output()
            .expect("run python3 (the serve tests need python3 and the openai and anthropic packages, as .ci/run installs them)");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        println!("{text}");
        assert!(
            !text.contains("No module named"),
            "the serve tests need the openai and anthropic packages: python3 -m pip install openai==3.51.0 anthropic==2.15.0 (as .ci/run does)"
        );
        assert!(out.status.success(), "python suite {class} failed:\n{text}\nserver log:\n{}", self.log());
        assert!(text.contains("\nOK"), "python suite {class} did not report OK:\n{text}");
    }

    /// Sends SIGTERM and waits for the exit status.
    fn terminate(&mut self, within: Duration) -> std::process::ExitStatus {
        let ok = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("run kill");
        assert!(ok.success(), "kill -TERM failed");
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("wait for the server") {
                return s;
            }
            assert!(t0.elapsed() < within, "the server did not exit within {within:?} of SIGTERM; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn openai_client_against_a_default_server() {
    let server = Server::start(&[]);
    server.python("Main");
    let log = server.log();
    // One line per request, with its counts and timings.
    let line = log.lines().find(|l| l.contains("endpoint=\"chat\"") && l.contains("status=200")).unwrap_or_else(|| panic!("no request line in the log:\n{log}"));
    for field in ["id=chatcmpl-", "prompt_tokens=", "completion_tokens=", "cached_tokens=", "ttft_ms=", "duration_ms="] {
        assert!(line.contains(field), "the request line lacks {field}: {line}");
    }
    assert!(log.contains("status=400"), "no 400 was logged:\n{log}");
}

#[test]
fn queue_limit_api_key_context_limit_and_draining_shutdown() {
    let mut server = Server::start(&["--max-seqs", "1", "--max-waiting", "1", "--max-model-len", "64", "--api-key", KEY, "--drain-seconds", "30"]);
    server.python("Limited");

    // A streaming request in flight when SIGTERM comes finishes before the process exits.
    let mut s = TcpStream::connect(&server.addr).expect("connect");
    let body = r#"{"prompt": "Go", "max_tokens": 12, "stream": true, "ignore_eos": true}"#;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let n = s.read(&mut first).expect("read the response head");
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&first[..n]));
    let reader = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = s.read_to_string(&mut rest);
        rest
    });
    std::thread::sleep(Duration::from_millis(100));
    let status = server.terminate(Duration::from_secs(60));
    let rest = reader.join().unwrap();
    assert!(status.success(), "the server exited with {status}; log:\n{}", server.log());
    assert!(rest.contains("data: [DONE]"), "the stream was cut by the shutdown:\n{rest}");
    assert_eq!(rest.matches("\"finish_reason\":\"length\"").count(), 1, "{rest}");
    let log = server.log();
    assert!(log.contains("shutting down: draining"), "{log}");
    assert!(log.contains("completion_tokens=12"), "the drained request's line is missing:\n{log}");
    assert!(TcpStream::connect(&server.addr).is_err(), "the port still accepts connections after the exit");
}

/// The vocab fixture with a chat template in Qwen3.5's format (tests/data/qwen35_style.jinja):
/// thinking and tools render as the model's template renders them.
fn thinking_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let src = shared("fixtures/vocab/mlx-q4");
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors", "model.safetensors.index.json"] {
        if src.join(name).exists() {
            std::fs::copy(src.join(name), dir.path().join(name)).unwrap_or_else(|e| panic!("copy {name}: {e}"));
        }
    }
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen35_style.jinja"), dir.path().join("chat_template.jinja")).expect("copy the template");
    dir
}

#[test]
fn responses_messages_and_reasoning_through_the_official_clients() {
    let model = thinking_model();
    let server = Server::start_on(model.path(), &["--served-model-name", "qwen35-style", "--served-model-name", "alias"]);
    for class in ["Chat", "Constrained", "Responses", "Messages", "Reuse"] {
        server.python_file("test_agents.py", class);
    }
    let log = server.log();
    for endpoint in ["responses", "messages", "count_tokens"] {
        assert!(log.contains(&format!("endpoint=\"{endpoint}\"")), "no {endpoint} request was logged:\n{log}");
    }
}
