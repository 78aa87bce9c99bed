"""A real coordinator: its tokens, a client over HTTPS that trusts the lab CA it made in its
state dir, its settings for the testbed's agents, waiting for it to answer, and the coordinator
as Ray actors (on SQLite or a real PostgreSQL server)."""
from __future__ import annotations

import contextlib
import json
import os
import time

from linkpass.core.fabric import from_testbed

from support.fleet import MODEL
from support.ports import free_port


def agent_tokens(state_dir, hosts=range(4)) -> dict[str, str]:
    """Each host's own agent token, derived from the coordinator's agent secret in `state_dir`."""
    import os

    from linkpass.coordinator.auth import agent_token, read_agent_secret

    secret = read_agent_secret(os.path.join(str(state_dir), "agent.secret"))
    return {f"h{i}": agent_token(secret, f"h{i}") for i in hosts}


def lab_ca_file(state_dir) -> str:
    """The CA certificate of the lab CA a coordinator made in its state dir on first start."""
    from linkpass.control.tls import lab_dir, lab_paths

    return lab_paths(lab_dir(str(state_dir)), "ca")[0]


def coordinator_on_testbed(fabric, state_dir: str, port: int) -> tuple[dict, dict]:
    """(settings, the agents' `coordinator:` section) of a coordinator for the testbed's agents:
    HTTPS with mutual TLS, the certificate naming the address the namespaced agents use, the
    fabric's model; each agent gets its own token derived from the agent secret."""
    settings = {"state_dir": state_dir, "listen": f"0.0.0.0:{port}", "fabric_model": from_testbed(fabric).to_dict(),
                "tls_san": [fabric.mgmt_root_addr], "require_client_cert": True}
    link = {"url": f"https://{fabric.mgmt_root_addr}:{port}", "report_ms": 100, "summary_s": 5,
            "agent_secret_file": os.path.join(state_dir, "agent.secret")}
    return settings, link


def coordinator_client(url: str, token: str | None, state_dir, client_cert: str | None = None, **kw):
    """A client of the coordinator at `url` that verifies it against its lab CA, as agents and the
    CLI do; `client_cert`: the name of a lab client certificate to show (mutual TLS)."""
    from linkpass.control.client import Client
    from linkpass.control.tls import build_client_context, lab_dir, lab_paths

    cert = lab_paths(lab_dir(str(state_dir)), client_cert) if client_cert else (None, None)
    return Client(url, token, tls=build_client_context(lab_ca_file(state_dir), *cert), **kw)


def role_token(settings, role):
    """The token the coordinator made for `role` (reader, operator) in its state directory."""
    with open(os.path.join(settings["state_dir"], f"{role}.token")) as f:
        return f.read().strip()


def wait_answering(client, timeout_s: float = 60.0) -> dict:
    """The coordinator's status, once its endpoint answers again (after a restart)."""
    from linkpass.control.client import Unreachable

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.get("/v1/status")
        except Unreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def ray_coordinator(directory, store: str, **settings):
    """The coordinator as Ray actors on a local Ray (the root and its shards with `shards`), with
    the helpers' fleet model and the given store ("sqlite", or "postgresql": a real server,
    started and removed here); yields (handle, url, settings). Stopped and Ray shut down after."""
    from linkpass.coordinator import ray_actor
    from support.pgserver import PostgresServer

    (directory / "fabric.json").write_text(json.dumps(MODEL.to_dict()))
    settings = {"state_dir": str(directory / "state"), "listen": f"127.0.0.1:{free_port()}",
                "fabric": str(directory / "fabric.json"), **settings}
    with contextlib.ExitStack() as stack:
        if store == "postgresql":
            pg = stack.enter_context(PostgresServer(tls=True))
            settings.update(pg.settings)
        ray_actor.connect(num_cpus=2)
        try:
            handle, url = ray_actor.ensure(settings)
            yield handle, url, settings
        finally:
            ray_actor.stop_all()
            ray_actor.shutdown()
