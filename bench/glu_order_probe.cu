// The GLU stand-ins of bench/glu_order_probe.py (compiled there by NVRTC, quant_kernels/ on the
// include path): layouts, inner loops and the glu_like kernel; see the probe's docstring.
#include "matvec.cu"
// TQ4_K with a block-contiguous order: round (u / 32) of the 16 rows of block (row / 16) is one
// run of 16 x 512 quant bytes and one of 16 x 64 scale bytes (the same bytes as TQ4_K's planes).
struct TQ4_KP : TQ4_K {
    static DEV void load(const Mat& m, int row, int u, Raw& r) {
        const long chunk = ((long)(row >> 4) * (m.nb / 4) + (u >> 5)) * 16 + (row & 15);
        r.q = ld16(m.qs + chunk * 512 + (u & 31) * 16);
        const V16 hv = ld16(m.sc + chunk * 64 + ((u & 31) >> 3) * 16);
        const int g = (u >> 1) & 3;
        const float d = h2f((u16)(hv.w[0] & 0xFFFFu)), dmin = h2f((u16)(hv.w[0] >> 16));
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            int sc, mn; k4_scale_min(hv.w[1], hv.w[2], hv.w[3], 2 * g + k, sc, mn);
            r.d[k] = d * qf((u32)sc); r.m[k] = dmin * qf((u32)mn);
        }
    }
};
template <> struct I8<TQ4_KP> : I8<TQ4_K> {};
// TQ4_K with its 12 scale bytes transposed: byte g of words 1, 2, 3 of the 16-byte block hold the
// 24 bits of 64-group g (sc[2g] | sc[2g+1] << 6 | mn[2g] << 12 | mn[2g+1] << 18), so a unit's two
// scales and mins are two byte permutes and four 6-bit fields away (k4_scale_min: about 25 each).
struct TQ4_KS : TQ4_K {
    static DEV void load(const Mat& m, int row, int u, Raw& r) {
        const long sb = (long)row * m.nb + (u >> 3);
        const int g = (u >> 1) & 3;
        r.q = ld16(m.qs + sb * 128 + 16 * (u & 7));
        const V16 hv = ld16(m.sc + sb * 16);
        const float d = h2f((u16)(hv.w[0] & 0xFFFFu)), dmin = h2f((u16)(hv.w[0] >> 16));
        const u32 f = __byte_perm(__byte_perm(hv.w[1], hv.w[2], g | (g + 4) << 4), hv.w[3], 0x10 | (g + 4) << 8);
        r.d[0] = d * qf(f & 63); r.d[1] = d * qf((f >> 6) & 63);
        r.m[0] = dmin * qf((f >> 12) & 63); r.m[1] = dmin * qf((f >> 18) & 63);
    }
};
template <> struct I8<TQ4_KS> : I8<TQ4_K> {};
// TQ4_K in the GGUF file's own order: each superblock's 16 bytes of d, dmin and scales, then its
// 128 quant bytes (144 bytes, 16-byte aligned), all in one plane (qs): a warp's round is one run
// of 576 bytes per row instead of 512 quant bytes in one plane and 64 scale bytes in another.
struct TQ4_KI : TQ4_K {
    static DEV void load(const Mat& m, int row, int u, Raw& r) {
        const u8* b = m.qs + ((long)row * m.nb + (u >> 3)) * 144;
        const int g = (u >> 1) & 3;
        r.q = ld16(b + 16 + 16 * (u & 7));
        const V16 hv = ld16(b);
        const float d = h2f((u16)(hv.w[0] & 0xFFFFu)), dmin = h2f((u16)(hv.w[0] >> 16));
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            int sc, mn; k4_scale_min(hv.w[1], hv.w[2], hv.w[3], 2 * g + k, sc, mn);
            r.d[k] = d * qf((u32)sc); r.m[k] = dmin * qf((u32)mn);
        }
    }
};
template <> struct I8<TQ4_KI> : I8<TQ4_K> {};

