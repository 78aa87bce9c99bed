"""`linkpass` command line: one entry point, a subcommand per capability."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from . import __version__
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
    from .testbed import cli as testbed_cli
    from . import demo, doctor, fleet_cli, paths_cli, probe_cli

    ap = argparse.ArgumentParser(prog="linkpass", description=__doc__.strip() if __doc__ else None)
    ap.add_argument("--version", action="version", version=f"linkpass {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    testbed_cli.register(sub)
    ag = sub.add_parser("agent", help="the per-host daemon: probe mesh, detection, failover of routes and ports",
                        description="Run the LinkPass agent on this host (in this network namespace).")
    ag.add_argument("--config", required=True, metavar="FILE", help="YAML config; see linkpass/agent/config.py")
    ag.add_argument("--max-seconds", type=float, default=None, help="stop by itself after this long")
    ag.add_argument("--dry-run", action="store_true",
                    help="detect and log every decision (route_change events with dry_run=true); touch nothing")
    ag.set_defaults(func=lambda a: __import__("linkpass.agent.daemon", fromlist=["main"]).main(
        a.config, a.max_seconds, a.dry_run), needs_root=True)
    paths_cli.register(sub)
    fleet_cli.register(sub)
    probe_cli.register(sub)
    doctor.register(sub)
    demo.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .testbed.build import TestbedError
    from .testbed.topology import TopologyError

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


if __name__ == "__main__":
    sys.exit(main())
