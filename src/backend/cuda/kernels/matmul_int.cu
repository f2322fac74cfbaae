// Integer-exact products of affine weights (numerics §2.2): one token by dp4a, batches and
// prompt chunks on int8 tensor cores.
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

// The byte offset `at` of a plane in shared memory for the dp4a kernels: the 16-byte piece
// index inside each 128-byte line XORed with the line's index, so that the eight lanes of a
// 128-bit load phase (two lane groups, four consecutive units of 64 each, in chunks of 4 or 12
// units: 2048- and 6144-wide rows) meet eight different bank groups. Other widths may meet
// two-way conflicts.
__device__ __forceinline__ u32 swizzle16(u32 at) { return at ^ (((at >> 7) & 7u) << 4); }

// One block of a row by one warp, lane l holding elements 2l and 2l + 1 (v0, v1): its scale
// into d[blk], d·f32(Σxi) into ds64[blk] and ds32[2·blk + h], its planes into `planes` (the
// row's, [3][kpad]). Twin of cpu::intdot::quantize_row for one block.
template <bool SWZ = false>
__device__ __forceinline__ void quantize_block(float v0, float v1, u32 blk, u32 lane, u32 kpad, signed char* planes, float* d, float* ds64, float* ds32) {
    // max|x| (exact in any order) and whether any element is NaN (numerics::act_scale).
    float m = fmaxf(fabsf(v0), fabsf(v1));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
    bool nan = __any_sync(FULL_MASK, isnan(v0) || isnan(v1));
    float db = nan ? __int_as_float(0x7fc00000) : __fdiv_rn(m, ACT_LEVELS);
    // numerics::act_quant: only a normal scale quantizes.
    bool normal = db >= 1.17549435e-38f && db <= 3.40282347e38f;
    int xs[2] = {normal ? __float2int_rn(__fdiv_rn(v0, db)) : 0, normal ? __float2int_rn(__fdiv_rn(v1, db)) : 0};
    // Σ xi per 32 elements: lanes 0..15 hold elements 0..31.
    int s = xs[0] + xs[1];
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    int s_lo = __shfl_sync(FULL_MASK, s, 0), s_hi = __shfl_sync(FULL_MASK, s, 16);
    if (lane == 0) {
        d[blk] = db;
        ds64[blk] = db * (float)(s_lo + s_hi);
        ds32[2 * blk] = db * (float)s_lo;
        ds32[2 * blk + 1] = db * (float)s_hi;
    }
    // numerics::act_planes, each element at its byte of the layout above.
    const u32 e0 = blk * 64 + 2 * lane;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int xi = xs[k];
        int p0 = ((xi + 128) & 255) - 128;
        int r1 = (xi - p0) >> 8;
        int p1 = ((r1 + 128) & 255) - 128;
        int p2 = (r1 - p1) >> 8;
        u32 e = e0 + k, in = e & 7;
        u32 at = (e & ~7u) + ((in & 1) ? 4 + (in >> 1) : (in >> 1));
        if (SWZ) at = swizzle16(at);
        planes[at] = (signed char)p0;
        planes[kpad + at] = (signed char)p1;
        planes[2 * kpad + at] = (signed char)p2;
    }
}

