"""Limits on a chat template's work: time, and the size of every string or list it builds.

A template is a program from the model file. The sandbox (chat.py) keeps it from Python's
internals; this keeps it from the machine's time and memory: ``range`` of 100,000 nested in a loop
of 100,000, ``'a' * 10**8``, ``'%0999999999d'|format(1)``, ``lipsum(10**7)`` or doubling a string
in a loop would otherwise hang the CLI or every request of a server.

* **Size**: each operation that can make a big string or list from small inputs (``*``, ``+``,
  ``~``, ``**``, ``%``, the ``format``, ``center``, ``indent``, ``replace``, ``join``, ``wordwrap``,
  ``tojson`` filters, the str methods ``center``/``ljust``/``rjust``/``zfill``/``expandtabs``/
  ``replace``/``join``/``format``/``format_map``, ``lipsum``) checks the size of its result before
  making it; the rendered output is capped too. ``MAX_CHARS`` (4 Mi characters) is far beyond any
  prompt a context holds.
* **Time**: ``MAX_SECONDS`` (2 s) of rendering. Every call, operator, ``range`` step and output
  chunk checks the clock; a loop that calls nothing is stopped by a watchdog that raises in the
  rendering thread (CPython's asynchronous exception) at the deadline.

A breach raises ``TemplateLimit`` (a ``BaseException``, so no ``except Exception`` inside the
template machinery swallows it); chat.py turns it into one TemplateError line.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import re
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from jinja2.compiler import CodeGenerator, optimizeconst

MAX_CHARS = 1 << 22
MAX_SECONDS = 2.0
MAX_POWER_BITS = 4096  # integers a template may compute with **
_WIDTH = re.compile(r"\d{6,}")  # a field width or precision of a million or more in a format string
_DIGITS = re.compile(r"\d+")  # (their sum bounds what a format string's widths can add)


class TemplateLimit(BaseException):
    """The template went past a limit; the message says which."""


class Budget:
    """The deadline and size limit of the render in progress on this thread (outside a render:
    no deadline, MAX_CHARS)."""

    _local = threading.local()

    @classmethod
    def max_chars(cls) -> int:
        return getattr(cls._local, "max_chars", MAX_CHARS)

    @classmethod
    def check(cls) -> None:
        deadline = getattr(cls._local, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise TemplateLimit(f"rendering took longer than {MAX_SECONDS:g} s")

    @classmethod
    @contextmanager
    def render(cls, seconds: float = MAX_SECONDS, input_chars: int = 0) -> Iterator[None]:
        """Run a render under the deadline, with a watchdog for loops that check nothing; strings
        may reach MAX_CHARS plus four times the messages' own size (a template copies them)."""
        cls._local.deadline = time.monotonic() + seconds
        cls._local.max_chars = MAX_CHARS + 4 * input_chars
        entry = _WATCHDOG.arm(time.monotonic() + seconds + 0.25, threading.get_ident())
        closed = False  # (the generator closed unused: its caller met the exception already)
        try:
            yield
        except GeneratorExit:
            closed = True
            raise
        finally:
            cls._local.deadline = None
            cls._local.max_chars = MAX_CHARS
            if _WATCHDOG.disarm(entry):  # from here on the watchdog cannot fire
                # it fired as the render ended: its exception, if still pending on this thread,
                # would surface later in code that is not the render's; it is raised here instead
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)
                if not closed:
                    raise TemplateLimit(f"rendering took longer than {MAX_SECONDS:g} s")


