// The KV cache's element types and page layout (kv_layout.py on the host side), shared by the
// kernels that write the cache (layers.cu's rope_kv; flash_decode.cu a decode row's own key in a
// quantized cache) and those that read it on the tensor cores (flash_attn.cu, flash_decode.cu).
//
// A layer's cache is pages of [n_head_kv][page_size] key rows. float and u16 (f16): a row is D
// elements. kvq8 / kvq4 (q8_0 / q4_0, llama.cpp's blocks of 32 values: x = d q, q4_0 x = d (q - 8)):
// a (page, KV head) block holds its page_size rows of values first (q8_0: D int8; q4_0: D / 2
// bytes, value 2i in the low nibble of byte i), then the rows' scales (D / 32 f16 each), so rows of
// values stay 16-byte aligned for cp.async.
#pragma once
#include "attn_parts.cuh"

struct kvq8 { u8 b; };
struct kvq4 { u8 b; };

// VB: bytes of a row's values; SB: of its scales; RAW: the stage is not an f16 tile (converted)
// PIECES: a row's cp.asyncs (16 bytes of values each, then one of its scales)
template <class KV, int D> struct KvRow {
    static constexpr int VB = D * (int)sizeof(KV), SB = 0, PIECES = VB / 16;
    static constexpr bool RAW = sizeof(KV) != 2;
};
template <int D> struct KvRow<kvq8, D> {
    static constexpr int VB = D, SB = D / 16, PIECES = VB / 16 + 1;
    static constexpr bool RAW = true;
};
template <int D> struct KvRow<kvq4, D> {
    static constexpr int VB = D / 2, SB = D / 16, PIECES = VB / 16 + 1;
    static constexpr bool RAW = true;
};

// Byte offset of the (page, hk) block in a layer's cache.
template <class KV, int D> DEV long kv_block(int page, int hk, int n_head_kv, int page_size) {
    return ((long)page * n_head_kv + hk) * page_size * (long)(KvRow<KV, D>::VB + KvRow<KV, D>::SB);
}

template <int N> DEV void kv_cp(void* dst, const void* src, bool valid) {  // cp.async of N = 4, 8 or 16 bytes
    if constexpr (N == 16) fa_cp16(dst, src, valid);
    else asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(smem_u32(dst)), "l"(src), "n"(N),
                      "r"(valid ? N : 0));
}

// A stage of KT rows: row j's values at j * LDRB bytes, the scales (quantized types) after KT rows.
// Piece c of row j (c < VB / 16: 16 bytes of values; c = VB / 16: the scales) of key row kp in the
// (page, hk) block at byte ``blk`` (ok: else zero-filled, masked later).
template <class KV, int D, int KT, int LDRB>
DEV void kv_stage_piece(int j, int c, const void* cache, long blk, int kp, int page_size, bool ok, char* stage) {
    using R = KvRow<KV, D>;
    const char* base = static_cast<const char*>(cache);
    if (c < R::VB / 16) {
        fa_cp16(stage + j * LDRB + 16 * c, base + (ok ? blk + (long)kp * R::VB + 16 * c : 0), ok);
    } else if constexpr (R::SB > 0) {
        kv_cp<R::SB>(stage + KT * LDRB + j * R::SB, base + (ok ? blk + (long)page_size * R::VB + kp * R::SB : 0), ok);
    }
}

