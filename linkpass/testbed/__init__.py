"""The testbed: a real multi-plane leaf-spine fabric in network namespaces, faults made of real
kernel mechanisms, and what tests, benchmarks and the demo run on it. Only the demo and the CLI's
registration of its commands import it (pyproject.toml's import contracts)."""
