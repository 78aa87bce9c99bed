"""What the CLI says about itself: every command's --help renders clean, and the completion
scripts and manual pages made from the parser are valid and complete."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from linkpass.cli import completion, manpage
from linkpass.cli.main import build_parser


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = completion.commands(build_parser())
# a path into the source tree means nothing to someone who installed the package
SOURCE_PATH = re.compile(r"(?<![\w/.~-])(?:see )?linkpass/[\w/]+(?:\.py)?\b")


def _help(cmd) -> str:
    return cmd.parser.format_help()


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c.path) or "linkpass")
def test_every_help_renders_without_format_leftovers(cmd, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width: the usual one
    text = _help(cmd)
    assert "%%" not in text and "%(" not in text, text
    assert not re.search(r"\n\s*%", text), "a unit wrapped away from its number"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c.path) or "linkpass")
def test_no_help_points_into_the_source_tree(cmd):
    found = SOURCE_PATH.findall(_help(cmd))
    assert not found, found


def test_the_walk_sees_every_command_and_hides_the_helper():
    names = {" ".join(c.path) for c in COMMANDS}
    assert {"", "status", "agents", "links", "paths", "events", "drain", "undrain", "coordinator",
            "coordinator token", "coordinator decommission", "tls init", "testbed up", "completion", "man"} <= names
    assert not any("__complete" in n for n in names)


# ---- completion --------------------------------------------------------------------------------
def script(shell: str, tmp_path) -> str:
    path = tmp_path / f"linkpass.{shell}"
    path.write_text(completion.SCRIPTS[shell](build_parser()))
    return str(path)


def test_bash_completion_is_valid_and_names_every_command(tmp_path):
    path = script("bash", tmp_path)
    out = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    text = open(path).read()
    for cmd in COMMANDS:
        for name in cmd.subcommands:
            assert re.search(rf"echo '[^']*\b{re.escape(name)}\b", text), name
        for opt in cmd.options:
            assert all(f in text for f in opt.flags), opt.flags


def complete_in_bash(tmp_path, line: str) -> list[str]:
    """What Tab offers after `line` in bash, with a `linkpass` on PATH that answers `__complete`
    like a coordinator with hosts h0, h1 and links p0l0-p0s0, h1-p0l0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "linkpass"
    stub.write_text('#!/bin/sh\n[ "$1" = __complete ] || exit 3\n'
                    'case "$2" in hosts) printf "h0\\nh1\\n";; links) printf "p0l0-p0s0\\nh1-p0l0\\n";; esac\n'
                    'echo "$@" > "$(dirname "$0")/last-args"\n')
    stub.chmod(0o755)
    words = line.split(" ")
    program = (f"source {script('bash', tmp_path)}\n"
               f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
               "_linkpass; printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    return [w for w in out.stdout.splitlines() if w]


@pytest.mark.parametrize("line,want", [
    ("linkpass st", ["status"]),
    ("linkpass coordinator ", ["token", "openapi", "decommission"]),
    ("linkpass coordinator to", ["token"]),
    ("linkpass status --out", ["--output"]),
    ("linkpass status -o ", ["table", "wide", "json", "yaml"]),
    ("linkpass links -o j", ["json"]),
    ("linkpass completion ", ["bash", "zsh", "fish"]),
    ("linkpass drain ", ["p0l0-p0s0", "h1-p0l0"]),
    ("linkpass drain --reason x p0", ["p0l0-p0s0"]),
    ("linkpass paths ", ["h0", "h1"]),
    ("linkpass paths h0 h", ["h0", "h1"]),
    ("linkpass coordinator token h", ["h0", "h1"]),
    ("linkpass coordinator decommission --reason gone ", ["h0", "h1"]),
    ("linkpass status ", []),
])
def test_bash_completes_commands_flags_choices_and_names(tmp_path, line, want):
    assert sorted(complete_in_bash(tmp_path, line)) == sorted(want)


def test_bash_passes_the_connection_flags_to_the_name_helper(tmp_path):
    complete_in_bash(tmp_path, "linkpass drain --context prod --coordinator https://c:9470 ")
    assert (tmp_path / "bin" / "last-args").read_text().split() == [
        "__complete", "links", "--context", "prod", "--coordinator", "https://c:9470"]


def test_bash_completes_files_for_file_flags(tmp_path):
    (tmp_path / "ops.token").write_text("x")
    assert "ops.token" in complete_in_bash(tmp_path, "linkpass status --token-file op")


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_completion_are_valid(tmp_path, shell):
    path = script(shell, tmp_path)
    text = open(path).read()
    for cmd in COMMANDS:
        for name in cmd.subcommands:
            assert name in text
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed: only the structure was checked")
    out = subprocess.run([shell, "-n", path], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_fish_completes_subcommands_and_choices(tmp_path):
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed")
    path = script("fish", tmp_path)

    def offers(line: str) -> list[str]:
        out = subprocess.run(["fish", "--no-config", "-c", f"source {path}; complete -C '{line}'"],
                             capture_output=True, text=True, timeout=30, env={**os.environ, "HOME": str(tmp_path)})
        assert out.returncode == 0, out.stderr
        return [w.split("\t")[0] for w in out.stdout.splitlines()]

    assert "token" in offers("linkpass coordinator ") and "status" not in offers("linkpass coordinator ")
    assert set(offers("linkpass status -o ")) == {"table", "wide", "json", "yaml"}
    assert "--output" in offers("linkpass links --")


def test_zsh_completes_subcommands_and_choices(tmp_path):
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    path = script("zsh", tmp_path)
    # stand-ins for the completion system's functions: they print what would be offered
    program = f"""
compdef() {{ :; }}
_describe() {{ local n=${{@[-1]}}; local -a items; items=("${{(@P)n}}"); print -l -- ${{items%%:*}}; }}
compadd() {{ shift; print -l -- "$@"; }}
_files() {{ print FILES; }}
source {path}
probe() {{ words=("$@"); CURRENT=$#; PREFIX="${{words[CURRENT]}}"; _linkpass; print -- ---; }}
probe linkpass coordinator ''
probe linkpass status -o ''
probe linkpass status --token-file ''
probe linkpass st
"""
    out = subprocess.run(["zsh", "-f", "-c", program], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    coordinator, output, token_file, top = out.stdout.split("---\n")[:4]
    assert set(coordinator.split()) == {"token", "openapi", "decommission"}
    assert set(output.split()) == {"table", "wide", "json", "yaml"}
    assert token_file.split() == ["FILES"]
    assert "status" in top.split() and "agents" in top.split()


# ---- man pages ---------------------------------------------------------------------------------
def test_man_pages_cover_every_command_and_render(tmp_path):
    pages = manpage.pages(build_parser())
    assert set(pages) == {"-".join(("linkpass", *c.path)) + ".1" for c in COMMANDS}
    top = pages["linkpass.1"]
    for section in ("NAME", "SYNOPSIS", "COMMANDS", "OPTIONS", "EXIT STATUS", "ENVIRONMENT", "FILES"):
        assert f".SH {section}\n" in top
    assert "\\fB\\-\\-output\\fR" in pages["linkpass-status.1"]
    groff = shutil.which("groff")
    if groff is None:
        pytest.skip("groff is not installed: only the structure was checked")
    for name, text in pages.items():
        out = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z"], input=text, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0 and not out.stderr, f"{name}: {out.stderr}"
    shown = subprocess.run([groff, "-man", "-Tutf8"], input=pages["linkpass-drain.1"], capture_output=True,
                           text=True, timeout=30, env={**os.environ, "GROFF_NO_SGR": "1"}).stdout
    plain = re.sub(r".\x08", "", shown)
    assert "--reason" in plain and "EXIT" not in plain.split("OPTIONS")[0].split("DESCRIPTION")[0]


def test_man_command_prints_a_page_or_writes_them_all(tmp_path, capsys):
    from linkpass.cli.main import main

    assert main(["man", "coordinator", "token"]) == 0
    assert capsys.readouterr().out.startswith(".TH LINKPASS-COORDINATOR-TOKEN 1")
    assert main(["man", "--out", str(tmp_path / "man1")]) == 0
    written = capsys.readouterr().out.split()
    assert str(tmp_path / "man1" / "linkpass-agents.1") in written and len(written) == len(COMMANDS)
    assert main(["man", "no", "such"]) == 3
    assert "no such command" in capsys.readouterr().err
