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

use super::columns::ColumnsMut;
#[cfg(test)]
use crate::model::weights::FloatType;
use crate::model::weights::{Matrix, MatrixData};

/// An instruction set the CPU kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Isa {
    /// Plain Rust, any CPU.
    #[default]
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
///
/// Lane `l` of the canonical order (numerics §2) is lane `l mod 16` of half `l / 16`; a row is
/// stored half-major, `[half][step][16]`, where step `c·E + e` holds element `e` of the words
/// `32c + 16·half + (0..16)`. A kernel that runs one half at a time (one accumulator per
/// output) then streams contiguous memory. Lanes past the last word are -0.0 (see `write_row`).
#[derive(Clone, Debug, Default)]
pub struct Transposed {
    /// Elements per word of the weights this was made for.
    pub per_word: usize,
    /// Words per row (`cols / per_word`).
    pub words: usize,
    /// 32-word chunks per row (the last may be partial).
    pub chunks: usize,
    pub rows: usize,
    /// `[rows][stride]` from `data[off]`, each row `[2][steps][16]` then padding; `off` puts
    /// the rows on 64-byte boundaries (whole-line vector loads; a load split across two lines
    /// costs two).
    data: Vec<f32>,
    off: usize,
}

impl Transposed {
    /// Transposes `rows` rows of `x` (`[rows, cols]`) for weights with `per_word` elements per word.
    pub fn new(x: &[f32], rows: usize, cols: usize, per_word: usize) -> Self {
        let mut t = Self::default();
        t.fill(x, rows, cols, per_word);
        t
    }

    /// [`Transposed::new`] into this buffer (no allocation once it is large enough).
    pub fn fill(&mut self, x: &[f32], rows: usize, cols: usize, per_word: usize) {
        self.shape(rows, cols, per_word);
        let (stride, off, half) = (self.stride(), self.off, self.half());
        for t in 0..rows {
            Self::write_row(&mut self.data[off + t * stride..off + (t + 1) * stride], &x[t * cols..(t + 1) * cols], per_word, half);
        }
    }

    /// Sets the shape for `rows` rows of `cols` columns and `per_word` elements per word, with
    /// room for the rows (their contents are left for [`Transposed::fill_rows`]).
    pub fn shape(&mut self, rows: usize, cols: usize, per_word: usize) {
        let words = cols / per_word;
        let chunks = words.div_ceil(32);
        *self = Self { per_word, words, chunks, rows, data: std::mem::take(&mut self.data), off: 0 };
        let need = rows * self.stride() + 16;
        if self.data.len() < need {
            self.data.resize(need, 0.0);
        }
        self.off = self.data.as_ptr().align_offset(64).min(16);
    }

    /// Writes rows `t0..t1` from `x` (`[rows, cols]`) into a buffer [`Transposed::shape`]d for
    /// them, through `base` = [`Transposed::base_mut`].
    ///
    /// # Safety
    /// `base` must come from this buffer after its last `shape`, and no other thread may
    /// access rows `t0..t1` meanwhile (other rows may be written concurrently).
    pub unsafe fn fill_rows(&self, isa: Isa, base: *mut f32, x: &[f32], cols: usize, t0: usize, t1: usize) {
        let stride = self.stride();
        for t in t0..t1 {
            // SAFETY: row t lies inside the buffer (`shape`) and is this caller's alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(t * stride), stride) };
            Self::write_row_isa(isa, dst, &x[t * cols..(t + 1) * cols], self.per_word, self.half());
        }
    }

    /// [`Transposed::write_row`] with the instruction set's permutes when every 32-word chunk
    /// is whole (the same floats moved to the same places; tested equal).
    fn write_row_isa(isa: Isa, dst: &mut [f32], xr: &[f32], per_word: usize, half: usize) {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 && per_word == 8 && xr.len().is_multiple_of(32 * 8) {
            assert!(dst.len() >= 2 * half && half == xr.len() / 2);
            // SAFETY: AVX-512 was detected; the sizes are checked above.
            unsafe { x86::transpose8(dst.as_mut_ptr(), xr, half) };
            dst[2 * half..].fill(-0.0);
            return;
        }
        let _ = isa;
        Self::write_row(dst, xr, per_word, half)
    }

    /// The first row's first float, for [`Transposed::fill_rows`].
    pub fn base_mut(&mut self) -> *mut f32 {
        self.data[self.off..].as_mut_ptr()
    }

