"""Who may call the coordinator: bearer tokens with roles.

    reader    read everything (status, links, paths, events, plans)
    agent     reader + register, heartbeat, report path verdicts
    operator  reader + drain / undrain

The tokens file holds only SHA-256 hashes of the tokens (a leaked file grants nothing):

    tokens:
      - {name: oncall, role: operator, sha256: 9f86d0...}
      - {name: fleet-agents, role: agent, sha256: 2c26b4...}

`ensure_tokens(dir)` makes one token per role on first start (the embedded default) and writes
each to <dir>/<role>.token (mode 0600) for the local CLI and the agents. Pure apart from that.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

import yaml

ROLES = ("reader", "agent", "operator")
# what each role may do, by action name (the HTTP endpoint names its action)
_ALLOWED = {
    "read": {"reader", "agent", "operator"},
    "report": {"agent"},
    "drain": {"operator"},
}


class AuthError(ValueError):
    """A tokens file is malformed; the message names the entry and field."""


@dataclass(frozen=True)
class Caller:
    name: str
    role: str

    def may(self, action: str) -> bool:
        return self.role in _ALLOWED[action]


def token_hash(token: str) -> str:
    return hashlib.sha256(token.strip().encode()).hexdigest()


class Tokens:
    def __init__(self, entries: dict[str, Caller]):
        self._by_hash = entries

    @classmethod
    def parse(cls, text: str, where: str = "tokens") -> "Tokens":
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise AuthError(f"{where}: not valid YAML ({exc})") from None
        items = raw.get("tokens") if isinstance(raw, dict) else None
        if not isinstance(items, list) or not items:
            raise AuthError(f"{where}: expected a mapping with a non-empty list 'tokens' of {{name, role, sha256}}")
        out: dict[str, Caller] = {}
        for i, it in enumerate(items):
            at = f"{where}.tokens[{i}]"
            if not isinstance(it, dict):
                raise AuthError(f"{at}: expected a mapping with name, role, sha256")
            name, role, digest = it.get("name"), it.get("role"), str(it.get("sha256", "")).lower()
            if not isinstance(name, str) or not name:
                raise AuthError(f"{at}.name: expected a non-empty string")
            if role not in ROLES:
                raise AuthError(f"{at}.role: {role!r} is not a role; one of {', '.join(ROLES)}")
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise AuthError(f"{at}.sha256: expected 64 hex digits (sha256sum of the token); "
                                "make one with `linkpass coordinator token NAME ROLE`")
            out[digest] = Caller(name, role)
        return cls(out)

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller an `Authorization: Bearer <token>` header names, or None."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = token_hash(authorization[7:])
        # constant-time compare against every entry: no timing hint of a near miss
        found = None
        for h, c in self._by_hash.items():
            if hmac.compare_digest(h, digest):
                found = c
        return found


def new_token() -> str:
    return secrets.token_urlsafe(32)


def ensure_tokens(directory: str) -> str:
    """The tokens file in `directory`, created with one token per role if missing; returns its path."""
    path = os.path.join(directory, "tokens.yaml")
    if os.path.exists(path):
        return path
    os.makedirs(directory, mode=0o700, exist_ok=True)
    entries = []
    for role in ROLES:
        token = new_token()
        _write_private(os.path.join(directory, f"{role}.token"), token + "\n")
        entries.append({"name": f"local-{role}", "role": role, "sha256": token_hash(token)})
    _write_private(path, yaml.safe_dump({"tokens": entries}, sort_keys=False))
    return path


def _write_private(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_token(path: str) -> str:
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise AuthError(f"{path}: the token file is empty")
    return token
