// One-shot all-reduce over peer memory for tensor parallelism's small sums (the decode steps' O and
// down products: a few KiB to 1 MiB), measured against NCCL inside graphs (bench/tp_allreduce.py);
// the tuning table's tp_oneshot_rows says up to how many rows it runs (0: NCCL for every sum).
//
// Lamport-style push: no flags and no fences. Every rank owns a receive buffer of 3 x world slots
// (cap floats each) that starts filled with -0.0, the "empty" value. In call e a rank writes its x
// into slot (e % 3, its rank) of every rank's buffer (stores over NVLink; -0.0 sent as +0.0), then
// waits in its own buffer until no element of slot (e % 3, s) is empty, for each s, and sums the
// slots in rank order, so every rank gets the same bits (the ranks sample alone from the result).
// The data is its own flag: a 4-byte store lands whole, and a float4 whose any part is still
// empty is read again. A rank clears its slots of call e - 1 ((e + 2) % 3) during call e: every
// rank has written them (it read them), and none writes there again before call e + 2, which needs
// this rank's data of call e + 1.
//
// Every rank launches the same fixed grid (AR_BLOCKS blocks), so block b handles the same indices
// in every call and on every rank; each block keeps its own buffer index (the call count modulo 3)
// and the length of its last call (what to clear) in device memory, so graphs replay it.
#include "allreduce.cuh"

#define AR_THREADS 256

// x[0:n] = the sum over the ranks of their x[0:n] (n % 4 == 0, n <= cap). recv[r]: rank r's receive
// buffer [3][world][cap]; epoch, last: this rank's [AR_BLOCKS] buffer indices and last lengths.
extern "C" __global__ void __launch_bounds__(AR_THREADS) allreduce_push(
    float* x, int n, const unsigned long long* __restrict__ recv, unsigned* epoch, int* last, int rank, int world,
    int cap) {
    __shared__ unsigned s_epoch;
    __shared__ int s_last;
    pdl_enter();
    if (threadIdx.x == 0) {
        s_epoch = (epoch[blockIdx.x] + 1) % 3;
        s_last = last[blockIdx.x];
    }
    __syncthreads();
    const unsigned e = s_epoch;
    const long slot = cap;
    const long cur = (long)e * world * slot, old = (long)((e + 2) % 3) * world * slot;
    const int n4 = n >> 2, last4 = s_last >> 2, step = gridDim.x * blockDim.x;
    const int first = blockIdx.x * blockDim.x + threadIdx.x;
    float4* x4 = reinterpret_cast<float4*>(x);
    for (int i = first; i < n4; i += step) {
        const float4 v = sendable4(x4[i]);
        for (int r = 0; r < world; ++r)
            reinterpret_cast<float4*>(reinterpret_cast<float*>(recv[r]) + cur + rank * slot)[i] = v;
    }
    float* own = reinterpret_cast<float*>(recv[rank]);
    const float4 empty = make_float4(-0.0f, -0.0f, -0.0f, -0.0f);
    for (int i = first; i < last4; i += step)
        for (int s = 0; s < world; ++s) reinterpret_cast<float4*>(own + old + s * slot)[i] = empty;
    const unsigned long long t0 = now_ns();
    for (int i = first; i < n4; i += step) {
        float4 acc = ar_wait4(reinterpret_cast<const float4*>(own + cur) + i, t0);
        for (int s = 1; s < world; ++s) add4(acc, ar_wait4(reinterpret_cast<const float4*>(own + cur + s * slot) + i, t0));
        x4[i] = acc;
    }
    if (threadIdx.x == 0) {
        epoch[blockIdx.x] = e;
        last[blockIdx.x] = n;
    }
}
