// Tensor-core A fragments built in registers from the raw quants (Q4_K, Q6_K): the tiles of
// mma_tiles.cuh without dequantizing W into shared memory.
//
// A warp owns 16 weight rows; lane (g, tig) = (lane / 4, lane % 4) holds rows g and g + 8 of
// them (mma.sync.m16n8k16's A layout). It reads its own quant bytes and scales of a 128-wide k
// step (staged in shared memory) and turns them into f16 pairs with f16x2 arithmetic:
// quant byte b -> f16 h = 1024 + b by one PRMT with 0x64 bytes, then (h - 1024) * ds + (-m) by
// sub.f16x2 and fma.f16x2 (two weights per instruction, against ~5 f32 instructions per
// weight, one conversion and a shared-memory round trip in the dequantizing path). Every mma
// spans 16 columns of one sub-block, so its scales are the same f16 pair for all four lanes of a
// row. A k16 MMA only needs A and B to agree on which column sits at which k: lane tig takes
// its own contiguous quant bytes, and the B fragment (x, f16, in shared memory) is read at the
// same columns. The x tile goes through shared memory (cp.async), and so do each step's raw
// weights (staged: mma_tiles_reg).
//
// Precision: ds = d * sc and m = dmin * mn are rounded to f16 (as is the dequantized weight in
// the other path), then q * ds - m is rounded once (fma).
#pragma once
#include "quant_types.cuh"

DEV u32 sel_bcast(int j) { return 0x4040u | (u32)(j * 0x0101); }  // (j, j): byte j of w in both halves

// 16 bytes of shared memory, in program order with the (volatile) MMAs around it.
DEV uint4 lds_b16(const u16* p) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"((u32)__cvta_generic_to_shared(p)));
    return v;
}

