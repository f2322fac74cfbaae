//! The operations a device must provide to run the model, and the description of one step.
//!
//! [`crate::model::forward`] is written once against the [`Backend`] trait; the CPU backend
//! ([`cpu`]) executes each operation at once and is the numerical reference, a device backend
//! records the same operations into its queue (and, for decode, into a captured graph). Every
//! operation's arithmetic is fixed by `docs/numerics.md`, so all backends return the same bits.
//!
//! Nothing in a step's control flow depends on token values or positions: those are data
//! ([`Batch`]) that a backend reads from its own memory. That is what lets a device capture a
//! decode step once and replay it for every token and every session.

pub mod cpu;
pub mod cuda;

use crate::config::ModelConfig;
use crate::model::weights::{AttentionWeights, GatedDeltaNetWeights, Matrix, MoeWeights, Weights};

/// A failure inside a backend (allocation, device errors, a request the state cannot hold).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("position {position} is beyond max_position_embeddings ({max}) of this model")]
    ContextFull { position: usize, max: usize },
    #[error("token id {id} is outside the model's vocabulary (vocab_size {vocab_size})")]
    TokenId { id: u32, vocab_size: usize },
    #[error("sequence slot {slot} {problem}")]
    Slot { slot: usize, problem: String },
    #[error("batch: {0}")]
    Batch(String),
    #[error("{0}")]
    Device(String),
}

/// The rows of one sequence inside a step: `len` consecutive rows starting at `first_row`,
/// holding the tokens at positions `pos .. pos + len` of the sequence whose state lives in
/// `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqRows {
    pub slot: u32,
    pub first_row: u32,
    pub len: u32,
    pub pos: u32,
}

/// One forward step: a chunk of a prompt, a decode token, or several sequences' tokens at once.
/// The logits of a row do not depend on what else is in the batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Token id of each row.
    pub ids: Vec<u32>,
    /// The sequences, in row order, covering every row exactly once.
    pub seqs: Vec<SeqRows>,
    /// Rows whose logits are wanted, in output order.
    pub logit_rows: Vec<u32>,
}

impl Batch {
    /// `ids` of one sequence in `slot` starting at position `pos`; logits for the last row only,
    /// or for every row when `all_logits`.
    pub fn single(slot: u32, pos: u32, ids: &[u32], all_logits: bool) -> Self {
        let n = ids.len() as u32;
        Self { ids: ids.to_vec(), seqs: vec![SeqRows { slot, first_row: 0, len: n, pos }], logit_rows: if all_logits { (0..n).collect() } else { vec![n.saturating_sub(1)] } }
    }

    /// Number of rows (tokens) in the step.
    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Checks that `seqs` tile the rows in order and `logit_rows` are in range.
    pub fn validate(&self) -> Result<(), BackendError> {
        let mut next = 0u32;
        for s in &self.seqs {
            if s.first_row != next || s.len == 0 {
                return Err(BackendError::Batch(format!("sequence rows {s:?} do not continue at row {next}")));
            }
            next += s.len;
        }
        if next as usize != self.ids.len() {
            return Err(BackendError::Batch(format!("sequences cover {next} rows, the batch has {}", self.ids.len())));
        }
        if let Some(r) = self.logit_rows.iter().find(|&&r| r as usize >= self.ids.len()) {
            return Err(BackendError::Batch(format!("logit row {r} out of range")));
        }
        Ok(())
    }

    /// Checks every id is inside a vocabulary of `vocab_size` ids.
    pub fn check_ids(&self, vocab_size: usize) -> Result<(), BackendError> {
        match self.ids.iter().find(|&&id| id as usize >= vocab_size) {
            Some(&id) => Err(BackendError::TokenId { id, vocab_size }),
            None => Ok(()),
        }
    }
}

