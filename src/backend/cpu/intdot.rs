//! Integer-exact products of affine (MLX-quantized) weights on the CPU (docs/numerics.md §2.2).
//!
//! The input rows are quantized once per product ([`QuantRows`]): per block of 64 elements a
//! scale `d` and exact integers `xi`, stored as three int8 planes (`xi = p0 + 256·p1 +
//! 65536·p2`), plus the exact sum of `xi` per 32 elements. A weight row's unit (the part of a
//! block inside one weight group) then gives `I = Σ q·xi` exactly, in any order. The epilogue
//! and fold are [`crate::numerics::unit_value`] and [`crate::numerics::fold_units`] (or the
//! same IEEE operations lane by lane), so every instruction set gives the bits of
//! [`crate::numerics::dot_affine_int`].
//!
//! The planes are stored two blocks at a time, so one 512-bit load of 64 code bytes (two
//! blocks of 4-bit codes) meets its planes in two more. On AVX-512 VNNI:
//! - **one input row** (decode): `vpdpbusd` multiplies the codes as stored by the planes, a
//!   shuffle tree sums sixteen units at once, and the epilogue runs sixteen units per
//!   instruction;
//! - **several input rows** (prompts, batches): a tile of sixteen weight rows has its codes
//!   unpacked once, one row per 32-bit lane, and each input row's quad of a plane is
//!   broadcast against it (`vpdpbusd`'s embedded broadcast): one instruction advances sixteen
//!   outputs, and the epilogue and fold run per lane, each in its own order.
//!
//! AVX2 multiplies with `vpmaddubsw` (unsigned 4-bit codes by signed planes: a pair of
//! products cannot saturate, |·| ≤ 2·15·128) and widens with `vpmaddwd`, in the same two forms
//! for 4-bit codes:
//! - **one input row**: a block's products of each plane add in 16 bits and widen; a shuffle
//!   tree sums eight units at once, and the epilogue runs eight units per instruction;
//! - **two or more input rows**: a tile of sixteen weight rows, one per 32-bit lane of two
//!   vectors, so each broadcast quad of a plane meets both; eight quads of a plane add in 16
//!   bits (|·| ≤ 8·2·15·128 < 2^15) before they widen, and the epilogue and fold run per lane.
//!
//! 8-bit codes on AVX2 (every x86 CPU with AVX2, VNNI or not):
//! - **two or more input rows**: the same tiles of sixteen weight rows, their codes widened
//!   once to i16 pairs (for `vpmaddwd`) and kept as byte quads (for `vpmaddubsw`). Each input
//!   row's `xi` is split as `L + 65536·H` (`L` its low 16 bits, signed; |H| ≤ 32; the
//!   quantized rows' wide form): pairs of `L` meet the code pairs in `vpmaddwd`, quads of `H`
//!   the code quads in `vpmaddubsw` (a pair of products |·| ≤ 2·255·32, two quads add in 16
//!   bits). The epilogue and fold run per lane;
//! - **one input row** (decode) still takes the generic loop: each output re-reads the codes
//!   (`unit_ints8`, nibbles against the planes), and the epilogue is scalar.
//!
//! Exactness of the 32-bit sums (4-bit codes): a unit's `I` satisfies |I| ≤ 64·15·2 080 768 <
//! 2^31, and every plane's partial sum is far inside i32 (|Σ q·p| ≤ 64·15·128). The lanes add
//! `a0 + (a1 << 8) + (a2 << 16)` and then sum lanes with wrapping 32-bit adds: the arithmetic
//! is exact modulo 2^32, and the true value lies in i32, so the result is `I` exactly whatever
//! the intermediate values. 8-bit codes can reach |I| ≈ 2^35: the generic loop keeps 64-bit
//! unit sums, and the 8-bit tile keeps per lane `A = Σ q·L` (|A| ≤ 64·255·2^15 = 2^29) and
//! `B = Σ q·H` (|B| ≤ 64·255·32) in i32, exact, and rounds `I = A + 65536·B` to f32 once, as
//! `i64 as f32` does: `(B + (A >> 16))·65536` and `A & 0xffff` are exact in f32, and one `fma`
//! adds them.
//!
//! Plane layout within a block. 4-bit codes split into low and high nibbles, which hold the
//! even and odd elements; so for those matrices a block's plane is `[even elements of 0..32 |
//! even of 32..64 | odd of 0..32 | odd of 32..64]` (16 bytes each), matching the nibble
//! vectors of 32 code bytes. 8-bit codes keep the natural order. Unused positions (a final
//! block of 32) hold zeros.

use super::simd::Isa;
use crate::model::weights::{FloatType, Matrix, MatrixData};
use crate::numerics::{act_planes, act_quant, act_scale, chunk_units, fold_units, unit_len, unit_value, ACT_BLOCK, PRODUCT_CHUNKS};

/// Bytes of two blocks' three planes in the Planes form: per plane `[64 | 64]` bytes.
const PAIR_BYTES: usize = 6 * ACT_BLOCK;
/// Input rows from which a product of 4-bit codes on AVX-512 VNNI unpacks tiles of weight rows
/// once for all of them; below it, each output reads its codes as stored (the tile's unpacking
/// costs about three one-row products).
pub const ROW_LANES_MIN_ROWS: usize = 4;
/// The same threshold for AVX2's tiles of sixteen weight rows (two vectors of eight lanes),
/// whose unpacking is transposed eight rows at a time and costs less than a one-row product.
pub const AVX2_ROW_LANES_MIN_ROWS: usize = 2;

/// The order of elements inside a block's plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Layout {
    /// Evens then odds per 32-element half, for 4-bit codes.
    #[default]
    Nibbles,
    /// Element order, for 8-bit codes.
    Natural,
}

impl Layout {
    /// The layout the products of `w` read (`None` for float weights, which keep numerics §2).
    pub fn of(w: &Matrix) -> Option<Layout> {
        match &w.data {
            MatrixData::Affine { bits: 4, .. } => Some(Layout::Nibbles),
            MatrixData::Affine { .. } => Some(Layout::Natural),
            MatrixData::Float { .. } => None,
        }
    }

    /// Position of element `e` (`< 64`) of a block in its plane.
    #[inline]
    fn pos(self, e: usize) -> usize {
        match self {
            Layout::Natural => e,
            Layout::Nibbles => {
                let (half, i) = (e / 32, e % 32);
                (i % 2) * 32 + half * 16 + i / 2
            }
        }
    }

    /// Offset of element `e` of block `b`, plane `p`, in a row of the Planes form: blocks go
    /// in pairs, each plane of a pair 128 bytes. Nibbles: `[evens of b | evens of b+1 | odds
    /// of b | odds of b+1]` (32 bytes each, so the low nibbles of 64 code bytes meet the first
    /// 64); Natural: `[b | b+1]`.
    #[inline]
    fn plane_at(self, b: usize, p: usize, e: usize) -> usize {
        let base = (b / 2) * PAIR_BYTES + p * 2 * ACT_BLOCK;
        match self {
            Layout::Natural => base + (b % 2) * ACT_BLOCK + e,
            Layout::Nibbles => {
                let at = self.pos(e);
                base + (at / 32) * ACT_BLOCK + (b % 2) * 32 + at % 32
            }
        }
    }
}

/// Output rows a task of a product of `w` over `rows` input rows should be a multiple of on
/// `isa`, when the integer kernel works in tiles (16 weight rows; 4-bit codes from
/// [`ROW_LANES_MIN_ROWS`] input rows on VNNI and [`AVX2_ROW_LANES_MIN_ROWS`] on AVX2, 8-bit
/// codes from [`AVX2_ROW_LANES_MIN_ROWS`] on every AVX2 CPU): a task of 24 rows would leave
/// half of its second tile idle.
pub fn row_granule(isa: Isa, w: &Matrix, rows: usize) -> Option<usize> {
    if matches!(w.data, MatrixData::Affine { bits: 8, .. }) {
        return (isa >= Isa::Avx2 && rows >= AVX2_ROW_LANES_MIN_ROWS).then_some(avx2::ROW_LANES);
    }
    if !matches!(w.data, MatrixData::Affine { bits: 4, .. }) {
        return None;
    }
    if vnni(isa) {
        (rows >= ROW_LANES_MIN_ROWS).then_some(16)
    } else {
        (isa >= Isa::Avx2 && rows >= AVX2_ROW_LANES_MIN_ROWS).then_some(avx2::ROW_LANES)
    }
}

/// Whether `isa` is AVX-512 on a CPU with VNNI (`vpdpbusd`).
#[inline]
pub fn vnni(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa == Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// Input rows `[rows, cols]` quantized for the integer-exact products.
#[derive(Clone, Debug, Default)]
pub struct QuantRows {
    pub layout: Layout,
    /// The instruction set that quantizes (every one writes the same bytes).
    pub isa: Isa,
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row (`ceil(cols / 64)`).
    pub blocks: usize,
    /// `[rows][blocks]` scales.
    d: Vec<f32>,
    /// `[rows][2·blocks]` exact `Σ xi` per 32 elements.
    sums: Vec<i32>,
    /// `[rows][ceil(blocks/2)][3][128]`: per pair of blocks, per plane, 128 bytes.
    planes: Vec<i8>,
    /// The epilogue's per-unit factors, `[rows][6·blocks]`: `d` per block, `d·f32(S)` per
    /// block, `d` per half block, `d·f32(S)` per half block (the operands of `unit_value` for
    /// units of 64 or 32).
    ev: Vec<f32>,
    /// Natural layout only: `[rows][cols]` each `xi`'s low digit `L` (its low 16 bits, signed)
    /// and `[rows][cols]` its high digit `H = (xi - L) / 65536` (|H| ≤ 32), in element order,
    /// so `xi = L + 65536·H` exactly: the operands of AVX2's 8-bit code tiles (`vpmaddwd` for
    /// `L`, `vpmaddubsw` for `H`).
    low: Vec<i16>,
    high: Vec<i8>,
}

impl QuantRows {
    /// Sizes the buffers for `rows` rows of `cols` (a multiple of 32) in `layout`, to be
    /// quantized with `isa` (every instruction set writes the same bytes).
    ///
    /// # Panics
    /// If `cols` is not a multiple of 32.
    pub fn shape(&mut self, isa: Isa, rows: usize, cols: usize, layout: Layout) {
        assert!(cols.is_multiple_of(32));
        self.isa = isa;
        self.layout = layout;
        self.rows = rows;
        self.cols = cols;
        self.blocks = cols.div_ceil(ACT_BLOCK);
        let bl = self.blocks;
        self.d.resize(rows * bl, 0.0);
        self.sums.resize(rows * 2 * bl, 0);
        self.planes.resize(rows * bl.div_ceil(2) * PAIR_BYTES, 0);
        self.ev.resize(rows * 6 * bl, 0.0);
        let wide = if layout == Layout::Natural { rows * cols } else { 0 };
        self.low.resize(wide, 0);
        self.high.resize(wide, 0);
    }

    /// Quantizes rows `r0..r1` of `x` (`[rows, cols]`) into buffers shaped by [`Self::shape`].
    ///
    /// # Safety
    /// `base` must be [`Self::base`] of this value after `shape`, and no other thread may
    /// write rows `r0..r1` meanwhile (other rows may be filled concurrently).
    pub unsafe fn fill_rows(&self, base: QuantBase, x: &[f32], r0: usize, r1: usize) {
        let (bl, cols) = (self.blocks, self.cols);
        for r in r0..r1 {
            // SAFETY: row r's scales and sums, which only this call writes.
            let (d, sums) = unsafe { (std::slice::from_raw_parts_mut(base.d.add(r * bl), bl), std::slice::from_raw_parts_mut(base.sums.add(r * 2 * bl), 2 * bl)) };
            let xr = &x[r * cols..(r + 1) * cols];
            // SAFETY: as above, row r's planes and epilogue factors.
            let (planes, ev) = unsafe {
                (
                    std::slice::from_raw_parts_mut(base.planes.add(r * bl.div_ceil(2) * PAIR_BYTES), bl.div_ceil(2) * PAIR_BYTES),
                    std::slice::from_raw_parts_mut(base.ev.add(r * 6 * bl), 6 * bl),
                )
            };
            #[cfg(target_arch = "x86_64")]
            if self.isa == Isa::Avx512 {
                // SAFETY: Avx512 is only chosen when the CPU reports AVX-512 F/BW/VL.
                unsafe { avx512::quantize_planes(self.layout, xr, d, sums, planes) };
            } else if self.isa == Isa::Avx2 {
                // SAFETY: Avx2 is only chosen when the CPU reports AVX2 and FMA.
                unsafe { avx2q::quantize_planes(self.layout, xr, d, sums, planes) };
            }
            if !cfg!(target_arch = "x86_64") || self.isa == Isa::Portable {
                planes.fill(0);
                let layout = self.layout;
                quantize_row(xr, d, sums, |b, e, p| {
                    for (k, &pk) in p.iter().enumerate() {
                        planes[layout.plane_at(b, k, e)] = pk;
                    }
                });
            }
            for b in 0..bl {
                let f = ev_factors(d[b], sums[2 * b], sums[2 * b + 1]);
                for (k, &v) in f.iter().enumerate() {
                    ev[ev_index(k, b, bl)] = v;
                }
            }
            if self.layout == Layout::Natural {
                // SAFETY: row r's digits, which only this call writes.
                let (lo, hi) = unsafe { (std::slice::from_raw_parts_mut(base.low.add(r * cols), cols), std::slice::from_raw_parts_mut(base.high.add(r * cols), cols)) };
                #[cfg(target_arch = "x86_64")]
                if self.isa >= Isa::Avx2 {
                    // SAFETY: Avx2 (and Avx512) is only chosen when the CPU reports AVX2.
                    unsafe { avx2q::wide_digits(planes, lo, hi) };
                    continue;
                }
                for e in 0..cols {
                    let pl = |p: usize| planes[Layout::Natural.plane_at(e / ACT_BLOCK, p, e % ACT_BLOCK)] as i32;
                    let xi = pl(0) + 256 * pl(1) + 65536 * pl(2);
                    lo[e] = xi as i16;
                    hi[e] = ((xi - lo[e] as i32) >> 16) as i8;
                }
            }
        }
    }

    /// Raw pointers for [`Self::fill_rows`] from several threads.
    pub fn base(&mut self) -> QuantBase {
        QuantBase {
            d: self.d.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
            planes: self.planes.as_mut_ptr(),
            ev: self.ev.as_mut_ptr(),
            low: self.low.as_mut_ptr(),
            high: self.high.as_mut_ptr(),
        }
    }

    /// Row `t`: scales, sums, planes, epilogue factors.
    #[inline(always)]
    fn row(&self, t: usize) -> (&[f32], &[i32], &[i8], &[f32]) {
        let bl = self.blocks;
        let pb = bl.div_ceil(2) * PAIR_BYTES;
        (&self.d[t * bl..(t + 1) * bl], &self.sums[t * 2 * bl..(t + 1) * 2 * bl], &self.planes[t * pb..(t + 1) * pb], &self.ev[t * 6 * bl..(t + 1) * 6 * bl])
    }

    /// Row `t`'s digits `L` and `H` (Natural layout only).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn wide_row(&self, t: usize) -> (&[i16], &[i8]) {
        (&self.low[t * self.cols..(t + 1) * self.cols], &self.high[t * self.cols..(t + 1) * self.cols])
    }
}

