// Normalization, RoPE + KV-cache write, and elementwise kernels (f32 activations).
//
// Positions come from device memory (pos[t]), and KV pages from a block table, so one launch
// configuration serves every position: these kernels can sit inside a replayed CUDA graph.
// KV cache layout, per layer: [pages][n_head_kv][page_size][head_dim].
#include "allreduce.cuh"
#include "kv_cache.cuh"

// y[t] = (res ? res[t] : 0) + x[t] * rsqrt(mean(x[t]^2) + eps) * w   (one block per row t; y may be
// res). y16 != null: also an f16 copy (the input of the tensor-core matmuls); xq != null: also the
// int8 copy (quant16 per 16 columns, see quant_int8.cuh; n % 16 == 0) of y, or of y * w2 when w2 is
// non-null, each piece with the squares of y: w2 is the next RMSNorm's weight, and a matvec given
// the copy with its norm flag applies that norm (a post-norm, the residual add and the next
// pre-norm in one launch: Gemma-3). Without w2 the copy is the next matvec's input as it stands.
//
// Latency (a decode step waits on every launch): thread i holds the float4s i + j blockDim (j <
// RMS_SLOTS; n % 4 == 0, n <= 4 RMS_SLOTS blockDim; rows 16-byte aligned) in registers; w and w2 are loaded before
// pdl_enter; a 16-column piece is four consecutive threads' float4s, quantized by shuffles (the
// same values as quant16), so nothing is read back from global memory.
constexpr int RMS_SLOTS = 2;

// A split model's row sum (REDUCE): x holds this rank's part of row t (its O or down product);
// the block pushes it to every rank and sums the ranks' parts in rank order (allreduce.cu's
// protocol with one buffer index a row: ep[t]; recv[r]: rank r's [3][world][rows_cap][n] buffer),
// writes the sum to xsum (the residual stream) and normalizes it: the all-reduce without a launch.
template <bool REDUCE>
DEV void rmsnorm_row(const float* x, int ldx, const float* __restrict__ w, float* y, int ldy, const float* res,
                     int ldr, int n, float eps, u16* y16, int ld16, u8* xq, int ldq, float4* xs, int lds, int xres,
                     const float* __restrict__ w2, float* xsum, int ldsum, const unsigned long long* recv,
                     unsigned* ep, int rank, int world, int rows_cap) {
    __shared__ float scratch[32];
    const int n4 = n / 4;
    float4 wv[RMS_SLOTS], w2v[RMS_SLOTS], v[RMS_SLOTS];
#pragma unroll
    for (int j = 0; j < RMS_SLOTS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        wv[j] = i < n4 ? __ldg(reinterpret_cast<const float4*>(w) + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        w2v[j] = i < n4 && w2 ? __ldg(reinterpret_cast<const float4*>(w2) + i) : make_float4(1.f, 1.f, 1.f, 1.f);
    }
    pdl_enter();
    const float4* xr = reinterpret_cast<const float4*>(x + (long)blockIdx.x * ldx);
    if (REDUCE) {
        __shared__ unsigned s_e;
        if (threadIdx.x == 0) s_e = (ep[blockIdx.x] + 1) % 3;
        __syncthreads();
        const long e = s_e, slot = (long)rows_cap * n, row = (long)blockIdx.x * n;
        float* own = reinterpret_cast<float*>(recv[rank]);
        const float4 empty = make_float4(-0.0f, -0.0f, -0.0f, -0.0f);
#pragma unroll
        for (int j = 0; j < RMS_SLOTS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i >= n4) continue;
            const float4 p = sendable4(xr[i]);
            for (int r = 0; r < world; ++r)
                reinterpret_cast<float4*>(reinterpret_cast<float*>(recv[r]) + (e * world + rank) * slot + row)[i] = p;
        }
        const long old = ((e + 2) % 3) * world * slot + row;
#pragma unroll
        for (int j = 0; j < RMS_SLOTS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < n4)
                for (int r = 0; r < world; ++r) reinterpret_cast<float4*>(own + old + r * slot)[i] = empty;
        }
        const unsigned long long t0 = now_ns();
        const float* cur = own + e * world * slot + row;
        float4* out = reinterpret_cast<float4*>(xsum + (long)blockIdx.x * ldsum);
#pragma unroll
        for (int j = 0; j < RMS_SLOTS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i >= n4) continue;
            v[j] = ar_wait4(reinterpret_cast<const float4*>(cur) + i, t0);
            for (int r = 1; r < world; ++r) add4(v[j], ar_wait4(reinterpret_cast<const float4*>(cur + r * slot) + i, t0));
            out[i] = v[j];
        }
        if (threadIdx.x == 0) ep[blockIdx.x] = (unsigned)e;
    } else {
#pragma unroll
        for (int j = 0; j < RMS_SLOTS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            v[j] = i < n4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_SLOTS; ++j) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    ss = block_sum(ss, scratch);
    const float k = rsqrtf(ss / (float)n + eps);
    float* yr = y + (long)blockIdx.x * ldy;
    const float* rr = res ? res + (long)blockIdx.x * ldr : nullptr;
    u16* yh = y16 ? y16 + (long)blockIdx.x * ld16 : nullptr;
#pragma unroll
    for (int j = 0; j < RMS_SLOTS; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= n4) continue;
        float o[4] = {v[j].x * k * wv[j].x, v[j].y * k * wv[j].y, v[j].z * k * wv[j].z, v[j].w * k * wv[j].w};
        if (rr) {
            const float4 r = reinterpret_cast<const float4*>(rr)[i];
            o[0] = r.x + o[0]; o[1] = r.y + o[1]; o[2] = r.z + o[2]; o[3] = r.w + o[3];
        }
        v[j] = make_float4(o[0], o[1], o[2], o[3]);
        reinterpret_cast<float4*>(yr)[i] = v[j];
        if (yh)
#pragma unroll
            for (int c = 0; c < 4; ++c) yh[4 * i + c] = f2h(o[c]);
    }
    if (!xq) return;
