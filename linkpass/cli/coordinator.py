"""`linkpass coordinator`: the coordinator itself (a Ray actor), and the registration of every
command that asks it: status, agents, links, paths HOST, events (fleet.py), drain, undrain and
decommission (drains.py), token (tokens.py), openapi; their connection to the coordinator is
coordinator_client.py's, durations and times times.py's.

Every command: `-o table|wide|json|yaml`, `--coordinator URL`, `--token-file FILE`, `--ca-file`
and, for mutual TLS, `--cert-file`/`--key-file`, each also from the environment and a context of
the CLI's config file (`--context`, `--config-file`; settings.py has the precedence), and
`--insecure-http` to allow an http:// URL. Drains need an operator token. Exit codes: 0 ok,
1 warning, 2 critical (a write the coordinator's guard refused, too), 3 unknown (coordinator
unreachable, TLS or token refused, bad usage or config).
"""
from __future__ import annotations

import argparse
import json
import signal
import time

from ..core.constants import COORDINATOR_LISTEN, COORDINATOR_PORT
from ..console.output import EXIT_OK, EXIT_WARNING, CliError, error, paint
from ..observe.log import RANK
from ..console.files import absolute
from . import drains, fleet
from .coordinator_client import Usage
from .drains import add_decommission
from .tokens import add_token



