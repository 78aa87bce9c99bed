"""File and folder arguments, made absolute where they enter.

A path typed on the command line means "from the folder I am in". The commands hand such paths
on to processes that run elsewhere (the coordinator's Ray actor, agents in their namespaces,
guests) and write them into configs that refuse relative paths, so each is made absolute once,
as argparse reads it (`type=absolute`), and every later use sees the same file."""
from __future__ import annotations

import argparse
import os


def absolute(text: str) -> str:
    """argparse type: `~` expanded, then absolute against the current directory."""
    if not text or not text.strip():
        raise argparse.ArgumentTypeError("expected a file or folder, got an empty string")
    return os.path.abspath(os.path.expanduser(text))
