// out = silu(gate) * up, elementwise.
// CPU twin: Cpu::swiglu (numerics::silu).
extern "C" __global__ void swiglu(const float* gate, const float* up, u32 n, float* out) {
    pdl_enter();
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tf_silu(gate[i]) * up[i];
}
