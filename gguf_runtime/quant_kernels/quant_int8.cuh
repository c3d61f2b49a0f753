// Integer decoding for dp4a products with int8 activations (the q8 matvec path, matvec_q8.cuh).
//
//   I8<T>::words(raw, p, q[4], d, m)   piece p of a unit as 16 signed bytes (4 words, byte i of the
//                                      piece = byte i & 3 of word i >> 2) with weight i = d * q[i] + m
//   quant16(v, q[4], d, s)             16 activations to int8: d = max|v| / 127, q = rint(v / d)
//                                      (as v * (127 / max|v|)), s = d * sum(q)
//   quant16_rest(v, q, d, q2, d2, s)   the rounding error v - d q as a second int8 piece (q8_res)
//
// Then sum_i w_i x_i = d_w d_x dot(q_w, q_x) + m_w s_x: one dp4a per four weights and two float
// operations per sixteen, where the f32 path spends about four instructions per weight. The
// integer sums are exact; tests/test_quant_decode.py checks words() and quant16() on the CPU
// against numpy (reference_q8.py mirrors quant16 bit for bit).
#pragma once
#include "quant_types.cuh"
#ifndef __CUDACC_RTC__
#include <cmath>
#endif

HD int dp4a(u32 a, u32 b, int c) {  // c + sum of the four signed byte products
#ifdef __CUDA_ARCH__
    int r; asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
#else
    for (int k = 0; k < 4; ++k) c += (int)(i8)((a >> (8 * k)) & 0xFFu) * (int)(i8)((b >> (8 * k)) & 0xFFu);
    return c;
#endif
}

HD float i2f_small(int s) { return u2f((u32)(s + 0x4B400000)) - 12582912.f; }  // (float)s for |s| < 2^22

HD float mul_rn(float a, float b) {  // never contracted into an FMA (quant16 must equal numpy's float32)
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

HD u32 f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    u32 u; memcpy(&u, &f, 4); return u;
#endif
}

constexpr float Q8_MIN_AMAX = 1e-30f;  // below: the piece quantizes to zeros (127 / amax stays finite)

// A piece's step d and its inverse from its largest magnitude (every quantizer: quant16, the q8
// epilogue of matvec_block.cuh, layers.cu's rmsnorm; all must agree with numpy bit for bit).
HD void q8_step(float amax, float& inv, float& d) {
    const bool live = amax >= Q8_MIN_AMAX;
    inv = live ? 127.f / amax : 0.f;
    d = live ? amax / 127.f : 0.f;
}

// rint(v * inv) by the 1.5 * 2^23 trick (round to nearest even, like np.rint): the float's bits,
// whose low byte is the int8 and whose value less 0x4B400000 is the integer (q8_int).
HD u32 q8_bits(float v, float inv) { return f2u(add_rn(mul_rn(v, inv), 12582912.f)); }
HD int q8_int(u32 bits) { return (int)(bits - 0x4B400000u); }

HD void quant16(const float* v, u32 (&q)[4], float& d, float& s) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
    float inv;
    q8_step(amax, inv, d);
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 w = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 bits = q8_bits(v[4 * j + k], inv);
            sum += q8_int(bits);
            w |= (bits & 0xFFu) << (8 * k);
        }
        q[j] = w;
    }
    s = d * (float)sum;
}

// The rest of a piece (Tuning.q8_res): what rounding to d q left, r = v - d q (numpy's float32
// product, then difference), quantized as the piece was into q2 with step d2; s becomes d sum(q) +
// d2 sum(q2). A matvec multiplies d q + d2 q2: about 15 bits a value instead of 8 (Gemma-3's
// activations have outlier channels that leave a 16-value piece few steps for the rest).
HD float q8_rest(float v, float d, u32 bits) { return add_rn(v, -mul_rn(d, (float)q8_int(bits))); }

HD void quant16_rest(const float* v, const u32 (&q)[4], float d, u32 (&q2)[4], float& d2, float& s) {
    float r[16], amax = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int qi = (int)(i8)((q[i >> 2] >> (8 * (i & 3))) & 0xFFu);
        r[i] = add_rn(v[i], -mul_rn(d, (float)qi));
        amax = fmaxf(amax, fabsf(r[i]));
    }
    float inv;
    q8_step(amax, inv, d2);
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 w = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 bits = q8_bits(r[4 * j + k], inv);
            sum += q8_int(bits);
            w |= (bits & 0xFFu) << (8 * k);
        }
        q2[j] = w;
    }
    s = add_rn(s, mul_rn(d2, (float)sum));
}

HD float sumsq16(const float* v) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) s = fmaf(v[i], v[i], s);
    return s;
}