// A raw stage of KT rows (float, q8_0, q4_0) as an f16 tile [KT][LDH], by threads tid of nt. The
// quantized ones take 16 bytes a step (16 q8_0 values or one q4_0 block, one scale) in f16x2
// arithmetic: q exact as (1024 + u) - (1024 + offset), times d rounded once, as d q in float
// then rounded to f16 (the product of an f16 and a small integer is exact in float).
template <class KV, int D, int KT, int LDRB, int LDH>
DEV void kv_to_f16(const char* stage, u16* tile, int tid, int nt) {
    if constexpr (sizeof(KV) == 4) {
#pragma unroll 4
        for (int idx = tid; idx < KT * D / 4; idx += nt) {
            const int j = idx / (D / 4), c = 4 * (idx % (D / 4));
            const float4 f = *reinterpret_cast<const float4*>(stage + j * LDRB + 4 * c);
            *reinterpret_cast<uint2*>(tile + j * LDH + c) = make_uint2(pack_h2(f.x, f.y), pack_h2(f.z, f.w));
        }
    } else {
        constexpr bool Q8 = KvRow<KV, D>::VB == D;
        constexpr int PER = Q8 ? 16 : 32;  // values of 16 bytes
        const u16* sc = reinterpret_cast<const u16*>(stage + KT * LDRB);
#pragma unroll 2
        for (int idx = tid; idx < KT * D / PER; idx += nt) {
            const int j = idx / (D / PER), c = PER * (idx % (D / PER));
            const u32 h = sc[j * (D / 32) + c / 32];
            const u32 d2 = h | (h << 16);
            const uint4 w = *reinterpret_cast<const uint4*>(stage + j * LDRB + (Q8 ? c : c / 2));
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
            u32 out[PER / 2];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (Q8) {  // signed bytes: u = q + 128
                    const u32 u = ws[e] ^ 0x80808080u, off = 0x64806480u;  // (1152, 1152)
                    out[2 * e] = hmul2(hsub2(prmt(u, H_MAGIC, SEL01), off), d2);
                    out[2 * e + 1] = hmul2(hsub2(prmt(u, H_MAGIC, SEL23), off), d2);
                } else {  // byte i: value 2i (low nibble), 2i + 1 (high), stored q + 8
                    const u32 lo = ws[e] & 0x0F0F0F0Fu, hi = (ws[e] >> 4) & 0x0F0F0F0Fu, off = 0x64086408u;  // 1032
                    const u32 a = prmt(lo, hi, 0x5140u), b = prmt(lo, hi, 0x7362u);  // values 0-3, 4-7
                    out[4 * e] = hmul2(hsub2(prmt(a, H_MAGIC, SEL01), off), d2);
                    out[4 * e + 1] = hmul2(hsub2(prmt(a, H_MAGIC, SEL23), off), d2);
                    out[4 * e + 2] = hmul2(hsub2(prmt(b, H_MAGIC, SEL01), off), d2);
                    out[4 * e + 3] = hmul2(hsub2(prmt(b, H_MAGIC, SEL23), off), d2);
                }
            }
            uint4* dst = reinterpret_cast<uint4*>(tile + j * LDH + c);
#pragma unroll
            for (int e = 0; e < PER / 8; ++e)
                dst[e] = make_uint4(out[4 * e], out[4 * e + 1], out[4 * e + 2], out[4 * e + 3]);
        }
    }
}

// q8_0 / q4_0 (kv 2 / 3) of N values v[n], each of dimension i[n] of a warp's 32 consecutive ones
// (every lane calls; the N reductions interleaved), as reference_kv.py (llama.cpp's
// quantize_row_q8_0_ref / q4_0_ref) computes them bit for bit: the byte this lane stores (q4_0:
// even lanes, the pair's two nibbles), its offset in the row's values, and the block's scale.
struct KvQuant { u8 byte; int at; bool store; float d; };
template <int N> DEV void kv_quant(int kv, const int (&i)[N], const float (&v)[N], KvQuant (&r)[N]) {
    const int lane = threadIdx.x & 31;
    float a[N];
    int at[N];
#pragma unroll
    for (int n = 0; n < N; ++n) { a[n] = fabsf(v[n]); at[n] = lane; }
    if (kv == 2) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int n = 0; n < N; ++n) a[n] = fmaxf(a[n], __shfl_xor_sync(0xffffffffu, a[n], o));
#pragma unroll
        for (int n = 0; n < N; ++n) {
            r[n].d = a[n] / 127.f;
            const float id = r[n].d > 0.f ? 1.f / r[n].d : 0.f;
            r[n].byte = (u8)(signed char)roundf(__fmul_rn(v[n], id));
            r[n].at = i[n];
            r[n].store = true;
        }
    } else {  // the value of largest magnitude (the first such), over -8
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int n = 0; n < N; ++n) {
                const float b = __shfl_xor_sync(0xffffffffu, a[n], o);
                const int bt = __shfl_xor_sync(0xffffffffu, at[n], o);
                if (b > a[n] || (b == a[n] && bt < at[n])) { a[n] = b; at[n] = bt; }
            }
