// Definitions every tensorfold kernel shares. NVRTC compiles each kernel file with this text in
// front of it and no CUDA headers. Each function names the CPU function (src/) it reproduces bit
// for bit; the kernels are compiled with --fmad=false, so a*b+c is two roundings unless written
// as fmaf.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define TILE 256  // cpu::kernels::ATTENTION_TILE
// Floats of one attention tile's partial entry: m, l, o[dh], then the tile's scores (attn_scores).
#define PART_STRIDE(dh) ((dh) + 2 + TILE)

// One sequence's rows in a step (backend::SeqRows).
struct SeqDesc {
    u32 slot, first_row, len, pos;
};

// Where a slot's state lives: conv windows [L_gdn][Kc-1][conv_dim], recurrent states
// [L_gdn][Hv][dv][dk], and the KV page table [L_attn][2][max_pages] of page pointers.
struct SlotDesc {
    u64 conv, rec, pages;
};

// Per row of a step: its slot and position.
struct RowDesc {
    u32 slot, pos;
};

// Twin of numerics::fold_lanes: lane 0 receives p[0] after p[i] += p[i+h], h = 16..1.
__device__ __forceinline__ float fold32(float v) {
    v += __shfl_down_sync(FULL_MASK, v, 16);
    v += __shfl_down_sync(FULL_MASK, v, 8);
    v += __shfl_down_sync(FULL_MASK, v, 4);
    v += __shfl_down_sync(FULL_MASK, v, 2);
    v += __shfl_down_sync(FULL_MASK, v, 1);
    return v;
}

// Twin of numerics::dot_f32 for one warp: lane l accumulates elements l, l+32, ... in order.
// The result is in every lane. Loads are issued eight at a time ahead of the (ordered) FMAs.
__device__ __forceinline__ float warp_dot(const float* a, const float* b, u32 n) {
    u32 lane = threadIdx.x & 31;
    float acc = 0.0f;
    u32 i = lane;
    for (; i + 7 * 32 < n; i += 8 * 32) {
        float x[8], y[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            x[u] = a[i + 32 * u];
            y[u] = b[i + 32 * u];
        }
#pragma unroll
        for (int u = 0; u < 8; u++) acc = fmaf(x[u], y[u], acc);
    }
    for (; i < n; i += 32) acc = fmaf(a[i], b[i], acc);
    return __shfl_sync(FULL_MASK, fold32(acc), 0);
}

