// The device's float32 FMA peak for `tensorfold bench`: every thread runs 8 independent chains
// of fmaf (no memory traffic), then stores one value so nothing is optimised away.
// No CPU twin: a measurement, not part of the model.
extern "C" __global__ void fma_peak(float* out, u32 iters, float a, float b) {
    float x0 = threadIdx.x, x1 = x0 + 1.0f, x2 = x0 + 2.0f, x3 = x0 + 3.0f;
    float x4 = x0 + 4.0f, x5 = x0 + 5.0f, x6 = x0 + 6.0f, x7 = x0 + 7.0f;
    for (u32 i = 0; i < iters; i++) {
        x0 = fmaf(x0, a, b); x1 = fmaf(x1, a, b); x2 = fmaf(x2, a, b); x3 = fmaf(x3, a, b);
        x4 = fmaf(x4, a, b); x5 = fmaf(x5, a, b); x6 = fmaf(x6, a, b); x7 = fmaf(x7, a, b);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
}

// A step kernel that does nothing but take its turn in the stream (pdl_enter, common.cuh):
// `tensorfold bench` times a graph of as many of them as a decode token launches, the floor
// that a chain of dependent kernels costs before any of them does work.
extern "C" __global__ void chain_link() { pdl_enter(); }
