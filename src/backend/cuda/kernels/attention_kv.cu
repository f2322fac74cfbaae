// Gated attention: normalise and rotate each new key, store keys and values in the slot's KV
// pages. CPU twin: backend::cpu::kernels::attention_write_kv (rms_norm_row, rope_row).
// Grid: (rows, Hkv), block 32 (one warp). Needs dh <= 256 (checked on the host).

#define KV_PER_LANE 8  // 256 / 32

extern "C" __global__ void attn_write_kv(const float* k, const float* v, const float* k_norm, float eps,
                                         const float* rope, u32 rd, u32 hkv, u32 dh, u32 layer, u32 max_pages,
                                         const RowDesc* rows, const SlotDesc* slots) {
    __shared__ float kn[256];  // the normalised key, rotated from here
    u64 r = blockIdx.x;
    u32 g = blockIdx.y, lane = threadIdx.x;
    // The row, slot and page tables come from the host before the step, the norm weights and
    // the rotation table are weights: all followed or read without waiting on the previous
    // kernel (which writes k and v).
    RowDesc row = rows[r];
    const u64* pages = (const u64*)slots[row.slot].pages + (u64)layer * 2 * max_pages;
    u64 off = ((u64)(row.pos % TILE) * hkv + g) * dh;
    float* kd = (float*)pages[row.pos / TILE] + off;
    float* vd = (float*)pages[max_pages + row.pos / TILE] + off;
    u32 half = rd / 2;
    const float* cs = rope + (u64)row.pos * rd;
    float wn[KV_PER_LANE], c[KV_PER_LANE], s[KV_PER_LANE];
#pragma unroll
    for (int m = 0; m < KV_PER_LANE; m++) {
        u32 e = lane + 32 * m, i = e < half ? e : e - half;  // element e rotates with pair index i
        wn[m] = e < dh ? k_norm[e] : 0.0f;
        c[m] = e < rd ? cs[i] : 0.0f;
        s[m] = e < rd ? cs[half + i] : 0.0f;
    }
    pdl_enter();
    PROBE_SKIP(ATTN);
    const float* kr = k + r * hkv * dh + (u64)g * dh;
    const float* vr = v + r * hkv * dh + (u64)g * dh;
    float inv = tf_rsqrt(warp_dot(kr, kr, dh) / (float)dh + eps);
#pragma unroll
    for (int m = 0; m < KV_PER_LANE; m++) {
        u32 e = lane + 32 * m;
        if (e < dh) {
            kn[e] = (kr[e] * inv) * wn[m];
            vd[e] = vr[e];
        }
    }
    __syncwarp();
    // RoPE on the first rd elements (rope_row): x0 = kn[i], x1 = kn[i + half].
#pragma unroll
    for (int m = 0; m < KV_PER_LANE; m++) {
        u32 e = lane + 32 * m;
        if (e >= dh) continue;
        float out = kn[e];
        if (e < half) out = fmaf(kn[e], c[m], -(kn[e + half] * s[m]));
        else if (e < rd) out = fmaf(kn[e], c[m], kn[e - half] * s[m]);
        kd[e] = out;
    }
}
