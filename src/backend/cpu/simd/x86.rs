//! The x86-64 paths: one generic body per kernel, instantiated for AVX-512 (a 16-lane vector is
//! one zmm register) and AVX2 + FMA (two ymm registers), each inside a function compiled with
//! those target features, so scalar `f32::mul_add` in the same bodies is the hardware FMA.
//!
//! Every kernel performs the operations of its scalar twin in `kernels.rs` / `numerics.rs`, in
//! the same order, with correctly rounded vector instructions: the bits are the same (tested in
//! `simd.rs`).

// Register blocks are const-sized arrays indexed by the block's row and token: index loops
// keep the blocking visible.
#![allow(clippy::needless_range_loop)]

use super::Transposed;
use crate::backend::cpu::columns::ColumnsMut;
use crate::model::weights::{FloatType, Matrix, MatrixData};
use crate::numerics::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E};
use std::arch::x86_64::*;

/// 16 f32 lanes and the operations the kernels need. Every method is `#[inline(always)]` and only
/// called from functions compiled with the matching target features.
pub(super) trait V16: Copy {
    unsafe fn zero() -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// 16 u32 words in registers.
    type W: Copy;
    /// 16 words from unaligned bytes (`n` of them; missing ones are 0).
    unsafe fn words(p: *const u8, n: usize) -> Self::W;
    /// `((w >> shift) & mask) as f32` per lane.
    unsafe fn field(w: Self::W, shift: u32, mask: u32) -> Self;
    /// `((w >> 4e) & 15) as f32` per lane, `E` a constant.
    unsafe fn nibble<const E: u32>(w: Self::W) -> Self;
    /// bf16 in the low (`hi == false`) or high half of each word, widened.
    unsafe fn bf16(w: Self::W, hi: bool) -> Self;
    /// f16 in the low or high half of each word, widened.
    unsafe fn f16(w: Self::W, hi: bool) -> Self;
    unsafe fn bits(w: Self::W) -> Self;
    /// `table[idx[l]]` per lane, `idx[l] < 8`, from 8 floats at `table`.
    unsafe fn permute8(table: *const f32, idx: &[u32; 16]) -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn div(a: Self, b: Self) -> Self;
    /// `-a` (the sign bit flipped, as Rust's unary minus).
    unsafe fn neg(a: Self) -> Self;
    /// [`crate::numerics::exp`] per lane, bit for bit.
    unsafe fn exp(a: Self) -> Self;
    /// The halving fold of the 32 lanes `a ++ b` (numerics §2).
    unsafe fn fold(a: Self, b: Self) -> f32;
    /// The end of a panel tile ([`micro`]): folds the `MR · NR` outputs of `sums` (output `k`
    /// is token `k / NR`, row `k % NR`; the fold's first level done, as for
    /// [`V16::fold16_halved`]) 16 at a time, then 8 at a time (a group of fewer than 8 repeats
    /// its last output, folded and not stored), and stores token `i`'s first `nr` outputs at
    /// `y + i·ldy` for `i < mr`.
    #[inline(always)]
    unsafe fn fold_store<const MR: usize, const NR: usize>(sums: &[Self; 2 * MAX_NR], y: *mut f32, ldy: usize, mr: usize, nr: usize) {
        let mut out = [0.0f32; 2 * MAX_NR];
        let n = MR * NR;
        let mut k0 = 0;
        while k0 + 16 <= n {
            out[k0..k0 + 16].copy_from_slice(&Self::fold16_halved(sums[k0..k0 + 16].try_into().unwrap()));
            k0 += 16;
        }
        while k0 < n {
            let g = 8.min(n - k0);
            let v: [Self; 8] = std::array::from_fn(|j| sums[k0 + j.min(g - 1)]);
            out[k0..k0 + g].copy_from_slice(&Self::fold8_halved(&v)[..g]);
            k0 += g;
        }
        for i in 0..mr {
            for r in 0..nr {
                *y.add(i * ldy + r) = out[i * NR + r];
            }
        }
    }
    /// [`V16::fold16_halved`] of 8 outputs.
    #[inline(always)]
    unsafe fn fold8_halved(v: &[Self; 8]) -> [f32; 8] {
        let w: [Self; 16] = std::array::from_fn(|k| v[k % 8]);
        let f = Self::fold16_halved(&w);
        std::array::from_fn(|k| f[k])
    }
    /// The rest of the fold of 16 outputs whose first level (`p[i] + p[i + 16]`) is done:
    /// `v[k]` holds output `k`'s 16 lanes; then `p[i] + p[i + h]` for `h = 8, 4, 2, 1`.
    #[inline(always)]
    unsafe fn fold16_halved(v: &[Self; 16]) -> [f32; 16] {
        let mut out = [0.0f32; 16];
        for k in 0..16 {
            let mut p = [0.0f32; 16];
            v[k].store(p.as_mut_ptr());
            let mut h = 8;
            while h > 0 {
                for i in 0..h {
                    p[i] += p[i + h];
                }
                h /= 2;
            }
            out[k] = p[0];
        }
        out
    }
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
    unsafe fn nibble<const E: u32>(v: __m512i) -> Self {
        // vpermps reads only bits 0–3 of each index: the table {0, 1, …, 15} turns the low
        // nibble into its float (exact) without a mask or a conversion.
        let table = _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
        let idx = match E {
            0 => v,
            1 => _mm512_srli_epi32::<4>(v),
            2 => _mm512_srli_epi32::<8>(v),
            3 => _mm512_srli_epi32::<12>(v),
            4 => _mm512_srli_epi32::<16>(v),
            5 => _mm512_srli_epi32::<20>(v),
            6 => _mm512_srli_epi32::<24>(v),
            _ => _mm512_srli_epi32::<28>(v),
        };
        Z(_mm512_permutexvar_ps(idx, table))
    }
    #[inline(always)]
    unsafe fn bf16(v: __m512i, hi: bool) -> Self {
        let r = if hi { _mm512_and_si512(v, _mm512_set1_epi32(0xffff0000u32 as i32)) } else { _mm512_slli_epi32::<16>(v) };
        Z(_mm512_castsi512_ps(r))
    }
    #[inline(always)]
    unsafe fn f16(v: __m512i, hi: bool) -> Self {
        let h = if hi { _mm512_srli_epi32::<16>(v) } else { _mm512_and_si512(v, _mm512_set1_epi32(0xffff)) };
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
    unsafe fn add(a: Self, b: Self) -> Self {
        Z(_mm512_add_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Z(_mm512_sub_ps(a.0, b.0))
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
    unsafe fn neg(a: Self) -> Self {
        Z(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.0), _mm512_set1_epi32(i32::MIN))))
    }
    #[inline(always)]
    unsafe fn exp(a: Self) -> Self {
        let x = a.0;
        // k = rint(x·log2e) (ties to even), r = fma(−k, ln2_lo, fma(−k, ln2_hi, x)).
        let kf = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)));
        let r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(kf, _mm512_set1_ps(LN2_HI), x));
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
        // 2^k in two factors 2^(k/2) · 2^(k − k/2), k/2 truncated toward zero as Rust's `/`.
        let k = _mm512_cvtps_epi32(kf);
        let k1 = _mm512_srai_epi32::<1>(_mm512_add_epi32(k, _mm512_srli_epi32::<31>(k)));
        let k2 = _mm512_sub_epi32(k, k1);
        let bias = _mm512_set1_epi32(127);
        let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(k1, bias)));
        let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(k2, bias)));
        let mut v = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
        // The scalar branches, as blends: overflow, underflow, NaN.
        v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(EXP_MAX)), _mm512_set1_ps(f32::INFINITY));
        v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN)), _mm512_setzero_ps());
        v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), x);
        Z(v)
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
    #[inline(always)]
    unsafe fn fold8_halved(v: &[Self; 8]) -> [f32; 8] {
        let mut out = [0.0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), fold8_z(&v.map(|x| x.0)));
        out
    }
    #[inline(always)]
    unsafe fn fold16_halved(v: &[Self; 16]) -> [f32; 16] {
        let mut out = [0.0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), fold16_z(&v.map(|x| x.0)));
        out
    }
    #[inline(always)]
    unsafe fn fold_store<const MR: usize, const NR: usize>(sums: &[Self; 2 * MAX_NR], y: *mut f32, ldy: usize, mr: usize, nr: usize) {
        // The same folds as the default, their results kept in registers: lin[j] holds outputs
        // 16j..16j + 16 in order; then each token's outputs are picked out of the pair with one
        // permute and written with one masked store (no round trip through the stack).
        const { assert!(MR * NR <= 32 && NR <= 16) };
        let n = MR * NR;
        let mut lin = [_mm512_setzero_ps(); 2];
        let mut k0 = 0;
        while k0 + 16 <= n {
            lin[k0 / 16] = fold16_z(&std::array::from_fn(|j| sums[k0 + j].0));
            k0 += 16;
        }
        while k0 < n {
            // Groups of 8 start at multiples of 8.
            let g = 8.min(n - k0);
            let f = fold8_z(&std::array::from_fn(|j| sums[k0 + j.min(g - 1)].0));
            lin[k0 / 16] = if k0 % 16 == 0 { _mm512_castps256_ps512(f) } else { _mm512_insertf32x8::<1>(lin[k0 / 16], f) };
            k0 += g;
        }
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let mask = ((1u32 << nr) - 1) as __mmask16;
        for i in 0..mr {
            // Lanes j < nr take output i·NR + j (< 32: bit 4 picks lin[1]); the rest are masked.
            let v = _mm512_permutex2var_ps(lin[0], _mm512_add_epi32(lanes, _mm512_set1_epi32((i * NR) as i32)), lin[1]);
            _mm512_mask_storeu_ps(y.add(i * ldy), mask, v);
        }
    }
}

