// The pieces of the Lamport-style push all-reduce (the protocol: allreduce.cu's comment), shared by
// allreduce.cu and layers.cu's rmsnorm_allreduce (the sum inside the next RMSNorm's launch).
#pragma once
#include "common.cuh"

#define AR_EMPTY 0x80000000u           // -0.0f: a slot element not yet written
#define AR_PATIENCE_NS 30000000000ull  // a peer silent this long is gone (a trap, not a hang)

DEV float4 ld_volatile4(const float4* p) {
    float4 v;
    asm volatile("ld.volatile.global.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

DEV bool any_empty(float4 v) {
    return __float_as_uint(v.x) == AR_EMPTY || __float_as_uint(v.y) == AR_EMPTY || __float_as_uint(v.z) == AR_EMPTY ||
           __float_as_uint(v.w) == AR_EMPTY;
}

DEV float sendable(float v) { return __float_as_uint(v) == AR_EMPTY ? 0.0f : v; }

DEV float4 sendable4(float4 v) { return make_float4(sendable(v.x), sendable(v.y), sendable(v.z), sendable(v.w)); }

DEV unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The float4 at p once every part of it has landed (t0: when the wait began).
DEV float4 ar_wait4(const float4* p, unsigned long long t0) {
    float4 v = ld_volatile4(p);
    while (any_empty(v)) {
        if (now_ns() - t0 > AR_PATIENCE_NS) __trap();
        v = ld_volatile4(p);
    }
    return v;
}

DEV void add4(float4& a, float4 b) {
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
}
