// Flash attention for prompt chunks (prefill) on the tensor cores: online softmax, f16 operands,
// f32 accumulation, no score matrix in memory.
//
// A block takes BQ = 16 WT consecutive rows of the call and the G query heads of one KV head:
// NW = G WT warps, warp w = (head g = w / WT, rows 16 (w % WT) .. + 15). Every K/V tile it loads
// (KT keys, cp.async, ST stages) serves all G heads and all its rows (16 G WT query rows a tile).
// Per tile and warp:
//   S = Q K^T: mma.sync.m16n8k16, Q's A fragments (f16, scaled) in registers (D <= 128) or in
//     shared memory in fragment order (D = 256), K's B fragments by ldmatrix from the tile;
//   soft-cap, mask (a row sees keys lo(row) .. pos(row): causal, sliding window), online softmax
//     in the exp2 domain, each row's max over the 4 lanes that hold it;
//   O += P V: P's C fragments repacked as f16 A fragments in registers, V's B fragments by
//     ldmatrix.trans.
// Contract (prefill): the rows of a call that are not padding (seq < 0) belong to one sequence.
// A block walks the key tiles from its rows' lowest window start to their highest position; a
// warp skips the arithmetic of tiles outside its own rows' range. The KV cache is paged
// ([page][n_head_kv][page_size] rows of kv_cache.cuh's types: float, u16 = f16, q8_0, q4_0): an
// f16 cache goes straight into the tiles; the others are staged raw and converted to f16 tiles
// after they land. Query tiles run
// last-first: the longest rows start first. Rows past the call or padding write zeros.
#include "kv_cache.cuh"

template <int D, int G, int WT, int KT, int ST, class KV> struct Flash {
    using R = KvRow<KV, D>;
    static constexpr int NW = G * WT, NT = 32 * NW, BQ = 16 * WT, KTILE = KT;
    static constexpr int LDH = D + 8;  // f16 tile row (halves): 8 ldmatrix rows hit 8 distinct 16-byte bank groups
    static constexpr bool RAW = R::RAW;  // float, q8_0, q4_0: staged raw, converted into f16 tiles
    static constexpr bool QSM = D > 128;  // Q fragments in shared memory (in registers up to 128 dims)
    static constexpr int LDRB = RAW ? R::VB : 2 * LDH;  // a staged row (bytes): f16 stages are the tiles themselves
    static constexpr int STAGE = KT * (LDRB + R::SB);  // bytes of one stage of K (or V): rows, then scales
    // dynamic shared memory, bytes: K stages, V stages, (raw: the f16 K and V tiles), (QSM: Q fragments)
    static constexpr int BYTES = 2 * ST * STAGE + (RAW ? 2 * KT * LDH * 2 : 0) + (QSM ? NW * (D / 16) * 4 * 32 * 4 : 0);
    static_assert(KT % 16 == 0 && D % 32 == 0 && ST >= 2 && STAGE % 16 == 0, "tile shapes");
};

// cp.async of keys [k0, k0 + KT) of the sequence (page table tab) into stage (Ks, Vs); keys past
// hi or without a page are zero-filled (masked later; their V rows must be finite).
template <class F, int D, class KV>
DEV void fa_load(int k0, int hi, const int* tab, int max_pages, int page_size, int n_head_kv, int hk,
                 const KV* kcache, const KV* vcache, char* Ks, char* Vs) {
    constexpr int P = KvRow<KV, D>::PIECES, N = F::KTILE * P;
    for (int i = threadIdx.x; i < N; i += F::NT) {
        const int j = i / P, c = i % P, key = k0 + j;
        const int page = key <= hi && kv_page(key, page_size) < max_pages ? tab[kv_page(key, page_size)] : -1;
        const bool ok = page >= 0;
        const long blk = ok ? kv_block<KV, D>(page, hk, n_head_kv, page_size) : 0;
        kv_stage_piece<KV, D, F::KTILE, F::LDRB>(j, c, kcache, blk, kv_slot(key, page_size), page_size, ok, Ks);
        kv_stage_piece<KV, D, F::KTILE, F::LDRB>(j, c, vcache, blk, kv_slot(key, page_size), page_size, ok, Vs);
    }
}

