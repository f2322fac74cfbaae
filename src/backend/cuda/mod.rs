//! The CUDA backend: NVIDIA GPUs through the driver API, loaded at run time (cudarc with
//! `dynamic-loading`), kernels compiled with NVRTC at start (see [`compile`]).
//!
//! Every kernel (`kernels/*.cu`) names its CPU twin and reproduces its bits. A decode step is
//! one CUDA graph launch: the first time a step of a given shape runs on a given set of
//! buffers, its kernel launches are captured into a graph; later steps of that shape replay it.
//! What changes from token to token (ids, positions, which slot) is uploaded before the launch
//! into fixed device buffers that the kernels read, so the same graph serves every token and
//! every session. The capture is transparent to the model code: `forward` runs as usual, and the
//! backend records (first time) or skips (replays) its operations, launching the graph in
//! `end_step`.
//!
//! Lifetimes: all work runs on one stream and every buffer is freed in stream order
//! (`cuMemFreeAsync`), so memory is never released under a running kernel. No API of this
//! backend returns with device work that reads host memory still pending.

pub mod compile;
mod timeline;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::backend::cpu::kernels::ATTENTION_TILE;
use crate::backend::{Backend, BackendError, Batch, Products, SequenceState};
use crate::config::ModelConfig;
use crate::model::rope::RopeTable;
use crate::model::weights::{AttentionWeights, Ffn, FloatType, GatedDeltaNetWeights, Matrix, MatrixData, MlpWeights, MoeWeights, Weights};

fn dev_err(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("CUDA: {what}: {e:?}"))
}

/// Whether a CUDA driver can be loaded on this machine.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices (0 when there is no driver or no device).
pub fn device_count() -> usize {
    if !driver_available() {
        return 0;
    }
    CudaContext::device_count().map(|n| n.max(0) as usize).unwrap_or(0)
}

/// Largest number of rows (tokens) one step may hold on this backend, and of logits rows.
pub const MAX_ROWS: usize = 4096;
/// Most rows of a step recorded as a graph: decode steps, one token per sequence. Larger decode
/// steps run eagerly.
pub const GRAPH_MAX_ROWS: usize = 256;
/// The row counts decode graphs are recorded for: a decode step of `n` rows runs on the graph of
/// the smallest bucket `>= n` that its scratch buffers hold, the rows past `n` inert (they
/// compute on [`PAD_SLOT`], a slot no sequence has). A step whose scratch holds no bucket `>= n`
/// gets a graph of its own shape.
pub const DECODE_BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
/// Steps of up to this many rows take the attention kernels' decode shape (more blocks per head,
/// a warp per work item; any shape gives the same bits).
const ATTN_DECODE_ROWS: usize = 64;
/// Slots the device-side slot table holds for sequences.
pub const MAX_SLOTS: usize = 1024;
/// The slot-table entry of the inert rows that pad a decode step to its graph's bucket: a state
/// of its own (one KV page per attention layer), never a sequence's. Its rows all sit at
/// position 0; they race on its memory, which nothing reads for a real row.
const PAD_SLOT: u32 = MAX_SLOTS as u32;
/// Fewest rows the argmax and device-sampler buffers are made for (they grow by powers of two).
const CHOOSER_MIN_ROWS: usize = 64;
/// Slices per row of the two-pass argmax (`PARTS` in argmax.cu).
const ARGMAX_PARTS: usize = 64;
/// Value rows per block of `gdn_scan` (gdn_prompt.cu SCAN_WARPS).
const GDN_SCAN_WARPS: u32 = 4;

/// The bucket a decode step of `n` rows runs in when its buffers hold `cap` rows: the smallest of
/// [`DECODE_BUCKETS`] that is `>= n` and `<= cap`, else `n`.
fn bucket(n: usize, cap: usize) -> usize {
    DECODE_BUCKETS.iter().copied().find(|&b| b >= n && b <= cap).unwrap_or(n)
}
/// Most blocks per query head of `attn_scores` and `attn_tiles` in decode steps, whose work
/// items are a tile's 32 positions or 32 values (any number gives the same bits;
/// `TENSORFOLD_ATTN_BLOCKS` overrides it, for measuring). 128: up to 4 096 positions every item
/// of a head of 256 values has its own block. Prompt steps use at most 32.
const ATTN_BLOCKS: u32 = 128;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SeqDesc {
    slot: u32,
    first_row: u32,
    len: u32,
    pos: u32,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SlotDesc {
    conv: u64,
    rec: u64,
    pages: u64,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RowDesc {
    slot: u32,
    pos: u32,
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MatDesc {
    w: u64,
    sb: u64,
    y: u64,
    /// Residual stream to add the output to (0: none).
    res: u64,
    rows: u32,
    cols: u32,
    fmt: u32,
    group: u32,
    sdtype: u32,
    ldy: u32,
    row0: u32,
    /// 1: `offset_rows` is set (4-bit codes with 16-bit scales); 2: every row passes, the
    /// kernels read no bitmap.
    offset: u32,
    /// Bit `r % 32` of word `r / 32`: every group of row `r` passes [`offset_exact`], so the
    /// one-token kernels may decode that row with matmul.cu's offset decode (0: none).
    offset_rows: u64,
}
impl MatDesc {
    /// The descriptor of product `y = m·x`, whose rows start at block row `row0` of the launch.
    fn new(m: &CudaMatrix, y: &CudaTensor, row0: u32, stream: &CudaStream) -> Self {
        Self {
            w: ptr(&m.w, stream),
            sb: ptr(&m.sb, stream),
            y: ptr(&y.buf, stream),
            res: 0,
            rows: m.rows as u32,
            cols: m.cols as u32,
            fmt: m.fmt,
            group: m.group,
            sdtype: m.sdtype,
            ldy: y.cols as u32,
            row0,
            offset: if m.offset_all { 2 } else { m.offset_rows.is_some() as u32 },
            offset_rows: m.offset_rows.as_ref().map_or(0, |r| ptr(r, stream)),
        }
    }
}
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MatDescs {
    m: [MatDesc; 4],
    count: u32,
    pad: [u32; 3],
}
/// Kernel arguments by value, in the kernel's parameter order, for `cuLaunchKernelEx` (which
/// reads each through a pointer). Each value sits in its own 8-byte-aligned heap buffer, so the
/// pointers stay valid while the list grows.
struct Args<'a> {
    stream: &'a CudaStream,
    vals: Vec<Vec<u64>>,
}
impl Args<'_> {
    /// A plain value (an integer, a float, a `#[repr(C)]` descriptor).
    fn val<T: DeviceRepr + Copy>(mut self, v: T) -> Self {
        let mut words = vec![0u64; std::mem::size_of::<T>().div_ceil(8).max(1)];
        // SAFETY: `words` holds at least size_of::<T>() bytes; T is Copy (plain data).
        unsafe { std::ptr::copy_nonoverlapping(&v as *const T as *const u8, words.as_mut_ptr() as *mut u8, std::mem::size_of::<T>()) };
        self.vals.push(words);
        self
    }
    /// A device buffer's address.
    fn buf<T>(self, b: &CudaSlice<T>) -> Self {
        let p = ptr(b, self.stream);
        self.val(p)
    }
}
// SAFETY: plain-old-data structs with the layout of the C structs in kernels/*.cu.
unsafe impl DeviceRepr for SeqDesc {}
unsafe impl DeviceRepr for SlotDesc {}
unsafe impl DeviceRepr for RowDesc {}
unsafe impl DeviceRepr for MatDescs {}
// SAFETY: all-zero bytes are a valid value of each (integers only).
unsafe impl cudarc::driver::ValidAsZeroBits for SeqDesc {}
unsafe impl cudarc::driver::ValidAsZeroBits for SlotDesc {}
unsafe impl cudarc::driver::ValidAsZeroBits for RowDesc {}

/// A weight matrix on the device: codes (or float values) as stored in the checkpoint; for
/// affine formats the scales and biases interleaved per group (`[rows, groups]` pairs of the
/// stored dtype), so a kernel loads both with one instruction.
pub struct CudaMatrix {
    pub rows: usize,
    pub cols: usize,
    fmt: u32,
    group: u32,
    sdtype: u32,
    /// For 4-bit codes with 16-bit scales, a bit per row: every group of the row passes
    /// [`offset_exact`], so the one-token kernels may decode it without a subtraction.
    offset_rows: Option<CudaSlice<u32>>,
    /// Every bit of `offset_rows` is set (the common case for MLX checkpoints, whose bias is of
    /// the order of a few scales; a group fails when `b − 128·s` is not exact in f32, or s or b
    /// is zero, or the two are 2^20 or more apart).
    offset_all: bool,
    per_word: usize,
    w: CudaSlice<u8>,
    sb: CudaSlice<u8>,
}

/// `IntMat` of matmul_int.cu: one matrix of an integer-exact product.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IntMatDesc {
    w: u64,
    sb: u64,
    y: u64,
    res: u64,
    rows: u32,
    cols: u32,
    group: u32,
    ldy: u32,
    tile0: u32,
    pad: u32,
}
/// `IntMats` of matmul_int.cu: the matrices of one launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IntMatDescs {
    m: [IntMatDesc; 4],
    count: u32,
    pad: [u32; 3],
}
impl IntMatDesc {
    /// Matrix `m` writing `y` (and adding it to `res` when non-zero), its rows from launch row
    /// or tile `tile0`.
    fn new(m: &CudaMatrix, y: &CudaTensor, res: u64, tile0: u32, stream: &CudaStream) -> Self {
        Self {
            w: ptr(&m.w, stream),
            sb: ptr(&m.sb, stream),
            y: ptr(&y.buf, stream),
            res,
            rows: m.rows as u32,
            cols: m.cols as u32,
            group: m.group,
            ldy: y.cols as u32,
            tile0,
            pad: 0,
        }
    }
}
/// The widest input a one-token integer product quantizes in its own blocks (matmul_int.cu
/// `ONE_TOKEN_COLS`); wider ones take `quantize_rows` and the small tile.
const INT_ONE_TOKEN_COLS: usize = 12288;
/// `IntIn` of matmul_int.cu: the quantized input rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IntInDesc {
    planes: u64,
    d: u64,
    ds64: u64,
    ds32: u64,
    tokens: u32,
    blocks: u32,
    kpad: u32,
    pad: u32,
}
// SAFETY: plain-old-data with the layout of the C structs in matmul_int.cu.
unsafe impl DeviceRepr for IntMatDesc {}
unsafe impl DeviceRepr for IntInDesc {}
unsafe impl DeviceRepr for IntMatDescs {}

/// Device buffers of the quantized input of integer-exact products: `rows` rows of up to
/// `cols` (a multiple of 64) elements, as `quantize_rows` writes them.
struct IntScratch {
    rows: usize,
    cols: usize,
    /// `[rows][3][cols]` int8 planes.
    planes: CudaSlice<i8>,
    /// `[rows][cols/64]` block scales, and `d·f32(Σxi)` per block.
    d: CudaSlice<f32>,
    ds64: CudaSlice<f32>,
    /// `[rows][cols/32]`: `d·f32(Σxi)` per half block.
    ds32: CudaSlice<f32>,
}

impl IntScratch {
    fn new(stream: &Arc<CudaStream>, rows: usize, cols: usize) -> Result<Self, BackendError> {
        let e = |e| dev_err("allocating the integer-product input", e);
        Ok(Self {
            rows,
            cols,
            planes: stream.alloc_zeros::<i8>(rows * 3 * cols).map_err(e)?,
            d: stream.alloc_zeros::<f32>(rows * cols / 64).map_err(e)?,
            ds64: stream.alloc_zeros::<f32>(rows * cols / 64).map_err(e)?,
            ds32: stream.alloc_zeros::<f32>(rows * cols / 32).map_err(e)?,
        })
    }
}

/// Device buffers of a mixture-of-experts block (`Cuda::moe`) for `rows` rows: the router's
/// logits and choices, the shared expert, and the (row, expert) pairs grouped by expert.
struct MoeScratch {
    rows: usize,
    /// `[rows, E]` router logits; `[rows, 1]` the shared gate's logit.
    logits: CudaTensor,
    gate_logit: CudaTensor,
    /// `[rows, k]`: each row's experts in increasing index and their weights (`moe_route`).
    experts: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    /// `[rows·k]`: the row of each grouped pair, and the grouped index of each row's pairs;
    /// `1 + 3·items` the work list of the expert products (`moe_plan`).
    perm: CudaSlice<u32>,
    slot: CudaSlice<u32>,
    items: CudaSlice<u32>,
    /// The shared expert: `[rows, I_s]` gate, up and SwiGLU, `[rows, D]` output.
    shared_gate: CudaTensor,
    shared_up: CudaTensor,
    shared_act: CudaTensor,
    shared: CudaTensor,
    /// The grouped pairs: `[rows·k, D]` inputs, `[rows·k, I_e]` gate, up, SwiGLU, `[rows·k, D]` outputs.
    xe: CudaTensor,
    ge: CudaTensor,
    ue: CudaTensor,
    ae: CudaTensor,
    oe: CudaTensor,
}

/// Most work items of `moe_plan` for `pairs` (row, expert) pairs over `experts` experts in
/// tiles of `tile`: each expert used makes ⌈n_e / tile⌉ ≤ n_e / tile + 1 items.
fn moe_items(pairs: usize, experts: usize, tile: usize) -> usize {
    pairs.div_ceil(tile) + experts.min(pairs)
}

/// The tokens per item and rows per warp of the expert products for a step of `rows` rows
/// (the kernel `matmul_experts_t{T}r{R}`): one token per item for a single row, tiles of 4
/// while few pairs share an expert, of 8 beyond. A function of the row count alone, so a
/// graph's shape does not depend on the routing.
fn moe_tile(rows: usize, pairs: usize, experts: usize) -> (&'static str, u32, u32) {
    if rows == 1 {
        ("matmul_experts_t1r2", 1, 2)
    } else if pairs <= 4 * experts {
        ("matmul_experts_t4r2", 4, 2)
    } else {
        ("matmul_experts_t8r4", 8, 4)
    }
}

/// An f32 activation buffer on the device.
pub struct CudaTensor {
    buf: CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
    /// Identity for the graph cache (a graph is tied to the buffers it was captured with).
    id: u64,
}

/// The device memory of one sequence slot.
struct SlotMem {
    conv: CudaSlice<f32>,
    rec: CudaSlice<f32>,
    /// `[L_attn][2][max_pages]` device pointers to KV pages (0 where not allocated), a copy of
    /// `host_table`; a read-only slot's stays zero (no step reads it).
    table: CudaSlice<u64>,
    host_table: Vec<u64>,
    /// Per attention layer, keys and values: pages of `ATTENTION_TILE · Hkv · Dh` floats.
    /// A page may be shared ([`Page`]).
    pages: Vec<[Vec<Page>; 2]>,
    position: usize,
    /// A snapshot ([`Backend::snapshot_slot`]): no step may continue it, since it shares its
    /// last, partly filled pages with the slot it was taken from, which goes on writing them.
    read_only: bool,
}

/// A KV page, shared between slots where that is safe: a sequence writes only its own
/// positions, at or past its position, so a page whose `ATTENTION_TILE` positions are all
/// behind every holder's position is never written again, and a partly filled page is shared
/// only between the one slot that writes it and read-only snapshots of it at or behind its
/// position ([`SlotMem::read_only`]).
type Page = std::rc::Rc<CudaSlice<f32>>;

/// Every sequence slot on the device.
pub struct CudaStates {
    cfg: ModelConfig,
    slots: Vec<Option<SlotMem>>,
    max_pages: usize,
}

impl CudaStates {
    /// The slot a new state takes: the first free one, else one past the last.
    ///
    /// # Errors
    /// All [`MAX_SLOTS`] are taken.
    fn next_slot(&self) -> Result<usize, BackendError> {
        let idx = self.slots.iter().position(Option::is_none).unwrap_or(self.slots.len());
        if idx >= MAX_SLOTS {
            return Err(BackendError::Slot { slot: idx, problem: format!("exceeds the {MAX_SLOTS} slots of the CUDA backend") });
        }
        Ok(idx)
    }
}

impl SlotMem {
    /// KV pages held per attention layer, for keys and for values alike (they grow, are
    /// shared and are dropped together); host table entries past it are 0.
    fn pages_held(&self) -> usize {
        self.pages.first().map_or(0, |layer| layer[0].len())
    }

    /// Its entry in the device's slot table.
    fn desc(&self, stream: &CudaStream) -> SlotDesc {
        SlotDesc { conv: ptr(&self.conv, stream), rec: ptr(&self.rec, stream), pages: ptr(&self.table, stream) }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Eager,
    /// Recording the current step into a graph (key given).
    Capturing(GraphKey),
    /// Replaying a recorded graph: operations are skipped.
    Replaying(GraphKey),
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct GraphKey {
    rows: usize,
    seqs: usize,
    logit_rows: usize,
    /// The residual-stream tensor of the scratch the step runs on.
    scratch: u64,
}

/// A decode step run on a graph of more rows than it has: `rows` real rows padded to `brows`,
/// `logits` real logits rows padded to `blogits`. While the step is recorded, the operations
/// take the padded counts for the real ones ([`Step::eff`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pad {
    rows: usize,
    brows: usize,
    logits: usize,
    blogits: usize,
}

/// Which token-choosing kernel ends a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chooser {
    Argmax,
    Sample,
}