/// One sequence's state in host memory, in the layout every backend exports and imports (swap
/// out and in, save and restore, fork). All f32.
///
/// `clone_from` copies in place: every array keeps its allocation where it is large enough, so a
/// state reused for another sequence (the CPU backend's freed slots) allocates nothing.
#[derive(Debug, PartialEq)]
pub struct SequenceState {
    /// Tokens processed so far (the position of the next one).
    pub position: usize,
    /// Per GDN layer: the `[Kc−1, conv_dim]` window of pre-conv inputs, oldest row first.
    pub conv: Vec<Vec<f32>>,
    /// Per GDN layer: the `[Hv, dv, dk]` recurrent state (row `j` of head `h` is `S_h[:, j]`).
    pub recurrent: Vec<Vec<f32>>,
    /// Per attention layer: keys `[position, Hkv, Dh]` (normalised and rotated).
    pub keys: Vec<Vec<f32>>,
    /// Per attention layer: values `[position, Hkv, Dh]`.
    pub values: Vec<Vec<f32>>,
}

impl Clone for SequenceState {
    fn clone(&self) -> Self {
        Self { position: self.position, conv: self.conv.clone(), recurrent: self.recurrent.clone(), keys: self.keys.clone(), values: self.values.clone() }
    }

    fn clone_from(&mut self, source: &Self) {
        self.position = source.position;
        // `Vec<Vec<f32>>::clone_from` reuses the inner vectors' buffers too.
        self.conv.clone_from(&source.conv);
        self.recurrent.clone_from(&source.recurrent);
        self.keys.clone_from(&source.keys);
        self.values.clone_from(&source.values);
    }
}

impl SequenceState {
    /// The zero state of position 0 for `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let n_lin = cfg.num_linear_layers();
        let n_full = cfg.num_full_layers();
        Self {
            position: 0,
            conv: vec![vec![0.0; (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim()]; n_lin],
            recurrent: vec![vec![0.0; cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim]; n_lin],
            keys: vec![Vec::new(); n_full],
            values: vec![Vec::new(); n_full],
        }
    }

    /// Makes this the zero state of position 0 (what [`SequenceState::new`] gives for the
    /// model it was made for), keeping every array's allocation: the KV arrays become empty with
    /// their capacity, the conv windows and recurrent states zero.
    pub fn clear(&mut self) {
        self.position = 0;
        for a in self.conv.iter_mut().chain(&mut self.recurrent) {
            a.fill(0.0);
        }
        for a in self.keys.iter_mut().chain(&mut self.values) {
            a.clear();
        }
    }

    /// Checks every array has the size `cfg` implies for this position.
    pub fn check(&self, cfg: &ModelConfig) -> Result<(), BackendError> {
        let z = Self::new(cfg);
        let kv = self.position * cfg.num_key_value_heads * cfg.head_dim;
        let ok = self.conv.len() == z.conv.len()
            && self.recurrent.len() == z.recurrent.len()
            && self.keys.len() == z.keys.len()
            && self.values.len() == z.values.len()
            && self.conv.iter().all(|c| c.len() == z.conv[0].len())
            && self.recurrent.iter().all(|r| r.len() == z.recurrent[0].len())
            && self.keys.iter().chain(&self.values).all(|k| k.len() >= kv);
        if !ok || self.position > cfg.max_position_embeddings {
            return Err(BackendError::Batch(format!("a sequence state of position {} does not fit this model's shapes", self.position)));
        }
        Ok(())
    }

    /// Bytes of f32 data held (the KV arrays up to `position`).
    pub fn bytes(&self, cfg: &ModelConfig) -> usize {
        let kv = self.position * cfg.num_key_value_heads * cfg.head_dim;
        4 * (self.conv.iter().map(Vec::len).sum::<usize>() + self.recurrent.iter().map(Vec::len).sum::<usize>() + 2 * kv * self.keys.len())
    }
}

