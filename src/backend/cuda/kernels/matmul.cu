// y = W·x for up to four weight matrices that read the same input (fused projections), with
// an optional residual add (res += y) per matrix.
// CPU twin: backend::cpu::kernels::dot_decoded through simd::matmul (numerics §2): lane l of a
// warp owns the stored 32-bit words l, l+32, ... of a row, accumulates their decoded elements in
// order with fmaf, and the warp folds its lanes by halves.
//
// A warp computes R rows of one matrix for a tile of T tokens, so each weight word is loaded
// once per T tokens and each input value once per R rows. The arithmetic of an output does not
// depend on T or R. Prompt kernels (T > 1): grid (ceil(padded_rows / (R·8)), ceil(tokens / T)),
// block 256. One-token kernels: a warp per row (or gate/up pair), requesting the next batch of
// weights before the FMAs of the current one (group_t1).

struct Mat {
    const u8* w;   // codes (affine) or values (float), row-major
    const u8* sb;  // scales and biases interleaved per group, [rows, cols/group] pairs (affine; see load_sb)
    float* y;      // output [tokens, ldy]
    float* res;    // if set, the residual stream [tokens, ldy]: res += y (Cpu::matmul_residual)
    u32 rows, cols, fmt, group, sdtype, ldy, row0;
    u32 offset;    // 1: offset_rows is set (4-bit codes, 16-bit scales); 2: every row passes
    const u32* offset_rows;  // bit r: every group of row r passes offset_exact (nib_to_float_offset)
};
// fmt: 0 f32, 1 f16, 2 bf16 weights; 4 or 8: affine codes of that many bits.

struct Mats {
    Mat m[4];
    u32 count, pad0, pad1, pad2;
};

#define WARPS 8

template <int FMT>
struct Fmt;
template <> struct Fmt<4> { enum { E = 8 }; };
template <> struct Fmt<8> { enum { E = 4 }; };
template <> struct Fmt<2> { enum { E = 2 }; };
template <> struct Fmt<1> { enum { E = 2 }; };
template <> struct Fmt<0> { enum { E = 1 }; };

// Element e of word `wd` of a row whose group scale/bias are s, b.
// float(q) for a code q < 2^23 without an integer-to-float conversion (a quarter-rate
// instruction that bounds decode): 2^23 + q is exact in the mantissa, and subtracting 2^23 is
// exact. The value is bit-identical to (float)q. The code's byte is moved under the exponent
// 0x4B with one byte permute (PRMT); 4-bit codes are first split into the low and high nibbles
// of each byte (shared by the word's eight elements once inlined).
// 0x4B0000|byte k of v: selector bytes (from low) k, 4 (b.byte0 = 0), 5 (0), 7 (0x4B).
__device__ __forceinline__ float byte_to_float(u32 v, int k) {
#ifdef TF_PROBE_NO_FSUB  // attribution probe (wrong values): the cost of the subtraction
    return __uint_as_float(prmt(v, 0x4B000000u, 0x7540u | (u32)k));
#else
    return __uint_as_float(prmt(v, 0x4B000000u, 0x7540u | (u32)k)) - 8388608.0f;
#endif
}

// The offset decode of 4-bit codes (one-token kernels, for a row whose every group passes the
// host's offset_exact, CudaMatrix::offset_rows): with S = 256·s and B = b − 128·s, both exact,
// fma(S, 0.5 + q/256, B) rounds the same number s·q + b as fma(s, q, b), so it gives the same
// bits, and 0.5 + q/256 is the code under exponent 126 (byte permute: 0x3F, code, 0, 0), with no
// subtraction. S and B are computed once per group word: 256·s exactly, fmaf(-128, s, b) exact
// by the host's check. The constant is the permute's first operand and the code word its second
// (selector bytes 0, 1, 4 + k, 3): ptxas then keeps 0x3F000000 in one register and encodes each
// selector as an immediate, where the other order made it copy a selector into a register
// before every permute (one extra instruction per weight).
__device__ __forceinline__ float nib_to_float_offset(u32 v, int k) { return __uint_as_float(prmt(0x3F000000u, v, 0x3010u | ((u32)(4 + k) << 8))); }

template <int FMT>
__device__ __forceinline__ float decode(u32 wd, int e, float s, float b) {
    if (FMT == 4) return fmaf(s, byte_to_float(((e & 1) ? (wd >> 4) : wd) & 0x0F0F0F0Fu, e >> 1), b);
    if (FMT == 8) return fmaf(s, byte_to_float(wd, e), b);
    if (FMT == 2) return bf16_to_f32(e == 0 ? (wd & 0xffffu) : (wd >> 16));
    if (FMT == 1) return f16_to_f32((u16)(e == 0 ? (wd & 0xffffu) : (wd >> 16)));
    return __uint_as_float(wd);
}


// log2 of a group size (a power of two, checked at load), so a word's group is a shift away.
__device__ __forceinline__ u32 group_shift(u32 group) { return (u32)(__ffs((int)group) - 1); }