// One row's blocks: grid (ceil(blocks / 8), rows), 256 threads, a warp per block, a lane per
// two elements.
extern "C" __global__ void __launch_bounds__(256) quantize_rows(const float* x, u32 ldx, u32 cols, u32 blocks, u32 kpad, signed char* planes, float* d, float* ds64, float* ds32) {
    pdl_enter();
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32 blk = blockIdx.x * 8 + warp, row = blockIdx.y;
    if (blk >= blocks) return;
    u32 e0 = blk * 64 + 2 * lane;
    const float* xr = x + (u64)row * ldx;
    float v0 = e0 < cols ? xr[e0] : 0.0f, v1 = e0 + 1 < cols ? xr[e0 + 1] : 0.0f;
    quantize_block(v0, v1, blk, lane, kpad, planes + (u64)row * 3 * kpad, d + row * blocks, ds64 + row * blocks, ds32 + row * 2 * blocks);
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
    u32 tile0;     // the launch's first row tile of this matrix (one-token kernels: its first row)
    u32 pad;
};
// Up to four matrices of one input (fused projections), their row tiles one after another.
struct IntMats {
    IntMat m[4];
    u32 count, pad0, pad1, pad2;
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

// Elements of a row the one-token kernels quantize into shared memory themselves (wider rows
// take quantize_rows and the small tile; cuda/mod.rs INT_ONE_TOKEN_COLS).
#define ONE_TOKEN_COLS 12288

// Twin of quantize_rows for one row into shared memory, by the whole block: warp w takes
// blocks w, w + 8, ..., QB at a time with their loads issued together. The planes are
// swizzled (swizzle16), each `kpad` bytes apart (a multiple of 128, so that no swizzled byte
// leaves its plane).
template <int QB>
__device__ __forceinline__ void quantize_smem(const float* xr, u32 cols, u32 blocks, u32 kpad, signed char* planes, float* d, float* ds64, float* ds32) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (u32 base = warp; base < blocks; base += 8 * QB) {
        float v[QB][2];
#pragma unroll
        for (int i = 0; i < QB; i++) {
            u32 e0 = (base + 8 * i) * 64 + 2 * lane;
            v[i][0] = e0 < cols ? xr[e0] : 0.0f;
            v[i][1] = e0 + 1 < cols ? xr[e0 + 1] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < QB; i++) {
            const u32 blk = base + 8 * i;
            if (blk >= blocks) break;
            quantize_block<true>(v[i][0], v[i][1], blk, lane, kpad, planes, d, ds64, ds32);
        }
    }
}

// ---- One token by dp4a (decode) ----
//
// A block quantizes the token into shared memory once (quantize_smem, planes swizzled), then
// each warp computes groups of T1I_R rows: warp n of the grid takes groups n, n + 8·gridDim.x,
// ... (the launch's rows numbered on across its matrices, each matrix's first row at a multiple
// of 4, so a group never straddles two). Its lanes are eight groups of four, lane group c the
// units of fold chunk c (numerics §2.2: floor(c·U/8) .. floor((c+1)·U/8) − 1): at step j lane i
// of the group takes the chunk's unit 4j + i of every row, its exact I = Σ q·xi by dp4a (three
// planes, three independent s32 sums per row), and its value v; the lane group then adds the
// four values to its chunk sum in unit order (shuffles), and after the last step lane 0 adds the
// eight chunk sums in order. Integer sums, so the dp4a order is free; the f32 epilogue and fold
// are those of the tensor-core tiles. A group's codes are loaded a step at a time into T1I_NBUF
// register buffers, the first ones before pdl_enter (weights only).
//
// SWI: the launch is a gate and an up matrix of the same shape (ms.m[0], ms.m[1]), a warp's two
// rows are row g of each, and it writes both outputs and silu(gate)·up (swiglu.cu's twin) into
// ms.m[2].y (count stays 2).
#ifndef T1I_NBUF
#define T1I_NBUF 2
#endif
#ifndef T1I_R
#define T1I_R 2
#endif
// Blocks of the token a warp quantizes with their loads issued together (more registers).
#ifndef T1I_QB
#define T1I_QB 8
#endif
#if T1I_R != 1 && T1I_R != 2 && T1I_R != 4
#error "T1I_R must divide 4 (the host starts each matrix at a multiple of 4 rows)"
#endif

