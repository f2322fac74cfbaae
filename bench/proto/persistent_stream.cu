// Prototype, not part of the engine: how fast can one persistent kernel stream a Qwen3.5-2B decode
// token's one-token products (4-bit MLX affine codes, bf16 scales/biases, group 64) with the
// engine's exact decode arithmetic (numerics §2, the offset form of matmul.cu) when a producer
// warp per SM streams weights into a shared-memory ring with bulk copies, never waiting on
// activations, while the SM's consumer warps compute each product as soon as its input is ready?
// Each product's input is the previous product's output (a grid-wide counter per product), so the
// chain of dependencies is a token's; the norms, GDN heads and attention are left out.
//
//   nvcc -O3 -arch=sm_90 --fmad=false -o /tmp/ps bench/proto/persistent_stream.cu
//   /tmp/ps          # the chain: each product reads the previous one's output
//   /tmp/ps nodep    # every product reads the same input (no dependencies)
//   /tmp/ps lm       # the LM head alone
//
// Prints ms per token for the exact decode and for a loads-only variant (one FMA per word), the
// bytes, and a device-to-device copy's bandwidth for reference. The H200's figures and what they
// led to: bench/results/2026-12-01-h200-persistent-prototype.txt (matmul_t1s in matmul.cu is
// this loop, for the LM head). nvcc and the CUDA runtime headers are the device machine's; the
// engine itself compiles its kernels with NVRTC and includes no CUDA header.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>
#include <cuda_runtime.h>

typedef uint32_t u32;
typedef uint64_t u64;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int CONSUMERS = 16;                 // consumer warps per block
constexpr int THREADS = 32 * (CONSUMERS + 1);  // + one producer warp
constexpr int NSLOT = 3;
constexpr u32 SLOT = 55296;                    // 48 rows of 2048 columns or 16 of 6144 (codes + sb)
constexpr int MAXCOLS = 6144;
constexpr int MAXOPS = 128;

struct Op {
    const u32* w;   // codes [rows][cols/8]
    const u32* sb;  // bf16 scale (low) | bias (high) [rows][cols/64]
    float* y;       // [rows]
    u32 rows, cols, rch;  // rch: rows per chunk (48 or 16)
};
__constant__ Op ops[MAXOPS];

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(u64* b, u32 n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(n)); }
__device__ __forceinline__ void mb_expect(u64* b, u32 tx) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(tx) : "memory"); }
__device__ __forceinline__ void mb_arrive(u64* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory"); }
__device__ __forceinline__ void mb_wait(u64* b, u32 parity) {
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(smem_u32(b)), "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, u32 bytes, u64* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(bytes), "r"(smem_u32(b))
                 : "memory");
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
__device__ __forceinline__ float nib(u32 v, int k) { return __uint_as_float(prmt(0x3F000000u, v, 0x3010u | ((u32)(4 + k) << 8))); }
__device__ __forceinline__ float fold32(float v) {
    for (int h = 16; h; h >>= 1) v += __shfl_down_sync(0xffffffffu, v, h);
    return v;
}

// R rows of one chunk (codes at `codes`, row stride cw words; scales at `sbs`, row stride cg
// entries) against x in shared memory: each lane's words lane + 32u in order (numerics §2).
template <int R, bool LOADS_ONLY>
__device__ __forceinline__ void rows_dot(const u32* codes, const u32* sbs, u32 cw, u32 cg, const float* xs, float (&acc)[R]) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    for (u32 j = lane; j < cw; j += 32) {
        float4 x0 = ((const float4*)xs)[2 * j], x1 = ((const float4*)xs)[2 * j + 1];
        float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int r = 0; r < R; r++) {
            u32 wd = codes[r * cw + j];
            u32 sb = sbs[r * cg + (j >> 3)];
            float s = __uint_as_float(sb << 16), b = __uint_as_float(sb & 0xffff0000u);
            if (LOADS_ONLY) {
                acc[r] = fmaf(__uint_as_float((wd & 0x3F7FFFFFu) ^ __float_as_uint(s)), xv[r & 7], acc[r]);
                continue;
            }
            float B = fmaf(-128.0f, s, b), S = s * 256.0f;
            u32 lo = wd & 0x0F0F0F0Fu, hi = (wd >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[r] = fmaf(fmaf(S, nib((e & 1) ? hi : lo, e >> 1), B), xv[e], acc[r]);
        }
    }
}