/// [`V16::fold16_halved`] on zmm registers: output `k` in lane `k`.
#[inline(always)]
unsafe fn fold16_z(v: &[__m512; 16]) -> __m512 {
    // h = 8: c[k] = [o(2k) lanes 0..8 + 8..16 | o(2k+1) lanes 0..8 + 8..16].
    let c: [__m512; 8] = std::array::from_fn(|k| halve8(v[2 * k], v[2 * k + 1]));
    // h = 4: g[k] = 128-bit blocks of o(4k), o(4k+1), o(4k+2), o(4k+3).
    let g: [__m512; 4] = std::array::from_fn(|k| halve4(c[2 * k], c[2 * k + 1]));
    // h = 2: block j of j2[k] = [o(4·2k + j) lanes 0, 1 | o(4·(2k+1) + j) lanes 0, 1].
    let j2: [__m512; 2] = std::array::from_fn(|k| halve2(g[2 * k], g[2 * k + 1]));
    // h = 1: block j = [o(j), o(4 + j), o(8 + j), o(12 + j)].
    let r = halve1(j2[0], j2[1]);
    _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r)
}

/// [`V16::fold8_halved`] on zmm registers (the levels of [`fold16_z`] on 8 outputs): output
/// `k` in lane `k`.
#[inline(always)]
unsafe fn fold8_z(v: &[__m512; 8]) -> __m256 {
    let c: [__m512; 4] = std::array::from_fn(|k| halve8(v[2 * k], v[2 * k + 1]));
    let g: [__m512; 2] = std::array::from_fn(|k| halve4(c[2 * k], c[2 * k + 1]));
    // h = 2: block j = [o(j) lanes 0, 1 | o(4 + j) lanes 0, 1].
    let j2 = halve2(g[0], g[1]);
    // h = 1: block j = [o(j), o(4 + j), o(j), o(4 + j)].
    let r = halve1(j2, j2);
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, r))
}

// One level of the halving fold of two vectors x, y at once (fold16_halved, fold8_halved): each
// adds the lanes h apart within its blocks and packs x's sums beside y's.
/// h = 8: 256-bit halves.
#[inline(always)]
unsafe fn halve8(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(x, y), _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y))
}
/// h = 4: 128-bit blocks.
#[inline(always)]
unsafe fn halve4(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y))
}
/// h = 2: pairs of lanes within each 128-bit block.
#[inline(always)]
unsafe fn halve2(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(x, y), _mm512_shuffle_ps::<0b11_10_11_10>(x, y))
}
/// h = 1: single lanes within each 128-bit block.
#[inline(always)]
unsafe fn halve1(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(x, y), _mm512_shuffle_ps::<0b11_01_11_01>(x, y))
}

#[derive(Clone, Copy)]
pub(super) struct Y2(__m256, __m256);

