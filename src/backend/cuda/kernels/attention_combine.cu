// Gated attention, part 3: combine a query's tiles in increasing order and apply the sigmoid
// gate (numerics §6). CPU twin: backend::cpu::kernels::attend (combine) and attention_group (gate).
// Grid: rows · Hq, block Dh threads.

extern "C" __global__ void attn_combine(const float* part, const float* q_gate, u32 hq, u32 dh, u32 max_tiles,
                                        const RowDesc* rows, float* out) {
    u32 r = blockIdx.x / hq, h = blockIdx.x % hq, d = threadIdx.x;
    u32 n_tiles = rows[r].pos / TILE + 1;  // host-written before the step: read before waiting
    pdl_enter();
    PROBE_SKIP(ATTN);
    const float* pt = part + ((u64)r * hq + h) * max_tiles * PART_STRIDE(dh);
    float big_m = __int_as_float(0xff800000);
    for (u32 t = 0; t < n_tiles; t++) big_m = fmaxf(big_m, pt[(u64)t * PART_STRIDE(dh)]);
    float big_l = 0.0f, o = 0.0f;
    for (u32 t = 0; t < n_tiles; t++) {
        const float* tp = pt + (u64)t * PART_STRIDE(dh);
        float c = tf_exp(tp[0] - big_m);
        big_l = fmaf(tp[1], c, big_l);
        o = fmaf(tp[2 + d], c, o);
    }
    float gate = q_gate[(u64)r * hq * 2 * dh + (u64)h * 2 * dh + dh + d];
    out[(u64)r * hq * dh + (u64)h * dh + d] = (o / big_l) * tf_sigmoid(gate);
}
