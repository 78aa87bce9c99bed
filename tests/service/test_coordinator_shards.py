"""A sharded coordinator's real endpoints in one process (HTTPS, the lab CA, SQLite), without
Ray: the root sends agents to their shards, shards answer what brings nothing new and forward
the rest, the root learns who is alive, a restarted shard asks for tables again, the root away,
a real agent link following its redirect."""
from __future__ import annotations

import json
import threading
import time

import pytest

from linkpass.control.answers import AnswerRules
from linkpass.agent.config import CoordinatorLinkConfig
from linkpass.agent.coordinator_link import CoordinatorLink
from linkpass.coordinator import startup
from linkpass.control.client import Moved, Refusal
from linkpass.control.errors import CoordinatorError
from linkpass.coordinator.shard import LocalRoot, LocalShards
from linkpass.core.report_digest import table_digest
from linkpass.testbed.prometheus import promtool

from prometheus_client.parser import text_string_to_metric_families

from support.coordinator import agent_tokens, coordinator_client, lab_ca_file, role_token
from support.fleet import MODEL, identity, table_of
from support.ports import free_port
from support.waiting import wait_until


def settings_of(tmp_path, **more):
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(MODEL.to_dict()))
    return {"state_dir": str(tmp_path / "state"), "listen": f"127.0.0.1:{free_port()}", "fabric": str(fabric),
            "shards": 2, "shard_listen": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], **more}


class Sharded:
    """A root and its shards, in this process."""

    def __init__(self, settings):
        self.settings = settings
        self.shards = []  # the root reaches their parts of localization through this same list
        self.root = startup.start(settings, shards=LocalShards(self.shards))
        self.link = LocalRoot(self.root)
        self.shards.extend(startup.start_shard(settings, k, self.link) for k in range(2))
        self.tokens = agent_tokens(settings["state_dir"])

    def client(self, url, host):
        return coordinator_client(url, self.tokens[host], self.settings["state_dir"])

    def restart_shard(self, k):
        self.shards[k].close()
        self.shards[k] = startup.start_shard(self.settings, k, self.link)

    def close(self):
        for s in self.shards:
            s.close()
        self.root.close()
        self.root.service.coordinator.store.close()


@pytest.fixture
def sharded(tmp_path):
    s = Sharded(settings_of(tmp_path))
    try:
        yield s
    finally:
        s.close()


def owner(s, host):
    return s.root.service.router.owner(host)


def register_all(s):
    answers = {}
    for i in range(4):
        h = f"h{i}"
        with s.client(s.shards[owner(s, h)].url, h) as c:
            answers[h] = c.post("/v1/register", {**identity(i), "paths": table_of(i), "digests": True,
                                                 "plan_deltas": True})
    return answers


def test_the_root_sends_each_agent_to_its_shard(sharded):
    s = sharded
    assert [owner(s, f"h{i}") for i in range(4)] == [0, 0, 1, 1]  # one leaf each
    for i in range(4):
        with s.client(s.root.url, f"h{i}") as c, pytest.raises(Moved) as exc:
            c.post("/v1/register", {**identity(i), "paths": table_of(i)})
        assert exc.value.status == 307 and exc.value.url == s.shards[owner(s, f"h{i}")].url
    with s.client(s.shards[0].url, "h2") as c, pytest.raises(Moved) as exc:  # the wrong shard, too
        c.post("/v1/report", {"name": "h2"})
    assert exc.value.url == s.shards[1].url
    assert s.root.service.coordinator.agents == {}  # nothing was registered on the way


def test_agents_registered_at_their_shards_are_the_roots_fleet(sharded):
    s = sharded
    answers = register_all(s)
    assert sorted(s.root.service.coordinator.agents) == ["h0", "h1", "h2", "h3"]
    assert len(s.root.service.coordinator.paths) == sum(len(table_of(i)) for i in range(4))
    time.sleep(1.1)  # the plan is revised at most once a second
    with s.client(s.shards[0].url, "h0") as c:
        answer = c.post("/v1/report", {"name": "h0", "drain_version": answers["h0"]["drain_version"],
                                       "plan_version": None, "digests": True})
    peers = {p["name"] for p in answer["plan"]["peers"]}
    assert {"h2", "h3"} & peers  # its plan names hosts of the other shard: the root plans the fleet


