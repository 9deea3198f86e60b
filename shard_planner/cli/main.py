"""``shard-planner``: the entry point. Sets up logging, dispatches to a command module, and turns a
:class:`~shard_planner.errors.UserError` into one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading

from shard_planner import __version__
from shard_planner.cli.args import Parser, add_debug
from shard_planner.cli.once import OncePerCause
from shard_planner.errors import UserError

# In pipeline order; each is a module shard_planner.cli.<name> with add_parser() and run().
COMMANDS = ("trace", "estimate", "calibrate", "plan", "run", "report", "export", "tune")


def _available_commands(names: tuple[str, ...] = COMMANDS) -> list:
    return [
        importlib.import_module(f"shard_planner.cli.{name}")
        for name in names
        if importlib.util.find_spec(f"shard_planner.cli.{name}") is not None
    ]


def _named_command(argv: list[str] | None) -> tuple[str, ...]:
    """The command the command line names (its first word that is not an option), alone, when it is
    one of ours: only its module is imported (each pulls in its own stack: torch, CP-SAT, matplotlib),
    so ``shard-planner plan`` does not pay for importing the other commands. Every command otherwise
    (no command, a misspelt one, a bare --help): the parser then lists them all."""
    first = next((a for a in (argv or ()) if not a.startswith("-")), None)
    return (first,) if first in COMMANDS else COMMANDS


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the subparser of the command it names (see :func:`_named_command`)."""
    parser = Parser(
        prog="shard-planner",
        description="Plan, check and run PyTorch FSDP2 sharding: wrap boundaries, prefetch, reshard, "
        "activation checkpointing and micro-batch, for the fastest step that fits in memory.",
    )
    add_debug(parser, top=True)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__} (Python {sys.version.split()[0]})",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _available_commands(_named_command(argv) if argv is not None else COMMANDS):
        p = module.add_parser(sub)
        add_debug(p, top=False)
        p.set_defaults(_run=module.run)
    return parser


def configure_logging(debug: bool) -> None:
    """Configure the package logger (never the root logger), with the rank when there is one, each
    warning printed once per command (cli/once.py)."""
    rank = os.environ.get("RANK")
    fmt = ("[rank%s] " % rank if rank is not None else "") + "%(levelname)s %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(OncePerCause())  # see [Note: each warning once per cause]
    log = logging.getLogger("shard_planner")
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    log.propagate = False
    if not debug:
        # FakeTensorMode logs a whole traceback on a shape error; we report it in one line instead.
        logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that its cleanup runs as for Ctrl-C: a run's ranks are
    ended, a half-written file is removed."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the cleanup finish
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except UserError as exc:  # a value out of range (shard_planner.cli.args): one line, like every error
        print(f"shard-planner: error: {exc}", file=sys.stderr)
        return exc.exit_code
    configure_logging(args.debug)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print(f"shard-planner: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # the reader of our output left (`shard-planner plan ... | head`): say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe (docs of `signal`)
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated): the command cleaned up on the way out
        terminated = isinstance(exc, Terminated)
        print(f"shard-planner: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
