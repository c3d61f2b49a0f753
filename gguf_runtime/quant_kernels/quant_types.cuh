// Per-type decoding of repacked quant planes (see repack.py for the plane layouts).
//
// A row of K weights is cut into *units*; one thread loads a unit with aligned 16-byte loads,
// then decodes it as NP *pieces* of 16 weights that sit at 16 consecutive columns (xoff). Every
// type provides:
//   UE, NP                          elements and pieces per unit
//   Raw                             the unit's bytes and scales, in registers
//   load(m, row, u, raw)            global loads only
//   xoff(u, p)                      first column of piece p of unit u
//   qpiece(raw, p, q[16], d, m)     piece p as integer-valued floats q and a scale d and offset m
//                                   such that weight i = d * q[i] + m
// and piece<T>(raw, p, w[16]) gives the 16 dequantized weights. q is built without int-to-float
// conversions (a quarter-rate instruction on Hopper): OR the small integer into the mantissa of
// 2^23 and subtract 2^23 (exact for integers below 2^23). Products of the f16 scales and these
// integers are exact in f32, so the weights equal ggml's dequantization bit for bit.
// The same code compiles for the host, so tests/test_quant_decode.py checks it on the CPU
// against the numpy reference before it ever runs on a GPU.
#pragma once
#include "common.cuh"

HD float qf(u32 q) { return u2f(0x4B000000u | q) - 8388608.f; }  // (float)q for q < 2^23

struct Mat {  // one repacked matrix; plane pointers are nullptr when the type has no such plane
    const u8* qs; const u8* qh; const u8* sc; const u8* d;
    int nb;  // blocks per row
};

// ---- 32-element block types -------------------------------------------------------------------
struct TQ4_0 {
    static constexpr int UE = 32, NP = 2, BLOCK = 32;
    struct Raw { V16 q; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long b = (long)row * m.nb + u;
        r.q = ld16(m.qs + b * 16);
        r.d = h2f(ld16bits(m.d + b * 2));
    }
    static HD int xoff(int u, int p) { return u * 32 + p * 16; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = qf((byte_of(r.q, i) >> (4 * p)) & 0xF);
        d = r.d; m = -8.f * r.d;
    }
};

struct TQ4_1 {
    static constexpr int UE = 32, NP = 2, BLOCK = 32;
    struct Raw { V16 q; float d, m; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long b = (long)row * m.nb + u;
        r.q = ld16(m.qs + b * 16);
        const u32 dm = ld32(m.d + b * 4);
        r.d = h2f((u16)(dm & 0xFFFFu));
        r.m = h2f((u16)(dm >> 16));
    }
    static HD int xoff(int u, int p) { return u * 32 + p * 16; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = qf((byte_of(r.q, i) >> (4 * p)) & 0xF);
        d = r.d; m = r.m;
    }
};

struct TQ5_0 {
    static constexpr int UE = 32, NP = 2, BLOCK = 32;
    struct Raw { V16 q; u32 h; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long b = (long)row * m.nb + u;
        r.q = ld16(m.qs + b * 16);
        r.h = ld32(m.qh + b * 4);
        r.d = h2f(ld16bits(m.d + b * 2));
    }
    static HD int xoff(int u, int p) { return u * 32 + p * 16; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
            q[i] = qf(((byte_of(r.q, i) >> (4 * p)) & 0xF) | (((r.h >> (i + 16 * p)) & 1u) << 4));
        d = r.d; m = -16.f * r.d;
    }
};

struct TQ5_1 {
    static constexpr int UE = 32, NP = 2, BLOCK = 32;
    struct Raw { V16 q; u32 h; float d, m; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long b = (long)row * m.nb + u;
        r.q = ld16(m.qs + b * 16);
        r.h = ld32(m.qh + b * 4);
        const u32 dm = ld32(m.d + b * 4);
        r.d = h2f((u16)(dm & 0xFFFFu));
        r.m = h2f((u16)(dm >> 16));
    }
    static HD int xoff(int u, int p) { return u * 32 + p * 16; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i)
            q[i] = qf(((byte_of(r.q, i) >> (4 * p)) & 0xF) | (((r.h >> (i + 16 * p)) & 1u) << 4));
        d = r.d; m = r.m;
    }
};