// The E input values of word j for token row xp (vector loads where E allows).
template <int E>
__device__ __forceinline__ void load_x(const float* xp, float (&xv)[E]) {
    if (E >= 4) {
#pragma unroll
        for (int q = 0; q < E / 4; q++) {
            float4 v = ((const float4*)xp)[q];
            xv[4 * q] = v.x;
            xv[4 * q + 1] = v.y;
            xv[4 * q + 2] = v.z;
            xv[4 * q + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < E; e++) xv[e] = xp[e];
    }
}

// word(u, j) for the words j = j0 + 32u (u < U) of a batch that exist. When all of them do
// there is no branch between them, so the compiler can issue the input loads ahead of the FMAs.
template <int U, class Word>
__device__ __forceinline__ void over_batch(u32 j0, u32 words, Word&& word) {
    if (j0 + 32 * (U - 1) < words) {
#pragma unroll
        for (int u = 0; u < U; u++) word(u, j0 + 32 * u);
    } else {
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (j0 + 32 * u >= words) break;
            word(u, j0 + 32 * u);
        }
    }
}

// Prompt steps (T > 1 tokens): accumulates, for R rows (row r of matrix *ms[r], index rows[r])
// and T tokens, each lane's partial dot products in the canonical order: words j = lane,
// lane+32, ... ascending, elements of a word ascending. Words are loaded eight at a time
// (independent loads in flight), which keeps each lane's order: j, j+32, j+64, ...
template <int T, int R, int FMT, int SDT>
__device__ __forceinline__ void accumulate(const Mat* const* ms, const u32* rows, const float* x, u32 ldx, u32 t0, u32 nt,
                                           float (&acc)[T][R]) {
    const int E = Fmt<FMT>::E;
    const bool affine = FMT == 4 || FMT == 8;
    const u32 lane = threadIdx.x & 31;
    const u32 words = ms[0]->cols / E;
    const u32* wrow[R];
    const u8* sbrow[R];
    u32 group = affine ? ms[0]->group : 1, gshift = group_shift(group);
#pragma unroll
    for (int r = 0; r < R; r++) {
        wrow[r] = (const u32*)ms[r]->w + (u64)rows[r] * words;
        sbrow[r] = affine ? ms[r]->sb + (u64)rows[r] * (ms[r]->cols >> gshift) * sb_size(SDT) : ms[r]->sb;
    }
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = 0.0f;
    const int U = 8;
    for (u32 j0 = lane; j0 < words; j0 += 32 * U) {
        u32 wd[U][R];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) wd[u][r] = j0 + 32 * u < words ? wrow[r][j0 + 32 * u] : 0u;
        over_batch<U>(j0, words, [&](int u, u32 j) {
            float s[R], b[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                s[r] = b[r] = 0.0f;
                if (affine) load_sb<SDT>(sbrow[r], (j * E) >> gshift, s[r], b[r]);
            }
#pragma unroll
            for (int t = 0; t < T; t++) {
                // Tokens past the tile's end read the last row and accumulate into outputs that
                // are never written: no branch here either.
                u32 tt = (u32)t < nt ? (u32)t : nt - 1;
                float xv[E];
                load_x<E>(x + (u64)(t0 + tt) * ldx + (u64)j * E, xv);
#pragma unroll
                for (int e = 0; e < E; e++)
#pragma unroll
                    for (int r = 0; r < R; r++) acc[t][r] = fmaf(decode<FMT>(wd[u][r], e, s[r], b[r]), xv[e], acc[t][r]);
            }
        });
    }
}

// Calls call(FMT, SDT) for the weight format `fmt` and scale dtype `sdt` of the warp's matrix
// (a fused prompt launch may mix formats, each warp working on one matrix; one-token launches
// are split by format on the host): affine codes with each scale dtype, or float weights.
#define LAYOUT_SWITCH(call)                    \
    switch (fmt) {                             \
        case 4:                                \
            if (sdt == 2) call(4, 2);          \
            else if (sdt == 1) call(4, 1);     \
            else call(4, 0);                   \
            break;                             \
        case 8:                                \
            if (sdt == 2) call(8, 2);          \
            else if (sdt == 1) call(8, 1);     \
            else call(8, 0);                   \
            break;                             \
        case 2: call(2, 0); break;             \
        case 1: call(1, 0); break;             \
        default: call(0, 0); break;            \
    }

template <int T, int R, int FMT, int SDT>
__device__ __forceinline__ void body(const Mat& m, u32 n0, const float* x, u32 ldx, u32 t0, u32 nt) {
    const u32 lane = threadIdx.x & 31;
    u32 nr = m.rows - n0 < (u32)R ? m.rows - n0 : (u32)R;
    const Mat* ms[R];
    u32 rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        ms[r] = &m;
        rows[r] = n0 + ((u32)r < nr ? r : 0);
    }
    float acc[T][R];
    accumulate<T, R, FMT, SDT>(ms, rows, x, ldx, t0, nt, acc);
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = fold32(acc[t][r]);
            if (lane == 0 && (u32)t < nt && (u32)r < nr) {
                u64 o = (u64)(t0 + t) * m.ldy + n0 + r;
                m.y[o] = v;
                if (m.res) m.res[o] = m.res[o] + v;
            }
        }
}