#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    let kf = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
    let r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(kf, _mm256_set1_ps(LN2_HI), x));
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    let k = _mm256_cvtps_epi32(kf);
    let k1 = _mm256_srai_epi32::<1>(_mm256_add_epi32(k, _mm256_srli_epi32::<31>(k)));
    let k2 = _mm256_sub_epi32(k, k1);
    let bias = _mm256_set1_epi32(127);
    let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k1, bias)));
    let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k2, bias)));
    let mut v = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(EXP_MAX)));
    v = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN)));
    _mm256_blendv_ps(v, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
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
    unsafe fn nibble<const E: u32>(w: (__m256i, __m256i)) -> Self {
        Self::field(w, 4 * E, 15)
    }
    #[inline(always)]
    unsafe fn bf16(w: (__m256i, __m256i), hi: bool) -> Self {
        let f = |v: __m256i| if hi { _mm256_and_si256(v, _mm256_set1_epi32(0xffff0000u32 as i32)) } else { _mm256_slli_epi32::<16>(v) };
        Y2(_mm256_castsi256_ps(f(w.0)), _mm256_castsi256_ps(f(w.1)))
    }
    #[inline(always)]
    unsafe fn f16(w: (__m256i, __m256i), hi: bool) -> Self {
        // Gather the 16-bit halves (values ≤ 0xffff, so the saturating pack is exact), fix the
        // pack's lane order, widen.
        let half = |v: __m256i| if hi { _mm256_srli_epi32::<16>(v) } else { _mm256_and_si256(v, _mm256_set1_epi32(0xffff)) };
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
    unsafe fn add(a: Self, b: Self) -> Self {
        Y2(_mm256_add_ps(a.0, b.0), _mm256_add_ps(a.1, b.1))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Y2(_mm256_sub_ps(a.0, b.0), _mm256_sub_ps(a.1, b.1))
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
    unsafe fn neg(a: Self) -> Self {
        let s = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        Y2(_mm256_xor_ps(a.0, s), _mm256_xor_ps(a.1, s))
    }
    #[inline(always)]
    unsafe fn exp(a: Self) -> Self {
        Y2(exp8(a.0), exp8(a.1))
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

// ---------------------------------------------------------------------------------------------
// Element-wise functions (16 lanes at a time, the scalar function on the tail).

/// `x / (1 + exp(−x))`, as [`crate::numerics::silu`].
#[inline(always)]
unsafe fn silu_v<V: V16>(x: V) -> V {
    V::div(x, V::add(V::splat(1.0), V::exp(V::neg(x))))
}

/// `1 / (1 + exp(−x))`, as [`crate::numerics::sigmoid`].
#[inline(always)]
unsafe fn sigmoid_v<V: V16>(x: V) -> V {
    V::div(V::splat(1.0), V::add(V::splat(1.0), V::exp(V::neg(x))))
}

#[inline(always)]
unsafe fn silu_slice<V: V16>(x: &mut [f32]) {
    let n16 = x.len() / 16 * 16;
    let p = x.as_mut_ptr();
    let mut i = 0;
    while i < n16 {
        silu_v(V::load(p.add(i))).store(p.add(i));
        i += 16;
    }
    for v in &mut x[n16..] {
        *v = crate::numerics::silu(*v);
    }
}

#[inline(always)]
unsafe fn swiglu<V: V16>(g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = out.len();
    let n16 = n / 16 * 16;
    let mut i = 0;
    while i < n16 {
        V::mul(silu_v(V::load(g.as_ptr().add(i))), V::load(u.as_ptr().add(i))).store(out.as_mut_ptr().add(i));
        i += 16;
    }
    for i in n16..n {
        out[i] = crate::numerics::silu(g[i]) * u[i];
    }
}

/// `out[j] = ((o[j] · inv) · w[j]) · silu(z[j])` (numerics §4 step 5).
#[inline(always)]
unsafe fn gated_norm<V: V16>(o: &[f32], inv: f32, w: &[f32], z: &[f32], out: &mut [f32]) {
    let n = out.len();
    let n16 = n / 16 * 16;
    let iv = V::splat(inv);
    let mut j = 0;
    while j < n16 {
        let a = V::mul(V::mul(V::load(o.as_ptr().add(j)), iv), V::load(w.as_ptr().add(j)));
        V::mul(a, silu_v(V::load(z.as_ptr().add(j)))).store(out.as_mut_ptr().add(j));
        j += 16;
    }
    for j in n16..n {
        out[j] = ((o[j] * inv) * w[j]) * crate::numerics::silu(z[j]);
    }
}

/// `x[d] = x[d] · sigmoid(g[d])`.
#[inline(always)]
unsafe fn sigmoid_mul<V: V16>(x: &mut [f32], g: &[f32]) {
    let n = x.len();
    let n16 = n / 16 * 16;
    let mut d = 0;
    while d < n16 {
        V::mul(V::load(x.as_ptr().add(d)), sigmoid_v(V::load(g.as_ptr().add(d)))).store(x.as_mut_ptr().add(d));
        d += 16;
    }
    for d in n16..n {
        x[d] *= crate::numerics::sigmoid(g[d]);
    }
}

/// `out[i] = exp(s[i] − m)`.
#[inline(always)]
unsafe fn exp_shifted<V: V16>(s: &[f32], m: f32, out: &mut [f32]) {
    let n = s.len();
    let n16 = n / 16 * 16;
    let mv = V::splat(m);
    let mut i = 0;
    while i < n16 {
        V::exp(V::sub(V::load(s.as_ptr().add(i)), mv)).store(out.as_mut_ptr().add(i));
        i += 16;
    }
    for i in n16..n {
        out[i] = crate::numerics::exp(s[i] - m);
    }
}

/// RMSNorm of one row (numerics §3): canonical sum of squares, `(x · inv) · w`.
#[inline(always)]
unsafe fn rms_norm_row<V: V16>(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let ss = if n.is_multiple_of(32) { dot1::<V>(x.as_ptr(), x.as_ptr(), n) } else { crate::numerics::sum_squares(x) };
    let inv = crate::numerics::rsqrt(ss / n as f32 + eps);
    let iv = V::splat(inv);
    let n16 = n / 16 * 16;
    let mut i = 0;
    while i < n16 {
        V::mul(V::mul(V::load(x.as_ptr().add(i)), iv), V::load(w.as_ptr().add(i))).store(out.as_mut_ptr().add(i));
        i += 16;
    }
    for i in n16..n {
        out[i] = (x[i] * inv) * w[i];
    }
}

/// The GDN conv + SiLU ([`crate::backend::cpu::kernels::gdn_conv_taps`], then `silu`) of the
/// whole 16-channel blocks from `ch0` up to `ch1`, kernel size `K`, one channel per lane (each
/// channel's FMAs in the reference's order, from +0.0). Token `t`'s window is rows `t .. t + K`
/// of the window followed by the step's rows, so it is read in place, row after row: up to
/// [`CONV_SPAN`] blocks at a time (their taps in registers or L1) walk the tokens in order, so
/// the rows stream through memory instead of one line per 24 KiB stride. Then the window keeps
/// its last `K − 1` rows. Returns the first channel not done (the rest is under 16).
#[inline(always)]
unsafe fn gdn_conv16<V: V16, const K: usize>(cd: usize, taps: &[f32], conv: &mut ColumnsMut<'_>, qkv: &[f32], t_len: usize, y: &mut ColumnsMut<'_>) -> usize {
    let (ch0, ch1) = (conv.cols().start, conv.cols().end);
    debug_assert!(
        taps.len() >= ch1 * K && conv.rows() >= K - 1 && qkv.len() >= t_len * cd && y.rows() >= t_len && y.cols() == conv.cols() && conv.stride() == cd && y.stride() == cd
    );
    // Element (0, 0) of the window and of y (`conv.cols()` = `y.cols()` = ch0..ch1): only
    // channels ch0..ch1 of their rows are touched, through raw pointers.
    let (cp, qp, yp) = (conv.as_mut_ptr(), qkv.as_ptr(), y.as_mut_ptr());
    // Row r of the window followed by the step's rows.
    let row = |r: usize| -> *const f32 {
        if r < K - 1 {
            cp.add(r * cd) as *const f32
        } else {
            qp.add((r - (K - 1)) * cd)
        }
    };
    let end = ch0 + (ch1 - ch0) / 16 * 16;
    let mut cs = ch0;
    while cs < end {
        let nb = ((end - cs) / 16).min(CONV_SPAN);
        // Taps are [channel][K]: tap j of block b's 16 channels into one vector.
        let mut tp = [[V::zero(); K]; CONV_SPAN];
        for (b, tb) in tp.iter_mut().enumerate().take(nb) {
            for (j, v) in tb.iter_mut().enumerate() {
                let lanes: [f32; 16] = std::array::from_fn(|l| taps[(cs + 16 * b + l) * K + j]);
                *v = V::load(lanes.as_ptr());
            }
        }
        for t in 0..t_len {
            let rows: [*const f32; K] = std::array::from_fn(|j| row(t + j).add(cs));
            let yt = yp.add(t * cd + cs);
            for (b, tb) in tp.iter().enumerate().take(nb) {
                let mut acc = V::zero();
                for j in 0..K {
                    acc = V::fma(tb[j], V::load(rows[j].add(16 * b)), acc);
                }
                silu_v(acc).store(yt.add(16 * b));
            }
        }
        cs += 16 * nb;
    }
    // The window becomes rows t_len .. t_len + K − 1 (row j is overwritten only after every
    // row read so far, and later reads are of rows past it).
    for j in 0..K - 1 {
        let src = row(t_len + j);
        let mut c = ch0;
        while c < end {
            V::load(src.add(c)).store(cp.add(j * cd + c));
            c += 16;
        }
    }
    end
}

/// 16-channel blocks of the GDN conv that walk the tokens together (their taps: 8 KiB).
const CONV_SPAN: usize = 32;

// ---------------------------------------------------------------------------------------------
// Canonical dots, the delta rule, attention.

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

/// One state row `r` (`NV · 16` values) of the delta rule (numerics §4, step 4), held in
/// registers between its passes: `S = S·α; mem = dot(S, k); δ = (v − mem)·β; S = fma(k, δ, S)`;
/// returns `dot(S, q)`.
#[inline(always)]
unsafe fn gdn_row<V: V16, const NV: usize>(r: *mut f32, kv: &[V; NV], qv: &[V; NV], av: V, vj: f32, beta: f32) -> f32 {
    let mut row = [V::zero(); NV];
    for i in 0..NV {
        row[i] = V::mul(V::load(r.add(16 * i)), av);
    }
    // mem = dot(S, k): lanes 0..16 and 16..32 of each 32-element block.
    let (mut p0, mut p1) = (V::zero(), V::zero());
    for i in (0..NV).step_by(2) {
        p0 = V::fma(row[i], kv[i], p0);
        p1 = V::fma(row[i + 1], kv[i + 1], p1);
    }
    let mem = V::fold(p0, p1);
    let delta = (vj - mem) * beta;
    let dv = V::splat(delta);
    let (mut p0, mut p1) = (V::zero(), V::zero());
    for i in (0..NV).step_by(2) {
        row[i] = V::fma(kv[i], dv, row[i]);
        row[i + 1] = V::fma(kv[i + 1], dv, row[i + 1]);
        p0 = V::fma(row[i], qv[i], p0);
        p1 = V::fma(row[i + 1], qv[i + 1], p1);
    }
    for i in 0..NV {
        row[i].store(r.add(16 * i));
    }
    V::fold(p0, p1)
}

/// `dk / 16` vectors from `p`.
#[inline(always)]
unsafe fn load_n<V: V16, const NV: usize>(p: *const f32) -> [V; NV] {
    let mut v = [V::zero(); NV];
    for i in 0..NV {
        v[i] = V::load(p.add(16 * i));
    }
    v
}

/// The delta rule of one value head over its `dv` state rows (numerics §4, step 4), a state row
/// of `dk` values held in `dk / 16` registers between the passes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gdn_rows_regs<V: V16, const NV: usize>(s: &mut [f32], k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
    let (kv, qv) = (load_n::<V, NV>(k.as_ptr()), load_n::<V, NV>(q.as_ptr()));
    let av = V::splat(alpha);
    for (j, oj) in o.iter_mut().enumerate() {
        *oj = gdn_row::<V, NV>(s.as_mut_ptr().add(j * NV * 16), &kv, &qv, av, v[j], beta);
    }
}

/// 16 state rows of the delta rule (numerics §4, step 4) for `n` tokens, one row per vector lane:
/// the rows `r[0..16]` (`NV · 16` values each, `[16][dk]` from `r`) are transposed into `t`
/// (`t[i]` = element `i` of the 16 rows), run through the tokens, and transposed back.
///
/// Each row's arithmetic is [`gdn_row`]'s, lane for lane: canonical lane `l` of a row's dot
/// product (elements `l, l + 32, …`) is accumulator `l` here, over the 16 rows at once, and
/// the halving fold adds whole accumulators (`p[l] + p[l + h]`) instead of shuffling lanes of
/// one row. So no shuffles, no serial fold per row (the row-wise loop was bound by the
/// latency of its two folds), and `δ = (v − mem)·β` is one vector operation. `S·α` is
/// recomputed in the update pass rather than stored (the same product, the same bits).
/// Token `i`'s inputs are as in [`super::gdn_rows_tokens`], `v` and `o` pointing at the first
/// row's element.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gdn_rows16<V: V16, const NV: usize>(
    r: *mut f32,
    n: usize,
    k: *const f32,
    q: *const f32,
    alpha: &[f32],
    beta: &[f32],
    v: *const f32,
    v_stride: usize,
    o: *mut f32,
    o_stride: usize,
) {
    const { assert!(NV <= 8 && NV.is_multiple_of(2)) };
    let dk = NV * 16;
    // 64-byte aligned: a vector split across two cache lines costs two accesses.
    #[repr(align(64))]
    struct Rows([f32; 16 * 128]);
    let mut tb = Rows([0.0; 16 * 128]);
    let t = tb.0.as_mut_ptr();
    for row in 0..16 {
        for i in 0..dk {
            *t.add(i * 16 + row) = *r.add(row * dk + i);
        }
    }
    for tok in 0..n {
        let (kt, qt) = (k.add(tok * dk), q.add(tok * dk));
        let av = V::splat(alpha[tok]);
        // mem = dot(S·α, k): lane sums, the fold's first level as they finish.
        let mut p = [V::zero(); 16];
        for (l, pl) in p.iter_mut().enumerate() {
            let mut half = [V::zero(); 2];
            for (hh, acc) in half.iter_mut().enumerate() {
                for m in 0..NV / 2 {
                    let i = l + 16 * hh + 32 * m;
                    *acc = V::fma(V::mul(V::load(t.add(i * 16)), av), V::splat(*kt.add(i)), *acc);
                }
            }
            *pl = V::add(half[0], half[1]);
        }
        let mem = fold_halves(&mut p);
        let delta = V::mul(V::sub(V::load(v.add(tok * v_stride)), mem), V::splat(beta[tok]));
        // S = fma(k, δ, S·α); o = dot(S, q).
        let mut p = [V::zero(); 16];
        for (l, pl) in p.iter_mut().enumerate() {
            let mut half = [V::zero(); 2];
            for (hh, acc) in half.iter_mut().enumerate() {
                for m in 0..NV / 2 {
                    let i = l + 16 * hh + 32 * m;
                    let si = V::fma(V::splat(*kt.add(i)), delta, V::mul(V::load(t.add(i * 16)), av));
                    si.store(t.add(i * 16));
                    *acc = V::fma(si, V::splat(*qt.add(i)), *acc);
                }
            }
            *pl = V::add(half[0], half[1]);
        }
        fold_halves(&mut p).store(o.add(tok * o_stride));
    }
    for row in 0..16 {
        for i in 0..dk {
            *r.add(row * dk + i) = *t.add(i * 16 + row);
        }
    }
}

/// The fold's levels after the first (`p[i] + p[i + h]`, `h = 8, 4, 2, 1`) over 16 whole
/// accumulators; returns `p[0]`.
#[inline(always)]
unsafe fn fold_halves<V: V16>(p: &mut [V; 16]) -> V {
    let mut h = 8;
    while h > 0 {
        for i in 0..h {
            p[i] = V::add(p[i], p[i + h]);
        }
        h /= 2;
    }
    p[0]
}

/// Tokens from which [`gdn_tokens_regs`] transposes 16-row groups ([`gdn_rows16`]).
const GDN_MIN_TOKENS: usize = 8;

/// [`gdn_rows_regs`] for `alpha.len()` tokens (see [`super::gdn_rows_tokens`] for the layout):
/// from [`GDN_MIN_TOKENS`] tokens, groups of 16 rows run through every token at once
/// ([`gdn_rows16`]); other rows (all of them for fewer tokens) one at a time. A row's updates
/// are those of one token at a time, in token order.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gdn_tokens_regs<V: V16, const NV: usize>(s: &mut [f32], k: &[f32], q: &[f32], alpha: &[f32], beta: &[f32], v: &[f32], v_stride: usize, o: &mut [f32], o_stride: usize) {
    let dk = NV * 16;
    let (dv, n) = (s.len() / dk, alpha.len());
    let (sp, vp, op) = (s.as_mut_ptr(), v.as_ptr(), o.as_mut_ptr());
    let mut j = 0;
    // The transposes cost about as much as 4 tokens of updates: decode keeps to rows.
    while n >= GDN_MIN_TOKENS && j + 16 <= dv {
        gdn_rows16::<V, NV>(sp.add(j * dk), n, k.as_ptr(), q.as_ptr(), alpha, beta, vp.add(j), v_stride, op.add(j), o_stride);
        j += 16;
    }
    if j < dv {
        for t in 0..n {
            let (kv, qv) = (load_n::<V, NV>(k.as_ptr().add(t * dk)), load_n::<V, NV>(q.as_ptr().add(t * dk)));
            let av = V::splat(alpha[t]);
            for j in j..dv {
                *op.add(t * o_stride + j) = gdn_row::<V, NV>(sp.add(j * dk), &kv, &qv, av, *vp.add(t * v_stride + j), beta[t]);
            }
        }
    }
}

/// The delta rule of one value head for several tokens ([`super::gdn_rows_tokens`]), `dk` a
/// multiple of 32.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gdn_tokens<V: V16>(s: &mut [f32], dk: usize, k: &[f32], q: &[f32], alpha: &[f32], beta: &[f32], v: &[f32], v_stride: usize, o: &mut [f32], o_stride: usize) {
    match dk {
        64 => gdn_tokens_regs::<V, 4>(s, k, q, alpha, beta, v, v_stride, o, o_stride),
        128 => gdn_tokens_regs::<V, 8>(s, k, q, alpha, beta, v, v_stride, o, o_stride),
        _ => {
            let dv = s.len() / dk;
            for t in 0..alpha.len() {
                let o_t = &mut o[t * o_stride..t * o_stride + dv];
                gdn_rows::<V>(s, dk, &k[t * dk..(t + 1) * dk], &q[t * dk..(t + 1) * dk], alpha[t], beta[t], &v[t * v_stride..t * v_stride + dv], o_t);
            }
        }
    }
}

