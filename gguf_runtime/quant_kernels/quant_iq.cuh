// The 1- to 3-bit i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): a unit is 64
// weights of a 256-weight superblock, 4 pieces of 16. Each type gives a piece as 16 signed bytes
// (sbytes: 4 words, value i at byte i & 3 of word i >> 2) and a scale d, weight i = d * value i;
// grid rows (iq_tables.cuh) hold their values as bytes, so a row of the grid is two words of a
// piece as they are, signs applied by a byte-wise negation. The layouts follow ggml-common.h and
// reference_iq.py (the numpy oracle); planes in repack.py.
//
// IQ1's values are grid + delta (delta = +-1/8): 8 grid + 8 delta, an odd integer in -9..9, with d
// the row scale / 8 (exact: a power of two), so weight = d * value rounds once, as ggml's does.
#pragma once

#ifdef __CUDA_ARCH__
#define IQ_TABLE static __device__ const
#else
#define IQ_TABLE static const
#endif
#include "iq_tables.cuh"

HD u64 grid_row8(const unsigned long long* g, u32 i) {
#ifdef __CUDA_ARCH__
    return __ldg(g + i);
#else
    return g[i];
#endif
}

HD u32 grid_row4(const unsigned int* g, u32 i) {
#ifdef __CUDA_ARCH__
    return __ldg(g + i);
#else
    return g[i];
#endif
}

HD u32 popc32(u32 v) {
#ifdef __CUDA_ARCH__
    return __popc(v);
#else
    return __builtin_popcount(v);
#endif
}

// ksigns_iq2xs: a 7-bit sign index and, as bit 7, its parity
HD u32 ksign(u32 s7) { return s7 | ((popc32(s7) & 1u) << 7); }

// The bytes of w (values 1..127: never 0, so no carry crosses a byte) negated where bit k of s4 is set.
HD u32 neg_bytes(u32 w, u32 s4) {
    const u32 m = ((s4 * 0x00204081u) & 0x01010101u) * 0xFFu;
    return (w ^ m) + (m & 0x01010101u);
}

// A row of 8 grid values with its 8 sign bits: words out[0], out[1].
HD void signed_row8(u64 row, u32 signs, u32* out) {
    out[0] = neg_bytes((u32)row, signs & 0xFu);
    out[1] = neg_bytes((u32)(row >> 32), (signs >> 4) & 0xFu);
}

template <class D>
struct TIqBase {
    static constexpr int UE = 64, NP = 4, BLOCK = 256;
    static HD int xoff(int u, int p) { return (u >> 2) * 256 + (u & 3) * 64 + 16 * p; }
    // as integer-valued floats value + 128 (qf: no int-to-float conversion), offset -128 d (exact)
    template <class Raw>
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
        u32 w[4];
        D::sbytes(r, p, w, d);
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = qf(((w[i >> 2] >> (8 * (i & 3))) & 0xFFu) ^ 0x80u);
        m = -128.f * d;
    }
};

// IQ2_XXS (66 bytes: d, then 8 groups of 32 weights as 4 grid indices and a word of 4 7-bit sign
// indices and a 4-bit scale): qs the groups (8 bytes each), d. Piece p: group p / 2, rows 2 (p & 1) + 0, 1.
struct TIQ2_XXS : TIqBase<TIQ2_XXS> {
    struct Raw { V16 q; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        r.q = ld16(m.qs + sb * 64 + 16 * (u & 3));
        r.d = h2f(ld16bits(m.d + sb * 2));
    }
    static HD void sbytes(const Raw& r, int p, u32 (&w)[4], float& d) {
        const u32 idx = r.q.w[2 * (p >> 1)], aux = r.q.w[2 * (p >> 1) + 1];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * (p & 1) + j;
            signed_row8(grid_row8(iq2xxs_grid, (idx >> (8 * row)) & 0xFFu), ksign((aux >> (7 * row)) & 0x7Fu), w + 2 * j);
        }
        d = r.d * (0.5f + qf(aux >> 28)) * 0.25f;
    }
};

