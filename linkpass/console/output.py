"""Rendering for every CLI command: tables for people, JSON/YAML for scripts.

Colour only on a terminal and never when NO_COLOR is set (https://no-color.org).
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Iterable, Sequence

from ..core.states import Level

FORMATS = ("table", "wide", "json", "yaml")

# exit codes shared by all commands, for scripts and monitoring (the Nagios plugin convention);
# docs/cli.md has the table, and tests/unit/test_cli_docs.py holds it to this one
EXIT_OK, EXIT_WARNING, EXIT_CRITICAL, EXIT_UNKNOWN = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM, as a shell reports a process killed by SIGINT
EXIT_MEANING = {EXIT_OK: "ok", EXIT_WARNING: "warning", EXIT_CRITICAL: "critical", EXIT_UNKNOWN: "unknown",
                EXIT_INTERRUPTED: "interrupted"}
# every command's exit code and colour for a health level (`core.states`)
EXIT_OF_LEVEL = {Level.OK: EXIT_OK, Level.WARNING: EXIT_WARNING, Level.CRITICAL: EXIT_CRITICAL}
COLOUR_OF_LEVEL = {Level.OK: "green", Level.WARNING: "yellow", Level.CRITICAL: "red"}

_COLORS = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}


def use_color(stream=sys.stdout) -> bool:
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


def paint(text: str, color: str, stream=sys.stdout) -> str:
    if not use_color(stream):
        return text
    return f"\033[{_COLORS[color]}m{text}\033[0m"


def paint_level(text: str, level: Level | None, stream=sys.stdout) -> str:
    """`text` in the colour of `level`; red when there is no level (a word this code does not know)."""
    return paint(text, COLOUR_OF_LEVEL.get(level, "red"), stream)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(_strip(c)))
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for r in rows:
        lines.append("  ".join(c + " " * (w - len(_strip(c))) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


_SGR = re.compile("\033\\[[0-9;]*m")


def _strip(text: str) -> str:
    """Visible part of a possibly coloured cell."""
    return _SGR.sub("", text)


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (escapes, control characters, bidi
    overrides) shown as its Python escape: text from agents and the coordinator is untrusted, and
    an OSC sequence in a path's reason could set an operator's clipboard or title, or fake a colour."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def printable_doc(doc: Any) -> Any:
    """`doc` (JSON-like) with every string, keys included, made printable()."""
    if isinstance(doc, str):
        return printable(doc)
    if isinstance(doc, dict):
        return {printable_doc(k): printable_doc(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [printable_doc(v) for v in doc]
    return doc


def emit(doc: Any, fmt: str, render_table) -> None:
    """Print `doc` as JSON/YAML (which escape what a terminal would act on), or call
    render_table(doc) -> str for table/wide, with every string of `doc` made printable first."""
    if fmt == "json":
        print(json.dumps(doc, indent=2, default=str))
    elif fmt == "yaml":
        from ..formats import yaml_doc as yaml

        print(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False), end="")
    else:
        print(render_table(printable_doc(doc)))


class CliError(Exception):
    """A failure the command explains in one line on stderr (`linkpass: error: ...`), with the way
    out where one is known; `code` is the exit code (unknown by default: the command could not
    tell how the fleet is)."""

    def __init__(self, message: str, code: int = EXIT_UNKNOWN):
        super().__init__(message)
        self.code = code


def error(message: str, code: int = EXIT_UNKNOWN) -> int:
    """Print `linkpass: error: MESSAGE` on stderr (stdout stays for the output proper, empty on
    error, so `-o json` stays parseable); returns `code`."""
    print(f"{paint('linkpass: error:', 'red', sys.stderr)} {printable(message)}", file=sys.stderr)
    return code


def warn(message: str) -> None:
    print(f"{paint('linkpass: warning:', 'yellow', sys.stderr)} {printable(message)}", file=sys.stderr)
