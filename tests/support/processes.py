"""Child processes: draining a log pipe for the whole run (a full pipe would block its writer),
and stopping processes (SIGTERM, then kill)."""
from __future__ import annotations


class LogDrain:
    """Reads a child's text pipe line by line in a thread for as long as the child runs, so the
    child never blocks on a full pipe; `lines` holds everything read, `wait_for` waits for a
    line containing a string."""

    def __init__(self, pipe):
        import threading
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: any(text in ln for ln in self.lines), timeout_s)

    def text(self, join_s: float = 5.0) -> str:
        self._thread.join(join_s)
        with self._cond:
            return "".join(self.lines)


def stop_processes(procs) -> None:
    """SIGTERM every process (agents: a clean stop), then wait; kill what has not exited in 20 s."""
    import subprocess

    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
