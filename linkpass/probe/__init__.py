"""Probe I/O: engine, reflector, ECMP path discovery (sockets inside host namespaces)."""
