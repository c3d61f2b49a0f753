"""The `gguf-run` typer app and its entry point.

`gguf-run [MODEL] --prompt ...` is short for `gguf-run run [MODEL] --prompt ...`: ``main`` routes
argv to `run` unless its first word names another command. Every user error ends in one line on
stderr and exit code 2; Ctrl-C ends with 130.
"""

from __future__ import annotations

import functools
import sys

import typer

from . import llama_flags
from .thinking import think_argv
from ..errors import GGUFRunError, printable

app = typer.Typer(
    name="gguf-run",
    help="Run GGUF quantized LLMs: stream completions, chat, inspect, benchmark.\n\n"
         "gguf-run [MODEL.gguf] --prompt TEXT is short for gguf-run run ... "
         "(no MODEL: the embedded SmolLM2-135M-Instruct).",
    epilog="Examples:\n\n"
           "  gguf-run --prompt 'Why is the sky blue?'\n\n"
           "  gguf-run model.gguf -p 'Once upon a time' --raw -n 64 --temp 0\n\n"
           "  gguf-run info model.gguf\n\n"
           "  gguf-run tokenize model.gguf 'Hello world' --pieces\n\n"
           "  gguf-run bench model.gguf --batch 1,8,32,64\n\n"
           "llama.cpp's -m MODEL, -ngl N (0: the CPU), -fa, -s SEED and -np N (serve) are understood too.",
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# registers the commands on `app`
from . import chat_cmd, info_cmd, list_cmd, run_cmd, synth_cmd, bench_cmd, serve_cmd, perplexity_cmd, embed_cmd  # noqa: E402,F401,E501


@functools.cache
def _click_commands() -> dict:
    """The commands as click builds them from the typer app (once: ~8 ms a build)."""
    return dict(getattr(typer.main.get_command(app), "commands", {}))


def _commands() -> set[str]:
    return set(_click_commands())


def _takes_value(command: str, option: str) -> bool | None:
    """Whether ``command``'s option ``option`` reads the next word (a value, not a switch); None:
    the command has no such option."""
    cmd = _click_commands().get(command)
    for p in getattr(cmd, "params", ()):
        if option in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())):
            return not getattr(p, "is_flag", False) and not getattr(p, "count", False)
    return False if option in ("-h", "--help") else None


def route(argv: list[str]) -> list[str]:
    """Insert `run` unless argv starts with a command name or asks for the top-level help."""
    if argv and (argv[0] in _commands() or argv[0] in ("-h", "--help", "--version")):
        return argv
    return ["run", *argv]


def _exception_classes() -> tuple[tuple, tuple, tuple]:
    """(usage errors, exits, aborts): typer's own, and click's when click is installed (typer up
    to 0.2x raised click's; later typer vendors click and raises its copies)."""
    usage = {c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"}
    exits, aborts = {typer.Exit}, {typer.Abort}
    try:
        import click
    except ImportError:
        pass
    else:
        usage.add(click.ClickException)
        exits.add(click.exceptions.Exit)
        aborts.add(click.exceptions.Abort)
    return tuple(usage), tuple(exits), tuple(aborts)


_USAGE_ERRORS, _EXITS, _ABORTS = _exception_classes()


def err(msg: str) -> None:
    print(f"error: {printable(msg)}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = route(list(sys.argv[1:] if argv is None else argv))
    if args == ["--version"]:
        from .. import __version__
        print(f"gguf-run {__version__}")
        return 0
    try:
        quiet = "-q" in args or "--quiet" in args
        args = think_argv(args, _takes_value)  # (first: to translate, a bare --think reads the next word)
        args = llama_flags.translate(args, _takes_value, (lambda m: None) if quiet else
                                     (lambda m: print(f"note: {m}", file=sys.stderr, flush=True)))
        # without standalone mode typer returns click's exit code for an abort (Ctrl-C: 130)
        code = app(args=args, prog_name="gguf-run", standalone_mode=False)
    except _EXITS as e:
        return e.exit_code
    except _ABORTS:
        return 130
    except _USAGE_ERRORS as e:  # bad option, missing argument, bad value
        err(e.format_message().replace("\n", " "))
        return 2
    except GGUFRunError as e:
        err(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gguf-run ... | head`
        return 0
    return code if isinstance(code, int) else 0
