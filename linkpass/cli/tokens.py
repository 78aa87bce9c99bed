"""`linkpass coordinator token`: an agent host's token (derived from the fleet's agent secret, at
the host's epoch; --revoke moves the epoch), and people's and systems' listed tokens (create,
list, revoke). Runs where the coordinator's state is; works with the coordinator down.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..console.output import EXIT_OK, error, table, warn
from ..console.files import absolute


def add_token(actions: argparse._SubParsersAction) -> None:
    """`linkpass coordinator token ...`."""
    tk = actions.add_parser("token", help="tokens: an agent host's (token HOST), people's and systems' "
                                          "(token create NAME --role R | list | revoke NAME)",
                            usage="linkpass coordinator token HOST [--out FILE] [--revoke [--reason R]]\n"
                                  "       linkpass coordinator token create NAME --role reader|operator [--out FILE]\n"
                                  "       linkpass coordinator token list [-o table|json]\n"
                                  "       linkpass coordinator token revoke NAME",
                            description="Run where the coordinator's state directory is (--state-dir); works with "
                                        "the coordinator down. `token HOST` derives HOST's agent token from the "
                                        "fleet's agent secret, at HOST's current epoch: it speaks for HOST only; put "
                                        "it in that host's agent token_file, mode 0600. With --revoke every token "
                                        "HOST had so far is refused from now on (the running coordinator within a "
                                        "second) and the new one printed. `token create NAME --role operator` makes "
                                        "a token for a person (or a system, role reader), listed in tokens.yaml by "
                                        "its hash, printed once: drains and decommissions are recorded with NAME. "
                                        "`token list` shows the listed tokens and revoked hosts; `token revoke NAME` "
                                        "removes a listed token (refused from the coordinator's next tick). Exit 0 "
                                        "done, 3 no state, bad name or usage.")
    tk.add_argument("target", nargs="+", metavar="HOST | create NAME | list | revoke NAME",
                    help="an agent host (e.g. h3), or an action on listed tokens").complete = "hosts"
    tk.add_argument("--role", choices=("reader", "operator"), help="with create: what the token may do")
    tk.add_argument("-o", "--output", choices=("table", "json"), default="table", help="with list")
    tk.add_argument("--state-dir", default=None, type=absolute, help="the coordinator's state (default /var/lib/linkpass/coordinator)")
    tk.add_argument("--store", metavar="URL", default=None,
                    help="the coordinator's PostgreSQL store, when it keeps its state there (as its --store)")
    tk.add_argument("--store-password-file", metavar="FILE", type=absolute, default=None, help="that store user's password")
    tk.add_argument("--store-tls-ca", metavar="FILE", type=absolute, default=None, help="that store server's CA (as the coordinator's)")
    tk.add_argument("--store-insecure-plaintext", action="store_true",
                    help="reach that store without TLS (as the coordinator's)")
    tk.add_argument("--out", metavar="FILE", type=absolute, help="write the token to FILE (mode 0600) instead of printing it")
    tk.add_argument("--revoke", action="store_true",
                    help="refuse every earlier token of HOST (stolen, leaked, host rebuilt) and print the new one")
    tk.add_argument("--reason", help="why you revoke (recorded in the history with your user name)")
    tk.set_defaults(func=_token)


def _token(args) -> int:
    """`token HOST`, or the listed tokens' actions (create, list, revoke)."""
    words = args.target
    for flag, given in (("--store-password-file", args.store_password_file), ("--store-tls-ca", args.store_tls_ca),
                        ("--store-insecure-plaintext", args.store_insecure_plaintext or None)):
        if given is not None and args.store is None:
            return error(f"{flag}: only with --store (the SQLite store in --state-dir has no password and no "
                         "connection)")
    if args.store_insecure_plaintext:
        if args.store_tls_ca is not None:
            return error("--store-tls-ca: not used with --store-insecure-plaintext (no TLS to verify); remove one "
                         "of the two")
        warn("PostgreSQL store without TLS (--store-insecure-plaintext): the store's traffic crosses the network "
             "unencrypted")
    if words[0] in ("create", "list", "revoke"):
        return _listed_token(args, words[0], words[1:])
    if len(words) != 1:
        return error(f"token: {' '.join(words)!r}: give one HOST, or `create NAME --role R`, `list`, `revoke NAME`")
    if args.role is not None:
        return error("--role: only with `token create NAME` (an agent host's token has no role to choose)")
    args.host = words[0]
    return _agent_token(args)


