//! Integer-exact products of affine (MLX-quantized) weights on the CPU (docs/numerics.md §2.2).
//!
//! The input rows are quantized once per product ([`QuantRows`]): per block of 64 elements a
//! scale `d` and exact integers `xi`, stored as three int8 planes, plus the exact sum of `xi`
//! per 32 elements. A weight row's unit (the part of a block inside one weight group) then
//! gives `I = Σ q·xi` exactly, in any order: AVX2 multiplies unsigned 4-bit codes by the
//! signed planes with `vpmaddubsw` (a pair of products cannot saturate) and widens with
//! `vpmaddwd`. The epilogue and fold are [`crate::numerics::unit_value`] and
//! [`crate::numerics::fold_units`], so every instruction set gives the bits of
//! [`crate::numerics::dot_affine_int`].
//!
//! Plane layout. 4-bit codes split into low and high nibbles, which hold the even and odd
//! elements; so for those matrices a block's plane is `[even elements of 0..32 | even of
//! 32..64 | odd of 0..32 | odd of 32..64]` (16 bytes each), matching the nibble vectors of 32
//! code bytes. 8-bit codes keep the natural order. Unused positions (a final block of 32)
//! hold zeros.

use super::simd::Isa;
use crate::model::weights::{Matrix, MatrixData};
use crate::numerics::{act_planes, act_quant, act_scale, fold_units, unit_len, unit_value, ACT_BLOCK};

/// Bytes of one block's three planes.
const BLOCK_BYTES: usize = 3 * ACT_BLOCK;

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
}

/// Input rows `[rows, cols]` quantized for the integer-exact products.
#[derive(Clone, Debug, Default)]
pub struct QuantRows {
    pub layout: Layout,
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row (`ceil(cols / 64)`).
    pub blocks: usize,
    /// `[rows][blocks]` scales.
    d: Vec<f32>,
    /// `[rows][2·blocks]` exact `Σ xi` per 32 elements.
    sums: Vec<i32>,
    /// `[rows][blocks][3][64]` planes.
    planes: Vec<i8>,
}

impl QuantRows {
    /// Sizes the buffers for `rows` rows of `cols` (a multiple of 32) in `layout`.
    pub fn shape(&mut self, rows: usize, cols: usize, layout: Layout) {
        debug_assert!(cols.is_multiple_of(32));
        self.layout = layout;
        self.rows = rows;
        self.cols = cols;
        self.blocks = cols.div_ceil(ACT_BLOCK);
        self.d.resize(rows * self.blocks, 0.0);
        self.sums.resize(rows * 2 * self.blocks, 0);
        self.planes.resize(rows * self.blocks * BLOCK_BYTES, 0);
    }

    /// Quantizes rows `r0..r1` of `x` (`[rows, cols]`) into buffers shaped by [`Self::shape`].
    ///
    /// # Safety
    /// `base` must be [`Self::base`] of this value after `shape`, and no other thread may
    /// write rows `r0..r1` meanwhile (other rows may be filled concurrently).
    pub unsafe fn fill_rows(&self, base: QuantBase, x: &[f32], r0: usize, r1: usize) {
        let (bl, cols) = (self.blocks, self.cols);
        for r in r0..r1 {
            // SAFETY: row r's parts of the three buffers, which only this call writes.
            let (d, sums, planes) = unsafe {
                (
                    std::slice::from_raw_parts_mut(base.d.add(r * bl), bl),
                    std::slice::from_raw_parts_mut(base.sums.add(r * 2 * bl), 2 * bl),
                    std::slice::from_raw_parts_mut(base.planes.add(r * bl * BLOCK_BYTES), bl * BLOCK_BYTES),
                )
            };
            quantize_row(self.layout, &x[r * cols..(r + 1) * cols], d, sums, planes);
        }
    }

    /// Raw pointers for [`Self::fill_rows`] from several threads.
    pub fn base(&mut self) -> QuantBase {
        QuantBase { d: self.d.as_mut_ptr(), sums: self.sums.as_mut_ptr(), planes: self.planes.as_mut_ptr() }
    }

    #[inline]
    fn row(&self, t: usize) -> (&[f32], &[i32], &[i8]) {
        let bl = self.blocks;
        (&self.d[t * bl..(t + 1) * bl], &self.sums[t * 2 * bl..(t + 1) * 2 * bl], &self.planes[t * bl * BLOCK_BYTES..(t + 1) * bl * BLOCK_BYTES])
    }
}

/// Pointers into a [`QuantRows`]' buffers, shared by the threads that fill disjoint rows.
#[derive(Clone, Copy, Debug)]
pub struct QuantBase {
    d: *mut f32,
    sums: *mut i32,
    planes: *mut i8,
}
// SAFETY: only handed to `fill_rows`, whose callers write disjoint rows.
unsafe impl Send for QuantBase {}
// SAFETY: as above.
unsafe impl Sync for QuantBase {}

