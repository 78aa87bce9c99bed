"""The route actuator's pure parts: the desired route never removes the last plane, a route
message decodes as the route meant, the journal's malformed lines, config errors."""
from __future__ import annotations

import pytest

from linkpass.agent.routes import RTPROT_LINKPASS, PeerRoutes, RouteActuator, RouteChoice, desired_route


def test_desired_route_never_removes_the_last_plane():
    peer = PeerRoutes("h1", "198.18.0.2", {0: ("198.18.64.0", "p0"), 1: ("198.18.72.0", "p1")})
    assert desired_route(peer, {1}, (0, 1)) == RouteChoice("h1", (1,))
    kept = desired_route(peer, set(), (1,))
    assert kept.planes == (1,) and kept.refused == (1,) and "fail static" in kept.reason
    assert desired_route(peer, {5}, (0, 1)).planes == (0, 1)  # an unknown plane is not usable


@pytest.mark.parametrize("hops", [[("198.18.64.0", 7)], [("198.18.64.0", 7), ("198.18.72.0", 9)]])
def test_our_route_message_decodes_as_the_route_we_meant(hops):
    """The hand-packed RTM_NEWROUTE, read back by pyroute2's own rtnetlink parser."""
    from pyroute2.netlink.rtnl.rtmsg import rtmsg

    from linkpass.agent.netlink import NLM_F_REPLACE, RTM_NEWROUTE, route_replace_message

    raw = route_replace_message(42, "198.18.0.3", "198.18.0.1", hops, RTPROT_LINKPASS, 10)
    msg = rtmsg(raw)
    msg.decode()
    assert msg["header"]["type"] == RTM_NEWROUTE and msg["header"]["flags"] & NLM_F_REPLACE
    assert msg["header"]["length"] == len(raw) and msg["header"]["sequence_number"] == 42
    assert (msg["dst_len"], msg["proto"], msg["table"]) == (32, RTPROT_LINKPASS, 254)
    assert msg.get_attr("RTA_DST") == "198.18.0.3" and msg.get_attr("RTA_PREFSRC") == "198.18.0.1"
    assert msg.get_attr("RTA_METRICS").get_attr("RTAX_RTO_MIN") == 10
    if len(hops) == 1:
        assert (msg.get_attr("RTA_GATEWAY"), msg.get_attr("RTA_OIF")) == hops[0]
    else:
        got = [(nh.get_attr("RTA_GATEWAY"), nh["oif"]) for nh in msg.get_attr("RTA_MULTIPATH")]
        assert got == hops
    with pytest.raises(ValueError):
        route_replace_message(1, "198.18.0.3", "198.18.0.1", [], RTPROT_LINKPASS, 10)


@pytest.mark.parametrize("line, why", [
    ('{"peer": "h1", "planes": [1]}', None),
    ('{"peer": "h1", "pla', "not JSON"),
    ('[]', "expected an object, got list"),
    ('5', "expected an object, got int"),
    ('{"planes": [0]}', "peer: expected a name"),
    ('{"peer": ["h1"], "planes": [0]}', "peer: expected a name"),
    ('{"peer": "h1", "planes": 5}', "planes: expected a list of planes 0..63"),
    ('{"peer": "h1", "planes": null}', "planes: expected a list"),
    ('{"peer": "h1", "planes": ["0"]}', "planes: expected a list"),
    ('{"peer": "h1", "planes": [true]}', "planes: expected a list"),
    ('{"peer": "h1", "planes": [64]}', "planes: expected a list"),
])
def test_journal_lines_of_the_wrong_shape_are_not_records(line, why):
    from linkpass.agent.routes import journal_record

    got = journal_record(line)
    if why is None:
        assert got == ("h1", (1,))
    else:
        assert isinstance(got, str) and got.startswith(why), got


def test_reconcile_skips_malformed_journal_lines_and_logs_them(tmp_path):
    journal = tmp_path / "journal"
    journal.write_text('{"peer": "h1", "planes": [1]}\n[]\n{"peer": "h2", "planes": 5}\n{"peer": ["h3"]}\n'
                       '{"peer": "h2", "planes": [0]}\n{"peer": "h3", "pla')
    hops = {0: ("198.18.64.0", "p0"), 1: ("198.18.72.0", "p1")}
    peers = {n: PeerRoutes(n, f"198.18.0.{k}", hops) for k, n in enumerate(("h1", "h2", "h3"), 2)}
    logs = []
    act = RouteActuator(None, "198.18.0.1", peers, str(journal), dry_run=True,
                        log=lambda ev, **f: logs.append((ev, f)))
    assert act.reconcile() == {"h1": (1,), "h2": (0,), "h3": (0, 1)}  # h3: no good line, the baseline
    (ev, fields), = logs
    assert ev == "route_journal_lines_skipped" and fields["count"] == 4
    assert fields["first"][0] == "line 2: expected an object, got list" and fields["first"][3].startswith("line 6: not JSON")


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="rto_min_ms: 0 is out of range"):
        RouteActuator(None, "198.18.0.1", {}, str(tmp_path / "j"), rto_min_ms=0)
