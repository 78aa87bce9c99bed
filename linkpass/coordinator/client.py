"""A small HTTP/JSON client for the coordinator's endpoint (agents, CLI, benchmark).

One persistent connection (keep-alive), re-opened after an error. Errors say whether the
coordinator was unreachable (Unreachable) or answered with a refusal (Refusal: status + its
message, which is written for the person reading it).
"""
from __future__ import annotations

import http.client
import json
import os
from urllib.parse import urlencode, urlparse

from .auth import read_token
from ..core.constants import COORDINATOR_URL
from .runner import DEFAULT_STATE_DIR


class Unreachable(ConnectionError):
    pass


class Refusal(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Client:
    def __init__(self, url: str, token: str | None, timeout_s: float = 5.0):
        u = urlparse(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"coordinator URL must look like http://HOST:PORT, got {url!r}")
        self.url = url
        self.host, self.port = u.hostname, u.port or 80
        self.token = token
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get(self, path: str, **params):
        q = {k: v for k, v in params.items() if v is not None}
        return self._call("GET", path + (f"?{urlencode(q)}" if q else ""), None)

    def post(self, path: str, body: dict):
        return self._call("POST", path, json.dumps(body).encode())

    def post_raw(self, path: str, payload: bytes, token: str | None = None):
        """POST an already encoded JSON body (as `token`'s holder, default the client's own)."""
        return self._call("POST", path, payload, token)

    def _call(self, method: str, path: str, payload: bytes | None, token: str | None = None):
        headers = {"Content-Type": "application/json"}
        if token or self.token:
            headers["Authorization"] = f"Bearer {token or self.token}"
        for attempt in (0, 1):  # a kept-alive connection the server closed: one fresh retry
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                self._conn.request(method, path, body=payload, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt or not isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError,
                                                   ConnectionResetError)):
                    raise Unreachable(f"coordinator at {self.url} does not answer ({exc})") from None
        try:
            doc = json.loads(data) if data else None
        except ValueError:
            doc = None
        if resp.status >= 400:
            msg = doc.get("error") if isinstance(doc, dict) else data[:200].decode(errors="replace")
            raise Refusal(resp.status, msg or f"HTTP {resp.status}")
        return doc if doc is not None else data


def cli_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("LINKPASS_COORDINATOR") or COORDINATOR_URL


def cli_token(explicit_file: str | None = None) -> str | None:
    """The caller's token: $LINKPASS_TOKEN, --token-file, ~/.config/linkpass/token, or on the
    coordinator's own host the local read-only token (drains need an operator token)."""
    if os.environ.get("LINKPASS_TOKEN"):
        return os.environ["LINKPASS_TOKEN"].strip()
    for path in (explicit_file, os.path.expanduser("~/.config/linkpass/token"),
                 os.path.join(os.environ.get("LINKPASS_STATE_DIR", DEFAULT_STATE_DIR), "reader.token")):
        if path and os.path.exists(path):
            return read_token(path)
    return None
