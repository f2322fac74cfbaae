// Sampling one token from each logits row on the device: penalties, temperature, top-k,
// softmax, top-p, min-p and the Philox draw, with the arithmetic and order of the CPU twin,
// sampling::Sampler::sample (docs/numerics.md §9). The host runs this kernel only for
// 1 <= top_k <= 1024 and penalty windows of at most 1024 ids; other settings sample on the host,
// with the same result. Grid: rows, block 1024.

#define MAXK 1024
#define BLOCK 1024

struct SampleParams {
    float temperature, top_p, min_p, rep, pres, freq;
    u32 top_k, window_cap;
    u64 seed;
};

__device__ __forceinline__ float no_nan(float x) { return x != x ? __int_as_float(0xff800000) : x; }

// Larger value -> larger key; -0 and +0 equal.
__device__ __forceinline__ u32 order_key(float v) {
    u32 b = v == 0.0f ? 0u : __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// sampling::uniform: Philox4x32-10 keyed by the seed, counter (position, 0, 0).
__device__ float uniform01(u64 seed, u64 position) {
    u32 c0 = (u32)position, c1 = (u32)(position >> 32), c2 = 0, c3 = 0;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        u64 p0 = (u64)0xD2511F53u * c0;
        u64 p1 = (u64)0xCD9E8D57u * c2;
        u32 hi0 = (u32)(p0 >> 32), lo0 = (u32)p0, hi1 = (u32)(p1 >> 32), lo1 = (u32)p1;
        u32 n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
    }
    return (float)(c0 >> 8) * (1.0f / 16777216.0f);
}

// (value desc, id asc): true when (va, ia) comes before (vb, ib).
__device__ __forceinline__ bool before(float va, u32 ia, float vb, u32 ib) { return va > vb || (va == vb && ia < ib); }