template <bool LOADS_ONLY>
__global__ void __launch_bounds__(THREADS, 1) stream(u32 nops, const float* x0, u32* done, u32 dep) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    float* xs = (float*)(smem + NSLOT * SLOT);
    u64* full = (u64*)(smem + NSLOT * SLOT + MAXCOLS * 4);
    u64* empty = full + NSLOT;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = gridDim.x;
    if (threadIdx.x == 0) {
        for (int i = 0; i < NSLOT; i++) {
            mb_init(&full[i], 1);
            mb_init(&empty[i], CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == CONSUMERS) {
        // Producer: every chunk of this block, in order, as fast as slots free up.
        if (lane == 0) {
            u32 it = 0;
            for (u32 k = 0; k < nops; k++) {
                const Op op = ops[k];
                const u32 cw = op.cols / 8, cg = op.cols / 64, nch = (op.rows + op.rch - 1) / op.rch;
                for (u32 c = blockIdx.x; c < nch; c += G, it++) {
                    const u32 slot = it % NSLOT, use = it / NSLOT;
                    if (use > 0) mb_wait(&empty[slot], (use - 1) & 1);
                    const u32 r0 = c * op.rch, n = min(op.rch, op.rows - r0);
                    const u32 cb = n * cw * 4, sbb = n * cg * 4;
                    mb_expect(&full[slot], cb + sbb);
                    unsigned char* dst = ring + slot * SLOT;
                    bulk(dst, op.w + (u64)r0 * cw, cb, &full[slot]);
                    bulk(dst + op.rch * cw * 4, op.sb + (u64)r0 * cg, sbb, &full[slot]);
                }
            }
        }
        return;
    }
    // Consumers.
    u32 it = 0;
    for (u32 k = 0; k < nops; k++) {
        const Op op = ops[k];
        const u32 cw = op.cols / 8, cg = op.cols / 64, nch = (op.rows + op.rch - 1) / op.rch;
        // The input: x0 for the first product, else the previous product's output once every
        // block has written its rows.
        if (k > 0 && dep) {
            if (threadIdx.x == 0)
                while (ld_acquire(&done[k - 1]) < G) {
                }
            asm volatile("bar.sync 1, %0;" ::"r"(32 * CONSUMERS) : "memory");
        }
        const float* src = k == 0 || !dep ? x0 : ops[k - 1].y;
        const u32 prow = k == 0 || !dep ? op.cols : ops[k - 1].rows;
        for (u32 i = threadIdx.x; i < op.cols; i += 32 * CONSUMERS) xs[i] = __ldcg(src + (i % prow)) * 0.03125f;
        asm volatile("bar.sync 1, %0;" ::"r"(32 * CONSUMERS) : "memory");
        for (u32 c = blockIdx.x; c < nch; c += G, it++) {
            const u32 slot = it % NSLOT, use = it / NSLOT;
            mb_wait(&full[slot], use & 1);
            const u32 r0 = c * op.rch, n = min(op.rch, op.rows - r0);
            const u32* codes = (const u32*)(ring + slot * SLOT);
            const u32* sbs = (const u32*)(ring + slot * SLOT + op.rch * cw * 4);
            if (op.rch == 48) {
                const u32 rr = warp * 3;
                float acc[3];
                if (rr < n) rows_dot<3, LOADS_ONLY>(codes + rr * cw, sbs + rr * cg, cw, cg, xs, acc);
                __syncwarp();
                if (lane == 0) mb_arrive(&empty[slot]);
                if (rr < n) {
#pragma unroll
                    for (int r = 0; r < 3; r++) {
                        float v = fold32(acc[r]);
                        if (lane == 0 && rr + r < n) op.y[r0 + rr + r] = v;
                    }
                }
            } else {
                const u32 rr = warp;
                float acc[1];
                if (rr < n) rows_dot<1, LOADS_ONLY>(codes + rr * cw, sbs + rr * cg, cw, cg, xs, acc);
                __syncwarp();
                if (lane == 0) mb_arrive(&empty[slot]);
                if (rr < n) {
                    float v = fold32(acc[0]);
                    if (lane == 0) op.y[r0 + rr] = v;
                }
            }
        }
        asm volatile("bar.sync 1, %0;" ::"r"(32 * CONSUMERS) : "memory");
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(&done[k], 1u);
        }
    }
}

__global__ void fill(u32* p, u64 n, u32 seed, u32 mode) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        // mode 1: bf16 scale in [2^-8, 2^-7) and bias -8·scale-ish, both exact for the offset form.
        p[i] = mode == 0 ? h : (0x3B80u | (h & 0x7Fu)) | ((0xBC00u | ((h >> 8) & 0x7Fu)) << 16);
    }
}

