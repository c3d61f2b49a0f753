// Normalization, RoPE + KV-cache write, and elementwise kernels (f32 activations).
//
// Positions come from device memory (pos[t]), and KV pages from a block table, so one launch
// configuration serves every position: these kernels can sit inside a replayed CUDA graph.
// KV cache layout, per layer: [pages][n_head_kv][page_size][head_dim].
#include "quant_int8.cuh"

// y[t] = (res ? res[t] : 0) + x[t] * rsqrt(mean(x[t]^2) + eps) * w   (one block per row t; y may be
// res). y16 != null: also an f16 copy (the input of the tensor-core matmuls); xq != null: also the
// int8 copy (quant16 per 16 columns, see quant_int8.cuh; n % 16 == 0) of y, or of y * w2 when w2 is
// non-null, each piece with the squares of y: w2 is the next RMSNorm's weight, and a matvec given
// the copy with its norm flag applies that norm (a post-norm, the residual add and the next
// pre-norm in one launch: Gemma-3). Without w2 the copy is the next matvec's input as it stands.
extern "C" __global__ void rmsnorm(const float* __restrict__ x, int ldx, const float* __restrict__ w,
                                   float* y, int ldy, const float* res, int ldr, int n, float eps,
                                   u16* y16, int ld16, u8* xq, int ldq, float4* xs, int lds,
                                   const float* __restrict__ w2) {
    __shared__ float scratch[32];
    pdl_enter();
    const float* xr = x + (long)blockIdx.x * ldx;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float k = rsqrtf(ss / (float)n + eps);
    float* yr = y + (long)blockIdx.x * ldy;
    const float* rr = res ? res + (long)blockIdx.x * ldr : nullptr;
    u16* yh = y16 ? y16 + (long)blockIdx.x * ld16 : nullptr;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] * k * w[i];
        const float o = rr ? rr[i] + v : v;
        yr[i] = o;
        if (yh) yh[i] = f2h(o);
    }
    if (!xq) return;
    __syncthreads();  // y as written (y may alias res: recomputing would add it twice)
    for (int j = threadIdx.x; j < n / 16; j += blockDim.x) {  // sixteen at a time
        float v[16], sq = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float o = yr[16 * j + i];
            sq = fmaf(o, o, sq);
            v[i] = w2 ? o * w2[16 * j + i] : o;
        }
        u32 q[4]; float d, s;
        quant16(v, q, d, s);
        *reinterpret_cast<uint4*>(xq + (long)blockIdx.x * ldq + 16 * j) = make_uint4(q[0], q[1], q[2], q[3]);
        xs[(long)blockIdx.x * lds + j] = make_float4(d, s, sq, 0.f);
    }
}

// The int8 copy of x[t, :n] (n % 16 == 0), as rmsnorm writes it: one thread per 16 columns.
// Both write each piece's (d, s, sum of squares, 0) (matvec_block.cuh's XQ).
extern "C" __global__ void quantize_q8(const float* __restrict__ x, int ldx, int n, int rows, u8* xq, int ldq,
                                       float4* xs, int lds) {
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
    u32 q[4]; float d, s;
    quant16(v, q, d, s);
    *reinterpret_cast<uint4*>(xq + (long)t * ldq + 16 * j) = make_uint4(q[0], q[1], q[2], q[3]);
    xs[(long)t * lds + j] = make_float4(d, s, sumsq16(v), 0.f);
}

// One block per (token t, head h) over the fused QKV rows [q heads | k heads | v heads], blockDim
// = head_dim. Q and K heads: optional per-head RMSNorm (qnw/knw non-null), then RoPE (the first
// n_rot dims; neox: pairs (i, i + n_rot/2), else (2i, 2i+1)); Q is written back in place, K into
// the cache slot of pos[t]; V heads are copied into the cache. Rows with seq[t] < 0 (padding in a
// batch bucket) are skipped: they write nothing.
extern "C" __global__ void rope_kv(float* qkv, int ldqkv, int n_head, int n_head_kv, int head_dim,
                                   int head_dim_v, int n_rot, int neox, const float* __restrict__ qnw,
                                   const float* __restrict__ knw, float eps,
                                   const double* __restrict__ inv_freq, const int* __restrict__ pos,
                                   const int* __restrict__ seq, const int* __restrict__ table, int max_pages,
                                   int page_size, float* kcache, float* vcache) {
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
            vcache[(((long)page * n_head_kv + hv) * page_size + slot) * head_dim_v + i] =
                row[(n_head + n_head_kv) * head_dim + hv * head_dim_v + i];
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
    else kcache[(((long)page * n_head_kv + (h - n_head)) * page_size + slot) * head_dim + i] = v;
}

// y[t, i] = act(g[t, i]) * u[t, i]; ACT 0 = SiLU, 1 = GELU (tanh); writes f16 when out16 != null
extern "C" __global__ void glu(const float* __restrict__ g, const float* __restrict__ u, int ld, int n, int rows,
                               int act, float* y, int ldy, u16* out16, int ld16) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    pdl_enter();
    if (idx >= (long)rows * n) return;
    const int t = (int)(idx / n), i = (int)(idx % n);
    const float gv = g[(long)t * ld + i];
    const float v = (act == 0 ? silu_f(gv) : gelu_tanh_f(gv)) * u[(long)t * ld + i];
    if (out16) out16[(long)t * ld16 + i] = f2h(v);
    else y[(long)t * ldy + i] = v;
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
