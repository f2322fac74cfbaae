//! The CPU twins of every kernel: the executable definition of docs/numerics.md.
//!
//! Each function here is the reference its CUDA kernel is tested against bit for bit, and the
//! fast CPU paths ([`super::simd`]) are tested against these on the same inputs. They are
//! written for clarity first: loops in the order the numerics document gives.

use super::columns::ColumnsMut;
use super::simd::{self, Isa};
use crate::config::ModelConfig;
use crate::model::rope::RopeTable;
use crate::model::weights::{AttentionWeights, GatedDeltaNetWeights, Matrix};
use crate::numerics::{dot_f32, exp, fma, fold_lanes, rsqrt, sigmoid, softplus, sum_squares, LANES};

/// Positions per attention tile: scores are reduced per tile, and tiles are combined in
/// increasing order (numerics §6). A device splits long contexts across blocks at these
/// boundaries, so the result does not depend on how many blocks ran.
pub const ATTENTION_TILE: usize = 256;

/// Epsilon of the GDN q/k L2 norm, added to the sum of squares (spec G5, P8).
pub const L2_NORM_EPS: f32 = 1e-6;

/// Canonical dot of an already-decoded weight row with `x` (numerics §2): word `j` of the
/// stored row (`per_word` elements) goes to lane `j mod 32`, each lane accumulates with FMAs
/// in index order, lanes fold by halves.
#[inline(always)]
pub fn dot_decoded(per_word: usize, w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut p = [0.0f32; LANES];
    let chunk = per_word * LANES;
    let mut base = 0;
    while base < x.len() {
        let end = (base + chunk).min(x.len());
        for (k, (&wv, &xv)) in w[base..end].iter().zip(&x[base..end]).enumerate() {
            let lane = k / per_word;
            p[lane] = fma(wv, xv, p[lane]);
        }
        base = end;
    }
    fold_lanes(p)
}

/// RMSNorm of one row (numerics §3): `ss` = canonical sum of squares,
/// `inv = 1 / sqrt(ss / n + eps)`, `out[i] = (x[i] · inv) · w[i]`.
#[inline]
pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rsqrt(sum_squares(x) / x.len() as f32 + eps);
    for ((o, &xv), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = (xv * inv) * wv;
    }
}

/// Embedding rows (spec E1): `x[t] = decode(table[ids[t]])`.
pub fn embed(table: &Matrix, ids: &[u32], x: &mut [f32]) {
    let d = table.cols;
    for (t, &id) in ids.iter().enumerate() {
        table.decode_row(id as usize, &mut x[t * d..(t + 1) * d]);
    }
}

/// Causal depthwise conv + SiLU (spec G2/G3, numerics §4 step 1) of channels `ch0..ch1` =
/// `conv.cols()` for `t_len` consecutive tokens of one sequence. `qkv` is `[T, conv_dim]`, `conv`
/// those channels of the `[Kc−1, conv_dim]` window (oldest row first, updated), `y` those
/// channels of `[T, conv_dim]`, which receive `silu(conv)`. Channels are independent, so callers
/// may split them across threads (each task its own [`ColumnsMut`] of the two buffers).
pub fn gdn_conv(isa: Isa, cfg: &ModelConfig, taps: &[f32], conv: ColumnsMut<'_>, qkv: &[f32], t_len: usize, y: ColumnsMut<'_>) {
    simd::gdn_conv(isa, cfg.linear_conv_kernel_dim, cfg.conv_dim(), taps, conv, qkv, t_len, y);
}

