//! The arithmetic every backend shares: portable transcendental functions, the canonical
//! reduction order, and bf16/f16 widening.
//!
//! `docs/numerics.md` is the specification; this module is its executable form. Everything
//! here uses only IEEE-754 basic operations (`+ − × ÷ sqrt`, correctly rounded) and explicit
//! fused multiply-adds, so a CUDA kernel compiled with `--fmad=false` that performs the same
//! operations in the same order produces the same bits. No function calls the platform libm
//! for anything that reaches the logits.
//!
//! Constants are written with every decimal digit of their exact binary value (hence
//! `clippy::excessive_precision` is allowed here): the hex patterns beside them are what a
//! CUDA twin must reproduce.
#![allow(clippy::excessive_precision)]

/// Number of partial sums in every canonical reduction: one per lane of a CUDA warp.
pub const LANES: usize = 32;

/// `a·b + c` with one rounding (IEEE-754 fusedMultiplyAdd).
///
/// `f32::mul_add` lowers to the hardware instruction where the target has one and to a
/// correctly rounded software routine otherwise, so the result is the same everywhere.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

/// Folds 32 partial sums by halves: `p[i] += p[i + h]` for h = 16, 8, 4, 2, 1, returning `p[0]`.
///
/// This is the order of a CUDA warp's `__shfl_down_sync` tree and of two 16-lane AVX-512
/// registers added and then halved. Addition is commutative in IEEE arithmetic, so
/// `__shfl_xor_sync` trees give the same result in lane 0.
#[inline]
pub fn fold_lanes(mut p: [f32; LANES]) -> f32 {
    let mut h = LANES / 2;
    while h > 0 {
        for i in 0..h {
            p[i] += p[i + h];
        }
        h /= 2;
    }
    p[0]
}

/// Canonical dot product of `w` and `x` over `x.len()` elements, where weight elements are
/// stored `per_word` to a 32-bit word (8 for 4-bit, 4 for 8-bit, 2 for bf16/f16, 1 for f32).
///
/// Word `j` (elements `j·per_word .. (j+1)·per_word`) belongs to partial `j mod 32`; each
/// partial accumulates its elements in increasing index with `acc = fma(w[k], x[k], acc)`,
/// starting from +0.0; the partials are then folded with [`fold_lanes`]. `w(k)` returns the
/// decoded f32 weight of element `k`.
///
/// This scalar form is the reference the SIMD and CUDA implementations are tested against.
///
/// # Panics
/// If `x.len()` is not a multiple of `per_word` (a checked model never asks for that).
#[inline]
pub fn dot_ref(per_word: usize, x: &[f32], mut w: impl FnMut(usize) -> f32) -> f32 {
    assert!(per_word > 0 && x.len().is_multiple_of(per_word));
    let mut p = [0.0f32; LANES];
    for (j, word) in x.chunks_exact(per_word).enumerate() {
        let lane = j % LANES;
        for (e, &xv) in word.iter().enumerate() {
            p[lane] = fma(w(j * per_word + e), xv, p[lane]);
        }
    }
    fold_lanes(p)
}

/// Canonical dot product of two f32 vectors (activations with activations: attention scores,
/// the delta-rule products): [`dot_ref`] with one element per word, so element `k` goes to
/// partial `k mod 32`.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut p = [0.0f32; LANES];
    for (k, (&av, &bv)) in a.iter().zip(b).enumerate() {
        p[k % LANES] = fma(av, bv, p[k % LANES]);
    }
    fold_lanes(p)
}

/// Canonical sum of squares: `dot_f32(x, x)`.
#[inline]
pub fn sum_squares(x: &[f32]) -> f32 {
    dot_f32(x, x)
}

/// `1 / sqrt(v)` as two correctly rounded operations (not a hardware reciprocal estimate).
#[inline(always)]
pub fn rsqrt(v: f32) -> f32 {
    1.0 / v.sqrt()
}

// ---------------------------------------------------------------------------------------------
// Integer-exact products (docs/numerics.md §2.2)

/// Elements per activation block: one scale `d` per block of the input row.
pub const ACT_BLOCK: usize = 64;

/// The largest |xi| a block's scale aims at: 127·128², so `xi` splits into three int8 planes
/// (base-256 digits, the top one within ±32) and Σ q·xi over 64 elements of 4-bit codes fits i32.
pub const ACT_LEVELS: f32 = 2_080_768.0;