/// A block's epilogue factors: `d`, `d·f32(S)` of the whole block, then per half `d` and
/// `d·f32(S_h)` (the products `unit_value` forms, rounded the same way).
#[inline]
fn ev_factors(d: f32, s0: i32, s1: i32) -> [f32; 6] {
    [d, d * (s0 + s1) as f32, d, d * s0 as f32, d, d * s1 as f32]
}

/// Index of factor `k` (of [`ev_factors`]) of block `b` in a row of factors `[d per block |
/// dS per block | d per half block | dS per half block]` (`6·bl` entries).
#[inline]
fn ev_index(k: usize, b: usize, bl: usize) -> usize {
    match k {
        0 => b,
        1 => bl + b,
        2 | 4 => 2 * bl + 2 * b + (k - 2) / 2,
        _ => 4 * bl + 2 * b + (k - 3) / 2,
    }
}

/// Pointers into a [`QuantRows`]' buffers, shared by the threads that fill disjoint rows.
#[derive(Clone, Copy, Debug)]
pub struct QuantBase {
    d: *mut f32,
    sums: *mut i32,
    planes: *mut i8,
    ev: *mut f32,
    low: *mut i16,
    high: *mut i8,
}
// SAFETY: only handed to `fill_rows`, whose callers write disjoint rows.
unsafe impl Send for QuantBase {}
// SAFETY: as above.
unsafe impl Sync for QuantBase {}

/// One row: per block its scale and the exact sums of its halves; `put(block, element,
/// planes)` stores each element's planes.
#[inline]
fn quantize_row(x: &[f32], d: &mut [f32], sums: &mut [i32], mut put: impl FnMut(usize, usize, [i8; 3])) {
    for (b, blk) in x.chunks(ACT_BLOCK).enumerate() {
        let db = act_scale(blk);
        d[b] = db;
        let (mut s0, mut s1) = (0i32, 0i32);
        for (e, &v) in blk.iter().enumerate() {
            let xi = act_quant(v, db);
            if e < 32 {
                s0 += xi;
            } else {
                s1 += xi;
            }
            put(b, e, act_planes(xi));
        }
        sums[2 * b] = s0;
        sums[2 * b + 1] = s1;
    }
}

/// `y[t][n] = W[n] · x[t]` in the integer-exact form for `n in n0 .. n0 + count`, every row
/// `t` of `xq`. `scratch` is reused between calls.
///
/// # Safety
/// As [`super::simd::matmul`]: `y` valid for `xq.rows · ldy` floats, `n0 + count ≤ min(ldy,
/// w.rows)`, and no other thread touches elements `(t, n0..n0+count)` meanwhile.
///
/// # Panics
/// If `w` is not affine or `xq` was made for another layout or width.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(isa: Isa, w: &Matrix, xq: &QuantRows, y: *mut f32, ldy: usize, n0: usize, count: usize, scratch: &mut Scratch) {
    let MatrixData::Affine { bits, group_size, weight, scales, biases, scale_dtype } = &w.data else {
        panic!("intdot::matmul: {} is not affine", w.name);
    };
    let (bits, gs) = (*bits as usize, *group_size);
    assert!(Layout::of(w) == Some(xq.layout) && xq.cols == w.cols, "intdot::matmul: {} against rows of {}", w.name, xq.cols);
    let (cols, ul) = (w.cols, unit_len(gs));
    let units = cols / ul;
    let groups = cols / gs;
    let (wb, sb) = (cols * bits / 8, groups * scale_dtype.size());
    scratch.s.resize(groups, 0.0);
    scratch.b.resize(groups, 0.0);
    scratch.ints.resize(units, 0);
    // The fold's chunk bounds, the same for every output.
    let bounds: [usize; PRODUCT_CHUNKS + 1] = std::array::from_fn(|c| if c < PRODUCT_CHUNKS { chunk_units(units, c).0 } else { units });
    #[cfg(target_arch = "x86_64")]
    if bits == 4 && isa >= Isa::Avx2 {
        let w = (weight.as_slice(), scales.as_slice(), biases.as_slice(), *scale_dtype);
        // SAFETY: `vnni` checked the CPU, and Avx2 (and Avx512) is only chosen when it reports
        // AVX2 and FMA; the caller's contract on `y`.
        unsafe {
            if vnni(isa) {
                if xq.rows >= ROW_LANES_MIN_ROWS {
                    vnni::matmul_rows(gs, w, xq, &bounds, y, ldy, n0, count, scratch);
                } else {
                    vnni::matmul_each(gs, w, xq, &bounds, y, ldy, n0, count, scratch);
                }
            } else if xq.rows >= AVX2_ROW_LANES_MIN_ROWS {
                avx2::matmul_rows(gs, w, xq, &bounds, y, ldy, n0, count, scratch);
            } else {
                avx2::matmul_each(gs, w, xq, &bounds, y, ldy, n0, count, scratch);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if bits == 8 && isa >= Isa::Avx2 && xq.rows >= AVX2_ROW_LANES_MIN_ROWS {
        // SAFETY: Avx2 (and Avx512) is only chosen when the CPU reports AVX2 and FMA; the
        // caller's contract on `y`.
        unsafe { avx2::matmul_rows8(gs, (weight.as_slice(), scales.as_slice(), biases.as_slice(), *scale_dtype), xq, &bounds, y, ldy, n0, count, scratch) };
        return;
    }
    let Scratch { s, b, ints, .. } = scratch;
    for n in n0..n0 + count {
        let codes = &weight.as_slice()[n * wb..(n + 1) * wb];
        let (sr, br) = (&scales.as_slice()[n * sb..(n + 1) * sb], &biases.as_slice()[n * sb..(n + 1) * sb]);
        for g in 0..groups {
            s[g] = scale_dtype.get(sr, g);
            b[g] = scale_dtype.get(br, g);
        }
        for t in 0..xq.rows {
            let (d, sums, planes, _) = xq.row(t);
            unit_ints(isa, bits, ul, codes, planes, ints);
            let r = Epilogue { ul, gs, s, b, d, sums, ints };
            #[cfg(target_arch = "x86_64")]
            // SAFETY: Avx2 (and Avx512) is only chosen when the CPU reports AVX2 and FMA.
            let value = if isa >= Isa::Avx2 { unsafe { r.value_fma() } } else { r.value() };
            #[cfg(not(target_arch = "x86_64"))]
            let value = r.value();
            // SAFETY: the caller's contract on `y`.
            unsafe { *y.add(t * ldy + n) = value };
        }
    }
}

/// Weights of one product: codes, scales, biases (all rows) and the scales' type.
#[cfg(target_arch = "x86_64")]
type Weights<'a> = (&'a [u8], &'a [u8], &'a [u8], FloatType);

/// Per-call buffers of [`matmul`]: a row's scales and biases (per group and per unit), its
/// unit integers and values, and the row-lanes kernel's tile of unpacked codes and scales.
#[derive(Debug, Default)]
pub struct Scratch {
    s: Vec<f32>,
    b: Vec<f32>,
    ints: Vec<i64>,
    su: Vec<f32>,
    bu: Vec<f32>,
    v: Vec<f32>,
    codes: Vec<u8>,
    ts: Vec<f32>,
    tb: Vec<f32>,
}

/// One output's epilogue (numerics §2.2): every unit's value from its integers, folded.
struct Epilogue<'a> {
    ul: usize,
    gs: usize,
    s: &'a [f32],
    b: &'a [f32],
    d: &'a [f32],
    sums: &'a [i32],
    ints: &'a [i64],
}

impl Epilogue<'_> {
    /// The output: `fold_units` over `unit_value`, unit by unit in order. Unit `u` is in group
    /// `u >> log2(gs/ul)` and block `u >> log2(64/ul)` (both powers of two): no division.
    #[inline(always)]
    fn value(&self) -> f32 {
        let (gsh, bsh) = ((self.gs / self.ul).trailing_zeros(), (ACT_BLOCK / self.ul).trailing_zeros());
        let whole = self.ul == ACT_BLOCK;
        fold_units(self.ints.len(), |u| {
            let (g, blk) = (u >> gsh, u >> bsh);
            let sum = if whole { self.sums[2 * blk] + self.sums[2 * blk + 1] } else { self.sums[u] };
            unit_value(self.s[g], self.b[g], self.d[blk], self.ints[u], sum)
        })
    }

    /// [`Epilogue::value`] compiled for FMA hardware, so each `fma` is one instruction rather
    /// than a call (the same rounding either way).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn value_fma(&self) -> f32 {
        self.value()
    }
}

/// `ints[u] = Σ q·xi` over every unit of one weight row against one quantized input row
/// (Planes form).
fn unit_ints(isa: Isa, bits: usize, ul: usize, codes: &[u8], planes: &[i8], ints: &mut [i64]) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: Avx2 (and Avx512, a superset) is only chosen when the CPU reports AVX2.
        unsafe {
            if bits == 4 {
                avx2::unit_ints4(ul, codes, planes, ints);
            } else {
                avx2::unit_ints8(ul, codes, planes, ints);
            }
        }
        return;
    }
    let _ = isa;
    unit_ints_portable(bits, ul, codes, planes, ints);
}