__device__ __forceinline__ int dp4a_s8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp4a_u8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// `rows`: the launch's rows (each matrix's padded to a multiple of 4), or with SWI the rows of
// the gate matrix.
template <int BITS, int SDT, int UL, bool SWI>
__device__ __forceinline__ void matmul_int_t1(const IntMats& ms, const float* x, u32 rows) {
    __shared__ __align__(16) signed char qplanes[3 * ONE_TOKEN_COLS];
    __shared__ float qd[ONE_TOKEN_COLS / 64], qds64[ONE_TOKEN_COLS / 64], qds32[ONE_TOKEN_COLS / 32];
    constexpr int R = SWI ? 2 : T1I_R;
    constexpr int NW = BITS * UL / 32;  // code words of a unit
    constexpr int NP = UL / 16;         // 16-byte pieces of a unit's plane
    typedef typename Sb<SDT>::T SbT;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane >> 2, li = lane & 3;
    const u32 cols = ms.m[0].cols, units = cols / UL, blocks = (cols + 63) / 64, kpad = (64 * blocks + 127) & ~127u;
    const u32 ua = c * units / CHUNKS, ub = (c + 1) * units / CHUNKS;
    const u32 steps = ((units + CHUNKS - 1) / CHUNKS + 3) / 4;
    const u32 groups = SWI ? rows : rows / R;
    const u32 base = blockIdx.x * 8 + warp, stride = gridDim.x * 8;
    const u32 nb = base < groups ? ((groups - 1 - base) / stride + 1) * steps : 0;
    struct Buf {
        u32 w[R][NW];
        SbT sb[R];
    };
    // Batch n of this warp: group base + (n / steps)·stride, step n % steps; row r of the group
    // is row r0 + r of matrix *mp[r].
    auto where = [&](u32 n, const IntMat* (&mp)[R], u32& r0, u32& j) {
        const u32 grp = base + (n / steps) * stride;
        j = n % steps;
        if (SWI) {
#pragma unroll
            for (int r = 0; r < R; r++) mp[r] = &ms.m[r];
            r0 = grp;
        } else {
            const u32 row = R * grp;
            u32 mi = 0;
            for (u32 i = 1; i < ms.count; i++)
                if (row >= ms.m[i].tile0) mi = i;
#pragma unroll
            for (int r = 0; r < R; r++) mp[r] = &ms.m[mi];
            r0 = row - ms.m[mi].tile0;
        }
    };
    auto rowof = [&](u32 r0, int r) { return SWI ? r0 : r0 + r; };
    auto load = [&](Buf& b, u32 n) {
        const IntMat* mp[R];
        u32 r0, j;
        where(n, mp, r0, j);
        const u32 u = ua + 4 * j + li;
        if (u >= ub) return;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const IntMat& m = *mp[r];
            const u32 row = min(rowof(r0, r), m.rows - 1);
            const uint4* wp = (const uint4*)(m.w + (u64)row * (m.cols * BITS / 8) + (u64)u * (UL * BITS / 8));
#pragma unroll
            for (int k = 0; k < NW / 4; k++) {
                const uint4 v = wp[k];
                b.w[r][4 * k] = v.x;
                b.w[r][4 * k + 1] = v.y;
                b.w[r][4 * k + 2] = v.z;
                b.w[r][4 * k + 3] = v.w;
            }
            b.sb[r] = load_sb_raw<SDT>(m.sb + (u64)row * (m.cols / m.group) * sb_size(SDT), u * UL / m.group);
        }
    };
    Buf buf[T1I_NBUF];
#pragma unroll
    for (int s = 0; s < T1I_NBUF; s++)
        if (s < nb) load(buf[s], s);
    pdl_enter();
    quantize_smem<T1I_QB>(x, cols, blocks, kpad, qplanes, qd, qds64, qds32);
    __syncthreads();
    float cacc[R];
    auto compute = [&](const Buf& b, u32 n) {
        const IntMat* mp[R];
        u32 r0, j;
        where(n, mp, r0, j);
        const u32 u = ua + 4 * j + li;
        float v[R];
#pragma unroll
        for (int r = 0; r < R; r++) v[r] = 0.0f;
        if (u < ub) {
            // Each code word's even and odd elements as four bytes (the planes' order).
            u32 lo[R][NP * 2], hi[R][NP * 2];
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int k = 0; k < NP * 2; k++) {
                    if (BITS == 4) {
                        lo[r][k] = b.w[r][k] & 0x0F0F0F0Fu;
                        hi[r][k] = (b.w[r][k] >> 4) & 0x0F0F0F0Fu;
                    } else {
                        lo[r][k] = prmt(b.w[r][2 * k], b.w[r][2 * k + 1], 0x6420);
                        hi[r][k] = prmt(b.w[r][2 * k], b.w[r][2 * k + 1], 0x7531);
                    }
                }
            int acc[3][R];
#pragma unroll
            for (int p = 0; p < 3; p++) {
#pragma unroll
                for (int r = 0; r < R; r++) acc[p][r] = 0;
#pragma unroll
                for (int q = 0; q < NP; q++) {
                    const uint4 pv = *(const uint4*)(qplanes + p * kpad + swizzle16(u * UL + 16 * q));
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        int a = acc[p][r];
                        if (BITS == 4) {
                            a = dp4a_s8(lo[r][2 * q], pv.x, a);
                            a = dp4a_s8(hi[r][2 * q], pv.y, a);
                            a = dp4a_s8(lo[r][2 * q + 1], pv.z, a);
                            a = dp4a_s8(hi[r][2 * q + 1], pv.w, a);
                        } else {
                            a = dp4a_u8(lo[r][2 * q], pv.x, a);
                            a = dp4a_u8(hi[r][2 * q], pv.y, a);
                            a = dp4a_u8(lo[r][2 * q + 1], pv.z, a);
                            a = dp4a_u8(hi[r][2 * q + 1], pv.w, a);
                        }
                        acc[p][r] = a;
                    }
                }
            }
            const float dd = qd[u * UL / 64], ds = UL == 64 ? qds64[u] : qds32[u];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float fi;
                if (BITS == 4) {
                    fi = (float)(acc[2][r] * 65536 + acc[1][r] * 256 + acc[0][r]);
                } else {
                    long long ii = (long long)acc[0][r] + ((long long)acc[1][r] << 8) + ((long long)acc[2][r] << 16);
                    fi = __ll2float_rn(ii);
                }
                float sc, bi;
                unpack_sb<SDT>(b.sb[r], sc, bi);
                v[r] = __fmaf_rn(sc * dd, fi, bi * ds);
            }
        }
        // The lane group's four values into its chunk sum, in unit order.
        if (j == 0) {
#pragma unroll
            for (int r = 0; r < R; r++) cacc[r] = 0.0f;
        }