/// A recorded step.
struct Recorded {
    graph: cudarc::driver::CudaGraph,
    /// Kernel launches recorded into it.
    nodes: u64,
    /// The token-choosing kernel recorded with it, if any.
    chooser: Option<Chooser>,
    /// Its record in the timeline probe, when that is on.
    timeline_record: Option<usize>,
}

/// A token-choosing kernel to run after a replayed graph that was recorded without it.
#[derive(Clone, Copy, Debug)]
struct PendingChooser {
    kind: Chooser,
    logits: u64,
    rows: u32,
    v_eff: u32,
    ld: u32,
}

/// Sampling parameters of one row as `sample.cu` reads them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct SampleParamsRepr {
    temperature: f32,
    top_p: f32,
    min_p: f32,
    rep: f32,
    pres: f32,
    freq: f32,
    top_k: u32,
    window_cap: u32,
    seed: u64,
}
// SAFETY: plain data with the layout of `SampleParams` in sample.cu; zero bytes are valid.
unsafe impl DeviceRepr for SampleParamsRepr {}
unsafe impl cudarc::driver::ValidAsZeroBits for SampleParamsRepr {}

/// Penalty window ids per row the device sampler holds.
pub const SAMPLE_WINDOW: usize = 1024;
/// Largest top-k the device sampler handles.
pub const SAMPLE_MAX_K: usize = 1024;

/// Per-step device buffers and backend-owned temporaries (fixed addresses: graphs read them).
struct Step {
    ids: CudaSlice<u32>,
    seqs: CudaSlice<SeqDesc>,
    rows: CudaSlice<RowDesc>,
    logit_rows: CudaSlice<u32>,
    slot_table: CudaSlice<SlotDesc>,
    host_slot_table: Vec<SlotDesc>,
    slot_table_dirty: bool,
    rope: Option<CudaSlice<f32>>,
    rope_host: Option<RopeTable>,
    rope_rows_on_device: usize,
    /// GDN temporary: silu(conv) `[rows, conv_dim]`.
    gdn_y: Option<CudaSlice<f32>>,
    /// gdn_prep's rows for prompt steps, `[rows][conv_dim + 2·Hv]` (gdn_prompt.cu).
    gdn_prep: Option<CudaSlice<f32>>,
    /// The input of integer-exact products, quantized (`quantize_rows`).
    int_in: Option<IntScratch>,
    /// A mixture-of-experts block's buffers (taken out while `Cuda::moe` runs).
    moe: Option<MoeScratch>,
    /// Attention tile partials for eager steps (grown) and for graphs (fixed once captured).
    part_eager: Option<CudaSlice<f32>>,
    part_graph: Option<CudaSlice<f32>>,
    part_graph_tiles: usize,
    /// Tiles per query the current step's partial buffer holds.
    max_tiles: usize,
    sampled: CudaSlice<u32>,
    /// Ids the device already holds in `ids` (written by the last greedy step).
    device_ids: Vec<u32>,
    mode: Mode,
    batch_rows: usize,
    graphs: HashMap<GraphKey, Recorded>,
    captured_chooser: Option<Chooser>,
    pending_chooser: Option<PendingChooser>,
    /// Device sampler inputs: per-row parameters, penalty windows, positions; and its scratch.
    sample_params: CudaSlice<SampleParamsRepr>,
    sample_win: CudaSlice<u32>,
    sample_wlen: CudaSlice<u32>,
    sample_pos: CudaSlice<u64>,
    sample_work: Option<CudaSlice<f32>>,
    /// Rows the device sampler's buffers hold (`sample_params`, `sample_wlen`, `sample_pos`,
    /// `sample_win` in windows of [`SAMPLE_WINDOW`], `sample_work` in rows of the vocabulary).
    sample_cap: usize,
    /// Rows the last [`Backend::set_sampling`] prepared (0: none).
    sample_rows: usize,
    /// Per-slice bests of the two-pass argmax: `[argmax_cap rows][64 slices]`.
    argmax_v: CudaSlice<f32>,
    argmax_i: CudaSlice<u32>,
    argmax_cap: usize,
    /// Whether the current step (set up by `begin_step`) runs as a graph, and its padding.
    graph_step: bool,
    pad: Option<Pad>,
    /// The state of [`PAD_SLOT`] (made on the first padded step).
    pad_slot: Option<SlotMem>,
    error: Option<BackendError>,
    launches: u64,
    /// Host synchronisations (waits for the device).
    waits: u64,
    /// `launches` when the current capture began.
    capture_start: u64,
    /// Kernel timings while profiling: (name, start event, end event).
    profile: Option<Vec<(String, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>>,
    event_pool: Vec<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    /// The timeline probe (`TENSORFOLD_TIMELINE`, timeline.rs), when on, and the record of the
    /// graph being captured.
    timeline: Option<timeline::Timeline>,
    timeline_record: Option<usize>,
}

impl Step {
    /// The row count an operation of the current step launches over for `rows`, the count the
    /// model passes it: the padded count while a padded step is recorded (the real rows and the
    /// real logits rows each map to their bucket), else `rows`.
    fn eff(&self, rows: usize) -> usize {
        match (self.mode, self.pad) {
            (Mode::Capturing(_), Some(p)) if rows == p.rows => p.brows,
            (Mode::Capturing(_), Some(p)) if rows == p.logits => p.blogits,
            _ => rows,
        }
    }

    /// The attention partial buffer this step's kernels use (the graphs' while capturing, else
    /// the eager one) and the tiles per query it holds.
    fn attention_partials(&self) -> (&CudaSlice<f32>, u32) {
        let part = if matches!(self.mode, Mode::Capturing(_)) { &self.part_graph } else { &self.part_eager };
        (part.as_ref().expect("begin_step sized the partials"), self.max_tiles as u32)
    }

    /// Labels the next node of the graph being captured for the timeline probe (when both are on).
    fn label_node(&mut self, label: &str) {
        if let (Mode::Capturing(_), Some(t)) = (self.mode, self.timeline.as_mut()) {
            t.label(label);
        }
    }
}

/// How `matmul_t1s` (kernels/matmul.cu) lays out a block's shared memory for rows of `cols`
/// 4-bit codes in groups of `group`: x (`cols` floats), `2·nslot` mbarriers, then, from the next
/// multiple of 128 bytes, `nslot` slots of [`T1S_ROWS`] rows (their codes, then their
/// 16-bit scale/bias pairs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StreamLayout {
    /// Slots in the ring (2 to 8: fewer leave the producer no room to run ahead).
    nslot: u32,
    /// Bytes of one slot.
    slot: u32,
    /// Dynamic shared memory of a block, in bytes.
    smem: u32,
}

/// Consumer warps of a `matmul_t1s` block (`S_WARPS` in matmul.cu; the block adds one producer
/// warp) and rows per chunk (`S_ROWS`: two per consumer warp, one word of the offset bitmap).
const T1S_WARPS: u32 = 16;
const T1S_ROWS: usize = 32;

impl StreamLayout {
    /// The layout with the most slots that fits in `smem_max` bytes, or `None` when the rows
    /// do not suit the kernel: `cols` a multiple of 256 (whole 32-word batches per lane) and at
    /// most 8192, `cols / group` a multiple of 4 (bulk copies move multiples of 16 bytes), or
    /// fewer than two slots fit.
    fn new(cols: usize, group: usize, smem_max: usize) -> Option<Self> {
        if !cols.is_multiple_of(256) || cols > 8192 || group == 0 || !cols.is_multiple_of(group) || !(cols / group).is_multiple_of(4) {
            return None;
        }
        let slot = T1S_ROWS * (cols / 2 + 4 * (cols / group));
        let head = |n: usize| (cols * 4 + 16 * n).next_multiple_of(128);
        let nslot = (2..=8).rev().find(|&n| head(n) + n * slot <= smem_max)?;
        Some(Self { nslot: nslot as u32, slot: slot as u32, smem: (head(nslot) + nslot * slot) as u32 })
    }
}

/// The CUDA backend on one device.
pub struct Cuda {
    /// Keeps the context alive as long as the backend (streams and buffers hold it too).
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    name: String,
    arch: String,
    step: Mutex<Step>,
    next_id: std::sync::atomic::AtomicU64,
    cfg_cache: Mutex<Option<ModelConfig>>,
    /// Capture decode steps as graphs (`TENSORFOLD_CUDA_GRAPHS=0` turns it off, for comparison).
    use_graphs: std::sync::atomic::AtomicBool,
    /// Launch kernels with programmatic dependent launch (sm_90+; `TENSORFOLD_CUDA_PDL=0` turns
    /// it off): a kernel's blocks are scheduled while the previous kernel ends, hiding the
    /// launch gap between the nodes of a decode graph.
    pdl: bool,
    /// One-token launches of at least this many rows of at most 2048 columns, or of 16384 rows
    /// or more, compute two rows per warp (`matmul_t1r2`; `TENSORFOLD_T1R2_MIN_ROWS`, default
    /// 4096): the x loads halve. Smaller launches, and 4096-row launches of long rows (9B's
    /// output and down projections: 3.55 -> 3.85 ms), keep a warp per row for the warps
    /// (measured on the H200, bench/results README "Fourth pass").
    t1r2_min_rows: usize,
    /// Most blocks per query head of the attention kernels ([`ATTN_BLOCKS`] unless `TENSORFOLD_ATTN_BLOCKS`).
    attn_blocks: u32,
    /// Multiprocessors: the grid of the streamed one-token product (`matmul_t1s`).
    sms: u32,
    /// Shared memory one `matmul_t1s` block may use (the device's opt-in maximum; 0 before
    /// sm_90, where the kernel's bulk copies do not exist).
    t1s_smem: u32,
    /// One-token launches of a single matrix of at least this many rows stream it
    /// (`matmul_t1s`; `TENSORFOLD_T1S_MIN_ROWS`, default 65 536: the LM head).
    t1s_min_rows: usize,
    /// Tokens from which integer products of 4-bit codes take the wide tile (matmul_int.cu
    /// `_wide`); `TENSORFOLD_INT_WIDE_ROWS`, a scheduling knob (the bits are the same).
    int_wide_rows: usize,
    /// Row counts up to which batched products below the wide tile take the 32 × 16 tile (`_mid`,
    /// two blocks per multiprocessor) instead of 32 × 32 (`_large`); `TENSORFOLD_INT_MID_ROWS`
    /// (default: all of them), a scheduling knob (the bits are the same).
    int_mid_rows: usize,
    /// Blocks of the one-token integer products (matmul_int.cu `_one`) resident at once on the
    /// device, at most `TENSORFOLD_INT_ONE_BLOCKS` (default 2) per multiprocessor: their grid,
    /// so a launch of many rows has no tail wave.
    int_one_blocks: u32,
    /// The default memory pool keeps freed memory ([`keep_pool_memory`]).
    pool_kept: bool,
    /// The arithmetic of affine products ([`Products`]).
    products: Products,
    /// Per mixture-of-experts layer (keyed by its router's weight address), `[3][E]` pairs of
    /// device addresses (codes, scales and biases) of the experts' gate, up and down matrices.
    expert_tables: Mutex<HashMap<u64, CudaSlice<u64>>>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cuda({})", self.name)
    }
}

/// Keeps the memory that stream-ordered frees give back in the device's default pool instead
/// of returning it to the driver at every synchronization (the pool's default release
/// threshold is 0), so the slots, KV pages and snapshots a server allocates and frees every
/// tick do not map fresh memory each time. What the process holds is then its peak, which the
/// runtime's state and snapshot budgets bound. `TENSORFOLD_POOL_KEEP=0` keeps the driver's
/// default.
fn keep_pool_memory(ctx: &CudaContext) -> Result<bool, BackendError> {
    if !ctx.has_async_alloc() || std::env::var("TENSORFOLD_POOL_KEEP").is_ok_and(|v| v == "0") {
        return Ok(false);
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the device is open; the pool handle and the attribute's u64 are written and
    // read as the driver's API gives them.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().map_err(|e| dev_err("the device's memory pool", e))?;
        sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut threshold as *mut u64).cast())
            .result()
            .map_err(|e| dev_err("the memory pool's release threshold", e))?;
    }
    Ok(true)
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _guard) = s.device_ptr(stream);
    p
}

