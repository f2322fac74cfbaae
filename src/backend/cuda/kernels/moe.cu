// The routing and the weighted sum of a mixture-of-experts block (numerics §7.1); the experts'
// products run in matmul.cu's matmul_experts_* over the rows these kernels group by expert.
// CPU twin: Cpu::moe (backend/cpu/mod.rs) and kernels::moe_route.

// Per row r of the router logits [rows, E]: softmax with our exp and a sequential sum, k passes
// of selection (the largest probability not yet taken, the lower index among equals), the k
// probabilities divided by their sum in rank order when `norm`, then the k sorted by expert
// index into experts[r·k ..] and weights[r·k ..]. A warp per row, four rows per block: lane l
// holds experts l, l+32, ...; the maximum is exact in any order, the sum is lane 0's, in index
// order, and a selection pass is the warp's first maximum.
#define MOE_MAX_K 32
#define MOE_MAX_E 1024
#define MOE_ROUTE_WARPS 4
// With `plan` (a step of one row) it also writes what moe_plan would for that row: its k pairs
// are already grouped (one per expert, in index order), item j = (expert j, pair j, 1 pair).
extern "C" __global__ void __launch_bounds__(32 * MOE_ROUTE_WARPS) moe_route(const float* logits, u32 rows, u32 E, u32 k, u32 norm, u32* experts, float* weights,
                                                                             u32 plan, u32* perm, u32* slot, u32* items) {
    pdl_enter();
    __shared__ float ps[MOE_ROUTE_WARPS][MOE_MAX_E];
    __shared__ float sum[MOE_ROUTE_WARPS];
    u32 w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32 r = blockIdx.x * MOE_ROUTE_WARPS + w;
    if (r >= rows) return;
    const float* l = logits + (u64)r * E;
    float* p = ps[w];
    // Twin of the CPU's fold from -inf with `x > m`: NaN never becomes the maximum.
    float m = __int_as_float(0xff800000);
    for (u32 i = lane; i < E; i += 32) m = l[i] > m ? l[i] : m;
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(FULL_MASK, m, o);
        m = v > m ? v : m;
    }
    for (u32 i = lane; i < E; i += 32) p[i] = tf_exp(l[i] - m);
    __syncwarp();
    if (lane == 0) {
        // In index order; the loads of 16 are issued ahead of their adds.
        float s = 0.0f;
        u32 i = 0;
        for (; i + 16 <= E; i += 16) {
            float v[16];
#pragma unroll
            for (int u = 0; u < 16; u++) v[u] = p[i + u];
#pragma unroll
            for (int u = 0; u < 16; u++) s += v[u];
        }
        for (; i < E; i++) s += p[i];
        sum[w] = s;
    }
    __syncwarp();
    float s = sum[w];
    for (u32 i = lane; i < E; i += 32) p[i] = p[i] / s;
    __syncwarp();
    // The CPU's pass starts from the first expert not taken and replaces it by a strictly
    // larger one, so a NaN there is kept and a NaN elsewhere never wins: the same here.
    u32 ce[MOE_MAX_K];
    float cw[MOE_MAX_K];
    u32 taken = 0;  // bit t: expert lane + 32·t is taken (E ≤ 1024)
    for (u32 j = 0; j < k; j++) {
        u32 first = 0xffffffffu, bi = 0xffffffffu;
        float bv = 0.0f;
        for (u32 i = lane, t = 0; i < E; i += 32, t++) {
            if ((taken >> t) & 1) continue;
            if (first == 0xffffffffu) first = i;
            float v = p[i];
            if (v == v && (bi == 0xffffffffu || v > bv)) bi = i, bv = v;
        }
        for (int o = 16; o > 0; o >>= 1) {
            u32 f2 = __shfl_xor_sync(FULL_MASK, first, o), i2 = __shfl_xor_sync(FULL_MASK, bi, o);
            float v2 = __shfl_xor_sync(FULL_MASK, bv, o);
            first = f2 < first ? f2 : first;
            if (i2 != 0xffffffffu && (bi == 0xffffffffu || v2 > bv || (v2 == bv && i2 < bi))) bi = i2, bv = v2;
        }
        u32 pick = (p[first] != p[first] || bi == 0xffffffffu) ? first : bi;
        if (pick % 32 == lane) taken |= 1u << (pick / 32);
        ce[j] = pick;
        cw[j] = p[pick];
    }
    if (lane != 0) return;
    if (norm) {
        float t = 0.0f;
        for (u32 j = 0; j < k; j++) t += cw[j];
        for (u32 j = 0; j < k; j++) cw[j] = cw[j] / t;
    }
    // Insertion sort by expert index (the indices are distinct).
    for (u32 j = 1; j < k; j++) {
        u32 e = ce[j];
        float v = cw[j];
        int t = (int)j - 1;
        while (t >= 0 && ce[t] > e) {
            ce[t + 1] = ce[t];
            cw[t + 1] = cw[t];
            t--;
        }
        ce[t + 1] = e;
        cw[t + 1] = v;
    }
    for (u32 j = 0; j < k; j++) {
        experts[(u64)r * k + j] = ce[j];
        weights[(u64)r * k + j] = cw[j];
    }
    if (plan) {
        items[0] = k;
        for (u32 j = 0; j < k; j++) {
            perm[j] = 0;
            slot[j] = j;
            items[1 + 3 * j] = ce[j];
            items[2 + 3 * j] = j;
            items[3 + 3 * j] = 1;
        }
    }
}

