// out[i] = x[rows[i]].
// CPU twin: Cpu::gather_rows.
extern "C" __global__ void gather_rows(const float* x, const u32* rows, u32 cols, float* out) {
    pdl_enter();
    u64 i = blockIdx.y;
    u32 k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < cols) out[i * cols + k] = x[(u64)rows[i] * cols + k];
}
