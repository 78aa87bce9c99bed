"""TLS on the coordinator's control path: contexts built from PEM files (the endpoint, http.py,
runs each connection's handshake with the server context). Standard library only (`ssl`), so
agents need nothing more than Python; making certificates is `lab_ca.py`'s.

    build_server_context(cert, key, ca, require_client_cert)   the endpoint: TLS >= 1.2; with
        require_client_cert, a client must show a certificate the CA signed (mutual TLS)
    build_client_context(ca, cert, key)                         agents and the CLI: the server's
        certificate must chain to `ca` (only to it; to the system's trust store without one) and
        name the host or address in the URL; `cert`/`key` are shown when the server asks (mutual TLS)
    certificate_names(peercert)                                 the names a verified client
        certificate gives (its CNs and DNS SANs): with mutual TLS the endpoint lets an agent token
        in only over a certificate that names the token's host (`names_host`)

Errors name the setting that points at the bad file (each caller passes its own names: a config
field, a settings key, a command-line flag) and say how to make a good one.
"""
from __future__ import annotations

import os
import ssl

# the lab CA's layout (lab_ca.py makes it; clients find their files by these names)
SERVER = "coordinator"  # DIR/coordinator.crt and .key: the endpoint's
LOCAL_CLIENT = "cli"  # DIR/cli.crt and .key: the CLI on the coordinator's host, like its local tokens
HANDSHAKE_TIMEOUT_S = 10.0  # a client that connects and never finishes its handshake loses its connection
MAKE_ONE = "make a lab CA with `linkpass tls init --dir DIR` (docs/security.md, TLS set-up)"


class TlsError(ValueError):
    """A TLS file is missing or unusable; the message starts with the setting that names it."""


def lab_paths(directory: str, name: str) -> tuple[str, str]:
    """(certificate, key) of `name` ("ca", SERVER or a client) in a lab CA's directory."""
    return os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")


def lab_dir(state_dir: str) -> str:
    """Where the coordinator keeps its lab CA when it is given no certificate."""
    return os.path.join(state_dir, "tls")


def build_server_context(cert_file: str, key_file: str, ca_file: str | None = None,
                         require_client_cert: bool = False,
                         names: tuple[str, str, str] = ("cert_file", "key_file", "ca_file")) -> ssl.SSLContext:
    """The endpoint's context. `names`: what the caller calls the cert, key and CA settings."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert_file, key_file, names[0], names[1])
    if require_client_cert:
        if not ca_file:
            raise TlsError(f"{names[2]}: required when client certificates are required (the CA that signs "
                           f"the agents' and the CLI's certificates); {MAKE_ONE}")
        _load_ca(ctx, ca_file, names[2])
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def build_client_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                         names: tuple[str, str, str] = ("ca_file", "cert_file", "key_file")) -> ssl.SSLContext:
    """A client's context: the server's certificate is verified (chain and host name) always."""
    if bool(cert_file) != bool(key_file):
        given, missing = (names[1], names[2]) if cert_file else (names[2], names[1])
        raise TlsError(f"{missing}: required with {given} (a client certificate and its private key go together)")
    if ca_file:
        # only this CA: a given ca_file replaces the system's trust store rather than adding to it
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
        _load_ca(ctx, ca_file, names[0])
    else:
        ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        _load_chain(ctx, cert_file, key_file, names[1], names[2])
    return ctx


def mutual(ctx: ssl.SSLContext | None) -> bool:
    """Whether a server context asks every client for a certificate the CA signed."""
    return ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED


def certificate_names(peercert: dict | None) -> frozenset[str]:
    """The subject's common names and the DNS subject alternative names of a client certificate
    the handshake verified (`SSLObject.getpeercert()`); empty without one."""
    if not peercert:
        return frozenset()
    names = {value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"}
    names |= {value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS"}
    return frozenset(names)


def names_host(names: frozenset[str], host: str) -> bool:
    """Whether a certificate with these names speaks for `host`: a CN or DNS SAN equal to it, case
    aside (DNS names are case-blind, and some CAs write them in lower case)."""
    return host.lower() in {n.lower() for n in names}


def _load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str | None, cert_name: str, key_name: str) -> None:
    for name, path in ((cert_name, cert_file), (key_name, key_file)):
        _readable(path, name)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise TlsError(f"{cert_name}/{key_name}: {cert_file} and {key_file} are not a PEM certificate and its "
                       f"private key ({exc.reason or exc}); {MAKE_ONE}") from None


def _load_ca(ctx: ssl.SSLContext, ca_file: str, name: str) -> None:
    _readable(ca_file, name)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TlsError(f"{name}: {ca_file} holds no PEM CA certificate ({exc.reason or exc}); {MAKE_ONE}") from None


def _readable(path: str, name: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TlsError(f"{name}: cannot read {path} ({exc.strerror}); {MAKE_ONE}, or point {name} at your "
                       "own PEM file") from None
