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
// KV: the cache's element type, float or u16 (f16); tiles and Fk, Fv hold it as the cache does,
// and the arithmetic is f32.
#include "common.cuh"

// cp.async of 16 bytes global -> shared, zero-filled when !valid (as mma_regs.cuh's, which needs
// mma_tiles.cuh's constants to compile).
DEV void tile_cp16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 16 : 0));
}
DEV void tile_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> DEV void tile_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Four cache elements from shared memory as floats (16 bytes of float, 8 of f16).
DEV float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
DEV float4 ld4(const u16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    return make_float4(h2f(u.x & 0xFFFFu), h2f(u.x >> 16), h2f(u.y & 0xFFFFu), h2f(u.y >> 16));
}
DEV void st_kv(float* p, float v) { *p = v; }
DEV void st_kv(u16* p, float v) { *p = f2h(v); }

template <int D, int G, int W, int KT_, class KV> struct Tile {
    static constexpr int KT = KT_;  // keys per tile
    static constexpr int NT = 32 * W, C = D / 4;  // threads; 4-element chunks per row (scores, P V)
    static constexpr int VE = 16 / sizeof(KV), CC = D / VE;  // elements per cp.async; its chunks per row
    static constexpr int SP = G * KT >= NT || NT % (G * KT) ? 1 : NT / (G * KT);  // threads per score: 1, 2, 4..
    // K row stride (elements): the SP parts' 4-element reads hit distinct banks; rows 16-byte aligned
    static constexpr int LD = D + (sizeof(KV) == 4 || SP > 1 ? 4 * SP : 8);
    static_assert(C % SP == 0 && (SP & (SP - 1)) == 0, "a score's parts: a power of two dividing D / 4");
    static_assert(KT % 4 == 0 && D % 16 == 0, "shared arrays stay 16-byte aligned");
};

