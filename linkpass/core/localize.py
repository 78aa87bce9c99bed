"""Fault localization: which directed links explain the paths the agents call bad.

Pure: no sockets, no files, no clock reads. Network tomography in the manner of NetBouncer and
007: every agent reports, per probed path, a verdict (good or bad, and when it can tell, whether
the probe or its reply was lost); the links a path crosses are known from the fleet model; the
coordinator looks for the fewest links that explain the bad paths without contradicting the good.

Model
-----
An `Observation` is one path's latest verdict: the directed links the probes cross (`forward`)
and the ones their replies cross (`reverse`). A bad observation becomes one or two *claims*,
each a set of candidate links of which at least one must be faulty:

    direction FWD     one claim: a forward link          (the reverse links are not blamed)
    direction REV     one claim: a reverse link          (the forward links worked: credit)
    direction BOTH    two claims: a forward link AND a reverse link (how a cut looks)
    direction None    one claim: any link either way     (the agent cannot tell)

(`Direction.FWD`/`REV` are a path's directions, `states.Direction`; they may be passed as their
values, "forward" and "reverse".)

Evidence is weighed per reporter, so that one agent's many paths over a link count once: on
each link a reporter *votes* good if it has more good than bad evidence there, bad if the
reverse. A link is *exonerated* when at least 2 reporters vote it good and they are at least as
many as those voting it bad, plus `exonerate_margin` (default 0: a tie acquits, so two liars
cannot convict a link that works for two others).

Suspects: a claim all of whose candidate links are exonerated contradicts what everyone else
sees. A reporter with at least `suspect_claims` such claims, making up at least `suspect_share`
of its claims, is a *suspect* (noisy, lying, or its own clock or NIC confused): its claims are
set aside and its votes, good and bad, stop counting. Repeated until no new suspect appears,
since discounting one suspect's votes can expose another that it shielded.

Greedy explanation: repeatedly take the non-exonerated link that explains the most claims not
yet explained (ties: fewer good observations on it, then more distinct reporters, then name),
provided those claims come from at least `min_reporters` distinct reporters, number at least
`min_claims`, and outnumber the good observations across the link: one lying or noisy agent
alone never produces a finding. Nor do a few noisy agents whose random claims happen to meet on
one link, as they do somewhere in a large enough fleet: each reporter lends a link the share of
its claims that name it, and the shares must add up to `min_support` (default 1): the reporters
of a real fault have most of their bad paths across it, a noisy agent a tenth here and there.
Links that explain exactly the same claims with the same good
evidence cannot be told apart: the finding names one and lists the others as `alternatives`,
its confidence shared among them. A host's uplink is
corroborated by others even so: its up direction also carries the replies to the probes other
hosts send it, its down direction their probes. Independent concurrent faults each explain
their own claims, so each is found.

The `Localizer` is incremental: `update()` adjusts per-link counters, so `findings()` touches
only the bad observations and the links on them.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Iterable

from linkpass.core.fabric import HOST_LEAF, FabricError, FabricModel, split_directed
from linkpass.core.detector import DIRECTION_OF_REASON
from linkpass.core.states import Direction, is_bad, is_good

BOTH = "both"  # a bad path lost both ways: its probes and its replies
DIRECTIONS = (Direction.FWD, Direction.REV, BOTH, None)
# The most candidate links a claim may name and still count. A reply lost on an untraced route
# may have crossed any link of any route ECMP could pick: 2 + 2S links between the leaves of a
# 2-tier plane of S spines (66 at 32 spines), 2 + 2S + 2SC between the pods of a 3-tier one
# (2 114 at 32 spines and 32 cores per group). Such a claim gives each link a 1/2 114 share of
# a vote, yet counted whole it would make every link that a few noisy agents' lost replies
# happen to share look like a culprit. Left out, the fault is found from the probes that cross
# it forward, whose claims name at most 6 links.
MAX_CANDIDATES = 128


@dataclass(frozen=True, slots=True)
class Observation:
    """One path's verdict from `reporter`; `key` is unique per path fleet-wide ("h3/17").

    `reverse` is the directed links the replies are known to cross. Pass the full reply path
    when known; when it is not, pass None: a good path credits, and a loss of unknown direction
    blames, only the links EVERY reply must cross (`FabricModel.reverse_definite`, derived from
    `forward`'s first and last link); a reply known lost (REV, BOTH) blames every link it MAY
    have crossed (`FabricModel.reverse_possible`: those and both links of each spine ECMP may
    pick). A reply lost on a spine link is then explained by that link, which the probes of
    other paths cross, and its reporter is not taken for a liar because its claim named only
    host links that work for everyone else.
    `direction` says which way the loss was, for bad observations only (see module doc):
    a `Direction` (or its value), BOTH or None."""

    reporter: str
    key: str
    forward: tuple[str, ...]
    reverse: tuple[str, ...] | None
    bad: bool
    direction: Direction | str | None = None


@dataclass(frozen=True)
class Finding:
    link: str  # physical link name
    direction: str  # the link's: fabric.UP | fabric.DOWN
    directed: str  # "link:direction"
    confidence: float  # 0..1
    bad_paths: int  # bad observations this link explains
    good_paths: int  # observations whose traffic crossed it fine (suspects' not counted)
    reporters: tuple[str, ...]  # distinct reporters of the bad paths it explains
    alternatives: tuple[str, ...] = ()  # directed links the evidence cannot tell from this one

    def as_dict(self) -> dict:
        return {"link": self.link, "direction": self.direction, "directed": self.directed,
                "confidence": self.confidence, "bad_paths": self.bad_paths, "good_paths": self.good_paths,
                "reporters": list(self.reporters), "alternatives": list(self.alternatives)}


@dataclass(frozen=True, slots=True)
class _Entry:
    """What one observation contributed to the counters, to take it back exactly."""

    obs: Observation
    credited: tuple[str, ...]  # links it gives good evidence to
    claims: tuple[tuple[str, ...], ...]  # candidate sets, one per claim (bad observations)
    blamed: tuple[str, ...]  # union of the claims' candidates


@dataclass(slots=True)
class _Claims:
    """The bad observations' claims, numbered: claim i is `reporter[i]`'s, about path `key[i]`,
    and names `candidates[i]`; `of[d]` lists the claims naming directed link d."""

    reporter: list[str]
    key: list[str]
    candidates: list[tuple[str, ...]]
    of: dict[str, list[int]]
    per_reporter: dict[str, int]  # reporter -> its number of claims


class Localizer:
    def __init__(self, model: FabricModel, *, min_reporters: int = 2, min_claims: int = 2,
                 exonerate_margin: int = 0, suspect_claims: int = 2, suspect_share: float = 0.25,
                 max_candidates: int = MAX_CANDIDATES, min_support: float = 1.0,
                 pause: Callable[[], AbstractContextManager] = nullcontext):
        self.model = model
        # what the host does around a localization pass; a coordinator pauses its cyclic
        # collector (kernel/heap.py), which core may not touch
        self.pause = pause
        self.min_support = min_support
        self.max_candidates = max_candidates
        self.suspect_claims = suspect_claims
        self.suspect_share = suspect_share
        self.min_reporters = min_reporters
        self.min_claims = min_claims
        self.exonerate_margin = exonerate_margin
        self._entries: dict[str, _Entry] = {}
        self._bad_keys: set[str] = set()
        self._by_reporter: dict[str, set[str]] = {}
        self._good_by: dict[str, dict[str, int]] = {}  # directed link -> reporter -> good evidence
        self._bad_by: dict[str, dict[str, int]] = {}  # directed link -> reporter -> bad observations
        # directed link -> reporters voting it good / bad (more good than bad evidence there, or
        # the reverse): kept as evidence comes and goes, so exonerated() need not count them
        self._good_votes: dict[str, int] = {}
        self._bad_votes: dict[str, int] = {}

    # ---- ingest ------------------------------------------------------------------------------
    def update(self, obs: Observation) -> None:
        """Record `obs`, replacing any earlier observation with the same key."""
        way = _way(obs)
        if obs.key in self._entries:
            self.forget(obs.key)
        entry = self._entry(obs, way)
        self._entries[obs.key] = entry
        r = obs.reporter
        keys = self._by_reporter.get(r)
        if keys is None:
            keys = self._by_reporter[r] = set()
        keys.add(obs.key)
        good_by, bad_by, good_votes = self._good_by, self._bad_by, self._good_votes
        for d in entry.credited:  # _add(good_by, bad_by, d, r, +1), inline: every path's hot loop
            by = good_by.get(d)
            if by is None:
                by = good_by[d] = {}
            n = by.get(r, 0)
            by[r] = n + 1
            other = bad_by.get(d)
            m = other.get(r, 0) if other else 0
            if n == m == 0:  # r's first evidence on d: a new good vote
                good_votes[d] = good_votes.get(d, 0) + 1
            elif n <= m:
                self._move_vote(d, n - m, n - m + 1)
        if obs.bad:
            self._bad_keys.add(obs.key)
            for d in entry.blamed:
                self._add(self._bad_by, self._good_by, d, r, -1)

    def forget(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        r = entry.obs.reporter
        keys = self._by_reporter[r]
        keys.discard(key)
        if not keys:
            del self._by_reporter[r]
        for d in entry.credited:
            self._drop(self._good_by, self._bad_by, d, r, +1)
        if entry.obs.bad:
            self._bad_keys.discard(key)
            for d in entry.blamed:
                self._drop(self._bad_by, self._good_by, d, r, -1)

    def _add(self, mine: dict, theirs: dict, d: str, r: str, sign: int) -> None:
        """One more piece of r's evidence on d in `mine` (good: sign +1, bad: -1; `theirs` the
        other kind); its vote moves only when the evidence was even or against."""
        by = mine.get(d)
        if by is None:
            by = mine[d] = {}
        n = by.get(r, 0)
        by[r] = n + 1
        other = theirs.get(d)
        m = other.get(r, 0) if other else 0
        if n <= m:
            diff = sign * (n - m)  # good minus bad, before
            self._move_vote(d, diff, diff + sign)

    def _drop(self, mine: dict, theirs: dict, d: str, r: str, sign: int) -> None:
        """One piece less of r's evidence on d in `mine` (as `_add`)."""
        by = mine[d]
        n = by[r]
        _decrement(by, r)
        if not by:
            del mine[d]
        other = theirs.get(d)
        m = other.get(r, 0) if other else 0
        if n <= m + 1:
            diff = sign * (n - m)
            self._move_vote(d, diff, diff - sign)

    def _move_vote(self, d: str, before: int, after: int) -> None:
        """A reporter's good-minus-bad evidence on d went from `before` to `after` (one apart):
        move its vote (good above 0, bad below) in the counts."""
        if before > 0:
            if after > 0:
                return
            counts = self._good_votes
        elif before < 0:
            if after < 0:
                return
            counts = self._bad_votes
        else:
            counts = None
        if counts is not None:
            m = counts[d] - 1
            if m:
                counts[d] = m
            else:
                del counts[d]
        if after:
            counts = self._good_votes if after > 0 else self._bad_votes
            counts[d] = counts.get(d, 0) + 1

    def forget_reporter(self, reporter: str) -> None:
        for key in list(self._by_reporter.get(reporter, ())):
            self.forget(key)

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, obs: Observation, way: Direction | str | None) -> _Entry:
        forward = tuple(obs.forward)
        if not obs.bad:
            return _Entry(obs, forward + self._replies(obs, possible=False), (), ())
        if way is Direction.FWD:
            claims = (forward,)
        elif way is Direction.REV:
            claims = (self._replies(obs, possible=True),)
        elif way == BOTH:
            claims = (forward, self._replies(obs, possible=True))
        else:
            claims = (tuple(dict.fromkeys(forward + self._replies(obs, possible=False))),)
        # a claim naming too many links says next to nothing about any of them (see MAX_CANDIDATES)
        claims = tuple(c for c in claims if c and len(c) <= self.max_candidates)
        blamed = tuple(dict.fromkeys(d for c in claims for d in c))
        # a lost reply means the probe got through: its links worked
        credited = forward if way is Direction.REV else ()
        return _Entry(obs, credited, claims, blamed)

    def _replies(self, obs: Observation, possible: bool) -> tuple[str, ...]:
        """The links the path's replies cross: `obs.reverse` when known; else those every reply
        crosses whatever ECMP picks (what a reply that arrived credits), or with `possible` those
        it may cross (what a reply known lost blames)."""
        if obs.reverse is not None:
            return tuple(obs.reverse)
        if not obs.forward:
            return ()
        try:
            last = self.model.link_at(obs.forward[-1])
            if last is None or last.kind != HOST_LEAF:
                return ()  # not a path to a host (or no link of this fleet): nothing is known about replies
            if possible:  # a claim longer than max_candidates is dropped (_entry): not listed at all
                return self.model.reverse_possible(obs.reporter, last.plane, last.a, self.max_candidates)
            return self.model.reverse_definite(obs.reporter, last.plane, last.a)
        except FabricError:
            return ()

    # ---- explain -----------------------------------------------------------------------------
    def exonerated(self, d: str, ignore: frozenset[str] | set[str] = frozenset()) -> bool:
        """At least 2 reporters vote `d` good, and at least as many (plus the margin) as vote it
        bad; the votes of the reporters in `ignore` (suspects) do not count."""
        return self._exonerated((d,), ignore)[d]

    def _exonerated(self, links: Iterable[str], ignore: frozenset[str] | set[str]) -> dict[str, bool]:
        """exonerated() of each of `links`, in one loop (findings() asks it of every link a claim
        names: tens of thousands at 131 072 GPUs)."""
        good_all, bad_all, margin = self._good_by, self._bad_by, self.exonerate_margin
        good_votes_of, bad_votes_of = self._good_votes, self._bad_votes
        out = {}
        for d in links:
            good_votes = good_votes_of.get(d, 0)
            if good_votes < 2:  # ignoring votes never adds good ones
                out[d] = False
                continue
            good_by, bad_by = good_all[d], bad_all.get(d, _NO_VOTES)
            if ignore and not (ignore.isdisjoint(good_by) and ignore.isdisjoint(bad_by)):
                good_votes = bad_votes = 0  # a suspect voted here: count without it
                for r, n in good_by.items():
                    if n > bad_by.get(r, 0) and r not in ignore:
                        good_votes += 1
                for r, n in bad_by.items():
                    if n > good_by.get(r, 0) and r not in ignore:
                        bad_votes += 1
                out[d] = good_votes >= 2 and good_votes >= bad_votes + margin
            else:
                out[d] = good_votes >= bad_votes_of.get(d, 0) + margin
        return out

    def suspects(self) -> set[str]:
        """Reporters whose bad claims the others' good evidence contradicts (see findings())."""
        return self.explain()[0]

    def findings(self) -> list[Finding]:
        """Links that explain the bad observations, most confident first."""
        return self.explain()[1]

    def claim_counts(self) -> dict[str, int]:
        """Reporter -> its claims among the observations held here."""
        out: dict[str, int] = {}
        for key in self._bad_keys:
            entry = self._entries[key]
            r = entry.obs.reporter
            out[r] = out.get(r, 0) + len(entry.claims)
        return out

    def explain(self, known: frozenset[str] | set[str] = frozenset(), reporter_claims: dict[str, int] | None = None,
                suspects: frozenset[str] | set[str] = frozenset(),
                cleared: frozenset[str] | set[str] = frozenset()) -> tuple[set[str], list[Finding]]:
        """(suspects, findings). For a localizer holding part of the fleet's paths
        (core/shards.py), what the other parts know: `known`, directed links found faulty
        elsewhere, whose claims count as explained from the start; `reporter_claims`, each
        reporter's claims over all its paths, which its shares of support are taken from (a
        noisy agent seen here by one path is not a whole reporter's worth); `suspects`,
        reporters found noisy elsewhere; `cleared`, directed links exonerated by a localizer
        holding all of their evidence (here a part of it may not be enough).

        Runs inside `pause()`: a coordinator pauses its cyclic collector (kernel/heap.py), since
        what this allocates is acyclic and freed as it goes, and a full pass it would trigger
        walks the fleet's evidence (at 131 072 GPUs ~100 ms, more than the localization itself)."""
        with self.pause():
            claims = self._claims()
            if reporter_claims:
                per = claims.per_reporter
                for r, n in reporter_claims.items():
                    if n > per.get(r, n):
                        per[r] = n
            suspects, live_links = self._suspects(claims, set(suspects), cleared)
            return suspects, self._greedy(claims, suspects, live_links, known)

    def named(self) -> set[str]:
        """The directed links the bad observations' claims name."""
        return {d for key in self._bad_keys for c in self._entries[key].claims for d in c}

    def cleared(self, links: Iterable[str]) -> set[str]:
        """Which of `links` are exonerated here (see exonerated())."""
        return {d for d, ok in self._exonerated(links, frozenset()).items() if ok}

    def _claims(self) -> _Claims:
        """Phase 1: every bad observation's claims, numbered, and the claims naming each link."""
        reporter: list[str] = []
        keys: list[str] = []
        candidates: list[tuple[str, ...]] = []
        of: dict[str, list[int]] = {}
        for key in self._bad_keys:
            entry = self._entries[key]
            for cands in entry.claims:
                i = len(reporter)
                reporter.append(entry.obs.reporter)
                keys.append(key)
                candidates.append(cands)
                for d in cands:
                    of.setdefault(d, []).append(i)
        per_reporter: dict[str, int] = {}
        for r in reporter:
            per_reporter[r] = per_reporter.get(r, 0) + 1
        return _Claims(reporter, keys, candidates, of, per_reporter)

    def _suspects(self, claims: _Claims, suspects: set[str],
                  cleared: frozenset[str] | set[str] = frozenset()) -> tuple[set[str], dict[str, list[int]]]:
        """Phase 2: the suspects, and the links not exonerated once their votes stop counting
        (each with the claims naming it).

        A claim all of whose links work for others is contradicted; a reporter making several
        such claims is noisy or lying: its claims are set aside and its votes stop counting
        (its bad votes no longer shield links, which can expose more suspects, so repeat).
        Links in `cleared` count as exonerated whatever the votes here say."""
        status = self._exonerated(claims.of, suspects)
        for d in cleared:
            if d in status:
                status[d] = True
        while True:
            live_links = {d: idx for d, idx in claims.of.items() if not status[d]}
            alive = [False] * len(claims.reporter)
            for idx in live_links.values():
                for i in idx:
                    alive[i] = True
            contradicted: dict[str, int] = {}
            for i, r in enumerate(claims.reporter):
                if not alive[i]:
                    contradicted[r] = contradicted.get(r, 0) + 1
            more = {r for r, n in contradicted.items() if r not in suspects
                    and n >= self.suspect_claims and n >= self.suspect_share * claims.per_reporter[r]}
            if not more:
                return suspects, live_links
            suspects |= more
            # only the links the new suspects voted on can change; of those, the ones only
            # suspects' claims name matter no more (those claims count as explained)
            touched = set()
            for r in more:
                for key in self._by_reporter.get(r, ()):
                    entry = self._entries[key]
                    touched.update(entry.credited)
                    touched.update(entry.blamed)
            of, reporter = claims.of, claims.reporter
            for d in touched.intersection(status):
                if all(reporter[i] in suspects for i in of[d]):
                    del status[d]
                    del of[d]
            status.update(self._exonerated(touched.intersection(status) - set(cleared), suspects))

    def _greedy(self, claims: _Claims, suspects: set[str], live_links: dict[str, list[int]],
                known: frozenset[str] | set[str] = frozenset()) -> list[Finding]:
        """Phase 3: repeatedly the link that explains the most claims not yet explained (see the
        module doc), most confident first. The suspects' claims, and those naming a `known`
        link, count as explained from the start. Consumes `live_links`."""
        claim_reporter = claims.reporter
        per_reporter = claims.per_reporter
        explained = [r in suspects for r in claim_reporter]
        for d in known:
            for i in claims.of.get(d, ()):
                explained[i] = True

        def rank_of(d: str):
            """(rank, live claims, reporters) of a candidate now, or None if it cannot be chosen."""
            live = [i for i in live_links[d] if not explained[i]]
            if len(live) < self.min_claims:
                return None
            good = self._good_paths(d, suspects)
            if len(live) <= good:  # more paths work across it than fail: not the culprit
                return None
            reporters = {claim_reporter[i] for i in live}
            if len(reporters) < self.min_reporters:
                return None
            support = sum(1 / per_reporter[claim_reporter[i]] for i in live)
            if support < self.min_support - 1e-9:
                return None
            return (-len(live), good, -len(reporters), d), live, reporters

        # Lazy greedy (same choices as rescanning every candidate each round): explaining claims
        # only ever worsens a candidate's rank, so a stored rank is a bound; the best candidate
        # is the top of the heap once its recomputed rank still equals its stored one.
        heap = []
        for d in live_links:
            r = rank_of(d)
            if r is not None:
                heap.append(r[0])
        heapq.heapify(heap)
        out: list[Finding] = []
        while heap:
            stored = heapq.heappop(heap)
            d = stored[3]
            r = rank_of(d)
            if r is None:
                continue
            if r[0] != stored:
                heapq.heappush(heap, r[0])
                continue
            _, live, reporters = r
            alternatives = self._twins(d, live, live_links, explained, claims.candidates, suspects)
            for i in live:
                explained[i] = True
            del live_links[d]
            out.append(self._finding(d, live, reporters, claims.key, alternatives, suspects))
        out.sort(key=lambda f: (-f.confidence, f.directed))
        return out

    def _good_paths(self, d: str, suspects: set[str]) -> int:
        """Good observations across `d`, not counting the suspects' (their word counts for nothing)."""
        by = self._good_by.get(d)
        if not by:
            return 0
        if suspects:
            return sum(n for r, n in by.items() if r not in suspects)
        return sum(by.values())

    def _twins(self, d: str, live: list[int], live_links: dict[str, list[int]], explained: list[bool],
               claim_cands: list[tuple[str, ...]], suspects: set[str]) -> tuple[str, ...]:
        """Other links that explain exactly the same claims, with the same good evidence: the
        probes cannot tell them apart (e.g. leaf 0 -> spine and spine -> leaf 1 with two leaves)."""
        target = set(live)
        good = self._good_paths(d, suspects)
        twins = []
        for other in claim_cands[live[0]]:  # a twin is a candidate of every claim, so of this one
            if other == d or other not in live_links or self._good_paths(other, suspects) != good:
                continue
            if {i for i in live_links[other] if not explained[i]} == target:
                twins.append(other)
        return tuple(sorted(twins))

    def _finding(self, d: str, live: list[int], reporters: set[str], claim_key: list[str],
                 alternatives: tuple[str, ...], suspects: set[str]) -> Finding:
        bad = len({claim_key[i] for i in live})
        good = self._good_paths(d, suspects)
        # purity: how cleanly the link's traffic fails; support: how independent the witnesses;
        # shared evenly with links the evidence cannot tell from this one
        confidence = bad / (bad + good) * (1.0 - 0.5 ** len(reporters)) / (1 + len(alternatives))
        name, direction = split_directed(d)
        return Finding(name, direction, d, round(confidence, 4), bad, good, tuple(sorted(reporters)), alternatives)