/// The conv part of [`gdn_conv`]: `y[t][ch] = Σ_j fma(tap[ch][j], window[j][ch], ·)` over the
/// window `[c₀ … c_{K−2}; m_t]`, without the SiLU, for the channels `conv.cols()` (= `y.cols()`);
/// updates the window. `qkv` rows are `cd` floats. Works on blocks of 16 channels (each
/// channel's FMAs in the order of numerics §4, so a compiler may vectorise the channel loop
/// without changing a bit).
#[inline(always)]
pub fn gdn_conv_taps(kc: usize, cd: usize, taps: &[f32], conv: &mut ColumnsMut<'_>, qkv: &[f32], t_len: usize, y: &mut ColumnsMut<'_>) {
    const B: usize = 16;
    const KMAX: usize = 8;
    debug_assert_eq!(conv.cols(), y.cols());
    if kc > KMAX {
        return gdn_conv_taps_any(kc, cd, taps, conv, qkv, t_len, y);
    }
    let (ch0, ch1) = (conv.cols().start, conv.cols().end);
    let mut cb = ch0;
    while cb < ch1 {
        let (n, o) = (B.min(ch1 - cb), cb - ch0);
        let mut tp = [[0.0f32; B]; KMAX];
        let mut win = [[0.0f32; B]; KMAX];
        for l in 0..n {
            for j in 0..kc {
                tp[j][l] = taps[(cb + l) * kc + j];
            }
        }
        for (j, wj) in win.iter_mut().enumerate().take(kc - 1) {
            wj[..n].copy_from_slice(&conv.row(j)[o..o + n]);
        }
        for t in 0..t_len {
            win[kc - 1][..n].copy_from_slice(&qkv[t * cd + cb..t * cd + cb + n]);
            let mut acc = [0.0f32; B];
            for j in 0..kc {
                for l in 0..B {
                    acc[l] = fma(tp[j][l], win[j][l], acc[l]);
                }
            }
            y.row(t)[o..o + n].copy_from_slice(&acc[..n]);
            for j in 0..kc - 1 {
                win[j] = win[j + 1];
            }
        }
        for (j, wj) in win.iter().enumerate().take(kc - 1) {
            conv.row(j)[o..o + n].copy_from_slice(&wj[..n]);
        }
        cb += n;
    }
}

/// [`gdn_conv_taps`] for any kernel size, one channel at a time.
fn gdn_conv_taps_any(kc: usize, cd: usize, taps: &[f32], conv: &mut ColumnsMut<'_>, qkv: &[f32], t_len: usize, y: &mut ColumnsMut<'_>) {
    let mut window = vec![0.0f32; kc];
    let ch0 = conv.cols().start;
    for ch in conv.cols() {
        let (tap, o) = (&taps[ch * kc..(ch + 1) * kc], ch - ch0);
        for (j, wj) in window.iter_mut().enumerate().take(kc - 1) {
            *wj = conv.row(j)[o];
        }
        for t in 0..t_len {
            window[kc - 1] = qkv[t * cd + ch];
            let mut acc = 0.0f32;
            for j in 0..kc {
                acc = fma(tap[j], window[j], acc);
            }
            y.row(t)[o] = acc;
            window.rotate_left(1);
        }
        for (j, &wj) in window.iter().enumerate().take(kc - 1) {
            conv.row(j)[o] = wj;
        }
    }
}

/// q/k L2 normalisation of key head `kappa` of one token (spec G5, numerics §4 step 2): `y` is
/// the token's `silu(conv)` row; writes `qn`, `kn` (`dk` each), q also scaled by `dk^−1/2`.
pub fn gdn_qk_norm_head(isa: Isa, cfg: &ModelConfig, y: &[f32], kappa: usize, qn: &mut [f32], kn: &mut [f32]) {
    let (dk, key_dim) = (cfg.linear_key_head_dim, cfg.key_dim());
    let q_scale = rsqrt(dk as f32);
    let q = &y[kappa * dk..(kappa + 1) * dk];
    let inv = rsqrt(simd::dot(isa, q, q) + L2_NORM_EPS);
    for e in 0..dk {
        qn[e] = (q[e] * inv) * q_scale;
    }
    let k = &y[key_dim + kappa * dk..key_dim + (kappa + 1) * dk];
    let inv = rsqrt(simd::dot(isa, k, k) + L2_NORM_EPS);
    for e in 0..dk {
        kn[e] = k[e] * inv;
    }
}

/// The delta rule of one value head over its `dv` state rows (numerics §4 step 4), the
/// scalar reference: `S = S·α; mem = dot(S, k); δ = (v − mem)·β; S = fma(k, δ, S);
/// o = dot(S, q)` per row. `s` is `[dv, dk]`.
pub fn gdn_rows_ref(s: &mut [f32], k: &[f32], q: &[f32], alpha: f32, beta: f32, v: &[f32], o: &mut [f32]) {
    let dk = k.len();
    for (j, oj) in o.iter_mut().enumerate() {
        let row = &mut s[j * dk..(j + 1) * dk];
        for x in row.iter_mut() {
            *x *= alpha;
        }
        let mem = dot_f32(row, k);
        let delta = (v[j] - mem) * beta;
        for (x, &kv) in row.iter_mut().zip(k) {
            *x = fma(kv, delta, *x);
        }
        *oj = dot_f32(row, q);
    }
}

