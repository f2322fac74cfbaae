//! The chat page of `tensorfold serve` (`/`, src/serve/web/) as a person uses it: a real headless
//! Chromium (Debian's `chromium`), driven by playwright-core (tests/web/chat.test.mjs, run by
//! node's test runner), against the built binary on the vocab fixture: a default server, and one
//! with `--api-key` and a 64-token context. `.ci/run` installs chromium, runs `npm ci` in
//! tests/web and sets TENSORFOLD_REQUIRE_BROWSER=1, so there a missing browser fails the test;
//! elsewhere it is skipped with the reason printed.
//!
//! `TENSORFOLD_SCREENSHOTS=docs cargo test --release --test web` also writes the README's
//! screenshots (docs/webchat-wide.png, docs/webchat-narrow.png).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use tensorfold::testutil::shared;

const KEY: &str = "web-test-key-41c9";

/// A running server; killed when dropped.
struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `tensorfold serve` on the vocab fixture on a free port and waits for its address.
    fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfold"))
            .args(["serve", "-m"])
            .arg(shared("fixtures/vocab/mlx-q4"))
            .args(["--device", "cpu", "--port", "0"])
            .args(extra)
            .env("RUST_LOG", "tensorfold=info")
            .env_remove("TENSORFOLD_API_KEY")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start tensorfold serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let l = log.clone();
        // Reads stderr to its end (so the pipe never fills), sending the address once logged.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                }
                let mut g = l.lock().unwrap();
                g.push_str(&line);
                g.push('\n');
            }
        });
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(addr) => Self { child, base: format!("http://{addr}"), log },
            Err(_) => {
                let _ = child.kill();
                panic!("the server did not start listening; its log:\n{}", log.lock().unwrap());
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

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
    let open = Server::start(&[]);
    let limited = Server::start(&["--api-key", KEY, "--max-model-len", "64"]);
    let mut cmd = Command::new("node");
    cmd.current_dir(&dir)
        .args(["--test", "--test-reporter=spec", "chat.test.mjs"])
        .env("TF_BASE", &open.base)
        .env("TF_LIMITED_BASE", &limited.base)
        .env("TF_KEY", KEY)
        .env("TF_CHROMIUM", &chromium)
        .env_remove("TF_WEB_DIR");
    if let Some(shots) = std::env::var_os("TENSORFOLD_SCREENSHOTS") {
        cmd.env("TF_SHOTS", Path::new(env!("CARGO_MANIFEST_DIR")).join(shots));
    }
    let out = cmd.output().expect("run node");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    let logs = || format!("default server's log:\n{}\nkeyed server's log:\n{}", open.log.lock().unwrap(), limited.log.lock().unwrap());
    assert!(out.status.success(), "the browser tests failed:\n{text}\n{}", logs());
    // node's runner prints its totals; a file that ran nothing must not pass.
    let passed = text.lines().find_map(|l| l.trim_start_matches(['ℹ', ' ']).strip_prefix("pass ")).and_then(|n| n.trim().parse::<u32>().ok());
    assert!(passed.is_some_and(|n| n >= 7), "fewer browser tests passed than written:\n{text}");
}