/// The portable form of [`unit_ints`]: each element's code times its `xi`, rebuilt from the
/// planes.
fn unit_ints_portable(bits: usize, ul: usize, codes: &[u8], planes: &[i8], ints: &mut [i64]) {
    let layout = if bits == 4 { Layout::Nibbles } else { Layout::Natural };
    for (u, out) in ints.iter_mut().enumerate() {
        let mut acc = 0i64;
        for k in u * ul..(u + 1) * ul {
            let q = if bits == 4 { (codes[k / 2] >> (4 * (k % 2))) & 15 } else { codes[k] } as i64;
            let (blk, e) = (k / ACT_BLOCK, k % ACT_BLOCK);
            let pl = |p: usize| planes[layout.plane_at(blk, p, e)] as i64;
            acc += q * (pl(0) + 256 * pl(1) + 65536 * pl(2));
        }
        *out = acc;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{unit_len, FloatType, QuantRows, Scratch, Weights, ACT_BLOCK, PAIR_BYTES, PRODUCT_CHUNKS};
    use std::arch::x86_64::*;

    /// Sum of the eight i32 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256i) -> i32 {
        unsafe {
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
            _mm_cvtsi128_si32(s)
        }
    }

    /// The code bytes of block `blk` (32 of 4-bit codes, 64 of 8-bit), zero past the row's end.
    #[inline(always)]
    unsafe fn load_codes(codes: &[u8], at: usize) -> __m256i {
        unsafe {
            if at + 32 <= codes.len() {
                _mm256_loadu_si256(codes.as_ptr().add(at) as *const __m256i)
            } else {
                _mm256_zextsi128_si256(_mm_loadu_si128(codes.as_ptr().add(at) as *const __m128i))
            }
        }
    }

    #[inline(always)]
    unsafe fn plane(pl: &[i8], at: usize) -> __m256i {
        unsafe { _mm256_loadu_si256(pl.as_ptr().add(at) as *const __m256i) }
    }

    /// 4-bit codes against nibble-layout planes.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unit_ints4(ul: usize, codes: &[u8], planes: &[i8], ints: &mut [i64]) {
        unsafe {
            let (mask, ones) = (_mm256_set1_epi8(15), _mm256_set1_epi16(1));
            let blocks = (codes.len() * 2).div_ceil(ACT_BLOCK);
            for blk in 0..blocks {
                let c = load_codes(codes, blk * 32);
                let lo = _mm256_and_si256(c, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
                // Plane p of this block: evens at p·128 + (blk % 2)·32, odds 64 further.
                let pl = &planes[(blk / 2) * PAIR_BYTES + (blk % 2) * 32..];
                let mut m = [_mm256_setzero_si256(); 3];
                for (p, mp) in m.iter_mut().enumerate() {
                    let even = _mm256_maddubs_epi16(lo, plane(pl, p * 2 * ACT_BLOCK));
                    let odd = _mm256_maddubs_epi16(hi, plane(pl, p * 2 * ACT_BLOCK + ACT_BLOCK));
                    *mp = _mm256_madd_epi16(_mm256_add_epi16(even, odd), ones);
                }
                let t = _mm256_add_epi32(_mm256_add_epi32(m[0], _mm256_slli_epi32(m[1], 8)), _mm256_slli_epi32(m[2], 16));
                if ul == ACT_BLOCK {
                    ints[blk] = hsum(t) as i64;
                } else {
                    // Lanes 0..4 hold elements 0..32 of the block, lanes 4..8 the rest.
                    let (a, b) = (_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                    let h = |s: __m128i| {
                        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
                        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)))
                    };
                    ints[2 * blk] = h(a) as i64;
                    if 2 * blk + 1 < ints.len() {
                        ints[2 * blk + 1] = h(b) as i64;
                    }
                }
            }
        }
    }

    /// 8-bit codes against natural-layout planes: each code as its two nibbles (`q = 16·hi +
    /// lo`, so no pair of products saturates), per 32 elements.
    #[target_feature(enable = "avx2")]
    pub unsafe fn unit_ints8(ul: usize, codes: &[u8], planes: &[i8], ints: &mut [i64]) {
        unsafe {
            let (mask, ones, sixteen) = (_mm256_set1_epi8(15), _mm256_set1_epi16(1), _mm256_set1_epi16(16));
            let halves = codes.len() / 32;
            for h in 0..halves {
                let c = _mm256_loadu_si256(codes.as_ptr().add(32 * h) as *const __m256i);
                let lo = _mm256_and_si256(c, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
                let blk = h / 2;
                let pl = &planes[(blk / 2) * PAIR_BYTES + (blk % 2) * ACT_BLOCK + (h % 2) * 32..];
                let mut i = 0i64;
                for p in 0..3 {
                    let x = plane(pl, p * 2 * ACT_BLOCK);
                    let s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x), ones), _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x), sixteen));
                    i += (hsum(s) as i64) << (8 * p);
                }
                if ul == ACT_BLOCK {
                    if h % 2 == 0 {
                        ints[h / 2] = i;
                    } else {
                        ints[h / 2] += i;
                    }
                } else {
                    ints[h] = i;
                }
            }
        }
    }

    /// Bytes ahead of the codes in use that a decode product asks the cache for.
    const PREFETCH_BYTES: usize = 4096;

    /// Block `blk` of one weight row (4-bit codes) against one input row: lanes 0..4 hold its
    /// first 32 elements, 4..8 the rest, each lane `a0 + 256·a1 + 65536·a2` modulo 2^32 (`ap`
    /// the lane's sum of codes times plane `p`). Each plane's even and odd products add in
    /// 16 bits (|·| ≤ 4·15·128) before `vpmaddwd` widens them, by 1 or 256.
    #[inline(always)]
    unsafe fn block_ints(codes: &[u8], planes: &[i8], blk: usize) -> __m256i {
        unsafe {
            let (mask, ones, c256) = (_mm256_set1_epi8(15), _mm256_set1_epi16(1), _mm256_set1_epi16(256));
            let c = load_codes(codes, blk * 32);
            let lo = _mm256_and_si256(c, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
            // Plane p of this block: evens at p·128 + (blk % 2)·32, odds 64 further.
            let pl = &planes[(blk / 2) * PAIR_BYTES + (blk % 2) * 32..];
            let p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, plane(pl, 0)), _mm256_maddubs_epi16(hi, plane(pl, ACT_BLOCK)));
            let p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, plane(pl, 2 * ACT_BLOCK)), _mm256_maddubs_epi16(hi, plane(pl, 3 * ACT_BLOCK)));
            let p2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, plane(pl, 4 * ACT_BLOCK)), _mm256_maddubs_epi16(hi, plane(pl, 5 * ACT_BLOCK)));
            let a01 = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, c256));
            _mm256_add_epi32(a01, _mm256_slli_epi32(_mm256_madd_epi16(p2, ones), 16))
        }
    }

    /// Per 128-bit half, the sums of the four lanes of `a`, `b`, `c`, `d` in that order.
    #[inline(always)]
    unsafe fn sum4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
        unsafe {
            let l1 = |a: __m256i, b: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
            let (x, y) = (l1(a, b), l1(c, d));
            _mm256_add_epi32(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y))
        }
    }

    /// Eight units' integers of one weight row against one input row, in unit order from unit
    /// `u0` (units past `units` are 0): units of 64 are blocks, summed over all eight lanes of
    /// [`block_ints`]; units of 32 are halves of blocks, summed over four.
    #[inline(always)]
    unsafe fn eight_units(whole: bool, codes: &[u8], planes: &[i8], bl: usize, u0: usize) -> __m256i {
        unsafe {
            let z = _mm256_setzero_si256();
            let bi = |blk: usize| if blk < bl { block_ints(codes, planes, blk) } else { z };
            if whole {
                let b0 = u0;
                let v0 = sum4(bi(b0), bi(b0 + 1), bi(b0 + 2), bi(b0 + 3));
                let v1 = sum4(bi(b0 + 4), bi(b0 + 5), bi(b0 + 6), bi(b0 + 7));
                // Low halves of v0, v1 hold the first 32 elements' sums of blocks 0..4, 4..8.
                _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(v0, v1), _mm256_permute2x128_si256::<0x31>(v0, v1))
            } else {
                let b0 = u0 / 2;
                // Lanes: units 0 2 4 6 | 1 3 5 7.
                let v = sum4(bi(b0), bi(b0 + 1), bi(b0 + 2), bi(b0 + 3));
                _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
            }
        }
    }

    /// One weight row's scales and biases per unit: bf16 in place (one group per unit, or
    /// per two units), or widened to f32.
    #[derive(Clone, Copy)]
    enum Scales<'a> {
        Bf16(&'a [u8], &'a [u8]),
        Bf16Pairs(&'a [u8], &'a [u8]),
        F32(&'a [f32], &'a [f32]),
    }

    impl Scales<'_> {
        /// Units `u0..u0+8` as f32 (all inside the row): a bf16 is the top half of its f32.
        #[inline(always)]
        unsafe fn load(self, u0: usize) -> (__m256, __m256) {
            unsafe {
                match self {
                    Scales::Bf16(s, b) => {
                        let w = |r: &[u8]| _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(r.as_ptr().add(2 * u0) as *const __m128i)), 16));
                        (w(s), w(b))
                    }
                    Scales::Bf16Pairs(s, b) => {
                        // Groups u0/2..u0/2+4, each into two lanes.
                        let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
                        let w = |r: &[u8]| {
                            _mm256_castsi256_ps(_mm256_slli_epi32(
                                _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(_mm_loadl_epi64(r.as_ptr().add(u0) as *const __m128i)), pairs),
                                16,
                            ))
                        };
                        (w(s), w(b))
                    }
                    Scales::F32(s, b) => (_mm256_loadu_ps(s.as_ptr().add(u0)), _mm256_loadu_ps(b.as_ptr().add(u0))),
                }
            }
        }
    }

    /// One output of 4-bit codes against one input row of the Planes form: eight units'
    /// integers at a time ([`eight_units`]), their values `fma(s·d, f32(I), b·(d·f32(S)))`
    /// eight lanes at once into `v`, then the fold in unit order (`bounds`: the chunks' first
    /// units, then the unit count). A final group of fewer than eight units loads its factors
    /// masked and copies its scales (zeros past the end).
    #[inline(always)]
    unsafe fn row_value(ul: usize, codes: &[u8], planes: &[i8], ev: &[f32], sc: Scales<'_>, bounds: &[usize; PRODUCT_CHUNKS + 1], v: &mut [f32]) -> f32 {
        let units = bounds[PRODUCT_CHUNKS];
        let bl = ev.len() / 6;
        debug_assert!(v.len() >= units.next_multiple_of(8) && planes.len() == bl.div_ceil(2) * PAIR_BYTES);
        let whole = ul == ACT_BLOCK;
        let (dof, sof) = if whole { (0, bl) } else { (2 * bl, 4 * bl) };
        let mut u0 = 0;
        while u0 < units {
            // SAFETY: blocks below `bl` lie inside `codes` and `planes`; whole groups of eight
            // units inside the per-unit slices, the last group copied.
            unsafe {
                prefetch(codes.as_ptr().wrapping_add(u0 * ul / 2 + PREFETCH_BYTES));
                let i = eight_units(whole, codes, planes, bl, u0);
                let (d, ds, s, b) = if u0 + 8 <= units {
                    let (s, b) = sc.load(u0);
                    (_mm256_loadu_ps(ev.as_ptr().add(dof + u0)), _mm256_loadu_ps(ev.as_ptr().add(sof + u0)), s, b)
                } else {
                    let k = units - u0;
                    let m = _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                    let mut f = [[0.0f32; 8]; 2];
                    for j in 0..k {
                        (f[0][j], f[1][j]) = match sc {
                            Scales::Bf16(s, b) => (bf16(s, u0 + j), bf16(b, u0 + j)),
                            Scales::Bf16Pairs(s, b) => (bf16(s, (u0 + j) / 2), bf16(b, (u0 + j) / 2)),
                            Scales::F32(s, b) => (s[u0 + j], b[u0 + j]),
                        };
                    }
                    let (d, ds) = (_mm256_maskload_ps(ev.as_ptr().add(dof + u0), m), _mm256_maskload_ps(ev.as_ptr().add(sof + u0), m));
                    (d, ds, _mm256_loadu_ps(f[0].as_ptr()), _mm256_loadu_ps(f[1].as_ptr()))
                };
                let val = _mm256_fmadd_ps(_mm256_mul_ps(s, d), _mm256_cvtepi32_ps(i), _mm256_mul_ps(b, ds));
                _mm256_storeu_ps(v.as_mut_ptr().add(u0), val);
            }
            u0 += 8;
        }
        // numerics::fold_units, with the chunk bounds computed once per product.
        let mut y = 0.0f32;
        for c in 0..PRODUCT_CHUNKS {
            let mut acc = 0.0f32;
            for &x in &v[bounds[c]..bounds[c + 1]] {
                acc += x;
            }
            y += acc;
        }
        y
    }

    /// The bf16 at index `i` of `r`, widened.
    #[inline(always)]
    fn bf16(r: &[u8], i: usize) -> f32 {
        f32::from_bits((u16::from_le_bytes([r[2 * i], r[2 * i + 1]]) as u32) << 16)
    }

    /// A hint to bring the line at `p` into the cache (no effect on any value; `p` need not
    /// be inside an allocation).
    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: a prefetch reads nothing architecturally.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
    }

    /// `y[t][n]` for every input row (a few) and `n in n0..n0+count`, one output at a time
    /// with [`row_value`]: the codes as stored, 4 KiB of them prefetched ahead.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn matmul_each(
        gs: usize,
        w: Weights<'_>,
        xq: &QuantRows,
        bounds: &[usize; PRODUCT_CHUNKS + 1],
        y: *mut f32,
        ldy: usize,
        n0: usize,
        count: usize,
        scratch: &mut Scratch,
    ) {
        let (weight, scales, biases, dt) = w;
        let (ul, units) = (unit_len(gs), bounds[PRODUCT_CHUNKS]);
        let (wb, sb) = (xq.cols / 2, xq.cols / gs * dt.size());
        assert!((n0 + count) * wb <= weight.len() && (n0 + count) * sb <= scales.len().min(biases.len()));
        scratch.su.resize(units, 0.0);
        scratch.bu.resize(units, 0.0);
        scratch.v.resize(units.next_multiple_of(8), 0.0);
        let Scratch { su, bu, v, .. } = scratch;
        // Bf16 with a group per unit or per two is read in place; the rest widened per unit.
        let raw = dt == FloatType::BF16 && (gs == ul || gs == 2 * ul);
        for n in n0..n0 + count {
            // SAFETY: row n's codes, scales and biases lie inside the buffers (asserted above).
            let (codes, sr, br) = unsafe {
                (
                    std::slice::from_raw_parts(weight.as_ptr().add(n * wb), wb),
                    std::slice::from_raw_parts(scales.as_ptr().add(n * sb), sb),
                    std::slice::from_raw_parts(biases.as_ptr().add(n * sb), sb),
                )
            };
            if !raw {
                // SAFETY: the row's scales and biases; `su` and `bu` hold its units.
                unsafe {
                    widen_units(dt, gs, ul, sr, su);
                    widen_units(dt, gs, ul, br, bu);
                }
            }
            let sc = match (raw, gs == ul) {
                (true, true) => Scales::Bf16(sr, br),
                (true, false) => Scales::Bf16Pairs(sr, br),
                (false, _) => Scales::F32(su, bu),
            };
            // The scales of rows ahead (a hint: the hardware prefetcher follows the codes).
            prefetch(scales.as_ptr().wrapping_add((n + 8) * sb));
            prefetch(biases.as_ptr().wrapping_add((n + 8) * sb));
            for t in 0..xq.rows {
                let (_, _, planes, ev) = xq.row(t);
                // SAFETY: the caller's contract on `y`.
                unsafe { *y.add(t * ldy + n) = row_value(ul, codes, planes, ev, sc, bounds, v) };
            }
        }
    }

    /// The 8×8 transpose of 32-bit lanes: lane `j` of result `i` is lane `i` of `v[j]`.
    #[inline(always)]
    unsafe fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
        unsafe {
            let t: [__m256i; 8] = std::array::from_fn(|i| {
                let (a, b) = (v[2 * (i / 2)], v[2 * (i / 2) + 1]);
                if i % 2 == 0 {
                    _mm256_unpacklo_epi32(a, b)
                } else {
                    _mm256_unpackhi_epi32(a, b)
                }
            });
            // Per 128-bit half, u[4g + j] holds lane j (of the half) of v[4g..4g+4].
            let u: [__m256i; 8] = std::array::from_fn(|i| {
                let (g, j) = (i / 4, i % 4);
                let (a, b) = (t[4 * g + j / 2], t[4 * g + 2 + j / 2]);
                if j % 2 == 0 {
                    _mm256_unpacklo_epi64(a, b)
                } else {
                    _mm256_unpackhi_epi64(a, b)
                }
            });
            std::array::from_fn(|i| if i < 4 { _mm256_permute2x128_si256::<0x20>(u[i], u[4 + i]) } else { _mm256_permute2x128_si256::<0x31>(u[i - 4], u[i]) })
        }
    }

    /// A weight row's scales (or biases) `r` widened per unit into `dst` (its units): eight
    /// at a time where a unit is a group or half of one (each type's conversion to f32 is
    /// exact, so any instruction gives `FloatType::get`'s value), one at a time otherwise.
    #[inline(always)]
    unsafe fn widen_units(dt: FloatType, gs: usize, ul: usize, r: &[u8], dst: &mut [f32]) {
        let units = dst.len();
        let mut u = 0;
        if gs == ul {
            while u + 8 <= units {
                // SAFETY: units u..u+8 are groups inside `r` and units inside `dst`.
                unsafe {
                    let v = match dt {
                        FloatType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(r.as_ptr().add(2 * u) as *const __m128i)), 16)),
                        FloatType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(r.as_ptr().add(2 * u) as *const __m128i)),
                        FloatType::F32 => _mm256_loadu_ps(r.as_ptr().add(4 * u) as *const f32),
                    };
                    _mm256_storeu_ps(dst.as_mut_ptr().add(u), v);
                }
                u += 8;
            }
        } else if gs == 2 * ul {
            // Groups of two units (128): four groups, each into two lanes.
            let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            while u + 8 <= units {
                // SAFETY: groups u/2..u/2+4 lie inside `r`, units u..u+8 inside `dst`.
                unsafe {
                    let g = u / 2;
                    let v = match dt {
                        FloatType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadl_epi64(r.as_ptr().add(2 * g) as *const __m128i)), 16)),
                        FloatType::F16 => _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(r.as_ptr().add(2 * g) as *const __m128i))),
                        FloatType::F32 => _mm256_castps128_ps256(_mm_loadu_ps(r.as_ptr().add(4 * g) as *const f32)),
                    };
                    _mm256_storeu_ps(dst.as_mut_ptr().add(u), _mm256_permutevar8x32_ps(v, pairs));
                }
                u += 8;
            }
        }
        for (k, d) in dst.iter_mut().enumerate().skip(u) {
            *d = dt.get(r, k * ul / gs);
        }
    }

    /// The scales and biases of a tile's rows `row(0..ROW_LANES)` per unit, transposed to
    /// `[unit][row]` into `ts` and `tb`; `su` and `bu` hold them `[row][unit]` on the way, each
    /// row's `units` padded to a multiple of eight (the padding is never read as a unit).
    /// `s.3` is the bytes of one row's scales.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn tile_scales(
        s: (&[u8], &[u8], FloatType, usize),
        gs: usize,
        ul: usize,
        units: usize,
        row: impl Fn(usize) -> usize,
        su: &mut [f32],
        bu: &mut [f32],
        ts: &mut [f32],
        tb: &mut [f32],
    ) {
        let (scales, biases, dt, sb) = s;
        let units8 = units.next_multiple_of(8);
        for r in 0..ROW_LANES {
            let rw = row(r);
            // SAFETY: the row's scales and biases, and its units in `su` and `bu`.
            unsafe {
                widen_units(dt, gs, ul, &scales[rw * sb..(rw + 1) * sb], &mut su[r * units8..r * units8 + units]);
                widen_units(dt, gs, ul, &biases[rw * sb..(rw + 1) * sb], &mut bu[r * units8..r * units8 + units]);
            }
        }
        for (src, dst) in [(&*su, &mut *ts), (&*bu, &mut *tb)] {
            for u0 in (0..units8).step_by(8) {
                for h in 0..H {
                    // SAFETY: eight units of eight rows inside `src`, stored inside `dst`.
                    unsafe {
                        let t = transpose8(std::array::from_fn(|r| _mm256_castps_si256(_mm256_loadu_ps(src.as_ptr().add((8 * h + r) * units8 + u0)))));
                        for (j, tj) in t.iter().enumerate() {
                            _mm256_storeu_si256(dst.as_mut_ptr().add((u0 + j) * ROW_LANES + 8 * h) as *mut __m256i, *tj);
                        }
                    }
                }
            }
        }
    }

    /// Per vector of a tile, the lanes that hold one of its `live` weight rows (all ones).
    #[inline(always)]
    unsafe fn lane_mask(live: usize) -> [__m256i; H] {
        unsafe { std::array::from_fn(|h| _mm256_cmpgt_epi32(_mm256_set1_epi32(live as i32 - 8 * h as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))) }
    }

    /// Weight rows per tile of the row-lanes kernel: one per 32-bit lane of `H` vectors.
    pub const ROW_LANES: usize = 16;
    const H: usize = ROW_LANES / 8;

    /// `y[t][n]` for every input row of the Planes form and `n in n0..n0+count`, weight rows in
    /// the lanes: each tile of sixteen weight rows has its codes unpacked once into
    /// `[block][quad][row][4 codes]` (and its scales into `[unit][row]`), then every input
    /// row's quad of each plane is broadcast and meets the quads of rows 0..8 and 8..16
    /// (`vpmaddubsw`, two input rows a pass). A unit's eight even quads (or eight odd ones),
    /// then its other eight, add in 16 bits (|·| ≤ 8·2·15·128 < 2^15) before `vpmaddwd` widens
    /// them. The epilogue and fold run per lane (one weight row) in unit order, per input row.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn matmul_rows(
        gs: usize,
        w: Weights<'_>,
        xq: &QuantRows,
        bounds: &[usize; PRODUCT_CHUNKS + 1],
        y: *mut f32,
        ldy: usize,
        n0: usize,
        count: usize,
        scratch: &mut Scratch,
    ) {
        let (weight, scales, biases, dt) = w;
        let (cols, bl) = (xq.cols, xq.blocks);
        let (ul, groups, units) = (unit_len(gs), cols / gs, bounds[PRODUCT_CHUNKS]);
        let (wb, sb) = (cols / 2, groups * dt.size());
        assert!((n0 + count) * wb <= weight.len() && (n0 + count) * sb <= scales.len().min(biases.len()));
        let units8 = units.next_multiple_of(8);
        scratch.codes.resize(bl * 16 * 4 * ROW_LANES, 0);
        scratch.ts.resize(units8 * ROW_LANES, 0.0);
        scratch.tb.resize(units8 * ROW_LANES, 0.0);
        scratch.su.resize(ROW_LANES * units8, 0.0);
        scratch.bu.resize(ROW_LANES * units8, 0.0);
        let Scratch { codes, ts, tb, su, bu, .. } = scratch;
        let mask = _mm256_set1_epi8(15);
        let mut n = n0;
        while n < n0 + count {
            let live = (n0 + count - n).min(ROW_LANES);
            // Lanes past `live` repeat the last row: computed, never stored.
            let row = |r: usize| n + r.min(live - 1);
            // Per block and eight rows, their code vectors' low and high nibbles transposed:
            // quad k of the eight rows is vector k.
            for b in 0..bl {
                for h in 0..H {
                    // SAFETY: `load_codes` stays inside each row; the stores inside the tile.
                    unsafe {
                        let v: [__m256i; 8] = std::array::from_fn(|r| load_codes(&weight[row(8 * h + r) * wb..(row(8 * h + r) + 1) * wb], 32 * b));
                        let lo = transpose8(std::array::from_fn(|r| _mm256_and_si256(v[r], mask)));
                        let hi = transpose8(std::array::from_fn(|r| _mm256_and_si256(_mm256_srli_epi16(v[r], 4), mask)));
                        let at = codes.as_mut_ptr().add(b * 16 * 4 * ROW_LANES + 32 * h);
                        for k in 0..8 {
                            _mm256_storeu_si256(at.add(k * 4 * ROW_LANES) as *mut __m256i, lo[k]);
                            _mm256_storeu_si256(at.add((8 + k) * 4 * ROW_LANES) as *mut __m256i, hi[k]);
                        }
                    }
                }
            }
            // SAFETY: the rows lie inside the weights (asserted above); the buffers as resized.
            unsafe { tile_scales((scales, biases, dt, sb), gs, ul, units, row, su, bu, ts, tb) };
            let m = lane_mask(live);
            let tl = RowTile { bl, bounds, codes, ts, tb };
            let mut t0 = 0;
            while t0 < xq.rows {
                // SAFETY: the tile's buffers as filled above; the caller's contract on `y`.
                unsafe {
                    let left = xq.rows - t0;
                    t0 += if ul == ACT_BLOCK {
                        if left >= 2 {
                            tl.store(&tl.tokens::<2, true>(xq, t0), y, ldy, n, t0, &m)
                        } else {
                            tl.store(&tl.tokens::<1, true>(xq, t0), y, ldy, n, t0, &m)
                        }
                    } else if left >= 2 {
                        tl.store(&tl.tokens::<2, false>(xq, t0), y, ldy, n, t0, &m)
                    } else {
                        tl.store(&tl.tokens::<1, false>(xq, t0), y, ldy, n, t0, &m)
                    };
                }
            }
            n += live;
        }
    }

    /// One tile of [`matmul_rows`]: its codes `[block][quad][row][4]`, scales and biases
    /// `[unit][row]`.
    struct RowTile<'a> {
        bl: usize,
        bounds: &'a [usize; PRODUCT_CHUNKS + 1],
        codes: &'a [u8],
        ts: &'a [f32],
        tb: &'a [f32],
    }

    impl RowTile<'_> {
        /// Writes `TT` input rows' outputs (the lanes of `m`) from `t0`; returns `TT`.
        #[inline(always)]
        unsafe fn store<const TT: usize>(&self, v: &[[__m256; H]; TT], y: *mut f32, ldy: usize, n: usize, t0: usize, m: &[__m256i; H]) -> usize {
            for (t, vt) in v.iter().enumerate() {
                for h in 0..H {
                    // SAFETY: the caller's contract on `y` (columns n..n+live of these rows).
                    unsafe { _mm256_maskstore_ps(y.add((t0 + t) * ldy + n + 8 * h), m[h], vt[h]) };
                }
            }
            TT
        }

        /// The tile's outputs for input rows `t0..t0+TT`: lane `r` of `result[t][h]` is weight
        /// row `8h + r` against input row `t0 + t`. `WHOLE`: units of 64 (else of 32).
        #[inline(always)]
        unsafe fn tokens<const TT: usize, const WHOLE: bool>(&self, xq: &QuantRows, t0: usize) -> [[__m256; H]; TT] {
            unsafe {
                let bl = self.bl;
                let (dof, sof) = if WHOLE { (0, bl) } else { (2 * bl, 4 * bl) };
                let rows: [(*const i8, &[f32]); TT] = std::array::from_fn(|t| {
                    let (_, _, p, e) = xq.row(t0 + t);
                    (p.as_ptr(), e)
                });
                let (ones, c256) = (_mm256_set1_epi16(1), _mm256_set1_epi16(256));
                let mut y = [[_mm256_setzero_ps(); H]; TT];
                for c in 0..PRODUCT_CHUNKS {
                    let mut acc_c = [[_mm256_setzero_ps(); H]; TT];
                    for u in self.bounds[c]..self.bounds[c + 1] {
                        let (blk, half) = if WHOLE { (u, 0) } else { (u / 2, u % 2) };
                        // The block's evens start here in each plane of its pair; odds 64 on.
                        let base = (blk / 2) * PAIR_BYTES + (blk % 2) * 32;
                        let wq = self.codes.as_ptr().add(blk * 16 * 4 * ROW_LANES);
                        let mut it = [[_mm256_setzero_si256(); H]; TT];
                        // A unit of 64 is quads 0..8 (evens), then 8..16 (odds); one of 32
                        // its evens, quads 4h..4h+4, and its odds 8 further.
                        for w in 0..if WHOLE { 2 } else { 1 } {
                            let mut acc = [[[_mm256_setzero_si256(); H]; 3]; TT];
                            for i in 0..8 {
                                let k = if WHOLE { 8 * w + i } else { 4 * half + i / 2 + 8 * (i % 2) };
                                let wv: [__m256i; H] = std::array::from_fn(|h| _mm256_loadu_si256(wq.add(k * 4 * ROW_LANES + 32 * h) as *const __m256i));
                                let off = base + (k / 8) * ACT_BLOCK + (k % 8) * 4;
                                for (t, at) in acc.iter_mut().enumerate() {
                                    let x = rows[t].0.add(off);
                                    for (p, a) in at.iter_mut().enumerate() {
                                        let xv = _mm256_set1_epi32((x.add(p * 2 * ACT_BLOCK) as *const i32).read_unaligned());
                                        for h in 0..H {
                                            a[h] = _mm256_add_epi16(a[h], _mm256_maddubs_epi16(wv[h], xv));
                                        }
                                    }
                                }
                            }
                            for (t, at) in acc.iter().enumerate() {
                                for h in 0..H {
                                    let a01 = _mm256_add_epi32(_mm256_madd_epi16(at[0][h], ones), _mm256_madd_epi16(at[1][h], c256));
                                    it[t][h] = _mm256_add_epi32(it[t][h], _mm256_add_epi32(a01, _mm256_slli_epi32(_mm256_madd_epi16(at[2][h], ones), 16)));
                                }
                            }
                        }
                        for h in 0..H {
                            let (s, b) = (_mm256_loadu_ps(self.ts.as_ptr().add(u * ROW_LANES + 8 * h)), _mm256_loadu_ps(self.tb.as_ptr().add(u * ROW_LANES + 8 * h)));
                            for t in 0..TT {
                                let ev = rows[t].1;
                                let sd = _mm256_mul_ps(s, _mm256_set1_ps(ev[dof + u]));
                                let v = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(it[t][h]), _mm256_mul_ps(b, _mm256_set1_ps(ev[sof + u])));
                                acc_c[t][h] = _mm256_add_ps(acc_c[t][h], v);
                            }
                        }
                    }
                    for t in 0..TT {
                        for h in 0..H {
                            y[t][h] = _mm256_add_ps(y[t][h], acc_c[t][h]);
                        }
                    }
                }
                y
            }
        }
    }

    /// `f32(a + 65536·b)` per lane, rounded once to nearest even (as `i64 as f32`), for |b| +
    /// |a|/65536 < 2^24: with `c = b + (a >> 16)` and `l = a & 0xffff` the value is `c·65536 +
    /// l`, both terms exact in f32, and one `fma` rounds their exact sum.
    #[inline(always)]
    unsafe fn exact_f32(a: __m256i, b: __m256i) -> __m256 {
        unsafe {
            let c = _mm256_add_epi32(b, _mm256_srai_epi32(a, 16));
            let l = _mm256_and_si256(a, _mm256_set1_epi32(0xffff));
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(65536.0), _mm256_cvtepi32_ps(l))
        }
    }

    /// [`matmul_rows`] for 8-bit codes: each tile of sixteen weight rows has its codes widened
    /// once to i16 pairs, `[pair][row][2]`, and kept as bytes, `[quad][row][4]`; every input
    /// row's pair of low digits `L` is broadcast against the pairs (`vpmaddwd`) and its quad of
    /// high digits `H` against the quads (`vpmaddubsw`, |a pair of products| ≤ 2·255·32, two
    /// quads added in 16 bits before `vpmaddwd` widens them), two input rows a pass; the digits
    /// are [`QuantRows`]' wide form. Exactness: per unit and lane `A = Σ q·L` and `B = Σ q·H`
    /// add in i32 (|A| ≤ 64·255·32 768 = 2^29, |B| ≤ 64·255·32), and `I = A + 65536·B` (up to
    /// about 2^35) reaches f32 with one rounding ([`exact_f32`]). The epilogue and fold run per
    /// lane in unit order, per input row, as for 4-bit codes.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn matmul_rows8(
        gs: usize,
        w: Weights<'_>,
        xq: &QuantRows,
        bounds: &[usize; PRODUCT_CHUNKS + 1],
        y: *mut f32,
        ldy: usize,
        n0: usize,
        count: usize,
        scratch: &mut Scratch,
    ) {
        let (weight, scales, biases, dt) = w;
        let (cols, bl) = (xq.cols, xq.blocks);
        let (ul, groups, units) = (unit_len(gs), cols / gs, bounds[PRODUCT_CHUNKS]);
        let (wb, sb) = (cols, groups * dt.size());
        assert!((n0 + count) * wb <= weight.len() && (n0 + count) * sb <= scales.len().min(biases.len()));
        assert!(xq.low.len() == xq.rows * cols && xq.high.len() == xq.rows * cols);
        let units8 = units.next_multiple_of(8);
        // Pairs as i16 (`cols·32` bytes), then quads as bytes (`cols·16`).
        let quads = cols * 2 * ROW_LANES;
        scratch.codes.resize(cols * 3 * ROW_LANES, 0);
        scratch.ts.resize(units8 * ROW_LANES, 0.0);
        scratch.tb.resize(units8 * ROW_LANES, 0.0);
        scratch.su.resize(ROW_LANES * units8, 0.0);
        scratch.bu.resize(ROW_LANES * units8, 0.0);
        let Scratch { codes, ts, tb, su, bu, .. } = scratch;
        let mut n = n0;
        while n < n0 + count {
            let live = (n0 + count - n).min(ROW_LANES);
            // Lanes past `live` repeat the last row: computed, never stored.
            let row = |r: usize| n + r.min(live - 1);
            // Per 16 elements and eight rows, their codes widened to eight i16 pairs and
            // transposed: pair k of the eight rows is vector k.
            for q in 0..cols / 16 {
                for h in 0..H {
                    // SAFETY: 16 bytes inside each row (cols is a multiple of 32); the stores
                    // inside the tile.
                    unsafe {
                        let v: [__m256i; 8] = std::array::from_fn(|r| _mm256_cvtepu8_epi16(_mm_loadu_si128(weight.as_ptr().add(row(8 * h + r) * wb + 16 * q) as *const __m128i)));
                        let t = transpose8(v);
                        let at = codes.as_mut_ptr().add(8 * q * 4 * ROW_LANES + 32 * h);
                        for (k, tk) in t.iter().enumerate() {
                            _mm256_storeu_si256(at.add(k * 4 * ROW_LANES) as *mut __m256i, *tk);
                        }
                        // The same 16 codes as four quads of bytes: quad k of a row is the
                        // bytes of its pairs 2k and 2k+1 (each i16 < 256).
                        let at = codes.as_mut_ptr().add(quads + 4 * q * 4 * ROW_LANES + 32 * h);
                        let bytes = |v: __m256i| _mm256_and_si256(_mm256_or_si256(v, _mm256_srli_epi32(v, 8)), _mm256_set1_epi32(0xffff));
                        for k in 0..4 {
                            let b = _mm256_or_si256(bytes(t[2 * k]), _mm256_slli_epi32(bytes(t[2 * k + 1]), 16));
                            _mm256_storeu_si256(at.add(k * 4 * ROW_LANES) as *mut __m256i, b);
                        }
                    }
                }
            }
            // SAFETY: the rows lie inside the weights (asserted above); the buffers as resized.
            unsafe { tile_scales((scales, biases, dt, sb), gs, ul, units, row, su, bu, ts, tb) };
            let m = lane_mask(live);
            let tl = RowTile { bl, bounds, codes, ts, tb };
            let mut t0 = 0;
            while t0 < xq.rows {
                // SAFETY: the tile's buffers as filled above; the caller's contract on `y`.
                unsafe {
                    let left = xq.rows - t0;
                    t0 += if ul == ACT_BLOCK {
                        if left >= 2 {
                            tl.store(&tl.tokens8::<2, true>(xq, t0), y, ldy, n, t0, &m)
                        } else {
                            tl.store(&tl.tokens8::<1, true>(xq, t0), y, ldy, n, t0, &m)
                        }
                    } else if left >= 2 {
                        tl.store(&tl.tokens8::<2, false>(xq, t0), y, ldy, n, t0, &m)
                    } else {
                        tl.store(&tl.tokens8::<1, false>(xq, t0), y, ldy, n, t0, &m)
                    };
                }
            }
            n += live;
        }
    }

    impl RowTile<'_> {
        /// [`RowTile::tokens`] for a tile of 8-bit codes (`[pair][row][2]` i16, pairs in
        /// element order).
        #[inline(always)]
        unsafe fn tokens8<const TT: usize, const WHOLE: bool>(&self, xq: &QuantRows, t0: usize) -> [[__m256; H]; TT] {
            unsafe {
                let bl = self.bl;
                let ul = if WHOLE { ACT_BLOCK } else { ACT_BLOCK / 2 };
                let (dof, sof) = if WHOLE { (0, bl) } else { (2 * bl, 4 * bl) };
                let rows: [(*const i16, *const i8, &[f32]); TT] = std::array::from_fn(|t| {
                    let (lo, hi) = xq.wide_row(t0 + t);
                    let (_, _, _, e) = xq.row(t0 + t);
                    (lo.as_ptr(), hi.as_ptr(), e)
                });
                let ones = _mm256_set1_epi16(1);
                let quads = self.codes.as_ptr().add(xq.cols * 2 * ROW_LANES);
                let mut y = [[_mm256_setzero_ps(); H]; TT];
                for c in 0..PRODUCT_CHUNKS {
                    let mut acc_c = [[_mm256_setzero_ps(); H]; TT];
                    for u in self.bounds[c]..self.bounds[c + 1] {
                        let e0 = u * ul;
                        let wp = self.codes.as_ptr().add((e0 / 2) * 4 * ROW_LANES);
                        let wq = quads.add((e0 / 4) * 4 * ROW_LANES);
                        let mut a = [[_mm256_setzero_si256(); H]; TT];
                        let mut b = [[_mm256_setzero_si256(); H]; TT];
                        // Eight elements a step: four pairs against `L`, two quads against `H`
                        // (|a pair of products| ≤ 2·255·32, so two quads add in 16 bits).
                        for i in 0..ul / 8 {
                            let hq: [[__m256i; H]; 2] =
                                std::array::from_fn(|j| std::array::from_fn(|h| _mm256_loadu_si256(wq.add((2 * i + j) * 4 * ROW_LANES + 32 * h) as *const __m256i)));
                            for t in 0..TT {
                                let x0 = _mm256_set1_epi32((rows[t].1.add(e0 + 8 * i) as *const i32).read_unaligned());
                                let x1 = _mm256_set1_epi32((rows[t].1.add(e0 + 8 * i + 4) as *const i32).read_unaligned());
                                for h in 0..H {
                                    let s = _mm256_add_epi16(_mm256_maddubs_epi16(hq[0][h], x0), _mm256_maddubs_epi16(hq[1][h], x1));
                                    b[t][h] = _mm256_add_epi32(b[t][h], _mm256_madd_epi16(s, ones));
                                }
                            }
                            for j in 0..4 {
                                let k = 4 * i + j;
                                let wv: [__m256i; H] = std::array::from_fn(|h| _mm256_loadu_si256(wp.add(k * 4 * ROW_LANES + 32 * h) as *const __m256i));
                                for t in 0..TT {
                                    let xl = _mm256_set1_epi32((rows[t].0.add(e0 + 2 * k) as *const i32).read_unaligned());
                                    for h in 0..H {
                                        a[t][h] = _mm256_add_epi32(a[t][h], _mm256_madd_epi16(wv[h], xl));
                                    }
                                }
                            }
                        }
                        for h in 0..H {
                            let (s, bb) = (_mm256_loadu_ps(self.ts.as_ptr().add(u * ROW_LANES + 8 * h)), _mm256_loadu_ps(self.tb.as_ptr().add(u * ROW_LANES + 8 * h)));
                            for t in 0..TT {
                                let ev = rows[t].2;
                                let sd = _mm256_mul_ps(s, _mm256_set1_ps(ev[dof + u]));
                                let v = _mm256_fmadd_ps(sd, exact_f32(a[t][h], b[t][h]), _mm256_mul_ps(bb, _mm256_set1_ps(ev[sof + u])));
                                acc_c[t][h] = _mm256_add_ps(acc_c[t][h], v);
                            }
                        }
                    }
                    for t in 0..TT {
                        for h in 0..H {
                            y[t][h] = _mm256_add_ps(y[t][h], acc_c[t][h]);
                        }
                    }
                }
                y
            }
        }
    }
}

