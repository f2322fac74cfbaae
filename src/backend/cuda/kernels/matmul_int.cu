// Integer-exact products of affine weights (numerics §2.2), on int8 tensor cores.
// CPU twins: backend::cpu::intdot (QuantRows::fill_rows for quantize_rows; matmul for
// matmul_int), whose scalar definition is numerics::dot_affine_int.
//
// quantize_rows turns each input row into, per block of 64 elements, a scale d, exact
// integers xi as three int8 planes (xi = p0 + 256·p1 + 65536·p2), and the products the
// epilogue needs, d·f32(Σxi) per unit of 64 and of 32. matmul_int then computes, per output
// and unit, the exact I = Σ q·xi with mma.sync m16n8k32 (u8 codes × s8 planes, s32
// accumulators; integers, so neither tiling nor the order of the tensor core's sums changes a
// bit), the unit's value fma(s·d, f32(I), b·(d·f32(Σxi))), and the fold: a block's eight
// warps are the eight chunks of numerics::fold_units, each summing its units in order, and
// the chunks are added in order from shared memory.
//
// Plane layout, per row [3][kpad] bytes, kpad = 64·blocks: element 8j + e of the row sits at
// byte 8j + (e even ? e/2 : 4 + e/2), so the low nibbles of stored code word j (elements 8j,
// 8j+2, 8j+4, 8j+6) meet the first four bytes and the high nibbles the other four. A thread
// of an mma owns code word 2t + s of k-step s of a unit of 64 (word t of a unit of 32), and
// reads the matching 8 plane bytes of a column as its B fragment (b0 the evens, b1 the odds).

#define ACT_LEVELS 2080768.0f  // numerics::ACT_LEVELS
#define CHUNKS 8               // numerics::PRODUCT_CHUNKS: one warp each

// One row's blocks: grid (ceil(blocks / 8), rows), 256 threads, a warp per block, a lane per
// two elements. Twin of cpu::intdot::quantize_row.
extern "C" __global__ void __launch_bounds__(256) quantize_rows(const float* x, u32 ldx, u32 cols, u32 blocks, u32 kpad, signed char* planes, float* d, float* ds64, float* ds32) {
    pdl_enter();
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32 blk = blockIdx.x * 8 + warp, row = blockIdx.y;
    if (blk >= blocks) return;
    u32 e0 = blk * 64 + 2 * lane;
    const float* xr = x + (u64)row * ldx;
    float v0 = e0 < cols ? xr[e0] : 0.0f, v1 = e0 + 1 < cols ? xr[e0 + 1] : 0.0f;
    // max|x| (exact in any order) and whether any element is NaN (numerics::act_scale).
    float m = fmaxf(fabsf(v0), fabsf(v1));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
    bool nan = __any_sync(FULL_MASK, isnan(v0) || isnan(v1));
    float db = nan ? __int_as_float(0x7fc00000) : __fdiv_rn(m, ACT_LEVELS);
    // numerics::act_quant: only a normal scale quantizes.
    bool normal = db >= 1.17549435e-38f && db <= 3.40282347e38f;
    int x0 = normal ? __float2int_rn(__fdiv_rn(v0, db)) : 0;
    int x1 = normal ? __float2int_rn(__fdiv_rn(v1, db)) : 0;
    // Σ xi per 32 elements: lanes 0..15 hold elements 0..31.
    int s = x0 + x1;
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    int s_lo = __shfl_sync(FULL_MASK, s, 0), s_hi = __shfl_sync(FULL_MASK, s, 16);
    if (lane == 0) {
        d[row * blocks + blk] = db;
        ds64[row * blocks + blk] = db * (float)(s_lo + s_hi);
        ds32[row * 2 * blocks + 2 * blk] = db * (float)s_lo;
        ds32[row * 2 * blocks + 2 * blk + 1] = db * (float)s_hi;
    }
    // numerics::act_planes, each element at its byte of the layout above.
    signed char* pr = planes + (u64)row * 3 * kpad;
    int xs[2] = {x0, x1};
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int xi = xs[k];
        int p0 = ((xi + 128) & 255) - 128;
        int r1 = (xi - p0) >> 8;
        int p1 = ((r1 + 128) & 255) - 128;
        int p2 = (r1 - p1) >> 8;
        u32 e = e0 + k, in = e & 7;
        u32 at = (e & ~7u) + ((in & 1) ? 4 + (in >> 1) : (in >> 1));
        pr[at] = (signed char)p0;
        pr[kpad + at] = (signed char)p1;
        pr[2 * kpad + at] = (signed char)p2;
    }
}