template <class T> struct I8;

HD void nib_words(const V16& v, int shift, u32 (&q)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = (v.w[j] >> shift) & 0x0F0F0F0Fu;
}

// The four high bits (bit 4) of word j of a Q5_0/Q5_1 piece: bits 16p + 4j .. + 3 of qh, spread to
// bit 4 of each byte by one multiply (the four shifted copies do not overlap).
HD u32 q5_high(u32 h, int p, int j) { return (((h >> (16 * p + 4 * j)) & 0xFu) * 0x2040810u) & 0x10101010u; }

template <> struct I8<TQ4_0> {
    static HD void words(const TQ4_0::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        nib_words(r.q, 4 * p, q); d = r.d; m = -8.f * r.d;
    }
};
template <> struct I8<TQ4_1> {
    static HD void words(const TQ4_1::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        nib_words(r.q, 4 * p, q); d = r.d; m = r.m;
    }
};
template <> struct I8<TQ5_0> {
    static HD void words(const TQ5_0::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        nib_words(r.q, 4 * p, q);
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] |= q5_high(r.h, p, j);
        d = r.d; m = -16.f * r.d;
    }
};
template <> struct I8<TQ5_1> {
    static HD void words(const TQ5_1::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        nib_words(r.q, 4 * p, q);
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] |= q5_high(r.h, p, j);
        d = r.d; m = r.m;
    }
};
template <> struct I8<TQ8_0> {
    static HD void words(const TQ8_0::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] = r.q[p].w[j];  // already signed bytes
        d = r.d; m = 0.f;
    }
};
template <class T> struct I8Lut {  // MXFP4, IQ4_NL, IQ4_XS: the table's signed bytes
    static HD void words(const typename T::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        lut_words<typename T::L>(r.q, p, q); d = r.d; m = 0.f;
    }
};
template <> struct I8<TMXFP4> : I8Lut<TMXFP4> {};
template <> struct I8<TIQ4_NL> : I8Lut<TIQ4_NL> {};
template <> struct I8<TIQ4_XS> : I8Lut<TIQ4_XS> {};
template <class T> struct I8Iq {  // the i-quants: their pieces are signed bytes already
    static HD void words(const typename T::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        T::sbytes(r, p, q, d); m = 0.f;
    }
};
template <> struct I8<TIQ2_XXS> : I8Iq<TIQ2_XXS> {};
template <> struct I8<TIQ2_XS> : I8Iq<TIQ2_XS> {};
template <> struct I8<TIQ2_S> : I8Iq<TIQ2_S> {};
template <> struct I8<TIQ3_XXS> : I8Iq<TIQ3_XXS> {};
template <> struct I8<TIQ3_S> : I8Iq<TIQ3_S> {};
template <> struct I8<TIQ1_S> : I8Iq<TIQ1_S> {};
template <> struct I8<TIQ1_M> : I8Iq<TIQ1_M> {};
template <> struct I8<TQ2_K> {
    static HD void words(const TQ2_K::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        const u32 sc = (r.sc >> (8 * p)) & 0xFFu;
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] = (r.q.w[j] >> (2 * p)) & 0x03030303u;
        d = r.d * qf(sc & 0xF); m = -(r.dmin * qf(sc >> 4));
    }
};
template <> struct I8<TQ3_K> {
    static HD void words(const TQ3_K::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        const int bit = 4 * r.h + p;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            q[j] = ((r.q.w[j] >> (2 * p)) & 0x03030303u) | (((r.hm.w[j] >> bit) & 0x01010101u) << 2);
        d = r.dl[p]; m = -4.f * r.dl[p];
    }
};
template <> struct I8<TQ4_K> {
    static HD void words(const TQ4_K::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        nib_words(r.q, 4 * p, q); d = r.d[p]; m = -r.m[p];
    }
};
template <> struct I8<TQ5_K> {
    static HD void words(const TQ5_K::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        const int bit = 2 * r.g + p;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            q[j] = ((r.q.w[j] >> (4 * p)) & 0x0F0F0F0Fu) | (((r.qh.w[j] >> bit) & 0x01010101u) << 4);
        d = r.d[p]; m = -r.m[p];
    }
};
template <> struct I8<TQ6_K> {
    static HD void words(const TQ6_K::Raw& r, int p, u32 (&q)[4], float& d, float& m) {
        const V16& l = (p & 1) ? r.lb : r.la;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            q[j] = ((l.w[j] >> (4 * (p >> 1))) & 0x0F0F0F0Fu) | (((r.qh.w[j] >> (2 * p)) & 0x03030303u) << 4);
        d = r.dl[p]; m = -32.f * r.dl[p];
    }
};
