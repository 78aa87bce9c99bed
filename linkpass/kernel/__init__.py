"""Thin adapters to what a process runs on: the kernel (network and process namespaces, RDMA
devices, sockets' diagnostics) and the interpreter's cyclic collector (heap)."""
