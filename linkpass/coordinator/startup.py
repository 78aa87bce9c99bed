"""Start a coordinator from its settings, each checked first: store, fabric model, tokens, endpoint. No Ray here:
`ray_actor.py` calls `start(settings)` inside the actor; tests call it directly.

settings (a plain dict, so Ray can pass it to a restarted actor unchanged):
    state_dir        SQLite database and tokens (default /var/lib/linkpass/coordinator)
    listen           "HOST:PORT" (default 127.0.0.1:9470)
    fabric_model     the fabric model itself, as FabricModel.to_dict() (e.g. of a testbed, which its
                     callers resolve: the coordinator does not import the testbed)
    fabric           path of a fabric model JSON (the same document)
    tokens           path of the tokens file (default <state_dir>/tokens.yaml, made on first start)
    agent_secret     path of the agent secret agents' tokens derive from (default <state_dir>/agent.secret)
    max_drain_share  blast-radius guard: share of one tier's links in one plane (default 0.05)
    agent_timeout_s  an agent silent this long is reported lost (default 10)
    agent_expire_s   ... and this long, forgotten as by `linkpass coordinator decommission` (default 86400)
    event_retention_s, event_retention_count   events kept: at most this old, at most this many
                     (default 90 days, 1 000 000)
    max_body_bytes, max_connections, read_timeout_s, idle_timeout_s, workers, max_pending,
    json_max_depth, events_limit_max, refusal_rate_per_s, refusal_burst, refusal_summary_s,
    token_rate_per_s, token_burst, max_queue (a shard's reports held for the root)
                     what one client may cost the endpoint (`http.Limits`, which gives the defaults)
    tls_cert_file, tls_key_file   the endpoint's certificate and key (PEM). Default: the lab CA's
                     in <state_dir>/tls, made on first start (lab_ca.py) with a client
                     certificate `cli` for the local CLI, like the local tokens
    tls_ca_file      the CA that signs client certificates (default: the lab CA's ca.crt)
    tls_san          more names/addresses for the lab CA's coordinator certificate (e.g. the
                     address agents use when listening on 0.0.0.0)
    require_client_cert   mutual TLS: refuse clients without a certificate the CA signed
    insecure_http    serve plain HTTP instead (tokens then cross the network in cleartext; a
                     warning is logged). HTTPS is the default.
    store            keep the state in PostgreSQL, postgresql://USER@HOST[:PORT]/DATABASE (default:
                     SQLite in state_dir); store_password_file: that user's password (one line)
    store_tls_ca_file   the CA that signed the PostgreSQL server's certificate (default: the system's
                     trust store). The store is reached over TLS only, the certificate verified and
                     its name checked against the URL's host; the user authenticates with
                     SCRAM-SHA-256 only
    store_insecure_plaintext   reach the store without TLS instead (its traffic crosses the
                     network unencrypted and the server is not authenticated by a certificate; a
                     warning is logged)
    log_level        debug, info, warning or error: log lines below it are not written (default
                     $LINKPASS_LOG_LEVEL of the process that starts it, or info)
    shards           coordinator shards agents report to (default 1: the coordinator takes them
                     itself). With S > 1 the coordinator started here is the root: it sends every
                     agent to its shard (shard.py) and needs a fabric model (the map is by pod)
    shard_listen     "HOST:PORT" of each shard (default: the root's host, ports listen+1 .. listen+S).
                     Agents are sent to that host, or for a wildcard address (0.0.0.0) to the
                     first tls_san name

Log lines (observe/log.py) go to stderr; inside the Ray actor, to <state_dir>/coordinator.log
(`actor_log`), which `linkpass coordinator` copies to its own stderr.

Every setting is checked before anything starts; an unknown or out-of-range one is refused with
its name.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import time

from ..core.fabric import FabricError, FabricModel
from ..kernel.heap import collector_paused
from ..core.constants import COORDINATOR_LISTEN
from ..observe.log import RANK, LogFile, Logger
from .auth import SECRET_FILE, AuthError, Tokens, ensure_secret, ensure_tokens, read_agent_secret
from ..core.shards import ShardedLocalizer, ShardError, ShardMap
from .http import CoordinatorServer, Limits
from .refusals import Refusals
from .service import CoordinatorService
from .shard import RootLink, Router, ShardFront, ShardLink, ShardParts
from .coordinator import Coordinator, CoordinatorConfig, CoordinatorError
from .store import StoreError, open_store, parse_postgres_url, redacted
from ..control.bodies import is_decimal
from ..control.tls import LOCAL_CLIENT, SERVER, TlsError, lab_dir, lab_paths
from .tls import build_server_context

DEFAULT_STATE_DIR = "/var/lib/linkpass/coordinator"
LOG_FILE = "coordinator.log"  # in the state directory: the actor's log lines (actor_log)


def load_model(settings: dict) -> FabricModel | None:
    if settings.get("fabric_model"):
        try:
            return FabricModel.from_dict(settings["fabric_model"])
        except FabricError as exc:
            raise CoordinatorError(f"fabric_model: {exc}") from None
    if settings.get("fabric"):
        try:
            with open(settings["fabric"]) as f:
                return FabricModel.from_dict(json.load(f))
        except (OSError, ValueError) as exc:
            raise CoordinatorError(f"fabric: cannot load {settings['fabric']} ({exc})") from None
    return None


def parse_listen(text: str, name: str = "listen") -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not is_decimal(port) or not 0 <= int(port) < 65536:
        raise CoordinatorError(f"{name}: expected HOST:PORT such as {COORDINATOR_LISTEN}, got {text!r}")
    return host, int(port)


MAX_SHARDS = 1024


def shard_addresses(settings: dict) -> list[tuple[str, int]]:
    """(host, port) each shard listens on: shard_listen, or the root's host and the ports after its own."""
    shards = settings.get("shards") or 1
    if settings.get("shard_listen"):
        return [parse_listen(x, "shard_listen") for x in settings["shard_listen"]]
    host, port = parse_listen(settings.get("listen") or COORDINATOR_LISTEN)
    if port == 0 or port + shards >= 65536:
        raise CoordinatorError(f"shard_listen: required with listen {host}:{port} (shards take the ports after the "
                               "root's; give each shard's HOST:PORT)")
    return [(host, port + 1 + k) for k in range(shards)]


