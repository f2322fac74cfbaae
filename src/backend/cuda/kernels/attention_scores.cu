// Gated attention, part 1: the scaled scores s = dot(q, k_i) · Dh^-1/2 of every position i up to
// the row's own (numerics §6), written into the tile partials (after each tile's m, l and o; see
// attn_tiles). The query is q_norm's RMSNorm then RoPE (attention_group), computed by each block.
// CPU twin: backend::cpu::kernels::attend (the scores) after attention_group's q norm and RoPE.
// Grid: (rows · Hq, blocks), block 256. Work items are (tile, 32 positions); blocks stride over
// them, so any grid gives the same scores. Warp w takes positions 4w .. 4w + 3 of an item with
// all their key loads in flight together; each score is warp_dot's canonical order (lane l:
// elements l, l+32, ... ascending; fmaf(q, k) = fmaf(k, q) exactly). Needs dh <= 256 (checked on
// the host).

#define SC_POS 32  // positions per work item
#define SC_PW 4    // positions per warp
#define SC_D 8     // 256 / 32: elements of a key per lane

extern "C" __global__ void __launch_bounds__(256) attn_scores(const float* q_gate, const float* q_norm, float eps, const float* rope, u32 rd, u32 hq,
                                                              u32 hkv, u32 dh, u32 layer, u32 max_pages, u32 max_tiles, const RowDesc* rows,
                                                              const SlotDesc* slots, float* part) {
    __shared__ float q[256];
    __shared__ float inv_s;
    u32 r = blockIdx.x / hq, h = blockIdx.x % hq;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    RowDesc row = rows[r];
    u32 p = row.pos;
    u32 n_tiles = p / TILE + 1;
    u32 items = n_tiles * (TILE / SC_POS);
    if (blockIdx.y >= items) return;
    u32 g = h / (hq / hkv);
    const u64* pages = (const u64*)slots[row.slot].pages + (u64)layer * 2 * max_pages;
    // The row, slot and page tables come from the host before the step: read above without
    // waiting; the query and the new key row come from the previous kernels.
    pdl_enter();
    PROBE_SKIP(ATTN);
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
    float qv[SC_D];
#pragma unroll
    for (u32 dd = 0; dd < SC_D; dd++) qv[dd] = lane + 32 * dd < dh ? q[lane + 32 * dd] : 0.0f;
    const float scale = tf_rsqrt((float)dh);
    for (u32 k = blockIdx.y; k < items; k += gridDim.y) {
        u32 t = k / (TILE / SC_POS), lo = t * TILE;
        u32 n = (p + 1 - lo) < TILE ? (p + 1 - lo) : TILE;
        u32 first = (k % (TILE / SC_POS)) * SC_POS + warp * SC_PW;  // this warp's first position in the tile
        if (first >= n) continue;
        const float* kp = (const float*)pages[t];
        float kv[SC_PW][SC_D];
#pragma unroll
        for (u32 j = 0; j < SC_PW; j++)
#pragma unroll
            for (u32 dd = 0; dd < SC_D; dd++) {
                u32 i = first + j, d = lane + 32 * dd;
                kv[j][dd] = i < n && d < dh ? kp[((u64)i * hkv + g) * dh + d] : 0.0f;
            }
        float* sc = part + (((u64)r * hq + h) * max_tiles + t) * PART_STRIDE(dh) + dh + 2;
#pragma unroll
        for (u32 j = 0; j < SC_PW; j++) {
            // Elements past dh are skipped, not added as zeros (warp_dot's order).
            float acc = 0.0f;
#pragma unroll
            for (u32 dd = 0; dd < SC_D; dd++)
                if (lane + 32 * dd < dh) acc = fmaf(qv[dd], kv[j][dd], acc);
            float s = fold32(acc) * scale;
            if (lane == 0 && first + j < n) sc[first + j] = s;
        }
    }
}