/// The AVX2 quantizer: the bytes of [`quantize_row`] and the plane placement of each form,
/// eight elements per operation. `x / d` is the same IEEE division and the conversion rounds
/// to nearest even (the default MXCSR), so `xi` is `act_quant`'s.
#[cfg(target_arch = "x86_64")]
mod avx2q {
    use super::{Layout, ACT_BLOCK, PAIR_BYTES};
    use crate::numerics::ACT_LEVELS;
    use std::arch::x86_64::*;

    /// The three planes of eight `xi` (numerics::act_planes, lane by lane), as i32 lanes.
    #[inline(always)]
    unsafe fn planes3(xi: __m256i) -> [__m256i; 3] {
        unsafe {
            let (c128, m255) = (_mm256_set1_epi32(128), _mm256_set1_epi32(255));
            let p0 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(xi, c128), m255), c128);
            let r1 = _mm256_srai_epi32(_mm256_sub_epi32(xi, p0), 8);
            let p1 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(r1, c128), m255), c128);
            let p2 = _mm256_srai_epi32(_mm256_sub_epi32(r1, p1), 8);
            [p0, p1, p2]
        }
    }

    /// Thirty-two i32 lanes inside the i8 range as bytes in element order (the packs
    /// interleave 128-bit halves; the permutation puts them back).
    #[inline(always)]
    unsafe fn bytes32(v: &[__m256i]) -> __m256i {
        unsafe {
            let b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
        }
    }

    /// The wide form of one row (Natural planes): per 16 elements the planes widened to i16,
    /// `L = p0 + (p1 << 8)` wrapping, and `H = p2 - 1` exactly where that wrapped (`p1 < 0`
    /// and `L ≥ 0`: `p0 + 256·p1 < -32 768`), else `p2`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn wide_digits(planes: &[i8], lo: &mut [i16], hi: &mut [i8]) {
        let cols = lo.len();
        assert!(cols.is_multiple_of(16) && hi.len() == cols && planes.len() >= cols.div_ceil(2 * ACT_BLOCK) * PAIR_BYTES);
        for e in (0..cols).step_by(16) {
            let (b, j) = (e / ACT_BLOCK, e % ACT_BLOCK);
            let at = (b / 2) * PAIR_BYTES + (b % 2) * ACT_BLOCK + j;
            // SAFETY: 16 bytes of each plane inside the row (asserted), and of `lo` and `hi`.
            unsafe {
                let p = |k: usize| _mm256_cvtepi8_epi16(_mm_loadu_si128(planes.as_ptr().add(at + k * 2 * ACT_BLOCK) as *const __m128i));
                let (p0, p1, p2) = (p(0), p(1), p(2));
                let l = _mm256_add_epi16(p0, _mm256_slli_epi16(p1, 8));
                let h = _mm256_add_epi16(p2, _mm256_srai_epi16(_mm256_andnot_si256(l, p1), 15));
                _mm256_storeu_si256(lo.as_mut_ptr().add(e) as *mut __m256i, l);
                _mm_storeu_si128(hi.as_mut_ptr().add(e) as *mut __m128i, _mm_packs_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
            }
        }
    }

    /// One row into the Planes form (`planes`: the row's pairs).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_planes(layout: Layout, x: &[f32], d: &mut [f32], sums: &mut [i32], planes: &mut [i8]) {
        let bl = d.len();
        if bl % 2 == 1 {
            // The missing second block of the last pair.
            planes[(bl / 2) * PAIR_BYTES..].fill(0);
        }
        for b in 0..bl {
            // SAFETY: the block lies inside `x`; the stores inside the row's pair `b / 2`.
            unsafe {
                let blk = &x[b * ACT_BLOCK..(b * ACT_BLOCK + ACT_BLOCK).min(x.len())];
                let k = blk.len() / 8;
                let v: [__m256; 8] = std::array::from_fn(|i| if i < k { _mm256_loadu_ps(blk.as_ptr().add(8 * i)) } else { _mm256_setzero_ps() });
                // act_scale: NaN when any element is NaN, else max|x| / ACT_LEVELS.
                let abs = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
                let (mut nan, mut m) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for xv in &v {
                    nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(*xv, *xv));
                    m = _mm256_max_ps(m, _mm256_and_ps(*xv, abs));
                }
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                let m = _mm_max_ss(m, _mm_movehdup_ps(m));
                let db = if _mm256_movemask_ps(nan) != 0 { f32::NAN } else { _mm_cvtss_f32(m) / ACT_LEVELS };
                let xi: [__m256i; 8] = if db.is_normal() {
                    let dv = _mm256_set1_ps(db);
                    std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_div_ps(v[i], dv)))
                } else {
                    [_mm256_setzero_si256(); 8]
                };
                let hsum = |a: __m256i, b: __m256i, c: __m256i, e: __m256i| {
                    let s = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, e));
                    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
                };
                d[b] = db;
                sums[2 * b] = hsum(xi[0], xi[1], xi[2], xi[3]);
                sums[2 * b + 1] = hsum(xi[4], xi[5], xi[6], xi[7]);
                let pl: [[__m256i; 3]; 8] = std::array::from_fn(|i| planes3(xi[i]));
                let cols: [[__m256i; 8]; 3] = std::array::from_fn(|p| std::array::from_fn(|i| pl[i][p]));
                let base = planes.as_mut_ptr().add((b / 2) * PAIR_BYTES);
                for (p, col) in cols.iter().enumerate() {
                    // Elements 0..32 and 32..64 of plane p.
                    let (lo, hi) = (bytes32(&col[..4]), bytes32(&col[4..]));
                    let at = base.add(p * 2 * ACT_BLOCK);
                    match layout {
                        Layout::Natural => {
                            _mm256_storeu_si256(at.add((b % 2) * ACT_BLOCK) as *mut __m256i, lo);
                            _mm256_storeu_si256(at.add((b % 2) * ACT_BLOCK + 32) as *mut __m256i, hi);
                        }
                        Layout::Nibbles => {
                            // Per 16 elements, evens then odds; then per 32, [evens | odds].
                            let eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
                            let split = |v: __m256i| _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(v, eo));
                            let (lo, hi) = (split(lo), split(hi));
                            _mm256_storeu_si256(at.add((b % 2) * 32) as *mut __m256i, _mm256_permute2x128_si256::<0x20>(lo, hi));
                            _mm256_storeu_si256(at.add(ACT_BLOCK + (b % 2) * 32) as *mut __m256i, _mm256_permute2x128_si256::<0x31>(lo, hi));
                        }
                    }
                }
            }
        }
    }
}

