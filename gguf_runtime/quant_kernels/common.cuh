// Shared device helpers. Compiles under NVRTC (CuPy RawModule) and nvcc, with no CUDA headers.
#pragma once
#ifndef __CUDACC_RTC__
#include <cstring>
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef INFINITY  // NVRTC has no <cmath>
#define INFINITY __int_as_float(0x7f800000)
#endif

#define HD __host__ __device__ __forceinline__
#define DEV __device__ __forceinline__

// ---- 16-byte vector of raw bytes, and loads -------------------------------------------------
struct V16 { u32 w[4]; };

HD u32 byte_of(const V16& v, int i) { return (v.w[i >> 2] >> (8 * (i & 3))) & 0xFFu; }

HD V16 ld16(const u8* p) {
#ifdef __CUDA_ARCH__
    const uint4 t = __ldg(reinterpret_cast<const uint4*>(p));
    V16 v; v.w[0] = t.x; v.w[1] = t.y; v.w[2] = t.z; v.w[3] = t.w;
    return v;
#else
    V16 v; const u32* q = reinterpret_cast<const u32*>(p);
    v.w[0] = q[0]; v.w[1] = q[1]; v.w[2] = q[2]; v.w[3] = q[3];
    return v;
#endif
}

HD u32 ld32(const u8* p) {
#ifdef __CUDA_ARCH__
    return __ldg(reinterpret_cast<const unsigned int*>(p));
#else
    return *reinterpret_cast<const u32*>(p);
#endif
}

HD u16 ld16bits(const u8* p) {
#ifdef __CUDA_ARCH__
    return __ldg(reinterpret_cast<const unsigned short*>(p));
#else
    return *reinterpret_cast<const u16*>(p);
#endif
}

// ---- float conversions -----------------------------------------------------------------------
HD float u2f(u32 bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

HD float h2f(u16 h) {
#ifdef __CUDA_ARCH__
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#else
    const u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  // subnormal: normalize
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; --exp; }
            man &= 0x3FFu;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7F800000u | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

HD float bf2f(u16 h) { return u2f((u32)h << 16); }

DEV u16 f2h(float f) {
    u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}

DEV u32 pack_h2(float a, float b) {  // a in the low half; one conversion instruction for the pair
    u32 h; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(b), "f"(a)); return h;
}

// The KV cache's page of a key and its slot there: a page holds a power of two of keys (the
// attention launchers check), so shifts, not runtime divisions, which cost ~20 instructions each
// and ran for every 16 bytes the attention kernels stage (bench/RESULTS.md row 104).
DEV int kv_page(int key, int page_size) { return key >> (31 - __clz(page_size)); }
DEV int kv_slot(int key, int page_size) { return key & (page_size - 1); }

// f16x2 arithmetic on packed pairs (low half first), and bytes into f16 pairs by PRMT: quant byte
// b -> f16 0x64bb = 1024 + b, exact, so (h - 1024 - offset) * d rounds once (mma_regs.cuh,
// kv_cache.cuh).
DEV u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel)); return d;
}
DEV u32 hsub2(u32 a, u32 b) { u32 d; asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
DEV u32 hmul2(u32 a, u32 b) { u32 d; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
DEV u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
constexpr u32 H_MAGIC = 0x64646464u;  // PRMT filler: f16 0x64bb = 1024 + b
constexpr u32 H1024 = 0x64006400u;    // (1024, 1024)
// Bytes (0, 1) / (2, 3) of w as the f16 pair (1024 + b0, 1024 + b1) / (1024 + b2, 1024 + b3)
constexpr u32 SEL01 = 0x4140u, SEL23 = 0x4342u;

// 16 floats to 16 f16 at a 16-byte aligned address (two 16-byte stores).
DEV void store16_f16(u16* dst, const float* w) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = make_uint4(pack_h2(w[0], w[1]), pack_h2(w[2], w[3]), pack_h2(w[4], w[5]), pack_h2(w[6], w[7]));
    d[1] = make_uint4(pack_h2(w[8], w[9]), pack_h2(w[10], w[11]), pack_h2(w[12], w[13]), pack_h2(w[14], w[15]));
}

// ---- programmatic dependent launch (sm_90+; no-ops on older GPUs and for plain launches) ----------
// Inside captured graphs the launchers start kernels with the programmatic-serialization attribute
// (pdl.py), so a kernel may begin while the one before it finishes. Every kernel calls pdl_enter()
// before it reads anything a kernel may have written and before its first write; before it, it
// reads only weights (never written). pdl_enter waits for the previous kernel to complete (its
// writes visible), then lets the next kernel launch: at most two kernels overlap, and the next
// one's weight loads run under this one's work. (Letting the next kernel launch before the wait
// was slower, by a wide margin on SmolLM2's decode; measured: see bench/RESULTS.md.)
DEV void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- warp and block reductions ---------------------------------------------------------------
DEV float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The warp's largest (v, i), ties to the lower i; every lane gets it.
DEV void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        const int j = __shfl_xor_sync(0xffffffffu, i, o);
        if (w > v || (w == v && j < i)) { v = w; i = j; }
    }
}

// Sum over the block; every thread gets the result. `scratch` holds >= 32 floats.
DEV float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.f;
    return warp_sum(v);
}

DEV float silu_f(float x) { return x / (1.f + __expf(-x)); }

// gpt-oss's clamped SwiGLU (ACT 2): gate clamped above at 7, up to [-7, 7], gate sigmoid(1.702 gate)
// (up + 1): the constants of llama.cpp and transformers (the files carry none; model_config checks)
DEV float swiglu_oai_f(float g, float u) {
    g = fminf(g, 7.f);
    return g / (1.f + expf(-1.702f * g)) * (fminf(fmaxf(u, -7.f), 7.f) + 1.f);
}

DEV float gelu_tanh_f(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