/// The delta rule for any `dk` that is a multiple of 32 (state rows through memory).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gdn_rows<V: V16>(s: &mut [f32], dk: usize, k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
    match dk {
        64 => return gdn_rows_regs::<V, 4>(s, k, q, alpha, beta, v, o),
        128 => return gdn_rows_regs::<V, 8>(s, k, q, alpha, beta, v, o),
        _ => {}
    }
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

/// Attention of the `G` query heads of one KV group over positions `0..=p` (numerics §6 for
/// each head, the bits of [`crate::backend::cpu::kernels::attend`]): every key and value row is
/// read once for the group. `q` holds the `G` normalised, rotated queries (`[G][dh]`), `out`
/// receives `[G][dh]`; `buf` is scratch.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_group<V: V16, const G: usize>(q: &[f32], keys: &[f32], values: &[f32], p: usize, stride: usize, head_off: usize, buf: &mut Vec<f32>, out: &mut [f32]) {
    use crate::backend::cpu::kernels::ATTENTION_TILE;
    use crate::numerics::exp;
    let dh = q.len() / G;
    let scale = crate::numerics::rsqrt(dh as f32);
    let n = p + 1;
    let n_tiles = p / ATTENTION_TILE + 1;
    // Scratch: scores [G][n], per tile and head (m, l, o[dh]), weights e [G][TILE].
    let tile_len = dh + 2;
    let (sc_off, tl_off, e_off) = (0, G * n, G * n + n_tiles * G * tile_len);
    buf.clear();
    buf.resize(e_off + G * ATTENTION_TILE, 0.0);
    let bp = buf.as_mut_ptr();
    // Scores: one pass over the keys, G canonical dots per key.
    for tau in 0..n {
        let k = keys.as_ptr().add(tau * stride + head_off);
        let mut acc = [[V::zero(); 2]; G];
        let mut c = 0;
        while c < dh {
            let (k0, k1) = (V::load(k.add(c)), V::load(k.add(c + 16)));
            for (h, a) in acc.iter_mut().enumerate() {
                let qh = q.as_ptr().add(h * dh + c);
                a[0] = V::fma(V::load(qh), k0, a[0]);
                a[1] = V::fma(V::load(qh.add(16)), k1, a[1]);
            }
            c += 32;
        }
        for (h, a) in acc.iter().enumerate() {
            *bp.add(sc_off + h * n + tau) = V::fold(a[0], a[1]) * scale;
        }
    }
    for t in 0..n_tiles {
        let lo = t * ATTENTION_TILE;
        let hi = ((t + 1) * ATTENTION_TILE).min(n);
        let len = hi - lo;
        let mut m = [f32::NEG_INFINITY; G];
        let mut l = [0.0f32; G];
        for h in 0..G {
            let sh = std::slice::from_raw_parts(bp.add(sc_off + h * n + lo), len);
            m[h] = sh.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let eh = std::slice::from_raw_parts_mut(bp.add(e_off + h * ATTENTION_TILE), len);
            exp_shifted::<V>(sh, m[h], eh);
            for &e in eh.iter() {
                l[h] += e;
            }
        }
        // o[h][d] = Σ_τ fma(e[h][τ], v_τ[d], ·) in increasing τ, 64 dims × G heads in registers.
        let tbase = bp.add(tl_off + t * G * tile_len);
        let mut d = 0;
        while d < dh {
            let nd = ((dh - d) / 16).min(4);
            let mut o = [[V::zero(); 4]; G];
            for (i, tau) in (lo..hi).enumerate() {
                let vrow = values.as_ptr().add(tau * stride + head_off + d);
                let mut vv = [V::zero(); 4];
                for (j, x) in vv.iter_mut().enumerate().take(nd) {
                    *x = V::load(vrow.add(16 * j));
                }
                for (h, oh) in o.iter_mut().enumerate() {
                    let ev = V::splat(*bp.add(e_off + h * ATTENTION_TILE + i));
                    for j in 0..nd {
                        oh[j] = V::fma(ev, vv[j], oh[j]);
                    }
                }
            }
            for (h, oh) in o.iter().enumerate() {
                for (j, x) in oh.iter().enumerate().take(nd) {
                    x.store(tbase.add(h * tile_len + 2 + d + 16 * j));
                }
            }
            d += 16 * nd;
        }
        for h in 0..G {
            *tbase.add(h * tile_len) = m[h];
            *tbase.add(h * tile_len + 1) = l[h];
        }
    }
    // Combine the tiles of each head in increasing order.
    for h in 0..G {
        let tile = |t: usize| bp.add(tl_off + (t * G + h) * tile_len);
        let big_m = (0..n_tiles).map(|t| *tile(t)).fold(f32::NEG_INFINITY, f32::max);
        let mut big_l = 0.0f32;
        let oh = out.as_mut_ptr().add(h * dh);
        let mut d = 0;
        while d < dh {
            V::zero().store(oh.add(d));
            d += 16;
        }
        for t in 0..n_tiles {
            let c = exp(*tile(t) - big_m);
            big_l = crate::numerics::fma(*tile(t).add(1), c, big_l);
            let cv = V::splat(c);
            let o = tile(t).add(2);
            let mut d = 0;
            while d < dh {
                V::fma(V::load(o.add(d)), cv, V::load(oh.add(d))).store(oh.add(d));
                d += 16;
            }
        }
        let lv = V::splat(big_l);
        let mut d = 0;
        while d < dh {
            V::div(V::load(oh.add(d)), lv).store(oh.add(d));
            d += 16;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Matrix products.

/// Group offsets of the 16 lanes of half `h` of a chunk, relative to the half's first group,
/// for `per_word` elements per word and groups of `gs` elements.
fn half_group_index(per_word: usize, gs: usize) -> [[u32; 16]; 2] {
    let mut idx = [[0u32; 16]; 2];
    for (h, ih) in idx.iter_mut().enumerate() {
        let first = 16 * h;
        for (l, v) in ih.iter_mut().enumerate() {
            *v = (((first + l) * per_word) / gs - (first * per_word) / gs) as u32;
        }
    }
    idx
}

/// Widens `n` 16/32-bit floats of `b` to f32 (exact).
#[inline(always)]
fn widen(ft: FloatType, b: &[u8], out: &mut [f32]) {
    match ft {
        FloatType::BF16 => {
            for (d, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        ft => {
            for (g, d) in out.iter_mut().enumerate() {
                *d = ft.get(b, g);
            }
        }
    }
}

/// A 4-bit affine matrix in the shape the fast paths take: every row a whole number of 16-word
/// halves, groups of 16 elements or more (so a half holds at most 8 groups).
pub(super) struct Q4<'a> {
    codes: &'a [u8],
    scales: &'a [u8],
    biases: &'a [u8],
    sdt: FloatType,
    /// log2 of the group size (a power of two).
    gs_log2: u32,
    /// 32-bit words per row (`cols / 8`).
    words: usize,
    /// Groups per row.
    groups: usize,
    idx: [[u32; 16]; 2],
}

impl<'a> Q4<'a> {
    pub(super) fn of(w: &'a Matrix) -> Option<Self> {
        match &w.data {
            MatrixData::Affine { bits: 4, group_size, weight, scales, biases, scale_dtype } => {
                let (gs, words) = (*group_size, w.cols / 8);
                let groups = w.cols / gs;
                if words % 16 != 0 || !gs.is_power_of_two() || gs < 16 {
                    return None;
                }
                Some(Self {
                    codes: weight.as_slice(),
                    scales: scales.as_slice(),
                    biases: biases.as_slice(),
                    sdt: *scale_dtype,
                    gs_log2: gs.trailing_zeros(),
                    words,
                    groups,
                    idx: half_group_index(8, gs),
                })
            }
            _ => None,
        }
    }

    /// Row `n`'s scales and biases widened into `s`, `b` (`groups` values each).
    #[inline(always)]
    fn row_scales(&self, n: usize, s: &mut [f32], b: &mut [f32]) {
        let sb = self.groups * self.sdt.size();
        widen(self.sdt, &self.scales[n * sb..(n + 1) * sb], &mut s[..self.groups]);
        widen(self.sdt, &self.biases[n * sb..(n + 1) * sb], &mut b[..self.groups]);
    }
}

/// One 16-word half `h` of every chunk of `RB` rows against `MR` tokens: decodes each word's 8
/// codes with `fma(scale, q, bias)` and accumulates lane-wise (numerics §2, §2.1). `sb[r]` points
/// at row `r`'s widened scales, then its biases (`groups + 8` floats each).
#[inline(always)]
unsafe fn q4_half<V: V16, const MR: usize, const RB: usize>(q: &Q4, rows: [*const u8; RB], sb: [*const f32; RB], xt: &Transposed, h: usize, acc: &mut [[V; RB]; MR]) {
    let (xstride, half) = (xt.stride(), xt.half());
    let chunks = (q.words - 16 * h).div_ceil(32);
    let idx = &q.idx[h];
    let boff = q.groups + 8;
    for c in 0..chunks {
        let first_word = c * 32 + 16 * h;
        let g0 = (first_word * 8) >> q.gs_log2;
        let mut wd = [V::words(rows[0], 16); RB];
        let mut sv = [V::zero(); RB];
        let mut bv = [V::zero(); RB];
        for r in 0..RB {
            wd[r] = V::words(rows[r].add(first_word * 4), 16);
            sv[r] = V::permute8(sb[r].add(g0), idx);
            bv[r] = V::permute8(sb[r].add(boff + g0), idx);
        }
        for r in 0..RB {
            _mm_prefetch::<_MM_HINT_T0>(rows[r].wrapping_add(first_word * 4 + PREFETCH_BYTES) as *const i8);
        }
        let xb = xt.ptr().add(h * half + c * 8 * 16);
        q4_step::<V, MR, RB, 0>(xb, xstride, &wd, &sv, &bv, acc);
        q4_step::<V, MR, RB, 1>(xb, xstride, &wd, &sv, &bv, acc);
        q4_step::<V, MR, RB, 2>(xb, xstride, &wd, &sv, &bv, acc);
        q4_step::<V, MR, RB, 3>(xb, xstride, &wd, &sv, &bv, acc);
        q4_step::<V, MR, RB, 4>(xb, xstride, &wd, &sv, &bv, acc);
        q4_step::<V, MR, RB, 5>(xb, xstride, &wd, &sv, &bv, acc);
        q4_step::<V, MR, RB, 6>(xb, xstride, &wd, &sv, &bv, acc);
        q4_step::<V, MR, RB, 7>(xb, xstride, &wd, &sv, &bv, acc);
    }
}

/// Element `E` of 16 words of `RB` rows: decode, then one FMA per token.
#[inline(always)]
unsafe fn q4_step<V: V16, const MR: usize, const RB: usize, const E: u32>(xb: *const f32, xstride: usize, wd: &[V::W; RB], sv: &[V; RB], bv: &[V; RB], acc: &mut [[V; RB]; MR]) {
    let mut xv = [V::zero(); MR];
    for (i, x) in xv.iter_mut().enumerate() {
        *x = V::load(xb.add(i * xstride + E as usize * 16));
    }
    for r in 0..RB {
        let wv = V::fma(sv[r], V::nibble::<E>(wd[r]), bv[r]);
        for i in 0..MR {
            acc[i][r] = V::fma(wv, xv[i], acc[i][r]);
        }
    }
}

/// Bytes ahead of the current weight codes that the decode kernel asks the cache for: enough
/// requests in flight to cover the memory latency on a bandwidth-starved core.
const PREFETCH_BYTES: usize = 4096;

/// `RB` rows from `n` of a 4-bit matrix against all `MR` tokens of `xt`; `buf` holds
/// `RB · 2 · (groups + 8)` floats.
#[inline(always)]
unsafe fn q4_rows<V: V16, const MR: usize, const RB: usize>(q: &Q4, xt: &Transposed, n: usize, y: *mut f32, ldy: usize, buf: &mut [f32]) {
    let per = 2 * (q.groups + 8);
    let mut rows = [std::ptr::null::<u8>(); RB];
    let mut sb = [std::ptr::null::<f32>(); RB];
    for r in 0..RB {
        let (s, b) = buf[r * per..(r + 1) * per].split_at_mut(q.groups + 8);
        q.row_scales(n + r, s, b);
        sb[r] = buf.as_ptr().add(r * per);
        rows[r] = q.codes.as_ptr().add((n + r) * q.words * 4);
    }
    let mut a0 = [[V::zero(); RB]; MR];
    q4_half::<V, MR, RB>(q, rows, sb, xt, 0, &mut a0);
    let mut a1 = [[V::zero(); RB]; MR];
    if q.words > 16 {
        q4_half::<V, MR, RB>(q, rows, sb, xt, 1, &mut a1);
    }
    for i in 0..MR {
        for r in 0..RB {
            *y.add(i * ldy + n + r) = V::fold(a0[i][r], a1[i][r]);
        }
    }
}

/// Few tokens (decode) of a 4-bit matrix: each weight row is decoded in registers and used at
/// once, `RB` rows per pass so their loads and FMA chains overlap.
#[inline(always)]
unsafe fn q4_matvec<V: V16, const MR: usize, const RB: usize>(q: &Q4, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize, scratch: &mut Vec<f32>) {
    let per = 2 * (q.groups + 8);
    if scratch.len() < RB * per {
        scratch.resize(RB * per, 0.0);
    }
    let mut n = n0;
    while n + RB <= n0 + count {
        q4_rows::<V, MR, RB>(q, xt, n, y, ldy, scratch);
        n += RB;
    }
    while n < n0 + count {
        q4_rows::<V, MR, 1>(q, xt, n, y, ldy, scratch);
        n += 1;
    }
}

/// `n` scales (or biases) of type `sdt` at `src` widened to f32 at `dst` (exact), 16 at a time.
#[inline(always)]
unsafe fn widen_avx512(sdt: FloatType, src: *const u8, n: usize, dst: *mut f32) {
    let mut g = 0;
    while g < n {
        let k = (n - g).min(16);
        let m = ((1u32 << k) - 1) as __mmask16;
        let v = match sdt {
            FloatType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src.add(2 * g) as *const i16)))),
            FloatType::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src.add(2 * g) as *const i16)),
            FloatType::F32 => _mm512_maskz_loadu_ps(m, src.add(4 * g) as *const f32),
        };
        _mm512_mask_storeu_ps(dst.add(g), m, v);
        g += 16;
    }
}