template <int T, int R>
__device__ __forceinline__ void matmul(const Mats& ms, const float* x, u32 ldx, u32 n_tok) {
    pdl_enter();
    u32 g = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;  // first padded row of this warp
    u32 i = 0;
    while (i + 1 < ms.count && g >= ms.m[i + 1].row0) i++;
    const Mat& m = ms.m[i];
    if (g < m.row0) return;
    u32 n0 = g - m.row0;
    if (n0 >= m.rows) return;
    u32 t0 = blockIdx.y * T;
    if (t0 >= n_tok) return;
    u32 nt = n_tok - t0 < (u32)T ? n_tok - t0 : (u32)T;
    u32 fmt = m.fmt, sdt = m.sdtype;
#define CALL(F, S) body<T, R, F, S>(m, n0, x, ldx, t0, nt)
    LAYOUT_SWITCH(CALL)
#undef CALL
}

extern "C" __global__ void __launch_bounds__(256) matmul_t4r2(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<4, 2>(ms, x, ldx, n_tok); }
extern "C" __global__ void __launch_bounds__(256) matmul_t8r4(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<8, 4>(ms, x, ldx, n_tok); }

// Mixture-of-experts products (Cuda::moe; CPU twin: Cpu::moe's per-expert products, the same
// arithmetic as every product above). The rows are (token, expert) pairs grouped by expert
// (moe.cu's moe_plan): item y covers up to T consecutive pairs of one expert, items[0] the items
// there are, then (expert, first pair, pairs) per item. ms gives the shapes, formats and outputs
// of the launch's matrices (one expert's gate and up, or its down); their weights come from
// tab, `[ms.count][E]` pairs of device pointers (codes, scales and biases). Grid (ceil(padded
// rows / (R·8)), most items), block 256; blocks past the step's items exit.
template <int T, int R>
__device__ __forceinline__ void matmul_experts(const Mats& ms, const u64* tab, u32 E, const u32* items, const float* x, u32 ldx) {
    pdl_enter();
    if (blockIdx.y >= items[0]) return;
    const u32* it = items + 1 + 3 * blockIdx.y;
    u32 e = it[0], p0 = it[1], n = it[2];
    u32 g = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    u32 i = 0;
    while (i + 1 < ms.count && g >= ms.m[i + 1].row0) i++;
    Mat m = ms.m[i];
    if (g < m.row0) return;
    u32 n0 = g - m.row0;
    if (n0 >= m.rows) return;
    m.w = (const u8*)tab[2 * ((u64)i * E + e)];
    m.sb = (const u8*)tab[2 * ((u64)i * E + e) + 1];
    m.y += (u64)p0 * m.ldy;
    const float* xp = x + (u64)p0 * ldx;
    u32 fmt = m.fmt, sdt = m.sdtype;
#define CALL(F, S) body<T, R, F, S>(m, n0, xp, ldx, 0, n)
    LAYOUT_SWITCH(CALL)
#undef CALL
}

extern "C" __global__ void __launch_bounds__(256) matmul_experts_t4r2(Mats ms, const u64* tab, u32 E, const u32* items, const float* x, u32 ldx) {
    matmul_experts<4, 2>(ms, tab, E, items, x, ldx);
}
extern "C" __global__ void __launch_bounds__(256) matmul_experts_t8r4(Mats ms, const u64* tab, u32 E, const u32* items, const float* x, u32 ldx) {
    matmul_experts<8, 4>(ms, tab, E, items, x, ldx);
}

// ---- One token (decode) ----
//
// A warp computes one group of R rows, each row's words in batches of U per lane (words
// jl + lane + 32u for the batch starting at word jl). Two register buffers alternate: while the
// warp computes one batch the next is in flight, so a row longer than one batch keeps loads
// going during the FMAs. The first two batches are requested before pdl_enter(): weights only,
// so they arrive while the previous kernel ends. Each lane's words still come in the canonical
// order (numerics §2).

// Words per lane per batch, for one row and for two; with 64 registers (4 blocks of 256 per
// multiprocessor) two buffers fit without spilling. (Measured on the H200, 2b decode: 1.50 ms
// per token with these, 1.55-1.66 with 8/4 words at 2-3 blocks.)
#ifndef T1_U1
#define T1_U1 4
#endif
#ifndef T1_U2
#define T1_U2 2
#endif
#ifndef T1_MINB
#define T1_MINB 4
#endif
#if T1_U1 < 1 || T1_U2 < 1
#error "T1_U1 and T1_U2 must be at least 1 (a batch of no words never ends)"
#endif

