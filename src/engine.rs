//! A loaded model with its state storage and step buffers: the API the program (and later the
//! server) drives. It turns "these tokens, for this session" into backend steps: prompts in
//! chunks of matrix-matrix products, then one token at a time; and it moves sessions' states
//! between the backend and host memory (swap, fork, save, load, snapshots).
//!
//! Everything here goes through the [`Backend`] trait's slot methods (`alloc_slot`,
//! `free_slot`, `export_slot`, `import_slot`), so every backend gets sessions.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, Batch, SeqRows, SequenceState};
use crate::model::{Model, Scratch};
use crate::sampling::SamplingParams;
use crate::session::{self, Displaced, ModelIdentity, PrefixCache, Residence, Reuse, Session, SessionError, SessionRecord, SnapshotConfig, SnapshotHome};

/// Tokens per prompt chunk: each chunk is one step of matrix-matrix products. The logits do not
/// depend on it (docs/numerics.md: chunked prefill equals token-by-token).
pub const DEFAULT_CHUNK: usize = 256;

/// A model, the state of its sessions, the buffers of its steps and the snapshots of states.
pub struct Engine<B: Backend> {
    pub model: Model<B>,
    states: B::States,
    chunk: usize,
    prefill: Option<Scratch<B>>,
    decode: Scratch<B>,
    /// Buffers of decode-shaped steps of several sessions (`batch_capacity` rows).
    batch_decode: Option<Scratch<B>>,
    batch_capacity: usize,
    logits: Vec<f32>,
    /// The buffer of the next [`Chosen::Logits`], handed back by [`Engine::recycle`]: a step's
    /// `[k, V]` host logits (16 MiB for 16 rows of Qwen3.5's vocabulary) are not allocated anew
    /// each step.
    spare_logits: Vec<f32>,
    snapshots: PrefixCache,
    snapshot_time: Duration,
    /// Where the model's files are, for its identity in session files.
    model_dir: Option<PathBuf>,
    identity: OnceLock<ModelIdentity>,
}

impl<B: Backend> Engine<B> {
    /// An engine whose prompt steps hold up to `chunk` tokens, with snapshots off
    /// ([`Engine::set_snapshots`] turns them on).
    pub fn new(model: Model<B>, chunk: usize) -> Result<Self, BackendError> {
        let states = model.backend.new_states(&model.config)?;
        let decode = model.scratch(1, 1)?;
        let chunk = chunk.clamp(1, model.backend.max_rows());
        Ok(Self {
            model,
            states,
            chunk,
            prefill: None,
            decode,
            batch_decode: None,
            batch_capacity: 1,
            logits: Vec::new(),
            spare_logits: Vec::new(),
            snapshots: PrefixCache::new(SnapshotConfig::disabled()),
            snapshot_time: Duration::ZERO,
            model_dir: None,
            identity: OnceLock::new(),
        })
    }

