// RMSNorm of rows, optionally after a residual add.
// CPU twins: backend::cpu::kernels::rms_norm_row (Cpu::rms_norm) and Cpu::add_rms_norm.
// Grid: rows, block 256. Warp 0 computes the canonical sum of squares (numerics §2/§3).

__device__ void norm_row(const float* xr, const float* w, float eps, u32 cols, float* outr) {
    __shared__ float inv_s;
    if (threadIdx.x < 32) {
        float ss = warp_dot(xr, xr, cols);
        if (threadIdx.x == 0) inv_s = tf_rsqrt(ss / (float)cols + eps);
    }
    __syncthreads();
    float inv = inv_s;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) outr[i] = (xr[i] * inv) * w[i];
}

extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float eps, u32 cols, float* out) {
    u64 r = blockIdx.x;
    norm_row(x + r * cols, w, eps, cols, out + r * cols);
}

// x[r] += y[r]; out[r] = RMSNorm(x[r]).
extern "C" __global__ void add_rms_norm_rows(float* x, const float* y, const float* w, float eps, u32 cols, float* out) {
    u64 r = blockIdx.x;
    float* xr = x + r * cols;
    const float* yr = y + r * cols;
    for (u32 i = threadIdx.x; i < cols; i += blockDim.x) xr[i] = xr[i] + yr[i];
    __syncthreads();
    norm_row(xr, w, eps, cols, out + r * cols);
}
