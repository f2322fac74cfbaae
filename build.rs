//! Records the commit the binary is built from, for `tensorfold bench` to print: a figure must
//! name the code that produced it wherever the binary runs (a GPU machine's copy of the
//! repository may carry a stale `.git`).

use std::path::Path;
use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TENSORFOLD_GIT_COMMIT={commit}");
    // Again when a commit is made or checked out, or a source changes (dirty or not).
    for p in [".git/HEAD", ".git/index", "src"] {
        if Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    if let Ok(head) = std::fs::read_to_string(".git/HEAD") {
        if let Some(r) = head.strip_prefix("ref: ") {
            println!("cargo:rerun-if-changed=.git/{}", r.trim());
        }
    }
}
