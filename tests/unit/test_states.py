"""The path-state vocabulary (pure): every state through the health mapping and the classes, and
every command that reads a state gives it the same health, exit code and colour."""
from __future__ import annotations

import ast
import inspect

import pytest

from linkpass.cli import fleet as fleet_cli
from linkpass.console import output
from linkpass.cli import paths as local_cli
from linkpass.coordinator import coordinator as coordinator_module
from linkpass.coordinator.coordinator import Coordinator
from linkpass.core.localize import path_evidence
from linkpass.coordinator.store import Store
from linkpass.core import fabric as F
from linkpass.core import states as S
from linkpass.core.detector import DIRECTION_OF_REASON, Reason
from linkpass.core.localize import BOTH, Localizer, Observation
from linkpass.core.states import DARK, HEALTH, Direction, Level, State
from linkpass.demo.timeline import Fault, first_verdict
from linkpass.doctor import checks as D

from support.doctor import healthy
from support.fleet import MODEL, fail_paths, identity, table_of


NOW = 1_796_000_000.0

# state: (usable, dark, bad, good, health); the table of states.py's docstring
EXPECTED = {
    State.UP: (True, False, False, True, Level.OK),
    State.SUSPECT: (True, False, False, False, Level.WARNING),
    State.RECOVERING: (False, False, False, False, Level.WARNING),
    State.DEGRADED: (False, False, True, False, Level.WARNING),
    State.DOWN: (False, True, True, False, Level.CRITICAL),
    State.DAMPED: (False, True, True, False, Level.CRITICAL),
}
EXIT = {Level.OK: output.EXIT_OK, Level.WARNING: output.EXIT_WARNING, Level.CRITICAL: output.EXIT_CRITICAL}


@pytest.mark.parametrize("state", list(State))
def test_every_state_has_one_health_and_its_classes(state):
    usable, dark, bad, good, health = EXPECTED[state]
    assert (state.usable, state in DARK, state in S.BAD, state in S.GOOD, state.health) == EXPECTED[state]
    assert (state in S.USABLE, S.is_bad(state.value), S.is_good(state.value)) == (usable, bad, good)
    assert HEALTH[state] is health and S.health_of(state.value) is health and S.health_of(state) is health
    assert S.state_of(state.value) is state
    assert (state in S.HELD_OUT) == (not usable and not dark)


def test_the_classes_fit_together():
    usable, held, dark, bad, good = (set(c) for c in (S.USABLE, S.HELD_OUT, DARK, S.BAD, S.GOOD))
    assert set(HEALTH) == set(State) == set(EXPECTED)
    assert usable | held | dark == set(State)
    assert len(S.USABLE) + len(S.HELD_OUT) + len(DARK) == len(State)  # no state in two classes
    assert dark == {s for s in State if s.health is Level.CRITICAL}  # critical is exactly dark
    assert good == {s for s in State if s.health is Level.OK}
    assert dark <= bad and not bad & usable
    assert S.STATE_NAMES == tuple(s.value for s in State)


def test_names_that_are_not_states_have_no_health():
    for name in (None, "", "UP", "dead", ["up"]):
        assert S.state_of(name) is None and S.health_of(name) is None
        assert not S.is_bad(name) and not S.is_good(name)


def test_worst():
    assert S.worst([]) is Level.OK and S.worst([None, Level.OK]) is Level.OK
    assert S.worst([Level.WARNING, None, Level.OK]) is Level.WARNING
    assert S.worst([Level.WARNING, Level.CRITICAL, Level.OK]) is Level.CRITICAL
    assert [lv.rank for lv in Level] == [0, 1, 2]


# ---- every command gives a state the same health ---------------------------------------------

def local_row(state: str, replies: int = 100, loss_pct: float = 0.0) -> dict:
    """A `GET /v1/paths` row of the local agent, with a clean window unless told otherwise."""
    return {"peer": "h1", "plane": 0, "path": "5f3a", "state": state, "reason": None, "sport": 49153,
            "sent": 1000, "replies": 1000, "jitter_ns": 2000, "window_s": 1.0,
            "window": {"sent": 100, "replies": replies, "loss_pct": loss_pct, "loss_fwd_pct": loss_pct,
                       "loss_rev_pct": 0.0},
            "rtt_ns": {"p50": 40_000, "p99": 90_000}, "owd_fwd_ns": None, "owd_rev_ns": None}


def host_row(state: str) -> dict:
    """A `GET /v1/paths?host=` row of the coordinator."""
    return {"key": "h0/1", "host": "h0", "peer": "h1", "plane": 0, "sport": 49153, "state": state,
            "reason": None, "updated": NOW - 5, "links": []}


