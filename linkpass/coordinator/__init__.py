"""The coordinator: fleet view, fault localization, probe plans, drains (see service.py)."""
