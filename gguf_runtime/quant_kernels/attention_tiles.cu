// Attention for batch decode steps: one block per (KV head, row), no splits. Many rows give enough
// blocks (the 8B at B = 64: 512), so instead of attention.cu's split chunks (each a few keys, a
// warp reduction per key and head, a merge across blocks) a block streams all of its row's keys
// through shared memory in tiles of KT keys (cp.async, ST stages: ST - 1 tiles are in flight while
// one is computed). Per tile:
//   scores: SP threads per (head, key), each a dot product over D / SP dims read from shared memory;
//   softmax: one warp per head, an online update of its running max and sum;
//   P V: one thread per (head, 4 dims), float4 reads of the V tile.
// Tiles are aligned to multiples of KT positions (a tile's pages are whole; keys before lo, after
// the row's position or past its pages are masked, their rows zero-filled). early != 0 (every row
// one token of its own sequence): the row's own key and value are held apart (Fk, Fv), never read
// from a tile, and the first ST - 1 tiles are issued before pdl_enter (with PDL they overlap the
// kernel before; q and the row's own key wait for it). n_rot > 0 (with early): q, k and v are the
// raw QKV rows, and this kernel does rope_kv's work for its heads (layers.cu: RoPE on q and k,
// pairs (2i, 2i + 1) or neox (i, i + n_rot / 2), the same float arithmetic; k and v into the cache).
#include "common.cuh"

// cp.async of 16 bytes global -> shared, zero-filled when !valid (as mma_regs.cuh's, which needs
// matmul_mma.cu's constants to compile).
DEV void tile_cp16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 16 : 0));
}
DEV void tile_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> DEV void tile_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <int D, int G, int W, int KT_> struct Tile {
    static constexpr int KT = KT_;  // keys per tile
    static constexpr int NT = 32 * W, C = D / 4;  // threads; 16-byte chunks per row
    static constexpr int SP = G * KT >= NT || NT % (G * KT) ? 1 : NT / (G * KT);  // threads per score: 1, 2, 4..
    static constexpr int LD = D + 4 * SP;  // K row stride (floats): the SP parts' float4 reads hit distinct banks
    static_assert(KT * C % NT == 0, "a tile's chunks are spread evenly over the threads");
    static_assert(C % SP == 0 && (SP & (SP - 1)) == 0, "a score's parts: a power of two dividing D / 4");
};

// cp.async of the keys of tile [k0, k0 + KT) that lie in [lo, p] but the key ``fresh`` into stage
// (Ks, Vs); the others are zero-filled (their scores are masked, their V rows must be finite).
template <class T, int D>
DEV void load_tile(int k0, int lo, int p, int fresh, const int* tab, int max_pages, int page_size, int n_head_kv,
                   int hk, const float* kcache, const float* vcache, float* Ks, float* Vs) {
#pragma unroll
    for (int r = 0; r < T::KT * T::C / T::NT; ++r) {
        const int i = threadIdx.x + r * T::NT, j = i / T::C, c = i % T::C, key = k0 + j;
        const int page = key >= lo && key <= p && key / page_size < max_pages ? tab[key / page_size] : -1;
        if (key == fresh) continue;  // held in Fk, Fv
        const bool ok = page >= 0;
        const long base = ok ? (((long)page * n_head_kv + hk) * page_size + key % page_size) * D + 4 * c : 0;
        tile_cp16(Ks + j * T::LD + 4 * c, kcache + base, ok);
        tile_cp16(Vs + j * D + 4 * c, vcache + base, ok);
    }
}

// RoPE of element i of a head x (D floats, shared memory) at the angles cs (cos, sin per pair).
DEV float rope_at(const float* x, int i, const float* cs, int n_rot, int neox) {
    if (i >= n_rot) return x[i];
    const int half = n_rot / 2;
    const bool first = neox ? i < half : (i & 1) == 0;
    const int j = neox ? (first ? i : i - half) : i >> 1, partner = neox ? (first ? i + half : i - half) : i ^ 1;
    const float v = x[i], o = x[partner], cf = cs[2 * j], sf = cs[2 * j + 1];
    return first ? v * cf - o * sf : o * sf + v * cf;
}

