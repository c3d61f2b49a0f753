"""Batched decoding on the bucket graphs: uneven prompts, paged KV, each sequence as if alone."""

import dataclasses

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.engine.decode_loop import sample_loop  # noqa: E402
from gguf_runtime.backends.cuda.backend import CudaBackend  # noqa: E402
from gguf_runtime.engine.batch import generate_batch  # noqa: E402
from gguf_runtime.errors import BackendError  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.model_config import config_from_gguf  # noqa: E402
from gguf_runtime.quant_kernels.launchers import MAX_MMV_TOKENS  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402

from twin_files import TWINS, twin_path  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=TWINS)
def pair(request):
    """A 64-slot backend and a one-sequence backend on the same twin."""
    f = open_gguf(twin_path(request.param))
    cfg = config_from_gguf(f)
    return CudaBackend(f, cfg, 512, max_batch=64), CudaBackend(f, cfg, 512)


@pytest.fixture(scope="module")
def backend(pair):
    return pair[0]


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [1, 3, 9, 17, 40, 5, 2, 33, 12, 7, 25, 4, 60, 8, 19, 11][:n]  # pages of 16: uneven, crossing
    return [rng.integers(10, 40000, k).tolist() for k in lengths]


def step_kernels(be, ps, rows: int) -> list[str]:
    """The kernels of one eager greedy step of ``rows`` sequences (prompts ps[:rows])."""
    for s in range(rows):
        be.seq_add(s, ps[s], GREEDY, 8)
    be.kernels.timeline = []
    with be.stream:
        be._step(rows, (False, True))
    be.stream.synchronize()
    names, be.kernels.timeline = [n for n, _, _ in be.kernels.timeline], None
    for s in range(rows):
        be.seq_release(s)
    return names


def test_small_batch_equals_each_sequence_alone(pair):
    """Up to 8 rows the batch runs the matvecs of one sequence: with the output head on them too
    (head_mma_rows 0), identical greedy tokens. The tuning table's head_mma_rows (4) puts the heads
    of steps of 4-8 rows on the tensor cores: each sequence then gets the tokens it gets alone in
    that bucket, and steps of 2 rows keep the matvec head."""
    backend, single = pair
    ps = prompts(5)
    tune = backend.tune
    assert tune.head_mma_rows == 4
    backend.retune(dataclasses.replace(tune, head_mma_rows=0))
    try:
        batched = generate_batch(backend, ps, 40, GREEDY)
    finally:
        backend.retune(tune)
    for p, got in zip(ps, batched):
        single.truncate(0)
        single.prefill(p)
        assert got == list(sample_loop(single, 40, GREEDY, p, frozenset()))
    ps = prompts(8)
    batched = generate_batch(backend, ps, 24, GREEDY, bucket=8)
    for s in (0, 7):
        assert batched[s] == generate_batch(backend, [ps[s]], 24, GREEDY, slots=[s], bucket=8)[0]
    for rows, mma in ((2, False), (4, True), (8, True)):
        names = step_kernels(backend, ps, rows)
        assert any(n.startswith("mma_") for n in names) == mma


def test_tensor_core_bucket_equals_alone_in_the_same_bucket(backend):
    """Buckets above 8 rows run the tensor-core kernels; each sequence gets the tokens it gets
    when it runs alone in that bucket (padding rows write no KV and affect no other row)."""
    ps = prompts(16, seed=1)
    batched = generate_batch(backend, ps, 24, GREEDY, bucket=16)
    for s in (0, 4, 12):
        alone = generate_batch(backend, [ps[s]], 24, GREEDY, slots=[s], bucket=16)[0]
        assert batched[s] == alone