    /// Names the directory the model was loaded from, whose files give its identity in session
    /// files ([`ModelIdentity::of_dir`], computed on the first save or load).
    pub fn with_model_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.model_dir = Some(dir.into());
        self.identity = OnceLock::new();
        self
    }

    /// The model's identity, hashed once per engine on first use.
    ///
    /// # Errors
    /// [`SessionError::Identity`] when no model directory was given or its files cannot be read.
    pub fn identity(&self) -> Result<ModelIdentity, SessionError> {
        if let Some(id) = self.identity.get() {
            return Ok(*id);
        }
        let dir = self.model_dir.as_ref().ok_or_else(|| SessionError::Identity("the engine was built without its model directory (Engine::with_model_dir)".into()))?;
        let id = ModelIdentity::of_dir(dir)?;
        Ok(*self.identity.get_or_init(|| id))
    }

    /// Vocabulary width of a logits row.
    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Checks every id is a row of the embedding: a backend's `embed` indexes the table with it
    /// (an id past it would panic on the CPU and read foreign memory on a device).
    fn check_ids(&self, ids: &[u32]) -> Result<(), BackendError> {
        let vocab_size = self.vocab_size();
        match ids.iter().find(|&&id| id as usize >= vocab_size) {
            Some(&id) => Err(BackendError::TokenId { id, vocab_size }),
            None => Ok(()),
        }
    }

    /// The backend's state storage (slots), e.g. to check which slots are allocated.
    pub fn states(&self) -> &B::States {
        &self.states
    }

    /// The snapshots.
    pub fn snapshots(&self) -> &PrefixCache {
        &self.snapshots
    }

    /// Sets when snapshots are taken and their memory budgets (evicting down to them).
    pub fn set_snapshots(&mut self, config: SnapshotConfig) {
        let displaced = self.snapshots.set_config(config);
        self.spill(displaced);
    }

    /// Tells the backend how much state memory to set aside ([`Backend::reserve_state_memory`]):
    /// `max_seqs` states with one KV page each (`ATTENTION_TILE` positions), and the snapshot
    /// slot tier's budget.
    pub fn reserve_state_memory(&self, max_seqs: usize) {
        let per_seq = session::snapshot_bytes(&self.model.config, crate::backend::cpu::kernels::ATTENTION_TILE);
        let bytes = (max_seqs as u64).saturating_mul(per_seq).saturating_add(self.snapshots.config().device_budget_bytes);
        self.model.backend.reserve_state_memory(bytes);
    }

    /// Drops every snapshot.
    pub fn clear_snapshots(&mut self) {
        for slot in self.snapshots.clear() {
            let _ = self.model.backend.free_slot(&mut self.states, slot);
        }
    }

    /// Snapshots that left the slot tier: each moves to host memory when that tier has room
    /// (else it goes), and its slot is freed. A copy that fails loses only that snapshot.
    fn spill(&mut self, displaced: Vec<Displaced>) {
        for d in displaced {
            if self.snapshots.fits_host(d.bytes) {
                if let Ok(st) = self.model.backend.export_slot(&self.states, d.slot) {
                    self.snapshots.insert(&d.tokens, st, d.bytes);
                }
            }
            let _ = self.model.backend.free_slot(&mut self.states, d.slot);
        }
    }

    /// Frees the slots of snapshots that left the slot tier, without keeping them.
    fn drop_displaced(&mut self, displaced: Vec<Displaced>) {
        for d in displaced {
            let _ = self.model.backend.free_slot(&mut self.states, d.slot);
        }
    }

    /// Work for when nothing runs: moves the least recently used slot snapshot to host memory
    /// while the slot tier holds more than half its budget, so that the next burst of snapshots
    /// finds room without dropping any. One snapshot per call (a device-to-host copy of one
    /// state); returns whether there may be more to do.
    pub fn spill_idle(&mut self) -> bool {
        if self.snapshots.slot_bytes() <= self.snapshots.config().device_budget_bytes / 2 {
            return false;
        }
        match self.snapshots.pop_oldest_slot() {
            Some(d) => {
                self.spill(vec![d]);
                true
            }
            None => false,
        }
    }

    /// A new slot for a sequence: when the backend has none left (slots or memory), the least
    /// recently used slot snapshots give theirs up first, one at a time.
    fn alloc_slot(&mut self) -> Result<u32, BackendError> {
        loop {
            match self.model.backend.alloc_slot(&mut self.states) {
                Ok(slot) => return Ok(slot),
                Err(e) => match self.snapshots.pop_oldest_slot() {
                    Some(d) => self.drop_displaced(vec![d]),
                    None => return Err(e),
                },
            }
        }
    }

    /// A new, empty session (position 0) in a new slot.
    pub fn new_session(&mut self, params: SamplingParams) -> Result<Session, BackendError> {
        let slot = self.alloc_slot()?;
        Ok(Session::new(Residence::Device(slot), params))
    }

    /// Frees a session's slot (if it holds one) and its state.
    pub fn free_session(&mut self, s: Session) -> Result<(), BackendError> {
        match s.home {
            Residence::Device(slot) => self.model.backend.free_slot(&mut self.states, slot),
            Residence::Host(_) => Ok(()),
        }
    }

    /// Moves a session's state to host memory and frees its slot (no-op when already there).
    pub fn swap_out(&mut self, s: &mut Session) -> Result<(), BackendError> {
        if let Residence::Device(slot) = s.home {
            let st = self.model.backend.export_slot(&self.states, slot)?;
            self.model.backend.free_slot(&mut self.states, slot)?;
            s.home = Residence::Host(Box::new(st));
        }
        Ok(())
    }

    /// Moves a swapped-out session's state into a new slot (no-op when resident).
    pub fn swap_in(&mut self, s: &mut Session) -> Result<(), BackendError> {
        if let Residence::Host(st) = &s.home {
            let slot = self.place(st)?;
            s.home = Residence::Device(slot);
        }
        Ok(())
    }

    /// A new slot holding `st`.
    fn place(&mut self, st: &SequenceState) -> Result<u32, BackendError> {
        let slot = self.alloc_slot()?;
        if let Err(e) = self.model.backend.import_slot(&mut self.states, slot, st) {
            let _ = self.model.backend.free_slot(&mut self.states, slot);
            return Err(e);
        }
        Ok(slot)
    }

    /// The session's state in host memory (a copy when resident).
    fn state_of<'a>(&self, s: &'a Session) -> Result<Cow<'a, SequenceState>, BackendError> {
        match &s.home {
            Residence::Device(slot) => Ok(Cow::Owned(self.model.backend.export_slot(&self.states, *slot)?)),
            Residence::Host(st) => Ok(Cow::Borrowed(&**st)),
        }
    }

    /// A copy of `s` (history, settings, meta, state) in a new slot, to be continued
    /// independently.
    pub fn fork(&mut self, s: &Session) -> Result<Session, BackendError> {
        let st = self.state_of(s)?.into_owned();
        let slot = self.place(&st)?;
        let mut f = Session::new(Residence::Device(slot), s.params);
        f.tokens = s.tokens.clone();
        f.position = s.position;
        f.meta = s.meta.clone();
        Ok(f)
    }

    /// Empties a session: no tokens, the zero state (settings and meta are kept).
    pub fn reset(&mut self, s: &mut Session) -> Result<(), BackendError> {
        let zero = SequenceState::new(&self.model.config);
        match s.home {
            Residence::Device(slot) => self.model.backend.import_slot(&mut self.states, slot, &zero)?,
            Residence::Host(_) => s.home = Residence::Host(Box::new(zero)),
        }
        s.tokens.clear();
        s.position = 0;
        Ok(())
    }

    /// Appends `ids` to the session's history and feeds every pending id through the model
    /// (swapping the session in if needed). Returns the logits (`[V]`) of the last id, or of
    /// every id fed (`[n, V]`, the pending ids first) when `all_logits`. `progress(done, n)` is
    /// called after each step. On error the ids not consumed are removed again.
    ///
    /// With snapshots on, a snapshot is taken whenever the position reaches a multiple of the
    /// stride (steps are split there; the logits do not depend on the split).
    pub fn feed(&mut self, s: &mut Session, ids: &[u32], all_logits: bool, progress: &mut dyn FnMut(usize, usize)) -> Result<&[f32], BackendError> {
        let before = s.tokens.len();
        s.tokens.extend_from_slice(ids);
        let r = self.process(s, all_logits, progress);
        if r.is_err() {
            s.tokens.truncate(before.max(s.position));
        }
        r?;
        Ok(&self.logits)
    }

    /// Feeds the pending ids of `s`; the result is left in `self.logits`.
    fn process(&mut self, s: &mut Session, all_logits: bool, progress: &mut dyn FnMut(usize, usize)) -> Result<(), BackendError> {
        let total = s.tokens.len() - s.position;
        if total == 0 {
            return Err(BackendError::Batch("no tokens to feed".into()));
        }
        self.check_ids(s.pending())?;
        self.swap_in(s)?;
        let slot = s.slot().expect("swapped in");
        let v = self.vocab_size();
        let stride = if self.snapshots.config().enabled() { self.snapshots.config().every } else { 0 };
        let mut out = Vec::with_capacity(if all_logits { total * v } else { v });
        let mut done = 0;
        while s.position < s.tokens.len() {
            let pos = s.position;
            let mut n = (s.tokens.len() - pos).min(self.chunk);
            if stride > 0 {
                n = n.min(stride - pos % stride);
            }
            let batch = Batch::single(slot, pos as u32, &s.tokens[pos..pos + n], all_logits);
            let want = batch.logit_rows.len();
            let scratch = if n == 1 { &mut self.decode } else { prefill_scratch(&self.model, &mut self.prefill, self.chunk, n, want)? };
            self.model.step(&batch, &mut self.states, scratch)?;
            s.position += n;
            if all_logits || s.position == s.tokens.len() {
                self.model.backend.read_tensor(&scratch.logits, want, &mut self.logits)?;
                out.extend_from_slice(&self.logits);
            }
            if stride > 0 && s.position.is_multiple_of(stride) {
                self.snapshot(s)?;
            }
            done += n;
            progress(done, total);
        }
        self.logits = out;
        Ok(())
    }

    /// One model step over the pending tokens of several resident sessions: `rows[i].take`
    /// tokens of session `i` (from its position), rows in the order given, the last row of each
    /// `rows[i].logits` session wanting logits. Every session advances by its `take`. The
    /// sessions with `rows[i].snapshot` are snapshotted ([`Engine::snapshot`]) once the step is
    /// enqueued and before its result is read, so on a device that host work overlaps the
    /// step; a read that then fails leaves the positions advanced and the snapshots kept (the
    /// states did advance).
    ///
    /// `choose` says what comes back: the logits rows (`[k, V]`, in the order of the sessions
    /// that want them), or the ids chosen where the logits are (greedy, or the device sampler
    /// prepared by [`Backend::set_sampling`] with one entry per logits row). Decode-shaped steps
    /// (one row per session) of up to [`Engine::set_batch_capacity`] rows run on buffers
    /// allocated once, so a device records one graph per shape and replays it.
    ///
    /// # Errors
    /// [`BackendError::Batch`] when a session is not resident or `take` exceeds its pending
    /// tokens; [`BackendError::TokenId`] for an id outside the vocabulary (nothing is consumed);
    /// the backend's own errors.
    pub fn step_sessions(&mut self, rows: &mut [StepRows<'_>], choose: Choose) -> Result<Chosen, BackendError> {
        let mut batch = Batch::default();
        for r in rows.iter() {
            let s = &*r.session;
            let slot = s.slot().ok_or_else(|| BackendError::Batch("a session in the step is not resident".into()))?;
            if r.take == 0 || s.position + r.take > s.tokens.len() {
                return Err(BackendError::Batch(format!("{} tokens asked of a session with {} pending", r.take, s.tokens.len() - s.position)));
            }
            let ids = &s.tokens[s.position..s.position + r.take];
            self.check_ids(ids)?;
            let first = batch.ids.len() as u32;
            batch.ids.extend_from_slice(ids);
            batch.seqs.push(SeqRows { slot, first_row: first, len: r.take as u32, pos: s.position as u32 });
            if r.all_logits {
                batch.logit_rows.extend(first..first + r.take as u32);
            } else if r.logits {
                batch.logit_rows.push(first + r.take as u32 - 1);
            }
        }
        let (n, k) = (batch.rows(), batch.logit_rows.len());
        if n == 0 {
            return Err(BackendError::Batch("an empty step".into()));
        }
        let decode_shaped = n == batch.seqs.len();
        let buffers = if n == 1 {
            StepBuffers::Decode
        } else if decode_shaped && n <= self.batch_capacity {
            if self.batch_decode.is_none() {
                self.batch_decode = Some(self.model.scratch(self.batch_capacity, self.batch_capacity)?);
            }
            StepBuffers::Batch
        } else {
            prefill_scratch(&self.model, &mut self.prefill, self.chunk.max(n), n, k)?;
            StepBuffers::Prefill
        };
        {
            let scratch = buffers.of(&mut self.decode, &mut self.batch_decode, &mut self.prefill);
            match choose {
                Choose::Greedy { v_eff } if k > 0 => self.model.launch_greedy(&batch, &mut self.states, scratch, v_eff)?,
                Choose::Sample { v_eff } if k > 0 => self.model.launch_sample(&batch, &mut self.states, scratch, v_eff)?,
                _ => self.model.step(&batch, &mut self.states, scratch)?,
            }
        }
        for r in rows.iter_mut() {
            r.session.position += r.take;
        }
        // Snapshots are enqueued after the step (so they hold its result) and their host work
        // overlaps it on a device: it no longer delays the next step.
        let t_snap = Instant::now();
        for r in rows.iter().filter(|r| r.snapshot) {
            // A snapshot that cannot be taken is only not kept; a device fault is sticky and
            // the read below reports it.
            let _ = self.snapshot(&*r.session);
        }
        self.snapshot_time = t_snap.elapsed();
        let scratch = buffers.of(&mut self.decode, &mut self.batch_decode, &mut self.prefill);
        Ok(match choose {
            _ if k == 0 => Chosen::Logits(Vec::new()),
            Choose::Logits => {
                let mut out = std::mem::take(&mut self.spare_logits);
                self.model.backend.read_tensor(&scratch.logits, k, &mut out)?;
                Chosen::Logits(out)
            }
            Choose::Greedy { v_eff } => Chosen::Ids(self.model.backend.argmax_read(&scratch.logits, k, v_eff)?),
            Choose::Sample { v_eff } => Chosen::Ids(self.model.backend.sample_read(&scratch.logits, k, v_eff)?),
        })
    }

    /// Host time the last [`Engine::step_sessions`] spent taking its snapshots
    /// ([`StepRows::snapshot`]), while the device ran the step.
    pub fn snapshot_time(&self) -> Duration {
        self.snapshot_time
    }

    /// Hands a step's result back once it has been read, so that the next
    /// [`Engine::step_sessions`] returning logits writes them into its buffer rather than a new
    /// one (the larger of the two buffers is kept).
    pub fn recycle(&mut self, chosen: Chosen) {
        if let Chosen::Logits(v) = chosen {
            if v.capacity() > self.spare_logits.capacity() {
                self.spare_logits = v;
            }
        }
    }

    /// Decode-shaped steps of up to `rows` sessions run on buffers allocated once (at the first
    /// such step) instead of the prompt buffers; the default is 1 (none).
    pub fn set_batch_capacity(&mut self, rows: usize) {
        let rows = rows.clamp(1, self.model.backend.max_rows());
        if rows != self.batch_capacity {
            self.batch_capacity = rows;
            self.batch_decode = None;
        }
    }

    /// Makes `prompt` the session's history without processing it, reusing as much state as
    /// possible: the session's own state when the tokens it consumed are a prefix of `prompt`,
    /// or the longest snapshot that is (whichever is longer; at least the last token is left
    /// pending, for its logits), else the zero state. Returns what was reused; the pending
    /// tokens are `prompt[reused..]`.
    ///
    /// # Errors
    /// An empty prompt, an id outside the vocabulary (the session is then unchanged), or the
    /// backend's errors placing the state.
    pub fn prepare_prompt(&mut self, s: &mut Session, prompt: &[u32]) -> Result<Reuse, BackendError> {
        let n = prompt.len();
        if n == 0 {
            return Err(BackendError::Batch("the prompt is empty".into()));
        }
        self.check_ids(prompt)?;
        let own = (s.position < n && prompt.starts_with(&s.tokens[..s.position])).then_some(s.position);
        let snap_len = if self.snapshots.config().enabled() { self.snapshots.lookup(prompt, n - 1).map(|sn| sn.tokens().len()) } else { None };
        let reuse = match (own, snap_len) {
            (o, Some(l)) if o.is_none_or(|o| l > o) => {
                let b = &self.model.backend;
                match (self.snapshots.longest_prefix(prompt, l).expect("found above").home(), &mut s.home) {
                    (SnapshotHome::Host(st), Residence::Device(slot)) => b.import_slot(&mut self.states, *slot, st)?,
                    (SnapshotHome::Host(st), home @ Residence::Host(_)) => *home = Residence::Host(Box::new(st.clone())),
                    (&SnapshotHome::Slot(from), Residence::Device(slot)) => b.copy_slot(&mut self.states, from, *slot)?,
                    (&SnapshotHome::Slot(from), home @ Residence::Host(_)) => *home = Residence::Host(Box::new(b.export_slot(&self.states, from)?)),
                }
                s.position = l;
                Reuse { reused: l, from_snapshot: true, processed: n - l }
            }
            (Some(o), _) => Reuse { reused: o, from_snapshot: false, processed: n - o },
            (None, _) => {
                self.reset(s)?;
                Reuse { reused: 0, from_snapshot: false, processed: n }
            }
        };
        s.tokens.clear();
        s.tokens.extend_from_slice(prompt);
        Ok(reuse)
    }

    /// A new session holding `state` after `tokens[..state.position]`, with the rest of
    /// `tokens` pending (a loaded session file), in a new slot.
    ///
    /// # Errors
    /// A state that does not fit the model, more consumed positions than tokens, ids outside
    /// the vocabulary, or no free slot.
    pub fn session_from_saved(&mut self, tokens: &[u32], state: &SequenceState, params: SamplingParams) -> Result<Session, BackendError> {
        if state.position > tokens.len() {
            return Err(BackendError::Batch(format!("a state at position {} with {} tokens", state.position, tokens.len())));
        }
        state.check(&self.model.config)?;
        self.check_ids(tokens)?;
        let slot = self.place(state)?;
        let mut s = Session::new(Residence::Device(slot), params);
        s.tokens = tokens.to_vec();
        s.position = state.position;
        Ok(s)
    }

    /// Keeps the state of `s` at its position as a snapshot (when snapshots are on, it fits a
    /// budget and that prefix is not held already). Returns whether one was taken.
    ///
    /// A resident session's snapshot goes to a slot of its own when the slot tier has a budget
    /// and the backend a free slot (a copy where the states are: on a GPU no host round trip),
    /// dropping the least recently used slot snapshots past the budget; otherwise to host
    /// memory.
    pub fn snapshot(&mut self, s: &Session) -> Result<bool, BackendError> {
        let bytes = session::snapshot_bytes(&self.model.config, s.position);
        let prefix = &s.tokens[..s.position];
        if s.position == 0 || !self.snapshots.fits(bytes) || self.snapshots.touch(prefix) {
            return Ok(false);
        }
        if let (Residence::Device(src), true) = (&s.home, self.snapshots.fits_slot(bytes)) {
            // No free slot (or memory) is not an error: the host tier takes it (a device fault
            // is sticky, and the host tier's copy reports it).
            if let Ok(slot) = self.model.backend.snapshot_slot(&mut self.states, *src) {
                return Ok(match self.snapshots.insert_slot(prefix, slot, bytes) {
                    Some(displaced) => {
                        // Dropped, not copied to host memory: a copy here would stall every
                        // running sequence (bench/results: 2026-12-02 H200 snapshots); idle time
                        // moves them out before the tier fills ([`Engine::spill_idle`]).
                        self.drop_displaced(displaced);
                        true
                    }
                    None => {
                        let _ = self.model.backend.free_slot(&mut self.states, slot);
                        false
                    }
                });
            }
        }
        if !self.snapshots.fits_host(bytes) {
            return Ok(false);
        }
        let st = self.state_of(s)?.into_owned();
        Ok(self.snapshots.insert(prefix, st, bytes))
    }

    /// Makes `prompt` the session's history and returns the logits (`[V]`) of its last token,
    /// processing as little as possible: it continues the session's own state when the tokens
    /// that state consumed are a prefix of `prompt`, or resumes from the longest snapshot that
    /// is (whichever is longer; at least the last token is always fed, for its logits), else
    /// starts from the zero state. Takes a snapshot at the end of the prompt (when snapshots are
    /// on) and at every stride position on the way.
    pub fn prompt(&mut self, s: &mut Session, prompt: &[u32], progress: &mut dyn FnMut(usize, usize)) -> Result<(Reuse, &[f32]), BackendError> {
        let reuse = self.prepare_prompt(s, prompt)?;
        if let Err(e) = self.process(s, false, progress) {
            s.tokens.truncate(s.position);
            return Err(e);
        }
        if self.snapshots.config().enabled() {
            self.snapshot(s)?;
        }
        Ok((reuse, &self.logits))
    }

    /// Writes the session to `path` (format in [`crate::session`]), atomically. The session
    /// stays where it is.
    pub fn save_session(&self, s: &Session, path: &Path) -> Result<(), SessionError> {
        let identity = self.identity()?;
        let rec = SessionRecord { tokens: &s.tokens, params: s.params, meta: &s.meta, state: self.state_of(s)?, products: self.model.backend.products() };
        session::write_session(path, &rec, identity, &self.model.config)
    }

    /// Reads a session written by [`Engine::save_session`] (in any process) into a new slot.
    ///
    /// # Errors
    /// The file's own problems ([`SessionError`]: unreadable, not a session, another format
    /// version, truncated, checksum mismatch, another model, saved with other products than
    /// this backend's, shapes of another model), or no free slot.
    pub fn load_session(&mut self, path: &Path) -> Result<Session, SessionError> {
        let products = self.model.backend.products();
        let l = session::read_session(path, &self.model.config, products, &mut || self.identity())?;
        let slot = self.place(&l.state)?;
        let mut s = Session::new(Residence::Device(slot), l.params);
        s.tokens = l.tokens;
        s.position = l.state.position;
        s.meta = l.meta;
        Ok(s)
    }

    /// Appends `ids` to the session and feeds every pending id, then samples the greedy next id
    /// over ids `< v_eff` (the largest logit of the last row, smallest id on ties) where the
    /// logits are: on a GPU, inside the step's graph, which also leaves the id where the next
    /// step reads its token. The id is not pushed to the session.
    pub fn feed_greedy(&mut self, s: &mut Session, ids: &[u32], v_eff: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<u32, BackendError> {
        let before = s.tokens.len();
        s.tokens.extend_from_slice(ids);
        let r = self.process_choosing(s, v_eff, false, progress);
        if r.is_err() {
            s.tokens.truncate(before.max(s.position));
        }
        r
    }

    /// Like [`Engine::feed_greedy`], but samples the next id with the session's settings
    /// (penalties over its history, the draw keyed by its seed and position) where the logits
    /// are. Returns `None`, feeding nothing, when the backend cannot sample these settings
    /// itself ([`Backend::set_sampling`]); then use [`Engine::feed`] and [`Session::sample`],
    /// which give the same id.
    pub fn feed_sample(&mut self, s: &mut Session, ids: &[u32], v_eff: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<Option<u32>, BackendError> {
        let mut history = s.tokens.clone();
        history.extend_from_slice(ids);
        let p = s.params;
        let n = match p.repeat_last_n {
            0 => 0,
            n if n < 0 => history.len(),
            n => (n as usize).min(history.len()),
        };
        let row = crate::backend::RowSampling { params: p, window: history[history.len() - n..].to_vec(), position: history.len() as u64 };
        if !self.model.backend.set_sampling(std::slice::from_ref(&row))? {
            return Ok(None);
        }
        let before = s.tokens.len();
        s.tokens.extend_from_slice(ids);
        let r = self.process_choosing(s, v_eff, true, progress);
        if r.is_err() {
            s.tokens.truncate(before.max(s.position));
        }
        r.map(Some)
    }

    fn process_choosing(&mut self, s: &mut Session, v_eff: usize, sample: bool, progress: &mut dyn FnMut(usize, usize)) -> Result<u32, BackendError> {
        let total = s.tokens.len() - s.position;
        if total == 0 {
            return Err(BackendError::Batch("no tokens to feed".into()));
        }
        self.check_ids(s.pending())?;
        // All but the last step as usual (snapshots included), then the last one greedy.
        let stride = if self.snapshots.config().enabled() { self.snapshots.config().every } else { 0 };
        // The step boundaries `process` uses; the last step's length.
        let mut pos = s.position;
        let last = loop {
            let mut k = (s.tokens.len() - pos).min(self.chunk);
            if stride > 0 {
                k = k.min(stride - pos % stride);
            }
            if pos + k == s.tokens.len() {
                break k;
            }
            pos += k;
        };
        if total > last {
            let keep = s.tokens.split_off(s.tokens.len() - last);
            let r = self.process(s, false, progress);
            s.tokens.extend(keep);
            r?;
        }
        self.swap_in(s)?;
        let slot = s.slot().expect("swapped in");
        let pos = s.position;
        let batch = Batch::single(slot, pos as u32, &s.tokens[pos..pos + last], false);
        let scratch = if last == 1 { &mut self.decode } else { prefill_scratch(&self.model, &mut self.prefill, self.chunk, last, 1)? };
        let next = if sample { self.model.step_sample(&batch, &mut self.states, scratch, v_eff)? } else { self.model.step_greedy(&batch, &mut self.states, scratch, v_eff)? };
        s.position += last;
        if stride > 0 && s.position.is_multiple_of(stride) {
            self.snapshot(s)?;
        }
        progress(total, total);
        next.first().copied().ok_or_else(|| BackendError::Batch("no id sampled".into()))
    }

    /// The logits rows of the last one-token step (`[rows, V]`), read from the backend.
    ///
    /// # Errors
    /// [`BackendError::Batch`] when `rows` exceeds the rows a one-token step has (one).
    pub fn decode_logits(&mut self, rows: usize) -> Result<Vec<f32>, BackendError> {
        if rows > self.decode.max_logit_rows {
            return Err(BackendError::Batch(format!("{rows} logits rows asked of a one-token step, which has {}", self.decode.max_logit_rows)));
        }
        let mut v = Vec::new();
        self.model.backend.read_tensor(&self.decode.logits, rows, &mut v)?;
        Ok(v)
    }

    /// Feeds `ids` to `s` as one eager step with [`crate::model::forward_probed`], handing every
    /// intermediate tensor to `probe(layer, op, values)` (read back to the host).
    pub fn probe_step(&mut self, s: &mut Session, ids: &[u32], probe: &mut dyn FnMut(usize, &str, Vec<f32>)) -> Result<(), BackendError> {
        if !s.pending().is_empty() || ids.is_empty() {
            return Err(BackendError::Batch("probe_step needs a session without pending ids and some ids".into()));
        }
        self.check_ids(ids)?;
        self.swap_in(s)?;
        let slot = s.slot().expect("swapped in");
        let batch = Batch::single(slot, s.position as u32, ids, false);
        // One step of all the ids, however many: forward_probed writes every row into the
        // scratch without Model::step's size check.
        let scratch = if ids.len() == 1 { &mut self.decode } else { prefill_scratch(&self.model, &mut self.prefill, self.chunk, ids.len(), 1)? };
        self.model.backend.begin_step(&mut self.states, &batch)?;
        let backend = &self.model.backend;
        let mut err = None;
        crate::model::forward_probed(&self.model, &batch, &mut self.states, scratch, &mut |l, op, t| {
            // The final norm and the LM head run on the gathered logit rows only.
            let rows = if matches!(op, "final norm" | "lm_head") { batch.logit_rows.len() } else { batch.rows() };
            let mut v = Vec::new();
            match backend.read_tensor(t, rows, &mut v) {
                Ok(()) => probe(l, op, v),
                Err(e) => {
                    err.get_or_insert(e);
                }
            }
        });
        self.model.backend.end_step(&mut self.states, &batch)?;
        s.tokens.extend_from_slice(ids);
        s.position += ids.len();
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A copy of the session's state in host memory.
    pub fn export_state(&self, s: &Session) -> Result<SequenceState, BackendError> {
        Ok(self.state_of(s)?.into_owned())
    }

    /// A new resident session holding `state` after `tokens` (e.g. a state from another engine).
    pub fn session_from_state(&mut self, state: &SequenceState, tokens: &[u32], params: SamplingParams) -> Result<Session, BackendError> {
        if state.position != tokens.len() {
            return Err(BackendError::Batch(format!("a state at position {} with {} tokens", state.position, tokens.len())));
        }
        let slot = self.place(state)?;
        let mut s = Session::new(Residence::Device(slot), params);
        s.tokens = tokens.to_vec();
        s.position = tokens.len();
        Ok(s)
    }
}

/// One session's part of a step ([`Engine::step_sessions`]).
pub struct StepRows<'a> {
    pub session: &'a mut Session,
    /// Pending tokens to feed (from the session's position).
    pub take: usize,
    /// Whether the last of them wants logits.
    pub logits: bool,
    /// Whether every one of them wants logits (a prompt whose logits are all kept); implies
    /// `logits`.
    pub all_logits: bool,
    /// Whether to keep the session's state after the step as a snapshot ([`Engine::snapshot`]).
    pub snapshot: bool,
}

/// Which of the engine's buffers a step runs on.
#[derive(Clone, Copy)]
enum StepBuffers {
    Decode,
    Batch,
    Prefill,
}

impl StepBuffers {
    /// These buffers among the engine's (allocated before the step).
    fn of<'a, B: Backend>(self, decode: &'a mut Scratch<B>, batch: &'a mut Option<Scratch<B>>, prefill: &'a mut Option<Scratch<B>>) -> &'a mut Scratch<B> {
        match self {
            StepBuffers::Decode => decode,
            StepBuffers::Batch => batch.as_mut().expect("allocated before the step"),
            StepBuffers::Prefill => prefill.as_mut().expect("allocated before the step"),
        }
    }
}