// the bytes TQ4_K(P)::load reads, by the type's order (tag dispatch: NVRTC has no <type_traits>)
DEV void raw_v16(const TQ4_K*, const Mat& m, int row, int u, V16& q, V16& s) {
    q = ld16(m.qs + ((long)row * m.nb + (u >> 3)) * 128 + 16 * (u & 7));
    s = ld16(m.sc + ((long)row * m.nb + (u >> 3)) * 16);
}
DEV void raw_v16(const TQ4_KI*, const Mat& m, int row, int u, V16& q, V16& s) {
    const u8* b = m.qs + ((long)row * m.nb + (u >> 3)) * 144;
    q = ld16(b + 16 + 16 * (u & 7));
    s = ld16(b);
}
DEV void raw_v16(const TQ4_KP*, const Mat& m, int row, int u, V16& q, V16& s) {
    const long chunk = ((long)(row >> 4) * (m.nb / 4) + (u >> 5)) * 16 + (row & 15);
    q = ld16(m.qs + chunk * 512 + (u & 31) * 16);
    s = ld16(m.sc + chunk * 64 + ((u & 31) >> 3) * 16);
}

// mmv_block_q8 (B = 1, R = 2, WG = 1, no norm) with the unit count known at compile time: the
// rounds unrolled, their addresses immediate offsets (the 8B's 4,096 columns: 4 rounds).
template <class T, int UNITS>
DEV void mmv_q8_fixed(const Mat (&m)[2], const int (&row)[2], const XQ& xq, float (&acc)[2][1]) {
    const int tid = threadIdx.x & 31;
    acc[0][0] = acc[1][0] = 0.f;
    typename T::Raw raw[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) T::load(m[r], row[r], tid, raw[r]);
    pdl_enter();
#pragma unroll
    for (int i = 0; i < UNITS / 32; ++i) {
        const int u = tid + 32 * i;
#pragma unroll
        for (int p = 0; p < T::NP; ++p) {
            const int off = T::xoff(u, p);
            const uint4 xv = *reinterpret_cast<const uint4*>(xq.q + off);
            const float4 xs = xq.s[off >> 4];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                u32 q[4]; float d, mo;
                I8<T>::words(raw[r], p, q, d, mo);
                const int s = dp4a(q[3], xv.w, dp4a(q[2], xv.z, dp4a(q[1], xv.y, dp4a(q[0], xv.x, 0))));
                acc[r][0] = fmaf(d * xs.x, i2f_small(s), fmaf(mo, xs.y, acc[r][0]));
            }
        }
        if (i + 1 < UNITS / 32)
#pragma unroll
            for (int r = 0; r < 2; ++r) T::load(m[r], row[r], u + 32, raw[r]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) acc[r][0] = warp_sum(acc[r][0]);
}

// dp4a with the scales another way (Q4_K, K <= 8,192: a row's superblocks fit one load per lane):
// SMODE 0: each lane loads superblock (lane) of each row once, before pdl_enter (one coalesced
// 16-byte load per lane), and a round takes its superblock's bytes by shuffles; 1: no scales at
// all (constants: the bound for any scale layout).
DEV void sc_decode(const TQ4_K*, const V16& hv, int g, float (&d)[2], float (&mo)[2]) {
    const float dd = h2f((u16)(hv.w[0] & 0xFFFFu)), dmin = h2f((u16)(hv.w[0] >> 16));
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        int sc, mn; k4_scale_min(hv.w[1], hv.w[2], hv.w[3], 2 * g + k, sc, mn);
        d[k] = dd * qf((u32)sc); mo[k] = -dmin * qf((u32)mn);
    }
}
DEV void sc_decode(const TQ4_KS*, const V16& hv, int g, float (&d)[2], float (&mo)[2]) {
    const float dd = h2f((u16)(hv.w[0] & 0xFFFFu)), dmin = h2f((u16)(hv.w[0] >> 16));
    const u32 f = __byte_perm(__byte_perm(hv.w[1], hv.w[2], g | (g + 4) << 4), hv.w[3], 0x10 | (g + 4) << 8);
    d[0] = dd * qf(f & 63); d[1] = dd * qf((f >> 6) & 63);
    mo[0] = -dmin * qf((f >> 12) & 63); mo[1] = -dmin * qf((f >> 18) & 63);
}

