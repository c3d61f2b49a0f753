// Decode attention on the tensor cores: each row is one token of its own sequence, its keys split
// over a fixed grid (kv head, split, row) as attention.cu splits them, and each block streams its
// share through per-warp cp.async rings deep enough to keep the cache's bytes in flight at depth.
//
// A block takes the G query heads of one KV head for row t and keys [start, end) of the row's
// range cut into ns = min(n_split, ceil(n / min_keys)) chunks (fit: as few as give the warps as many
// rounds, dec_splits) of whole KT-aligned tiles (blocks past ns exit; keys before the window's start
// are masked), so that a tile of a page holds one run of rows: one page lookup a tile
// (bench/RESULTS.md: the per-row lookups were half a q8_0 tile's instructions). target > 0:
// the splits follow the work of the whole step instead, about ``target`` blocks in all (the SMs'
// share): a split covers at least total keys x n_head_kv / target keys, so one long row among
// short ones takes many blocks and each short one a single block. Calls of several rows number
// their (row, split) blocks row by row in grid.y (grid.z one): the blocks with keys come first
// and, with target, the grid holds few more (a grid of n_split blocks a row was mostly blocks
// that only exited, each holding an SM's shared memory, dispatched before later rows'). Its NW warps
// take the chunk's KT-key tiles in turn (tile i: warp i % NW), each warp with its own ring of ST
// stages, so no warp waits on another inside the loop. Per tile, as flash_attn.cu does for a
// prompt's rows: S = Q K^T by mma.sync m16n8k16 (the A rows are the G heads, f16, scaled; rows G
// to 15 zero), mask (keys past end) and soft-cap, an online softmax in the exp2 domain, O += P V
// with V by ldmatrix.trans, or (Dec::TR) O^T += V^T P^T, whose tiles' rows are dimensions, so no
// accumulator holds a zero head. The warps merge in shared memory (the stages' space), and the
// row's splits merge in attn_parts.cuh's merge_splits. early != 0: the keys before the row's own
// position come from earlier steps, so their tiles are requested before pdl_enter; the row's own
// key (written by the kernel before) is requested after it; or (own_kv, quantized caches) the
// QKV product left the row's key (rotated) and value in own_kv's row, and the warp whose tile holds
// the row's position quantizes them into that tile and the cache (kv_own_row: rope_kv's launch
// saved; the epilogue writes f16 and float caches itself); or (n_rot > 0, f16 caches) q points at
// raw QKV rows and the kernel does rope_kv's work (layers.cu) for its heads: every block rotates
// (and QK-normalizes) its G query heads, the block holding the row's own key rotates it and writes
// it and the value into the cache, and its warp puts them into the tile (dec_rope_head: rope_kv's
// sums and arithmetic, so the cache and the outputs are the bits of rope_kv then this kernel).
// The cache is any of kv_cache.cuh's types: f16 stages are the tiles; float and q4_0 stages
// convert into the warp's f16 tiles once they land; q8_0 stages are converted in registers
// straight into the mma fragments (Dec::REG: K's B fragments with Q's dimensions permuted to
// match, and O accumulated transposed, so that V's bytes are A fragments and P's C fragments B
// fragments), which spares the tiles' shared memory and half the registers (two blocks an SM;
// bench/RESULTS.md row 150).
#include "kv_cache.cuh"

template <int D, int G, int NW, int KT, int ST, class KV> struct Dec {
    using R = KvRow<KV, D>;
    static constexpr int KTILE = KT, LDH = D + 8;  // f16 tile row (halves), padded as flash_attn.cu's
    static constexpr bool RAW = R::RAW;  // float, q8_0, q4_0: staged raw, converted into f16 tiles
    // q8_0: converted in registers straight into the mma fragments instead (no f16 tiles); its rows
    // padded by 16 bytes so that the fragments' 32-bit loads of 8 rows meet 32 banks
    static constexpr bool REG = R::SB > 0 && R::VB == D;
    // O accumulated transposed (see the kernel): REG needs it; 64-dim heads gain by it, 128-dim f16
    // caches lost (bench/RESULTS.md row 151)
    static constexpr bool TR = REG || D <= 64;
    // a staged row (bytes): f16 stages are the tiles
    static constexpr int LDRB = REG ? R::VB + 16 : RAW ? R::VB : 2 * LDH;
    static constexpr int STAGE = KT * (LDRB + R::SB);  // bytes of one stage of K (or V): rows, then scales
    // a warp's ring (bytes): K and V stages, and (raw) the f16 tiles they convert into
    static constexpr int WARP_BYTES = 2 * ST * STAGE + (RAW && !REG ? 2 * KT * LDH * 2 : 0);
    static constexpr int BYTES = NW * WARP_BYTES;
    static_assert(KT % 16 == 0 && D % 32 == 0 && ST >= 2 && G <= 8 && STAGE % 16 == 0, "tile shapes");
    static_assert(WARP_BYTES >= G * D * 4 + 2 * G * 4, "the merge reuses a warp's ring");
};