@pytest.mark.parametrize("name", TWINS)
def test_tensor_core_small_buckets(name, monkeypatch):
    """decode_mmv_rows 2 (the tuning table's choice for models over 1 GiB): decode steps of 4 and 8
    rows run the tensor-core products, and each sequence gets the tokens it gets alone in that
    bucket; a 2-row step keeps the matvecs. The rule by size, and bad values."""
    from gguf_runtime.backends.cuda import tuning

    monkeypatch.setenv("GGUF_RUN_TUNE", "decode_mmv_rows=2")
    f = open_gguf(twin_path(name))
    be = CudaBackend(f, config_from_gguf(f), 256, max_batch=8)
    assert be.blocks.decode_mmv_rows == 2
    ps = prompts(8, seed=4)
    for n in (4, 8):
        batched = generate_batch(be, ps[:n], 16, GREEDY, bucket=n)
        for s in (0, n - 1):
            assert batched[s] == generate_batch(be, [ps[s]], 16, GREEDY, slots=[s], bucket=n)[0]
    for rows, mma in ((2, False), (4, True), (8, True)):
        names = step_kernels(be, ps, rows)
        assert any(n.startswith("mma_") for n in names) == mma
        assert any(n.startswith("mmv_") for n in names) != mma
    monkeypatch.delenv("GGUF_RUN_TUNE")
    assert tuning.choose(2 << 30).decode_mmv_rows == 2 and tuning.choose(1 << 29).decode_mmv_rows == 8
    for bad in ("0", "9", "two"):
        with pytest.raises(BackendError, match="decode_mmv_rows"):
            tuning.choose(1 << 20, overrides=f"decode_mmv_rows={bad}")


def test_sampled_batch_is_reproducible_and_pages_return(backend):
    free = backend.kv.free_pages()
    ps = prompts(12, seed=2)
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=i, repeat_penalty=1.1) for i in range(12)]
    a = generate_batch(backend, ps, 30, params, seeds=list(range(12)))
    b = generate_batch(backend, ps, 30, params, seeds=list(range(12)))
    assert a == b
    assert len({tuple(x) for x in a}) > 1
    assert backend.kv.free_pages() == free


def test_buckets_replay_without_allocation(backend):
    backend.capture_buckets()
    assert {k[1] for k in backend.graphs.graphs if k[0] == "decode"} >= {1, 2, 4, 8, 16, 32, 64}
    ps = prompts(16, seed=3) * 4  # 64 sequences
    generate_batch(backend, ps, 4, GREEDY)  # warm
    for s, p in enumerate(ps):
        backend.seq_add(s, p, GREEDY, 210)
    backend.stream.synchronize()
    pool = cp.get_default_memory_pool()
    mem = (pool.used_bytes(), pool.total_bytes())
    kernels, graphs = backend.kernels.launches, backend.graphs.launches
    for i in range(200):
        backend.batch_step(64)
        if i % 32 == 31:
            backend.stream.synchronize()
    backend.stream.synchronize()
    assert (pool.used_bytes(), pool.total_bytes()) == mem
    assert backend.kernels.launches == kernels  # no kernel launched from the host per step...
    assert backend.graphs.launches - graphs == 200  # ...one graph launch per step
    for s in range(64):
        backend.seq_release(s)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("name", TWINS)
def test_attention_tiles_step_matches_split_attention(name, kv_type):
    """A tensor-core decode step with attention_tiles.cu forced (RoPE and the KV write in it where
    the model has no per-head norms) gives the logits of attention.cu's splits with rope_kv, with
    either cache type."""
    f = open_gguf(twin_path(name))
    cfg = config_from_gguf(f)
    be = CudaBackend(f, cfg, 512, max_batch=16, use_graph=False, kv_type=kv_type)
    for s, p in enumerate(prompts(16, seed=4)):
        be.seq_add(s, p, GREEDY, 64)
    be.stream.synchronize()
    be._save_state()
    logits, kinds = [], []
    for tiles in ("off", "on"):
        be.retune(dataclasses.replace(be.tune, tiles=tiles))
        kinds.append(any(k.startswith("attn_tiles") for k in step_kernels_now(be, 16)))
        be.ws.logits.fill(np.nan)
        with be.stream:
            be._step(16, (False, True))
            logits.append(be.ws.logits[:16].get())
            be._restore_state()
    assert kinds == [False, True]  # (the choice reaches the step)
    split, tiled = (np.asarray(x, np.float64) for x in logits)
    assert np.isfinite(tiled).all()
    err = np.linalg.norm(tiled - split) / np.linalg.norm(split)
    print(f"{name}, {kv_type} cache: relative logit difference {err:.1e}")
    assert err < 1e-2  # f32 sums in another order, through f16 copies and every layer


