"""/readyz says when an agent is ready, and what it waits for (the agents themselves, started from
one config file on the testbed: tests/root/test_agent_fleet_config.py)."""
from __future__ import annotations

from linkpass.agent.api import readiness_route


class _Progress:
    def __init__(self, stalled):
        self.stalled = stalled

    def stalled_s(self):
        return self.stalled

    def health(self):
        return 503, b"probe thread stalled: no probe sent or received for 4 s while 3 paths are configured\n"


def test_readyz_says_what_the_agent_waits_for():
    assert readiness_route(lambda: None, _Progress(None))() == (200, b"ready\n", "text/plain")
    status, body, _ = readiness_route(lambda: "no peers yet: waiting for the coordinator's probe plan", _Progress(None))()
    assert status == 503 and b"waiting for the coordinator's probe plan" in body
    status, body, _ = readiness_route(lambda: None, _Progress(4.0))()
    assert status == 503 and body.startswith(b"probe thread stalled")
