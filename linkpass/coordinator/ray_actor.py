"""Every `ray.*` call of LinkPass lives here: the coordinator as a detached, named Ray actor.
(The fleet simulator's sweeps, a separate package, have theirs in `linkpass_sim/sweep.py`.)

One bootstrap path: `ensure(settings)` returns the running actor if there is one (in namespace
"linkpass", name "coordinator") and creates it otherwise. `max_restarts=-1`: if its process dies,
Ray starts a new one with the same settings; it reopens the same SQLite database and listens on
the same address, so agents and the CLI carry on after a few failed requests. Agents are ordinary
daemons and never talk to Ray: they use the actor's HTTP endpoint.

The actor's log lines go to <state_dir>/coordinator.log (runner.actor_log), not to Ray's worker
files (`log_to_driver=False`): `linkpass coordinator` copies that file to its own stderr.
"""
from __future__ import annotations

import os
import signal
import time

import ray

NAMESPACE = "linkpass"
ACTOR_NAME = "coordinator"


@ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)
class CoordinatorActor:
    def __init__(self, settings: dict):
        from .runner import actor_log, settle_heap, start  # noqa: PLC0415 (imported in the actor's process)

        # Ray starts workers at nice 15 (batch work); the coordinator answers agents and on-call
        # and must not starve behind a busy host's batch jobs. Lowering needs CAP_SYS_NICE.
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass
        self.server = start(settings, log=actor_log(settings))
        settle_heap()  # the actor's process is the coordinator's alone

    def endpoint(self) -> str:
        return self.server.url

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Stop serving, as a clean stop does (its `stopped` log line); `stop()` ends the process."""
        self.server.close()


_FORK_GUARD = []


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at `address`, or start a local one (the embedded default)."""
    if ray.is_initialized():
        return
    if not _FORK_GUARD:
        # Ray's SIGTERM handler is inherited by forked children; pyroute2 forks a helper per
        # namespace socket and SIGTERMs it, and with that handler the child unwound into this
        # process's code and ran on as a second copy (seen in pytest and the benchmark)
        os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
        _FORK_GUARD.append(True)
    kwargs = {"namespace": NAMESPACE, "log_to_driver": False, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)


def ensure(settings: dict, timeout_s: float = 60.0):
    """The coordinator actor (get-if-exists, else create) and its endpoint URL once it answers."""
    handle = CoordinatorActor.options(name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached",
                                      get_if_exists=True).remote(settings)
    return handle, endpoint(handle, timeout_s)


def endpoint(handle, timeout_s: float = 60.0) -> str:
    return ray.get(handle.endpoint.remote(), timeout=timeout_s)


def actor_pid(handle, timeout_s: float = 60.0) -> int:
    return ray.get(handle.pid.remote(), timeout=timeout_s)


def existing():
    """The running coordinator actor, or None."""
    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def stop(handle, timeout_s: float = 15.0) -> None:
    """Stop the actor for good (no restart): its server closes first, then its process is killed."""
    try:
        ray.get(handle.close.remote(), timeout=timeout_s)
    except ray.exceptions.RayError:  # dead, restarting or stuck: the kill ends it all the same
        pass
    ray.kill(handle, no_restart=True)


def wait_restarted(handle, old_pid: int, timeout_s: float = 60.0) -> int:
    """After the actor's process died: wait until a new process answers; returns its pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = ray.get(handle.pid.remote(), timeout=5)
            if pid != old_pid:
                return pid
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the coordinator actor did not come back within {timeout_s:.0f} s")


def shutdown() -> None:
    if ray.is_initialized():
        ray.shutdown()