@pytest.fixture
def colour(monkeypatch):
    monkeypatch.setattr(output, "use_color", lambda stream=None: True)


def state_cell(text: str, state: str) -> str:
    """The painted state cell in a rendered table (the first cell that paints `state`)."""
    for code in output._COLORS.values():
        if f"\033[{code}m{state}\033[0m" in text:
            return code
    raise AssertionError(f"{state} is not painted in {text!r}")


@pytest.mark.parametrize("state", list(State))
def test_paths_local_and_paths_host_agree_on_every_state(state, colour):
    want = EXIT[EXPECTED[state][4]]
    for others in ([], ["up"], ["up", "suspect"]):
        names = [state.value, *others]
        assert local_cli.paths_exit([local_row(s) for s in names]) == \
            fleet_cli.paths_exit([host_row(s) for s in names]), names
    assert local_cli.paths_exit([local_row(state.value)]) == want
    assert fleet_cli.paths_exit([host_row(state.value)]) == want
    colour_code = output._COLORS[output.COLOUR_OF_LEVEL[state.health]]
    assert state_cell(local_cli.render([local_row(state.value)]), state.value) == colour_code
    assert state_cell(fleet_cli.render_paths([host_row(state.value)], NOW), state.value) == colour_code


def test_the_local_window_can_only_make_a_path_worse():
    assert local_cli.paths_exit([local_row("up", loss_pct=5.0)]) == output.EXIT_WARNING
    assert local_cli.paths_exit([local_row("up", replies=0, loss_pct=100.0)]) == output.EXIT_CRITICAL
    assert local_cli.paths_exit([local_row("down", loss_pct=5.0)]) == output.EXIT_CRITICAL
    assert local_cli.paths_exit([]) == fleet_cli.paths_exit([]) == output.EXIT_OK
    text = local_cli.render([local_row("suspect"), local_row("degraded"), local_row("damped"),
                             local_row("up", replies=0, loss_pct=100.0)])
    assert text.endswith("4 paths, window 1 s: 2 lossy or degraded, 2 dark or down")


def test_a_down_the_agent_holds_back_is_a_warning_and_says_so(colour):
    held = {**local_row("down"), "held": True}
    assert local_cli.paths_exit([held]) == output.EXIT_WARNING
    assert local_cli.paths_exit([held, local_row("down")]) == output.EXIT_CRITICAL
    assert local_cli.paths_exit([{**held, "window": {**held["window"], "replies": 0}}]) == output.EXIT_CRITICAL
    text = local_cli.render([held, local_row("up")])
    assert state_cell(text, "down (held)") == output._COLORS[output.COLOUR_OF_LEVEL[Level.WARNING]]
    assert text.endswith("2 paths, window 1 s: 0 lossy or degraded, 0 dark or down, 1 down but held "
                         "(traffic not moved)")


def test_a_state_this_code_does_not_know_is_shown_red_and_judges_nothing(colour):
    assert local_cli.paths_exit([local_row("sideways")]) == fleet_cli.paths_exit([host_row("sideways")]) == 0
    assert state_cell(local_cli.render([local_row("sideways")]), "sideways") == output._COLORS["red"]


@pytest.mark.parametrize("state", list(State))
def test_doctor_judges_a_path_by_its_health(state):
    f = healthy()
    f.agent_rows = [{"peer": "h1", "plane": 0, "state": state.value}]
    want = {Level.OK: D.OK, Level.WARNING: D.WARN, Level.CRITICAL: D.FAIL}[state.health]
    assert D.check_agent(f).status == want
    f.agent_rows.append({"peer": "h2", "plane": 0, "state": "up"})  # one path left: never FAIL
    assert D.check_agent(f).status == (D.OK if state.health is Level.OK else D.WARN)


@pytest.mark.parametrize("state", list(State))
def test_fleet_status_warns_for_every_path_that_is_not_ok(coord, state):
    coord.report({"name": "h0", "changes": [{"id": 1, "state": state.value, "reason": None}]}, 1001.0)
    # one path is never a localized fault: at worst a warning for the fleet
    assert coord.status(1001.0)["health"] == ("ok" if state.health is Level.OK else "warning")


# ---- the coordinator's localization evidence and the demo's verdicts: the BAD class ------------

