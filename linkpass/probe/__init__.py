"""Probe I/O: the C probe engine and its binding, the Python reference engine, ECMP path discovery (sockets inside host namespaces)."""
