//! A checkpoint directory on disk: memory-mapped safetensors shards and the index of their
//! tensors.
//!
//! This layer knows files and bytes, not the model: it maps every shard (one file, or the
//! shards listed in `model.safetensors.index.json`), checks that each header is well formed and
//! covers its file exactly (a truncated download is an error here), and hands out zero-copy
//! views. `crate::model::weights` gives the tensors their meaning.
//!
//! Safetensors files written by MLX are not 8-byte aligned (rust-notes.md §3): nothing here
//! casts bytes to wider types; readers decode little-endian values from byte slices.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
pub use safetensors::Dtype;

/// A problem with the files of a checkpoint. Every variant names the file (and tensor).
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{dir}: not a directory (pass a model directory holding config.json and *.safetensors)")]
    NotADirectory { dir: PathBuf },
    #[error("{dir}: no *.safetensors files and no model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a valid safetensors file ({reason}); the file may be truncated or corrupt")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Index { path: PathBuf, reason: String },
    #[error("tensor `{name}` appears in both {first} and {second}")]
    Duplicate { name: String, first: PathBuf, second: PathBuf },
}

/// A byte range of a memory-mapped file (or of an owned buffer), cheap to clone: the storage
/// is reference counted and stays alive while any view does.
#[derive(Clone)]
pub struct Bytes {
    store: Store,
    range: Range<usize>,
}

#[derive(Clone)]
enum Store {
    Map(Arc<Mmap>),
    Owned(Arc<[u8]>),
}

impl Bytes {
    /// Bytes held in memory rather than mapped (tests, generated weights).
    pub fn from_vec(v: Vec<u8>) -> Self {
        let n = v.len();
        Self { store: Store::Owned(v.into()), range: 0..n }
    }

    /// The bytes themselves (any alignment).
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match &self.store {
            Store::Map(m) => &m[self.range.clone()],
            Store::Owned(v) => &v[self.range.clone()],
        }
    }
    pub fn len(&self) -> usize {
        self.range.len()
    }
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Bytes `r` of these bytes (relative to their start), sharing the same storage: one
    /// expert's rows of a stacked 3-D tensor.
    ///
    /// # Panics
    /// If `r` reaches past the end (callers slice whole rows of a tensor whose size they checked).
    pub fn slice(&self, r: Range<usize>) -> Self {
        assert!(r.start <= r.end && r.end <= self.range.len(), "Bytes::slice {r:?} of {} bytes", self.range.len());
        Self { store: self.store.clone(), range: self.range.start + r.start..self.range.start + r.end }
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({}..{})", self.range.start, self.range.end)
    }
}

/// Where one tensor lives and what its header says.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub name: String,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    range: Range<usize>,
}

/// The mapped shards of a checkpoint directory and the tensors they hold.
pub struct Checkpoint {
    pub dir: PathBuf,
    files: Vec<(PathBuf, Arc<Mmap>)>,
    tensors: BTreeMap<String, TensorEntry>,
}

