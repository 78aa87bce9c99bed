"""A small certificate authority for labs, the testbed and the embedded default: one CA, the
coordinator's server certificate and a client certificate per agent host (and the CLI).

    DIR/ca.crt, ca.key                  the CA (ECDSA P-256, CA:true, path length 0)
    DIR/coordinator.crt, .key           server auth; SANs: localhost, 127.0.0.1, ::1 and the names
                                        and addresses asked for (e.g. the testbed's management address)
    DIR/<client>.crt, .key              client auth, CN=<client> (mutual TLS)

Every file is written 0600 (atomically) in a 0700 directory. `ensure` is idempotent: a valid CA is
kept unless `force`; a leaf certificate is kept while it is signed by that CA, matches its key, is
valid for more than RENEW_DAYS and (the coordinator's) names every SAN asked for; otherwise it is
issued again (the coordinator's with the SANs it had plus those asked for). A CA that exists but
is not valid is not replaced without `force` (the certificates it signed would stop verifying):
the error says so.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .auth import write_private
from ..control.tls import SERVER, lab_paths as paths

CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_DAYS = 30  # a leaf closer than this to its end is issued again
DEFAULT_SANS = ("localhost", "127.0.0.1", "::1")
RESERVED = {"ca", SERVER}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_DNS = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


class LabCaError(ValueError):
    """Bad input or an existing CA that cannot be used; the message names the option or file and the fix."""


def parse_sans(items, where: str = "--san") -> list[x509.GeneralName]:
    """IP addresses and DNS names, in the order given (duplicates dropped)."""
    out: list[x509.GeneralName] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(text))
        except ValueError:
            if not _DNS.match(text):
                raise LabCaError(f"{where}: {text!r} is neither an IP address nor a DNS name") from None
            name = x509.DNSName(text.lower())
        if name not in out:
            out.append(name)
    return out


def ensure(directory: str, clients=(), sans=(), force: bool = False, now: dt.datetime | None = None,
           where_clients: str = "--hosts", where_sans: str = "--san") -> dict[str, str]:
    """Make or keep the CA, the coordinator's certificate and one per client; returns
    {name: "made" | "kept" | "renewed"} for each. Changes nothing when an argument is bad."""
    now = now or dt.datetime.now(dt.timezone.utc)
    for c in clients:
        if not _NAME.match(str(c)) or c in RESERVED:
            raise LabCaError(f"{where_clients}: {c!r} is not a usable client name (letters, digits, '.', '_', '-'; "
                             f"not {' or '.join(sorted(RESERVED))})")
    wanted = parse_sans([*DEFAULT_SANS, *sans], where_sans)
    done: dict[str, str] = {}
    ca = None if force else _load_ca(directory, now)
    if ca is None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        ca = _make_ca(directory, now)
        done["ca"] = "made"
    else:
        done["ca"] = "kept"
    ca_cert, ca_key = ca
    leaves = [(SERVER, True, wanted)] + [(c, False, []) for c in dict.fromkeys(clients)]
    for name, server, names in leaves:
        state = "made" if done["ca"] == "made" else _leaf_state(directory, name, ca_cert, names, now)
        if state != "kept":
            if server and state == "renewed":  # names asked for before stay: one caller's SANs never drop another's
                names = names + [n for n in _sans_of(paths(directory, name)[0]) if n not in names]
            _issue(directory, name, ca_cert, ca_key, server, names, now)
        done[name] = state
    return done


# ---- the CA -----------------------------------------------------------------------------------
def _load_ca(directory: str, now: dt.datetime):
    """The existing CA (cert, key), None if there is none; LabCaError if it is there but unusable."""
    cert_path, key_path = paths(directory, "ca")
    if not os.path.exists(cert_path) and not os.path.exists(key_path):
        return None
    why = None
    try:
        cert, key = _read(cert_path, key_path)
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        if not bc.ca:
            why = "it is not a CA certificate"
        elif cert.not_valid_after_utc <= now:
            why = f"it expired on {cert.not_valid_after_utc:%Y-%m-%d}"
        elif key.public_key() != cert.public_key():
            why = "ca.key is not the key of ca.crt"
    except (OSError, ValueError, x509.ExtensionNotFound) as exc:
        why = f"it does not load ({getattr(exc, 'strerror', None) or exc})"
    if why:
        raise LabCaError(f"{cert_path}: the CA in {directory} cannot be used: {why}. Pass --force to make a new CA "
                         "(every certificate the old one signed must then be issued again: this command does it)")
    return cert, key


def _make_ca(directory: str, now: dt.datetime):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "LinkPass lab"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "LinkPass lab CA")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    _write(directory, "ca", cert, key)
    return cert, key


# ---- leaves -----------------------------------------------------------------------------------
def _leaf_state(directory: str, name: str, ca_cert, names, now: dt.datetime) -> str:
    """'kept' if the leaf on disk is good as it is; 'made' if missing; 'renewed' otherwise."""
    cert_path, key_path = paths(directory, name)
    if not os.path.exists(cert_path) or not os.path.exists(key_path):
        return "made"
    try:
        cert, key = _read(cert_path, key_path)
        cert.verify_directly_issued_by(ca_cert)
    except (OSError, ValueError, TypeError, InvalidSignature):
        return "renewed"
    if key.public_key() != cert.public_key() or cert.not_valid_after_utc - now < dt.timedelta(days=RENEW_DAYS):
        return "renewed"
    if names:
        try:
            have = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
        except x509.ExtensionNotFound:
            return "renewed"
        if not set(names) <= have:
            return "renewed"
    return "kept"


def _sans_of(cert_path: str) -> list[x509.GeneralName]:
    try:
        with open(cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []


def _issue(directory: str, name: str, ca_cert, ca_key, server: bool, names, now: dt.datetime) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "LinkPass lab"),
                                  x509.NameAttribute(NameOID.COMMON_NAME, name)]))
         .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                      crl_sign=False, content_commitment=False, data_encipherment=False,
                                      key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False))
    if names:
        b = b.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    _write(directory, name, b.sign(ca_key, hashes.SHA256()), key)


# ---- files ------------------------------------------------------------------------------------
def _read(cert_path: str, key_path: str):
    with open(cert_path, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    with open(key_path, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    return cert, key


def _write(directory: str, name: str, cert, key) -> None:
    """Key first, then certificate, each 0600 and atomic: a crash in between leaves a new key beside
    the old certificate, which the next run finds mismatched and issues again."""
    cert_path, key_path = paths(directory, name)
    write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))


