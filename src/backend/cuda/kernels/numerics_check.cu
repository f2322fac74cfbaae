// Self-test of the portable functions: evaluates each on an array so the host can compare the
// bits with numerics::{exp, log, softplus, sigmoid, silu}. Grid: ceil(n / 256), block 256.
extern "C" __global__ void numerics_check(const float* x, u32 n, float* out) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    out[5 * (u64)i + 0] = tf_exp(v);
    out[5 * (u64)i + 1] = tf_log(v);
    out[5 * (u64)i + 2] = tf_softplus(v);
    out[5 * (u64)i + 3] = tf_sigmoid(v);
    out[5 * (u64)i + 4] = tf_silu(v);
}