#pragma unroll
    for (int j = 0; j < RMS_SLOTS; ++j) {  // whole warps: n % 16 == 0, so a piece's 4 threads agree on i < n4
        const int i = threadIdx.x + j * blockDim.x;
        if (j * blockDim.x >= n4) break;  // block-uniform
        const float o[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
        float q[4], amax = 0.f, sq = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            q[c] = w2 ? o[c] * (&w2v[j].x)[c] : o[c];
            amax = fmaxf(amax, fabsf(q[c]));
            sq = fmaf(o[c], o[c], sq);
        }
#pragma unroll
        for (int m = 1; m < 4; m <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
            sq += __shfl_xor_sync(0xffffffffu, sq, m);
        }
        float inv, d;
        q8_step(amax, inv, d);
        u32 word = 0, bits[4];
        int sum = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            bits[c] = q8_bits(q[c], inv);
            sum += q8_int(bits[c]);
            word |= (bits[c] & 0xFFu) << (8 * c);
        }
#pragma unroll
        for (int m = 1; m < 4; m <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
        float s = d * (float)sum, d2 = 0.f;
        u32 word2 = 0;
        if (xres) {  // the rest (quant16_rest), the same way
            float r[4], amax2 = 0.f, inv2;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                r[c] = q8_rest(q[c], d, bits[c]);
                amax2 = fmaxf(amax2, fabsf(r[c]));
            }
#pragma unroll
            for (int m = 1; m < 4; m <<= 1) amax2 = fmaxf(amax2, __shfl_xor_sync(0xffffffffu, amax2, m));
            q8_step(amax2, inv2, d2);
            int sum2 = 0;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const u32 b2 = q8_bits(r[c], inv2);
                sum2 += q8_int(b2);
                word2 |= (b2 & 0xFFu) << (8 * c);
            }
#pragma unroll
            for (int m = 1; m < 4; m <<= 1) sum2 += __shfl_xor_sync(0xffffffffu, sum2, m);
            s = add_rn(s, mul_rn(d2, (float)sum2));
        }
        if (i >= n4) continue;
        *reinterpret_cast<u32*>(xq + (long)blockIdx.x * ldq + 4 * i) = word;
        if (xres) *reinterpret_cast<u32*>(xq + (long)blockIdx.x * ldq + xres + 4 * i) = word2;
        if ((i & 3) == 0) xs[(long)blockIdx.x * lds + i / 4] = make_float4(d, s, sq, d2);
    }
}