def step_kernels_now(be, rows: int) -> list[str]:
    """The kernels one eager step of ``rows`` (the sequences admitted) launches, the state restored
    after it."""
    be.kernels.timeline = []
    with be.stream:
        be._save_state()
        be._step(rows, (False, True), be._deep(rows))
        be._restore_state()
    be.stream.synchronize()
    names, be.kernels.timeline = [n for n, _, _ in be.kernels.timeline], None
    return names


@pytest.mark.parametrize("name", TWINS)
def test_deep_batch_steps_take_flash_decode(name):
    """tiles_max_keys: a batch step whose rows hold more keys on average than it runs its attention
    on flash_decode.cu, with the logits of tiles=off bit for bit; a shallower one on
    attention_tiles.cu, with those of tiles=on; each kind has its graph, both captured with the
    buckets, and batch_step replays the one its rows call for."""
    f = open_gguf(twin_path(name))
    cfg = config_from_gguf(f)
    be = CudaBackend(f, cfg, 512, max_batch=16, kv_type="f16")
    be.retune(dataclasses.replace(be.tune, tiles="auto", tiles_min_blocks=1, tiles_max_keys=1))
    if not be._deep_bucket(16):
        pytest.skip(f"{name}: its batch steps have no flash_decode to take")
    for s, p in enumerate(prompts(16, seed=6)):
        be.seq_add(s, p, GREEDY, 64)
    mean = sum(be.slot_len[:16]) / 16
    be.stream.synchronize()
    got = {}
    for label, tune in (("deep", dataclasses.replace(be.tune, tiles_max_keys=int(mean) - 1)),
                        ("shallow", dataclasses.replace(be.tune, tiles_max_keys=int(mean) + 1)),
                        ("off", dataclasses.replace(be.tune, tiles="off")),
                        ("on", dataclasses.replace(be.tune, tiles="on"))):
        be.retune(tune)
        kernels = step_kernels_now(be, 16)
        with be.stream:
            be._save_state()
            be.ws.logits.fill(np.nan)
            be._step(16, (False, True), be._deep(16))
            got[label] = (be._deep(16), any(k.startswith("attn_tiles") for k in kernels), be.ws.logits[:16].get())
            be._restore_state()
    assert [got[k][:2] for k in ("deep", "shallow", "off", "on")] == [(True, False), (False, True), (False, False),
                                                                      (False, True)]
    assert np.isfinite(got["deep"][2]).all() and np.isfinite(got["shallow"][2]).all()
    np.testing.assert_array_equal(got["deep"][2], got["off"][2])
    np.testing.assert_array_equal(got["shallow"][2], got["on"][2])
    be.retune(dataclasses.replace(be.tune, tiles="auto", tiles_max_keys=int(mean) - 1))
    be.capture_buckets()
    assert {("decode", 16, False, True), ("decode", 16, False, True, "deep")} <= set(be.graphs.graphs)
    n, keys = be.graphs.launches, set(be.graphs.graphs)
    be.batch_step(16)  # deep: its graph, no capture
    be.stream.synchronize()
    assert be.graphs.launches == n + 1 and set(be.graphs.graphs) == keys
    for s in range(16):
        be.seq_release(s)


