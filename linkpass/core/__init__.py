"""The pure core: what the agent, the coordinator and the simulator decide with, as data in and
data out. No I/O, no clock reads, no randomness reads (time and seeds come in as arguments);
standard library only. `lint-imports` (pyproject.toml) holds it to that.

    constants      ports, protocol numbers, cadences shared by every layer
    states         path states, their classes and health levels, directions
    names          node and link names, the one fabric generator
    fabric         the fabric model: directed links, paths onto links
    wire           the probe packet; probe_event: what the data path tells the decision loop
    telemetry      loss, RTT, one-way delay per path; clock: clock sync between hosts
    paths          ECMP path tables from traces
    detector       per-path state machine
    localize       which links explain the bad paths; plan: which paths each host probes
    entropy_table  the entropy table's layout and codec
"""
