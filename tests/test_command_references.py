"""Every `linkpass ...` command that a message, docstring or fix names exists: an error that
sends on-call to a command the CLI does not have is worse than no hint."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from linkpass.cli.main import build_parser

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# the runbooks too: on-call runs what they say, at 3 a.m.
DOCS = [os.path.join(ROOT, "docs", "runbooks.md")]


def referenced_commands():
    files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(ROOT, "linkpass")) for n in sorted(names)
             if n.endswith(".py")]
    for path in files + DOCS:
        for m in re.finditer(r"`linkpass ([^`\n]+)`", open(path).read()):
            yield os.path.relpath(path, ROOT), m.group(1)


def test_some_commands_are_referenced():
    assert len(list(referenced_commands())) > 20


@pytest.mark.parametrize("where,command", list(referenced_commands()))
def test_referenced_command_exists(where, command):
    if "{args." in command:
        return  # the running command's own name
    # optional parts and placeholders: `paths HOST [PEER]`, `--prefix {prefix}`, `testbed ...`
    text = re.sub(r"\{[^}]*\}", "x", re.sub(r"\[[^\]]*\]", "", command)).replace("...", "")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(text.split())
    except SystemExit:
        pass
    # missing arguments are the placeholders' business; a word or flag the CLI lacks is not
    assert "invalid choice" not in err.getvalue() and "unrecognized arguments" not in err.getvalue(), \
        f"{where} names `linkpass {command}`: {err.getvalue().strip().splitlines()[-1]}"