// Query-head g's A fragments of k step ks for this lane (rows grp, grp + 8 of the warp).
template <class F, int KS> struct QFrags {
    u32 r[F::QSM ? 1 : KS][4];
    uint4* sm;  // QSM: [warp][ks][lane] uint4
    DEV void set(int ks, const u32 (&a)[4]) {
        if constexpr (F::QSM) sm[ks * 32] = make_uint4(a[0], a[1], a[2], a[3]);
        else { r[ks][0] = a[0]; r[ks][1] = a[1]; r[ks][2] = a[2]; r[ks][3] = a[3]; }
    }
    DEV void get(int ks, u32 (&a)[4]) const {
        if constexpr (F::QSM) {
            const uint4 v = sm[ks * 32];
            a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
        } else { a[0] = r[ks][0]; a[1] = r[ks][1]; a[2] = r[ks][2]; a[3] = r[ks][3]; }
    }
};

DEV float2 fa_q2(const float* p, bool ok) { return ok ? *reinterpret_cast<const float2*>(p) : make_float2(0.f, 0.f); }

template <int D, int G, int WT, int KT, int ST, class KV>
__global__ void __launch_bounds__(32 * G * WT) flash_prefill(
        const float* __restrict__ q, int ldq, const KV* __restrict__ kcache, const KV* __restrict__ vcache,
        const int* __restrict__ pos, const int* __restrict__ seq, const int* __restrict__ table, int max_pages,
        int page_size, int n_head_kv, int rows, float scale, float cap, int window, float* __restrict__ out,
        int ldo, u16* __restrict__ out16, int ld16, const float* __restrict__ sinks) {
    using F = Flash<D, G, WT, KT, ST, KV>;
    constexpr int KS = D / 16, NS = KT / 8, ND = D / 8, LDH = F::LDH, BIG = 0x7fffffff;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ float4 fa_smem[];
    char* Kst = reinterpret_cast<char*>(fa_smem);
    char* Vst = Kst + ST * F::STAGE;
    u16* Kh = reinterpret_cast<u16*>(Vst + ST * F::STAGE);  // raw caches: the converted f16 tiles
    u16* Vh = Kh + (F::RAW ? KT * LDH : 0);
    uint4* Qf = reinterpret_cast<uint4*>(Vh + (F::RAW ? KT * LDH : 0));
    __shared__ int s_lo, s_hi, s_seq;

    if (dynamic_smem() < (u32)F::BYTES) __trap();  // the launcher's size (launch_attention.flash_smem) is short
    pdl_enter();
    const int hk = blockIdx.x, r0 = (gridDim.y - 1 - blockIdx.y) * F::BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
    const int g = warp / WT, wr0 = r0 + (warp % WT) * 16;
    if (threadIdx.x == 0) { s_lo = BIG; s_hi = -1; s_seq = -1; }
    __syncthreads();
    if (threadIdx.x < F::BQ) {  // the block's key range and sequence
        const int r = r0 + threadIdx.x;
        if (r < rows && seq[r] >= 0) {
            const int p = pos[r];
            atomicMin(&s_lo, window > 0 ? max(0, p - window + 1) : 0);
            atomicMax(&s_hi, p);
            atomicMax(&s_seq, seq[r]);
        }
    }
    __syncthreads();
    const int lo = s_lo, hi = s_hi;
    // this lane's rows (grp, grp + 8 of the warp's 16): last key pA, pB (-1: no row) and first lA, lB
    const int ra = wr0 + grp, rb = ra + 8;
    const int pA = ra < rows && seq[ra] >= 0 ? pos[ra] : -1, pB = rb < rows && seq[rb] >= 0 ? pos[rb] : -1;
    const int lA = window > 0 ? max(0, pA - window + 1) : 0, lB = window > 0 ? max(0, pB - window + 1) : 0;
    int wmax = max(pA, pB), wmin = min(pA < 0 ? BIG : lA, pB < 0 ? BIG : lB);  // the warp's key range
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
        wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
    }
    QFrags<F, KS> qf;
    qf.sm = Qf + warp * KS * 32 + lane;
    {
        const float* qa = q + (long)ra * ldq + (hk * G + g) * D + 2 * tig;
        const float* qb = q + (long)rb * ldq + (hk * G + g) * D + 2 * tig;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const float2 x0 = fa_q2(qa + 16 * ks, pA >= 0), x1 = fa_q2(qb + 16 * ks, pB >= 0);
            const float2 x2 = fa_q2(qa + 16 * ks + 8, pA >= 0), x3 = fa_q2(qb + 16 * ks + 8, pB >= 0);
            const u32 a[4] = {pack_h2(x0.x * scale, x0.y * scale), pack_h2(x1.x * scale, x1.y * scale),
                              pack_h2(x2.x * scale, x2.y * scale), pack_h2(x3.x * scale, x3.y * scale)};
            qf.set(ks, a);
        }
    }
    float o[ND][4], mA = -INFINITY, mB = -INFINITY, sA = 0.f, sB = 0.f;