def test_localization_evidence_is_bad_for_down_damped_degraded_and_good_for_up():
    evidence = {s: path_evidence(s.value, None) for s in State}
    assert {s for s, e in evidence.items() if e is not None and e[0]} == {State.DOWN, State.DAMPED, State.DEGRADED}
    assert {s for s, e in evidence.items() if e is not None and not e[0]} == {State.UP}
    assert path_evidence("degraded", "gray_loss_rev") == (True, Direction.REV)
    assert path_evidence("degraded", "latency_fwd") == (True, Direction.FWD)
    assert path_evidence("down", "hard_failure") == (True, None)


def test_the_demo_counts_a_verdict_for_the_bad_states_only():
    fault = Fault(0, "link-down", "x", "h0-p0l0", None, "hard", 0.0, 1_000_000_000, 2_000_000_000)
    for s in State:
        seen = first_verdict(fault, [{"event": "path_state", "new": s.value, "ts": 1.5}])
        assert (seen is not None) == (s in S.BAD), s


# ---- directions -----------------------------------------------------------------------------

def test_a_paths_direction_is_spelled_once():
    assert [(d.value, d.short) for d in Direction] == [("forward", "fwd"), ("reverse", "rev")]
    for reason, d in DIRECTION_OF_REASON.items():
        assert reason.value.endswith("_" + d.short)  # gray_loss_fwd, latency_rev, ...
    assert set(DIRECTION_OF_REASON) == {Reason.GRAY_LOSS_FWD, Reason.GRAY_LOSS_REV, Reason.LATENCY_FWD,
                                        Reason.LATENCY_REV}


def test_the_localizer_takes_a_direction_or_its_value():
    fwd = ("h0-p0l0:up", "h1-p0l0:down")

    def findings(direction):
        loc = Localizer(MODEL, min_reporters=1, min_claims=1)
        loc.update(Observation("h0", "h0/1", fwd, (), True, direction))
        return [f.directed for f in loc.findings()]

    assert findings(Direction.FWD) == findings("forward") != []
    assert findings(Direction.REV) == findings("reverse")
    assert findings(BOTH) == findings("both")
    with pytest.raises(ValueError, match="'forward', 'reverse', 'both', None"):
        findings("fwd")


def test_a_links_direction_and_its_mirror():
    assert F.LINK_DIRECTIONS == (F.UP, F.DOWN) == ("up", "down")
    assert F.opposite(F.UP) == F.DOWN and F.opposite(F.DOWN) == F.UP
    assert F.mirror("p0l0-p0s1:up") == "p0l0-p0s1:down" and F.mirror(F.mirror("h0-p0l0:up")) == "h0-p0l0:up"
    with pytest.raises(F.FabricError):
        F.opposite("either")


# ---- the coordinator reads no clock ----------------------------------------------------------

def test_the_coordinator_reads_no_clock():
    tree = ast.parse(inspect.getsource(coordinator_module))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {"time", "datetime", "monotonic", "perf_counter"} & (imported | modules)
    with pytest.raises(TypeError):
        Coordinator(None, None)  # the time comes from the caller: `wall_s` is required


def test_localization_takes_no_more_of_the_time_than_the_cost_clock_allows(tmp_path):
    """The host's cost clock bounds how often the tick relocalizes: here every localization
    "takes" 1 s, so the next may run 4 s later at the earliest."""
    ticks = iter(range(0, 1000))
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, MODEL, wall_s=1000.0, cost_clock=lambda: float(next(ticks)))
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 1000.0)
    c.tick(1000.0)
    link = "p0l0-p0s1"
    fail_paths(c, 1010.0, {f"{link}:up", f"{link}:down"})
    c.tick(1010.0)
    assert len(c.findings) == 2
    fail_paths(c, 1011.0, {f"{link}:up", f"{link}:down"}, reason=None, state="up")
    c.tick(1012.0)
    assert len(c.findings) == 2  # due at 1014
    c.tick(1014.0)
    assert c.findings == {}
    store.close()


def test_the_wide_table_says_what_a_recovering_path_waits_for():
    rec = {**local_row("recovering"), "reason": "reply_seen",
           "waiting_for": ["hold-down 120 ms more", "37/100 good probes in a row"]}
    text = local_cli.render([rec, local_row("up")], wide=True)
    assert "waiting for hold-down 120 ms more; 37/100 good probes in a row" in text
    assert "waiting for" not in local_cli.render([rec], wide=False)


def test_every_state_has_its_own_colour_in_every_view():
    from linkpass.core.states import COLOR
    from linkpass.observe.dashboards import STATE_COLORS

    assert set(COLOR) == set(State) and len(set(COLOR.values())) == len(State)
    assert STATE_COLORS == {s.value: c for s, c in COLOR.items()}
