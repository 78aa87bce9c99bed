"""Quoted figures stay true to the code: a benchmark JSON that README.md or docs/ quote, run before
a later change to the code that benchmark measures (its script's MEASURES), is stale, and the
paragraph or table row that names it must say so ("stale") until the benchmark is re-run. Which
commit a JSON ran on: the `commit` it records (sim/linkpass_sim/report.py), unless the tree was
dirty; else the commit that last changed the file. Needs the repository's history: skipped in a
shallow clone or outside git, loudly.

Moves: a measured file is followed through its renames, so a change made under its former name
still counts and a move that keeps its content (a pure rename) does not. A commit that moves
benchmark scripts and only re-points their paths (imports, MEASURES, usage lines) says so with the
trailer `Benchmark-behaviour-unchanged: <why>`; its changes to benchmark scripts then do not
count, its changes to anything else they measure still do."""
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
# the benchmark scripts: the lab's (testbed, agent, C core, coordinator, plugin) and the simulator's
BENCH_DIRS = ("bench", "sim/bench")
# a commit message trailer: this commit's edits to benchmark scripts leave what they do unchanged
UNCHANGED_TRAILER = "Benchmark-behaviour-unchanged"
# a run's JSON as docs name it: "2026-12-05/failover.json", also after "benchmarks/" or
# "docs/benchmarks/" (not inside another path)
JSON_REF = re.compile(r"(?:(?<=benchmarks/)|(?<![\w/.-]))(20\d\d-\d\d-\d\d)/([\w.-]+\.json)")


def git(root: Path, *args: str) -> str | None:
    out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else None


def scripts(root: Path) -> list[Path]:
    """Every benchmark script, in either benchmark folder."""
    return sorted(s for d in BENCH_DIRS for s in (root / d).glob("*.py"))


def script(root: Path, benchmark: str) -> Path:
    """The script of a benchmark (the `benchmark` a JSON records), wherever it lives."""
    found = [root / d / f"{benchmark}.py" for d in BENCH_DIRS if (root / d / f"{benchmark}.py").is_file()]
    assert len(found) == 1, f"benchmark {benchmark!r}: scripts {found} in {BENCH_DIRS}"
    return found[0]


def measures(root: Path, benchmark: str) -> tuple[str, ...]:
    """The MEASURES tuple of the benchmark's script, read without running the script."""
    path = script(root, benchmark)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MEASURES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"{path.relative_to(root)} has no MEASURES")


def ran_on(root: Path, path: Path) -> str | None:
    """The commit a benchmark JSON's figures describe, or None while it is not committed."""
    doc = json.loads(path.read_text())
    rel = str(path.relative_to(root))
    recorded = doc.get("commit")
    if recorded and doc.get("dirty") is False and git(root, "rev-parse", "--verify", "--quiet", f"{recorded}^{{commit}}"):
        return recorded
    return git(root, "log", "--format=%H", "-1", "--", rel) or None  # the commit of its present content


def former_names(root: Path, base: str, path: str) -> set[str]:
    """The names a measured file had in the commits after `base` (git follows its renames)."""
    if not (root / path).is_file():
        return set()  # a folder: git follows files only
    out = git(root, "log", "--follow", "--name-status", "--format=", f"{base}..HEAD", "--", path) or ""
    return {name for line in out.splitlines() for name in line.split("\t")[1:]}