#pragma unroll
        for (int n = 0; n < N; ++n) {
            r[n].d = __shfl_sync(0xffffffffu, v[n], at[n]) / -8.f;
            const float id = r[n].d != 0.f ? 1.f / r[n].d : 0.f;
            const int q = min(15, (int)__fadd_rn(__fmul_rn(v[n], id), 8.5f));
            const int hi = __shfl_down_sync(0xffffffffu, q, 1);
            r[n].byte = (u8)(q | (hi << 4));
            r[n].at = i[n] / 2;
            r[n].store = (lane & 1) == 0;
        }
    }
}

// Write value v of dimension i (this thread's; a warp holds 32 consecutive dimensions, D % 32 == 0
// for the quantized kinds, every lane calls) of key row ``slot`` of the (page, hk) block of a
// layer's cache of kind kv (0 float, 1 f16, 2 q8_0, 3 q4_0) with D-dim rows (kv_quant's arithmetic).
DEV void kv_store(void* cache, int kv, int page, int hk, int n_head_kv, int page_size, int slot, int D, int i,
              float v) {
    if (kv < 2) {
        const long at = (((long)page * n_head_kv + hk) * page_size + slot) * D + i;
        if (kv == 1) static_cast<u16*>(cache)[at] = f2h(v);
        else static_cast<float*>(cache)[at] = v;
        return;
    }
    const int vb = kv == 2 ? D : D / 2, sb = D / 16;
    char* blk = static_cast<char*>(cache) + ((long)page * n_head_kv + hk) * page_size * (long)(vb + sb);
    const int ii[1] = {i};
    const float vv[1] = {v};
    KvQuant k[1];
    kv_quant<1>(kv, ii, vv, k);
    if (k[0].store) reinterpret_cast<u8*>(blk)[(long)slot * vb + k[0].at] = k[0].byte;
    if ((threadIdx.x & 31) == 0) reinterpret_cast<u16*>(blk + (long)page_size * vb)[slot * (D / 32) + i / 32] = f2h(k[0].d);
}

// A decode row's own key and value (D floats each at kx and vx, rope applied) quantized by one
// warp as kv_store does (the 2 D / 32 blocks' reductions interleaved): into row j of a K and a V
// stage of KT rows (values at j * LDRB, scales after the KT rows) and into row ``slot`` of the
// caches' (page, hk) blocks (a flash_decode row writes its own key: rope_kv's launch saved).
template <class KV, int D, int KT, int LDRB>
DEV void kv_own_row(const float* kx, const float* vx, int lane, char* kst, char* vst, int j, void* kcache,
                    void* vcache, int page, int hk, int n_head_kv, int page_size, int slot) {
    using R = KvRow<KV, D>;
    static_assert(R::SB > 0, "quantized caches");
    constexpr int kind = R::VB == D ? 2 : 3, C = D / 32, N = 2 * C;
    const long blk = kv_block<KV, D>(page, hk, n_head_kv, page_size);
    int i[N];
    float v[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
        i[n] = 32 * (n % C) + lane;
        v[n] = (n < C ? kx : vx)[i[n]];
    }
    KvQuant r[N];
    kv_quant<N>(kind, i, v, r);
#pragma unroll
    for (int n = 0; n < N; ++n) {
        char* st = n < C ? kst : vst;
        char* cb = static_cast<char*>(n < C ? kcache : vcache) + blk;
        if (r[n].store) {
            st[j * LDRB + r[n].at] = (char)r[n].byte;
            cb[(long)slot * R::VB + r[n].at] = (char)r[n].byte;
        }
        if (lane == 0) {
            const u16 h = f2h(r[n].d);
            reinterpret_cast<u16*>(st + KT * LDRB + j * R::SB)[n % C] = h;
            reinterpret_cast<u16*>(cb + (long)page_size * R::VB + slot * R::SB)[n % C] = h;
        }
    }
}