// cp.async: 16 bytes global -> shared, zero-filled when !valid (the source address stays valid).
DEV void cp_async16(void* dst, const void* src, bool valid) {
    u64 s;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(s) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((u32)s), "l"(src), "r"(valid ? 16 : 0));
}
// ... to a shared-space address (__cvta_generic_to_shared once, not a generic pointer a copy: each
// generic one costs its conversion's 64-bit arithmetic in the loop).
DEV void cp_async16s(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
DEV void cp_async4s(u32 dst, const void* src) {  // 4 bytes (src 4-byte aligned)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}
DEV u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <class T> struct RegA { static constexpr bool OK = false; static constexpr int WROW = 0; };  // WROW: below

// Q4_K. A 128-wide step is half a superblock: its 64-groups G = 0, 1 (sub-blocks lo = 2 G' and
// hi = 2 G' + 1 of the superblock, G' = 2 half + G). Lane tig takes quant bytes 8 tig .. 8 tig + 7
// of each group's 32: byte i holds element 8 tig + i of sub-block lo (low nibble) and of hi (high
// nibble). MMA j (0, 1) of a sub-block takes bytes 4 j .. 4 j + 3: k (2 tig, 2 tig + 1) <- bytes
// 4 j, 4 j + 1 and k (2 tig + 8, + 9) <- 4 j + 2, 4 j + 3, so the B fragments of both MMAs are the
// 8 halves at column 8 tig of the sub-block: one 16-byte load. Row stride 160 halves (80 words):
// the two rows of a quarter warp fall in opposite bank halves.
template <> struct RegA<TQ4_K> {
    static constexpr bool OK = true;
    static constexpr int LDX = 160;
    struct Raw { uint2 q[2][2]; V16 s[2]; };  // [row g, g + 8][group]; the 16 scale bytes of each row
    // A step's raw data of a row staged in shared memory by cp.async (mma_tiles_reg): its 64 quant
    // bytes, then its 16 scale bytes, padded to 96 (24 words: the 8-byte reads of a half warp and
    // the 16-byte reads of a quarter warp are conflict-free).
    static constexpr int WROW = 96, CHUNKS = 5;

    // A row's (d, d), (-dmin, -dmin) and its four 6-bit scales and mins (a byte each) of this half
    // of the superblock, from its 16 scale bytes (words: (d, dmin), scales12).
    static DEV void half_scales(const V16& s, int half, u32& d2, u32& nmin2, u32& sc, u32& mn) {
        d2 = prmt(s.w[0], 0u, 0x1010u);
        nmin2 = prmt(s.w[0], 0u, 0x3232u) ^ 0x80008000u;
        if (half == 0) {
            sc = s.w[1] & 0x3F3F3F3Fu;
            mn = s.w[2] & 0x3F3F3F3Fu;
        } else {
            sc = (s.w[3] & 0x0F0F0F0Fu) | ((s.w[1] >> 2) & 0x30303030u);
            mn = ((s.w[3] >> 4) & 0x0F0F0F0Fu) | ((s.w[2] >> 2) & 0x30303030u);
        }
    }
    struct Rows {};  // (its staged reads need nothing more of the rows)
    static DEV Rows rows(const Mat&, int, int) { return {}; }
    static DEV const u8* chunk(const Mat& m, int row, int k0, int c) {  // 16-byte piece c of a row's step
        const long b = (long)row * m.nb + (k0 >> 8);
        return c < 4 ? m.qs + b * 128 + 64 * ((k0 >> 7) & 1) + 16 * c : m.sc + b * 16;
    }
    static DEV void load_smem(const u8* ws, const Rows&, int, Raw& raw) {  // ws: row g's staged bytes (row g + 8 at 8 WROW)
        const int tig = threadIdx.x & 3;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int G = 0; G < 2; ++G)
                raw.q[i][G] = *reinterpret_cast<const uint2*>(ws + i * 8 * WROW + 32 * G + 8 * tig);
            const uint4 v = *reinterpret_cast<const uint4*>(ws + i * 8 * WROW + 64);
            raw.s[i] = V16{{v.x, v.y, v.z, v.w}};
        }
    }
    // A thread's share of the cp.async of a k step's rows [row0 + j jstride, + 16 WR) of the NM
    // tiles into a stage (16-byte chunks; chunk idx = thread + NTHR i: tile j, row r, piece c), its
    // addresses worked out once: each chunk's source at k = 0 and its offset in the stage; a step
    // adds k / 2 bytes to a quant chunk (half a superblock's 128 bytes a step) and 16 a superblock
    // to a scale chunk (working them out each step was a large share of the loop's instructions).
    template <int WR, int NM> struct Plan {
        static constexpr int ROWS = 16 * WR, CH = NM * ROWS * CHUNKS, N = (CH + NTHR - 1) / NTHR;
        const u8* src[N];
        u32 dst[N], scale = 0;  // scale: bit i set where chunk i is a row's scales

        DEV Plan(const Mat (&ms)[NM], int n_rows, int row0, int jstride) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const int idx = min((int)threadIdx.x + i * NTHR, CH - 1);  // (past CH: never issued)
                const int j = idx / (ROWS * CHUNKS), r = idx / CHUNKS % ROWS, c = idx % CHUNKS;
                Mat m = ms[0];  // ms[j] by selects: indexed at run time, the array went to local memory
#pragma unroll
                for (int q = 1; q < NM; ++q)
                    if (j == q) m = ms[q];
                src[i] = chunk(m, min(row0 + j * jstride + r, n_rows - 1), 0, c);
                dst[i] = (j * ROWS + r) * WROW + 16 * c;
                scale |= (u32)(c == CHUNKS - 1) << i;
            }
        }
        DEV void issue(int k0, u32 ws) const {  // ws: the stage's shared-space address
            const int oq = k0 >> 1, os = (k0 >> 8) << 4;
#pragma unroll
            for (int i = 0; i < N; ++i)
                if (CH % NTHR == 0 || (int)threadIdx.x + i * NTHR < CH)
                    cp_async16s(ws + dst[i], src[i] + ((scale >> i) & 1 ? os : oq), true);
        }
    };

    // The MMAs of one 128-wide step for NM tiles (GLU: gate and up; tall: two row tiles) against
    // the same x: each B fragment load feeds all NM tiles.
    template <int NT, int NM>
    static DEV void step(const Raw (&raw)[NM], int k0, const u16* xs, float (&acc)[NM][NT][4]) {
        const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3, half = (k0 >> 7) & 1;
        u32 sc[NM][2], mn[NM][2], d2[NM][2], nmin2[NM][2];  // per row: this half's 6-bit scales and mins
#pragma unroll
        for (int m = 0; m < NM; ++m)
#pragma unroll
            for (int i = 0; i < 2; ++i) half_scales(raw[m].s[i], half, d2[m][i], nmin2[m][i], sc[m][i], mn[m][i]);
        // Straight-line code (faster than an `unroll 1` loop: the 8B's GLU at B=64).
        // The B loads are volatile (lds_b16), so they stay between the MMAs instead of all 32
        // being hoisted (spills in the GLU).
#pragma unroll
        for (int G = 0; G < 2; ++G)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                u32 a[NM][2][4];  // [tile][mma j][a0..a3]
#pragma unroll
                for (int m = 0; m < NM; ++m)
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        // (d sc, d sc) and (-dmin mn, -dmin mn) of sub-block 4 half + 2 G + hi
                        const u32 ds = hmul2(hsub2(prmt(sc[m][i], H_MAGIC, sel_bcast(2 * G + hi)), H1024), d2[m][i]);
                        const u32 nm = hmul2(hsub2(prmt(mn[m][i], H_MAGIC, sel_bcast(2 * G + hi)), H1024), nmin2[m][i]);
                        const uint2 q = G ? raw[m].q[i][1] : raw[m].q[i][0];
#pragma unroll
                        for (int j = 0; j < 2; ++j) {
                            const u32 nib = (hi ? (j ? q.y : q.x) >> 4 : (j ? q.y : q.x)) & 0x0F0F0F0Fu;
                            a[m][j][i] = hfma2(hsub2(prmt(nib, H_MAGIC, SEL01), H1024), ds, nm);
                            a[m][j][2 + i] = hfma2(hsub2(prmt(nib, H_MAGIC, SEL23), H1024), ds, nm);
                        }
                    }
                const u16* xp = xs + g * LDX + 64 * G + 32 * hi + 8 * tig;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const uint4 b = lds_b16(xp + nt * 8 * LDX);
