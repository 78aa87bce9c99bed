"""Packages for fleets, installed: a fresh venv that holds only the agent's dependencies and runs
the agent on the testbed, the agent's image probing on the testbed, and the Debian package
installed, upgraded and removed with dpkg (the packages' contents: tests/unit/test_fleet_packages.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from linkpass import __version__
from linkpass.testbed.agents import write_agent_configs

from support.ports import free_port
from support.processes import LogDrain, stop_processes

REPO = Path(__file__).resolve().parents[2]
PACKAGE = [sys.executable, str(REPO / "deploy" / "package.py")]
KEY = bytes(range(32))
# what a production host's agent must not pull in: the coordinator's, the demo's, the tests'
NOT_ON_AN_AGENT = ("ray", "cryptography", "pg8000", "scapy", "torch", "matplotlib", "numpy")

def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          str(wheel)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return venv


def h0_agent_probes_h1(fab, tmp_path: Path, h0_linkpass: list[str]) -> None:
    """h0 runs the agent `h0_linkpass` starts, h1 the repository's: they must probe each other
    with 0 loss, read through h0's local API by the repository's CLI."""
    port = free_port()
    configs = write_agent_configs(fab, str(tmp_path), KEY, api_port=port, interval_ms=5)
    for i in (0, 1):
        doc = yaml.safe_load(open(configs[i]))
        doc["peers"] = [p for p in doc["peers"] if p["name"] in ("h0", "h1")]
        with open(configs[i], "w") as f:
            yaml.safe_dump(doc, f)
    cmds = {0: h0_linkpass, 1: [sys.executable, "-m", "linkpass.cli"]}
    procs = {i: subprocess.Popen(["ip", "netns", "exec", fab.netns(f"h{i}"), *cmds[i], "agent", "--config",
                                  configs[i], "--max-seconds", "60"], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for i in (0, 1)}
    drains = {i: LogDrain(p.stderr) for i, p in procs.items()}
    try:
        for d in drains.values():
            assert d.wait_for('"event": "started"', 60), d.text(0)[-2000:]
        deadline, rows = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            out = subprocess.run(["ip", "netns", "exec", fab.netns("h0"), sys.executable, "-m", "linkpass.cli", "paths",
                                  "--port", str(port), "-o", "json"], capture_output=True, text=True, timeout=30)
            rows = yaml.safe_load(out.stdout) if out.stdout.startswith("[") else []
            if rows and all(r["replies"] > 100 for r in rows):
                break
            time.sleep(0.5)
        assert rows and {r["peer"] for r in rows} == {"h1"}, rows
        assert all(r["replies"] > 100 and r["lost_fwd"] == 0 and r["lost_rev"] == 0 for r in rows), rows
        assert procs[0].poll() is None and procs[1].poll() is None
    finally:
        stop_processes(procs.values())


def test_wheel_in_a_fresh_venv_runs_the_agent_with_only_its_own_dependencies(dist, clean_faults, tmp_path):
    fab = clean_faults
    venv = _fresh_venv(tmp_path, dist["wheel"])
    py = str(venv / "bin" / "python")
    for mod in NOT_ON_AN_AGENT:
        probe = subprocess.run([py, "-c", f"import {mod}"], capture_output=True, text=True, cwd=tmp_path)
        assert probe.returncode != 0, f"{mod} came with the wheel's dependencies"
    exe = str(venv / "bin" / "linkpass")
    ver = subprocess.run([exe, "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert ver.stdout.strip() == f"linkpass {__version__}"
    h0_agent_probes_h1(fab, tmp_path, [exe])


def test_agent_image_builds_and_its_agent_probes_on_the_testbed(clean_faults, tmp_path):
    """deploy/container/Containerfile's agent target, built by buildah on a Debian 12 root
    bootstrapped here (no registry reachable), its storage private to the test; the image's agent
    then runs in testbed host h0's namespace, as the DaemonSet runs it (host network, NET_RAW,
    NET_ADMIN and SYS_NICE), and probes h1's agent with 0 loss."""
    fab = clean_faults
    storage = tmp_path / "containers"
    b = ["buildah", "--root", str(storage / "root"), "--runroot", str(storage / "run"), "--storage-driver", "vfs"]
    try:
        built = subprocess.run(PACKAGE + ["image", "--target", "agent", "--tag", "localhost/linkpass:test",
                                          "--storage", str(storage)], capture_output=True, text=True, timeout=1800)
        assert built.returncode == 0, built.stdout + built.stderr[-3000:]
        assert "package: wrote the image localhost/linkpass:test" in built.stdout
        config = json.loads(subprocess.run(b + ["inspect", "--type", "image", "localhost/linkpass:test"],
                                           capture_output=True, text=True, check=True).stdout)["OCIv1"]["config"]
        assert config["Entrypoint"] == ["linkpass"] and config["Cmd"][:1] == ["agent"]
        ctr = subprocess.run(b + ["from", "-q", "localhost/linkpass:test"], capture_output=True, text=True,
                             check=True).stdout.strip()
        inside = b + ["run", "--isolation", "chroot", "--network", "host", "--cap-add",
                      "CAP_NET_RAW,CAP_NET_ADMIN,CAP_SYS_NICE", "-v", f"{tmp_path}:{tmp_path}", ctr, "--"]
        ver = subprocess.run(inside + ["linkpass", "--version"], capture_output=True, text=True, timeout=120)
        assert ver.stdout.strip() == f"linkpass {__version__}", ver.stderr
        for mod in NOT_ON_AN_AGENT:
            got = subprocess.run(inside + ["python3", "-c", f"import {mod}"], capture_output=True, text=True)
            assert got.returncode != 0, f"{mod} is in the agent's image"
        h0_agent_probes_h1(fab, tmp_path, inside + ["linkpass"])
    finally:
        subprocess.run(b + ["rm", "--all"], capture_output=True)
        subprocess.run(b + ["rmi", "--all", "--force"], capture_output=True)
        subprocess.run(["rm", "-rf", "--one-file-system", str(storage)], check=False)