template <class T, int SMODE>
DEV void mmv_q8_sc(const Mat (&m)[2], const int (&row)[2], int K, const XQ& xq, float (&acc)[2][1]) {
    const int lane = threadIdx.x & 31, units = K / 32, nb = K / 256;
    acc[0][0] = acc[1][0] = 0.f;
    V16 q[2], sv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        q[r] = ld16(m[r].qs + ((long)row[r] * nb + (lane >> 3)) * 128 + 16 * (lane & 7));
        if (SMODE == 0) sv[r] = lane < nb ? ld16(m[r].sc + ((long)row[r] * nb + lane) * 16) : V16{{0u, 0u, 0u, 0u}};
    }
    pdl_enter();
    int src = lane >> 3;
    for (int u = lane; u < units; u += 32, src += 4) {
        float d[2][2], mo[2][2];
        const int g = (u >> 1) & 3;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (SMODE == 0) {
                V16 hv;
#pragma unroll
                for (int w = 0; w < 4; ++w) hv.w[w] = __shfl_sync(0xffffffffu, sv[r].w[w], src);
                sc_decode((const T*)nullptr, hv, g, d[r], mo[r]);
            } else {
                d[r][0] = d[r][1] = 0.01f; mo[r][0] = mo[r][1] = -0.5f;
            }
        }
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int off = TQ4_K::xoff(u, p);
            const uint4 xv = *reinterpret_cast<const uint4*>(xq.q + off);
            const float4 xs = xq.s[off >> 4];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                u32 w[4]; nib_words(q[r], 4 * p, w);
                const int s = dp4a(w[3], xv.w, dp4a(w[2], xv.z, dp4a(w[1], xv.y, dp4a(w[0], xv.x, 0))));
                acc[r][0] = fmaf(d[r][p] * xs.x, i2f_small(s), fmaf(mo[r][p], xs.y, acc[r][0]));
            }
        }
        if (u + 32 < units)
#pragma unroll
            for (int r = 0; r < 2; ++r) q[r] = ld16(m[r].qs + ((long)row[r] * nb + ((u + 32) >> 3)) * 128 + 16 * (lane & 7));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) acc[r][0] = warp_sum(acc[r][0]);
}

// ... or (SMODE 2) the warp's two rows' scale bytes copied to shared memory by cp.async before
// pdl_enter (K = 4,096: 16 superblocks a row, one 16-byte copy per lane), a round reading its own.
template <class T>
DEV void mmv_q8_smem(const Mat (&m)[2], const int (&row)[2], int K, const XQ& xq, float (&acc)[2][1]) {
    __shared__ __align__(16) V16 hs[16][2][16];  // [warp][row][superblock]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, units = K / 32, nb = K / 256;
    acc[0][0] = acc[1][0] = 0.f;
    V16 q[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) q[r] = ld16(m[r].qs + ((long)row[r] * nb + (lane >> 3)) * 128 + 16 * (lane & 7));
    {
        const int r = lane >> 4, sb = lane & 15;
        u64 dst;
        asm("cvta.to.shared.u64 %0, %1;" : "=l"(dst) : "l"(&hs[warp][r][sb]));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)dst), "l"(m[r].sc + ((long)row[r] * nb + sb) * 16));
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    pdl_enter();
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncwarp();
    for (int u = lane; u < units; u += 32) {
        float d[2][2], mo[2][2];
        const int g = (u >> 1) & 3;
#pragma unroll
        for (int r = 0; r < 2; ++r) sc_decode((const T*)nullptr, hs[warp][r][u >> 3], g, d[r], mo[r]);
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int off = TQ4_K::xoff(u, p);
            const uint4 xv = *reinterpret_cast<const uint4*>(xq.q + off);
            const float4 xs = xq.s[off >> 4];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                u32 w[4]; nib_words(q[r], 4 * p, w);
                const int s = dp4a(w[3], xv.w, dp4a(w[2], xv.z, dp4a(w[1], xv.y, dp4a(w[0], xv.x, 0))));
                acc[r][0] = fmaf(d[r][p] * xs.x, i2f_small(s), fmaf(mo[r][p], xs.y, acc[r][0]));
            }
        }
        if (u + 32 < units)
