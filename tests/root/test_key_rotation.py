"""Rotating the fleet key on the testbed without a flag day (docs/security.md): three rounds of a
config change and a reload, host by host, with mixed keys in every round; no path leaves UP and
no probe is dropped as forged. A host that signs with a key its peers do not accept yet is the
control: its probes are dropped there as bad_tag and its paths fail, so the test can see it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import yaml

from linkpass.core.names import host_name
from linkpass.testbed.agents import Agents

from support.waiting import wait_until


OLD, NEW = bytes(range(32)), bytes(range(200, 232))
HOSTS = [0, 1, 2, 3]


def counters(fab, h: int) -> dict:
    """The agent's /v1/counters, read inside its host's namespace (the API listens on 127.0.0.1)."""
    code = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9471/v1/counters', timeout=5).read().decode())"
    out = subprocess.run(["ip", "netns", "exec", fab.netns(host_name(h)), sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=20)
    return json.loads(out.stdout)


def key_file(directory: str, name: str, key: bytes) -> str:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())
    return path


def reconfigure(agents: Agents, h: int, **fields) -> None:
    """Set (or, with None, remove) top-level fields of host h's config, then reload it (SIGHUP)."""
    path = os.path.join(agents.directory, f"agent-{host_name(h)}.yaml")
    doc = yaml.safe_load(open(path))
    for k, v in fields.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    with open(path, "w") as f:
        yaml.safe_dump(doc, f)
    before = len(agents.events(h, "reloaded"))
    agents.procs[h].send_signal(signal.SIGHUP)
    wait_until(lambda: len(agents.events(h, "reloaded")) > before, 20, f"{host_name(h)} reloading",
               lambda: agents.events(h)[-5:])


def downs(agents: Agents) -> list[tuple[str, dict]]:
    """Paths that went DOWN (or were damped) and were not put back as `spurious_down` (a reply that
    came late, not lost: this loaded machine keeps a reflector waiting now and then, keys or not).
    A key a peer does not accept drops every probe, so that is how it shows; a full-size probe late
    under load can mark a path degraded for a moment, which says nothing about keys."""
    out = []
    for h in HOSTS:
        events = agents.events(h, "path_state")
        for i, ev in enumerate(events):
            if ev["new"] not in ("down", "damped"):
                continue
            undone = False  # put back as spurious before the path went down again (a reply may be seen first)
            for later in events[i + 1:]:
                if later["path"] != ev["path"]:
                    continue
                if later.get("reason") == "spurious_down":
                    undone = True
                    break
                if later["new"] in ("down", "damped"):
                    break
            if not undone:
                out.append((host_name(h), ev))
    return out


def test_a_fleet_rotates_its_key_in_three_rounds_with_no_false_failure(clean_faults, tmp_path):
    fab = clean_faults
    d = str(tmp_path)
    with Agents(fab, d, HOSTS, key=OLD, interval_ms=2, routes=False, entropy=False) as agents:  # started
        assert agents.wait_healthy(timeout_s=60), agents.not_up()
        time.sleep(2)
        baseline = len(downs(agents))
        old_file = os.path.join(d, "fleet.key")
        new_file = key_file(d, "fleet-next.key", NEW)
        # 1: accept the new key, host by host; everyone still signs with the old one
        for h in HOSTS:
            reconfigure(agents, h, fleet_key_accept_file=new_file)
            time.sleep(0.5)  # mixed: some hosts accept two keys, some one
        assert all(counters(fab, h)["stats"].get("other_key", 0) == 0 for h in HOSTS)
        # 2: sign with the new key, still accept the old one; mixed signers in between
        for h in HOSTS:
            reconfigure(agents, h, fleet_key_file=new_file, fleet_key_accept_file=old_file)
            time.sleep(0.5)
        time.sleep(1)
        # every host has seen packets only the other key explains (old-key signers before it switched)
        seen = {h: counters(fab, h)["stats"].get("other_key", 0) for h in HOSTS}
        assert all(n > 0 for n in seen.values()), seen
        # 3: drop the old key
        for h in HOSTS:
            reconfigure(agents, h, fleet_key_accept_file=None)
            time.sleep(0.5)
        time.sleep(2)
        bad = {h: counters(fab, h)["drops"].get("bad_tag", 0) for h in HOSTS}
        assert bad == dict.fromkeys(HOSTS, 0), bad
        assert len(downs(agents)) == baseline, downs(agents)[baseline:]
        wait_until(lambda: all(not rows for rows in agents.not_up().values()), 10, "every path up",
                   agents.not_up)

        # the control: h0 signs with a third key nobody accepts; its peers drop its probes as forged
        # and h0 sees its paths fail, which is what the rounds above must never cause
        third = key_file(d, "fleet-third.key", bytes(range(100, 132)))
        reconfigure(agents, 0, fleet_key_file=third)
        wait_until(lambda: counters(fab, 1)["drops"].get("bad_tag", 0) > 0, 10, "h1 dropping h0's probes")
        wait_until(lambda: len(downs(agents)) > baseline, 15, "h0's paths failing")