/// Chunks of the fold over a row's units: chunk `c` holds units `⌊c·U/8⌋ .. ⌊(c+1)·U/8⌋`.
pub const PRODUCT_CHUNKS: usize = 8;

/// The scale of one activation block: `max|x| / 127·128²` (an IEEE division); NaN when any
/// element is NaN, so a NaN reaches the outputs it feeds.
#[inline]
pub fn act_scale(block: &[f32]) -> f32 {
    if block.iter().any(|v| v.is_nan()) {
        return f32::NAN;
    }
    block.iter().fold(0.0f32, |m, &v| m.max(v.abs())) / ACT_LEVELS
}

/// An activation as an integer of its block: `round_half_even(x / d)` (an IEEE division) when
/// `d` is a normal number, else 0 (a block of zeros or of values below 2.4e-32, or a NaN or
/// infinite block, whose outputs [`unit_value`] then makes 0 or NaN). With a normal `d`,
/// |result| ≤ 2 080 768.
#[inline]
pub fn act_quant(x: f32, d: f32) -> i32 {
    if d.is_normal() {
        (x / d).round_ties_even() as i32
    } else {
        0
    }
}

/// The three int8 planes of `xi`: base-256 digits with the lower two in `-128..=127`, so
/// `xi = p0 + 256·p1 + 65536·p2` exactly.
#[inline]
pub fn act_planes(xi: i32) -> [i8; 3] {
    let p0 = ((xi + 128) & 255) - 128;
    let r1 = (xi - p0) >> 8;
    let p1 = ((r1 + 128) & 255) - 128;
    let p2 = (r1 - p1) >> 8;
    [p0 as i8, p1 as i8, p2 as i8]
}

/// Elements per unit of an affine product: the intersection of a weight group and an
/// activation block (`min(group_size, 64)`; group sizes are powers of two from 32).
#[inline]
pub fn unit_len(group_size: usize) -> usize {
    group_size.min(ACT_BLOCK)
}

/// One unit's value: `fma(s·d, f32(I), b·(d·f32(S)))`, with `I = Σ q·xi` and `S = Σ xi` exact
/// integers and every product rounded (integers to f32 round to nearest even).
#[inline]
pub fn unit_value(scale: f32, bias: f32, d: f32, i: i64, sum: i32) -> f32 {
    fma(scale * d, i as f32, bias * (d * sum as f32))
}

/// Units `start .. end` of chunk `c` of a row of `units` units.
#[inline]
pub fn chunk_units(units: usize, c: usize) -> (usize, usize) {
    (c * units / PRODUCT_CHUNKS, (c + 1) * units / PRODUCT_CHUNKS)
}

/// The fold of a row's unit values: each chunk sums its units in order from +0.0, and the
/// result sums the chunks in order from +0.0.
#[inline]
pub fn fold_units(units: usize, mut v: impl FnMut(usize) -> f32) -> f32 {
    let mut y = 0.0f32;
    for c in 0..PRODUCT_CHUNKS {
        let (a, b) = chunk_units(units, c);
        let mut acc = 0.0f32;
        for u in a..b {
            acc += v(u);
        }
        y += acc;
    }
    y
}

/// The integer-exact product of one affine weight row with `x` (numerics §2.2): `code(k)` is
/// the stored code of element `k`, `scale(g)` / `bias(g)` the widened scale and bias of group
/// `g`. The scalar reference every fast path (CPU SIMD, CUDA) is tested against.
///
/// # Panics
/// If `group_size` is not a multiple of 32 or does not divide `x.len()`.
pub fn dot_affine_int(group_size: usize, x: &[f32], code: impl Fn(usize) -> u32, scale: impl Fn(usize) -> f32, bias: impl Fn(usize) -> f32) -> f32 {
    assert!(group_size.is_multiple_of(32) && x.len().is_multiple_of(group_size));
    let ul = unit_len(group_size);
    let d: Vec<f32> = x.chunks(ACT_BLOCK).map(act_scale).collect();
    fold_units(x.len() / ul, |u| {
        let (k0, b) = (u * ul, u * ul / ACT_BLOCK);
        let (mut i, mut sum) = (0i64, 0i32);
        for (k, &xv) in x.iter().enumerate().skip(k0).take(ul) {
            let xi = act_quant(xv, d[b]);
            i += code(k) as i64 * xi as i64;
            sum += xi;
        }
        let g = k0 / group_size;
        unit_value(scale(g), bias(g), d[b], i, sum)
    })
}