/// The AVX-512 quantizer (F/BW/VL): the bytes of [`quantize_row`] and the plane placement of
/// each form, sixteen elements per operation. `x / d` is the same IEEE division and the
/// conversion rounds to nearest even (the default MXCSR), so `xi` is `act_quant`'s.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Layout, ACT_BLOCK, PAIR_BYTES};
    use crate::numerics::ACT_LEVELS;
    use std::arch::x86_64::*;

    /// One block (64 elements, or 32 at a row's end) as four vectors of `xi` (zero past the
    /// block's end), with its scale and the sums of its halves.
    #[inline(always)]
    unsafe fn block_xi(blk: &[f32]) -> ([__m512i; 4], f32, i32, i32) {
        unsafe {
            let k = blk.len() / 16;
            let v: [__m512; 4] = std::array::from_fn(|i| if i < k { _mm512_loadu_ps(blk.as_ptr().add(16 * i)) } else { _mm512_setzero_ps() });
            // act_scale: NaN when any element is NaN, else max|x| / ACT_LEVELS.
            let mut nan = 0u16;
            let mut m = _mm512_setzero_ps();
            for x in &v {
                nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(*x, *x);
                m = _mm512_max_ps(m, _mm512_abs_ps(*x));
            }
            let d = if nan != 0 { f32::NAN } else { _mm512_reduce_max_ps(m) / ACT_LEVELS };
            let xi: [__m512i; 4] = if d.is_normal() {
                let dv = _mm512_set1_ps(d);
                std::array::from_fn(|i| _mm512_cvtps_epi32(_mm512_div_ps(v[i], dv)))
            } else {
                [_mm512_setzero_si512(); 4]
            };
            let s0 = _mm512_reduce_add_epi32(_mm512_add_epi32(xi[0], xi[1]));
            let s1 = _mm512_reduce_add_epi32(_mm512_add_epi32(xi[2], xi[3]));
            (xi, d, s0, s1)
        }
    }

    /// The three planes of sixteen `xi` (numerics::act_planes, lane by lane).
    #[inline(always)]
    unsafe fn planes3(xi: __m512i) -> [__m128i; 3] {
        unsafe {
            let (c128, m255) = (_mm512_set1_epi32(128), _mm512_set1_epi32(255));
            let digit = |v: __m512i| _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), m255), c128);
            let p0 = digit(xi);
            let r1 = _mm512_srai_epi32(_mm512_sub_epi32(xi, p0), 8);
            let p1 = digit(r1);
            let p2 = _mm512_srai_epi32(_mm512_sub_epi32(r1, p1), 8);
            [_mm512_cvtepi32_epi8(p0), _mm512_cvtepi32_epi8(p1), _mm512_cvtepi32_epi8(p2)]
        }
    }

    /// The four vectors of a block in plane order: Nibbles `[evens of 0..32 | evens of 32..64
    /// | odds of 0..32 | odds of 32..64]`, Natural as they are.
    #[inline(always)]
    unsafe fn in_plane_order(layout: Layout, xi: [__m512i; 4]) -> [__m512i; 4] {
        unsafe {
            match layout {
                Layout::Natural => xi,
                Layout::Nibbles => {
                    let ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                    let od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
                    [
                        _mm512_permutex2var_epi32(xi[0], ev, xi[1]),
                        _mm512_permutex2var_epi32(xi[2], ev, xi[3]),
                        _mm512_permutex2var_epi32(xi[0], od, xi[1]),
                        _mm512_permutex2var_epi32(xi[2], od, xi[3]),
                    ]
                }
            }
        }
    }

    /// One row into the Planes form (`planes`: the row's pairs).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    pub unsafe fn quantize_planes(layout: Layout, x: &[f32], d: &mut [f32], sums: &mut [i32], planes: &mut [i8]) {
        let bl = d.len();
        if bl % 2 == 1 {
            // The missing second block of the last pair.
            planes[(bl / 2) * PAIR_BYTES..].fill(0);
        }
        for b in 0..bl {
            // SAFETY: the block lies inside `x`; the stores inside the row's pair `b / 2`.
            unsafe {
                let (xi, db, s0, s1) = block_xi(&x[b * ACT_BLOCK..(b * ACT_BLOCK + ACT_BLOCK).min(x.len())]);
                d[b] = db;
                sums[2 * b] = s0;
                sums[2 * b + 1] = s1;
                let q = in_plane_order(layout, xi);
                let base = planes.as_mut_ptr().add((b / 2) * PAIR_BYTES);
                for (i, &qi) in q.iter().enumerate() {
                    // Plane offset of these sixteen positions (numerics of `Layout::plane_at`).
                    let at = match layout {
                        Layout::Natural => (b % 2) * ACT_BLOCK + 16 * i,
                        Layout::Nibbles => (i / 2) * ACT_BLOCK + (b % 2) * 32 + (i % 2) * 16,
                    };
                    for (p, pb) in planes3(qi).iter().enumerate() {
                        _mm_storeu_si128(base.add(p * 2 * ACT_BLOCK + at) as *mut __m128i, *pb);
                    }
                }
            }
        }
    }
}