struct TQ8_0 {
    static constexpr int UE = 32, NP = 2, BLOCK = 32;
    struct Raw { V16 q[2]; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long b = (long)row * m.nb + u;
        r.q[0] = ld16(m.qs + b * 32);
        r.q[1] = ld16(m.qs + b * 32 + 16);
        r.d = h2f(ld16bits(m.d + b * 2));
    }
    static HD int xoff(int u, int p) { return u * 32 + p * 16; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = qf(byte_of(r.q[p], i) ^ 0x80u);  // int8 + 128
        d = r.d; m = -128.f * r.d;
    }
};

// ---- non-linear 4-bit types: each nibble indexes a table of 16 signed bytes --------------------
// MXFP4 (gpt-oss: E2M1 values doubled, times 2^(e - 128)) and IQ4_NL / IQ4_XS (kvalues_iq4nl).
// A block's 16 quant bytes hold element i in the low nibble of byte i and element 16 + i in its
// high nibble (piece 0: the low nibbles, piece 1: the high). The table is four words, entry 0 in
// the low byte of T0. As integers the pieces are q + 128 (qf, offset m = -128 d): exact.
struct LutMXFP4 { static constexpr u32 T0 = 0x03020100u, T1 = 0x0C080604u, T2 = 0xFDFEFF00u, T3 = 0xF4F8FAFCu; };
struct LutIQ4 { static constexpr u32 T0 = 0xBFAD9881u, T1 = 0xF6EADDCFu, T2 = 0x26190D01u, T3 = 0x71594535u; };

// The 8 nibbles of w through the table: lo = the 4 low nibbles' signed bytes (piece 0's
// elements), hi = the high ones' (piece 1's). On the GPU five byte permutes (llama.cpp's
// get_int_from_table_16): the low 3 bits of a nibble pick from entries 0-7 and from 8-15, its top
// bit picks between the two.
template <class L>
HD void lut_nibbles(u32 w, u32& lo, u32& hi) {
#ifdef __CUDA_ARCH__
    const u32 pick = 0x32103210u | ((w & 0x88888888u) >> 1);
    u32 t[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 s = w >> (16 * i);
        t[i] = __byte_perm(__byte_perm(L::T0, L::T1, s), __byte_perm(L::T2, L::T3, s), pick >> (16 * i));
    }
    lo = __byte_perm(t[0], t[1], 0x6420u);
    hi = __byte_perm(t[0], t[1], 0x7531u);
#else
    const u32 tab[4] = {L::T0, L::T1, L::T2, L::T3};
    lo = hi = 0;
    for (int i = 0; i < 4; ++i) {
        const u32 a = (w >> (8 * i)) & 0xFu, b = (w >> (8 * i + 4)) & 0xFu;
        lo |= ((tab[a >> 2] >> (8 * (a & 3))) & 0xFFu) << (8 * i);
        hi |= ((tab[b >> 2] >> (8 * (b & 3))) & 0xFFu) << (8 * i);
    }
#endif
}

// Piece p of a 16-byte nibble block through the table: 16 signed bytes, four words.
template <class L>
HD void lut_words(const V16& q, int p, u32 (&w)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 lo, hi;
        lut_nibbles<L>(q.w[j], lo, hi);
        w[j] = p ? hi : lo;
    }
}

template <class L>
HD void lut_qpiece(const V16& q, int p, float* out) {  // as integer-valued floats q + 128
    u32 w[4];
    lut_words<L>(q, p, w);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = qf(((w[i >> 2] >> (8 * (i & 3))) & 0xFFu) ^ 0x80u);
}

HD u32 ld8bits(const u8* p) {
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}

HD float e8m0_half(u32 e) { return u2f(e < 2 ? 0x00200000u << e : (e - 1) << 23); }  // 2^(e - 128), as ggml

// MXFP4 and IQ4_NL: 32-element blocks, the 16 nibble bytes in qs and the block scale in d (MXFP4:
// one E8M0 byte; IQ4_NL: an f16).
template <class Lut, bool E8M0>
struct TLut32 {
    static constexpr int UE = 32, NP = 2, BLOCK = 32;
    using L = Lut;
    struct Raw { V16 q; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long b = (long)row * m.nb + u;
        r.q = ld16(m.qs + b * 16);
        r.d = E8M0 ? e8m0_half(ld8bits(m.d + b)) : h2f(ld16bits(m.d + b * 2));
    }
    static HD int xoff(int u, int p) { return u * 32 + p * 16; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
        lut_qpiece<L>(r.q, p, q); d = r.d; m = -128.f * r.d;
    }
};
struct TMXFP4 : TLut32<LutMXFP4, true> {};
struct TIQ4_NL : TLut32<LutIQ4, false> {};