// ---------------------------------------------------------------------------------------------
// exp

// The constants of `exp` are crate-visible so the vector forms (`backend::cpu::simd`) use the
// same values.
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split so that k·LN2_HI is exact for |k| < 2^9.
pub(crate) const LN2_HI: f32 = 0.693_145_751_953_125; // 0x3f317200
pub(crate) const LN2_LO: f32 = 1.428_606_765_330_187e-6; // 0x35bfbe8e
/// Above this, e^x overflows f32.
pub(crate) const EXP_MAX: f32 = 88.722_835;
/// Below this, e^x rounds to zero.
pub(crate) const EXP_MIN: f32 = -103.972_08;
/// Taylor coefficients 1/n! (n = 7 … 2) rounded to f32, highest first (Horner order).
pub(crate) const EXP_POLY: [f32; 6] = [1.984_127e-4, 1.388_888_9e-3, 8.333_333e-3, 4.166_666_8e-2, 0.166_666_67, 0.5];

/// `2^k` for `k` in `-126..=127`, built from its bit pattern.
#[inline(always)]
fn pow2i(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// e^x in f32, accurate to about 1 ulp, with the same bits on every platform.
///
/// Method: `x = k·ln2 + r` with `k = rint(x·log2 e)` and `r` computed by two FMAs against a
/// split ln 2 (`|r| ≤ 0.35`); `e^r` by a degree-7 Taylor polynomial in Horner form (FMAs);
/// the result is scaled by `2^k` in two exact steps so subnormal results round once.
/// `exp(0) = 1` exactly; overflow gives +inf, underflow +0, NaN propagates.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_MAX {
        return f32::INFINITY;
    }
    if x < EXP_MIN {
        return 0.0;
    }
    let kf = (x * LOG2E).round_ties_even();
    let r = fma(-kf, LN2_LO, fma(-kf, LN2_HI, x));
    // Taylor coefficients 1/n! rounded to f32 (1/7! … 1/2!, then 1, 1).
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = fma(p, r, c);
    }
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    let k = kf as i32;
    // Split 2^k into two factors that are both normal numbers.
    let k1 = k / 2;
    let k2 = k - k1;
    p * pow2i(k1) * pow2i(k2)
}

// ---------------------------------------------------------------------------------------------
// log

/// Natural logarithm in f32, accurate to about 1 ulp, with the same bits on every platform.
///
/// Method: `x = m·2^e` with `m ∈ [√½, √2)`, `f = m − 1`, `s = f/(2+f)`;
/// `ln(1+f) = f − (f²/2 − s·(f²/2 + R(s²)))` with `R` the odd-series remainder of
/// `2·atanh(s)` (coefficients of the classic single-precision minimax fit), then
/// `e·ln2` added in two parts. `log(1) = 0`, `log(0) = −inf`, negative or NaN gives NaN.
#[inline]
pub fn log(x: f32) -> f32 {
    if x.is_nan() || x < 0.0 {
        return f32::NAN;
    }
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    let mut x = x;
    let mut e: i32 = 0;
    if x < f32::MIN_POSITIVE {
        // Subnormal: scale into the normal range exactly.
        x *= 8_388_608.0; // 2^23
        e -= 23;
    }
    let bits = x.to_bits();
    e += ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000); // [1, 2)
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let f = m - 1.0; // exact (Sterbenz)
    let s = f / (2.0 + f);
    let z = s * s;
    let w = z * z;
    // Even and odd halves of the remainder polynomial, as in the classic single-precision log.
    let t1 = w * fma(w, 0.242_790_79, 0.400_009_72);
    let t2 = z * fma(w, 0.284_987_87, 0.666_666_6);
    let r = t2 + t1;
    let hfsq = 0.5 * f * f;
    let ef = e as f32;
    // ln x = e·ln2_hi + (f − (hfsq − (s·(hfsq + r) + e·ln2_lo)))
    let lo = fma(ef, LN2_LO, s * (hfsq + r));
    fma(ef, LN2_HI, f - (hfsq - lo))
}