def router_of(settings: dict, model: FabricModel | None) -> Router | None:
    """The shard map and the shards' URLs, for a sharded coordinator (None with one shard)."""
    shards = settings.get("shards") or 1
    if shards == 1:
        return None
    if model is None:
        raise CoordinatorError("shards: a sharded coordinator needs a fabric model (--fabric or --testbed): its "
                               "shards own pods or leaf groups of it")
    try:
        shard_map = ShardMap(model, shards)
    except ShardError as exc:
        raise CoordinatorError(f"settings.{exc}") from None
    scheme = "http" if settings.get("insecure_http") else "https"
    urls = [f"{scheme}://{_url_host(h, settings)}:{p}" for h, p in shard_addresses(settings)]
    return Router(shard_map, urls)


def _url_host(host: str, settings: dict) -> str:
    """The host agents are sent to for a shard listening on `host`: itself, or for a wildcard
    listener the first tls_san name (the name agents reach the coordinator by, which its
    certificate names), else 127.0.0.1."""
    if host in WILDCARD:
        host = (settings.get("tls_san") or ["127.0.0.1"])[0]
    return f"[{host}]" if ":" in host else host


TLS_SETTINGS = ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_san", "require_client_cert")
WILDCARD = {"", "0.0.0.0", "::", "[::]"}


def tls_files(settings: dict, state_dir: str, host: str) -> tuple[str, str, str | None] | None:
    """(cert, key, CA) the endpoint serves with, or None for plain HTTP; makes the lab CA on first
    start when no certificate is given. Errors name the setting."""
    if settings.get("insecure_http"):
        given = [k for k in TLS_SETTINGS if settings.get(k)]
        if given:
            raise CoordinatorError(f"{given[0]}: not used with insecure_http (plain HTTP); remove one of the two")
        return None
    cert, key, ca = settings.get("tls_cert_file"), settings.get("tls_key_file"), settings.get("tls_ca_file")
    if bool(cert) != bool(key):
        missing, given = ("tls_key_file", "tls_cert_file") if cert else ("tls_cert_file", "tls_key_file")
        raise CoordinatorError(f"{missing}: required with {given} (the endpoint's certificate and its key go together)")
    if not cert:
        from . import lab_ca  # cryptography: only where certificates are made

        directory = lab_dir(state_dir)
        os.makedirs(state_dir, mode=0o700, exist_ok=True)  # as private as the tokens beside it
        try:
            lab_ca.ensure(directory, clients=[LOCAL_CLIENT], sans=[h for h in [host] if h not in WILDCARD]
                          + list(settings.get("tls_san") or ()), where_sans="tls_san")
        except lab_ca.LabCaError as exc:
            raise CoordinatorError(str(exc)) from None
        cert, key = lab_paths(directory, SERVER)
        ca = ca or lab_paths(directory, "ca")[0]
    return cert, key, ca


