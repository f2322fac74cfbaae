// y = W·x for up to four weight matrices that read the same input (fused projections).
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
template <int FMT>
__device__ __forceinline__ float decode(u32 wd, int e, float s, float b) {
    if (FMT == 4) return fmaf(s, (float)((wd >> (4 * e)) & 15u), b);
    if (FMT == 8) return fmaf(s, (float)((wd >> (8 * e)) & 255u), b);
    if (FMT == 2) return bf16_to_f32(e == 0 ? (wd & 0xffffu) : (wd >> 16));
    if (FMT == 1) return f16_to_f32((u16)(e == 0 ? (wd & 0xffffu) : (wd >> 16)));
    return __uint_as_float(wd);
}

template <int T, int R, int FMT>
__device__ __forceinline__ void body(const Mat& m, u32 n0, const float* x, u32 ldx, u32 t0, u32 nt) {
    const int E = Fmt<FMT>::E;
    const u32 lane = threadIdx.x & 31;
    const u32 words = m.cols / E;
    const bool affine = FMT == 4 || FMT == 8;
    const u32 groups = affine ? m.cols / m.group : 1;
    float acc[T][R];
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = 0.0f;
    u32 nr = m.rows - n0 < (u32)R ? m.rows - n0 : (u32)R;
    const u32* wrow[R];
#pragma unroll
    for (int r = 0; r < R; r++) wrow[r] = (const u32*)m.w + (u64)(n0 + ((u32)r < nr ? r : 0)) * words;
    for (u32 j = lane; j < words; j += 32) {
        u32 wd[R];
        float s[R], b[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            wd[r] = wrow[r][j];
            if (affine) {
                u64 g = (u64)(n0 + ((u32)r < nr ? r : 0)) * groups + (u64)j * E / m.group;
                s[r] = load_float(m.s, g, m.sdtype);
                b[r] = load_float(m.b, g, m.sdtype);
            } else {
                s[r] = 0.0f;
                b[r] = 0.0f;
            }
        }
#pragma unroll
        for (int e = 0; e < E; e++) {
            float wf[R];
#pragma unroll
            for (int r = 0; r < R; r++) wf[r] = decode<FMT>(wd[r], e, s[r], b[r]);
#pragma unroll
            for (int t = 0; t < T; t++) {
                if ((u32)t < nt) {
                    float xv = x[(u64)(t0 + t) * ldx + (u64)j * E + e];
#pragma unroll
                    for (int r = 0; r < R; r++) acc[t][r] = fmaf(wf[r], xv, acc[t][r]);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = fold32(acc[t][r]);
            if (lane == 0 && (u32)t < nt && (u32)r < nr) m.y[(u64)(t0 + t) * m.ldy + n0 + r] = v;
        }
}

template <int T, int R>
__device__ __forceinline__ void matmul(const Mats& ms, const float* x, u32 ldx, u32 n_tok) {
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
    switch (m.fmt) {
        case 4: body<T, R, 4>(m, n0, x, ldx, t0, nt); break;
        case 8: body<T, R, 8>(m, n0, x, ldx, t0, nt); break;
        case 2: body<T, R, 2>(m, n0, x, ldx, t0, nt); break;
        case 1: body<T, R, 1>(m, n0, x, ldx, t0, nt); break;
        default: body<T, R, 0>(m, n0, x, ldx, t0, nt); break;
    }
}

extern "C" __global__ void __launch_bounds__(256) matmul_t1r1(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<1, 1>(ms, x, ldx, n_tok); }
extern "C" __global__ void __launch_bounds__(256) matmul_t4r2(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<4, 2>(ms, x, ldx, n_tok); }
extern "C" __global__ void __launch_bounds__(256) matmul_t8r4(Mats ms, const float* x, u32 ldx, u32 n_tok) { matmul<8, 4>(ms, x, ldx, n_tok); }
