// Attention over the paged KV cache with a fixed grid: (kv head, split, query token).
//
// Each query token t attends to positions [lo, pos[t]] (lo > 0 only for sliding-window layers),
// cut into ns = min(n_split, ceil(n / min_keys)) equal chunks computed in-kernel (blocks past ns
// exit), so the launch does not depend on the context length. A block (W warps) runs an online
// softmax over its chunk for the G = n_head / n_head_kv query heads that share the KV head, each
// warp four keys at a time (their loads issued together); the warps merge in shared memory, and
// with ns > 1 each block writes (max, sum, weighted V) per head and the row's last block merges
// the splits. The same kernel serves decode and prefill. oq non-null: the writing block also
// stores the int8 copy of its heads' outputs (the O projection's q8 input). KV: the cache's
// element type, float or u16 (f16); the arithmetic is f32.
#include "attn_parts.cuh"

DEV float kv_f(float v) { return v; }
DEV float kv_f(u16 v) { return h2f(v); }

// The four keys' loads of a warp's round (keys k0 + W j): their pages and addresses, and their K
// and V rows except the key ``fresh`` (< 0: none), which the caller loads after pdl_enter.
template <int E, int W, class KV>
DEV void load_keys(int k0, int end, int fresh, const int* tab, int max_pages, int page_size, int n_head_kv, int hk,
                   int lane, const KV* kcache, const KV* vcache, float (&kv)[4][E], float (&vv)[4][E],
                   bool (&ok)[4], long (&base)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int key = k0 + W * j;
        const int page = key < end && kv_page(key, page_size) < max_pages ? tab[kv_page(key, page_size)] : -1;
        ok[j] = page >= 0;  // < 0: past the chunk, or past the sequence's pages (never written)
        base[j] = ok[j] ? (((long)page * n_head_kv + hk) * page_size + kv_slot(key, page_size)) * (32 * E) : 0;
        const bool now = ok[j] && key != fresh;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            kv[j][e] = now ? kv_f(kcache[base[j] + lane + 32 * e]) : 0.f;
            vv[j][e] = now ? kv_f(vcache[base[j] + lane + 32 * e]) : 0.f;
        }
    }
}

// W warps per block (32 W threads); a split covers at least min_keys keys. early != 0 (decode
// steps: each row is one token of its own sequence): the positions, the page table and the keys
// before the row's own are loads of memory no kernel of this step writes (earlier steps' keys,
// the sampler's bumped position, host-written tables), so they are issued before pdl_enter and
// overlap the kernel before; only q and the row's own key and value (written by that kernel) wait.
template <int D, int G, int W, class KV>
__global__ void __launch_bounds__(32 * W) attn_split(
        const float* __restrict__ q, int ldq, const KV* __restrict__ kcache, const KV* __restrict__ vcache,
        const int* __restrict__ pos, const int* __restrict__ seq, const int* __restrict__ table, int max_pages,
        int page_size, int n_head_kv, float scale, float cap, int window, int n_split, int min_keys, int early,
        float* __restrict__ part_o, float* __restrict__ part_ml, unsigned* __restrict__ counter,
        float* __restrict__ out, int ldo, u16* __restrict__ out16, int ld16, u8* oq, int ldoq, float4* os,
        int ldos, int ores, const float* __restrict__ sinks) {
    constexpr int E = D / 32, KR = 4 * W;  // keys per round: each warp four keys, their loads together
    if (!early) pdl_enter();
    const int hk = blockIdx.x, s = blockIdx.y, t = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_head = n_head_kv * G;
    const bool pad = seq[t] < 0;  // a padding row of a batch bucket: no keys
    const int p = pad ? 0 : pos[t];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int n = p + 1 - lo, ns = min(n_split, (n + min_keys - 1) / min_keys);
    if (s >= ns) return;  // every block of the row computes the same ns
    const int chunk = (n + ns - 1) / ns;
    const int start = lo + s * chunk, end = pad ? start : min(p + 1, start + chunk);
    const int* tab = table + (long)(pad ? 0 : seq[t]) * max_pages;

    float kv[4][E], vv[4][E];
    bool ok[4];
    long base[4];
    int k0 = start + warp;
    load_keys<E, W, KV>(k0, end, early ? p : -1, tab, max_pages, page_size, n_head_kv, hk, lane, kcache, vcache,
                        kv, vv, ok, base);
    if (early) {
        pdl_enter();
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (ok[j] && k0 + W * j == p)
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    kv[j][e] = kv_f(kcache[base[j] + lane + 32 * e]);
                    vv[j][e] = kv_f(vcache[base[j] + lane + 32 * e]);
                }
    }
    float qv[G][E], acc[G][E], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qh = q + (long)t * ldq + (hk * G + g) * D;
