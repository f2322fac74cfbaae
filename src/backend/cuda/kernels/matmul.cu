// y = W·x for up to four weight matrices that read the same input (fused projections), with
// an optional residual add (res += y) per matrix.
// CPU twin: backend::cpu::kernels::dot_decoded through simd::matmul (numerics §2): lane l of a
// warp owns the stored 32-bit words l, l+32, ... of a row, accumulates their decoded elements in
// order with fmaf, and the warp folds its lanes by halves.
//
// A warp computes R rows of one matrix for a tile of T tokens, so each weight word is loaded
// once per T tokens and each input value once per R rows. The arithmetic of an output does not
// depend on T or R. Grid: (ceil(padded_rows / (R·8)), ceil(tokens / T)), block 256.

struct Mat {
    const u8* w;   // codes (affine) or values (float), row-major
    const u8* s;   // scales [rows, cols/group] (affine)
    const u8* b;   // biases [rows, cols/group] (affine)
    float* y;      // output [tokens, ldy]
    float* res;    // if set, the residual stream [tokens, ldy]: res += y (Cpu::matmul_residual)
    u32 rows, cols, fmt, group, sdtype, ldy, row0, pad;
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
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
// 0x4B0000|byte k of v: selector bytes (from low) k, 4 (b.byte0 = 0), 5 (0), 7 (0x4B).
__device__ __forceinline__ float byte_to_float(u32 v, int k) { return __uint_as_float(prmt(v, 0x4B000000u, 0x7540u | (u32)k)) - 8388608.0f; }

template <int FMT>
__device__ __forceinline__ float decode(u32 wd, int e, float s, float b) {
    if (FMT == 4) return fmaf(s, byte_to_float(((e & 1) ? (wd >> 4) : wd) & 0x0F0F0F0Fu, e >> 1), b);
    if (FMT == 8) return fmaf(s, byte_to_float(wd, e), b);
    if (FMT == 2) return bf16_to_f32(e == 0 ? (wd & 0xffffu) : (wd >> 16));
    if (FMT == 1) return f16_to_f32((u16)(e == 0 ? (wd & 0xffffu) : (wd >> 16)));
    return __uint_as_float(wd);
}

// Scale or bias i of a row, of dtype SDT (0 f32, 1 f16, 2 bf16): a template parameter, so the
// inner loops carry no dtype branch.
template <int SDT>
__device__ __forceinline__ float load_scale(const u8* p, u32 i) {
    if (SDT == 2) return bf16_to_f32(((const u16*)p)[i]);
    if (SDT == 1) return f16_to_f32(((const u16*)p)[i]);
    return ((const float*)p)[i];
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

// Accumulates, for R rows (row r of matrix *ms[r], index rows[r]) and T tokens, each lane's
// partial dot products in the canonical order: words j = lane, lane+32, ... ascending, elements
// of a word ascending. Words are loaded eight at a time (independent loads in flight), which
// keeps each lane's order: j, j+32, j+64, ...
template <int T, int R, int FMT, int SDT>
__device__ __forceinline__ void accumulate(const Mat* const* ms, const u32* rows, const float* x, u32 ldx, u32 t0, u32 nt,
                                           float (&acc)[T][R]) {
    const int E = Fmt<FMT>::E;
    const bool affine = FMT == 4 || FMT == 8;
    const u32 lane = threadIdx.x & 31;
    const u32 words = ms[0]->cols / E;
    const u32* wrow[R];
    const u8* srow[R];
    const u8* brow[R];
    u32 group = affine ? ms[0]->group : 1, sdt = ms[0]->sdtype, gshift = group_shift(group);
    u32 ssize = sdt == 0 ? 4 : 2;
#pragma unroll
    for (int r = 0; r < R; r++) {
        wrow[r] = (const u32*)ms[r]->w + (u64)rows[r] * words;
        srow[r] = affine ? ms[r]->s + (u64)rows[r] * (ms[r]->cols / group) * ssize : ms[r]->s;
        brow[r] = affine ? ms[r]->b + (u64)rows[r] * (ms[r]->cols / group) * ssize : ms[r]->b;
    }
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = 0.0f;
    const int U = 8;
    // The group scale and bias of word j of each row.
    auto scales = [&](u32 j, float (&s)[R], float (&b)[R]) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            u32 g = affine ? (j * E) >> gshift : 0;
            s[r] = affine ? load_scale<SDT>(srow[r], g) : 0.0f;
            b[r] = affine ? load_scale<SDT>(brow[r], g) : 0.0f;
        }
    };
    // Word j (`wd`, one per row) for every token: inputs, then the ordered FMAs.
    auto fmas = [&](const u32 (&wd)[R], const float (&s)[R], const float (&b)[R], u32 j) {
#pragma unroll
        for (int t = 0; t < T; t++) {
            // Tokens past the tile's end read the last row and accumulate into outputs that are
            // never written: no branch here either.
            u32 tt = (u32)t < nt ? (u32)t : nt - 1;
            float xv[E];
            load_x<E>(x + (u64)(t0 + tt) * ldx + (u64)j * E, xv);
#pragma unroll
            for (int e = 0; e < E; e++)
#pragma unroll
                for (int r = 0; r < R; r++) acc[t][r] = fmaf(decode<FMT>(wd[r], e, s[r], b[r]), xv[e], acc[t][r]);
        }
    };
    if constexpr (T == 1) {
        // One token (decode): latency matters most.
        // A batch: words j0 + 32u (u < U) of each row; with one row also their scales and biases
        // (with two, per word, to save registers). The first batch is loaded before
        // pdl_enter(): weights only, so they arrive while the previous kernel ends.
        constexpr bool ahead = R == 1;
        u32 wd[U][R];
        float sa[ahead ? U : 1][R], ba[ahead ? U : 1][R];
        auto load_batch = [&](u32 j0) {
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    bool in = j0 + 32 * u < words;
                    wd[u][r] = in ? wrow[r][j0 + 32 * u] : 0u;
                    if constexpr (ahead) {
                        u32 g = affine ? ((j0 + 32 * u) * E) >> gshift : 0;
                        sa[u][r] = affine && in ? load_scale<SDT>(srow[r], g) : 0.0f;
                        ba[u][r] = affine && in ? load_scale<SDT>(brow[r], g) : 0.0f;
                    }
                }
        };
        auto word = [&](int u, u32 j) {
            float s[R], b[R];
            if constexpr (ahead) {
#pragma unroll
                for (int r = 0; r < R; r++) {
                    s[r] = sa[u][r];
                    b[r] = ba[u][r];
                }
            } else {
                scales(j, s, b);
            }
            fmas(wd[u], s, b, j);
        };
        load_batch(lane);
        pdl_enter();
        for (u32 j0 = lane; j0 < words; j0 += 32 * U) {
            if (j0 != lane) load_batch(j0);
            over_batch<U>(j0, words, word);
        }
    } else {
        // Many tokens (prompt): registers matter most; scales and biases are loaded per word.
        // (pdl_enter() ran at the kernel's start.)
        for (u32 j0 = lane; j0 < words; j0 += 32 * U) {
            u32 wd[U][R];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) wd[u][r] = j0 + 32 * u < words ? wrow[r][j0 + 32 * u] : 0u;
            over_batch<U>(j0, words, [&](int u, u32 j) {
                float s[R], b[R];
                scales(j, s, b);
                fmas(wd[u], s, b, j);
            });
        }
    }
}