// One word of each of R rows into acc[R]: its E elements in order, each decoded (the offset
// decode when OFS: 4-bit codes whose rows pass offset_row; s and b are the group's scale and
// bias, turned into 256·s and b − 128·s here) and multiplied into the row's running sum with
// one FMA (numerics §2). Shared by every one-token kernel (group_t1, stream_rows).
template <int R, int FMT, bool OFS>
__device__ __forceinline__ void word_t1(const u32 (&wd)[R], float (&s)[R], float (&b)[R], const float (&xv)[Fmt<FMT>::E], float (&acc)[R]) {
    const int E = Fmt<FMT>::E;
#if defined(TF_PROBE_DECODE_FREE) || defined(TF_PROBE_LOADS_ONLY)
    // Speed-of-light probes (wrong values; bench/device.sh probe): the same loads of codes,
    // scales and inputs, with the decode free (one FMA per element, the code word as its
    // weight) or with one FMA per word.
    if constexpr (true) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            float wf = __uint_as_float((wd[r] & 0x3F7FFFFFu) ^ __float_as_uint(s[r]));
#ifdef TF_PROBE_LOADS_ONLY
            acc[r] = fmaf(wf, xv[r % E], acc[r]);
#else
#pragma unroll
            for (int e = 0; e < E; e++) acc[r] = fmaf(wf, xv[e], acc[r]);
#endif
        }
    } else
#endif
    if constexpr (OFS) {
        static_assert(FMT == 4, "the offset decode is for 4-bit codes");
        u32 lo[R], hi[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            b[r] = fmaf(-128.0f, s[r], b[r]);
            s[r] = s[r] * 256.0f;
            lo[r] = wd[r] & 0x0F0F0F0Fu;
            hi[r] = (wd[r] >> 4) & 0x0F0F0F0Fu;
        }
#pragma unroll
        for (int e = 0; e < E; e++)
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] = fmaf(fmaf(s[r], nib_to_float_offset((e & 1) ? hi[r] : lo[r], e >> 1), b[r]), xv[e], acc[r]);
    } else {
#pragma unroll
        for (int e = 0; e < E; e++)
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] = fmaf(decode<FMT>(wd[r], e, s[r], b[r]), xv[e], acc[r]);
    }
}

// The codes and interleaved scales and biases of a warp's R rows.
template <int R>
struct Group {
    const u32* w[R];
    const u8* sb[R];
};

// Accumulates group g into acc[R] (each lane's partial sums), then calls done(acc).
// GSH: log2 of the group size when known at compile time (0: the runtime `gshift`), so the
// scale/bias loads of a batch are constant offsets from one cursor.
//
// Each lane reads through cursors that advance a batch at a time: its first code word of the
// next batch to load (wc), that word's scale/bias entry (sc), and its first input values of the
// batch to compute (xc). Word jl + lane + 32u is 32u words past wc, and its entry is u·sbu past
// sc: 32·E elements span whole groups (group_size ≤ 128 ≤ 32·E, checked at load), so the
// group of word j + 32 is sbu = 32·E / group_size entries on. A whole batch is then loaded with
// no bounds check and no per-word address arithmetic; only a row's last partial batch is
// predicated.
template <int R, int FMT, int SDT, bool OFS, int GSH, class Done>
__device__ __forceinline__ void group_t1(u32 words, u32 gshift, const Group<R>& g, const float* x, Done&& done) {
    const int E = Fmt<FMT>::E, U = R == 1 ? T1_U1 : T1_U2;
    constexpr bool affine = FMT == 4 || FMT == 8;
    typedef typename Sb<SDT>::T SbT;
    const u32 lane = threadIdx.x & 31;
    const u32 gsh = GSH ? (u32)GSH : gshift;
    const u32 sbu = (32u * E) >> gsh;
    struct Buf {
        u32 wd[U][R];
        SbT sb[affine ? U : 1][R];
    };
    const u32* wc[R];
    const SbT* sc[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        wc[r] = g.w[r] + lane;
        sc[r] = (const SbT*)g.sb[r] + ((lane * E) >> gsh);
    }
    u32 jl = 0;  // first word of the next batch to load
    auto load = [&](Buf& d) {
        if (jl + 32 * U <= words) {
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    d.wd[u][r] = wc[r][32 * u];
                    if constexpr (affine) d.sb[u][r] = sc[r][u * sbu];
                }
        } else {
#pragma unroll
            for (int u = 0; u < U; u++) {
                bool in = jl + lane + 32 * u < words;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    d.wd[u][r] = in ? wc[r][32 * u] : 0u;
                    if constexpr (affine) d.sb[u][r] = in ? sc[r][u * sbu] : SbT{};
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            wc[r] += 32 * U;
            sc[r] += U * sbu;
        }
        jl += 32 * U;
    };
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    const float* xc = x + lane * E;
    u32 jc = 0;  // first word of the batch to compute
    auto compute = [&](const Buf& d) {
        over_batch<U>(jc + lane, words, [&](int u, u32) {
            float xv[E];
            load_x<E>(xc + 32 * E * u, xv);
            float s[R], b[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                s[r] = b[r] = 0.0f;
                if constexpr (affine) unpack_sb<SDT>(d.sb[u][r], s[r], b[r]);
            }
            word_t1<R, FMT, OFS>(d.wd[u], s, b, xv, acc);
        });
        xc += 32 * U * E;
        jc += 32 * U;
    };
    // Both buffers are filled before waiting on the previous kernel (weights only), so a row of
    // up to two batches is entirely in flight while that kernel ends. Then each step computes
    // one buffer and refills it with the batch after the other buffer's, keeping one batch in
    // flight during every compute.
    Buf A, B;
    load(A);
    if (jl < words) load(B);
    pdl_enter();
    auto step = [&](Buf& cur) -> bool {
        compute(cur);
        if (jl < words) load(cur);
        return jc < words;
    };
    while (step(A) && step(B)) {
    }
    done(acc);
}

