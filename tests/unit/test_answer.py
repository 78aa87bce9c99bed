"""The coordinator's answer as the agent takes it: checked whole, refused with the field named,
and a refused answer applies nothing and never stops the agent's coordinator thread."""
from __future__ import annotations

import copy

import pytest

from linkpass.control.answers import AnswerError, AnswerRules, Drain, parse_answer
from linkpass.agent.config import CoordinatorLinkConfig, Peer


H1 = Peer("h1", 2, "198.18.0.2", {0: "198.18.64.3", 1: "198.18.72.3"})
RULES = AnswerRules("h0", 1, 4, frozenset({"198.18.0.1", "198.18.64.1", "198.18.72.1"}), {"h1": H1})


def plan_peer(name="h2", agent_id=3, service="198.18.0.3", nics=None):
    return {"name": name, "agent_id": agent_id, "service": service,
            "nics": nics if nics is not None else {"0": "198.18.64.5", "1": "198.18.72.5"}}


GOOD = {"drain_version": 4, "plan_version": 2,
        "drains": [{"link": "p0l0-p0s1", "addrs": ["198.18.128.0", "198.18.128.1"]}],
        "plan": {"version": 2, "peers": [plan_peer(), {"name": "h1", "agent_id": 2, "service": "198.18.0.2",
                                                        "nics": {"0": "198.18.64.3", "1": "198.18.72.3"}},
                                         plan_peer("h0", 1, "198.18.0.1", {"0": "198.18.64.1"})]}}


def test_a_good_answer_comes_back_typed():
    got = parse_answer(GOOD, RULES)
    assert (got.drain_version, got.plan_version) == (4, 2)
    assert got.drains == (Drain("p0l0-p0s1", ("198.18.128.0", "198.18.128.1")),)
    # this host's own entry is dropped; a config peer named identically is accepted
    assert [p.name for p in got.plan.peers] == ["h2", "h1"]
    assert got.plan.peers[0] == Peer("h2", 3, "198.18.0.3", {0: "198.18.64.5", 1: "198.18.72.5"})
    bare = parse_answer({"drain_version": None, "plan_version": None, "plan": None}, RULES)
    assert bare.drains is None and bare.plan is None


def edit(fn):
    doc = copy.deepcopy(GOOD)
    fn(doc)
    return doc


BAD = [
    (["x"], "answer: expected a JSON object, got list"),
    (None, "answer: expected a JSON object, got null"),
    (edit(lambda d: d.update(drains=["x"])), "drains[0]: expected an object, got str"),
    (edit(lambda d: d.update(drains=[{"link": "l", "addrs": None}])), "drains[0].addrs: expected a list, got null"),
    (edit(lambda d: d.update(drains=[{"addrs": []}])), "drains[0].link: required field is missing"),
    (edit(lambda d: d.update(drains={"link": "l"})), "drains: expected a list, got dict"),
    (edit(lambda d: d["drains"][0]["addrs"].append("leaf1.example.com")),
     "drains[0].addrs[2]: 'leaf1.example.com' is not an IP address"),
    (edit(lambda d: d["drains"][0].update(addrs=["198.18.0.1"] * 9)), "drains[0].addrs: 9 entries, more than the 8"),
    (edit(lambda d: d.update(drain_version="7")), "drain_version: expected an integer >= 0 or null"),
    (edit(lambda d: d.update(plan_version=True)), "plan_version: expected an integer >= 0 or null"),
    (edit(lambda d: d.update(extra=1)), "answer.extra: unknown field"),
    (edit(lambda d: d.update(plan=["h2"])), "plan: expected an object, got list"),
    (edit(lambda d: d.update(plan={"version": 2})), "plan.peers: required field is missing"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(service="h2.example.com"))),
     "plan.peers[0].service: 'h2.example.com' is not an IP address (host names are not accepted)"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(nics={"0": "localhost"}))),
     "plan.peers[0].nics.0: 'localhost' is not an IP address"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(nics={"0": "224.0.0.1"}))),
     "plan.peers[0].nics.0: 224.0.0.1 is not a unicast address"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(nics={"0": "198.18.64.1"}))),
     "plan.peers[0].nics.0: 198.18.64.1 is an address of this host"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(nics={"64": "198.18.64.5"}))),
     "plan.peers[0].nics key: expected a plane 0..63, got 64"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(nics=None) | {"nics": []})),
     "plan.peers[0].nics: expected an object plane -> address"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(agent_id=0))),
     "plan.peers[0].agent_id: expected an integer 1..4294967295, got 0"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(agent_id=1))),
     "plan.peers[0].agent_id: 1 is this agent's own id"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer(name="x" * 256))),
     "plan.peers[0].name: expected a printable name of 1..255 characters"),
    (edit(lambda d: d["plan"]["peers"].append(plan_peer())), "plan.peers[3].name: 'h2' is listed twice"),
    (edit(lambda d: d["plan"]["peers"].append(plan_peer("h9", 3, "198.18.0.9", {"0": "198.18.64.9"}))),
     "plan.peers[3].agent_id: 3 is used by 'h2' too"),
    # a plan cannot redefine a peer of the config file: not its addresses, not its id
    (edit(lambda d: d["plan"]["peers"][1]["nics"].update({"0": "198.18.99.9"})),
     "plan.peers[1]: peer 'h1' (agent 2) differs from the config file's peer 'h1'"),
    (edit(lambda d: d["plan"]["peers"][1].update(agent_id=7)), "plan.peers[1]: peer 'h1' (agent 7) differs"),
    (edit(lambda d: d["plan"]["peers"].__setitem__(0, plan_peer("impostor", 2, "198.18.0.9"))),
     "plan.peers[0]: peer 'impostor' (agent 2) differs from the config file's peer 'h1'"),
    # sizes: more peers than the configured maximum (4 here)
    (edit(lambda d: d["plan"]["peers"].extend(plan_peer(f"h{k}", k + 1, f"198.18.0.{k + 1}", {"0": f"198.18.64.{k * 2 + 1}"})
                                               for k in range(3, 5))),
     "plan.peers: 5 entries, more than the 4 allowed"),
    (edit(lambda d: d.update(send_paths="yes")), "send_paths: expected true or false, got str"),
    (edit(lambda d: d.update(digests=1)), "digests: expected true or false, got int"),
]