// Groups the rows·k (row, expert) pairs by expert, rows in order within an expert (as Cpu::moe's
// lists): pair p of the grouped order reads row perm[p]; slot[r·k + j] is the grouped index of
// row r's j-th expert; items lists the work of matmul_experts_*: items[0] their count, then per
// item (expert, first grouped pair, pairs), at most `tile` pairs each. One block of 1024
// threads, thread e counting and placing expert e's pairs (E ≤ 1024); the offsets are the
// block's exclusive scans of the counts and of the items per expert.
extern "C" __global__ void __launch_bounds__(1024) moe_plan(const u32* experts, u32 rows, u32 k, u32 E, u32 tile, u32* perm, u32* slot, u32* items) {
    pdl_enter();
    __shared__ u32 wsum[32][2];
    u32 P = rows * k, e = threadIdx.x, lane = e & 31, w = e >> 5;
    u32 c = 0;
    if (e < E)
        for (u32 p = 0; p < P; p++) c += experts[p] == e;
    u32 it = (c + tile - 1) / tile;
    // Inclusive scans within the warp, then of the warp totals.
    u32 sc = c, si = it;
    for (int o = 1; o < 32; o <<= 1) {
        u32 a = __shfl_up_sync(FULL_MASK, sc, o), b = __shfl_up_sync(FULL_MASK, si, o);
        if (lane >= (u32)o) sc += a, si += b;
    }
    if (lane == 31) wsum[w][0] = sc, wsum[w][1] = si;
    __syncthreads();
    if (w == 0) {
        u32 a = wsum[lane][0], b = wsum[lane][1];
        for (int o = 1; o < 32; o <<= 1) {
            u32 a2 = __shfl_up_sync(FULL_MASK, a, o), b2 = __shfl_up_sync(FULL_MASK, b, o);
            if (lane >= (u32)o) a += a2, b += b2;
        }
        wsum[lane][0] = a, wsum[lane][1] = b;
    }
    __syncthreads();
    u32 base = sc - c + (w ? wsum[w - 1][0] : 0), ibase = si - it + (w ? wsum[w - 1][1] : 0);
    if (e == blockDim.x - 1) items[0] = ibase + it;
    if (e >= E || c == 0) return;
    u32 n = 0;
    for (u32 p = 0; p < P && n < c; p++) {
        if (experts[p] != e) continue;
        perm[base + n] = p / k;
        slot[p] = base + n;
        n++;
    }
    for (u32 t = 0; t < it; t++) {
        u32* q = items + 1 + 3 * (ibase + t);
        q[0] = e;
        q[1] = base + t * tile;
        q[2] = min(tile, c - t * tile);
    }
}

// y[r] = Σ_j weights[r·k+j] · out[slot[r·k+j]] (j in increasing expert index, from +0.0, a
// product then an add per term), then y[r] += sigmoid(gate_logit[r]) · shared[r], h[r] += y[r].
extern "C" __global__ void moe_combine(const float* out, const u32* slot, const float* weights, const float* gate_logit, const float* shared, u32 k, u32 d,
                                       float* y, float* h) {
    pdl_enter();
    u32 r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    float acc = 0.0f;
    for (u32 j = 0; j < k; j++) {
        float v = out[(u64)slot[r * k + j] * d + c];
        acc = acc + v * weights[r * k + j];
    }
    float g = tf_sigmoid(gate_logit[r]);
    float v = acc + g * shared[(u64)r * d + c];
    y[(u64)r * d + c] = v;
    h[(u64)r * d + c] = h[(u64)r * d + c] + v;
}