// IQ4_XS: 256-element superblocks of 8 groups of 32 (a unit: one group); sc holds d (f16), the
// scales' high bits (u16, 2 a group) and low nibbles (4 bytes): group scale d (ls - 32).
struct TIQ4_XS {
    static constexpr int UE = 32, NP = 2, BLOCK = 256;
    using L = LutIQ4;
    struct Raw { V16 q; float d; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 3);
        const int g = u & 7;
        r.q = ld16(m.qs + sb * 128 + 16 * g);
        const u32 h = ld32(m.sc + sb * 8), l = ld32(m.sc + sb * 8 + 4);
        const u32 ls = ((l >> (4 * g)) & 0xFu) | (((h >> (16 + 2 * g)) & 3u) << 4);
        r.d = h2f((u16)(h & 0xFFFFu)) * (qf(ls) - 32.f);
    }
    static HD int xoff(int u, int p) { return (u >> 3) * 256 + (u & 7) * 32 + 16 * p; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
        lut_qpiece<L>(r.q, p, q); d = r.d; m = -128.f * r.d;
    }
};

// ---- 256-element K-quants ---------------------------------------------------------------------
// Q2_K / Q3_K / Q6_K units: (superblock sb, half h, sixteen-byte slice s), 4 units per superblock.
struct TQ2_K {
    static constexpr int UE = 64, NP = 4, BLOCK = 256;
    struct Raw { V16 q; u32 sc; float d, dmin; };  // sc: the 4 scale bytes 8h+s+2j, j = 0..3
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        const int h = (u >> 1) & 1, s = u & 1;
        r.q = ld16(m.qs + sb * 64 + 32 * h + 16 * s);
        const u32 lo = ld32(m.sc + sb * 16 + 8 * h), hi = ld32(m.sc + sb * 16 + 8 * h + 4);
        // bytes 8h+s, 8h+s+2, 8h+s+4, 8h+s+6
        const u32 a = (lo >> (8 * s)) & 0xFFu, b = (lo >> (8 * (s + 2))) & 0xFFu;
        const u32 c = (hi >> (8 * s)) & 0xFFu, e = (hi >> (8 * (s + 2))) & 0xFFu;
        r.sc = a | (b << 8) | (c << 16) | (e << 24);
        const u32 dm = ld32(m.d + sb * 4);
        r.d = h2f((u16)(dm & 0xFFFFu));
        r.dmin = h2f((u16)(dm >> 16));
    }
    static HD int xoff(int u, int p) { return (u >> 2) * 256 + ((u >> 1) & 1) * 128 + 32 * p + 16 * (u & 1); }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
        const u32 sc = (r.sc >> (8 * p)) & 0xFFu;
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = qf((byte_of(r.q, i) >> (2 * p)) & 3u);
        d = r.d * qf(sc & 0xF); m = -(r.dmin * qf(sc >> 4));
    }
};

HD u32 byte_rt(const V16& v, int i) {  // byte i (run-time, 0..15) by selects, not array indexing
    const u32 w = i < 4 ? v.w[0] : i < 8 ? v.w[1] : i < 12 ? v.w[2] : v.w[3];
    return (w >> (8 * (i & 3))) & 0xFFu;
}