def test_a_shard_answers_heartbeats_itself_and_the_root_hears_of_them(sharded):
    s = sharded
    answers = register_all(s)
    root_reports = s.root.requests
    with s.client(s.shards[0].url, "h0") as c:
        beat = {"name": "h0", "drain_version": answers["h0"]["drain_version"],
                "plan_version": answers["h0"]["plan_version"], "digests": True}
        wait_until(lambda: s.shards[0].service.coordinator.versions is not None, 5, "the shard learns the root's versions")
        beat["plan_version"] = s.shards[0].service.coordinator.versions[0]
        with s.root.service.lock:
            s.root.service.coordinator.agents["h0"].last_seen = before = time.time() - 5
        for _ in range(5):
            assert c.post("/v1/report", beat) == {"drain_version": beat["drain_version"],
                                                  "plan_version": beat["plan_version"], "digests": True}
        digest = table_digest((r["id"], r["state"], r["reason"]) for r in table_of(0))
        assert "send_paths" not in c.post("/v1/report", {**beat, "digest": digest})
    assert s.shards[0].service.coordinator.counters["answered"] == 6
    assert s.root.requests == root_reports  # none of them reached the root's endpoint
    wait_until(lambda: s.root.service.coordinator.agents["h0"].last_seen > before + 4, 5, "the root hears h0 is alive")


def current(s, k, answers, host):
    """A report's versions as the agent holds them once its shard knows the root's."""
    wait_until(lambda: s.shards[k].service.coordinator.versions is not None, 5, "the shard learns the root's versions")
    return {"drain_version": answers[host]["drain_version"], "plan_version": s.shards[k].service.coordinator.versions[0],
            "digests": True}


def test_changes_are_queued_for_the_root_and_the_rest_forwarded_at_once(sharded):
    s = sharded
    answers = register_all(s)
    v = current(s, 1, answers, "h2")
    with s.client(s.shards[1].url, "h2") as c:
        answer = c.post("/v1/report", {"name": "h2", **v, "changes": [{"id": 1, "state": "down",
                                                                         "reason": "hard_failure"}]})
        assert answer == {"drain_version": v["drain_version"], "plan_version": v["plan_version"], "digests": True}
        wait_until(lambda: s.root.service.coordinator.paths["h2/1"].state == "down", 5, "the queued change reaches the root")
        assert s.shards[1].service.coordinator.counters["queued"] == 1
        assert s.shards[1].service.coordinator.counters.get("forwarded", 0) == 0
        # a digest that differs from the shard's copy (it says h2/1 is up): the root is asked at once
        stale = table_digest((r["id"], r["state"], r["reason"]) for r in table_of(2))
        answer = c.post("/v1/report", {"name": "h2", **v, "digest": stale})
    assert answer.get("send_paths") is True  # the root holds h2/1 down too: it asks for the table
    assert s.shards[1].service.coordinator.counters["forwarded"] == 1


def test_a_full_queue_is_503_and_nothing_of_the_report_is_kept(tmp_path):
    s = Sharded(settings_of(tmp_path, max_queue=2))
    try:
        answers = register_all(s)
        v = current(s, 0, answers, "h0")
        s.link.server = None  # the root away: the queue fills
        with s.client(s.shards[0].url, "h0") as c:
            for pid in (1, 2):
                c.post("/v1/report", {"name": "h0", **v, "changes": [{"id": pid, "state": "down",
                                                                        "reason": "hard_failure"}]})
            with pytest.raises(Refusal) as exc:
                c.post("/v1/report", {"name": "h0", **v, "changes": [{"id": 3, "state": "down",
                                                                        "reason": "hard_failure"}]})
            assert exc.value.status == 503 and "max_queue" in str(exc.value)
            assert s.shards[0].service.coordinator.tables["h0"][3] == ("up", None)  # the refused change is not held
            s.link.server = s.root  # back: the queue drains in order, and takes the resent change
            wait_until(lambda: not s.shards[0].service.coordinator.queue, 5, "the queue drains")
            c.post("/v1/report", {"name": "h0", **v, "changes": [{"id": 3, "state": "down", "reason": "hard_failure"}]})
        wait_until(lambda: all(s.root.service.coordinator.paths[f"h0/{p}"].state == "down" for p in (1, 2, 3)), 5,
                   "every change at the root")
    finally:
        s.close()


