"""`linkpass` command line: one entry point, a subcommand per capability."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from .. import __version__
from ..observe.log import say
from ..console.output import EXIT_CRITICAL, EXIT_INTERRUPTED, EXIT_UNKNOWN, CliError, error, paint
from .parser import Parser


def _root_required(what: str) -> None:
    if os.geteuid() != 0:
        raise SystemExit(_fail(f"{what} needs root (it creates network namespaces and routes); run it with sudo",
                               EXIT_UNKNOWN))


def _fail(message: str, code: int = EXIT_CRITICAL) -> int:
    # with the journal's priority prefix under systemd: `journalctl -p err` shows why a unit died
    say(f"{paint('linkpass: error:', 'red', sys.stderr)} {message}")
    return code


_MAIN_PID = os.getpid()


def _raise_interrupt(_sig, _frame):
    # Libraries fork helpers (pyroute2 opens namespace sockets from a forked child, then
    # SIGTERMs it): a forked copy of us must just die, never unwind into our cleanup code.
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signal.SIGTERM)
    raise KeyboardInterrupt


DEBUG_HELP = "on an unexpected error, show its traceback (also $LINKPASS_DEBUG=1)"


def build_parser() -> argparse.ArgumentParser:
    # the testbed's own commands register here; nothing else outside tests, the demo and the
    # benchmarks imports the testbed
    from ..testbed import cli as testbed_cli
    from .. import demo
    from . import agent as agent_cli, coordinator as coordinator_cli, doctor, pathcheck, paths, selfdoc, tls

    ap = Parser(prog="linkpass", description="Network-level link failover for GPU fabrics: the host agent, the "
                                             "coordinator that sees the fleet, and the commands on-call runs "
                                             "against them.",
                epilog="Exit codes: 0 ok, 1 warning, 2 critical, 3 unknown (bad usage, no answer, refused token, "
                       "an error), 130 interrupted; `linkpass man` prints the manual.")
    ap.add_argument("--version", action="version", version=f"linkpass {__version__}")
    ap.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    testbed_cli.register(sub)
    agent_cli.register(sub)
    paths.register(sub)
    coordinator_cli.register(sub)
    tls.register(sub)
    pathcheck.register(sub)
    doctor.register(sub)
    demo.register(sub)
    selfdoc.register(sub, build_parser)
    for p in subparsers(ap):  # `linkpass status --debug` as well as `linkpass --debug status`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return ap


def subparsers(parser: argparse.ArgumentParser):
    """Every subcommand's parser below `parser`, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in dict.fromkeys(action.choices.values()):  # an alias maps to the same parser
                yield sp
                yield from subparsers(sp)


# the packages only an extra installs (pyproject.toml), and that extra
EXTRA_OF_MODULE = {"ray": "coordinator", "cryptography": "coordinator", "torch": "demo", "matplotlib": "demo",
                   "numpy": "sim", "scapy": "test"}


def _debugging(argv: list[str]) -> bool:
    given = argv[:argv.index("--")] if "--" in argv else argv
    return "--debug" in given or os.environ.get("LINKPASS_DEBUG", "") not in ("", "0")


def _unexpected(exc: BaseException) -> str:
    """One line for an error no command turned into a message: what, and the way out where the
    kind of error tells it."""
    import json

    lines = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    extra = EXTRA_OF_MODULE.get((getattr(exc, "name", None) or "").split(".")[0])
    if isinstance(exc, ModuleNotFoundError) and extra:
        return (f"this command needs {exc.name}, which an agent host's install leaves out: "
                f"pip install 'linkpass[{extra}]' (docs/install.md)")
    if isinstance(exc, PermissionError):
        fix = "check the file's owner and mode, or run with sudo"
    elif isinstance(exc, FileNotFoundError):
        fix = "check the path"
    elif isinstance(exc, (KeyError, TypeError, json.JSONDecodeError)):
        fix = ("an answer this version does not understand: compare `linkpass --version` with the coordinator's "
               "and the agents'")
    else:
        fix = "a bug, most likely"
    return f"{what} ({fix}; --debug shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code. Whatever goes wrong ends in one line on stderr, never a
    traceback (unless --debug or $LINKPASS_DEBUG=1 asks for it)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["__complete"]:  # the completion scripts' helper: quick, quiet, never an error
        from .completion import complete_main

        return complete_main(argv[1:])
    debug = _debugging(argv)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # the reader went away (`linkpass events` piped to head): nothing more to say to it, and Python
        # must not complain about the pipe again when it flushes at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_UNKNOWN
    except CliError as exc:
        if debug:
            traceback.print_exc()
        return error(str(exc), exc.code)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, exit 3
        if debug:
            traceback.print_exc()
        return error(_unexpected(exc))


def _run(argv: list[str]) -> int:
    from ..testbed.build import TestbedError
    from ..testbed.topology import TopologyError

    # SIGTERM unwinds like Ctrl-C, so every command's cleanup (finally blocks) runs
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help(sys.stderr)
        return EXIT_UNKNOWN
    if getattr(args, "needs_root", False):
        _root_required(f"`linkpass {args.command}`")
    try:
        return int(args.func(args) or 0)
    except (TestbedError, TopologyError) as exc:
        return _fail(str(exc))


