"""Manual pages in roff (man(7) macros) for `linkpass` and each of its commands, made from the
argparse parser (completion.commands), so a page says what the command accepts today.

    linkpass man | man -l -              the top page
    linkpass man coordinator token       one command's page
    linkpass man --out /usr/local/share/man/man1
"""
from __future__ import annotations

import argparse
import re

from .. import __version__
from .completion import Command, commands
from ..console.output import EXIT_CRITICAL, EXIT_INTERRUPTED, EXIT_MEANING, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING

# the top page's reference sections: what docs/cli.md says at length
_EXIT_WHEN = {  # what each of the shared exit codes (console/output.py) means, at length
    EXIT_OK: "healthy, or the command did what was asked",
    EXIT_WARNING: "something is degraded (a drained or unwatched link, a lossy path), or a --dry-run found the "
                  "change would be refused",
    EXIT_CRITICAL: "a localized fault, a lost agent, a dark path; or a drain the coordinator's guard refused",
    EXIT_UNKNOWN: "the health could not be told: bad usage or config file, the coordinator or agent does not "
                  "answer, TLS failed, the token was refused (HTTP 401/403), or an unexpected error",
}
EXIT_STATUS = [(code, f"{EXIT_MEANING[code]}: {_EXIT_WHEN[code]}") for code in sorted(_EXIT_WHEN)]
EXIT_STATUS.append((EXIT_INTERRUPTED, f"{EXIT_MEANING[EXIT_INTERRUPTED]} (Ctrl-C, SIGTERM)"))
ENVIRONMENT = [
    ("LINKPASS_COORDINATOR", "the coordinator's URL (after --coordinator, before the config file)"),
    ("LINKPASS_TOKEN", "your token itself (after --token-file, before the config file)"),
    ("LINKPASS_CA_FILE", "CA file to verify the coordinator with (after --ca-file)"),
    ("LINKPASS_CERT_FILE, LINKPASS_KEY_FILE", "client certificate and key, for mutual TLS"),
    ("LINKPASS_CONTEXT", "the config file's context to use (after --context)"),
    ("LINKPASS_CONFIG", "the CLI's config file (after --config-file)"),
    ("XDG_CONFIG_HOME", "where the config file and a default token file are looked for (default ~/.config)"),
    ("LINKPASS_STATE_DIR", "the coordinator's state directory, for its local tokens and lab CA "
                           "(default /var/lib/linkpass/coordinator)"),
    ("LINKPASS_DEBUG", "1: show the traceback of an unexpected error, as --debug"),
    ("NO_COLOR", "set: no colour, even on a terminal"),
]
FILES = [
    ("~/.config/linkpass/config.yaml", "coordinator contexts: current-context, and contexts: NAME: coordinator, "
                                       "token-file, ca-file, cert-file, key-file"),
    ("~/.config/linkpass/token", "your token, when no flag, variable or context names one"),
    ("/var/lib/linkpass/coordinator/reader.token, operator.token",
     "on the coordinator's host: the tokens it made for the local CLI"),
]


def esc(text: str) -> str:
    """Text for a roff line: backslashes escaped, hyphens as minus signs (options copy and paste
    right), other than ASCII as named glyphs, and a leading dot or quote made harmless."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    text = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)  # groff's input is ASCII
    return re.sub(r"(^|\n)([.'])", r"\1\\&\2", text)


def _para(text: str) -> str:
    return esc(" ".join(text.split()))


def _file_name(path: tuple[str, ...]) -> str:
    return "-".join(("linkpass", *path))


def _th(cmd: Command) -> str:
    return f'.TH {_file_name(cmd.path).upper()} 1 "" "linkpass {__version__}" "LinkPass manual"\n'


def _usage(parser: argparse.ArgumentParser) -> str:
    """argparse's usage, wrapped at 78 columns whatever the terminal (a page reads the same anywhere)."""
    fmt = parser.formatter_class(prog=parser.prog, width=78)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return ".nf\n" + esc(fmt.format_help().strip("\n")) + "\n.fi\n"


def page(cmd: Command, every: list[Command]) -> str:
    out = [_th(cmd), ".SH NAME\n", f"{esc(_file_name(cmd.path))} \\- {_para(cmd.help or 'LinkPass')}\n",
           ".SH SYNOPSIS\n", _usage(cmd.parser)]
    desc = cmd.parser.description or ""
    if desc:
        out.append(".SH DESCRIPTION\n")
        for block in desc.split("\n\n"):
            out.append((".PP\n" if out[-1] != ".SH DESCRIPTION\n" else "") + _block(block))
    if cmd.subcommands:
        out.append(".SH COMMANDS\n")
        for name, help_ in cmd.subcommands.items():
            out.append(f".TP\n.B {esc(' '.join(('linkpass', *cmd.path, name)))}\n{_para(help_)}\n")
    if cmd.positionals:
        out.append(".SH ARGUMENTS\n")
        for name, help_, _ in cmd.positionals:
            out.append(f".TP\n.I {esc(name)}\n{_para(help_)}\n")
    if cmd.options:
        out.append(".SH OPTIONS\n")
        for o in cmd.options:
            flags = ", ".join(f"\\fB{esc(f)}\\fR" for f in o.flags)
            value = f" \\fI{esc(o.metavar)}\\fR" if o.metavar else ""
            out.append(f".TP\n{flags}{value}\n{_para(o.help)}\n")
    if not cmd.path:
        out.append(".SH EXIT STATUS\n")
        for code, meaning in EXIT_STATUS:
            out.append(f".TP\n.B {code}\n{_para(meaning)}\n")
        out.append(".SH ENVIRONMENT\n")
        out += [f".TP\n.B {esc(name)}\n{_para(what)}\n" for name, what in ENVIRONMENT]
        out.append(".SH FILES\n")
        out += [f".TP\n.I {esc(name)}\n{_para(what)}\n" for name, what in FILES]
    see = sorted({_file_name(c.path) for c in every if c is not cmd and (not c.path or c.path[:-1] == cmd.path)})
    if see:
        out.append(".SH SEE ALSO\n" + ",\n".join(f"\\fB{esc(n)}\\fR(1)" for n in see) + "\n")
    return "".join(out)


def _block(text: str) -> str:
    """A paragraph of a description; an indented block (an example command) stays as it is."""
    lines = text.strip("\n").split("\n")
    if all(line.startswith("    ") or not line.strip() for line in lines):
        return ".RS\n.nf\n" + "\n".join(esc(line[4:]) for line in lines) + "\n.fi\n.RE\n"
    return _para(text) + "\n"


def pages(root: argparse.ArgumentParser) -> dict[str, str]:
    """Every page, by file name (linkpass.1, linkpass-status.1, ...)."""
    every = commands(root)
    return {f"{_file_name(c.path)}.1": page(c, every) for c in every}