impl Cuda {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel.
    ///
    /// # Errors
    /// No CUDA driver or NVRTC library, no such device, a kernel that does not compile.
    pub fn new(ordinal: usize) -> Result<Self, BackendError> {
        if !driver_available() {
            return Err(BackendError::Device("no CUDA driver (libcuda) on this machine".into()));
        }
        if !compile::nvrtc_available() {
            return Err(BackendError::Device("libnvrtc was not found; install the CUDA toolkit or put libnvrtc on LD_LIBRARY_PATH".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err(&format!("opening device {ordinal}"), e))?;
        // Before any allocation (cudarc#555): we order all work on one stream ourselves.
        // SAFETY: no allocation or stream exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| dev_err("creating a stream", e))?;
        let pool_kept = keep_pool_memory(&ctx)?;
        let (maj, min) = ctx.compute_capability().map_err(|e| dev_err("compute capability", e))?;
        let arch = format!("sm_{maj}{min}");
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let mut funcs = HashMap::new();
        let timeline = timeline::Timeline::from_env(&stream)?;
        for src in compile::SOURCES {
            let cubin = compile::compile_cached(src, &arch).map_err(BackendError::Device)?;
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(|e| dev_err(&format!("loading {}", src.file), e))?;
            if let Some(t) = &timeline {
                t.attach(&module, &stream)?;
            }
            for &entry in src.entries {
                let f = module.load_function(entry).map_err(|e| dev_err(&format!("{}: {entry}", src.file), e))?;
                funcs.insert(entry, f);
            }
        }
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| dev_err("attribute", e))? as u32;
        // The streamed one-token product (sm_90's bulk copies) gets the most shared memory a
        // block may opt into; where that cannot be set it is not used (matmul_t1r2 remains).
        let mut t1s_smem = 0;
        if maj >= 9 {
            let optin = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).unwrap_or(0);
            if optin > 0 && funcs["matmul_t1s"].set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin).is_ok() {
                t1s_smem = optin as u32;
            }
        }
        // At most TENSORFOLD_INT_ONE_BLOCKS blocks per multiprocessor (a scheduling knob: each
        // block quantizes the token once, so fewer, longer-lived blocks repeat less of it).
        let per_sm_cap = std::env::var("TENSORFOLD_INT_ONE_BLOCKS").ok().and_then(|v| v.parse().ok()).unwrap_or(2u32).max(1);
        let mut int_one_blocks = u32::MAX;
        for &entry in compile::SOURCES.iter().flat_map(|s| s.entries.iter()).filter(|e| e.starts_with("matmul_int") && (e.ends_with("_one") || e.ends_with("_one_swiglu"))) {
            let per_sm = funcs[entry].occupancy_max_active_blocks_per_multiprocessor(256, 0, None).map_err(|e| dev_err(&format!("occupancy of {entry}"), e))?;
            int_one_blocks = int_one_blocks.min(per_sm.clamp(1, per_sm_cap) * sms);
        }
        let alloc = |n: usize| -> Result<CudaSlice<u32>, BackendError> { stream.alloc_zeros::<u32>(n).map_err(|e| dev_err("allocating step buffers", e)) };
        let step = Step {
            ids: alloc(MAX_ROWS)?,
            seqs: stream.alloc_zeros::<SeqDesc>(MAX_ROWS).map_err(|e| dev_err("allocating step buffers", e))?,
            rows: stream.alloc_zeros::<RowDesc>(MAX_ROWS).map_err(|e| dev_err("allocating step buffers", e))?,
            logit_rows: alloc(MAX_ROWS)?,
            slot_table: stream.alloc_zeros::<SlotDesc>(MAX_SLOTS + 1).map_err(|e| dev_err("allocating the slot table", e))?,
            host_slot_table: vec![SlotDesc::default(); MAX_SLOTS + 1],
            slot_table_dirty: false,
            rope: None,
            rope_host: None,
            rope_rows_on_device: 0,
            gdn_y: None,
            gdn_prep: None,
            int_in: None,
            moe: None,
            part_eager: None,
            part_graph: None,
            part_graph_tiles: 0,
            max_tiles: 0,
            sampled: alloc(MAX_ROWS)?,
            device_ids: Vec::new(),
            mode: Mode::Eager,
            batch_rows: 0,
            graphs: HashMap::new(),
            captured_chooser: None,
            pending_chooser: None,
            sample_params: stream.alloc_zeros::<SampleParamsRepr>(CHOOSER_MIN_ROWS).map_err(|e| dev_err("allocating sampler buffers", e))?,
            sample_win: alloc(CHOOSER_MIN_ROWS * SAMPLE_WINDOW)?,
            sample_wlen: alloc(CHOOSER_MIN_ROWS)?,
            sample_pos: stream.alloc_zeros::<u64>(CHOOSER_MIN_ROWS).map_err(|e| dev_err("allocating sampler buffers", e))?,
            sample_work: None,
            sample_cap: CHOOSER_MIN_ROWS,
            sample_rows: 0,
            argmax_v: stream.alloc_zeros::<f32>(CHOOSER_MIN_ROWS * ARGMAX_PARTS).map_err(|e| dev_err("allocating argmax buffers", e))?,
            argmax_i: alloc(CHOOSER_MIN_ROWS * ARGMAX_PARTS)?,
            argmax_cap: CHOOSER_MIN_ROWS,
            graph_step: false,
            pad: None,
            pad_slot: None,
            error: None,
            launches: 0,
            waits: 0,
            capture_start: 0,
            profile: None,
            event_pool: Vec::new(),
            timeline,
            timeline_record: None,
        };
        let use_graphs = std::env::var("TENSORFOLD_CUDA_GRAPHS").map(|v| v != "0").unwrap_or(true);
        // Programmatic launches inside captured graphs need sm_90 and a CUDA 12.3 driver.
        let mut driver = 0;
        // SAFETY: writes one integer.
        let driver_ok = unsafe { sys::cuDriverGetVersion(&mut driver) } == sys::CUresult::CUDA_SUCCESS && driver >= 12030;
        let pdl = maj >= 9 && driver_ok && std::env::var("TENSORFOLD_CUDA_PDL").map(|v| v != "0").unwrap_or(true);
        Ok(Self {
            _ctx: ctx,
            stream,
            funcs,
            name,
            arch,
            step: Mutex::new(step),
            next_id: std::sync::atomic::AtomicU64::new(1),
            cfg_cache: Mutex::new(None),
            use_graphs: std::sync::atomic::AtomicBool::new(use_graphs),
            pdl,
            t1r2_min_rows: std::env::var("TENSORFOLD_T1R2_MIN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(4096),
            sms,
            int_one_blocks,
            pool_kept,
            t1s_smem,
            t1s_min_rows: std::env::var("TENSORFOLD_T1S_MIN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(65536),
            int_wide_rows: std::env::var("TENSORFOLD_INT_WIDE_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(128),
            int_mid_rows: std::env::var("TENSORFOLD_INT_MID_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(usize::MAX),
            products: Products::default(),
            expert_tables: Mutex::new(HashMap::new()),
            attn_blocks: std::env::var("TENSORFOLD_ATTN_BLOCKS").ok().and_then(|v| v.parse().ok()).filter(|&b: &u32| (1..=1024).contains(&b)).unwrap_or(ATTN_BLOCKS),
        })
    }

    /// This backend with the given form of the affine products (f32 unless set; before the
    /// model is uploaded).
    pub fn with_products(mut self, products: Products) -> Self {
        self.products = products;
        self
    }

    /// The device's name and architecture.
    pub fn device_name(&self) -> String {
        format!("{} ({})", self.name, self.arch)
    }

    /// Turns graph capture of decode steps on or off (off: every operation launches eagerly,
    /// so intermediate tensors can be read between operations).
    pub fn set_graphs(&self, on: bool) {
        self.use_graphs.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Kernel launches issued so far (captured launches count once, replays not at all).
    pub fn launches(&self) -> u64 {
        self.step.lock().unwrap().launches
    }

    /// Graphs recorded so far.
    pub fn graphs(&self) -> usize {
        self.step.lock().unwrap().graphs.len()
    }

    /// Kernel nodes of the recorded one-row decode graphs (the largest, if several).
    pub fn decode_graph_nodes(&self) -> Option<u64> {
        self.step.lock().unwrap().graphs.iter().filter(|(k, _)| k.rows == 1).map(|(_, r)| r.nodes).max()
    }

    /// Two events for timing a span of the stream (the machine measurements).
    fn timing_events(&self) -> Result<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent), BackendError> {
        let ctx = self.stream.context();
        let ev = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| dev_err("event", e));
        Ok((ev()?, ev()?))
    }

    /// Device copy bandwidth in bytes/s, counting bytes read plus bytes written: the median of
    /// `reps` device-to-device copies of `bytes` (event-timed).
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<Vec<f64>, BackendError> {
        let n = bytes / 4;
        let src = self.stream.alloc_zeros::<f32>(n).map_err(|e| dev_err("alloc", e))?;
        let mut dst = self.stream.alloc_zeros::<f32>(n).map_err(|e| dev_err("alloc", e))?;
        let (e0, e1) = self.timing_events()?;
        let mut out = Vec::new();
        for i in 0..reps + 1 {
            e0.record(&self.stream).map_err(|e| dev_err("event", e))?;
            self.stream.memcpy_dtod(&src, &mut dst).map_err(|e| dev_err("copy", e))?;
            e1.record(&self.stream).map_err(|e| dev_err("event", e))?;
            let ms = e0.elapsed_ms(&e1).map_err(|e| dev_err("event", e))? as f64;
            if i > 0 {
                out.push(2.0 * (n * 4) as f64 / (ms / 1e3));
            }
        }
        Ok(out)
    }

    /// Float32 FMA peak in FLOP/s (2 per FMA): every multiprocessor full of threads running
    /// independent FMA chains, event-timed, best of 3.
    pub fn fma_peak(&self) -> Result<f64, BackendError> {
        let sms = self.stream.context().attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| dev_err("attribute", e))? as u32;
        let (blocks, threads, iters) = (sms * 8, 256u32, 20_000u32);
        let mut out = self.stream.alloc_zeros::<f32>((blocks * threads) as usize).map_err(|e| dev_err("alloc", e))?;
        let (e0, e1) = self.timing_events()?;
        let f = &self.funcs["fma_peak"];
        let (a, b) = (0.999_f32, 0.001_f32);
        let mut best = 0.0f64;
        for _ in 0..4 {
            e0.record(&self.stream).map_err(|e| dev_err("event", e))?;
            // SAFETY: arguments match machine.cu; `out` holds blocks·threads floats.
            unsafe { self.stream.launch_builder(f).arg(&mut out).arg(&iters).arg(&a).arg(&b).launch(Self::cfg1((blocks, 1, 1), threads, 0)) }
                .map_err(|e| dev_err("fma_peak", e))?;
            e1.record(&self.stream).map_err(|e| dev_err("event", e))?;
            let ms = e0.elapsed_ms(&e1).map_err(|e| dev_err("event", e))? as f64;
            let flops = 2.0 * 8.0 * iters as f64 * (blocks * threads) as f64;
            best = best.max(flops / (ms / 1e3));
        }
        Ok(best)
    }

    /// Milliseconds one replay of a graph of `kernels` empty kernels takes (`chain_link`, each
    /// `blocks` blocks of 256 threads, launched as the decode graph launches its kernels, with
    /// programmatic dependent launch where on): the cost of a decode token's chain of dependent
    /// kernels before any work. Median of 20 replays, event-timed.
    pub fn chain_floor(&self, kernels: usize, blocks: u32) -> Result<f64, BackendError> {
        self._ctx.bind_to_thread().map_err(|e| dev_err("context", e))?;
        self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| dev_err("beginning graph capture", e))?;
        let mut launched = Ok(());
        for _ in 0..kernels {
            // SAFETY: chain_link takes no arguments and touches no memory.
            launched = launched.and(unsafe { self.kernel("chain_link", (blocks, 1, 1), 256, 0, self.args()) });
        }
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(|e| dev_err("ending graph capture", e))?;
        launched.map_err(|e| dev_err("chain_link", e))?;
        let graph = graph.ok_or_else(|| BackendError::Device("graph capture produced no graph".into()))?;
        let (e0, e1) = self.timing_events()?;
        let mut ms = Vec::new();
        for i in 0..21 {
            e0.record(&self.stream).map_err(|e| dev_err("event", e))?;
            graph.launch().map_err(|e| dev_err("launching a graph", e))?;
            e1.record(&self.stream).map_err(|e| dev_err("event", e))?;
            let t = e0.elapsed_ms(&e1).map_err(|e| dev_err("event", e))? as f64;
            if i > 0 {
                ms.push(t);
            }
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[ms.len() / 2])
    }

    /// Host waits (synchronisations) issued so far.
    pub fn host_waits(&self) -> u64 {
        self.step.lock().unwrap().waits
    }

    /// Evaluates the device's `exp, log, softplus, sigmoid, silu` on `x` (5 outputs per input),
    /// for comparison with [`crate::numerics`].
    pub fn numerics_check(&self, x: &[f32]) -> Result<Vec<f32>, BackendError> {
        let xd = self.stream.clone_htod(x).map_err(|e| dev_err("upload", e))?;
        let mut out = self.stream.alloc_zeros::<f32>(5 * x.len()).map_err(|e| dev_err("alloc", e))?;
        let n = x.len() as u32;
        let f = &self.funcs["numerics_check"];
        // SAFETY: arguments match numerics_check.cu; buffers hold n and 5n floats.
        unsafe {
            self.stream.launch_builder(f).arg(&xd).arg(&n).arg(&mut out).launch(LaunchConfig { grid_dim: (n.div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
        }
        .map_err(|e| dev_err("numerics_check", e))?;

        let v = self.stream.clone_dtoh(&out).map_err(|e| dev_err("download", e))?;
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))?;
        Ok(v)
    }

    /// Runs `f` unless the current step is being replayed; records the first error.
    fn launch<T>(&self, what: &str, f: impl FnOnce(&mut Step) -> Result<T, cudarc::driver::DriverError>) {
        self.launch_as(what, None, f)
    }

    /// Whether a launch's label is worth formatting: eager launches are being timed, or the
    /// timeline probe labels graph nodes.
    fn labels_wanted(&self) -> bool {
        let st = self.step.lock().unwrap();
        st.profile.is_some() || st.timeline.is_some()
    }

    /// [`Cuda::launch`], timed under `label` instead of `what` when profiling.
    fn launch_as<T>(&self, what: &str, label: Option<String>, f: impl FnOnce(&mut Step) -> Result<T, cudarc::driver::DriverError>) {
        let mut st = self.step.lock().unwrap();
        // A step that met an error launches nothing more (it fails at its end): a refused
        // buffer size must not become a kernel indexing past it.
        if matches!(st.mode, Mode::Replaying(_)) || st.error.is_some() {
            return;
        }
        // Profiling (eager steps only): events around the launch, summed per kernel name.
        let timed = st.profile.is_some() && st.mode == Mode::Eager;
        let start = if timed { self.event_pair(&mut st).ok() } else { None };
        if let Some((a, _)) = &start {
            let _ = a.record(&self.stream);
        }
        st.label_node(label.as_deref().unwrap_or(what));
        if let Err(e) = f(&mut st) {
            if st.error.is_none() {
                st.error = Some(dev_err(what, e));
            }
        }
        if let Some((a, b)) = start {
            let _ = b.record(&self.stream);
            if let Some(p) = st.profile.as_mut() {
                p.push((label.unwrap_or_else(|| what.to_string()), a, b));
            }
        }
        st.launches += 1;
    }

    fn event_pair(&self, st: &mut Step) -> Result<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent), cudarc::driver::DriverError> {
        if let Some(pair) = st.event_pool.pop() {
            return Ok(pair);
        }
        let ctx = self.stream.context();
        Ok((ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?, ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?))
    }

    /// Starts (`true`) or stops timing every eagerly launched kernel with CUDA events.
    pub fn set_profile(&self, on: bool) {
        let mut st = self.step.lock().unwrap();
        st.profile = if on { Some(Vec::new()) } else { None };
    }

