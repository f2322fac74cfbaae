//! The CPU backend: the numerical reference, and fast.
//!
//! Weights are used in place from the memory map. Each operation runs at once on the calling
//! thread (and, for the large ones, on the thread pool), with the arithmetic of
//! [`kernels`], which is the executable form of docs/numerics.md.

pub mod columns;
pub mod intdot;
pub mod kernels;
pub mod machine;
pub mod pool;
pub mod simd;

use crate::backend::{Backend, BackendError, Batch, Products, SequenceState};
use crate::config::ModelConfig;
use crate::model::rope::RopeTable;
use crate::model::weights::{AttentionWeights, GatedDeltaNetWeights, Matrix, MlpWeights, MoeWeights};
use columns::ColumnsMut;
use pool::ThreadPool;
use simd::{Isa, Transposed};
use std::cell::RefCell;
use std::sync::Mutex;

/// The CPU backend: an instruction set for the matrix products and a thread pool.
#[derive(Debug)]
pub struct Cpu {
    isa: Isa,
    products: Products,
    pool: ThreadPool,
    /// Buffers reused from step to step (no allocation per operation once warm).
    scratch: Mutex<Scratch>,
    /// A mixture-of-experts block's buffers (apart from `scratch`: the block's products lock
    /// that).
    moe: Mutex<MoeScratch>,
}

/// Reusable buffers of the calling thread's side of an operation.
#[derive(Debug, Default)]
struct Scratch {
    /// The input of a product in lane order, one per element width in use.
    xts: Vec<Transposed>,
    /// The input quantized for integer-exact products, one per plane layout in use.
    xqs: Vec<intdot::QuantRows>,
    /// `(output, first row, rows)` of each task of a product.
    tasks: Vec<(usize, usize, usize)>,
    /// GDN: `silu(conv)` rows.
    y: Vec<f32>,
}

/// Reusable buffers of [`Backend::moe`] on the CPU (`[rows, hidden]` ones are megabytes for a
/// prompt chunk): each is reshaped to every call's rows and grows to the largest call.
#[derive(Debug, Default)]
struct MoeScratch {
    /// Router logits and the shared expert's gate logit.
    router: Tensor,
    gate_logit: Tensor,
    /// The shared expert's output, the weighted sum of the routed experts' outputs, and one
    /// expert's input and output rows.
    shared: Tensor,
    acc: Tensor,
    xe: Tensor,
    ye: Tensor,
    /// Gate, up and activation of the MLP running (an expert's or the shared expert's).
    mlp: [Tensor; 3],
    /// Each expert's `(row, weight)` list.
    by_expert: Vec<Vec<(usize, f32)>>,
    probs: Vec<f32>,
    chosen: Vec<(u32, f32)>,
}

