"""The fleet key file, read the one way every reader reads it (the agent, `linkpass doctor`).

The fleet key authenticates every probe (BLAKE2b, core/wire.py): whoever reads it can forge
probes and replies for the whole fleet, whoever can write it can make this agent drop them all.
So the file is refused, with a message naming it and the fix, unless it is

- a regular file (a symlink to one is followed: secrets are often mounted that way),
- owned by the agent's uid or by root,
- readable and writable by its owner only (no group or other bits: `chmod 600`),
- 32..64 bytes of key, raw or as hex text (`config.read_fleet_key`).

The checks run on the opened descriptor, so the file checked is the file read.
"""
from __future__ import annotations

import os
import stat

from .config import ConfigError, read_fleet_key

MAX_FILE_BYTES = 4096  # a key file is 32..64 bytes (or twice that as hex, plus a newline)


def mode_problem(mode: int, uid: int, euid: int) -> str | None:
    """Why a key file with this mode and owner is refused, or None. Pure."""
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if uid not in (euid, 0):
        return f"belongs to uid {uid}, not to this agent's uid {euid} or root (`chown {euid}` it)"
    others = stat.S_IMODE(mode) & 0o077
    if others:
        who = " and ".join(w for w, bits in (("its group", 0o070), ("others", 0o007)) if others & bits)
        return (f"can be read or written by {who} (mode {stat.S_IMODE(mode):04o}); a fleet key must be "
                "readable by its owner only")
    return None


def load_fleet_key(path: str, field: str = "fleet_key_file") -> bytes:
    """The key in `path`, or ConfigError naming the config field, the file and the fix."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{field}: {path} does not exist; the fleet's key (the same file on every host) goes "
                          f"there, e.g. made once with `(umask 077; python3 -c 'import secrets; "
                          f"print(secrets.token_hex(32))' > {path})` (docs/install.md)") from None
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        problem = mode_problem(st.st_mode, st.st_uid, os.geteuid())
        if problem:
            fix = f"chmod 600 {path}" if "owner only" in problem else "replace it with a file only its owner can read"
            raise ConfigError(f"{field}: {path} {problem}: {fix}")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return read_fleet_key(data, f"{field}: {path}")


def load_fleet_keys(key_file: str, accept_file: str | None) -> tuple[bytes, bytes | None]:
    """(the key to sign with, the other key accepted during a rotation or None)."""
    key = load_fleet_key(key_file)
    other = load_fleet_key(accept_file, "fleet_key_accept_file") if accept_file else None
    return key, (other if other != key else None)
