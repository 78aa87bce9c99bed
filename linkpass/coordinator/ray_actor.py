"""Every `ray.*` call of LinkPass lives here: the coordinator as a detached, named Ray actor.
(The fleet simulator's sweeps, a separate package, have theirs in `linkpass_sim/sweep.py`.)

One bootstrap path: `ensure(settings)` returns the running actor if there is one (in namespace
"linkpass", name "coordinator") and creates it otherwise. `max_restarts=-1`: if its process dies,
Ray starts a new one with the same settings; it reopens the same SQLite database and listens on
the same address, so agents and the CLI carry on after a few failed requests. Agents are ordinary
daemons and never talk to Ray: they use the actor's HTTP endpoint.

The actor's log lines go to <state_dir>/coordinator.log (startup.actor_log), not to Ray's worker
files (`log_to_driver=False`): `linkpass coordinator` copies that file to its own stderr.

Who may call the actors. A driver connected to the Ray cluster can find every named actor and call
its methods; the methods by which a sharded coordinator's actors feed each other (the root's
`shard_register`, `shard_report`, `shard_reports`, `heard` and `add_events`, a shard's
`localize_part`) take agents' reports and write history as if an authenticated agent had sent
them. Two walls keep other drivers out:
  1. Ray's token authentication (RAY_AUTH_MODE=token): a process without the cluster's token does
     not reach Ray at all. `ray.init()` of a local Ray turns it on by itself; a cluster started
     with `ray start` (KubeRay) has it only when every node is given the token
     (deploy/kubernetes/linkpass-raycluster.yaml does, from a Secret).
  2. The actors' credential (`actor_credential`): each of those methods takes `credential=` and
     refuses a call without the right one (ActorCredentialError). The actors derive it themselves
     from the agent secret they already read (every actor of one coordinator reads the same one),
     so it never travels in the actors' creation arguments; a driver that merely connected to Ray
     and calls `ray.get_actor("coordinator", namespace="linkpass").shard_report.remote(...)`
     is refused. This is a second wall, not a sandbox: a driver inside the cluster can still run
     its own code on the actors' node (a task reading the secret file) or kill the actors, which
     only the first wall prevents. `endpoint`, `pid` and `close` stay open: they give nothing
     away, and any driver could `ray.kill` an actor anyway.
"""
from __future__ import annotations

import gc
import hashlib
import hmac
import os
import signal
import time

import ray

from ..kernel import heap

NAMESPACE = "linkpass"
ACTOR_NAME = "coordinator"  # the coordinator, or the root of a sharded one
SHARD_NAME = "coordinator-shard-{}"  # its shards

# the derivation's own label: an agent token's MAC input starts "linkpass agent", so no agent
# token (every node holds its own) is this credential, nor gives it away
_CREDENTIAL_CONTEXT = b"linkpass ray actors v1\0"


class ActorCredentialError(PermissionError):
    """A call to a coordinator actor's internal method came without the actors' credential (or
    with another one): only the coordinator's own actors make those calls."""


def actor_credential(settings: dict) -> str:
    """The credential the coordinator's actors present to each other (module docstring, Who may
    call): HMAC-SHA256 of the agent secret (settings.agent_secret, or <state_dir>/agent.secret,
    made if missing as the coordinator itself does), under a label of its own. The same for the
    root and every shard, and again after Ray restarts one; a new agent secret makes a new one."""
    from .auth import SECRET_FILE, AuthError, ensure_secret, read_agent_secret  # noqa: PLC0415
    from ..control.errors import CoordinatorError  # noqa: PLC0415
    from .startup import DEFAULT_STATE_DIR  # noqa: PLC0415

    state_dir = settings.get("state_dir") or DEFAULT_STATE_DIR
    try:
        path = settings.get("agent_secret") or ensure_secret(os.path.join(state_dir, SECRET_FILE))
        secret = read_agent_secret(path)
    except OSError as exc:
        raise CoordinatorError(f"{exc.filename}: {exc.strerror}") from None
    except AuthError as exc:
        raise CoordinatorError(str(exc)) from None
    return hmac.new(secret, _CREDENTIAL_CONTEXT, hashlib.sha256).hexdigest()