// IQ2_XS (74 bytes: d, 32 u16 = 9-bit grid index | 7-bit sign index a row of 8, 8 bytes of 4-bit
// scales, one a 16 weights): qs the u16s, sc the scales, d.
struct TIQ2_XS : TIqBase<TIQ2_XS> {
    struct Raw { V16 q; u32 sc; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        r.q = ld16(m.qs + sb * 64 + 16 * (u & 3));
        r.sc = ld16bits(m.sc + sb * 8 + 2 * (u & 3));
        r.d = h2f(ld16bits(m.d + sb * 2));
    }
    static HD void sbytes(const Raw& r, int p, u32 (&w)[4], float& d) {
        const u32 two = r.q.w[p];  // rows 2p, 2p + 1
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 v = (two >> (16 * j)) & 0xFFFFu;
            signed_row8(grid_row8(iq2xs_grid, v & 511u), ksign(v >> 9), w + 2 * j);
        }
        d = r.d * (0.5f + qf((r.sc >> (4 * p)) & 0xFu)) * 0.25f;
    }
};

// IQ2_S (82 bytes: d, 32 grid index low bytes, 32 sign bytes, 8 bytes of 2-bit index highs, 8
// bytes of 4-bit scales): qs the index bytes then the sign bytes, sc the highs then the scales, d.
struct TIQ2_S : TIqBase<TIQ2_S> {
    struct Raw { u32 idx[2], sg[2], qh, sc; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        const u8* q = m.qs + sb * 64 + 8 * (u & 3);
        r.idx[0] = ld32(q); r.idx[1] = ld32(q + 4);
        r.sg[0] = ld32(q + 32); r.sg[1] = ld32(q + 36);
        r.qh = ld16bits(m.sc + sb * 16 + 2 * (u & 3));
        r.sc = ld16bits(m.sc + sb * 16 + 8 + 2 * (u & 3));
        r.d = h2f(ld16bits(m.d + sb * 2));
    }
    static HD void sbytes(const Raw& r, int p, u32 (&w)[4], float& d) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * p + j;  // of the unit's 8
            const u32 i = ((r.idx[row >> 2] >> (8 * (row & 3))) & 0xFFu) | (((r.qh >> (2 * row)) & 3u) << 8);
            signed_row8(grid_row8(iq2s_grid, i), (r.sg[row >> 2] >> (8 * (row & 3))) & 0xFFu, w + 2 * j);
        }
        d = r.d * (0.5f + qf((r.sc >> (4 * p)) & 0xFu)) * 0.25f;
    }
};

// IQ3_XXS (98 bytes: d, 64 grid indices (rows of 4), 8 words of 4 7-bit sign indices (a sign index
// a row pair) and a 4-bit scale, one a group of 32): qs the indices, sc the words, d.
struct TIQ3_XXS : TIqBase<TIQ3_XXS> {
    struct Raw { V16 q; u32 aux[2]; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        r.q = ld16(m.qs + sb * 64 + 16 * (u & 3));
        r.aux[0] = ld32(m.sc + sb * 32 + 8 * (u & 3));
        r.aux[1] = ld32(m.sc + sb * 32 + 8 * (u & 3) + 4);
        r.d = h2f(ld16bits(m.d + sb * 2));
    }
    static HD void sbytes(const Raw& r, int p, u32 (&w)[4], float& d) {
        const u32 aux = r.aux[p >> 1], idx = r.q.w[p];  // rows 4p .. 4p + 3 of the unit
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 s = ksign((aux >> (7 * (2 * (p & 1) + (j >> 1)))) & 0x7Fu);
            w[j] = neg_bytes(grid_row4(iq3xxs_grid, (idx >> (8 * j)) & 0xFFu), (s >> (4 * (j & 1))) & 0xFu);
        }
        d = r.d * (0.5f + qf(aux >> 28)) * 0.5f;
    }
};

// IQ3_S (110 bytes: d, 64 grid index low bytes, 8 bytes of index high bits, 32 sign bytes (a bit
// a weight), 4 bytes of 4-bit scales, one a group of 32: d (1 + 2 s)): qs the low bytes, qh the
// high bits, sc the signs then the scales (padded to 48 bytes), d.
struct TIQ3_S : TIqBase<TIQ3_S> {
    struct Raw { V16 q; u32 qh, sg[2], sc; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        r.q = ld16(m.qs + sb * 64 + 16 * (u & 3));
        r.qh = ld16bits(m.qh + sb * 8 + 2 * (u & 3));
        r.sg[0] = ld32(m.sc + sb * 48 + 8 * (u & 3));
        r.sg[1] = ld32(m.sc + sb * 48 + 8 * (u & 3) + 4);
        r.sc = ld8bits(m.sc + sb * 48 + 32 + (u & 3));
        r.d = h2f(ld16bits(m.d + sb * 2));
    }
    static HD void sbytes(const Raw& r, int p, u32 (&w)[4], float& d) {
        const u32 idx = r.q.w[p], signs = (r.sg[p >> 1] >> (16 * (p & 1))) & 0xFFFFu;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int k = 4 * p + j;  // index of the unit's 16
            const u32 i = ((idx >> (8 * j)) & 0xFFu) | (((r.qh >> k) & 1u) << 8);
            w[j] = neg_bytes(grid_row4(iq3s_grid, i), (signs >> (4 * j)) & 0xFu);
        }
        d = r.d * qf(1u + 2u * ((r.sc >> (4 * (p >> 1))) & 0xFu));
    }
};