// y = W·x (+ res) for one token: rows row .. row + R - 1 of matrix m, R per warp (R = 2: the
// input values a lane loads serve both rows, halving the L1 traffic of x; the arithmetic of
// each row is the same for any R). A last odd row is computed twice (its second copy reads the
// same words) and written once.
template <int R, int FMT, int SDT, bool OFS, int GSH = 0>
__device__ __forceinline__ void t1_body(const Mat& m, const float* x, u32 row) {
    const u32 words = m.cols / Fmt<FMT>::E;
    const u32 gshift = group_shift(FMT == 4 || FMT == 8 ? m.group : 1);
    const u64 sbrow = (u64)(m.cols >> gshift) * sb_size(SDT);
    Group<R> g;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const u32 rr = row + r < m.rows ? row + r : row;
        g.w[r] = (const u32*)m.w + (u64)rr * words;
        g.sb[r] = m.sb + rr * sbrow;
    }
    group_t1<R, FMT, SDT, OFS, GSH>(words, gshift, g, x, [&](const float (&acc)[R]) {
        float v[R];
#pragma unroll
        for (int r = 0; r < R; r++) v[r] = fold32(acc[r]);
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                const u32 o = row + r;
                if (o < m.rows) {
                    m.y[o] = v[r];
                    if (m.res) m.res[o] = m.res[o] + v[r];
                }
            }
        }
    });
}

// Whether row `row` of m may use the offset decode (CudaMatrix::offset_rows). When every row
// passes (offset 2) no bitmap is read, so the weight loads do not wait on that load.
__device__ __forceinline__ bool offset_row(const Mat& m, u32 row) {
    return m.offset == 2 || (m.offset == 1 && ((m.offset_rows[row >> 5] >> (row & 31)) & 1u));
}

// Calls call(SDT, GSH) for a 16-bit scale dtype and the group size as log2 (so the offset
// path's scale loads are constant offsets; group_size is 32, 64 or 128, checked at load).
#define OFS_SWITCH(call)                                      \
    if (sdt == 2) {                                           \
        if (group == 32) call(2, 5);                          \
        else if (group == 64) call(2, 6);                     \
        else call(2, 7);                                      \
    } else {                                                  \
        if (group == 32) call(1, 5);                          \
        else if (group == 64) call(1, 6);                     \
        else call(1, 7);                                      \
    }

template <int R>
__device__ __forceinline__ void t1_mat(const Mat& m, const float* x, u32 row);

// Grid: ceil(padded rows / (8·R)) over the launch's matrices (which share a format: the host
// splits launches by format and pads each matrix's first row to a multiple of R), block 256:
// warp n computes launch rows R·n .. R·n + R - 1, numbered on across the matrices. The offset
// decode is chosen per warp: every row it computes must pass.
template <int R>
__device__ __forceinline__ void t1_rows(const Mats& ms, const float* x, u32 rows) {
    if (TF_PROBE_SKIP_T1 || (TF_PROBE_SKIP_LMHEAD && rows > 65536)) {
        pdl_enter();
        return;
    }
    u32 n = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    if (n >= rows) return;  // having read nothing
    u32 i = 0;
    while (i + 1 < ms.count && n >= ms.m[i + 1].row0) i++;
    const Mat& m = ms.m[i];
    const u32 row = n - m.row0;
    if (row >= m.rows) return;  // a padding row
    t1_mat<R>(m, x, row);
}

// Rows row .. row + R - 1 of m for one token, with the offset decode where every row passes.
template <int R>
__device__ __forceinline__ void t1_mat(const Mat& m, const float* x, u32 row) {
    u32 fmt = m.fmt, sdt = m.sdtype;
    bool ofs = fmt == 4;
#pragma unroll
    for (int r = 0; r < R; r++) ofs = ofs && (row + r >= m.rows || offset_row(m, row + r));
    if (ofs) {
        const u32 group = m.group;
#define CALL(S, G) t1_body<R, 4, S, true, G>(m, x, row)
        OFS_SWITCH(CALL)
#undef CALL
        return;
    }
#define CALL(F, S) t1_body<R, F, S, false>(m, x, row)
    LAYOUT_SWITCH(CALL)
#undef CALL
}

