"""The host agent: the daemon that probes, detects and fails over on one host.

Pure (shared with the fleet simulator): `config` (validated YAML), `decide` (planes for routes,
ports for the entropy table), `failover` (events -> detector -> decisions). I/O: `daemon` (the
process), `routes` + `netlink` (the route actuator), `entropy_writer`, `api` (local query API and
metrics), `coordinator_link`.
"""