__device__ __forceinline__ float bf16_to_f32(u32 bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Scale/bias dtype codes (model::weights::FloatType): 0 f32, 1 f16, 2 bf16.
__device__ __forceinline__ float load_float(const u8* p, u32 i, u32 dtype) {
    if (dtype == 2) return bf16_to_f32(((const u16*)p)[i]);
    if (dtype == 1) return f16_to_f32(((const u16*)p)[i]);
    return ((const float*)p)[i];
}

__device__ __forceinline__ float pow2i(int k) { return __int_as_float((k + 127) << 23); }

// Twin of numerics::exp.
__device__ __forceinline__ float tf_exp(float x) {
    if (x != x) return x;
    if (x > 88.722835f) return __int_as_float(0x7f800000);
    if (x < -103.97208f) return 0.0f;
    float kf = rintf(x * 1.44269504088896340736f);
    float r = fmaf(-kf, 1.428606765330187e-6f, fmaf(-kf, 0.693145751953125f, x));
    float p = 1.984127e-4f;
    p = fmaf(p, r, 1.3888889e-3f);
    p = fmaf(p, r, 8.333333e-3f);
    p = fmaf(p, r, 4.1666668e-2f);
    p = fmaf(p, r, 0.16666667f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int k = (int)kf;
    int k1 = k / 2;
    int k2 = k - k1;
    return p * pow2i(k1) * pow2i(k2);
}

// Twin of numerics::log.
__device__ __forceinline__ float tf_log(float x) {
    if (x != x || x < 0.0f) return __int_as_float(0x7fc00000);
    if (x == 0.0f) return __int_as_float(0xff800000);
    if (x == __int_as_float(0x7f800000)) return x;
    int e = 0;
    if (x < 1.17549435e-38f) {
        x *= 8388608.0f;
        e -= 23;
    }
    u32 bits = __float_as_uint(x);
    e += (int)((bits >> 23) & 0xff) - 127;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    if (m > 1.41421356237309504880f) {
        m *= 0.5f;
        e += 1;
    }
    float f = m - 1.0f;
    float s = f / (2.0f + f);
    float z = s * s;
    float w = z * z;
    float t1 = w * fmaf(w, 0.24279079f, 0.40000972f);
    float t2 = z * fmaf(w, 0.28498787f, 0.6666666f);
    float r = t2 + t1;
    float hfsq = 0.5f * f * f;
    float ef = (float)e;
    float lo = fmaf(ef, 1.428606765330187e-6f, s * (hfsq + r));
    return fmaf(ef, 0.693145751953125f, f - (hfsq - lo));
}

// Twins of numerics::log1p, softplus, sigmoid, silu.
__device__ __forceinline__ float tf_log1p(float y) {
    float u = 1.0f + y;
    if (u == 1.0f) return y;
    return tf_log(u) * (y / (u - 1.0f));
}
__device__ __forceinline__ float tf_softplus(float x) { return x > 20.0f ? x : tf_log1p(tf_exp(x)); }
__device__ __forceinline__ float tf_sigmoid(float x) { return 1.0f / (1.0f + tf_exp(-x)); }
__device__ __forceinline__ float tf_silu(float x) { return x / (1.0f + tf_exp(-x)); }
__device__ __forceinline__ float tf_rsqrt(float v) { return 1.0f / sqrtf(v); }

// Attribution probes, for `bench/device.sh probe` only (the logits are wrong with any of them):
// a kernel family compiled with -DTF_PROBE_SKIP_<FAMILY> (TENSORFOLD_CUDA_DEFINES) returns right
// after pdl_enter(), so the decode time that disappears is that family's share of the chain.
#define PROBE_SKIP(family) \
    if (TF_PROBE_SKIP_##family) return
#ifndef TF_PROBE_SKIP_GDN
#define TF_PROBE_SKIP_GDN 0
#endif
#ifndef TF_PROBE_SKIP_NORM
#define TF_PROBE_SKIP_NORM 0
#endif
#ifndef TF_PROBE_SKIP_ATTN
#define TF_PROBE_SKIP_ATTN 0
#endif
#ifndef TF_PROBE_SKIP_T1
#define TF_PROBE_SKIP_T1 0
#endif
#ifndef TF_PROBE_SKIP_LMHEAD  // one-token products of more than 65 536 rows
#define TF_PROBE_SKIP_LMHEAD 0
#endif

// Programmatic dependent launch (sm_90 and later; elsewhere these compile to nothing and the
// host launches without it). A kernel launched with it may start while the previous kernel of
// the stream is still running: pdl_enter() waits until that kernel has completed and its writes
// are visible, then lets the next kernel start. Every step kernel calls it before it writes
// anything and before it reads what the previous kernel may write. Before it a kernel reads
// only weights, the tables the host writes before the step (rows, sequences, slots, KV page
// pointers), and state that only this layer's GDN kernels write (its recurrent state and conv
// windows, by gdn_heads, gdn_conv or gdn_scan, never by the kernel just before; last written in
// an earlier step: when this kernel starts, every block of the previous one has passed its own
// pdl_enter() or exited, so every kernel before that one has completed, and a completed grid's
// writes are visible to later grids). That needs at least one block of every kernel to reach
// pdl_enter() (a block that exits first counts as triggered without waiting): every step
// kernel's block 0 does.
#ifdef TF_PROBE_TIMELINE
// Timeline probe (backend/cuda/timeline.rs; timing only): the host points this at a buffer,
// [0] a counter, then one %globaltimer reading per kernel taken by block 0 after its wait.
__device__ unsigned long long* tf_timeline = nullptr;
#endif
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef TF_PROBE_TIMELINE
    if (tf_timeline && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        unsigned int i = atomicAdd((unsigned int*)tf_timeline, 1u);
        if (i < 4096u) tf_timeline[1 + i] = t;
    }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Byte permute (PRMT): byte i of the result is byte (sel >> 4i) & 7 of a (bytes 0..3) and b (4..7).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// Scale and bias of group g of a row, of dtype SDT (0 f32, 1 f16, 2 bf16: a template parameter,
// so the inner loops carry no dtype branch). The upload interleaves them (CudaMatrix::sb), so one
// load brings both: a 32-bit word (scale in the low half) for 16-bit dtypes, a float2 for f32.
template <int SDT> struct Sb { typedef u32 T; };
template <> struct Sb<0> { typedef float2 T; };
template <int SDT>
__device__ __forceinline__ typename Sb<SDT>::T load_sb_raw(const u8* row, u32 g) { return ((const typename Sb<SDT>::T*)row)[g]; }
template <int SDT>
__device__ __forceinline__ void unpack_sb(typename Sb<SDT>::T v, float& s, float& b) {
    if constexpr (SDT == 0) {
        s = v.x;
        b = v.y;
    } else if constexpr (SDT == 1) {
        s = f16_to_f32((u16)(v & 0xffffu));
        b = f16_to_f32((u16)(v >> 16));
    } else {
        s = __uint_as_float(v << 16);
        b = __uint_as_float(v & 0xffff0000u);
    }
}
template <int SDT>
__device__ __forceinline__ void load_sb(const u8* row, u32 g, float& s, float& b) { unpack_sb<SDT>(load_sb_raw<SDT>(row, g), s, b); }
// Bytes of one group's interleaved scale and bias.
__device__ __forceinline__ u32 sb_size(u32 sdt) { return sdt == 0 ? 8 : 4; }
