// Gated DeltaNet over prompt chunks (steps where a sequence has more than one token), in three
// kernels: what does not depend on the state runs in parallel over tokens, and only the delta
// rule stays sequential, a warp per value row (each row of the state evolves on its own given
// the token's q, k, v and gates). gdn_heads does the same arithmetic fused for decode steps;
// the two give the same bits (the same operations in the same order, only split over kernels).
// CPU twin: backend::cpu::kernels::gdn_conv, then gdn_head (gdn_qk_norm_head, gdn_rows_ref)
// (numerics §4 steps 1-5).
//
// The prepared rows (`prep`, [rows][pd], pd = conv_dim + 2·Hv): q normalised and scaled
// [Hk·dk], k normalised [Hk·dk], v [Hv·dv] (conv + SiLU), then beta [Hv] and alpha [Hv].
// Needs dk <= 128, dv <= 128 and kc <= 8 (checked on the host).

// Conv + SiLU of one 128-channel part of a token, then the q/k L2 norm or the gates.
// Grid (2·Hk + Hv, longest sequence, sequences), block 128: part p < Hk is the q of key head p,
// p < 2·Hk the k of key head p − Hk, else the v of value head p − 2·Hk.
extern "C" __global__ void __launch_bounds__(128) gdn_prep(const float* qkv, const float* taps, u32 kc, const float* b, const float* a,
                                                           const float* a_neg, const float* dt_bias, u32 hk, u32 hv, u32 dk, u32 dv,
                                                           u32 layer, const SeqDesc* seqs, const SlotDesc* slots, float* prep) {
    __shared__ float y[128];
    __shared__ float inv_s;
    pdl_enter();
    PROBE_SKIP(GDN);
    const SeqDesc sq = seqs[blockIdx.z];
    const u32 t = blockIdx.y, part = blockIdx.x, c = threadIdx.x;
    if (t >= sq.len) return;
    const u32 key_dim = hk * dk, value_dim = hv * dv, cd = 2 * key_dim + value_dim, pd = cd + 2 * hv;
    const bool qk = part < 2 * hk;
    const u32 n = qk ? dk : dv, ch0 = qk ? part * dk : 2 * key_dim + (part - 2 * hk) * dv;
    const u64 row = sq.first_row + t;
    // The window of token t: inputs t − (kc − 1) … t, those before the chunk from the slot's
    // conv state (its kc − 1 last inputs, oldest first), which gdn_scan replaces afterwards.
    const float* conv = (const float*)slots[sq.slot].conv + (u64)layer * (kc - 1) * cd;
    if (c < n) {
        const u32 ch = ch0 + c;
        float acc = 0.0f;
        for (u32 j = 0; j < kc; j++) {
            const int idx = (int)t - (int)(kc - 1) + (int)j;
            const float x = idx >= 0 ? qkv[(sq.first_row + (u64)idx) * cd + ch] : conv[(u64)((int)kc - 1 + idx) * cd + ch];
            acc = fmaf(taps[(u64)ch * kc + j], x, acc);
        }
        y[c] = tf_silu(acc);
    }
    float* r = prep + row * pd;
    if (qk) {
        __syncthreads();
        if (c < 32) {
            const float ss = warp_dot(y, y, n);
            if (c == 0) inv_s = tf_rsqrt(ss + 1e-6f);
        }
        __syncthreads();
        const float inv = inv_s;
        if (c < n) r[ch0 + c] = part < hk ? (y[c] * inv) * tf_rsqrt((float)dk) : y[c] * inv;
    } else {
        if (c < n) r[ch0 + c] = y[c];
        if (c == 0) {
            const u32 h = part - 2 * hk;
            r[cd + h] = tf_sigmoid(b[row * hv + h]);
            r[cd + hv + h] = tf_exp(a_neg[h] * tf_softplus(a[row * hv + h] + dt_bias[h]));
        }
    }
}

#define SCAN_WARPS 4  // value rows per block (gdn_scan)
#define SCAN_AHEAD 4  // tokens whose inputs a warp has in flight