extern "C" __global__ void __launch_bounds__(1024) rmsnorm(
        const float* __restrict__ x, int ldx, const float* __restrict__ w, float* y, int ldy, const float* res,
        int ldr, int n, float eps, u16* y16, int ld16, u8* xq, int ldq, float4* xs, int lds, int xres,
        const float* __restrict__ w2) {
    rmsnorm_row<false>(x, ldx, w, y, ldy, res, ldr, n, eps, y16, ld16, xq, ldq, xs, lds, xres, w2, nullptr, 0,
                       nullptr, nullptr, 0, 1, 0);
}

// rmsnorm of the sum over the ranks of x (rmsnorm_row's REDUCE); xsum may be x.
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_allreduce(
        const float* x, int ldx, const float* __restrict__ w, float* y, int ldy, const float* res, int ldr, int n,
        float eps, u16* y16, int ld16, u8* xq, int ldq, float4* xs, int lds, int xres, const float* __restrict__ w2,
        float* xsum, int ldsum, const unsigned long long* __restrict__ recv, unsigned* ep, int rank, int world,
        int rows_cap) {
    rmsnorm_row<true>(x, ldx, w, y, ldy, res, ldr, n, eps, y16, ld16, xq, ldq, xs, lds, xres, w2, xsum, ldsum, recv,
                      ep, rank, world, rows_cap);
}

// The int8 copy of x[t, :n] (n % 16 == 0), as rmsnorm writes it: one thread per 16 columns.
// Both write each piece's (d, s, sum of squares, d2) (matvec_block.cuh's XQ), and the rests' int8
// at xq + xres where xres > 0 (q8_res).
extern "C" __global__ void quantize_q8(const float* __restrict__ x, int ldx, int n, int rows, u8* xq, int ldq,
                                       float4* xs, int lds, int xres) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    pdl_enter();
    if (j >= n / 16 || t >= rows) return;
    const float4* src = reinterpret_cast<const float4*>(x + (long)t * ldx + 16 * j);
    float v[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 f = src[i];
        v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
    u32 q[4], q2[4] = {0, 0, 0, 0}; float d, s, d2 = 0.f;
    quant16(v, q, d, s);
    if (xres) quant16_rest(v, q, d, q2, d2, s);
    *reinterpret_cast<uint4*>(xq + (long)t * ldq + 16 * j) = make_uint4(q[0], q[1], q[2], q[3]);
    if (xres) *reinterpret_cast<uint4*>(xq + (long)t * ldq + xres + 16 * j) = make_uint4(q2[0], q2[1], q2[2], q2[3]);
    xs[(long)t * lds + j] = make_float4(d, s, sumsq16(v), d2);
}

