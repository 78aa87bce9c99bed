"""The probe core's receive path (decoder, size and budget checks, reflector: probe_rx.h), built
with AddressSanitizer and UBSan, survives 10^5 random, truncated, mutated, over-long and replayed
packets: no sanitizer report, no broken invariant, every input accounted for."""
from __future__ import annotations

import pytest

from linkpass.testbed import fuzz


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return fuzz.build(tmp_path_factory.mktemp("fuzz"))


def test_the_receive_path_survives_hostile_packets_under_sanitizers(harness):
    run = fuzz.fuzz(harness, 100_000, seed=1)
    assert run.clean, run.report[-4000:] or run
    o = run.outcomes
    drops = o["drops"]
    # the run reached every stage: reflected valid requests, took replies, dropped by every cheap
    # check, by size, by budget, by ICRC and tag, caught replays, and expired reflector entries
    assert o["reflected"] > 10_000 and o["replies"] > 0 and o["reflector_expired"] > 0
    for reason in ("short", "not_roce", "bad_magic", "bad_length", "bad_icrc", "bad_tag", "replay",
                   "unexpected_size", "source_over_budget"):
        assert drops.get(reason, 0) > 0, reason
    assert o["reflected"] + o["replies"] + sum(drops.values()) == 100_000


def test_a_sanitizer_report_fails_the_run(harness, tmp_path):
    """The check can fail: a harness built from a receive path that trusts the padding (the
    decoder's bound removed) is caught writing a reply past its send slot."""
    src = (fuzz.PROBE_DIR / "probe_wire.h").read_text()
    bound = "if (pad > MAX_PAD || n != (size_t)MIN_PAYLOAD + pad) return D_BAD_LENGTH;"
    assert bound in src
    rx = (fuzz.PROBE_DIR / "probe_rx.h").read_text()
    gate = "if (!r->pad_ok[pad]) return"
    assert gate in rx
    for name, text in (("probe_wire.h", src.replace(bound, "if (n != (size_t)MIN_PAYLOAD + pad) return D_BAD_LENGTH;")),
                       ("probe_rx.h", rx.replace(gate, "if (pad <= MAX_PAD && !r->pad_ok[pad]) return")),
                       ("blake2b.h", (fuzz.PROBE_DIR / "blake2b.h").read_text()),
                       ("fuzz_harness.c", fuzz.HARNESS.read_text())):
        (tmp_path / name).write_text(text)
    broken = fuzz.build(tmp_path, src_dir=tmp_path)
    run = fuzz.fuzz(broken, 100_000, seed=1)
    assert not run.clean and "heap-buffer-overflow" in run.report
