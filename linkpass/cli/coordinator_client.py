"""The CLI's connection to the coordinator: where it is and who you are to it (flags, environment,
the config file's context: settings.py), the client made from them, and one line on stderr for
each way a call can fail, with the exit code it means (3 unknown; 2 for a write the
coordinator's guard refused).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ..core.constants import COORDINATOR_URL
from ..console.output import EXIT_CRITICAL, EXIT_UNKNOWN, FORMATS, error, paint, warn
from ..console.files import absolute
from ..control.errors import FORBIDDEN, REFUSED, UNAUTHENTICATED


def output_args(p: argparse.ArgumentParser, watch: bool = True) -> None:
    """The arguments of every command that asks the coordinator: -o, where it is and who you are,
    and (for reads) --watch."""
    p.add_argument("-o", "--output", choices=FORMATS, default="table", metavar="FORMAT",
                   help="table (default), wide (more columns), json or yaml: a document on stdout, "
                        "errors on stderr")
    client_args(p)
    if watch:
        p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                       help="redraw every SECONDS (default 2) until Ctrl-C")


def client_args(p: argparse.ArgumentParser, for_what: str = "") -> None:
    """Where the coordinator is and who you are to it: flag, else environment, else the config
    file's context, else the default (settings.py)."""
    p.add_argument("--coordinator", metavar="URL", help=f"coordinator endpoint{for_what} (default "
                                                        "$LINKPASS_COORDINATOR, the context's, or "
                                                        f"{COORDINATOR_URL})")
    p.add_argument("--token-file", metavar="FILE", type=absolute, help="file holding your token (default: $LINKPASS_TOKEN, "
                                                        "the context's token-file, ~/.config/linkpass/token, or on "
                                                        "the coordinator's host its reader.token)")
    p.add_argument("--context", metavar="NAME", help="a context of the config file: its coordinator, token and "
                                                     "TLS files (default $LINKPASS_CONTEXT or current-context)")
    p.add_argument("--config-file", metavar="FILE", type=absolute, help="the CLI's config file (default $LINKPASS_CONFIG or "
                                                         "~/.config/linkpass/config.yaml)")
    tls_args(p)


def tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-file", metavar="FILE", type=absolute, help="CA the coordinator's certificate must chain to (default "
                                                     "$LINKPASS_CA_FILE, the context's; on its host its lab CA; "
                                                     "else the system's)")
    p.add_argument("--cert-file", metavar="FILE", type=absolute, help="your client certificate, for mutual TLS (default "
                                                       "$LINKPASS_CERT_FILE, the context's)")
    p.add_argument("--key-file", metavar="FILE", type=absolute, help="its private key (default $LINKPASS_KEY_FILE, the context's)")
    p.add_argument("--insecure-http", action="store_true",
                   help="allow an http:// coordinator URL (your token crosses the network in cleartext)")


# ---- plumbing ---------------------------------------------------------------------------
def make_client(args, timeout_s: float = 5.0):
    """A client for the coordinator the settings name (flag > environment > context > default);
    raises ValueError (settings.ConfigError, tls.TlsError, Usage) with a one-line reason."""
    from ..control.tokens import read_token
    from ..control.client import Client
    from ..control.tls import build_client_context
    from .settings import from_args

    s = from_args(args)
    token = s.token.value
    if s.token_file.value:
        try:
            token = read_token(s.token_file.value)
        except OSError as exc:
            raise Usage(f"{_label(s.token_file, '--token-file')} {s.token_file.value}: cannot read it "
                         f"({exc.strerror})") from None
    url = s.coordinator.value
    insecure = bool(getattr(args, "insecure_http", False))
    tls = None
    if not url.startswith("http://"):
        tls = build_client_context(s.ca_file.value, s.cert_file.value, s.key_file.value,
                                   names=(_label(s.ca_file, "--ca-file"), _label(s.cert_file, "--cert-file"),
                                          _label(s.key_file, "--key-file")))
    client = Client(url, token, timeout_s=timeout_s, tls=tls, insecure_http=insecure)
    client.settings = s  # where each setting came from, for the hints of a failure
    if client.tls is None:
        warn(f"plain HTTP to {url} (--insecure-http): your token crosses the network in cleartext")
    return client


def _label(setting, flag: str) -> str:
    """How a message names a setting: the flag, the variable or the context it came from."""
    return flag if setting.source in (flag, "default") else setting.source


class Usage(ValueError):
    pass


def call(args, fn, write: bool = False):
    """Run fn(client) -> exit code, turning the usual failures into one line on stderr each.
    Whatever fails, the fleet's health is unknown (3); only a write (`write`) the coordinator
    refused on purpose (409: its blast-radius guard, a stranded host pair) is critical (2): what
    on-call asked for did not happen, for a reason about the fleet."""
    from ..control.client import AnswerTooLarge, Refusal, TlsFailure, Unreachable

    try:
        client = make_client(args)
    except ValueError as exc:  # settings.ConfigError, tls.TlsError, Usage, a malformed URL
        return error(str(exc))
    try:
        return fn(client)
    except (TlsFailure, AnswerTooLarge) as exc:
        return error(str(exc))
    except Unreachable as exc:
        return error(f"{exc}; {_where_hint(client.settings)}")
    except Refusal as exc:
        if exc.kind in (UNAUTHENTICATED, FORBIDDEN):
            return error(f"refused (HTTP {exc.status}): {exc}{_auth_hint(exc, client.settings)}")
        if write and exc.kind == REFUSED:
            return error(f"{paint('refused:', 'red', sys.stderr)} {exc} (HTTP 409)", EXIT_CRITICAL)
        return error(f"{exc} (HTTP {exc.status})")
    finally:
        client.close()


def _where_hint(s) -> str:
    source = ("the default address" if s.coordinator.source == "default"
              else f"the address is from {s.coordinator.source}")
    return (f"{source}. Is the coordinator running (`linkpass coordinator`)? Point at it with --coordinator, "
            "$LINKPASS_COORDINATOR or a context (--context)")


def _auth_hint(exc, s) -> str:
    """What to do about a refused token, naming where this one came from and files that exist."""
    reader, operator = os.path.join(s.state_dir, "reader.token"), os.path.join(s.state_dir, "operator.token")
    if exc.kind == FORBIDDEN and exc.doc.get("needs_role") == "operator":
        return (f"; {s.token_source()}; this needs an operator token: --token-file {operator} on the "
                "coordinator's host, or an operator entry of its tokens.yaml (docs/security.md, Roles and tokens)")
    if exc.kind == UNAUTHENTICATED:
        return (f"; {s.token_source()}; give a valid one with --token-file FILE, $LINKPASS_TOKEN or a context's "
                f"token-file: on the coordinator's host, {reader} (reads) or {operator} (drain, undrain, "
                "decommission)")
    return ""


def watch(args, fn) -> int:
    if not getattr(args, "watch", None):
        return call(args, lambda c: fn(args, c, time.time()))
    code = EXIT_UNKNOWN
    try:
        while True:
            if sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            code = call(args, lambda c: fn(args, c, time.time()))
            if args.output in ("table", "wide"):  # JSON and YAML stay documents only
                print(paint(f"every {args.watch:g} s, Ctrl-C to stop - {time.strftime('%H:%M:%S')}", "dim"))
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code
