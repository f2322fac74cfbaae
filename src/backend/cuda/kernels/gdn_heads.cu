// Gated DeltaNet q/k L2 norms, gates, delta rule and gated RMSNorm: one block per (value head,
// sequence), tokens in order. Every warp normalises the head's q and k itself (the same
// arithmetic in each, no block barrier). The head's state stays in registers for the whole
// step: warp w holds rows w, w+32, ... (up to 4), lane l holds elements l, l+32, ... (up to 4)
// of each, which is the canonical lane order of the row's dot products; the warp's rows are
// processed together.
// CPU twin: backend::cpu::kernels::gdn_qk_norm, then gdn_head with gdn_rows_ref (numerics §4
// steps 2-5).
// Grid: (Hv, n_seqs), block 1024 (32 warps). Needs dk <= 128 and dv <= 128 (checked on the host).

#define MAXR 4
#define MAXL 4

extern "C" __global__ void __launch_bounds__(1024) gdn_heads(const float* y, const float* z,
                                                             const float* b, const float* a, const float* a_neg, const float* dt_bias,
                                                             const float* norm_w, float eps, u32 hk, u32 hv, u32 dk, u32 dv, u32 layer,
                                                             const SeqDesc* seqs, const SlotDesc* slots, float* out) {
    pdl_enter();
    __shared__ float o[MAXR * 32];
    __shared__ float inv_s;
    u32 h = blockIdx.x;
    SeqDesc sq = seqs[blockIdx.y];
    u32 key_dim = hk * dk, value_dim = hv * dv, cd = 2 * key_dim + value_dim;
    u32 kappa = h / (hv / hk);
    float* state = (float*)slots[sq.slot].rec + ((u64)layer * hv + h) * dv * dk;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float S[MAXR][MAXL];
#pragma unroll
    for (int q = 0; q < MAXR; q++)
#pragma unroll
        for (int e = 0; e < MAXL; e++) {
            u32 j = warp + 32 * q, i = lane + 32 * e;
            S[q][e] = (j < dv && i < dk) ? state[(u64)j * dk + i] : 0.0f;
        }
    for (u32 t = 0; t < sq.len; t++) {
        u64 row = sq.first_row + t;
        float beta = tf_sigmoid(b[row * hv + h]);
        float alpha = tf_exp(a_neg[h] * tf_softplus(a[row * hv + h] + dt_bias[h]));
        // q/k L2 norm of key head kappa (gdn_qk_norm's arithmetic)
        const float* qh = y + row * cd + (u64)kappa * dk;
        const float* kh = y + row * cd + key_dim + (u64)kappa * dk;
        const float* v = y + row * cd + 2 * key_dim + (u64)h * dv;
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
        // Decay, then mem = S·k, per row (lanes past dk hold 0 and add nothing... they are
        // skipped: each lane only accumulates its own elements i < dk, in order).
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
        for (u32 j = threadIdx.x; j < dv; j += blockDim.x) {
            float zj = z[row * value_dim + (u64)h * dv + j];
            out[row * value_dim + (u64)h * dv + j] = ((o[j] * inv) * norm_w[j]) * tf_silu(zj);
        }
        __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < MAXR; q++)
#pragma unroll
        for (int e = 0; e < MAXL; e++) {
            u32 j = warp + 32 * q, i = lane + 32 * e;
            if (j < dv && i < dk) state[(u64)j * dk + i] = S[q][e];
        }
}