__device__ __forceinline__ void mma_u8s8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct IntMat {
    const u8* w;   // codes [rows, cols·bits/8]
    const u8* sb;  // interleaved scales and biases (CudaMatrix::sb)
    float* y;      // [tokens, ldy]
    float* res;    // if set: res += y
    u32 rows, cols, group, ldy;
};
struct IntIn {
    const signed char* planes;  // [tokens][3][kpad]
    const float* d;             // [tokens][blocks]
    const float* ds64;          // [tokens][blocks]
    const float* ds32;          // [tokens][2·blocks]
    u32 tokens, blocks, kpad, pad;
};

// A fragments of one row for unit u: for k-step s, the low nibbles (elements 8j, 8j+2, ...)
// and the high nibbles of code word j = 2t + s (UL 64) or t (UL 32), as u8 (8-bit codes: the
// even and odd bytes of the two words that hold those elements).
template <int BITS, int UL>
__device__ __forceinline__ void load_a(const u8* row, u32 u, u32 t, u32 (&lo)[UL / 32], u32 (&hi)[UL / 32]) {
    if (BITS == 4) {
        if (UL == 64) {
            uint2 v = *(const uint2*)(row + u * 32 + 8 * t);
            lo[0] = v.x & 0x0F0F0F0Fu;
            hi[0] = (v.x >> 4) & 0x0F0F0F0Fu;
            lo[UL / 32 - 1] = v.y & 0x0F0F0F0Fu;
            hi[UL / 32 - 1] = (v.y >> 4) & 0x0F0F0F0Fu;
        } else {
            u32 v = *(const u32*)(row + u * 16 + 4 * t);
            lo[0] = v & 0x0F0F0F0Fu;
            hi[0] = (v >> 4) & 0x0F0F0F0Fu;
        }
    } else {
        if (UL == 64) {
            uint4 v = *(const uint4*)(row + u * 64 + 16 * t);
            lo[0] = prmt(v.x, v.y, 0x6420);
            hi[0] = prmt(v.x, v.y, 0x7531);
            lo[UL / 32 - 1] = prmt(v.z, v.w, 0x6420);
            hi[UL / 32 - 1] = prmt(v.z, v.w, 0x7531);
        } else {
            uint2 v = *(const uint2*)(row + u * 32 + 8 * t);
            lo[0] = prmt(v.x, v.y, 0x6420);
            hi[0] = prmt(v.x, v.y, 0x7531);
        }
    }
}

// y = W·x for tokens n0 .. n0 + 8·NT and rows r0 .. r0 + 16·MT of one matrix: grid
// (ceil(rows / 16·MT), ceil(tokens / 8·NT)), 256 threads (the eight chunks).
template <int BITS, int SDT, int UL, int MT, int NT>
__device__ __forceinline__ void matmul_int(const IntMat& m, const IntIn& in) {
    __shared__ float part[CHUNKS][16 * MT][8 * NT];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 r0 = blockIdx.x * 16 * MT, n0 = blockIdx.y * 8 * NT;
    const u32 units = m.cols / UL, ua = warp * units / CHUNKS, ub = (warp + 1) * units / CHUNKS;
    const u32 rowbytes = m.cols * BITS / 8, groups = m.cols / m.group, sbs = sb_size(SDT);
    const u8* wrow[MT][2];
    const u8* sbrow[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 r = min(r0 + 16 * mt + g + 8 * h, m.rows - 1);
            wrow[mt][h] = m.w + (u64)r * rowbytes;
            sbrow[mt][h] = m.sb + (u64)r * groups * sbs;
        }
    pdl_enter();
    u32 tok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) tok[nt] = min(n0 + 8 * nt + g, in.tokens - 1);
    float cacc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) cacc[mt][nt][i] = 0.0f;
    constexpr int KS = UL / 32;
    for (u32 u = ua; u < ub; u++) {
        u32 alo[MT][2][KS], ahi[MT][2][KS];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) load_a<BITS, UL>(wrow[mt][h], u, t, alo[mt][h], ahi[mt][h]);
        // B fragments: plane p, k-step s of token column tok[nt].
        u32 b[3][NT][KS][2];