impl Checkpoint {
    /// Maps the safetensors files of `dir`: those named by `model.safetensors.index.json` when it
    /// exists, else every `*.safetensors` in the directory.
    ///
    /// # Errors
    /// Missing directory or files, unreadable files, headers that do not parse or do not cover
    /// their file exactly (truncation), tensor names repeated across shards.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        if !dir.is_dir() {
            return Err(CheckpointError::NotADirectory { dir: dir.to_path_buf() });
        }
        let index_path = dir.join("model.safetensors.index.json");
        let mut names: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read(&index_path).map_err(|source| CheckpointError::Open { path: index_path.clone(), source })?;
            let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| CheckpointError::Index { path: index_path.clone(), reason: format!("not valid JSON: {e}") })?;
            let map =
                v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| CheckpointError::Index { path: index_path.clone(), reason: "has no `weight_map` object".into() })?;
            let mut files: Vec<PathBuf> = Vec::new();
            for (tensor, file) in map {
                let file =
                    file.as_str().ok_or_else(|| CheckpointError::Index { path: index_path.clone(), reason: format!("weight_map entry for `{tensor}` is not a file name") })?;
                // Shard names are plain file names inside the directory.
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(CheckpointError::Index { path: index_path.clone(), reason: format!("shard name `{file}` is not a plain file name") });
                }
                let p = dir.join(file);
                if !files.contains(&p) {
                    files.push(p);
                }
            }
            files
        } else {
            let rd = std::fs::read_dir(dir).map_err(|source| CheckpointError::Open { path: dir.to_path_buf(), source })?;
            rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "safetensors")).collect()
        };
        names.sort();
        if names.is_empty() {
            return Err(CheckpointError::NoWeights { dir: dir.to_path_buf() });
        }

        let mut files = Vec::with_capacity(names.len());
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        for (fi, path) in names.into_iter().enumerate() {
            let f = File::open(&path).map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            // SAFETY: the map is read-only; a checkpoint modified while mapped is outside what any
            // inference engine can defend against (llama.cpp and safetensors' own loaders map too).
            let map = unsafe { Mmap::map(&f) }.map_err(|source| CheckpointError::Open { path: path.clone(), source })?;
            let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| CheckpointError::Corrupt { path: path.clone(), reason: e.to_string() })?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                let entry = TensorEntry { name: name.clone(), file: fi, dtype: info.dtype, shape: info.shape.clone(), range: data_start + a..data_start + b };
                if let Some(prev) = tensors.insert(name.clone(), entry) {
                    return Err(CheckpointError::Duplicate { name, first: files_path(&files, prev.file), second: path.clone() });
                }
            }
            files.push((path, Arc::new(map)));
        }
        Ok(Self { dir: dir.to_path_buf(), files, tensors })
    }

    /// The header entry of tensor `name`, if any shard has it.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// Every tensor, by name.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        self.tensors.values()
    }

    /// Path of the shard holding `t`.
    pub fn path_of(&self, t: &TensorEntry) -> &Path {
        &self.files[t.file].0
    }

    /// Zero-copy view of the bytes of `t`.
    pub fn bytes(&self, t: &TensorEntry) -> Bytes {
        Bytes { store: Store::Map(self.files[t.file].1.clone()), range: t.range.clone() }
    }

    /// Every shard, in the order tensors refer to them (sorted by file name), with its whole
    /// mapped contents: the safetensors header followed by the tensor bytes it covers.
    pub fn shards(&self) -> impl Iterator<Item = (&Path, &[u8])> {
        self.files.iter().map(|(p, m)| (p.as_path(), &m[..]))
    }

    /// Total bytes of all shards on disk.
    pub fn file_bytes(&self) -> u64 {
        self.files.iter().map(|(_, m)| m.len() as u64).sum()
    }
}

fn files_path(files: &[(PathBuf, Arc<Mmap>)], i: usize) -> PathBuf {
    files.get(i).map(|f| f.0.clone()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{shared, TempDir};

    #[test]
    fn maps_the_mlx_fixture() {
        let c = Checkpoint::open(&shared("fixtures/tiny/mlx-q4")).unwrap();
        let t = c.get("language_model.model.embed_tokens.weight").unwrap();
        assert_eq!(t.dtype, Dtype::U32);
        assert_eq!(t.shape, vec![2048, 32]);
        assert_eq!(c.bytes(t).len(), 2048 * 32 * 4);
    }

    #[test]
    fn truncated_file_is_named() {
        let tmp = TempDir::new("ckpt-trunc");
        let src = std::fs::read(shared("fixtures/tiny/mlx-q4/model.safetensors")).unwrap();
        std::fs::write(tmp.path().join("model.safetensors"), &src[..src.len() - 100]).unwrap();
        let err = Checkpoint::open(tmp.path()).err().unwrap().to_string();
        assert!(err.contains("model.safetensors") && err.contains("truncated"), "{err}");
    }

    #[test]
    fn empty_directory_is_an_error() {
        let tmp = TempDir::new("ckpt-empty");
        let err = Checkpoint::open(tmp.path()).err().unwrap().to_string();
        assert!(err.contains("no *.safetensors"), "{err}");
        let err = Checkpoint::open(&tmp.path().join("nope")).err().unwrap().to_string();
        assert!(err.contains("not a directory"), "{err}");
    }

    #[test]
    fn garbage_header_is_named() {
        let tmp = TempDir::new("ckpt-garbage");
        let mut bytes = 20u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{not json at all!!!}");
        std::fs::write(tmp.path().join("x.safetensors"), &bytes).unwrap();
        let err = Checkpoint::open(tmp.path()).err().unwrap().to_string();
        assert!(err.contains("x.safetensors") && err.contains("not a valid safetensors"), "{err}");
    }
}