def test_a_restarted_shard_asks_each_agent_for_its_table_once(sharded):
    s = sharded
    answers = register_all(s)
    s.restart_shard(0)
    with s.client(s.shards[0].url, "h1") as c:
        beat = {"name": "h1", "drain_version": answers["h1"]["drain_version"], "digests": True}
        assert c.post("/v1/report", beat).get("send_paths") is True
        c.post("/v1/report", {**beat, "paths": table_of(1)})
        wait_until(lambda: s.shards[0].service.coordinator.versions is not None, 5, "the shard learns the root's versions")
        assert "send_paths" not in c.post("/v1/report", {**beat, "plan_version": s.shards[0].service.coordinator.versions[0]})
    assert s.shards[0].service.coordinator.counters["answered"] == 1


def test_with_the_root_away_heartbeats_and_changes_are_answered_and_the_rest_is_503(sharded):
    s = sharded
    answers = register_all(s)
    beat = {"name": "h0", **current(s, 0, answers, "h0")}
    s.link.server = None  # the root is away
    with s.client(s.shards[0].url, "h0") as c:
        assert c.post("/v1/report", beat)["drain_version"] == beat["drain_version"]
        c.post("/v1/report", {**beat, "changes": [{"id": 1, "state": "down", "reason": "hard_failure"}]})  # queued
        with pytest.raises(Refusal) as exc:  # a whole table needs the root's answer, after the queued change
            c.post("/v1/report", {**beat, "paths": table_of(0)})
        assert exc.value.status == 503 and "cannot reach the root" in str(exc.value)
        with s.client(s.shards[0].url, "h1") as c1, pytest.raises(Refusal) as exc:
            c1.post("/v1/report", {"name": "h1", **current(s, 0, answers, "h1"), "paths": table_of(1)})
        assert exc.value.status == 503 and "cannot reach the root" in str(exc.value)
    wait_until(lambda: s.shards[0].service.coordinator.counters["root_unreachable"] >= 2, 5, "the failed calls are counted")
    assert s.root.service.coordinator.paths["h0/1"].state == "up"
    s.link.server = s.root
    wait_until(lambda: s.root.service.coordinator.paths["h0/1"].state == "down", 5, "the queued change arrives")


def test_a_registration_does_not_overtake_the_agents_queued_changes(sharded):
    # an agent restarted while its shard still held its changes for the root: the registration
    # (a whole new table) must reach the root after them, or their stale states would win
    s = sharded
    answers = register_all(s)
    v = current(s, 0, answers, "h0")
    s.link.server = None
    with s.client(s.shards[0].url, "h0") as c:
        c.post("/v1/report", {"name": "h0", **v, "changes": [{"id": 1, "state": "down", "reason": "hard_failure"}]})
        with pytest.raises(Refusal) as exc:
            c.post("/v1/register", {**identity(0), "paths": table_of(0)})
        assert exc.value.status == 503 and "earlier reports" in str(exc.value)
        s.link.server = s.root
        wait_until(lambda: not s.shards[0].service.coordinator.queue, 5, "the queue drains")
        c.post("/v1/register", {**identity(0), "paths": table_of(0)})
    assert s.root.service.coordinator.paths["h0/1"].state == "up"  # the registration's table, applied last


def test_a_shard_serves_agents_only(sharded):
    s = sharded
    with coordinator_client(s.shards[0].url, None, s.settings["state_dir"]) as c:
        with pytest.raises(Refusal) as exc:
            c.get("/v1/status")
        assert exc.value.status == 421 and "is the root's" in str(exc.value)
        assert c.get("/v1/healthz") == {"ok": True}


def test_status_shows_the_shards_and_one_that_is_away(sharded):
    from linkpass.cli.fleet import render_status

    s = sharded
    register_all(s)
    op = coordinator_client(s.root.url, role_token(s.settings, "reader"), s.settings["state_dir"])
    with op:
        wait_until(lambda: not any(x["away"] for x in op.get("/v1/status")["shards"]), 5, "both shards heard from")
        doc = op.get("/v1/status")
        assert [(x["shard"], x["url"], x["hosts"]) for x in doc["shards"]] == \
            [(0, s.shards[0].url, 2), (1, s.shards[1].url, 2)]
        assert doc["health"] == "ok" and "coordinator shards: 2, all answering" in render_status(doc, time.time())
        s.shards[1].close()
        wait_until(lambda: op.get("/v1/status")["shards"][1]["away"], 10, "shard 1 counted away")
        doc = op.get("/v1/status")
    assert doc["health"] == "warning"
    text = render_status(doc, time.time())
    assert f"shard 1 ({s.shards[1].url}, 2 hosts) is away: not heard from for" in text


