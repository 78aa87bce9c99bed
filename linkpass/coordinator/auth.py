"""Who may call the coordinator: bearer tokens with roles, and agents bound to their host.

    reader    read everything (status, links, paths, events, plans)
    agent     reader + register and report, as its own host only
    operator  reader + drain / undrain / decommission

Reader and operator tokens are listed in the tokens file, which holds only SHA-256 hashes of the
tokens (a leaked file grants nothing):

    tokens:
      - {name: oncall, role: operator, sha256: 9f86d0...}
      - {name: grafana, role: reader, sha256: 2c26b4...}
      - {name: h7-static, role: agent, host: h7, sha256: fcde2b...}   # an agent entry names its host

An agent's token speaks for one host. Besides entries like the last one, every agent token can be
derived from the fleet's agent secret (`<state-dir>/agent.secret`, which only the coordinator's
host holds), at the host's epoch:

    lpa1.<host>.<base64url(HMAC-SHA256(secret, "linkpass agent v1\\0" + host))>                 epoch 0
    lpa1.<host>.<epoch>.<base64url(HMAC-SHA256(secret, "linkpass agent v2\\0" + host + "\\0" + epoch))>

The coordinator checks the MAC and takes the caller's host (and epoch) from the token, so a fleet
of any size needs no list of hosts, a new host needs only `linkpass coordinator token HOST`, and a
stolen token lets its holder report as that one host and no other. The two MAC inputs start with
different contexts, so a MAC of one form never verifies as the other, whatever dots a host name
holds.

Revoking one host's tokens: the coordinator keeps the lowest epoch it accepts per host (in its
store, `Store.agent_epochs`; hosts never revoked are at 0). `linkpass coordinator token HOST
--revoke` raises it by one and prints the token of the new epoch; every older token of that host,
derived or listed (a listed agent token counts as epoch 0), is then refused with `Revoked`.
Rotating the secret still revokes every derived token at once.

On first start (the embedded default) `ensure_tokens(dir)` makes the reader and operator tokens,
writing each to <dir>/<role>.token (mode 0600) for the local CLI, and `ensure_secret(path)` the
agent secret.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import tempfile
from dataclasses import dataclass

from ..formats import yaml_doc as yaml

from ..control.bodies import HOST_NAME_RE

ROLES = ("reader", "agent", "operator")
# what each role may do, by action name (the HTTP endpoint names its action)
_ALLOWED = {
    "read": {"reader", "agent", "operator"},
    "report": {"agent"},
    "drain": {"operator"},
    "decommission": {"operator"},
}
NEEDS = {"report": "agent", "drain": "operator", "decommission": "operator", "read": "reader"}
# a host's name as agents and the fleet model use it (h0, gpu-017.rack3); no "/" (path keys), no space
AGENT_TOKEN_PREFIX = "lpa1."
_AGENT_MAC_CONTEXT = b"linkpass agent v1\0"  # epoch 0: the form every token had before epochs
_AGENT_EPOCH_MAC_CONTEXT = b"linkpass agent v2\0"  # epoch >= 1
MAX_EPOCH = 2**31 - 1  # revocations of one host; the store's integer and the token's digits stay small
SECRET_FILE = "agent.secret"


class AuthError(ValueError):
    """A tokens file or secret is malformed; the message names the entry and field."""


@dataclass(frozen=True)
class Caller:
    name: str
    role: str
    host: str | None = None  # agents: the one host this token speaks for
    epoch: int = 0  # agents: the token's epoch (a listed agent token is of epoch 0)

    def may(self, action: str) -> bool:
        return self.role in _ALLOWED[action]


@dataclass(frozen=True)
class Revoked:
    """A well-formed agent token of `host` whose epoch is below the lowest the coordinator accepts:
    it was good once, and `linkpass coordinator token HOST --revoke` ended it."""

    host: str
    epoch: int
    min_epoch: int

    def message(self) -> str:
        """For the 401 answer: names the host and the fix, and no secret material."""
        return (f"the agent token of {self.host} was revoked (it is of epoch {self.epoch}; this coordinator accepts "
                f"epoch {self.min_epoch} and later): install the host's new token, which `linkpass coordinator "
                f"token {self.host}` prints on the coordinator's host, in its agent's token_file")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.strip().encode()).hexdigest()


def valid_host(name) -> bool:
    return isinstance(name, str) and HOST_NAME_RE.fullmatch(name) is not None


def agent_token(secret: bytes, host: str, epoch: int = 0) -> str:
    """The token that lets an agent speak for `host` (and for no other) at `epoch`; epoch 0 is the
    epoch-less form, so hosts never revoked keep the tokens they have."""
    if not valid_host(host):
        raise AuthError(f"host {host!r}: expected a host name of letters, digits, '.', '_' or '-' (1..64)")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        raise AuthError(f"epoch {epoch!r}: expected an integer 0..{MAX_EPOCH}")
    if epoch == 0:
        mac = hmac.new(secret, _AGENT_MAC_CONTEXT + host.encode(), hashlib.sha256).digest()
        return f"{AGENT_TOKEN_PREFIX}{host}.{_b64(mac)}"
    mac = hmac.new(secret, _AGENT_EPOCH_MAC_CONTEXT + host.encode() + b"\0" + str(epoch).encode(),
                   hashlib.sha256).digest()
    return f"{AGENT_TOKEN_PREFIX}{host}.{epoch}.{_b64(mac)}"


def _b64(mac: bytes) -> str:
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def _epoch_of(text: str) -> int | None:
    """The epoch a token's field spells, in its one canonical form (ASCII digits, no leading zero,
    1..MAX_EPOCH), or None."""
    if not text.isascii() or not text.isdigit() or text[0] == "0" or len(text) > len(str(MAX_EPOCH)):
        return None
    n = int(text)
    return n if n <= MAX_EPOCH else None


class Tokens:
    def __init__(self, entries: dict[str, Caller], agent_secret: bytes | None = None):
        self._by_hash = entries
        self._secret = agent_secret
        # host -> lowest epoch accepted (hosts absent: 0); replaced whole, never changed in place,
        # so the endpoint's loop reads it without a lock while the tick thread refreshes it
        self._min_epochs: dict[str, int] = {}

    def __len__(self) -> int:
        """How many tokens the file lists (derived agent tokens are not counted)."""
        return len(self._by_hash)

    def with_entries_of(self, other: "Tokens") -> "Tokens":
        """A Tokens with `other`'s listed entries and this one's secret and epochs (a reload of the
        tokens file)."""
        fresh = Tokens(other._by_hash, self._secret)
        fresh._min_epochs = self._min_epochs
        return fresh

    def set_min_epochs(self, epochs: dict[str, int]) -> None:
        """The lowest epoch accepted per host, as the store holds it."""
        self._min_epochs = dict(epochs)

    def min_epochs(self) -> dict[str, int]:
        """What set_min_epochs was given last (a sharded coordinator's root hands it to its shards)."""
        return dict(self._min_epochs)

    @classmethod
    def parse(cls, text: str, where: str = "tokens", agent_secret: bytes | None = None) -> "Tokens":
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
                raise AuthError(f"{at}.sha256: expected 64 hex digits, the SHA-256 of the token; make one with "
                                "`printf %s \"$TOKEN\" | sha256sum` (a new token: "
                                "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
            host = it.get("host")
            if role == "agent" and not valid_host(host):
                raise AuthError(f"{at}.host: an agent token speaks for one host, so its entry names it "
                                f"(got {host!r}); or delete the entry and give each agent its own derived token "
                                "with `linkpass coordinator token HOST`")
            if role != "agent" and host is not None:
                raise AuthError(f"{at}.host: only agent entries name a host; a {role} token is not bound to one")
            if digest in out:
                raise AuthError(f"{at}.sha256: the same token is listed twice (also as {out[digest].name!r})")
            out[digest] = Caller(name, role, host)
        return cls(out, agent_secret)

    def caller(self, authorization: str | None) -> Caller | Revoked | None:
        """The caller an `Authorization: Bearer <token>` header names; Revoked if it is an agent
        token whose epoch its host no longer accepts; None if it names nobody."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        token = authorization[7:].strip()
        if token.startswith(AGENT_TOKEN_PREFIX) and self._secret is not None:
            found = self._derived(token)
        else:
            digest = token_hash(token)
            # constant-time compare against every entry: no timing hint of a near miss
            found = None
            for h, c in self._by_hash.items():
                if hmac.compare_digest(h, digest):
                    found = c
        if found is None or found.role != "agent":
            return found
        lowest = self._min_epochs.get(found.host, 0)
        return Revoked(found.host, found.epoch, lowest) if found.epoch < lowest else found

    def _derived(self, token: str) -> Caller | None:
        """A derived agent token's caller (its epoch on it), or None. `lpa1.a.b.c.MAC` reads as host
        `a.b.c` at epoch 0 and, if `c` is an epoch, as host `a.b` at epoch c: the MAC says which."""
        head, _, _ = token[len(AGENT_TOKEN_PREFIX):].rpartition(".")
        candidates = [(head, 0)]
        host, _, field = head.rpartition(".")
        epoch = _epoch_of(field)
        if epoch is not None:
            candidates.append((host, epoch))
        found = None
        for host, epoch in candidates:
            if valid_host(host) and hmac.compare_digest(agent_token(self._secret, host, epoch).encode(),
                                                        token.encode()):
                found = Caller(host, "agent", host, epoch)
        return found


# a listed token's name: a person (alice, alice@example.com) or a system (grafana); the history
# records it as who drained, undrained or decommissioned
TOKEN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}")


def listed_tokens(path: str) -> list[dict]:
    """The tokens file's entries (name, role, host), checked as the coordinator checks them;
    never the hashes."""
    with open(path) as f:
        text = f.read()
    Tokens.parse(text, path)  # refuses what the coordinator would
    return [{"name": e["name"], "role": e["role"], "host": e.get("host")}
            for e in (yaml.safe_load(text) or {})["tokens"]]


def create_listed_token(path: str, name: str, role: str) -> str:
    """A new reader or operator token for `name` (a person, or a system such as grafana), listed in
    the tokens file by its hash; returns the token, which nothing stores."""
    if not isinstance(name, str) or not TOKEN_NAME_RE.fullmatch(name):
        raise AuthError(f"name: {name!r} is not a token name: letters, digits and . _ @ + -, up to 64 "
                        "(a person's, e.g. alice, so the history says who drained)")
    if role not in ("reader", "operator"):
        raise AuthError(f"--role: {role!r}; a listed token is a reader's or an operator's (an agent's token "
                        "comes from `linkpass coordinator token HOST`)")
    with _locked(path):
        with open(path) as f:
            raw = yaml.safe_load(f.read()) or {}
        entries = list(raw.get("tokens") or [])
        if any(e.get("name") == name for e in entries):
            raise AuthError(f"name: {name!r} already has a token; revoke it first (`linkpass coordinator token "
                            f"revoke {name}`) or pick another name")
        token = new_token()
        entries.append({"name": name, "role": role, "sha256": token_hash(token)})
        text = yaml.safe_dump({**raw, "tokens": entries}, sort_keys=False)
        Tokens.parse(text, path)
        write_private(path, text)
    return token


def remove_listed_token(path: str, name: str) -> dict:
    """Remove `name`'s entry from the tokens file (its token is refused from the coordinator's next
    tick on); returns what was removed. The last entry is kept: a file without tokens is refused."""
    with _locked(path):
        with open(path) as f:
            raw = yaml.safe_load(f.read()) or {}
        entries = list(raw.get("tokens") or [])
        gone = [e for e in entries if e.get("name") == name]
        if not gone:
            raise AuthError(f"{name!r} has no listed token (`linkpass coordinator token list` shows them; an agent "
                            f"host's tokens are revoked with `linkpass coordinator token HOST --revoke`)")
        rest = [e for e in entries if e.get("name") != name]
        if not rest:
            raise AuthError(f"{name!r} is the last listed token; make another first (the coordinator refuses a "
                            "tokens file without any)")
        write_private(path, yaml.safe_dump({**raw, "tokens": rest}, sort_keys=False))
    return {"name": name, "role": gone[0].get("role"), "host": gone[0].get("host")}


class _locked:
    """An exclusive lock beside the tokens file: two CLIs editing it at once do not lose an entry."""

    def __init__(self, path: str):
        self.path = f"{path}.lock"

    def __enter__(self):
        import fcntl

        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the lock


def new_token() -> str:
    return secrets.token_urlsafe(32)


def ensure_secret(path: str) -> str:
    """The agent secret at `path`, made (32 random bytes, hex, mode 0600) if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    if not os.path.exists(path):
        write_private(path, secrets.token_hex(32) + "\n")
    return path


def ensure_tokens(directory: str) -> str:
    """The tokens file in `directory`, created with a reader and an operator token if missing;
    returns its path."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, "tokens.yaml")
    if os.path.exists(path):
        return path
    entries = []
    for role in ("reader", "operator"):
        token = new_token()
        write_private(os.path.join(directory, f"{role}.token"), token + "\n")
        entries.append({"name": f"local-{role}", "role": role, "sha256": token_hash(token)})
    write_private(path, yaml.safe_dump({"tokens": entries}, sort_keys=False))
    return path


def read_agent_secret(path: str) -> bytes:
    """The fleet's agent secret: hex text of 32..64 bytes."""
    with open(path) as f:
        text = f.read().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise AuthError(f"{path}: the agent secret is not hex text") from None
    if not 32 <= len(secret) <= 64:
        raise AuthError(f"{path}: the agent secret is {len(secret)} bytes; it must be 32..64 (delete the file to "
                        "have the coordinator make a new one, then hand every agent a new token)")
    return secret


def write_private(path: str, data: str | bytes) -> None:
    """Write a secret file readable by its owner only, atomically (a reader never sees half).
    The file is made new under a name nobody could have planted (mkstemp: O_EXCL, mode 0600, this
    process's owner), then renamed over `path`, which replaces a link there rather than follows it:
    a directory others can write to cannot hand the secret to a file of theirs."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
