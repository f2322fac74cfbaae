//! The CPU twins of every kernel: the executable definition of docs/numerics.md.
//!
//! Each function here is the reference its CUDA kernel is tested against bit for bit, and the
//! fast CPU paths ([`super::simd`]) are tested against these on the same inputs. They are
//! written for clarity first: loops in the order the numerics document gives.

use crate::config::ModelConfig;
use crate::model::rope::RopeTable;
use crate::model::weights::{AttentionWeights, GatedDeltaNetWeights, Matrix};
use crate::numerics::{dot_f32, exp, fma, fold_lanes, rsqrt, sigmoid, silu, softplus, sum_squares, LANES};

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

/// `y[t][n] = W[n] · x[t]` for `t < rows`: `x` is `[rows, W.cols]`, `y` is `[rows, ldy]` and
/// columns `n0 .. n0 + count` of it are written (a thread's share of the outputs).
pub fn matmul_rows(w: &Matrix, x: &[f32], rows: usize, y: &mut [f32], ldy: usize, n0: usize, count: usize) {
    let k = w.cols;
    let per_word = w.elems_per_word();
    let mut wrow = vec![0.0f32; k];
    for n in n0..n0 + count {
        w.decode_row(n, &mut wrow);
        for t in 0..rows {
            y[t * ldy + n] = dot_decoded(per_word, &wrow, &x[t * k..(t + 1) * k]);
        }
    }
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

/// One sequence's rows through the Gated DeltaNet mixer, spec (G2)–(G12), numerics §4.
///
/// `qkv` `[T, conv_dim]`, `z` `[T, value_dim]`, `b`, `a` `[T, Hv]` are the projections of this
/// sequence's `T` rows; `conv` is the `[Kc−1, conv_dim]` window (oldest row first) and
/// `state` the `[Hv, dv, dk]` recurrent state (row `j` of head `h` is `S_h[:, j]`), both
/// updated in place; `out` `[T, value_dim]` receives the gated-norm outputs.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_net_seq(
    cfg: &ModelConfig,
    w: &GatedDeltaNetWeights,
    conv: &mut [f32],
    state: &mut [f32],
    qkv: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    t_len: usize,
    out: &mut [f32],
) {
    let (hk, hv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
    let (dk, dv, kc) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim);
    let (key_dim, value_dim, cd) = (cfg.key_dim(), cfg.value_dim(), cfg.conv_dim());
    let group = hv / hk;
    let q_scale = rsqrt(dk as f32);
    let mut y = vec![0.0f32; cd];
    let mut qn = vec![0.0f32; key_dim];
    let mut kn = vec![0.0f32; key_dim];
    let mut o = vec![0.0f32; dv];
    for t in 0..t_len {
        let m = &qkv[t * cd..(t + 1) * cd];
        // (G2)/(G3) depthwise causal conv over [window; m], then SiLU; the window shifts by one.
        for ch in 0..cd {
            let taps = &w.conv1d[ch * kc..(ch + 1) * kc];
            let mut acc = 0.0f32;
            for j in 0..kc - 1 {
                acc = fma(taps[j], conv[j * cd + ch], acc);
            }
            acc = fma(taps[kc - 1], m[ch], acc);
            y[ch] = silu(acc);
        }
        conv.copy_within(cd.., 0);
        conv[(kc - 2) * cd..].copy_from_slice(m);
        // (G5) L2-normalise each q and k head; q also scaled by dk^-1/2.
        for i in 0..hk {
            let q = &y[i * dk..(i + 1) * dk];
            let inv = rsqrt(sum_squares(q) + L2_NORM_EPS);
            for e in 0..dk {
                qn[i * dk + e] = (q[e] * inv) * q_scale;
            }
            let k = &y[key_dim + i * dk..key_dim + (i + 1) * dk];
            let inv = rsqrt(sum_squares(k) + L2_NORM_EPS);
            for e in 0..dk {
                kn[i * dk + e] = k[e] * inv;
            }
        }
        for h in 0..hv {
            // (G6) gates.
            let beta = sigmoid(b[t * hv + h]);
            let alpha = exp(w.a[h] * softplus(a[t * hv + h] + w.dt_bias[h]));
            let kappa = h / group;
            let kh = &kn[kappa * dk..(kappa + 1) * dk];
            let qh = &qn[kappa * dk..(kappa + 1) * dk];
            let v = &y[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv];
            let s_h = &mut state[h * dv * dk..(h + 1) * dv * dk];
            // (G7)–(G11) per state row: decay, read, delta, write, read-out.
            for j in 0..dv {
                let row = &mut s_h[j * dk..(j + 1) * dk];
                for s in row.iter_mut() {
                    *s *= alpha;
                }
                let mem = dot_f32(row, kh);
                let delta = (v[j] - mem) * beta;
                for (s, &kv) in row.iter_mut().zip(kh) {
                    *s = fma(kv, delta, *s);
                }
                o[j] = dot_f32(row, qh);
            }
            // (G12) gated RMSNorm over dv with the plain weight, times silu(z).
            let inv = rsqrt(sum_squares(&o) / dv as f32 + cfg.rms_norm_eps);
            let zr = &z[t * value_dim + h * dv..t * value_dim + (h + 1) * dv];
            let orow = &mut out[t * value_dim + h * dv..t * value_dim + (h + 1) * dv];
            for j in 0..dv {
                orow[j] = ((o[j] * inv) * w.norm[j]) * silu(zr[j]);
            }
        }
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
            rms_norm_row(src, &w.k_norm, cfg.rms_norm_eps, dst);
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
pub fn attend(q: &[f32], keys: &[f32], values: &[f32], p: usize, stride: usize, head_off: usize, scores: &mut Vec<f32>, tiles: &mut Vec<(f32, f32, Vec<f32>)>, out: &mut [f32]) {
    let dh = q.len();
    let scale = rsqrt(dh as f32);
    scores.clear();
    for tau in 0..=p {
        let k = &keys[tau * stride + head_off..tau * stride + head_off + dh];
        scores.push(dot_f32(q, k) * scale);
    }
    let n_tiles = p / ATTENTION_TILE + 1;
    tiles.resize_with(n_tiles, || (0.0, 0.0, Vec::new()));
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

/// One sequence's query rows through attention (spec A1, A3, A4, A6, A7): per query head,
/// RMS-normalise and rotate q, attend over the cache up to its position, multiply by
/// `sigmoid(gate)`. `q_gate` is `[T, Hq·2·Dh]` (per head: q then gate), `out` `[T, Hq·Dh]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_seq(
    cfg: &ModelConfig,
    w: &AttentionWeights,
    rope: &RopeTable,
    pos: usize,
    t_len: usize,
    q_gate: &[f32],
    keys: &[f32],
    values: &[f32],
    out: &mut [f32],
) {
    let (hq, hkv, dh, rd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim());
    let group = hq / hkv;
    let stride = hkv * dh;
    let mut q = vec![0.0f32; dh];
    let mut o = vec![0.0f32; dh];
    let mut scores = Vec::new();
    let mut tiles = Vec::new();
    for t in 0..t_len {
        let p = pos + t;
        let (cos, sin) = rope.row(p);
        for h in 0..hq {
            let row = &q_gate[t * hq * 2 * dh + h * 2 * dh..t * hq * 2 * dh + (h + 1) * 2 * dh];
            rms_norm_row(&row[..dh], &w.q_norm, cfg.rms_norm_eps, &mut q);
            rope_row(&mut q[..rd], cos, sin);
            attend(&q, keys, values, p, stride, (h / group) * dh, &mut scores, &mut tiles, &mut o);
            let dst = &mut out[t * hq * dh + h * dh..t * hq * dh + (h + 1) * dh];
            for d in 0..dh {
                dst[d] = o[d] * sigmoid(row[dh + d]);
            }
        }
    }
}
