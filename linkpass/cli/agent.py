"""`linkpass agent`: run the per-host daemon (linkpass/agent/daemon.py) in this network namespace."""
from __future__ import annotations

import argparse

from ..observe.log import RANK


def register(sub: argparse._SubParsersAction) -> None:
    ag = sub.add_parser("agent", help="the per-host daemon: probe mesh, detection, failover of routes and ports",
                        description="Run the LinkPass agent on this host (in this network namespace).")
    ag.add_argument("--config", required=True, metavar="FILE", help="YAML config; see linkpass/agent/config.py")
    ag.add_argument("--max-seconds", type=float, default=None, help="stop by itself after this long")
    ag.add_argument("--dry-run", action="store_true",
                    help="detect and log every decision (route_change events with dry_run=true); touch nothing")
    ag.add_argument("--log-level", choices=tuple(RANK), default=None,
                    help="write log lines of this level and above (default $LINKPASS_LOG_LEVEL or info)")
    ag.set_defaults(func=run, needs_root=True)


def run(args) -> int:
    from ..agent.daemon import main  # the daemon's imports (pyroute2, the C core) only when it runs

    return main(args.config, args.max_seconds, args.dry_run, args.log_level)