#pragma unroll
        for (int t = 0; t < 4; t++) {
            const bool take = ua + 4 * j + t < ub;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const float vt = __shfl_sync(FULL_MASK, v[r], t, 4);
                if (take) cacc[r] = cacc[r] + vt;
            }
        }
        if (j + 1 == steps) {
            float y[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                y[r] = 0.0f;
#pragma unroll
                for (int k = 0; k < CHUNKS; k++) y[r] = y[r] + __shfl_sync(FULL_MASK, cacc[r], 4 * k);
            }
            if (lane == 0) {
                if (SWI) {
                    if (r0 < mp[0]->rows) {
                        mp[0]->y[r0] = y[0];
                        mp[1]->y[r0] = y[R - 1];
                        ms.m[2].y[r0] = tf_silu(y[0]) * y[R - 1];
                    }
                } else {
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const IntMat& m = *mp[r];
                        const u32 o = r0 + r;
                        if (o < m.rows) {
                            m.y[o] = y[r];
                            if (m.res) m.res[o] = m.res[o] + y[r];
                        }
                    }
                }
            }
        }
    };
    for (u32 n = 0; n < nb; n += T1I_NBUF) {
#pragma unroll
        for (int s = 0; s < T1I_NBUF; s++) {
            if (n + s < nb) {
                compute(buf[s], n + s);
                if (n + s + T1I_NBUF < nb) load(buf[s], n + s + T1I_NBUF);
            }
        }
    }
}

// Units a warp loads together before their products (more bytes in flight per warp).
#define BATCH 4

