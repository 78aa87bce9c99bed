"""Every `linkpass ...` command that a message, docstring or fix names exists: an error that
sends on-call to a command the CLI does not have is worse than no hint."""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from linkpass.cli.completion import complete_parser
from linkpass.cli.main import build_parser


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# the runbooks and the CLI's own docs too: on-call runs what they say, at 3 a.m.
DOCS = [os.path.join(ROOT, "docs", name) for name in ("runbooks.md", "cli.md", "coordinator.md")]
# a command line in a docs code block (indented), e.g. "    sudo linkpass man --out DIR  # ..."
CODE_LINE = re.compile(r"^ {4,}(?:sudo )?linkpass ([^\n]+)$", re.M)


def referenced_commands():
    files = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(ROOT, "linkpass")) for n in sorted(names)
             if n.endswith(".py")]
    for path in files + DOCS:
        text = open(path).read()
        for m in re.finditer(r"`linkpass ([^`\n]+)`", text):
            yield os.path.relpath(path, ROOT), m.group(1)
        if path in DOCS:
            for m in CODE_LINE.finditer(text):
                yield os.path.relpath(path, ROOT), m.group(1)


def test_some_commands_are_referenced():
    assert len(list(referenced_commands())) > 20


@pytest.mark.parametrize("where,command", list(referenced_commands()))
def test_referenced_command_exists(where, command):
    if "{args." in command:
        return  # the running command's own name
    # the command alone, without what the shell does with it: pipes, redirections, comments
    command = re.split(r"\s(?:\||&&|2?>|#)(?:\s|$)", command)[0]
    # optional parts (nested too) and placeholders: `paths HOST [PEER]`, `--prefix {prefix}`, `testbed ...`
    text = command
    while re.search(r"\[[^\[\]]*\]", text):
        text = re.sub(r"\[[^\[\]]*\]", "", text)
    text = re.sub(r"\{[^}]*\}", "x", text).replace("...", "")
    try:
        words = shlex.split(text)  # --reason "optic flapping, NET-1234" is one argument
    except ValueError:
        words = text.split()
    # the completion scripts' helper has a parser of its own, outside the CLI's
    parser = complete_parser() if words[:1] == ["__complete"] else build_parser()
    words = words[1:] if words[:1] == ["__complete"] else words
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(words)
    except SystemExit:
        pass
    # missing arguments are the placeholders' business; a word or flag the CLI lacks is not
    assert "invalid choice" not in err.getvalue() and "unrecognized arguments" not in err.getvalue(), \
        f"{where} names `linkpass {command}`: {err.getvalue().strip().splitlines()[-1]}"
