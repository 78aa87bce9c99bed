"""Assemble a coordinator from settings: store, fabric model, tokens, endpoint. No Ray here:
`ray_actor.py` calls `start(settings)` inside the actor; tests call it directly.

settings (a plain dict, so Ray can pass it to a restarted actor unchanged):
    state_dir        SQLite database and tokens (default /var/lib/linkpass/coordinator)
    listen           "HOST:PORT" (default 127.0.0.1:9470)
    fabric_model     the fabric model itself, as FabricModel.to_dict() (e.g. of a testbed, which its
                     callers resolve: the coordinator does not import the testbed)
    fabric           path of a fabric model JSON (the same document)
    max_drain_share  blast-radius guard: share of one tier's links in one plane (default 0.05)
    agent_timeout_s  an agent silent this long is reported lost (default 10)
    tls_cert_file, tls_key_file   the endpoint's certificate and key (PEM). Default: the lab CA's
                     in <state_dir>/tls, made on first start (lab_ca.py) with a client
                     certificate `cli` for the local CLI, like the local tokens
    tls_ca_file      the CA that signs client certificates (default: the lab CA's ca.crt)
    tls_san          more names/addresses for the lab CA's coordinator certificate (e.g. the
                     address agents use when listening on 0.0.0.0)
    require_client_cert   mutual TLS: refuse clients without a certificate the CA signed
    insecure_http    serve plain HTTP instead (tokens then cross the network in cleartext; a
                     warning is logged). HTTPS is the default.
"""
from __future__ import annotations

import json
import os
import time

from ..core.fabric import FabricError, FabricModel
from ..core.constants import COORDINATOR_LISTEN
from .auth import Tokens, ensure_tokens
from .http import CoordinatorServer
from .coordinator import Coordinator, CoordinatorConfig, CoordinatorError
from .store import Store
from .tls import LOCAL_CLIENT, SERVER, TlsError, build_server_context, lab_dir, lab_paths

DEFAULT_STATE_DIR = "/var/lib/linkpass/coordinator"


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


def parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise CoordinatorError(f"listen: expected HOST:PORT such as {COORDINATOR_LISTEN}, got {text!r}")
    return host, int(port)


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


def start(settings: dict) -> CoordinatorServer:
    state_dir = settings.get("state_dir") or DEFAULT_STATE_DIR
    host, port = parse_listen(settings.get("listen") or COORDINATOR_LISTEN)
    tls = server_context(settings, state_dir, host)  # first: a bad TLS setting starts nothing
    tokens_path = settings.get("tokens") or ensure_tokens(state_dir)
    with open(tokens_path) as f:
        tokens = Tokens.parse(f.read(), tokens_path)
    config = CoordinatorConfig(max_drain_share=float(settings.get("max_drain_share", 0.05)),
                               agent_timeout_s=float(settings.get("agent_timeout_s", 10.0)))
    store = Store(os.path.join(state_dir, "coordinator.db"))
    # the wall clock, as CoordinatorServer passes it to every call; perf_counter times its own work
    coordinator = Coordinator(store, load_model(settings), config, now=time.time(), cost_clock=time.perf_counter)
    server = CoordinatorServer(coordinator, tokens, host, port, tls=tls)
    if tls is None:
        server.log("insecure_http", url=server.url,
                   warning="plain HTTP (insecure_http): tokens and reports cross the network in cleartext")
    return server
