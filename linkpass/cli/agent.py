"""`linkpass agent`: run the per-host daemon (linkpass/agent/daemon.py) in this network namespace.

It needs capabilities, not root: the daemon checks its own at start and names what is missing
(the systemd unit runs it as the linkpass user with CAP_NET_RAW and CAP_NET_ADMIN)."""
from __future__ import annotations

import argparse

from ..observe.log import RANK
from ..console.files import absolute


def register(sub: argparse._SubParsersAction) -> None:
    ag = sub.add_parser("agent", help="the per-host daemon: probe mesh, detection, failover of routes and ports",
                        description="Run the LinkPass agent on this host (in this network namespace). It needs "
                                    "CAP_NET_RAW and CAP_NET_ADMIN (root has them; the systemd unit grants them to "
                                    "the linkpass user) and, for SCHED_FIFO, CAP_SYS_NICE or an RLIMIT_RTPRIO.")
    ag.add_argument("--config", metavar="FILE", type=absolute,
                    help="YAML config (every field: docs/failover.md; one file for a fleet: docs/install.md)")
    ag.add_argument("--check-config", action="store_true",
                    help="check the config, its key and TLS files and the capabilities here, show what `auto` "
                         "found on this host, and exit: 0 it would start, 2 it would not")
    ag.add_argument("--schema", action="store_true",
                    help="print the config file's JSON Schema (deploy/schema/agent-config.schema.json) and exit")
    ag.add_argument("-o", "--output", choices=("table", "json"), default="table",
                    help="with --check-config: table for people, json for scripts")
    ag.add_argument("--max-seconds", type=float, default=None, help="stop by itself after this long")
    ag.add_argument("--dry-run", action="store_true",
                    help="detect and log every decision (route_change events with dry_run=true); touch nothing")
    ag.add_argument("--log-level", choices=tuple(RANK), default=None,
                    help="write log lines of this level and above (default $LINKPASS_LOG_LEVEL or info)")
    ag.set_defaults(func=run, needs_root=False)  # capabilities, checked by the daemon itself


def run(args) -> int:
    if args.schema:
        import json

        from ..agent.config import schema

        print(json.dumps(schema(), indent=2))
        return 0
    if not args.config:
        from ..console.output import error

        return error("agent: --config FILE is required (or --schema to print the config's JSON Schema)")
    if args.check_config:
        return check_config(args.config, args.dry_run, args.output)
    from ..agent.daemon import main  # the daemon's imports (pyroute2, the C core) only when it runs
    from ..probe.common import ProbePortBusy

    try:
        return main(args.config, args.max_seconds, args.dry_run, args.log_level)
    except ProbePortBusy as exc:  # probe.engine: sockets where RoCEv2's port is someone else's
        from ..observe.log import say

        say(f"linkpass agent: probe engine: {exc}")
        return 2


def check_config(path: str, dry_run: bool, fmt: str) -> int:
    """What the agent would run with here, or the one reason it would not start."""
    import json

    from ..agent.config import ConfigError
    from ..agent.daemon import capability_refusal, load, probe_engine_kind
    from ..kernel import caps
    from ..console.output import EXIT_CRITICAL, EXIT_OK, error

    try:
        cfg, _key, accept_key = load(path)
    except ConfigError as exc:
        return error(f"config error: {exc}", EXIT_CRITICAL)
    refusal = capability_refusal(cfg, dry_run, caps.read_cap_eff(), probe_engine_kind(cfg))
    doc = {"config": path, "ok": refusal is None, "would_refuse": refusal, "name": cfg.name, "agent_id": cfg.agent_id,
           "service": cfg.service, "nics": [{"plane": n.plane, "ifname": n.ifname, "addr": n.addr,
                                              "gateway": n.gateway} for n in cfg.nics],
           "peers": len(cfg.peers), "metrics": f"{cfg.metrics_address}:{cfg.metrics_port}",
           "coordinator": cfg.coordinator.url if cfg.coordinator else None, "fleet_keys": 2 if accept_key else 1,
           "routes": cfg.routes_enabled, "entropy": cfg.entropy_enabled, "engine": probe_engine_kind(cfg)}
    if fmt == "json":
        print(json.dumps(doc, indent=2))
    else:
        print(f"{path}: {'ok' if refusal is None else 'valid, but the agent would not start here'}")
        print(f"  host {cfg.name}  agent_id {cfg.agent_id}  service {cfg.service}  engine {doc['engine']}")
        for n in doc["nics"]:
            print(f"  plane {n['plane']}: {n['ifname']} {n['addr']}" + (f" via {n['gateway']}" if n["gateway"] else ""))
        print(f"  peers {doc['peers']}  metrics {doc['metrics']}  coordinator {doc['coordinator'] or 'none'}  "
              f"fleet keys {doc['fleet_keys']}  routes {'on' if cfg.routes_enabled else 'off'}  "
              f"entropy {'on' if cfg.entropy_enabled else 'off'}")
    if refusal is not None:
        return error(refusal, EXIT_CRITICAL)
    return EXIT_OK