// One warp's cp.async of the KT-aligned tile of keys [k0, k0 + KT) into a stage; keys at or past
// end are zero-filled (masked later); the key ``skip`` is left alone (its row is requested later:
// two copies in flight to one address would land in either order). A tile inside one page (pages
// of KT keys or more) is one run of rows: one page lookup, consecutive lanes on consecutive bytes;
// a tile over several pages looks each row's page up.
// The byte offset of key's (page, hk) block in a layer's cache, -1 past end or without a page.
template <class KV, int D>
DEV long dec_block(int key, int end, const int* tab, int max_pages, int page_size, int n_head_kv, int hk) {
    const int pg = kv_page(key, page_size);
    const int page = key < end && pg < max_pages ? tab[pg] : -1;
    return page >= 0 ? kv_block<KV, D>(page, hk, n_head_kv, page_size) : -1;
}

template <class F, int D, class KV>
DEV void dec_load(int k0, int end, int skip, const int* tab, int max_pages, int page_size, int n_head_kv, int hk,
                  int lane, const KV* kcache, const KV* vcache, char* Ks, char* Vs) {
    using R = KvRow<KV, D>;
    constexpr int KT = F::KTILE, VP = R::VB / 16;  // 16-byte pieces of a row's values
    const char* kb = reinterpret_cast<const char*>(kcache);
    const char* vb = reinterpret_cast<const char*>(vcache);
    const int valid = min(KT, end - k0);  // rows below end
    const bool one = page_size >= KT;
    auto block_of = [&](int key) { return dec_block<KV, D>(key, end, tab, max_pages, page_size, n_head_kv, hk); };
    const long blk = one ? block_of(k0) : -1;
#pragma unroll
    for (int i = lane; i < KT * VP; i += 32) {
        const int j = i / VP, c = i % VP, key = k0 + j;
        if (key == skip) continue;
        const long b = one ? blk : block_of(key);
        const bool ok = j < valid && b >= 0;
        const long at = ok ? b + (long)kv_slot(key, page_size) * R::VB + 16 * c : 0;
        fa_cp16(Ks + j * F::LDRB + 16 * c, kb + at, ok);
        fa_cp16(Vs + j * F::LDRB + 16 * c, vb + at, ok);
    }
    if constexpr (R::SB > 0) {  // the rows' scales, a lane a row
        static_assert(KT <= 32, "a lane a row");
        const int key = k0 + lane;
        if (lane < KT && key != skip) {
            const long b = one ? blk : block_of(key);
            const bool ok = lane < valid && b >= 0;
            const long at = ok ? b + (long)page_size * R::VB + kv_slot(key, page_size) * R::SB : 0;
            kv_cp<R::SB>(Ks + KT * F::LDRB + lane * R::SB, kb + at, ok);
            kv_cp<R::SB>(Vs + KT * F::LDRB + lane * R::SB, vb + at, ok);
        }
    }
}