/// How to choose the next id of one logits row on the device ([`Backend::set_sampling`]).
#[derive(Clone, Debug)]
pub struct RowSampling {
    pub params: crate::sampling::SamplingParams,
    /// The penalty window: the last `repeat_last_n` ids of the history (empty when off).
    pub window: Vec<u32>,
    /// The position the sampled id will have (the history length): keys the random draw.
    pub position: u64,
}

/// A device that runs the model's operations.
///
/// Tensors are row-major f32 `[rows, cols]` buffers allocated for a maximum row count; each
/// operation acts on the first `batch.rows()` rows (or `batch.logit_rows.len()` for the logits
/// path). Weights are uploaded once ([`Backend::upload_matrix`]); per-sequence state lives in
/// [`Backend::States`], addressed by slot.
/// The arithmetic of the products of affine (quantized) weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Products {
    /// Decoded weights times f32 activations, 32 lanes of FMAs (docs/numerics.md §2).
    #[default]
    F32,
    /// Activations as exact integers per block, integer sums, one f32 epilogue per unit
    /// (docs/numerics.md §2.2).
    Int,
}

impl Products {
    /// The environment variable programs may read the mode from ([`Products::from_env`]).
    pub const ENV: &'static str = "TENSORFOLD_PRODUCTS";

    /// The mode's name as the `--products` flag and [`Products::ENV`] spell it.
    pub fn name(self) -> &'static str {
        match self {
            Products::F32 => "f32",
            Products::Int => "int",
        }
    }

    /// The mode named by [`Products::ENV`]: `None` when it is unset or empty. For a program's
    /// edge (the command line, a test harness): no backend reads the environment; they take
    /// the mode from their constructors.
    ///
    /// # Errors
    /// [`ProductsError::Env`] for a value other than `f32` or `int` (or one not UTF-8).
    pub fn from_env() -> Result<Option<Self>, ProductsError> {
        match std::env::var(Self::ENV) {
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(ProductsError::Env { value: v.to_string_lossy().into_owned() }),
            Ok(v) if v.is_empty() => Ok(None),
            Ok(v) => v.parse().map(Some).map_err(|_| ProductsError::Env { value: v }),
        }
    }
}

impl std::fmt::Display for Products {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Products {
    type Err = ProductsError;
    /// `f32` or `int`.
    fn from_str(s: &str) -> Result<Self, ProductsError> {
        match s {
            "f32" => Ok(Products::F32),
            "int" => Ok(Products::Int),
            _ => Err(ProductsError::Unknown { value: s.to_string() }),
        }
    }
}

/// A products mode that is not one ([`Products`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProductsError {
    /// A name other than `f32` or `int`.
    #[error("unknown products mode `{value}` (expected f32 or int)")]
    Unknown { value: String },
    /// [`Products::ENV`] holds something other than `f32` or `int`.
    #[error("TENSORFOLD_PRODUCTS={value:?} is not a products mode: expected f32 or int (or unset it; --products overrides it)")]
    Env { value: String },
}

pub trait Backend {
    /// A weight matrix resident on the device.
    type Matrix;
    /// An f32 vector resident on the device.
    type Vector;
    /// An f32 activation buffer.
    type Tensor;
    /// The state (conv windows, recurrent states, KV caches) of every sequence slot.
    type States;