extern "C" __global__ void __launch_bounds__(256, T1_MINB) matmul_t1r1(Mats ms, const float* x, u32 rows) { t1_rows<1>(ms, x, rows); }

// One token per item (a decode step of one row: each of its k experts is an item), the
// one-token path of each expert's rows: matmul_experts's grid and items, then t1_mat with the
// item's weights (the offset decode when the host says every expert's rows pass: offset 2).
extern "C" __global__ void __launch_bounds__(256, T1_MINB) matmul_experts_t1r2(Mats ms, const u64* tab, u32 E, const u32* items, const float* x, u32 ldx) {
    pdl_enter();
    if (blockIdx.y >= items[0]) return;
    const u32* it = items + 1 + 3 * blockIdx.y;
    u32 e = it[0], p0 = it[1];
    u32 n = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * 2;
    u32 i = 0;
    while (i + 1 < ms.count && n >= ms.m[i + 1].row0) i++;
    Mat m = ms.m[i];
    if (n < m.row0 || n - m.row0 >= m.rows) return;
    m.w = (const u8*)tab[2 * ((u64)i * E + e)];
    m.sb = (const u8*)tab[2 * ((u64)i * E + e) + 1];
    m.y += (u64)p0 * m.ldy;
    t1_mat<2>(m, x + (u64)p0 * ldx, n - m.row0);
}
// (At 64 registers ptxas spills a few values of the two-row kernel outside the loop; 3 blocks
// per multiprocessor and no spills measured slower on the H200.)
extern "C" __global__ void __launch_bounds__(256, T1_MINB) matmul_t1r2(Mats ms, const float* x, u32 rows) { t1_rows<2>(ms, x, rows); }

// The MLP's gate and up projections with SwiGLU fused: a warp computes row n of both (same
// arithmetic as two matmul outputs) and writes gate[n], up[n] and act[n] = silu(gate)·up
// (CPU twin of the pair: Cpu::matmul then Cpu::swiglu). ms.m[0] is gate_proj, ms.m[1] up_proj,
// both with the same format; `act` has the layout of their outputs.
template <int T, int FMT, int SDT>
__device__ __forceinline__ void pair_body(const Mats& ms, u32 n, const float* x, u32 ldx, u32 t0, u32 nt, float* act) {
    const u32 lane = threadIdx.x & 31;
    const Mat* mp[2] = {&ms.m[0], &ms.m[1]};
    u32 rows[2] = {n, n};
    float acc[T][2];
    accumulate<T, 2, FMT, SDT>(mp, rows, x, ldx, t0, nt, acc);
#pragma unroll
    for (int t = 0; t < T; t++) {
        float g = fold32(acc[t][0]);
        float u = fold32(acc[t][1]);
        if (lane == 0 && (u32)t < nt) {
            u64 o = (u64)(t0 + t) * ms.m[0].ldy + n;
            ms.m[0].y[o] = g;
            ms.m[1].y[o] = u;
            act[o] = tf_silu(g) * u;
        }
    }
}

template <int T>
__device__ __forceinline__ void matmul_swiglu(const Mats& ms, const float* x, u32 ldx, u32 n_tok, float* act) {
    pdl_enter();
    u32 n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (n >= ms.m[0].rows) return;
    u32 t0 = blockIdx.y * T;
    if (t0 >= n_tok) return;
    u32 nt = n_tok - t0 < (u32)T ? n_tok - t0 : (u32)T;
    u32 fmt = ms.m[0].fmt, sdt = ms.m[0].sdtype;
#define CALL(F, S) pair_body<T, F, S>(ms, n, x, ldx, t0, nt, act)
    LAYOUT_SWITCH(CALL)
#undef CALL
}

extern "C" __global__ void __launch_bounds__(256) matmul_swiglu_t4(Mats ms, const float* x, u32 ldx, u32 n_tok, float* act) { matmul_swiglu<4>(ms, x, ldx, n_tok, act); }
extern "C" __global__ void __launch_bounds__(256) matmul_swiglu_t8(Mats ms, const float* x, u32 ldx, u32 n_tok, float* act) { matmul_swiglu<8>(ms, x, ldx, n_tok, act); }

