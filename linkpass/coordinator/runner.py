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


def start(settings: dict) -> CoordinatorServer:
    state_dir = settings.get("state_dir") or DEFAULT_STATE_DIR
    host, port = parse_listen(settings.get("listen") or COORDINATOR_LISTEN)
    tokens_path = settings.get("tokens") or ensure_tokens(state_dir)
    with open(tokens_path) as f:
        tokens = Tokens.parse(f.read(), tokens_path)
    config = CoordinatorConfig(max_drain_share=float(settings.get("max_drain_share", 0.05)),
                               agent_timeout_s=float(settings.get("agent_timeout_s", 10.0)))
    store = Store(os.path.join(state_dir, "coordinator.db"))
    # the wall clock, as CoordinatorServer passes it to every call; perf_counter times its own work
    coordinator = Coordinator(store, load_model(settings), config, now=time.time(), cost_clock=time.perf_counter)
    return CoordinatorServer(coordinator, tokens, host, port)