class _Watchdog:
    """One daemon thread for every render's deadline: at a deadline whose render has not ended it
    raises TemplateLimit in the rendering thread. (A timer thread per render cost ~1 ms a request,
    half of a long chat history's template and tokenizer work.)

    The rendering threads take ``_lock`` only in ``with`` blocks that call no Python function: an
    asynchronous exception is raised where a Python function starts, and one raised inside a
    Condition's ``__exit__`` (before it releases its lock) had left the lock held, so every later
    render of every thread waited for it for ever (a server's event loop too). The watchdog thread
    therefore polls the heap (deadlines lie >= 0.25 s ahead) instead of waiting on a Condition."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heap: list = []  # (deadline, order, entry); entry: {"tid", "done", "fired"}
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, tid: int) -> dict:
        entry = {"tid": tid, "done": False, "fired": False}
        item = (deadline, next(self._order), entry)
        with self._lock:  # (heappush is C)
            heapq.heappush(self._heap, item)
        t = self._thread
        if t is None or not t.is_alive():  # (two threads may start one each: both serve the heap)
            t = self._thread = threading.Thread(target=self._run, name="gguf-template-watchdog", daemon=True)
            t.start()
        return entry

    def disarm(self, entry: dict) -> bool:
        """The render has ended; whether the watchdog fired at it."""
        with self._lock:  # (the watchdog fires under this lock, only for entries not done)
            entry["done"] = True
        return entry["fired"]

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            with self._lock:
                while self._heap and (self._heap[0][2]["done"] or self._heap[0][0] <= now):
                    entry = heapq.heappop(self._heap)[2]
                    if not entry["done"]:
                        entry["done"] = entry["fired"] = True
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(entry["tid"]),
                                                                   ctypes.py_object(TemplateLimit))
                wait = self._heap[0][0] - now if self._heap else self.POLL_S
            time.sleep(min(max(wait, 0.001), self.POLL_S))


_WATCHDOG = _Watchdog()


def check_size(n: int, what: str) -> None:
    Budget.check()
    if n > (limit := Budget.max_chars()):
        raise TemplateLimit(f"{what} would make {n:,} items or characters (the limit is {limit:,})")


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, bytes)) else len(str(x))


def _check_format_string(fmt: Any, args: Any = ()) -> None:
    if isinstance(fmt, str) and _WIDTH.search(fmt):
        raise TemplateLimit("a format string asks for a width or precision of a million or more")
    if isinstance(fmt, str):  # what it can make at most: its text, its fields' widths, its arguments
        vals = args.values() if isinstance(args, dict) else args if isinstance(args, (list, tuple)) else (args,)
        check_size(len(fmt) + sum(int(d) for d in _DIGITS.findall(fmt)) + sum(_size(a) for a in vals),
                   "formatting a string")
    for a in args if isinstance(args, (list, tuple)) else (args,):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) >= 10 ** 6 and isinstance(fmt, str) and "*" in fmt:
            raise TemplateLimit("a format string takes a width of a million or more from its arguments")


# ---- operators ---------------------------------------------------------------------------------

def binop(operator: str, left: Any, right: Any) -> Any:
    """The sandbox's intercepted operators, each checked before it runs."""
    Budget.check()
    if operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, list, tuple, bytes)) and isinstance(n, int):
            check_size(len(seq) * max(n, 0), "repeating a string or list")
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            check_size(len(left) + len(right), "joining two strings or lists")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if abs(left).bit_length() * right > MAX_POWER_BITS:
                raise TemplateLimit(f"a power of {MAX_POWER_BITS}+ bits")
    elif operator == "%" and isinstance(left, str):
        _check_format_string(left, right)
        out = left % right
        check_size(len(out), "formatting a string")
        return out
    return {"*": lambda a, b: a * b, "+": lambda a, b: a + b, "**": lambda a, b: a ** b,
            "%": lambda a, b: a % b, "-": lambda a, b: a - b, "/": lambda a, b: a / b,
            "//": lambda a, b: a // b}[operator](left, right)


def check_shown(value: Any) -> Any:
    """``value`` unchanged, once what ``str(value)`` would write is known to fit: a list holding one
    big list many times (a cheap repeat) prints as a billion characters before any output check.
    The walk counts each list, tuple and dict's items before it looks inside (the clock runs)."""
    if isinstance(value, (list, tuple, dict)):
        limit, total, stack = Budget.max_chars(), 0, [value]
        while stack:
            v = stack.pop()
            total += len(v)
            if total > limit:
                raise TemplateLimit(f"printing a list or dict would make over {limit:,} items (the limit)")
            Budget.check()
            stack.extend(x for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (list, tuple, dict)))
    return value


def concat(items: Any) -> str:
    """``a ~ b ~ ...``: Jinja's str_join with the size checked first."""
    parts = [str(check_shown(x)) for x in items]
    check_size(sum(len(p) for p in parts), "joining strings with ~")
    return "".join(parts)


class LimitedCodeGenerator(CodeGenerator):
    """Jinja's code generator with ``~`` routed through ``environment.limited_concat``."""

    @optimizeconst
    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.limited_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


# ---- calls: str methods that size their result from an argument ----------------------------------