def later_changes(root: Path, base: str, paths: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """The commits after `base` that change what `paths` name, newest first: (the commit's
    "hash date subject", the measured files it changed). A measured file is followed through
    its renames; a pure rename between measured names changes nothing, nor does a
    benchmark script's edit in a commit that carries UNCHANGED_TRAILER."""
    names = set(paths).union(*(former_names(root, base, p) for p in paths))

    def measured(name: str) -> bool:
        return any(name == n or name.startswith(n.rstrip("/") + "/") for n in names)

    def is_script(name: str) -> bool:
        return str(Path(name).parent) in BENCH_DIRS and name.endswith(".py")

    # --cc: a merge counts where its result differs from every parent (a resolution of its own)
    log = git(root, "log", "-M", "--cc", "--name-status",
              f"--format=%x01%h %cs %s%x02%(trailers:key={UNCHANGED_TRAILER},valueonly)%x03",
              f"{base}..HEAD", "--", *sorted(names)) or ""
    changes = []
    for entry in log.split("\x01")[1:]:
        head, rest = entry.split("\x03", 1)
        line, trailer = head.split("\x02", 1)
        changed = []
        for status_line in rest.strip().splitlines():
            status, *files = status_line.split("\t")
            if status == "R100" and all(measured(f) for f in files):
                continue  # moved, content kept
            if trailer.strip() and all(is_script(f) for f in files):
                continue  # the commit says its script edits change no benchmark's behaviour
            changed += [f for f in files if measured(f)]
        if changed:
            changes.append((line, changed))
    return changes


def staleness(root: Path, path: Path) -> str | None:
    """Why the figures of a benchmark JSON are stale (the newest later change to what its
    benchmark measures), or None when they are not."""
    base = ran_on(root, path)
    if base is None:
        return None
    benchmark = json.loads(path.read_text())["benchmark"]
    # its script under either folder: a short script moved with its paths re-pointed may differ
    # too much for git to see a rename
    own = tuple(f"{d}/{benchmark}.py" for d in BENCH_DIRS)
    later = later_changes(root, base, measures(root, benchmark) + own)
    if not later:
        return None
    newest = later[0][0]
    touched = sorted({f for _, files in later for f in files})
    return (f"{len(later)} later commits change what `{benchmark}` measures "
            f"({', '.join(touched[:4])}{' …' if len(touched) > 4 else ''}; newest {newest[:60]})")


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
    assert scripts(ROOT), BENCH_DIRS
    for path in scripts(ROOT):
        paths = measures(ROOT, path.stem)  # also: no benchmark's name is in both folders
        assert str(path.relative_to(ROOT)) in paths, path
        missing = [p for p in paths if not (ROOT / p).exists()]
        assert not missing, f"{path.name}: MEASURES names what does not exist: {missing}"


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


def test_a_move_neither_dates_a_run_nor_hides_a_change(tmp_path):
    """Moves, on a repository made here: a benchmark script moved to the other folder with its
    paths re-pointed (the commit says so), a measured file moved as it is; neither makes a run
    stale. A change to the script or the code before the move still does, and so does one after
    it, and a move that says nothing."""
    root = tmp_path / "repo"
    (root / "sim" / "bench").mkdir(parents=True)
    (root / "docs" / "benchmarks" / "2026-01-01").mkdir(parents=True)
    (root / "code.py").write_text("x = 1\n")
    old = root / "sim" / "bench" / "speed.py"
    old.write_text('"""python sim/bench/speed.py"""\nMEASURES = ("code.py", "sim/bench/speed.py")\nN = 10\n')
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}

    def commit(message: str) -> str:
        subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(root), "commit", "-qm", message], check=True, env=env)
        return git(root, "rev-parse", "HEAD")

    def move_script(message: str) -> None:
        (root / "bench").mkdir(exist_ok=True)
        subprocess.run(["git", "-C", str(root), "mv", "sim/bench/speed.py", "bench/speed.py"], check=True)
        moved = root / "bench" / "speed.py"
        moved.write_text(moved.read_text().replace("sim/bench/", "bench/"))
        commit(message)

    def run(note: str) -> None:
        (root / "docs" / "benchmarks" / "2026-01-01" / "speed.json").write_text(json.dumps(
            {"benchmark": "speed", "commit": git(root, "rev-parse", "HEAD"), "dirty": False, "rows": [], "note": note}))
        (root / "README.md").write_text(f"Fast: 3 ms (2026-01-01/speed.json, {note}).\n")
        commit(f"a run of speed: {note}")

    subprocess.run(["git", "init", "-q", str(root)], check=True)
    commit("code and its benchmark")
    run("first")
    move_script(f"The speed benchmark is lab tooling\n\n{UNCHANGED_TRAILER}: paths only")
    assert measures(root, "speed") == ("code.py", "bench/speed.py")
    assert unmarked_stale(root) == []
    subprocess.run(["git", "-C", str(root), "mv", "code.py", "lib.py"], check=True)
    moved = root / "bench" / "speed.py"
    moved.write_text(moved.read_text().replace('"code.py"', '"lib.py"'))
    commit(f"code.py is lib.py\n\n{UNCHANGED_TRAILER}: MEASURES follows the move")
    assert unmarked_stale(root) == []
    # a change under the former names, before the moves, still dates the run
    subprocess.run(["git", "-C", str(root), "reset", "-q", "--hard", "HEAD~2"], check=True)
    old.write_text(old.read_text().replace("N = 10", "N = 20"))
    commit("more trials")
    move_script(f"The speed benchmark is lab tooling\n\n{UNCHANGED_TRAILER}: paths only")
    problems = unmarked_stale(root)
    assert len(problems) == 1 and "1 later commits" in problems[0] and "more trials" in problems[0], problems
    # and after them: the moved script's code, the moved file's content
    run("second")
    moved = root / "bench" / "speed.py"
    moved.write_text(moved.read_text().replace("N = 20", "N = 30"))
    commit("yet more trials")
    assert "yet more trials" in unmarked_stale(root)[0]
    run("third")
    (root / "code.py").write_text("x = 3\n")
    commit("faster code")
    assert "code.py" in unmarked_stale(root)[0]
    # a script move that does not say its edits are paths only counts as a change
    run("fourth")
    subprocess.run(["git", "-C", str(root), "mv", "bench/speed.py", "sim/bench/speed.py"], check=True)
    old.write_text(old.read_text().replace('"bench/', '"sim/bench/'))
    commit("back, silently")
    assert "back, silently" in unmarked_stale(root)[0]
    # a script edited in a commit that says so, beside a real change to the code: the code counts
    run("fifth")
    old.write_text(old.read_text().replace('"""python', '"""usage: python'))
    (root / "code.py").write_text("x = 4\n")
    commit(f"usage line; slower code\n\n{UNCHANGED_TRAILER}: the usage line")
    problems = unmarked_stale(root)
    assert len(problems) == 1 and "(code.py;" in problems[0], problems


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
