"""Thin adapters to the kernel: network namespaces, process namespaces."""