/// What a step returns ([`Engine::step_sessions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choose {
    /// The logits rows, read back to the host.
    Logits,
    /// The greedy id of every logits row over ids `< v_eff`, taken where the logits are.
    Greedy { v_eff: usize },
    /// The id sampled for every logits row by the device sampler ([`Backend::set_sampling`],
    /// called before the step with one entry per logits row and returning `true`).
    Sample { v_eff: usize },
}

/// The result of [`Engine::step_sessions`].
#[derive(Clone, Debug, PartialEq)]
pub enum Chosen {
    /// `[k, V]` logits, one row per session that wanted logits, in step order (empty when none
    /// did).
    Logits(Vec<f32>),
    /// One id per session that wanted logits, in step order.
    Ids(Vec<u32>),
}

/// The prompt-step buffers `slot` holds, first (re)allocated when they cannot hold a step of
/// `rows` rows and `logit_rows` logits rows. They grow by powers of two up to the chunk
/// (`cap`), never shrink, and hold no more logits rows than steps asked for: a short prompt with
/// a large chunk, or prompts that want only their last row's logits (`[rows, vocab_size]` floats
/// each: 250 MB for 256 rows of Qwen3.5's vocabulary), do not allocate for a full chunk of them.
fn prefill_scratch<'a, B: Backend>(model: &Model<B>, slot: &'a mut Option<Scratch<B>>, cap: usize, rows: usize, logit_rows: usize) -> Result<&'a mut Scratch<B>, BackendError> {
    let (have_rows, have_logits) = slot.as_ref().map_or((0, 0), |s| (s.max_rows, s.max_logit_rows));
    if rows > have_rows || logit_rows > have_logits {
        let size = |need: usize, have: usize| need.checked_next_power_of_two().unwrap_or(need).min(cap.max(need)).max(have);
        let (r, l) = (size(rows, have_rows), size(logit_rows, have_logits));
        // The old buffers go before the new ones are allocated.
        *slot = None;
        *slot = Some(model.scratch(r, l)?);
    }
    Ok(slot.as_mut().expect("allocated above"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::model::HostModel;
    use crate::testutil::shared;

    fn engine(chunk: usize) -> Engine<Cpu> {
        let dir = shared("fixtures/tiny/mlx-q4");
        let host = HostModel::open(&dir).unwrap();
        Engine::new(Model::new(&host, Cpu::with(crate::backend::cpu::simd::Isa::Portable, 1)).unwrap(), chunk).unwrap().with_model_dir(dir)
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn prompt_buffers_are_sized_to_the_steps_not_to_the_chunk() {
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 2048) as u32).collect();
        let mut one = engine(1);
        let mut s1 = one.new_session(SamplingParams::greedy()).unwrap();
        let want = one.feed(&mut s1, &prompt, true, &mut |_, _| {}).unwrap().to_vec();

        // A prompt of 5 tokens, of which only the last wants logits, used to allocate 256 rows of
        // every activation and 256 × vocab_size logits floats.
        let mut e = engine(256);
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let last = e.feed(&mut s, &prompt[..5], false, &mut |_, _| {}).unwrap().to_vec();
        let p = e.prefill.as_ref().unwrap();
        assert_eq!((p.max_rows, p.max_logit_rows), (8, 1));
        assert_eq!(bits(&last), bits(&want[4 * 2048..5 * 2048]));
        // A chunk far larger than any prompt (2^40 rows: the allocation used to abort the process).
        let mut e = engine(1 << 40);
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let last = e.feed(&mut s, &prompt[..5], false, &mut |_, _| {}).unwrap().to_vec();
        let p = e.prefill.as_ref().unwrap();
        assert_eq!((p.max_rows, p.max_logit_rows), (8, 1));
        assert_eq!(bits(&last), bits(&want[4 * 2048..5 * 2048]));
        // More rows, then every row's logits: the buffers grow (by powers of two), the bits do not
        // change.
        let all = e.feed(&mut s, &prompt[5..], true, &mut |_, _| {}).unwrap().to_vec();
        let p = e.prefill.as_ref().unwrap();
        assert_eq!((p.max_rows, p.max_logit_rows), (64, 64));
        assert_eq!(bits(&all), bits(&want[5 * 2048..]));
        // Never beyond the chunk.
        let mut e = engine(16);
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let all = e.feed(&mut s, &prompt, true, &mut |_, _| {}).unwrap().to_vec();
        let p = e.prefill.as_ref().unwrap();
        assert_eq!((p.max_rows, p.max_logit_rows), (16, 16));
        assert_eq!(bits(&all), bits(&want));
        let g = e.feed_greedy(&mut s, &prompt[..20], 2048, &mut |_, _| {}).unwrap();
        let _ = one.feed(&mut s1, &prompt[..19], false, &mut |_, _| {}).unwrap();
        assert_eq!(g, crate::sampling::argmax(one.feed(&mut s1, &prompt[19..20], false, &mut |_, _| {}).unwrap()));
    }

    #[test]
    fn freed_slots_are_reused_and_give_the_bits_of_fresh_ones() {
        let prompt: Vec<u32> = (0..300).map(|i| (i * 53 % 2048) as u32).collect();
        let mut fresh = engine(64);
        let mut f = fresh.new_session(SamplingParams::greedy()).unwrap();
        let want = fresh.feed(&mut f, &prompt[..40], true, &mut |_, _| {}).unwrap().to_vec();
        let whole = fresh_session_after(&mut fresh, &prompt);
        let long = fresh.export_state(&whole).unwrap();

        // A long sequence leaves its slot; the next session gets its state (KV caches dropped,
        // recurrent states reused) and must start from zero all the same.
        let mut e = engine(64);
        let mut a = e.new_session(SamplingParams::greedy()).unwrap();
        let _ = e.feed(&mut a, &prompt, false, &mut |_, _| {}).unwrap();
        let slot = a.slot();
        e.free_session(a).unwrap();
        let mut b = e.new_session(SamplingParams::greedy()).unwrap();
        assert_eq!(b.slot(), slot);
        assert_eq!(e.export_state(&b).unwrap(), SequenceState::new(&e.model.config));
        assert_eq!(bits(e.feed(&mut b, &prompt[..40], true, &mut |_, _| {}).unwrap()), bits(&want));
        // A long state imported into a reused slot (in place), and a slot copied onto another
        // (in place), continue exactly.
        let c = e.session_from_state(&long, &prompt, SamplingParams::greedy()).unwrap();
        assert_eq!(e.export_state(&c).unwrap(), long);
        let mut d = e.fork(&c).unwrap();
        let mut g = fresh.session_from_state(&long, &prompt, SamplingParams::greedy()).unwrap();
        let next = fresh.feed(&mut g, &[7], false, &mut |_, _| {}).unwrap().to_vec();
        assert_eq!(bits(e.feed(&mut d, &[7], false, &mut |_, _| {}).unwrap()), bits(&next));
        e.model.backend.copy_slot(&mut e.states, c.slot().unwrap(), b.slot().unwrap()).unwrap();
        assert_eq!(e.model.backend.export_slot(&e.states, b.slot().unwrap()).unwrap(), long);
    }

    /// A new session of `e` fed `prompt`.
    fn fresh_session_after(e: &mut Engine<Cpu>, prompt: &[u32]) -> Session {
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let _ = e.feed(&mut s, prompt, false, &mut |_, _| {}).unwrap();
        s
    }

    #[test]
    fn step_logits_written_into_a_recycled_buffer_are_the_same_bits() {
        let mut e = engine(64);
        let v = e.vocab_size();
        let mut a = e.new_session(SamplingParams::greedy()).unwrap();
        let mut b = e.new_session(SamplingParams::greedy()).unwrap();
        a.tokens.extend_from_slice(&[3, 1, 4, 1]);
        b.tokens.extend_from_slice(&[2, 7]);
        let step = |e: &mut Engine<Cpu>, a: &mut Session, b: &mut Session| {
            let mut rows = [
                StepRows { session: a, take: 1, logits: true, all_logits: false, snapshot: false },
                StepRows { session: b, take: 1, logits: true, all_logits: false, snapshot: false },
            ];
            e.step_sessions(&mut rows, Choose::Logits).unwrap()
        };
        let first = step(&mut e, &mut a, &mut b);
        let Chosen::Logits(l) = &first else { panic!("logits asked") };
        assert_eq!(l.len(), 2 * v);
        e.recycle(first);
        let second = step(&mut e, &mut a, &mut b);
        // Solo runs of the same prefixes.
        let mut solo = engine(64);
        let mut want = Vec::new();
        for p in [&[3u32, 1][..], &[2, 7]] {
            let mut s = solo.new_session(SamplingParams::greedy()).unwrap();
            want.extend_from_slice(solo.feed(&mut s, p, false, &mut |_, _| {}).unwrap());
        }
        let Chosen::Logits(l) = &second else { panic!("logits asked") };
        assert_eq!(bits(l), bits(&want));
    }

    #[test]
    fn clearing_a_state_gives_the_zero_state_and_clone_from_copies_it_whole() {
        let e = engine(64);
        let cfg = &e.model.config;
        let mut s = SequenceState::new(cfg);
        s.position = 3;
        for a in s.conv.iter_mut().chain(&mut s.recurrent) {
            a.fill(1.5);
        }
        for a in s.keys.iter_mut().chain(&mut s.values) {
            a.resize(3 * cfg.num_key_value_heads * cfg.head_dim, -2.0);
        }
        let mut t = SequenceState::new(cfg);
        t.clone_from(&s);
        assert_eq!(t, s);
        s.clear();
        assert_eq!(s, SequenceState::new(cfg));
        t.clone_from(&s);
        assert_eq!(t, s);
    }

    #[test]
    fn probe_step_runs_steps_longer_than_the_chunk() {
        // `tensorfold verify` probes a prompt prefix of any length; with more ids than the chunk
        // the forward pass wrote past the prompt buffers (a panic on the CPU).
        let ids: Vec<u32> = (0..11).map(|i| (i * 101 % 2048) as u32).collect();
        let mut e = engine(4);
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let mut lm_head = Vec::new();
        e.probe_step(&mut s, &ids, &mut |_, op, v| {
            if op == "lm_head" {
                lm_head = v;
            }
        })
        .unwrap();
        assert_eq!((s.position(), s.tokens()), (11, &ids[..]));
        let mut fresh = e.new_session(SamplingParams::greedy()).unwrap();
        let want = e.feed(&mut fresh, &ids, false, &mut |_, _| {}).unwrap();
        assert_eq!(bits(&lm_head), bits(want));
    }

    #[test]
    fn decode_logits_reads_the_one_token_step_and_refuses_more_rows() {
        let mut e = engine(4);
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let want = e.feed(&mut s, &[3, 1, 4], false, &mut |_, _| {}).unwrap().to_vec();
        let _ = e.feed(&mut s, &[1], false, &mut |_, _| {}).unwrap();
        let last = e.feed(&mut s, &[5], false, &mut |_, _| {}).unwrap().to_vec();
        assert_ne!(bits(&want), bits(&last));
        assert_eq!(bits(&e.decode_logits(1).unwrap()), bits(&last));
        // Two rows used to panic slicing the one-row buffer.
        assert!(matches!(e.decode_logits(2), Err(BackendError::Batch(m)) if m.contains("2 logits rows")));
    }

    #[test]
    fn ids_outside_the_vocabulary_are_refused_and_leave_the_session_as_it_was() {
        let mut e = engine(4);
        let v = e.vocab_size() as u32;
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let want = e.feed(&mut s, &[5, 6, 7], false, &mut |_, _| {}).unwrap().to_vec();
        let is_token_id = |r: Result<(), BackendError>| matches!(r, Err(BackendError::TokenId { id, vocab_size }) if id == v && vocab_size == v as usize);
        // feed, the greedy and sampling feeds, prompt and probe_step, each with one bad id.
        assert!(is_token_id(e.feed(&mut s, &[8, v], false, &mut |_, _| {}).map(|_| ())));
        assert!(is_token_id(e.feed_greedy(&mut s, &[v], v as usize, &mut |_, _| {}).map(|_| ())));
        assert!(is_token_id(e.prompt(&mut s, &[5, 6, 7, v], &mut |_, _| {}).map(|_| ())));
        assert!(is_token_id(e.probe_step(&mut s, &[v], &mut |_, _, _| {})));
        // Nothing was consumed or reset: the session continues as if they never came.
        assert_eq!((s.tokens(), s.position()), (&[5u32, 6, 7][..], 3));
        let got = e.feed(&mut s, &[8], false, &mut |_, _| {}).unwrap().to_vec();
        let mut fresh = e.new_session(SamplingParams::greedy()).unwrap();
        let _ = e.feed(&mut fresh, &[5, 6, 7], false, &mut |_, _| {}).unwrap();
        let reference = e.feed(&mut fresh, &[8], false, &mut |_, _| {}).unwrap().to_vec();
        assert!(want.iter().zip(&got).any(|(a, b)| a != b), "a new token changes the logits");
        assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), reference.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    }
}