    /// A short description for logs (`cpu (avx512, 2 threads)`).
    fn describe(&self) -> String;
    /// The arithmetic of this backend's affine products (fixed when it is built, before any
    /// weight is uploaded): the logits and states it computes depend on it.
    fn products(&self) -> Products;
    /// The most rows (tokens) one step may hold; the engine splits prompts to fit. A step's
    /// logits rows are bounded by the same number.
    fn max_rows(&self) -> usize {
        usize::MAX
    }
    /// The most sequence slots allocated at once ([`Backend::alloc_slot`] refuses more).
    fn max_slots(&self) -> usize {
        usize::MAX
    }
    /// Refuses a model this backend cannot run, before any weight is uploaded
    /// ([`crate::model::Model::new`] asks first). The default runs every model.
    fn check_model(&self, _cfg: &ModelConfig) -> Result<(), BackendError> {
        Ok(())
    }
    fn upload_matrix(&self, m: &Matrix) -> Result<Self::Matrix, BackendError>;
    /// Called once when a model's weights are on the backend ([`crate::model::Model::new`]),
    /// before any step: a backend builds here what its kernels need over them (CUDA: the
    /// tables of expert weight addresses that its expert products read on the device). The
    /// default does nothing.
    fn prepare_model(&self, _weights: &Weights<Self::Matrix, Self::Vector>) -> Result<(), BackendError> {
        Ok(())
    }
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Vector, BackendError>;
    fn tensor(&self, rows: usize, cols: usize) -> Result<Self::Tensor, BackendError>;
    /// Copies the first `rows·cols` values of a tensor to the host.
    fn read_tensor(&self, t: &Self::Tensor, rows: usize, out: &mut Vec<f32>) -> Result<(), BackendError>;

    /// Empty state storage for `cfg`.
    fn new_states(&self, cfg: &ModelConfig) -> Result<Self::States, BackendError>;
    /// A fresh zero state (position 0) in a new slot.
    fn alloc_slot(&self, states: &mut Self::States) -> Result<u32, BackendError>;
    /// Releases a slot. A backend may keep its memory for the next [`Backend::alloc_slot`] (the
    /// CPU's does).
    fn free_slot(&self, states: &mut Self::States, slot: u32) -> Result<(), BackendError>;
    /// Position (tokens already processed) of a slot.
    fn slot_position(&self, states: &Self::States, slot: u32) -> Result<usize, BackendError>;
    /// Copies a slot's state to host memory (swap out, save, fork). The KV arrays hold exactly
    /// `position` rows.
    fn export_slot(&self, states: &Self::States, slot: u32) -> Result<SequenceState, BackendError>;
    /// Replaces a slot's state with `state` (swap in, restore).
    fn import_slot(&self, states: &mut Self::States, slot: u32, state: &SequenceState) -> Result<(), BackendError>;
    /// Gives slot `dst` the exact state and position of slot `src` (a snapshot of a prefix kept
    /// where the states are, a fork): both then continue as `src` would have. `dst` must be
    /// allocated; copying a slot onto itself does nothing. The default is
    /// [`Backend::export_slot`] then [`Backend::import_slot`] (through host memory); a device
    /// copies on the device.
    fn copy_slot(&self, states: &mut Self::States, src: u32, dst: u32) -> Result<(), BackendError> {
        if src == dst {
            self.slot_position(states, src)?;
            return Ok(());
        }
        self.slot_position(states, dst)?;
        let state = self.export_slot(states, src)?;
        self.import_slot(states, dst, &state)
    }
    /// A hint that about `bytes` of state memory (slots, KV pages, snapshots) will be allocated
    /// and freed over and over: a device may set that much aside now, so that those
    /// allocations do not have to map fresh memory later (CUDA: its memory pool keeps it). The
    /// default does nothing; a device that cannot set it aside allocates as it goes.
    fn reserve_state_memory(&self, bytes: u64) {
        let _ = bytes;
    }
    /// A new slot holding `src`'s state, as [`Backend::alloc_slot`] then [`Backend::copy_slot`]
    /// give, but read-only: no step may continue it until [`Backend::copy_slot`] or
    /// [`Backend::import_slot`] replaces its state (a backend that shares memory refuses such a
    /// step with [`BackendError::Slot`]), so a device may share memory with `src` (CUDA: the KV
    /// pages) rather than copy it. For snapshots of a prefix, resumed by copying them into
    /// another slot; the default is those two calls.
    fn snapshot_slot(&self, states: &mut Self::States, src: u32) -> Result<u32, BackendError> {
        let slot = self.alloc_slot(states)?;
        if let Err(e) = self.copy_slot(states, src, slot) {
            let _ = self.free_slot(states, slot);
            return Err(e);
        }
        Ok(slot)
    }
    /// Makes `batch` runnable: checks every sequence continues its slot at the right position,
    /// grows KV caches and the RoPE table to hold it, and loads the step description where the
    /// operations read it. Called before the operations of a step.
    fn begin_step(&self, states: &mut Self::States, batch: &Batch) -> Result<(), BackendError>;
    /// [`Backend::begin_step`] for a step whose operations write scratch buffers that hold
    /// `max_rows` rows and `max_logit_rows` logits rows ([`crate::model::Scratch`]): a device may
    /// then compute more rows than the step has, inert rows that touch no sequence's state,
    /// to run the step on a graph recorded for a larger shape. [`crate::model::Model::step`]
    /// and its greedy and sampling forms call this. The default is [`Backend::begin_step`].
    fn begin_step_within(&self, states: &mut Self::States, batch: &Batch, max_rows: usize, max_logit_rows: usize) -> Result<(), BackendError> {
        let _ = (max_rows, max_logit_rows);
        self.begin_step(states, batch)
    }
    /// Advances every slot of the step by its row count. Called after the operations.
    fn end_step(&self, states: &mut Self::States, batch: &Batch) -> Result<(), BackendError>;

