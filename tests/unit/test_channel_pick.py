"""Which port a channel opens its next QP on (pure: no device): the first healthy one in the
offered order, not one that failed lately, not the one in use; when every port failed, still
one (fail static), and a failed port is offered again once its hold has passed."""
from __future__ import annotations

import pytest

from linkpass_rdma import channel
from linkpass.kernel.rdma import RdmaUnavailable


def _channel(ports):
    ch = channel.Channel.__new__(channel.Channel)  # the port choice alone: no QPs, no peer
    ch.ports, ch.bad = (lambda: ports), {}
    return ch


def test_the_first_healthy_port_in_order_is_chosen_and_the_active_one_excluded():
    ch = _channel([49160, 49152, 49153])
    assert ch._pick() == 49160
    assert ch._pick(exclude={49160}) == 49152


def test_a_failed_port_is_avoided_during_its_hold_and_offered_again_after(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(channel.time, "monotonic", lambda: now[0])
    ch = _channel([49160, 49152])
    ch.bad[49160] = now[0] + channel.BAD_HOLD_S
    assert ch._pick() == 49152
    now[0] += channel.BAD_HOLD_S + 0.1
    assert ch._pick() == 49160


def test_with_every_port_failed_one_is_still_chosen_and_with_none_offered_the_error_says_so():
    ch = _channel([49160, 49152])
    ch.bad = {49160: 1e18, 49152: 1e18}
    assert ch._pick(exclude={49160}) == 49152  # fail static: somewhere to go
    with pytest.raises(RdmaUnavailable, match="no healthy source port"):
        _channel([])._pick()


def test_table_ports_follow_the_agents_entropy_table(tmp_path):
    """The ports a channel is offered come from the table the agent writes: a port the agent
    takes out is gone at the next read; a fail-static entry or a missing one gives the fallback."""
    from linkpass.agent.entropy_writer import EntropyWriter
    from linkpass.core.entropy_table import ENTRY_FAIL_STATIC

    path = str(tmp_path / "entropy")
    with EntropyWriter(path, capacity=8) as w:
        w.update("198.18.64.7", 0, (49152, 49153, 49160))
        ports = channel.table_ports("198.18.64.7", 0, path, fallback=(50000,), min_interval_s=0)
        assert ports() == (49152, 49153, 49160)
        w.update("198.18.64.7", 0, (49153, 49160))  # the agent saw 49152's path fail
        assert ports() == (49153, 49160)
        w.update("198.18.64.7", 0, (49152, 49153, 49160), flags=ENTRY_FAIL_STATIC)
        assert ports() == (50000,)
        assert channel.table_ports("198.18.64.9", 0, path, fallback=(50000,), min_interval_s=0)() == (50000,)
        static = channel.table_ports("198.18.64.7", 0, path, min_interval_s=0)
        assert static() == (49152, 49153, 49160)  # no fallback: the fail-static entry's own ports
    missing = channel.table_ports("198.18.64.7", 0, str(tmp_path / "none"), fallback=(50001,), min_interval_s=0)
    assert missing() == (50001,)