def server_context(settings: dict, state_dir: str, host: str):
    files = tls_files(settings, state_dir, host)
    if files is None:
        return None
    try:
        return build_server_context(*files, require_client_cert=bool(settings.get("require_client_cert")),
                                    names=("tls_cert_file", "tls_key_file", "tls_ca_file"))
    except TlsError as exc:
        raise CoordinatorError(str(exc)) from None


_PATHS = ("state_dir", "listen", "fabric_model", "fabric", "tokens", "agent_secret", "tls_cert_file", "tls_key_file",
          "tls_ca_file", "store", "store_password_file", "store_tls_ca_file")
# settings that name a file or folder: absolute, since the coordinator runs as a Ray actor, whose
# working directory is Ray's, not the caller's (the CLI makes its arguments absolute)
_FILES = ("state_dir", "fabric", "tokens", "agent_secret", "tls_cert_file", "tls_key_file", "tls_ca_file",
          "store_password_file", "store_tls_ca_file")
_FLAGS = ("require_client_cert", "insecure_http", "store_insecure_plaintext")
# number settings: (the dataclass that owns the default, lowest, highest, integer?)
_NUMBERS = {
    "max_drain_share": (CoordinatorConfig, 0.0, 1.0, False),
    "agent_timeout_s": (CoordinatorConfig, 0.1, 86400.0 * 365, False),
    "agent_expire_s": (CoordinatorConfig, 1.0, 86400.0 * 3650, False),
    "event_retention_s": (CoordinatorConfig, 60.0, 86400.0 * 3650, False),
    "event_retention_count": (CoordinatorConfig, 100, 10**9, True),
    "max_body_bytes": (Limits, 1024, 1 << 30, True),
    "max_connections": (Limits, 16, 1_000_000, True),
    "read_timeout_s": (Limits, 0.1, 3600.0, False),
    "idle_timeout_s": (Limits, 0.1, 86400.0, False),
    "workers": (Limits, 1, 256, True),
    "max_pending": (Limits, 1, 100_000, True),
    "json_max_depth": (Limits, 4, 1000, True),
    "events_limit_max": (Limits, 1, 10**7, True),
    "refusal_rate_per_s": (Limits, 0.01, 1e6, False),
    "refusal_burst": (Limits, 1, 10**6, True),
    "refusal_summary_s": (Limits, 0.1, 86400.0, False),
    "token_rate_per_s": (Limits, 0.01, 1e6, False),
    "token_burst": (Limits, 1, 10**6, True),
    "max_queue": (Limits, 1, 10_000_000, True),
}


