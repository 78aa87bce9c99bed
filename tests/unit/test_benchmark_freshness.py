"""Quoted figures stay true to the code: a benchmark JSON that README.md or docs/ quote, run before
a later change to the code that benchmark measures (its script's MEASURES), is stale, and the
paragraph or table row that names it must say so ("stale") until the benchmark is re-run. Which
commit a JSON ran on: the `commit` it records (sim/linkpass_sim/report.py), unless the tree was
dirty; else the commit that last changed the file. Needs the repository's history: skipped in a
shallow clone or outside git, loudly."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
# a run's JSON as docs name it: "2026-12-05/failover.json", also after "benchmarks/" or
# "docs/benchmarks/" (not inside another path)
JSON_REF = re.compile(r"(?:(?<=benchmarks/)|(?<![\w/.-]))(20\d\d-\d\d-\d\d)/([\w.-]+\.json)")


def git(root: Path, *args: str) -> str | None:
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else None


def measures(root: Path, benchmark: str) -> tuple[str, ...]:
    """The MEASURES tuple of sim/bench/<benchmark>.py, read without running the script."""
    tree = ast.parse((root / "sim" / "bench" / f"{benchmark}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MEASURES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"sim/bench/{benchmark}.py has no MEASURES")


def ran_on(root: Path, path: Path) -> str | None:
    """The commit a benchmark JSON's figures describe, or None while it is not committed."""
    doc = json.loads(path.read_text())
    rel = str(path.relative_to(root))
    recorded = doc.get("commit")
    if recorded and doc.get("dirty") is False and git(root, "rev-parse", "--verify", "--quiet", f"{recorded}^{{commit}}"):
        return recorded
    return git(root, "log", "--format=%H", "-1", "--", rel) or None  # the commit of its present content


def staleness(root: Path, path: Path) -> str | None:
    """Why the figures of a benchmark JSON are stale (the newest later change to what its
    benchmark measures), or None when they are not."""
    base = ran_on(root, path)
    if base is None:
        return None
    benchmark = json.loads(path.read_text())["benchmark"]
    paths = measures(root, benchmark)
    later = git(root, "log", "--format=%h %cs %s", f"{base}..HEAD", "--", *paths)
    if not later:
        return None
    newest = later.splitlines()[0]
    touched = git(root, "diff", "--name-only", base, "HEAD", "--", *paths) or ""
    return (f"{len(later.splitlines())} later commits change what `{benchmark}` measures "
            f"({', '.join(touched.split()[:4])}{' …' if len(touched.split()) > 4 else ''}; newest {newest[:60]})")


def unmarked_stale(root: Path) -> list[str]:
    """Every place a doc quotes a stale JSON without saying it is stale: 'file: json: why'."""
    docs = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    cache: dict[Path, str | None] = {}
    problems = []
    for doc in docs:
        for block in re.split(r"\n\s*\n|\n(?=\|)", doc.read_text()):  # paragraphs, and each table row alone
            for m in JSON_REF.finditer(block):
                path = root / "docs" / "benchmarks" / m.group(1) / m.group(2)
                if not path.is_file():
                    continue  # a name that is not a benchmark JSON here (test_docs_front_door checks names)
                if path not in cache:
                    cache[path] = staleness(root, path)
                if cache[path] and "stale" not in block.lower():
                    problems.append(f"{doc.relative_to(root)}: {m.group(0)}: {cache[path]}")
    return problems


