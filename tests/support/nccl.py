"""The NCCL net plugin and its harness, built where the project's build puts them
(rdma/nccl/build/); the harness run with LinkPass's variables, and a transfer that runs until the
test has seen what it waits for."""
from __future__ import annotations

import os

from support.waiting import wait_until


NCCL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "rdma", "nccl")
NCCL_PLUGIN = os.path.join(NCCL_DIR, "build", "libnccl-net-linkpass.so")
NCCL_HARNESS = os.path.join(NCCL_DIR, "build", "lp_harness")


def nccl_build() -> tuple[str, str]:
    """(plugin .so, harness) as `make deps` builds them; make is a no-op when they are up to date."""
    import subprocess

    subprocess.run(["make", "-s", "-C", NCCL_DIR], check=True, capture_output=True)
    return NCCL_PLUGIN, NCCL_HARNESS


def nccl_harness(*args: str, env: dict | None = None, timeout: float = 120, netns: str | None = None):
    """Run the harness on the plugin with LINKPASS_NICS on two loopback planes (127.0.0.1, .2) and no
    entropy table unless `env` says otherwise; returns the CompletedProcess (text)."""
    import subprocess

    plugin, harness = nccl_build()
    e = dict(os.environ)
    e.update({"LINKPASS_NICS": "127.0.0.1,127.0.0.2", "LINKPASS_ENTROPY_TABLE": "/nonexistent/linkpass-entropy"})
    e.update(env or {})
    cmd = [harness, "-l", plugin, *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)


def harness_fields(out: str, first: str) -> dict[str, str]:
    """key=value pairs of the harness's output line that starts with `first` (e.g. "transfer", "stats")."""
    for line in out.splitlines():
        if line.startswith(first + " "):
            return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    raise AssertionError(f"no {first!r} line in the harness output:\n{out}")


class HarnessRun:
    """A harness transfer in the background that runs until stop() (its -S file): wait_for(text)
    polls its log lines, so a test acts on what the plugin did, not on how long it took."""

    def __init__(self, stop_dir, *args: str, env: dict | None = None, netns: str | None = None):
        import subprocess
        import threading

        plugin, harness = nccl_build()
        self.stop_file = os.path.join(str(stop_dir), "stop-harness")
        e = dict(os.environ)
        e.update({"LINKPASS_NICS": "127.0.0.1,127.0.0.2", "LINKPASS_ENTROPY_TABLE": "/nonexistent/linkpass-entropy"})
        e.update(env or {})
        cmd = [harness, "-l", plugin, "transfer", "-n", "100000000", "-S", self.stop_file, "-T", "300", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")),
                                        daemon=True)
        self._reader.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def wait_for(self, text: str, times: int = 1, timeout_s: float = 60) -> None:
        wait_until(lambda: self.count(text) >= times or self.proc.poll() is not None, timeout_s, repr(text))
        assert self.count(text) >= times, f"the harness ended before {text!r}:\n{self.log[-3000:]}"

    def stop(self, timeout_s: float = 120) -> tuple[int, str, str]:
        """Stop posting, let the posted messages finish; (exit code, stdout, log)."""
        with open(self.stop_file, "w"):
            pass
        try:
            out = self.proc.stdout.read()
            self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()
        self._reader.join(timeout=10)
        return self.proc.returncode, out, self.log

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