    /// One row `xr` into lane order in `dst` (one row's stride): lanes past the last word -0.0.
    /// A kernel that runs every lane multiplies them by its padding weights, which are +0.0
    /// (masked loads, the panel's zeros): the product is -0.0, and `a + (-0.0) = a` for every
    /// `a` (a +0.0 product would turn a -0.0 lane into +0.0). So those lanes stay exactly as
    /// the reference, which never touches them, leaves them.
    fn write_row(dst: &mut [f32], xr: &[f32], per_word: usize, half: usize) {
        dst.fill(-0.0);
        for (c, block) in xr.chunks(32 * per_word).enumerate() {
            for (lane, word) in block.chunks_exact(per_word).enumerate() {
                let base = (lane / 16) * half + c * per_word * 16 + lane % 16;
                for (e, &v) in word.iter().enumerate() {
                    dst[base + e * 16] = v;
                }
            }
        }
    }

    /// 32-lane steps per row (`chunks · per_word`).
    pub fn steps(&self) -> usize {
        self.chunks * self.per_word
    }

    /// Floats of one half of a row (`steps · 16`).
    pub fn half(&self) -> usize {
        self.steps() * 16
    }

    /// Floats from one row to the next: both halves, rounded up to an odd number of 64-byte
    /// lines so that rows (and the panel rows laid out alike) fall on different L1 sets instead
    /// of all 4 KiB apart.
    pub fn stride(&self) -> usize {
        ((2 * self.steps()) | 1) * 16
    }

    /// Offset within a row of lane `lane` (0..32) of step `step`.
    #[inline(always)]
    pub fn offset(&self, step: usize, lane: usize) -> usize {
        (lane / 16) * self.half() + step * 16 + lane % 16
    }

    fn row(&self, t: usize) -> &[f32] {
        let stride = self.stride();
        &self.data[self.off + t * stride..self.off + (t + 1) * stride]
    }

    /// The first row's first float (64-byte aligned when the allocation allows).
    pub fn ptr(&self) -> *const f32 {
        self.data[self.off..].as_ptr()
    }
}

/// Rows per task the matrix product of `tokens` tokens prefers (its kernel's row block), so
/// tasks split no block.
pub fn row_granule(isa: Isa, tokens: usize) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            if tokens <= 4 {
                x86::avx512::MATVEC_ROWS
            } else {
                x86::avx512::PANEL_ROWS
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            if tokens <= 4 {
                x86::avx2::MATVEC_ROWS
            } else {
                x86::avx2::PANEL_ROWS
            }
        }
        _ => 1,
    }
}

/// `y[t][n] = W[n] · x[t]` for `n in n0 .. n0 + count`, `t < xt.rows`, with the given ISA.
/// `y` points at a `[rows, ldy]` buffer; `panel` is scratch. Every ISA gives the bits of the
/// portable reference.
///
/// # Safety
/// `y` must be valid for writes of `xt.rows · ldy` floats, `n0 + count ≤ min(ldy, w.rows)`, and
/// no other thread may access elements `(t, n0..n0+count)` meanwhile (other columns may be
/// written concurrently: that is how the pool splits a product).
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(isa: Isa, w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize, panel: &mut Vec<f32>) {
    debug_assert_eq!(xt.per_word, w.elems_per_word());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only produced when the CPU reports these features.
        Isa::Avx512 => unsafe { x86::avx512::matmul(w, xt, y, ldy, n0, count, panel) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above for AVX2, FMA and F16C.
        Isa::Avx2 => unsafe { x86::avx2::matmul(w, xt, y, ldy, n0, count, panel) },
        _ => matmul_portable(w, xt, y, ldy, n0, count, panel),
    }
}

/// Dispatches `$f(args)` to the instruction set's module, or evaluates `$portable`.
macro_rules! dispatch {
    ($isa:expr, $ok:expr, $f:ident($($a:expr),*), $portable:expr) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the ISA was detected at run time; `$ok` checks the kernel's shape rules.
            Isa::Avx512 if $ok => unsafe { x86::avx512::$f($($a),*) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 if $ok => unsafe { x86::avx2::$f($($a),*) },
            _ => $portable,
        }
    };
}

/// Asks the cache for the lines of `x` (a hint: no effect on any value; nothing off x86-64).
#[inline(always)]
pub fn prefetch(x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..x.len()).step_by(16) {
        // SAFETY: a prefetch reads nothing architecturally; the address lies inside `x`.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(x.as_ptr().add(i) as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Canonical dot of two f32 vectors (numerics §2 with one element per word).
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    dispatch!(isa, a.len().is_multiple_of(32), dot(a, b), crate::numerics::dot_f32(a, b))
}