@pytest.mark.parametrize("n_prompt", [70, 150])
def test_prefix_cache_pages_give_the_logits_of_a_whole_prefill(backend, n_prompt):
    """A conversation's second turn (the first turn's prompt, its 9 greedy tokens, 5 more) takes the
    full pages the first turn left (its prompt prefilled, its answer written by decode steps) and
    evaluates the rest (70: 4 pages, the last 20 tokens at 64..83; 150: 9 pages, 20 tokens at
    144..163, past the 128 keys where chunked admission went wrong on the small twins): its
    next-token logits match those of the same tokens prefilled whole in another slot (pages or
    positions off by one would not)."""
    be = backend
    free = be.kv.free_pages()
    rng = np.random.default_rng(9)
    p = rng.integers(10, 30000, n_prompt).tolist()
    assert be.seq_add(0, p, GREEDY, 20, reuse=True) == n_prompt
    for _ in range(9):
        be.batch_step(1)
    be.stream.synchronize()
    gen = [be.seq_token(0, i) for i in range(10)]
    be.seq_release(0, p + gen[:9])  # step 9 wrote gen[8]'s K/V
    q = p + gen[:9] + rng.integers(10, 30000, 5).tolist()
    pages = (n_prompt + 9) // 16
    assert be.kv.pool.cached() >= pages
    logits = []
    for slot, reuse, want in ((1, True, len(q) - 16 * pages), (2, False, len(q))):
        assert be.seq_add(slot, q, GREEDY, 20, reuse=reuse) == want
        logits.append(cp.asnumpy(be.last_logits[-1], stream=be.stream).astype(np.float64))
    be.seq_release(1)
    be.seq_release(2)
    be.kv.pool.clear()
    reused, whole = logits
    err = np.linalg.norm(reused - whole) / np.linalg.norm(whole)
    print(f"prefix-cache logits, {16 * pages} cached of {len(q)}, against a whole prefill: relative difference "
          f"{err:.1e}")
    assert err < 1e-2 and reused.argmax() == whole.argmax()
    assert be.kv.free_pages() == free and be.kv.pool.cached() == 0


@pytest.mark.parametrize("chunk,bar,steps", [(64, 1e-6, True), (48, 3e-2, True), (64, 1e-6, False)])
def test_prompt_in_chunks_between_decode_steps_gives_the_logits_of_a_whole_prefill(backend, chunk, bar, steps):
    """The server's chunked admission: slot 0's 150-token prompt evaluated in chunks with a decode
    step of slot 1 (bucket 2: slot 0's row in it, inactive) after each: its last chunk's logits
    match the same prompt prefilled whole in slot 2: chunks on 64-key tiles as the whole prompt's
    (the same sums: bitwise in the prefix-cache test), chunks of 48 within the f32 reordering bar
    of test_attention_tiles_step_matches_split_attention (measured 1.0e-2 and 1.2e-2 on the
    twins). Before the fix a decode step advanced the filling slot's length: chunks landed at
    wrong positions. It samples from its own logits. Without the decode steps (steps=False), the
    same chunks tell a decode-step interaction from a prefill chunk at 128 keys and more. Logits are
    read on the backend's stream: a plain .get() (the legacy stream) raced a replayed prefill graph
    and read the chunk before's logits (1.4-1.5 off on the small twins, whose prefill is a graph)."""
    be = backend
    free = be.kv.free_pages()
    rng = np.random.default_rng(11)
    p = rng.integers(10, 30000, 150).tolist()
    be.seq_add(1, rng.integers(10, 30000, 20).tolist(), GREEDY, 40)
    assert be.seq_start(0, p, GREEDY, 10) == 0
    for s in range(0, 150, chunk):
        be.seq_prefill(0, p[s:s + chunk])
        if s + chunk < 150 and steps:
            be.batch_step(2)
    chunked = cp.asnumpy(be.last_logits[-1], stream=be.stream).astype(np.float64)
    be.seq_first(0, p, GREEDY, 0)
    be.seq_add(2, p, GREEDY, 10)
    whole = cp.asnumpy(be.last_logits[-1], stream=be.stream).astype(np.float64)
    err = np.linalg.norm(chunked - whole) / np.linalg.norm(whole)
    print(f"chunks of {chunk} between decode steps against a whole prefill: relative difference {err:.1e}")
    be.stream.synchronize()
    tokens = be.seq_token(0, 0), be.seq_token(2, 0)
    for s in range(3):  # (released before asserting: a failure leaves the pool as it found it)
        be.seq_release(s)
    assert err < bar
    assert tokens == (int(chunked.argmax()), int(whole.argmax()))
    assert be.kv.free_pages() == free