// y = W·x for tokens n0 .. n0 + 8·NT and rows r0 .. r0 + 16·MT of one of the matrices, for
// each row tile blockIdx.x, blockIdx.x + gridDim.x, ... below `tiles` (Σ ceil(rows / 16·MT)):
// grid (≤ tiles, ceil(tokens / 8·NT)), 256 threads (the eight chunks).
template <int BITS, int SDT, int UL, int MT, int NT>
__device__ __forceinline__ void matmul_int(const IntMats& ms, IntIn in, u32 tiles) {
    __shared__ float part[CHUNKS][16 * MT][8 * NT];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 n0 = blockIdx.y * 8 * NT;
    constexpr int KS = UL / 32;
    // Larger tiles hold one unit at a time (their fragments already fill the registers).
    constexpr int NB = MT * NT == 1 ? BATCH : 1;
    // A batch's weights: BATCH units requested together (bytes in flight per warp). The first
    // batch of the first tile is requested before pdl_enter (weights only), so it arrives while
    // the previous kernel ends and this block quantizes its input.
    u32 alo[NB][MT][2][KS], ahi[NB][MT][2][KS];
    typename Sb<SDT>::T sbc[NB][MT][2];
    auto geometry = [&](u32 tile, const IntMat*& mp, u32& r0, u32& ua, u32& ub, const u8* (&wrow)[MT][2], const u8* (&sbrow)[MT][2]) {
        u32 mi = 0;
        for (u32 i = 1; i < ms.count; i++)
            if (tile >= ms.m[i].tile0) mi = i;
        mp = &ms.m[mi];
        const IntMat& m = *mp;
        r0 = (tile - m.tile0) * 16 * MT;
        const u32 units = m.cols / UL;
        ua = warp * units / CHUNKS;
        ub = (warp + 1) * units / CHUNKS;
        const u32 rowbytes = m.cols * BITS / 8, groups = m.cols / m.group, sbs = sb_size(SDT);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                u32 r = min(r0 + 16 * mt + g + 8 * h, m.rows - 1);
                wrow[mt][h] = m.w + (u64)r * rowbytes;
                sbrow[mt][h] = m.sb + (u64)r * groups * sbs;
            }
    };
    auto load_batch = [&](u32 u0, u32 ub, u32 group, const u8* (&wrow)[MT][2], const u8* (&sbrow)[MT][2]) {
#pragma unroll
        for (int k = 0; k < NB; k++) {
            if (u0 + k < ub) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        load_a<BITS, UL>(wrow[mt][h], u0 + k, t, alo[k][mt][h], ahi[k][mt][h]);
                        sbc[k][mt][h] = load_sb_raw<SDT>(sbrow[mt][h], (u0 + k) * UL / group);
                    }
            }
        }
    };
    bool prefetched = false;
    if (blockIdx.x < tiles) {
        const IntMat* mp;
        u32 r0, ua, ub;
        const u8* wrow[MT][2];
        const u8* sbrow[MT][2];
        geometry(blockIdx.x, mp, r0, ua, ub, wrow, sbrow);
        load_batch(ua, ub, mp->group, wrow, sbrow);
        prefetched = true;
    }
    pdl_enter();
    u32 tok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) tok[nt] = min(n0 + 8 * nt + g, in.tokens - 1);
    for (u32 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const IntMat* mp;
        u32 r0, ua, ub;
        const u8* wrow[MT][2];
        const u8* sbrow[MT][2];
        geometry(tile, mp, r0, ua, ub, wrow, sbrow);
        const IntMat& m = *mp;
        float cacc[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) cacc[mt][nt][i] = 0.0f;
        for (u32 u0 = ua; u0 < ub; u0 += NB) {
            // The batch's weights (unless prefetched), then their products in unit order.
            if (!prefetched) load_batch(u0, ub, m.group, wrow, sbrow);
            prefetched = false;
#pragma unroll
            for (int k = 0; k < NB; k++) {
                const u32 u = u0 + k;
                if (u >= ub) break;
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
                // I per output, exact. One-token tiles: one s32 accumulator per plane (three
                // independent mma chains), combined in i32 for 4-bit codes (every partial sum
                // stays below 2^31: numerics §2.2). Larger 4-bit tiles: Horner over the planes
                // in one accumulator (fewer registers; the same bound holds). 8-bit codes: one
                // accumulator per plane, combined in i64.
                constexpr int NACC = (BITS == 8 || MT * NT == 1) ? 3 : 1;
                int acc[NACC][MT][NT][4];
#pragma unroll
                for (int q = 0; q < NACC; q++)
#pragma unroll
                    for (int mt = 0; mt < MT; mt++)
#pragma unroll
                        for (int nt = 0; nt < NT; nt++)
#pragma unroll
                            for (int i = 0; i < 4; i++) acc[q][mt][nt][i] = 0;
                if constexpr (NACC == 3) {
#pragma unroll
                    for (int s = 0; s < KS; s++)
#pragma unroll
                        for (int mt = 0; mt < MT; mt++)
#pragma unroll
                            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                                for (int p = 0; p < 3; p++) {
                                    const u32 a[4] = {alo[k][mt][0][s], alo[k][mt][1][s], ahi[k][mt][0][s], ahi[k][mt][1][s]};
                                    mma_u8s8(acc[p][mt][nt], a, b[p][nt][s][0], b[p][nt][s][1]);
                                }
                } else {
#pragma unroll
                    for (int p = 2; p >= 0; p--)
#pragma unroll
                        for (int mt = 0; mt < MT; mt++)
#pragma unroll
                            for (int nt = 0; nt < NT; nt++) {
                                if (p < 2) {
#pragma unroll
                                    for (int i = 0; i < 4; i++) acc[0][mt][nt][i] *= 256;
                                }
#pragma unroll
                                for (int s = 0; s < KS; s++) {
                                    const u32 a[4] = {alo[k][mt][0][s], alo[k][mt][1][s], ahi[k][mt][0][s], ahi[k][mt][1][s]};
                                    mma_u8s8(acc[0][mt][nt], a, b[p][nt][s][0], b[p][nt][s][1]);
                                }
                            }
                }
                // The unit's value into each output's chunk sum.
                const u32 blk = u * UL / 64;
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        float sc, bi;
                        unpack_sb<SDT>(sbc[k][mt][h], sc, bi);
#pragma unroll
                        for (int nt = 0; nt < NT; nt++)
#pragma unroll
                            for (int j = 0; j < 2; j++) {
                                u32 tk = min(n0 + 8 * nt + 2 * t + j, in.tokens - 1);
                                float dd = in.d[tk * in.blocks + blk];
                                float ds = UL == 64 ? in.ds64[tk * in.blocks + u] : in.ds32[tk * 2 * in.blocks + u];
                                float fi;
                                const int i = 2 * h + j;
                                if constexpr (NACC == 1) {
                                    fi = (float)acc[0][mt][nt][i];
                                } else if constexpr (BITS == 4) {
                                    fi = (float)(acc[NACC - 1][mt][nt][i] * 65536 + acc[NACC > 1 ? 1 : 0][mt][nt][i] * 256 + acc[0][mt][nt][i]);
                                } else {
                                    long long ii = (long long)acc[0][mt][nt][i] + ((long long)acc[NACC > 1 ? 1 : 0][mt][nt][i] << 8) + ((long long)acc[NACC - 1][mt][nt][i] << 16);
                                    fi = __ll2float_rn(ii);
                                }
                                float v = __fmaf_rn(sc * dd, fi, bi * ds);
                                cacc[mt][nt][2 * h + j] = cacc[mt][nt][2 * h + j] + v;
                            }
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
        // `part` is read above before the next tile writes it.
        __syncthreads();
    }
}

// Entry points: bits, scale dtype (0 f32, 1 f16, 2 bf16), unit length, and the tile: one
// token quantized in the block (decode), 16 rows × 8 tokens (a few rows), 32 × 32 (prompts,
// batched decode), or 32 × 16 with two blocks resident per multiprocessor (batched decode).
#define MM_INT(BITS, SDT, UL)                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) matmul_int##BITS##_s##SDT##_u##UL##_one(IntMats m, const float* x, u32 rows) {                              \
        matmul_int_t1<BITS, SDT, UL, false>(m, x, rows);                                                                                \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) matmul_int##BITS##_s##SDT##_u##UL##_one_swiglu(IntMats m, const float* x, u32 rows) {                       \
        matmul_int_t1<BITS, SDT, UL, true>(m, x, rows);                                                                                 \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) matmul_int##BITS##_s##SDT##_u##UL##_small(IntMats m, IntIn in, const float* x, u32 tiles) {  \
        matmul_int<BITS, SDT, UL, 1, 1>(m, in, tiles);                                                                                       \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) matmul_int##BITS##_s##SDT##_u##UL##_large(IntMats m, IntIn in, const float* x, u32 tiles) {  \
        matmul_int<BITS, SDT, UL, 2, 4>(m, in, tiles);                                                                                       \
    }                                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 2) matmul_int##BITS##_s##SDT##_u##UL##_mid(IntMats m, IntIn in, const float* x, u32 tiles) {  \
        matmul_int<BITS, SDT, UL, 2, 2>(m, in, tiles);                                                                                       \
    }
