//! Models by name: `ORG/NAME` (or `ORG/NAME@REVISION`) resolved in the Hugging Face cache as the
//! Hub's own clients lay it out, downloaded into it through `hf-hub` when missing.
//!
//! The cache (`huggingface_hub`'s layout, which `hf-hub` writes too):
//! `<cache>/models--ORG--NAME/refs/<revision>` holds a commit hash,
//! `snapshots/<commit>/` holds the repo's files, usually symlinks into `blobs/`. The cache is
//! `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`. A revision that is a 40-hex commit hash names its snapshot
//! directly; any other (a branch or tag) is looked up in `refs/`. A snapshot counts as cached when
//! its `config.json` and every weight file (those of `model.safetensors.index.json`, else at least
//! one `*.safetensors`) are there, following symlinks, so a half-finished download is not taken
//! for a model. `HF_HUB_OFFLINE=1` (or `true`/`yes`/`on`) means the network is never touched.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

/// Why a repo id could not be turned into a model directory. Every variant names the repo and
/// the cache path.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{repo}@{revision} is not in the Hugging Face cache ({path}: {reason}), and HF_HUB_OFFLINE is set, so it was not downloaded")]
    NotCached { repo: String, revision: String, path: PathBuf, reason: String },
    #[error("downloading {repo}@{revision} into {cache}: {source}")]
    Download {
        repo: String,
        revision: String,
        cache: PathBuf,
        #[source]
        source: Box<ApiError>,
    },
    #[error("{repo}@{revision} was downloaded into {cache}, but {reason}")]
    Incomplete { repo: String, revision: String, cache: PathBuf, reason: String },
}

/// A model repo on the Hub and the revision wanted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoSpec {
    /// `ORG/NAME`.
    pub repo_id: String,
    /// A branch, tag or commit hash (`main` unless `@REV` was given).
    pub revision: String,
}

impl RepoSpec {
    /// Parses `ORG/NAME` or `ORG/NAME@REV`; `None` when `s` does not look like a repo id (the Hub's
    /// rules: each part of letters, digits, `-`, `_`, `.`, not starting or ending with `-` or
    /// `.`, no `--` or `..`, at most 96 characters).
    pub fn parse(s: &str) -> Option<Self> {
        let (id, revision) = match s.split_once('@') {
            Some((id, rev)) if !rev.is_empty() && !rev.chars().any(char::is_whitespace) => (id, rev),
            Some(_) => return None,
            None => (s, "main"),
        };
        let (org, name) = id.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && !p.starts_with(['-', '.'])
                && !p.ends_with(['-', '.'])
                && !p.contains("--")
                && !p.contains("..")
        };
        (id.len() <= 96 && part_ok(org) && part_ok(name)).then(|| Self { repo_id: id.to_string(), revision: revision.to_string() })
    }

    /// `models--ORG--NAME`, the repo's folder in the cache.
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.repo_id.replace('/', "--"))
    }

    fn is_commit(&self) -> bool {
        self.revision.len() == 40 && self.revision.bytes().all(|b| b.is_ascii_hexdigit())
    }
}

/// Where the cache is and whether the network may be used.
#[derive(Clone, Debug)]
pub struct HubOptions {
    /// The hub cache directory (holding `models--*` folders).
    pub cache_dir: PathBuf,
    /// Never touch the network (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// Show download progress bars.
    pub progress: bool,
    /// The Hub's address (`HF_ENDPOINT`), when not the default.
    pub endpoint: Option<String>,
    /// An access token (`HF_TOKEN`); else `hf-hub` reads the token file beside the cache.
    pub token: Option<String>,
}

impl HubOptions {
    /// From the environment, as `huggingface_hub` reads it (module docs).
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let cache_dir = var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|x| x.join("huggingface").join("hub")))
            .or_else(|| var("HOME").or_else(|| var("USERPROFILE")).map(|h| h.join(".cache").join("huggingface").join("hub")))
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| matches!(v.trim().to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE"));
        let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let nonempty = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self { cache_dir, offline, progress, endpoint: nonempty("HF_ENDPOINT"), token: nonempty("HF_TOKEN") }
    }
}

