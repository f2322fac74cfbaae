// Gated attention, part 2: per (query row, head, tile of 256 positions) the tile's max score m,
// sum of exponentials l and weighted values o[Dh] (numerics §6), from the scores attn_scores
// wrote into the tile's partial entry.
// CPU twin: backend::cpu::kernels::attend (tile loop).
// Grid: (rows · Hq, blocks), block 256 (8 warps). Work items are (tile, 32 of the Dh values);
// blocks stride over them, so any grid gives the same partials. An item first asks for its
// slice of the tile's values, [positions][32] (every thread 8 vector loads, all in flight:
// one round trip to memory per item, where a thread walking its own column waited once per
// batch), then computes the tile's m and exponentials e_i = exp(s_i - m) (every item of a tile
// the same numbers), parks the slice in shared memory, and warp 0 sums e_i · v_i for its 32
// values sequentially in i. The item of the first 32 values also writes m and l, l summed by one
// thread in i order. Needs dh <= 256 and dh % 32 == 0 (checked on the host).

#define AT_DC 32                   // values per work item
#define AT_V4 (TILE * AT_DC / 4 / 256)  // float4 loads per thread for a whole tile's slice

extern "C" __global__ void __launch_bounds__(256) attn_tiles(u32 hq, u32 hkv, u32 dh, u32 layer, u32 max_pages, u32 max_tiles,
                                                             const RowDesc* rows, const SlotDesc* slots, float* part) {
    __shared__ float e[TILE];
    __shared__ float4 vs[TILE * AT_DC / 4];  // the item's values, [position][AT_DC]
    __shared__ float red[8];
    u32 r = blockIdx.x / hq, h = blockIdx.x % hq;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    RowDesc row = rows[r];
    u32 p = row.pos;
    u32 n_tiles = p / TILE + 1, nd = dh / AT_DC;
    u32 items = n_tiles * nd;
    if (blockIdx.y >= items) return;
    u32 g = h / (hq / hkv);
    const u64* pages = (const u64*)slots[row.slot].pages + (u64)layer * 2 * max_pages;
    // The tables come from the host before the step; the scores (previous kernel) and the new
    // value row (the kernel before it) are read after the wait.
    pdl_enter();
    PROBE_SKIP(ATTN);
    for (u32 k = blockIdx.y; k < items; k += gridDim.y) {
        u32 t = k / nd, c = k % nd, lo = t * TILE;
        u32 n = (p + 1 - lo) < TILE ? (p + 1 - lo) : TILE;
        const float* vp = (const float*)pages[max_pages + t] + (u64)g * dh + c * AT_DC;
        float4 vr[AT_V4];
        float4 zero;
        zero.x = zero.y = zero.z = zero.w = 0.0f;
#pragma unroll
        for (u32 q = 0; q < AT_V4; q++) {
            u32 f = threadIdx.x + 256 * q, i = f / (AT_DC / 4), d4 = f % (AT_DC / 4);
            vr[q] = i < n ? ((const float4*)(vp + (u64)i * hkv * dh))[d4] : zero;
        }
        float* out = part + (((u64)r * hq + h) * max_tiles + t) * PART_STRIDE(dh);
        float s = threadIdx.x < n ? out[dh + 2 + threadIdx.x] : __int_as_float(0xff800000);
        // m = max over the tile (exact in any order).
        float m = s;
        for (u32 o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
        if (lane == 0) red[warp] = m;
        __syncthreads();
        m = red[0];
        for (u32 w = 1; w < 8; w++) m = fmaxf(m, red[w]);
        if (threadIdx.x < n) e[threadIdx.x] = tf_exp(s - m);
#pragma unroll
        for (u32 q = 0; q < AT_V4; q++) vs[threadIdx.x + 256 * q] = vr[q];
        __syncthreads();
        if (c == 0 && threadIdx.x == 32) {  // warp 1: warp 0 is busy with the values
            float l = 0.0f;
            for (u32 i = 0; i < n; i++) l += e[i];
            out[0] = m;
            out[1] = l;
        }
        if (warp == 0) {
            const float* vf = (const float*)vs;
            float acc = 0.0f;
            for (u32 i = 0; i < n; i++) acc = fmaf(e[i], vf[i * AT_DC + lane], acc);
            out[2 + c * AT_DC + lane] = acc;
        }
        __syncthreads();
    }
}
