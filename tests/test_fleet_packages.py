"""Packages for fleets: the wheel (built from the sdist, manylinux-tagged), a fresh venv that
holds only the agent's dependencies and runs the agent on the testbed, and the Debian package's
contents (deploy/package.py); one version source; the OS-package scripts never touch a service
they did not install."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from linkpass import __version__
from linkpass.testbed.agents import write_agent_configs

from support.ports import free_port
from support.processes import LogDrain, stop_processes

REPO = Path(__file__).resolve().parent.parent
PACKAGE = [sys.executable, str(REPO / "deploy" / "package.py")]
KEY = bytes(range(32))
# what a production host's agent must not pull in: the coordinator's, the demo's, the tests'
NOT_ON_AN_AGENT = ("ray", "cryptography", "pg8000", "scapy", "torch", "matplotlib", "numpy")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist (`package.py wheel`), then the .deb made from that wheel."""
    out = tmp_path_factory.mktemp("dist")
    for args in (["wheel", "--out", str(out)], None):
        if args is None:
            wheel = next(out.glob("linkpass-*.whl"))
            args = ["deb", "--out", str(out), "--wheel", str(wheel)]
        run = subprocess.run(PACKAGE + args, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "package: wrote" in run.stdout  # the progress lines a person watching sees
    return {"wheel": next(out.glob("linkpass-*.whl")), "sdist": next(out.glob("linkpass-*.tar.gz")),
            "deb": next(out.glob("linkpass_*.deb"))}


@pytest.mark.unit
def test_one_version_source():
    meta = pyproject()["project"]
    assert "version" not in meta and "version" in meta["dynamic"]
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "linkpass.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


@pytest.mark.unit
def test_the_agent_depends_on_three_packages_and_the_rest_are_extras():
    meta = pyproject()["project"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower() for d in meta["dependencies"]}
    assert names == {"pyroute2", "prometheus-client", "pyyaml"}
    extras = meta["optional-dependencies"]
    assert {"coordinator", "demo", "sim", "test"} <= set(extras)
    assert any(d.startswith("ray") for d in extras["coordinator"])
    assert "linkpass[coordinator]" in extras["demo"]  # the demo runs a real coordinator
    assert meta["urls"] and meta["license"] and meta["classifiers"]
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")


@pytest.mark.unit
def test_os_package_scripts_never_stop_a_service_they_did_not_install():
    runtime = (REPO / "deploy" / "install-os-deps.sh").read_text()
    tests = (REPO / "deploy" / "install-test-deps.sh").read_text()
    code = [ln for ln in runtime.splitlines() if not ln.lstrip().startswith("#")]
    assert not any("systemctl" in ln or "frr" in ln or "qemu" in ln for ln in code), \
        "the runtime script installs what the agent needs, nothing for the tests and no service change"
    # the test script touches FRR's and PostgreSQL's units only when this run installed them
    lines = [ln.strip() for ln in tests.splitlines()]
    guards = [i for i, ln in enumerate(lines)
              if ln.startswith(("if $installing_frr && command -v systemctl", "if $installing_pg && command -v systemctl"))]
    assert len(guards) == 2
    for guard in guards:
        assert any("systemctl" in ln for ln in lines[guard + 1:guard + 3])
    assert all(any(i in range(g, g + 3) for g in guards) for i, ln in enumerate(lines)
               if "systemctl" in ln and not ln.startswith("#"))
    for script in ("install-os-deps.sh", "install-test-deps.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "deploy" / script)]).returncode == 0


@pytest.mark.unit
def test_wheel_is_manylinux_with_the_compiled_core_license_and_metadata(dist):
    wheel = dist["wheel"]
    assert re.fullmatch(rf"linkpass-{re.escape(__version__)}-cp3\d+-cp3\d+-manylinux_2_\d+_(x86_64|aarch64)\.whl",
                        wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"linkpass-{__version__}.dist-info/METADATA").decode()
    assert any(re.fullmatch(r"linkpass/probe/_probecore\.cpython-3\d+-[\w-]+\.so", n) for n in names)
    assert any(n.endswith("dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    requires = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist: ")]
    plain = {re.split(r"[<>=; ]", r)[0].lower() for r in requires if "extra ==" not in r}
    assert plain == {"pyroute2", "prometheus-client", "pyyaml"}, requires
    assert any(r.startswith("ray") and 'extra == "coordinator"' in r for r in requires), requires
    assert "Project-URL: Source, " in meta and "License-Expression: Apache-2.0" in meta
    # the sdist the wheel was built from carries the C sources and the license
    with tarfile.open(dist["sdist"]) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"LICENSE", "linkpass/probe/_probecore.c", "linkpass/probe/probe_rx.h", "rdma/nccl/Makefile",
            "rdma/entropy_table.h", "setup.py"} <= members


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


@pytest.mark.root
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


@pytest.mark.root
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


def _deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.unit
def test_deb_carries_the_venv_units_plugin_docs_and_safe_scripts(dist, tmp_path):
    deb = dist["deb"]
    assert _deb_field(deb, "Package") == "linkpass" and _deb_field(deb, "Version") == f"{__version__}-1"
    depends = _deb_field(deb, "Depends")
    assert "python3 (>= 3.11)" in depends and "iproute2" in depends
    assert "frr" not in depends and "qemu" not in depends and "nftables" not in depends  # the testbed's, not the agent's
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    paths = {ln.split()[5].removeprefix(".") for ln in listing.splitlines()}
    want = {"/opt/linkpass/venv/bin/linkpass", "/opt/linkpass/bin/linkpass", "/usr/bin/linkpass",
            "/opt/linkpass/lib/libnccl-net-linkpass.so", "/lib/systemd/system/linkpass-agent.service",
            "/lib/systemd/system/linkpass-coordinator.service", "/usr/share/doc/linkpass/copyright",
            "/usr/share/doc/linkpass/failover.md", "/usr/share/linkpass/prometheus/linkpass-rules.yml",
            "/usr/share/linkpass/grafana/linkpass-fleet.json", "/usr/share/doc/linkpass/examples/agent-fleet.yaml",
            "/usr/share/doc/linkpass/install.md", "/usr/lib/sysusers.d/linkpass.conf",
            "/usr/lib/sysctl.d/90-linkpass.conf"}
    assert want <= paths, want - paths
    assert not any(re.search(r"/site-packages/(ray|torch|scapy|cryptography|numpy)/", p) for p in paths)
    assert "/usr/bin/linkpass -> /opt/linkpass/bin/linkpass" in listing
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    # nothing in the package names the directory it was staged in
    staged = subprocess.run(["grep", "-rlI", "linkpass-deb-", str(root)], capture_output=True, text=True)
    assert staged.stdout == "", staged.stdout
    assert (root / "opt/linkpass/venv/bin/linkpass").read_text().splitlines()[0] == "#!/opt/linkpass/venv/bin/python"
    assert os.readlink(root / "opt/linkpass/venv/bin/python3") == "/usr/bin/python3"
    run = subprocess.run([str(root / "opt/linkpass/venv/bin/python"), "-m", "linkpass", "--version"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.stdout.strip() == f"linkpass {__version__}", run.stderr
    # md5sums match the files
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    sums = dict(reversed(ln.split("  ", 1)) for ln in (control / "md5sums").read_text().splitlines())
    assert len(sums) > 100
    for rel in ("opt/linkpass/venv/bin/linkpass", "usr/share/doc/linkpass/copyright"):
        assert sums[rel] == hashlib.md5((root / rel).read_bytes()).hexdigest()
    # maintainer scripts: valid sh; they stop only the package's own units and never enable or start one
    for name in ("postinst", "prerm", "postrm"):
        text = (control / name).read_text()
        assert subprocess.run(["sh", "-n", str(control / name)]).returncode == 0
        commands = [ln.strip() for ln in text.splitlines() if not ln.strip().startswith(("#", "echo "))]
        for ln in commands:
            if "systemctl" in ln and "daemon-reload" not in ln:
                assert "disable --now linkpass-agent.service linkpass-coordinator.service" in ln, ln
        assert not any(re.search(r"systemctl\s+(enable|start|restart)", ln) for ln in commands)
        assert "frr" not in text


def _in_root(root: Path, *argv: str, user: str | None = None) -> subprocess.CompletedProcess:
    """A command inside the unpacked Debian system (chroot; no /proc, /sys or /dev mounted, so
    nothing in there can reach this machine's kernel settings)."""
    wrap = ["/usr/sbin/runuser", "-u", user, "--"] if user else []
    return subprocess.run(["chroot", str(root), *wrap, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.root
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


@pytest.mark.unit
def test_package_script_reports_a_failing_step_in_one_line_and_exits_1(tmp_path):
    run = subprocess.run(PACKAGE + ["deb", "--out", str(tmp_path), "--wheel", str(tmp_path / "missing.whl")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.startswith("package: error: ") and "missing.whl" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not list(tmp_path.glob("*.deb"))


@pytest.mark.unit
def test_example_configs_are_valid_for_the_hosts_they_describe():
    from linkpass.agent.config import HostFacts, load_text, parse

    examples = REPO / "deploy" / "examples"
    fleet = yaml.safe_load((examples / "agent-fleet.yaml").read_text())
    for i in (1, 7, 300):
        a, b = divmod(i, 256)
        addrs = [("lo", f"198.18.{a}.{b}/32"), ("bond0", f"198.19.{a}.{b}/16")]
        addrs += [(f"ens{p}f0", f"198.18.{16 * (p + 1) + a}.{(2 * b + 1) % 256}/31") for p in range(8)]
        cfg = parse(fleet, HostFacts(f"gpu-{i}", tuple(addrs)))
        assert len(cfg.nics) == 8 and all(n.gateway for n in cfg.nics) and cfg.name == f"gpu-{i}"
        assert cfg.metrics_address == f"198.19.{a}.{b}" and cfg.coordinator.follow_plan
    one = load_text((examples / "agent-one-host.yaml").read_text(), "agent-one-host.yaml")
    assert (one.name, len(one.nics), len(one.peers), one.coordinator) == ("gpu-a11", 2, 2, None)


@pytest.mark.unit
def test_a_command_that_needs_an_extra_says_which_in_one_line(tmp_path):
    """On an agent host (no Ray, no cryptography) `linkpass coordinator` and `linkpass tls init`
    name the extra to install instead of a traceback: simulated by hiding both packages."""
    hide = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('ray', 'cryptography'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from linkpass.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    for args in (["coordinator", "--state-dir", str(tmp_path / "s"), "--max-seconds", "1"],
                 ["tls", "init", "--dir", str(tmp_path / "tls")]):
        run = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=60,
                             cwd=REPO)
        assert run.returncode == 3, (args, run.stderr)
        assert "pip install 'linkpass[coordinator]'" in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