#define MM_INT_SDT(BITS, UL) MM_INT(BITS, 0, UL) MM_INT(BITS, 1, UL) MM_INT(BITS, 2, UL)
MM_INT_SDT(4, 64)
MM_INT_SDT(4, 32)
MM_INT_SDT(8, 64)
MM_INT_SDT(8, 32)

// Prompt chunks with 4-bit codes: a block computes 128 rows × 32 tokens, its four warps 32 rows
// each (2 × 4 fragments), every warp walking all units in order: the eight chunks of the fold one
// after another, each summed in unit order from +0.0 and added in order into the output (the
// same sums as the split kernel above, where each warp is one chunk). A unit's codes, planes,
// scales and biases and activation scales are copied into shared memory by cp.async, the next
// unit's while the current one multiplies; the warps share the planes and the
// weights are read once per 32 tokens.
#define WIDE_N 32

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
template <int BYTES>
__device__ __forceinline__ void cp_async(void* s, const void* g) {
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(s)), "l"(g) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(s)), "l"(g), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// Units in shared memory at once: the next one is copied while the current one multiplies
// (four measured no faster on the H200: bench/results/2026-12-02-h200-int-wide-tile-2b.txt).
#define WIDE_STAGES 2

#define WIDE_WARPS 4
template <int UL, int SDT>
struct __align__(16) WideStage {
    u8 a[32 * WIDE_WARPS][UL / 2];             // the unit's code bytes of each row
    signed char b[WIDE_N][3 * UL];    // the unit's three planes of each token
    typename Sb<SDT>::T sb[32 * WIDE_WARPS];   // each row's scale and bias of the unit's group
    float d[WIDE_N], ds[WIDE_N];      // each token's block scale and d·f32(Σxi) of the unit
};

