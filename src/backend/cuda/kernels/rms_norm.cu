// RMSNorm of rows, optionally after a residual add.
// CPU twins: backend::cpu::kernels::rms_norm_row (Cpu::rms_norm) and Cpu::add_rms_norm.
// Grid: rows, block 256. The block stages the row in shared memory (cols <= 8192), then warp 0
// computes the canonical sum of squares (numerics §2/§3) from it.

#define MAX_COLS 8192

__device__ void norm_row(const float* xr, const float* w, float eps, u32 cols, float* outr) {
    __shared__ float inv_s;
    __shared__ float row[MAX_COLS];
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) row[i] = xr[i];
    __syncthreads();
    if (threadIdx.x < 32) {
        float acc = 0.0f;
        for (u32 i = threadIdx.x; i < cols; i += 32) acc = fmaf(row[i], row[i], acc);
        float ss = fold32(acc);
        if (threadIdx.x == 0) inv_s = tf_rsqrt(ss / (float)cols + eps);
    }
    __syncthreads();
    float inv = inv_s;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) outr[i] = (row[i] * inv) * w[i];
}

extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float eps, u32 cols, float* out) {
    u64 r = blockIdx.x;
    norm_row(x + r * cols, w, eps, cols, out + r * cols);
}

// x[r] += y[r]; out[r] = RMSNorm(x[r]). Each thread reads back only what it wrote before the
// barrier inside norm_row.
extern "C" __global__ void add_rms_norm_rows(float* x, const float* y, const float* w, float eps, u32 cols, float* out) {
    u64 r = blockIdx.x;
    float* xr = x + r * cols;
    const float* yr = y + r * cols;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) xr[i] = xr[i] + yr[i];
    norm_row(xr, w, eps, cols, out + r * cols);
}