#pragma unroll
                    for (int m = 0; m < NM; ++m) {
                        mma16816(acc[m][nt], a[m][0][0], a[m][0][1], a[m][0][2], a[m][0][3], b.x, b.y);
                        mma16816(acc[m][nt], a[m][1][0], a[m][1][1], a[m][1][2], a[m][1][3], b.z, b.w);
                    }
                }
            }
    }
};

// Q6_K. A 128-wide step is half h of a superblock: element 128 h + 32 p + l (quadrant p, l < 32)
// is ql[64 h + l] (p = 0, 2: low / high nibble) or ql[64 h + 32 + l] (p = 1, 3) with bits 2p, 2p+1
// of qh[32 h + l] on top, minus 32, times scale 8 h + 2 p + l / 16 (16-element sub-blocks). MMA
// (b, p) covers l = 16 b .. 16 b + 15; lane tig takes l = 16 b + 4 tig + i, i < 4 (one word of
// each plane). B: 4 halves at column 32 p + 16 b + 4 tig (8-byte loads; row stride 144 halves =
// 72 words: the four rows of a half warp in four bank quarters).
template <> struct RegA<TQ6_K> {
    static constexpr bool OK = true;
    static constexpr int LDX = 144;
    struct Raw { u32 la[2][2], lb[2][2], qh[2][2]; uint2 s[2]; u32 d[2]; };  // [row][b]; this half's 8 scales
    // A step's raw data of a row staged in shared memory by cp.async (mma_tiles_reg): its 64 ql
    // bytes, 32 qh bytes, the superblock's 16 scale bytes and the 4-byte word that holds its d
    // (the d plane is 2-byte aligned), padded to 144 (36 words: the 8 rows' word reads of a warp
    // fall in distinct banks). Loaded into registers a step ahead instead, its quants were the
    // products' longest wait (bench/RESULTS.md row 235).
    static constexpr int WROW = 144, CHUNKS = 8;

    // The half of the staged word that holds d: superblock s of the lane's rows g, g + 8 (their
    // d at the row's d plane address + 2 s) is half (dpar + s) & 1.
    struct Rows { u32 dpar[2]; };
    static DEV Rows rows(const Mat& m, int n_rows, int r) {
        Rows p;
#pragma unroll
        for (int i = 0; i < 2; ++i)
            p.dpar[i] = (u32)(reinterpret_cast<unsigned long long>(m.d + (long)min(r + 8 * i, n_rows - 1) * m.nb * 2) >> 1) & 1u;
        return p;
    }
    // A row's piece c at k = 0: 16 bytes of ql (c < 4), of qh (4, 5), the scales (6); c = 7: the d
    // plane at the row's first superblock (issue takes the aligned word of the step's d).
    static DEV const u8* chunk(const Mat& m, int row, int c) {
        const long b = (long)row * m.nb;
        return c < 4 ? m.qs + b * 128 + 16 * c : c < 6 ? m.qh + b * 64 + 16 * (c - 4) : c == 6 ? m.sc + b * 16 : m.d + b * 2;
    }
    static DEV void load_smem(const u8* ws, const Rows& p, int k0, Raw& raw) {  // ws: row g's (row g + 8 at 8 WROW)
        const int tig = threadIdx.x & 3, h = (k0 >> 7) & 1, s = k0 >> 8;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const u8* w = ws + i * 8 * WROW;
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                raw.la[i][bb] = *reinterpret_cast<const u32*>(w + 16 * bb + 4 * tig);
                raw.lb[i][bb] = *reinterpret_cast<const u32*>(w + 32 + 16 * bb + 4 * tig);
                raw.qh[i][bb] = *reinterpret_cast<const u32*>(w + 64 + 16 * bb + 4 * tig);
            }
            raw.s[i] = *reinterpret_cast<const uint2*>(w + 96 + 8 * h);
            const u32 dw = *reinterpret_cast<const u32*>(w + 112);
            raw.d[i] = (p.dpar[i] + s) & 1 ? dw >> 16 : dw & 0xFFFFu;
        }
    }
    // A thread's share of the cp.async of a k step's rows (RegA<TQ4_K>::Plan's scheme): each
    // chunk's source at k = 0, its offset in the stage and its kind (2 bits: ql, qh, scales, d).
    template <int WR, int NM> struct Plan {
        static constexpr int ROWS = 16 * WR, CH = NM * ROWS * CHUNKS, N = (CH + NTHR - 1) / NTHR;
        static_assert(N <= 16, "two bits a chunk");
        const u8* src[N];
        u32 dst[N], kind = 0;

        DEV Plan(const Mat (&ms)[NM], int n_rows, int row0, int jstride) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const int idx = min((int)threadIdx.x + i * NTHR, CH - 1);  // (past CH: never issued)
                const int j = idx / (ROWS * CHUNKS), r = idx / CHUNKS % ROWS, c = idx % CHUNKS;
                Mat m = ms[0];  // (by selects, as Q4_K's)
#pragma unroll
                for (int q = 1; q < NM; ++q)
                    if (j == q) m = ms[q];
                src[i] = chunk(m, min(row0 + j * jstride + r, n_rows - 1), c);
                dst[i] = (j * ROWS + r) * WROW + 16 * c;
                kind |= (u32)(c < 4 ? 0 : c < 6 ? 1 : c == 6 ? 2 : 3) << (2 * i);
            }
        }
        DEV void issue(int k0, u32 ws) const {  // ws: the stage's shared-space address
            const int oq = k0 >> 1, oh = k0 >> 2, os = (k0 >> 8) << 4, od = (k0 >> 8) << 1;
#pragma unroll
            for (int i = 0; i < N; ++i)
                if (CH % NTHR == 0 || (int)threadIdx.x + i * NTHR < CH) {
                    const u32 kd = (kind >> (2 * i)) & 3u;
                    if (kd == 3)
                        cp_async4s(ws + dst[i], reinterpret_cast<const void*>(
                                                    reinterpret_cast<unsigned long long>(src[i] + od) & ~3ull));
                    else
                        cp_async16s(ws + dst[i], src[i] + (kd == 0 ? oq : kd == 1 ? oh : os), true);
                }
        }
    };

    template <int NT, int NM>
    static DEV void step(const Raw (&raw)[NM], int, const u16* xs, float (&acc)[NM][NT][4]) {
        const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
        constexpr u32 H1056 = 0x64206420u, H1152 = 0x64806480u;  // 1024 + 32; 1024 + 128
#pragma unroll
        for (int bb = 0; bb < 2; ++bb)
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                u32 a[NM][4];
#pragma unroll
                for (int m = 0; m < NM; ++m)
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const u32 d2 = raw[m].d[i] | (raw[m].d[i] << 16);
                        // scale 2 p + bb of this half: signed byte, offset by 128 to an unsigned one
                        const u32 sw = (p < 2 ? raw[m].s[i].x : raw[m].s[i].y) ^ 0x80808080u;
                        const u32 ds = hmul2(hsub2(prmt(sw, H_MAGIC, sel_bcast(2 * (p & 1) + bb)), H1152), d2);
                        const u32 l = (p & 1) ? raw[m].lb[i][bb] : raw[m].la[i][bb], h = raw[m].qh[i][bb];
                        const u32 lo = (p < 2 ? l : l >> 4) & 0x0F0F0F0Fu;
                        const u32 hb = (p == 0 ? h << 4 : p == 1 ? h << 2 : p == 2 ? h : h >> 2) & 0x30303030u;
                        const u32 q = lo | hb;  // 6-bit quants, one per byte
                        a[m][i] = hmul2(hsub2(prmt(q, H_MAGIC, SEL01), H1056), ds);
                        a[m][2 + i] = hmul2(hsub2(prmt(q, H_MAGIC, SEL23), H1056), ds);
                    }
                const u16* xp = xs + g * LDX + 32 * p + 16 * bb + 4 * tig;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const uint2 b = *reinterpret_cast<const uint2*>(xp + nt * 8 * LDX);