def check_settings(settings: dict) -> tuple[CoordinatorConfig, Limits]:
    """The coordinator's and the endpoint's settings, each checked; refusals name the setting."""
    known = _PATHS + _FLAGS + ("tls_san", "log_level", "shards", "shard_listen") + tuple(_NUMBERS)
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise CoordinatorError(f"settings.{unknown[0]}: not a coordinator setting; known: "
                               f"{', '.join(sorted(known))}")
    for name in _FLAGS:
        if settings.get(name) is not None and not isinstance(settings[name], bool):
            raise CoordinatorError(f"settings.{name}: expected true or false, got {settings[name]!r}")
    for name in _FILES:
        value = settings.get(name)
        if value is not None and not (isinstance(value, str) and value.startswith("/")):
            raise CoordinatorError(f"settings.{name}: {value!r} is not an absolute path; the coordinator's actor "
                                   "does not run in the caller's folder (e.g. /var/lib/linkpass/coordinator)")
    level = settings.get("log_level")
    if level is not None and level not in RANK:
        raise CoordinatorError(f"settings.log_level: expected one of {', '.join(RANK)}, got {level!r}")
    if settings.get("store") is not None:
        try:
            parse_postgres_url(settings["store"])  # a bad URL is refused here, before anything starts
        except StoreError as exc:
            raise CoordinatorError(f"settings.{exc}") from None
        if settings.get("store_insecure_plaintext") and settings.get("store_tls_ca_file") is not None:
            raise CoordinatorError("settings.store_tls_ca_file: not used with settings.store_insecure_plaintext (no "
                                   "TLS to verify); remove one of the two")
    else:
        for name in ("store_password_file", "store_tls_ca_file", "store_insecure_plaintext"):
            if settings.get(name) not in (None, False):
                raise CoordinatorError(f"settings.{name}: only with settings.store (a postgresql:// URL); the "
                                       "SQLite store in the state directory has no password and no connection")
    shards = settings.get("shards")
    if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS):
        raise CoordinatorError(f"settings.shards: expected a whole number 1..{MAX_SHARDS}, got {shards!r}")
    listen = settings.get("shard_listen")
    if listen is not None:
        if not (isinstance(listen, (list, tuple)) and all(isinstance(x, str) for x in listen)):
            raise CoordinatorError(f"settings.shard_listen: expected a list of HOST:PORT, one per shard, got {listen!r}")
        if len(listen) != (shards or 1):
            raise CoordinatorError(f"settings.shard_listen: {len(listen)} addresses for {shards or 1} shards; give "
                                   "one per shard, or none (ports after the root's)")
        for x in listen:
            parse_listen(x, "shard_listen")
    san = settings.get("tls_san")
    if san is not None and not (isinstance(san, (list, tuple)) and all(isinstance(x, str) and x for x in san)):
        raise CoordinatorError(f"settings.tls_san: expected a list of host names or addresses, got {san!r}")
    values: dict[type, dict] = {CoordinatorConfig: {}, Limits: {}}
    for name, (owner, lo, hi, integer) in _NUMBERS.items():
        v = settings.get(name)
        if v is None:
            continue
        ok = not isinstance(v, bool) and (isinstance(v, int) if integer else isinstance(v, (int, float)))
        if not ok or not (math.isfinite(v) and lo <= v <= hi):
            raise CoordinatorError(f"settings.{name}: expected {'an integer' if integer else 'a number'} "
                                   f"{lo:g}..{hi:g}, got {v!r}")
        values[owner][name] = v if integer else float(v)
    config, limits = CoordinatorConfig(**values[CoordinatorConfig]), Limits(**values[Limits])
    if config.agent_expire_s <= config.agent_timeout_s:
        raise CoordinatorError(f"settings.agent_expire_s: {config.agent_expire_s:g} s must be longer than "
                               f"agent_timeout_s ({config.agent_timeout_s:g} s): an agent is lost before it expires")
    return config, limits


def _open_files_for(limits: Limits) -> Limits:
    """Raise this process's open-file limit towards what max_connections needs; if the hard limit
    is lower, serve fewer connections rather than fail to accept."""
    need = limits.max_connections + 256  # the database, Ray's sockets, the listener
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
        if soft < need:
            return dataclasses.replace(limits, max_connections=max(16, soft - 256))
    return limits


def log_path(settings: dict) -> str:
    """Where the coordinator actor writes its log lines."""
    return os.path.join(settings.get("state_dir") or DEFAULT_STATE_DIR, LOG_FILE)


def actor_log(settings: dict) -> Logger:
    """The log of the coordinator as a Ray actor: its stderr is one of Ray's worker files, which
    nobody reads, so its lines go to log_path(settings) (bounded; `linkpass coordinator` copies
    them to its own stderr, and so to its journal)."""
    path = log_path(settings)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)  # as private as the tokens beside it
    return Logger("coordinator", stream=LogFile(path), level=settings.get("log_level"))


def log_history(log: Logger, events: list[tuple]) -> None:
    """The committed history events on-call wants in the coordinator's own log (the journal) too,
    one line each: the rare, fleet-level ones. Per-path detections and recoveries stay in the
    store (`linkpass events`)."""
    for ts, kind, actor, subject, detail in events:
        f = {"subject": subject, "actor": actor, "at": round(ts, 6),
             **{k: v for k, v in (detail or {}).items() if k not in ("subject", "actor", "at", "level")}}
        if kind == "localization":
            log("localized", **f)
        elif kind == "cleared":
            log("localization_cleared", **f)
        elif kind == "drain":
            log("link_drained", **f)
        elif kind == "undrain":
            log("link_undrained", **f)
        elif kind == "agent" and f.get("what") == "lost":
            log("agent_changed", level="warning", **f)
        elif kind == "agent":
            log("agent_changed", **f)
        elif kind == "refused":
            log("request_refused", **f)
        elif kind == "coordinator" and subject == "plan" and f.get("what") == "covered":
            log("plan_coverage", level="info", **f)
        elif kind == "coordinator" and subject == "plan":  # links the agents' probe budgets leave short
            log("plan_coverage", **f)


