"""The commands that describe the CLI itself: `linkpass completion bash` (or zsh, fish: the scripts
of completion.py) and `linkpass man` (manpage.py's pages), both made from the whole CLI's
parser, which main.py hands in."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from ..console.files import absolute
from ..console.output import EXIT_OK, error
from . import manpage
from .completion import SCRIPTS, SHELLS, commands


def register(sub: argparse._SubParsersAction, root: Callable[[], argparse.ArgumentParser]) -> None:
    """`completion` and `man`; `root` builds the whole CLI's parser, which both describe."""
    c = sub.add_parser("completion", help="shell completion script for bash, zsh or fish",
                       description="Print the completion script for SHELL: subcommands, flags, their choices, files, "
                                   "and link and host names from the coordinator. Install: bash: linkpass "
                                   "completion bash > /etc/bash_completion.d/linkpass (or `source <(linkpass "
                                   "completion bash)` in ~/.bashrc); zsh: linkpass completion zsh > "
                                   "\"${fpath[1]}/_linkpass\"; fish: linkpass completion fish > "
                                   "~/.config/fish/completions/linkpass.fish.")
    c.add_argument("shell", choices=SHELLS)
    c.set_defaults(func=lambda args: run_completion(args, root()))

    m = sub.add_parser("man", help="the manual pages (roff), made from the commands themselves",
                       description="Print the manual page of a command (default: linkpass itself) as roff, to read "
                                   "with `man -l -`; or write every page to DIR (--out) for MANPATH: linkpass.1, "
                                   "linkpass-status.1, linkpass-coordinator-token.1, ...")
    m.add_argument("command", nargs="*", help="the command whose page to print, e.g. status or coordinator token")
    m.add_argument("--out", metavar="DIR", type=absolute, help="write every page into DIR (made if missing) instead")
    m.set_defaults(func=lambda args: run_man(args, root()))


def run_completion(args, root: argparse.ArgumentParser) -> int:
    print(SCRIPTS[args.shell](root), end="")
    return EXIT_OK


def run_man(args, root: argparse.ArgumentParser) -> int:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name, text in manpage.pages(root).items():
            path = os.path.join(args.out, name)
            with open(path, "w") as f:
                f.write(text)
            print(path)
        return EXIT_OK
    want = tuple(args.command)
    for cmd in commands(root):
        if cmd.path == want:
            print(manpage.page(cmd, commands(root)), end="")
            return EXIT_OK
    return error(f"no such command: linkpass {' '.join(want)} (`linkpass --help` lists them)")