// One token: as matmul_t1r1, warp n computing row n of gate and of up. Grid ceil(rows / 8).
template <int FMT, int SDT, bool OFS, int GSH = 0>
__device__ __forceinline__ void pair_t1_body(const Mats& ms, const float* x, float* act) {
    const Mat& gm = ms.m[0];
    const Mat& um = ms.m[1];
    u32 n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (n >= gm.rows) return;  // having read nothing
    const u32 words = gm.cols / Fmt<FMT>::E;
    const u32 gshift = group_shift(FMT == 4 || FMT == 8 ? gm.group : 1);
    const u64 sbrow = (u64)(gm.cols >> gshift) * sb_size(SDT);
    Group<2> g;
    g.w[0] = (const u32*)gm.w + (u64)n * words;
    g.w[1] = (const u32*)um.w + (u64)n * words;
    g.sb[0] = gm.sb + n * sbrow;
    g.sb[1] = um.sb + n * sbrow;
    group_t1<2, FMT, SDT, OFS, GSH>(words, gshift, g, x, [&](const float (&acc)[2]) {
        float gv = fold32(acc[0]);
        float uv = fold32(acc[1]);
        if ((threadIdx.x & 31) == 0) {
            gm.y[n] = gv;
            um.y[n] = uv;
            act[n] = tf_silu(gv) * uv;
        }
    });
}

extern "C" __global__ void __launch_bounds__(256, T1_MINB) matmul_swiglu_t1(Mats ms, const float* x, float* act) {
    if (TF_PROBE_SKIP_T1) {
        pdl_enter();
        return;
    }
    u32 fmt = ms.m[0].fmt, sdt = ms.m[0].sdtype;
    u32 n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (fmt == 4 && n < ms.m[0].rows && offset_row(ms.m[0], n) && offset_row(ms.m[1], n)) {
        const u32 group = ms.m[0].group;
#define CALL(S, G) pair_t1_body<4, S, true, G>(ms, x, act)
        OFS_SWITCH(CALL)
#undef CALL
        return;
    }
#define CALL(F, S) pair_t1_body<F, S, false>(ms, x, act)
    LAYOUT_SWITCH(CALL)
#undef CALL
}

