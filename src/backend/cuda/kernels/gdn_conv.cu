// Gated DeltaNet causal depthwise conv + SiLU for every token of every sequence in the step.
// CPU twin: backend::cpu::kernels::gdn_conv (numerics §4 step 1).
// Grid: (ceil(conv_dim / 256), n_seqs), block 256: one thread per channel, tokens in order.

extern "C" __global__ void gdn_conv(const float* qkv, const float* taps, u32 kc, u32 cd, u32 layer,
                                    const SeqDesc* seqs, const SlotDesc* slots, float* y) {
    pdl_enter();
    PROBE_SKIP(GDN);
    u32 ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= cd) return;
    SeqDesc s = seqs[blockIdx.y];
    float* conv = (float*)slots[s.slot].conv + (u64)layer * (kc - 1) * cd;
    float win[8];  // kc <= 8 (checked on the host)
    for (u32 j = 0; j + 1 < kc; j++) win[j] = conv[(u64)j * cd + ch];
    const float* tap = taps + (u64)ch * kc;
    for (u32 t = 0; t < s.len; t++) {
        u64 row = s.first_row + t;
        win[kc - 1] = qkv[row * cd + ch];
        float acc = 0.0f;
        for (u32 j = 0; j < kc; j++) acc = fmaf(tap[j], win[j], acc);
        y[row * cd + ch] = tf_silu(acc);
        for (u32 j = 0; j + 1 < kc; j++) win[j] = win[j + 1];
    }
    for (u32 j = 0; j + 1 < kc; j++) conv[(u64)j * cd + ch] = win[j];
}