#pragma unroll
    for (int d = 0; d < ND; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

    const int* tab = table + (long)max(s_seq, 0) * max_pages;
    const int first = hi < 0 ? 0 : lo / KT * KT, n_tiles = hi < 0 ? 0 : (hi - first) / KT + 1;
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {  // one commit group per tile (empty past the last)
        if (s < n_tiles)
            fa_load<F, D, KV>(first + s * KT, hi, tab, max_pages, page_size, n_head_kv, hk, kcache, vcache,
                              Kst + s * F::STAGE, Vst + s * F::STAGE);
        fa_commit();
    }
    for (int i = 0; i < n_tiles; ++i) {
        const int k0 = first + i * KT, st = i % ST;
        fa_wait<ST - 2>();  // this tile's group has landed (later ones may be in flight)
        __syncthreads();    // ... for every thread; the stage computed last iteration is free
        if (i + ST - 1 < n_tiles) {
            const int sn = (i + ST - 1) % ST;
            fa_load<F, D, KV>(k0 + (ST - 1) * KT, hi, tab, max_pages, page_size, n_head_kv, hk, kcache, vcache,
                              Kst + sn * F::STAGE, Vst + sn * F::STAGE);
        }
        fa_commit();
        const u16* Kt;
        const u16* Vt;
        if constexpr (F::RAW) {  // raw stage -> f16 tiles
            kv_to_f16<KV, D, KT, F::LDRB, LDH>(Kst + st * F::STAGE, Kh, threadIdx.x, F::NT);
            kv_to_f16<KV, D, KT, F::LDRB, LDH>(Vst + st * F::STAGE, Vh, threadIdx.x, F::NT);
            __syncthreads();
            Kt = Kh;
            Vt = Vh;
        } else {
            Kt = reinterpret_cast<const u16*>(Kst + st * F::STAGE);
            Vt = reinterpret_cast<const u16*>(Vst + st * F::STAGE);
        }
        if (k0 > wmax || k0 + KT - 1 < wmin) continue;  // no key of this tile for the warp's rows
        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kp = 0; kp < KS; kp += 2) {  // S = Q K^T, two k steps per ldmatrix.x4
            u32 a0[4], a1[4];
            qf.get(kp, a0);
            qf.get(kp + 1, a1);
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                u32 b[4];
                ldsm4(b, Kt + (8 * n + (lane & 7)) * LDH + 16 * kp + 8 * (lane >> 3));
                fa_mma(s[n], a0, b[0], b[1]);
                fa_mma(s[n], a1, b[2], b[3]);
            }
        }
        float xa = -INFINITY, xb = -INFINITY;  // mask, soft-cap, the rows' maxima (log2 domain)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + 8 * n + 2 * tig + (e & 1);
                float v = s[n][e];
                if (cap > 0.f) v = cap * tanhf(v / cap);
                const bool ok = e < 2 ? key >= lA && key <= pA : key >= lB && key <= pB;
                v = ok ? v * LOG2E : -INFINITY;
                s[n][e] = v;
                if (e < 2) xa = fmaxf(xa, v); else xb = fmaxf(xb, v);
            }
#pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, o2));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, o2));
        }
        const float na = fmaxf(mA, xa), nb = fmaxf(mB, xb);  // -inf while a row has seen no key
        const float ca = na == -INFINITY ? 1.f : exp2f(mA - na), cb = nb == -INFINITY ? 1.f : exp2f(mB - nb);
        mA = na;
        mB = nb;
        float ta = 0.f, tb = 0.f;
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            s[n][0] = na == -INFINITY ? 0.f : exp2f(s[n][0] - na);
            s[n][1] = na == -INFINITY ? 0.f : exp2f(s[n][1] - na);
            s[n][2] = nb == -INFINITY ? 0.f : exp2f(s[n][2] - nb);
            s[n][3] = nb == -INFINITY ? 0.f : exp2f(s[n][3] - nb);
            ta += s[n][0] + s[n][1];
            tb += s[n][2] + s[n][3];
        }
        sA = sA * ca + ta;  // this lane's share of the rows' sums (the quad adds them at the end)
        sB = sB * cb + tb;
#pragma unroll
        for (int d = 0; d < ND; ++d) { o[d][0] *= ca; o[d][1] *= ca; o[d][2] *= cb; o[d][3] *= cb; }
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {  // O += P V: P's C fragments are the A fragments of k step kk
            const u32 pa[4] = {pack_h2(s[2 * kk][0], s[2 * kk][1]), pack_h2(s[2 * kk][2], s[2 * kk][3]),
                               pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int d = 0; d < ND; d += 2) {
                u32 b[4];
                ldsm4t(b, Vt + (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * LDH + 8 * d + 8 * (lane >> 4));
                fa_mma(o[d], pa, b[0], b[1]);
                fa_mma(o[d + 1], pa, b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        sA += __shfl_xor_sync(0xffffffffu, sA, o2);
        sB += __shfl_xor_sync(0xffffffffu, sB, o2);
    }
    if (sinks) {  // gpt-oss: the head's sink logit joins the denominator (log2 domain, as mA and mB)
        const float sk = sinks[hk * G + g] * LOG2E;
        if (mA > -INFINITY) sA += exp2f(sk - mA);
        if (mB > -INFINITY) sB += exp2f(sk - mB);
    }
    const float ia = sA > 0.f ? 1.f / sA : 0.f, ib = sB > 0.f ? 1.f / sB : 0.f;  // no key (padding): zeros
    const int col = (hk * G + g) * D + 2 * tig;
#pragma unroll
    for (int d = 0; d < ND; ++d) {
        if (ra < rows) {
            const float2 v = make_float2(o[d][0] * ia, o[d][1] * ia);
            *reinterpret_cast<float2*>(out + (long)ra * ldo + col + 8 * d) = v;
            if (out16) *reinterpret_cast<u32*>(out16 + (long)ra * ld16 + col + 8 * d) = pack_h2(v.x, v.y);
        }
        if (rb < rows) {
            const float2 v = make_float2(o[d][2] * ib, o[d][3] * ib);
            *reinterpret_cast<float2*>(out + (long)rb * ldo + col + 8 * d) = v;
            if (out16) *reinterpret_cast<u32*>(out16 + (long)rb * ld16 + col + 8 * d) = pack_h2(v.x, v.y);
        }
    }
}

#ifdef GGUF_INSTANTIATE_ALL
#define INST1(D, G, WT, KT, ST, KV) template __global__ void flash_prefill<D, G, WT, KT, ST, KV>(const float*, int, \
    const KV*, const KV*, const int*, const int*, const int*, int, int, int, int, float, float, int, float*, int, \
    u16*, int, const float*);
#define INST(D, G, WT, KT) INST1(D, G, WT, KT, 2, float) INST1(D, G, WT, KT, 2, u16) INST1(D, G, WT, KT, 2, kvq8) \
    INST1(D, G, WT, KT, 2, kvq4)
INST(64, 1, 4, 64) INST(64, 3, 2, 64) INST(64, 3, 1, 64) INST(128, 4, 2, 64) INST(128, 4, 1, 64)
INST(128, 4, 2, 32) INST(128, 8, 1, 64) INST(128, 8, 1, 32) INST(256, 4, 1, 32) INST(256, 8, 1, 32)
INST1(128, 4, 2, 64, 3, u16)
#endif
