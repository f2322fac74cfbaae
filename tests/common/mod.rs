//! What the test files that run `tensorfold serve` share: the server process on a free
//! loopback port (`mod common;` in each; every file uses part of it).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// A running `tensorfold serve`; killed when dropped.
pub struct Server {
    pub child: Child,
    /// `127.0.0.1:PORT`, as it logged it.
    pub addr: String,
    /// Its stderr so far (the log lines).
    log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `tensorfold serve -m model --device cpu --port 0 EXTRA` and waits for the address
    /// it logs (a log without one within two minutes fails the test, showing the log).
    pub fn start_on(model: &Path, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfold"))
            .args(["serve", "-m"])
            .arg(model)
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
            Ok(addr) => Self { child, addr, log },
            Err(_) => {
                let _ = child.kill();
                panic!("the server did not start listening; its log:\n{}", log.lock().unwrap());
            }
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The log so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