def test_a_shards_metrics_say_what_it_did_with_reports(sharded):
    s = sharded
    answers = register_all(s)
    wait_until(lambda: s.shards[0].service.coordinator.versions is not None, 5, "the shard learns the root's versions")
    with s.client(s.shards[0].url, "h0") as c:
        c.post("/v1/report", {"name": "h0", "drain_version": answers["h0"]["drain_version"],
                              "plan_version": s.shards[0].service.coordinator.versions[0]})
    with s.client(s.shards[0].url, "h3") as c, pytest.raises(Moved):
        c.post("/v1/report", {"name": "h3"})
    got = scrape(s, s.shards[0].url)
    assert got[("linkpass_coordinator_shard_agents", (("shard", "0"),))] == 2
    assert got[("linkpass_coordinator_shard_reports_total", (("outcome", "answered"), ("shard", "0")))] == 1
    assert got[("linkpass_coordinator_shard_reports_total", (("outcome", "registrations"), ("shard", "0")))] == 2
    assert got[("linkpass_coordinator_shard_reports_total", (("outcome", "redirected"), ("shard", "0")))] == 1
    assert ("linkpass_coordinator_requests_total", ()) in got  # the endpoint's own families too


def test_an_agent_given_the_roots_address_finds_its_shard(sharded, tmp_path):
    s = sharded
    token = tmp_path / "h3.token"
    token.write_text(s.tokens["h3"])
    logged = []
    cfg = CoordinatorLinkConfig(s.root.url, str(token), report_ms=50, ca_file=lab_ca_file(s.settings["state_dir"]))
    link = CoordinatorLink(cfg, lambda: identity(3), lambda: table_of(3), lambda d: None, lambda p: None,
                           lambda event, **f: logged.append((event, f)), rules=AnswerRules("h3", 4, 1024))
    link.start()
    try:
        wait_until(lambda: "h3" in s.root.service.coordinator.agents, 10, "h3 registered through its shard")
        assert link.url == s.shards[1].url
        assert ("coordinator_moved", {"url": s.shards[1].url, "was": s.root.url}) in logged
        wait_until(lambda: s.shards[1].service.coordinator.counters["answered"] > 0, 10, "its heartbeats answered by the shard")
    finally:
        link.stop()


def test_a_shard_that_stays_away_sends_the_agent_back_to_the_root(sharded, tmp_path):
    s = sharded
    token = tmp_path / "h0.token"
    token.write_text(s.tokens["h0"])
    cfg = CoordinatorLinkConfig(s.root.url, str(token), report_ms=50, ca_file=lab_ca_file(s.settings["state_dir"]))
    went = threading.Event()
    link = CoordinatorLink(cfg, lambda: identity(0), lambda: table_of(0), lambda d: None, lambda p: None,
                           lambda event, **f: went.set() if event == "coordinator_moved" else None,
                           rules=AnswerRules("h0", 1, 1024))
    link.backoff.first = link.backoff.cap = 0.05
    link.start()
    try:
        assert went.wait(10)
        wait_until(lambda: link.registered, 10, "h0 registered at shard 0")
        s.shards[0].close()  # shard 0 is gone, and comes back elsewhere
        s.settings["shard_listen"][0] = f"127.0.0.1:{free_port()}"
        s.root.close()
        s.root.service.coordinator.store.close()
        s.root = startup.start(s.settings)
        s.link.server = s.root
        s.shards[0] = startup.start_shard(s.settings, 0, s.link)
        wait_until(lambda: link.url == s.shards[0].url and link.registered, 30, "h0 back through the root at the new shard")
    finally:
        link.stop()


def test_sharding_settings_are_checked_by_name(tmp_path):
    for bad, why in (({"shards": 0}, "settings.shards: expected a whole number"),
                     ({"shards": 3, "shard_listen": None}, "more than the fabric's 2 leaves"),
                     ({"shard_listen": ["127.0.0.1:1"]}, "settings.shard_listen: 1 addresses for 2 shards"),
                     ({"shard_listen": ["127.0.0.1:1", "nonsense"]}, "shard_listen: expected HOST:PORT"),
                     ({"fabric": None}, "shards: a sharded coordinator needs a fabric model")):
        with pytest.raises(CoordinatorError, match=why):
            startup.start({k: v for k, v in {**settings_of(tmp_path), **bad}.items() if v is not None})


