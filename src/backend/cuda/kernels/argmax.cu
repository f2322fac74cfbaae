// Greedy sampling: the largest logit of each row, the smallest id among equal ones, NaN read as
// -inf. CPU twin: sampling::argmax. Two passes: `argmax_part` finds the best of each of 64 slices
// of a row (grid (64, rows), block 256), `argmax_rows` the best of those and writes the id to
// `out[i]` and to `next_ids[i]` (where the next decode step reads its token; grid rows, block 64).
// The order is total (value desc, id asc), so the result does not depend on how it is split.

__device__ __forceinline__ void better(float& bv, u32& bi, float v, u32 i) {
    if (i != 0xffffffffu && (bi == 0xffffffffu || v > bv || (v == bv && i < bi))) {
        bv = v;
        bi = i;
    }
}

#define PARTS 64

__device__ void block_best(float& bv, u32& bi, float* sv, u32* si) {
    for (u32 o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(FULL_MASK, bv, o);
        u32 i = __shfl_xor_sync(FULL_MASK, bi, o);
        better(bv, bi, v, i);
    }
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (u32 w = 1; w < (blockDim.x >> 5); w++) better(bv, bi, sv[w], si[w]);
}

extern "C" __global__ void argmax_part(const float* logits, u32 v_eff, u32 ldv, float* part_v, u32* part_i) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ u32 si[32];
    u64 r = blockIdx.y;
    const float* row = logits + r * ldv;
    u32 per = (v_eff + PARTS - 1) / PARTS;
    u32 lo = blockIdx.x * per, hi = lo + per < v_eff ? lo + per : v_eff;
    float bv = __int_as_float(0xff800000);
    u32 bi = 0xffffffffu;
    // AM_U logits per thread requested together (the LM head just wrote them to L2): one round
    // trip per AM_U instead of one per logit. Each thread still visits its ids in increasing order.
    const u32 AM_U = 16;
    for (u32 i0 = lo + threadIdx.x; i0 < hi; i0 += AM_U * blockDim.x) {
        float l[AM_U];
#pragma unroll
        for (u32 u = 0; u < AM_U; u++) {
            u32 i = i0 + u * blockDim.x;
            l[u] = i < hi ? row[i] : 0.0f;
        }
#pragma unroll
        for (u32 u = 0; u < AM_U; u++) {
            u32 i = i0 + u * blockDim.x;
            if (i < hi) better(bv, bi, l[u] != l[u] ? __int_as_float(0xff800000) : l[u], i);
        }
    }
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        part_v[r * PARTS + blockIdx.x] = bv;
        part_i[r * PARTS + blockIdx.x] = bi;
    }
}

extern "C" __global__ void argmax_rows(const float* part_v, const u32* part_i, u32* out, u32* next_ids) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ u32 si[32];
    u64 r = blockIdx.x;
    float bv = __int_as_float(0xff800000);
    u32 bi = 0xffffffffu;
    better(bv, bi, part_v[r * PARTS + threadIdx.x], part_i[r * PARTS + threadIdx.x]);
    block_best(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        out[r] = bi;
        next_ids[r] = bi;
    }
}