// Grid (Σ ceil(rows / 128) over the matrices, ceil(tokens / 32)), 128 threads: grid.x is the
// tile count (the entry points' `x` and `tiles` are unused, kept for the launch's one signature).
template <int SDT, int UL>
__device__ __forceinline__ void matmul_int_wide(const IntMats& ms, const IntIn& in) {
    constexpr int KS = UL / 32, MT = 2, NT = 4, AB = UL / 2, W = WIDE_WARPS, WIDE_M = 32 * W;
    __shared__ WideStage<UL, SDT> stg[WIDE_STAGES];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 tile = blockIdx.x;
    u32 mi = 0;
    for (u32 i = 1; i < ms.count; i++)
        if (tile >= ms.m[i].tile0) mi = i;
    const IntMat& m = ms.m[mi];
    const u32 r0 = (tile - m.tile0) * WIDE_M, n0 = blockIdx.y * WIDE_N;
    const u32 units = m.cols / UL, rowbytes = m.cols / 2, groups = m.cols / m.group, sbs = sb_size(SDT);
    // Weights (codes, scales and biases) of unit u into stage s; then what the previous kernel
    // wrote (planes, activation scales).
    auto issue_w = [&](u32 u, int s) {
        for (u32 i = threadIdx.x; i < WIDE_M * (AB / 16); i += 32 * W) {
            const u32 rl = i / (AB / 16), c = i % (AB / 16), r = min(r0 + rl, m.rows - 1);
            cp_async<16>(&stg[s].a[rl][16 * c], m.w + (u64)r * rowbytes + u * AB + 16 * c);
        }
        for (u32 rl = threadIdx.x; rl < WIDE_M; rl += 32 * W) {
            const u32 r = min(r0 + rl, m.rows - 1);
            cp_async<SDT == 0 ? 8 : 4>(&stg[s].sb[rl], m.sb + ((u64)r * groups + u * UL / m.group) * sbs);
        }
    };
    auto issue_x = [&](u32 u, int s) {
        for (u32 i = threadIdx.x; i < WIDE_N * 3 * (UL / 16); i += 32 * W) {
            const u32 tl = i / (3 * (UL / 16)), rest = i % (3 * (UL / 16)), p = rest / (UL / 16), c = rest % (UL / 16);
            const u32 tk = min(n0 + tl, in.tokens - 1);
            cp_async<16>(&stg[s].b[tl][p * UL + 16 * c], in.planes + ((u64)tk * 3 + p) * in.kpad + u * UL + 16 * c);
        }
        if (threadIdx.x < 2 * WIDE_N) {
            const u32 tl = threadIdx.x % WIDE_N, tk = min(n0 + tl, in.tokens - 1);
            if (threadIdx.x < WIDE_N)
                cp_async<4>(&stg[s].d[tl], in.d + tk * in.blocks + u * UL / 64);
            else
                cp_async<4>(&stg[s].ds[tl], UL == 64 ? in.ds64 + tk * in.blocks + u : in.ds32 + tk * 2 * in.blocks + u);
        }
    };
    // The first units' weights before the wait, then their inputs; one commit group per unit
    // (empty past the last unit, so the count of groups in flight stays fixed).
#pragma unroll
    for (int k = 0; k < WIDE_STAGES - 1; k++)
        if (k < units) issue_w(k, k);
    pdl_enter();
#pragma unroll
    for (int k = 0; k < WIDE_STAGES - 1; k++) {
        if (k < units) issue_x(k, k);
        cp_commit();
    }
    float cacc[MT][NT][4], yacc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) cacc[mt][nt][i] = yacc[mt][nt][i] = 0.0f;
    auto flush = [&]() {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    yacc[mt][nt][i] = yacc[mt][nt][i] + cacc[mt][nt][i];
                    cacc[mt][nt][i] = 0.0f;
                }
    };
    // Chunk c of the fold is units floor(c·U/8) .. floor((c+1)·U/8) − 1 (numerics::fold_units).
    u32 c = 0, cend = units / CHUNKS;
    for (u32 u = 0; u < units; u++) {
        const int s = u % WIDE_STAGES;
        cp_wait<WIDE_STAGES - 2>();
        // Every thread's copies of unit u have landed, and every warp is done with unit u − 1,
        // whose stage the next copies overwrite.
        __syncthreads();
        if (u + WIDE_STAGES - 1 < units) {
            const int sn = (u + WIDE_STAGES - 1) % WIDE_STAGES;
            issue_w(u + WIDE_STAGES - 1, sn);
            issue_x(u + WIDE_STAGES - 1, sn);
        }
        cp_commit();
        while (u == cend) {
            flush();
            c++;
            cend = (c + 1) * units / CHUNKS;
        }
        const WideStage<UL, SDT>& S = stg[s];
        u32 alo[MT][2][KS], ahi[MT][2][KS];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) load_a<4, UL>(S.a[32 * warp + 16 * mt + g + 8 * h], 0, t, alo[mt][h], ahi[mt][h]);
        // I per output: Horner over the planes in one s32 accumulator (numerics §2.2: every
        // partial sum of a 4-bit unit fits).
        int acc[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[mt][nt][i] = 0;
#pragma unroll
        for (int p = 2; p >= 0; p--) {
            u32 b[NT][KS][2];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const signed char* pp = S.b[8 * nt + g] + p * UL;
                if (UL == 64) {
                    uint4 v = *(const uint4*)(pp + 16 * t);
                    b[nt][0][0] = v.x;
                    b[nt][0][1] = v.y;
                    b[nt][KS - 1][0] = v.z;
                    b[nt][KS - 1][1] = v.w;
                } else {
                    uint2 v = *(const uint2*)(pp + 8 * t);
                    b[nt][0][0] = v.x;
                    b[nt][0][1] = v.y;
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    if (p < 2) {
#pragma unroll
                        for (int i = 0; i < 4; i++) acc[mt][nt][i] *= 256;
                    }
#pragma unroll
                    for (int ks = 0; ks < KS; ks++) {
                        const u32 a[4] = {alo[mt][0][ks], alo[mt][1][ks], ahi[mt][0][ks], ahi[mt][1][ks]};
                        mma_u8s8(acc[mt][nt], a, b[nt][ks][0], b[nt][ks][1]);
                    }
                }
        }
        // The unit's value into each output's chunk sum.
        float dd[NT][2], dsum[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float2 dv = *(const float2*)&S.d[8 * nt + 2 * t];
            const float2 sv = *(const float2*)&S.ds[8 * nt + 2 * t];
            dd[nt][0] = dv.x;
            dd[nt][1] = dv.y;
            dsum[nt][0] = sv.x;
            dsum[nt][1] = sv.y;
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float sc, bi;
                unpack_sb<SDT>(S.sb[32 * warp + 16 * mt + g + 8 * h], sc, bi);
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        const float v = __fmaf_rn(sc * dd[nt][j], (float)acc[mt][nt][2 * h + j], bi * dsum[nt][j]);
                        cacc[mt][nt][2 * h + j] = cacc[mt][nt][2 * h + j] + v;
                    }
            }
    }
    while (c < CHUNKS) {
        flush();
        c++;
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 r = r0 + 32 * warp + 16 * mt + g + 8 * (i >> 1), tk = n0 + 8 * nt + 2 * t + (i & 1);
                if (r >= m.rows || tk >= in.tokens) continue;
                const float yv = yacc[mt][nt][i];
                m.y[(u64)tk * m.ldy + r] = yv;
                if (m.res) m.res[(u64)tk * m.ldy + r] = m.res[(u64)tk * m.ldy + r] + yv;
            }
}

#define MM_INT_WIDE(SDT, UL)                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) matmul_int4_s##SDT##_u##UL##_wide(IntMats m, IntIn in, const float* x, u32 tiles) { \
        matmul_int_wide<SDT, UL>(m, in);                                                                                             \
    }
MM_INT_WIDE(0, 64)
MM_INT_WIDE(1, 64)
MM_INT_WIDE(2, 64)
MM_INT_WIDE(0, 32)
MM_INT_WIDE(1, 32)
MM_INT_WIDE(2, 32)
