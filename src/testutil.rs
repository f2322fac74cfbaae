//! Helpers shared by unit and integration tests (not part of the engine's API).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{Backend, Batch};
use crate::model::Model;
use crate::sampling::argmax;

/// `../shared/<rel>` beside the repository (`$TENSORFOLD_SHARED/<rel>` when set): the fixtures,
/// tokenizers and reference outputs every test reads.
///
/// # Panics
/// When that path does not exist, with a message naming it, so a test without its data fails
/// saying what it looked for rather than with a bare "No such file or directory" further on.
#[track_caller]
pub fn shared(rel: &str) -> PathBuf {
    let base = match std::env::var_os("TENSORFOLD_SHARED") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared"),
    };
    existing(base.join(rel))
}

/// `path`, after checking that it exists (see [`shared`]).
#[track_caller]
fn existing(path: PathBuf) -> PathBuf {
    if !path.exists() {
        panic!("test data missing: {} (the tests read the shared/ folder beside the checkout, or $TENSORFOLD_SHARED)", path.display());
    }
    path
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!("tensorfold-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fixture's `reference.safetensors` (see ../shared/fixtures/README.md).
pub struct Reference {
    /// Prompt then greedy continuation.
    pub ids: Vec<u32>,
    /// Positions whose logits are kept.
    pub positions: Vec<usize>,
    /// Vocabulary width of the logits rows.
    pub vocab: usize,
    /// mlx-lm float32 logits on `mlx-q4/`, `[positions, vocab]`.
    pub mlx_full: Vec<f32>,
    /// transformers float32 logits on `hf/`, where that layout ships.
    pub hf_full: Option<Vec<f32>>,
}

impl Reference {
    pub fn read(path: &Path) -> Self {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("reference parses");
        let f32s = |name: &str| -> Option<(Vec<f32>, Vec<usize>)> {
            let t = st.tensor(name).ok()?;
            Some((t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(), t.shape().to_vec()))
        };
        let i32s = |name: &str| -> Vec<i32> {
            let t = st.tensor(name).unwrap();
            t.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
        };
        let (mlx_full, shape) = f32s("mlx_full").expect("mlx_full");
        Self {
            ids: i32s("ids").into_iter().map(|x| x as u32).collect(),
            positions: i32s("positions").into_iter().map(|x| x as usize).collect(),
            vocab: shape[1],
            mlx_full,
            hf_full: f32s("hf_full").map(|x| x.0),
        }
    }

    /// The fixtures README's measure: max |got − want| over every kept row and vocabulary entry,
    /// divided by the standard deviation of all of `want`.
    pub fn score(got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len());
        let n = want.len() as f64;
        let mean = want.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = want.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        let max = got.iter().zip(want).map(|(&a, &b)| (a as f64 - b as f64).abs()).fold(0.0, f64::max);
        max / var.sqrt()
    }
}

/// Greedy continuation of `prompt` on one fresh sequence until `len` ids: the prompt as one chunk,
/// then one token per step, each the host [`argmax`] of the previous step's logits (kept on the
/// host so the reference comparison does not depend on a backend's own argmax).
pub fn greedy_ids<B: Backend>(model: &Model<B>, prompt: &[u32], len: usize) -> Vec<u32> {
    let mut states = model.backend.new_states(&model.config).unwrap();
    let slot = model.backend.alloc_slot(&mut states).unwrap();
    let mut scratch = model.scratch(prompt.len(), 1).unwrap();
    let mut ids = prompt.to_vec();
    let mut logits = Vec::new();
    model.step(&Batch::single(slot, 0, &ids, false), &mut states, &mut scratch).unwrap();
    while ids.len() < len {
        model.backend.read_tensor(&scratch.logits, 1, &mut logits).unwrap();
        let next = argmax(&logits);
        ids.push(next);
        let pos = ids.len() as u32 - 1;
        model.step(&Batch::single(slot, pos, &[next], false), &mut states, &mut scratch).unwrap();
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "test data missing: /nonexistent/fixtures/tiny/mlx-q4 (")]
    fn missing_test_data_is_named() {
        existing(Path::new("/nonexistent").join("fixtures/tiny/mlx-q4"));
    }

    #[test]
    fn existing_test_data_is_returned() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        assert_eq!(existing(here.clone()), here);
    }
}
