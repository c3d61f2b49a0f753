// The GLU of Q4_K weights for 64-token tiles on Hopper's warpgroup MMA (wgmma, sm_90a; compiled
// with -arch=sm_90a, sources.ARCH): y16 = f16(act(G x) * (U x)), matmul_mma.cu's mma_glu with
// the same block (128 threads = one warpgroup, 64 weight rows x 64 tokens, gate and up), the same
// staging (raw quants and scales of each 128-wide k step by cp.async, ST stages) and the same
// epilogue. What differs is the product: wgmma.m64n64k16 takes A (16 rows a warp, mma.sync's A
// fragment layout) from the registers the warp dequantizes into and B = the x tile from shared
// memory, and runs asynchronously: the warp dequantizes the next 16 columns while the tensor
// cores multiply the last ones, and one instruction a matrix replaces a warp's eight mma.sync.
//
// B is read through a descriptor in the canonical K-major layout without swizzle: 8 x 8 core
// matrices (8 tokens x 16 bytes, 128 contiguous bytes); core matrix (token group tg, column
// group cg) of a step's tile at (16 tg + cg) x 128 bytes, so the next 8 columns are 128 bytes on
// (LBO) and the next 8 tokens 2048 (SBO). wgmma's k order is the tile's own, so the A fragments
// are built in natural k order (lane tig: columns 2 tig, 2 tig + 1 and 2 tig + 8, + 9 of each 16),
// not in mma_regs.cuh's per-lane order: each lane reads four 32-bit words of a row's 32-byte
// group and keeps a 16-bit half of each (PRMT).
#include "mma_tiles.cuh"

DEV void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DEV void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> DEV void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Keep the compiler from moving accumulator reads or writes across the asynchronous MMAs.
DEV void wg_hold(float (&d)[8][4]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
        asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}

// Descriptor of a K-major B tile without swizzle: start, LBO, SBO (bytes, 16-byte units).
DEV u64 wg_desc(const void* p, u32 lbo, u32 sbo) {
    return (u64)((smem_addr(p) & 0x3FFFFu) >> 4) | (u64)(lbo >> 4) << 16 | (u64)(sbo >> 4) << 32;
}

// d[nt][0..3] += A (16 rows a warp) x B (64 tokens): d[nt] is mma.sync's C fragment of tokens 8 nt..
DEV void wgmma_n64(float (&d)[8][4], const u32 (&a)[4], u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

constexpr int WG_TB = 64, WG_XS = WG_TB * TK;  // tokens a tile; halves of a step's x tile (unpadded)

// x[t0 .. t0 + 64) x columns [k0, k0 + 128) into Xs as core matrices (zeros past n_tok and K). A
// warp's 32 pieces: 8 tokens x 4 consecutive column groups (64 bytes of each token's row from
// global memory; 512 contiguous bytes of shared memory).
DEV void x_tile_cm(const u16* __restrict__ x, int ldx, int n_tok, int t0, int k0, int K, u16* Xs) {
#pragma unroll
    for (int i = 0; i < WG_TB * (TK / 8) / NTHR; ++i) {
        const int idx = threadIdx.x + i * NTHR, r = idx & 7, cg = (idx >> 3) & 15, tg = idx >> 7;
        const int b = 8 * tg + r, c = 8 * cg;
        cp_async16(Xs + (16 * tg + cg) * 64 + 8 * r, x + (long)min(t0 + b, n_tok - 1) * ldx + min(k0 + c, K - 8),
                   t0 + b < n_tok && k0 + c < K);
    }
}

// One 128-wide k step of gate (m = 0) and up (1): ws = the step's staged rows (RegA<TQ4_K>::stage),
// Xs its x tile. Per 16 columns: dequantize both A fragments, fence, two wgmmas, commit; then
// wait for all but the newest group, so at most two chunks' fragments are live.
DEV void glu_wg_step(const u8* ws, int k0, const u16* Xs, float (&acc)[2][8][4]) {
    using R = RegA<TQ4_K>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tig = lane & 3, half = (k0 >> 7) & 1;
    const u32 pick = tig & 1 ? 0x7632u : 0x5410u;  // this lane's 16-bit halves of two words
    u32 sc[2][2], mn[2][2], d2[2][2], nmin2[2][2];  // [mat][row g, g + 8]: this half's scales and mins
    const u8* row[2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            row[m][i] = ws + (m * 64 + 16 * warp + (lane >> 2) + 8 * i) * R::WROW;
            const uint4 v = *reinterpret_cast<const uint4*>(row[m][i] + 64);
            R::half_scales(V16{{v.x, v.y, v.z, v.w}}, half, d2[m][i], nmin2[m][i], sc[m][i], mn[m][i]);
        }
#pragma unroll
    for (int G = 0; G < 2; ++G) {
        // words 4 (tig / 2) + 8 j of each row's group: bytes 2 tig (+ 1) + 8 j are this lane's
        u32 w[2][2][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    w[m][i][j] = *reinterpret_cast<const u32*>(row[m][i] + 32 * G + 8 * j + 4 * (tig >> 1));
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            u32 ds[2][2], nm[2][2];  // sub-block 4 half + 2 G + hi: (d sc, d sc), (-dmin mn, -dmin mn)
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    ds[m][i] = hmul2(hsub2(prmt(sc[m][i], H_MAGIC, sel_bcast(2 * G + hi)), H1024), d2[m][i]);
                    nm[m][i] = hmul2(hsub2(prmt(mn[m][i], H_MAGIC, sel_bcast(2 * G + hi)), H1024), nmin2[m][i]);
                }
#pragma unroll
            for (int c = 0; c < 2; ++c) {  // columns 64 G + 32 hi + 16 c of the step
                u32 a[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        // bytes 16 c + 2 tig, + 1 (k 2 tig, + 1) and 16 c + 2 tig + 8, + 9 (k + 8)
                        const u32 q = prmt(w[m][i][2 * c], w[m][i][2 * c + 1], pick);
                        const u32 nib = (hi ? q >> 4 : q) & 0x0F0F0F0Fu;
                        a[m][i] = hfma2(hsub2(prmt(nib, H_MAGIC, SEL01), H1024), ds[m][i], nm[m][i]);
                        a[m][2 + i] = hfma2(hsub2(prmt(nib, H_MAGIC, SEL23), H1024), ds[m][i], nm[m][i]);
                    }
                const u64 desc = wg_desc(Xs + (8 * G + 4 * hi + 2 * c) * 64, 128, 2048);
                wg_fence();
                wgmma_n64(acc[0], a[0], desc);
                wgmma_n64(acc[1], a[1], desc);
                wg_commit();
                wg_wait<1>();
            }
        }
    }
}

