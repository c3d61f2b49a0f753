// Staged scales (matvec.cu, IO bit 2): a block of P rows (P consecutive rows of one matrix, P a
// power of two, the first a multiple of P) decodes its rows' K-quant scales once into shared
// memory, then runs them as the staged twin of the type (TQ4_KS<P>, TQ6_KS<P>), whose units load only
// their quants and read their scales from there. Same values as the type's.
//
// Layout: per (row % P, superblock) four float4s, in unit order: for Q4_K float4 g holds (d sc,
// dmin m) of sub-blocks 2g and 2g + 1 (unit u reads float4 u / 2 of its row); for Q6_K float4 u % 4
// holds the four d sc of unit u's pieces (unit u reads float4 u). The staged Mat's sc plane points
// at the block's copy (the GLU: 16 gate rows, then 16 up rows).
#pragma once
#include "quant_int8.cuh"

template <int P>
DEV const float4* staged_row(const Mat& m, int row) {
    return reinterpret_cast<const float4*>(m.sc) + (row & (P - 1)) * 4 * m.nb;
}

template <int P>
struct TQ4_KS {
    static constexpr int UE = 32, NP = 2, BLOCK = 256;
    struct Raw { V16 q; const float4* s; };
    static DEV void load(const Mat& m, int row, int u, Raw& r) {
        r.q = TQ4_K::load_q(m, (long)row * m.nb + (u >> 3), (u >> 1) & 3, u & 1);
        r.s = staged_row<P>(m, row) + (u >> 1);
    }
    static HD int xoff(int u, int p) { return TQ4_K::xoff(u, p); }
    struct Item { V16 v; };  // one superblock's scale bytes: d, dmin, scales12
    static DEV Item stage_load(const u8* sc, const u8*, long blk) { return Item{ld16(sc + blk * 16)}; }
    static DEV void stage_decode(const Item& it, float4* o) {
        const V16& v = it.v;
        const float d = h2f((u16)(v.w[0] & 0xFFFFu)), dmin = h2f((u16)(v.w[0] >> 16));
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            int s0, m0, s1, m1;
            k4_scale_min(v.w[1], v.w[2], v.w[3], 2 * g, s0, m0);
            k4_scale_min(v.w[1], v.w[2], v.w[3], 2 * g + 1, s1, m1);
            o[g] = make_float4(d * qf((u32)s0), dmin * qf((u32)m0), d * qf((u32)s1), dmin * qf((u32)m1));
        }
    }
};
template <int P> struct I8<TQ4_KS<P>> {
    static DEV void words(const typename TQ4_KS<P>::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        nib_words(r.q, 4 * p, q);
        const float4 s = *r.s;
        d = p ? s.z : s.x; m = -(p ? s.w : s.y);
    }
};

template <int P>
struct TQ6_KS {
    static constexpr int UE = 64, NP = 4, BLOCK = 256;
    struct Raw { V16 la, lb, qh; const float4* s; };
    static DEV void load(const Mat& m, int row, int u, Raw& r) {
        TQ6_K::load_q(m, (long)row * m.nb + (u >> 2), u, r.la, r.lb, r.qh);
        r.s = staged_row<P>(m, row) + u;
    }
    static HD int xoff(int u, int p) { return TQ6_K::xoff(u, p); }
    struct Item { V16 v; u32 d; };  // one superblock's 16 int8 scales and its f16 d
    static DEV Item stage_load(const u8* sc, const u8* d, long blk) {
        return Item{ld16(sc + blk * 16), ld16bits(d + blk * 2)};
    }
    static DEV void stage_decode(const Item& it, float4* o) {
        const float d = h2f((u16)it.d);
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // unit k of the superblock: h = k / 2, s = k % 2 (TQ6_K::load)
            const int b0 = 8 * (k >> 1) + (k & 1);
            o[k] = make_float4(d * (float)(i8)byte_of(it.v, b0), d * (float)(i8)byte_of(it.v, b0 + 2),
                               d * (float)(i8)byte_of(it.v, b0 + 4), d * (float)(i8)byte_of(it.v, b0 + 6));
        }
    }
};
template <int P> struct I8<TQ6_KS<P>> {
    static DEV void words(const typename TQ6_KS<P>::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        const V16& l = (p & 1) ? r.lb : r.la;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            q[j] = ((l.w[j] >> (4 * (p >> 1))) & 0x0F0F0F0Fu) | (((r.qh.w[j] >> (2 * p)) & 0x03030303u) << 4);
        const float4 s = *r.s;
        d = p == 0 ? s.x : (p == 1 ? s.y : (p == 2 ? s.z : s.w)); m = -32.f * d;
    }
};

template <class T, int P> struct Staged;  // the staged twin of a type that has one
template <int P> struct Staged<TQ4_K, P> { using type = TQ4_KS<P>; };
template <int P> struct Staged<TQ6_K, P> { using type = TQ6_KS<P>; };

// The staging: issue() loads this thread's first superblock of scale bytes, before the quants of
// the block's first units go out; finish(), after them, decodes it and any further ones (P nb mats
// in all: the P rows from row0 of matrix a, then of b), then syncs the block.
template <class TS, int P>
struct KStage {
    const u8* sc_a; const u8* d_a; const u8* sc_b; const u8* d_b; int row0, n, nb, mats; float4* ks;
    typename TS::Item it;
    DEV typename TS::Item at(int i) const {  // item i: matrix i / P nb, row i / nb % P, superblock i % nb
        const int j = i % (P * nb), r = min(row0 + j / nb, n - 1);
        const bool a = i < P * nb;
        return TS::stage_load(a ? sc_a : sc_b, a ? d_a : d_b, (long)r * nb + j % nb);
    }
    DEV void issue() { if ((int)threadIdx.x < P * nb * mats) it = at(threadIdx.x); }
    DEV void finish() {
        const int items = P * nb * mats;
        int i = threadIdx.x;
        if (i < items) TS::stage_decode(it, ks + 4 * i);
        for (i += blockDim.x; i < items; i += blockDim.x) TS::stage_decode(at(i), ks + 4 * i);
        __syncthreads();
    }
};