def report_cut(s):
    """The same cut as the unsharded coordinator's test, its reports queued by the shards;
    (the root's coordinator, the directed links the root localized)."""
    register_all(s)
    link = "p0l0-p0s1"
    crossing = {f"{link}:up", f"{link}:down"}
    c = s.root.service.coordinator
    for i in range(4):
        h = f"h{i}"
        with s.root.service.lock:
            changes = [{"id": int(k.split("/")[1]), "state": "down", "reason": "hard_failure"}
                       for k, rec in c.paths.items() if rec.reporter == h and set(rec.links) & crossing]
        with s.client(s.shards[owner(s, h)].url, h) as agent:
            agent.post("/v1/report", {"name": h, "changes": changes})
    wait_until(lambda: set(c.findings) == crossing, 10, "the root localizes the cut")
    return c, crossing


def test_a_cut_reported_through_the_shards_is_localized_by_them(sharded):
    c, crossing = report_cut(sharded)
    assert set(c.findings) == crossing
    # the shards explained it: each holds the evidence over its links, the root's own part none
    # (no pod is split), and the root stood in for none
    parts = c.localizer.parts
    assert all(len(sh.shard.part) > 0 for sh in sharded.shards)
    assert len(parts.root) == 0 and parts.standing_in == {}
    shard0, root = scrape(sharded, sharded.shards[0].url), scrape(sharded, sharded.root.url)
    assert shard0[("linkpass_coordinator_shard_localization_paths", (("shard", "0"),))] == len(parts.held[0]) > 0
    assert shard0[("linkpass_coordinator_shard_localization_rounds_total", (("shard", "0"),))] >= 2
    assert root[("linkpass_coordinator_localization_stood_in", ())] == 0


def scrape(s, url) -> dict:
    with coordinator_client(url, None, s.settings["state_dir"]) as c:
        text = c.get("/metrics").decode()
    lint = promtool("check", "metrics", stdin=text)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text)
            for x in f.samples}


def test_a_restarted_shards_part_gets_its_evidence_again(sharded):
    s = sharded
    c, crossing = report_cut(s)
    held = [len(sh.shard.part) for sh in s.shards]
    whole = c.localizer.parts.counters["parts_sent_whole"]
    assert whole == 2  # each part once, at the root's start
    s.restart_shard(1)
    assert len(s.shards[1].shard.part) == 0
    with s.root.service.lock:  # the next news for shard 1's part finds it empty
        c.localizer.update(next(iter(c.localizer.parts.held[1].values())))
        c.relocalize(time.time())
    assert set(c.findings) == crossing
    assert [len(sh.shard.part) for sh in s.shards] == held
    assert c.localizer.parts.standing_in == {}
    assert scrape(s, s.root.url)[("linkpass_coordinator_localization_parts_sent_whole_total", ())] == 3


def test_the_root_explains_the_part_of_a_shard_that_is_away_until_it_is_back(sharded):
    s = sharded
    c, crossing = report_cut(s)
    parts = c.localizer.parts
    away, s.shards[0] = s.shards[0], None
    try:
        with s.root.service.lock:
            c.localizer.update(next(iter(parts.held[0].values())))  # a path of shard 0's again: it is asked
            c.relocalize(time.time())
        assert set(c.findings) == crossing and set(parts.standing_in) == {0}
        assert [x["localized_by"] for x in s.root.service.shards_status(time.time())] == ["root", "shard"]
    finally:
        s.shards[0] = away
    with s.root.service.lock:
        c.localizer.update(next(iter(parts.held[0].values())))
        c.relocalize(time.time())
    assert set(parts.standing_in) == {0}, "tried again only after RETRY_S"
    parts.clock = lambda: time.monotonic() + parts.RETRY_S
    with s.root.service.lock:
        c.localizer.update(next(iter(parts.held[0].values())))
        c.relocalize(time.time())
    assert set(c.findings) == crossing and parts.standing_in == {}
    assert [x["localized_by"] for x in s.root.service.shards_status(time.time())] == ["shard", "shard"]
