"""The coordinator: fleet view, fault localization, probe plans, drains (the logic: coordinator.py)."""
