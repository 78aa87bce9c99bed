"""The probe core's receive path under a sanitizer: builds fuzz_harness.c (lab tooling, here; it
includes the same probe_wire.h and probe_rx.h the extension compiles, from linkpass/probe) and
runs it.

`build(out_dir)` compiles it with AddressSanitizer and UBSan (every report fatal), or optimised
and without them (`sanitize=False`, for timing); `fuzz(binary, count, seed)` feeds it `count`
hostile packets and says whether it came through (`FuzzRun.clean`); `cost(binary, kind, count)`
is the receive path's ns per packet for one kind of junk. tests/unit/test_fuzz_harness.py and
bench/reliability.py run these; the harness's header says what it sends.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).parent / "fuzz_harness.c"
PROBE_DIR = Path(__file__).parent.parent / "probe"  # the receive path's headers
COMMON = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-function"]
SANITIZE = ["-O2", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
OPTIMISE = ["-O2"]  # as the extension is built (setup.py)
# leaks are reported too; a report ends the run with exit code 99
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=1:exitcode=99:abort_on_error=0",
                 "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=99"}
REPORT_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "invariant broken")


class BuildError(RuntimeError):
    pass


def build(out_dir: str | os.PathLike, sanitize: bool = True, cc: str | None = None,
          src_dir: str | os.PathLike | None = None) -> Path:
    """Compile the harness into out_dir; returns the binary's path. `src_dir`: a folder holding its
    own fuzz_harness.c and headers (a test's altered copies); default: this harness and the probe
    core's headers."""
    cc = cc or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise BuildError("no C compiler: install gcc (apt-get install gcc), which the extension needs too")
    out = Path(out_dir) / ("fuzz_harness-asan" if sanitize else "fuzz_harness")
    harness, headers = (HARNESS, PROBE_DIR) if src_dir is None else (Path(src_dir) / HARNESS.name, Path(src_dir))
    cmd = [cc, *COMMON, f"-I{headers}", *(SANITIZE if sanitize else OPTIMISE), str(harness), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return out


@dataclass
class FuzzRun:
    inputs: int
    returncode: int
    outcomes: dict = field(default_factory=dict)  # the harness's counts (reflected, drops by reason, ...)
    report: str = ""  # what the sanitizer or an invariant check said, if anything

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and not self.report and self.outcomes.get("inputs") == self.inputs


def fuzz(binary: str | os.PathLike, count: int, seed: int, timeout_s: float = 600) -> FuzzRun:
    """Feed `count` hostile packets (seeded) through the harness."""
    done = subprocess.run([str(binary), "fuzz", str(count), str(seed)], capture_output=True, text=True,
                          env={**os.environ, **SANITIZER_ENV}, timeout=timeout_s)
    report = done.stderr if any(m in done.stderr for m in REPORT_MARKERS) or done.returncode else ""
    try:
        outcomes = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    except json.JSONDecodeError:
        outcomes = {}
    return FuzzRun(count, done.returncode, outcomes, report)


def cost(binary: str | os.PathLike, kind: str, count: int) -> float:
    """ns per packet of `kind` junk (unexpected_size, over_budget, bad_tag) through the receive path."""
    done = subprocess.run([str(binary), "cost", kind, str(count)], capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)["ns_per_packet"])
