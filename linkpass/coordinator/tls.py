"""TLS at the coordinator's endpoint: the server context built from PEM files (http.py runs each
connection's handshake with it) and what a verified client certificate says. Standard library
only (`ssl`). The clients' context and the lab CA's file layout are control/tls.py's; making
certificates is `lab_ca.py`'s.

    build_server_context(cert, key, ca, require_client_cert)   TLS >= 1.2; with
        require_client_cert, a client must show a certificate the CA signed (mutual TLS)
    certificate_names(peercert)                                 the names a verified client
        certificate gives (its CNs and DNS SANs): with mutual TLS the endpoint lets an agent token
        in only over a certificate that names the token's host (`names_host`)

Errors name the setting that points at the bad file (each caller passes its own names: a config
field, a settings key, a command-line flag) and say how to make a good one.
"""
from __future__ import annotations

import ssl

from ..control.tls import MAKE_ONE, TlsError, load_ca, load_chain

# the lab CA's layout (lab_ca.py makes it; clients find their files by these names)
HANDSHAKE_TIMEOUT_S = 10.0  # a client that connects and never finishes its handshake loses its connection



def build_server_context(cert_file: str, key_file: str, ca_file: str | None = None,
                         require_client_cert: bool = False,
                         names: tuple[str, str, str] = ("cert_file", "key_file", "ca_file")) -> ssl.SSLContext:
    """The endpoint's context. `names`: what the caller calls the cert, key and CA settings."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(ctx, cert_file, key_file, names[0], names[1])
    if require_client_cert:
        if not ca_file:
            raise TlsError(f"{names[2]}: required when client certificates are required (the CA that signs "
                           f"the agents' and the CLI's certificates); {MAKE_ONE}")
        load_ca(ctx, ca_file, names[2])
        ctx.verify_mode = ssl.CERT_REQUIRED
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