HD int q3k_scale(const V16& s12, int i) {  // the i-th of 16 six-bit scales, minus 32
    const int lo = (int)(i < 8 ? (byte_rt(s12, i) & 0xF) : (byte_rt(s12, i - 8) >> 4));
    const int hi = (int)(byte_rt(s12, 8 + (i & 3)) >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

struct TQ3_K {
    static constexpr int UE = 64, NP = 4, BLOCK = 256;
    struct Raw { V16 q, hm; float dl[4]; int h; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        const int h = (u >> 1) & 1, s = u & 1;
        r.q = ld16(m.qs + sb * 64 + 32 * h + 16 * s);
        r.hm = ld16(m.qh + sb * 32 + 16 * s);
        const V16 s12 = ld16(m.sc + sb * 16);  // scales12, d
        const float d = h2f((u16)(s12.w[3] & 0xFFFFu));
#pragma unroll
        for (int j = 0; j < 4; ++j) r.dl[j] = d * (float)q3k_scale(s12, 8 * h + 2 * j + s);
        r.h = h;
    }
    static HD int xoff(int u, int p) { return (u >> 2) * 256 + ((u >> 1) & 1) * 128 + 32 * p + 16 * (u & 1); }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
        const int bit = 4 * r.h + p;  // value = dl * (low2 - (high bit ? 0 : 4)) = dl * (low2 + 4 high) - 4 dl
#pragma unroll
        for (int i = 0; i < 16; ++i)
            q[i] = qf(((byte_of(r.q, i) >> (2 * p)) & 3u) | (((byte_of(r.hm, i) >> bit) & 1u) << 2));
        d = r.dl[p]; m = -4.f * r.dl[p];
    }
};

// ggml's get_scale_min_k4 from the three words of scales[12] (w1 = bytes 0-3, w2 = 4-7, w3 = 8-11),
// for a run-time j in 0..7: shifts and selects on registers only.
HD void k4_scale_min(u32 w1, u32 w2, u32 w3, int j, int& sc, int& mn) {
    const int lo = 8 * (j & 3);
    const int sc_lo = (int)((w1 >> lo) & 63), mn_lo = (int)((w2 >> lo) & 63);
    const int sc_hi = (int)(((w3 >> lo) & 0xF) | (((w1 >> (lo + 6)) & 3) << 4));
    const int mn_hi = (int)(((w3 >> (lo + 4)) & 0xF) | (((w2 >> (lo + 6)) & 3) << 4));
    sc = j < 4 ? sc_lo : sc_hi;
    mn = j < 4 ? mn_lo : mn_hi;
}

// Q4_K / Q5_K units: (superblock sb, 64-group g, slice s), 8 units per superblock; piece 0 is the
// low nibbles (sub-block 2g), piece 1 the high nibbles (sub-block 2g+1).
struct TQ4_K {
    static constexpr int UE = 32, NP = 2, BLOCK = 256;
    struct Raw { V16 q; float d[2], m[2]; };
    static HD V16 load_q(const Mat& m, long sb, int g, int s) {  // unit (sb, g, s)'s 16 quant bytes
        return ld16(m.qs + sb * 128 + 32 * g + 16 * s);
    }
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 3);
        const int g = (u >> 1) & 3, s = u & 1;
        r.q = load_q(m, sb, g, s);
        const V16 hv = ld16(m.sc + sb * 16);  // d, dmin, scales12: one 16-byte load
        const float d = h2f((u16)(hv.w[0] & 0xFFFFu)), dmin = h2f((u16)(hv.w[0] >> 16));
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            int sc, mn; k4_scale_min(hv.w[1], hv.w[2], hv.w[3], 2 * g + k, sc, mn);
            r.d[k] = d * qf((u32)sc); r.m[k] = dmin * qf((u32)mn);
        }
    }
    static HD int xoff(int u, int p) { return (u >> 3) * 256 + ((u >> 1) & 3) * 64 + 32 * p + 16 * (u & 1); }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = qf((byte_of(r.q, i) >> (4 * p)) & 0xF);
        d = r.d[p]; m = -r.m[p];
    }
};

struct TQ5_K {
    static constexpr int UE = 32, NP = 2, BLOCK = 256;
    struct Raw { V16 q, qh; float d[2], m[2]; int g; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 3);
        const int g = (u >> 1) & 3, s = u & 1;
        r.q = ld16(m.qs + sb * 128 + 32 * g + 16 * s);
        r.qh = ld16(m.qh + sb * 32 + 16 * s);
        const V16 hv = ld16(m.sc + sb * 16);  // d, dmin, scales12: one 16-byte load
        const float d = h2f((u16)(hv.w[0] & 0xFFFFu)), dmin = h2f((u16)(hv.w[0] >> 16));
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            int sc, mn; k4_scale_min(hv.w[1], hv.w[2], hv.w[3], 2 * g + k, sc, mn);
            r.d[k] = d * qf((u32)sc); r.m[k] = dmin * qf((u32)mn);
        }
        r.g = g;
    }
    static HD int xoff(int u, int p) { return (u >> 3) * 256 + ((u >> 1) & 3) * 64 + 32 * p + 16 * (u & 1); }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
        const int bit = 2 * r.g + p;