// BK (f16 caches): a tile's rows come by cp.async.bulk (the copy engine, one 16-byte-aligned row a
// request, into the padded tile rows) instead of sixteen 16-byte cp.asyncs a lane, and each stage
// of the warp's ring has an mbarrier that counts the tile's bytes. Rows past end or without a page
// are zeroed by the lane that would copy them (a masked key's V row must not hold NaN); the row
// ``skip`` is left alone as in dec_load.
DEV void mbar_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}
DEV void mbar_expect(u64* bar, u32 bytes) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(smem_u32(bar)),
                 "r"(bytes) : "memory");
}
DEV void mbar_wait(u64* bar, u32 parity) {
    asm volatile("{ .reg .pred done; FD_WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; "
                 "@!done bra FD_WAIT_%=; }" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
DEV void bulk_row(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

template <class F, int D, class KV>
DEV void dec_load_bulk(int k0, int end, int skip, const int* tab, int max_pages, int page_size, int n_head_kv, int hk,
                       int lane, const KV* kcache, const KV* vcache, char* Ks, char* Vs, u64* bar) {
    using R = KvRow<KV, D>;
    static_assert(R::SB == 0 && R::VB % 16 == 0, "f16 and float rows: one bulk request a row");
    constexpr int KT = F::KTILE;
    const int valid = min(KT, end - k0);
    const long b1 = page_size >= KT ? dec_block<KV, D>(k0, end, tab, max_pages, page_size, n_head_kv, hk) : -2;
    // each lane's rows r = lane + 32 i of the 2 KT (K rows, then V rows): their blocks first, then
    // the tile's bytes on the barrier before any request (its count may only reach zero once they land)
    constexpr int N = (2 * KT + 31) / 32;
    long b[N];
    u32 bytes = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {  // (every lane takes part in each ballot)
        const int r = lane + 32 * i, key = k0 + r % KT;
        b[i] = r >= 2 * KT || key == skip ? -2
             : b1 != -2                   ? (r % KT < valid ? b1 : -1)
                                          : dec_block<KV, D>(key, end, tab, max_pages, page_size, n_head_kv, hk);
        bytes += __popc(__ballot_sync(0xffffffffu, b[i] >= 0)) * R::VB;
    }
    if (lane == 0) mbar_expect(bar, bytes);
    __syncwarp();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // this stage's earlier generic writes
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int r = lane + 32 * i, j = r % KT;
        if (b[i] == -2) continue;  // no row, or the row skip
        char* dst = (r < KT ? Ks : Vs) + j * F::LDRB;
        if (b[i] >= 0) {
            const char* base = reinterpret_cast<const char*>(r < KT ? kcache : vcache);
            bulk_row(dst, base + b[i] + (long)kv_slot(k0 + j, page_size) * R::VB, R::VB, bar);
        } else {
#pragma unroll
            for (int c = 0; c < R::VB / 16; ++c) reinterpret_cast<uint4*>(dst)[c] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// q8_0 bytes (XORed with 0x80: q + 128) of w chosen by sel as the f16 pair d q, rounded once as
// kv_to_f16 does: q8_h2 with one f16 scale h for both, q8_h2s with a pair of scales
DEV u32 q8_h2s(u32 w, u32 sel, u32 d2) { return hmul2(hsub2(prmt(w, H_MAGIC, sel), 0x64806480u), d2); }
DEV u32 q8_h2(u32 w, u32 sel, u32 h) { return q8_h2s(w, sel, h | (h << 16)); }

// rope_kv's work (layers.cu) on one D-dim head src (global, float) into dst (shared), by one warp
// (lane: dimensions lane + 32 r): the RMS norm by nw (if any) with rope_kv's sums (block_sum over
// D threads: the warp sums of its D / 32 warps, then one warp's sum of those) and RoPE of the
// dimensions below n_rot at the angles cs (cos, sin a pair) with its arithmetic, so the bits are
// rope_kv's.
template <int D>
DEV void dec_rope_head(const float* src, float* dst, const float* nw, float eps, const float* cs, int n_rot,
                       int neox, int lane) {
    constexpr int NR = D / 32;
    float v[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) v[r] = src[lane + 32 * r];
    if (nw) {
        float w = 0.f;  // lane r: warp r's sum (the second stage's operand), others 0
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const float s = warp_sum(v[r] * v[r]);
            if (lane == r) w = s;
        }
        const float ss = warp_sum(w);
#pragma unroll
        for (int r = 0; r < NR; ++r) v[r] = v[r] * rsqrtf(ss / (float)D + eps) * nw[lane + 32 * r];
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) dst[lane + 32 * r] = v[r];
    __syncwarp();
#pragma unroll
    for (int r = 0; r < NR; ++r) {  // written out (not attention_tiles.cu's rope_at: here the compiler
        const int i = lane + 32 * r;  // contracted its products otherwise, and the bits must equal rope_kv's)
        if (i < n_rot) {
            int j, partner;
            bool first;
            if (neox) { const int half = n_rot / 2; first = i < half; j = first ? i : i - half; partner = first ? i + half : i - half; }
            else { j = i >> 1; first = (i & 1) == 0; partner = i ^ 1; }
            const float cf = cs[2 * j], sf = cs[2 * j + 1], o = dst[partner];
            v[r] = first ? v[r] * cf - o * sf : o * sf + v[r] * cf;
        }
    }
    __syncwarp();  // every lane has read dst
#pragma unroll
    for (int r = 0; r < NR; ++r) dst[lane + 32 * r] = v[r];
}

// The splits of a row at position p (the keys of its window): with kps (the step's keys a split,
// batches) n / kps of them, else enough of min_keys; at most n_split; whole KT-key tiles each, and
// counted again from the tiles a split then takes, so that none is empty. fit (without kps): then
// the fewest splits whose NW warps take as many rounds of tiles each as those would (past n_split
// x NW tiles): a split costs its row's merge a share of its bytes, a round a load's round trip.
template <int KT, int NW>
DEV int dec_splits(int p, int window, int n_split, int min_keys, int kps, int fit) {
    const int lo = window > 0 ? max(0, p - window + 1) : 0, n = p + 1 - lo / KT * KT, nt = (n + KT - 1) / KT;
    int ns = kps > 0 ? max(1, min(n_split, n / kps)) : min(n_split, (n + min_keys - 1) / min_keys);
    if (fit && kps == 0) {
        const int rounds = ((nt + ns - 1) / ns + NW - 1) / NW;
        ns = (nt + rounds * NW - 1) / (rounds * NW);
    }
    const int chunk = (nt + ns - 1) / ns * KT;
    return (n + chunk - 1) / chunk;
}

template <int D, int G, int NW, int KT, int ST, class KV, int BK = 0>
__global__ void __launch_bounds__(32 * NW) flash_decode(
        const float* __restrict__ q, int ldq, const KV* __restrict__ kcache, const KV* __restrict__ vcache,
        const int* __restrict__ pos, const int* __restrict__ seq, const int* __restrict__ table, int max_pages,
        int page_size, int n_head_kv, float scale, float cap, int window, int n_split, int min_keys, int target,
        int fit, int early, float* __restrict__ part_o, float* __restrict__ part_ml, unsigned* __restrict__ counter,
        float* __restrict__ out, int ldo, u16* __restrict__ out16, int ld16, u8* oq, int ldoq, float4* os,
        int ldos, int ores, const float* __restrict__ sinks, const float* __restrict__ own_kv, int ld_own, int rows,
        const double* __restrict__ inv_freq, int n_rot, int neox, const float* __restrict__ qnw,
        const float* __restrict__ knw, float eps) {
    using F = Dec<D, G, NW, KT, ST, KV>;
    constexpr int KS = D / 16, NS = KT / 8, LDH = F::LDH;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ float4 fd_smem[];
    if (dynamic_smem() < (u32)F::BYTES) __trap();  // the launcher's size (launch_attention.decode_smem) is short
    if (!early) pdl_enter();
    const int hk = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
    int s = blockIdx.y, t = blockIdx.z, kps = 0;
    if (target > 0) {  // keys a split from the step's total (every block of the step computes the same)
        int total = 0;
        for (int r = lane; r < rows; r += 32)
            if (seq[r] >= 0) total += min(pos[r] + 1, window > 0 ? window : pos[r] + 1);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        kps = max(min_keys, (int)(((long)total * n_head_kv + target - 1) / target));
    }
    if (gridDim.z == 1 && rows > 1) {
        // a packed grid (launch_attention.dec_grid_y): blockIdx.y numbers the step's (row, split)
        // blocks row by row (dec_splits of each row), the blocks past them exit; so every block
        // with keys is dispatched before any without, and with target the grid holds few more
        // blocks than there are. Else (one row, decode_packed off) the grid is (kv head, split, row)
        int done = 0;  // the splits of the rows before this 32
        t = -1;
        for (int r0 = 0; r0 < rows && t < 0; r0 += 32) {
            const int r = r0 + lane;
            const int c =
                r < rows ? dec_splits<KT, NW>(seq[r] < 0 ? 0 : pos[r], window, n_split, min_keys, kps, fit) : 0;
            int inc = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += v;
            }
            const int first = done + inc - c;  // this row's first block
            const unsigned hit = __ballot_sync(0xffffffffu, c > 0 && s >= first && s < first + c);
            if (hit) {
                const int L = __ffs(hit) - 1;
                t = r0 + L;
                s -= __shfl_sync(0xffffffffu, first, L);
                break;
            }
            done += __shfl_sync(0xffffffffu, inc, 31);
        }
        if (t < 0) return;
    }
    const bool pad = seq[t] < 0;  // a padding row of a batch bucket: no keys
    const int p = pad ? 0 : pos[t];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int base = lo / KT * KT;  // tiles start at multiples of KT (keys below lo are masked)
    const int n = p + 1 - base;
    const int ns = dec_splits<KT, NW>(p, window, n_split, min_keys, kps, fit);
    // a split's keys: whole tiles (dec_splits: none is empty)
    const int chunk = ((n + KT - 1) / KT + ns - 1) / ns * KT;
    if (s >= ns) return;
    const int start = base + s * chunk, end = pad ? start : min(p + 1, start + chunk);
    const int* tab = table + (long)(pad ? 0 : seq[t]) * max_pages;

    char* ring = reinterpret_cast<char*>(fd_smem) + warp * F::WARP_BYTES;
    char* Kst = ring;
    char* Vst = Kst + ST * F::STAGE;
    u16* Kh = reinterpret_cast<u16*>(Vst + ST * F::STAGE);  // raw caches: the converted f16 tiles
    u16* Vh = Kh + (F::RAW ? KT * LDH : 0);
    const int n_tiles = end > start ? (end - start + KT - 1) / KT : 0;
    const int mine = n_tiles > warp ? (n_tiles - 1 - warp) / NW + 1 : 0;  // this warp's tiles: warp + NW i
    const int skip = early ? p : -1;
    constexpr bool QUANT = KvRow<KV, D>::SB > 0;
    const bool fuse = QUANT && early && own_kv != nullptr;  // this kernel writes the row's own key
    // rope_kv's work here (n_rot > 0 with early; f16 caches, the launcher's check): q, k and v are
    // raw QKV rows. Its scratch is warp 0's last stage, which no load fills before the loop's first
    // step: K's for the rotated query heads [G][D]; V's for the angles (n_rot / 2 pairs) and the
    // rotated key [D]. A row without a page for its own key is left as rope_kv leaves it (q as it
    // is, nothing written: the early path then reads zeros for the key)
    // the row's own page (-1: none), for every path that touches the own key (read before pdl_enter:
    // page tables change only between steps)
    const int own_pg = kv_page(p, page_size), own_page = pad || own_pg >= max_pages ? -1 : tab[own_pg];
    const bool rot = early && n_rot > 0 && own_page >= 0;
    if (rot && (F::RAW || BK)) __trap();
    static_assert(F::RAW || (F::STAGE >= 4 * G * D && F::STAGE >= 8 * D), "rope scratch in a stage");
    float* rq = reinterpret_cast<float*>(reinterpret_cast<char*>(fd_smem) + (ST - 1) * F::STAGE);
    float* rcs = reinterpret_cast<float*>(reinterpret_cast<char*>(fd_smem) + (2 * ST - 1) * F::STAGE);
    float* rk = rcs + D;
    static_assert(!BK || (!F::RAW && !QUANT), "bulk rows: f16 caches");
    __shared__ __align__(8) u64 fd_bar[BK ? NW * ST : 1];  // BK: a barrier a stage of each warp's ring
    u64* bars = fd_bar + (BK ? warp * ST : 0);
    if constexpr (BK) {
        if (lane < ST) mbar_init(bars + lane);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        __syncwarp();
    }
    // this warp's tile (its i) holding the row's own key, else -1; own: the same, where the prologue
    // requests the key's row from the cache
    const int ot = (p - start) / KT;
    const int own_i = early && end == p + 1 && ot % NW == warp ? ot / NW : -1;
    const int own = !fuse && !rot && own_i < ST - 1 ? own_i : -1;
#pragma unroll
    for (int i = 0; i < ST - 1; ++i) {  // one commit group per tile (empty past the last)
        if (i < mine) {
            if constexpr (BK)
                dec_load_bulk<F, D, KV>(start + (warp + NW * i) * KT, end, skip, tab, max_pages, page_size, n_head_kv,
                                        hk, lane, kcache, vcache, Kst + i * F::STAGE, Vst + i * F::STAGE, bars + i);
            else
                dec_load<F, D, KV>(start + (warp + NW * i) * KT, end, skip, tab, max_pages, page_size, n_head_kv, hk,
                                   lane, kcache, vcache, Kst + i * F::STAGE, Vst + i * F::STAGE);
        }
        fa_commit();
    }
    if (rot)  // the angles of position p (pos and inv_freq come from earlier steps: before pdl_enter)
        for (int j = threadIdx.x; j < n_rot / 2; j += 32 * NW) {
            double sn, cn;
            sincos((double)p * inv_freq[j], &sn, &cn);
            rcs[2 * j] = (float)cn;
            rcs[2 * j + 1] = (float)sn;
        }
    if (early) {
        pdl_enter();
        if (own >= 0) {  // the own key's row into its prologue tile: a group of its own
            const int j = p - (start + (warp + NW * own) * KT);
            const int page = own_page;  // none: zeros, as dec_load
            const long blk = kv_block<KV, D>(max(page, 0), hk, n_head_kv, page_size);
            for (int c = lane; c < KvRow<KV, D>::PIECES; c += 32) {
                kv_stage_piece<KV, D, KT, F::LDRB>(j, c, kcache, blk, kv_slot(p, page_size), page_size, page >= 0,
                                                   Kst + own * F::STAGE);
                kv_stage_piece<KV, D, KT, F::LDRB>(j, c, vcache, blk, kv_slot(p, page_size), page_size, page >= 0,
                                                   Vst + own * F::STAGE);
            }
        }
        fa_commit();
    }
    float kown[D / 32];  // rot, the own key's warp: its dimensions lane + 32 r, rotated
    if (rot) {
        __syncthreads();  // the angles
        const float* raw = q + (long)t * ldq;
        // warp w: heads w, w + NW, ... of the G query heads and (g = G) the key where this block
        // holds the row's own one
        for (int g = warp; g < G + (end == p + 1); g += NW)
            dec_rope_head<D>(raw + (g < G ? hk * G + g : n_head_kv * G + hk) * D, g < G ? rq + g * D : rk,
                             g < G ? qnw : knw, eps, rcs, n_rot, neox, lane);
        __syncthreads();
        if (end == p + 1) {  // k and v into the cache, as rope_kv stores them
            const long at = (((long)own_page * n_head_kv + hk) * page_size + kv_slot(p, page_size)) * D;
            u16* kc = reinterpret_cast<u16*>(const_cast<KV*>(kcache)) + at;
            u16* vc = reinterpret_cast<u16*>(const_cast<KV*>(vcache)) + at;
            const float* vx = raw + (n_head_kv * (G + 1) + hk) * D;
            for (int i = threadIdx.x; i < D; i += 32 * NW) {
                kc[i] = f2h(rk[i]);
                vc[i] = f2h(vx[i]);
            }
            if (own_i >= 0)
#pragma unroll
                for (int r = 0; r < D / 32; ++r) kown[r] = rk[lane + 32 * r];
        }
    }
    // Q's A fragments: row grp is head grp (< G), rows grp + 8 are zero (a[1], a[3]). Columns 2 tig
    // (+ 1) and 2 tig + 8 (+ 1) of k step ks are dimensions 16 ks + 2 tig (+ 1) and + 8 (+ 1); REG:
    // 16 ks + 4 tig + 0 to 3, the four bytes of one 32-bit word of a q8_0 key row (S's sum over the
    // dimensions does not care for their order)
    u32 qa[KS][2];
    {
        const float* qh = (rot ? rq + min(grp, G - 1) * D : q + (long)t * ldq + (hk * G + min(grp, G - 1)) * D) +
                          (F::REG ? 4 : 2) * tig;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int c2 = F::REG ? 2 : 8;
            const float2 x0 = grp < G ? *reinterpret_cast<const float2*>(qh + 16 * ks) : make_float2(0.f, 0.f);
            const float2 x2 = grp < G ? *reinterpret_cast<const float2*>(qh + 16 * ks + c2) : make_float2(0.f, 0.f);
            qa[ks][0] = pack_h2(x0.x * scale, x0.y * scale);
            qa[ks][1] = pack_h2(x2.x * scale, x2.y * scale);
        }
    }
    if (rot) __syncthreads();  // every warp has read rq: warp 0's last stage is the loop's again
    // TR: O^T's accumulators (rows the dimensions, D / 16 tiles; columns the heads 2 tig, 2 tig + 1:
    // every register holds a head's value, where O's rows 8-15 are zero heads): P's C fragments are
    // the B fragments of P^T as they stand, V^T's A fragments come by ldmatrix.trans or (REG) from
    // the stage's bytes. Else O's (rows the heads, D / 8 tiles)
    constexpr int NO = F::TR ? D / 16 : D / 8;
    float o[NO][4], m = -INFINITY, l = 0.f;
#pragma unroll
    for (int d = 0; d < NO; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

    for (int i = 0; i < mine; ++i) {
        const int k0 = start + (warp + NW * i) * KT, st = i % ST;
        if constexpr (BK) {
            mbar_wait(bars + st, (i / ST) & 1);  // this tile's bulk rows have landed
            if (i == own) fa_wait<0>();          // ... and the own key's cp.async
        } else if (i == own) {
            fa_wait<0>();  // the own key's group came after the prologue's
        } else {
            fa_wait<ST - 2>();  // this tile's group has landed (later ones may be in flight)
        }
        __syncwarp();  // ... for every lane; the stage computed last iteration is free
        if (i + ST - 1 < mine) {
            const int sn = (i + ST - 1) % ST;
            if constexpr (BK)
                dec_load_bulk<F, D, KV>(start + (warp + NW * (i + ST - 1)) * KT, end, fuse || rot ? p : -1, tab,
                                        max_pages, page_size, n_head_kv, hk, lane, kcache, vcache,
                                        Kst + sn * F::STAGE, Vst + sn * F::STAGE, bars + sn);
            else
                dec_load<F, D, KV>(start + (warp + NW * (i + ST - 1)) * KT, end, fuse || rot ? p : -1, tab,
                                   max_pages, page_size, n_head_kv, hk, lane, kcache, vcache, Kst + sn * F::STAGE,
                                   Vst + sn * F::STAGE);
        }
        fa_commit();
        if constexpr (QUANT) {
            if (fuse && i == own_i) {  // the row's own key and value: quantized here (dec_load left the row)
                const int page = own_page, slot = kv_slot(p, page_size), j = p - k0;
                const float* kx = own_kv + (long)t * ld_own + (n_head_kv * G + hk) * D;
                if (page >= 0) {
                    kv_own_row<KV, D, KT, F::LDRB>(kx, kx + n_head_kv * D, lane, Kst + st * F::STAGE,
                                                   Vst + st * F::STAGE, j, const_cast<KV*>(kcache),
                                                   const_cast<KV*>(vcache), page, hk, n_head_kv, page_size, slot);
                } else {  // no page for it: nothing into the cache (as rope_kv), zeros into the row (as a load)
                    using R = KvRow<KV, D>;
                    for (int c = lane; c < R::VB + R::SB; c += 32) {
                        const int at = c < R::VB ? j * F::LDRB + c : KT * F::LDRB + j * R::SB + c - R::VB;
                        Kst[st * F::STAGE + at] = Vst[st * F::STAGE + at] = 0;
                    }
                }
                __syncwarp();
            }
        }
        if constexpr (!F::RAW && !BK) {
            if (rot && i == own_i) {  // the row's own key and value (rotated above; dec_load left the row)
                const int j = p - k0;
                u16* kr = reinterpret_cast<u16*>(Kst + st * F::STAGE + j * F::LDRB);
                u16* vr = reinterpret_cast<u16*>(Vst + st * F::STAGE + j * F::LDRB);
                const float* vx = q + (long)t * ldq + (n_head_kv * (G + 1) + hk) * D;
#pragma unroll
                for (int r = 0; r < D / 32; ++r) {
                    kr[lane + 32 * r] = f2h(kown[r]);
                    vr[lane + 32 * r] = f2h(vx[lane + 32 * r]);
                }
                __syncwarp();
            }
        }
        const u16* Kt = nullptr;
        const u16* Vt = nullptr;
        const char* Kb = Kst + st * F::STAGE;  // REG: the raw stages
        const char* Vb = Vst + st * F::STAGE;
        if constexpr (F::RAW && !F::REG) {  // raw stage -> f16 tiles
            kv_to_f16<KV, D, KT, F::LDRB, LDH>(Kst + st * F::STAGE, Kh, lane, 32);
            kv_to_f16<KV, D, KT, F::LDRB, LDH>(Vst + st * F::STAGE, Vh, lane, 32);
            __syncwarp();
            Kt = Kh;
            Vt = Vh;
        } else {
            Kt = reinterpret_cast<const u16*>(Kst + st * F::STAGE);
            Vt = reinterpret_cast<const u16*>(Vst + st * F::STAGE);
        }
        // S = Q K^T, two k steps per ldmatrix.x4, into two accumulators (even and odd k steps): the
        // dependent chain of mma is half as long
        float sc[NS][4], sd[NS][4];
#pragma unroll
        for (int nn = 0; nn < NS; ++nn)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[nn][e] = sd[nn][e] = 0.f;
#pragma unroll
        for (int kp = 0; kp < KS; kp += 2) {
            const u32 a0[4] = {qa[kp][0], 0u, qa[kp][1], 0u}, a1[4] = {qa[kp + 1][0], 0u, qa[kp + 1][1], 0u};
#pragma unroll
            for (int nn = 0; nn < NS; ++nn) {
                u32 b[4];
                if constexpr (F::REG) {  // key 8 nn + grp, words 4 kp + tig and 4 (kp + 1) + tig, scale kp / 2
                    const int key = 8 * nn + grp;
                    const char* row = Kb + key * F::LDRB + 16 * kp + 4 * tig;
                    const u32 x0 = *reinterpret_cast<const u32*>(row) ^ 0x80808080u;
                    const u32 x1 = *reinterpret_cast<const u32*>(row + 16) ^ 0x80808080u;
                    const u32 h = reinterpret_cast<const u16*>(Kb + KT * F::LDRB)[key * (D / 32) + kp / 2];
                    b[0] = q8_h2(x0, SEL01, h);
                    b[1] = q8_h2(x0, SEL23, h);
                    b[2] = q8_h2(x1, SEL01, h);
                    b[3] = q8_h2(x1, SEL23, h);
                } else {
                    ldsm4(b, Kt + (8 * nn + (lane & 7)) * LDH + 16 * kp + 8 * (lane >> 3));
                }
                fa_mma(sc[nn], a0, b[0], b[1]);
                fa_mma(sd[nn], a1, b[2], b[3]);
            }
        }
#pragma unroll
        for (int nn = 0; nn < NS; ++nn) { sc[nn][0] += sd[nn][0]; sc[nn][1] += sd[nn][1]; }
        float x = -INFINITY;  // mask, soft-cap, the row's maximum (log2 domain)
#pragma unroll
        for (int nn = 0; nn < NS; ++nn)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float v = sc[nn][e];
                if (cap > 0.f) v = cap * tanhf(v / cap);
                const int key = k0 + 8 * nn + 2 * tig + e;
                v = key < end && key >= lo ? v * LOG2E : -INFINITY;
                sc[nn][e] = v;
                x = fmaxf(x, v);
            }
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
        const float mn = fmaxf(m, x);  // finite: every tile holds at least one key of [lo, end)
        const float c = exp2f(m - mn);
        m = mn;
        float ts = 0.f;
#pragma unroll
        for (int nn = 0; nn < NS; ++nn) {
            sc[nn][0] = exp2f(sc[nn][0] - mn);
            sc[nn][1] = exp2f(sc[nn][1] - mn);
            ts += sc[nn][0] + sc[nn][1];
        }
        l = l * c + ts;  // this lane's share of the row's sum (the quad adds them at the end)
        if constexpr (!F::TR) {
#pragma unroll
            for (int d = 0; d < NO; ++d) { o[d][0] *= c; o[d][1] *= c; }
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {  // O += P V: P's C fragments are the A fragments of k step kk
                const u32 pa[4] = {pack_h2(sc[2 * kk][0], sc[2 * kk][1]), 0u,
                                   pack_h2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), 0u};
#pragma unroll
                for (int d = 0; d < NO; d += 2) {
                    u32 b[4];
                    ldsm4t(b, Vt + (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * LDH + 8 * d + 8 * (lane >> 4));
                    fa_mma(o[d], pa, b[0], b[1]);
                    fa_mma(o[d + 1], pa, b[2], b[3]);
                }
            }
        } else {
            // O^T += V^T P^T; the heads' rescale factors from the lanes holding their rows of S
            const float ca = __shfl_sync(0xffffffffu, c, 8 * tig), cb = __shfl_sync(0xffffffffu, c, 8 * tig + 4);
#pragma unroll
            for (int d = 0; d < NO; ++d) { o[d][0] *= ca; o[d][1] *= cb; o[d][2] *= ca; o[d][3] *= cb; }
#pragma unroll
            for (int kk = 0; kk < KT / 16; ++kk) {
                // P^T's B fragment of k step kk: keys 16 kk + 2 tig (+ 1) and + 8 (+ 1) of head grp
                const u32 pb0 = pack_h2(sc[2 * kk][0], sc[2 * kk][1]);
                const u32 pb1 = pack_h2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
                if constexpr (F::REG) {
                    const int r0 = 16 * kk + 2 * tig;  // V^T's A fragments: keys r0, r0 + 1, r0 + 8, r0 + 9
                    const u16* vs = reinterpret_cast<const u16*>(Vb + KT * F::LDRB);
#pragma unroll
                    // word grp + 8 j of each key row: dimensions 32 j + 4 grp + 0..3
                    for (int j = 0; j < D / 32; ++j) {
                        const char* w = Vb + r0 * F::LDRB + 4 * (grp + 8 * j);
                        const u32 v0 = *reinterpret_cast<const u32*>(w) ^ 0x80808080u;
                        const u32 v1 = *reinterpret_cast<const u32*>(w + F::LDRB) ^ 0x80808080u;
                        const u32 v8 = *reinterpret_cast<const u32*>(w + 8 * F::LDRB) ^ 0x80808080u;
                        const u32 v9 = *reinterpret_cast<const u32*>(w + 9 * F::LDRB) ^ 0x80808080u;
                        const u32 d01 = vs[r0 * (D / 32) + j] | (u32)vs[(r0 + 1) * (D / 32) + j] << 16;
                        const u32 d89 = vs[(r0 + 8) * (D / 32) + j] | (u32)vs[(r0 + 9) * (D / 32) + j] << 16;
#pragma unroll
                        // tile 2 j + h: its rows grp / grp + 8 are the word's dimensions 2 h / 2 h + 1;
                        // sel pairs row r's byte with row r + 1's for each of the two
                        for (int h = 0; h < 2; ++h) {
                            const u32 sel = h ? 0x7362u : 0x5140u;
                            const u32 t01 = prmt(v0, v1, sel), t89 = prmt(v8, v9, sel);
                            const u32 a[4] = {q8_h2s(t01, SEL01, d01), q8_h2s(t01, SEL23, d01), q8_h2s(t89, SEL01, d89),
                                              q8_h2s(t89, SEL23, d89)};
                            fa_mma(o[2 * j + h], a, pb0, pb1);
                        }
                    }
                } else {  // tile d: dimensions 16 d + grp (+ 8), from the f16 tile's rows by ldmatrix.trans
#pragma unroll
                    for (int d = 0; d < NO; ++d) {
                        u32 a[4];
                        ldsm4t(a, Vt + (16 * kk + (lane & 7) + 8 * (lane >> 4)) * LDH + 16 * d +
                                      8 * ((lane >> 3) & 1));
                        fa_mma(o[d], a, pb0, pb1);
                    }
                }
            }
        }
    }
    fa_wait<0>();
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // the warps' merge: each warp's (max, sum, O) per head into its own ring, then per head the
    // weights exp2(m_w - M) and the weighted sums
    float* wo = reinterpret_cast<float*>(ring);  // [G][D] of this warp, then m[G], l[G]
    __syncwarp();
    if constexpr (!F::TR) {
        if (grp < G) {
#pragma unroll
            for (int d = 0; d < NO; ++d)
                *reinterpret_cast<float2*>(wo + grp * D + 8 * d + 2 * tig) = make_float2(o[d][0], o[d][1]);
        }
    } else {
#pragma unroll
        for (int d = 0; d < NO; ++d) {  // O^T's rows grp / grp + 8: dimensions e0 / e1 of heads 2 tig, 2 tig + 1
            // REG: dimensions 32 j + 4 grp + 2 h (+ 1) of tile d = 2 j + h; else 16 d + grp (+ 8)
            const int e0 = F::REG ? 32 * (d / 2) + 4 * grp + 2 * (d % 2) : 16 * d + grp;
            const int e1 = F::REG ? e0 + 1 : e0 + 8;
            if (2 * tig < G) { wo[2 * tig * D + e0] = o[d][0]; wo[2 * tig * D + e1] = o[d][2]; }
            if (2 * tig + 1 < G) { wo[(2 * tig + 1) * D + e0] = o[d][1]; wo[(2 * tig + 1) * D + e1] = o[d][3]; }
        }
    }
    if (grp < G && tig == 0) { wo[G * D + grp] = m; wo[G * D + G + grp] = l; }
    __syncthreads();
    __shared__ float fw[NW][G], sML[G][2];
    if (threadIdx.x < G) {
        const int g = threadIdx.x;
        float M = -INFINITY, L = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w)
            M = fmaxf(M, reinterpret_cast<const float*>(fd_smem)[w * (F::WARP_BYTES / 4) + G * D + g]);
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float* r = reinterpret_cast<const float*>(fd_smem) + w * (F::WARP_BYTES / 4) + G * D;
            const float f = M > -INFINITY ? exp2f(r[g] - M) : 0.f;
            fw[w][g] = f;
            L += r[G + g] * f;
        }
        sML[g][0] = M / LOG2E;  // natural-log domain, as merge_splits and attention.cu keep it
        // the row's only block: a sink (gpt-oss) joins the denominator here, else in merge_splits
        sML[g][1] = sinks && ns == 1 && M > -INFINITY ? L + exp2f(fmaf(sinks[hk * G + g], LOG2E, -M)) : L;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
        const int g = idx / D, e = idx % D;
        float O = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) O = fmaf(reinterpret_cast<const float*>(fd_smem)[w * (F::WARP_BYTES / 4) + idx],
                                             fw[w][g], O);
        const float L = sML[g][1];
        if (ns == 1) {  // the row's only block: the output directly
            const float v = L > 0.f ? O / L : 0.f;
            out[(long)t * ldo + (hk * G + g) * D + e] = v;
            if (out16) out16[(long)t * ld16 + (hk * G + g) * D + e] = f2h(v);
            continue;
        }
        const long slot = ((long)t * n_head_kv * G + hk * G + g) * n_split + s;
        part_o[slot * D + e] = O;
        if (e == 0) { part_ml[2 * slot] = sML[g][0]; part_ml[2 * slot + 1] = L; }
    }
    merge_splits<D, G>(t, hk, ns, n_split, n_head_kv, part_o, part_ml, counter, out, ldo, out16, ld16, oq, ldoq, os,
                       ldos, ores, sinks);
}

