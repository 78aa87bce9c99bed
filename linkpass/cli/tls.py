"""`linkpass tls init`: a lab CA and the certificates the coordinator, its agents and the CLI
need for HTTPS and mutual TLS.

    linkpass tls init --dir /etc/linkpass/tls --hosts h0,h1,h2 --san 198.19.0.1,coord.lab

Idempotent: a valid CA in DIR is kept (--force makes a new one and issues everything again), and
so is every certificate that is still good. Exit 0 done, 3 bad usage or an unusable CA in DIR.
"""
from __future__ import annotations

import argparse
import sys

from ..console.output import EXIT_OK, EXIT_UNKNOWN, error
from ..console.files import absolute


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tls", help="TLS for the coordinator's control path: a lab CA and its certificates")
    tsub = t.add_subparsers(dest="tls_command", metavar="COMMAND")
    i = tsub.add_parser("init", help="make (or keep) a lab CA, the coordinator's certificate and client certificates",
                        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("--dir", required=True, type=absolute, help="where the files go (made 0700; every file 0600)")
    i.add_argument("--hosts", default="", metavar="NAMES",
                   help="agent hosts that get a client certificate (NAME.crt/.key), comma-separated; "
                        "the CLI's `cli` is always made")
    i.add_argument("--san", default="", metavar="NAMES",
                   help="the coordinator's addresses and DNS names, comma-separated (localhost, 127.0.0.1 and ::1 "
                        "are always in)")
    i.add_argument("--force", action="store_true", help="make a new CA even if DIR holds a valid one")
    i.set_defaults(func=run_init)
    t.set_defaults(func=lambda a: (t.print_help(sys.stderr), EXIT_UNKNOWN)[1])


def run_init(args) -> int:
    from ..coordinator import lab_ca
    from ..control.tls import LOCAL_CLIENT, SERVER, lab_paths

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        done = lab_ca.ensure(args.dir, clients=[*hosts, LOCAL_CLIENT], sans=args.san.split(","), force=args.force)
    except lab_ca.LabCaError as exc:
        return error(str(exc))
    for name, what in done.items():
        print(f"{what:8} {lab_paths(args.dir, name)[0]}")
    ca = lab_paths(args.dir, "ca")[0]
    cert, key = lab_paths(args.dir, SERVER)
    print(f"coordinator: linkpass coordinator --tls-cert {cert} --tls-key {key} [--tls-ca {ca} --require-client-cert]")
    print(f"agents: coordinator: {{url: https://..., ca_file: {ca}, cert_file: {lab_paths(args.dir, 'HOST')[0]}, "
          f"key_file: {lab_paths(args.dir, 'HOST')[1]}}}")
    print(f"CLI: --ca-file {ca} (or $LINKPASS_CA_FILE); mutual TLS: --cert-file/--key-file "
          f"{lab_paths(args.dir, LOCAL_CLIENT)[0]} and .key")
    return EXIT_OK
