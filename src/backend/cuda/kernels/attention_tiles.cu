// Gated attention, part 2: per (query row, head, tile of 256 positions) the tile's max score m,
// sum of exponentials l and weighted values o[Dh] (numerics §6), from the scores attn_scores
// wrote into the tile's partial entry.
// CPU twin: backend::cpu::kernels::attend (tile loop).
// Grid: (rows · Hq, blocks), block 256 (8 warps). Work items are (tile, G·32 of the Dh values):
// blocks stride over them, so any grid (and any G) gives the same partials. An item computes the
// tile's max m and exponentials e_i = exp(s_i - m) (every item of a tile the same numbers), then
// walks the positions in stages of 256/G: the stage's value slice [positions][G·32] is requested
// at once (every thread 8 vector loads, all in flight) into shared memory, and warp w < G adds
// e_i · v_i for its 32 values in position order. The item of the first values also writes m and
// l, l summed by one thread in i order. Steps of up to 64 rows (decode, batched decode) use
// G = 1 (a whole tile's slice in one round trip, the most items); larger steps (prompts), which
// have rows to spare, the largest G of 8, 4, 2 dividing head_dim / 32 (8 for head_dim 256).
// Needs dh <= 256 and dh % (32·G) == 0, G a power of two up to 8 (chosen on the host).

#define AT_V4 (TILE * 32 / 4 / 256)  // float4 loads per thread per stage (8)

// One set for every instantiation of tiles_body (a function's own would be one per G).
__shared__ float e[TILE];
__shared__ float4 vs[TILE * 32 / 4];  // one stage's values, [position][gw·32]
__shared__ float red[8];

template <u32 gw>
__device__ __forceinline__ void tiles_body(u32 hq, u32 hkv, u32 dh, u32 layer, u32 max_pages, u32 max_tiles, const RowDesc* rows,
                                           const SlotDesc* slots, float* part) {
    u32 r = blockIdx.x / hq, h = blockIdx.x % hq;
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    RowDesc row = rows[r];
    u32 p = row.pos;
    const u32 width = gw * 32, pc = TILE / gw, w4 = width / 4;  // values per item, positions per stage
    u32 n_tiles = p / TILE + 1, nd = dh / width;
    u32 items = n_tiles * nd;
    if (blockIdx.y >= items) return;
    u32 g = h / (hq / hkv);
    const u64* pages = (const u64*)slots[row.slot].pages + (u64)layer * 2 * max_pages;
    // The tables come from the host before the step; the scores (previous kernel) and the new
    // value row (the kernel before it) are read after the wait.
    pdl_enter();
    PROBE_SKIP(ATTN);
    float4 zero;
    zero.x = zero.y = zero.z = zero.w = 0.0f;
    for (u32 k = blockIdx.y; k < items; k += gridDim.y) {
        u32 t = k / nd, c = k % nd, lo = t * TILE;
        u32 n = (p + 1 - lo) < TILE ? (p + 1 - lo) : TILE;
        const float* vp = (const float*)pages[max_pages + t] + (u64)g * dh + c * width;
        // The first stage's values are requested before the scores are read.
        float4 vr[AT_V4];
#pragma unroll
        for (u32 q = 0; q < AT_V4; q++) {
            u32 f = threadIdx.x + 256 * q, i = f / w4;
            vr[q] = i < n ? ((const float4*)(vp + (u64)i * hkv * dh))[f % w4] : zero;
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
        float acc = 0.0f;
        for (u32 i0 = 0; i0 < n; i0 += pc) {
            if (i0 > 0) {
#pragma unroll
                for (u32 q = 0; q < AT_V4; q++) {
                    u32 f = threadIdx.x + 256 * q, i = i0 + f / w4;
                    vr[q] = i < n ? ((const float4*)(vp + (u64)i * hkv * dh))[f % w4] : zero;
                }
            }
#pragma unroll
            for (u32 q = 0; q < AT_V4; q++) vs[threadIdx.x + 256 * q] = vr[q];
            __syncthreads();
            if (i0 == 0 && c == 0 && threadIdx.x == 32) {  // one thread of warp 1 (warp 0 always has values)
                float l = 0.0f;
                for (u32 i = 0; i < n; i++) l += e[i];
                out[0] = m;
                out[1] = l;
            }
            if (warp < gw) {
                const float* vf = (const float*)vs + warp * 32 + lane;
                u32 m_i = n - i0 < pc ? n - i0 : pc;
                for (u32 i = 0; i < m_i; i++) acc = fmaf(e[i0 + i], vf[i * width], acc);
            }
            __syncthreads();
        }
        if (warp < gw) out[2 + c * width + warp * 32 + lane] = acc;
    }
}

extern "C" __global__ void __launch_bounds__(256) attn_tiles(u32 hq, u32 hkv, u32 dh, u32 layer, u32 max_pages, u32 max_tiles, u32 gw,
                                                             const RowDesc* rows, const SlotDesc* slots, float* part) {
    // G a compile-time constant: the slice's indexing is shifts, not divisions.
    if (gw == 8) tiles_body<8>(hq, hkv, dh, layer, max_pages, max_tiles, rows, slots, part);
    else if (gw == 4) tiles_body<4>(hq, hkv, dh, layer, max_pages, max_tiles, rows, slots, part);
    else if (gw == 2) tiles_body<2>(hq, hkv, dh, layer, max_pages, max_tiles, rows, slots, part);
    else tiles_body<1>(hq, hkv, dh, layer, max_pages, max_tiles, rows, slots, part);
}
