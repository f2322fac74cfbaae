// Embedding rows: x[r] = decode(table[ids[r]]).
// CPU twin: model::weights::Matrix::decode_row (via backend::cpu::kernels::embed).
// Grid: (ceil(cols / 256), rows), block 256: one thread per element.

// `sb`: scales and biases interleaved per group (CudaMatrix), elements of dtype `sdtype`.
extern "C" __global__ void embed_rows(const u8* words, const u8* sb, u32 fmt, u32 group,
                                      u32 sdtype, u32 cols, const u32* ids, float* x) {
    pdl_enter();
    u32 r = blockIdx.y;
    u32 k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= cols) return;
    u64 id = ids[r];
    float v;
    if (fmt == 4 || fmt == 8) {
        u32 bits = fmt, per_word = 32 / bits;
        u32 word = ((const u32*)words)[id * (cols / per_word) + k / per_word];
        float q = (float)((word >> (bits * (k % per_word))) & ((1u << bits) - 1u));
        u64 g = id * (cols / group) + k / group;
        v = fmaf(load_float(sb, 2 * g, sdtype), q, load_float(sb, 2 * g + 1, sdtype));
    } else {
        v = load_float(words, id * cols + k, fmt);
    }
    x[(u64)r * cols + k] = v;
}