// The delta rule, tokens in order: warp w of block (h, p) owns row j = SCAN_WARPS·p + w of value
// head h's state, lane l its elements l, l + 32, … (the canonical lane order of the row's dot
// products), in registers for the whole chunk; the unnormalised output o[j] goes to `out`.
// The blocks also move each sequence's conv window to the chunk's last inputs.
// Grid (Hv, ceil(dv / SCAN_WARPS), sequences), block 32·SCAN_WARPS.
extern "C" __global__ void __launch_bounds__(32 * SCAN_WARPS) gdn_scan(const float* prep, const float* qkv, u32 kc, u32 hk, u32 hv, u32 dk, u32 dv,
                                                                      u32 layer, const SeqDesc* seqs, const SlotDesc* slots, float* out) {
    const u32 h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 j = blockIdx.y * SCAN_WARPS + warp;
    const SeqDesc sq = seqs[blockIdx.z];
    const u32 key_dim = hk * dk, value_dim = hv * dv, cd = 2 * key_dim + value_dim, pd = cd + 2 * hv;
    const u32 kappa = h / (hv / hk);
    float* state = (float*)slots[sq.slot].rec + ((u64)layer * hv + h) * dv * dk;
    // The state was last written by this layer's GDN kernel in an earlier step (pdl_enter in
    // common.cuh): read before waiting.
    float S[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const u32 i = lane + 32 * e;
        S[e] = (j < dv && i < dk) ? state[(u64)j * dk + i] : 0.0f;
    }
    pdl_enter();
    PROBE_SKIP(GDN);
    if (sq.len == 0) return;
    // The new conv window (gdn_prep, which read the old one, has completed): inputs
    // len − (kc − 1) … len − 1, the older ones from the old window, entries in increasing order
    // (entry i reads entry i + len, not yet replaced).
    {
        float* conv = (float*)slots[sq.slot].conv + (u64)layer * (kc - 1) * cd;
        const u32 nb = gridDim.x * gridDim.y, fb = blockIdx.x * gridDim.y + blockIdx.y;
        for (u32 ch = fb * blockDim.x + threadIdx.x; ch < cd; ch += nb * blockDim.x)
            for (u32 i = 0; i + 1 < kc; i++) {
                const int idx = (int)sq.len - (int)(kc - 1) + (int)i;
                conv[(u64)i * cd + ch] = idx >= 0 ? qkv[(sq.first_row + (u64)idx) * cd + ch] : conv[(u64)((int)kc - 1 + idx) * cd + ch];
            }
    }
    if (j >= dv) return;
    const float* base = prep + (u64)sq.first_row * pd;
    const u32 qo = kappa * dk, ko = key_dim + kappa * dk, vo = 2 * key_dim + h * dv + j;
    float kk[SCAN_AHEAD][4], qq[SCAN_AHEAD][4], vv[SCAN_AHEAD], bb[SCAN_AHEAD], aa[SCAN_AHEAD];
    auto load = [&](u32 t, int s) {
        if (t >= sq.len) return;
        const float* r = base + (u64)t * pd;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const u32 i = lane + 32 * e;
            kk[s][e] = i < dk ? r[ko + i] : 0.0f;
            qq[s][e] = i < dk ? r[qo + i] : 0.0f;
        }
        vv[s] = r[vo];
        bb[s] = r[cd + h];
        aa[s] = r[cd + hv + h];
    };
#pragma unroll
    for (int s = 0; s < SCAN_AHEAD; s++) load(s, s);
    for (u32 t0 = 0; t0 < sq.len; t0 += SCAN_AHEAD) {
#pragma unroll
        for (int s = 0; s < SCAN_AHEAD; s++) {
            const u32 t = t0 + s;
            if (t >= sq.len) break;
            const float alpha = aa[s], beta = bb[s];
            // Decay, then mem = S·k: each lane its own elements i < dk in order.
            float acc = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (lane + 32 * e < dk) {
                    S[e] = S[e] * alpha;
                    acc = fmaf(S[e], kk[s][e], acc);
                }
            const float mem = __shfl_sync(FULL_MASK, fold32(acc), 0);
            const float delta = (vv[s] - mem) * beta;
            float o = 0.0f;
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (lane + 32 * e < dk) {
                    S[e] = fmaf(kk[s][e], delta, S[e]);
                    o = fmaf(S[e], qq[s][e], o);
                }
            const float ot = fold32(o);
            if (lane == 0) out[(sq.first_row + (u64)t) * value_dim + (u64)h * dv + j] = ot;
            load(t + SCAN_AHEAD, s);
        }
    }
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const u32 i = lane + 32 * e;
        if (i < dk) state[(u64)j * dk + i] = S[e];
    }
}

// The gated RMSNorm of each token's head output, in place: out = ((o·inv)·w)·silu(z).
// Grid (Hv, longest sequence, sequences), block 128.
extern "C" __global__ void __launch_bounds__(128) gdn_out(const float* z, const float* norm_w, float eps, u32 hv, u32 dv, const SeqDesc* seqs, float* out) {
    __shared__ float o[128];
    __shared__ float inv_s;
    const u32 j = threadIdx.x, h = blockIdx.x, t = blockIdx.y;
    const float nw = j < dv ? norm_w[j] : 0.0f;
    pdl_enter();
    PROBE_SKIP(GDN);
    const SeqDesc sq = seqs[blockIdx.z];
    if (t >= sq.len) return;
    const u64 at = (sq.first_row + (u64)t) * hv * dv + (u64)h * dv;
    float zj = 0.0f;
    if (j < dv) {
        o[j] = out[at + j];
        zj = z[at + j];
    }
    __syncthreads();
    if (j < 32) {
        const float ss = warp_dot(o, o, dv);
        if (j == 0) inv_s = tf_rsqrt(ss / (float)dv + eps);
    }
    __syncthreads();
    if (j < dv) out[at + j] = ((o[j] * inv_s) * nw) * tf_silu(zj);
}