def register(sub: argparse._SubParsersAction) -> None:
    """`linkpass coordinator` (its actions: token, openapi, decommission), then the fleet's reads and
    the drains, in this order (the order of `linkpass --help`)."""
    co = sub.add_parser("coordinator", help="run the coordinator (a Ray actor) that sees the whole fleet",
                        description="Start the coordinator as a detached, named Ray actor. Without --address it "
                                    "starts a local Ray instance and stays in the foreground until Ctrl-C; with "
                                    "--address it joins that Ray cluster, makes sure the actor runs, and returns.")
    co.add_argument("--address", help="Ray cluster to join (auto: this node's; HOST:6379 from a Ray node; ray://HOST:10001 "
                    "with ray[client]); default: a local Ray")
    co.add_argument("--listen", default=None, help=f"HOST:PORT of the endpoint (default {COORDINATOR_LISTEN}; "
                                                   f"0.0.0.0:{COORDINATOR_PORT} with --testbed, so namespaced agents reach it)")
    co.add_argument("--state-dir", default=None, type=absolute, help="SQLite database and tokens (default /var/lib/linkpass/coordinator)")
    co.add_argument("--shards", type=int, default=None, metavar="S",
                    help="coordinator shards agents report to (default 1). With S > 1 a root actor and S shard "
                         "actors, each with its own endpoint (ports after --listen's, or --shard-listen); agents "
                         "configured with the root's address are sent to their shard. Needs a fabric model")
    co.add_argument("--shard-listen", action="append", default=None, metavar="HOST:PORT",
                    help="a shard's endpoint, once per shard in order (default: the root's host, the ports after its own)")
    co.add_argument("--store", metavar="URL", default=None,
                    help="keep the state in PostgreSQL instead of SQLite in --state-dir: postgresql://USER@HOST:PORT/DB "
                         "(a server every Ray node reaches, so a restarted actor finds its state anywhere)")
    co.add_argument("--store-password-file", metavar="FILE", type=absolute, default=None,
                    help="the --store user's password (one line, mode 0600; never in the URL)")
    co.add_argument("--store-tls-ca", metavar="FILE", type=absolute, default=None,
                    help="the CA (PEM) that signed the --store server's TLS certificate (default: the system's "
                         "trust store); the store is reached over TLS only, its certificate checked against the "
                         "CA and the URL's host")
    co.add_argument("--store-insecure-plaintext", action="store_true",
                    help="reach the --store server without TLS: the state crosses the network unencrypted, to a "
                         "server no certificate vouches for (a warning is logged)")
    src = co.add_mutually_exclusive_group()
    src.add_argument("--testbed", metavar="PREFIX", help="use this running testbed's fabric as the fleet model")
    src.add_argument("--fabric", metavar="FILE", type=absolute, help="fleet model JSON (links, hosts, addresses)")
    co.add_argument("--max-drain-share", type=float, default=0.05,
                    help="blast-radius guard: share of one tier's links in one plane that may be drained (default 0.05)")
    co.add_argument("--agent-timeout-s", type=float, default=None,
                    help="an agent silent this long is reported lost (default 10)")
    co.add_argument("--agent-expire-s", type=float, default=None,
                    help="an agent silent this long is forgotten, as by `decommission` (default 86400)")
    co.add_argument("--event-retention-days", type=float, default=None,
                    help="events older than this are deleted (default 90)")
    co.add_argument("--event-retention-count", type=int, default=None,
                    help="at most this many events are kept, the newest (default 1000000)")
    co.add_argument("--max-body-bytes", type=int, default=None,
                    help="largest request body accepted; larger ones get 413 (default 4194304)")
    co.add_argument("--stop", action="store_true", help="stop the running coordinator actor (with --address)")
    co.add_argument("--max-seconds", type=float, default=None, help="stop by itself after this long (foreground)")
    co.add_argument("--log-level", choices=tuple(RANK), default=None,
                    help="the coordinator writes log lines of this level and above (default $LINKPASS_LOG_LEVEL or "
                         "info); in the foreground they are copied from <state-dir>/coordinator.log to stderr")
    tls = co.add_argument_group("TLS", "HTTPS by default; without --tls-cert, a lab CA in <state-dir>/tls is made on "
                                       "first start (docs/security.md, TLS set-up)")
    tls.add_argument("--tls-cert", metavar="FILE", type=absolute, help="the endpoint's certificate (PEM; with --tls-key)")
    tls.add_argument("--tls-key", metavar="FILE", type=absolute, help="its private key (PEM)")
    tls.add_argument("--tls-ca", metavar="FILE", type=absolute, help="CA of client certificates (default: the lab CA's)")
    tls.add_argument("--tls-san", metavar="NAMES", help="more names/addresses for the lab CA's coordinator "
                                                      "certificate, comma-separated (--testbed adds its address)")
    tls.add_argument("--require-client-cert", action="store_true",
                     help="mutual TLS: refuse clients without a certificate the CA signed")
    tls.add_argument("--insecure-http", action="store_true",
                     help="serve plain HTTP: tokens cross the network in cleartext (a warning is logged)")
    co.set_defaults(func=run_coordinator)
    actions = co.add_subparsers(dest="coordinator_action", metavar="ACTION",
                                title="actions (without one, the coordinator itself runs)")
    add_token(actions)
    oa = actions.add_parser("openapi", help="print the coordinator's HTTP API as OpenAPI 3.1 (JSON)",
                            description="The same document the coordinator serves at /v1/openapi.json, made from "
                                        "its route table; needs no coordinator. Exit 0.")
    oa.set_defaults(func=_openapi)
    add_decommission(actions)

    fleet.register(sub)
    drains.register(sub)


def _openapi(args) -> int:
    from ..coordinator.http import openapi_doc

    print(json.dumps(openapi_doc(), indent=2))
    return EXIT_OK


# ---- the coordinator process -------------------------------------------------------------
def _testbed_model(prefix: str) -> dict:
    """`--testbed PREFIX`: that running testbed's fabric, as the coordinator's model."""
    from ..core.fabric import from_testbed
    from ..testbed.build import load_fabric  # the one testbed-facing option of a fleet command

    return from_testbed(load_fabric(prefix)).to_dict()