    /// `x[r] = decode(table[ids[r]])` (spec E1).
    fn embed(&self, table: &Self::Matrix, batch: &Batch, x: &mut Self::Tensor);
    /// `out[r] = RMSNorm(x[r]; w)` with `w` the effective scale (numerics §3).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32, rows: usize, out: &mut Self::Tensor);
    /// `out_i[r] = W_i · x[r]` for every pair, all reading the same input (fused projections).
    fn matmul(&self, x: &Self::Tensor, rows: usize, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]);
    /// `u[r] = RMSNorm(x[r]; w)` (numerics §3), then `out_i[r] = W_i · u[r]`: a layer's norm
    /// and the projections that read it. Writes `u` too. The default is [`Backend::rms_norm`]
    /// then [`Backend::matmul`]; a device may compute the norm inside the product.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32, rows: usize, u: &mut Self::Tensor, outs: &mut [(&Self::Matrix, &mut Self::Tensor)]) {
        self.rms_norm(x, w, eps, rows, u);
        self.matmul(u, rows, outs);
    }
    /// `y[r] = W · x[r]`, then the residual add `h[r] = h[r] + y[r]` (numerics §3): the
    /// product that ends a mixer or an MLP. Writes `y` and `h`.
    fn matmul_residual(&self, x: &Self::Tensor, rows: usize, w: &Self::Matrix, y: &mut Self::Tensor, h: &mut Self::Tensor);
    /// `out[r] = silu(gate[r]) ⊙ up[r]` (spec M1).
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor, rows: usize, out: &mut Self::Tensor);
    /// The MLP's first half after its norm: `u = RMSNorm(x; w)`, `gate = W_gate·u`,
    /// `up = W_up·u`, `act = silu(gate) ⊙ up`, as [`Backend::rms_norm_matmul`] then
    /// [`Backend::swiglu`] (the default); a device may fuse them.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_matmul_swiglu(
        &self,
        x: &Self::Tensor,
        w: &Self::Vector,
        eps: f32,
        rows: usize,
        u: &mut Self::Tensor,
        gate_w: &Self::Matrix,
        up_w: &Self::Matrix,
        gate: &mut Self::Tensor,
        up: &mut Self::Tensor,
        act: &mut Self::Tensor,
    ) {
        self.rms_norm_matmul(x, w, eps, rows, u, &mut [(gate_w, &mut *gate), (up_w, &mut *up)]);
        self.swiglu(gate, up, rows, act);
    }
    /// The mixture-of-experts block after its norm (transformers `Qwen3_5MoeSparseMoeBlock`,
    /// docs/numerics.md §7.1): per row of `u`, the router's softmax over `E` experts, the top
    /// `num_experts_per_tok` (ties to the lower index), their weights renormalised when
    /// `norm_topk_prob`; `y = Σ_e w_e · expert_e(u)` in increasing expert index, plus
    /// `sigmoid(shared_expert_gate · u) · shared_expert(u)`; then the residual add `h = h + y`.
    /// Each row's bits depend on that row alone, however rows are grouped by expert. Writes `y`
    /// and `h` (`[rows, D]`). A backend that has no MoE kernels refuses such a model in
    /// [`Backend::check_model`] and is never asked.
    #[allow(clippy::too_many_arguments)]
    fn moe(&self, w: &MoeWeights<Self::Matrix>, cfg: &ModelConfig, rows: usize, u: &Self::Tensor, y: &mut Self::Tensor, h: &mut Self::Tensor);
    /// The Gated DeltaNet mixer after its input projections, spec (G2)–(G12): causal conv,
    /// SiLU, q/k L2 norms, gates, delta rule, gated RMSNorm. `layer` indexes the GDN layers.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_net(
        &self,
        w: &GatedDeltaNetWeights<Self::Matrix, Self::Vector>,
        layer: usize,
        cfg: &ModelConfig,
        batch: &Batch,
        states: &mut Self::States,
        qkv: &Self::Tensor,
        z: &Self::Tensor,
        b: &Self::Tensor,
        a: &Self::Tensor,
        out: &mut Self::Tensor,
    );
    /// The gated attention mixer after its input projections, spec (A1)–(A7): q/k RMSNorm,
    /// partial RoPE, KV cache write, causal softmax attention (GQA), sigmoid gate. `layer`
    /// indexes the full-attention layers.
    #[allow(clippy::too_many_arguments)]
    fn gated_attention(
        &self,
        w: &AttentionWeights<Self::Matrix, Self::Vector>,
        layer: usize,
        cfg: &ModelConfig,
        batch: &Batch,
        states: &mut Self::States,
        q_gate: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        out: &mut Self::Tensor,
    );
    /// `out[i] = x[batch.logit_rows[i]]`.
    fn gather_rows(&self, x: &Self::Tensor, batch: &Batch, out: &mut Self::Tensor);

    /// Queues greedy sampling of the first `rows` logits rows over ids `< v_eff`
    /// ([`crate::sampling::argmax`]'s arithmetic). A device does it where the logits are and
    /// writes each id where the next step reads its token; the default does nothing until
    /// [`Backend::argmax_read`].
    fn argmax_enqueue(&self, _logits: &Self::Tensor, _rows: usize, _v_eff: usize) {}

    /// Prepares sampling of the next step's logits rows on the device, one entry per row, before
    /// the step begins. Returns `false` when this backend does not sample these settings itself
    /// (the default); the caller then reads the logits and samples on the host, with the same
    /// result.
    fn set_sampling(&self, _rows: &[RowSampling]) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// Queues sampling of the first `rows` logits rows as [`Backend::set_sampling`] prepared.
    fn sample_enqueue(&self, _logits: &Self::Tensor, _rows: usize, _v_eff: usize) {}

    /// The ids of the last [`Backend::sample_enqueue`] (waits for the device).
    fn sample_read(&self, _logits: &Self::Tensor, _rows: usize, _v_eff: usize) -> Result<Vec<u32>, BackendError> {
        Err(BackendError::Device("this backend does not sample on the device".into()))
    }

    /// The ids of the last [`Backend::argmax_enqueue`] (waits for the device). The default
    /// reads the logits and takes the argmax on the host.
    fn argmax_read(&self, logits: &Self::Tensor, rows: usize, v_eff: usize) -> Result<Vec<u32>, BackendError> {
        let mut buf = Vec::new();
        self.read_tensor(logits, rows, &mut buf)?;
        let v = buf.len() / rows.max(1);
        Ok((0..rows).map(|r| crate::sampling::argmax(&buf[r * v..r * v + v_eff])).collect())
    }
}