def _in_root(root: Path, *argv: str, user: str | None = None) -> subprocess.CompletedProcess:
    """A command inside the unpacked Debian system (chroot; no /proc, /sys or /dev mounted, so
    nothing in there can reach this machine's kernel settings)."""
    wrap = ["/usr/sbin/runuser", "-u", user, "--"] if user else []
    return subprocess.run(["chroot", str(root), *wrap, *argv], capture_output=True, text=True, timeout=120)


def test_deb_installs_upgrades_and_removes_with_dpkg_on_a_debian_system(dist, tmp_path):
    """The documented bare-metal steps on a real Debian 12 system: the Soft-RoCE guest's root
    (debootstrap minbase + python3, iproute2), unpacked into a directory. dpkg installs into it
    (`--root`: maintainer scripts run chrooted there); no systemd in it, as in a container."""
    from linkpass.testbed import guests

    image = guests.ensure_image()
    root = tmp_path / "debian"
    root.mkdir()
    unpack = subprocess.run(f"zstd -dc {image.initrd} | cpio -idm --quiet", shell=True, cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert unpack.returncode == 0 and (root / "var/lib/dpkg/status").exists(), unpack.stderr
    reserved = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text()
    try:
        dpkg = ["dpkg", f"--root={root}"]
        first = subprocess.run(dpkg + ["-i", str(dist["deb"])], capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "linkpass: installed. Next: /etc/linkpass/agent.yaml" in first.stdout + first.stderr
        # postinst: both system users (useradd: no systemd-sysusers here), /etc/linkpass root:linkpass 0750
        users = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()}
        assert users["linkpass"][6] == users["linkpass-coordinator"][6] == "/usr/sbin/nologin"
        assert int(users["linkpass"][2]) < 1000  # system users
        etc = (root / "etc/linkpass").stat()
        assert oct(etc.st_mode & 0o777) == "0o750" and etc.st_uid == 0 and etc.st_gid == int(users["linkpass"][3])
        # its sysctl file could not be applied from a chroot: said so, and this machine's value unchanged
        assert "applies at boot" in first.stderr
        assert Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text() == reserved
        # the documented next steps: key and config in place, then the check, as the agent's own user
        (root / "tmp/fleet.key").write_text(KEY.hex() + "\n")
        shutil.copy(REPO / "deploy/examples/agent-one-host.yaml", root / "tmp/agent.yaml")
        for argv in (["install", "-o", "linkpass", "-g", "linkpass", "-m", "0600", "/tmp/fleet.key",
                      "/etc/linkpass/fleet.key"],
                     ["install", "-o", "root", "-g", "linkpass", "-m", "0640", "/tmp/agent.yaml",
                      "/etc/linkpass/agent.yaml"]):
            assert _in_root(root, *argv).returncode == 0
        check = _in_root(root, "linkpass", "agent", "--config", "/etc/linkpass/agent.yaml", "--check-config",
                         "-o", "json", user="linkpass")
        assert check.returncode == 0, check.stdout + check.stderr
        doc = json.loads(check.stdout)
        assert doc["ok"] and doc["name"] == "gpu-a11" and doc["fleet_keys"] == 1
        version = _in_root(root, "linkpass", "--version", user="linkpass")
        assert version.stdout.strip() == f"linkpass {__version__}", version.stderr
        # upgrade (the same package again): postinst runs again and changes nothing it made
        again = subprocess.run(dpkg + ["-i", str(dist["deb"])], capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()} == users
        # remove: the code goes, the operator's key and config stay; purge keeps them too
        gone = subprocess.run(dpkg + ["-r", "linkpass"], capture_output=True, text=True, timeout=300)
        assert gone.returncode == 0, gone.stdout + gone.stderr
        assert not (root / "opt/linkpass/venv").exists() and not (root / "usr/bin/linkpass").is_symlink()
        assert not (root / "lib/systemd/system/linkpass-agent.service").exists()
        purged = subprocess.run(dpkg + ["-P", "linkpass"], capture_output=True, text=True, timeout=300)
        assert purged.returncode == 0, purged.stdout + purged.stderr
        assert (root / "etc/linkpass/fleet.key").exists() and (root / "etc/linkpass/agent.yaml").exists()
        status = subprocess.run(dpkg + ["-s", "linkpass"], capture_output=True, text=True)
        assert status.returncode != 0  # dpkg knows nothing of it any more
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)