// grid = (64-row tiles, 64-token tiles, K splits); part / counter as mma_glu's.
template <int ACT, int ST>
__global__ void __launch_bounds__(NTHR) mma_glu_wg(PLANES(0), PLANES(1), int n, const u16* __restrict__ x, int ldx,
                                                   int n_tok, int K, u16* y, int ldy, float* part, unsigned* counter) {
    using R = RegA<TQ4_K>;
    static_assert(ST >= 2, "two stages at least");
    constexpr int WS = 2 * 64 * R::WROW;  // bytes of a step's staged rows, gate then up
    extern __shared__ __align__(128) u16 smem[];
    const int row0 = blockIdx.x * 64, t0 = blockIdx.y * WG_TB;
    int kb, ke;
    k_range(K, kb, ke);
    const Mat ms[2] = {MAT(0, TQ4_K), MAT(1, TQ4_K)};
    u8* wsm = reinterpret_cast<u8*>(smem + ST * WG_XS);
    float acc[2][8][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[m][nt][0] = acc[m][nt][1] = acc[m][nt][2] = acc[m][nt][3] = 0.f;
    const R::Plan<4, 2> plan(ms, n, row0, 0);
#pragma unroll
    for (int s = 0; s < ST - 1; ++s)
        if (kb + s * TK < ke) plan.issue(kb + s * TK, smem_addr(wsm + s * WS));
    pdl_enter();  // the first weights load before it (common.cuh)
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {  // cp.async group s: x of step s (group 0 also the weights above)
        if (kb + s * TK < ke) x_tile_cm(x, ldx, n_tok, t0, kb + s * TK, K, smem + s * WG_XS);
        cp_async_commit();
    }
    wg_hold(acc[0]);
    wg_hold(acc[1]);
    int buf = 0;
    for (int k0 = kb; k0 < ke; k0 += TK) {
        cp_async_wait<ST - 2>();  // this step's group is in
        // cp.async wrote the tile through the generic proxy; wgmma reads it through the async one
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        wg_wait<0>();     // the previous step's MMAs are done with their stage ...
        __syncthreads();  // ... in every warp: it takes step k0 + (ST - 1) TK
        const int kn = k0 + (ST - 1) * TK, nb = buf == 0 ? ST - 1 : buf - 1;
        if (kn < ke) {
            plan.issue(kn, smem_addr(wsm + nb * WS));
            x_tile_cm(x, ldx, n_tok, t0, kn, K, smem + nb * WG_XS);
        }
        cp_async_commit();
        glu_wg_step(wsm + buf * WS, k0, smem + buf * WG_XS, acc);
        buf = buf + 1 == ST ? 0 : buf + 1;
    }
    wg_wait<0>();
    wg_hold(acc[0]);
    wg_hold(acc[1]);
    if (gridDim.z > 1 && !merge_splits<2, 8>(acc, part, counter)) return;
    glu_combine<ACT>(acc);
    for_each_c<4, 8>(acc[0], row0, t0, [&](int r, int t, float v) {
        if (r < n && t < n_tok) y[(long)t * ldy + r] = f2h(v);
    });
}

#ifdef GGUF_INSTANTIATE_ALL
#define WG_ARGS PLANES(0), PLANES(1), int, const u16*, int, int, int, u16*, int, float*, unsigned*
template __global__ void mma_glu_wg<0, 2>(WG_ARGS);
template __global__ void mma_glu_wg<1, 2>(WG_ARGS);
template __global__ void mma_glu_wg<0, 3>(WG_ARGS);
#endif