// One block per (token t, head h) over the fused QKV rows [q heads | k heads | v heads], blockDim
// = head_dim. Q and K heads: optional per-head RMSNorm (qnw/knw non-null), then RoPE (the first
// n_rot dims; neox: pairs (i, i + n_rot/2), else (2i, 2i+1)); Q is written back in place, K into
// the cache slot of pos[t]; V heads are copied into the cache, both as its type kv (kv_cache.cuh's
// kv_store: 0 float, 1 f16, 2 q8_0, 3 q4_0; the quantized ones need head_dim = head_dim_v = the
// block's threads, a multiple of 32). Rows with seq[t] < 0 (padding in a batch bucket) are
// skipped: they write nothing.
extern "C" __global__ void rope_kv(float* qkv, int ldqkv, int n_head, int n_head_kv, int head_dim,
                                   int head_dim_v, int n_rot, int neox, const float* __restrict__ qnw,
                                   const float* __restrict__ knw, float eps,
                                   const double* __restrict__ inv_freq, const int* __restrict__ pos,
                                   const int* __restrict__ seq, const int* __restrict__ table, int max_pages,
                                   int page_size, void* kcache, void* vcache, int kv) {
    __shared__ float xs[512];
    __shared__ float scratch[32];
    const int t = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    pdl_enter();
    if (seq[t] < 0) return;
    const int p = pos[t];
    const int page = p / page_size < max_pages ? table[(long)seq[t] * max_pages + p / page_size] : -1;
    const int slot = p % page_size;
    if (page < 0) return;  // past the pages this sequence owns: write nothing
    float* row = qkv + (long)t * ldqkv;
    if (h >= n_head + n_head_kv) {  // V head: copy into the cache
        const int hv = h - n_head - n_head_kv;
        if (i < head_dim_v)
            kv_store(vcache, kv, page, hv, n_head_kv, page_size, slot, head_dim_v, i,
                     row[(n_head + n_head_kv) * head_dim + hv * head_dim_v + i]);
        return;
    }
    const bool is_q = h < n_head;
    float* src = row + (is_q ? h * head_dim : n_head * head_dim + (h - n_head) * head_dim);
    float v = i < head_dim ? src[i] : 0.f;
    const float* nw = is_q ? qnw : knw;
    if (nw) {
        const float ss = block_sum(v * v, scratch);
        if (i < head_dim) v = v * rsqrtf(ss / (float)head_dim + eps) * nw[i];
    }
    xs[i] = v;
    __syncthreads();
    if (i < n_rot) {
        int j, partner; bool first;
        if (neox) { const int half = n_rot / 2; first = i < half; j = first ? i : i - half; partner = first ? i + half : i - half; }
        else { j = i >> 1; first = (i & 1) == 0; partner = i ^ 1; }
        double s, c;
        sincos((double)p * inv_freq[j], &s, &c);
        const float cf = (float)c, sf = (float)s, o = xs[partner];
        v = first ? v * cf - o * sf : o * sf + v * cf;
    }
    if (i >= head_dim) return;
    if (is_q) src[i] = v;
    else kv_store(kcache, kv, page, h - n_head, n_head_kv, page_size, slot, head_dim, i, v);
}

// y[t, i] = act(g[t, i]) * u[t, i]; ACT 0 = SiLU, 1 = GELU (tanh), 2 = gpt-oss's clamped SwiGLU
// (swiglu_oai_f); writes f16 when out16 != null
extern "C" __global__ void glu(const float* __restrict__ g, const float* __restrict__ u, int ld, int n, int rows,
                               int act, float* y, int ldy, u16* out16, int ld16) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    pdl_enter();
    if (idx >= (long)rows * n) return;
    const int t = (int)(idx / n), i = (int)(idx % n);
    const float gv = g[(long)t * ld + i];
    const float uv = u[(long)t * ld + i];
    const float v = act == 2 ? swiglu_oai_f(gv, uv) : (act == 0 ? silu_f(gv) : gelu_tanh_f(gv)) * uv;
    if (out16) out16[(long)t * ld16 + i] = f2h(v);
    else y[(long)t * ldy + i] = v;
}

// x[t, :] += y[t, :] / (1 + exp(-(h[t, :] . w))): Qwen2-MoE's shared expert y under its per-token
// sigmoid gate (one block a row, the dot product in f32)
extern "C" __global__ void add_gated(float* x, int ldx, const float* __restrict__ h, int ldh,
                                     const float* __restrict__ w, const float* __restrict__ y, int ldy, int n) {
    __shared__ float scratch[32];
    const long t = blockIdx.x;
    pdl_enter();
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s = fmaf(h[t * ldh + i], w[i], s);
    const float e = 1.f + expf(-block_sum(s, scratch));
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[t * ldx + i] += y[t * ldy + i] / e;
}

// y[t, i] += b[i]
extern "C" __global__ void add_bias(float* y, int ldy, const float* __restrict__ b, int n, int rows) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    pdl_enter();
    if (idx >= (long)rows * n) return;
    y[(idx / n) * ldy + idx % n] += b[idx % n];
}

// x = cap * tanh(x / cap)
extern "C" __global__ void softcap(float* x, int ld, int n, int rows, float cap) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    pdl_enter();
    if (idx >= (long)rows * n) return;
    float* p = x + (idx / n) * ld + idx % n;
    *p = cap * tanhf(*p / cap);
}
