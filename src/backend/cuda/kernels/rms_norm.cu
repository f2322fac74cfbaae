// RMSNorm of rows (the norm of Backend::rms_norm_matmul and rms_norm_matmul_swiglu).
// CPU twin: backend::cpu::kernels::rms_norm_row (Cpu::rms_norm).
// Grid: rows, block 512. The block stages the row in shared memory (cols <= 8192), then warp 0
// computes the canonical sum of squares (numerics §2/§3) from it.

#define MAX_COLS 8192

// 1 / rms of a row already in shared memory (`row`, `cols` values), in every thread.
__device__ float inv_rms_staged(const float* row, float eps, u32 cols) {
    __shared__ float inv_s;
    if (threadIdx.x < 32) {
        float acc = 0.0f;
        u32 i = threadIdx.x;
        // Eight loads ahead of the ordered FMAs.
        for (; i + 7 * 32 < cols; i += 8 * 32) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = row[i + 32 * u];
#pragma unroll
            for (int u = 0; u < 8; u++) acc = fmaf(v[u], v[u], acc);
        }
        for (; i < cols; i += 32) acc = fmaf(row[i], row[i], acc);
        float ss = fold32(acc);
        if (threadIdx.x == 0) inv_s = tf_rsqrt(ss / (float)cols + eps);
    }
    __syncthreads();
    return inv_s;
}

// Norm weights held per thread when a row has at most WH values per thread (2048 columns at
// block 512): they are read before waiting on the previous kernel, off the critical path.
#define WH 4

extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float eps, u32 cols, float* out) {
    __shared__ float row[MAX_COLS];
    const bool held = cols <= WH * blockDim.x;
    float wv[WH];
#pragma unroll
    for (int k = 0; k < WH; k++) {
        u32 i = threadIdx.x + k * blockDim.x;
        wv[k] = held && i < cols ? w[i] : 0.0f;
    }
    pdl_enter();
    PROBE_SKIP(NORM);
    u64 r = blockIdx.x;
    const float* xr = x + r * cols;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) row[i] = xr[i];
    __syncthreads();
    float inv = inv_rms_staged(row, eps, cols);
    float* outr = out + r * cols;
    if (held) {
#pragma unroll
        for (int k = 0; k < WH; k++) {
            u32 i = threadIdx.x + k * blockDim.x;
            if (i < cols) outr[i] = (row[i] * inv) * wv[k];
        }
    } else {
        for (u32 i = threadIdx.x; i < cols; i += blockDim.x) outr[i] = (row[i] * inv) * w[i];
    }
}
