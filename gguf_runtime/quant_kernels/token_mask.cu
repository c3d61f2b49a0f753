// Grammar masks inside the batch step (structured output, forced tool calls): each row's logits of
// the tokens its slot's grammar forbids set to -inf after the penalty and before the sampler, so
// constrained and free sequences share a step. mask: u32 [n_seq][words], bit i % 32 of word i / 32
// set where token i is allowed (llguidance's layout, filled by the host between steps); a free
// slot's row is all ones and changes nothing. Row r belongs to slot slot_map[r] or slot0 + r, as
// the sampler's rows do; padding slots (seq < 0) are skipped. Grid (word blocks, rows): a thread a
// word.
#include "common.cuh"

extern "C" __global__ void apply_mask(float* logits, int ld, int n_vocab, const unsigned* __restrict__ mask,
                                      int words, const int* __restrict__ seq, int slot0,
                                      const int* __restrict__ slot_map) {
    pdl_enter();
    const int r = blockIdx.y, w = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = slot_map ? slot_map[r] : slot0 + r;
    if (b < 0 || seq[b] < 0 || w >= words) return;
    const unsigned m = mask[(long)b * words + w];
    if (m == 0xffffffffu) return;
    float* x = logits + (long)r * ld + 32 * w;
    const int n = min(32, n_vocab - 32 * w);
    for (int j = 0; j < n; ++j)
        if (!(m >> j & 1u)) x[j] = -INFINITY;
}
