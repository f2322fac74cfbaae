//! Fast CPU paths of the canonical matrix product, chosen at run time (AVX-512, AVX2+FMA, or
//! the portable loop), all giving the bits of [`super::kernels::dot_decoded`].
//!
//! The canonical order (docs/numerics.md §2) gives lane `j mod 32` every stored 32-bit word
//! `j` of a weight row, `E` elements per word. Here the 32 lanes are two 16-lane halves (one
//! zmm register each, or two ymm), so a lane's elements are consecutive steps of one vector
//! lane: the input row is transposed once per product into that order (`xT[c][e][lane]` =
//! `x[(32c + lane)·E + e]`), and a block of weight rows is decoded into the same order (a
//! "panel") once and reused for every token. The final fold of the 32 lanes is the halving
//! tree, done with register halves.
//!
//! Lanes past the end of a row (when the row has fewer than a multiple of 32 words) are
//! untouched by masked FMAs, exactly as the reference never adds to them.

use crate::model::weights::{FloatType, Matrix, MatrixData};

/// An instruction set the CPU kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 + FMA (x86-64-v3).
    Avx2,
    /// AVX-512 F/BW/VL.
    Avx512,
}

impl Isa {
    /// Instruction sets this CPU supports, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                v.push(Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    /// The fastest available, unless `TENSORFOLD_CPU_ISA` (`portable`, `avx2`, `avx512`) asks
    /// for a slower one.
    pub fn detect() -> Isa {
        let avail = Self::available();
        let best = *avail.last().unwrap();
        match std::env::var("TENSORFOLD_CPU_ISA").ok().as_deref() {
            Some("portable") => Isa::Portable,
            Some("avx2") if avail.contains(&Isa::Avx2) => Isa::Avx2,
            Some("avx512") if avail.contains(&Isa::Avx512) => Isa::Avx512,
            _ => best,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// The input rows of a product in lane order, shared by every output row.
pub struct Transposed {
    /// Elements per word of the weights this was made for.
    pub per_word: usize,
    /// Words per row (`cols / per_word`).
    pub words: usize,
    /// 32-word chunks per row (the last may be partial).
    pub chunks: usize,
    pub rows: usize,
    /// `[rows][chunks][per_word][32]`; lanes past the last word are 0.
    pub data: Vec<f32>,
}

impl Transposed {
    /// Transposes `rows` rows of `x` (`[rows, cols]`) for weights with `per_word` elements per word.
    pub fn new(x: &[f32], rows: usize, cols: usize, per_word: usize) -> Self {
        let words = cols / per_word;
        let chunks = words.div_ceil(32);
        let stride = chunks * per_word * 32;
        let mut data = vec![0.0f32; rows * stride];
        for t in 0..rows {
            let xr = &x[t * cols..(t + 1) * cols];
            let dst = &mut data[t * stride..(t + 1) * stride];
            for j in 0..words {
                let (c, lane) = (j / 32, j % 32);
                for e in 0..per_word {
                    dst[(c * per_word + e) * 32 + lane] = xr[j * per_word + e];
                }
            }
        }
        Self { per_word, words, chunks, rows, data }
    }

    fn row(&self, t: usize) -> &[f32] {
        let stride = self.chunks * self.per_word * 32;
        &self.data[t * stride..(t + 1) * stride]
    }
}

/// `y[t][n] = W[n] · x[t]` for `n in n0 .. n0 + count`, `t < xt.rows`, with the given ISA.
/// `y` points at a `[rows, ldy]` buffer. Every ISA gives the bits of the portable reference.
///
/// # Safety
/// `y` must be valid for writes of `xt.rows · ldy` floats, `n0 + count ≤ min(ldy, w.rows)`, and
/// no other thread may access elements `(t, n0..n0+count)` meanwhile (other columns may be
/// written concurrently: that is how the pool splits a product).
pub unsafe fn matmul(isa: Isa, w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize) {
    debug_assert_eq!(xt.per_word, w.elems_per_word());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only produced when the CPU reports these features.
        Isa::Avx512 => unsafe { x86::matmul_avx512(w, xt, y, ldy, n0, count) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above for AVX2, FMA and F16C.
        Isa::Avx2 => unsafe { x86::matmul_avx2(w, xt, y, ldy, n0, count) },
        _ => matmul_portable(w, xt, y, ldy, n0, count),
    }
}

/// Canonical dot of two f32 vectors (numerics §2 with one element per word).
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA was detected; lengths are equal and a multiple of 32.
        Isa::Avx512 if a.len() % 32 == 0 => unsafe { x86::dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 if a.len() % 32 == 0 => unsafe { x86::dot_avx2(a, b) },
        _ => crate::numerics::dot_f32(a, b),
    }
}

/// The delta rule of one value head (numerics §4 step 4): `s` is its `[dv, dk]` state (row `j`
/// is `S[:, j]`), `k`/`q` the normalised key and query (`dk`), `v` the values (`dv`); writes
/// `o` (`dv`). The bits of [`super::kernels::gdn_rows_ref`] on every ISA.
#[allow(clippy::too_many_arguments)]
pub fn gdn_rows(isa: Isa, s: &mut [f32], k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
    let dk = k.len();
    debug_assert_eq!(s.len(), dk * o.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA was detected; dk is a multiple of 32, `s` holds dv rows of dk.
        Isa::Avx512 if dk % 32 == 0 => unsafe { x86::gdn_avx512(s, dk, k, q, alpha, beta, v, o) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 if dk % 32 == 0 => unsafe { x86::gdn_avx2(s, dk, k, q, alpha, beta, v, o) },
        _ => super::kernels::gdn_rows_ref(s, k, q, alpha, beta, v, o),
    }
}

/// Attention of one query head at position `p` (numerics §6); the bits of
/// [`super::kernels::attend`] on every ISA. `scores` and `tile_o` are scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend(isa: Isa, q: &[f32], keys: &[f32], values: &[f32], p: usize, stride: usize, head_off: usize, scores: &mut Vec<f32>, tile_o: &mut Vec<f32>, out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA was detected; head_dim is a multiple of 32 and the cache holds p + 1 rows.
        Isa::Avx512 if q.len() % 32 == 0 => unsafe { x86::attend_avx512(q, keys, values, p, stride, head_off, scores, tile_o, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 if q.len() % 32 == 0 => unsafe { x86::attend_avx2(q, keys, values, p, stride, head_off, scores, tile_o, out) },
        _ => super::kernels::attend(q, keys, values, p, stride, head_off, scores, out),
    }
}

/// Decodes row `n` of `w` into lane order: `panel[(c·E + e)·32 + lane]` = weight element
/// `(32c + lane)·E + e` (0 past the last word).
pub fn decode_panel_row(w: &Matrix, n: usize, panel: &mut [f32]) {
    let per_word = w.elems_per_word();
    let mut row = vec![0.0f32; w.cols];
    w.decode_row(n, &mut row);
    panel.fill(0.0);
    for j in 0..w.cols / per_word {
        let (c, lane) = (j / 32, j % 32);
        for e in 0..per_word {
            panel[(c * per_word + e) * 32 + lane] = row[j * per_word + e];
        }
    }
}

/// The reference loop over the transposed layout (the same arithmetic as
/// [`super::kernels::dot_decoded`], in the layout the SIMD paths use).
unsafe fn matmul_portable(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize) {
    let e_n = xt.per_word;
    let mut panel = vec![0.0f32; xt.chunks * e_n * 32];
    for n in n0..n0 + count {
        decode_panel_row(w, n, &mut panel);
        for t in 0..xt.rows {
            let x = xt.row(t);
            let mut p = [0.0f32; 32];
            for c in 0..xt.chunks {
                let lanes = (xt.words - c * 32).min(32);
                for e in 0..e_n {
                    let base = (c * e_n + e) * 32;
                    for (l, acc) in p.iter_mut().enumerate().take(lanes) {
                        *acc = crate::numerics::fma(panel[base + l], x[base + l], *acc);
                    }
                }
            }
            *y.add(t * ldy + n) = crate::numerics::fold_lanes(p);
        }
    }
}

/// Reads 16-bit float `i` of a byte slice as f32 bits-exactly (scales and biases).
#[inline(always)]
fn scale_at(ft: FloatType, b: &[u8], i: usize) -> f32 {
    ft.get(b, i)
}

/// Per-row accessors the SIMD paths share: byte slices of one row's codes, scales, biases.
struct RowBytes<'a> {
    words: &'a [u8],
    scales: &'a [u8],
    biases: &'a [u8],
}

fn row_bytes(w: &Matrix, n: usize) -> RowBytes<'_> {
    match &w.data {
        MatrixData::Float { dtype, data } => {
            let rb = w.cols * dtype.size();
            RowBytes { words: &data.as_slice()[n * rb..(n + 1) * rb], scales: &[], biases: &[] }
        }
        MatrixData::Affine { bits, group_size, weight, scales, biases, scale_dtype } => {
            let wb = w.cols * *bits as usize / 8;
            let sb = w.cols / group_size * scale_dtype.size();
            RowBytes {
                words: &weight.as_slice()[n * wb..(n + 1) * wb],
                scales: &scales.as_slice()[n * sb..(n + 1) * sb],
                biases: &biases.as_slice()[n * sb..(n + 1) * sb],
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The x86-64 paths. One generic kernel, instantiated for a 16-lane vector made of one
    //! zmm (AVX-512) or two ymm (AVX2) registers.

    use super::{row_bytes, scale_at, Transposed};
    use crate::model::weights::{FloatType, Matrix, MatrixData};
    use std::arch::x86_64::*;

    /// 16 f32 lanes and the operations the kernel needs. Every method is `#[inline(always)]`
    /// and only called from functions compiled with the matching target features.
    pub(super) trait V16: Copy {
        unsafe fn zero() -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(self, p: *mut f32);
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
        /// `fma(a, b, c)` in lanes `< n`, `c` elsewhere.
        unsafe fn fma_first(a: Self, b: Self, c: Self, n: usize) -> Self;
        /// 16 u32 words in registers.
        type W: Copy;
        /// 16 words from unaligned bytes (`n` of them; missing ones are 0).
        unsafe fn words(p: *const u8, n: usize) -> Self::W;
        /// `((w >> shift) & mask) as f32` per lane.
        unsafe fn field(w: Self::W, shift: u32, mask: u32) -> Self;
        /// bf16 in the low (`hi == false`) or high half of each word, widened.
        unsafe fn bf16(w: Self::W, hi: bool) -> Self;
        /// f16 in the low or high half of each word, widened.
        unsafe fn f16(w: Self::W, hi: bool) -> Self;
        unsafe fn bits(w: Self::W) -> Self;
        /// `table[idx[l]]` per lane, `idx[l] < 8`, from 8 floats at `table`.
        unsafe fn permute8(table: *const f32, idx: &[u32; 16]) -> Self;
        unsafe fn splat(x: f32) -> Self;
        unsafe fn mul(a: Self, b: Self) -> Self;
        unsafe fn div(a: Self, b: Self) -> Self;
        /// The halving fold of the 32 lanes `a ++ b` (numerics §2).
        unsafe fn fold(a: Self, b: Self) -> f32;
    }

    #[derive(Clone, Copy)]
    pub(super) struct Z(__m512);

    impl V16 for Z {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Z(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Z(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm512_storeu_ps(p, self.0)
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Z(_mm512_fmadd_ps(a.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn fma_first(a: Self, b: Self, c: Self, n: usize) -> Self {
            let m: __mmask16 = if n >= 16 { 0xffff } else { ((1u32 << n) - 1) as __mmask16 };
            Z(_mm512_mask3_fmadd_ps(a.0, b.0, c.0, m))
        }
        type W = __m512i;
        #[inline(always)]
        unsafe fn words(p: *const u8, n: usize) -> __m512i {
            if n >= 16 {
                _mm512_loadu_si512(p as *const _)
            } else {
                _mm512_maskz_loadu_epi32(((1u32 << n) - 1) as __mmask16, p as *const i32)
            }
        }
        #[inline(always)]
        unsafe fn field(v: __m512i, shift: u32, mask: u32) -> Self {
            let q = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(shift as i32)), _mm512_set1_epi32(mask as i32));
            Z(_mm512_cvtepi32_ps(q))
        }
        #[inline(always)]
        unsafe fn bf16(v: __m512i, hi: bool) -> Self {
            let r = if hi { _mm512_and_si512(v, _mm512_set1_epi32(0xffff0000u32 as i32)) } else { _mm512_slli_epi32(v, 16) };
            Z(_mm512_castsi512_ps(r))
        }
        #[inline(always)]
        unsafe fn f16(v: __m512i, hi: bool) -> Self {
            let h = if hi { _mm512_srli_epi32(v, 16) } else { _mm512_and_si512(v, _mm512_set1_epi32(0xffff)) };
            Z(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)))
        }
        #[inline(always)]
        unsafe fn bits(v: __m512i) -> Self {
            Z(_mm512_castsi512_ps(v))
        }
        #[inline(always)]
        unsafe fn permute8(table: *const f32, idx: &[u32; 16]) -> Self {
            let t = _mm512_castps256_ps512(_mm256_loadu_ps(table));
            Z(_mm512_permutexvar_ps(_mm512_loadu_si512(idx.as_ptr() as *const _), t))
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Z(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Z(_mm512_mul_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn div(a: Self, b: Self) -> Self {
            Z(_mm512_div_ps(a.0, b.0))
        }
        #[inline(always)]
        unsafe fn fold(a: Self, b: Self) -> f32 {
            let s16 = _mm512_add_ps(a.0, b.0); // p[i] += p[i+16]
            let s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), _mm512_extractf32x8_ps::<1>(s16));
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
            _mm_cvtss_f32(s1)
        }
    }

    #[derive(Clone, Copy)]
    pub(super) struct Y2(__m256, __m256);

    #[inline(always)]
    unsafe fn mask8(n: usize) -> __m256i {
        let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), iota)
    }

    impl V16 for Y2 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Y2(_mm256_setzero_ps(), _mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            Y2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            _mm256_storeu_ps(p, self.0);
            _mm256_storeu_ps(p.add(8), self.1);
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            Y2(_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1))
        }
        #[inline(always)]
        unsafe fn fma_first(a: Self, b: Self, c: Self, n: usize) -> Self {
            let r = Self::fma(a, b, c);
            let m0 = _mm256_castsi256_ps(mask8(n.min(8)));
            let m1 = _mm256_castsi256_ps(mask8(n.saturating_sub(8)));
            Y2(_mm256_blendv_ps(c.0, r.0, m0), _mm256_blendv_ps(c.1, r.1, m1))
        }
        type W = (__m256i, __m256i);
        #[inline(always)]
        unsafe fn words(p: *const u8, n: usize) -> (__m256i, __m256i) {
            if n >= 16 {
                (_mm256_loadu_si256(p as *const _), _mm256_loadu_si256(p.add(32) as *const _))
            } else {
                let mut buf = [0u32; 16];
                std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr() as *mut u8, 4 * n);
                (_mm256_loadu_si256(buf.as_ptr() as *const _), _mm256_loadu_si256(buf.as_ptr().add(8) as *const _))
            }
        }
        #[inline(always)]
        unsafe fn field(w: (__m256i, __m256i), shift: u32, mask: u32) -> Self {
            let s = _mm_cvtsi32_si128(shift as i32);
            let m = _mm256_set1_epi32(mask as i32);
            Y2(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w.0, s), m)), _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w.1, s), m)))
        }
        #[inline(always)]
        unsafe fn bf16(w: (__m256i, __m256i), hi: bool) -> Self {
            let f = |v: __m256i| if hi { _mm256_and_si256(v, _mm256_set1_epi32(0xffff0000u32 as i32)) } else { _mm256_slli_epi32(v, 16) };
            Y2(_mm256_castsi256_ps(f(w.0)), _mm256_castsi256_ps(f(w.1)))
        }
        #[inline(always)]
        unsafe fn f16(w: (__m256i, __m256i), hi: bool) -> Self {
            // Gather the 16-bit halves (values ≤ 0xffff, so the saturating pack is exact), fix the
            // pack's lane order, widen.
            let half = |v: __m256i| if hi { _mm256_srli_epi32(v, 16) } else { _mm256_and_si256(v, _mm256_set1_epi32(0xffff)) };
            let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(half(w.0), half(w.1)));
            Y2(_mm256_cvtph_ps(_mm256_castsi256_si128(p)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(p)))
        }
        #[inline(always)]
        unsafe fn bits(w: (__m256i, __m256i)) -> Self {
            Y2(_mm256_castsi256_ps(w.0), _mm256_castsi256_ps(w.1))
        }
        #[inline(always)]
        unsafe fn permute8(table: *const f32, idx: &[u32; 16]) -> Self {
            let t = _mm256_loadu_ps(table);
            let i0 = _mm256_loadu_si256(idx.as_ptr() as *const _);
            let i1 = _mm256_loadu_si256(idx.as_ptr().add(8) as *const _);
            Y2(_mm256_permutevar8x32_ps(t, i0), _mm256_permutevar8x32_ps(t, i1))
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Y2(_mm256_set1_ps(x), _mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            Y2(_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1))
        }
        #[inline(always)]
        unsafe fn div(a: Self, b: Self) -> Self {
            Y2(_mm256_div_ps(a.0, b.0), _mm256_div_ps(a.1, b.1))
        }
        #[inline(always)]
        unsafe fn fold(a: Self, b: Self) -> f32 {
            // Lanes 0..8 | 8..16 | 16..24 | 24..32 = a.0 | a.1 | b.0 | b.1.
            let s16_lo = _mm256_add_ps(a.0, b.0); // p[i] += p[i+16], i < 8
            let s16_hi = _mm256_add_ps(a.1, b.1); // i in 8..16
            let s8 = _mm256_add_ps(s16_lo, s16_hi); // p[i] += p[i+8]
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
            _mm_cvtss_f32(s1)
        }
    }

    /// One row's scales and biases widened to f32 once (affine only), padded so that 8 values
    /// can be read from any group.
    struct RowScales {
        s: Vec<f32>,
        b: Vec<f32>,
        /// Per half `h`: lane → group offset from the half's first group.
        idx: [[u32; 16]; 2],
    }

    impl RowScales {
        fn new(w: &Matrix) -> Self {
            let (groups, per_word, gs) = match &w.data {
                MatrixData::Affine { bits, group_size, .. } => (w.cols / group_size, (32 / bits) as usize, *group_size),
                _ => (0, 1, 1),
            };
            let mut idx = [[0u32; 16]; 2];
            for (h, ih) in idx.iter_mut().enumerate() {
                let first = 16 * h;
                for (l, v) in ih.iter_mut().enumerate() {
                    *v = (((first + l) * per_word) / gs - (first * per_word) / gs) as u32;
                }
            }
            Self { s: vec![0.0; groups + 8], b: vec![0.0; groups + 8], idx }
        }

        fn load(&mut self, w: &Matrix, rb: &super::RowBytes<'_>) {
            if let MatrixData::Affine { scale_dtype, group_size, .. } = &w.data {
                let n = w.cols / group_size;
                let (s, b) = (&mut self.s[..n], &mut self.b[..n]);
                match scale_dtype {
                    // The common case, without a per-element dtype dispatch.
                    FloatType::BF16 => {
                        for (d, c) in s.iter_mut().zip(rb.scales.chunks_exact(2)) {
                            *d = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                        }
                        for (d, c) in b.iter_mut().zip(rb.biases.chunks_exact(2)) {
                            *d = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                        }
                    }
                    ft => {
                        for g in 0..n {
                            s[g] = scale_at(*ft, rb.scales, g);
                            b[g] = scale_at(*ft, rb.biases, g);
                        }
                    }
                }
            }
        }
    }

    /// Decodes 16 lanes (half `h` of chunk `c`) of a row into `out[e]`, `e < E`.
    #[inline(always)]
    unsafe fn decode16<V: V16>(w: &Matrix, rb: &super::RowBytes<'_>, rs: &RowScales, c: usize, h: usize, lanes: usize, out: &mut [V; 8]) {
        let first_word = c * 32 + h * 16;
        let words = V::words(rb.words.as_ptr().add(first_word * 4), lanes);
        match &w.data {
            MatrixData::Affine { bits, group_size, .. } => {
                let per_word = (32 / bits) as usize;
                let g0 = first_word * per_word / group_size;
                let s = V::permute8(rs.s.as_ptr().add(g0), &rs.idx[h]);
                let b = V::permute8(rs.b.as_ptr().add(g0), &rs.idx[h]);
                let mask = (1u32 << bits) - 1;
                for (e, o) in out.iter_mut().enumerate().take(per_word) {
                    *o = V::fma(s, V::field(words, bits * e as u32, mask), b);
                }
            }
            MatrixData::Float { dtype: FloatType::BF16, .. } => {
                out[0] = V::bf16(words, false);
                out[1] = V::bf16(words, true);
            }
            MatrixData::Float { dtype: FloatType::F16, .. } => {
                out[0] = V::f16(words, false);
                out[1] = V::f16(words, true);
            }
            MatrixData::Float { dtype: FloatType::F32, .. } => {
                out[0] = V::bits(words);
            }
        }
    }

    /// Few tokens (decode): each weight row is decoded in registers and used at once.
    #[inline(always)]
    unsafe fn matvec_generic<V: V16, const MR: usize>(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize) {
        let e_n = xt.per_word;
        let xstride = xt.chunks * e_n * 32;
        let mr = xt.rows;
        debug_assert!(mr <= MR);
        let mut rs = RowScales::new(w);
        let mut dec = [V::zero(); 8];
        for n in n0..n0 + count {
            let rb = row_bytes(w, n);
            rs.load(w, &rb);
            let mut acc = [[V::zero(); 2]; MR];
            for c in 0..xt.chunks {
                let words = (xt.words - c * 32).min(32);
                for h in 0..2 {
                    let lanes = words.saturating_sub(16 * h).min(16);
                    if lanes == 0 {
                        continue;
                    }
                    decode16::<V>(w, &rb, &rs, c, h, lanes, &mut dec);
                    for (e, wv) in dec.iter().enumerate().take(e_n) {
                        let off = (c * e_n + e) * 32 + 16 * h;
                        for (i, a) in acc.iter_mut().enumerate().take(mr) {
                            let xv = V::load(xt.data.as_ptr().add(i * xstride + off));
                            a[h] = if lanes == 16 { V::fma(*wv, xv, a[h]) } else { V::fma_first(*wv, xv, a[h], lanes) };
                        }
                    }
                }
            }
            for (i, a) in acc.iter().enumerate().take(mr) {
                *y.add(i * ldy + n) = V::fold(a[0], a[1]);
            }
        }
    }

    /// The kernel: blocks of `NR` weight rows decoded into a panel once, then `MR` tokens at a
    /// time, each output with a 32-lane accumulator (two `V16`).
    #[inline(always)]
    unsafe fn matmul_generic<V: V16, const MR: usize, const NR: usize>(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize) {
        let e_n = xt.per_word;
        let plen = xt.chunks * e_n * 32;
        if xt.rows <= 4 {
            return matvec_generic::<V, 4>(w, xt, y, ldy, n0, count);
        }
        let mut panel = vec![0.0f32; NR * plen];
        let mut dec = [V::zero(); 8];
        let mut rs = RowScales::new(w);
        let xstride = plen;
        let mut n = n0;
        while n < n0 + count {
            let nr = NR.min(n0 + count - n);
            // Decode the panel of rows n .. n + nr.
            for r in 0..nr {
                let rb = row_bytes(w, n + r);
                rs.load(w, &rb);
                let pr = panel.as_mut_ptr().add(r * plen);
                for c in 0..xt.chunks {
                    let words = (xt.words - c * 32).min(32);
                    for h in 0..2 {
                        let lanes = words.saturating_sub(16 * h).min(16);
                        if lanes == 0 {
                            continue;
                        }
                        decode16::<V>(w, &rb, &rs, c, h, lanes, &mut dec);
                        for (e, d) in dec.iter().enumerate().take(e_n) {
                            d.store(pr.add((c * e_n + e) * 32 + 16 * h));
                        }
                    }
                }
            }
            // Every token against the panel.
            let mut t = 0;
            while t < xt.rows {
                let mr = MR.min(xt.rows - t);
                let mut acc = [[[V::zero(); 2]; NR]; MR];
                for c in 0..xt.chunks {
                    let words = (xt.words - c * 32).min(32);
                    let full = words == 32;
                    for e in 0..e_n {
                        let off = (c * e_n + e) * 32;
                        for h in 0..2 {
                            let lanes = words.saturating_sub(16 * h).min(16);
                            if lanes == 0 {
                                continue;
                            }
                            let mut xv = [V::zero(); MR];
                            for (i, xvi) in xv.iter_mut().enumerate().take(mr) {
                                *xvi = V::load(xt.data.as_ptr().add((t + i) * xstride + off + 16 * h));
                            }
                            for r in 0..nr {
                                let wv = V::load(panel.as_ptr().add(r * plen + off + 16 * h));
                                for i in 0..mr {
                                    acc[i][r][h] = if full { V::fma(wv, xv[i], acc[i][r][h]) } else { V::fma_first(wv, xv[i], acc[i][r][h], lanes) };
                                }
                            }
                        }
                    }
                }
                for i in 0..mr {
                    for r in 0..nr {
                        *y.add((t + i) * ldy + n + r) = V::fold(acc[i][r][0], acc[i][r][1]);
                    }
                }
                t += mr;
            }
            n += nr;
        }
    }

    /// Canonical dot with one element per lane word (`n` a multiple of 32): lane `k mod 32`.
    #[inline(always)]
    unsafe fn dot1<V: V16>(a: *const f32, b: *const f32, n: usize) -> f32 {
        let (mut p0, mut p1) = (V::zero(), V::zero());
        let mut i = 0;
        while i < n {
            p0 = V::fma(V::load(a.add(i)), V::load(b.add(i)), p0);
            p1 = V::fma(V::load(a.add(i + 16)), V::load(b.add(i + 16)), p1);
            i += 32;
        }
        V::fold(p0, p1)
    }

    /// The delta rule of one value head over its `dv` state rows (numerics §4, step 4).
    #[inline(always)]
    unsafe fn gdn_rows<V: V16>(s: &mut [f32], dk: usize, k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
        let av = V::splat(alpha);
        for (j, oj) in o.iter_mut().enumerate() {
            let r = s.as_mut_ptr().add(j * dk);
            let mut i = 0;
            while i < dk {
                V::mul(V::load(r.add(i)), av).store(r.add(i));
                i += 16;
            }
            let mem = dot1::<V>(r, k.as_ptr(), dk);
            let delta = (v[j] - mem) * beta;
            let dv = V::splat(delta);
            let mut i = 0;
            while i < dk {
                V::fma(V::load(k.as_ptr().add(i)), dv, V::load(r.add(i))).store(r.add(i));
                i += 16;
            }
            *oj = dot1::<V>(r, q.as_ptr(), dk);
        }
    }

    /// Attention of one head over positions `0..=p` with the tile order of numerics §6.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn attend<V: V16>(q: &[f32], keys: &[f32], values: &[f32], p: usize, stride: usize, head_off: usize, scores: &mut Vec<f32>, tile_o: &mut Vec<f32>, out: &mut [f32]) {
        use crate::backend::cpu::kernels::ATTENTION_TILE;
        use crate::numerics::exp;
        let dh = q.len();
        let scale = crate::numerics::rsqrt(dh as f32);
        scores.clear();
        for tau in 0..=p {
            scores.push(dot1::<V>(q.as_ptr(), keys.as_ptr().add(tau * stride + head_off), dh) * scale);
        }
        let n_tiles = p / ATTENTION_TILE + 1;
        // Per tile: (m, l) and o[dh].
        tile_o.clear();
        tile_o.resize(n_tiles * (dh + 2), 0.0);
        for t in 0..n_tiles {
            let lo = t * ATTENTION_TILE;
            let hi = ((t + 1) * ATTENTION_TILE).min(p + 1);
            let m = scores[lo..hi].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut l = 0.0f32;
            let o = tile_o.as_mut_ptr().add(t * (dh + 2) + 2);
            for tau in lo..hi {
                let e = exp(scores[tau] - m);
                l += e;
                let ev = V::splat(e);
                let vrow = values.as_ptr().add(tau * stride + head_off);
                let mut d = 0;
                while d < dh {
                    V::fma(ev, V::load(vrow.add(d)), V::load(o.add(d))).store(o.add(d));
                    d += 16;
                }
            }
            tile_o[t * (dh + 2)] = m;
            tile_o[t * (dh + 2) + 1] = l;
        }
        let big_m = (0..n_tiles).map(|t| tile_o[t * (dh + 2)]).fold(f32::NEG_INFINITY, f32::max);
        let mut big_l = 0.0f32;
        out.fill(0.0);
        for t in 0..n_tiles {
            let c = exp(tile_o[t * (dh + 2)] - big_m);
            big_l = crate::numerics::fma(tile_o[t * (dh + 2) + 1], c, big_l);
            let cv = V::splat(c);
            let o = tile_o.as_ptr().add(t * (dh + 2) + 2);
            let mut d = 0;
            while d < dh {
                V::fma(V::load(o.add(d)), cv, V::load(out.as_ptr().add(d))).store(out.as_mut_ptr().add(d));
                d += 16;
            }
        }
        let lv = V::splat(big_l);
        let mut d = 0;
        while d < dh {
            V::div(V::load(out.as_ptr().add(d)), lv).store(out.as_mut_ptr().add(d));
            d += 16;
        }
    }

    macro_rules! instantiate {
        ($feat:literal, $v:ty, $dot:ident, $gdn:ident, $attend:ident) => {
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $dot(a: &[f32], b: &[f32]) -> f32 {
                dot1::<$v>(a.as_ptr(), b.as_ptr(), a.len())
            }
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(super) unsafe fn $gdn(s: &mut [f32], dk: usize, k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
                gdn_rows::<$v>(s, dk, k, q, alpha, beta, v, o)
            }
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(super) unsafe fn $attend(q: &[f32], keys: &[f32], values: &[f32], p: usize, stride: usize, head_off: usize, scores: &mut Vec<f32>, tile_o: &mut Vec<f32>, out: &mut [f32]) {
                attend::<$v>(q, keys, values, p, stride, head_off, scores, tile_o, out)
            }
        };
    }
    instantiate!("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2", Z, dot_avx512, gdn_avx512, attend_avx512);
    instantiate!("avx2,fma,f16c", Y2, dot_avx2, gdn_avx2, attend_avx2);

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")]
    pub(super) unsafe fn matmul_avx512(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize) {
        matmul_generic::<Z, 4, 3>(w, xt, y, ldy, n0, count)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn matmul_avx2(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize) {
        matmul_generic::<Y2, 2, 1>(w, xt, y, ldy, n0, count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::kernels::dot_decoded;
    use crate::checkpoint::Bytes;

    /// A small deterministic generator for test data.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn f(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
        fn floats(&mut self, n: usize, ft: FloatType) -> Vec<u8> {
            let mut out = Vec::new();
            for _ in 0..n {
                let v = self.f() * 0.1;
                match ft {
                    FloatType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                    FloatType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
                    FloatType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
                }
            }
            out
        }
    }

    fn matrices(rng: &mut Rng, rows: usize, cols: usize) -> Vec<Matrix> {
        let mut v = Vec::new();
        for (bits, gs) in [(4u32, 32usize), (4, 64), (4, 128), (8, 32), (8, 64)] {
            if cols % gs != 0 {
                continue;
            }
            let groups = cols / gs;
            // Misaligned views (offset 3) like MLX files.
            let mut wb = vec![0u8; 3];
            wb.extend(rng.bytes(rows * cols * bits as usize / 8));
            let mut sb = vec![0u8; 1];
            sb.extend(rng.floats(rows * groups, FloatType::BF16));
            let bb = rng.floats(rows * groups, FloatType::F16);
            let _ = bb;
            let bb = rng.floats(rows * groups, FloatType::BF16);
            let slice = |mut b: Vec<u8>, skip: usize| {
                b.drain(..skip);
                Bytes::from_vec(b)
            };
            v.push(Matrix {
                name: format!("affine{bits}g{gs}"),
                rows,
                cols,
                data: MatrixData::Affine { bits, group_size: gs, weight: slice(wb, 3), scales: slice(sb, 1), biases: Bytes::from_vec(bb), scale_dtype: FloatType::BF16 },
            });
        }
        for ft in [FloatType::BF16, FloatType::F16, FloatType::F32] {
            v.push(Matrix { name: format!("{ft:?}"), rows, cols, data: MatrixData::Float { dtype: ft, data: Bytes::from_vec(rng.floats(rows * cols, ft)) } });
        }
        v
    }

    #[test]
    fn every_isa_gives_the_reference_bits() {
        let mut rng = Rng(7);
        for &(rows, cols) in &[(7usize, 64usize), (5, 256), (9, 320), (4, 1280), (3, 2048 + 256 + 64)] {
            for w in matrices(&mut rng, rows, cols) {
                for tokens in [1usize, 2, 5, 9] {
                    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.f()).collect();
                    // The reference: decode the row, canonical dot.
                    let mut want = vec![0.0f32; tokens * rows];
                    let mut row = vec![0.0f32; cols];
                    for n in 0..rows {
                        w.decode_row(n, &mut row);
                        for t in 0..tokens {
                            want[t * rows + n] = dot_decoded(w.elems_per_word(), &row, &x[t * cols..(t + 1) * cols]);
                        }
                    }
                    let xt = Transposed::new(&x, tokens, cols, w.elems_per_word());
                    for isa in Isa::available() {
                        let mut got = vec![f32::NAN; tokens * rows];
                        // Two calls over halves of the rows, as the pool splits them.
                        let h = rows / 2;
                        unsafe {
                            matmul(isa, &w, &xt, got.as_mut_ptr(), rows, 0, h);
                            matmul(isa, &w, &xt, got.as_mut_ptr(), rows, h, rows - h);
                        }
                        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{} {isa:?} rows {rows} cols {cols} tokens {tokens}", w.name);
                    }
                }
            }
        }
    }

    #[test]
    fn gdn_rows_and_attention_match_the_reference_on_every_isa() {
        use crate::backend::cpu::kernels::{attend as attend_ref, gdn_rows_ref};
        let mut rng = Rng(11);
        for dk in [64usize, 128] {
            let dv = dk;
            let s0: Vec<f32> = (0..dv * dk).map(|_| rng.f()).collect();
            let k: Vec<f32> = (0..dk).map(|_| rng.f() * 0.1).collect();
            let q: Vec<f32> = (0..dk).map(|_| rng.f() * 0.1).collect();
            let v: Vec<f32> = (0..dv).map(|_| rng.f()).collect();
            let mut want_s = s0.clone();
            let mut want_o = vec![0.0f32; dv];
            gdn_rows_ref(&mut want_s, &k, &q, 0.93, 0.4, &v, &mut want_o);
            for isa in Isa::available() {
                let mut got_s = s0.clone();
                let mut got_o = vec![0.0f32; dv];
                gdn_rows(isa, &mut got_s, &k, &q, 0.93, 0.4, &v, &mut got_o);
                assert!(got_s.iter().zip(&want_s).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} state dk={dk}");
                assert!(got_o.iter().zip(&want_o).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} out dk={dk}");
            }
        }
        // Attention over 1, 255, 256, 700 positions (one to three tiles), GQA offsets.
        for dh in [64usize, 256] {
            let (hkv, stride) = (2usize, 2 * dh);
            let n = 701;
            let keys: Vec<f32> = (0..n * stride).map(|_| rng.f()).collect();
            let values: Vec<f32> = (0..n * stride).map(|_| rng.f()).collect();
            let q: Vec<f32> = (0..dh).map(|_| rng.f() * 3.0).collect();
            for p in [0usize, 254, 255, 256, 700] {
                for g in 0..hkv {
                    let mut want = vec![0.0f32; dh];
                    attend_ref(&q, &keys, &values, p, stride, g * dh, &mut Vec::new(), &mut want);
                    for isa in Isa::available() {
                        let mut got = vec![0.0f32; dh];
                        attend(isa, &q, &keys, &values, p, stride, g * dh, &mut Vec::new(), &mut Vec::new(), &mut got);
                        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} dh={dh} p={p}");
                    }
                }
            }
        }
    }
}