def test_prompts_packed_in_one_forward_give_each_prompt_alone(backend):
    """seq_prefill_many (the server's admissions of one step): prompts of 19 and 45 tokens and the
    last 38 of a 70-token prompt whose first 32 were evaluated before, in one forward (each part
    padded in front to the flash kernel's query block): each one's first-token logits match the
    prompt prefilled alone in another slot (cuBLAS sums rows in another order: the f32 bar), and
    the first tokens sampled are the same."""
    be = backend
    assert be.part_align() > 0
    free = be.kv.free_pages()
    rng = np.random.default_rng(12)
    ps = [rng.integers(10, 30000, n).tolist() for n in (19, 45, 70)]
    for slot, p in zip((3, 4, 5), ps):
        assert be.seq_start(slot, p, GREEDY, 10) == 0
    be.seq_prefill(5, ps[2][:32])
    be.seq_prefill_many([(3, ps[0], (ps[0], GREEDY, 0, False)), (4, ps[1], (ps[1], GREEDY, 0, False)),
                         (5, ps[2][32:], (ps[2], GREEDY, 0, False))])
    packed = cp.asnumpy(be.last_logits[:3], stream=be.stream).astype(np.float64)
    alone = []
    for slot, p in zip((6, 7, 8), ps):
        be.seq_add(slot, p, GREEDY, 10)
        alone.append(cp.asnumpy(be.last_logits[-1], stream=be.stream).astype(np.float64))
    be.stream.synchronize()
    firsts = [(be.seq_token(a, 0), be.seq_token(b, 0)) for a, b in zip((3, 4, 5), (6, 7, 8))]
    for s in range(3, 9):
        be.seq_release(s)
    errs = [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(packed, alone)]
    print(f"packed prompt parts against each alone: relative differences {', '.join(f'{e:.1e}' for e in errs)}")
    assert max(errs) < 1e-2
    assert all(a == b for a, b in firsts), firsts
    assert be.kv.free_pages() == free


