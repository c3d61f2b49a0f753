"""The template watchdog (format/template_limits.py) under renders that end just as their deadline
passes, on several threads: each render ends or raises TemplateLimit from its own ``with``, no
exception surfaces later, and no thread waits for ever (a lock left held by an asynchronous
exception had hung every later render of a server: tests/test_server.py once waited 13 minutes)."""

import random
import threading
import time

from gguf_runtime.format import template_limits as TL


def test_renders_ending_at_their_deadline_never_hang_or_raise_late():
    late, counts = [], []

    def worker(n: int) -> None:
        rng = random.Random(threading.get_ident())
        ended = raised = 0
        for _ in range(n):
            try:
                try:
                    # the watchdog's deadline ~10 ms ahead (seconds + 0.25); the render busy for
                    # about as long, so it ends before, at or after the watchdog fires
                    with TL.Budget.render(seconds=-0.24):
                        end = time.monotonic() + 0.010 + rng.uniform(-150e-6, 150e-6)
                        while time.monotonic() < end:
                            pass
                    ended += 1
                except TL.TemplateLimit:
                    raised += 1
                x = 0
                for _ in range(2000):  # an exception left pending would be raised in here
                    x += 1
            except TL.TemplateLimit:
                late.append(1)
        counts.append((ended, raised))

    threads = [threading.Thread(target=worker, args=(120,), daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a render waits for ever"
    assert not late, f"{len(late)} TemplateLimit(s) raised after their render ended"
    assert len(counts) == 4 and sum(e + r for e, r in counts) == 480
    # both outcomes happened: the test came near the race it guards
    assert sum(e for e, _ in counts) > 0 and sum(r for _, r in counts) > 0
    # and the watchdog still stops a loop that checks nothing
    t0 = time.monotonic()
    try:
        with TL.Budget.render(seconds=0.1):
            while True:
                pass
    except TL.TemplateLimit:
        pass
    assert time.monotonic() - t0 < 2.0