// Shared memory (floats, float4-read arrays first): Ks[ST][KT][LD], Vs[ST][KT][D], Fk[D], Fv[D],
// Qs[G][D], CS[D], Ps[G][KT], Cs[G], Ls[G].
template <int D, int G, int W, int KT, int ST>
__global__ void __launch_bounds__(32 * W) attn_tiles(
        const float* __restrict__ q, int ldq, float* __restrict__ kcache, float* __restrict__ vcache,
        const int* __restrict__ pos, const int* __restrict__ seq, const int* __restrict__ table, int max_pages,
        int page_size, int n_head_kv, float scale, float cap, int window, int early,
        const double* __restrict__ inv_freq, int n_rot, int neox, float* __restrict__ out, int ldo,
        u16* __restrict__ out16, int ld16) {
    using T = Tile<D, G, W, KT>;
    constexpr int LD = T::LD, NT = T::NT, SP = T::SP, HW = (G + W - 1) / W, NP = G * T::C;
    constexpr int PP = (NP + NT - 1) / NT;  // (head, 4 dims) pairs per thread in P V
    static_assert(ST >= 2, "two stages at least");
    extern __shared__ float4 smem4[];
    float* Ks = reinterpret_cast<float*>(smem4);
    float* Vs = Ks + ST * KT * LD;
    float* Fk = Vs + ST * KT * D;
    float* Fv = Fk + D;
    float* Qs = Fv + D;
    float* CS = Qs + G * D;
    float* Ps = CS + D;
    float* Cs = Ps + G * KT;
    float* Ls = Cs + G;
    if (!early) pdl_enter();
    const int hk = blockIdx.x, t = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool pad = seq[t] < 0;  // a padding row of a batch bucket: no keys
    const int p = pad ? -1 : pos[t];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int first = lo / KT * KT, n_tiles = pad ? 0 : (p - first) / KT + 1;
    const int* tab = table + (long)(pad ? 0 : seq[t]) * max_pages;
    const int fresh = early && !pad ? p : -1;  // the key held in Fk, Fv
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {  // one commit group per tile (empty past the last)
        if (s < n_tiles)
            load_tile<T, D>(first + s * KT, lo, p, fresh, tab, max_pages, page_size, n_head_kv, hk, kcache, vcache,
                            Ks + s * KT * LD, Vs + s * KT * D);
        tile_commit();
    }
    const float* qr = q + (long)t * ldq + hk * G * D;
    if (early) pdl_enter();
    if (fresh >= 0) {  // the row's own key and value (no page: zeros, masked)
        const int page = p / page_size < max_pages ? tab[p / page_size] : -1;
        const long base = (((long)max(page, 0) * n_head_kv + hk) * page_size + p % page_size) * D;
        if (n_rot > 0) {  // raw rows: k and v of this KV head, RoPE angles of position p
            const float* kr = q + (long)t * ldq + (n_head_kv * G + hk) * D;
            for (int i = threadIdx.x; i < D; i += NT) {
                Fk[i] = kr[i];
                Fv[i] = kr[n_head_kv * D + i];
            }
            for (int j = threadIdx.x; j < n_rot / 2; j += NT) {
                double sn, cn;
                sincos((double)p * inv_freq[j], &sn, &cn);
                CS[2 * j] = (float)cn;
                CS[2 * j + 1] = (float)sn;
            }
            __syncthreads();
            float kv[(D + NT - 1) / NT];
#pragma unroll
            for (int r = 0; r < (D + NT - 1) / NT; ++r)
                if (threadIdx.x + r * NT < D) kv[r] = rope_at(Fk, threadIdx.x + r * NT, CS, n_rot, neox);
            __syncthreads();  // every thread has read Fk
#pragma unroll
            for (int r = 0; r < (D + NT - 1) / NT; ++r) {
                const int i = threadIdx.x + r * NT;
                if (i >= D) break;
                Fk[i] = kv[r];
                if (page >= 0) { kcache[base + i] = kv[r]; vcache[base + i] = Fv[i]; }
            }
        } else {
            for (int i = threadIdx.x; i < D; i += NT) {
                Fk[i] = page >= 0 ? kcache[base + i] : 0.f;
                Fv[i] = page >= 0 ? vcache[base + i] : 0.f;
            }
        }
    }
    if (n_rot > 0 && fresh >= 0) {  // q: RoPE through Qs (the angles are in CS)
        for (int i = threadIdx.x; i < G * D; i += NT) Qs[i] = qr[i];
        __syncthreads();
        float qv[(G * D + NT - 1) / NT];
#pragma unroll
        for (int r = 0; r < (G * D + NT - 1) / NT; ++r) {
            const int i = threadIdx.x + r * NT;
            if (i < G * D) qv[r] = rope_at(Qs + i / D * D, i % D, CS, n_rot, neox);
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < (G * D + NT - 1) / NT; ++r) {
            const int i = threadIdx.x + r * NT;
            if (i < G * D) Qs[i] = qv[r] * scale;
        }
    } else {
        for (int i = threadIdx.x; i < G * D; i += NT) Qs[i] = qr[i] * scale;
    }
    float m[HW], l[HW];  // warp w's heads w, w + W, ...: running max and sum
#pragma unroll
    for (int h = 0; h < HW; ++h) { m[h] = -INFINITY; l[h] = 0.f; }
    float4 acc[PP];
#pragma unroll
    for (int r = 0; r < PP; ++r) acc[r] = make_float4(0.f, 0.f, 0.f, 0.f);

    for (int i = 0; i < n_tiles; ++i) {
        const int st = i % ST, k0 = first + i * KT;
        const float* K = Ks + st * KT * LD;
        const float* V = Vs + st * KT * D;
        tile_wait<ST - 2>();  // this tile's group is in (the next ones' may still be in flight)
        __syncthreads();  // ... for every thread; and the stage computed last iteration is free
        if (i + ST - 1 < n_tiles) {
            const int sn = (i + ST - 1) % ST;
            load_tile<T, D>(k0 + (ST - 1) * KT, lo, p, fresh, tab, max_pages, page_size, n_head_kv, hk, kcache,
                            vcache, Ks + sn * KT * LD, Vs + sn * KT * D);
        }
        tile_commit();
        for (int idx = threadIdx.x; idx < G * KT * SP; idx += NT) {  // scores: SP threads per (head g, key j)
            const int part = idx % SP, g = idx / SP / KT, j = idx / SP % KT, key = k0 + j;
            const float4* kr = reinterpret_cast<const float4*>(key == fresh ? Fk : K + j * LD) + part;
            const float4* qr = reinterpret_cast<const float4*>(Qs + g * D) + part;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 8
            for (int c = 0; c < T::C; c += SP) {  // chunk c + part: the parts of a key interleave by float4
                const float4 kv = kr[c], qv = qr[c];
                a0 = fmaf(kv.x, qv.x, a0); a1 = fmaf(kv.y, qv.y, a1);
                a2 = fmaf(kv.z, qv.z, a2); a3 = fmaf(kv.w, qv.w, a3);
            }
            float s = (a0 + a1) + (a2 + a3);
#pragma unroll
            for (int o = SP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (cap > 0.f) s = cap * tanhf(s / cap);
            const bool ok = key >= lo && key <= p && key / page_size < max_pages && tab[key / page_size] >= 0;
            if (part == 0) Ps[g * KT + j] = ok ? s : -INFINITY;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < HW; ++h) {  // softmax: warp w updates head g = w + W h
            const int g = warp + W * h;
            if (g >= G) break;
            float mx = -INFINITY;
            for (int j = lane; j < KT; j += 32) mx = fmaxf(mx, Ps[g * KT + j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mn = fmaxf(m[h], mx);  // -inf only while every key so far had no page
            const float corr = mn == -INFINITY ? 1.f : __expf(m[h] - mn);  // 0 on the first tile (m = -inf)
            float sum = 0.f;
            for (int j = lane; j < KT; j += 32) {
                const float e = mn == -INFINITY ? 0.f : __expf(Ps[g * KT + j] - mn);  // masked keys: 0
                Ps[g * KT + j] = e;
                sum += e;
            }
            l[h] = l[h] * corr + warp_sum(sum);
            m[h] = mn;
            if (lane == 0) Cs[g] = corr;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < PP; ++r) {  // P V: thread (head g, dims 4 c .. 4 c + 3)
            const int idx = threadIdx.x + r * NT;
            if (idx >= NP) break;
            const int g = idx / T::C, c = idx % T::C;
            const float corr = Cs[g];
            float4 a = acc[r];
            a.x *= corr; a.y *= corr; a.z *= corr; a.w *= corr;
#pragma unroll 8
            for (int j = 0; j < KT; ++j) {
                const float pj = Ps[g * KT + j];
                const float4 v = reinterpret_cast<const float4*>(k0 + j == fresh ? Fv : V + j * D)[c];
                a.x = fmaf(pj, v.x, a.x); a.y = fmaf(pj, v.y, a.y); a.z = fmaf(pj, v.z, a.z); a.w = fmaf(pj, v.w, a.w);
            }
            acc[r] = a;
        }
    }
    if (lane == 0)
#pragma unroll
        for (int h = 0; h < HW; ++h)
            if (warp + W * h < G) Ls[warp + W * h] = l[h];
    __syncthreads();
#pragma unroll
    for (int r = 0; r < PP; ++r) {
        const int idx = threadIdx.x + r * NT;
        if (idx >= NP) break;
        const int g = idx / T::C, c = idx % T::C;
        const float inv = Ls[g] > 0.f ? 1.f / Ls[g] : 0.f;  // a padding row: zeros
        const float4 o = make_float4(acc[r].x * inv, acc[r].y * inv, acc[r].z * inv, acc[r].w * inv);
        const long e = (long)(hk * G + g) * D + 4 * c;
        *reinterpret_cast<float4*>(out + (long)t * ldo + e) = o;
        if (out16) {
            u16* h = out16 + (long)t * ld16 + e;
            h[0] = f2h(o.x); h[1] = f2h(o.y); h[2] = f2h(o.z); h[3] = f2h(o.w);
        }
    }
}

#ifdef GGUF_INSTANTIATE_ALL
#define INST(D, G, W, KT, ST) template __global__ void attn_tiles<D, G, W, KT, ST>(const float*, int, float*, float*, \
    const int*, const int*, const int*, int, int, int, float, float, int, int, const double*, int, int, float*, int, \
    u16*, int);
INST(64, 1, 2, 64, 2) INST(64, 3, 2, 64, 2) INST(128, 4, 4, 32, 2) INST(128, 4, 4, 16, 4) INST(128, 4, 4, 8, 6)
INST(128, 8, 8, 32, 2) INST(256, 4, 8, 16, 2) INST(256, 8, 8, 16, 3)
#endif