def _way(obs: Observation) -> Direction | str | None:
    """`obs.direction` as one of DIRECTIONS (a Direction's value becomes the Direction)."""
    d = obs.direction
    if d is None or isinstance(d, Direction):
        return d
    if d == BOTH:
        return BOTH
    try:
        return Direction(d)
    except ValueError:
        raise ValueError(f"observation {obs.key}: direction {d!r} is unknown; one of "
                         f"{', '.join(repr(x.value if isinstance(x, Direction) else x) for x in DIRECTIONS)}") from None


_NO_VOTES: dict[str, int] = {}


def _decrement(counts: dict[str, int], k: str) -> None:
    n = counts[k] - 1
    if n:
        counts[k] = n
    else:
        del counts[k]


def localize(model: FabricModel, observations: Iterable[Observation], **options) -> list[Finding]:
    """One-shot: findings for `observations` (later ones with a repeated key win)."""
    loc = Localizer(model, **options)
    for obs in observations:
        loc.update(obs)
    return loc.findings()


# ---- what a reported path tells the localizer ---------------------------------------------------

_DIRECTION_OF_REASON = {r.value: d for r, d in DIRECTION_OF_REASON.items()}


def path_evidence(state: str, reason: str | None) -> tuple[bool, Direction | None] | None:
    """What a path's reported state and reason tell the localizer: (bad, direction), or None
    for the passing states (suspect: a probe late; recovering: in hold-down), which leave the
    path's last evidence standing until it settles (and are the commonest reports)."""
    bad = is_bad(state)
    if not bad and not is_good(state):
        return None
    return bad, _DIRECTION_OF_REASON.get(reason or "")