def test_the_digest_flags_come_back_typed_and_default_to_off():
    base = {"drain_version": 1, "plan_version": None}
    assert (parse_answer(base, RULES).digests, parse_answer(base, RULES).send_paths) == (False, False)
    got = parse_answer({**base, "digests": True, "send_paths": True}, RULES)
    assert (got.digests, got.send_paths) == (True, True)


@pytest.mark.parametrize("raw, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_a_bad_answer_is_refused_naming_what_is_wrong(raw, message):
    with pytest.raises(AnswerError) as err:
        parse_answer(raw, RULES)
    assert str(err.value).startswith(message), str(err.value)


def test_the_peer_cap_comes_from_the_config_with_a_default():
    assert CoordinatorLinkConfig("http://x:1", "t").max_plan_peers == 1024
    many = {"plan": {"peers": [plan_peer(f"p{k}", k + 10, f"198.18.1.{k}", {"0": f"198.18.65.{k}"})
                               for k in range(5)]}}
    assert len(parse_answer(many, AnswerRules("h0", 1, 5)).plan.peers) == 5
    with pytest.raises(AnswerError, match="more than the 4 allowed"):
        parse_answer(many, AnswerRules("h0", 1, 4))


def link_under_test(tmp_path):
    from linkpass.agent import coordinator_link as CL

    token = tmp_path / "token"
    token.write_text("t0ken\n")
    logs, drains, plans = [], [], []
    link = CL.CoordinatorLink(CoordinatorLinkConfig("http://127.0.0.1:9", str(token), insecure_http=True), lambda: {"name": "h0"}, list,
                              drains.append, plans.append, lambda ev, **f: logs.append((ev, f)), rules=RULES)
    return link, logs, drains, plans


def test_a_refused_answer_applies_nothing_keeps_the_versions_and_is_logged_once(tmp_path):
    link, logs, drains, plans = link_under_test(tmp_path)
    link._answer(GOOD)
    assert drains == [GOOD_DRAINS] and [p.version for p in plans] == [2]
    assert (link.drain_version, link.plan_version) == (4, 2)
    bad = edit(lambda d: d.update(drain_version=5, plan_version=3, drains=[{"link": "l", "addrs": None}]))
    for _ in range(3):
        link._answer(bad)  # every report brings the same bad answer back
    link._answer(["x"])
    assert len(drains) == 1 and len(plans) == 1  # nothing of it reached the main loop
    assert (link.drain_version, link.plan_version) == (4, 2)  # so the coordinator sends it again
    assert link.stats["answers_rejected"] == 4
    rejected = [f["error"] for ev, f in logs if ev == "coordinator_answer_rejected"]
    assert rejected == ["drains[0].addrs: expected a list, got null", "answer: expected a JSON object, got list"]


GOOD_DRAINS = (Drain("p0l0-p0s1", ("198.18.128.0", "198.18.128.1")),)


def delta_answer(peers, remove=(), since=2, version=3, **more):
    return {"drain_version": 5, "plan_version": version,
            "drains": [{"link": "p1l0-p1s0", "addrs": ["198.18.129.0"]}],
            "plan_delta": {"from": since, "version": version, "peers": peers, "remove": list(remove)}, **more}


@pytest.mark.parametrize("answer,message", [
    (delta_answer([plan_peer("h3", 4, "h3.example.com")]), "plan_delta.peers[0].service: 'h3.example.com' is not"),
    (delta_answer([plan_peer("h3", 3, "198.18.0.4", {"0": "198.18.64.7"})]),
     "plan_delta.peers[0].agent_id: 3 is used by 'h2' too"),  # h2, held, has id 3
    (delta_answer([plan_peer(f"p{k}", k + 10, f"198.18.1.{k}", {"0": f"198.18.65.{k}"}) for k in range(3)]),
     "plan_delta: the plan it makes names 5 peers, more than the 4 allowed"),
    (delta_answer([plan_peer("h1", 2, "198.18.0.9")]), "plan_delta.peers[0]: peer 'h1' (agent 2) differs"),
    (delta_answer([], remove=[7]), "plan_delta.remove[0]: expected a printable name"),
    (dict(delta_answer([]), plan_version=4), "plan_delta.version: 3 is not the answer's plan_version 4"),
    (dict(delta_answer([]), plan=GOOD["plan"]), "plan_delta: given together with plan"),
])
def test_a_plan_delta_is_checked_whole_with_the_plan_it_makes_before_anything_applies(tmp_path, answer, message):
    link, logs, drains, plans = link_under_test(tmp_path)
    link._answer(GOOD)  # holds plan 2: h2, h1
    link._answer(answer)
    assert len(drains) == 1 and len(plans) == 1  # neither its drains nor its plan reached the main loop
    assert link.drain_version == 4 and link.stats["answers_rejected"] == 1
    assert link.plan_version is None  # the same delta would come again: the whole plan is asked for
    rejected = [f["error"] for ev, f in logs if ev == "coordinator_answer_rejected"]
    assert len(rejected) == 1 and rejected[0].startswith(message), rejected


def test_a_good_delta_makes_a_whole_plan_and_a_stale_one_asks_for_it(tmp_path):
    link, logs, drains, plans = link_under_test(tmp_path)
    link._answer(GOOD)
    link._answer(delta_answer([plan_peer("h3", 4, "198.18.0.4", {"0": "198.18.64.7"})], remove=["h2", "h9"]))
    assert [p.name for p in plans[-1].peers] == ["h1", "h3"] and plans[-1].version == 3
    assert link.plan_version == 3 and link.drain_version == 5 and len(drains) == 2
    # from a version the agent does not hold: its drains apply, its plan does not, the whole plan is asked for
    link._answer(delta_answer([], remove=["h1"], since=1, version=4, drain_version=6))
    assert len(plans) == 2 and link.plan_version is None and link.drain_version == 6
    assert link.stats["plan_deltas_dropped"] == 1 and link.stats["answers_rejected"] == 0


def _one_answer_server(answer: bytes):
    """A loopback listener that answers one request with `answer` (raw HTTP) and closes."""
    import socket
    import threading
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(answer)
            except OSError:  # the client stopped reading, as it should
                pass
        srv.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


@pytest.mark.parametrize("head, body", [
    (b"Content-Length: 999999999999\r\n", b"{}"),                     # announced too large: not even read
    (b"", b"[" + b"0," * 600_000 + b"0]"),                             # no length, streamed until close
    (b"Transfer-Encoding: chunked\r\n", b"100010\r\n" + b" " * 0x100010 + b"\r\n0\r\n\r\n"),
])
def test_an_oversized_answer_is_dropped_unread(head, body):
    from linkpass.control.client import AnswerTooLarge, Client
    port = _one_answer_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + head + b"\r\n" + body)
    c = Client(f"http://127.0.0.1:{port}", "t", insecure_http=True, max_answer_bytes=1 << 20)
    with pytest.raises(AnswerTooLarge, match="hostile server"):
        c.get("/v1/plan", host="h0")
    assert c._conn is None  # the connection with a half-read answer is not reused