// ---- One token, streamed through shared memory (launches of many rows: the LM head) ----
//
// A persistent grid of one block per multiprocessor. The block's last warp (the producer) copies
// chunks of S_ROWS rows, their codes and then their scales and biases, into a ring of slots in
// shared memory with bulk copies (cp.async.bulk, completing on the slot's `full` mbarrier), and
// reuses a slot once every consumer warp has arrived on its `empty` mbarrier. It never reads the
// input: it waits only for free slots (and, once its first nslot chunks are requested, for the
// previous kernel in pdl_enter(), as every thread does), so DRAM stays busy, and those first
// chunks are weights requested before the wait. Warps 0..S_WARPS-1 compute two rows each per chunk from shared memory with group_t1's
// arithmetic: lane l's words l, l+32, ... in order, the offset decode when both rows pass (else
// the plain decode, which gives the same bits), then the fold by halves (numerics §2). A word
// costs no address arithmetic beyond a shared-memory offset and no bounds predicate.
// (bench/proto/persistent_stream.cu measured the idea first. Two rows per warp measured faster
// than four: 2B's LM head 133 against 147 us, H200.)
// CPU twin: as matmul_t1r1 (Cpu::matmul, dot_decoded).
// Needs (Cuda::stream_fits on the host): 4-bit codes with 16-bit scales, cols a multiple of 256
// and at most 8192, cols / group a multiple of 4 (16-byte copies), sm_90. Grid: one block per
// multiprocessor; block 32·(S_WARPS + 1); dynamic shared memory: x [cols] floats, 2·nslot
// mbarriers, then (128-byte aligned) nslot slots of slot_bytes = S_ROWS·(cols/2 + 4·cols/group).
#define S_ROWS 32  // one word of the offset bitmap
#define S_WARPS 16

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mb_init(u64* b, u32 n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void mb_expect(u64* b, u32 tx) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(tx) : "memory"); }
__device__ __forceinline__ void mb_arrive(u64* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory"); }
__device__ __forceinline__ void mb_wait(u64* b, u32 parity) {
    // (A label inside braces is local to them, so every inlined copy may use the same name.)
    asm volatile("{\n .reg .pred p;\n MB_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra MB_WAIT;\n}\n" ::"r"(smem_addr(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes),
                 "r"(smem_addr(b))
                 : "memory");
}

// Two rows of a chunk: codes [2][cw] and scale/bias entries [2][cg] in shared memory, x in xs;
// each lane's words in group_t1's order, each through word_t1.
template <int SDT, int GSH, bool OFS>
__device__ __forceinline__ void stream_rows(const u32* codes, const u32* sbs, u32 cw, u32 cg, const float* xs, float (&acc)[2]) {
    const u32 lane = threadIdx.x & 31;
    acc[0] = acc[1] = 0.0f;
    for (u32 j = lane; j < cw; j += 32) {
        float xv[8];
        load_x<8>(xs + 8 * j, xv);
        float s[2], b[2];
        u32 wd[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            wd[r] = codes[r * cw + j];
            unpack_sb<SDT>(sbs[r * cg + ((8 * j) >> GSH)], s[r], b[r]);
        }
        word_t1<2, 4, OFS>(wd, s, b, xv, acc);
    }
}

template <int SDT, int GSH>
__device__ __forceinline__ void t1s_body(const Mat& m, const float* x, u32 nslot, u32 slot_bytes, unsigned char* smem) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = gridDim.x;
    const u32 cols = m.cols, cw = cols / 8, cg = cols >> GSH, nch = (m.rows + S_ROWS - 1) / S_ROWS;
    float* xs = (float*)smem;
    u64* full = (u64*)(smem + cols * 4);
    u64* empty = full + nslot;
    unsigned char* ring = smem + ((cols * 4 + 16 * nslot + 127) & ~127u);
    if (threadIdx.x == 0) {
        for (u32 i = 0; i < nslot; i++) {
            mb_init(&full[i], 1);
            mb_init(&empty[i], S_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == S_WARPS) {
        // The producer: this block's chunks c = blockIdx.x + G·i in order, each into slot i % nslot.
        if (lane == 0) {
            u32 it = 0;
            for (u32 c = blockIdx.x; c < nch; c += G, it++) {
                if (it == nslot) pdl_enter();  // the first nslot chunks were requested before the wait
                const u32 slot = it % nslot, use = it / nslot;
                if (use > 0) mb_wait(&empty[slot], (use - 1) & 1);
                const u32 r0 = c * S_ROWS, n = m.rows - r0 < S_ROWS ? m.rows - r0 : S_ROWS;
                const u32 cb = n * cw * 4, sbb = n * cg * 4;
                unsigned char* dst = ring + slot * slot_bytes;
                mb_expect(&full[slot], cb + sbb);
                bulk_copy(dst, (const u32*)m.w + (u64)r0 * cw, cb, &full[slot]);
                bulk_copy(dst + S_ROWS * cw * 4, (const u32*)m.sb + (u64)r0 * cg, sbb, &full[slot]);
            }
            if (it <= nslot) pdl_enter();
        } else {
            pdl_enter();
        }
        return;
    }
    pdl_enter();
    for (u32 i = threadIdx.x; i < cols; i += 32 * S_WARPS) xs[i] = x[i];
    asm volatile("bar.sync 1, %0;" ::"r"(32 * S_WARPS) : "memory");
    const u32 rr = 2 * warp;  // this warp's rows of each chunk
    // The offset bits of a chunk's 32 rows are one word of the bitmap (CudaMatrix::offset_rows),
    // requested a chunk ahead so that its load never waits behind the chunk's copy.
    auto offset_bits = [&](u32 c) -> u32 { return m.offset == 2 ? ~0u : m.offset == 1 ? m.offset_rows[c] : 0u; };
    u32 bits_next = blockIdx.x < nch ? offset_bits(blockIdx.x) : 0u;
    u32 it = 0;
    for (u32 c = blockIdx.x; c < nch; c += G, it++) {
        const u32 slot = it % nslot, use = it / nslot;
        const u32 bits = bits_next;
        if (c + G < nch) bits_next = offset_bits(c + G);
        mb_wait(&full[slot], use & 1);
        const u32 r0 = c * S_ROWS, n = m.rows - r0 < S_ROWS ? m.rows - r0 : S_ROWS;
        float acc[2];
        if (rr < n) {
            const u32* codes = (const u32*)(ring + slot * slot_bytes) + rr * cw;
            const u32* sbs = (const u32*)(ring + slot * slot_bytes + S_ROWS * cw * 4) + rr * cg;
            // A second row past the matrix's end computes on stale bytes and is never written.
            if (((bits >> rr) & 1u) && (rr + 1 >= n || ((bits >> (rr + 1)) & 1u))) stream_rows<SDT, GSH, true>(codes, sbs, cw, cg, xs, acc);
            else stream_rows<SDT, GSH, false>(codes, sbs, cw, cg, xs, acc);
        }
        __syncwarp();
        if (lane == 0) mb_arrive(&empty[slot]);
        if (rr < n) {
            float v0 = fold32(acc[0]), v1 = fold32(acc[1]);
            if (lane == 0) {
                const u32 o = r0 + rr;
                m.y[o] = v0;
                if (m.res) m.res[o] = m.res[o] + v0;
                if (rr + 1 < n) {
                    m.y[o + 1] = v1;
                    if (m.res) m.res[o + 1] = m.res[o + 1] + v1;
                }
            }
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(32 * (S_WARPS + 1), 1) matmul_t1s(Mats ms, const float* x, u32 nslot, u32 slot_bytes) {
    extern __shared__ __align__(128) unsigned char t1s_smem[];
    if (TF_PROBE_SKIP_T1 || (TF_PROBE_SKIP_LMHEAD && ms.m[0].rows > 65536)) {
        pdl_enter();
        return;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const Mat& m = ms.m[0];
    const u32 sdt = m.sdtype, group = m.group;
#define CALL(S, G) t1s_body<S, G>(m, x, nslot, slot_bytes, t1s_smem)
    OFS_SWITCH(CALL)
#undef CALL
#else
    pdl_enter();
#endif
}