/// The snapshot directory of `spec` in the cache, or why it is not (fully) there.
pub fn cached_snapshot(spec: &RepoSpec, cache_dir: &Path) -> Result<PathBuf, (PathBuf, String)> {
    let repo_dir = cache_dir.join(spec.folder_name());
    let commit = if spec.is_commit() {
        spec.revision.clone()
    } else {
        let r = repo_dir.join("refs").join(&spec.revision);
        match std::fs::read_to_string(&r) {
            Ok(s) => s.trim().to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err((r, "no such ref: the repo (or this revision) was never downloaded".into())),
            Err(e) => return Err((r, e.to_string())),
        }
    };
    let snap = repo_dir.join("snapshots").join(&commit);
    if !snap.is_dir() {
        return Err((snap, format!("refs/{} names commit {commit}, whose snapshot directory is missing", spec.revision)));
    }
    // `is_file` follows symlinks: a link into a missing blob counts as missing.
    let missing = |f: &str| -> Option<(PathBuf, String)> { (!snap.join(f).is_file()).then(|| (snap.join(f), format!("{f} is missing from the snapshot (or its blob is)"))) };
    if let Some(m) = missing("config.json") {
        return Err(m);
    }
    let index = snap.join("model.safetensors.index.json");
    if index.is_file() {
        let v: serde_json::Value = std::fs::read(&index).ok().and_then(|b| serde_json::from_slice(&b).ok()).ok_or_else(|| (index.clone(), "is not readable JSON".to_string()))?;
        let shards: std::collections::BTreeSet<&str> = v.get("weight_map").and_then(|m| m.as_object()).into_iter().flat_map(|m| m.values().filter_map(|f| f.as_str())).collect();
        for s in shards {
            if let Some(m) = missing(s) {
                return Err(m);
            }
        }
    } else {
        let any = std::fs::read_dir(&snap)
            .map_err(|e| (snap.clone(), e.to_string()))?
            .filter_map(Result::ok)
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors") && e.path().is_file());
        if !any {
            return Err((snap, "the snapshot holds no *.safetensors file".into()));
        }
    }
    Ok(snap)
}

/// Files of a repo a text model needs (mlx-lm's `allow_patterns`, top level only): configs,
/// weights, tokenizer and template files.
fn wanted(file: &str) -> bool {
    !file.contains('/')
        && (file.ends_with(".json")
            || file.ends_with(".jinja")
            || file.ends_with(".txt")
            || file.ends_with(".tiktoken")
            || file == "tokenizer.model"
            || (file.starts_with("model") && file.ends_with(".safetensors")))
}

/// The local directory of `spec`: its cached snapshot, else (unless offline) downloaded into the
/// cache first.
///
/// # Errors
/// [`HubError::NotCached`] when offline and the snapshot is missing or incomplete (naming the
/// path looked at and why); [`HubError::Download`] when the Hub cannot be reached or refuses;
/// [`HubError::Incomplete`] when the repo lacks a `config.json` or the download left a gap.
pub fn resolve(spec: &RepoSpec, opts: &HubOptions) -> Result<PathBuf, HubError> {
    let (path, reason) = match cached_snapshot(spec, &opts.cache_dir) {
        Ok(dir) => return Ok(dir),
        Err(why) => why,
    };
    if opts.offline {
        return Err(HubError::NotCached { repo: spec.repo_id.clone(), revision: spec.revision.clone(), path, reason });
    }
    download(spec, opts)
}