#ifdef GGUF_INSTANTIATE_ALL
#define INST1(D, G, NW, KT, ST, KV) template __global__ void flash_decode<D, G, NW, KT, ST, KV>(const float*, int, \
    const KV*, const KV*, const int*, const int*, const int*, int, int, int, float, float, int, int, int, int, \
    int, int, float*, float*, unsigned*, float*, int, u16*, int, u8*, int, float4*, int, int, const float*, \
    const float*, int, int, const double*, int, int, const float*, const float*, float);
#define INST(D, G, NW, KT, ST) INST1(D, G, NW, KT, ST, float) INST1(D, G, NW, KT, ST, u16) \
    INST1(D, G, NW, KT, ST, kvq8) INST1(D, G, NW, KT, ST, kvq4)
INST(64, 1, 4, 16, 3) INST(64, 3, 4, 16, 3) INST(128, 4, 4, 16, 3) INST(128, 4, 4, 16, 4) INST(128, 4, 4, 32, 3)
INST(128, 8, 4, 16, 3) INST(256, 4, 4, 16, 3) INST(256, 8, 4, 16, 3) INST(128, 4, 2, 16, 4) INST(128, 4, 8, 16, 2)
template __global__ void flash_decode<128, 4, 8, 16, 2, u16, 1>(const float*, int, const u16*, const u16*, const int*,
    const int*, const int*, int, int, int, float, float, int, int, int, int, int, int, float*, float*, unsigned*,
    float*, int, u16*, int, u8*, int, float4*, int, int, const float*, const float*, int, int, const double*, int, int,
    const float*, const float*, float);
#endif