/// AVX-512 VNNI kernels of 4-bit codes (module doc: the two forms and why the 32-bit sums are
/// exact).
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{unit_len, FloatType, QuantRows, Scratch, Weights, ACT_BLOCK, PAIR_BYTES, PRODUCT_CHUNKS};
    use std::arch::x86_64::*;

    /// Bytes ahead of the codes in use that a decode product asks the cache for (as the f32
    /// matrix-vector kernels do).
    const PREFETCH_BYTES: usize = 4096;

    /// A hint to bring the line at `p` into the cache (no effect on any value; `p` need not
    /// be inside an allocation).
    #[inline(always)]
    pub fn prefetch(p: *const u8) {
        // SAFETY: a prefetch reads nothing architecturally.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
    }

    /// One weight row's scales and biases per unit: bf16 in place (one group per unit), or
    /// widened to f32.
    #[derive(Clone, Copy)]
    pub enum Scales<'a> {
        Bf16(&'a [u8], &'a [u8]),
        F32(&'a [f32], &'a [f32]),
    }

    impl Scales<'_> {
        /// Units `u0..u0+16` (the lanes of `m`) as f32: a bf16 is the top half of its f32.
        #[inline(always)]
        unsafe fn load(self, u0: usize, m: __mmask16) -> (__m512, __m512) {
            unsafe {
                match self {
                    Scales::Bf16(s, b) => {
                        let w = |r: &[u8]| _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r.as_ptr().add(2 * u0) as *const i16)), 16));
                        (w(s), w(b))
                    }
                    Scales::F32(s, b) => (_mm512_maskz_loadu_ps(m, s.as_ptr().add(u0)), _mm512_maskz_loadu_ps(m, b.as_ptr().add(u0))),
                }
            }
        }
    }

    /// Plane-combined lanes of blocks `2j, 2j+1` of one weight row against one input row:
    /// lanes 0..8 hold block 2j (0..4 its first 32 elements, 4..8 the rest), lanes 8..16 block
    /// 2j+1; each lane `a0 + (a1 << 8) + (a2 << 16)` modulo 2^32.
    #[inline(always)]
    unsafe fn pair_ints(codes: &[u8], planes: &[i8], j: usize) -> __m512i {
        unsafe {
            let at = 64 * j;
            let n = (codes.len() - at).min(64);
            let p = codes.as_ptr().add(at);
            prefetch(p.wrapping_add(PREFETCH_BYTES));
            // Past the row's end (an odd block count or a final half block) the codes are 0.
            let c = if n == 64 { _mm512_loadu_si512(p as *const _) } else { _mm512_maskz_loadu_epi8((1u64 << n) - 1, p as *const i8) };
            let mask = _mm512_set1_epi8(15);
            let lo = _mm512_and_si512(c, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
            let pl = planes.as_ptr().add(j * PAIR_BYTES);
            let plane = |a: __m512i, k: usize| {
                let x = pl.add(k * 2 * ACT_BLOCK);
                let a = _mm512_dpbusd_epi32(a, lo, _mm512_loadu_si512(x as *const _));
                _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512(x.add(ACT_BLOCK) as *const _))
            };
            // Horner order, ((a2·256) + a1)·256 + a0: one accumulator, no adds.
            let a = _mm512_slli_epi32(plane(_mm512_setzero_si512(), 2), 8);
            plane(_mm512_slli_epi32(plane(a, 1), 8), 0)
        }
    }

    /// Sixteen units of 64 (eight [`pair_ints`] vectors, unit `2i` in the low half of `t[i]`,
    /// `2i+1` in the high half) summed to one lane each, in unit order. Pairs of vectors
    /// interleave and add (32-bit, then 64-bit elements), then 128-bit quarters.
    #[inline(always)]
    unsafe fn tree64(t: &[__m512i; 8]) -> __m512i {
        unsafe {
            let l1 = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            let l2 = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
            let v0 = l2(l1(t[0], t[1]), l1(t[2], t[3]));
            let v1 = l2(l1(t[4], t[5]), l1(t[6], t[7]));
            // Quarter k of v_m holds quarter k's sums of t[4m..4m+4]; quarters 0+1 are the
            // even units, 2+3 the odd ones.
            let w = _mm512_add_epi32(_mm512_shuffle_i32x4(v0, v1, 0b10_00_10_00), _mm512_shuffle_i32x4(v0, v1, 0b11_01_11_01));
            // w's lanes are units 0 2 4 6 1 3 5 7 8 10 12 14 9 11 13 15.
            _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), w)
        }
    }

    /// Sixteen units of 32 (four [`pair_ints`] vectors, unit `4i + k` in quarter `k` of
    /// `t[i]`) summed to one lane each, in unit order.
    #[inline(always)]
    unsafe fn tree32(t: &[__m512i; 8]) -> __m512i {
        unsafe {
            let l1 = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            let (a, b) = (l1(t[0], t[1]), l1(t[2], t[3]));
            let v = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
            // Lane 4k + i is unit 4i + k.
            _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v)
        }
    }

    /// One output of 4-bit codes against one input row of the Planes form: sixteen units'
    /// integers at a time, their values `fma(s·d, f32(I), b·(d·f32(S)))` sixteen lanes at once,
    /// then the fold in unit order (`bounds`: the chunks' first units, then the unit count).
    #[inline(always)]
    unsafe fn row_value(ul: usize, codes: &[u8], planes: &[i8], ev: &[f32], sc: Scales<'_>, bounds: &[usize; PRODUCT_CHUNKS + 1], v: &mut [f32]) -> f32 {
        let units = bounds[PRODUCT_CHUNKS];
        let bl = ev.len() / 6;
        let pairs = bl.div_ceil(2);
        debug_assert!(v.len() >= units && planes.len() == pairs * PAIR_BYTES);
        // Pairs of blocks per sixteen units, and where the units' `d` and `d·f32(S)` start.
        let (per, dof, sof) = if ul == ACT_BLOCK { (8, 0, bl) } else { (4, 2 * bl, 4 * bl) };
        let mut u0 = 0;
        while u0 < units {
            // SAFETY: pairs below `pairs` lie inside `codes` and `planes`; the masked lanes
            // stay inside the per-unit slices.
            unsafe {
                let mut t = [_mm512_setzero_si512(); 8];
                for (i, ti) in t.iter_mut().enumerate().take(per) {
                    let j = u0 / 16 * per + i;
                    if j < pairs {
                        *ti = pair_ints(codes, planes, j);
                    }
                }
                let i = if per == 8 { tree64(&t) } else { tree32(&t) };
                let k = (units - u0).min(16);
                let m: __mmask16 = if k == 16 { 0xffff } else { (1u16 << k) - 1 };
                let ld = |s: &[f32], at: usize| _mm512_maskz_loadu_ps(m, s.as_ptr().add(at));
                let (d, ds) = (ld(ev, dof + u0), ld(ev, sof + u0));
                let (s, b) = sc.load(u0, m);
                let val = _mm512_fmadd_ps(_mm512_mul_ps(s, d), _mm512_cvtepi32_ps(i), _mm512_mul_ps(b, ds));
                _mm512_mask_storeu_ps(v.as_mut_ptr().add(u0), m, val);
            }
            u0 += 16;
        }
        // numerics::fold_units, with the chunk bounds computed once per product.
        let mut y = 0.0f32;
        for c in 0..PRODUCT_CHUNKS {
            let mut acc = 0.0f32;
            for &x in &v[bounds[c]..bounds[c + 1]] {
                acc += x;
            }
            y += acc;
        }
        y
    }

    /// `y[t][n]` for every input row (a few) and `n in n0..n0+count`, one output at a time
    /// with [`row_value`]: the codes as stored, 4 KiB of them prefetched ahead.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
    pub unsafe fn matmul_each(
        gs: usize,
        w: Weights<'_>,
        xq: &QuantRows,
        bounds: &[usize; PRODUCT_CHUNKS + 1],
        y: *mut f32,
        ldy: usize,
        n0: usize,
        count: usize,
        scratch: &mut Scratch,
    ) {
        let (weight, scales, biases, dt) = w;
        let (ul, units) = (unit_len(gs), bounds[PRODUCT_CHUNKS]);
        let (wb, sb) = (xq.cols / 2, xq.cols / gs * dt.size());
        assert!((n0 + count) * wb <= weight.len() && (n0 + count) * sb <= scales.len().min(biases.len()));
        scratch.su.resize(units, 0.0);
        scratch.bu.resize(units, 0.0);
        scratch.v.resize(units, 0.0);
        let Scratch { su, bu, v, .. } = scratch;
        // Bf16 with one group per unit is read in place; the rest widened per unit first.
        let raw = dt == FloatType::BF16 && gs == ul;
        let rows: Vec<(&[i8], &[f32])> = (0..xq.rows)
            .map(|t| {
                let (_, _, p, e) = xq.row(t);
                (p, e)
            })
            .collect();
        for n in n0..n0 + count {
            // SAFETY: row n's codes, scales and biases lie inside the buffers (asserted above).
            let (codes, sr, br) = unsafe {
                (
                    std::slice::from_raw_parts(weight.as_ptr().add(n * wb), wb),
                    std::slice::from_raw_parts(scales.as_ptr().add(n * sb), sb),
                    std::slice::from_raw_parts(biases.as_ptr().add(n * sb), sb),
                )
            };
            if !raw {
                for u in 0..units {
                    su[u] = dt.get(sr, u * ul / gs);
                    bu[u] = dt.get(br, u * ul / gs);
                }
            }
            let sc = if raw { Scales::Bf16(sr, br) } else { Scales::F32(su, bu) };
            // The scales of rows ahead (a hint: the hardware prefetcher follows the codes).
            prefetch(scales.as_ptr().wrapping_add((n + 8) * sb));
            prefetch(biases.as_ptr().wrapping_add((n + 8) * sb));
            for (t, &(planes, ev)) in rows.iter().enumerate() {
                // SAFETY: the caller's contract on `y`.
                unsafe { *y.add(t * ldy + n) = row_value(ul, codes, planes, ev, sc, bounds, v) };
            }
        }
    }

    /// Weight rows per tile of the row-lanes kernel: one per 32-bit lane.
    const ROW_LANES: usize = 16;

    /// `y[t][n]` for every input row of the Planes form and `n in n0..n0+count`, weight rows in
    /// the lanes: each tile of sixteen weight rows has its codes unpacked once into
    /// `[block][quad][row][4 codes]` (and its scales into `[unit][row]`), then every input
    /// row's quad of each plane is broadcast against a quad of all sixteen rows. The
    /// epilogue and fold run per lane (one weight row) in unit order, per input row.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
    pub unsafe fn matmul_rows(
        gs: usize,
        w: Weights<'_>,
        xq: &QuantRows,
        bounds: &[usize; PRODUCT_CHUNKS + 1],
        y: *mut f32,
        ldy: usize,
        n0: usize,
        count: usize,
        scratch: &mut Scratch,
    ) {
        let (weight, scales, biases, dt) = w;
        let (cols, bl) = (xq.cols, xq.blocks);
        let (ul, groups, units) = (unit_len(gs), cols / gs, bounds[PRODUCT_CHUNKS]);
        let (wb, sb) = (cols / 2, groups * dt.size());
        scratch.codes.resize(bl * 16 * 4 * ROW_LANES, 0);
        scratch.ts.resize(units.next_multiple_of(16) * ROW_LANES, 0.0);
        scratch.tb.resize(units.next_multiple_of(16) * ROW_LANES, 0.0);
        scratch.su.resize(units.next_multiple_of(16), 0.0);
        scratch.bu.resize(units.next_multiple_of(16), 0.0);
        let Scratch { codes, ts, tb, su, bu, .. } = scratch;
        // Byte offsets of the sixteen quads of a block in its tile part, and of sixteen
        // consecutive units in the scale tiles (one row's lane).
        let step = _mm512_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960);
        let mask = _mm256_set1_epi8(15);
        let mut n = n0;
        while n < n0 + count {
            let live = (n0 + count - n).min(ROW_LANES);
            // Lanes past `live` repeat the last row: computed, never stored.
            for r in 0..ROW_LANES {
                let row = n + r.min(live - 1);
                let c = &weight[row * wb..(row + 1) * wb];
                for b in 0..bl {
                    // SAFETY: the masked bytes lie inside the row; the scatter inside the tile.
                    unsafe {
                        let k = (c.len() - 32 * b).min(32);
                        let v = _mm256_maskz_loadu_epi8(((1u64 << k) - 1) as u32, c.as_ptr().add(32 * b) as *const i8);
                        let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_and_si256(v, mask)), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                        _mm512_i32scatter_epi32::<1>(codes.as_mut_ptr().add(b * 16 * 4 * ROW_LANES + 4 * r) as *mut _, step, q);
                    }
                }
                let (sr, br) = (&scales[row * sb..(row + 1) * sb], &biases[row * sb..(row + 1) * sb]);
                if dt == FloatType::BF16 && gs == ul {
                    for u0 in (0..units).step_by(16) {
                        // SAFETY: the masked lanes lie inside the row's scales and the buffers.
                        unsafe {
                            let m: __mmask16 = if units - u0 >= 16 { 0xffff } else { (1u16 << (units - u0)) - 1 };
                            let (s, b) = Scales::Bf16(sr, br).load(u0, m);
                            _mm512_mask_storeu_ps(su.as_mut_ptr().add(u0), m, s);
                            _mm512_mask_storeu_ps(bu.as_mut_ptr().add(u0), m, b);
                        }
                    }
                } else {
                    for u in 0..units {
                        su[u] = dt.get(sr, u * ul / gs);
                        bu[u] = dt.get(br, u * ul / gs);
                    }
                }
                for u0 in (0..units).step_by(16) {
                    // SAFETY: the buffers hold whole groups of sixteen units.
                    unsafe {
                        let at = u0 * ROW_LANES + r;
                        _mm512_i32scatter_ps::<1>(ts.as_mut_ptr().add(at) as *mut _, step, _mm512_loadu_ps(su.as_ptr().add(u0)));
                        _mm512_i32scatter_ps::<1>(tb.as_mut_ptr().add(at) as *mut _, step, _mm512_loadu_ps(bu.as_ptr().add(u0)));
                    }
                }
            }
            let m: __mmask16 = if live == 16 { 0xffff } else { (1u16 << live) - 1 };
            let tl = RowTile { ul, bl, bounds, codes, ts, tb };
            let mut t0 = 0;
            while t0 < xq.rows {
                // SAFETY: the tile's buffers as filled above; the caller's contract on `y`.
                unsafe {
                    let left = xq.rows - t0;
                    let k = if left >= 8 {
                        tl.store(&tl.tokens::<8>(xq, t0), y, ldy, n, t0, m)
                    } else if left >= 4 {
                        tl.store(&tl.tokens::<4>(xq, t0), y, ldy, n, t0, m)
                    } else if left >= 2 {
                        tl.store(&tl.tokens::<2>(xq, t0), y, ldy, n, t0, m)
                    } else {
                        tl.store(&tl.tokens::<1>(xq, t0), y, ldy, n, t0, m)
                    };
                    t0 += k;
                }
            }
            n += live;
        }
    }

    /// One tile of [`matmul_rows`]: its codes `[block][quad][row][4]`, scales and biases
    /// `[unit][row]`.
    struct RowTile<'a> {
        ul: usize,
        bl: usize,
        bounds: &'a [usize; PRODUCT_CHUNKS + 1],
        codes: &'a [u8],
        ts: &'a [f32],
        tb: &'a [f32],
    }

    impl RowTile<'_> {
        /// Writes `TT` input rows' outputs (lanes of `m`) from `t0`; returns `TT`.
        #[inline(always)]
        unsafe fn store<const TT: usize>(&self, v: &[__m512; TT], y: *mut f32, ldy: usize, n: usize, t0: usize, m: __mmask16) -> usize {
            for (t, vt) in v.iter().enumerate() {
                // SAFETY: the caller's contract on `y` (columns n..n+live of these rows).
                unsafe { _mm512_mask_storeu_ps(y.add((t0 + t) * ldy + n), m, *vt) };
            }
            TT
        }

        /// The tile's outputs for input rows `t0..t0+TT`: lane `r` of `result[t]` is weight
        /// row `r` against input row `t0 + t`.
        #[inline(always)]
        unsafe fn tokens<const TT: usize>(&self, xq: &QuantRows, t0: usize) -> [__m512; TT] {
            unsafe {
                let (ul, bl) = (self.ul, self.bl);
                let (dof, sof) = if ul == ACT_BLOCK { (0, bl) } else { (2 * bl, 4 * bl) };
                let rows: [(&[i8], &[f32]); TT] = std::array::from_fn(|t| {
                    let (_, _, p, e) = xq.row(t0 + t);
                    (p, e)
                });
                let mut y = [_mm512_setzero_ps(); TT];
                for c in 0..PRODUCT_CHUNKS {
                    let mut acc_c = [_mm512_setzero_ps(); TT];
                    for u in self.bounds[c]..self.bounds[c + 1] {
                        let e0 = u * ul;
                        let (blk, half) = (e0 / ACT_BLOCK, (e0 / 32) % 2);
                        // The block's evens start here in each plane of its pair; odds 64 on.
                        let base = (blk / 2) * PAIR_BYTES + (blk % 2) * 32;
                        let mut acc = [[_mm512_setzero_si512(); 3]; TT];
                        let wq = self.codes.as_ptr().add(blk * 16 * 4 * ROW_LANES);
                        // A unit of 64 is quads 0..16; one of 32 its evens, quads 4h..4h+4,
                        // and its odds 8 further. (A loop, not a closure: a closure may be
                        // compiled apart from this function's target features.)
                        let nk = if ul == ACT_BLOCK { 16 } else { 8 };
                        for i in 0..nk {
                            let k = if ul == ACT_BLOCK { i } else { 4 * half + i / 2 + 8 * (i % 2) };
                            let wv = _mm512_loadu_si512(wq.add(k * 4 * ROW_LANES) as *const _);
                            let off = base + (k / 8) * ACT_BLOCK + (k % 8) * 4;
                            for (t, at) in acc.iter_mut().enumerate() {
                                let x = rows[t].0.as_ptr().add(off);
                                for (p, a) in at.iter_mut().enumerate() {
                                    let xv = _mm512_set1_epi32((x.add(p * 2 * ACT_BLOCK) as *const i32).read_unaligned());
                                    *a = _mm512_dpbusd_epi32(*a, wv, xv);
                                }
                            }
                        }
                        let (s, b) = (_mm512_loadu_ps(self.ts.as_ptr().add(u * ROW_LANES)), _mm512_loadu_ps(self.tb.as_ptr().add(u * ROW_LANES)));
                        for t in 0..TT {
                            let [a0, a1, a2] = acc[t];
                            let i = _mm512_add_epi32(_mm512_add_epi32(a0, _mm512_slli_epi32(a1, 8)), _mm512_slli_epi32(a2, 16));
                            let ev = rows[t].1;
                            let sd = _mm512_mul_ps(s, _mm512_set1_ps(ev[dof + u]));
                            let v = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(i), _mm512_mul_ps(b, _mm512_set1_ps(ev[sof + u])));
                            acc_c[t] = _mm512_add_ps(acc_c[t], v);
                        }
                    }
                    for t in 0..TT {
                        y[t] = _mm512_add_ps(y[t], acc_c[t]);
                    }
                }
                y
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::tests::Rng;
    use crate::checkpoint::Bytes;
    use crate::numerics::dot_affine_int;

    fn affine(rows: usize, cols: usize, bits: u32, gs: usize, dt: FloatType, rng: &mut Rng) -> Matrix {
        let weight = rng.bytes(rows * cols * bits as usize / 8);
        let groups = rows * cols / gs;
        let enc = |v: f32| -> Vec<u8> {
            match dt {
                FloatType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                FloatType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                FloatType::F32 => v.to_le_bytes().to_vec(),
            }
        };
        let sc: Vec<u8> = (0..groups).flat_map(|_| enc(0.01 + 0.02 * rng.f().abs())).collect();
        let bi: Vec<u8> = (0..groups).flat_map(|_| enc(-0.1 * rng.f())).collect();
        Matrix {
            name: "w".into(),
            rows,
            cols,
            data: MatrixData::Affine { bits, group_size: gs, weight: Bytes::from_vec(weight), scales: Bytes::from_vec(sc), biases: Bytes::from_vec(bi), scale_dtype: dt },
        }
    }

    fn reference(w: &Matrix, x: &[f32], n: usize) -> f32 {
        let MatrixData::Affine { bits, group_size, weight, scales, biases, scale_dtype } = &w.data else { unreachable!() };
        let (bits, wb, sb) = (*bits as usize, w.cols * *bits as usize / 8, w.cols / group_size * scale_dtype.size());
        let codes = &weight.as_slice()[n * wb..(n + 1) * wb];
        let (sr, br) = (&scales.as_slice()[n * sb..(n + 1) * sb], &biases.as_slice()[n * sb..(n + 1) * sb]);
        let code = |k: usize| if bits == 4 { ((codes[k / 2] >> (4 * (k % 2))) & 15) as u32 } else { codes[k] as u32 };
        dot_affine_int(*group_size, x, code, |g| scale_dtype.get(sr, g), |g| scale_dtype.get(br, g))
    }

    /// Inputs with an outlier, a tiny value beside ordinary ones, a zero block, a NaN block
    /// (when `nan`), and the extremes of the activation planes (±max|x| in every element of a
    /// block, so `xi = ±2 080 768` and each unit's `I` nears its bound).
    fn inputs(tokens: usize, cols: usize, nan: bool, rng: &mut Rng) -> Vec<f32> {
        let mut x: Vec<f32> = (0..tokens * cols).map(|_| rng.f() * 3.0).collect();
        x[5] = 900.0;
        if tokens > 1 {
            x[cols + 1] = -1e-30;
        }
        if tokens > 2 && cols >= 128 {
            x[2 * cols + 64..2 * cols + 128].fill(0.0);
        }
        if tokens > 3 {
            // Every code times the largest |xi| (a code of 15 in every element gives I at its
            // bound; random codes come near).
            x[3 * cols..3 * cols + 64].fill(-7.5);
        }
        if nan && tokens > 4 {
            x[4 * cols + 3] = f32::NAN;
        }
        x
    }

    /// Every instruction set, layout, group size, scale type and a final half block give the
    /// scalar reference's bits, with outliers, zero and NaN blocks and huge dynamic range in
    /// the input; input row counts below and above [`ROW_LANES_MIN_ROWS`] (both VNNI kernels),
    /// weight rows below and above a tile of sixteen (the tails).
    #[test]
    fn every_isa_gives_the_reference_bits() {
        let mut rng = Rng(7);
        let shapes: &[(u32, usize, usize)] = &[
            (4, 64, 256),
            (4, 32, 224),
            (4, 128, 384),
            (8, 64, 192),
            (8, 32, 96),
            (8, 128, 256),
            (8, 32, 1056),
            (8, 64, 1088),
            (4, 64, 64),
            (4, 32, 32),
            (4, 64, 192),
            (4, 64, 1088),
            (4, 32, 1056),
        ];
        for &(bits, gs, cols) in shapes {
            for (dt, rows, tokens) in [
                (FloatType::BF16, 5, 3),
                (FloatType::BF16, 13, 19),
                (FloatType::F16, 9, 8),
                (FloatType::F32, 3, 1),
                (FloatType::BF16, 37, 36),
                (FloatType::BF16, 21, 1),
                (FloatType::F16, 18, 5),
            ] {
                let w = affine(rows, cols, bits, gs, dt, &mut rng);
                let x = inputs(tokens, cols, true, &mut rng);
                let layout = Layout::of(&w).unwrap();
                let want: Vec<u32> = (0..tokens * rows).map(|i| reference(&w, &x[(i / rows) * cols..(i / rows + 1) * cols], i % rows).to_bits()).collect();
                for isa in Isa::available() {
                    let mut xq = QuantRows::default();
                    xq.shape(isa, tokens, cols, layout);
                    let base = xq.base();
                    // Two fills of disjoint rows, as the threads do.
                    unsafe { xq.fill_rows(base, &x, 0, tokens / 2) };
                    unsafe { xq.fill_rows(base, &x, tokens / 2, tokens) };
                    let mut y = vec![f32::NAN; tokens * rows];
                    let mut scratch = Scratch::default();
                    // Two calls over a split of the rows, as the pool's tasks.
                    let split = rows / 2;
                    unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, 0, split, &mut scratch) };
                    unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, split, rows - split, &mut scratch) };
                    for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
                        assert_eq!(got.to_bits(), want, "{isa:?} bits {bits} gs {gs} cols {cols} {dt:?} t {} n {}", i / rows, i % rows);
                    }
                }
            }
        }
    }

    /// The edges of the tiled kernels (AVX2: sixteen weight rows, two input rows a pass;
    /// VNNI: sixteen rows, up to eight input rows a pass) and of the one-row kernels (eight or
    /// sixteen units a step): weight row counts around 8, 16 and 32, input row counts on
    /// both sides of each kernel's threshold and of a pass, tasks starting inside a tile,
    /// every group size and scale type, odd block counts, final half blocks and unit counts
    /// that leave one unit past a step.
    #[test]
    fn tile_edges_give_the_reference_bits() {
        let mut rng = Rng(23);
        for &(bits, gs, cols) in &[
            (4, 32usize, 224usize),
            (4, 64, 192),
            (4, 128, 384),
            (4, 64, 1088),
            (4, 32, 1056),
            (4, 128, 128),
            (8, 32, 224),
            (8, 64, 192),
            (8, 128, 384),
            (8, 32, 1056),
            (8, 128, 128),
        ] {
            for dt in [FloatType::BF16, FloatType::F16, FloatType::F32] {
                for rows in [1usize, 2, 7, 9, 16, 17, 33] {
                    let w = affine(rows, cols, bits, gs, dt, &mut rng);
                    for tokens in [1usize, 2, 3, 4, 7, 9, 17] {
                        let x = inputs(tokens, cols, true, &mut rng);
                        let want: Vec<u32> = (0..tokens * rows).map(|i| reference(&w, &x[(i / rows) * cols..(i / rows + 1) * cols], i % rows).to_bits()).collect();
                        for isa in Isa::available() {
                            let mut xq = QuantRows::default();
                            xq.shape(isa, tokens, cols, Layout::of(&w).unwrap());
                            let base = xq.base();
                            unsafe { xq.fill_rows(base, &x, 0, tokens) };
                            // Tasks split at a third of the rows (inside a tile), reusing one scratch.
                            let mut y = vec![f32::NAN; tokens * rows];
                            let mut scratch = Scratch::default();
                            let split = rows / 3;
                            unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, 0, split, &mut scratch) };
                            unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, split, rows - split, &mut scratch) };
                            for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
                                assert_eq!(got.to_bits(), want, "{isa:?} bits {bits} gs {gs} cols {cols} {dt:?} rows {rows} tokens {tokens}: t {} n {}", i / rows, i % rows);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Units at the bound of AVX2's 16-bit sums: codes of 15 against `xi = -32 896` (planes
    /// -128, -128, 0) in all but one element per block, so eight quads of a plane add to
    /// 8·2·15·(-128) = -30 720 before widening; every group size, one input row and many.
    #[test]
    fn units_at_the_16_bit_bound_keep_their_bits() {
        // d = 2032 / 2 080 768 = 2^-10 exactly, so the others give xi = -32.125 · 2^10.
        for gs in [32, 64, 128] {
            let (rows, cols) = (17, 256);
            let mut w = affine(rows, cols, 4, gs, FloatType::BF16, &mut Rng(5));
            if let MatrixData::Affine { weight, .. } = &mut w.data {
                *weight = Bytes::from_vec(vec![0xff; rows * cols / 2]);
            }
            for tokens in [1, 2, 3, 17] {
                let x: Vec<f32> = (0..tokens * cols).map(|i| if i % 64 == 7 { 2032.0 } else { -32.125 }).collect();
                let mut q = QuantRows::default();
                q.shape(Isa::Portable, tokens, cols, Layout::Nibbles);
                let base = q.base();
                unsafe { q.fill_rows(base, &x, 0, tokens) };
                assert_eq!((q.d[0], q.sums[0]), (2f32.powi(-10), 2_080_768 - 31 * 32_896), "the input is not at the bound");
                for isa in Isa::available() {
                    let mut xq = QuantRows::default();
                    xq.shape(isa, tokens, cols, Layout::Nibbles);
                    let base = xq.base();
                    unsafe { xq.fill_rows(base, &x, 0, tokens) };
                    let mut y = vec![f32::NAN; tokens * rows];
                    unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, 0, rows, &mut Scratch::default()) };
                    for t in 0..tokens {
                        for n in 0..rows {
                            let want = reference(&w, &x[t * cols..(t + 1) * cols], n);
                            assert_eq!(y[t * rows + n].to_bits(), want.to_bits(), "{isa:?} gs {gs} tokens {tokens} t {t} n {n}");
                        }
                    }
                }
            }
        }
    }

    /// Units at the bounds of AVX2's 8-bit tiles: codes of 255 against `xi = -32 768` (digits
    /// `L = -32 768`, `H = 0`: |Σ q·L| at its bound, 64·255·2^15) or `xi = -32 896` (`L =
    /// 32 640`, `H = -1`, the borrow of the low digit) in all but one element per block, whose
    /// `xi = 2 080 768` has `H = 32`; every group size and scale type, one input row and many.
    #[test]
    fn eight_bit_units_at_the_digit_bounds_keep_their_bits() {
        for other in [-32.0f32, -32.125] {
            for gs in [32, 64, 128] {
                for dt in [FloatType::BF16, FloatType::F16, FloatType::F32] {
                    let (rows, cols) = (17, 256);
                    let mut w = affine(rows, cols, 8, gs, dt, &mut Rng(5));
                    if let MatrixData::Affine { weight, .. } = &mut w.data {
                        *weight = Bytes::from_vec(vec![0xff; rows * cols]);
                    }
                    for tokens in [1, 2, 3, 17] {
                        let x: Vec<f32> = (0..tokens * cols).map(|i| if i % 64 == 7 { 2032.0 } else { other }).collect();
                        let mut q = QuantRows::default();
                        q.shape(Isa::Portable, tokens, cols, Layout::Natural);
                        let base = q.base();
                        unsafe { q.fill_rows(base, &x, 0, tokens) };
                        assert_eq!(q.d[0], 2f32.powi(-10), "the input is not at the bound");
                        assert_eq!((q.low[0], q.high[0]), (((other * 1024.0) as i32) as i16, if other == -32.0 { 0 } else { -1 }));
                        for isa in Isa::available() {
                            let mut xq = QuantRows::default();
                            xq.shape(isa, tokens, cols, Layout::Natural);
                            let base = xq.base();
                            unsafe { xq.fill_rows(base, &x, 0, tokens) };
                            let mut y = vec![f32::NAN; tokens * rows];
                            unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, 0, rows, &mut Scratch::default()) };
                            for t in 0..tokens {
                                for n in 0..rows {
                                    let want = reference(&w, &x[t * cols..(t + 1) * cols], n);
                                    assert_eq!(y[t * rows + n].to_bits(), want.to_bits(), "{isa:?} {other} gs {gs} {dt:?} tokens {tokens} t {t} n {n}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// A unit at the bound of its integer: codes of 15 against `xi = ±2 080 768` everywhere
    /// (|I| = 64·15·2 080 768, just under 2^31), one input row and many, against the reference.
    #[test]
    fn units_at_the_integer_bound_keep_their_bits() {
        for bits in [4, 8] {
            for tokens in [1, 2, 3, 17] {
                at_the_bound(bits, tokens);
            }
        }
    }

    /// Codes at their largest (15 or 255) against `xi = ±2 080 768`: for 8-bit codes |I| =
    /// 64·255·2 080 768 ≈ 2^35, past i32 and f32's exact integers.
    fn at_the_bound(bits: u32, tokens: usize) {
        let (rows, cols) = (9, 256);
        let mut w = affine(rows, cols, bits, 64, FloatType::BF16, &mut Rng(3));
        if let MatrixData::Affine { weight, .. } = &mut w.data {
            *weight = Bytes::from_vec(vec![0xff; rows * cols * bits as usize / 8]);
        }
        let x: Vec<f32> = (0..tokens * cols).map(|i| if (i / 64) % 2 == 0 { 2.5 } else { -1.25 }).collect();
        for isa in Isa::available() {
            let mut xq = QuantRows::default();
            xq.shape(isa, tokens, cols, Layout::of(&w).unwrap());
            let base = xq.base();
            unsafe { xq.fill_rows(base, &x, 0, tokens) };
            let mut y = vec![f32::NAN; tokens * rows];
            unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, 0, rows, &mut Scratch::default()) };
            for t in 0..tokens {
                for n in 0..rows {
                    let want = reference(&w, &x[t * cols..(t + 1) * cols], n);
                    assert_eq!(y[t * rows + n].to_bits(), want.to_bits(), "{isa:?} bits {bits} t {t} n {n}");
                }
            }
        }
    }

    /// Every instruction set quantizes to the same bytes, in both layouts, with half blocks,
    /// odd block counts, zero, NaN and infinite blocks, tiny and subnormal values.
    #[test]
    fn every_isa_quantizes_to_the_same_bytes() {
        let mut rng = Rng(11);
        for &cols in &[32usize, 64, 96, 192, 224, 1056] {
            let tokens = 21;
            let mut x = inputs(tokens, cols, true, &mut rng);
            x[6 * cols + 2] = f32::INFINITY;
            x[7 * cols + 9] = 3e-39; // subnormal
            for layout in [Layout::Nibbles, Layout::Natural] {
                let fill = |isa: Isa| {
                    let mut xq = QuantRows::default();
                    xq.shape(isa, tokens, cols, layout);
                    // Stale bytes from an earlier use must not show.
                    xq.planes.fill(0x55);
                    let base = xq.base();
                    unsafe { xq.fill_rows(base, &x, 0, tokens) };
                    xq
                };
                let want = fill(Isa::Portable);
                for isa in Isa::available() {
                    let got = fill(isa);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got.d), bits(&want.d), "{isa:?} {layout:?} cols {cols}: scales");
                    assert_eq!(got.sums, want.sums, "{isa:?} {layout:?} cols {cols}: sums");
                    assert_eq!(bits(&got.ev), bits(&want.ev), "{isa:?} {layout:?} cols {cols}: factors");
                    assert_eq!(got.planes, want.planes, "{isa:?} {layout:?} cols {cols}: planes");
                    assert_eq!((&got.low, &got.high), (&want.low, &want.high), "{isa:?} {layout:?} cols {cols}: digits");
                }
            }
        }
    }
}