thread_local! {
    /// Per-thread scratch of the kernels: the decoded panel of a product; a GDN head's
    /// normalised q and k and delta-rule outputs; attention's queries and scores.
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static INTDOT: RefCell<intdot::Scratch> = RefCell::new(intdot::Scratch::default());
    static GDN: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static ATTN: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

impl Default for Cpu {
    fn default() -> Self {
        Self::new()
    }
}

/// Weight bytes one matmul task should cover: large enough that handing out tasks costs
/// little, small enough that two to sixty-four threads stay balanced.
const TASK_BYTES: usize = 96 * 1024;

/// Output rows per task of a prompt-sized product: every task streams all the step's inputs
/// once (traffic per FMA falls as 1 / rows), and smaller tasks balance the threads better at
/// the end of each product; 24 measured best of 24/48/96 with two threads.
const PANEL_TASK_ROWS: usize = 24;

impl Cpu {
    /// The fastest instruction set this CPU has ([`Isa::detect`]) and one thread per core
    /// (`TENSORFOLD_THREADS` overrides), with f32 products ([`Cpu::with_products`] to change).
    pub fn new() -> Self {
        let threads = std::env::var("TENSORFOLD_THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        Self::with(Isa::detect(), threads)
    }

    /// A backend with a given instruction set and thread count (tests compare them), with f32
    /// products ([`Cpu::with_products`] to change).
    pub fn with(isa: Isa, threads: usize) -> Self {
        Self { isa, products: Products::default(), pool: ThreadPool::new(threads), scratch: Mutex::new(Scratch::default()), moe: Mutex::new(MoeScratch::default()) }
    }

    /// This backend with the given form of the affine products (before the model is uploaded:
    /// the weights' layout depends on it).
    pub fn with_products(mut self, products: Products) -> Self {
        self.products = products;
        self
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Memory copy bandwidth with this backend's threads, bytes/s, one figure per copy
    /// ([`machine::copy_bandwidth`]).
    pub fn copy_bandwidth(&self, repeats: usize) -> Vec<f64> {
        machine::copy_bandwidth(&self.pool, repeats)
    }

    /// Read bandwidth samples in bytes/s with this backend's threads
    /// ([`machine::read_bandwidth`]).
    pub fn read_bandwidth(&self, repeats: usize) -> Vec<f64> {
        machine::read_bandwidth(&self.pool, repeats)
    }

    /// Float32 FMA peak of this backend's instruction set and threads, FLOP/s
    /// ([`machine::fma_peak`]).
    pub fn fma_peak(&self, iters: usize) -> f64 {
        machine::fma_peak(self.isa, &self.pool, iters)
    }
}

impl Cpu {
    /// `out = W_down · (silu(W_gate · x) ⊙ (W_up · x))` over `rows` rows (width `inter`, in
    /// `mlp`'s buffers): one expert of a mixture-of-experts block, with the dense MLP's
    /// operations.
    fn swiglu_mlp(&self, w: &MlpWeights, x: &Tensor, rows: usize, inter: usize, mlp: &mut [Tensor; 3], out: &mut Tensor) {
        let [gate, up, act] = mlp;
        for t in [&mut *gate, &mut *up, &mut *act] {
            t.reshape(rows, inter);
        }
        self.matmul(x, rows, &mut [(&w.gate_proj, gate), (&w.up_proj, up)]);
        self.swiglu(gate, up, rows, act);
        self.matmul(act, rows, &mut [(&w.down_proj, out)]);
    }

    /// `f(r0, r1)` over blocks of `rows` rows: on every thread for a prompt, in one call on
    /// this thread for decode (row-wise work: the split changes no bit).
    fn row_blocks(&self, rows: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let blocks = if rows <= 4 { 1 } else { (2 * self.threads()).min(rows) };
        self.pool.run(blocks, &|b| f(rows * b / blocks, rows * (b + 1) / blocks));
    }
}

/// A raw pointer that tasks on other threads may write through (each task its own outputs).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint elements; the pool joins them before the buffer is used again.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// A row-major f32 buffer `[rows, cols]` (capacity; operations use a prefix of the rows).
#[derive(Clone, Debug, Default)]
pub struct Tensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl Tensor {
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Makes this a `[rows, cols]` tensor in its own buffer, grown when too small (never
    /// shrunk). The values are stale: what reads them must write them first.
    fn reshape(&mut self, rows: usize, cols: usize) -> &mut Self {
        if self.data.len() < rows * cols {
            self.data.resize(rows * cols, 0.0);
        }
        (self.rows, self.cols) = (rows, cols);
        self
    }
}

/// Every sequence slot on the CPU, plus the shared RoPE table.
#[derive(Clone, Debug)]
pub struct CpuStates {
    cfg: ModelConfig,
    slots: Vec<Option<SequenceState>>,
    /// The states of freed slots, whose conv windows and recurrent states (the same size for
    /// every sequence) the next allocated slots reuse, so sequences that come and go neither
    /// allocate nor free them (bench/results/2026-12-03-cpu-soak-reuse.md). At most one per
    /// free slot: never more than the slots allocated at once.
    free: Vec<SequenceState>,
    rope: RopeTable,
}

impl CpuStates {
    /// The state in `slot`.
    pub fn get(&self, slot: u32) -> Result<&SequenceState, BackendError> {
        self.slots.get(slot as usize).and_then(Option::as_ref).ok_or_else(|| BackendError::Slot { slot: slot as usize, problem: "is not allocated".into() })
    }
    fn get_mut(&mut self, slot: u32) -> Result<&mut SequenceState, BackendError> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut).ok_or_else(|| BackendError::Slot { slot: slot as usize, problem: "is not allocated".into() })
    }
}

impl Backend for Cpu {
    type Matrix = Matrix;
    type Vector = Vec<f32>;
    type Tensor = Tensor;
    type States = CpuStates;

    fn describe(&self) -> String {
        let t = self.threads();
        let ints = if self.products == Products::Int { ", integer products" } else { "" };
        format!("cpu ({}, {t} thread{}{ints})", self.isa.name(), if t == 1 { "" } else { "s" })
    }

    fn products(&self) -> Products {
        self.products
    }

    fn upload_matrix(&self, m: &Matrix) -> Result<Matrix, BackendError> {
        Ok(m.clone())
    }

    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>, BackendError> {
        Ok(v.to_vec())
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<Tensor, BackendError> {
        Ok(Tensor { data: vec![0.0; rows * cols], rows, cols })
    }

    fn read_tensor(&self, t: &Tensor, rows: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.clear();
        out.extend_from_slice(&t.data[..rows * t.cols]);
        Ok(())
    }

    fn new_states(&self, cfg: &ModelConfig) -> Result<CpuStates, BackendError> {
        Ok(CpuStates { cfg: cfg.clone(), slots: Vec::new(), free: Vec::new(), rope: RopeTable::new(cfg.rotary_dim(), cfg.rope_theta) })
    }

    fn alloc_slot(&self, states: &mut CpuStates) -> Result<u32, BackendError> {
        let s = match states.free.pop() {
            Some(mut s) => {
                s.clear();
                s
            }
            None => SequenceState::new(&states.cfg),
        };
        if let Some(i) = states.slots.iter().position(Option::is_none) {
            states.slots[i] = Some(s);
            return Ok(i as u32);
        }
        states.slots.push(Some(s));
        Ok(states.slots.len() as u32 - 1)
    }

    fn free_slot(&self, states: &mut CpuStates, slot: u32) -> Result<(), BackendError> {
        states.get(slot)?;
        let mut s = states.slots[slot as usize].take().expect("allocated: checked above");
        // Not the KV caches: their size follows the sequence, so kept, each slot would hold the
        // longest sequence it ever ran. They go back to the allocator (under `serve`, to the
        // system: crate::hostmem).
        for a in s.keys.iter_mut().chain(&mut s.values) {
            *a = Vec::new();
        }
        states.free.push(s);
        Ok(())
    }

    fn slot_position(&self, states: &CpuStates, slot: u32) -> Result<usize, BackendError> {
        Ok(states.get(slot)?.position)
    }

    fn export_slot(&self, states: &CpuStates, slot: u32) -> Result<SequenceState, BackendError> {
        Ok(states.get(slot)?.clone())
    }

    fn import_slot(&self, states: &mut CpuStates, slot: u32, state: &SequenceState) -> Result<(), BackendError> {
        state.check(&states.cfg)?;
        // In place: the slot's arrays keep their allocations.
        states.get_mut(slot)?.clone_from(state);
        Ok(())
    }

    fn copy_slot(&self, states: &mut CpuStates, src: u32, dst: u32) -> Result<(), BackendError> {
        states.get(src)?;
        states.get(dst)?;
        if src != dst {
            // In place, as import_slot.
            let mut to = states.slots[dst as usize].take().expect("allocated: checked above");
            to.clone_from(states.get(src).expect("checked above"));
            states.slots[dst as usize] = Some(to);
        }
        Ok(())
    }

    fn begin_step(&self, states: &mut CpuStates, batch: &Batch) -> Result<(), BackendError> {
        batch.validate()?;
        batch.check_ids(states.cfg.vocab_size)?;
        let max = states.cfg.max_position_embeddings;
        let width = states.cfg.num_key_value_heads * states.cfg.head_dim;
        let mut top = 0;
        for s in &batch.seqs {
            let st = states.get_mut(s.slot)?;
            if st.position != s.pos as usize {
                return Err(BackendError::Slot { slot: s.slot as usize, problem: format!("is at position {}, but the step continues it at {}", st.position, s.pos) });
            }
            let end = (s.pos + s.len) as usize;
            if end > max {
                return Err(BackendError::ContextFull { position: end - 1, max });
            }
            for (k, v) in st.keys.iter_mut().zip(st.values.iter_mut()) {
                k.resize(end * width, 0.0);
                v.resize(end * width, 0.0);
            }
            top = top.max(end);
        }
        states.rope.ensure(top);
        Ok(())
    }

    fn end_step(&self, states: &mut CpuStates, batch: &Batch) -> Result<(), BackendError> {
        for s in &batch.seqs {
            states.get_mut(s.slot)?.position += s.len as usize;
        }
        Ok(())
    }

    fn embed(&self, table: &Matrix, batch: &Batch, x: &mut Tensor) {
        kernels::embed(table, &batch.ids, &mut x.data);
    }

    fn rms_norm(&self, x: &Tensor, w: &Vec<f32>, eps: f32, rows: usize, out: &mut Tensor) {
        let (c, isa) = (x.cols, self.isa);
        // The threads write through a raw pointer: check the shapes once, here.
        assert!(out.cols == c && rows * c <= out.data.len() && rows * c <= x.data.len(), "rms_norm: {rows} rows of {c} into a [{}, {}] tensor", out.rows, out.cols);
        let out_p = SendPtr(out.data.as_mut_ptr());
        self.row_blocks(rows, &|r0, r1| {
            // SAFETY: this block writes only rows r0..r1 of `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(out_p.get().add(r0 * c), (r1 - r0) * c) };
            for r in r0..r1 {
                simd::rms_norm_row(isa, &x.data[r * c..(r + 1) * c], w, eps, &mut o[(r - r0) * c..(r - r0 + 1) * c]);
            }
        });
    }

    fn matmul_residual(&self, x: &Tensor, rows: usize, w: &Matrix, y: &mut Tensor, h: &mut Tensor) {
        debug_assert_eq!(h.cols, y.cols);
        self.matmul(x, rows, &mut [(w, &mut *y)]);
        // Element-wise, so prompt rows split across the threads (the add was serial).
        let c = h.cols;
        assert!(rows * c <= h.data.len() && rows * c <= y.data.len(), "matmul_residual: {rows} rows of {c}");
        let (h_p, y) = (SendPtr(h.data.as_mut_ptr()), &*y);
        self.row_blocks(rows, &|r0, r1| {
            // SAFETY: this block writes only rows r0..r1 of `h`, inside its first rows · c floats.
            let hr = unsafe { std::slice::from_raw_parts_mut(h_p.get().add(r0 * c), (r1 - r0) * c) };
            for (a, &b) in hr.iter_mut().zip(&y.data[r0 * c..r1 * c]) {
                *a += b;
            }
        });
    }

    fn matmul(&self, x: &Tensor, rows: usize, outs: &mut [(&Matrix, &mut Tensor)]) {
        if rows == 0 {
            return;
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch { xts, xqs, tasks, .. } = &mut *guard;
        // Integer-exact products read the input quantized, once per plane layout; the others
        // read it in lane order, once per element width (fused products share them).
        let layout = |w: &Matrix| if self.products == Products::Int { intdot::Layout::of(w) } else { None };
        let mut widths: Vec<usize> = Vec::with_capacity(outs.len());
        let mut layouts: Vec<intdot::Layout> = Vec::new();
        for (w, _) in outs.iter() {
            debug_assert_eq!(w.cols, x.cols);
            if let Some(l) = layout(w) {
                if !layouts.contains(&l) {
                    layouts.push(l);
                }
                continue;
            }
            let pw = w.elems_per_word();
            if !widths.contains(&pw) {
                widths.push(pw);
            }
        }
        if xqs.len() < layouts.len() {
            xqs.resize(layouts.len(), intdot::QuantRows::default());
        }
        for (xq, &l) in xqs.iter_mut().zip(&layouts) {
            xq.shape(self.isa, rows, x.cols, l);
            let base = xq.base();
            let xq = &*xq;
            self.row_blocks(rows, &|r0, r1| {
                // SAFETY: this block writes only rows r0..r1; `base` is this buffer's after `shape`.
                unsafe { xq.fill_rows(base, &x.data, r0, r1) };
            });
        }
        if xts.len() < widths.len() {
            xts.resize(widths.len(), Transposed::default());
        }
        for (xt, &pw) in xts.iter_mut().zip(&widths) {
            xt.shape(rows, x.cols, pw);
            // Rows in parallel for prompts (a serial transpose left the other threads idle).
            let base = SendPtr(xt.base_mut());
            let (xt, cols, isa) = (&*xt, x.cols, self.isa);
            self.row_blocks(rows, &|r0, r1| {
                // SAFETY: this block writes only rows r0..r1; `base` is this buffer's after `shape`.
                unsafe { xt.fill_rows(isa, base.get(), &x.data, cols, r0, r1) };
            });
        }
        // Tasks: runs of output rows of each matrix, about TASK_BYTES of weights each (scaled
        // down when many tokens share the panel, so prefill splits finer), in whole row blocks
        // of the kernel.
        let granule = simd::row_granule(self.isa, rows);
        let threads = self.threads();
        tasks.clear();
        for (i, (w, _)) in outs.iter().enumerate() {
            let per_task = if rows <= 4 {
                // Decode: about TASK_BYTES of weights per task.
                TASK_BYTES / w.row_bytes().max(1)
            } else {
                // Prompt: up to PANEL_TASK_ROWS rows, fewer when that leaves under 4 tasks
                // per thread.
                PANEL_TASK_ROWS.min(w.rows / (4 * threads))
            };
            let granule = if layout(w).is_some() { intdot::row_granule(self.isa, w, rows).unwrap_or(granule) } else { granule };
            let per_task = per_task.max(granule).div_ceil(granule) * granule;
            let mut n = 0;
            while n < w.rows {
                let c = per_task.min(w.rows - n);
                tasks.push((i, n, c));
                n += c;
            }
        }
        let ys: Vec<(SendPtr, usize, usize)> = outs.iter_mut().map(|(_, y)| (SendPtr(y.data.as_mut_ptr()), y.cols, y.data.len())).collect();
        // Each matrix with the input it reads: an index into `xqs` (Ok) or `xts` (Err).
        let ws: Vec<(&Matrix, Result<usize, usize>)> = outs
            .iter()
            .map(|(w, _)| {
                let input = match layout(w) {
                    Some(l) => Ok(layouts.iter().position(|&m| m == l).unwrap()),
                    None => Err(widths.iter().position(|&p| p == w.elems_per_word()).unwrap()),
                };
                (&**w, input)
            })
            .collect();
        let (isa, tasks, xts, xqs) = (self.isa, &*tasks, &*xts, &*xqs);
        self.pool.run(tasks.len(), &|k| {
            let (i, n0, count) = tasks[k];
            let (w, input) = ws[i];
            let (ptr, ldy, len) = ys[i];
            debug_assert!(rows * ldy <= len && n0 + count <= ldy);
            match input {
                Ok(q) => INTDOT.with(|s| {
                    // SAFETY: as below.
                    unsafe { intdot::matmul(isa, w, &xqs[q], ptr.get(), ldy, n0, count, &mut s.borrow_mut()) };
                }),
                Err(xi) => PANEL.with(|panel| {
                    // SAFETY: the buffer holds `rows · ldy` floats; task k writes only columns
                    // n0..n0+count of its output, and tasks of one output cover disjoint columns.
                    unsafe { simd::matmul(isa, w, &xts[xi], ptr.get(), ldy, n0, count, &mut panel.borrow_mut()) };
                }),
            }
        });
    }

    fn swiglu(&self, gate: &Tensor, up: &Tensor, rows: usize, out: &mut Tensor) {
        let n = rows * gate.cols;
        // The threads write through a raw pointer: check the sizes once, here.
        assert!(n <= out.data.len() && n <= gate.data.len() && n <= up.data.len(), "swiglu: {n} values into {}", out.data.len());
        // Element-wise: prompt-sized calls split across the threads in 16-float blocks.
        let blocks = if n < 64 * 1024 { 1 } else { 2 * self.threads() };
        let (isa, out_p) = (self.isa, SendPtr(out.data.as_mut_ptr()));
        self.pool.run(blocks, &|b| {
            let (i0, i1) = ((n * b / blocks) & !15, if b + 1 == blocks { n } else { (n * (b + 1) / blocks) & !15 });
            // SAFETY: block b writes only out[i0..i1], inside the buffer's first n floats.
            let o = unsafe { std::slice::from_raw_parts_mut(out_p.get().add(i0), i1 - i0) };
            simd::swiglu(isa, &gate.data[i0..i1], &up.data[i0..i1], o);
        });
    }

    fn moe(&self, w: &MoeWeights, cfg: &ModelConfig, rows: usize, u: &Tensor, y: &mut Tensor, h: &mut Tensor) {
        let moe = cfg.moe.expect("a mixture-of-experts layer in a model whose config has no experts");
        let d = u.cols;
        assert!(y.cols == d && h.cols == d && rows * d <= y.data.len() && rows * d <= h.data.len(), "moe: {rows} rows of {d}");
        if rows == 0 {
            return;
        }
        let mut guard = self.moe.lock().unwrap_or_else(|e| e.into_inner());
        let MoeScratch { router, gate_logit, shared, acc, xe, ye, mlp, by_expert, probs, chosen } = &mut *guard;
        // Router logits and the shared expert's gate logit: two products reading u.
        self.matmul(u, rows, &mut [(&w.gate, router.reshape(rows, moe.num_experts)), (&w.shared_expert_gate, gate_logit.reshape(rows, 1))]);
        self.swiglu_mlp(&w.shared_expert, u, rows, moe.shared_expert_intermediate_size, mlp, shared.reshape(rows, d));
        // Each row's experts, then each expert's rows (in row order) with their weights.
        by_expert.resize_with(moe.num_experts, Vec::new);
        for list in by_expert.iter_mut() {
            list.clear();
        }
        for r in 0..rows {
            kernels::moe_route(router.row(r), moe.num_experts_per_tok, moe.norm_topk_prob, probs, chosen);
            for &(e, wt) in chosen.iter() {
                by_expert[e as usize].push((r, wt));
            }
        }
        // acc[r] = Σ_e w_e · expert_e(u[r]), expert by expert in increasing index: a row's terms
        // are added in that order whatever other rows an expert serves (numerics §7.1).
        acc.reshape(rows, d).data[..rows * d].fill(0.0);
        for (e, list) in by_expert.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let n = list.len();
            xe.reshape(n, d);
            for (i, &(r, _)) in list.iter().enumerate() {
                xe.data[i * d..(i + 1) * d].copy_from_slice(u.row(r));
            }
            self.swiglu_mlp(&w.experts[e], xe, n, moe.moe_intermediate_size, mlp, ye.reshape(n, d));
            for (i, &(r, wt)) in list.iter().enumerate() {
                for (a, &v) in acc.data[r * d..(r + 1) * d].iter_mut().zip(ye.row(i)) {
                    *a += v * wt;
                }
            }
        }
        // y = acc + sigmoid(gate) · shared; h = h + y.
        for r in 0..rows {
            let g = crate::numerics::sigmoid(gate_logit.data[r]);
            let (yr, hr) = (&mut y.data[r * d..(r + 1) * d], &mut h.data[r * d..(r + 1) * d]);
            for j in 0..d {
                yr[j] = acc.data[r * d + j] + g * shared.data[r * d + j];
                hr[j] += yr[j];
            }
        }
    }

    fn gated_delta_net(
        &self,
        w: &GatedDeltaNetWeights,
        layer: usize,
        cfg: &ModelConfig,
        batch: &Batch,
        states: &mut CpuStates,
        qkv: &Tensor,
        z: &Tensor,
        b: &Tensor,
        a: &Tensor,
        out: &mut Tensor,
    ) {
        let (cd, hv) = (cfg.conv_dim(), cfg.linear_num_value_heads);
        let dv = cfg.linear_value_head_dim;
        let head_state = dv * cfg.linear_key_head_dim;
        let isa = self.isa;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch { y, .. } = &mut *guard;
        for s in &batch.seqs {
            let st = states.get_mut(s.slot).expect("slot checked in begin_step");
            let (r0, n) = (s.first_row as usize, s.len as usize);
            let rows = |t: &Tensor| r0 * t.cols..(r0 + n) * t.cols;
            // Step 1: conv + SiLU, channels split across threads (they write every value of y,
            // so it is only grown, never cleared).
            if y.len() < n * cd {
                y.resize(n * cd, 0.0);
            }
            let blocks = (n * cd).div_ceil(16 * 1024).clamp(1, 4 * self.threads());
            let kc = cfg.linear_conv_kernel_dim;
            // The tasks write through raw pointers: check the buffers hold what they cover, here.
            assert!(st.conv[layer].len() >= (kc - 1) * cd && st.recurrent[layer].len() >= hv * head_state, "gated_delta_net: state of layer {layer}");
            assert!(out.cols == hv * dv && rows(out).end <= out.data.len(), "gated_delta_net: {n} rows into a [{}, {}] tensor", out.rows, out.cols);
            let (conv_p, y_p) = (SendPtr(st.conv[layer].as_mut_ptr()), SendPtr(y.as_mut_ptr()));
            let qkv_rows = &qkv.data[rows(qkv)];
            self.pool.run(blocks, &|i| {
                // Blocks of whole 16-channel vectors.
                let (ch0, ch1) = ((cd * i / blocks) & !15, if i + 1 == blocks { cd } else { (cd * (i + 1) / blocks) & !15 });
                // SAFETY: the window holds Kc−1 rows of cd floats and y n rows (asserted / grown
                // above); block i alone touches channels ch0..ch1 of either (the blocks' ranges
                // are disjoint), and the pool joins every block before the buffers are used again.
                let (conv, y) = unsafe { (ColumnsMut::new(conv_p.get(), kc - 1, cd, ch0..ch1), ColumnsMut::new(y_p.get(), n, cd, ch0..ch1)) };
                kernels::gdn_conv(isa, cfg, &w.conv1d, conv, qkv_rows, n, y);
            });
            // Steps 2–5: one task per value head (each normalises its key head's q and k).
            let (state_p, out_p) = (SendPtr(st.recurrent[layer].as_mut_ptr()), SendPtr(out.data.as_mut_ptr()));
            let (out_start, ocols) = (rows(out).start, out.cols);
            let (zr, br, ar) = (&z.data[rows(z)], &b.data[rows(b)], &a.data[rows(a)]);
            let y = &*y;
            self.pool.run(hv, &|h| {
                // SAFETY: head h alone touches its state rows (h·head_state.., inside the state)
                // and columns h·dv..(h+1)·dv of the sequence's n output rows (inside `out`, asserted
                // above); the pool joins every head before either buffer is used again.
                let state_h = unsafe { std::slice::from_raw_parts_mut(state_p.get().add(h * head_state), head_state) };
                let out_h = unsafe { ColumnsMut::new(out_p.get().add(out_start), n, ocols, h * dv..(h + 1) * dv) };
                GDN.with(|qk| kernels::gdn_head(isa, cfg, w, h, state_h, y, zr, br, ar, n, &mut qk.borrow_mut(), out_h));
            });
        }
    }

    fn gated_attention(
        &self,
        w: &AttentionWeights,
        layer: usize,
        cfg: &ModelConfig,
        batch: &Batch,
        states: &mut CpuStates,
        q_gate: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &mut Tensor,
    ) {
        let CpuStates { slots, rope, .. } = states;
        let (hq, dh) = (cfg.num_attention_heads, cfg.head_dim);
        for s in &batch.seqs {
            let st = slots[s.slot as usize].as_mut().expect("slot checked in begin_step");
            let (r0, n, pos) = (s.first_row as usize, s.len as usize, s.pos as usize);
            let rows = |t: &Tensor| r0 * t.cols..(r0 + n) * t.cols;
            kernels::attention_write_kv(self.isa, cfg, w, rope, pos, n, &k.data[rows(k)], &v.data[rows(v)], &mut st.keys[layer], &mut st.values[layer]);
            let (keys, values, rope) = (&st.keys[layer], &st.values[layer], &*rope);
            let qg = &q_gate.data[rows(q_gate)];
            let out_p = SendPtr(out.data.as_mut_ptr());
            let (isa, qcols, ocols) = (self.isa, q_gate.cols, out.cols);
            let hkv = cfg.num_key_value_heads;
            let gs = hq / hkv;
            // One task per (token, KV group): the group's query heads read the cache once.
            self.pool.run(n * hkv, &|i| {
                let (t, g) = (i / hkv, i % hkv);
                // SAFETY: task (t, g) writes only the outputs of heads g·G..(g+1)·G in row r0 + t.
                let dst = unsafe { std::slice::from_raw_parts_mut(out_p.get().add((r0 + t) * ocols + g * gs * dh), gs * dh) };
                ATTN.with(|scratch| {
                    kernels::attention_group(isa, cfg, w, rope, pos + t, g, &qg[t * qcols..(t + 1) * qcols], keys, values, &mut scratch.borrow_mut(), dst);
                });
            });
        }
    }

    fn argmax_read(&self, logits: &Tensor, rows: usize, v_eff: usize) -> Result<Vec<u32>, BackendError> {
        // In place: the default copies the logits rows out first.
        let c = logits.cols;
        Ok((0..rows).map(|r| crate::sampling::argmax(&logits.data[r * c..r * c + v_eff])).collect())
    }

    fn gather_rows(&self, x: &Tensor, batch: &Batch, out: &mut Tensor) {
        let c = x.cols;
        for (i, &r) in batch.logit_rows.iter().enumerate() {
            out.data[i * c..(i + 1) * c].copy_from_slice(x.row(r as usize));
        }
    }
}
