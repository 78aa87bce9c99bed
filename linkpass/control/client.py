"""A small HTTP/JSON client for the coordinator's endpoint (agents, CLI, benchmark).

HTTPS by default: the server's certificate is verified against the context's CA (tls.py). A
plain http:// URL is refused unless the caller asks for it (`insecure_http`), since the token
would cross the network in cleartext. One persistent connection (keep-alive), re-opened after an
error. Errors say whether the coordinator was unreachable (Unreachable; TlsFailure when the TLS
handshake failed) or answered with a refusal (Refusal: status + its message, which is written for
the person reading it).
"""
from __future__ import annotations

import http.client
import json
import ssl
from urllib.parse import urlencode, urlparse


class Unreachable(ConnectionError):
    pass


class TlsFailure(Unreachable):
    """The TLS handshake failed: an untrusted or misnamed server certificate, or the server wanted
    a client certificate."""


class AnswerTooLarge(Unreachable):
    """The coordinator's answer was larger than the client accepts (`max_answer_bytes`)."""


# a whole plan for the largest fleet, or 10 000 events, is a few MB; far more is a broken or hostile server
MAX_ANSWER_BYTES = 64 << 20


class Refusal(RuntimeError):
    """The coordinator answered with a refusal: `status`, its message (for a person) and, when it
    names one, its `kind` (control/errors.py; what a program matches); `doc`, the answer's other
    fields (a role refusal's `needs_role`)."""

    def __init__(self, status: int, message: str, kind: str | None = None, doc: dict | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.doc = doc or {}


class Moved(Refusal):
    """307/308: this endpoint sends the caller elsewhere (a sharded coordinator's agents to their
    shard); `url` is where, as the Location header says."""

    def __init__(self, status: int, message: str, url: str | None):
        super().__init__(status, message)
        self.url = url


class Client:
    def __init__(self, url: str, token: str | None, timeout_s: float = 5.0, tls: ssl.SSLContext | None = None,
                 insecure_http: bool = False, max_answer_bytes: int = MAX_ANSWER_BYTES):
        """`tls`: the context to verify the server with (tls.build_client_context; default: the
        system's trust store). `insecure_http`: allow an http:// URL. An answer longer than
        `max_answer_bytes` is not read into memory: AnswerTooLarge."""
        u = urlparse(url)
        if u.scheme not in ("https", "http") or not u.hostname:
            raise ValueError(f"coordinator URL must look like https://HOST:PORT, got {url!r}")
        if u.scheme == "http" and not insecure_http:
            raise ValueError(f"coordinator URL {url} is plain HTTP: the token would cross the network in cleartext. "
                             "Use https://HOST:PORT, or allow plain HTTP explicitly (--insecure-http; "
                             "insecure_http: true in the agent's coordinator section)")
        self.url = url
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.tls = (tls or ssl.create_default_context()) if u.scheme == "https" else None
        self.token = token
        self.timeout_s = timeout_s
        self.max_answer_bytes = max_answer_bytes
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
                self._conn = (http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s) if self.tls is None
                              else http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                                               context=self.tls))
            try:
                self._conn.request(method, path, body=payload, headers=headers)
                resp = self._conn.getresponse()
                data = self._read_bounded(resp)
                break
            except AnswerTooLarge:
                self.close()
                raise
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if attempt or not isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError,
                                                   ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                    if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError):
                        why = ": ".join(str(x) for x in (exc.reason, getattr(exc, "verify_message", None)) if x)
                        raise TlsFailure(f"TLS with the coordinator at {self.url} failed ({why or exc}): check "
                                         "the CA file (--ca-file, coordinator.ca_file) and, if it requires client "
                                         "certificates, the certificate and key") from None
                    raise Unreachable(f"coordinator at {self.url} does not answer ({exc})") from None
        try:
            doc = json.loads(data) if data else None
        except ValueError:
            doc = None
        if resp.status >= 400 or resp.status in (307, 308):
            msg = doc.get("error") if isinstance(doc, dict) else data[:200].decode(errors="replace")
            if resp.status in (307, 308):
                raise Moved(resp.status, msg or f"HTTP {resp.status}", resp.getheader("Location"))
            kind = doc.get("kind") if isinstance(doc, dict) and isinstance(doc.get("kind"), str) else None
            rest = {k: v for k, v in doc.items() if k not in ("error", "kind")} if isinstance(doc, dict) else None
            raise Refusal(resp.status, msg or f"HTTP {resp.status}", kind, rest)
        return doc if doc is not None else data

    def _read_bounded(self, resp) -> bytes:
        declared = resp.getheader("Content-Length")
        if declared and declared.isascii() and declared.isdigit() and int(declared) > self.max_answer_bytes:
            raise AnswerTooLarge(f"coordinator at {self.url} announced a {int(declared)}-byte answer, more than the "
                                 f"{self.max_answer_bytes} this client reads: not read (a broken or hostile server?)")
        data = resp.read(self.max_answer_bytes + 1)
        if len(data) > self.max_answer_bytes:
            raise AnswerTooLarge(f"coordinator at {self.url} sent more than {self.max_answer_bytes} bytes: "
                                 "dropped (a broken or hostile server?)")
        return data
