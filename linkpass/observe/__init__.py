"""Observability around the agents and the coordinator: the Prometheus rules and Grafana
dashboards (generated here, checked in under deploy/), and a private Prometheus server for the
demo and the tests."""
