"""`linkpass demo`: a real all-reduce keeps running while the fabric's links fail.

One command, on the embedded default: build the default testbed (4 hosts × 2 planes), start the
coordinator (a Ray actor on a local Ray) and an agent on every host, run two jobs side by side —
a torch.distributed gloo job (one rank per host, bound to the hosts' service addresses: LinkPass
moves its routes) and a ring all-reduce over LinkPass's NCCL net plugin (one rank per host on
the hosts' planes: the plugin moves its lanes; `--job` picks one or both), every result
bit-checked — and break the fabric under them one fault at a time: an uplink cut, a leaf–spine
link down, gray loss on a spine link, a flapping link, a one-direction loss, an MTU black hole.
Each fault is aimed at the link of its tier that carries the most of the jobs' traffic. It
prints the timeline per job (fault → detected → localized → rerouted → back to speed), draws the
per-step all-reduce time with the faults marked (PNG and a terminal sparkline) and a summary
(`-o json` for scripts). `--compare` then runs the same script with LinkPass off — no agents, no
LinkPass routes, no coordinator; the plugin alone, without the agents' table — on the same
fabric, in the same run.

Everything it starts is stopped and everything it builds is removed on the way out, also on
Ctrl-C, SIGTERM or a crash; a run killed with SIGKILL is cleaned up by the next one.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack

from ..console.output import EXIT_CRITICAL, EXIT_OK, EXIT_WARNING, paint, table
from ..core.names import host_name
from . import timeline
from .script import SCRIPT, Scripted, select
from ..console.files import absolute
from ..testbed.agents import LAB_INTERVAL_MS
from ..testbed.ports import free_port

HOSTS = [0, 1, 2, 3]
DEFAULT_PREFIX = "lpdemo"
GLOO, PLUGIN, BASELINE = "gloo", "nccl-plugin", "single-tcp"  # BASELINE: the benchmark's, not a --job
JOB_CHOICES = {"gloo": (GLOO,), "nccl-plugin": (PLUGIN,), "both": (GLOO, PLUGIN)}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: a real gloo all-reduce keeps running while links fail",
                       description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", action="store_true", help="then run the same faults with LinkPass off")
    p.add_argument("--job", choices=tuple(JOB_CHOICES), default="both",
                   help="gloo (torch, routes moved), nccl-plugin (ring all-reduce over the NCCL net plugin, "
                        "lanes moved) or both side by side (default)")
    p.add_argument("--faults", metavar="KINDS", help=f"comma-separated subset of: {', '.join(s.kind for s in SCRIPT)}")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table",
                   help="json: the summary on stdout, progress on stderr")
    p.add_argument("--out", metavar="DIR", type=absolute, help="output folder (default out/demo-<time>): plot, summary, logs")
    p.add_argument("--size-mb", type=float, default=4.0, help="all-reduce bucket, MB of float32 (default 4)")
    p.add_argument("--plugin-size-mb", type=float, default=1.0,
                   help="the NCCL-plugin job's all-reduce, MB of uint32 (default 1: beside the gloo job on two "
                        "cores, a bigger one slows the gloo job's recovery by taking its CPU)")
    p.add_argument("--compute-ms", type=float, default=10.0, help="simulated compute per step (default 10)")
    p.add_argument("--job-timeout-s", type=float, default=30.0,
                   help="collective timeout; a failed collective restarts the job (default 30, like NCCL)")
    p.add_argument("--interval-ms", type=float, default=LAB_INTERVAL_MS,
                   help=f"agents' probe interval (default {LAB_INTERVAL_MS:g}: four agents at 1 ms saturate a 2-core machine)")
    p.add_argument("--rto-min-ms", type=int, default=10,
                   help="rto_min on the agents' routes: how soon TCP retransmits onto the new path (default 10)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"name prefix of the demo testbed (default {DEFAULT_PREFIX})")
    p.add_argument("--keep", action="store_true", help="leave the testbed up at the end")
    p.set_defaults(func=run, needs_root=True)


class Demo:
    """One demo run: its fabric, its output folder, and the things it started (for cleanup)."""

    def __init__(self, args, stack: ExitStack):
        self.args, self.stack = args, stack
        self.json_out = args.output == "json"
        # absolute from here on: the folder is written into the agents' configs and read by
        # processes started elsewhere (absolute() is --out's argparse type)
        self.out = args.out or absolute(os.path.join("out", "demo-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S")))
        os.makedirs(self.out, exist_ok=True)
        self.script = select(args.faults)
        self.fab = None
        self.agents = None
        self.coordinator_url = None
        self.reader_token = None
        self.reader_token_file = None  # Prometheus reads it for the series that name hosts and links
        self.tls_dir = None  # the coordinator's lab CA
        self.prom = None  # the demo's Prometheus (linkpass.testbed.prometheus), when it could start
        self.alerts: dict[str, list[tuple[float, float]]] = {}  # alertname -> firing spans, LinkPass on
        self.alert_instances: dict[str, list[tuple[float, float]]] = {}  # ... each instance's own
        self.fired: list[dict] = []  # alert_summary of the run with LinkPass
        self.t0_wall = time.time()
        self.t0 = time.monotonic()
        self.runs: list[tuple] = []  # (panel name, steps, faults, restart times) for the plot

    # ---- output --------------------------------------------------------------------------
    @property
    def stream(self):
        return sys.stderr if self.json_out else sys.stdout

    def say(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def step(self, text: str) -> None:
        self.say(paint(f"[{time.monotonic() - self.t0:5.1f} s] {text}", "bold", self.stream))

    def progress(self, text: str) -> None:
        self.say(f"  {paint('…', 'dim', self.stream)} {text}")

    # ---- set-up --------------------------------------------------------------------------
    def build(self) -> None:
        from ..testbed import build, faults, traffic
        from ..testbed.topology import preset

        build.clean(self.args.prefix)  # a run killed with SIGKILL may have left objects behind
        self.step("building the default testbed: 4 hosts × 2 planes, 2 leaves + 2 spines per plane")
        self.fab = build.up(preset("default"), self.args.prefix, self.progress)
        if not self.args.keep:
            self.stack.callback(build.down, self.args.prefix)
        self.stack.callback(faults.clear, self.args.prefix)
        rows = traffic.reachability(self.fab)
        bad = [r for r in rows if not r["ok"]]
        if bad:
            raise RuntimeError(f"the fresh testbed does not deliver: {len(bad)} of {len(rows)} paths fail, e.g. "
                               f"{bad[0]['src']} → {bad[0]['dst']} plane {bad[0]['plane']}")
        self.progress(f"every host reaches every host over every plane ({len(rows)} paths)")

    def start_coordinator(self, extra: dict | None = None) -> None:
        """The coordinator as a detached Ray actor; `extra`: more of its settings (shards, a
        PostgreSQL store), over the demo's."""
        from ..coordinator import ray_actor
        from ..control.tls import lab_dir
        from ..core.fabric import from_testbed

        self.step("starting the coordinator: a Ray actor on a local Ray")
        port = free_port()
        state = os.path.abspath(os.path.join(self.out, "coordinator"))
        # HTTPS with mutual TLS: the coordinator makes its lab CA in <state>/tls on first start, its
        # certificate naming the address the namespaced agents reach it on
        settings = {"state_dir": state, "listen": f"0.0.0.0:{port}", "fabric_model": from_testbed(self.fab).to_dict(),
                    "tls_san": [self.fab.mgmt_root_addr], "require_client_cert": True, **(extra or {})}
        sigterm = signal.getsignal(signal.SIGTERM)
        ray_actor.connect(num_cpus=1)
        signal.signal(signal.SIGTERM, sigterm)  # Ray installs its own; ours unwinds through the cleanup
        self.stack.callback(ray_actor.shutdown)
        handle, _ = ray_actor.ensure(settings)
        self.stack.callback(self.stop_coordinator)
        self.coordinator_url = f"https://{self.fab.mgmt_root_addr}:{port}"
        self.reader_token_file = os.path.join(state, "reader.token")
        self.reader_token = open(self.reader_token_file).read().strip()
        self.tls_dir = lab_dir(state)
        self.progress(f"coordinator answers at {self.coordinator_url} (TLS, client certificates required; "
                      f"state and lab CA in {state})")
        self._actor = handle

    def client(self):
        """A reader's client of the coordinator, with the lab CA and the CLI's client certificate."""
        from ..control.client import Client
        from ..control.tls import LOCAL_CLIENT, build_client_context, lab_paths

        return Client(self.coordinator_url, self.reader_token,
                      tls=build_client_context(lab_paths(self.tls_dir, "ca")[0], *lab_paths(self.tls_dir, LOCAL_CLIENT)))

    def stop_coordinator(self) -> None:
        from ..coordinator import ray_actor

        if getattr(self, "_actor", None) is not None:
            ray_actor.stop_all()  # the shards, if any, then the root
            self._actor = None
        sigterm = signal.getsignal(signal.SIGTERM)
        ray_actor.shutdown()
        # Ray's shutdown puts the kernel's SIGTERM action back to the default behind Python's back
        # (Python still lists ours): set ours again, so a SIGTERM in the rest of the run still
        # unwinds through the cleanup instead of leaving the testbed behind
        signal.signal(signal.SIGTERM, sigterm)

    def start_agents(self) -> None:
        from ..testbed.agents import Agents

        self.step(f"starting an agent on each of the 4 hosts (probes every {self.args.interval_ms:g} ms "
                  "on every path to every peer)")
        link = {"url": self.coordinator_url, "agent_secret_file": os.path.join(self.out, "coordinator", "agent.secret"),
                "report_ms": 50, "summary_s": 5}
        # damping memory of 1 s (default 10 s): the flapping link is reusable a few seconds after
        # it stops, so the next fault meets a healthy fabric; size probes every 10th probe so an
        # MTU black hole is seen in ~150 ms at this probe rate
        self.agents = Agents(self.fab, os.path.join(self.out, "agents"), HOSTS, interval_ms=self.args.interval_ms,
                             coordinator=link, detect={"flap_half_life_ms": 1000},
                             probe={"size_probe_every": 10}, route_options={"rto_min_ms": self.args.rto_min_ms},
                             tls_dir=self.tls_dir)
        self.stack.callback(self.stop_agents)
        self.agents.start()
        expected = sum(1 if self.fab.leaf_of(a, p) == self.fab.leaf_of(b, p) else self.fab.spec.spines_per_plane
                       for a in HOSTS for b in HOSTS if a != b for p in range(self.fab.spec.planes))
        status = self.wait_coordinator(lambda st: st["paths"] == expected and
                                       st["paths_by_state"].get("up") == expected and not st["findings"], 60)
        if status is None:
            raise RuntimeError(f"the coordinator did not hear of {expected} healthy paths within 60 s; "
                               f"the agents' logs are in {self.out}/agents")
        self.progress(f"{expected} paths (every ECMP path to every peer, both planes) probed and up, "
                      "as the coordinator sees them")

    def start_prometheus(self) -> None:
        """Prometheus scraping every agent over the management network and the coordinator over
        mutual TLS, the project's rules loaded at lab durations; its alerts join the timeline."""
        from ..core.constants import AGENT_METRICS_PORT
        from ..testbed.prometheus import PrometheusMissing, for_lab
        from ..observe.rules import LAB, alerts

        self.step("starting Prometheus (Debian's package, a private data dir removed on exit): scraping the agents "
                  "and the coordinator, with LinkPass's alert rules")
        coordinator = self.coordinator_url.split("://", 1)[1] if self.coordinator_url else None
        try:
            self.prom = for_lab([f"{self.fab.mgmt_addr(h)}:{AGENT_METRICS_PORT}" for h in HOSTS], coordinator,
                                self.tls_dir, self.reader_token_file)
        except (PrometheusMissing, RuntimeError) as exc:
            self.progress(paint(f"no Prometheus ({exc}); the ALERT column stays empty", "yellow", self.stream))
            return
        self.stack.callback(self.stop_prometheus)
        deadline = time.monotonic() + 30
        while not (len(up := self.prom.targets_up()) == len(HOSTS) + 1 and all(up.values())):
            if time.monotonic() > deadline:
                down = [u for u, ok in up.items() if not ok]
                self.progress(paint(f"Prometheus cannot scrape {', '.join(down) or 'its targets'}; going on",
                                    "yellow", self.stream))
                break
            time.sleep(0.5)
        else:
            self.progress(f"Prometheus at {self.prom.url}: {len(HOSTS)} agents and the coordinator scraped every "
                          f"second, {len(alerts(LAB))} alert rules")

    def take_alerts(self) -> None:
        """The alerts that fired while LinkPass ran, once what still fires has had time to clear."""
        if self.prom is None:
            return
        deadline = time.monotonic() + 20
        while self.prom.firing() and time.monotonic() < deadline:
            time.sleep(0.5)
        end = time.time()
        self.alerts = self.prom.firing_spans(self.t0_wall, end)
        self.alert_instances = self.prom.firing_spans(self.t0_wall, end, merge=False)
        self.fired = alert_summary(self.alerts, self.t0_wall, sorted(self.prom.firing()))

    def stop_prometheus(self) -> None:
        if self.prom is not None:
            self.prom.close()
            self.prom = None

    def wait_coordinator(self, pred, timeout_s: float) -> dict | None:
        """The coordinator's status once pred(status) holds, or None at the timeout."""
        from ..control.client import Refusal, Unreachable

        c = self.client()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                try:
                    st = c.get("/v1/status")
                    if pred(st):
                        return st
                except (Refusal, Unreachable):
                    pass
                time.sleep(0.2)
            return None
        finally:
            c.close()

    def stop_agents(self) -> None:
        """Stop the agents and remove their routes: without LinkPass the testbed's own routes are
        the whole story."""
        if self.agents is not None:
            self.agents.stop()
            self.agents.remove_routes()
            self.agents = None

    # ---- the jobs and the faults ---------------------------------------------------------
    def start_jobs(self, name: str, linkpass: bool, kinds: tuple[str, ...] | None = None) -> dict:
        """The jobs `--job` asks for (or `kinds`), started and running: kind -> job. BASELINE is
        the same ring over one TCP connection per peer (bench/nccl_plugin.py's peer)."""
        from .ranks import PluginRingJob, TrainingJob

        jobs = {}
        for kind in kinds or JOB_CHOICES[self.args.job]:
            out = os.path.join(self.out, f"job-{name}" if kind == GLOO else f"job-{name}-{kind}")
            if kind == GLOO:
                job = TrainingJob(self.fab, out, HOSTS, self.args.size_mb, self.args.compute_ms,
                                  self.args.job_timeout_s)
                self.step(f"starting the training job: torch.distributed gloo, {len(HOSTS)} ranks, "
                          f"{self.args.size_mb:g} MB all-reduce per step + {self.args.compute_ms:g} ms compute")
            else:
                from linkpass_rdma import nccl

                size_mb = getattr(self.args, "plugin_size_mb", None) or self.args.size_mb
                job = PluginRingJob(self.fab, out, HOSTS, size_mb,
                                    nccl.plugin() if kind == PLUGIN else nccl.baseline(), nccl.allreduce(),
                                    entropy_dir=self.agents.directory if linkpass and self.agents else None,
                                    compute_ms=self.args.compute_ms)
                self.step(f"starting the NCCL-plugin job: a ring all-reduce over {os.path.basename(job.plugin)}, "
                          f"{len(HOSTS)} ranks on both planes, {size_mb:g} MB per step + "
                          f"{self.args.compute_ms:g} ms compute" + ("" if linkpass else ", the plugin alone"))
            self.stack.callback(job.stop, 10.0)
            job.start()
            self.progress(f"running: {len(job.steps())} steps done, every result bit-exact so far"
                          if not job.wrong_results() else paint(f"{job.wrong_results()} wrong results", "red"))
            jobs[kind] = job
        return jobs

    @staticmethod
    def wait_all(jobs: dict, pred, timeout_s: float, what: str) -> None:
        """Poll every job (restarting one whose rank failed) until pred() holds."""
        first, *others = jobs.values()

        def polled() -> bool:
            for j in others:
                j.poll()
            return pred()
        first.wait_until(polled, timeout_s, what)

    def wait_steady(self, jobs: dict, linkpass: bool) -> None:
        """Until the fabric has recovered from the last fault and every job has run a full
        baseline window since: with LinkPass, every path back up (damping included)."""
        if linkpass and not self.agents.wait_healthy(timeout_s=60):
            self.progress(paint("agents still see unhealthy paths after 60 s; going on", "yellow"))
        since = time.time_ns()
        for job in jobs.values():
            self.wait_all(jobs, lambda: any(s["start_ns"] > since for s in job.steps()),
                          self.args.job_timeout_s * 2 + 30, "the job to resume")
        for job in jobs.values():
            resumed = next(s["start_ns"] for s in job.steps() if s["start_ns"] > since)
            self.wait_all(jobs, lambda: job.steps()[-1]["end_ns"] - resumed >= timeline.BASELINE_S * 1e9, 60,
                          "a baseline of steps")

    def inject(self, jobs: dict, index: int, sc: Scripted) -> timeline.Fault:
        from ..testbed import faults
        from .aim import busiest, measure_load

        link, frm, rate = busiest(self.fab, measure_load(self.fab), sc.tier, sc.directed)
        where = f"{link}" + (f" from {frm}" if frm else "")
        rec = faults.apply(self.args.prefix, faults.FaultSpec(sc.fault, link, frm if sc.directed else None,
                                                              dict(sc.params)))
        effective = rec["effective_mono_ns"]
        if sc.fault == "flap":  # the flapper is a process of its own: its first DOWN is the fault
            self.wait_all(jobs, lambda: faults.flap_transitions(self.args.prefix, rec["id"]), 30,
                          "the flapper's first DOWN")
            effective = faults.flap_transitions(self.args.prefix, rec["id"])[0][0]
        injected = effective + time.time_ns() - time.monotonic_ns()
        self.progress(f"{index}: {sc.label} on {where} (carrying {rate / 1e6:.0f} MB/s of the jobs' traffic), "
                      f"held {sc.hold_s:g} s")
        self.wait_all(jobs, lambda: time.time_ns() - injected >= sc.hold_s * 1e9, sc.hold_s + 60, "the fault's hold")
        gone = faults.clear(self.args.prefix, link)
        cleared = max((g.get("cleared_mono_ns") or 0 for g in gone), default=0) or time.monotonic_ns()
        return timeline.Fault(index=index, kind=sc.kind, label=sc.label, link=link, direction=frm,
                              severity=sc.severity, load_mbps=round(rate / 1e6, 1), injected_ns=injected,
                              cleared_ns=cleared + time.time_ns() - time.monotonic_ns(), alerts=sc.alerts)

    def run_script(self, jobs: dict, linkpass: bool) -> list[timeline.Fault]:
        done = []
        for i, sc in enumerate(self.script, 1):
            self.wait_steady(jobs, linkpass)
            done.append(self.inject(jobs, i, sc))
        self.wait_steady(jobs, linkpass)
        return done

    # ---- what happened -------------------------------------------------------------------
    def agent_events(self) -> list[dict]:
        if self.agents is None:
            return []
        return [e for h in HOSTS for e in self.agents.events(h) if e.get("event") in ("path_state", "route_change")]

    def coordinator_events(self) -> list[dict]:
        if self.coordinator_url is None:
            return []
        c = self.client()
        try:
            return c.get("/v1/events", kind="localization", limit=1000)
        finally:
            c.close()

    def finish_run(self, name: str, jobs: dict, faults: list[timeline.Fault], linkpass: bool) -> dict:
        """Stop the jobs; kind -> RunSummary, and a plot panel per job."""
        agent_events = self.agent_events() if linkpass else []
        coordinator_events = self.coordinator_events() if linkpass else []
        if linkpass:
            self.take_alerts()
        out = {}
        for kind, job in jobs.items():
            job.stop()
            out[kind] = timeline.summarise("linkpass" if linkpass else "off", job.steps(), job.wrong_results(),
                                           job.restarts, faults, agent_events, coordinator_events,
                                           self.fab.spec.planes, self.alert_instances if linkpass else None)
            panel = name + {GLOO: "", PLUGIN: " · NCCL plugin" + ("" if linkpass else " alone"),
                            BASELINE: " · single TCP"}[kind]
            self.runs.append((panel, job.steps(), faults, job.restart_at_ns))
        return out

