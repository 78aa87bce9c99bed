"""The one place PyYAML is imported: every YAML file LinkPass reads or writes (agent and CLI
config, token files, alert rules, `-o yaml`, the lab's generated configs) goes through these
names, safe loading and dumping only. A change of parser is this file."""
from yaml import YAMLError, safe_dump, safe_load

__all__ = ["YAMLError", "safe_dump", "safe_load"]
