"""Host steal from /proc/stat (linkpass.testbed.steal): the per-CPU field, in ns, and the most
any one CPU lost between two samples."""
from __future__ import annotations

import os

from linkpass.testbed import steal

STAT = """cpu  1511376 18961 421623 2406470 7643 0 157257 109365 0 0
cpu0 755000 9000 210000 1200000 3800 0 78000 54000 0 0
cpu1 756376 9961 211623 1206470 3843 0 79257 55365 0 0
intr 123456 0 0
ctxt 99
"""


def test_each_cpus_steal_is_read_in_ns_and_the_total_line_is_not_a_cpu():
    assert steal.parse(STAT) == [54000 * steal.TICK_NS, 55365 * steal.TICK_NS]


def test_a_kernel_without_the_steal_field_reads_as_none():
    assert steal.parse("cpu  1 2 3 4\ncpu0 1 2 3 4\n") == []


def test_the_most_one_cpu_lost_between_samples_is_what_a_trial_saw():
    before = steal.parse(STAT)
    after = [before[0] + 3 * steal.TICK_NS, before[1] + steal.TICK_NS]
    assert steal.stolen_ms(before, after) == round(3 * steal.TICK_NS / 1e6, 3)
    assert steal.stolen_ms(before, before) == 0.0
    assert steal.stolen_ms(before, after[:1]) == 0.0  # a CPU came or went: no comparison


def test_this_machine_reports_one_figure_per_cpu_that_never_goes_back():
    first = steal.sample()
    assert len(first) == os.cpu_count()
    assert all(b >= a for a, b in zip(first, steal.sample()))
