// What the split attention kernels share (attention.cu, attention_tiles.cu): the merge of a row's
// key splits by the last of its blocks to finish, and the int8 copy of a block's outputs.
#pragma once
#include "quant_int8.cuh"

// The int8 copy (quant16 per 16 columns, as layers.cu's quantize_q8) of the n floats at o (this
// block's outputs, written before the call by any of its threads).
DEV void q8_copy(const float* o, int n, u8* oq, float4* os) {
    __syncthreads();  // the block's output stores are visible to all its threads
    for (int j = threadIdx.x; j < n / 16; j += blockDim.x) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 f = reinterpret_cast<const float4*>(o + 16 * j)[i];
            v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
        }
        u32 q[4]; float d, s;
        quant16(v, q, d, s);
        *reinterpret_cast<uint4*>(oq + 16 * j) = make_uint4(q[0], q[1], q[2], q[3]);
        os[j] = make_float4(d, s, sumsq16(v), 0.f);
    }
}

// Called by every thread of split block of row t, KV head hk, after it wrote its partials: per
// head g of the group, (max, sum) at part_ml[2 slot] and the weighted V sum at part_o[slot D],
// slot = (t n_head + hk G + g) n_split + split. The block that counts last (counter[t n_head_kv +
// hk]; it leaves it zero again) merges the ns <= 32 splits into out (and out16) and returns true;
// the others return false.
template <int G, int D>
DEV bool merge_splits(int t, int hk, int n_head_kv, int n_split, int ns, const float* part_o, const float* part_ml,
                      unsigned* counter, float* out, int ldo, u16* out16, int ld16) {
    const int n_head = n_head_kv * G, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = blockDim.x >> 5;
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counter[t * n_head_kv + hk], 1u) == (unsigned)(ns - 1);
    __syncthreads();
    if (!last) return false;
    __threadfence();
    // per head the softmax weights of the splits, then the weighted sums. Every (max, sum) pair
    // is staged in shared memory by one parallel load: a serial walk over global memory here cost
    // one L2 round trip per split (most of the kernel's time on SmolLM2).
    __shared__ float wt[G][32], wl[G][32];
    for (int idx = threadIdx.x; idx < G * ns; idx += blockDim.x) {
        const int g = idx / ns, k = idx % ns;
        const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml) + (((long)t * n_head + hk * G + g) * n_split + k));
        wt[g][k] = ml.x;
        wl[g][k] = ml.y;
    }
    __syncthreads();
    for (int g = warp; g < G; g += W) {  // warp w merges heads w, w + W: lane k holds split k
        const float mk = lane < ns ? wt[g][lane] : -INFINITY;
        float M = mk;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        const float f = (lane < ns && M > -INFINITY) ? __expf(mk - M) : 0.f;
        float L = (lane < ns ? wl[g][lane] : 0.f) * f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        const float inv = L > 0.f ? 1.f / L : 0.f;
        if (lane < ns) wt[g][lane] = f * inv;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D / 4; idx += blockDim.x) {  // 4 dims per thread: float4 loads
        const int g = idx / (D / 4), e = 4 * (idx % (D / 4));
        const float* po = part_o + ((long)t * n_head + hk * G + g) * n_split * D + e;
        float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int k = 0; k < ns; ++k) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(po + (long)k * D));
            const float w = wt[g][k];
            O.x = fmaf(v.x, w, O.x); O.y = fmaf(v.y, w, O.y); O.z = fmaf(v.z, w, O.z); O.w = fmaf(v.w, w, O.w);
        }
        const long o = (long)t * ldo + (hk * G + g) * D + e;
        *reinterpret_cast<float4*>(out + o) = O;
        if (out16) {
            u16* h = out16 + (long)t * ld16 + (hk * G + g) * D + e;
            h[0] = f2h(O.x); h[1] = f2h(O.y); h[2] = f2h(O.z); h[3] = f2h(O.w);
        }
    }
    if (threadIdx.x == 0) counter[t * n_head_kv + hk] = 0u;
    return true;
}
