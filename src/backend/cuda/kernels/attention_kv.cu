// Gated attention: normalise and rotate each new key, store keys and values in the slot's KV
// pages. CPU twin: backend::cpu::kernels::attention_write_kv (rms_norm_row, rope_row).
// Grid: (rows, Hkv), block 32 (one warp).

extern "C" __global__ void attn_write_kv(const float* k, const float* v, const float* k_norm, float eps,
                                         const float* rope, u32 rd, u32 hkv, u32 dh, u32 layer, u32 max_pages,
                                         const RowDesc* rows, const SlotDesc* slots) {
    u64 r = blockIdx.x;
    u32 g = blockIdx.y, lane = threadIdx.x;
    // The row, slot and page tables come from the host before the step: followed without
    // waiting on the previous kernel (which writes k and v).
    RowDesc row = rows[r];
    const u64* pages = (const u64*)slots[row.slot].pages + (u64)layer * 2 * max_pages;
    u64 off = ((u64)(row.pos % TILE) * hkv + g) * dh;
    float* kd = (float*)pages[row.pos / TILE] + off;
    float* vd = (float*)pages[max_pages + row.pos / TILE] + off;
    pdl_enter();
    PROBE_SKIP(ATTN);
    const float* kr = k + r * hkv * dh + (u64)g * dh;
    const float* vr = v + r * hkv * dh + (u64)g * dh;
    float inv = tf_rsqrt(warp_dot(kr, kr, dh) / (float)dh + eps);
    for (u32 e = lane; e < dh; e += 32) {
        kd[e] = (kr[e] * inv) * k_norm[e];
        vd[e] = vr[e];
    }
    __syncwarp();
    u32 half = rd / 2;
    const float* cs = rope + (u64)row.pos * rd;
    for (u32 i = lane; i < half; i += 32) {
        float x0 = kd[i], x1 = kd[i + half], c = cs[i], s = cs[half + i];
        kd[i] = fmaf(x0, c, -(x1 * s));
        kd[i + half] = fmaf(x1, c, x0 * s);
    }
}