/// One row: per block its scale, the exact sums of its halves, and its planes.
fn quantize_row(layout: Layout, x: &[f32], d: &mut [f32], sums: &mut [i32], planes: &mut [i8]) {
    for (b, blk) in x.chunks(ACT_BLOCK).enumerate() {
        let db = act_scale(blk);
        d[b] = db;
        let pl = &mut planes[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
        pl.fill(0);
        let (mut s0, mut s1) = (0i32, 0i32);
        for (e, &v) in blk.iter().enumerate() {
            let xi = act_quant(v, db);
            if e < 32 {
                s0 += xi;
            } else {
                s1 += xi;
            }
            let p = act_planes(xi);
            let at = layout.pos(e);
            for (k, &pk) in p.iter().enumerate() {
                pl[k * ACT_BLOCK + at] = pk;
            }
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
    let Scratch { s, b, ints } = scratch;
    for n in n0..n0 + count {
        let codes = &weight.as_slice()[n * wb..(n + 1) * wb];
        let (sr, br) = (&scales.as_slice()[n * sb..(n + 1) * sb], &biases.as_slice()[n * sb..(n + 1) * sb]);
        for g in 0..groups {
            s[g] = scale_dtype.get(sr, g);
            b[g] = scale_dtype.get(br, g);
        }
        for t in 0..xq.rows {
            let (d, sums, planes) = xq.row(t);
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

/// Per-call buffers of [`matmul`]: a row's scales and biases and its unit integers.
#[derive(Debug, Default)]
pub struct Scratch {
    s: Vec<f32>,
    b: Vec<f32>,
    ints: Vec<i64>,
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

/// `ints[u] = Σ q·xi` over every unit of one weight row against one quantized input row.
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
            let pl = &planes[blk * BLOCK_BYTES..];
            let at = layout.pos(e);
            let xi = pl[at] as i64 + 256 * pl[ACT_BLOCK + at] as i64 + 65536 * pl[2 * ACT_BLOCK + at] as i64;
            acc += q * xi;
        }
        *out = acc;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{ACT_BLOCK, BLOCK_BYTES};
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
                let pl = &planes[blk * BLOCK_BYTES..];
                let mut m = [_mm256_setzero_si256(); 3];
                for (p, mp) in m.iter_mut().enumerate() {
                    let even = _mm256_maddubs_epi16(lo, plane(pl, p * ACT_BLOCK));
                    let odd = _mm256_maddubs_epi16(hi, plane(pl, p * ACT_BLOCK + 32));
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
                let pl = &planes[(h / 2) * BLOCK_BYTES + (h % 2) * 32..];
                let mut i = 0i64;
                for p in 0..3 {
                    let x = plane(pl, p * ACT_BLOCK);
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::tests::Rng;
    use crate::checkpoint::Bytes;
    use crate::model::weights::FloatType;
    use crate::numerics::dot_affine_int;

    fn affine(rows: usize, cols: usize, bits: u32, gs: usize, rng: &mut Rng) -> Matrix {
        let weight = rng.bytes(rows * cols * bits as usize / 8);
        let groups = rows * cols / gs;
        let sc: Vec<u8> = (0..groups).flat_map(|_| half::bf16::from_f32(0.01 + 0.02 * rng.f().abs()).to_le_bytes()).collect();
        let bi: Vec<u8> = (0..groups).flat_map(|_| half::bf16::from_f32(-0.1 * rng.f()).to_le_bytes()).collect();
        Matrix {
            name: "w".into(),
            rows,
            cols,
            data: MatrixData::Affine {
                bits,
                group_size: gs,
                weight: Bytes::from_vec(weight),
                scales: Bytes::from_vec(sc),
                biases: Bytes::from_vec(bi),
                scale_dtype: FloatType::BF16,
            },
        }
    }

    fn reference(w: &Matrix, x: &[f32], n: usize) -> f32 {
        let MatrixData::Affine { bits, group_size, weight, scales, biases, scale_dtype } = &w.data else { unreachable!() };
        let (bits, wb, sb) = (*bits as usize, w.cols * *bits as usize / 8, w.cols / group_size * 2);
        let codes = &weight.as_slice()[n * wb..(n + 1) * wb];
        let (sr, br) = (&scales.as_slice()[n * sb..(n + 1) * sb], &biases.as_slice()[n * sb..(n + 1) * sb]);
        let code = |k: usize| if bits == 4 { ((codes[k / 2] >> (4 * (k % 2))) & 15) as u32 } else { codes[k] as u32 };
        dot_affine_int(*group_size, x, code, |g| scale_dtype.get(sr, g), |g| scale_dtype.get(br, g))
    }

    /// Every instruction set, layout, group size and a final half block give the scalar
    /// reference's bits, with outliers, zero blocks and huge dynamic range in the input.
    #[test]
    fn every_isa_gives_the_reference_bits() {
        let mut rng = Rng(7);
        for &(bits, gs, cols) in &[(4u32, 64usize, 256usize), (4, 32, 224), (4, 128, 384), (8, 64, 192), (8, 32, 96), (8, 128, 256), (4, 64, 64), (4, 32, 32)] {
            let rows = 5;
            let w = affine(rows, cols, bits, gs, &mut rng);
            let tokens = 3;
            let mut x: Vec<f32> = (0..tokens * cols).map(|_| rng.f() * 3.0).collect();
            x[5] = 900.0; // an outlier
            x[cols + 1] = -1e-30; // a tiny value beside ordinary ones
            if cols >= 128 {
                for v in &mut x[2 * cols + 64..2 * cols + 128] {
                    *v = 0.0; // a zero block
                }
            }
            for isa in Isa::available() {
                let mut xq = QuantRows::default();
                xq.shape(tokens, cols, Layout::of(&w).unwrap());
                let base = xq.base();
                unsafe { xq.fill_rows(base, &x, 0, tokens) };
                let mut y = vec![f32::NAN; tokens * rows];
                unsafe { matmul(isa, &w, &xq, y.as_mut_ptr(), rows, 0, rows, &mut Scratch::default()) };
                for t in 0..tokens {
                    for n in 0..rows {
                        let want = reference(&w, &x[t * cols..(t + 1) * cols], n);
                        assert_eq!(y[t * rows + n].to_bits(), want.to_bits(), "{isa:?} bits {bits} gs {gs} cols {cols} t {t} n {n}");
                    }
                }
            }
        }
    }
}