    /// Device time per kernel name (milliseconds, launches) since profiling started, sorted by
    /// time; clears the record.
    pub fn profile_report(&self) -> Result<Vec<(String, f64, usize)>, BackendError> {
        let mut st = self.step.lock().unwrap();
        let recs = match st.profile.as_mut() {
            Some(p) => std::mem::take(p),
            None => return Ok(Vec::new()),
        };
        let mut sums: HashMap<String, (f64, usize)> = HashMap::new();
        for (name, a, b) in recs {
            let ms = a.elapsed_ms(&b).map_err(|e| dev_err("profile", e))? as f64;
            let e = sums.entry(name).or_insert((0.0, 0));
            e.0 += ms;
            e.1 += 1;
            st.event_pool.push((a, b));
        }
        let mut v: Vec<(String, f64, usize)> = sums.into_iter().map(|(k, (t, n))| (k, t, n)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok(v)
    }

    /// Queues the kernel that picks each row's next id (recorded into a graph being captured;
    /// after the graph when it replays one recorded without this kernel).
    fn enqueue_chooser(&self, kind: Chooser, logits: &CudaTensor, rows: usize, v_eff: usize) {
        let (v, ld) = (v_eff as u32, logits.cols as u32);
        let lp = ptr(&logits.buf, &self.stream);
        let mut st = self.step.lock().unwrap();
        // What the kernels would index past is refused here, as an error of the step.
        let n = st.eff(rows);
        let refusal = if v_eff > logits.cols || n > logits.rows {
            Some(format!("{n} logits rows over ids < {v_eff} do not fit a logits tensor of [{}, {}]", logits.rows, logits.cols))
        } else if kind == Chooser::Argmax && n > st.argmax_cap {
            Some(format!("{n} rows to choose from exceed the argmax buffers ({} rows)", st.argmax_cap))
        } else if kind == Chooser::Sample && (rows > st.sample_rows || n > st.sample_cap || st.sample_work.as_ref().is_none_or(|w| w.len() < n * logits.cols)) {
            Some(format!("{rows} rows to sample, but set_sampling prepared {}", st.sample_rows))
        } else {
            None
        };
        if let Some(r) = refusal {
            st.error.get_or_insert(BackendError::Batch(r));
        }
        if st.error.is_some() {
            return;
        }
        match st.mode {
            Mode::Replaying(key) => {
                if st.graphs[&key].chooser != Some(kind) {
                    st.pending_chooser = Some(PendingChooser { kind, logits: lp, rows: rows as u32, v_eff: v, ld });
                }
                return;
            }
            Mode::Capturing(_) => st.captured_chooser = Some(kind),
            Mode::Eager => {}
        }
        if let Err(e) = self.launch_chooser(&mut st, kind, lp, n as u32, v, ld) {
            st.error.get_or_insert(dev_err("choosing tokens", e));
        }
        st.launches += if kind == Chooser::Argmax { 2 } else { 1 };
    }

    fn launch_chooser(&self, st: &mut Step, kind: Chooser, logits: u64, rows: u32, v_eff: u32, ld: u32) -> Result<(), cudarc::driver::DriverError> {
        // SAFETY: arguments match argmax.cu / sample.cu; `logits` is the step's logits tensor
        // (`rows` rows of `ld` floats), the other buffers hold at least `rows` rows
        // (`enqueue_chooser` checked: `argmax_cap`, `sample_cap`, `sampled` and `ids` MAX_ROWS).
        unsafe {
            match kind {
                Chooser::Argmax => {
                    st.label_node("argmax_part");
                    st.label_node("argmax_rows");
                    self.kernel("argmax_part", (ARGMAX_PARTS as u32, rows, 1), 256, 0, self.args().val(logits).val(v_eff).val(ld).buf(&st.argmax_v).buf(&st.argmax_i))?;
                    self.kernel("argmax_rows", (rows, 1, 1), ARGMAX_PARTS as u32, 0, self.args().buf(&st.argmax_v).buf(&st.argmax_i).buf(&st.sampled).buf(&st.ids))
                }
                Chooser::Sample => {
                    st.label_node("sample_rows");
                    let Some(work) = st.sample_work.as_ref() else { return Ok(()) };
                    self.kernel(
                        "sample_rows",
                        (rows, 1, 1),
                        1024,
                        0,
                        self.args()
                            .val(logits)
                            .val(v_eff)
                            .val(ld)
                            .buf(&st.sample_params)
                            .buf(&st.sample_win)
                            .buf(&st.sample_wlen)
                            .buf(&st.sample_pos)
                            .buf(work)
                            .buf(&st.sampled)
                            .buf(&st.ids),
                    )
                }
            }
        }
    }

    fn check(&self) -> Result<(), BackendError> {
        match self.step.lock().unwrap().error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn func(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn args(&self) -> Args<'_> {
        Args { stream: &self.stream, vals: Vec::new() }
    }

    /// Launches kernel `name` on the stream (`block` threads, `smem` bytes of dynamic shared
    /// memory), with programmatic dependent launch when [`Cuda::pdl`] is on: every step kernel
    /// calls `pdl_enter()` (common.cuh) before it touches anything but weights.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters, and the buffers it names must outlive the
    /// kernel (they do: buffers are freed in stream order).
    unsafe fn kernel(&self, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: Args) -> Result<(), cudarc::driver::DriverError> {
        self._ctx.bind_to_thread()?;
        let mut vals = args.vals;
        let mut params: Vec<*mut c_void> = vals.iter_mut().map(|w| w.as_mut_ptr().cast()).collect();
        // SAFETY: an all-zero launch attribute is valid; we set the one field we use.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: `params` points at one value per kernel parameter (the caller's contract).
        unsafe { sys::cuLaunchKernelEx(&cfg, self.func(name).cu_function(), params.as_mut_ptr(), std::ptr::null_mut()).result() }
    }

    fn cfg1(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
        LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: shared }
    }

    fn new_tensor_id(&self) -> u64 {
        self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes sure the step temporaries hold `rows` rows for `cfg`.
    fn ensure_temps(&self, st: &mut Step, cfg: &ModelConfig, rows: usize) -> Result<(), BackendError> {
        let need = |b: &Option<CudaSlice<f32>>, n: usize| b.as_ref().is_none_or(|b| b.len() < n);
        let rows = rows.max(1);
        let a = |n: usize| self.stream.alloc_zeros::<f32>(n).map_err(|e| dev_err("allocating GDN temporaries", e));
        // Sized for the largest step seen (at least 256 rows), so graphs keep valid pointers.
        let cap = rows.max(256);
        if self.products == Products::Int {
            let cols = Self::product_cols(cfg);
            if st.int_in.as_ref().is_none_or(|q| q.rows < rows || q.cols < cols) {
                st.int_in = Some(IntScratch::new(&self.stream, cap, cols)?);
                st.graphs.clear();
            }
        }
        if let Some(moe) = &cfg.moe {
            if st.moe.as_ref().is_none_or(|m| m.rows < rows) {
                st.moe = Some(self.moe_scratch(cfg, moe, cap)?);
                st.graphs.clear();
            }
        }
        // Prompt steps prepare every token's GDN inputs in parallel (gdn_prompt.cu); not used
        // by decode graphs, so growing it keeps them.
        let prep_cols = cfg.conv_dim() + 2 * cfg.linear_num_value_heads;
        if rows > 1 && need(&st.gdn_prep, rows * prep_cols) {
            st.gdn_prep = Some(a(cap * prep_cols)?);
        }
        // The conv output goes through memory only when gdn_conv runs on its own.
        if !Self::conv_in_heads(cfg) && need(&st.gdn_y, rows * cfg.conv_dim()) {
            st.gdn_y = Some(a(cap * cfg.conv_dim())?);
            st.graphs.clear();
        }
        Ok(())
    }

    /// Whether `gdn_heads` runs the GDN conv itself: when every key head has one value head,
    /// each conv channel belongs to one block; otherwise several value heads share q/k windows
    /// and `gdn_conv` runs first.
    fn conv_in_heads(cfg: &ModelConfig) -> bool {
        cfg.linear_num_value_heads == cfg.linear_num_key_heads
    }

    /// For a one-token product of `m` alone that `matmul_t1s` may stream (4-bit codes with
    /// 16-bit scales in groups of 32, 64 or 128, a launch of at least `t1s_min_rows` rows,
    /// sm_90): its [`StreamLayout`].
    fn stream_fits(&self, m: &CudaMatrix) -> Option<StreamLayout> {
        if self.t1s_smem == 0 || m.rows < self.t1s_min_rows || m.fmt != 4 || !matches!(m.sdtype, 1 | 2) || !matches!(m.group, 32 | 64 | 128) {
            return None;
        }
        StreamLayout::new(m.cols, m.group as usize, self.t1s_smem as usize)
    }

    /// Whether two matrices store their weights alike (format, group size, scale dtype) over the
    /// same input width.
    fn same_format(a: &CudaMatrix, b: &CudaMatrix) -> bool {
        (a.fmt, a.group, a.sdtype, a.offset_rows.is_some(), a.cols) == (b.fmt, b.group, b.sdtype, b.offset_rows.is_some(), b.cols)
    }

    /// The descriptors of one product launch over `outs` (at most four), each matrix's rows
    /// starting at a multiple of `r` (the kernel's rows per warp), each output added to the
    /// residual stream at `res` when non-zero; and the padded rows of them all.
    fn mat_descs(&self, outs: &[(&CudaMatrix, &mut CudaTensor)], res: u64, r: u32) -> (MatDescs, u32) {
        let mut d = MatDescs::default();
        let mut row0 = 0u32;
        for (i, (m, y)) in outs.iter().enumerate() {
            d.m[i] = MatDesc::new(m, y, row0, &self.stream);
            d.m[i].res = res;
            debug_assert_eq!(m.per_word, 32 / if m.fmt >= 4 { m.fmt as usize } else { 32 / [1, 2, 2][m.fmt as usize] });
            row0 += (m.rows as u32).div_ceil(r) * r;
        }
        d.count = outs.len() as u32;
        (d, row0)
    }

    /// A product launch's name in the eager profile (`name ROWSxCOLS [+res]`), when profiling or
    /// probing the timeline.
    fn profile_label(&self, name: &str, rows: u32, cols: usize, res: u64) -> Option<String> {
        self.labels_wanted().then(|| format!("{name} {rows}x{cols}{}", if res != 0 { " +res" } else { "" }))
    }

    /// The widest input of any product of `cfg` (what [`IntScratch`] must hold per row).
    fn product_cols(cfg: &ModelConfig) -> usize {
        let moe = cfg.moe.as_ref().map_or(0, |m| m.moe_intermediate_size.max(m.shared_expert_intermediate_size));
        [cfg.hidden_size, cfg.intermediate_size, cfg.value_dim(), cfg.num_attention_heads * cfg.head_dim, moe].into_iter().max().unwrap_or(0).next_multiple_of(64)
    }

    /// Integer-exact products (numerics §2.2) of the affine matrices among `outs`: `x`
    /// quantized once, then one `matmul_int` launch per matrix. Returns the matrices left for
    /// the f32 kernels (float weights).
    fn matmul_int_rows(&self, x: &CudaTensor, rows: usize, outs: &[(&CudaMatrix, &mut CudaTensor)], res: u64) -> Vec<usize> {
        let rest: Vec<usize> = (0..outs.len()).filter(|&i| outs[i].0.fmt < 4).collect();
        if rest.len() == outs.len() {
            return rest;
        }
        let cols = x.cols as u32;
        let blocks = cols.div_ceil(64);
        let kpad = 64 * blocks;
        let x_buf = ptr(&x.buf, &self.stream);
        // One token is quantized by each block of the product (INT_ONE_TOKEN_COLS).
        // The tile: 0 one token quantized in the block, 1 small, 2 large (matmul_int.cu).
        let tile = match rows {
            1 if cols as usize <= INT_ONE_TOKEN_COLS => 0,
            1..=8 => 1,
            _ => 2,
        };
        if tile != 0 {
            self.launch("quantize_rows", |st| {
                let q = st.int_in.as_ref().expect("ensure_temps sizes the integer-product input");
                assert!(q.rows >= rows && q.cols >= kpad as usize, "quantize_rows: {rows}x{cols} past {}x{}", q.rows, q.cols);
                let a = self.args().val(x_buf).val(cols).val(cols).val(blocks).val(kpad).buf(&q.planes).buf(&q.d).buf(&q.ds64).buf(&q.ds32);
                unsafe { self.kernel("quantize_rows", (blocks.div_ceil(8), rows as u32, 1), 256, 0, a) }
            });
        }
        let wide = tile == 2 && rows >= self.int_wide_rows;
        let tile = if tile == 2 && !wide && rows <= self.int_mid_rows { 5 } else { tile };
        // Launches of up to four matrices stored alike (format, scale dtype, unit length).
        let affine: Vec<&(&CudaMatrix, &mut CudaTensor)> = outs.iter().filter(|(m, _)| m.fmt >= 4).collect();
        let key = |m: &CudaMatrix| (m.fmt, m.sdtype, m.group.min(64));
        let mut i = 0;
        while i < affine.len() {
            let mut j = i + 1;
            while j < affine.len() && j - i < 4 && key(affine[j].0) == key(affine[i].0) {
                j += 1;
            }
            let (fmt, sdt, ul) = key(affine[i].0);
            // The tile of this launch: wide (128 rows × 32 tokens) for 4-bit codes in prompts.
            let tile = if wide && fmt == 4 { 3 } else { tile };
            // Rows and tokens of a tile. The one-token kernel counts rows instead, each matrix
            // starting at a multiple of 4 (a warp's rows never straddle two matrices).
            let (tr, tt) = match tile {
                3 => (128u32, 32u32),
                2 => (32, 32),
                5 => (32, 16),
                1 => (16, 8),
                _ => (1, 1),
            };
            let mut d = IntMatDescs::default();
            let mut tiles = 0u32;
            for (k, (m, y)) in affine[i..j].iter().map(|p| (p.0, &p.1)).enumerate() {
                d.m[k] = IntMatDesc::new(m, y, res, tiles, &self.stream);
                tiles += if tile == 0 { (m.rows as u32).next_multiple_of(4) } else { (m.rows as u32).div_ceil(tr) };
            }
            d.count = (j - i) as u32;
            // One-token launches: eight warps a block, each looping over pairs of rows, at most
            // the blocks resident at once (each block quantizes the token once).
            let blocks_x = if tile == 0 { self.int_one_grid(tiles) } else { tiles };
            let grid = (blocks_x, (rows as u32).div_ceil(tt), 1);
            let fname = compile::matmul_int_entry(fmt, sdt, ul, tile);
            let label = self.profile_label(fname, tiles * tr, affine[i].0.cols, res);
            self.launch_as(fname, label, |st| {
                let q = st.int_in.as_ref().expect("ensure_temps sizes the integer-product input");
                let inp = IntInDesc {
                    planes: ptr(&q.planes, &self.stream),
                    d: ptr(&q.d, &self.stream),
                    ds64: ptr(&q.ds64, &self.stream),
                    ds32: ptr(&q.ds32, &self.stream),
                    tokens: rows as u32,
                    blocks,
                    kpad,
                    pad: 0,
                };
                if tile == 0 {
                    return unsafe { self.kernel(fname, grid, 256, 0, self.args().val(d).val(x_buf).val(tiles)) };
                }
                let threads = if tile == 3 { 128 } else { 256 };
                unsafe { self.kernel(fname, grid, threads, 0, self.args().val(d).val(inp).val(x_buf).val(tiles)) }
            });
            i = j;
        }
        rest
    }

    /// The grid of a one-token integer product of `rows` rows: a block of eight warps per 16
    /// rows, at most the blocks resident at once.
    fn int_one_grid(&self, rows: u32) -> u32 {
        rows.div_ceil(16).clamp(1, self.int_one_blocks)
    }

    /// `gate = W_gate·x`, `up = W_up·x`, `act = silu(gate) ⊙ up` for one token in one integer-product launch
    /// (matmul_int.cu `_one_swiglu`), for matrices stored alike (the caller's `pair`) when they
    /// are affine and the token fits the kernel's shared memory; false (nothing launched)
    /// otherwise.
    fn matmul_int_swiglu_one(&self, x: &CudaTensor, gate_w: &CudaMatrix, up_w: &CudaMatrix, gate: &CudaTensor, up: &CudaTensor, act: &CudaTensor) -> bool {
        if gate_w.fmt < 4 || gate_w.cols > INT_ONE_TOKEN_COLS {
            return false;
        }
        let mut d = IntMatDescs::default();
        d.m[0] = IntMatDesc::new(gate_w, gate, 0, 0, &self.stream);
        d.m[1] = IntMatDesc::new(up_w, up, 0, 0, &self.stream);
        // The third descriptor carries only the SwiGLU output.
        d.m[2].y = ptr(&act.buf, &self.stream);
        d.count = 2;
        let rows = gate_w.rows as u32;
        let fname = compile::matmul_int_entry(gate_w.fmt, gate_w.sdtype, gate_w.group.min(64), 4);
        let label = self.labels_wanted().then(|| format!("{fname} 2x{}x{}", gate_w.rows, gate_w.cols));
        let x_buf = ptr(&x.buf, &self.stream);
        let grid = (self.int_one_grid(2 * rows), 1, 1);
        self.launch_as(fname, label, |_| unsafe { self.kernel(fname, grid, 256, 0, self.args().val(d).val(x_buf).val(rows)) });
        true
    }

    /// `y_i = W_i · x` over `rows` tokens (one token, prompt steps, batched decode), adding each output to
    /// `res` when given.
    fn matmul_rows(&self, x: &CudaTensor, rows: usize, outs: &mut [(&CudaMatrix, &mut CudaTensor)], res: Option<&CudaTensor>) {
        if rows == 0 {
            return;
        }
        if self.products == Products::Int {
            let resp = res.map_or(0, |h| ptr(&h.buf, &self.stream));
            let rest = self.matmul_int_rows(x, rows, outs, resp);
            if rest.len() < outs.len() {
                for i in rest {
                    let (m, y) = &mut outs[i];
                    self.matmul_rows_f32(x, rows, &mut [(*m, &mut **y)], res);
                }
                return;
            }
        }
        self.matmul_rows_f32(x, rows, outs, res)
    }

    /// [`Cuda::matmul_rows`] with the f32 products of numerics §2 for every matrix.
    fn matmul_rows_f32(&self, x: &CudaTensor, rows: usize, outs: &mut [(&CudaMatrix, &mut CudaTensor)], res: Option<&CudaTensor>) {
        if rows == 0 {
            return;
        }
        let res = res.map_or(0, |h| ptr(&h.buf, &self.stream));
        if rows == 1 {
            // One launch per run of matrices stored alike (the one-token kernel dispatches on
            // the first matrix's format), at most four per launch.
            let mut i = 0;
            while i < outs.len() {
                let mut j = i + 1;
                while j < outs.len() && j - i < 4 && Self::same_format(outs[i].0, outs[j].0) {
                    j += 1;
                }
                if j == i + 1 {
                    if let Some(StreamLayout { nslot, slot, smem }) = self.stream_fits(outs[i].0) {
                        let (d, row0) = self.mat_descs(&outs[i..j], res, 1);
                        let label = self.profile_label("matmul_t1s", row0, outs[i].0.cols, res);
                        let grid = (self.sms, 1, 1);
                        self.launch_as("matmul_t1s", label, |_| unsafe {
                            self.kernel("matmul_t1s", grid, 32 * (T1S_WARPS + 1), smem, self.args().val(d).buf(&x.buf).val(nslot).val(slot))
                        });
                        i = j;
                        continue;
                    }
                }
                let total: usize = outs[i..j].iter().map(|(m, _)| m.rows).sum();
                // Two rows per warp halve the warps: worth it where many warps remain and each
                // has little to do (short rows), or the launch is huge (the LM head).
                let short = outs[i].0.cols <= 2048;
                let r = if total >= self.t1r2_min_rows && (short || total >= 16384) { 2 } else { 1 };
                let (d, row0) = self.mat_descs(&outs[i..j], res, r);
                let name = if r == 2 { "matmul_t1r2" } else { "matmul_t1r1" };
                let grid = (row0.div_ceil(8 * r), 1, 1);
                let label = self.profile_label(name, row0, outs[i].0.cols, res);
                self.launch_as(name, label, |_| unsafe { self.kernel(name, grid, 256, 0, self.args().val(d).buf(&x.buf).val(row0)) });
                i = j;
            }
            return;
        }
        let (name, t, r) = if rows <= 4 { ("matmul_t4r2", 4u32, 2u32) } else { ("matmul_t8r4", 8, 4) };
        for group in outs.chunks(4) {
            let (d, row0) = self.mat_descs(group, res, r);
            let (ldx, n_tok) = (x.cols as u32, rows as u32);
            let grid = (row0.div_ceil(r * 8), n_tok.div_ceil(t), 1);
            let label = self.profile_label(name, row0, group[0].0.cols, res);
            self.launch_as(name, label, |_| unsafe { self.kernel(name, grid, 256, 0, self.args().val(d).buf(&x.buf).val(ldx).val(n_tok)) });
        }
    }

    /// `out = silu(gate) ⊙ up` over `rows` tokens.
    fn swiglu_rows(&self, gate: &CudaTensor, up: &CudaTensor, rows: usize, out: &mut CudaTensor) {
        let n = (rows * gate.cols) as u32;
        if n == 0 {
            return;
        }
        self.launch("swiglu", |_| unsafe { self.kernel("swiglu", (n.div_ceil(256), 1, 1), 256, 0, self.args().buf(&gate.buf).buf(&up.buf).val(n).buf(&out.buf)) });
    }

    /// `gate = W_gate·x`, `up = W_up·x`, `act = silu(gate) ⊙ up` over `rows` tokens.
    #[allow(clippy::too_many_arguments)]
    fn matmul_swiglu_rows(&self, x: &CudaTensor, rows: usize, gate_w: &CudaMatrix, up_w: &CudaMatrix, gate: &mut CudaTensor, up: &mut CudaTensor, act: &mut CudaTensor) {
        let pair = Self::same_format(gate_w, up_w) && gate_w.rows == up_w.rows && gate.cols == up.cols && gate.cols == act.cols;
        if pair && rows == 1 && self.products == Products::Int && self.matmul_int_swiglu_one(x, gate_w, up_w, gate, up, act) {
            return;
        }
        if rows == 0 || !pair || self.products == Products::Int {
            self.matmul_rows(x, rows, &mut [(gate_w, &mut *gate), (up_w, &mut *up)], None);
            self.swiglu_rows(gate, up, rows, act);
            return;
        }
        let mut d = MatDescs::default();
        for (i, (m, y)) in [(gate_w, &*gate), (up_w, &*up)].into_iter().enumerate() {
            d.m[i] = MatDesc::new(m, y, 0, &self.stream);
        }
        d.count = 2;
        if rows == 1 {
            let name = "matmul_swiglu_t1";
            let grid = ((gate_w.rows as u32).div_ceil(8), 1, 1);
            let label = self.labels_wanted().then(|| format!("{name} 2x{}x{}", gate_w.rows, gate_w.cols));
            self.launch_as(name, label, |_| unsafe { self.kernel(name, grid, 256, 0, self.args().val(d).buf(&x.buf).buf(&act.buf)) });
            return;
        }
        let (name, t) = if rows <= 4 { ("matmul_swiglu_t4", 4u32) } else { ("matmul_swiglu_t8", 8) };
        let (ldx, n_tok) = (x.cols as u32, rows as u32);
        let grid = ((gate_w.rows as u32).div_ceil(8), n_tok.div_ceil(t), 1);
        let label = self.labels_wanted().then(|| format!("{name} 2x{}x{}", gate_w.rows, gate_w.cols));
        self.launch_as(name, label, |_| unsafe { self.kernel(name, grid, 256, 0, self.args().val(d).buf(&x.buf).val(ldx).val(n_tok).buf(&act.buf)) });
    }
}

impl Cuda {
    /// [`MoeScratch`] for `rows` rows of `cfg`.
    fn moe_scratch(&self, cfg: &ModelConfig, moe: &crate::config::MoeConfig, rows: usize) -> Result<MoeScratch, BackendError> {
        let (d, e, k) = (cfg.hidden_size, moe.num_experts, moe.num_experts_per_tok);
        let (ie, is, p) = (moe.moe_intermediate_size, moe.shared_expert_intermediate_size, rows * k);
        let u = |n: usize| self.stream.alloc_zeros::<u32>(n.max(1)).map_err(|e| dev_err("allocating expert buffers", e));
        let f = |n: usize| self.stream.alloc_zeros::<f32>(n.max(1)).map_err(|e| dev_err("allocating expert buffers", e));
        // A step of fewer rows may use a smaller tile: size for tiles of one, the longest list.
        let items = moe_items(p, e, 1);
        Ok(MoeScratch {
            rows,
            logits: self.tensor(rows, e)?,
            gate_logit: self.tensor(rows, 1)?,
            experts: u(p)?,
            weights: f(p)?,
            perm: u(p)?,
            slot: u(p)?,
            items: u(1 + 3 * items)?,
            shared_gate: self.tensor(rows, is)?,
            shared_up: self.tensor(rows, is)?,
            shared_act: self.tensor(rows, is)?,
            shared: self.tensor(rows, d)?,
            xe: self.tensor(p, d)?,
            ge: self.tensor(p, ie)?,
            ue: self.tensor(p, ie)?,
            ae: self.tensor(p, ie)?,
            oe: self.tensor(p, d)?,
        })
    }

    /// [`Backend::moe`] over `rows` launch rows (already padded while a graph is recorded):
    /// router and shared-gate logits, the shared expert, then on the device `moe_route` (each
    /// row's experts and weights), `moe_plan` (the pairs grouped by expert), the grouped inputs,
    /// the experts' gate/up products, SwiGLU and down products over the groups
    /// (`matmul_experts_*`, weights through the layer's address table), and `moe_combine`.
    /// No host round trip: a decode step with experts is captured like any other.
    #[allow(clippy::too_many_arguments)]
    fn moe_rows(&self, w: &MoeWeights<CudaMatrix>, moe: &crate::config::MoeConfig, rows: usize, u: &CudaTensor, y: &mut CudaTensor, h: &mut CudaTensor, s: &mut MoeScratch) {
        let (d, e, k) = (u.cols, moe.num_experts, moe.num_experts_per_tok);
        let Some(table) = self.expert_tables.lock().unwrap().get(&ptr(&w.gate.w, &self.stream)).map(|t| ptr(t, &self.stream)) else {
            let mut st = self.step.lock().unwrap();
            if st.error.is_none() {
                st.error = Some(BackendError::Device("a mixture-of-experts layer whose expert table was not built (prepare_model)".into()));
            }
            return;
        };
        // Router logits and the shared expert's gate logit (one launch reading u), the shared expert.
        self.matmul_rows(u, rows, &mut [(&w.gate, &mut s.logits), (&w.shared_expert_gate, &mut s.gate_logit)], None);
        let se = &w.shared_expert;
        self.matmul_swiglu_rows(u, rows, &se.gate_proj, &se.up_proj, &mut s.shared_gate, &mut s.shared_up, &mut s.shared_act);
        self.matmul_rows(&s.shared_act, rows, &mut [(&se.down_proj, &mut s.shared)], None);
        // Routing and grouping.
        let (r, p) = (rows as u32, (rows * k) as u32);
        let (name, tile, rw) = moe_tile(rows, rows * k, e);
        let norm = moe.norm_topk_prob as u32;
        // A step of one row needs no grouping (moe_route writes the work list) and no gathered
        // input (every pair reads row 0 of u: the kernels step through x by ldx = 0).
        let single = rows == 1;
        self.launch("moe_route", |_| unsafe {
            self.kernel(
                "moe_route",
                (r.div_ceil(4), 1, 1),
                128,
                0,
                self.args()
                    .buf(&s.logits.buf)
                    .val(r)
                    .val(e as u32)
                    .val(k as u32)
                    .val(norm)
                    .buf(&s.experts)
                    .buf(&s.weights)
                    .val(single as u32)
                    .buf(&s.perm)
                    .buf(&s.slot)
                    .buf(&s.items),
            )
        });
        let cols = d as u32;
        if !single {
            self.launch("moe_plan", |_| unsafe {
                self.kernel("moe_plan", (1, 1, 1), 1024, 0, self.args().buf(&s.experts).val(r).val(k as u32).val(e as u32).val(tile).buf(&s.perm).buf(&s.slot).buf(&s.items))
            });
            // A launch's grid.y is at most 65 535 rows (rows·k reaches 131 072 at k = 32).
            let (perm, xe) = (ptr(&s.perm, &self.stream), ptr(&s.xe.buf, &self.stream));
            for first in (0..p).step_by(65_535) {
                let n = (p - first).min(65_535);
                let (perm, xe) = (perm + 4 * first as u64, xe + 4 * first as u64 * cols as u64);
                self.launch("gather_rows", |_| unsafe { self.kernel("gather_rows", (cols.div_ceil(256), n, 1), 256, 0, self.args().buf(&u.buf).val(perm).val(cols).val(xe)) });
            }
        }
        // The experts' products over the groups: gate and up in one launch, then down.
        let items = moe_items(rows * k, e, tile as usize) as u32;
        let experts = |mats: &[(&CudaMatrix, &CudaTensor, bool)], tab: u64, x: &CudaTensor, ldx: u32, what: &str| {
            let mut dd = MatDescs::default();
            let mut row0 = 0u32;
            for (i, (m, out, offset_all)) in mats.iter().enumerate() {
                dd.m[i] = MatDesc::new(m, out, row0, &self.stream);
                // The one-token kernel may use the offset decode when every expert's rows pass
                // (the bitmaps are per expert; no kernel reads them here).
                dd.m[i].offset = if *offset_all && tile == 1 { 2 } else { 0 };
                dd.m[i].offset_rows = 0;
                row0 += (m.rows as u32).div_ceil(rw) * rw;
            }
            dd.count = mats.len() as u32;
            let grid = (row0.div_ceil(rw * 8), items, 1);
            let label = self.labels_wanted().then(|| format!("{name} {what} {row0}x{}", mats[0].0.cols));
            self.launch_as(name, label, |_| unsafe { self.kernel(name, grid, 256, 0, self.args().val(dd).val(tab).val(e as u32).buf(&s.items).buf(&x.buf).val(ldx)) });
        };
        let e0 = &w.experts[0];
        let pair_bytes = 2 * std::mem::size_of::<u64>() as u64;
        let all = |f: fn(&MlpWeights<CudaMatrix>) -> &CudaMatrix| w.experts.iter().all(|x| f(x).offset_all);
        let (og, ou, od) = (all(|x| &x.gate_proj), all(|x| &x.up_proj), all(|x| &x.down_proj));
        let (xe, ldx) = if single { (u, 0) } else { (&s.xe, cols) };
        experts(&[(&e0.gate_proj, &s.ge, og), (&e0.up_proj, &s.ue, ou)], table, xe, ldx, "gate|up");
        self.swiglu_rows(&s.ge, &s.ue, rows * k, &mut s.ae);
        experts(&[(&e0.down_proj, &s.oe, od)], table + 2 * e as u64 * pair_bytes, &s.ae, s.ae.cols as u32, "down");
        self.launch("moe_combine", |_| unsafe {
            self.kernel(
                "moe_combine",
                (cols.div_ceil(256), r, 1),
                256,
                0,
                self.args().buf(&s.oe.buf).buf(&s.slot).buf(&s.weights).buf(&s.gate_logit.buf).buf(&s.shared.buf).val(k as u32).val(cols).buf(&y.buf).buf(&h.buf),
            )
        });
    }
}

/// Scales and biases (same length, `size`-byte elements) as `[s0 b0 s1 b1 ...]`: the layout
/// the kernels read (`load_sb` in matmul.cu, embed.cu).
fn interleave(scales: &[u8], biases: &[u8], size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(scales.len() * 2);
    for (s, b) in scales.chunks_exact(size).zip(biases.chunks_exact(size)) {
        out.extend_from_slice(s);
        out.extend_from_slice(b);
    }
    out
}

/// Whether a group's 4-bit values `fma(s, q, b)` (numerics §2) may be computed as
/// `fma(256·s, 0.5 + q/256, b − 128·s)`: the float `0.5 + q/256` is one byte permute away from the
/// code (matmul.cu `nib_to_float_offset`), where `float(q)` needs a subtraction more. The two are
/// the same number before the one rounding, `256s·(0.5 + q/256) + (b − 128s) = s·q + b`, so the
/// same bits, when `256·s` and `b − 128·s` are exact in f32. Also required: s and b finite and
/// non-zero (a zero bias could change the sign of a zero weight) and within 2^20 of each other
/// in magnitude, so the f64 difference below is itself exact.
pub fn offset_exact(s: f32, b: f32) -> bool {
    if !s.is_finite() || !b.is_finite() || s == 0.0 || b == 0.0 {
        return false;
    }
    let ratio = (b as f64 / s as f64).abs();
    if !(2f64.powi(-20)..=2f64.powi(20)).contains(&ratio) {
        return false;
    }
    let big = 256.0 * s;
    let diff = b as f64 - 128.0 * s as f64; // exact: two short significands within 2^27
    big.is_finite() && (diff as f32) as f64 == diff && (diff as f32).is_finite()
}

fn fmt_codes(m: &Matrix) -> (u32, u32, u32) {
    let dt = |f: FloatType| match f {
        FloatType::F32 => 0,
        FloatType::F16 => 1,
        FloatType::BF16 => 2,
    };
    match &m.data {
        MatrixData::Float { dtype, .. } => (dt(*dtype), 0, 0),
        MatrixData::Affine { bits, group_size, scale_dtype, .. } => (*bits, *group_size as u32, dt(*scale_dtype)),
    }
}

/// Step set-up and teardown, slot copies, the inert pad slot.
impl Cuda {
    /// `begin_step`: `caps` are the rows and logits rows the step's scratch buffers hold, when
    /// known; a decode step may then be padded to a bucket's graph.
    fn begin(&self, states: &mut CudaStates, batch: &Batch, caps: Option<(usize, usize)>) -> Result<(), BackendError> {
        batch.validate()?;
        self.check()?;
        let (n, l) = (batch.rows(), batch.logit_rows.len());
        if n > MAX_ROWS || l > MAX_ROWS {
            return Err(BackendError::Batch(format!("{n} rows / {l} logits rows exceed the CUDA backend's {MAX_ROWS}")));
        }
        batch.check_ids(states.cfg.vocab_size)?;
        let cfg = states.cfg.clone();
        let max = cfg.max_position_embeddings;
        let page_len = ATTENTION_TILE * cfg.num_key_value_heads * cfg.head_dim;
        let max_pages = states.max_pages;
        let mut rows = Vec::with_capacity(batch.rows());
        let mut seqs = Vec::with_capacity(batch.seqs.len());
        let mut top = 0usize;
        for s in &batch.seqs {
            let m = states.slots.get_mut(s.slot as usize).and_then(Option::as_mut).ok_or(BackendError::Slot { slot: s.slot as usize, problem: "is not allocated".into() })?;
            if m.position != s.pos as usize {
                return Err(BackendError::Slot { slot: s.slot as usize, problem: format!("is at position {}, but the step continues it at {}", m.position, s.pos) });
            }
            if m.read_only {
                return Err(BackendError::Slot { slot: s.slot as usize, problem: "holds a snapshot, which no step may continue".into() });
            }
            let end = (s.pos + s.len) as usize;
            if end > max {
                return Err(BackendError::ContextFull { position: end - 1, max });
            }
            // KV pages for positions < end (allocated outside any graph; the page table is data).
            let need = end.div_ceil(ATTENTION_TILE);
            let have = m.pages_held();
            if have < need {
                for (l, layer) in m.pages.iter_mut().enumerate() {
                    for (kv, pages) in layer.iter_mut().enumerate() {
                        while pages.len() < need {
                            let d = self.stream.alloc_zeros::<f32>(page_len).map_err(|e| dev_err("allocating a KV page", e))?;
                            m.host_table[(l * 2 + kv) * max_pages + pages.len()] = ptr(&d, &self.stream);
                            pages.push(Page::new(d));
                        }
                    }
                }
                self.upload_page_table(m, max_pages, have..need)?;
            }
            seqs.push(SeqDesc { slot: s.slot, first_row: s.first_row, len: s.len, pos: s.pos });
            for t in 0..s.len {
                rows.push(RowDesc { slot: s.slot, pos: s.pos + t });
            }
            top = top.max(end);
        }
        // A decode-shaped step (one row per sequence) runs as a graph, on the bucket's graph when
        // the scratch buffers hold its rows (the logits rows too, when every row wants logits).
        let graph = self.use_graphs.load(std::sync::atomic::Ordering::Relaxed) && (1..=GRAPH_MAX_ROWS).contains(&n) && batch.seqs.iter().all(|s| s.len == 1);
        let mut pad = None;
        if let (true, Some((cap_rows, cap_logits))) = (graph, caps) {
            let brows = bucket(n, if l == n { cap_rows.min(cap_logits) } else { cap_rows });
            let blogits = match l {
                0 => 0,
                _ if l == n => brows,
                _ => bucket(l, cap_logits),
            };
            if (brows, blogits) != (n, l) {
                pad = Some(Pad { rows: n, brows, logits: l, blogits });
            }
        }
        let (brows, blogits) = pad.map_or((n, l), |p| (p.brows, p.blogits));
        let mut st = self.step.lock().unwrap();
        if pad.is_some() && st.pad_slot.is_none() {
            let mem = self.pad_slot_mem(&cfg, max_pages)?;
            st.host_slot_table[PAD_SLOT as usize] = mem.desc(&self.stream);
            st.slot_table_dirty = true;
            st.pad_slot = Some(mem);
        }
        // The inert rows: each its own one-token sequence of the pad slot at position 0; the
        // padded logits rows read the inert rows (or the last row).
        for r in n..brows {
            seqs.push(SeqDesc { slot: PAD_SLOT, first_row: r as u32, len: 1, pos: 0 });
            rows.push(RowDesc { slot: PAD_SLOT, pos: 0 });
        }
        let mut logit_rows = batch.logit_rows.clone();
        logit_rows.extend((l..blogits).map(|i| (n + i - l).min(brows - 1) as u32));
        // RoPE rows for every position the step touches.
        if top > st.rope_rows_on_device {
            let rd = cfg.rotary_dim();
            let lo = st.rope_rows_on_device;
            let host = st.rope_host.as_mut().expect("new_states ran");
            host.ensure(top);
            let chunk = host.as_slice()[lo * rd..top * rd].to_vec();
            let dst = st.rope.as_mut().expect("new_states ran");
            let mut view = dst.slice_mut(lo * rd..top * rd);
            self.stream.memcpy_htod(&chunk, &mut view).map_err(|e| dev_err("RoPE table", e))?;
            st.rope_rows_on_device = top;
        }
        if st.slot_table_dirty {
            let t = st.host_slot_table.clone();
            self.stream.memcpy_htod(&t, &mut st.slot_table).map_err(|e| dev_err("slot table", e))?;
            st.slot_table_dirty = false;
        }
        // The ids are already on the device when the last greedy step wrote exactly these (the
        // inert rows' ids are then the last step's: ids the argmax or the host wrote, all valid).
        if st.device_ids != batch.ids {
            let mut ids = batch.ids.clone();
            ids.resize(brows, 0);
            let mut v = st.ids.slice_mut(0..brows);
            self.stream.memcpy_htod(&ids, &mut v).map_err(|e| dev_err("ids", e))?;
        }
        st.device_ids.clear();
        {
            let mut v = st.seqs.slice_mut(0..seqs.len());
            self.stream.memcpy_htod(&seqs, &mut v).map_err(|e| dev_err("sequences", e))?;
        }
        {
            let mut v = st.rows.slice_mut(0..rows.len());
            self.stream.memcpy_htod(&rows, &mut v).map_err(|e| dev_err("rows", e))?;
        }
        if !logit_rows.is_empty() {
            let mut v = st.logit_rows.slice_mut(0..logit_rows.len());
            self.stream.memcpy_htod(&logit_rows, &mut v).map_err(|e| dev_err("logit rows", e))?;
        }
        self.ensure_temps(&mut st, &cfg, brows)?;
        // The argmax's per-slice bests, for every row a chooser may run over.
        if blogits.max(l) > st.argmax_cap {
            let cap = blogits.max(l).next_power_of_two().max(CHOOSER_MIN_ROWS);
            st.argmax_v = self.stream.alloc_zeros::<f32>(cap * ARGMAX_PARTS).map_err(|e| dev_err("allocating argmax buffers", e))?;
            st.argmax_i = self.stream.alloc_zeros::<u32>(cap * ARGMAX_PARTS).map_err(|e| dev_err("allocating argmax buffers", e))?;
            st.argmax_cap = cap;
            st.graphs.clear();
        }
        // Attention partials: [rows][Hq][tiles][Dh + 2 + tile] (m, l, o, the tile's scores).
        let per_row = cfg.num_attention_heads * (cfg.head_dim + 2 + ATTENTION_TILE);
        let tiles = top.div_ceil(ATTENTION_TILE).max(1);
        let need = batch.rows() * per_row * tiles;
        if st.part_eager.as_ref().is_none_or(|b| b.len() < need) {
            st.part_eager = Some(self.stream.alloc_zeros::<f32>(need).map_err(|e| dev_err("attention partials", e))?);
        }
        st.max_tiles = tiles;
        // Graphs use a partial buffer sized for the longest context, never reallocated while
        // they live (it grows with the largest bucket; the graphs are then recorded again). Where
        // it cannot be had, the step runs eagerly: the same bits.
        let mut graph = graph;
        if graph {
            let g_tiles = max.div_ceil(ATTENTION_TILE);
            if st.part_graph.as_ref().is_none_or(|b| b.len() < brows * per_row * g_tiles) {
                st.part_graph = None;
                st.graphs.clear();
                match self.stream.alloc_zeros::<f32>(brows * per_row * g_tiles) {
                    Ok(b) => {
                        st.part_graph = Some(b);
                        st.part_graph_tiles = g_tiles;
                    }
                    Err(_) => graph = false,
                }
            }
        }
        st.graph_step = graph;
        st.pad = if graph { pad } else { None };
        st.batch_rows = batch.rows();
        st.mode = Mode::Eager;
        Ok(())
    }

    /// The state of [`PAD_SLOT`]: zero conv windows and recurrent states, and the one KV page
    /// per attention layer that rows at position 0 write and read.
    fn pad_slot_mem(&self, cfg: &ModelConfig, max_pages: usize) -> Result<SlotMem, BackendError> {
        let mut mem = self.slot_mem(cfg, max_pages)?;
        let page_len = ATTENTION_TILE * cfg.num_key_value_heads * cfg.head_dim;
        for (l, layer) in mem.pages.iter_mut().enumerate() {
            for (kv, pages) in layer.iter_mut().enumerate() {
                let d = self.stream.alloc_zeros::<f32>(page_len).map_err(|e| dev_err("allocating the pad slot", e))?;
                mem.host_table[(l * 2 + kv) * max_pages] = ptr(&d, &self.stream);
                pages.push(Page::new(d));
            }
        }
        self.stream.memcpy_htod(&mem.host_table, &mut mem.table).map_err(|e| dev_err("allocating the pad slot", e))?;
        Ok(mem)
    }

    /// Uploads the entries of pages `range` of every layer's keys and values from the slot's host
    /// page table: one small copy per table row, where a copy of the whole table (98 KB for a
    /// 262,144-position context) from pageable memory would wait for the stream.
    fn upload_page_table(&self, m: &mut SlotMem, max_pages: usize, range: std::ops::Range<usize>) -> Result<(), BackendError> {
        if range.is_empty() {
            return Ok(());
        }
        for row in 0..m.pages.len() * 2 {
            let (lo, hi) = (row * max_pages + range.start, row * max_pages + range.end);
            let mut view = m.table.slice_mut(lo..hi);
            self.stream.memcpy_htod(&m.host_table[lo..hi], &mut view).map_err(|e| dev_err("page table", e))?;
        }
        Ok(())
    }

    /// Puts `mem` in slot `idx` ([`CudaStates::next_slot`]) and names it in the device's slot
    /// table (uploaded by the next step).
    fn install_slot(&self, states: &mut CudaStates, idx: usize, mem: SlotMem) -> u32 {
        let mut st = self.step.lock().unwrap();
        st.host_slot_table[idx] = mem.desc(&self.stream);
        st.slot_table_dirty = true;
        if idx == states.slots.len() {
            states.slots.push(None);
        }
        states.slots[idx] = Some(mem);
        idx as u32
    }

    /// A zero state at position 0 with no KV pages.
    fn slot_mem(&self, cfg: &ModelConfig, max_pages: usize) -> Result<SlotMem, BackendError> {
        let n_lin = cfg.num_linear_layers();
        let n_full = cfg.num_full_layers();
        let z = |n: usize| self.stream.alloc_zeros::<f32>(n.max(1)).map_err(|e| dev_err("allocating a sequence slot", e));
        let conv = z(n_lin * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim())?;
        let rec = z(n_lin * cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim)?;
        let host_table = vec![0u64; (n_full * 2 * max_pages).max(1)];
        // Zeroed on the device (a memset in stream order, where an upload would wait for it).
        let table = self.stream.alloc_zeros::<u64>(host_table.len()).map_err(|e| dev_err("allocating a page table", e))?;
        Ok(SlotMem { conv, rec, table, host_table, pages: (0..n_full).map(|_| [Vec::new(), Vec::new()]).collect(), position: 0, read_only: false })
    }

    /// The row count an operation launches over for the model's `rows` ([`Step::eff`]).
    fn eff(&self, rows: usize) -> usize {
        self.step.lock().unwrap().eff(rows)
    }

    /// Row counts of the recorded graphs, ascending (decode buckets, or a step's own shape).
    pub fn graph_rows(&self) -> Vec<usize> {
        self.graph_nodes().into_iter().map(|(rows, _)| rows).collect()
    }

    /// Row count and kernel nodes of every recorded graph, ascending.
    pub fn graph_nodes(&self) -> Vec<(usize, u64)> {
        let mut v: Vec<(usize, u64)> = self.step.lock().unwrap().graphs.iter().map(|(k, r)| (k.rows, r.nodes)).collect();
        v.sort_unstable();
        v
    }

    /// `end_step` before the step's padding is reset.
    fn end(&self, states: &mut CudaStates, batch: &Batch) -> Result<(), BackendError> {
        let mut st = self.step.lock().unwrap();
        let mode = st.mode;
        st.mode = Mode::Eager;
        match mode {
            Mode::Eager => {}
            Mode::Capturing(key) => {
                let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(|e| dev_err("ending graph capture", e))?;
                if let Some(e) = st.error.take() {
                    return Err(e);
                }
                let graph = graph.ok_or_else(|| BackendError::Device("graph capture produced no graph".into()))?;
                graph.upload().map_err(|e| dev_err("uploading a graph", e))?;
                graph.launch().map_err(|e| dev_err("launching a graph", e))?;
                let chooser = st.captured_chooser.take();
                let nodes = st.launches - st.capture_start;
                let timeline_record = st.timeline_record.take();
                st.graphs.insert(key, Recorded { graph, nodes, chooser, timeline_record });
            }
            Mode::Replaying(key) => {
                // A step refused while it was being set up (a chooser's buffers) runs nothing:
                // its slots keep their state and position.
                if let Some(e) = st.error.take() {
                    return Err(e);
                }
                if let Some(record) = st.graphs[&key].timeline_record {
                    if let Some(t) = st.timeline.as_mut() {
                        t.arm(&self.stream, record)?;
                    }
                }
                st.graphs[&key].graph.launch().map_err(|e| dev_err("launching a graph", e))?;
                if let Some(p) = st.pending_chooser.take() {
                    self.launch_chooser(&mut st, p.kind, p.logits, p.rows, p.v_eff, p.ld).map_err(|e| dev_err("choosing tokens", e))?;
                    st.launches += if p.kind == Chooser::Argmax { 2 } else { 1 };
                }
            }
        }
        drop(st);
        self.check()?;
        for s in &batch.seqs {
            if let Some(m) = states.slots.get_mut(s.slot as usize).and_then(Option::as_mut) {
                m.position += s.len as usize;
            }
        }
        Ok(())
    }
}

impl Backend for Cuda {
    type Matrix = CudaMatrix;
    type Vector = CudaSlice<f32>;
    type Tensor = CudaTensor;
    type States = CudaStates;

    fn describe(&self) -> String {
        let ints = if self.products == Products::Int { ", integer products" } else { "" };
        format!("cuda ({}, {}{ints})", self.name, self.arch)
    }

    fn products(&self) -> Products {
        self.products
    }

    fn max_rows(&self) -> usize {
        MAX_ROWS
    }

    fn max_slots(&self) -> usize {
        MAX_SLOTS
    }

    fn check_model(&self, cfg: &ModelConfig) -> Result<(), BackendError> {
        if let Some(m) = &cfg.moe {
            let refuse = |why: String| Err(BackendError::Device(format!("{}: {why}; use --device cpu", cfg.path.display())));
            if m.num_experts > 1024 || m.num_experts_per_tok > 32 {
                return refuse(format!("{} experts, {} per token: the CUDA expert kernels route at most 1024 experts and 32 per token", m.num_experts, m.num_experts_per_tok));
            }
            if self.products == Products::Int {
                return refuse("the CUDA backend runs mixture-of-experts models with f32 products only (integer products, --products int, have no expert kernels yet)".into());
            }
        }
        Ok(())
    }

    fn prepare_model(&self, weights: &Weights<CudaMatrix, CudaSlice<f32>>) -> Result<(), BackendError> {
        let mut tables = self.expert_tables.lock().unwrap();
        for l in &weights.layers {
            let Ffn::Moe(m) = &l.mlp else { continue };
            let mut t = Vec::with_capacity(6 * m.experts.len());
            fn pick(x: &MlpWeights<CudaMatrix>, i: usize) -> &CudaMatrix {
                [&x.gate_proj, &x.up_proj, &x.down_proj][i]
            }
            for i in 0..3 {
                let first = pick(&m.experts[0], i);
                for x in &m.experts {
                    let x = pick(x, i);
                    // One launch serves every expert with the first one's descriptor.
                    if !Self::same_format(first, x) || x.rows != first.rows {
                        return Err(BackendError::Device("the experts of a mixture-of-experts layer are stored in different formats or shapes".into()));
                    }
                    t.push(ptr(&x.w, &self.stream));
                    t.push(ptr(&x.sb, &self.stream));
                }
            }
            let dev = self.stream.clone_htod(&t).map_err(|e| dev_err("uploading an expert table", e))?;
            tables.insert(ptr(&m.gate.w, &self.stream), dev);
        }
        Ok(())
    }

    fn moe(&self, w: &MoeWeights<CudaMatrix>, cfg: &ModelConfig, rows: usize, u: &CudaTensor, y: &mut CudaTensor, h: &mut CudaTensor) {
        let moe = cfg.moe.as_ref().expect("a mixture-of-experts layer in a model whose config has no experts");
        let rows = self.eff(rows);
        if rows == 0 {
            return;
        }
        let Some(mut s) = self.step.lock().unwrap().moe.take() else {
            let mut st = self.step.lock().unwrap();
            if st.error.is_none() {
                st.error = Some(BackendError::Device("mixture-of-experts buffers missing (begin_step sizes them)".into()));
            }
            return;
        };
        debug_assert!(s.rows >= rows);
        self.moe_rows(w, moe, rows, u, y, h, &mut s);
        self.step.lock().unwrap().moe = Some(s);
    }

    fn upload_matrix(&self, m: &Matrix) -> Result<CudaMatrix, BackendError> {
        let (fmt, group, sdtype) = fmt_codes(m);
        let up = |b: &[u8]| -> Result<CudaSlice<u8>, BackendError> {
            if b.is_empty() {
                return self.stream.alloc_zeros::<u8>(4).map_err(|e| dev_err("upload", e));
            }
            self.stream.clone_htod(b).map_err(|e| dev_err(&format!("uploading {}", m.name), e))
        };
        let mut offset_all = false;
        let (w, sb, offset_rows) = match &m.data {
            MatrixData::Float { data, .. } => (up(data.as_slice())?, up(&[])?, None),
            MatrixData::Affine { weight, scales, biases, scale_dtype, bits, .. } => {
                let offset_rows = if *bits == 4 && *scale_dtype != FloatType::F32 {
                    let (ss, bs) = (scales.as_slice(), biases.as_slice());
                    let groups = ss.len() / scale_dtype.size() / m.rows.max(1);
                    let mut bits = vec![0u32; m.rows.div_ceil(32)];
                    offset_all = true;
                    for r in 0..m.rows {
                        let ok = (r * groups..(r + 1) * groups).all(|i| offset_exact(scale_dtype.get(ss, i), scale_dtype.get(bs, i)));
                        bits[r / 32] |= (ok as u32) << (r % 32);
                        offset_all &= ok;
                    }
                    Some(self.stream.clone_htod(&bits).map_err(|e| dev_err(&format!("uploading {}", m.name), e))?)
                } else {
                    None
                };
                (up(weight.as_slice())?, up(&interleave(scales.as_slice(), biases.as_slice(), scale_dtype.size()))?, offset_rows)
            }
        };
        Ok(CudaMatrix { rows: m.rows, cols: m.cols, fmt, group, sdtype, offset_rows, offset_all, per_word: m.elems_per_word(), w, sb })
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaSlice<f32>, BackendError> {
        if v.is_empty() {
            return self.stream.alloc_zeros::<f32>(1).map_err(|e| dev_err("upload", e));
        }
        self.stream.clone_htod(v).map_err(|e| dev_err("uploading a vector", e))
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor, BackendError> {
        let buf = self.stream.alloc_zeros::<f32>((rows * cols).max(1)).map_err(|e| dev_err("allocating activations", e))?;
        Ok(CudaTensor { buf, rows, cols, id: self.new_tensor_id() })
    }

    fn read_tensor(&self, t: &CudaTensor, rows: usize, out: &mut Vec<f32>) -> Result<(), BackendError> {
        self.check()?;
        out.resize(rows * t.cols, 0.0);
        let view = t.buf.slice(0..rows * t.cols);
        self.stream.memcpy_dtoh(&view, out.as_mut_slice()).map_err(|e| dev_err("reading activations", e))?;
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))?;
        self.step.lock().unwrap().waits += 1;
        self.check()
    }

    fn new_states(&self, cfg: &ModelConfig) -> Result<CudaStates, BackendError> {
        if cfg.linear_conv_kernel_dim > 8 {
            return Err(BackendError::Device(format!("linear_conv_kernel_dim {} > 8 is not supported by the CUDA kernels", cfg.linear_conv_kernel_dim)));
        }
        if cfg.linear_key_head_dim > 128 || cfg.linear_value_head_dim > 128 {
            return Err(BackendError::Device(format!(
                "GDN head dims dk {} / dv {} > 128 are not supported by the CUDA kernels",
                cfg.linear_key_head_dim, cfg.linear_value_head_dim
            )));
        }
        if cfg.hidden_size > 8192 || cfg.intermediate_size > 65536 {
            return Err(BackendError::Device(format!("hidden_size {} > 8192 is not supported by the CUDA RMSNorm kernel", cfg.hidden_size)));
        }
        if cfg.head_dim > 256 || !cfg.head_dim.is_multiple_of(32) || !cfg.num_attention_heads.is_multiple_of(cfg.num_key_value_heads) {
            return Err(BackendError::Device(format!(
                "head_dim {} (num_attention_heads {}, num_key_value_heads {}) is not supported by the CUDA kernels: they need a head_dim of at most 256, a multiple of 32, and whole query groups",
                cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
            )));
        }
        *self.cfg_cache.lock().unwrap() = Some(cfg.clone());
        let mut st = self.step.lock().unwrap();
        if st.rope.is_none() {
            let rows = cfg.max_position_embeddings;
            st.rope = Some(self.stream.alloc_zeros::<f32>(rows * cfg.rotary_dim()).map_err(|e| dev_err("allocating the RoPE table", e))?);
            st.rope_host = Some(RopeTable::new(cfg.rotary_dim(), cfg.rope_theta));
        }
        Ok(CudaStates { cfg: cfg.clone(), slots: Vec::new(), max_pages: cfg.max_position_embeddings.div_ceil(ATTENTION_TILE) })
    }

    /// One allocation of `bytes` (at most 80% of the free device memory), freed at once: the
    /// pool keeps it, and the slots, pages and snapshots allocated later come out of it
    /// instead of each mapping fresh memory (hundreds of microseconds of host time for a 2B
    /// model's 20 MB state: bench/results/2026-12-07-h100-snapshots-2b.md).
    fn reserve_state_memory(&self, bytes: u64) {
        if !self.pool_kept || bytes == 0 {
            return;
        }
        let free = self._ctx.mem_get_info().map_or(0, |(free, _)| free as u64);
        let n = bytes.min(free / 10 * 8) as usize;
        // SAFETY: never read or written; the stream-ordered free gives it to the pool.
        if let Ok(block) = unsafe { self.stream.alloc::<u8>(n.max(1)) } {
            drop(block);
            let _ = self.stream.synchronize();
        }
    }

    fn alloc_slot(&self, states: &mut CudaStates) -> Result<u32, BackendError> {
        let idx = states.next_slot()?;
        let mem = self.slot_mem(&states.cfg, states.max_pages)?;
        Ok(self.install_slot(states, idx, mem))
    }

    fn free_slot(&self, states: &mut CudaStates, slot: u32) -> Result<(), BackendError> {
        match states.slots.get_mut(slot as usize) {
            Some(s @ Some(_)) => {
                *s = None; // stream-ordered frees
                let mut st = self.step.lock().unwrap();
                st.host_slot_table[slot as usize] = SlotDesc::default();
                st.slot_table_dirty = true;
                Ok(())
            }
            _ => Err(BackendError::Slot { slot: slot as usize, problem: "is not allocated".into() }),
        }
    }

    fn slot_position(&self, states: &CudaStates, slot: u32) -> Result<usize, BackendError> {
        states.slots.get(slot as usize).and_then(Option::as_ref).map(|s| s.position).ok_or(BackendError::Slot { slot: slot as usize, problem: "is not allocated".into() })
    }

    fn export_slot(&self, states: &CudaStates, slot: u32) -> Result<SequenceState, BackendError> {
        self.check()?;
        let cfg = &states.cfg;
        let m = states.slots.get(slot as usize).and_then(Option::as_ref).ok_or(BackendError::Slot { slot: slot as usize, problem: "is not allocated".into() })?;
        // Straight into the vectors the state is made of (no staging copy on the host).
        let down = |src: &CudaSlice<f32>, range: std::ops::Range<usize>| -> Result<Vec<f32>, BackendError> {
            let mut v = vec![0.0f32; range.len()];
            self.stream.memcpy_dtoh(&src.slice(range), v.as_mut_slice()).map_err(|e| dev_err("swap out", e))?;
            Ok(v)
        };
        let per_conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim();
        let per_rec = cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim;
        let n_lin = cfg.num_linear_layers();
        let width = cfg.num_key_value_heads * cfg.head_dim;
        let conv = (0..n_lin).map(|l| down(&m.conv, l * per_conv..(l + 1) * per_conv)).collect::<Result<_, _>>()?;
        let recurrent = (0..n_lin).map(|l| down(&m.rec, l * per_rec..(l + 1) * per_rec)).collect::<Result<_, _>>()?;
        let mut keys = Vec::new();
        let mut values = Vec::new();
        let page_len = ATTENTION_TILE * width;
        for layer in &m.pages {
            for (kv, dst) in layer.iter().zip([&mut keys, &mut values]) {
                let mut v = vec![0.0f32; m.position * width];
                for (page, chunk) in kv.iter().zip(v.chunks_mut(page_len)) {
                    self.stream.memcpy_dtoh(&page.slice(0..chunk.len()), chunk).map_err(|e| dev_err("swap out", e))?;
                }
                dst.push(v);
            }
        }
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))?;
        Ok(SequenceState { position: m.position, conv, recurrent, keys, values })
    }

