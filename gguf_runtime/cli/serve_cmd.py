"""`gguf-run serve`: the Ollama/OpenAI-compatible HTTP server (gguf_runtime.server)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Optional

import typer

from ..engine.engine import DEFAULT_CTX, check_spec
from ..errors import GGUFRunError
from .app import app
from .options import (BATCHES, TensorParallel, Backend, CacheTypeK, CacheTypeV, CtxSize, ModelArg, NoGraph, Quiet, kv_types, note_printer,
                      models_folder, resolve_model)
from .progress import progress_bars



def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise GGUFRunError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                           "is another server running there? pick another --port") from None
    sock.set_inheritable(True)
    return sock


@app.command("serve", epilog="Examples:\n\n  gguf-run serve\n\n"
             "  gguf-run serve model.gguf --port 8080 --max-batch 32\n\n"
             "  curl http://127.0.0.1:11434/api/generate -d '{\"model\": \"MODEL\", \"prompt\": \"Hi\"}'\n\n"
             "  OLLAMA_HOST=127.0.0.1:11434 ollama run MODEL  (the ollama CLI as a client)")
def serve(
    model: Optional[str] = ModelArg,
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(11434, "--port", min=0, max=65535, help="TCP port (Ollama's default; 0: any free)"),
    max_batch: int = typer.Option(64, "--max-batch", help="cuda: sequences decoded together, one of "
                                  "1, 2, 4, 8, 16, 32, 64 (numpy runs one at a time)"),
    name: Optional[str] = typer.Option(None, "--name", help="model name clients use (default: MODEL's Ollama "
                                       "name, or the file name without .gguf; ':latest' is implied)"),
    ctx_size: Optional[int] = CtxSize,
    backend: str = Backend,
    cache_type_k: str = CacheTypeK,
    cache_type_v: str = CacheTypeV,
    tensor_parallel: int = TensorParallel,
    no_graph: bool = NoGraph,
    max_body: int = typer.Option(1 << 20, "--max-body", min=1024, help="largest request body in bytes (413 above)"),
    max_queue: int = typer.Option(1024, "--max-queue", min=1, help="requests in progress at most (503 above)"),
    lookahead: int = typer.Option(2, "--lookahead", min=1, max=8, help="cuda: decode steps in flight ahead of "
                                  "the tokens being read (hides host time; each costs a token of context)"),
    stream_interval: Optional[float] = typer.Option(None, "--stream-interval", min=0.0, max=1000.0, metavar="MS",
                                                    help="a stream is written at most every MS milliseconds while "
                                                         "its request runs (the first and last token at once; tokens "
                                                         "meanwhile go out as one chunk); 0: a write a step "
                                                         "[default: 10]"),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="cuda: evaluate every prompt whole "
                                         "(by default KV pages of earlier prompts and answers are kept and reused "
                                         "for prompts that start with the same tokens, until the pool needs them)"),
    allow_origin: Optional[list[str]] = typer.Option(None, "--allow-origin", metavar="ORIGIN",
                                                     help="a browser origin allowed besides localhost ones "
                                                          "(repeatable; '*': any), like Ollama's OLLAMA_ORIGINS"),
    models: Optional[str] = typer.Option(None, "--models", metavar="DIR",
                                         help="also serve this folder's .gguf files (by their stems) and the local "
                                              "Ollama store's models: listed in /api/tags, loaded when a request "
                                              "names one (one at a time: the loaded one is unloaded once its "
                                              "requests are done)"),
    keep_alive: str = typer.Option("-1", "--keep-alive", metavar="DURATION",
                                   help="how long the model stays loaded after the last request (\"5m\", \"1h\", "
                                        "0; -1: for ever), unless a request's keep_alive says otherwise; unloaded, "
                                        "the next request loads it again (as Ollama's OLLAMA_KEEP_ALIVE, whose "
                                        "default is 5m)"),
    spec: str = typer.Option("none", "--spec", help="cuda: speculative decoding of greedy requests while at "
                             "most two decode, all greedy: none, or ngram (tokens proposed by lookup in each "
                             "one's prompt and output, checked together: the same text); else plain steps"),
    spec_k: int = typer.Option(4, "--spec-k", help="--spec: tokens proposed a step at most (adapts to acceptance)"),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn's: critical|error|warning|info|debug "
                                  "(info logs every request)"),
    quiet: bool = Quiet,
) -> None:
    """Serve MODEL over HTTP: Ollama's /api/generate, /api/chat, /api/tags, /api/show,
    /api/version and OpenAI's /v1/chat/completions, /v1/completions, /v1/models.

    With the cuda backend, requests are batched continuously: new ones join between decode steps
    and every running sequence advances each step (up to --max-batch at once; more wait in line).
    The numpy backend (no GPU) runs one request at a time, first come first served; the others
    wait. The server answers while the model loads: /health is 503 until it is in, requests wait
    for it. Ctrl-C stops taking requests, cancels running ones and exits.
    """
    try:
        import uvicorn
        from ..server.adapters import make_adapter
        from ..server.app import Service, build_app
        from ..server.guard import is_loopback
        from ..server import schemas as S
        from ..format.model_store import list_models
    except ImportError as e:
        raise GGUFRunError(f"the server needs {e.name}: pip install 'gguf-run[serve]'") from None
    if max_batch not in BATCHES:
        raise typer.BadParameter(f"must be one of {', '.join(map(str, BATCHES))}", param_hint="'--max-batch'")
    if log_level not in ("critical", "error", "warning", "info", "debug"):
        raise typer.BadParameter("must be critical, error, warning, info or debug", param_hint="'--log-level'")
    try:
        keep = S.keep_alive(keep_alive, "--keep-alive")
    except S.ApiError as e:
        raise typer.BadParameter(str(e).removeprefix("--keep-alive "), param_hint="'--keep-alive'") from None
    kv = kv_types(cache_type_k, cache_type_v)
    if spec == "draft":
        raise GGUFRunError("serve --spec draft is not served yet; use --spec ngram or none")
    check_spec(spec, spec_k)
    models = models_folder(models)
    path = resolve_model(model, models)
    if name is None and model and path != model:  # a name (a blob's file name means nothing to clients)
        in_folder = models and os.path.realpath(os.path.dirname(path)) == os.path.realpath(models)
        name = os.path.splitext(os.path.basename(path))[0] if in_folder else model
    catalog = [(m.name, str(m.path)) for m in list_models(models)] if models else []
    note = note_printer(quiet)
    sock = _bind(host, port)

    def loader(file: str):
        from ..engine.engine import Engine

        with progress_bars(quiet) as progress:
            eng = Engine(file, backend=backend, n_ctx=ctx_size, progress=progress, note=note,
                         use_graph=not no_graph, max_batch=max_batch, kv_types=kv,
                         tensor_parallel=tensor_parallel)
            return make_adapter(eng, depth=lookahead, progress=progress, prefix_cache=not no_prefix_cache,
                                spec=spec, spec_k=spec_k)

    try:
        svc = Service(lambda: loader(path), name=name, max_body=max_body, max_queue=max_queue, keep_alive=keep,
                      catalog=catalog, loader=loader, path=path, n_ctx=DEFAULT_CTX if ctx_size is None else ctx_size,
                      **({} if stream_interval is None else {"stream_interval": stream_interval / 1e3}))
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()
    failed: list[BaseException] = []  # what the load raised (raised here once the server has stopped)

    def load() -> None:
        try:
            svc.start()
        except BaseException as e:  # noqa: BLE001 - the server stops, then serve raises it
            failed.append(e)
            server.should_exit = True
            return
        if server.should_exit:  # (stopped while it loaded)
            return
        a = svc.scheduler.adapter
        mode = f"{a.max_slots} sequences per step" if a.name == "cuda" else "one request at a time"
        print(f"serving {svc.card.name} ({a.name}, {mode}, context {a.n_ctx}) on "
              f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}", file=sys.stderr, flush=True)
        if not quiet:
            if host not in ("127.0.0.1", "localhost", "::1"):
                print(f"note: listening on {host}: reachable from other machines, with no authentication",
                      file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            # the model loads once the server listens: /health is llama-server's 503 until it is in,
            # and requests for it wait for it
            threading.Thread(target=load, name="gguf-load", daemon=True).start()

        def handle_exit(self, sig, frame) -> None:  # no re-raise of the signal afterwards: exit 0
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True
            svc.stopping()
            sched = svc.scheduler
            if sched is not None:
                sched.shutdown(wait=False)  # running streams end now, so connections close

    config = uvicorn.Config(build_app(svc, check_host=is_loopback(host), allow_origins=tuple(allow_origin or ())),
                            log_level=log_level, timeout_graceful_shutdown=3,
                            lifespan="off",  # (the app has no startup or shutdown hooks; a second Ctrl-C
                            # cancelling the lifespan task made starlette log a traceback)
                            access_log=log_level in ("info", "debug"))
    server = Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        svc.shutdown()
        sock.close()
    if failed:
        raise failed[0]
    if svc.loading:  # stopped (Ctrl-C, SIGTERM) before the model was in: an interrupted load's exit (130)
        raise KeyboardInterrupt