/// The delta rule of one value head (numerics §4 step 4): `s` is its `[dv, dk]` state (row `j`
/// is `S[:, j]`), `k`/`q` the normalised key and query (`dk`), `v` the values (`dv`); writes
/// `o` (`dv`). The bits of [`super::kernels::gdn_rows_ref`] on every ISA.
#[allow(clippy::too_many_arguments)]
pub fn gdn_rows(isa: Isa, s: &mut [f32], k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
    let dk = k.len();
    assert!(s.len() == dk * o.len() && q.len() == dk && v.len() == o.len());
    dispatch!(isa, dk.is_multiple_of(32), gdn(s, dk, k, q, alpha, beta, v, o), super::kernels::gdn_rows_ref(s, k, q, alpha, beta, v, o))
}

/// The delta rule of one value head for `n = alpha.len()` consecutive tokens (numerics §4 step
/// 4, token after token): `s` is the head's `[dv, dk]` state, token `t` reads its normalised key
/// and query at `k[t·dk..]`, `q[t·dk..]`, gates `alpha[t]`, `beta[t]` and values
/// `v[t·v_stride..][..dv]`, and writes `o[t·o_stride..][..dv]`. The bits of
/// [`super::kernels::gdn_rows_ref`] applied token after token on every ISA; the fast paths run
/// each block of state rows through all `n` tokens while it stays in L1 (every row's update
/// reads only that row and the token's inputs).
#[allow(clippy::too_many_arguments)]
pub fn gdn_rows_tokens(isa: Isa, s: &mut [f32], dk: usize, k: &[f32], q: &[f32], alpha: &[f32], beta: &[f32], v: &[f32], v_stride: usize, o: &mut [f32], o_stride: usize) {
    let n = alpha.len();
    if n == 0 {
        return;
    }
    let dv = s.len() / dk;
    assert!(s.len() == dk * dv && beta.len() == n && k.len() >= n * dk && q.len() >= n * dk);
    assert!(o_stride >= dv && v.len() >= (n - 1) * v_stride + dv && o.len() >= (n - 1) * o_stride + dv);
    dispatch!(isa, dk.is_multiple_of(32), gdn_tokens(s, dk, k, q, alpha, beta, v, v_stride, o, o_stride), {
        for t in 0..n {
            let (kt, qt) = (&k[t * dk..(t + 1) * dk], &q[t * dk..(t + 1) * dk]);
            super::kernels::gdn_rows_ref(s, kt, qt, alpha[t], beta[t], &v[t * v_stride..t * v_stride + dv], &mut o[t * o_stride..t * o_stride + dv]);
        }
    })
}

/// Attention of `g` query heads sharing one KV head (at `head_off`) at position `p`: `q` is
/// `[g][dh]`, `out` `[g][dh]`. Each head gets the bits of [`super::kernels::attend`]; the fast
/// paths read every key and value row once for the group. `buf` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(isa: Isa, g: usize, q: &[f32], keys: &[f32], values: &[f32], p: usize, stride: usize, head_off: usize, buf: &mut Vec<f32>, out: &mut [f32]) {
    assert!(g > 0 && q.len().is_multiple_of(g) && out.len() == q.len());
    let dh = q.len() / g;
    assert!(head_off + dh <= stride && keys.len() >= (p + 1) * stride && values.len() >= (p + 1) * stride);
    let done = dispatch!(isa, dh.is_multiple_of(32), attend_group(g, q, keys, values, p, stride, head_off, buf, out), false);
    if !done {
        for h in 0..g {
            super::kernels::attend(&q[h * dh..(h + 1) * dh], keys, values, p, stride, head_off, buf, &mut out[h * dh..(h + 1) * dh]);
        }
    }
}

/// `x[i] = silu(x[i])`.
pub fn silu(isa: Isa, x: &mut [f32]) {
    dispatch!(isa, true, silu(x), x.iter_mut().for_each(|v| *v = crate::numerics::silu(*v)))
}

/// `out[i] = silu(g[i]) · u[i]` (spec M1).
pub fn swiglu(isa: Isa, g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == out.len() && u.len() == out.len());
    dispatch!(isa, true, swiglu(g, u, out), {
        for ((o, &gv), &uv) in out.iter_mut().zip(g).zip(u) {
            *o = crate::numerics::silu(gv) * uv;
        }
    })
}

/// `out[j] = ((o[j] · inv) · w[j]) · silu(z[j])` (numerics §4 step 5).
pub fn gated_norm(isa: Isa, o: &[f32], inv: f32, w: &[f32], z: &[f32], out: &mut [f32]) {
    assert!(o.len() == out.len() && w.len() == out.len() && z.len() == out.len());
    dispatch!(isa, true, gated_norm(o, inv, w, z, out), {
        for j in 0..out.len() {
            out[j] = ((o[j] * inv) * w[j]) * crate::numerics::silu(z[j]);
        }
    })
}