extern "C" __global__ void __launch_bounds__(BLOCK) sample_rows(const float* logits, u32 v_eff, u32 ldv, const SampleParams* params,
                                                                const u32* win, const u32* wlen, const u64* positions, float* work,
                                                                u32* out, u32* next_ids) {
    pdl_enter();
    __shared__ u32 hist[256];
    __shared__ float cv[MAXK];
    __shared__ u32 ci[MAXK];
    __shared__ float pr[MAXK];
    __shared__ u32 s_count, s_digit, s_need, s_ties_taken, s_result;
    __shared__ u32 warp_sums[BLOCK / 32];
    const u32 tid = threadIdx.x, r = blockIdx.x;
    const SampleParams p = params[r];
    const float* row = logits + (u64)r * ldv;
    float* w = work + (u64)r * ldv;

    // 1. Penalties: each distinct id of the window, by its first occurrence.
    for (u32 i = tid; i < v_eff; i += BLOCK) w[i] = row[i];
    __syncthreads();
    bool use_rp = p.rep != 1.0f, use_sub = p.freq != 0.0f || p.pres != 0.0f;
    u32 wl = wlen[r];
    const u32* wr = win + (u64)r * p.window_cap;
    if ((use_rp || use_sub) && wl > 0) {
        for (u32 i = tid; i < wl; i += BLOCK) {
            u32 id = wr[i];
            bool first = true;
            u32 c = 0;
            for (u32 j = 0; j < wl; j++) {
                if (wr[j] == id) {
                    if (j < i) first = false;
                    c++;
                }
            }
            if (first && id < v_eff) {
                float l = row[id];
                if (use_rp) l = l > 0.0f ? l / p.rep : l * p.rep;
                if (use_sub) l = l - (float)c * p.freq - p.pres;
                w[id] = l;
            }
        }
    }
    __syncthreads();

    // 2. Greedy (the host does not send greedy rows here, but the definition is kept whole).
    bool greedy = !(p.temperature > 0.0f) || p.top_k == 1;
    // 3. Temperature; NaN sorts as -inf.
    if (!greedy)
        for (u32 i = tid; i < v_eff; i += BLOCK) w[i] = no_nan(w[i] / p.temperature);
    else
        for (u32 i = tid; i < v_eff; i += BLOCK) w[i] = no_nan(w[i]);
    __syncthreads();
    u32 k = greedy ? 1u : (p.top_k == 0 || p.top_k > v_eff ? v_eff : p.top_k);
    if (k > MAXK) k = MAXK;  // the host guarantees top_k <= MAXK

    // 4. The k-th best key by radix selection, 8 bits at a time from the top.
    u32 prefix = 0, mask = 0, need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = tid; i < 256; i += BLOCK) hist[i] = 0;
        __syncthreads();
        for (u32 i = tid; i < v_eff; i += BLOCK) {
            u32 key = order_key(w[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 acc = 0, d = 255;
            for (int b = 255; b >= 0; b--) {
                if (acc + hist[b] >= need) {
                    d = (u32)b;
                    break;
                }
                acc += hist[b];
            }
            s_digit = d;
            s_need = need - acc;
        }
        __syncthreads();
        prefix |= s_digit << shift;
        mask |= 255u << shift;
        need = s_need;
        __syncthreads();
    }
    // Candidates: every key above the k-th, then the `need` smallest ids equal to it.
    if (tid == 0) {
        s_count = 0;
        s_ties_taken = 0;
    }
    __syncthreads();
    for (u32 i = tid; i < v_eff; i += BLOCK) {
        if (order_key(w[i]) > prefix) {
            u32 slot = atomicAdd(&s_count, 1u);
            cv[slot] = w[i];
            ci[slot] = i;
        }
    }
    __syncthreads();
    u32 lane = tid & 31, warp = tid >> 5;
    for (u32 base = 0; base < v_eff && s_ties_taken < need; base += BLOCK) {
        u32 i = base + tid;
        bool tie = i < v_eff && order_key(w[i]) == prefix;
        u32 ballot = __ballot_sync(FULL_MASK, tie);
        if (lane == 0) warp_sums[warp] = __popc(ballot);
        __syncthreads();
        u32 before_me = 0;
        for (u32 q = 0; q < warp; q++) before_me += warp_sums[q];
        before_me += __popc(ballot & ((1u << lane) - 1u));
        u32 taken = s_ties_taken;
        if (tie && taken + before_me < need) {
            u32 slot = (k - need) + taken + before_me;
            cv[slot] = w[i];
            ci[slot] = i;
        }
        __syncthreads();
        if (tid == 0) {
            u32 total = 0;
            for (u32 q = 0; q < BLOCK / 32; q++) total += warp_sums[q];
            s_ties_taken = taken + total < need ? taken + total : need;
        }
        __syncthreads();
    }
    // Sort the k candidates (value desc, id asc): bitonic over 1024 slots, unused slots last.
    for (u32 i = tid; i < MAXK; i += BLOCK)
        if (i >= k) {
            cv[i] = __int_as_float(0xff800000);
            ci[i] = 0xffffffffu;
        }
    __syncthreads();
    for (u32 size = 2; size <= MAXK; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            u32 i = tid, j = i ^ stride;
            if (j > i) {
                bool up = (i & size) == 0;
                bool swap = up ? before(cv[j], ci[j], cv[i], ci[i]) : before(cv[i], ci[i], cv[j], ci[j]);
                if (swap) {
                    float tv = cv[i];
                    cv[i] = cv[j];
                    cv[j] = tv;
                    u32 ti = ci[i];
                    ci[i] = ci[j];
                    ci[j] = ti;
                }
            }
            __syncthreads();
        }
    }
    if (greedy) {
        if (tid == 0) {
            out[r] = ci[0];
            next_ids[r] = ci[0];
        }
        return;
    }

    // 5. Softmax in candidate order.
    float m = cv[0];
    if (!(m == m) || m == __int_as_float(0x7f800000) || m == __int_as_float(0xff800000)) {
        if (tid == 0) {
            out[r] = ci[0];
            next_ids[r] = ci[0];
        }
        return;
    }
    if (tid < k) pr[tid] = tf_exp(cv[tid] - m);
    __syncthreads();
    if (tid == 0) {
        float sum = 0.0f;
        for (u32 i = 0; i < k; i++) sum += pr[i];
        for (u32 i = 0; i < k; i++) pr[i] = pr[i] / sum;
        u32 keep = k;
        // 6. Top-p: the shortest prefix reaching top_p.
        if (p.top_p < 1.0f) {
            float cum = 0.0f;
            for (u32 i = 0; i < k; i++) {
                cum += pr[i];
                if (cum >= p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        // 7. Min-p: a filter keeping order; at least the first.
        if (p.min_p > 0.0f) {
            float thr = p.min_p * pr[0];
            u32 wpos = 0;
            for (u32 i = 0; i < keep; i++) {
                if (pr[i] >= thr) {
                    pr[wpos] = pr[i];
                    ci[wpos] = ci[i];
                    wpos++;
                }
            }
            keep = wpos > 0 ? wpos : 1;
        }
        // 8. Draw.
        float total = 0.0f;
        for (u32 i = 0; i < keep; i++) total += pr[i];
        float t = uniform01(p.seed, positions[r]) * total;
        float run = 0.0f;
        u32 last_positive = 0, chosen = 0xffffffffu;
        for (u32 i = 0; i < keep; i++) {
            run += pr[i];
            if (run > t) {
                chosen = ci[i];
                break;
            }
            if (pr[i] > 0.0f) last_positive = i;
        }
        if (chosen == 0xffffffffu) chosen = ci[last_positive];
        s_result = chosen;
        out[r] = chosen;
        next_ids[r] = chosen;
    }
}
