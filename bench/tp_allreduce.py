"""Tensor parallelism's all-reduce alone: microseconds a call inside a captured graph, the one-shot
kernel over peer memory (allreduce.cu) against NCCL, for the sizes a decode step sums (rows x
n_embd floats).

    python bench/tp_allreduce.py [--world 2] [--n-embd 4096] [--rows 1,8,64] [--calls 64]

One process a GPU (spawn), as the backend's ranks; each captures `calls` all-reduces in one graph,
replays it (warm-up, then 20 timed replays, CUDA events) and rank 0 prints the median a call.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics


def rank_main(rank: int, world: int, uid, args, out) -> None:
    import faulthandler
    import sys

    import cupy as cp

    faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang (a rank that never joins) says where

    from gguf_runtime.backends.cuda.collectives import NcclCollectives
    from gguf_runtime.quant_kernels import launchers as L

    cp.cuda.Device(rank).use()
    comm = NcclCollectives(world, uid, rank)
    k = L.Kernels()
    rows_list = [int(r) for r in args.rows.split(",")]
    comm.setup(k, 1, 1, args.n_embd, max(rows_list))  # (one-shot buffers for the largest call)
    stream = cp.cuda.Stream(non_blocking=True)
    res = {}
    for rows in rows_list:
        print(f"rank {rank}: rows {rows}", file=sys.stderr, flush=True)
        x = cp.full((rows, args.n_embd), float(rank + 1), cp.float32)
        for kind in ("oneshot", "nccl"):
            saved = comm.oneshot_floats
            if kind == "nccl":
                comm.oneshot_floats = 0
            with stream:
                comm.all_reduce(x)  # (compiles the kernel; one eager call)
                stream.synchronize()
                x.fill(float(rank + 1))
                comm.all_reduce(x)
                stream.synchronize()
                ok = bool((x == world * (world + 1) / 2).all())
                stream.begin_capture()
                for _ in range(args.calls):
                    comm.all_reduce(x)
                g = stream.end_capture()
            g.upload(stream)
            times = []
            for i in range(25):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                g.launch(stream)
                b.record(stream)
                b.synchronize()
                if i >= 5:
                    times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / args.calls)
            comm.oneshot_floats = saved
            res[(rows, kind)] = (statistics.median(times), ok)
    if rank == 0:
        out.put(res)
        out.close()
        out.join_thread()
    os._exit(0)  # (no teardown: NCCL's and the peer mappings' destructors can wait on a gone rank)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--rows", default="1,2,8,64")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=60.0, help="s: a rank still running then prints its stack")
    args = ap.parse_args()
    from gguf_runtime.backends.cuda.collectives import unique_id

    uid = unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, args.world, uid, args, q)) for r in range(args.world)]
    for p in ps:
        p.start()
    res = q.get(timeout=600)
    for p in ps:
        p.join()
    print(f"| rows | KiB | one-shot us | NCCL us | (world {args.world}, {args.calls} calls a graph) |")
    print("| ---: | --: | ---: | ---: | --- |")
    for rows in sorted({r for r, _ in res}):
        o, n = res[(rows, "oneshot")], res[(rows, "nccl")]
        print(f"| {rows} | {rows * args.n_embd * 4 // 1024} | {o[0]:.2f}{'' if o[1] else ' WRONG'} | "
              f"{n[0]:.2f}{'' if n[1] else ' WRONG'} | |")


if __name__ == "__main__":
    main()
