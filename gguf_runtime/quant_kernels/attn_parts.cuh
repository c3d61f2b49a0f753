// Pieces the attention kernels share (attention.cu, flash_attn.cu, flash_decode.cu): the tensor
// cores' operand loads (cp.async, ldmatrix) and f16 mma, the int8 copy of a block's outputs (the O
// projection's input), and the merge of a row's key splits by the split that finishes last.
#pragma once
#include "quant_int8.cuh"

DEV u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
DEV u32 dynamic_smem() { u32 r; asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r)); return r; }
DEV void fa_cp16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
DEV void fa_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> DEV void fa_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

DEV void fa_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
DEV void ldsm4(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
DEV void ldsm4t(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

// The int8 copy (quant16 per 16 columns, as layers.cu's quantize_q8; with the rests' at oq + res
// where res > 0) of the n floats at o (this block's outputs, written before the call by any of its
// threads).
DEV void q8_copy(const float* o, int n, u8* oq, float4* os, int res) {
    __syncthreads();  // the block's output stores are visible to all its threads
    for (int j = threadIdx.x; j < n / 16; j += blockDim.x) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 f = reinterpret_cast<const float4*>(o + 16 * j)[i];
            v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
        }
        u32 q[4], q2[4] = {0, 0, 0, 0}; float d, s, d2 = 0.f;
        quant16(v, q, d, s);
        if (res) quant16_rest(v, q, d, q2, d2, s);
        *reinterpret_cast<uint4*>(oq + 16 * j) = make_uint4(q[0], q[1], q[2], q[3]);
        if (res) *reinterpret_cast<uint4*>(oq + res + 16 * j) = make_uint4(q2[0], q2[1], q2[2], q2[3]);
        os[j] = make_float4(d, s, sumsq16(v), d2);
    }
}

// After a block of split s wrote its heads' partial results of row t (part_o: the weighted V sums,
// part_ml: (max, sum) per head, natural-log domain; ns == 1: the outputs themselves, in out and
// out16), the row's last split block (counter) merges them all into out (and out16, and the int8
// copy where oq). Every block of the row calls it; ns <= 32. sinks (gpt-oss; or null): each head's
// sink logit joins the softmax's denominator, e^(sink - M) (natural-log domain).
template <int D, int G>
DEV void merge_splits(int t, int hk, int ns, int n_split, int n_head_kv, const float* part_o, const float* part_ml,
                      unsigned* counter, float* out, int ldo, u16* out16, int ld16, u8* oq, int ldoq, float4* os,
                      int ldos, int ores, const float* sinks) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5, n_head = n_head_kv * G;
    const long h0 = (long)(hk * G) * D;  // the block's heads: G * D consecutive outputs of row t
    if (ns == 1) {
        if (oq) q8_copy(out + (long)t * ldo + h0, G * D, oq + (long)t * ldoq + h0, os + (long)t * ldos + h0 / 16, ores);
        return;
    }
    // the last split block of this (t, hk) merges every split
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counter[t * n_head_kv + hk], 1u) == (unsigned)(ns - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    // merge: per head the softmax weights of the splits (ns <= 32), then the weighted sums.
    // Every (max, sum) pair is staged in shared memory by one parallel load: a serial walk over
    // global memory here cost one L2 round trip per split (most of the kernel's time on SmolLM2).
    __shared__ float wt[G][32], wl[G][32];
    for (int idx = threadIdx.x; idx < G * ns; idx += blockDim.x) {
        const int g = idx / ns, k = idx % ns;
        const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml) + (((long)t * n_head + hk * G + g) * n_split + k));
        wt[g][k] = ml.x;
        wl[g][k] = ml.y;
    }
    __syncthreads();
    for (int g = warp; g < G; g += nw) {  // warp w merges heads w, w + nw: lane k holds split k
        const float mk = lane < ns ? wt[g][lane] : -INFINITY;
        float M = mk;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        const float f = (lane < ns && M > -INFINITY) ? __expf(mk - M) : 0.f;
        float L = (lane < ns ? wl[g][lane] : 0.f) * f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        if (sinks && M > -INFINITY) L += __expf(sinks[hk * G + g] - M);
        const float inv = L > 0.f ? 1.f / L : 0.f;
        if (lane < ns) wt[g][lane] = f * inv;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D / 4; idx += blockDim.x) {  // 4 dims per thread: float4 loads
        const int g = idx / (D / 4), e = 4 * (idx % (D / 4));
        const float* po = part_o + ((long)t * n_head + hk * G + g) * n_split * D + e;
        float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k0 = 0; k0 < ns; k0 += 16) {  // 16 loads in flight: one L2 round trip per 16 splits
            float4 v[16];
#pragma unroll
            for (int j = 0; j < 16; ++j)
                v[j] = k0 + j < ns ? __ldcg(reinterpret_cast<const float4*>(po + (long)(k0 + j) * D))
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float w = k0 + j < ns ? wt[g][k0 + j] : 0.f;
                O.x = fmaf(v[j].x, w, O.x); O.y = fmaf(v[j].y, w, O.y); O.z = fmaf(v[j].z, w, O.z);
                O.w = fmaf(v[j].w, w, O.w);
            }
        }
        const long o = (long)t * ldo + (hk * G + g) * D + e;
        *reinterpret_cast<float4*>(out + o) = O;
        if (out16) {
            u16* h = out16 + (long)t * ld16 + (hk * G + g) * D + e;
            h[0] = f2h(O.x); h[1] = f2h(O.y); h[2] = f2h(O.z); h[3] = f2h(O.w);
        }
    }
    if (threadIdx.x == 0) counter[t * n_head_kv + hk] = 0u;
    if (oq) q8_copy(out + (long)t * ldo + h0, G * D, oq + (long)t * ldoq + h0, os + (long)t * ldos + h0 / 16, ores);
}
