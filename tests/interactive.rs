//! `chat` at a terminal (a pseudo-terminal: typing, Ctrl-C, history) and `run` stopped by SIGINT.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use expectrl::{Eof, Expect, NBytes, Regex, Session};
use tensorfold::testutil::{shared, TempDir};

#[cfg(unix)]
#[test]
fn chat_at_a_terminal_ctrl_c_stops_the_reply_history_recalls_and_two_presses_exit() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tensorfold"));
    let m = shared("fixtures/vocab/mlx-q4");
    cmd.args(["chat", "-m", m.to_str().unwrap(), "--device", "cpu", "-n", "2000", "--temp", "0"]).env("TERM", "xterm");
    let mut p = Session::spawn(cmd).expect("spawn chat in a pty");
    p.set_expect_timeout(Some(Duration::from_secs(120)));
    p.expect("> ").unwrap();
    for msg in ["hello there", "and again"] {
        p.send_line(msg).unwrap();
        // The echo of the typed line ends in a newline (after rustyline's terminal codes).
        p.expect(msg).unwrap();
        p.expect("\n").unwrap();
        // Some reply text, then Ctrl-C: the reply stops, its summary says so, the prompt returns.
        p.expect(NBytes(4)).unwrap();
        p.send("\x03").unwrap();
        p.expect("(interrupted").unwrap();
        let summary = p.expect(Regex(r"\[prompt [^\]]*\]")).unwrap();
        let summary = String::from_utf8_lossy(summary.get(0).unwrap()).into_owned();
        assert!(summary.contains("stopped by Ctrl-C"), "{summary}");
        p.expect("> ").unwrap();
    }
    // The up arrow recalls the last message.
    p.send("\x1b[A").unwrap();
    p.expect("and again").unwrap();
    // Ctrl-C twice at the prompt exits (130, as a second press always does).
    p.send("\x03").unwrap();
    p.expect("Ctrl-C again to exit").unwrap();
    p.send("\x03").unwrap();
    p.expect(Eof).unwrap();
    let status = p.get_process().wait().unwrap();
    assert_eq!(format!("{status:?}"), format!("Exited(Pid({}), 130)", p.get_process().pid()));
}

#[cfg(unix)]
#[test]
fn run_stopped_by_sigint_prints_its_summary_exits_0_and_saves_the_session() {
    let tmp = TempDir::new("sigint");
    let file = tmp.path().join("s.bin");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfold"))
        .args(["run", "--device", "cpu", "-p", "def f", "-n", "-1", "--save-session", file.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Past the echoed prompt: the first generated text.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 64];
    while seen.len() <= "def f".len() {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "run ended before generating");
        seen.extend_from_slice(&buf[..n]);
    }
    let kill = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    std::io::copy(&mut stdout, &mut std::io::sink()).unwrap();
    let o = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("stopped by Ctrl-C") && e.contains("(interrupted"), "{e}");
    assert!(e.contains(&format!("saved to {}", file.display())), "{e}");
    assert!(std::fs::metadata(&file).unwrap().len() > 0);
}
