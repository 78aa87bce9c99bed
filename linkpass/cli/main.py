"""`linkpass` command line: one entry point, a subcommand per capability."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from .. import __version__
from .output import EXIT_CRITICAL, EXIT_UNKNOWN, paint


def _root_required(what: str) -> None:
    if os.geteuid() != 0:
        raise SystemExit(_fail(f"{what} needs root (it creates network namespaces and routes); run it with sudo",
                               EXIT_UNKNOWN))


def _fail(message: str, code: int = EXIT_CRITICAL) -> int:
    print(f"{paint('linkpass: error:', 'red', sys.stderr)} {message}", file=sys.stderr)
    return code


_MAIN_PID = os.getpid()


def _raise_interrupt(_sig, _frame):
    # Libraries fork helpers (pyroute2 opens namespace sockets from a forked child, then
    # SIGTERMs it): a forked copy of us must just die, never unwind into our cleanup code.
    if os.getpid() != _MAIN_PID:
        os._exit(128 + signal.SIGTERM)
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    # the testbed's own commands register here; nothing else outside tests, the demo and the
    # benchmarks imports the testbed
    from ..testbed import cli as testbed_cli, pathcheck
    from .. import demo
    from . import agent as agent_cli, coordinator as coordinator_cli, doctor, paths, tls

    ap = argparse.ArgumentParser(prog="linkpass", description=__doc__.strip() if __doc__ else None)
    ap.add_argument("--version", action="version", version=f"linkpass {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    testbed_cli.register(sub)
    agent_cli.register(sub)
    paths.register(sub)
    coordinator_cli.register(sub)
    tls.register(sub)
    pathcheck.register(sub)
    doctor.register(sub)
    demo.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..testbed.build import TestbedError
    from ..testbed.topology import TopologyError

    # SIGTERM unwinds like Ctrl-C, so every command's cleanup (finally blocks) runs
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return EXIT_UNKNOWN
    if getattr(args, "needs_root", False):
        _root_required(f"`linkpass {args.command}`")
    try:
        return int(args.func(args) or 0)
    except (TestbedError, TopologyError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


