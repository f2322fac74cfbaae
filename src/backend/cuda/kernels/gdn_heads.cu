// Gated DeltaNet gates, delta rule and gated RMSNorm: one block per (value head, sequence),
// tokens in order, state rows updated in place in the slot's recurrent state.
// CPU twin: backend::cpu::kernels::gdn_head with gdn_rows_ref (numerics §4 steps 3-5).
// Grid: (Hv, n_seqs), block 1024 (32 warps; warp w takes state rows w, w+32, ...).

extern "C" __global__ void gdn_heads(const float* y, const float* qn, const float* kn, const float* z,
                                     const float* b, const float* a, const float* a_neg, const float* dt_bias,
                                     const float* norm_w, float eps, u32 hk, u32 hv, u32 dk, u32 dv, u32 layer,
                                     const SeqDesc* seqs, const SlotDesc* slots, float* out) {
    extern __shared__ float o[];  // dv outputs of the current token
    __shared__ float inv_s;
    u32 h = blockIdx.x;
    SeqDesc sq = seqs[blockIdx.y];
    u32 key_dim = hk * dk, value_dim = hv * dv, cd = 2 * key_dim + value_dim;
    u32 kappa = h / (hv / hk);
    float* state = (float*)slots[sq.slot].rec + ((u64)layer * hv + h) * dv * dk;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (u32 t = 0; t < sq.len; t++) {
        u64 row = sq.first_row + t;
        float beta = tf_sigmoid(b[row * hv + h]);
        float alpha = tf_exp(a_neg[h] * tf_softplus(a[row * hv + h] + dt_bias[h]));
        const float* kh = kn + row * key_dim + (u64)kappa * dk;
        const float* qh = qn + row * key_dim + (u64)kappa * dk;
        const float* v = y + row * cd + 2 * key_dim + (u64)h * dv;
        for (u32 j = warp; j < dv; j += nwarps) {
            float* s = state + (u64)j * dk;
            float acc = 0.0f;
            for (u32 i = lane; i < dk; i += 32) {
                float sv = s[i] * alpha;
                s[i] = sv;
                acc = fmaf(sv, kh[i], acc);
            }
            float mem = __shfl_sync(FULL_MASK, fold32(acc), 0);
            float delta = (v[j] - mem) * beta;
            acc = 0.0f;
            for (u32 i = lane; i < dk; i += 32) {
                float sv = fmaf(kh[i], delta, s[i]);
                s[i] = sv;
                acc = fmaf(sv, qh[i], acc);
            }
            float oj = fold32(acc);
            if (lane == 0) o[j] = oj;
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
}