def test_packed_first_tokens_mix_greedy_sampled_and_penalized(backend):
    """The first tokens of one packed forward's prompts, sampled in one launch through the slot map
    (a greedy prompt, a sampled one, a sampled one with a repetition penalty, and a chunk that is
    not its prompt's last part, which samples nothing): each slot's sampler state and first token
    are those of its logits row sampled alone (seq_first's kernels, per mode) into another slot
    with the same seed, from a copy of the same logits (the penalty edits them in place)."""
    be = backend
    free = be.kv.free_pages()
    rng = np.random.default_rng(21)
    ps = [rng.integers(10, 30000, n).tolist() for n in (23, 50, 37, 90)]
    params = [GREEDY, SamplingParams(temperature=0.9, top_k=50, seed=5),
              SamplingParams(temperature=0.7, top_k=20, repeat_penalty=1.3, repeat_last_n=32, seed=6), GREEDY]
    seeds = [11, 12, 13, 14]
    slots, alone = (9, 3, 5, 7), (20, 21, 22, 23)
    for slot, other, p, q in zip(slots, alone, ps, params):
        assert be.seq_start(slot, p, q, 10) == 0
        assert be.seq_start(other, p, q, 10) == 0
    parts = [(9, ps[0]), (3, ps[1]), (5, ps[3][:40]), (7, ps[2])]
    be._forward_parts(parts)
    with be.stream:
        saved = be.last_logits.copy()
    firsts = [(0, 9, (ps[0], params[0], seeds[0], False)), (1, 3, (ps[1], params[1], seeds[1], False)),
              (3, 7, (ps[2], params[2], seeds[2], False))]
    be._first_many(firsts, 4)
    for row, slot, (p, q, seed, _) in firsts:
        other = alone[slots.index(slot)]
        be.slot_len[other] = be.slot_len[slot]
        be._prime(other, p, q, seed)
        with be.stream:
            be.last_logits[:4] = saved
            be._sample(*be._mode(q), rows=1, slot0=other, row=row)
    be.stream.synchronize()
    state = lambda a, s, w=1: a[s * w:(s + 1) * w].get().tolist()  # noqa: E731
    for row, slot, _ in firsts:
        other = alone[slots.index(slot)]
        assert be.seq_token(slot, 0) == be.seq_token(other, 0), (slot, other)
        for a, w in ((be.pos, 1), (be.hist_n, 1), (be.hist, 64), (be.step, 1), (be.p_temp, 1), (be.p_seed, 1),
                     (be.p_penalty, 1), (be.p_last_n, 1), (be.p_top_k, 1), (be.counter, 1)):
            assert state(a, slot, w) == state(a, other, w)
        assert state(be.seq, slot) == [slot] and be.decoding[slot]
    assert not be.decoding[5] and int(be.seq[5].get()) == -1  # the unfinished prompt: nothing sampled
    for s in slots + alone:
        be.seq_release(s)
    assert be.kv.free_pages() == free