// Calls call(FMT, SDT) for the weight format `fmt` and scale dtype `sdt` of the warp's matrix
// (a fused launch may mix formats; each warp works on one matrix): affine codes with each scale
// dtype, or float weights.
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
    // With one token pdl_enter() is in accumulate(), after the first weights are requested (a
    // warp without rows returns having read nothing); with many, here.
    if constexpr (T > 1) pdl_enter();
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

extern "C" __global__ void __launch_bounds__(256) matmul_t1r1(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<1, 1>(ms, x, ldx, n_tok); }
extern "C" __global__ void __launch_bounds__(256) matmul_t4r2(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<4, 2>(ms, x, ldx, n_tok); }
extern "C" __global__ void __launch_bounds__(256) matmul_t8r4(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<8, 4>(ms, x, ldx, n_tok); }

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
    // pdl_enter() as in matmul().
    if constexpr (T > 1) pdl_enter();
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

extern "C" __global__ void __launch_bounds__(256) matmul_swiglu_t1(Mats ms, const float* x, u32 ldx, u32 n_tok, float* act) { matmul_swiglu<1>(ms, x, ldx, n_tok, act); }
extern "C" __global__ void __launch_bounds__(256) matmul_swiglu_t4(Mats ms, const float* x, u32 ldx, u32 n_tok, float* act) { matmul_swiglu<4>(ms, x, ldx, n_tok, act); }
extern "C" __global__ void __launch_bounds__(256) matmul_swiglu_t8(Mats ms, const float* x, u32 ldx, u32 n_tok, float* act) { matmul_swiglu<8>(ms, x, ldx, n_tok, act); }
