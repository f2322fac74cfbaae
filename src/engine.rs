//! A loaded model with its state storage and step buffers: the API the program (and later the
//! server) drives. It turns "these tokens, for this sequence" into backend steps: prompts in
//! chunks of matrix-matrix products, then one token at a time.

use crate::backend::{Backend, BackendError, Batch};
use crate::model::{Model, Scratch};

/// Tokens per prompt chunk: each chunk is one step of matrix-matrix products. The logits do not
/// depend on it (docs/numerics.md: chunked prefill equals token-by-token).
pub const DEFAULT_CHUNK: usize = 256;

/// One sequence: its slot in the backend's state storage and the ids it has consumed.
#[derive(Debug)]
pub struct Sequence {
    slot: u32,
    /// Every id fed through the model, in order (the position of the next one is `len()`).
    pub tokens: Vec<u32>,
}

impl Sequence {
    /// Position of the next token.
    pub fn position(&self) -> usize {
        self.tokens.len()
    }
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

/// A model, the state of its sequences and the buffers of its steps.
pub struct Engine<B: Backend> {
    pub model: Model<B>,
    states: B::States,
    chunk: usize,
    prefill: Option<Scratch<B>>,
    decode: Scratch<B>,
    logits: Vec<f32>,
}

impl<B: Backend> Engine<B> {
    /// An engine whose prompt steps hold up to `chunk` tokens.
    pub fn new(model: Model<B>, chunk: usize) -> Result<Self, BackendError> {
        let states = model.backend.new_states(&model.config)?;
        let decode = model.scratch(1, 1)?;
        Ok(Self { model, states, chunk: chunk.max(1), prefill: None, decode, logits: Vec::new() })
    }

    /// Vocabulary width of a logits row.
    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// A new, empty sequence.
    pub fn new_sequence(&mut self) -> Result<Sequence, BackendError> {
        Ok(Sequence { slot: self.model.backend.alloc_slot(&mut self.states)?, tokens: Vec::new() })
    }

    /// Frees a sequence's state.
    pub fn free_sequence(&mut self, seq: Sequence) -> Result<(), BackendError> {
        self.model.backend.free_slot(&mut self.states, seq.slot)
    }

    /// Feeds `ids` to `seq` in chunks. Returns the logits of the last id (`[V]`), or of every id
    /// (`[ids.len(), V]`) when `all_logits`. `progress(done, total)` is called after each chunk.
    pub fn feed(&mut self, seq: &mut Sequence, ids: &[u32], all_logits: bool, progress: &mut dyn FnMut(usize, usize)) -> Result<&[f32], BackendError> {
        if ids.is_empty() {
            return Err(BackendError::Batch("no tokens to feed".into()));
        }
        let v = self.vocab_size();
        let mut out = Vec::with_capacity(if all_logits { ids.len() * v } else { v });
        let mut done = 0;
        for part in ids.chunks(self.chunk) {
            let last_part = done + part.len() == ids.len();
            let batch = Batch::single(seq.slot, seq.position() as u32, part, all_logits);
            let want = batch.logit_rows.len();
            let scratch = if part.len() == 1 {
                &mut self.decode
            } else {
                if self.prefill.is_none() {
                    self.prefill = Some(self.model.scratch(self.chunk, self.chunk)?);
                }
                self.prefill.as_mut().unwrap()
            };
            self.model.step(&batch, &mut self.states, scratch)?;
            seq.tokens.extend_from_slice(part);
            if all_logits || last_part {
                self.model.backend.read_tensor(&scratch.logits, want, &mut self.logits)?;
                out.extend_from_slice(&self.logits);
            }
            done += part.len();
            progress(done, ids.len());
        }
        self.logits = out;
        Ok(&self.logits)
    }
}
