// Gated DeltaNet, the whole step after the input projections: causal depthwise conv + SiLU of
// the head's q, k and v channels, q/k L2 norms, gates, delta rule and gated RMSNorm. One block
// per (value head, sequence), tokens in order. Per token, thread c < 2·dk + dv runs the conv of
// the head's channel c (q channels of key head kappa, then its k channels, then the value head's
// v channels) into shared memory; the conv window stays with that thread (a small local array)
// and goes back to the slot at the end. That needs each channel read by one block: with several value
// heads per key head (Hv > Hk) the q/k windows are shared, so the host runs gdn_conv first and
// passes its output (`conv_here` = 0), which the threads copy instead. Every warp normalises the head's q and k itself (the same
// arithmetic in each, no block barrier). The head's state stays in registers for the whole
// step: warp w holds rows w, w+32, ... (up to 4), lane l holds elements l, l+32, ... (up to 4)
// of each, which is the canonical lane order of the row's dot products; the warp's rows are
// processed together.
// CPU twin: backend::cpu::kernels::gdn_conv, then gdn_head (gdn_qk_norm_head, gdn_rows_ref)
// (numerics §4 steps 1-5).
// Grid: (Hv, n_seqs), block 1024 (32 warps). Needs dk <= 128, dv <= 128 and kc <= 8 (checked on
// the host).

#define MAXR 4
#define MAXL 4