/// The 16 decoded values `fma(scale, q, bias)`, `q = 0..15`, of the group whose widened scale
/// is at `s` and bias at `b`: the value of a code is then one lookup (the same FMA on the same
/// inputs as decoding the code in place, so the same bits).
#[inline(always)]
unsafe fn group_table(s: *const f32, b: *const f32) -> __m512 {
    let q = _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
    _mm512_fmadd_ps(_mm512_set1_ps(*s), q, _mm512_set1_ps(*b))
}

/// Half `h` of chunk `c` of `RB` rows against `MR` tokens, AVX-512, groups of 64 or more
/// elements: each group's 16 possible values are computed once ([`group_table`]) and every
/// code becomes its value by one permute, so a weight costs its lookup and its lane FMA
/// (numerics §2, §2.1; the bits of [`q4_half`]). With `TWO` (groups of 64) lanes 0–7 and 8–15
/// of a half lie in two groups: the index of a code gets bit 4 set on lanes 8–15 and a
/// two-table permute picks the group; with larger groups the half lies in one group, and the
/// permute reads only the index's low 4 bits, which are the code after a shift.
#[inline(always)]
unsafe fn q4_lut_step<const MR: usize, const RB: usize, const TWO: bool>(
    q: &Q4,
    rows: [*const u8; RB],
    sb: [*const f32; RB],
    xt: &Transposed,
    c: usize,
    h: usize,
    acc: &mut [[__m512; RB]; MR],
) {
    let (xstride, half) = (xt.stride(), xt.half());
    let boff = q.groups + 8;
    let nib = _mm512_set1_epi32(0x0f0f_0f0f);
    // Bit 4 of every byte on lanes 8–15: the second group's table.
    let hi_lanes = _mm512_mask_blend_epi32(0xff00, _mm512_setzero_si512(), _mm512_set1_epi32(0x1010_1010));
    let first_word = c * 32 + 16 * h;
    let g0 = (first_word * 8) >> q.gs_log2;
    let xb = xt.ptr().add(h * half + c * 8 * 16);
    for r in 0..RB {
        let w = _mm512_loadu_si512(rows[r].add(first_word * 4) as *const _);
        let ta = group_table(sb[r].add(g0), sb[r].add(boff + g0));
        let mut wv = [_mm512_setzero_ps(); 8];
        if TWO {
            let tb = group_table(sb[r].add(g0 + 1), sb[r].add(boff + g0 + 1));
            // (w & 0x0f…) | bit 4 on lanes 8–15: byte k holds element 2k's index; the same of
            // w >> 4 holds element 2k + 1's.
            let even = _mm512_ternarylogic_epi32::<0xea>(w, nib, hi_lanes);
            let odd = _mm512_ternarylogic_epi32::<0xea>(_mm512_srli_epi32::<4>(w), nib, hi_lanes);
            wv[0] = _mm512_permutex2var_ps(ta, even, tb);
            wv[1] = _mm512_permutex2var_ps(ta, odd, tb);
            wv[2] = _mm512_permutex2var_ps(ta, _mm512_srli_epi32::<8>(even), tb);
            wv[3] = _mm512_permutex2var_ps(ta, _mm512_srli_epi32::<8>(odd), tb);
            wv[4] = _mm512_permutex2var_ps(ta, _mm512_srli_epi32::<16>(even), tb);
            wv[5] = _mm512_permutex2var_ps(ta, _mm512_srli_epi32::<16>(odd), tb);
            wv[6] = _mm512_permutex2var_ps(ta, _mm512_srli_epi32::<24>(even), tb);
            wv[7] = _mm512_permutex2var_ps(ta, _mm512_srli_epi32::<24>(odd), tb);
        } else {
            wv[0] = _mm512_permutexvar_ps(w, ta);
            wv[1] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(w), ta);
            wv[2] = _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(w), ta);
            wv[3] = _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(w), ta);
            wv[4] = _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(w), ta);
            wv[5] = _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(w), ta);
            wv[6] = _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(w), ta);
            wv[7] = _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(w), ta);
        }
        for e in 0..8 {
            for i in 0..MR {
                acc[i][r] = _mm512_fmadd_ps(wv[e], _mm512_loadu_ps(xb.add(i * xstride + e * 16)), acc[i][r]);
            }
        }
    }
}