def _credentials(settings: dict, state_dir: str) -> tuple[Tokens, str]:
    """The tokens agents and operators authenticate with, and the file they come from."""
    tokens_path = settings.get("tokens") or ensure_tokens(state_dir)
    secret_path = settings.get("agent_secret") or ensure_secret(os.path.join(state_dir, SECRET_FILE))
    try:
        secret = read_agent_secret(secret_path)
        with open(tokens_path) as f:
            return Tokens.parse(f.read(), tokens_path, agent_secret=secret), tokens_path
    except OSError as exc:
        raise CoordinatorError(f"{exc.filename}: {exc.strerror}") from None
    except AuthError as exc:
        raise CoordinatorError(str(exc)) from None


def _refusals(limits: Limits) -> Refusals:
    return Refusals(limits.refusal_rate_per_s, limits.refusal_burst, limits.refusal_summary_s)


def start_shard(settings: dict, shard: int, root: RootLink, log: Logger | None = None) -> CoordinatorServer:
    """Shard `shard` of a sharded coordinator serving (shard.py), with the root reached by `root`.
    The same settings as the root's: the same tokens, TLS and fabric model."""
    _, limits = check_settings(settings)
    log = log or Logger("coordinator", level=settings.get("log_level"))
    router = router_of(settings, load_model(settings))
    if router is None or not 0 <= shard < router.map.shards:
        raise CoordinatorError(f"shard {shard}: this coordinator has {settings.get('shards') or 1} shard(s)")
    state_dir = settings.get("state_dir") or DEFAULT_STATE_DIR
    host, port = shard_addresses(settings)[shard]
    tls = server_context(settings, state_dir, host)
    tokens, tokens_path = _credentials(settings, state_dir)
    front = ShardFront(router, shard, root, max_queue=limits.max_queue)
    service = CoordinatorService(front, tokens, _refusals(limits), tokens_path=tokens_path, log=log)
    server = CoordinatorServer(service, host, port, limits=_open_files_for(limits), tls=tls)
    log("started", url=server.url, pid=os.getpid(), shard=shard, hosts=len(router.map.hosts_of(shard)),
        tls=tls is not None, client_certs=server.mutual)
    return server


def start(settings: dict, log: Logger | None = None, shards: ShardLink | None = None) -> CoordinatorServer:
    """The coordinator serving, as `settings` say; `log`: where its log lines go (default stderr).
    With `shards` > 1, the root of a sharded coordinator (its shards: start_shard), which
    localizes through its shards, reached by `shards` (without it: with one localizer here)."""
    config, limits = check_settings(settings)
    log = log or Logger("coordinator", level=settings.get("log_level"))
    state_dir = settings.get("state_dir") or DEFAULT_STATE_DIR
    host, port = parse_listen(settings.get("listen") or COORDINATOR_LISTEN)
    tls = server_context(settings, state_dir, host)  # first: a bad TLS setting starts nothing
    tokens, tokens_path = _credentials(settings, state_dir)
    model = load_model(settings)
    router = router_of(settings, model)  # before the store: a bad shard setting opens nothing
    try:
        store = open_store(settings.get("store"), settings.get("store_password_file"), state_dir,
                           on_committed=lambda events: log_history(log, events),
                           tls_ca_file=settings.get("store_tls_ca_file"),
                           insecure_plaintext=bool(settings.get("store_insecure_plaintext")))
    except StoreError as exc:
        raise CoordinatorError(str(exc)) from None
    # the wall clock, as CoordinatorServer passes it to every call; perf_counter times its own work
    localizer = None
    if router is not None and shards is not None:
        localizer = ShardedLocalizer(model, router.map, ShardParts(model, router.map, shards))
    with collector_paused():  # the restored state: the whole fleet's paths at once (kernel/heap.py)
        coordinator = Coordinator(store, model, config, wall_s=time.time(), cost_clock=time.perf_counter, localizer=localizer)
    service = CoordinatorService(coordinator, tokens, _refusals(limits), tokens_path=tokens_path, router=router,
                                 log=log)
    server = CoordinatorServer(service, host, port, limits=_open_files_for(limits), tls=tls)
    log("started", url=server.url, pid=os.getpid(), state_dir=state_dir, store=store.kind, agents=len(coordinator.agents),
        paths=len(coordinator.paths), tls=tls is not None, client_certs=server.mutual,
        **({"shards": router.urls} if router else {}))
    if tls is None:
        log("insecure_http", url=server.url,
            warning="plain HTTP (insecure_http): tokens and reports cross the network in cleartext")
    if store.kind == "postgresql" and settings.get("store_insecure_plaintext"):
        log("store_insecure_plaintext", level="warning", store=redacted(settings["store"]),
            warning="PostgreSQL store without TLS (store_insecure_plaintext): the fleet's state and the "
                    "revocations cross the network unencrypted, and no certificate says which server answers")
    return server