fn download(spec: &RepoSpec, opts: &HubOptions) -> Result<PathBuf, HubError> {
    let fail = |e: ApiError| HubError::Download { repo: spec.repo_id.clone(), revision: spec.revision.clone(), cache: opts.cache_dir.clone(), source: Box::new(e) };
    let mut builder = ApiBuilder::from_cache(Cache::new(opts.cache_dir.clone())).with_progress(opts.progress);
    if let Some(e) = &opts.endpoint {
        builder = builder.with_endpoint(e.clone());
    }
    if opts.token.is_some() {
        builder = builder.with_token(opts.token.clone());
    }
    let api = builder.build().map_err(fail)?;
    let repo = api.repo(Repo::with_revision(spec.repo_id.clone(), RepoType::Model, spec.revision.clone()));
    let info = repo.info().map_err(fail)?;
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).filter(|f| wanted(f)).collect();
    let incomplete = |reason: String| HubError::Incomplete { repo: spec.repo_id.clone(), revision: spec.revision.clone(), cache: opts.cache_dir.clone(), reason };
    if !files.contains(&"config.json") {
        return Err(incomplete("the repo has no config.json".into()));
    }
    for f in files {
        // `get` takes a file already in the snapshot, so an interrupted download resumes.
        repo.get(f).map_err(fail)?;
    }
    cached_snapshot(spec, &opts.cache_dir).map_err(|(p, why)| incomplete(format!("{}: {why}", p.display())))
}