/// `RB` rows from `n` of a 4-bit matrix with groups of 64+ against all `MR` tokens of `xt`
/// ([`q4_lut_step`]); `buf` holds `RB · 2 · (groups + 8)` floats.
#[inline(always)]
unsafe fn q4_lut_rows<const MR: usize, const RB: usize, const TWO: bool>(q: &Q4, xt: &Transposed, n: usize, y: *mut f32, ldy: usize, buf: &mut [f32]) {
    let per = 2 * (q.groups + 8);
    let sbytes = q.groups * q.sdt.size();
    let mut rows = [std::ptr::null::<u8>(); RB];
    let mut sb = [std::ptr::null::<f32>(); RB];
    for r in 0..RB {
        let p = buf.as_mut_ptr().add(r * per);
        widen_avx512(q.sdt, q.scales.as_ptr().add((n + r) * sbytes), q.groups, p);
        widen_avx512(q.sdt, q.biases.as_ptr().add((n + r) * sbytes), q.groups, p.add(q.groups + 8));
        sb[r] = p;
        rows[r] = q.codes.as_ptr().add((n + r) * q.words * 4);
    }
    // Both halves of a chunk at once: 2·RB·MR independent FMA chains (a lane's own chain is
    // serial, 4 cycles an FMA), and the chunk's two cache lines used together.
    let mut a0 = [[_mm512_setzero_ps(); RB]; MR];
    let mut a1 = [[_mm512_setzero_ps(); RB]; MR];
    let full = q.words / 32;
    for c in 0..full {
        for r in 0..RB {
            _mm_prefetch::<_MM_HINT_T0>(rows[r].wrapping_add(c * 128 + PREFETCH_BYTES) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(rows[r].wrapping_add(c * 128 + 64 + PREFETCH_BYTES) as *const i8);
        }
        q4_lut_step::<MR, RB, TWO>(q, rows, sb, xt, c, 0, &mut a0);
        q4_lut_step::<MR, RB, TWO>(q, rows, sb, xt, c, 1, &mut a1);
    }
    if !q.words.is_multiple_of(32) {
        // A last lone half (Q4 rows are whole halves).
        q4_lut_step::<MR, RB, TWO>(q, rows, sb, xt, full, 0, &mut a0);
    }
    for i in 0..MR {
        for r in 0..RB {
            *y.add(i * ldy + n + r) = Z::fold(Z(a0[i][r]), Z(a1[i][r]));
        }
    }
}

/// Few tokens (decode) of a 4-bit matrix with groups of 64 or more elements, AVX-512: the
/// lookup kernel ([`q4_lut_step`]), `RB` rows per pass. False (nothing done) for other shapes.
#[inline(always)]
unsafe fn q4_lut_matvec<const MR: usize, const RB: usize>(q: &Q4, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize, scratch: &mut Vec<f32>) -> bool {
    let two = match q.gs_log2 {
        6 => true,
        7.. => false,
        _ => return false,
    };
    let per = 2 * (q.groups + 8);
    if scratch.len() < RB * per {
        scratch.resize(RB * per, 0.0);
    }
    let mut n = n0;
    while n + RB <= n0 + count {
        if two {
            q4_lut_rows::<MR, RB, true>(q, xt, n, y, ldy, scratch);
        } else {
            q4_lut_rows::<MR, RB, false>(q, xt, n, y, ldy, scratch);
        }
        n += RB;
    }
    while n < n0 + count {
        if two {
            q4_lut_rows::<MR, 1, true>(q, xt, n, y, ldy, scratch);
        } else {
            q4_lut_rows::<MR, 1, false>(q, xt, n, y, ldy, scratch);
        }
        n += 1;
    }
    true
}

/// Per-row scales and biases widened to f32 once (affine formats), for the panel decode.
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
        Self { s: vec![0.0; groups + 8], b: vec![0.0; groups + 8], idx: half_group_index(per_word, gs) }
    }

    fn load(&mut self, w: &Matrix, rb: &super::RowBytes<'_>) {
        if let MatrixData::Affine { scale_dtype, group_size, .. } = &w.data {
            let n = w.cols / group_size;
            widen(*scale_dtype, rb.scales, &mut self.s[..n]);
            widen(*scale_dtype, rb.biases, &mut self.b[..n]);
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

/// Decodes row `n` of `w` into the lane order of `xt` at `dst` (`[2][steps][16]`, 0 past the
/// last word), any format.
#[inline(always)]
unsafe fn decode_row_lanes<V: V16>(w: &Matrix, n: usize, xt: &Transposed, rs: &mut RowScales, dst: *mut f32) {
    let (e_n, half) = (xt.per_word, xt.half());
    let rb = super::row_bytes(w, n);
    rs.load(w, &rb);
    let mut dec = [V::zero(); 8];
    for c in 0..xt.chunks {
        let words = (xt.words - c * 32).min(32);
        for h in 0..2 {
            let lanes = words.saturating_sub(16 * h).min(16);
            if lanes == 0 {
                for e in 0..e_n {
                    V::zero().store(dst.add(h * half + (c * e_n + e) * 16));
                }
                continue;
            }
            decode16::<V>(w, &rb, rs, c, h, lanes, &mut dec);
            for (e, d) in dec.iter().enumerate().take(e_n) {
                d.store(dst.add(h * half + (c * e_n + e) * 16));
            }
        }
    }
}

/// Where the last K block of the second half puts its outputs: the first half's finished lane
/// sums (`[MR][NR][16]` at `half0[i·ld + r·16]`), and the output block in `y` (`y[i·ldy + r]`
/// for the `mr` valid tokens and `nr` valid rows).
#[derive(Clone, Copy)]
struct Finish {
    half0: *const f32,
    y: *mut f32,
    ldy: usize,
    mr: usize,
    nr: usize,
}

/// One half of `MR` tokens × `NR` decoded rows over `steps` steps: `xs[i]`, `ws[r]` point at
/// the half's first step (16 lanes, contiguous), each output has one accumulator. The partial
/// lane sums start at +0.0 (`first`) or come from `acc` (`[MR][NR][16]` at `acc[i·ld + r·16]`)
/// and go back there, except with `finish` (the second half's last K block): then the first
/// half's lane sums are added (`half0[l] + acc[l]`, the fold's first level: numerics §2, lane
/// `l` plus lane `l + 16`), the rest of the fold runs on the registers 16 (or 8) outputs at a
/// time, and the valid outputs go to `y`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<V: V16, const MR: usize, const NR: usize>(
    xs: [*const f32; MR],
    ws: [*const f32; NR],
    steps: usize,
    acc_p: *mut f32,
    ld: usize,
    first: bool,
    finish: Option<Finish>,
) {
    let mut acc = [[V::zero(); NR]; MR];
    if !first {
        for i in 0..MR {
            for r in 0..NR {
                acc[i][r] = V::load(acc_p.add(i * ld + r * 16));
            }
        }
    }
    for s in 0..steps {
        let mut xv = [V::zero(); MR];
        for i in 0..MR {
            xv[i] = V::load(xs[i].add(s * 16));
        }
        for r in 0..NR {
            let wv = V::load(ws[r].add(s * 16));
            for i in 0..MR {
                acc[i][r] = V::fma(wv, xv[i], acc[i][r]);
            }
        }
    }
    match finish {
        None => {
            for i in 0..MR {
                for r in 0..NR {
                    acc[i][r].store(acc_p.add(i * ld + r * 16));
                }
            }
        }
        Some(f) => {
            // Token-major: output k is token k / NR, row k % NR. (Only constant indices into
            // `acc`, so it stays in registers through the loop above.)
            let mut lane_sums = [V::zero(); 2 * MAX_NR];
            for i in 0..MR {
                for r in 0..NR {
                    lane_sums[i * NR + r] = V::add(V::load(f.half0.add(i * ld + r * 16)), acc[i][r]);
                }
            }
            V::fold_store::<MR, NR>(&lane_sums, f.y, f.ldy, f.mr, f.nr);
        }
    }
}

/// Tokens per block of the panel path: the block's inputs (one K block of one half, 64 KiB)
/// stay in L2 while every row of the task passes over them (16 measured better than 32 or 64).
const TOKEN_BLOCK: usize = 16;
/// Steps per K block of the panel path, per half: `NR` rows of it (6 × 64 × 64 B = 24 KiB) stay
/// in L1 while every token of the token block passes over them. The lane sums are parked
/// between K blocks (2 memory accesses per output per 64 FMAs).
const K_STEPS: usize = 64;
/// The largest row block of the panel kernel (`NR`); `MR · NR` outputs of [`micro`] are at most
/// `2 · MAX_NR`.
const MAX_NR: usize = 16;

/// Many tokens (prompt processing), any format: the task's rows are decoded once into a panel
/// in the lane order of `xt`; then per token block, half and K block, `NR` rows × `MR` tokens at
/// a time run [`micro`], the partial lane sums parked in a buffer between K blocks (stored and
/// reloaded f32 values: the per-lane order of numerics §2 is unchanged), the first half's
/// finished sums kept until the second half's last K block adds them and folds its outputs in
/// registers. Partial blocks repeat the last valid token or row and store only valid outputs.
#[inline(always)]
unsafe fn gemm<V: V16, const MR: usize, const NR: usize>(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize, scratch: &mut Vec<f32>) {
    const { assert!(NR <= MAX_NR && MR * NR <= 2 * MAX_NR) };
    let (plen, half, steps) = (xt.stride(), xt.half(), xt.steps());
    let rows_pad = count.div_ceil(NR) * NR;
    // Panel rows, then the lane sums of each half, [TOKEN_BLOCK + MR][rows_pad][16] each.
    let ld = rows_pad * 16;
    let acc_len = (TOKEN_BLOCK + MR) * ld;
    if scratch.len() < count * plen + 2 * acc_len + 16 {
        scratch.resize(count * plen + 2 * acc_len + 16, 0.0);
    }
    let base = scratch.as_mut_ptr();
    // align_offset may answer usize::MAX (never for f32 on x86): the 16 spare floats cap it.
    let base = base.add(base.align_offset(64).min(16));
    // The task's weights come from memory (each is read once per product): ask for all their
    // lines at once rather than one miss after another as the decode walks them.
    for r in 0..count {
        let rb = super::row_bytes(w, n0 + r);
        for b in [rb.words, rb.scales, rb.biases] {
            for o in (0..b.len()).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(b.as_ptr().add(o) as *const i8);
            }
        }
    }
    let mut rs = RowScales::new(w);
    for r in 0..count {
        decode_row_lanes::<V>(w, n0 + r, xt, &mut rs, base.add(r * plen));
    }
    let panel = base as *const f32;
    let acc = [base.add(count * plen), base.add(count * plen + acc_len)];
    let mut tb = 0;
    while tb < xt.rows {
        let t_end = (tb + TOKEN_BLOCK).min(xt.rows);
        for h in 0..2 {
            let mut k0 = 0;
            while k0 < steps {
                let ks = K_STEPS.min(steps - k0);
                let last = k0 + ks == steps;
                let mut r = 0;
                while r < count {
                    let nr = NR.min(count - r);
                    let mut ws = [std::ptr::null::<f32>(); NR];
                    for (j, wp) in ws.iter_mut().enumerate() {
                        *wp = panel.add((r + j.min(nr - 1)) * plen + h * half + k0 * 16);
                    }
                    let mut t = tb;
                    while t < t_end {
                        let mr = MR.min(t_end - t);
                        let mut xs = [std::ptr::null::<f32>(); MR];
                        for (i, xp) in xs.iter_mut().enumerate() {
                            *xp = xt.ptr().add((t + i.min(mr - 1)) * plen + h * half + k0 * 16);
                        }
                        let at = (t - tb) * ld + r * 16;
                        let finish = (h == 1 && last).then(|| Finish { half0: acc[0].add(at), y: y.add(t * ldy + n0 + r), ldy, mr, nr });
                        micro::<V, MR, NR>(xs, ws, ks, acc[h].add(at), ld, k0 == 0, finish);
                        t += mr;
                    }
                    r += nr;
                }
                k0 += ks;
            }
        }
        tb = t_end;
    }
}