def _fmt_ms(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _fmt_s(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


def alert_summary(spans: dict[str, list[tuple[float, float]]], t0: float, still_firing: list[str]) -> list[dict]:
    """Per alert that fired during the run: how often, when (s after the demo's start), cleared?"""
    return [{"alert": name, "fired": len(sp), "spans_s": [[round(a - t0, 1), round(b - t0, 1)] for a, b in sp],
             "cleared": name not in still_firing} for name, sp in sorted(spans.items(), key=lambda kv: kv[1][0][0])]


def _short(alert: str | None) -> str:
    return (alert or "").removeprefix("LinkPass")


def render_run(run: timeline.RunSummary, title: str, sparkline: tuple[str, str] | None) -> str:
    rows = []
    for f in run.faults:
        where = f.link + (f" from {f.direction}" if f.direction else "")
        named = "—" if f.localized_ms is None else \
            f"{_fmt_ms(f.localized_ms)} ({f.localized_as.split(':')[0]}{'' if f.localized_as.startswith(f.link) else ' twin'})"
        verdict = paint("✓", "green") if f.met else paint("✗", "red")
        alert = "—" if f.alert_ms is None else f"{f.alert_ms / 1000:.1f} s ({_short(f.alert)})"
        rows.append([f.index, f.label, where, f"{f.load_mbps:.0f}", _fmt_ms(f.detect_ms), named, _fmt_ms(f.reroute_ms),
                     _fmt_ms(f.stall_ms), _fmt_s(f.recovered_s), alert, f"≤ {f.target_stall_ms:.0f} ms, ≤ 1 s",
                     verdict])
    out = [paint(title, "bold"),
           table(["#", "FAULT", "LINK", "MB/S", "DETECTED", "LOCALIZED", "REROUTED", "STALL", "BACK TO 95 %",
                  "ALERT FIRED", "TARGET", ""], rows),
           f"  steps {run.steps} · wrong results {run.wrong_results} · restarts {run.restarts} · "
           f"all-reduce p50 {_fmt_ms(run.step_ms_p50)}, p99 {_fmt_ms(run.step_ms_p99)}"]
    if run.noise_stall_ms:
        n = run.noise_stall_ms
        out.append(f"  scheduling noise: fault-free 2.5 s windows read as a STALL of {_fmt_ms(n['median'])} median, "
                   f"{_fmt_ms(n['p90'])} p90 ({n['windows']} windows) on this machine")
    if sparkline and sparkline[0]:
        out += ["  slowest all-reduce over time (log scale), faults numbered below:",
                "  " + sparkline[0], "  " + sparkline[1]]
    return "\n".join(out)


def run(args) -> int:
    from .plot import write_png
    from .ranks import JobFailed

    try:
        select(args.faults)
    except ValueError as exc:
        print(f"linkpass demo: {exc}", file=sys.stderr)
        return 2
    code = EXIT_CRITICAL
    with ExitStack() as stack:
        demo = Demo(args, stack)
        try:
            demo.say(paint("LinkPass demo — a real all-reduce keeps running while the fabric's links fail", "bold"))
            demo.build()
            demo.start_coordinator()
            demo.start_agents()
            demo.start_prometheus()
            jobs = demo.start_jobs("linkpass", linkpass=True)
            demo.step(f"breaking the fabric under the {'jobs' if len(jobs) > 1 else 'job'}, one fault at a time "
                      f"({len(demo.script)} faults)")
            faults = demo.run_script(jobs, linkpass=True)
            on_all = demo.finish_run("LinkPass on", jobs, faults, linkpass=True)
            off_all = {}
            without = None
            if args.compare:
                demo.step("--compare: LinkPass off (agents stopped, their routes removed, coordinator stopped)")
                demo.stop_prometheus()  # its alerts are taken; with the agents gone, all would be "down"
                demo.stop_agents()
                demo.stop_coordinator()
                without = _check_linkpass_absent(demo.fab, HOSTS)
                demo.progress(f"LinkPass routes on the hosts: {without['linkpass_routes']}, "
                              f"agents running: {without['agents_running']}")
                jobs = demo.start_jobs("off", linkpass=False)
                demo.step(f"the same {len(demo.script)} faults without LinkPass")
                faults_off = demo.run_script(jobs, linkpass=False)
                after = _check_linkpass_absent(demo.fab, HOSTS)
                without = {k: max(without[k], after[k]) for k in without}
                off_all = demo.finish_run("LinkPass off", jobs, faults_off, linkpass=False)
            kinds = list(on_all)
            plot = write_png(os.path.join(demo.out, "timeline.png"), demo.runs,
                             "all-reduce time per step while links fail (4 ranks: "
                             + " and ".join("torch gloo" if k == GLOO else "the NCCL plugin's ring" for k in kinds) + ")")
            alerts_png = None
            if demo.alerts:
                from .plot import write_alerts_png

                alerts_png = write_alerts_png(os.path.join(demo.out, "alerts.png"), demo.alerts, faults,
                                              demo.t0_wall)
            ok = all(timeline.targets_met(r) for r in on_all.values())
            unharmed = all(timeline.job_unharmed(r) for r in on_all.values())
            code = EXIT_OK if ok else EXIT_WARNING if unharmed else EXIT_CRITICAL
            # the first job's run is the summary's top level (as before the plugin job existed);
            # the plugin's, when both ran, is under "nccl_plugin"
            on, off = on_all[kinds[0]], off_all.get(kinds[0])
            elapsed = time.monotonic() - demo.t0
            summary = {
                "ok": ok, "duration_s": round(elapsed, 1), "output_dir": os.path.abspath(demo.out),
                "plot": os.path.abspath(plot),
                "job": {"ranks": len(HOSTS), "backend": kinds[0], "size_mb": args.size_mb,
                        "compute_ms": args.compute_ms, "timeout_s": args.job_timeout_s},
                "jobs": kinds,
                "agents": {"interval_ms": args.interval_ms},
                "targets": {"restarts": 0, "wrong_results": 0, "stall_ms": timeline.TARGET_STALL_MS,
                            "recovered_s": timeline.TARGET_RECOVERED_S, "duration_s": 180},
                **{k: v for k, v in on.as_dict().items() if k != "mode"},
                "compare": None if off is None else {**off.as_dict(), **without},
                "alerts": demo.fired,
                "alerts_plot": alerts_png and os.path.abspath(alerts_png),
            }
            if len(kinds) > 1:
                p_on, p_off = on_all[PLUGIN], off_all.get(PLUGIN)
                summary["nccl_plugin"] = {**p_on.as_dict(), "ok": timeline.targets_met(p_on),
                                          "compare": None if p_off is None else p_off.as_dict()}
            with open(os.path.join(demo.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            if args.output == "json":
                print(json.dumps(summary, indent=2))
            else:
                _print_report(demo, on_all, off_all, plot, code, elapsed)
        except (JobFailed, RuntimeError) as exc:
            demo.say(paint(f"demo failed: {exc}", "red", demo.stream))
            demo.say(f"logs: {os.path.abspath(demo.out)}")
        except KeyboardInterrupt:
            demo.say(paint("\ninterrupted: cleaning up", "yellow", demo.stream))
            raise
        finally:
            if args.keep and demo.fab is not None:
                demo.say(f"testbed left up (prefix {args.prefix}); remove it with "
                         f"`linkpass testbed down --prefix {args.prefix}`")
            demo.step("cleaning up: job, agents, coordinator, faults, testbed")
    return code


def _check_linkpass_absent(fab, hosts: list[int]) -> dict:
    """What of LinkPass is on the demo's hosts right now: routes of its protocol, agent processes
    in their namespaces."""
    from ..core.constants import RTPROT_LINKPASS

    routes = agents = 0
    for h in hosts:
        ns = fab.netns(host_name(h))
        routes += len(subprocess.run(["ip", "-n", ns, "route", "show", "proto", str(RTPROT_LINKPASS)],
                                     capture_output=True, text=True, check=False).stdout.splitlines())
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                  check=False).stdout.split():
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            agents += b"linkpass.cli" in argv and b"agent" in argv
    return {"linkpass_routes": routes, "agents_running": agents}


def _print_report(demo: Demo, on_all: dict, off_all: dict, plot: str, code: int, elapsed: float) -> None:
    from .plot import sparkline

    runs = {name: (steps, fl) for name, steps, fl, _ in demo.runs}
    for kind, on in on_all.items():
        what = "" if kind == GLOO else " — the NCCL plugin's ring all-reduce (lanes moved by the plugin)"
        panel = "LinkPass on" if kind == GLOO else "LinkPass on · NCCL plugin"
        demo.say()
        demo.say(render_run(on, f"With LinkPass{what} — ms after each fault took effect; stall = longest "
                                "all-reduce beyond the pre-fault median", sparkline(*runs[panel])))
    for kind, off in off_all.items():
        demo.say()
        if kind == GLOO:
            demo.say(render_run(off, "Without LinkPass (--compare): the same faults, the testbed's own ECMP routes",
                                sparkline(*runs["LinkPass off"])))
            worst = max((f.stall_ms or 0 for f in off.faults), default=0)
            demo.say(f"  without LinkPass the job sits out every fault until the script heals the link (worst "
                     f"stall {worst / 1000:.1f} s); a real cut lasts until someone replaces the optic, and NCCL "
                     f"gives up after ~30 s: the job restarts from its checkpoint")
        else:
            demo.say(render_run(off, "The NCCL plugin alone (--compare): no agents, no entropy table; the plugin "
                                     "finds stuck lanes itself", sparkline(*runs["LinkPass off · NCCL plugin alone"])))
    demo.say()
    if demo.fired:
        demo.say(paint("Prometheus alerts while LinkPass ran (lab rules; runbooks in docs/runbooks.md):", "bold"))
        for a in demo.fired:
            state = paint("cleared", "green") if a["cleared"] else paint("STILL FIRING", "red")
            first = a["spans_s"][0][0]
            demo.say(f"  {a['alert']:<30} fired {a['fired']}× (first {first:.0f} s into the demo), {state}")
        demo.say(f"  over time: {os.path.join(demo.out, 'alerts.png')}")
    else:
        demo.say("no Prometheus alerts (Prometheus did not run, or nothing fired: see above)")
    demo.say(f"plot: {plot}")
    demo.say(f"summary: {os.path.join(demo.out, 'summary.json')} (the same as `-o json`)")
    missed = sum(1 for on in on_all.values() for f in on.faults if not f.met)
    total = sum(len(on.faults) for on in on_all.values())
    verdict = {EXIT_OK: paint("demo passed: every target met", "green"),
               EXIT_WARNING: paint(f"the jobs were unharmed, but {missed} of {total} fault windows missed a timing "
                                   "target (exit 1; see docs/demo.md on this machine's noise)", "yellow"),
               }.get(code, paint("demo FAILED: a job restarted, got a wrong result, or a fault went unseen", "red"))
    demo.say(f"{verdict}: " + "; ".join(f"{'gloo' if k == GLOO else 'NCCL plugin'} {on.steps} steps, "
                                        f"{on.wrong_results} wrong results, {on.restarts} restarts"
                                        for k, on in on_all.items()) + f"; {elapsed:.0f} s in all")