def history_or_skip(root: Path) -> None:
    if git(root, "rev-parse", "--is-inside-work-tree") != "true":
        pytest.skip("FRESHNESS NOT CHECKED: not a git checkout")
    if git(root, "rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("FRESHNESS NOT CHECKED: a shallow clone has no history to date the JSONs by")


def test_every_benchmark_names_what_it_measures():
    for script in sorted((ROOT / "sim" / "bench").glob("*.py")):
        paths = measures(ROOT, script.stem)
        assert f"sim/bench/{script.name}" in paths, script
        missing = [p for p in paths if not (ROOT / p).exists()]
        assert not missing, f"{script.name}: MEASURES names what does not exist: {missing}"


def test_no_doc_quotes_a_stale_benchmark_without_saying_so():
    history_or_skip(ROOT)
    problems = unmarked_stale(ROOT)
    assert not problems, ("figures quoted from benchmark runs older than the code they measure; re-run the "
                          "benchmark and quote the new run, or say 'stale' where it is quoted:\n  "
                          + "\n  ".join(problems))


def test_a_benchmark_document_records_its_commit():
    history_or_skip(ROOT)
    sys.path.insert(0, str(ROOT / "sim"))
    try:
        from linkpass_sim.report import document
    finally:
        sys.path.remove(str(ROOT / "sim"))
    doc = document("clock", [])
    assert doc["commit"] == git(ROOT, "rev-parse", "HEAD") and isinstance(doc["dirty"], bool)


def test_the_check_finds_a_figure_older_than_its_code(tmp_path):
    """The rule itself, on a repository made here: a run, then a change to what it measures."""
    root = tmp_path / "repo"
    (root / "sim" / "bench").mkdir(parents=True)
    (root / "docs" / "benchmarks" / "2026-01-01").mkdir(parents=True)
    (root / "code.py").write_text("x = 1\n")
    (root / "other.py").write_text("y = 1\n")
    (root / "sim" / "bench" / "speed.py").write_text('MEASURES = ("code.py", "sim/bench/speed.py")\n')
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}

    def commit(message: str) -> str:
        subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(root), "commit", "-qm", message], check=True, env=env)
        return git(root, "rev-parse", "HEAD")

    subprocess.run(["git", "init", "-q", str(root)], check=True)
    first = commit("code")
    run = root / "docs" / "benchmarks" / "2026-01-01" / "speed.json"
    run.write_text(json.dumps({"benchmark": "speed", "commit": first, "dirty": False, "rows": []}))
    (root / "README.md").write_text("Fast: 3 ms (2026-01-01/speed.json).\n")
    commit("a run of speed")
    assert unmarked_stale(root) == []
    (root / "other.py").write_text("y = 2\n")  # not what it measures
    commit("other")
    assert unmarked_stale(root) == []
    (root / "code.py").write_text("x = 2\n")
    commit("faster code")
    problems = unmarked_stale(root)
    assert len(problems) == 1 and problems[0].startswith("README.md: 2026-01-01/speed.json: 1 later commits")
    assert "code.py" in problems[0] and "faster code" in problems[0]
    (root / "README.md").write_text("Fast: 3 ms (2026-01-01/speed.json; stale: re-run pending).\n")
    assert unmarked_stale(root) == []
    # a run on a dirty tree is dated by the commit of its file, not by the commit it recorded
    run.write_text(json.dumps({"benchmark": "speed", "commit": first, "dirty": True, "rows": []}))
    (root / "README.md").write_text("Fast: 2 ms (2026-01-01/speed.json).\n")
    commit("re-run")
    assert unmarked_stale(root) == []


def stale_runs(root: Path) -> dict[str, str]:
    """Every benchmark JSON under docs/benchmarks whose figures are stale, with why."""
    out = {}
    for path in sorted((root / "docs" / "benchmarks").glob("*/*.json")):
        why = staleness(root, path)
        if why:
            out[str(path.relative_to(root))] = why
    return out


if __name__ == "__main__":  # `python tests/unit/test_benchmark_freshness.py`: what is stale, and why
    for name, why in stale_runs(ROOT).items():
        print(f"{name}: {why}")


def test_a_quoted_run_is_found_however_the_doc_names_its_folder():
    text = ("bare 2026-12-05/failover.json, docs/benchmarks/2026-12-06/chaos.json, benchmarks/2026-12-04/a.json; "
            "not out/2026-12-03/b.json")
    assert [m.group(0) for m in JSON_REF.finditer(text)] == ["2026-12-05/failover.json", "2026-12-06/chaos.json",
                                                           "2026-12-04/a.json"]