def _listed_token(args, action: str, rest: list[str]) -> int:
    from ..coordinator.auth import (AuthError, create_listed_token, listed_tokens, remove_listed_token,
                                    write_private)
    from ..coordinator.startup import DEFAULT_STATE_DIR
    from ..coordinator.store import DB_FILE, StoreError, open_store

    want = {"create": 1, "list": 0, "revoke": 1}[action]
    if len(rest) != want:
        return error(f"token {action}: expected {'NAME' if want else 'no argument'}, got {' '.join(rest) or 'none'}")
    if args.revoke or args.reason:
        return error(f"--revoke/--reason: for an agent host's tokens (`token HOST --revoke`); `token {action}` "
                     "takes neither")
    if action == "create" and args.role is None:
        return error("token create: --role reader or --role operator is required")
    state = args.state_dir or DEFAULT_STATE_DIR
    path = os.path.join(state, "tokens.yaml")
    try:
        if action == "create":
            token = create_listed_token(path, rest[0], args.role)
            if args.out:
                write_private(args.out, token + "\n")
                print(f"wrote {rest[0]}'s {args.role} token to {args.out}")
            else:
                print(token)
            print(f"{rest[0]} may act as {args.role} from the coordinator's next tick; the token is shown once "
                  "(only its hash is kept)", file=sys.stderr)
        elif action == "revoke":
            gone = remove_listed_token(path, rest[0])
            print(f"revoked {gone['name']}'s {gone['role']} token: refused from the coordinator's next tick")
        else:
            rows = listed_tokens(path)
            revoked = {}
            if args.store is not None or os.path.exists(os.path.join(state, DB_FILE)):
                store = open_store(args.store, args.store_password_file, state, tls_ca_file=args.store_tls_ca,
                                   insecure_plaintext=args.store_insecure_plaintext)
                try:
                    revoked = store.agent_epochs()
                finally:
                    store.close()
            doc = {"listed": rows, "agent_hosts_revoked": revoked}
            if args.output == "json":
                print(json.dumps(doc, indent=2))
            else:
                print(table(["name", "role", "host"], [[r["name"], r["role"], r["host"] or "-"] for r in rows]))
                print(f"agent tokens are derived per host; {len(revoked)} host(s) had theirs revoked"
                      + (f": {', '.join(f'{h} (epoch {e})' for h, e in sorted(revoked.items()))}" if revoked else ""))
    except OSError as exc:
        return error(f"{exc.filename or path}: {exc.strerror}; run this where the coordinator keeps its state "
                     "(--state-dir), after it has started once")
    except (AuthError, StoreError) as exc:
        return error(str(exc))
    return EXIT_OK


def _agent_token(args) -> int:
    """Local to the coordinator's host, like issuing: who may revoke is who holds the state
    directory (and so the secret that mints every token), and it works with the coordinator down.
    The revocation goes into the coordinator's store, which the running coordinator reads every
    tick; the token printed is of the host's current epoch."""
    from ..coordinator.auth import MAX_EPOCH, SECRET_FILE, AuthError, agent_token, read_agent_secret, write_private
    from ..coordinator.startup import DEFAULT_STATE_DIR
    from ..coordinator.store import DB_FILE, StoreError, open_store

    if args.reason is not None and not args.revoke:
        return error("--reason: only with --revoke (it says why the host's tokens were revoked)")
    state = args.state_dir or DEFAULT_STATE_DIR
    path, db = os.path.join(state, SECRET_FILE), os.path.join(state, DB_FILE)
    store = None
    try:
        secret = read_agent_secret(path)
        agent_token(secret, args.host)  # the host name is checked before anything is written
        if args.revoke or args.store is not None or os.path.exists(db):
            store = open_store(args.store, args.store_password_file, state, tls_ca_file=args.store_tls_ca,
                               insecure_plaintext=args.store_insecure_plaintext)
        if args.revoke:
            epoch = store.revoke_agent(args.host, _local_user(), args.reason or "revoked by `linkpass coordinator "
                                       "token HOST --revoke`", time.time(), MAX_EPOCH)
        else:
            epoch = store.agent_epochs().get(args.host, 0) if store is not None else 0
        token = agent_token(secret, args.host, epoch)
    except OSError as exc:
        return error(f"{exc.filename or path}: {exc.strerror}; run this where the coordinator keeps its state "
                     "(--state-dir), after it has started once")
    except (AuthError, StoreError) as exc:
        return error(str(exc))
    finally:
        if store is not None:
            store.close()
    if args.out:
        write_private(args.out, token + "\n")
        print(f"wrote the agent token for {args.host} to {args.out}")
    else:
        print(token)
    if args.revoke:
        print(f"revoked every earlier agent token of {args.host} (it is at epoch {epoch} now): the coordinator "
              f"refuses them within a second, and after restarts. Put the new token in {args.host}'s agent "
              "token_file (mode 0600); the agent takes it at its next retry, within 5 s", file=sys.stderr)
    return EXIT_OK


def _local_user() -> str:
    """Who revoked, for the history: the sudo caller if there is one, else this process's user."""
    import getpass

    try:
        user = os.environ.get("SUDO_USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, no login name
        user = f"uid {os.getuid()}"
    return f"{user} (local)"