/// `x[d] = x[d] · sigmoid(g[d])` (the attention output gate).
pub fn sigmoid_mul(isa: Isa, x: &mut [f32], g: &[f32]) {
    assert_eq!(x.len(), g.len());
    dispatch!(isa, true, sigmoid_mul(x, g), x.iter_mut().zip(g).for_each(|(v, &gv)| *v *= crate::numerics::sigmoid(gv)))
}

/// `out[i] = exp(s[i] − m)`.
pub fn exp_shifted(isa: Isa, s: &[f32], m: f32, out: &mut [f32]) {
    assert_eq!(s.len(), out.len());
    dispatch!(isa, true, exp_shifted(s, m, out), s.iter().zip(out.iter_mut()).for_each(|(&v, o)| *o = crate::numerics::exp(v - m)))
}

/// RMSNorm of one row (numerics §3); the bits of [`super::kernels::rms_norm_row`].
pub fn rms_norm_row(isa: Isa, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert!(x.len() == w.len() && x.len() == out.len());
    dispatch!(isa, true, rms_norm_row(x, w, eps, out), super::kernels::rms_norm_row(x, w, eps, out))
}

/// The GDN conv + SiLU of channels `conv.cols()` (see [`super::kernels::gdn_conv`]).
#[allow(clippy::too_many_arguments)]
pub fn gdn_conv(isa: Isa, kc: usize, cd: usize, taps: &[f32], mut conv: ColumnsMut<'_>, qkv: &[f32], t_len: usize, mut y: ColumnsMut<'_>) {
    let ch1 = conv.cols().end;
    assert!(kc >= 1 && conv.cols() == y.cols() && ch1 <= cd && taps.len() >= ch1 * kc && conv.rows() >= kc - 1 && qkv.len() >= t_len * cd && y.rows() >= t_len);
    // The vector paths address the window and y with raw pointers, rows `cd` apart.
    assert!(conv.stride() == cd && y.stride() == cd, "gdn_conv: rows of {} and {} floats, not {cd}", conv.stride(), y.stride());
    dispatch!(isa, true, gdn_conv(kc, cd, taps, &mut conv, qkv, t_len, &mut y), {
        super::kernels::gdn_conv_taps(kc, cd, taps, &mut conv, qkv, t_len, &mut y);
        for t in 0..t_len {
            y.row(t).iter_mut().for_each(|v| *v = crate::numerics::silu(*v));
        }
    })
}

/// Decodes row `n` of `w` into the lane order of `xt` ([`Transposed`]): element
/// `(32c + lane)·E + e` at `xt.offset(c·E + e, lane)` (0 past the last word).
pub fn decode_panel_row(w: &Matrix, n: usize, xt: &Transposed, row: &mut Vec<f32>, panel: &mut [f32]) {
    let per_word = w.elems_per_word();
    row.resize(w.cols, 0.0);
    w.decode_row(n, row);
    panel.fill(0.0);
    for j in 0..w.cols / per_word {
        let (c, lane) = (j / 32, j % 32);
        for e in 0..per_word {
            panel[xt.offset(c * per_word + e, lane)] = row[j * per_word + e];
        }
    }
}