#pragma unroll
        for (int p = 0; p < 3; p++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const signed char* pp = in.planes + ((u64)tok[nt] * 3 + p) * in.kpad;
                if (UL == 64) {
                    uint4 v = *(const uint4*)(pp + u * 64 + 16 * t);
                    b[p][nt][0][0] = v.x;
                    b[p][nt][0][1] = v.y;
                    b[p][nt][KS - 1][0] = v.z;
                    b[p][nt][KS - 1][1] = v.w;
                } else {
                    uint2 v = *(const uint2*)(pp + u * 32 + 8 * t);
                    b[p][nt][0][0] = v.x;
                    b[p][nt][0][1] = v.y;
                }
            }
        // I per output: 4-bit codes by Horner over the planes in one s32 accumulator (every
        // partial value stays below 2^31: numerics §2.2); 8-bit codes one accumulator per plane.
        int acc[BITS == 4 ? 1 : 3][MT][NT][4];
#pragma unroll
        for (int q = 0; q < (BITS == 4 ? 1 : 3); q++)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[q][mt][nt][i] = 0;
#pragma unroll
        for (int p = 2; p >= 0; p--) {
            const int q = BITS == 4 ? 0 : p;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    if (BITS == 4 && p < 2) {
#pragma unroll
                        for (int i = 0; i < 4; i++) acc[0][mt][nt][i] *= 256;
                    }
#pragma unroll
                    for (int s = 0; s < KS; s++) {
                        const u32 a[4] = {alo[mt][0][s], alo[mt][1][s], ahi[mt][0][s], ahi[mt][1][s]};
                        mma_u8s8(acc[q][mt][nt], a, b[p][nt][s][0], b[p][nt][s][1]);
                    }
                }
        }
        // The unit's value into each output's chunk sum.
        const u32 grp = u * UL / m.group, blk = u * UL / 64;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float s, bb;
                load_sb<SDT>(sbrow[mt][h], grp, s, bb);
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        u32 tk = min(n0 + 8 * nt + 2 * t + j, in.tokens - 1);
                        float dd = in.d[tk * in.blocks + blk];
                        float ds = UL == 64 ? in.ds64[tk * in.blocks + u] : in.ds32[tk * 2 * in.blocks + u];
                        float fi;
                        if (BITS == 4) {
                            fi = (float)acc[0][mt][nt][2 * h + j];
                        } else {
                            long long ii = (long long)acc[0][mt][nt][2 * h + j] + ((long long)acc[1][mt][nt][2 * h + j] << 8) + ((long long)acc[2][mt][nt][2 * h + j] << 16);
                            fi = __ll2float_rn(ii);
                        }
                        float v = __fmaf_rn(s * dd, fi, bb * ds);
                        cacc[mt][nt][2 * h + j] = cacc[mt][nt][2 * h + j] + v;
                    }
            }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) part[warp][16 * mt + g + 8 * (i >> 1)][8 * nt + 2 * t + (i & 1)] = cacc[mt][nt][i];
    __syncthreads();
    for (u32 o = threadIdx.x; o < 16 * MT * 8 * NT; o += 256) {
        u32 rl = o / (8 * NT), tl = o % (8 * NT);
        u32 r = r0 + rl, tk = n0 + tl;
        if (r >= m.rows || tk >= in.tokens) continue;
        float yv = 0.0f;
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) yv = yv + part[c][rl][tl];
        m.y[(u64)tk * m.ldy + r] = yv;
        if (m.res) m.res[(u64)tk * m.ldy + r] = m.res[(u64)tk * m.ldy + r] + yv;
    }
}

// Entry points: bits, scale dtype (0 f32, 1 f16, 2 bf16), unit length, and the tile: 16 rows
// × 8 tokens (decode) or 32 × 32 (prompts, batched decode).
#define MM_INT(BITS, SDT, UL)                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) matmul_int##BITS##_s##SDT##_u##UL##_small(IntMat m, IntIn in) {                   \
        matmul_int<BITS, SDT, UL, 1, 1>(m, in);                                                                                          \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) matmul_int##BITS##_s##SDT##_u##UL##_large(IntMat m, IntIn in) {                   \
        matmul_int<BITS, SDT, UL, 2, 4>(m, in);                                                                                          \
    }
#define MM_INT_SDT(BITS, UL) MM_INT(BITS, 0, UL) MM_INT(BITS, 1, UL) MM_INT(BITS, 2, UL)
MM_INT_SDT(4, 64)
MM_INT_SDT(4, 32)
MM_INT_SDT(8, 64)
MM_INT_SDT(8, 32)
