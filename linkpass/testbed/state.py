"""Where a running testbed records itself: /run/linkpass/testbed/<prefix>.json.

The file holds the spec, the management subnet and the active faults, so `show`, `fault` and
`down` work from any process. Writers hold an flock on <prefix>.lock; writes are atomic
(temp file + rename) so a crash never leaves half a file.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from typing import Iterator

STATE_DIR = os.path.abspath(os.environ.get("LINKPASS_TESTBED_STATE_DIR", "/run/linkpass/testbed"))


def state_path(prefix: str) -> str:
    return os.path.join(STATE_DIR, f"{prefix}.json")


def agents_dir(prefix: str) -> str:
    """`testbed up --agents`: the agents' configs, key, logs, journals and entropy tables."""
    return os.path.join(STATE_DIR, f"{prefix}-agents")


def flap_log_path(prefix: str, fault_id: int) -> str:
    return os.path.join(STATE_DIR, f"{prefix}-flap-{fault_id}.log")


@contextlib.contextmanager
def locked(prefix: str) -> Iterator[None]:
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(os.path.join(STATE_DIR, f"{prefix}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(prefix: str) -> dict | None:
    try:
        with open(state_path(prefix)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def save(prefix: str, doc: dict) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = state_path(prefix) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, state_path(prefix))


def remove(prefix: str) -> None:
    for path in (state_path(prefix), os.path.join(STATE_DIR, f"{prefix}.lock")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(STATE_DIR):
            if name.startswith(f"{prefix}-flap-"):
                os.unlink(os.path.join(STATE_DIR, name))


def all_prefixes() -> list[str]:
    try:
        return sorted(n[:-5] for n in os.listdir(STATE_DIR) if n.endswith(".json"))
    except FileNotFoundError:
        return []