def _tls_settings(args) -> dict:
    """The TLS part of the coordinator's settings (startup.py); --testbed adds its management address."""
    if args.insecure_http:
        given = [flag for flag, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca),
                                      ("--tls-san", args.tls_san), ("--require-client-cert", args.require_client_cert)) if v]
        if given:
            raise Usage(f"{given[0]}: not used with --insecure-http (plain HTTP); remove one of the two")
        return {"insecure_http": True}
    sans = [s for s in (args.tls_san or "").split(",") if s.strip()]
    if args.testbed:
        from ..testbed.build import load_fabric

        sans.append(load_fabric(args.testbed).mgmt_root_addr)
    return {"tls_cert_file": args.tls_cert, "tls_key_file": args.tls_key, "tls_ca_file": args.tls_ca,
            "tls_san": sans, "require_client_cert": args.require_client_cert}


def _join_ray(address: str | None) -> None:
    """Join the Ray cluster at `address` (or start a local Ray); a failure is one line naming the
    address and what to check, never Ray's traceback."""
    from ..coordinator import ray_actor

    if address:
        _ray_answers(address)
    try:
        ray_actor.connect(address)
    except Exception as exc:  # Ray raises ValueError, ConnectionError, RuntimeError, ... by case
        text = str(exc)
        if not address:
            why = (f"could not start a local Ray instance ({_first_line(exc)}): check free memory and disk in "
                   "/tmp/ray, and that no stale Ray runs (`ray stop` ends it)")
        elif "ray[client]" in text:
            why = (f"--address {address}: a ray:// address needs the Ray Client (pip install 'ray[client]'); on a "
                   "node of the cluster, give the head's GCS address HOST:6379 instead")
        elif "Could not find any running Ray instance" in text:
            why = (f"--address {address}: no Ray instance runs on this host; start one (`ray start --head`) or "
                   "give the head's address, HOST:6379")
        else:
            why = (f"could not join Ray at {address} ({_first_line(exc)}): check the address (HOST:6379, "
                   "ray://HOST:10001 or auto) and that the Ray head runs (`ray status` on it)")
        raise CliError(why) from exc


def _ray_answers(address: str, timeout_s: float = 3.0) -> None:
    """Something listens at a HOST:PORT or ray://HOST:PORT address: Ray itself would retry an
    address nobody answers on for minutes, printing its own warnings."""
    import socket
    from urllib.parse import urlparse

    if "://" in address:
        u = urlparse(address)
        host, port = u.hostname, (u.port if u.netloc.rpartition(":")[2].isdigit() else None)
    else:
        host, _, port_text = address.rpartition(":")
        host, port = host.strip("[]"), int(port_text) if port_text.isdigit() else None
    if not host or port is None:
        return  # auto, local, or a form Ray itself will judge
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise CliError(f"--address {address}: nothing answers at {host}:{port} ({why}); check that the Ray "
                       "head runs there (`ray status` on it) and that this is its GCS port (6379 by default), "
                       "or its Ray Client port (10001) for ray://") from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0][:200] if lines else "") or type(exc).__name__


