//! Records the commit the binary is built from, for `tensorfold bench` to print: a figure must
//! name the code that produced it wherever the binary runs (a GPU machine's copy of the
//! repository may carry a stale `.git`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TENSORFOLD_GIT_COMMIT={commit}");
    // Again when a commit is made or checked out, or a source changes (dirty or not).
    println!("cargo:rerun-if-changed=src");
    for p in git_state_files(&root) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}

/// The files whose change means another commit is checked out or the index changed: HEAD, the
/// branch it names (its own file, or else `packed-refs` and HEAD's reflog) and the index.
/// Only files that exist: cargo reruns the script on every build while a named file is missing.
///
/// `.git` is looked for at or above the package, as git does. In a clone it is the git
/// directory. In a linked worktree (`git worktree add`) or a submodule it is a file `gitdir:
/// PATH`: HEAD and the index are in PATH, and a worktree's PATH holds a `commondir` file naming
/// the directory with the branches and `packed-refs`.
fn git_state_files(root: &Path) -> Vec<PathBuf> {
    let Some(top) = root.ancestors().find(|d| d.join(".git").exists()) else { return Vec::new() };
    let dot_git = top.join(".git");
    let git_dir = if dot_git.is_dir() {
        dot_git
    } else {
        let Ok(text) = fs::read_to_string(&dot_git) else { return Vec::new() };
        let Some(path) = text.lines().next().and_then(|l| l.strip_prefix("gitdir:")) else { return Vec::new() };
        // Relative to the directory holding `.git`; `join` keeps an absolute path as it is.
        top.join(path.trim())
    };
    let git_dir = fs::canonicalize(&git_dir).unwrap_or(git_dir);
    let common = match fs::read_to_string(git_dir.join("commondir")) {
        Ok(dir) => git_dir.join(dir.trim()),
        Err(_) => git_dir.clone(),
    };
    let common = fs::canonicalize(&common).unwrap_or(common);
    let mut files = vec![git_dir.join("HEAD"), git_dir.join("index")];
    // Follow HEAD's symbolic refs (`ref: refs/heads/NAME`) to the file that holds the commit.
    // A ref is a file of its own in the worktree's git directory (per-worktree refs) or in the
    // common one, or else a line of the common `packed-refs`.
    let mut at = git_dir.join("HEAD");
    for _ in 0..5 {
        let Some(name) = fs::read_to_string(&at).ok().and_then(|t| t.strip_prefix("ref:").map(|r| r.trim().to_string())) else { break };
        match [&git_dir, &common].into_iter().map(|d| d.join(&name)).find(|p| p.is_file()) {
            Some(loose) => {
                files.push(loose.clone());
                at = loose;
            }
            None => {
                // A commit will write the loose file, which cargo cannot watch before it exists
                // (a missing file reruns the script on every build): HEAD's reflog, appended
                // whenever HEAD or its branch moves, stands in for it.
                files.extend([common.join("packed-refs"), git_dir.join("logs").join("HEAD")]);
                break;
            }
        }
    }
    // The reftable format (`extensions.refStorage = reftable`) keeps every ref in tables listed
    // here, rewritten on each update.
    files.extend([&git_dir, &common].map(|d| d.join("reftable").join("tables.list")));
    files.sort();
    files.dedup();
    files.retain(|p| p.is_file());
    files
}
