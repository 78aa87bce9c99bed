"""README.md is the front door: short, its first commands the two that set everything up, every
link in it (and in docs/status.md and docs/benchmarks/README.md) pointing at something in the
repository, no document pointing outside the repository, and every benchmark JSON the figures
are quoted from present."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCH = ROOT / "docs" / "benchmarks" / "README.md"
STATUS = ROOT / "docs" / "status.md"
ALL_DOCS = [README] + sorted((ROOT / "docs").rglob("*.md"))
MAX_README_BYTES = 8192

# [text](target) and ![alt](target); the target up to whitespace or ")"
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# a bare mention of a document by its path from the root: docs/x.md, docs/benchmarks/README.md
BARE_DOC = re.compile(r"(?<![\w./-])(docs/[\w./-]*\w\.md)\b")
# a path that climbs: ../x, ../../x
UP_PATH = re.compile(r"(?<![\w.])((?:\.\./)+[\w.~/-]*)")
# a JSON document: 2026-11-30/demo.json, docs/benchmarks/..., sim/linkpass_sim/data/...
JSON_NAME = re.compile(r"(?<![\w./-])([\w][\w./-]*\.json)\b")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))  # http:, https:, mailto:


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def broken_links(path: Path) -> list[str]:
    """Relative links and bare docs/... mentions in `path` whose file (or heading) is missing."""
    text = path.read_text()
    bad = []
    for m in MD_LINK.finditer(text):
        target = m.group(1)
        if is_external(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading with that anchor)")
    for m in BARE_DOC.finditer(text):
        if not (ROOT / m.group(1)).is_file():
            bad.append(f"{m.group(1)} (no such file)")
    return bad


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, \
        f"README.md is {size} bytes (at most {MAX_README_BYTES}): move detail into docs/ and link it"


def test_readme_first_code_block_is_the_two_commands():
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(), re.M | re.S)
    assert blocks, "README.md has no code block"
    commands = [line.split("#", 1)[0].strip() for line in blocks[0].splitlines()]
    commands = [c for c in commands if c]
    assert commands[:2] == ["make demo", "make test"], \
        f"README.md's first code block must start with `make demo` and `make test`, not {commands[:2]}"


@pytest.mark.parametrize("path", [README, STATUS, BENCH], ids=rel)
def test_links_point_at_files_that_exist(path):
    assert path.is_file(), f"{rel(path)} is missing"
    bad = broken_links(path)
    assert not bad, f"{rel(path)} links to what is not in the repository: {bad}"


def test_readme_indexes_every_document():
    text = README.read_text()
    missing = [rel(p) for p in sorted((ROOT / "docs").glob("*.md")) if f"({rel(p)})" not in text]
    assert not missing, f"README.md's documentation list lacks {missing}"


@pytest.mark.parametrize("path", ALL_DOCS, ids=rel)
def test_no_reference_outside_the_repository(path):
    text = path.read_text()
    bad = []
    if "../shared" in text:
        bad.append("../shared")
    if re.search(r"workplace", text, re.I):
        bad.append("'workplace'")
    for m in UP_PATH.finditer(text):
        dest = (path.parent / m.group(1)).resolve()
        if dest != ROOT and ROOT not in dest.parents:
            bad.append(m.group(1))
    for m in MD_LINK.finditer(text):
        target = m.group(1).partition("#")[0]
        if target and not is_external(target):
            dest = (path.parent / target).resolve()
            if dest != ROOT and ROOT not in dest.parents:
                bad.append(target)
    assert not bad, f"{rel(path)} refers outside the repository: {sorted(set(bad))}"


def named_json_files() -> list[str]:
    return sorted(set(JSON_NAME.findall(BENCH.read_text())))


def test_benchmark_tables_name_their_json():
    assert len(named_json_files()) >= 10


@pytest.mark.parametrize("name", named_json_files())
def test_every_named_benchmark_json_exists(name):
    # docs/... and sim/... from the repository root, the rest (2026-11-30/demo.json) from docs/benchmarks/
    base = ROOT if name.split("/", 1)[0] in ("docs", "sim") else BENCH.parent
    assert (base / name).is_file(), f"docs/benchmarks/README.md names {name}, which does not exist"


def readme_commands() -> list[str]:
    text = README.read_text()
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            m = re.match(r"^\s*(?:sudo\s+)?linkpass\s+(.+)$", line)
            if m:
                found.append(re.split(r"\s#", m.group(1))[0].strip())
    found += re.findall(r"`(?:[^`\n]*\s)?linkpass ([^`\n]+)`", text)
    return found


def test_readme_names_commands():
    assert len(readme_commands()) >= 8


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_exists(command):
    from linkpass.cli.main import build_parser

    command = re.split(r"\s(?:\||&&|2?>|#)(?:\s|$)", command)[0]
    while re.search(r"\[[^\[\]]*\]", command):
        command = re.sub(r"\[[^\[\]]*\]", "", command)
    command = command.replace("...", "")
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(words)
    except SystemExit:
        pass
    assert "invalid choice" not in err.getvalue() and "unrecognized arguments" not in err.getvalue(), \
        f"README.md names `linkpass {command}`: {err.getvalue().strip().splitlines()[-1]}"