def check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    Budget.check()
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    nums = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if name in ("center", "ljust", "rjust", "zfill"):
        check_size(max(nums, default=0), f"str.{name}")
    elif name == "expandtabs":
        check_size(len(owner) * max(nums, default=8), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        check_size(len(owner) + count * max(len(args[1]) - len(args[0]), 0), "str.replace")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        check_size(sum(_size(x) for x in args[0]) + len(owner) * len(args[0]), "str.join")
    elif name in ("format", "format_map"):
        _check_format_string(owner, args)
        if any(isinstance(a, int) and abs(a) >= 10 ** 6 for a in nums) and "{" in owner and ":" in owner:
            raise TemplateLimit("a format call passes a width of a million or more")


# ---- filters ---------------------------------------------------------------------------------------

def limit_filters(filters: dict) -> None:
    """Wrap the filters that can make a big result from a small input."""

    def wrap(name: str, pre: Any = None) -> None:
        inner = filters[name]

        def limited(*args: Any, **kwargs: Any) -> Any:
            Budget.check()
            if pre is not None:
                pre(*args, **kwargs)
            out = inner(*args, **kwargs)
            if isinstance(out, (str, list)):
                check_size(len(out), f"the {name} filter")
            return out

        limited.__name__ = getattr(inner, "__name__", name)
        for attr in ("jinja_pass_arg",):  # pass_context / pass_environment markers
            if hasattr(inner, attr):
                setattr(limited, attr, getattr(inner, attr))
        filters[name] = limited

    def fmt_pre(value: Any, *args: Any, **kwargs: Any) -> None:
        _check_format_string(value, args)

    def width_pre(value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> None:
        if isinstance(width, int):
            check_size(width if not isinstance(value, str) else max(width, len(value)), "a width")

    def indent_pre(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
        w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        check_size(_size(value) + w * (str(value).count("\n") + 1), "the indent filter")

    def replace_pre(*args: Any, **kwargs: Any) -> None:
        # replace(eval_ctx, s, old, new, count=None): jinja passes the eval context first
        vals = [a for a in args if isinstance(a, str)]
        if len(vals) >= 3:
            s, old, new = vals[:3]
            count = s.count(old) if old else len(s) + 1
            check_size(len(s) + count * max(len(new) - len(old), 0), "the replace filter")

    def join_pre(*args: Any, **kwargs: Any) -> None:
        # join(eval_ctx, value, d="", attribute=None): the delimiter between every two items counts too
        at = next((i for i, a in enumerate(args) if isinstance(a, (list, tuple))), None)
        if at is not None:
            seq = args[at]
            d = kwargs.get("d", args[at + 1] if len(args) > at + 1 else "")
            check_size(sum(_size(x) for x in seq) + _size(d) * max(len(seq) - 1, 0), "the join filter")

    def wordwrap_pre(*args: Any, **kwargs: Any) -> None:
        # wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, ...): at most a line a
        # character, each ended by wrapstring
        s = next((a for a in args if isinstance(a, str)), "")
        wrap_with = kwargs.get("wrapstring", args[4] if len(args) > 4 else None)
        check_size(len(s) * (1 + (_size(wrap_with) if wrap_with is not None else 1)), "the wordwrap filter")

    def sum_pre(*args: Any, **kwargs: Any) -> None:
        # sum(environment, iterable, attribute=None, start=0): lists or strings added up make their total
        seq = next((a for a in args if isinstance(a, (list, tuple))), None)
        start = kwargs.get("start", args[3] if len(args) > 3 else 0)
        if seq is not None and (isinstance(start, (str, list, tuple)) or any(isinstance(x, (str, list, tuple))
                                                                            for x in seq[:1])):
            check_size(_size(start) + sum(_size(x) for x in seq), "the sum filter")

    def shown_pre(value: Any, *args: Any, **kwargs: Any) -> None:
        check_shown(value)

    def tojson_pre(value: Any, *args: Any, **kwargs: Any) -> None:
        check_shown(value)
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)  # (x, ensure_ascii, indent, ...)
        if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
            raise TemplateLimit("tojson indent above 64")

    for name, pre in (("format", fmt_pre), ("center", width_pre), ("indent", indent_pre),
                      ("replace", replace_pre), ("join", join_pre), ("wordwrap", wordwrap_pre),
                      ("tojson", tojson_pre), ("sum", sum_pre), ("string", shown_pre)):
        if name in filters:
            wrap(name, pre)


class LimitedRange:
    """``range`` for templates: at most MAX_CHARS steps, the clock checked as it goes."""

    def __init__(self, *args: int) -> None:
        self.r = range(*args)
        check_size(len(self.r), "range")

    def __len__(self) -> int:
        return len(self.r)

    def __iter__(self) -> Iterator[int]:
        for i, v in enumerate(self.r):
            if i % 1024 == 0:
                Budget.check()
            yield v

    def __getitem__(self, i: Any) -> Any:
        return self.r[i]


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - Jinja's names
    """Jinja's lipsum with at most 20 paragraphs of at most 100 words."""
    from jinja2.utils import generate_lorem_ipsum

    if not all(isinstance(v, int) for v in (n, min, max)) or n > 20 or max > 100 or min > max:
        raise TemplateLimit("lipsum beyond 20 paragraphs of 100 words")
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


def collect(chunks: Iterator[str]) -> str:
    """The rendered output, checked for size and time chunk by chunk."""
    out, total = [], 0
    for c in chunks:
        total += len(c)
        check_size(total, "the rendered prompt")
        out.append(c)
    return "".join(out)