#pragma unroll
        for (int i = 0; i < 16; ++i)
            q[i] = qf(((byte_of(r.q, i) >> (4 * p)) & 0xF) | (((byte_of(r.qh, i) >> bit) & 1u) << 4));
        d = r.d[p]; m = -r.m[p];
    }
};

struct TQ6_K {
    static constexpr int UE = 64, NP = 4, BLOCK = 256;
    struct Raw { V16 la, lb, qh; float dl[4]; };
    // unit u's quants: low nibbles of pieces 0 / 2 (la) and 1 / 3 (lb), high bits (qh); superblock sb
    static HD void load_q(const Mat& m, long sb, int u, V16& la, V16& lb, V16& qh) {
        const int h = (u >> 1) & 1, s = u & 1;
        const u8* ql = m.qs + sb * 128 + 64 * h + 16 * s;
        la = ld16(ql);
        lb = ld16(ql + 32);
        qh = ld16(m.qh + sb * 64 + 32 * h + 16 * s);
    }
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 2);
        const int h = (u >> 1) & 1, s = u & 1;
        load_q(m, sb, u, r.la, r.lb, r.qh);
        const V16 scv = ld16(m.sc + sb * 16);
        const float d = h2f(ld16bits(m.d + sb * 2));
#pragma unroll
        for (int j = 0; j < 4; ++j) r.dl[j] = d * (float)(i8)byte_rt(scv, 8 * h + s + 2 * j);
    }
    static HD int xoff(int u, int p) { return (u >> 2) * 256 + ((u >> 1) & 1) * 128 + 16 * (u & 1) + 32 * p; }
    static HD void qpiece(const Raw& r, int p, float* q, float& d, float& m) {
        const V16& l = (p & 1) ? r.lb : r.la;
#pragma unroll
        for (int i = 0; i < 16; ++i)
            q[i] = qf(((byte_of(l, i) >> (4 * (p >> 1))) & 0xF) | (((byte_of(r.qh, i) >> (2 * p)) & 3u) << 4));
        d = r.dl[p]; m = -32.f * r.dl[p];
    }
};

// ---- float types: a unit is 16 consecutive weights --------------------------------------------
struct TF32 {
    static constexpr int UE = 16, NP = 1, BLOCK = 1;
    struct Raw { V16 v[4]; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const u8* p = m.qs + ((long)row * m.nb + (long)u * 16) * 4;
#pragma unroll
        for (int i = 0; i < 4; ++i) r.v[i] = ld16(p + 16 * i);
    }
    static HD int xoff(int u, int) { return u * 16; }
    static HD void qpiece(const Raw& r, int, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = u2f(r.v[i >> 2].w[i & 3]);
        d = 1.f; m = 0.f;
    }
};

struct TF16 {
    static constexpr int UE = 16, NP = 1, BLOCK = 1;
    struct Raw { V16 v[2]; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const u8* p = m.qs + ((long)row * m.nb + (long)u * 16) * 2;
        r.v[0] = ld16(p); r.v[1] = ld16(p + 16);
    }
    static HD int xoff(int u, int) { return u * 16; }
    static HD void qpiece(const Raw& r, int, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = h2f((u16)(r.v[i >> 3].w[(i >> 1) & 3] >> (16 * (i & 1))));
        d = 1.f; m = 0.f;
    }
};

struct TBF16 {
    static constexpr int UE = 16, NP = 1, BLOCK = 1;
    struct Raw { V16 v[2]; };
    static HD void load(const Mat& m, int row, int u, Raw& r) {
        const u8* p = m.qs + ((long)row * m.nb + (long)u * 16) * 2;
        r.v[0] = ld16(p); r.v[1] = ld16(p + 16);
    }
    static HD int xoff(int u, int) { return u * 16; }
    static HD void qpiece(const Raw& r, int, float* q, float& d, float& m) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = bf2f((u16)(r.v[i >> 3].w[(i >> 1) & 3] >> (16 * (i & 1))));
        d = 1.f; m = 0.f;
    }
};

// The 16 dequantized weights of piece p: w = d * q + m.
template <class T>
HD void piece(const typename T::Raw& r, int p, float* w) {
    float q[16], d, m;
    T::qpiece(r, p, q, d, m);
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = fmaf(d, q[i], m);
}

#include "quant_iq.cuh"  // the 1- to 3-bit i-quants
