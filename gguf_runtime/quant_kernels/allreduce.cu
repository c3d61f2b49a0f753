// One-shot all-reduce over peer memory: tensor parallelism's small sums (the decode steps' O and
// down products, a few KiB to 1 MiB), measured against NCCL inside graphs (bench/tp_allreduce.py;
// slower as it stands, so off by default: the tuning table's tp_oneshot_rows).
//
// Every rank launches the same grid (AR_BLOCKS blocks, fixed, so block b handles the same indices
// in every call). Block b copies its slice of x into half (epoch & 1) of its rank's staging buffer,
// tells block b of every rank (a flag in that rank's memory: the epoch), waits for every rank's
// flag, then sums the ranks' slices in rank order, so every rank gets the same bits (the ranks
// sample alone from the result). Halves alternate by epoch: a rank can be at most one call ahead
// of another (it waits for the other's flag of that call), so it never overwrites the half a
// slower rank still reads. The epochs are each block's counter in device memory (graphs replay).
#include "common.cuh"

#define AR_THREADS 256

DEV void st_flag(unsigned* p, unsigned v) {
    asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

DEV unsigned ld_flag(const unsigned* p) {
    unsigned v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// x[0:n] = the sum over ranks of their x[0:n] (n % 4 == 0). stage[r]: rank r's staging buffer
// (two halves of half floats); flags[r]: rank r's flags [blocks][world]; epoch: this rank's
// [blocks] counters.
extern "C" __global__ void __launch_bounds__(AR_THREADS) allreduce_oneshot(
    float* x, int n, const unsigned long long* __restrict__ stage, const unsigned long long* __restrict__ flags,
    unsigned* epoch, int rank, int world, int half) {
    __shared__ unsigned s_epoch;
    pdl_enter();
    if (threadIdx.x == 0) s_epoch = epoch[blockIdx.x] + 1;
    __syncthreads();
    const unsigned e = s_epoch;
    const long off = (long)(e & 1) * half;
    const int n4 = n >> 2, step = gridDim.x * blockDim.x;
    float4* x4 = reinterpret_cast<float4*>(x);
    float4* mine = reinterpret_cast<float4*>(reinterpret_cast<float*>(stage[rank]) + off);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += step) mine[i] = x4[i];
    __syncthreads();
    if (threadIdx.x < world) {  // thread r: signal rank r, wait for rank r
        __threadfence_system();  // (the block's staging writes, ordered by the barrier, before the flag)
        unsigned* peer = reinterpret_cast<unsigned*>(flags[threadIdx.x]);
        st_flag(peer + blockIdx.x * world + rank, e);
        const unsigned* own = reinterpret_cast<const unsigned*>(flags[rank]) + blockIdx.x * world + threadIdx.x;
        while ((int)(ld_flag(own) - e) < 0) {
        }
        __threadfence_system();
    }
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += step) {
        float4 acc = __ldcg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(stage[0]) + off) + i);
        for (int r = 1; r < world; ++r) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(stage[r]) + off) + i);
            acc.x += v.x;
            acc.y += v.y;
            acc.z += v.z;
            acc.w += v.w;
        }
        x4[i] = acc;
    }
    if (threadIdx.x == 0) epoch[blockIdx.x] = e;
}