/// The reference loop over the transposed layout (the same arithmetic as
/// [`super::kernels::dot_decoded`], in the layout the SIMD paths use).
unsafe fn matmul_portable(w: &Matrix, xt: &Transposed, y: *mut f32, ldy: usize, n0: usize, count: usize, scratch: &mut Vec<f32>) {
    let e_n = xt.per_word;
    scratch.clear();
    scratch.resize(xt.stride(), 0.0);
    let mut row = Vec::new();
    for n in n0..n0 + count {
        decode_panel_row(w, n, xt, &mut row, scratch);
        let panel = &scratch[..];
        for t in 0..xt.rows {
            let x = xt.row(t);
            let mut p = [0.0f32; 32];
            for c in 0..xt.chunks {
                let lanes = (xt.words - c * 32).min(32);
                for e in 0..e_n {
                    for (l, acc) in p.iter_mut().enumerate().take(lanes) {
                        let o = xt.offset(c * e_n + e, l);
                        *acc = crate::numerics::fma(panel[o], x[o], *acc);
                    }
                }
            }
            *y.add(t * ldy + n) = crate::numerics::fold_lanes(p);
        }
    }
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
            RowBytes { words: &weight.as_slice()[n * wb..(n + 1) * wb], scales: &scales.as_slice()[n * sb..(n + 1) * sb], biases: &biases.as_slice()[n * sb..(n + 1) * sb] }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::cpu::kernels::dot_decoded;
    use crate::checkpoint::Bytes;

    /// A small deterministic generator for test data (SplitMix64), shared with `intdot`'s tests.
    pub(crate) struct Rng(pub(crate) u64);
    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        pub(crate) fn f(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
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
        let formats = [
            (4u32, 32usize, FloatType::BF16),
            (4, 64, FloatType::BF16),
            (4, 128, FloatType::BF16),
            (4, 16, FloatType::BF16),
            (4, 64, FloatType::F16),
            (4, 32, FloatType::F32),
            (4, 64, FloatType::F32),
            (4, 256, FloatType::BF16),
            (8, 32, FloatType::BF16),
            (8, 64, FloatType::BF16),
        ];
        for (bits, gs, sdt) in formats {
            if !cols.is_multiple_of(gs) {
                continue;
            }
            let groups = cols / gs;
            // Misaligned views (offset 3) like MLX files.
            let mut wb = vec![0u8; 3];
            wb.extend(rng.bytes(rows * cols * bits as usize / 8));
            let mut sb = vec![0u8; 1];
            sb.extend(rng.floats(rows * groups, sdt));
            let bb = rng.floats(rows * groups, sdt);
            let slice = |mut b: Vec<u8>, skip: usize| {
                b.drain(..skip);
                Bytes::from_vec(b)
            };
            v.push(Matrix {
                name: format!("affine{bits}g{gs}{sdt:?}"),
                rows,
                cols,
                data: MatrixData::Affine { bits, group_size: gs, weight: slice(wb, 3), scales: slice(sb, 1), biases: Bytes::from_vec(bb), scale_dtype: sdt },
            });
        }
        for ft in [FloatType::BF16, FloatType::F16, FloatType::F32] {
            v.push(Matrix { name: format!("{ft:?}"), rows, cols, data: MatrixData::Float { dtype: ft, data: Bytes::from_vec(rng.floats(rows * cols, ft)) } });
        }
        v
    }

    #[test]
    fn every_isas_transpose_is_the_scalar_one() {
        // Every float a distinct bit pattern (so a float in the wrong place shows), -0.0 and
        // NaN payloads among them; the destination starts as a pattern no path writes, so a
        // place left unwritten shows too. Whole chunks (the vector path: 1, 2, 4, 7 chunks)
        // and partial ones (the scalar path), every element width.
        let mut rng = Rng(23);
        for per_word in [8usize, 4, 2, 1] {
            for words in [32usize, 64, 128, 224, 40, 16, 100] {
                let cols = words * per_word;
                let mut xr: Vec<f32> = (0..cols).map(|_| f32::from_bits(rng.next() as u32)).collect();
                xr[cols / 3] = -0.0;
                let mut t = Transposed::default();
                t.shape(1, cols, per_word);
                let (stride, half) = (t.stride(), t.half());
                let mut want = vec![f32::from_bits(0x7fc0_1234); stride];
                Transposed::write_row(&mut want, &xr, per_word, half);
                for isa in Isa::available() {
                    let mut got = vec![f32::from_bits(0x7fc0_1234); stride];
                    Transposed::write_row_isa(isa, &mut got, &xr, per_word, half);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} per_word {per_word} words {words}");
                }
            }
        }
    }

    #[test]
    fn every_isa_gives_the_reference_bits() {
        // Shapes: partial 32-word chunks (64, 320, 2368 columns), a lone 16-word half (128,
        // 384), odd row counts (the decode kernel's row pairs, the panel's row blocks), token
        // counts of every decode kernel (1–4) and panel tails (5, 7, 9, 13), and more tokens
        // than one token block (70).
        let mut rng = Rng(7);
        let shapes = [(7usize, 64usize), (5, 256), (9, 320), (4, 1280), (3, 2048 + 256 + 64), (13, 128), (11, 384), (8, 1024)];
        for &(rows, cols) in &shapes {
            for w in matrices(&mut rng, rows, cols) {
                let tokens_list: &[usize] = if cols <= 384 { &[1, 2, 3, 4, 5, 7, 9, 13, 70] } else { &[1, 2, 3, 4, 5, 9] };
                for &tokens in tokens_list {
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
                        let mut panel = Vec::new();
                        unsafe {
                            matmul(isa, &w, &xt, got.as_mut_ptr(), rows, 0, h, &mut panel);
                            matmul(isa, &w, &xt, got.as_mut_ptr(), rows, h, rows - h, &mut panel);
                        }
                        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{} {isa:?} rows {rows} cols {cols} tokens {tokens}", w.name);
                    }
                }
            }
        }
    }

    #[test]
    fn lanes_past_a_partial_chunk_add_nothing() {
        // Every product underflows to -0.0 (1e-20 · -1e-30), so every lane of the reference ends
        // at -0.0 and so does the folded sum. A path that adds a 0·0 product for the lanes past
        // the last word of a partial 32-word chunk would turn those lanes into +0.0 and the sum
        // into +0.0.
        let tiny = |n: usize, v: f32, ft: FloatType| -> Vec<u8> {
            (0..n)
                .flat_map(|_| match ft {
                    FloatType::F32 => v.to_le_bytes().to_vec(),
                    _ => half::bf16::from_f32(v).to_bits().to_le_bytes().to_vec(),
                })
                .collect()
        };
        let rows = 7;
        // 4-bit, 40 words: every weight fma(0, q, bias) = bias.
        let affine = |name: &str, bias: f32| Matrix {
            name: name.into(),
            rows,
            cols: 320,
            data: MatrixData::Affine {
                bits: 4,
                group_size: 32,
                weight: Bytes::from_vec(vec![0x5au8; rows * 160]),
                scales: Bytes::from_vec(tiny(rows * 10, 0.0, FloatType::BF16)),
                biases: Bytes::from_vec(tiny(rows * 10, bias, FloatType::BF16)),
                scale_dtype: FloatType::BF16,
            },
        };
        let cases = [
            // 40 words of f32: a second chunk of 8 words.
            Matrix { name: "f32 40".into(), rows, cols: 40, data: MatrixData::Float { dtype: FloatType::F32, data: Bytes::from_vec(tiny(rows * 40, 1e-20, FloatType::F32)) } },
            affine("affine4 40 words", 1e-20),
        ];
        let negative = affine("affine4 40 words, negative weights", -1e-20);
        for (w, xv) in cases.iter().map(|w| (w, -1e-30f32)).chain([(&negative, 1e-30f32)]) {
            for tokens in [1usize, 2, 4, 5, 9] {
                let x = vec![xv; tokens * w.cols];
                let mut row = vec![0.0f32; w.cols];
                w.decode_row(0, &mut row);
                let want = dot_decoded(w.elems_per_word(), &row, &x[..w.cols]);
                assert_eq!(want.to_bits(), (-0.0f32).to_bits(), "{}: the reference", w.name);
                let xt = Transposed::new(&x, tokens, w.cols, w.elems_per_word());
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; tokens * rows];
                    let mut panel = Vec::new();
                    unsafe { matmul(isa, w, &xt, got.as_mut_ptr(), rows, 0, rows, &mut panel) };
                    assert!(got.iter().all(|v| v.to_bits() == want.to_bits()), "{} {isa:?} tokens {tokens}: {got:?}", w.name);
                }
            }
        }
    }

    #[test]
    fn gdn_rows_match_the_reference_on_every_isa() {
        use crate::backend::cpu::kernels::gdn_rows_ref;
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
    }

    #[test]
    fn gdn_rows_tokens_match_the_reference_token_after_token() {
        use crate::backend::cpu::kernels::gdn_rows_ref;
        let mut rng = Rng(19);
        // dk 64 and 128 (the register paths), 96 (the generic vector path), 48 (portable); dv
        // not a multiple of 16 rows (100), small (5); one token and a few (rows one at a time),
        // 8 and 70 (16-row groups).
        for (dk, dv) in [(128usize, 128usize), (128, 100), (64, 5), (64, 130), (96, 40), (48, 7)] {
            for n in [1usize, 3, 8, 70] {
                let (vs, os) = (dv + 3, dv + 5);
                let s0: Vec<f32> = (0..dv * dk).map(|_| rng.f()).collect();
                let k: Vec<f32> = (0..n * dk).map(|_| rng.f() * 0.1).collect();
                let q: Vec<f32> = (0..n * dk).map(|_| rng.f() * 0.1).collect();
                let alpha: Vec<f32> = (0..n).map(|_| 0.9 + 0.1 * rng.f()).collect();
                let beta: Vec<f32> = (0..n).map(|_| 0.5 + 0.5 * rng.f()).collect();
                let v: Vec<f32> = (0..n * vs).map(|_| rng.f()).collect();
                let mut want_s = s0.clone();
                let mut want_o = vec![f32::NAN; n * os];
                for t in 0..n {
                    gdn_rows_ref(&mut want_s, &k[t * dk..(t + 1) * dk], &q[t * dk..(t + 1) * dk], alpha[t], beta[t], &v[t * vs..t * vs + dv], &mut want_o[t * os..t * os + dv]);
                }
                for isa in Isa::available() {
                    let mut got_s = s0.clone();
                    let mut got_o = vec![f32::NAN; n * os];
                    gdn_rows_tokens(isa, &mut got_s, dk, &k, &q, &alpha, &beta, &v, vs, &mut got_o, os);
                    assert!(same_bits(&got_s, &want_s), "{isa:?} state dk={dk} dv={dv} n={n}");
                    assert!(same_bits(&got_o, &want_o), "{isa:?} out dk={dk} dv={dv} n={n}");
                }
            }
        }
    }

    /// Inputs that reach every branch of `exp`: NaN, ±inf, ±0, the overflow and underflow
    /// thresholds and their neighbours, results in the subnormal range, ties of `rint`, and
    /// random bit patterns over the whole f32 range.
    fn exp_inputs(rng: &mut Rng) -> Vec<f32> {
        use crate::numerics::{EXP_MAX, EXP_MIN};
        let up = |x: f32| f32::from_bits(x.to_bits() + 1);
        let mut v = vec![f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1.0, -1.0, EXP_MAX, up(EXP_MAX), EXP_MIN, up(EXP_MIN), -up(-EXP_MIN)];
        v.extend([88.0, 88.72, -87.3, -100.0, -103.9, 0.5 * std::f32::consts::LN_2, 1.5 * std::f32::consts::LN_2, -2.5 * std::f32::consts::LN_2]);
        v.extend((0..2000).map(|i| -110.0 + 200.0 * i as f32 / 2000.0));
        v.extend((0..3000).map(|_| f32::from_bits(rng.next() as u32)));
        v.extend((0..3000).map(|_| rng.f() * 30.0));
        v
    }

    /// Bit equality, except that any NaN equals any NaN: Rust does not specify NaN payloads
    /// (RFC 3514; LLVM folds `x − 0.0` to `x`, keeping a signalling NaN the hardware would
    /// quiet), and a NaN logit is a NaN whatever its payload.
    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    #[test]
    fn vector_exp_silu_sigmoid_give_the_scalar_bits() {
        use crate::numerics::{exp, sigmoid, silu};
        let mut rng = Rng(5);
        let x = exp_inputs(&mut rng);
        let g: Vec<f32> = (0..x.len()).map(|_| rng.f() * 4.0).collect();
        for isa in Isa::available() {
            // Every length up to two vectors and a tail, and the long sweep.
            for n in (0..40).chain([x.len()]) {
                let xs = &x[x.len() - n..];
                let mut got = vec![0.0f32; n];
                exp_shifted(isa, xs, 0.0, &mut got);
                let want: Vec<f32> = xs.iter().map(|&v| exp(v - 0.0)).collect();
                if let Some(i) = (0..n).find(|&i| !same_bits(&got[i..i + 1], &want[i..i + 1])) {
                    panic!("{isa:?} exp n={n}: exp({:e} = {:#x}) = {:e}, want {:e}", xs[i], xs[i].to_bits(), got[i], want[i]);
                }
                let mut got = xs.to_vec();
                super::silu(isa, &mut got);
                assert!(same_bits(&got, &xs.iter().map(|&v| silu(v)).collect::<Vec<_>>()), "{isa:?} silu n={n}");
                let mut got = vec![0.0f32; n];
                swiglu(isa, xs, &g[..n], &mut got);
                let want: Vec<f32> = xs.iter().zip(&g).map(|(&a, &b)| silu(a) * b).collect();
                assert!(same_bits(&got, &want), "{isa:?} swiglu n={n}");
                let mut got = g[..n].to_vec();
                sigmoid_mul(isa, &mut got, xs);
                let want: Vec<f32> = g[..n].iter().zip(xs).map(|(&a, &b)| a * sigmoid(b)).collect();
                assert!(same_bits(&got, &want), "{isa:?} sigmoid n={n}");
            }
            // A shift that moves inputs across the thresholds.
            let mut got = vec![0.0f32; x.len()];
            exp_shifted(isa, &x, 3.25, &mut got);
            assert!(same_bits(&got, &x.iter().map(|&v| exp(v - 3.25)).collect::<Vec<_>>()), "{isa:?} exp shifted");
        }
    }

    #[test]
    fn norms_and_conv_match_the_reference_on_every_isa() {
        use crate::backend::cpu::kernels::{gdn_conv_taps, rms_norm_row as rms_ref};
        let mut rng = Rng(13);
        for n in [16usize, 33, 64, 1024] {
            let x: Vec<f32> = (0..n).map(|_| rng.f() * 3.0).collect();
            let w: Vec<f32> = (0..n).map(|_| 1.0 + rng.f() * 0.1).collect();
            let z: Vec<f32> = (0..n).map(|_| rng.f() * 6.0).collect();
            let mut want = vec![0.0f32; n];
            rms_ref(&x, &w, 1e-6, &mut want);
            let wn: Vec<f32> = (0..n).map(|j| ((x[j] * 0.37) * w[j]) * crate::numerics::silu(z[j])).collect();
            for isa in Isa::available() {
                let mut got = vec![0.0f32; n];
                rms_norm_row(isa, &x, &w, 1e-6, &mut got);
                assert!(same_bits(&got, &want), "{isa:?} rms n={n}");
                gated_norm(isa, &x, 0.37, &w, &z, &mut got);
                assert!(same_bits(&got, &wn), "{isa:?} gated norm n={n}");
                if n % 32 == 0 {
                    assert_eq!(dot(isa, &x, &w).to_bits(), crate::numerics::dot_f32(&x, &w).to_bits());
                }
            }
        }
        // Conv + SiLU over 5 tokens of 100 channels, split into two channel ranges (at a whole
        // 16-channel block and not), kernel 4 (the vector path: blocks, then a tail of under 16
        // channels) and 3 (the reference's loop).
        // Fewer tokens than the window's rows (1, 2: the window's rows shift in place) and more
        // than one span of blocks (40 tokens of 600 channels).
        for (kc, cd, t) in [(4usize, 100usize, 5usize), (3, 100, 5), (4, 100, 1), (4, 100, 2), (4, 600, 40)] {
            let taps: Vec<f32> = (0..kc * cd).map(|_| rng.f()).collect();
            let conv0: Vec<f32> = (0..(kc - 1) * cd).map(|_| rng.f() * 5.0).collect();
            let qkv: Vec<f32> = (0..t * cd).map(|_| rng.f() * 5.0).collect();
            let mut want_conv = conv0.clone();
            let mut want_y = vec![0.0f32; t * cd];
            gdn_conv_taps(kc, cd, &taps, &mut ColumnsMut::from_slice(&mut want_conv, kc - 1, cd, 0..cd), &qkv, t, &mut ColumnsMut::from_slice(&mut want_y, t, cd, 0..cd));
            want_y.iter_mut().for_each(|v| *v = crate::numerics::silu(*v));
            for isa in Isa::available() {
                for split in [48usize, 37] {
                    let mut conv = conv0.clone();
                    let mut y = vec![0.0f32; t * cd];
                    gdn_conv(isa, kc, cd, &taps, ColumnsMut::from_slice(&mut conv, kc - 1, cd, 0..split), &qkv, t, ColumnsMut::from_slice(&mut y, t, cd, 0..split));
                    gdn_conv(isa, kc, cd, &taps, ColumnsMut::from_slice(&mut conv, kc - 1, cd, split..cd), &qkv, t, ColumnsMut::from_slice(&mut y, t, cd, split..cd));
                    assert!(same_bits(&conv, &want_conv) && same_bits(&y, &want_y), "{isa:?} conv kc={kc} cd={cd} t={t} split={split}");
                }
            }
        }
    }

    #[test]
    fn grouped_attention_gives_each_heads_reference_bits() {
        use crate::backend::cpu::kernels::attend as attend_ref;
        let mut rng = Rng(17);
        for (dh, hkv) in [(64usize, 2usize), (256, 2), (96, 1)] {
            let stride = hkv * dh;
            let n = 600;
            let keys: Vec<f32> = (0..n * stride).map(|_| rng.f()).collect();
            let values: Vec<f32> = (0..n * stride).map(|_| rng.f()).collect();
            for g in [1usize, 2, 3, 4, 8] {
                let q: Vec<f32> = (0..g * dh).map(|_| rng.f() * 3.0).collect();
                for p in [0usize, 1, 255, 256, 511, 599] {
                    let kv = hkv - 1;
                    let mut want = vec![0.0f32; g * dh];
                    for h in 0..g {
                        attend_ref(&q[h * dh..(h + 1) * dh], &keys, &values, p, stride, kv * dh, &mut Vec::new(), &mut want[h * dh..(h + 1) * dh]);
                    }
                    for isa in Isa::available() {
                        let mut got = vec![f32::NAN; g * dh];
                        attend_group(isa, g, &q, &keys, &values, p, stride, kv * dh, &mut Vec::new(), &mut got);
                        assert!(same_bits(&got, &want), "{isa:?} dh={dh} g={g} p={p}");
                    }
                }
            }
        }
    }
}