/// `ln(1 + y)` for `y ≥ 0`, accurate where `y` is tiny (used by [`softplus`]).
///
/// Method (Goldberg): `u = 1 + y`; if `u == 1` the answer is `y`, else `log(u) · (y / (u − 1))`,
/// which cancels the rounding error of `1 + y`.
#[inline]
pub fn log1p(y: f32) -> f32 {
    let u = 1.0 + y;
    if u == 1.0 {
        y
    } else {
        log(u) * (y / (u - 1.0))
    }
}

/// `ln(1 + e^x)`; `x` itself above 20 (the threshold transformers' `F.softplus` uses).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        log1p(exp(x))
    }
}

/// Logistic sigmoid `1 / (1 + e^−x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// SiLU (swish) `x / (1 + e^−x)`: one division instead of `x · sigmoid(x)`'s two roundings.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

// ---------------------------------------------------------------------------------------------
// 16-bit floats

/// Widens a bfloat16 bit pattern to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Widens an IEEE half bit pattern to f32 (exact).
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Rounds an f32 to the nearest bfloat16 (ties to even; NaN stays NaN). Used to write
/// checkpoints, never on the inference path.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

// ---------------------------------------------------------------------------------------------
// Deterministic f64 functions for tables computed once on the host (RoPE angles).

/// e^x in f64 by range reduction and a degree-13 Taylor polynomial; our own so the RoPE table
/// does not depend on the platform's libm.
pub fn exp_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x > 709.0 {
        return f64::INFINITY;
    }
    if x < -708.0 {
        return 0.0;
    }
    const LN2_HI: f64 = 6.931_471_803_691_238_164_9e-1; // 0x3fe62e42fee00000
    const LN2_LO: f64 = 1.908_214_929_270_587_700_0e-10; // 0x3dea39ef35793c76
    let k = (x * std::f64::consts::LOG2_E).round_ties_even();
    let r = (-k).mul_add(LN2_LO, (-k).mul_add(LN2_HI, x));
    let mut p = 0.0f64;
    let mut fact = [0.0f64; 14];
    fact[0] = 1.0;
    for n in 1..14 {
        fact[n] = fact[n - 1] * n as f64;
    }
    for n in (0..14).rev() {
        p = p.mul_add(r, 1.0 / fact[n]);
    }
    let k = k as i64;
    let scale = f64::from_bits(((k + 1023) as u64) << 52);
    p * scale
}

/// Natural logarithm in f64 for normal positive `x` (atanh series); our own, see [`exp_f64`].
pub fn log_f64(x: f64) -> f64 {
    assert!(x > 0.0 && x.is_finite() && x >= f64::MIN_POSITIVE);
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let z = s * s;
    // 2·atanh(s) = 2(s + s³/3 + s⁵/5 + …), |s| < 0.172 so 20 terms reach 1e-31.
    let mut p = 0.0f64;
    for n in (0..20).rev() {
        p = p.mul_add(z, 1.0 / (2 * n + 1) as f64);
    }
    (e as f64).mul_add(std::f64::consts::LN_2, 2.0 * s * p)
}