// cp.async of the keys of tile [k0, k0 + KT) that lie in [lo, p] but the key ``fresh`` into stage
// (Ks, Vs); the others are zero-filled (their scores are masked, their V rows must be finite).
template <class T, int D, class KV>
DEV void load_tile(int k0, int lo, int p, int fresh, const int* tab, int max_pages, int page_size, int n_head_kv,
                   int hk, const KV* kcache, const KV* vcache, KV* Ks, KV* Vs) {
#pragma unroll
    for (int r = 0; r < (T::KT * T::CC + T::NT - 1) / T::NT; ++r) {
        const int i = threadIdx.x + r * T::NT, j = i / T::CC, c = i % T::CC, key = k0 + j;
        if (T::KT * T::CC % T::NT && i >= T::KT * T::CC) break;
        const int pg = kv_page(key, page_size);
        const int page = key >= lo && key <= p && pg < max_pages ? tab[pg] : -1;
        if (key == fresh) continue;  // held in Fk, Fv
        const bool ok = page >= 0;
        const long base = ok ? (((long)page * n_head_kv + hk) * page_size + kv_slot(key, page_size)) * D + T::VE * c
                             : 0;
        tile_cp16(Ks + j * T::LD + T::VE * c, kcache + base, ok);
        tile_cp16(Vs + j * D + T::VE * c, vcache + base, ok);
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

// Shared memory (16-byte-read arrays first): KV Ks[ST][KT][LD], Vs[ST][KT][D], Fk[D], Fv[D]; floats
// Qs[G][D], CS[D], Ps[G][KT], Cs[G], Ls[G].
template <int D, int G, int W, int KT, int ST, class KV>
__global__ void __launch_bounds__(32 * W) attn_tiles(
        const float* __restrict__ q, int ldq, KV* __restrict__ kcache, KV* __restrict__ vcache,
        const int* __restrict__ pos, const int* __restrict__ seq, const int* __restrict__ table, int max_pages,
        int page_size, int n_head_kv, float scale, float cap, int window, int early,
        const double* __restrict__ inv_freq, int n_rot, int neox, float* __restrict__ out, int ldo,
        u16* __restrict__ out16, int ld16) {
    using T = Tile<D, G, W, KT, KV>;
    constexpr int LD = T::LD, NT = T::NT, SP = T::SP, HW = (G + W - 1) / W, NP = G * T::C;
    constexpr int PP = (NP + NT - 1) / NT;  // (head, 4 dims) pairs per thread in P V
    static_assert(ST >= 2, "two stages at least");
    extern __shared__ float4 smem4[];
    KV* Ks = reinterpret_cast<KV*>(smem4);
    KV* Vs = Ks + ST * KT * LD;
    KV* Fk = Vs + ST * KT * D;
    KV* Fv = Fk + D;
    float* Qs = reinterpret_cast<float*>(Fv + D);
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
            load_tile<T, D, KV>(first + s * KT, lo, p, fresh, tab, max_pages, page_size, n_head_kv, hk, kcache, vcache,
                            Ks + s * KT * LD, Vs + s * KT * D);
        tile_commit();
    }
    const float* qr = q + (long)t * ldq + hk * G * D;
    if (early) pdl_enter();
    if (fresh >= 0) {  // the row's own key and value (no page: zeros, masked)
        const int page = kv_page(p, page_size) < max_pages ? tab[kv_page(p, page_size)] : -1;
        const long base = (((long)max(page, 0) * n_head_kv + hk) * page_size + kv_slot(p, page_size)) * D;
        if (n_rot > 0) {  // raw rows: k and v of this KV head, RoPE angles of position p
            const float* kr = q + (long)t * ldq + (n_head_kv * G + hk) * D;
            float* Rk = Qs;  // the raw key (Qs is free until q's turn below)
            for (int i = threadIdx.x; i < D; i += NT) {
                Rk[i] = kr[i];
                st_kv(Fv + i, kr[n_head_kv * D + i]);
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
                if (threadIdx.x + r * NT < D) kv[r] = rope_at(Rk, threadIdx.x + r * NT, CS, n_rot, neox);
            __syncthreads();  // every thread has read Rk
#pragma unroll
            for (int r = 0; r < (D + NT - 1) / NT; ++r) {
                const int i = threadIdx.x + r * NT;
                if (i >= D) break;
                st_kv(Fk + i, kv[r]);
                if (page >= 0) { kcache[base + i] = Fk[i]; vcache[base + i] = Fv[i]; }
            }
        } else {
            for (int i = threadIdx.x; i < D; i += NT) {
                Fk[i] = page >= 0 ? kcache[base + i] : KV(0);
                Fv[i] = page >= 0 ? vcache[base + i] : KV(0);
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
        const KV* K = Ks + st * KT * LD;
        const KV* V = Vs + st * KT * D;
        tile_wait<ST - 2>();  // this tile's group is in (the next ones' may still be in flight)
        __syncthreads();  // ... for every thread; and the stage computed last iteration is free
        if (i + ST - 1 < n_tiles) {
            const int sn = (i + ST - 1) % ST;
            load_tile<T, D, KV>(k0 + (ST - 1) * KT, lo, p, fresh, tab, max_pages, page_size, n_head_kv, hk, kcache,
                            vcache, Ks + sn * KT * LD, Vs + sn * KT * D);
        }
        tile_commit();
        for (int idx = threadIdx.x; idx < G * KT * SP; idx += NT) {  // scores: SP threads per (head g, key j)
            const int part = idx % SP, g = idx / SP / KT, j = idx / SP % KT, key = k0 + j;
            const KV* kr = (key == fresh ? Fk : K + j * LD) + 4 * part;
            const float4* qr = reinterpret_cast<const float4*>(Qs + g * D) + part;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 8
            for (int c = 0; c < T::C; c += SP) {  // chunk c + part: the parts of a key interleave by 4 elements
                const float4 kv = ld4(kr + 4 * c), qv = qr[c];
                a0 = fmaf(kv.x, qv.x, a0); a1 = fmaf(kv.y, qv.y, a1);
                a2 = fmaf(kv.z, qv.z, a2); a3 = fmaf(kv.w, qv.w, a3);
            }
            float s = (a0 + a1) + (a2 + a3);
#pragma unroll
            for (int o = SP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (cap > 0.f) s = cap * tanhf(s / cap);
            const int pg = kv_page(key, page_size);
            const bool ok = key >= lo && key <= p && pg < max_pages && tab[pg] >= 0;
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
                const float4 v = ld4((k0 + j == fresh ? Fv : V + j * D) + 4 * c);
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
#define INST1(D, G, W, KT, ST, KV) template __global__ void attn_tiles<D, G, W, KT, ST, KV>(const float*, int, KV*, \
    KV*, const int*, const int*, const int*, int, int, int, float, float, int, int, const double*, int, int, float*, \
    int, u16*, int);
#define INST(D, G, W, KT, ST) INST1(D, G, W, KT, ST, float) INST1(D, G, W, KT, ST, u16)
INST(64, 1, 2, 64, 2) INST(64, 3, 2, 64, 2) INST(128, 4, 4, 32, 2) INST(128, 4, 4, 16, 4) INST(128, 4, 4, 8, 6)
INST(128, 8, 8, 32, 2) INST(256, 4, 8, 16, 2) INST(256, 8, 8, 16, 3) INST(128, 4, 4, 16, 2) INST(64, 3, 2, 32, 2)
INST(256, 8, 8, 8, 2) INST(256, 8, 8, 16, 2)
#endif