// IQ1: the bytes 8 g + 1 (delta +1/8) or 8 g - 1 (delta -1/8) of a row's grid values g in -1..1.
HD void iq1_row(u64 row, bool minus, u32* out) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        u32 v = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int g = (int)(i8)((row >> (8 * (4 * h + k))) & 0xFFu);
            v |= ((u32)(8 * g + (minus ? -1 : 1)) & 0xFFu) << (8 * k);
        }
        out[h] = v;
    }
}

// IQ1_S (50 bytes: d, 32 grid index low bytes (rows of 8), a u16 a group of 32: 3 index high bits a
// row, a 3-bit scale (d (2 s + 1)) and the delta's sign): qs the low bytes, qh the u16s, d.
struct TIQ1_S : TIqBase<TIQ1_S> {
    struct Raw { u32 idx[2], qh; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        r.idx[0] = ld32(m.qs + sb * 32 + 8 * (u & 3));
        r.idx[1] = ld32(m.qs + sb * 32 + 8 * (u & 3) + 4);
        r.qh = ld32(m.qh + sb * 16 + 4 * (u & 3));
        r.d = h2f(ld16bits(m.d + sb * 2));
    }
    static HD void sbytes(const Raw& r, int p, u32 (&w)[4], float& d) {
        const u32 h = (r.qh >> (16 * (p >> 1))) & 0xFFFFu;  // group p / 2's word
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * (p & 1) + j;  // of the group's 4
            const u32 i = ((r.idx[p >> 1] >> (8 * row)) & 0xFFu) | (((h >> (3 * row)) & 7u) << 8);
            iq1_row(grid_row8(iq1s_grid, i), (h & 0x8000u) != 0, w + 2 * j);
        }
        d = r.d * qf(2u * ((h >> 12) & 7u) + 1u) * 0.125f;
    }
};

// IQ1_M (56 bytes: 32 grid index low bytes, 16 bytes of a nibble a row (3 index high bits, the
// delta's sign), 4 u16 of 3-bit scales (one a 16 weights: d (2 s + 1)) whose top nibbles are the
// f16 d): qs the low bytes, qh the nibbles, sc the u16s.
struct TIQ1_M : TIqBase<TIQ1_M> {
    struct Raw { u32 idx[2], qh, sc; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        r.idx[0] = ld32(m.qs + sb * 32 + 8 * (u & 3));
        r.idx[1] = ld32(m.qs + sb * 32 + 8 * (u & 3) + 4);
        r.qh = ld32(m.qh + sb * 16 + 4 * (u & 3));
        const u32 s01 = ld32(m.sc + sb * 8), s23 = ld32(m.sc + sb * 8 + 4);
        r.sc = (u & 2 ? s23 : s01) >> (16 * (u & 1));
        const u32 bits = ((s01 >> 12) & 0x000Fu) | ((s01 >> 24) & 0x00F0u) | ((s23 >> 4) & 0x0F00u) | ((s23 >> 16) & 0xF000u);
        r.d = h2f((u16)bits);
    }
    static HD void sbytes(const Raw& r, int p, u32 (&w)[4], float& d) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int row = 2 * p + j;  // of the unit's 8
            const u32 nib = (r.qh >> (4 * row)) & 0xFu;
            const u32 i = ((r.idx[row >> 2] >> (8 * (row & 3))) & 0xFFu) | ((nib & 7u) << 8);
            iq1_row(grid_row8(iq1s_grid, i), (nib & 8u) != 0, w + 2 * j);
        }
        d = r.d * qf(2u * ((r.sc >> (3 * p)) & 7u) + 1u) * 0.125f;
    }
};