class _Serving:
    """An actor that serves an endpoint (`self.server`, http.CoordinatorServer)."""

    _credential: str = ""  # actor_credential(settings), set first thing in __init__

    def _admit(self, method: str, credential) -> None:
        """Refuse a call to an internal method that lacks the actors' credential."""
        if credential is None:
            raise ActorCredentialError(
                f"{type(self).__name__}.{method}: refused: no credential. Only the coordinator's own actors "
                "call this method, with credential= derived from the agent secret (ray_actor.actor_credential)")
        if not (isinstance(credential, str) and self._credential
                and hmac.compare_digest(credential.encode(), self._credential.encode())):
            raise ActorCredentialError(
                f"{type(self).__name__}.{method}: refused: the credential is not this coordinator's (its actors "
                "derive it from the agent secret; were they started with different ones?)")

    @staticmethod
    def _prompt() -> None:
        # Ray starts workers at nice 15 (batch work); the coordinator answers agents and on-call
        # and must not starve behind a busy host's batch jobs. Lowering needs CAP_SYS_NICE.
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass

    def endpoint(self) -> str:
        return self.server.url

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Stop serving, as a clean stop does (its `stopped` log line); `stop()` ends the process."""
        self.server.close()


# max_concurrency: a sharded coordinator's shards call the root side by side (each call takes
# the endpoint's lock inside; the threads only overlap the calls' round trips)
@ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0, max_concurrency=16)
class CoordinatorActor(_Serving):
    def __init__(self, settings: dict):
        from .startup import actor_log, check_settings, start  # noqa: PLC0415 (imported in the actor's process)

        self._prompt()
        check_settings(settings)  # a bad setting is refused by its name before any file is read
        self._credential = actor_credential(settings)
        sharded = (settings.get("shards") or 1) > 1
        links = RayShards(self._credential) if sharded else None
        self.server = start(settings, log=actor_log(settings), shards=links)
        heap.settle()  # the actor's process is the coordinator's alone

    # what shards ask of the root (shard.RootLink, through RayRoot); each refuses a call without
    # the actors' credential (module docstring, Who may call)
    def shard_register(self, req, *, credential=None):
        """An agent's registration a shard passes on (its table, for the root's view)."""
        self._admit("shard_register", credential)
        return self.server.service.register(req)

    def shard_report(self, req, *, credential=None):
        """An agent's report a shard could not answer alone."""
        self._admit("shard_report", credential)
        return self.server.service.report(req)

    def shard_reports(self, batch, *, credential=None):
        """Reports a shard answered itself and queued for the root, in order."""
        self._admit("shard_reports", credential)
        return self.server.service.reports_batch(batch)

    def heard(self, shard, names, *, credential=None):
        self._admit("heard", credential)
        return self.server.service.heard(shard, names)

    def add_events(self, events, *, credential=None):
        self._admit("add_events", credential)
        self.server.service.add_events(events)


@ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)
class ShardActor(_Serving):
    """Shard `shard` of a sharded coordinator (shard.py): its own endpoint; the root by name."""

    def __init__(self, settings: dict, shard: int):
        from .startup import actor_log, check_settings, start_shard  # noqa: PLC0415 (imported in the actor's process)

        self._prompt()
        check_settings(settings)
        self._credential = actor_credential(settings)  # the root's too: derived from the same agent secret
        self.server = start_shard(settings, shard, RayRoot(self._credential), log=actor_log(settings))
        heap.settle()  # the fleet model, out of the collector's sight (kernel/heap.py)

    def localize_part(self, *call, credential=None):
        """A round of the root's localization at this shard's part (shard.PartHost); only from the
        root (its credential)."""
        self._admit("localize_part", credential)
        out = self.server.shard.part.call(*call)
        if call[1] is None:
            gc.freeze()  # a part's whole evidence arrived: it stays, as the model does
        return out


