// Gated DeltaNet q/k L2 normalisation per key head and token.
// CPU twin: backend::cpu::kernels::gdn_qk_norm (numerics §4 step 2).
// Grid: (rows, Hk), block 32 (one warp).

extern "C" __global__ void gdn_qk_norm(const float* y, u32 cd, u32 key_dim, u32 dk, float* qn, float* kn) {
    u64 row = blockIdx.x;
    u32 i = blockIdx.y;
    const float* q = y + row * cd + (u64)i * dk;
    const float* k = y + row * cd + key_dim + (u64)i * dk;
    float q_scale = tf_rsqrt((float)dk);
    float inv_q = tf_rsqrt(warp_dot(q, q, dk) + 1e-6f);
    float inv_k = tf_rsqrt(warp_dot(k, k, dk) + 1e-6f);
    for (u32 e = threadIdx.x; e < dk; e += 32) {
        qn[row * key_dim + (u64)i * dk + e] = (q[e] * inv_q) * q_scale;
        kn[row * key_dim + (u64)i * dk + e] = k[e] * inv_k;
    }
}