int main(int argc, char** argv) {
    // "nodep": every product reads x0 (no chain of dependencies: streaming and decode only);
    // "lm": the LM head alone.
    const bool dep = !(argc > 1 && std::string(argv[1]) == "nodep");
    const bool lm_only = argc > 1 && std::string(argv[1]) == "lm";
    int dev = 0, sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    // Qwen3.5-2B: 24 layers (three GDN, one attention, six times), hidden 2048, MLP 6144.
    struct Shape { u32 rows, cols; };
    std::vector<Shape> shapes;
    for (int l = 0; l < (lm_only ? 0 : 24); l++) {
        bool attn = l % 4 == 3;
        shapes.push_back({attn ? 5120u : 8224u, 2048});  // q|gate,k,v or GDN qkv,z,b,a
        shapes.push_back({2048, 2048});                  // o_proj / out_proj
        shapes.push_back({12288, 2048});                 // gate|up
        shapes.push_back({2048, 6144});                  // down
    }
    shapes.push_back({248320, 2048});  // LM head
    std::vector<Op> hops;
    double bytes = 0;
    for (auto s : shapes) {
        Op o{};
        u64 nw = (u64)s.rows * s.cols / 8, ng = (u64)s.rows * s.cols / 64;
        u32 *w, *sb;
        float* y;
        CK(cudaMalloc(&w, nw * 4));
        CK(cudaMalloc(&sb, ng * 4));
        CK(cudaMalloc(&y, s.rows * 4));
        fill<<<1024, 256>>>(w, nw, (u32)hops.size() * 7 + 1, 0);
        fill<<<1024, 256>>>(sb, ng, (u32)hops.size() * 7 + 3, 1);
        o.w = w;
        o.sb = sb;
        o.y = y;
        o.rows = s.rows;
        o.cols = s.cols;
        o.rch = s.cols == 2048 ? 48 : 16;
        bytes += nw * 4.0 + ng * 4.0;
        hops.push_back(o);
    }
    CK(cudaMemcpyToSymbol(ops, hops.data(), hops.size() * sizeof(Op)));
    float* x0;
    CK(cudaMalloc(&x0, MAXCOLS * 4));
    fill<<<8, 256>>>((u32*)x0, MAXCOLS, 99, 1);
    u32* done;
    CK(cudaMalloc(&done, MAXOPS * 4));
    const int smem = NSLOT * SLOT + MAXCOLS * 4 + 2 * NSLOT * 8;
    CK(cudaFuncSetAttribute(stream<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(stream<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int variant = 0; variant < 2; variant++) {
        float best = 1e9, sum = 0;
        const int N = 30;
        for (int i = 0; i < N + 3; i++) {
            CK(cudaMemsetAsync(done, 0, MAXOPS * 4));
            CK(cudaEventRecord(a));
            if (variant == 0) stream<false><<<sms, THREADS, smem>>>((u32)hops.size(), x0, done, dep);
            else stream<true><<<sms, THREADS, smem>>>((u32)hops.size(), x0, done, dep);
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            CK(cudaGetLastError());
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            if (i >= 3) {
                sum += ms;
                if (ms < best) best = ms;
            }
        }
        float ylast;
        CK(cudaMemcpy(&ylast, hops.back().y, 4, cudaMemcpyDeviceToHost));
        printf("%-5s %-28s %7.3f ms/token mean, %7.3f best, %.3f GB, %6.0f GB/s (mean)   y[last][0]=%g\n", lm_only ? "lm" : dep ? "chain" : "nodep", variant ? "loads only (1 FMA per word)" : "exact decode",
               sum / N, best, bytes / 1e9, bytes / (sum / N * 1e-3) / 1e9, ylast);
    }
    // Reference: a large device-to-device copy, (read + written) / time.
    void *p, *q;
    const size_t n = (size_t)1 << 30;
    CK(cudaMalloc(&p, n));
    CK(cudaMalloc(&q, n));
    CK(cudaMemcpy(q, p, n, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(a));
    for (int i = 0; i < 10; i++) CK(cudaMemcpyAsync(q, p, n, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    printf("copy: %.0f GB/s (read + written); %d SMs; floor for these bytes at copy bandwidth: %.3f ms\n", 2.0 * n * 10 / (ms * 1e-3) / 1e9, sms,
           bytes / (2.0 * n * 10 / (ms * 1e-3)) * 1e3);
    return 0;
}