#pragma unroll
        for (int e = 0; e < E; ++e) { qv[g][e] = qh[lane + 32 * e] * scale; acc[g][e] = 0.f; }
        m[g] = -INFINITY; l[g] = 0.f;
    }
    while (k0 < end) {
        float sc[4][G];  // the 4 G dot products first: their warp sums are independent (they overlap)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float v = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) v = fmaf(qv[g][e], kv[j][e], v);
                sc[j][g] = v;
            }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int g = 0; g < G; ++g) sc[j][g] = warp_sum(sc[j][g]);
#pragma unroll
        for (int g = 0; g < G; ++g) {  // one online-softmax update for the group
            float mn = m[g];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (cap > 0.f) sc[j][g] = cap * tanhf(sc[j][g] / cap);
                if (ok[j]) mn = fmaxf(mn, sc[j][g]);
            }
            const float corr = mn == -INFINITY ? 1.f : __expf(m[g] - mn);
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= corr;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float pe = ok[j] ? __expf(sc[j][g] - mn) : 0.f;
                l[g] += pe;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = fmaf(pe, vv[j][e], acc[g][e]);
            }
            m[g] = mn;
        }
        k0 += KR;
        if (k0 < end)
            load_keys<E, W, KV>(k0, end, -1, tab, max_pages, page_size, n_head_kv, hk, lane, kcache, vcache, kv,
                                vv, ok, base);
    }
    // merge the W warps: per head the warps' weights exp(m_w - M) (fw) and the total L, then the
    // weighted sums, HG heads at a time through shared memory (at most 32 KB of partial outputs)
    constexpr int HG = G < 8192 / (W * D) ? G : (8192 / (W * D) > 0 ? 8192 / (W * D) : 1);
    __shared__ float sm[W][G], sl[W][G], fw[W][G], sML[G][2];
    __shared__ float so[W][HG][D];
    if (lane == 0)
#pragma unroll
        for (int g = 0; g < G; ++g) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
    __syncthreads();
    if (threadIdx.x < W * G) {
        const int w = threadIdx.x / G, g = threadIdx.x % G;
        float M = -INFINITY;
#pragma unroll
        for (int v = 0; v < W; ++v) M = fmaxf(M, sm[v][g]);
        fw[w][g] = M > -INFINITY ? __expf(sm[w][g] - M) : 0.f;
        if (w == 0) {
            float L = 0.f;
            if (M > -INFINITY)
#pragma unroll
                for (int v = 0; v < W; ++v) L += sl[v][g] * __expf(sm[v][g] - M);
            sML[g][0] = M;
            // the row's only block: a sink (gpt-oss) joins the denominator here, else in merge_splits
            sML[g][1] = sinks && ns == 1 && M > -INFINITY ? L + __expf(sinks[hk * G + g] - M) : L;
        }
    }
#pragma unroll
    for (int g0 = 0; g0 < G; g0 += HG) {
#pragma unroll
        for (int gg = 0; gg < HG; ++gg)
            if (g0 + gg < G)
#pragma unroll
                for (int e = 0; e < E; ++e) so[warp][gg][lane + 32 * e] = acc[g0 + gg][e];
        __syncthreads();  // so (and, in the first pass, fw and sML) complete
        for (int idx = threadIdx.x; idx < HG * D; idx += blockDim.x) {
            const int g = g0 + idx / D, e = idx % D;
            if (g >= G) break;
            float O = 0.f;
#pragma unroll
            for (int w = 0; w < W; ++w) O = fmaf(so[w][idx / D][e], fw[w][g], O);
            const float M = sML[g][0], L = sML[g][1];
            if (ns == 1) {  // the row's only block: the output directly
                const float o = L > 0.f ? O / L : 0.f;
                out[(long)t * ldo + (hk * G + g) * D + e] = o;
                if (out16) out16[(long)t * ld16 + (hk * G + g) * D + e] = f2h(o);
                continue;
            }
            const long slot = ((long)t * n_head + hk * G + g) * n_split + s;
            part_o[slot * D + e] = O;
            if (e == 0) { part_ml[2 * slot] = M; part_ml[2 * slot + 1] = L; }
        }
        if (g0 + HG < G) __syncthreads();  // this pass's reads of so are done
    }
    merge_splits<D, G>(t, hk, ns, n_split, n_head_kv, part_o, part_ml, counter, out, ldo, out16, ld16, oq, ldoq, os,
                       ldos, ores, sinks);
}

#ifdef GGUF_INSTANTIATE_ALL
#define INST1(D, G, W, KV) template __global__ void attn_split<D, G, W, KV>(const float*, int, const KV*, const KV*, \
    const int*, const int*, const int*, int, int, int, float, float, int, int, int, int, float*, float*, unsigned*, \
    float*, int, u16*, int, u8*, int, float4*, int, int, const float*);
#define INST(D, G, W) INST1(D, G, W, float) INST1(D, G, W, u16)
#define INST_W(D, G) INST(D, G, 4) INST(D, G, 8) INST(D, G, 16)
INST_W(64, 1) INST_W(64, 3) INST_W(128, 4) INST_W(128, 8) INST(256, 4, 4) INST(256, 4, 8) INST(256, 8, 4) INST(256, 8, 8)
#endif
