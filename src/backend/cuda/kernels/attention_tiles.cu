// Gated attention, part 1: per (query row, head, tile of 256 positions) the tile's max score m,
// sum of exponentials l and weighted values o[Dh] (numerics §6). Blocks stride over the tiles,
// so any grid size gives the same partials.
// CPU twin: backend::cpu::kernels::attend (tile loop) after attention_group's q norm and RoPE.
// Grid: (rows · Hq, blocks per query), block 256 (8 warps).

// Loads in flight (scheduling only, never the arithmetic; TENSORFOLD_CUDA_DEFINES): ATTN_SP
// positions per warp and ATTN_DU of their 32-element steps in the score loop, ATTN_VB positions
// per thread in the value loop.
#ifndef ATTN_SP
#define ATTN_SP 8
#endif
#ifndef ATTN_DU
#define ATTN_DU 4
#endif
#ifndef ATTN_VB
#define ATTN_VB 32
#endif
#if ATTN_SP < 1 || ATTN_DU < 1 || ATTN_VB < 1
#error "ATTN_SP, ATTN_DU and ATTN_VB must be at least 1 (a step of no positions never ends)"
#endif
#define TF_PRAGMA(x) _Pragma(#x)
#define TF_UNROLL(n) TF_PRAGMA(unroll n)

extern "C" __global__ void attn_tiles(const float* q_gate, const float* q_norm, float eps, const float* rope,
                                      u32 rd, u32 hq, u32 hkv, u32 dh, u32 layer, u32 max_pages, u32 max_tiles,
                                      const RowDesc* rows, const SlotDesc* slots, float* part) {
    __shared__ float q[256];
    __shared__ float e[TILE];
    __shared__ float red[8];
    __shared__ float inv_s;
    u32 r = blockIdx.x / hq, h = blockIdx.x % hq;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    RowDesc row = rows[r];
    u32 p = row.pos;
    u32 n_tiles = p / TILE + 1;
    if (blockIdx.y >= n_tiles) return;
    u32 g = h / (hq / hkv);
    const u64* pages = (const u64*)slots[row.slot].pages + (u64)layer * 2 * max_pages;
    // The row, slot and page tables come from the host before the step: read above without
    // waiting; the queries and the new key and value rows come from the previous kernels.
    pdl_enter();
    PROBE_SKIP(ATTN);
    // q: RMSNorm with q_norm, then RoPE (attention_group).
    const float* qr = q_gate + (u64)r * hq * 2 * dh + (u64)h * 2 * dh;
    if (warp == 0) {
        float ss = warp_dot(qr, qr, dh);
        if (lane == 0) inv_s = tf_rsqrt(ss / (float)dh + eps);
    }
    __syncthreads();
    for (u32 d = threadIdx.x; d < dh; d += blockDim.x) q[d] = (qr[d] * inv_s) * q_norm[d];
    __syncthreads();
    u32 half = rd / 2;
    const float* cs = rope + (u64)p * rd;
    for (u32 i = threadIdx.x; i < half; i += blockDim.x) {
        float x0 = q[i], x1 = q[i + half], c = cs[i], s = cs[half + i];
        q[i] = fmaf(x0, c, -(x1 * s));
        q[i + half] = fmaf(x1, c, x0 * s);
    }
    __syncthreads();
    float scale = tf_rsqrt((float)dh);
    for (u32 t = blockIdx.y; t < n_tiles; t += gridDim.y) {
        u32 lo = t * TILE;
        u32 n = (p + 1 - lo) < TILE ? (p + 1 - lo) : TILE;
        const float* kp = (const float*)pages[t];
        const float* vp = (const float*)pages[max_pages + t];
        // The tile's values are read after the scores: ask L2 for them now.
        for (u32 c = threadIdx.x * 32; c < n * dh; c += blockDim.x * 32) {
            u32 i = c / dh, d = c % dh;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vp + ((u64)i * hkv + g) * dh + d));
        }
        // Scores: warp w takes positions w + 8k, SP of them at a time so that their key loads
        // are in flight together; each is warp_dot's canonical order (lane l: elements l, l+32,
        // ... ascending; fmaf(q, k) = fmaf(k, q) exactly).
        const u32 SP = ATTN_SP;
        for (u32 i0 = warp; i0 < n; i0 += 8 * SP) {
            float acc[SP];
#pragma unroll
            for (u32 k = 0; k < SP; k++) acc[k] = 0.0f;
            TF_UNROLL(ATTN_DU)
            for (u32 d = lane; d < dh; d += 32) {
                float qd = q[d], kv[SP];
#pragma unroll
                for (u32 k = 0; k < SP; k++) {
                    u32 i = i0 + 8 * k;
                    kv[k] = i < n ? kp[((u64)i * hkv + g) * dh + d] : 0.0f;
                }
#pragma unroll
                for (u32 k = 0; k < SP; k++) acc[k] = fmaf(qd, kv[k], acc[k]);
            }
#pragma unroll
            for (u32 k = 0; k < SP; k++) {
                float s = fold32(acc[k]) * scale;
                if (lane == 0 && i0 + 8 * k < n) e[i0 + 8 * k] = s;
            }
        }
        __syncthreads();
        // m = max over the tile (exact in any order).
        float m = threadIdx.x < n ? e[threadIdx.x] : __int_as_float(0xff800000);
        for (u32 o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
        if (lane == 0) red[warp] = m;
        __syncthreads();
        m = red[0];
        for (u32 w = 1; w < 8; w++) m = fmaxf(m, red[w]);
        __syncthreads();
        if (threadIdx.x < n) e[threadIdx.x] = tf_exp(e[threadIdx.x] - m);
        __syncthreads();
        float* out = part + (((u64)r * hq + h) * max_tiles + t) * (dh + 2);
        if (threadIdx.x == 0) {
            float l = 0.0f;
            for (u32 i = 0; i < n; i++) l += e[i];
            out[0] = m;
            out[1] = l;
        }
        // Weighted values, sequential in i per d; VB value loads in flight per thread.
        const u32 VB = ATTN_VB;
        for (u32 d = threadIdx.x; d < dh; d += blockDim.x) {
            float acc = 0.0f;
            u32 i = 0;
            for (; i + VB <= n; i += VB) {
                float vv[VB];
#pragma unroll
                for (u32 k = 0; k < VB; k++) vv[k] = vp[((u64)(i + k) * hkv + g) * dh + d];
#pragma unroll
                for (u32 k = 0; k < VB; k++) acc = fmaf(e[i + k], vv[k], acc);
            }
            for (; i < n; i++) acc = fmaf(e[i], vp[((u64)i * hkv + g) * dh + d], acc);
            out[2 + d] = acc;
        }
        __syncthreads();
    }
}