#pragma unroll
                    for (int m = 0; m < NM; ++m) mma16816(acc[m][nt], a[m][0], a[m][1], a[m][2], a[m][3], b.x, b.y);
                }
            }
    }
};

// The x tile of tokens [t0, t0 + TB) x columns [k0, k0 + TK) into Xs (row stride LDX halves);
// zeros past n_tok and K.
template <int TB, int LDX>  // Xs: a shared-space address
DEV void x_tile_async(const u16* __restrict__ x, int ldx, int n_tok, int t0, int k0, int K, u32 Xs) {
    constexpr int CPR = TK / 8, RS = NTHR / CPR, N = (TB * CPR + NTHR - 1) / NTHR;  // RS: rows a pass
    static_assert(NTHR % CPR == 0, "whole rows a pass");
    const int b0 = threadIdx.x / CPR, c = (threadIdx.x % CPR) * 8;  // piece i: row b0 + RS i, columns c..
    const u16* xk = x + min(k0 + c, K - 8);
    const bool kin = k0 + c < K;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int b = b0 + RS * i;
        if (TB * CPR % NTHR == 0 || b < TB)
            cp_async16s(Xs + 2 * (b * LDX + c), xk + (long)min(t0 + b, n_tok - 1) * ldx, kin && t0 + b < n_tok);
    }
}

