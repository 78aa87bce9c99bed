"""The class of every parser of the CLI."""
from __future__ import annotations

import argparse

from ..console.output import EXIT_UNKNOWN


class Parser(argparse.ArgumentParser):
    """Every parser of the CLI (`add_subparsers` makes subcommands of the parent's class): a usage
    error exits 3, unknown, never argparse's 2, which scripts and monitoring read as critical."""

    def error(self, message: str):
        self.exit(EXIT_UNKNOWN, f"{self.prog}: error: {message}\n"
                                f"(`{self.prog} --help` lists the arguments)\n")