/// [`Transposed::write_row`] for 8 elements per word and whole 32-word chunks (`xr.len()` a
/// multiple of 256, `half = xr.len() / 2`): step `c·8 + e`, lane `l` of half `h` (at
/// `dst[h·half + (c·8 + e)·16 + l]`) is element `e` of word `32c + 16h + l`. Each 16 words
/// (128 floats, 8 registers) become their 8 steps in three rounds of two-register permutes.
/// Float `f = 8·word + e` starts in register `f >> 4` (word bits 3..1), lane `f & 15` (word bit
/// 0, then `e`); round `r` pairs the registers that differ in register bit `2 − r`, puts
/// element bit `2 − r` there and moves that word bit into the lanes, so that register `e` ends
/// with word `l` in lane `l`. Only moves: the floats are the same bits.
/// AVX-512 only (AVX2 keeps the scalar transpose).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")]
pub(crate) unsafe fn transpose8(dst: *mut f32, xr: &[f32], half: usize) {
    debug_assert!(xr.len().is_multiple_of(256) && half == xr.len() / 2);
    // Per round (register bit 2, 1, 0): the lanes of the pair's low and high outputs, as
    // indices into the pair (16 + lane for the high register).
    let idx = |t: [i32; 16]| _mm512_loadu_si512(t.as_ptr() as *const _);
    // Per round (register bit 2, 1, 0): the lanes of the pair's low and high outputs, as
    // indices into the pair (16 + lane for the high register).
    let (lo4, hi4) = (idx([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]), idx([4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]));
    let (lo2, hi2) = (idx([0, 1, 4, 5, 16, 17, 20, 21, 8, 9, 12, 13, 24, 25, 28, 29]), idx([2, 3, 6, 7, 18, 19, 22, 23, 10, 11, 14, 15, 26, 27, 30, 31]));
    let (lo1, hi1) = (idx([0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30]), idx([1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31]));
    // Registers a and b (a pair) become the pair's low and high outputs.
    #[inline(always)]
    unsafe fn pair(a: __m512, b: __m512, lo: __m512i, hi: __m512i) -> (__m512, __m512) {
        (_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b))
    }
    let mut src = xr.as_ptr();
    let mut out = dst;
    for _ in 0..xr.len() / 256 {
        for h in 0..2 {
            let v: [__m512; 8] = std::array::from_fn(|k| _mm512_loadu_ps(src.add(16 * k)));
            src = src.add(128);
            // Register bit 2: pairs (0, 4), (1, 5), (2, 6), (3, 7).
            let (a0, a4) = pair(v[0], v[4], lo4, hi4);
            let (a1, a5) = pair(v[1], v[5], lo4, hi4);
            let (a2, a6) = pair(v[2], v[6], lo4, hi4);
            let (a3, a7) = pair(v[3], v[7], lo4, hi4);
            // Register bit 1.
            let (b0, b2) = pair(a0, a2, lo2, hi2);
            let (b1, b3) = pair(a1, a3, lo2, hi2);
            let (b4, b6) = pair(a4, a6, lo2, hi2);
            let (b5, b7) = pair(a5, a7, lo2, hi2);
            // Register bit 0.
            let (c0, c1) = pair(b0, b1, lo1, hi1);
            let (c2, c3) = pair(b2, b3, lo1, hi1);
            let (c4, c5) = pair(b4, b5, lo1, hi1);
            let (c6, c7) = pair(b6, b7, lo1, hi1);
            let d = out.add(h * half);
            for (e, x) in [c0, c1, c2, c3, c4, c5, c6, c7].into_iter().enumerate() {
                _mm512_storeu_ps(d.add(16 * e), x);
            }
        }
        out = out.add(128);
    }
}

