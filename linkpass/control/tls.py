"""TLS for the control path's clients (agents, the CLI, benchmarks): the client context, built
from PEM files, and the lab CA's file layout. Standard library only (`ssl`), so agents need
nothing more than Python. The coordinator's server context is coordinator/tls.py's; making
certificates is coordinator/lab_ca.py's.

    build_client_context(ca, cert, key)   the server's certificate must chain to `ca` (only to it;
        to the system's trust store without one) and name the host or address in the URL;
        `cert`/`key` are shown when the server asks (mutual TLS)

Errors name the setting that points at the bad file (each caller passes its own names: a config
field, a settings key, a command-line flag) and say how to make a good one.
"""
from __future__ import annotations

import os
import ssl

# the lab CA's layout (lab_ca.py makes it; clients find their files by these names)
SERVER = "coordinator"  # DIR/coordinator.crt and .key: the endpoint's
LOCAL_CLIENT = "cli"  # DIR/cli.crt and .key: the CLI on the coordinator's host, like its local tokens
MAKE_ONE = "make a lab CA with `linkpass tls init --dir DIR` (docs/security.md, TLS set-up)"


class TlsError(ValueError):
    """A TLS file is missing or unusable; the message starts with the setting that names it."""


def lab_paths(directory: str, name: str) -> tuple[str, str]:
    """(certificate, key) of `name` ("ca", SERVER or a client) in a lab CA's directory."""
    return os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")


def lab_dir(state_dir: str) -> str:
    """Where the coordinator keeps its lab CA when it is given no certificate."""
    return os.path.join(state_dir, "tls")


def build_client_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                         names: tuple[str, str, str] = ("ca_file", "cert_file", "key_file")) -> ssl.SSLContext:
    """A client's context: the server's certificate is verified (chain and host name) always."""
    if bool(cert_file) != bool(key_file):
        given, missing = (names[1], names[2]) if cert_file else (names[2], names[1])
        raise TlsError(f"{missing}: required with {given} (a client certificate and its private key go together)")
    if ca_file:
        # only this CA: a given ca_file replaces the system's trust store rather than adding to it
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
        load_ca(ctx, ca_file, names[0])
    else:
        ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file:
        load_chain(ctx, cert_file, key_file, names[1], names[2])
    return ctx


def load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str | None, cert_name: str, key_name: str) -> None:
    for name, path in ((cert_name, cert_file), (key_name, key_file)):
        _readable(path, name)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise TlsError(f"{cert_name}/{key_name}: {cert_file} and {key_file} are not a PEM certificate and its "
                       f"private key ({exc.reason or exc}); {MAKE_ONE}") from None


def load_ca(ctx: ssl.SSLContext, ca_file: str, name: str) -> None:
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
