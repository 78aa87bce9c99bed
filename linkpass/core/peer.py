"""A peer host: its name, agent id, service address and one NIC address per plane; the same
whether the agent's config file or the coordinator's probe plan names it. Pure."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """A peer host, as probes and routes reach it."""

    name: str
    agent_id: int
    service: str
    nics: dict[int, str]  # plane -> address
