"""The demo's training job as processes: one `linkpass.demo.job` rank per testbed host.

`TrainingJob.start()` launches the ranks in their hosts' namespaces; `poll()` notices a rank
that died (a failed collective) and restarts the whole job from the next step, as a scheduler
would restart it from its checkpoint, counting the restart; `stop()` asks rank 0 to end the job
after the current step and reaps every rank (kills what does not exit).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ..core.names import host_name
from ..testbed.topology import Fabric

STORE_PORT = 29500  # + the restart count: a restarted job's store does not wait out TIME_WAIT


class JobFailed(RuntimeError):
    pass


class TrainingJob:
    def __init__(self, fab: Fabric, directory: str, hosts: list[int], size_mb: float, compute_ms: float,
                 timeout_s: float, max_restarts: int = 3):
        self.fab, self.dir, self.hosts = fab, directory, hosts
        self.size_mb, self.compute_ms, self.timeout_s = size_mb, compute_ms, timeout_s
        self.max_restarts = max_restarts
        self.restart_at_ns: list[int] = []
        self._parsed: dict[int, tuple[int, list[dict]]] = {}  # rank -> (bytes read, records so far)
        self.procs: dict[int, subprocess.Popen] = {}
        self.stop_file = os.path.join(directory, "stop")
        os.makedirs(directory, exist_ok=True)
        for r in range(len(hosts)):
            open(self.log(r), "w").close()
        if os.path.exists(self.stop_file):
            os.remove(self.stop_file)

    def log(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.jsonl")

    @property
    def restarts(self) -> int:
        return len(self.restart_at_ns)

    @property
    def store_port(self) -> int:
        return STORE_PORT + self.restarts

    def command(self, rank: int, host: int, start_step: int) -> tuple[list[str], dict | None]:
        """One rank's command line (run in its host's namespace) and environment (None: ours)."""
        return ([sys.executable, "-m", "linkpass.demo.job",
                 "--rank", str(rank), "--world", str(len(self.hosts)), "--addr", self.fab.service_addr(host),
                 "--master", self.fab.service_addr(self.hosts[0]), "--port", str(self.store_port),
                 "--size-mb", str(self.size_mb), "--compute-ms", str(self.compute_ms), "--timeout-s", str(self.timeout_s),
                 "--start-step", str(start_step), "--stop-file", self.stop_file, "--out", self.log(rank)], None)

    def _launch(self, start_step: int) -> None:
        for rank, h in enumerate(self.hosts):
            argv, env = self.command(rank, h, start_step)
            err = open(os.path.join(self.dir, f"rank{rank}.stderr"), "a")
            self.procs[rank] = subprocess.Popen(["ip", "netns", "exec", self.fab.netns(host_name(h)), *argv],
                                                stdout=subprocess.DEVNULL, stderr=err, env=env)
            err.close()

    def start(self, ready_steps: int = 20, timeout_s: float = 120.0) -> "TrainingJob":
        """Launch the ranks and wait until `ready_steps` steps have completed."""
        self._launch(0)
        deadline = time.monotonic() + timeout_s
        while len(self.steps()) < ready_steps:
            self.poll()
            if time.monotonic() > deadline:
                raise JobFailed(f"the training job did not get going within {timeout_s:.0f} s; "
                                f"see {self.dir}/rank*.stderr")
            time.sleep(0.1)
        return self

    def records(self, rank: int = 0) -> list[dict]:
        """The rank's log so far. Read on from where the last call stopped: the demo polls this
        every 50 ms on the job's own two cores, and a long run's log grows to megabytes."""
        offset, recs = self._parsed.get(rank, (0, []))
        with open(self.log(rank), "rb") as f:
            f.seek(offset)
            chunk = f.read()
        done = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        recs.extend(json.loads(line) for line in chunk[:done].splitlines())
        self._parsed[rank] = (offset + done, recs)
        return recs

    def steps(self) -> list[dict]:
        """Rank 0's completed steps, in order (every rank finishes an all-reduce together)."""
        return [r for r in self.records(0) if "step" in r]

    def wrong_results(self) -> int:
        return sum(1 for rank in range(len(self.hosts)) for r in self.records(rank) if "step" in r and not r["ok"])

    def poll(self) -> None:
        """Restart the job (from the step after the last completed one) if a rank failed."""
        failed = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None and p.returncode != 0}
        if not failed or os.path.exists(self.stop_file):
            return
        if self.restarts >= self.max_restarts:
            raise JobFailed(f"the training job failed {self.restarts + 1} times (rank exit codes {failed}); "
                            f"see {self.dir}/rank*.stderr")
        self._kill()
        self.restart_at_ns.append(time.time_ns())
        steps = self.steps()
        self._launch(steps[-1]["step"] + 1 if steps else 0)

    def wait_until(self, pred, timeout_s: float, what: str) -> None:
        """Poll the job (restarting it if it fails) until pred() holds."""
        deadline = time.monotonic() + timeout_s
        while not pred():
            self.poll()
            if time.monotonic() > deadline:
                raise JobFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> None:
        """End the job after the current step (rank 0 sees the stop file); kill what does not exit."""
        open(self.stop_file, "w").close()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()  # `ip netns exec` execs the interpreter: this is the rank itself
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = {}


class PluginRingJob(TrainingJob):
    """The same job's collective over an NCCL net plugin: one `lp_allreduce` rank per host
    (rdma/nccl/allreduce.c, a ring all-reduce using only the plugin's API), `size_mb` per step,
    every byte checked. Each rank's devices are its host's planes (LINKPASS_NICS); with
    `entropy_dir`, each reads its host's agent's entropy table there (`entropy-h<i>`), without it
    the plugin runs alone. `plugin`: the .so to load (LinkPass's, or the single-TCP baseline)."""

    def __init__(self, fab: Fabric, directory: str, hosts: list[int], size_mb: float, plugin: str, allreduce: str,
                 entropy_dir: str | None = None, env: dict | None = None, compute_ms: float = 0.0,
                 max_restarts: int = 3):
        super().__init__(fab, directory, hosts, size_mb, compute_ms=compute_ms, timeout_s=0, max_restarts=max_restarts)
        self.plugin, self.allreduce, self.entropy_dir, self.extra_env = plugin, allreduce, entropy_dir, env or {}

    def command(self, rank: int, host: int, start_step: int) -> tuple[list[str], dict | None]:
        rendezvous = os.path.join(self.dir, f"rendezvous-{self.restarts}")
        os.makedirs(rendezvous, exist_ok=True)
        planes = self.fab.spec.planes
        env = {**os.environ, **self.extra_env,
               "LINKPASS_NICS": ",".join(self.fab.nic_addr(host, p) for p in range(planes))}
        if self.entropy_dir:
            env["LINKPASS_ENTROPY_TABLE"] = os.path.abspath(os.path.join(self.entropy_dir, f"entropy-{host_name(host)}"))
        size = max(4, int(self.size_mb * 1024 * 1024) // 4 * 4)
        return ([self.allreduce, "--plugin", self.plugin, "--rank", str(rank), "--nranks", str(len(self.hosts)),
                 "--dir", rendezvous, "--sizes", str(size), "--stop-file", self.stop_file, "--warmup", "0",
                 "--compute-ms", str(self.compute_ms),
                 "--start-step", str(start_step), "--trace", self.log(rank)], env)
