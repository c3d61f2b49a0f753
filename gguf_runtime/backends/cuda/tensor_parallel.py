"""Tensor parallelism over the GPUs of one host: one process a GPU, started and supervised here.

Rank 0 is ``TensorParallelBackend`` in the caller's process: a CudaBackend over its part of the
model (format/shard.py) that the engine, the server and bench use as any backend. Ranks 1..N-1
are worker processes (``spawn``), each a CudaBackend over its part on GPU r. Every call that
does GPU work or changes a sequence's state is sent to the workers before rank 0 runs it
(backends/mirror.py), so every rank runs the same calls in the same order; the collectives inside them (NCCL,
collectives.py) keep the ranks' GPUs in step, and every rank samples the same token from the same
gathered logits and seeds, so no token crosses the host. Workers answer only at load.

A worker that dies takes the model with it (the other ranks would wait in NCCL for ever): the
watchdog prints one line and ends the process with exit code 2. ``close`` (also at the process's
exit, before multiprocessing ends the workers) has every rank end its communicator at once, each
after destroying its CUDA graphs: NCCL's abort waits until no graph holds a collective of its
communicator, and until every rank of the host calls it.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import sys
import threading
import time
import weakref

import cupy as cp

from ...errors import BackendError
from ...format.gguf_file import GGUFFile, open_gguf
from ...format.model_config import ModelConfig
from ...format.shard import ShardedFile, check_split
from ..mirror import MirrorFront, exit_now, plain, serve_calls, stop_all
from . import tuning
from .backend import CudaBackend
from .collectives import NcclCollectives, unique_id

LOAD_TIMEOUT = 1800.0  # s: a worker that neither loads nor fails in this time is stuck


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


def _worker(rank: int, world: int, uid: tuple, path: str, cfg: ModelConfig, n_ctx: int, kw: dict, conn,
            parent: int) -> None:
    """Rank ``rank``: load its part on GPU ``rank``, say ready (or why not), then run what rank 0 sends."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        cp.cuda.Device(rank).use()
        f = open_gguf(path)
        comm = NcclCollectives(world, uid, rank)
        part = ShardedFile(f, cfg, rank, world)
        be = CudaBackend(part, part.config, n_ctx, comm=comm, **kw)
    except BaseException as e:  # noqa: BLE001 (any failure is reported to rank 0 in one line)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        conn.send(("error", f"GPU {rank}: {msg}"))
        sys.exit(2)
    conn.send(("ready", None))

    def stop() -> None:
        be.end_collectives()  # (with rank 0's and the other workers': see close)
        exit_now()

    serve_calls(be, conn, f"tensor-parallel GPU {rank}", on_stop=stop)
    exit_now()  # the front is gone (its pipe closed): no teardown, whose NCCL destructor would wait for it


def _close_at_exit(ref) -> None:
    be = ref()
    if be is not None:
        be.close()


class TensorParallelBackend(MirrorFront, CudaBackend):
    """Rank 0 of a model split over ``world`` GPUs (module docstring)."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int, world: int, progress=None, note=None,
                 **kw) -> None:
        check_split(f, cfg, world)
        if cfg.n_expert and not tuning.choose(0).tp_moe:
            raise BackendError(f"{cfg.arch}: mixture-of-experts models are not split across GPUs yet (their split "
                               "has not run on GPUs); run it on one GPU")
        try:
            have = cp.cuda.runtime.getDeviceCount()
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise BackendError(f"no usable NVIDIA GPU ({e})") from None
        if have < world:
            raise BackendError(f"--tensor-parallel {world} needs {world} GPUs; this machine has {have}")
        self._depth, self._closing, self._workers, self._conns = 0, False, [], []
        uid = unique_id()
        ctx = mp.get_context("spawn")
        for r in range(1, world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, uid, f.path, cfg, n_ctx, plain(kw), theirs, os.getpid()),
                            daemon=True, name=f"gguf-run GPU {r}")
            p.start()
            theirs.close()
            self._workers.append((p, mine))
            self._conns.append(mine)
        threading.Thread(target=self._watch, daemon=True).start()
        # at exit before multiprocessing's own handler (registered earlier, run later) kills the
        # workers, which the watchdog would report as a failure; a weak reference: an unloaded model
        # (serve's keep_alive) is freed
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            comm = NcclCollectives(world, uid, 0)
            part = ShardedFile(f, cfg, 0, world)
            super().__init__(part, part.config, n_ctx, progress=progress, note=note, comm=comm, **kw)
        except BaseException:
            self.close()
            raise
        self._wait_ready()
        self.world = world
        self.mirror_kv()
        self._mirror_ready = True
        if note:
            uneven = part.split.uneven()
            note(f"note: tensor parallel over {world} GPUs (NCCL), {self.weights.nbytes / 2**30:.2f} GiB of weights "
                 f"on GPU 0" + (f"; {uneven}" if uneven else ""))

    # ---- supervision -----------------------------------------------------------------------------
    def _wait_ready(self) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT
        for r, (p, conn) in enumerate(self._workers, 1):
            while not conn.poll(0.2):
                if not p.is_alive() or time.monotonic() > deadline:
                    self.close()
                    raise BackendError(f"tensor-parallel GPU {r} stopped while loading (exit code {p.exitcode})")
            status, msg = conn.recv()
            if status != "ready":
                self.close()
                raise BackendError(f"tensor parallelism: {msg}")

    def _watch(self) -> None:
        """A worker gone: the other ranks would wait for it in NCCL for ever. While loading, rank 0
        reports a worker's failure itself when it gets to _wait_ready; stuck before that (in NCCL),
        this thread does, after a grace period."""
        dead_since: dict[int, float] = {}
        while not self._closing:
            for r, (p, conn) in enumerate(self._workers, 1):
                if p.is_alive():
                    continue
                if self.__dict__.get("_mirror_ready"):
                    why = f"stopped (exit code {p.exitcode}); the model cannot run without it"
                elif time.monotonic() - dead_since.setdefault(r, time.monotonic()) < 5.0:
                    continue
                else:
                    why = f"failed to load: {conn.recv()[1]}" if conn.poll() else f"stopped (exit code {p.exitcode})"
                if self._closing:
                    return
                print(f"error: tensor-parallel GPU {r} {why}", file=sys.stderr, flush=True)
                os._exit(2)
            time.sleep(0.5)

    def close(self) -> None:
        """Stop the workers: each ends its communicator as it stops, and rank 0 ends its own meanwhile
        (NCCL's abort waits for every rank's), then the processes are joined and rank 0's peer
        buffers freed. Once."""
        if self._closing:
            return
        self._closing = True
        comm = self.__dict__.get("comm")
        stop_all(self._conns)
        self.end_collectives()
        for p, _ in self._workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if comm is not None:
            comm.release_buffers()

    def __del__(self) -> None:
        # (freed unclosed, e.g. a model the server unloads: its workers stop with it)
        try:
            self.close()
        except Exception:  # noqa: BLE001 (a load that failed early, or interpreter shutdown)
            pass