#pragma unroll
            for (int r = 0; r < 2; ++r) q[r] = ld16(m[r].qs + ((long)row[r] * nb + ((u + 32) >> 3)) * 128 + 16 * (lane & 7));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) acc[r][0] = warp_sum(acc[r][0]);
}

// MODE 0: loads, xor; 1: TQ4_K::load (scale decode), xor; 2: mmv_block_q8 and SiLU (no epilogue);
// 3: mmv_q8_fixed (K = 4,096) and SiLU; 4: as 0, the quant loads only (no scales);
// 5: as 2 with gate and up rows alternating in one matrix (qs0: 2 N rows, gate i = row 2 i);
// 6, 7: mmv_q8_sc<0> (scales by shuffles), mmv_q8_sc<1> (no scales) and SiLU; 8: mmv_q8_smem.
template <class T, int MODE>
__global__ void __launch_bounds__(512) glu_like(const u8* qs0, const u8* sc0, const u8* qs1, const u8* sc1, int K,
                                                const u8* xq, const float4* xs, float* y) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row = blockIdx.x * 16 + warp, units = K / 32;
    if (MODE == 5) { qs1 = qs0; sc1 = sc0; }
    const Mat m[2] = {Mat{qs0, nullptr, sc0, nullptr, K / 256}, Mat{qs1, nullptr, sc1, nullptr, K / 256}};
    const int rows[2] = {MODE == 5 ? 2 * row : row, MODE == 5 ? 2 * row + 1 : row};
    float out;
    if constexpr (MODE == 2 || MODE == 3 || MODE >= 5) {
        float acc[2][1];
        if constexpr (MODE == 8) mmv_q8_smem<T>(m, rows, K, XQ{xq, K, xs, K / 16, 0, 0.f}, acc);
        else if constexpr (MODE >= 6) mmv_q8_sc<T, MODE - 6>(m, rows, K, XQ{xq, K, xs, K / 16, 0, 0.f}, acc);
        else if constexpr (MODE == 3) mmv_q8_fixed<T, 128>(m, rows, XQ{xq, K, xs, K / 16, 0, 0.f}, acc);
        else mmv_block_q8<T, 1, 2, 1>(m, rows, K, XQ{xq, K, xs, K / 16, 0, 0.f}, acc);
        out = silu_f(acc[0][0]) * acc[1][0];
    } else {
        u32 s = 0;
        V16 q[2], sc[2];
        typename T::Raw raw[2];
        auto ld = [&](int u) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if constexpr (MODE == 0 || MODE == 4) raw_v16((const T*)nullptr, m[r], row, u, q[r], sc[r]);
                else T::load(m[r], row, u, raw[r]);
            }
        };
        ld(lane);
        pdl_enter();
        for (int u = lane; u < units; u += 32) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if constexpr (MODE == 0) s ^= q[r].w[0] ^ q[r].w[1] ^ q[r].w[2] ^ q[r].w[3] ^ sc[r].w[lane & 3];
                else if constexpr (MODE == 4) s ^= q[r].w[0] ^ q[r].w[1] ^ q[r].w[2] ^ q[r].w[3];
                else s ^= raw[r].q.w[0] ^ raw[r].q.w[1] ^ raw[r].q.w[2] ^ raw[r].q.w[3] ^ __float_as_uint(raw[r].d[0] + raw[r].m[1]);
            }
            if (u + 32 < units) ld(u + 32);
        }
        for (int o = 16; o > 0; o >>= 1) s ^= __shfl_xor_sync(0xffffffffu, s, o);
        out = (float)(s & 1u);
    }
    if (lane == 0) y[row] = out;
}