    fn import_slot(&self, states: &mut CudaStates, slot: u32, state: &SequenceState) -> Result<(), BackendError> {
        state.check(&states.cfg)?;
        let cfg = states.cfg.clone();
        let page_len = ATTENTION_TILE * cfg.num_key_value_heads * cfg.head_dim;
        let width = cfg.num_key_value_heads * cfg.head_dim;
        let max_pages = states.max_pages;
        let m = states.slots.get_mut(slot as usize).and_then(Option::as_mut).ok_or(BackendError::Slot { slot: slot as usize, problem: "is not allocated".into() })?;
        let conv: Vec<f32> = state.conv.concat();
        let rec: Vec<f32> = state.recurrent.concat();
        self.stream.memcpy_htod(&conv, &mut m.conv).map_err(|e| dev_err("swap in", e))?;
        self.stream.memcpy_htod(&rec, &mut m.rec).map_err(|e| dev_err("swap in", e))?;
        let n_pages = state.position.div_ceil(ATTENTION_TILE);
        for (l, layer) in m.pages.iter_mut().enumerate() {
            for (kv, src) in [&state.keys[l], &state.values[l]].into_iter().enumerate() {
                layer[kv].clear();
                for p in 0..n_pages {
                    let mut page = vec![0.0f32; page_len];
                    let lo = p * ATTENTION_TILE * width;
                    let hi = ((p + 1) * ATTENTION_TILE * width).min(state.position * width);
                    page[..hi - lo].copy_from_slice(&src[lo..hi]);
                    let d = self.stream.clone_htod(&page).map_err(|e| dev_err("swap in", e))?;
                    m.host_table[(l * 2 + kv) * max_pages + p] = ptr(&d, &self.stream);
                    layer[kv].push(Page::new(d));
                }
                for p in n_pages..max_pages {
                    m.host_table[(l * 2 + kv) * max_pages + p] = 0;
                }
            }
        }
        self.stream.memcpy_htod(&m.host_table, &mut m.table).map_err(|e| dev_err("swap in", e))?;
        m.position = state.position;
        m.read_only = false;
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))?;
        Ok(())
    }

    /// Device to device: the conv windows and recurrent states, and the KV pages up to `src`'s
    /// position: `dst` shares `src`'s full pages (never written again, [`Page`]) and gets its
    /// own copy of the partly filled last one, which both go on writing (its own page at that
    /// index when no other slot holds it, else a new one); only `dst`'s page table goes up from
    /// the host.
    fn copy_slot(&self, states: &mut CudaStates, src: u32, dst: u32) -> Result<(), BackendError> {
        self.check()?;
        let alloc = |states: &CudaStates, s: u32| states.slots.get(s as usize).is_some_and(Option::is_some);
        for s in [src, dst] {
            if !alloc(states, s) {
                return Err(BackendError::Slot { slot: s as usize, problem: "is not allocated".into() });
            }
        }
        if src == dst {
            return Ok(());
        }
        let cfg = &states.cfg;
        let page_len = ATTENTION_TILE * cfg.num_key_value_heads * cfg.head_dim;
        let max_pages = states.max_pages;
        let mut d = states.slots[dst as usize].take().expect("checked above");
        let s = states.slots[src as usize].as_ref().expect("checked above");
        let copied = (|| -> Result<(), BackendError> {
            let e = |e| dev_err("copying a slot", e);
            self.stream.memcpy_dtod(&s.conv, &mut d.conv).map_err(e)?;
            self.stream.memcpy_dtod(&s.rec, &mut d.rec).map_err(e)?;
            let n_pages = s.position.div_ceil(ATTENTION_TILE);
            let full = s.position / ATTENTION_TILE;
            // Entries past both the old and the new page count are 0 already.
            let changed = n_pages.max(d.pages_held());
            for (l, (from, to)) in s.pages.iter().zip(d.pages.iter_mut()).enumerate() {
                for kv in 0..2 {
                    // Pages let go are freed in stream order; the page table that names them
                    // is replaced below, before any kernel reads it.
                    to[kv].truncate(n_pages);
                    for p in 0..n_pages {
                        if p < full {
                            match to[kv].get_mut(p) {
                                Some(page) => *page = from[kv][p].clone(),
                                None => to[kv].push(from[kv][p].clone()),
                            }
                            continue;
                        }
                        if to[kv].get_mut(p).and_then(Page::get_mut).is_none() {
                            // SAFETY: the whole page is written by the copy below before
                            // anything reads it.
                            let page = Page::new(unsafe { self.stream.alloc::<f32>(page_len) }.map_err(|e| dev_err("allocating a KV page", e))?);
                            match to[kv].get_mut(p) {
                                Some(old) => *old = page,
                                None => to[kv].push(page),
                            }
                        }
                        let page = Page::get_mut(&mut to[kv][p]).expect("held by this slot alone");
                        self.stream.memcpy_dtod(&*from[kv][p], page).map_err(e)?;
                    }
                    for p in 0..changed {
                        d.host_table[(l * 2 + kv) * max_pages + p] = to[kv].get(p).map_or(0, |page| ptr(page, &self.stream));
                    }
                }
            }
            // Also right when `dst` was a snapshot: its device table is zero, as are its host
            // entries past `changed`.
            self.upload_page_table(&mut d, max_pages, 0..changed)?;
            d.position = s.position;
            d.read_only = false;
            Ok(())
        })();
        states.slots[dst as usize] = Some(d);
        copied
    }

    /// A new read-only slot with `src`'s state: its own copy of the conv windows and recurrent
    /// states (uninitialized memory, then one device copy each) and every one of `src`'s KV
    /// pages shared ([`Page`]), so a snapshot at the end of a prompt copies no KV cache.
    fn snapshot_slot(&self, states: &mut CudaStates, src: u32) -> Result<u32, BackendError> {
        self.check()?;
        let s = states.slots.get(src as usize).and_then(Option::as_ref).ok_or(BackendError::Slot { slot: src as usize, problem: "is not allocated".into() })?;
        let idx = states.next_slot()?;
        let e = |e| dev_err("taking a snapshot", e);
        let copy = |from: &CudaSlice<f32>| -> Result<CudaSlice<f32>, BackendError> {
            // SAFETY: written whole by the copy before anything reads it.
            let mut to = unsafe { self.stream.alloc::<f32>(from.len()) }.map_err(e)?;
            self.stream.memcpy_dtod(from, &mut to).map_err(e)?;
            Ok(to)
        };
        let conv = copy(&s.conv)?;
        let rec = copy(&s.rec)?;
        let host_table = s.host_table.clone();
        // Never read on the device: no step continues a snapshot, and a slot that stops being
        // one (copy_slot, import_slot into it) uploads its table anew.
        let table = self.stream.alloc_zeros::<u64>(host_table.len()).map_err(e)?;
        let mem = SlotMem { conv, rec, table, host_table, pages: s.pages.clone(), position: s.position, read_only: true };
        Ok(self.install_slot(states, idx, mem))
    }

    fn begin_step(&self, states: &mut CudaStates, batch: &Batch) -> Result<(), BackendError> {
        self.begin(states, batch, None)
    }

    fn begin_step_within(&self, states: &mut CudaStates, batch: &Batch, max_rows: usize, max_logit_rows: usize) -> Result<(), BackendError> {
        self.begin(states, batch, Some((max_rows, max_logit_rows)))
    }

    fn end_step(&self, states: &mut CudaStates, batch: &Batch) -> Result<(), BackendError> {
        let r = self.end(states, batch);
        let mut st = self.step.lock().unwrap();
        st.pad = None;
        st.graph_step = false;
        r
    }

    fn embed(&self, table: &CudaMatrix, batch: &Batch, x: &mut CudaTensor) {
        // The first operation of every step decides: replay a graph recorded for this shape (the
        // bucket's, when padded) and these buffers, start recording one (decode steps, as
        // `begin_step` found), or run eagerly.
        {
            let mut st = self.step.lock().unwrap();
            st.captured_chooser = None;
            st.pending_chooser = None;
            if st.pad.is_some_and(|p| x.rows < p.brows) {
                // Buffers too small for the bucket (begin_step was not told their size): the
                // step's own shape.
                st.pad = None;
            }
            if st.graph_step {
                let (rows, logit_rows) = st.pad.map_or((batch.rows(), batch.logit_rows.len()), |p| (p.brows, p.blogits));
                let key = GraphKey { rows, seqs: rows, logit_rows, scratch: x.id };
                let eager_tiles = st.max_tiles;
                st.max_tiles = st.part_graph_tiles;
                if st.graphs.contains_key(&key) {
                    st.mode = Mode::Replaying(key);
                    return;
                }
                match self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
                    Ok(()) => {
                        st.mode = Mode::Capturing(key);
                        st.capture_start = st.launches;
                        st.timeline_record = st.timeline.as_mut().map(|t| t.begin_capture());
                    }
                    Err(e) => {
                        st.error.get_or_insert(dev_err("beginning graph capture", e));
                        st.max_tiles = eager_tiles;
                        st.pad = None;
                    }
                }
            } else {
                st.pad = None;
            }
        }
        let (cols, n) = (table.cols as u32, self.eff(batch.rows()) as u32);
        self.launch("embed_rows", |st| unsafe {
            let a = self.args().buf(&table.w).buf(&table.sb).val(table.fmt).val(table.group).val(table.sdtype).val(cols).buf(&st.ids).buf(&x.buf);
            self.kernel("embed_rows", (cols.div_ceil(256), n, 1), 256, 0, a)
        });
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaSlice<f32>, eps: f32, rows: usize, out: &mut CudaTensor) {
        let rows = self.eff(rows);
        // A step may want no logits rows: an empty grid is a launch error.
        if rows == 0 {
            return;
        }
        let cols = x.cols as u32;
        self.launch("rms_norm_rows", |_| unsafe { self.kernel("rms_norm_rows", (rows as u32, 1, 1), 512, 0, self.args().buf(&x.buf).buf(w).val(eps).val(cols).buf(&out.buf)) });
    }

    fn matmul(&self, x: &CudaTensor, rows: usize, outs: &mut [(&CudaMatrix, &mut CudaTensor)]) {
        self.matmul_rows(x, self.eff(rows), outs, None);
    }

    fn matmul_residual(&self, x: &CudaTensor, rows: usize, w: &CudaMatrix, y: &mut CudaTensor, h: &mut CudaTensor) {
        // The epilogue indexes `h` with `y`'s row length.
        debug_assert_eq!(h.cols, y.cols);
        self.matmul_rows(x, self.eff(rows), &mut [(w, y)], Some(h));
    }

    fn rms_norm_matmul_swiglu(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        u: &mut CudaTensor,
        gate_w: &CudaMatrix,
        up_w: &CudaMatrix,
        gate: &mut CudaTensor,
        up: &mut CudaTensor,
        act: &mut CudaTensor,
    ) {
        self.rms_norm(x, w, eps, rows, u);
        self.matmul_swiglu_rows(u, self.eff(rows), gate_w, up_w, gate, up, act);
    }

    fn swiglu(&self, gate: &CudaTensor, up: &CudaTensor, rows: usize, out: &mut CudaTensor) {
        self.swiglu_rows(gate, up, self.eff(rows), out);
    }

    fn gated_delta_net(
        &self,
        w: &GatedDeltaNetWeights<CudaMatrix, CudaSlice<f32>>,
        layer: usize,
        cfg: &ModelConfig,
        batch: &Batch,
        _states: &mut CudaStates,
        qkv: &CudaTensor,
        z: &CudaTensor,
        b: &CudaTensor,
        a: &CudaTensor,
        out: &mut CudaTensor,
    ) {
        let (kc, cd, l) = (cfg.linear_conv_kernel_dim as u32, cfg.conv_dim() as u32, layer as u32);
        let (hk, hv, dk, dv) = (cfg.linear_num_key_heads as u32, cfg.linear_num_value_heads as u32, cfg.linear_key_head_dim as u32, cfg.linear_value_head_dim as u32);
        let nseq = self.eff(batch.seqs.len()) as u32;
        let eps = cfg.rms_norm_eps;
        let conv_here = u32::from(Self::conv_in_heads(cfg));
        let longest = batch.seqs.iter().map(|s| s.len).max().unwrap_or(0);
        if longest > 1 {
            // A prompt step: conv, norms and gates in parallel over tokens, then the delta rule
            // a warp per value row, then the gated norm (gdn_prompt.cu; the bits of gdn_heads).
            self.launch("gdn_prep", |st| unsafe {
                let prep = st.gdn_prep.as_ref().expect("ensure_temps sizes the GDN prompt rows");
                let a = self
                    .args()
                    .buf(&qkv.buf)
                    .buf(&w.conv1d)
                    .val(kc)
                    .buf(&b.buf)
                    .buf(&a.buf)
                    .buf(&w.a)
                    .buf(&w.dt_bias)
                    .val(hk)
                    .val(hv)
                    .val(dk)
                    .val(dv)
                    .val(l)
                    .buf(&st.seqs)
                    .buf(&st.slot_table)
                    .buf(prep);
                self.kernel("gdn_prep", (2 * hk + hv, longest, nseq), 128, 0, a)
            });
            self.launch("gdn_scan", |st| unsafe {
                let prep = st.gdn_prep.as_ref().expect("ensure_temps sizes the GDN prompt rows");
                let a = self.args().buf(prep).buf(&qkv.buf).val(kc).val(hk).val(hv).val(dk).val(dv).val(l).buf(&st.seqs).buf(&st.slot_table).buf(&out.buf);
                self.kernel("gdn_scan", (hv, dv.div_ceil(GDN_SCAN_WARPS), nseq), 32 * GDN_SCAN_WARPS, 0, a)
            });
            self.launch("gdn_out", |st| unsafe {
                let a = self.args().buf(&z.buf).buf(&w.norm).val(eps).val(hv).val(dv).buf(&st.seqs).buf(&out.buf);
                self.kernel("gdn_out", (hv, longest, nseq), 128, 0, a)
            });
            return;
        }
        if conv_here == 0 {
            self.launch("gdn_conv", |st| unsafe {
                let a = self.args().buf(&qkv.buf).buf(&w.conv1d).val(kc).val(cd).val(l).buf(&st.seqs).buf(&st.slot_table).buf(st.gdn_y.as_ref().unwrap());
                self.kernel("gdn_conv", (cd.div_ceil(256), nseq, 1), 256, 0, a)
            });
        }
        self.launch("gdn_heads", |st| unsafe {
            let src = if conv_here == 1 { &qkv.buf } else { st.gdn_y.as_ref().unwrap() };
            let a = self
                .args()
                .buf(src)
                .buf(&w.conv1d)
                .val(kc)
                .val(conv_here)
                .buf(&z.buf)
                .buf(&b.buf)
                .buf(&a.buf)
                .buf(&w.a)
                .buf(&w.dt_bias)
                .buf(&w.norm)
                .val(eps)
                .val(hk)
                .val(hv)
                .val(dk)
                .val(dv)
                .val(l)
                .buf(&st.seqs)
                .buf(&st.slot_table)
                .buf(&out.buf);
            self.kernel("gdn_heads", (hv, nseq, 1), 1024, 0, a)
        });
    }

    fn gated_attention(
        &self,
        w: &AttentionWeights<CudaMatrix, CudaSlice<f32>>,
        layer: usize,
        cfg: &ModelConfig,
        batch: &Batch,
        states: &mut CudaStates,
        q_gate: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        out: &mut CudaTensor,
    ) {
        let (hq, hkv, dh, rd) = (cfg.num_attention_heads as u32, cfg.num_key_value_heads as u32, cfg.head_dim as u32, cfg.rotary_dim() as u32);
        let (l, rows, eps, max_pages) = (layer as u32, self.eff(batch.rows()) as u32, cfg.rms_norm_eps, states.max_pages as u32);
        self.launch("attn_write_kv", |st| unsafe {
            let a = self
                .args()
                .buf(&k.buf)
                .buf(&v.buf)
                .buf(&w.k_norm)
                .val(eps)
                .buf(st.rope.as_ref().unwrap())
                .val(rd)
                .val(hkv)
                .val(dh)
                .val(l)
                .val(max_pages)
                .buf(&st.rows)
                .buf(&st.slot_table);
            self.kernel("attn_write_kv", (rows, hkv, 1), 32, 0, a)
        });
        // Work items: (tile, 32 positions) for the scores, (tile, gw·32 values) for the tiles. A
        // decode step (a few rows) takes the most items, one warp of values each (gw = 1), up to
        // ATTN_BLOCKS blocks per head; a prompt step, whose rows already fill the device, keeps
        // every warp of an item busy (gw = 8 for head_dim 256) and at most 32 blocks per head,
        // so each block's query norm and rotation serve more positions. A graph is sized for any
        // context, an eager step for its own.
        let decode = rows as usize <= ATTN_DECODE_ROWS;
        let gw = if decode { 1 } else { [8u32, 4, 2, 1].into_iter().find(|g| (dh / 32).is_multiple_of(*g)).unwrap_or(1) };
        let cap = if decode { self.attn_blocks } else { self.attn_blocks.min(32) };
        let items = |st: &Step, per_tile: u32| (st.max_tiles as u32 * per_tile).clamp(1, cap);
        self.launch("attn_scores", |st| unsafe {
            let (part, max_tiles) = st.attention_partials();
            let a = self
                .args()
                .buf(&q_gate.buf)
                .buf(&w.q_norm)
                .val(eps)
                .buf(st.rope.as_ref().unwrap())
                .val(rd)
                .val(hq)
                .val(hkv)
                .val(dh)
                .val(l)
                .val(max_pages)
                .val(max_tiles)
                .buf(&st.rows)
                .buf(&st.slot_table)
                .buf(part);
            self.kernel("attn_scores", (rows * hq, items(st, ATTENTION_TILE as u32 / 32), 1), 256, 0, a)
        });
        self.launch("attn_tiles", |st| unsafe {
            let (part, max_tiles) = st.attention_partials();
            let a = self.args().val(hq).val(hkv).val(dh).val(l).val(max_pages).val(max_tiles).val(gw).buf(&st.rows).buf(&st.slot_table).buf(part);
            self.kernel("attn_tiles", (rows * hq, items(st, dh / (32 * gw)), 1), 256, 0, a)
        });
        self.launch("attn_combine", |st| unsafe {
            let (part, max_tiles) = st.attention_partials();
            self.kernel("attn_combine", (rows * hq, 1, 1), dh, 0, self.args().buf(part).buf(&q_gate.buf).val(hq).val(dh).val(max_tiles).buf(&st.rows).buf(&out.buf))
        });
    }

    fn gather_rows(&self, x: &CudaTensor, batch: &Batch, out: &mut CudaTensor) {
        let (cols, n) = (x.cols as u32, self.eff(batch.logit_rows.len()) as u32);
        if n == 0 {
            return;
        }
        if out.rows < n as usize {
            // begin_step_within was told more logits rows than these buffers hold.
            let mut st = self.step.lock().unwrap();
            st.error.get_or_insert(BackendError::Batch(format!("{n} logits rows do not fit a buffer of {}", out.rows)));
            return;
        }
        self.launch("gather_rows", |st| unsafe {
            self.kernel("gather_rows", (cols.div_ceil(256), n, 1), 256, 0, self.args().buf(&x.buf).buf(&st.logit_rows).val(cols).buf(&out.buf))
        });
    }

    fn argmax_enqueue(&self, logits: &CudaTensor, rows: usize, v_eff: usize) {
        self.enqueue_chooser(Chooser::Argmax, logits, rows, v_eff);
    }

    fn set_sampling(&self, rows: &[crate::backend::RowSampling]) -> Result<bool, BackendError> {
        let ok = !rows.is_empty() && rows.len() <= MAX_ROWS && rows.iter().all(|r| r.params.top_k >= 1 && r.params.top_k <= SAMPLE_MAX_K && r.window.len() <= SAMPLE_WINDOW);
        if !ok {
            return Ok(false);
        }
        let cfg = self.cfg_cache.lock().unwrap().clone().expect("new_states ran");
        let mut st = self.step.lock().unwrap();
        let n = rows.len();
        // The buffers hold a power of two of rows (at least 64), as many as a padded step of
        // `n` logits rows may sample (the bucket of `n` is at most the next power of two).
        st.sample_rows = 0;
        if n > st.sample_cap || st.sample_work.is_none() {
            let cap = n.next_power_of_two().max(st.sample_cap);
            let e = |e| dev_err("allocating sampler buffers", e);
            st.sample_work = None;
            st.graphs.clear();
            st.sample_params = self.stream.alloc_zeros::<SampleParamsRepr>(cap).map_err(e)?;
            st.sample_win = self.stream.alloc_zeros::<u32>(cap * SAMPLE_WINDOW).map_err(e)?;
            st.sample_wlen = self.stream.alloc_zeros::<u32>(cap).map_err(e)?;
            st.sample_pos = self.stream.alloc_zeros::<u64>(cap).map_err(e)?;
            st.sample_work = Some(self.stream.alloc_zeros::<f32>(cap * cfg.vocab_size).map_err(|e| dev_err("sampler scratch", e))?);
            st.sample_cap = cap;
        }
        let cap = st.sample_cap;
        let mut params: Vec<SampleParamsRepr> = rows
            .iter()
            .map(|r| SampleParamsRepr {
                temperature: r.params.temperature,
                top_p: r.params.top_p,
                min_p: r.params.min_p,
                rep: r.params.repetition_penalty,
                pres: r.params.presence_penalty,
                freq: r.params.frequency_penalty,
                top_k: r.params.top_k as u32,
                window_cap: SAMPLE_WINDOW as u32,
                seed: r.params.seed,
            })
            .collect();
        // Rows past `n` (a padded step's inert rows) sample with the first row's settings and
        // no penalty window: valid inputs whose ids nobody reads.
        params.resize(cap, params[0]);
        let mut win = vec![0u32; n * SAMPLE_WINDOW];
        for (i, r) in rows.iter().enumerate() {
            win[i * SAMPLE_WINDOW..i * SAMPLE_WINDOW + r.window.len()].copy_from_slice(&r.window);
        }
        let mut wlen: Vec<u32> = rows.iter().map(|r| r.window.len() as u32).collect();
        wlen.resize(cap, 0);
        let mut pos: Vec<u64> = rows.iter().map(|r| r.position).collect();
        pos.resize(cap, 0);
        let up = |e| dev_err("sampler inputs", e);
        self.stream.memcpy_htod(&params, &mut st.sample_params).map_err(up)?;
        {
            let mut v = st.sample_win.slice_mut(0..win.len());
            self.stream.memcpy_htod(&win, &mut v).map_err(up)?;
        }
        self.stream.memcpy_htod(&wlen, &mut st.sample_wlen).map_err(up)?;
        self.stream.memcpy_htod(&pos, &mut st.sample_pos).map_err(up)?;
        st.sample_rows = n;
        Ok(true)
    }

    fn sample_enqueue(&self, logits: &CudaTensor, rows: usize, v_eff: usize) {
        self.enqueue_chooser(Chooser::Sample, logits, rows, v_eff);
    }

    fn sample_read(&self, logits: &CudaTensor, rows: usize, v_eff: usize) -> Result<Vec<u32>, BackendError> {
        self.argmax_read(logits, rows, v_eff)
    }

    fn argmax_read(&self, _logits: &CudaTensor, rows: usize, _v_eff: usize) -> Result<Vec<u32>, BackendError> {
        self.check()?;
        let mut out = vec![0u32; rows];
        let mut st = self.step.lock().unwrap();
        {
            let view = st.sampled.slice(0..rows);
            self.stream.memcpy_dtoh(&view, out.as_mut_slice()).map_err(|e| dev_err("reading sampled ids", e))?;
        }
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))?;
        st.waits += 1;
        if let Some(t) = st.timeline.as_mut() {
            t.collect(&self.stream)?;
        }
        // The argmax kernel also wrote these ids where the next step reads its tokens.
        st.device_ids = out.clone();
        drop(st);
        self.check()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::{moe_items, moe_tile, offset_exact, StreamLayout, T1S_ROWS, T1S_WARPS};

    /// `moe_plan`'s work list never outgrows the buffer sized by `moe_items`: for every way
    /// of spreading a step's pairs over the experts (all on one, one each, skewed, random), the
    /// items the kernel makes (⌈n_e / tile⌉ per expert) fit, for the tile the step uses.
    #[test]
    fn moe_work_items_fit_their_bound() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for (experts, k) in [(8, 2), (256, 8), (512, 10), (1024, 32)] {
            for rows in [1, 2, 3, 4, 31, 64, 65, 256, 257, 1024] {
                let pairs = rows * k;
                let (_, tile, _) = moe_tile(rows, pairs, experts);
                let bound = moe_items(pairs, experts, tile as usize);
                for spread in 0..6 {
                    let mut count = vec![0usize; experts];
                    for p in 0..pairs {
                        let e = match spread {
                            0 => 0,
                            1 => p % experts,
                            2 => (p * p) % experts.min(7),
                            _ => (next() % experts as u64) as usize,
                        };
                        count[e] += 1;
                    }
                    let items: usize = count.iter().map(|&c| c.div_ceil(tile as usize)).sum();
                    assert!(items <= bound, "{experts} experts, {rows} rows × {k}: {items} items > {bound}");
                }
            }
        }
        // One token reads each expert once (one item per pair); many tokens share tiles.
        assert_eq!(moe_tile(1, 8, 256).1, 1);
        assert_eq!(moe_tile(257, 2056, 256).1, 8);
    }

    #[test]
    fn stream_layout_fits_the_h200_and_matches_the_kernel() {
        // The kernel's constants are the host's.
        let src = include_str!("kernels/matmul.cu");
        assert!(src.contains(&format!("#define S_ROWS {T1S_ROWS} ")), "S_ROWS in matmul.cu");
        assert!(src.contains(&format!("#define S_WARPS {T1S_WARPS}\n")), "S_WARPS in matmul.cu");
        assert_eq!(T1S_ROWS as u32, 2 * T1S_WARPS);
        // 227 KiB, the H200's opt-in shared memory per block.
        let h200 = 232_448;
        // 2B's LM head: 32 rows of 1024 code bytes and 32 scale/bias pairs; x takes 8 KiB.
        assert_eq!(StreamLayout::new(2048, 64, h200), Some(StreamLayout { nslot: 6, slot: 36_864, smem: 8_320 + 6 * 36_864 }));
        // 0.8B: at most eight slots.
        assert_eq!(StreamLayout::new(1024, 64, h200), Some(StreamLayout { nslot: 8, slot: 18_432, smem: 4_224 + 8 * 18_432 }));
        // 9B: two slots of 72 KiB.
        assert_eq!(StreamLayout::new(4096, 64, h200), Some(StreamLayout { nslot: 2, slot: 73_728, smem: 16_512 + 2 * 73_728 }));
        // Rows that do not suit the kernel, or no room for two slots.
        assert_eq!(StreamLayout::new(2112, 64, h200), None, "cols not a multiple of 256");
        assert_eq!(StreamLayout::new(256, 128, h200), None, "two groups a row: 8-byte copies");
        assert_eq!(StreamLayout::new(8192, 32, h200), None, "two slots do not fit");
        assert_eq!(StreamLayout::new(2048, 64, 48 * 1024), None, "two slots do not fit");
    }
    use crate::numerics::{bf16_to_f32, f16_to_f32};

    /// The offset decode's value, as matmul.cu computes it from the code's float 0.5 + q/256.
    fn offset_value(s: f32, b: f32, q: u32) -> f32 {
        let f = f32::from_bits(0x3F00_0000 | (q << 16));
        assert_eq!(f, 0.5 + q as f32 / 256.0);
        (s * 256.0).mul_add(f, (-128.0f32).mul_add(s, b))
    }

    /// Every accepted group gives the documented value `fma(s, q, b)` bit for bit for all 16
    /// codes; groups shaped like MLX's (bias about -8 scales, any sign and magnitude) are
    /// accepted, so the one-token kernels use the offset decode on real checkpoints.
    #[test]
    fn offset_decode_matches_the_documented_value() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut accepted, mut typical, mut typical_accepted) = (0, 0, 0);
        for i in 0..200_000 {
            let r = next();
            let (s, b) = if i % 2 == 0 { (bf16_to_f32(r as u16), bf16_to_f32((r >> 16) as u16)) } else { (f16_to_f32(r as u16), f16_to_f32((r >> 16) as u16)) };
            // Half of the pairs MLX-like: b = -k·s rounded to bf16, k in [0, 16).
            let (s, b, mlx) = if i % 4 < 2 {
                let k = (r >> 32) as u32 % 4096;
                let b = bf16_to_f32(((-(k as f32) / 256.0 * s).to_bits() >> 16) as u16);
                (s, b, s.is_finite() && s.abs() > 1e-30 && s.abs() < 1e30 && k >= 256)
            } else {
                (s, b, false)
            };
            if offset_exact(s, b) {
                accepted += 1;
                for q in 0..16 {
                    let want = s.mul_add(q as f32, b);
                    assert_eq!(offset_value(s, b, q).to_bits(), want.to_bits(), "s {s:e} b {b:e} q {q}");
                }
            }
            if mlx {
                typical += 1;
                typical_accepted += offset_exact(s, b) as u32;
            }
        }
        assert!(accepted > 50_000, "only {accepted} pairs accepted");
        assert_eq!(typical_accepted, typical, "an MLX-like group was refused");
    }

    #[test]
    fn offset_decode_refuses_what_it_cannot_reproduce() {
        // A zero or negative-zero bias (the weight's zero sign), zero or non-finite scales.
        for (s, b) in [(0.01f32, -0.0f32), (0.01, 0.0), (0.0, 1.0), (f32::INFINITY, 1.0), (1.0, f32::NAN)] {
            assert!(!offset_exact(s, b), "{s} {b}");
        }
        // b - 128 s needs 25 significant bits: 2^17 - (1 + 2^-7).
        assert!(!offset_exact(1024.0, -1.0078125));
        // Magnitudes too far apart for the check's own arithmetic.
        assert!(!offset_exact(2f32.powi(-80), 1.0));
        // And a typical group is accepted (bf16-sized scale and bias: 101·2^-13, -101·2^-10).
        assert!(offset_exact(101.0 / 8192.0, -101.0 / 1024.0));
    }
}
