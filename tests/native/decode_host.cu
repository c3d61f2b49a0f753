// Host build of the kernels' per-type decoders (quant_types.cuh, quant_int8.cuh), for CPU tests
// against numpy.
#include "quant_int8.cuh"

template <class T>
static void decode(const Mat& m, int rows, int K, float* out) {
    const int units = K / T::UE;
    for (int row = 0; row < rows; ++row)
        for (int u = 0; u < units; ++u) {
            typename T::Raw r;
            T::load(m, row, u, r);
            for (int p = 0; p < T::NP; ++p) {
                float w[16];
                piece<T>(r, p, w);
                for (int i = 0; i < 16; ++i) out[(long)row * K + T::xoff(u, p) + i] = w[i];
            }
        }
}

extern "C" int decode_rows(int type, const u8* qs, const u8* qh, const u8* sc, const u8* d,
                           int rows, int K, float* out) {
    Mat m{qs, qh, sc, d, 0};
    switch (type) {
#define CASE(id, T) case id: m.nb = K / T::BLOCK; decode<T>(m, rows, K, out); return 0;
        CASE(0, TF32) CASE(1, TF16) CASE(30, TBF16)
        CASE(2, TQ4_0) CASE(3, TQ4_1) CASE(6, TQ5_0) CASE(7, TQ5_1) CASE(8, TQ8_0)
        CASE(10, TQ2_K) CASE(11, TQ3_K) CASE(12, TQ4_K) CASE(13, TQ5_K) CASE(14, TQ6_K)
        CASE(39, TMXFP4) CASE(20, TIQ4_NL) CASE(23, TIQ4_XS)
        CASE(16, TIQ2_XXS) CASE(17, TIQ2_XS) CASE(22, TIQ2_S) CASE(18, TIQ3_XXS) CASE(21, TIQ3_S)
        CASE(19, TIQ1_S) CASE(29, TIQ1_M)
#undef CASE
    }
    return -1;
}

// The integer decoding of the q8 path: weight = d * (signed byte) + m.
template <class T>
static void decode_i8(const Mat& m, int rows, int K, float* out) {
    for (int row = 0; row < rows; ++row)
        for (int u = 0; u < K / T::UE; ++u) {
            typename T::Raw r;
            T::load(m, row, u, r);
            for (int p = 0; p < T::NP; ++p) {
                u32 q[4]; float d, mo;
                I8<T>::words(r, p, q, d, mo);
                for (int i = 0; i < 16; ++i)
                    out[(long)row * K + T::xoff(u, p) + i] = fmaf(d, (float)(i8)((q[i >> 2] >> (8 * (i & 3))) & 0xFFu), mo);
            }
        }
}

extern "C" int decode_rows_i8(int type, const u8* qs, const u8* qh, const u8* sc, const u8* d,
                              int rows, int K, float* out) {
    Mat m{qs, qh, sc, d, 0};
    switch (type) {
#define CASE(id, T) case id: m.nb = K / T::BLOCK; decode_i8<T>(m, rows, K, out); return 0;
        CASE(2, TQ4_0) CASE(3, TQ4_1) CASE(6, TQ5_0) CASE(7, TQ5_1) CASE(8, TQ8_0)
        CASE(10, TQ2_K) CASE(11, TQ3_K) CASE(12, TQ4_K) CASE(13, TQ5_K) CASE(14, TQ6_K)
        CASE(39, TMXFP4) CASE(20, TIQ4_NL) CASE(23, TIQ4_XS)
        CASE(16, TIQ2_XXS) CASE(17, TIQ2_XS) CASE(22, TIQ2_S) CASE(18, TIQ3_XXS) CASE(21, TIQ3_S)
        CASE(19, TIQ1_S) CASE(29, TIQ1_M)
#undef CASE
    }
    return -1;
}

// quant16 over n values (n % 16 == 0): q (n bytes), d and s (n / 16 each); and one dp4a sum.
extern "C" void quant_rows(const float* x, int n, u8* q, float* d, float* s) {
    for (int j = 0; j < n / 16; ++j) {
        u32 w[4];
        quant16(x + 16 * j, w, d[j], s[j]);
        memcpy(q + 16 * j, w, 16);
    }
}

// ... with rests (quant16_rest): q2 (n bytes) and d2 (n / 16) too; s covers both.
extern "C" void quant_rows_rest(const float* x, int n, u8* q, float* d, float* s, u8* q2, float* d2) {
    for (int j = 0; j < n / 16; ++j) {
        u32 w[4], w2[4];
        quant16(x + 16 * j, w, d[j], s[j]);
        quant16_rest(x + 16 * j, w, d[j], w2, d2[j], s[j]);
        memcpy(q + 16 * j, w, 16);
        memcpy(q2 + 16 * j, w2, 16);
    }
}

extern "C" int dp4a_host(u32 a, u32 b, int c) { return dp4a(a, b, c); }