// mma_tiles (mma_tiles.cuh) for a type with register fragments: the same operands and C layout.
// Each k step's raw quants and scales of the block's rows are copied to shared memory by
// cp.async, ST - 1 steps ahead, beside the x tiles (ST stages each), and each lane reads its own
// from there: loaded into registers one step ahead instead, every warp waited about a memory
// latency per step at their first use (the 8B's GLU and Q6_K products: long-scoreboard stalls)
// and they took two register copies of the raw data. ST > 2 keeps more steps' loads in flight
// (KernelKnobs.mma_stages: two, as deeper was slower).
template <class T, int WR, int NT, int NM, int ST>
DEV void mma_tiles_reg(const Mat (&ms)[NM], int n_rows, int row0, int jstride, const u16* x, int ldx, int n_tok,
                       int t0, int kb, int ke, int K, u16* smem, float (&acc)[NM][NT][4]) {
    using R = RegA<T>;
    constexpr int S = ST;  // stages (buffers) of x and of the staged raw weights
    static_assert(S >= 2 && R::WROW > 0, "two stages at least; staged raw weights");
    constexpr int TB = 8 * NT * (4 / WR), XS = TB * R::LDX, WS = NM * 16 * WR * R::WROW;
    const int warp = threadIdx.x >> 5, wr = warp % WR, wc = warp / WR, g = (threadIdx.x & 31) >> 2;
    const int r = row0 + 16 * wr + g;
    u8* wsm = reinterpret_cast<u8*>(smem + S * XS);  // S W stages after the S x tiles
    const u32 xs_s = smem_addr(smem), ws_s = xs_s + 2 * S * XS;  // the same, shared-space addresses
#pragma unroll
    for (int j = 0; j < NM; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[j][nt][0] = acc[j][nt][1] = acc[j][nt][2] = acc[j][nt][3] = 0.f;
    typename R::Rows rp[NM];  // what a lane's reads of its staged rows need to know of them
#pragma unroll
    for (int j = 0; j < NM; ++j) rp[j] = R::rows(ms[j], n_rows, r + j * jstride);
    const typename R::template Plan<WR, NM> plan(ms, n_rows, row0, jstride);
    // the block's k steps from k_first, wrapping around (mma_tiles.cuh)
    const int n = (ke - kb + TK - 1) / TK, k_start = k_first(kb, ke);
    auto next = [&](int k) { return k_next(k, kb, ke); };
    int kn = k_start;  // the step whose loads go out next
#pragma unroll
    for (int s = 0; s < S - 1; ++s, kn = next(kn))
        if (s < n) plan.issue(kn, ws_s + s * WS);
    kn = k_start;
    pdl_enter();  // the first weights load before it (common.cuh)
#pragma unroll
    for (int s = 0; s < S - 1; ++s, kn = next(kn)) {  // cp.async group s: x of step s (group 0 also the weights)
        if (s < n) x_tile_async<TB, R::LDX>(x, ldx, n_tok, t0, kn, K, xs_s + 2 * s * XS);
        cp_async_commit();
    }
    int buf = 0, k0 = k_start;
    for (int i = 0; i < n; ++i, k0 = next(k0), kn = next(kn)) {
        cp_async_wait<S - 2>();  // this step's group is in (later steps' may still be in flight)
        __syncthreads();         // ... for every thread; every warp is done with the previous step's buffers
        const int nb = buf == 0 ? S - 1 : buf - 1;  // the previous step's buffers
        if (i + S - 1 < n) {
            plan.issue(kn, ws_s + nb * WS);
            x_tile_async<TB, R::LDX>(x, ldx, n_tok, t0, kn, K, xs_s + 2 * nb * XS);
        }
        cp_async_commit();  // (empty past the end: the group count stays one per step)
        typename R::Raw cur[NM];
#pragma unroll
        for (int j = 0; j < NM; ++j)
            R::load_smem(wsm + buf * WS + (j * 16 * WR + 16 * wr + g) * R::WROW, rp[j], k0, cur[j]);
        R::template step<NT, NM>(cur, k0, smem + buf * XS + wc * 8 * NT * R::LDX, acc);
        buf = buf + 1 == S ? 0 : buf + 1;
    }
}