/// The entry points of one instruction set, each compiled with its target features.
macro_rules! isa_module {
    ($name:ident, $feat:literal, $v:ty, $rb:literal, $mr:literal, $nr:literal, $lut:literal) => {
        pub(crate) mod $name {
            use super::*;

            /// Rows per pass of the decode kernel, tokens × rows of the panel kernel.
            pub(crate) const MATVEC_ROWS: usize = $rb;
            pub(crate) const PANEL_ROWS: usize = $nr;

            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
                dot1::<$v>(a.as_ptr(), b.as_ptr(), a.len())
            }
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(crate) unsafe fn gdn(s: &mut [f32], dk: usize, k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
                gdn_rows::<$v>(s, dk, k, q, alpha, beta, v, o)
            }
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(crate) unsafe fn gdn_tokens(
                s: &mut [f32],
                dk: usize,
                k: &[f32],
                q: &[f32],
                alpha: &[f32],
                beta: &[f32],
                v: &[f32],
                v_stride: usize,
                o: &mut [f32],
                o_stride: usize,
            ) {
                super::gdn_tokens::<$v>(s, dk, k, q, alpha, beta, v, v_stride, o, o_stride)
            }
            /// `g` heads (1, 2, 4 or 8) of one KV group; false when `g` has no instance.
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(crate) unsafe fn attend_group(
                g: usize,
                q: &[f32],
                keys: &[f32],
                values: &[f32],
                p: usize,
                stride: usize,
                head_off: usize,
                buf: &mut Vec<f32>,
                out: &mut [f32],
            ) -> bool {
                match g {
                    1 => super::attend_group::<$v, 1>(q, keys, values, p, stride, head_off, buf, out),
                    2 => super::attend_group::<$v, 2>(q, keys, values, p, stride, head_off, buf, out),
                    4 => super::attend_group::<$v, 4>(q, keys, values, p, stride, head_off, buf, out),
                    8 => super::attend_group::<$v, 8>(q, keys, values, p, stride, head_off, buf, out),
                    _ => return false,
                }
                true
            }
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn silu(x: &mut [f32]) {
                silu_slice::<$v>(x)
            }
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
                super::swiglu::<$v>(g, u, out)
            }
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn gated_norm(o: &[f32], inv: f32, w: &[f32], z: &[f32], out: &mut [f32]) {
                super::gated_norm::<$v>(o, inv, w, z, out)
            }
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn sigmoid_mul(x: &mut [f32], g: &[f32]) {
                super::sigmoid_mul::<$v>(x, g)
            }
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn exp_shifted(s: &[f32], m: f32, out: &mut [f32]) {
                super::exp_shifted::<$v>(s, m, out)
            }
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
                super::rms_norm_row::<$v>(x, w, eps, out)
            }
            /// The conv + SiLU of [`crate::backend::cpu::kernels::gdn_conv`], its scalar FMAs
            /// compiled as the FMA instruction (the bits of the library call).
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(crate) unsafe fn gdn_conv(kc: usize, cd: usize, taps: &[f32], conv: &mut ColumnsMut<'_>, qkv: &[f32], t_len: usize, y: &mut ColumnsMut<'_>) {
                // Kernel size 4 (every Qwen3.5) in vectors of 16 channels; the rest as the
                // reference, vectorised by the compiler.
                let (ch0, ch1) = (conv.cols().start, conv.cols().end);
                let ch = if kc == 4 { super::gdn_conv16::<$v, 4>(cd, taps, conv, qkv, t_len, y) } else { ch0 };
                crate::backend::cpu::kernels::gdn_conv_taps(kc, cd, taps, &mut conv.sub(ch..ch1), qkv, t_len, &mut y.sub(ch..ch1));
                for t in 0..t_len {
                    silu_slice::<$v>(&mut y.row(t)[ch - ch0..]);
                }
            }
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn matmul(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize, panel: &mut Vec<f32>) {
                if xt.rows <= 4 {
                    if let Some(q) = Q4::of(w) {
                        if $lut {
                            let done = match xt.rows {
                                1 => q4_lut_matvec::<1, $rb>(&q, xt, y, ldy, n0, count, panel),
                                2 => q4_lut_matvec::<2, $rb>(&q, xt, y, ldy, n0, count, panel),
                                3 => q4_lut_matvec::<3, $rb>(&q, xt, y, ldy, n0, count, panel),
                                _ => q4_lut_matvec::<4, $rb>(&q, xt, y, ldy, n0, count, panel),
                            };
                            if done {
                                return;
                            }
                        }
                        return match xt.rows {
                            1 => q4_matvec::<$v, 1, $rb>(&q, xt, y, ldy, n0, count, panel),
                            2 => q4_matvec::<$v, 2, $rb>(&q, xt, y, ldy, n0, count, panel),
                            3 => q4_matvec::<$v, 3, $rb>(&q, xt, y, ldy, n0, count, panel),
                            _ => q4_matvec::<$v, 4, $rb>(&q, xt, y, ldy, n0, count, panel),
                        };
                    }
                }
                gemm::<$v, $mr, $nr>(w, xt, y, ldy, n0, count, panel)
            }
        }
    };
}

isa_module!(avx512, "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2", Z, 2, 4, 6, true);
isa_module!(avx2, "avx2,fma,f16c", Y2, 1, 2, 2, false);

#[cfg(test)]
mod tests {
    use super::*;

    /// `add` then `fold16_halved` (as the panel kernel folds) against the scalar halving fold,
    /// on lanes spanning 60 binary orders of magnitude with both signs (where a different
    /// pairing or order of the additions rounds differently), for both vector types.
    #[test]
    fn fold16_is_the_halving_fold() {
        unsafe fn check<V: V16>(seed: u64) {
            let mut s = seed;
            let mut next = || {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let m = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                m * f32::from_bits((((s >> 20) % 60) as u32 + 97) << 23)
            };
            let lanes: Vec<[f32; 32]> = (0..16).map(|_| std::array::from_fn(|_| next())).collect();
            let a: [V; 16] = std::array::from_fn(|k| V::load(lanes[k].as_ptr()));
            let b: [V; 16] = std::array::from_fn(|k| V::load(lanes[k].as_ptr().add(16)));
            let got = V::fold16_halved(&std::array::from_fn(|k| V::add(a[k], b[k])));
            let got8 = V::fold8_halved(&std::array::from_fn(|k| V::add(a[k + 8], b[k + 8])));
            for k in 0..8 {
                assert_eq!(got8[k].to_bits(), crate::numerics::fold_lanes(lanes[k + 8]).to_bits(), "fold8 output {k}");
            }
            for k in 0..16 {
                let want = crate::numerics::fold_lanes(lanes[k]);
                assert_eq!(got[k].to_bits(), want.to_bits(), "output {k}");
                assert_eq!(V::fold(a[k], b[k]).to_bits(), want.to_bits(), "fold {k}");
            }
        }
        #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
        unsafe fn check_z(seed: u64) {
            check::<Z>(seed)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn check_y2(seed: u64) {
            check::<Y2>(seed)
        }
        let z = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq");
        let y = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        for seed in 0..200 {
            if z {
                unsafe { check_z(seed) };
            }
            if y {
                unsafe { check_y2(seed) };
            }
        }
    }
}
