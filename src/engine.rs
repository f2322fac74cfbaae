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

    /// Feeds `ids` to `seq` and returns the greedy next id over ids `< v_eff` (the largest
    /// logit of the last row, smallest id on ties), sampled on the device where there is one.
    pub fn feed_greedy(&mut self, seq: &mut Sequence, ids: &[u32], v_eff: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<u32, BackendError> {
        if ids.is_empty() {
            return Err(BackendError::Batch("no tokens to feed".into()));
        }
        let (head, last) = ids.split_at(ids.len() - ((ids.len() - 1) % self.chunk + 1));
        let mut done = 0;
        for part in head.chunks(self.chunk) {
            // Earlier chunks need no logits.
            let mut batch = Batch::single(seq.slot, seq.position() as u32, part, false);
            batch.logit_rows.clear();
            self.ensure_prefill(part.len())?;
            let scratch = if part.len() == 1 { &mut self.decode } else { self.prefill.as_mut().unwrap() };
            self.model.step(&batch, &mut self.states, scratch)?;
            seq.tokens.extend_from_slice(part);
            done += part.len();
            progress(done, ids.len());
        }
        let batch = Batch::single(seq.slot, seq.position() as u32, last, false);
        self.ensure_prefill(last.len())?;
        let scratch = if last.len() == 1 { &mut self.decode } else { self.prefill.as_mut().unwrap() };
        let next = self.model.step_greedy(&batch, &mut self.states, scratch, v_eff)?;
        seq.tokens.extend_from_slice(last);
        progress(ids.len(), ids.len());
        next.first().copied().ok_or_else(|| BackendError::Batch("no id sampled".into()))
    }

    /// Allocates the prompt buffers the first time a step of more than one row runs.
    fn ensure_prefill(&mut self, rows: usize) -> Result<(), BackendError> {
        if rows > 1 && self.prefill.is_none() {
            self.prefill = Some(self.model.scratch(self.chunk, self.chunk)?);
        }
        Ok(())
    }

    /// The logits rows of the last one-token step (`[rows, V]`), read from the backend.
    pub fn decode_logits(&mut self, rows: usize) -> Result<Vec<f32>, BackendError> {
        let mut v = Vec::new();
        self.model.backend.read_tensor(&self.decode.logits, rows, &mut v)?;
        Ok(v)
    }

    /// Runs `ids` for `seq` as one eager step with [`crate::model::forward_probed`], handing
    /// every intermediate tensor to `probe(layer, op, values)` (read back to the host).
    pub fn probe_step(&mut self, seq: &mut Sequence, ids: &[u32], probe: &mut dyn FnMut(usize, &str, Vec<f32>)) -> Result<(), BackendError> {
        self.ensure_prefill(ids.len())?;
        let batch = Batch::single(seq.slot, seq.position() as u32, ids, false);
        let scratch = if ids.len() == 1 { &mut self.decode } else { self.prefill.as_mut().unwrap() };
        self.model.backend.begin_step(&mut self.states, &batch)?;
        let backend = &self.model.backend;
        let mut err = None;
        crate::model::forward_probed(&self.model, &batch, &mut self.states, scratch, &mut |l, op, t| {
            let rows = if op == "lm_head" { batch.logit_rows.len() } else { batch.rows() };
            let mut v = Vec::new();
            match backend.read_tensor(t, rows, &mut v) {
                Ok(()) => probe(l, op, v),
                Err(e) => {
                    err.get_or_insert(e);
                }
            }
        });
        self.model.backend.end_step(&mut self.states, &batch)?;
        seq.tokens.extend_from_slice(ids);
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Replaces `seq`'s state (swap in, restore).
    pub fn import(&mut self, seq: &mut Sequence, state: &crate::backend::SequenceState, tokens: &[u32]) -> Result<(), BackendError> {
        self.model.backend.import_slot(&mut self.states, seq.slot, state)?;
        seq.tokens = tokens.to_vec();
        Ok(())
    }

    /// A copy of `seq`'s state in host memory.
    pub fn export(&self, seq: &Sequence) -> Result<crate::backend::SequenceState, BackendError> {
        self.model.backend.export_slot(&self.states, seq.slot)
    }

    /// The backend's state storage (for state export and import).
    pub fn states(&mut self) -> &mut B::States {
        &mut self.states
    }
}