def run_coordinator(args) -> int:
    from ..coordinator import ray_actor
    from ..coordinator.startup import DEFAULT_STATE_DIR, log_path
    from ..control.tls import SERVER, lab_dir, lab_paths
    from ..observe.log import Follower, level_from_env

    try:
        tls = _tls_settings(args)
        log_level = level_from_env(args.log_level)  # resolved here: the actor's process has another environment
    except ValueError as exc:  # Usage, a bad --log-level in the environment
        return error(str(exc))
    settings = {"state_dir": args.state_dir or DEFAULT_STATE_DIR, "fabric": args.fabric,
                "fabric_model": _testbed_model(args.testbed) if args.testbed else None,
                "listen": args.listen or (f"0.0.0.0:{COORDINATOR_PORT}" if args.testbed else COORDINATOR_LISTEN),
                "max_drain_share": args.max_drain_share, "log_level": log_level, **tls}
    if args.store_insecure_plaintext and args.store_tls_ca is not None:
        return error("--store-tls-ca: not used with --store-insecure-plaintext (no TLS to verify); remove one of "
                     "the two")
    if (args.store is not None or args.store_password_file is not None or args.store_tls_ca is not None
            or args.store_insecure_plaintext):
        settings.update(store=args.store, store_password_file=args.store_password_file,
                        store_tls_ca_file=args.store_tls_ca)
        if args.store_insecure_plaintext:
            settings["store_insecure_plaintext"] = True
    for name in ("agent_timeout_s", "agent_expire_s", "event_retention_count", "max_body_bytes", "shards",
                 "shard_listen"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.event_retention_days is not None:
        settings["event_retention_s"] = args.event_retention_days * 86400
    from ..coordinator.startup import check_settings
    from ..control.errors import CoordinatorError

    try:
        check_settings(settings)  # refused here, by name, rather than inside the Ray actor
    except CoordinatorError as exc:
        return error(str(exc))
    print(f"starting {'a local Ray instance' if not args.address else 'on Ray at ' + args.address} ...", flush=True)
    _join_ray(args.address)
    follower = None
    try:
        if args.stop:
            if ray_actor.existing() is None and not ray_actor.shards():
                print("no coordinator actor is running")
                return EXIT_WARNING
            ray_actor.stop_all()
            print("coordinator stopped")
            return EXIT_OK
        if not args.address:
            # the actor's log lines from now on, copied to this process's stderr (under systemd, its
            # journal); detached on a cluster (--address), they stay in that file on the actor's node
            follower = Follower(log_path(settings)).start()
        try:
            handle, url = ray_actor.ensure(settings)
        except Exception as exc:  # Ray's own errors, a timeout: the actor's log says more
            raise CliError(f"the coordinator actor did not come up ({_first_line(exc)}); its log: "
                           f"{log_path(settings)}") from exc
        print(f"coordinator up: {url} (Ray actor {ray_actor.NAMESPACE}/{ray_actor.ACTOR_NAME}, pid "
              f"{ray_actor.actor_pid(handle)})")
        for k, h in enumerate(ray_actor.shards()):
            print(f"  shard {k}: {ray_actor.endpoint(h)} (Ray actor {ray_actor.NAMESPACE}/"
                  f"{ray_actor.SHARD_NAME.format(k)}); agents given the root's address are sent there")
        print(f"tokens: {settings['state_dir']}/{{reader,operator}}.token; agents: `linkpass coordinator token "
              f"HOST --state-dir {settings['state_dir']}` (one each); database: {settings['state_dir']}/coordinator.db")
        if args.insecure_http:
            print(paint("warning: plain HTTP (--insecure-http): tokens cross the network in cleartext", "yellow"))
        if args.store_insecure_plaintext:
            print(paint("warning: PostgreSQL store without TLS (--store-insecure-plaintext): the fleet's state "
                        "crosses the network unencrypted", "yellow"))
        else:
            print(f"TLS: certificate {settings.get('tls_cert_file') or lab_paths(lab_dir(settings['state_dir']), SERVER)[0]}"
                  f"; clients verify it with {settings.get('tls_ca_file') or lab_paths(lab_dir(settings['state_dir']), 'ca')[0]}"
                  + ("; client certificates required" if args.require_client_cert else ""))
        if args.address:
            return EXIT_OK  # detached: it lives on in the cluster
        end = None if args.max_seconds is None else time.monotonic() + args.max_seconds
        print("running; Ctrl-C stops it", flush=True)
        def on_term(_sig, _frame):  # ray.init replaced the CLI's handler: a stop is a Ctrl-C
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_term)
        from ..coordinator.foreground import hold  # READY=1, WATCHDOG=1, STOPPING=1 under systemd

        hold(url, settings, end)  # until `end`, SIGTERM or Ctrl-C
        ray_actor.stop_all()
        return EXIT_OK
    finally:
        if follower is not None:
            follower.stop()  # after the actor stopped: its last lines too
        if not args.address:
            ray_actor.shutdown()