class RayRoot:
    """shard.RootLink over Ray: the root actor, found by name (again after a failed call, so a
    root stopped and started anew is found too; one Ray restarts keeps its handle), called with
    the actors' credential. Its refusals (CoordinatorError) come back as themselves; a root that
    is away or slow, or refuses the credential, as RootUnreachable."""

    TIMEOUT_S = 10.0

    def __init__(self, credential: str):
        self._handle = None
        self._credential = credential

    def _call(self, method: str, *args):
        from ..control.errors import CoordinatorError  # noqa: PLC0415
        from .shard import RootUnreachable  # noqa: PLC0415

        try:
            handle = self._handle = self._handle or ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
            return ray.get(getattr(handle, method).remote(*args, credential=self._credential), timeout=self.TIMEOUT_S)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, CoordinatorError):
                raise exc.cause from None
            self._handle = None
            raise RootUnreachable(f"the root failed: {exc.cause!r}") from None
        except (ValueError, ray.exceptions.RayError) as exc:  # ValueError: no actor of that name (yet)
            self._handle = None
            raise RootUnreachable(f"the root actor does not answer ({type(exc).__name__})") from None

    def register(self, req):
        return self._call("shard_register", req)

    def report(self, req):
        return self._call("shard_report", req)

    def reports(self, batch):
        return self._call("shard_reports", batch)

    def heard(self, shard, names):
        return self._call("heard", shard, names)

    def add_events(self, events):
        self._call("add_events", events)


class RayShards:
    """shard.ShardLink over Ray: the shard actors, found by name (again after a failed call),
    asked side by side, with the actors' credential (`actor_credential` of the coordinator's
    settings). A shard that is away, slower than the timeout, or refuses the credential answers
    ShardUnreachable (the root explains its part itself meanwhile); a part that lost its
    evidence, PartLost."""

    def __init__(self, credential: str):
        self._handles: dict[int, object] = {}
        self._credential = credential

    def _handle(self, k: int):
        """Shard k's actor, or None when there is none of that name."""
        if k not in self._handles:
            try:
                self._handles[k] = ray.get_actor(SHARD_NAME.format(k), namespace=NAMESPACE)
            except ValueError:
                return None
        return self._handles[k]

    def parts(self, calls: dict, timeout_s: float) -> dict:
        from .shard import PartLost, ShardUnreachable  # noqa: PLC0415

        out: dict = {}
        refs = {}
        for k, call in calls.items():
            handle = self._handle(k)
            if handle is None:
                out[k] = ShardUnreachable(f"no actor {SHARD_NAME.format(k)}")
            else:
                refs[k] = handle.localize_part.remote(*call, credential=self._credential)
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for k, ref in refs.items():
            try:
                out[k] = ray.get(ref, timeout=0)
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, PartLost):
                    out[k] = exc.cause
                else:
                    self._handles.pop(k, None)
                    out[k] = ShardUnreachable(f"shard {k} failed: {exc.cause!r}")
            except ray.exceptions.RayError as exc:  # dead, restarting, or not done in time
                self._handles.pop(k, None)
                out[k] = ShardUnreachable(f"shard {k} does not answer ({type(exc).__name__})")
        return out

    def send(self, calls: dict) -> None:
        for k, call in calls.items():
            handle = self._handle(k)
            if handle is not None:  # none: the next question finds it unreachable
                # not awaited: Ray runs an actor's calls from one caller in order, so the next
                # question finds these applied (or, failed, its part's generation tells: PartLost)
                handle.localize_part.remote(*call, credential=self._credential)


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
    """The coordinator actor (get-if-exists, else create) and its endpoint URL once it answers;
    with `shards` > 1 it is the root, and its shards are made the same way after it."""
    handle = CoordinatorActor.options(name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached",
                                      get_if_exists=True).remote(settings)
    url = endpoint(handle, timeout_s)
    count = settings.get("shards") or 1
    for k in range(count if count > 1 else 0):  # after the root: they share its lab CA, made by it
        endpoint(shard(settings, k), timeout_s)
    return handle, url


def shard(settings: dict, k: int):
    """Shard k's actor (get-if-exists, else create)."""
    return ShardActor.options(name=SHARD_NAME.format(k), namespace=NAMESPACE, lifetime="detached",
                              get_if_exists=True).remote(settings, k)


def shards() -> list:
    """The running shard actors, in order (none for an unsharded coordinator)."""
    from .startup import MAX_SHARDS  # noqa: PLC0415 (the settings' bound; startup is heavy to import)

    out = []
    for k in range(MAX_SHARDS):
        try:
            out.append(ray.get_actor(SHARD_NAME.format(k), namespace=NAMESPACE))
        except ValueError:
            return out
    return out


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


def stop_all(timeout_s: float = 15.0) -> None:
    """Stop the coordinator for good: its shards, then the root (or the one actor)."""
    for h in shards():
        stop(h, timeout_s)
    h = existing()
    if h is not None:
        stop(h, timeout_s)


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
