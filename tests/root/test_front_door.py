"""The README's commands as a new user types them: `make demo` from the repository root with the
default output folder (the Makefile's own recipe, on one fault so it stays short), and the
`linkpass` commands of the README and docs run from a folder outside the repository with
relative file arguments."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import yaml

from support.testbed import prefix_for


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINKPASS = [sys.executable, "-m", "linkpass.cli"]


def test_make_demo_as_the_readme_says_writes_its_summary_in_the_default_folder():
    """`make demo` with nothing but a shorter fault list and a testbed prefix of this run's own:
    the default output folder (relative, out/demo-<time>) reaches the agents' configs."""
    before = set(glob.glob(os.path.join(ROOT, "out", "demo-*")))
    prefix = prefix_for("f")
    started = time.monotonic()
    proc = subprocess.run(["timeout", "300", "make", "-s", "demo", f"DEMO_ARGS=--faults uplink-cut --prefix {prefix}"],
                          cwd=ROOT, capture_output=True, text=True)
    made = sorted(set(glob.glob(os.path.join(ROOT, "out", "demo-*"))) - before)
    try:
        log = proc.stdout[-4000:] + proc.stderr[-2000:]
        # make's recipe turns the demo's exit 1 (jobs unharmed, a timing target missed) into 0
        assert proc.returncode == 0, log
        assert len(made) == 1, (made, log)
        with open(os.path.join(made[0], "summary.json")) as f:
            doc = json.load(f)
        assert doc["output_dir"] == made[0] and doc["plot"].startswith(made[0] + "/")
        for run in (doc, doc["nccl_plugin"]):  # both jobs, LinkPass on
            assert (run["restarts"], run["wrong_results"]) == (0, 0), log
            assert [f["kind"] for f in run["faults"]] == ["uplink-cut"]
            assert all(f["detect_ms"] is not None for f in run["faults"]), run["faults"]  # every fault seen
        assert doc["compare"]["restarts"] == 0 and doc["compare"]["linkpass_routes"] == 0
        # the agents' configs were written with absolute paths, as the agent requires
        configs = glob.glob(os.path.join(made[0], "agents", "agent-h*.yaml"))
        assert len(configs) == 4
        for path in configs:
            with open(path) as f:
                cfg = yaml.safe_load(f)
            assert cfg["probe"]["lanes_dir"].startswith(made[0] + "/")
            assert cfg["fleet_key_file"].startswith(made[0] + "/")
        assert f"summary: {made[0]}/summary.json" in proc.stdout
        print(f"make demo, one fault, --compare: {time.monotonic() - started:.0f} s")
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run(LINKPASS + ["testbed", "clean", "--prefix", prefix], cwd=ROOT, capture_output=True)


def run(args: list[str], cwd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "HOME": cwd, "XDG_CONFIG_HOME": os.path.join(cwd, ".config")}
    return subprocess.run(LINKPASS + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_docs_commands_work_from_a_folder_outside_the_repository(tmp_path):
    """The lab and fleet quickstarts' commands, typed in a folder of the user's with relative file
    arguments: a testbed, a fault, a coordinator whose state folder is relative (its Ray actor runs
    elsewhere), a host's agent token, TLS files, and an agent config checked from a relative path."""
    work = str(tmp_path / "work")
    os.makedirs(work)
    prefix = prefix_for("w")
    try:
        up = run(["testbed", "up", "--preset", "tiny", "--agents", "--prefix", prefix], work, timeout=180)
        assert up.returncode == 0, up.stderr[-2000:]
        # the agents outlive the command; each answers for its host in the host's namespace
        def h0_view() -> list[dict]:
            view = ["ip", "netns", "exec", f"{prefix}-h0", *LINKPASS, "paths", "--local", "-o", "json"]
            return json.loads(subprocess.run(view, cwd=work, capture_output=True, text=True, timeout=60,
                                             env={**os.environ, "PYTHONPATH": ROOT}).stdout)

        rows = h0_view()
        assert {(r["peer"], r["plane"]) for r in rows} == {("h1", 0), ("h1", 1)}
        down = run(["testbed", "fault", "--prefix", prefix, "down", "h0-p0l0"], work)
        assert down.returncode == 0, down.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rows = h0_view()
            if {r["plane"] for r in rows if r["state"] == "down"} == {0}:
                break
            time.sleep(0.2)
        assert {r["plane"] for r in rows if r["state"] == "down"} == {0}, rows
        clear = run(["testbed", "fault", "--prefix", prefix, "--clear"], work)
        assert clear.returncode == 0, clear.stderr

        # the coordinator with a relative --state-dir, for a few seconds
        coord = run(["coordinator", "--testbed", prefix, "--state-dir", "state", "--listen", "127.0.0.1:0",
                     "--insecure-http", "--max-seconds", "3"], work, timeout=180)
        assert coord.returncode == 0, coord.stdout[-2000:] + coord.stderr[-2000:]
        state = os.path.join(work, "state")
        assert os.path.exists(os.path.join(state, "coordinator.db")), os.listdir(work)
        assert os.path.exists(os.path.join(state, "reader.token"))
        assert f"tokens: {state}/" in coord.stdout  # what it prints names the real folder

        token = run(["coordinator", "token", "h0", "--state-dir", "state", "--out", "h0.token"], work)
        assert token.returncode == 0, token.stderr
        assert os.path.getsize(os.path.join(work, "h0.token")) > 20

        tls = run(["tls", "init", "--dir", "tls", "--hosts", "h0"], work)
        assert tls.returncode == 0, tls.stderr
        assert os.path.isdir(os.path.join(work, "tls"))

        # an agent config whose files are absolute, itself named by a relative path
        with open(os.path.join(work, "fleet.key"), "w") as f:
            f.write("ab" * 32)
        os.chmod(os.path.join(work, "fleet.key"), 0o600)
        doc = {"agent_id": 1, "name": "h0", "fleet_key_file": os.path.join(work, "fleet.key"),
               "service": "198.18.0.1", "nics": [{"plane": 0, "ifname": "p0", "addr": "198.18.64.1"}]}
        with open(os.path.join(work, "agent.yaml"), "w") as f:
            yaml.safe_dump(doc, f)
        check = run(["agent", "--config", "agent.yaml", "--check-config"], work)
        assert check.returncode == 0, check.stdout + check.stderr
        # and one with a relative file inside is refused, naming the field and the fix
        doc["fleet_key_file"] = "fleet.key"
        with open(os.path.join(work, "relative.yaml"), "w") as f:
            yaml.safe_dump(doc, f)
        bad = run(["agent", "--config", "relative.yaml", "--check-config"], work)
        assert bad.returncode == 2
        assert re.search(r"fleet_key_file: 'fleet.key' is not an absolute path; e\.g\. /etc/linkpass/fleet\.key",
                         bad.stderr), bad.stderr
        assert os.path.join(work, "relative.yaml") in bad.stderr  # the file named as a path that works anywhere
        gone = run(["testbed", "down", "--prefix", prefix], work)
        assert gone.returncode == 0, gone.stderr
        assert not [p for p in os.listdir("/proc") if p.isdigit() and _is_agent_of(p, prefix)]
    finally:
        run(["testbed", "clean", "--prefix", prefix], work)


def _is_agent_of(pid: str, prefix: str) -> bool:
    """A `linkpass agent` whose config lies in this testbed's agents folder."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"agent" in argv and any(f"/{prefix}-agents/".encode() in a for a in argv)