/// Tokens per pass of [`gdn_head`]: the pass's gates, normalised q/k and delta-rule outputs
/// (`2·dk + dv` floats per token) sit in scratch while the delta rule runs over them in blocks
/// of state rows.
const GDN_TOKENS: usize = 64;

/// Tokens ahead that [`gdn_head`] asks the cache for a token's inputs.
const PREFETCH_TOKENS: usize = 4;

/// Value head `h` of one sequence for `t_len` tokens (spec G5–G12, numerics §4 steps 2–5): q/k
/// norms of its key head, gates, delta rule on `state_h` (`[dv, dk]`, updated), gated RMSNorm
/// with `z`. `y` holds the `silu(conv)` rows `[T, conv_dim]` (q/k of key head `kappa` at
/// `kappa·dk` and `key_dim + kappa·dk`, values at `2·key_dim + h·dv`); `out` is the head's
/// columns `h·dv..(h+1)·dv` of the `[T, value_dim]` output, each row written once. Tokens run
/// in passes of [`GDN_TOKENS`]; within a pass the delta rule runs token after token for each
/// state row ([`simd::gdn_rows_tokens`]: rows are independent, so this is the arithmetic of one
/// token at a time), its outputs parked in `scratch` until the gated norm of each token writes
/// them to `out`. `scratch` also holds the pass's normalised q and k.
#[allow(clippy::too_many_arguments)]
pub fn gdn_head(
    isa: Isa,
    cfg: &ModelConfig,
    w: &GatedDeltaNetWeights,
    h: usize,
    state_h: &mut [f32],
    y: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    t_len: usize,
    scratch: &mut Vec<f32>,
    mut out: ColumnsMut<'_>,
) {
    let (hk, hv, dk, dv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    let (key_dim, value_dim, cd) = (cfg.key_dim(), cfg.value_dim(), cfg.conv_dim());
    assert!(out.cols() == (h * dv..(h + 1) * dv) && out.rows() >= t_len, "gdn_head {h}: columns {:?} of {} rows", out.cols(), out.rows());
    let kappa = h / (hv / hk);
    scratch.resize(GDN_TOKENS * (2 * dk + dv), 0.0);
    let (qn, rest) = scratch.split_at_mut(GDN_TOKENS * dk);
    let (kn, os) = rest.split_at_mut(GDN_TOKENS * dk);
    let (mut alpha, mut beta) = ([0.0f32; GDN_TOKENS], [0.0f32; GDN_TOKENS]);
    let mut t0 = 0;
    while t0 < t_len {
        let n = GDN_TOKENS.min(t_len - t0);
        for i in 0..n {
            let t = t0 + i;
            // The head's slices of token rows kilobytes apart come from L3 one miss at a time
            // unless asked for ahead: q, k, v and z of the token PREFETCH_TOKENS on.
            if t + PREFETCH_TOKENS < t_len {
                let (yr, zr) = (&y[(t + PREFETCH_TOKENS) * cd..(t + PREFETCH_TOKENS + 1) * cd], &z[(t + PREFETCH_TOKENS) * value_dim..(t + PREFETCH_TOKENS + 1) * value_dim]);
                simd::prefetch(&yr[kappa * dk..(kappa + 1) * dk]);
                simd::prefetch(&yr[key_dim + kappa * dk..key_dim + (kappa + 1) * dk]);
                simd::prefetch(&yr[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv]);
                simd::prefetch(&zr[h * dv..(h + 1) * dv]);
            }
            gdn_qk_norm_head(isa, cfg, &y[t * cd..(t + 1) * cd], kappa, &mut qn[i * dk..(i + 1) * dk], &mut kn[i * dk..(i + 1) * dk]);
            beta[i] = sigmoid(b[t * hv + h]);
            alpha[i] = exp(w.a[h] * softplus(a[t * hv + h] + w.dt_bias[h]));
        }
        let last = t0 + n - 1;
        let v = &y[t0 * cd + 2 * key_dim + h * dv..last * cd + 2 * key_dim + (h + 1) * dv];
        simd::gdn_rows_tokens(isa, state_h, dk, &kn[..n * dk], &qn[..n * dk], &alpha[..n], &beta[..n], v, cd, &mut os[..n * dv], dv);
        for (i, o) in os[..n * dv].chunks_exact(dv).enumerate() {
            let t = t0 + i;
            let inv = rsqrt(simd::dot(isa, o, o) / dv as f32 + cfg.rms_norm_eps);
            let zr = &z[t * value_dim + h * dv..t * value_dim + (h + 1) * dv];
            simd::gated_norm(isa, o, inv, &w.norm, zr, out.row(t));
        }
        t0 += n;
    }
}

/// Partial RoPE in the NeoX (rotate-half) pairing on the first `2·cos.len()` dims (numerics §5):
/// `x'[i] = fma(x[i], c, −(x[i+h]·s))`, `x'[i+h] = fma(x[i+h], c, x[i]·s)`.
#[inline]
pub fn rope_row(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let h = cos.len();
    for i in 0..h {
        let (x0, x1) = (x[i], x[i + h]);
        x[i] = fma(x0, cos[i], -(x1 * sin[i]));
        x[i + h] = fma(x1, cos[i], x0 * sin[i]);
    }
}

/// Writes this sequence's keys and values into its KV cache (spec A2–A5): each key head is
/// RMS-normalised with `k_norm` and rotated at its position; values are stored as projected.
/// `keys`/`values` are `[positions, Hkv, Dh]`, already long enough.
#[allow(clippy::too_many_arguments)]
pub fn attention_write_kv(
    isa: Isa,
    cfg: &ModelConfig,
    w: &AttentionWeights,
    rope: &RopeTable,
    pos: usize,
    t_len: usize,
    k: &[f32],
    v: &[f32],
    keys: &mut [f32],
    values: &mut [f32],
) {
    let (hkv, dh, rd) = (cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim());
    let width = hkv * dh;
    for t in 0..t_len {
        let p = pos + t;
        let (cos, sin) = rope.row(p);
        for g in 0..hkv {
            let src = &k[t * width + g * dh..t * width + (g + 1) * dh];
            let dst = &mut keys[p * width + g * dh..p * width + (g + 1) * dh];
            simd::rms_norm_row(isa, src, &w.k_norm, cfg.rms_norm_eps, dst);
            rope_row(&mut dst[..rd], cos, sin);
        }
        values[p * width..(p + 1) * width].copy_from_slice(&v[t * width..(t + 1) * width]);
    }
}

/// Attention of one query head at position `p` over cache positions `0..=p` (numerics §6).
///
/// Scores `s_τ = dot(q, k_τ) · Dh^−1/2`. Per tile of [`ATTENTION_TILE`] positions: `m` = max
/// score, `e_τ = exp(s_τ − m)`, `l = Σ e_τ` and `o[d] = Σ e_τ·v_τ[d]` accumulated in increasing
/// τ with FMAs. Tiles combine in increasing order: `M = max m_j`, `c_j = exp(m_j − M)`,
/// `L = Σ l_j·c_j`, `O[d] = Σ o_j[d]·c_j` (FMAs), and the result is `O[d] / L`.
#[allow(clippy::too_many_arguments)]
pub fn attend(q: &[f32], keys: &[f32], values: &[f32], p: usize, stride: usize, head_off: usize, scores: &mut Vec<f32>, out: &mut [f32]) {
    let dh = q.len();
    let scale = rsqrt(dh as f32);
    scores.clear();
    for tau in 0..=p {
        let k = &keys[tau * stride + head_off..tau * stride + head_off + dh];
        scores.push(dot_f32(q, k) * scale);
    }
    let n_tiles = p / ATTENTION_TILE + 1;
    let mut tiles: Vec<(f32, f32, Vec<f32>)> = vec![(0.0, 0.0, Vec::new()); n_tiles];
    for (j, tile) in tiles.iter_mut().enumerate().take(n_tiles) {
        let lo = j * ATTENTION_TILE;
        let hi = ((j + 1) * ATTENTION_TILE).min(p + 1);
        let m = scores[lo..hi].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut l = 0.0f32;
        tile.2.clear();
        tile.2.resize(dh, 0.0);
        for tau in lo..hi {
            let e = exp(scores[tau] - m);
            l += e;
            let v = &values[tau * stride + head_off..tau * stride + head_off + dh];
            for (o, &vv) in tile.2.iter_mut().zip(v) {
                *o = fma(e, vv, *o);
            }
        }
        tile.0 = m;
        tile.1 = l;
    }
    let big_m = tiles[..n_tiles].iter().map(|t| t.0).fold(f32::NEG_INFINITY, f32::max);
    let mut big_l = 0.0f32;
    out.fill(0.0);
    for tile in &tiles[..n_tiles] {
        let c = exp(tile.0 - big_m);
        big_l = fma(tile.1, c, big_l);
        for (o, &ov) in out.iter_mut().zip(&tile.2) {
            *o = fma(ov, c, *o);
        }
    }
    for o in out.iter_mut() {
        *o /= big_l;
    }
}

/// The query heads `g·G .. (g+1)·G` of KV group `g` (`G = Hq / Hkv`) of one token through
/// attention at position `p` (spec A1, A3, A4, A6, A7): for each head RMS-normalise and rotate
/// q, attend over the cache as [`attend`] does (every cache row read once for the group), multiply
/// by `sigmoid(gate)`. `row` is the token's q|gate projection, `out` the group's `[G·Dh]` outputs;
/// `scratch` is (queries, attention scratch).
#[allow(clippy::too_many_arguments)]
pub fn attention_group(
    isa: Isa,
    cfg: &ModelConfig,
    w: &AttentionWeights,
    rope: &RopeTable,
    p: usize,
    g: usize,
    row: &[f32],
    keys: &[f32],
    values: &[f32],
    scratch: &mut (Vec<f32>, Vec<f32>),
    out: &mut [f32],
) {
    let (hq, hkv, dh, rd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim());
    let gs = hq / hkv;
    let (q, buf) = scratch;
    q.resize(gs * dh, 0.0);
    let (cos, sin) = rope.row(p);
    for i in 0..gs {
        let h = g * gs + i;
        let qh = &mut q[i * dh..(i + 1) * dh];
        simd::rms_norm_row(isa, &row[h * 2 * dh..h * 2 * dh + dh], &w.q_norm, cfg.rms_norm_eps, qh);
        rope_row(&mut qh[..rd], cos, sin);
    }
    simd::attend_group(isa, gs, q, keys, values, p, hkv * dh, g * dh, buf, out);
    for i in 0..gs {
        let h = g * gs + i;
        simd::sigmoid_mul(isa, &mut out[i * dh..(i + 1) * dh], &row[h * 2 * dh + dh..(h + 1) * 2 * dh]);
    }
}

/// The router of a mixture-of-experts block for one row (numerics §7.1, transformers
/// `Qwen3_5MoeTopKRouter`): from the `E` router logits, the `k` chosen experts and their
/// weights, written to `chosen` in increasing expert index.
///
/// Softmax: `m = max l` (the first largest), `e_i = exp(l_i − m)`, `s` their sequential sum in
/// increasing `i`, `p_i = e_i / s`. Top-k: the `k` largest `p`, a tie going to the lower index.
/// When `norm_topk_prob`, `w = p / t` with `t` the sequential sum of the chosen `p` in rank
/// order (largest first); else `w = p`. `probs` is scratch (`E` values).
pub fn moe_route(logits: &[f32], k: usize, norm_topk_prob: bool, probs: &mut Vec<f32>, chosen: &mut Vec<(u32, f32)>) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, |m, x| if x > m { x } else { m });
    probs.clear();
    let mut s = 0.0f32;
    for &l in logits {
        let e = exp(l - m);
        probs.push(e);
        s += e;
    }
    for p in probs.iter_mut() {
        *p /= s;
    }
    // k passes of selection: each takes the largest p not yet taken, the lowest index first
    // among equals (`>` keeps the earlier one).
    chosen.clear();
    for _ in 0..k.min(logits.len()) {
        let mut best: Option<usize> = None;
        for (i, &p) in probs.iter().enumerate() {
            if chosen.iter().any(|&(e, _)| e as usize == i) {
                continue;
            }
            if best.is_none_or(|b| p > probs[b]) {
                best = Some(i);
            }
        }
        let b = best.expect("fewer experts than k were checked");
        chosen.push((b as u32, probs[b]));
    }
    if norm_topk_prob {
        let t = chosen.iter().fold(0.0f32, |t, &(_, p)| t + p);
        for c in chosen.iter_mut() {
            c.1 /= t;
        }
    }
    chosen.sort_unstable_by_key(|&(e, _)| e);
}