def test_packed_forward_graph_replays_equal_eager_runs(backend):
    """A packed forward's padded size runs eagerly first, then as a captured graph: the graph
    reads each call's prompts, positions and last rows from device memory (one set of prompts
    replayed, then another of the same padded size), and its logits are bitwise those of the
    eager forward of the same prompts."""
    be = backend
    if not (be.use_graph and be.pack_graph):
        pytest.skip("packed forwards are not graphed here")
    free = be.kv.free_pages()
    rng = np.random.default_rng(33)
    sets = [[rng.integers(10, 30000, n).tolist() for n in lens] for lens in ((30, 47, 9), (12, 60, 33))]

    def run(ps, graph):
        be.pack_graph = graph
        try:
            for slot, p in zip((30, 31, 32), ps):
                be.seq_start(slot, p, GREEDY, 4)
            be.seq_prefill_many([(s, p, (p, GREEDY, 0, False)) for s, p in zip((30, 31, 32), ps)])
            out = cp.asnumpy(be.last_logits[:3], stream=be.stream)
            be.stream.synchronize()
            return out, [be.seq_token(s, 0) for s in (30, 31, 32)]
        finally:
            for s in (30, 31, 32):
                be.seq_release(s)
            be.pack_graph = True

    rows = be.part_rows(30) + be.part_rows(47) + be.part_rows(9)
    key = ("packed", -(-rows // be.tune.prefill_quantum) * be.tune.prefill_quantum)
    be._prefill_runs.pop(key, None)
    be.graphs.graphs.pop(key, None)
    eager = [run(ps, False) for ps in sets]
    be._prefill_runs.pop(key, None)
    run(sets[0], True)  # first sight of the size: eager, the warm-up
    assert not be.graphs.has(key)
    launches = be.graphs.launches
    graphed = [run(ps, True) for ps in sets]  # captured, then replayed with other prompts
    assert be.graphs.has(key) and be.graphs.launches == launches + 2
    for (le, te), (lg, tg) in zip(eager, graphed):
        np.testing.assert_array_equal(lg, le)
        assert tg == te
    assert be.kv.free_pages() == free


def test_packed_sizes_captured_ahead_equal_eager_runs(backend):
    """capture_packed (serve_capture_packed at a server's start): every padded size up to its rows
    captured from padding-only runs, which write no cache and leave every slot's length; a packed
    forward of one of those sizes then replays the graph at once, its logits bitwise the eager
    forward's of the same prompts."""
    be = backend
    if not (be.use_graph and be.pack_graph):
        pytest.skip("packed forwards are not graphed here")
    q = be.tune.prefill_quantum
    rng = np.random.default_rng(34)
    ps = [rng.integers(10, 30000, n).tolist() for n in (21, 40)]
    rows = -(-(be.part_rows(21) + be.part_rows(40)) // q) * q
    keys = [("packed", r) for r in range(q, rows + q, q)]
    for key in keys:
        be._prefill_runs.pop(key, None)
        be.graphs.graphs.pop(key, None)
    free, lens = be.kv.free_pages(), list(be.slot_len)

    def run(graph):
        be.pack_graph = graph
        try:
            for slot, p in zip((40, 41), ps):
                be.seq_start(slot, p, GREEDY, 4)
            be.seq_prefill_many([(s, p, (p, GREEDY, 0, False)) for s, p in zip((40, 41), ps)])
            out = cp.asnumpy(be.last_logits[:2], stream=be.stream)
            be.stream.synchronize()
            return out, [be.seq_token(s, 0) for s in (40, 41)]
        finally:
            for s in (40, 41):
                be.seq_release(s)
            be.pack_graph = True

    eager = run(False)
    assert be.capture_packed(rows) == len(keys)
    assert all(be.graphs.has(key) for key in keys)
    assert be.kv.free_pages() == free and list(be.slot_len) == lens, "the padding runs wrote a sequence"
    launches = be.graphs.launches
    graphed = run(True)
    assert be.graphs.launches == launches + 1, "the captured size was not replayed at its first forward"
    np.testing.assert_array_equal(graphed[0], eager[0])
    assert graphed[1] == eager[1]


def test_small_chunks_captured_ahead_equal_eager_runs(backend):
    """capture_small (a server's start): chunks of 1 .. MAX_MMV_TOKENS rows captured from padding-only
    runs, which write no cache and leave every slot's length; a prompt whose cached prefix leaves 5
    tokens (the server's admission with the prefix cache) then replays that size's graph at once,
    its logits bitwise the eager run's."""
    be = backend
    if not (be.use_graph and be.prefill_graph):
        pytest.skip("prefill chunks are not graphed here")
    keys = [("prefill", r, False) for r in range(1, MAX_MMV_TOKENS + 1)]
    for key in keys:
        be._prefill_runs.pop(key, None)
        be.graphs.graphs.pop(key, None)
    p = np.random.default_rng(35).integers(10, 30000, 37).tolist()

    def run(graph):
        be.prefill_graph = graph
        try:
            cached = be.seq_start(40, p, GREEDY, 4, reuse=True)
            be.seq_prefill_many([(40, p[cached:], (p, GREEDY, 0, True))])
            out = cp.asnumpy(be.last_logits[:1], stream=be.stream)
            be.stream.synchronize()
            return cached, out, be.seq_token(40, 0)
        finally:
            be.seq_release(40, p)  # (its two full pages stay cached)
            be.prefill_graph = True

    def sums():
        return [int(cp.sum(a, dtype=cp.uint64)) for a in (be.kv.k, be.kv.v)]

    run(True)  # the whole prompt evaluated, its pages published
    eager = run(False)
    assert eager[0] == 32
    free, lens, before = be.kv.free_pages(), list(be.slot_len), sums()
    assert be.capture_small() == len(keys)
    assert all(be.graphs.has(key) for key in keys)
    assert be.kv.free_pages() == free and list(be.slot_len) == lens, "the padding runs took a sequence"
    assert sums() == before, "the padding runs wrote the cache"
    launches = be.graphs.launches
    graphed = run(True)
    assert be.graphs.launches == launches + 1, "the captured size was not replayed at its first use"
    assert graphed[0] == 32
    np.testing.assert_array_equal(graphed[1], eager[1])
    assert graphed[2] == eager[2]