extern "C" __global__ void __launch_bounds__(1024) gdn_heads(const float* src, const float* taps, u32 kc, u32 conv_here, const float* z,
                                                             const float* b, const float* a, const float* a_neg, const float* dt_bias,
                                                             const float* norm_w, float eps, u32 hk, u32 hv, u32 dk, u32 dv, u32 layer,
                                                             const SeqDesc* seqs, const SlotDesc* slots, float* out) {
    __shared__ float o[MAXR * 32];
    __shared__ float yc[3 * 128];  // the token's conv outputs: q [dk], k [dk], v [dv]
    __shared__ float inv_s;
    __shared__ float tap_s[8 * 384];  // this thread's conv taps, tap_s[j * 384 + c] (weights)
    u32 h = blockIdx.x;
    SeqDesc sq = seqs[blockIdx.y];
    u32 key_dim = hk * dk, value_dim = hv * dv, cd = 2 * key_dim + value_dim;
    u32 kappa = h / (hv / hk);
    float* state = (float*)slots[sq.slot].rec + ((u64)layer * hv + h) * dv * dk;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // This thread's conv channel (gdn_conv's arithmetic), if any.
    u32 c = threadIdx.x, nch = 2 * dk + dv;
    u32 ch = c < dk ? kappa * dk + c : c < 2 * dk ? key_dim + kappa * dk + (c - dk) : 2 * key_dim + h * dv + (c - 2 * dk);
    float* conv = (float*)slots[sq.slot].conv + (u64)layer * (kc - 1) * cd;
    float win[8];
    if (conv_here && c < nch) {
        for (u32 j = 0; j + 1 < kc; j++) win[j] = conv[(u64)j * cd + ch];
        // Each thread reads back only the taps it wrote itself: no barrier needed.
        for (u32 j = 0; j < kc; j++) tap_s[j * 384 + c] = taps[(u64)ch * kc + j];
    }
    float S[MAXR][MAXL];
#pragma unroll
    for (int q = 0; q < MAXR; q++)
#pragma unroll
        for (int e = 0; e < MAXL; e++) {
            u32 j = warp + 32 * q, i = lane + 32 * e;
            S[q][e] = (j < dv && i < dk) ? state[(u64)j * dk + i] : 0.0f;
        }
    // Per-head parameters (weights; the conv taps above too): read before waiting.
    const float a_neg_h = a_neg[h], dt_bias_h = dt_bias[h];
    const float norm_wj = threadIdx.x < dv ? norm_w[threadIdx.x] : 0.0f;
    // The recurrent state and conv windows were last written by this layer's GDN kernels
    // (gdn_heads, or gdn_conv / gdn_scan of a prompt step) in an earlier step,
    // which had completed before the kernel before this one began (stream order with
    // programmatic dependent launch), and the slot and sequence tables are written by the host
    // before the step: all may be read before waiting on the previous kernel (the projection
    // that writes the conv input, or gdn_conv).
    pdl_enter();
    PROBE_SKIP(GDN);
    for (u32 t = 0; t < sq.len; t++) {
        u64 row = sq.first_row + t;
        // The token's gates and output gate, requested together with its conv input (one
        // round trip to L2 instead of three).
        const float b_t = b[row * hv + h], a_t = a[row * hv + h];
        const float zj = threadIdx.x < dv ? z[row * value_dim + (u64)h * dv + threadIdx.x] : 0.0f;
        // The gates need only b and a: computed while the conv input is on its way.
        const float beta = tf_sigmoid(b_t);
        const float alpha = tf_exp(a_neg_h * tf_softplus(a_t + dt_bias_h));
        if (c < nch) {
            if (conv_here) {
                win[kc - 1] = src[row * cd + ch];
                float acc = 0.0f;
                for (u32 j = 0; j < kc; j++) acc = fmaf(tap_s[j * 384 + c], win[j], acc);
                yc[c] = tf_silu(acc);
                for (u32 j = 0; j + 1 < kc; j++) win[j] = win[j + 1];
            } else {
                yc[c] = src[row * cd + ch];
            }
        }
        __syncthreads();
        // q/k L2 norm of key head kappa (gdn_qk_norm's arithmetic)
        const float* qh = yc;
        const float* kh = yc + dk;
        const float* v = yc + 2 * dk;
        float q_scale = tf_rsqrt((float)dk);
        float inv_q = tf_rsqrt(warp_dot(qh, qh, dk) + 1e-6f);
        float inv_k = tf_rsqrt(warp_dot(kh, kh, dk) + 1e-6f);
        float kv[MAXL], qv[MAXL];
#pragma unroll
        for (int e = 0; e < MAXL; e++) {
            u32 i = lane + 32 * e;
            kv[e] = i < dk ? kh[i] * inv_k : 0.0f;
            qv[e] = i < dk ? (qh[i] * inv_q) * q_scale : 0.0f;
        }
        // Decay, then mem = S·k, per row: each lane accumulates its own elements i < dk in order
        // (elements past dk are skipped, not added as zeros).
        float mem[MAXR];
#pragma unroll
        for (int q = 0; q < MAXR; q++) {
            float acc = 0.0f;
#pragma unroll
            for (int e = 0; e < MAXL; e++) {
                if (lane + 32 * e < dk) {
                    S[q][e] = S[q][e] * alpha;
                    acc = fmaf(S[q][e], kv[e], acc);
                }
            }
            mem[q] = acc;
        }
#pragma unroll
        for (int q = 0; q < MAXR; q++) mem[q] = __shfl_sync(FULL_MASK, fold32(mem[q]), 0);
        float oq[MAXR];
#pragma unroll
        for (int q = 0; q < MAXR; q++) {
            u32 j = warp + 32 * q;
            float delta = ((j < dv ? v[j] : 0.0f) - mem[q]) * beta;
            float acc = 0.0f;
#pragma unroll
            for (int e = 0; e < MAXL; e++) {
                if (lane + 32 * e < dk) {
                    S[q][e] = fmaf(kv[e], delta, S[q][e]);
                    acc = fmaf(S[q][e], qv[e], acc);
                }
            }
            oq[q] = acc;
        }
#pragma unroll
        for (int q = 0; q < MAXR; q++) {
            float r = fold32(oq[q]);
            u32 j = warp + 32 * q;
            if (lane == 0 && j < dv) o[j] = r;
        }
        __syncthreads();
        if (warp == 0) {
            float ss = warp_dot(o, o, dv);
            if (lane == 0) inv_s = tf_rsqrt(ss / (float)dv + eps);
        }
        __syncthreads();
        float inv = inv_s;
        u32 j = threadIdx.x;  // dv <= 128 < blockDim.x
        if (j < dv) out[row * value_dim + (u64)h * dv + j] = ((o[j] * inv) * norm_wj) * tf_silu(zj);
        __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < MAXR; q++)
#pragma unroll
        for (int e = 0; e < MAXL; e++) {
            u32 j = warp + 32 * q, i = lane + 32 * e;
            if (j < dv && i < dk) state[(u64)j * dk + i] = S[q][e];
        }
    if (conv_here && c < nch)
        for (u32 j = 0; j + 1 < kc; j++) conv[(u64)j * cd + ch] = win[j];
}
