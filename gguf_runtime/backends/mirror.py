"""Running the same backend calls in several processes: tensor parallelism's control path
(backends/cuda/tensor_parallel.py), kept apart from CUDA so the CPU tests check it.

The front (``MirrorFront``, mixed into rank 0's backend class) sends every call in ``mirrored``
that is made from outside the backend to the workers' pipes before it runs the call itself; calls
the backend makes inside such a call are not sent (each worker makes them itself, inside the same
call). ``serve_calls`` is a worker's loop. Arguments travel pickled: callbacks (progress bars) and
objects of this process (streams) are dropped, and the KV cache's reserve / release take the
worker's own stream. A sequence's seed is chosen before the call is sent, so every rank samples
alike; a single sequence's launch closure is forwarded as a "launch" message per step. A grammar's
mask rows (``seq_constrain``: the caller writes rank 0's row on the host) go to the workers before
each call that samples with them, so every rank masks its logits alike.
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any, Iterable

import numpy as np

from ..errors import GGUFRunError

# (every rank captures and replays the same graphs: collectives match)
MIRRORED = ("prefill", "eval", "truncate", "start_decode", "run_steps", "batch_step", "seq_release", "hidden",
            "capture_buckets", "end_single", "retune", "seq_start", "seq_prefill", "seq_prefill_many",
            "seq_logprobs", "eval_argmax", "capture_verify", "capture_packed", "capture_small", "seq_constrain",
            "verify_many", "seq_commit")
# the calls that sample constrained slots: their mask rows as rank 0's caller wrote them go first
SAMPLING = ("batch_step", "seq_first", "seq_add", "seq_prefill_many")
MIRRORED_ATTRS = ("prefill_graph", "use_graph")


def plain(kw: dict[str, Any]) -> dict[str, Any]:
    """Arguments a worker can take: no callbacks, nothing with a ``ptr`` into this process (streams)."""
    return {k: v for k, v in kw.items() if not callable(v) and not hasattr(v, "ptr")}


class MirroredKV:
    """Rank 0's KV cache where callers outside the backend reserve or release pages (bench)."""

    def __init__(self, kv, owner: "MirrorFront") -> None:
        self._kv, self._owner = kv, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def reserve(self, *args, **kw):
        self._owner._send(("kv", "reserve", args, _local(kw)))
        return self._kv.reserve(*args, **kw)

    def release(self, *args, **kw):
        self._owner._send(("kv", "release", args, _local(kw)))
        return self._kv.release(*args, **kw)


def _local(kw: dict) -> dict:
    """The keywords a worker gets: its own stream replaces the caller's."""
    return {k: v for k, v in kw.items() if k != "stream"}


class MirrorFront:
    """Mixed in before the backend class; ``_conns``: the workers' pipe ends (set before any call),
    ``_mirror_ready``: set once loading is over (attribute writes mirror from then on)."""

    _conns: tuple = ()
    _depth = 0

    def _send(self, msg: tuple) -> None:
        if self._depth:
            return  # (a call inside a mirrored call: the workers make it themselves)
        op, name, args, kw = msg
        msg = (op, name, args, plain(kw))
        for conn in self._conns:
            conn.send(msg)

    def _mirror(self, name: str, *args, **kw):
        if name in SAMPLING and not self._depth:
            for slot in sorted(getattr(self, "_masked", ())):  # (bytes, not the pinned row itself)
                self._send(("mask", "", (slot, self.mask_host[slot].tobytes()), {}))
        self._send(("call", name, args, kw))
        self._depth += 1
        try:
            return getattr(super(MirrorFront, self), name)(*args, **kw)
        finally:
            self._depth -= 1

    def __setattr__(self, name: str, value: Any) -> None:
        if name in MIRRORED_ATTRS and self.__dict__.get("_mirror_ready"):
            self._send(("set", name, value, {}))
        object.__setattr__(self, name, value)

    def mirror_kv(self) -> None:
        """From now on reserve / release of ``self.kv`` from outside reach the workers."""
        self.kv = MirroredKV(self.kv, self)

    def seq_add(self, slot, prompt, params, max_new, seed=None, reuse=False) -> int:
        seed = int(seed) if seed is not None else secrets.randbits(63)  # (the same on every rank)
        return self._mirror("seq_add", slot, list(prompt), params, max_new, seed, reuse)

    def seq_first(self, slot, prompt, params, seed=None, publish=False, row=0) -> None:
        seed = int(seed) if seed is not None else secrets.randbits(63)  # (the same on every rank)
        return self._mirror("seq_first", slot, list(prompt), params, seed, publish, row)

    def start_single(self, history, params, seed, given=None):
        local = self._mirror("start_single", list(history), params, seed, given)
        msg = ("launch", "", (), {})

        def launch() -> None:
            for conn in self._conns:
                conn.send(msg)
            local()
        return launch


def _mirrored(name: str):
    def call(self, *args, **kw):
        return self._mirror(name, *args, **kw)
    call.__name__ = name
    return call


for _name in MIRRORED:
    setattr(MirrorFront, _name, _mirrored(_name))


def serve_calls(be, conn, label: str = "worker", on_stop=None) -> None:
    """A worker: run what the front sends, in order, until "stop" (then ``on_stop``, e.g. os._exit)
    or the pipe closes. An error the front raises too (same state, same call) is dropped; others
    are printed, one line each."""
    launch = None
    while True:
        try:
            op, name, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "call":
                out = getattr(be, name)(*args, **kwargs)
                if name == "start_single":
                    launch = out
            elif op == "launch":
                launch()
            elif op == "kv":
                getattr(be.kv, name)(*args, **kwargs, stream=be.stream)
            elif op == "mask":
                slot, words = args
                be.mask_host[slot] = np.frombuffer(words, be.mask_host.dtype)
            elif op == "set":
                setattr(be, name, args)
            elif op == "stop":
                if on_stop is not None:
                    on_stop()
                return
        except GGUFRunError:
            pass
        except Exception as e:  # noqa: BLE001
            print(f"warning: {label}: {name}: {type(e).__name__}: {e}", file=sys.stderr)


def stop_all(conns: Iterable) -> None:
    for conn in conns:
        try:
            conn.send(("stop", "", (), {}))
        except (OSError, ValueError):
            pass


def exit_now() -> None:
    os._exit(0)  # (no teardown: NCCL's and peer mappings' destructors can wait on gone ranks)