/// `(sin x, cos x)` in f64 for `|x| < 2^30`: Cody–Waite reduction by π/2 in three parts, then
/// Taylor polynomials on `|r| ≤ π/4`. Our own, see [`exp_f64`].
pub fn sin_cos_f64(x: f64) -> (f64, f64) {
    assert!(x.is_finite() && x.abs() < 1.0e9);
    // π/2 = P1 + P2 + P3, P1 and P2 with 33 significant bits so k·P1, k·P2 are exact for |k| < 2^20.
    const P1: f64 = 1.570_796_326_734_125_614_166; // 0x3ff921fb54400000
    const P2: f64 = 6.077_100_506_303_965_976_6e-11; // 0x3dd0b4611a600000
    const P3: f64 = 2.022_266_248_795_950_732_4e-21; // 0x3ba3198a2e037073
    let k = (x * std::f64::consts::FRAC_2_PI).round_ties_even();
    let r = (-k).mul_add(P3, (-k).mul_add(P2, (-k).mul_add(P1, x)));
    let z = r * r;
    // sin r = r·Σ (−1)^n z^n/(2n+1)!, cos r = Σ (−1)^n z^n/(2n)!, to n = 11.
    let mut s = 0.0f64;
    let mut c = 0.0f64;
    for n in (0..12).rev() {
        let mut fs = 1.0f64; // (2n+1)!
        for i in 1..=(2 * n + 1) {
            fs *= i as f64;
        }
        let fc = fs / (2 * n + 1) as f64; // (2n)!
        let sign = if n % 2 == 0 { 1.0 } else { -1.0 };
        s = s.mul_add(z, sign / fs);
        c = c.mul_add(z, sign / fc);
    }
    let sin_r = r * s;
    let cos_r = c;
    match (k as i64).rem_euclid(4) {
        0 => (sin_r, cos_r),
        1 => (cos_r, -sin_r),
        2 => (-sin_r, -cos_r),
        _ => (-cos_r, sin_r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between an f32 and an f64 reference.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w {
            return 0.0;
        }
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        ((got as f64) - want).abs() / ulp
    }

    fn sweep(lo: f32, hi: f32, n: usize) -> impl Iterator<Item = f32> {
        (0..=n).map(move |i| lo + (hi - lo) * (i as f32 / n as f32))
    }

    #[test]
    fn exp_is_within_two_ulp_of_f64_over_its_range() {
        let mut worst = 0.0f64;
        for x in sweep(-87.0, 88.0, 200_000) {
            worst = worst.max(ulps(exp(x), (x as f64).exp()));
        }
        assert!(worst <= 2.0, "worst exp error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn exp_handles_subnormal_results() {
        for x in sweep(-103.0, -87.5, 10_000) {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            // Subnormals have an absolute spacing of 2^-149.
            assert!((got - want).abs() <= 2.0 * 1.401_298_5e-45, "exp({x}) = {got}, want {want}");
        }
    }

    #[test]
    fn log_is_within_two_ulp_of_f64() {
        let mut worst = 0.0f64;
        for x in sweep(1e-30, 10.0, 100_000).chain(sweep(0.5, 2.0, 100_000)).chain(sweep(10.0, 3e38, 50_000)) {
            if x <= 0.0 {
                continue;
            }
            worst = worst.max(ulps(log(x), (x as f64).ln()));
        }
        assert!(worst <= 2.0, "worst log error {worst} ulp");
        assert_eq!(log(1.0), 0.0);
        assert_eq!(log(0.0), f32::NEG_INFINITY);
        assert!(log(-1.0).is_nan());
        let sub = 1.0e-40f32;
        assert!(ulps(log(sub), (sub as f64).ln()) <= 2.0);
    }

    #[test]
    fn softplus_sigmoid_silu_match_f64() {
        for x in sweep(-30.0, 30.0, 60_001) {
            let xd = x as f64;
            let sp = if xd > 20.0 { xd } else { xd.exp().ln_1p() };
            assert!(ulps(softplus(x), sp) <= 4.0, "softplus({x})");
            let sg = 1.0 / (1.0 + (-xd).exp());
            assert!(ulps(sigmoid(x), sg) <= 3.0, "sigmoid({x})");
            let sl = xd / (1.0 + (-xd).exp());
            assert!(ulps(silu(x), sl) <= 3.0, "silu({x})");
        }
    }

    #[test]
    fn fold_order_is_halving() {
        // Values chosen so that any other pairing rounds differently.
        let mut p = [0.0f32; LANES];
        p[0] = 1.0e8;
        p[16] = -1.0e8;
        p[1] = 1.0;
        p[8] = 3.0;
        p[24] = 0.5;
        // Halving: p0+p16 = 0; p8+p24 = 3.5; then p0 += p8 → 3.5; p1 stays 1 → total 4.5.
        assert_eq!(fold_lanes(p), 4.5);
        let mut q = [0.0f32; LANES];
        q[0] = 16_777_216.0; // 2^24
        q[1] = 1.0;
        q[2] = 1.0;
        // (q0 + q2) first rounds 2^24 + 1 to 2^24; then + q1 rounds again: 2^24. A left-to-right
        // sum (q0 + q1) + q2 gives the same here, but q2 + q1 first would give 2^24 + 2.
        assert_eq!(fold_lanes(q), 16_777_216.0);
    }

    #[test]
    fn dot_ref_assigns_words_to_lanes() {
        // 8 elements per word, 64 words: word j goes to lane j % 32.
        let mut x = vec![0.0f32; 8 * 64];
        x[0] = 1.0e8; // word 0, lane 0
        x[1] = 1.0; // word 0, lane 0: absorbed by 1e8 (spacing 8)
        x[128] = 5.0; // word 16, lane 16
        x[256] = -1.0e8; // word 32, lane 0 again
                         // lane 0: ((1e8 + 1) − 1e8) = 0; lane 16: 5; fold: 5.
        assert_eq!(dot_ref(8, &x, |_| 1.0), 5.0);
        // Element-wise lanes (k % 32) put 1, 5 and −1e8 all with 1e8 or beside it:
        // lane 0: ((1e8 + 5) − 1e8) = 8 (1e8 + 5 rounds to 1e8 + 8), lane 1: 1; fold: 9.
        assert_eq!(dot_f32(&x, &vec![1.0; x.len()]), 9.0);
    }

    #[test]
    fn f64_helpers_are_accurate() {
        for i in 0..1000 {
            let x = -700.0 + 1.4 * i as f64;
            let rel = (exp_f64(x) - x.exp()).abs() / x.exp();
            assert!(rel < 1e-15, "exp_f64({x})");
        }
        for i in 1..1000 {
            let x = i as f64 * 12345.678;
            assert!((log_f64(x) - x.ln()).abs() < 1e-14 * x.ln().abs().max(1.0));
        }
        for i in 0..10_000 {
            let x = i as f64 * 26.2144 - 1000.0;
            let (s, c) = sin_cos_f64(x);
            assert!((s - x.sin()).abs() < 1e-13, "sin({x})");
            assert!((c - x.cos()).abs() < 1e-13, "cos({x})");
        }
    }

    #[test]
    fn act_planes_rebuild_every_integer_in_range() {
        for xi in (-2_080_768..=2_080_768).step_by(97).chain([-2_080_768, -1, 0, 1, 127, 128, -129, 32767, 2_080_768]) {
            let [p0, p1, p2] = act_planes(xi);
            assert_eq!(p0 as i32 + 256 * p1 as i32 + 65536 * p2 as i32, xi);
            assert!((-32..=32).contains(&p2), "{xi}: top plane {p2}");
        }
    }

    #[test]
    fn act_quant_stays_in_range_and_zeroes_blocks_without_a_normal_scale() {
        let block: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 1.37e3).collect();
        let d = act_scale(&block);
        let q: Vec<i32> = block.iter().map(|&x| act_quant(x, d)).collect();
        assert!(q.iter().all(|v| v.abs() <= 2_080_768) && q.iter().any(|v| v.abs() == 2_080_768));
        assert_eq!(act_quant(1e-33, act_scale(&[1e-33, -2e-33])), 0); // subnormal scale
        assert!(act_scale(&[1.0, f32::NAN]).is_nan());
        assert_eq!(act_quant(1.0, f32::INFINITY), 0);
    }

    /// Against the exact value in f64, with one element 1000× its block's others.
    #[test]
    fn dot_affine_int_is_within_the_activation_rounding() {
        let n = 256;
        let x: Vec<f64> = (0..n).map(|i| if i == 70 { 900.0 } else { ((i * 37 % 101) as f64 - 50.0) / 55.0 }).collect();
        let codes: Vec<u32> = (0..n).map(|i| (i * 7 % 16) as u32).collect();
        let (s, b) = (|g: usize| 0.01 + 0.001 * g as f32, |g: usize| -0.08 + 0.002 * g as f32);
        let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let got = dot_affine_int(64, &xf, |k| codes[k], s, b) as f64;
        let exact: f64 = (0..n).map(|k| (s(k / 64) as f64 * codes[k] as f64 + b(k / 64) as f64) * xf[k] as f64).sum();
        let scale: f64 = (0..n).map(|k| ((s(k / 64) as f64 * codes[k] as f64 + b(k / 64) as f64) * xf[k] as f64).abs()).sum();
        // Each activation is off by at most half a step of max|x|/2 080 768 in its block; the
        // block with the outlier carries that outlier's step.
        assert!((got - exact).abs() <= 1e-5 * scale, "got {got}, exact {exact}");
    }
}