#[cfg(all(test, unix))] // the Hub's cache links snapshots to blobs with symlinks
mod tests {
    use super::*;
    use crate::testutil::{shared, TempDir};
    use std::fs;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    /// Lays `files` out as the Hub's clients do: each file's bytes as a blob named by a hash,
    /// a relative symlink to it in `snapshots/<commit>/`, and `refs/<branch>` naming the commit.
    fn cache_repo(cache: &Path, repo: &str, branch: &str, commit: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
        let root = cache.join(format!("models--{}", repo.replace('/', "--")));
        let snap = root.join("snapshots").join(commit);
        fs::create_dir_all(root.join("blobs")).unwrap();
        fs::create_dir_all(&snap).unwrap();
        fs::create_dir_all(root.join("refs")).unwrap();
        fs::write(root.join("refs").join(branch), commit).unwrap();
        for (i, (name, bytes)) in files.iter().enumerate() {
            let blob = format!("{:064x}", xxhash_rust::xxh3::xxh3_64(bytes) as u128 + i as u128);
            fs::write(root.join("blobs").join(&blob), bytes).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(name)).unwrap();
        }
        snap
    }

    fn tiny_hf_files() -> Vec<(&'static str, Vec<u8>)> {
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
            .into_iter()
            .map(|f| (f, fs::read(shared(&format!("fixtures/tiny/hf/{f}"))).unwrap()))
            .collect()
    }

    fn offline(cache: &Path) -> HubOptions {
        HubOptions { cache_dir: cache.to_path_buf(), offline: true, progress: false, endpoint: None, token: None }
    }

    #[test]
    fn repo_ids_parse_as_the_hub_spells_them() {
        assert_eq!(RepoSpec::parse("Qwen/Qwen3.5-0.8B"), Some(RepoSpec { repo_id: "Qwen/Qwen3.5-0.8B".into(), revision: "main".into() }));
        assert_eq!(RepoSpec::parse("mlx-community/Qwen3.5-0.8B-4bit@v1.0").map(|s| s.revision), Some("v1.0".into()));
        assert_eq!(RepoSpec::parse("mlx-community/Qwen3.5-0.8B-4bit").unwrap().folder_name(), "models--mlx-community--Qwen3.5-0.8B-4bit");
        for not_an_id in ["models", "a/b/c", "./x", "../x/y", "/abs/path", "org/-x", "org/x.", "org/a--b", "org/a@", "org/a b", "org/"] {
            assert_eq!(RepoSpec::parse(not_an_id), None, "{not_an_id}");
        }
    }

    #[test]
    fn a_cached_snapshot_resolves_offline_and_loads() {
        let tmp = TempDir::new("hub-cached");
        let snap = cache_repo(tmp.path(), "Qwen/Qwen3.5-0.8B", "main", COMMIT, &tiny_hf_files());
        let spec = RepoSpec::parse("Qwen/Qwen3.5-0.8B").unwrap();
        let dir = resolve(&spec, &offline(tmp.path())).unwrap();
        assert_eq!(dir, snap);
        // The snapshot is a model directory through its symlinks.
        let host = crate::model::HostModel::open(&dir).unwrap();
        assert_eq!(host.config.hidden_size, 256);
        // A commit hash names the snapshot without refs/.
        let by_commit = RepoSpec::parse(&format!("Qwen/Qwen3.5-0.8B@{COMMIT}")).unwrap();
        assert_eq!(resolve(&by_commit, &offline(tmp.path())).unwrap(), snap);
    }

    #[test]
    fn a_revision_other_than_main_reads_its_own_ref() {
        let tmp = TempDir::new("hub-rev");
        let other = "fedcba9876543210fedcba9876543210fedcba98";
        cache_repo(tmp.path(), "Qwen/Qwen3.5-0.8B", "main", COMMIT, &tiny_hf_files());
        let v2 = cache_repo(tmp.path(), "Qwen/Qwen3.5-0.8B", "v2", other, &tiny_hf_files());
        let spec = RepoSpec::parse("Qwen/Qwen3.5-0.8B@v2").unwrap();
        assert_eq!(resolve(&spec, &offline(tmp.path())).unwrap(), v2);
        let missing = RepoSpec::parse("Qwen/Qwen3.5-0.8B@v3").unwrap();
        let e = resolve(&missing, &offline(tmp.path())).unwrap_err().to_string();
        assert!(e.contains("Qwen/Qwen3.5-0.8B@v3") && e.contains("refs/v3") && e.contains("HF_HUB_OFFLINE"), "{e}");
    }

    #[test]
    fn offline_errors_name_the_repo_and_the_path_looked_in() {
        let tmp = TempDir::new("hub-missing");
        let spec = RepoSpec::parse("mlx-community/Qwen3.5-0.8B-4bit").unwrap();
        let e = resolve(&spec, &offline(tmp.path())).unwrap_err();
        let want_ref = tmp.path().join("models--mlx-community--Qwen3.5-0.8B-4bit/refs/main");
        assert!(matches!(&e, HubError::NotCached { path, .. } if *path == want_ref), "{e}");
        let text = e.to_string();
        assert!(text.contains("mlx-community/Qwen3.5-0.8B-4bit@main") && text.contains(&want_ref.display().to_string()), "{text}");

        // refs/main names a commit whose snapshot is gone.
        let snap = cache_repo(tmp.path(), "Qwen/Qwen3.5-0.8B", "main", COMMIT, &tiny_hf_files());
        fs::remove_dir_all(&snap).unwrap();
        let spec = RepoSpec::parse("Qwen/Qwen3.5-0.8B").unwrap();
        let text = resolve(&spec, &offline(tmp.path())).unwrap_err().to_string();
        assert!(text.contains(COMMIT) && text.contains("snapshot directory is missing"), "{text}");
    }

    #[test]
    fn an_incomplete_snapshot_is_not_taken_for_a_model() {
        let tmp = TempDir::new("hub-partial");
        let spec = RepoSpec::parse("Qwen/Qwen3.5-0.8B").unwrap();
        // Only the config was fetched (as a tool that reads configs leaves it).
        cache_repo(tmp.path(), "Qwen/Qwen3.5-0.8B", "main", COMMIT, &tiny_hf_files()[..1]);
        let text = resolve(&spec, &offline(tmp.path())).unwrap_err().to_string();
        assert!(text.contains("no *.safetensors"), "{text}");
        // A shard the index names whose blob is missing (a dangling symlink).
        let tmp = TempDir::new("hub-dangling");
        let mut files = tiny_hf_files();
        files.push(("model.safetensors.index.json", br#"{"weight_map": {"a": "model.safetensors"}}"#.to_vec()));
        let snap = cache_repo(tmp.path(), "Qwen/Qwen3.5-0.8B", "main", COMMIT, &files);
        fs::remove_file(fs::canonicalize(snap.join("model.safetensors")).unwrap()).unwrap();
        let e = resolve(&spec, &offline(tmp.path())).unwrap_err();
        assert!(matches!(&e, HubError::NotCached { path, .. } if *path == snap.join("model.safetensors")), "{e}");
    }

    #[test]
    fn wanted_files_are_what_mlx_lm_downloads() {
        for f in ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "chat_template.jinja", "merges.txt"] {
            assert!(wanted(f), "{f}");
        }
        for f in ["README.md", ".gitattributes", "onnx/model.onnx", "original/consolidated.safetensors", "pytorch_model.bin"] {
            assert!(!wanted(f), "{f}");
        }
    }
}
