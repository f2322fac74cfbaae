// Greedy sampling: the largest logit of each row, the smallest id among equal ones, NaN read as
// -inf. CPU twin: sampling::argmax. Writes the id to `out[i]` and to `next_ids[i]` (where the
// next decode step reads its token). Grid: logits rows, block 1024.

__device__ __forceinline__ void better(float& bv, u32& bi, float v, u32 i) {
    if (i != 0xffffffffu && (bi == 0xffffffffu || v > bv || (v == bv && i < bi))) {
        bv = v;
        bi = i;
    }
}

extern "C" __global__ void argmax_rows(const float* logits, u32 v_eff, u32 ldv, u32* out, u32* next_ids) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    u64 r = blockIdx.x;
    const float* row = logits + r * ldv;
    float bv = __int_as_float(0xff800000);
    u32 bi = 0xffffffffu;
    for (u32 i = threadIdx.x; i < v_eff; i += blockDim.x) {
        float l = row[i];
        if (l != l) l = __int_as_float(0xff800000);
        better(bv, bi, l, i);
    }
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
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < (blockDim.x >> 5); w++) better(bv, bi, sv[w], si[w]);
        out[r] = bi;
        next_ids[r] = bi;
    }
}
