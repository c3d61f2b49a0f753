"""Embeddings on the CUDA backend: its final hidden states (prefill chunks, no logits, the output
norm) against the numpy backend's, pooled vectors through the engine, and an embedding in a free
slot of the batch between a running generation's steps (its tokens unchanged, the pages given back)."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from gguf_runtime.backends.cuda.backend import CudaBackend  # noqa: E402
from gguf_runtime.backends.numpy.backend import NumpyBackend  # noqa: E402
from gguf_runtime.engine import embed as E  # noqa: E402
from gguf_runtime.engine.engine import Engine  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.model_config import config_from_gguf  # noqa: E402
from gguf_runtime.sampling import SamplingParams  # noqa: E402
from gguf_runtime.server.adapters import CudaAdapter, NoRoom  # noqa: E402

from micro_models import Micro, prompt_ids, write_micro  # noqa: E402

MIN_COS = 0.9999
GREEDY = SamplingParams(temperature=0.0)
TEXTS = ["The sky is blue because of Rayleigh scattering.", "Grass is green.", "A"]
# head size 64: the CUDA attention kernels take 64, 128 and 256
SHAPE = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, seed=11)


def cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("embed")
    return {p: write_micro(Micro(**SHAPE, pooling_type=p), d / f"p{p}.gguf") for p in (None, 1, 2)}


@pytest.fixture(scope="module")
def pair(paths):
    f = open_gguf(paths[None])
    cfg = config_from_gguf(f)
    return NumpyBackend(f, cfg, 256), CudaBackend(f, cfg, 256)


@pytest.mark.parametrize("n", [5, 40])
def test_hidden_states_match_numpy(pair, n):
    ref, be = pair
    ids = prompt_ids(4096, n, seed=n)
    want, got = ref.hidden(ids), be.hidden(ids)
    assert got.shape == (n, 256) and got.dtype == np.float32
    assert cos_rows(got, want).min() >= MIN_COS
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()  # a scale would pass the cosine
    for pooling in ("mean", "cls", "last"):
        assert cos_rows(E.pool(got, pooling), E.pool(want, pooling))[0] >= MIN_COS
    assert be.n_past == 0  # slot 0's sequence is forgotten


def test_hidden_in_several_chunks(paths):
    """A workspace of 64 rows: 100 tokens run as two prefill chunks, the second padded in front."""
    f = open_gguf(paths[None])
    cfg = config_from_gguf(f)
    ids = prompt_ids(4096, 100, seed=3)
    want = NumpyBackend(f, cfg, 256).hidden(ids)
    got = CudaBackend(f, cfg, 256, max_rows=64).hidden(ids)
    assert cos_rows(got, want).min() >= MIN_COS


@pytest.mark.parametrize("pooling", [None, 1, 2])
def test_engine_embed_matches_numpy_and_generation_goes_on(paths, pooling):
    cuda, host = Engine(paths[pooling], backend="cuda", n_ctx=256), Engine(paths[pooling], backend="numpy", n_ctx=256)
    prompt = cuda.encode_raw("Once upon a time")
    first = cuda.generate(prompt, n_predict=12, params=GREEDY).ids
    got, want = cuda.embed(TEXTS, dimensions=128), host.embed(TEXTS, dimensions=128)
    assert got.pooling == want.pooling and got.tokens == want.tokens
    assert cos_rows(got.vectors, want.vectors).min() >= MIN_COS
    np.testing.assert_allclose(np.linalg.norm(got.vectors, axis=1), 1.0, atol=1e-5)
    assert cuda.cached == [] and cuda.backend.n_past == 0
    again = cuda.generate(prompt, n_predict=12, params=GREEDY).ids  # slot 0 re-prefilled from scratch
    assert again == first


def run_slot(ad: CudaAdapter, slot: int, n: int, embed_after: int | None = None, embed_ids=None):
    out, vec = [], None
    while len(out) < n:
        out += ad.step().get(slot, [])
        if embed_after is not None and vec is None and len(out) >= embed_after:
            free = ad.be.kv.free_pages()
            vec = ad.embed(slot + 1, embed_ids)
            assert ad.be.kv.free_pages() == free  # the pages lent for it are back
    return out[:n], vec


def test_embedding_between_batch_steps_leaves_the_generation_alone(paths):
    eng = Engine(paths[1], backend="cuda", n_ctx=256, max_batch=4)
    ad = CudaAdapter(eng, capture=False)
    prompt = prompt_ids(4096, 9, seed=5)
    ad.add(0, prompt, GREEDY, 60)
    alone, _ = run_slot(ad, 0, 60)
    ad.release(0)
    ids = prompt_ids(4096, 40, seed=6)
    ad.add(0, prompt, GREEDY, 60)
    mixed, vec = run_slot(ad, 0, 60, embed_after=20, embed_ids=ids)
    ad.release(0)
    assert mixed == alone
    f = open_gguf(paths[1])
    want = E.pool(NumpyBackend(f, config_from_gguf(f), 256).hidden(ids), "mean")
    assert cos_rows(vec, want)[0] >= MIN_COS


def test_an_embedding_the_pages_cannot_hold_is_no_room(paths):
    eng = Engine(paths[None], backend="cuda", n_ctx=256, max_batch=2, kv_tokens=64)
    ad = CudaAdapter(eng, capture=False)
    free = ad.be.kv.free_pages()
    with pytest.raises(NoRoom):
        ad.embed(1, prompt_ids(4096, 100))
    assert ad.be.kv.free_pages() == free and ad.be.kv.capacity(1) == 0
    assert ad.embed(1, prompt_ids(4096, 60)).shape == (256,)  # 4 pages of 16: fits
    assert ad.be.kv.free_pages() == free
