"""The `linkpass` command line: `main.py` is the entry point, `output.py` renders every command's
output, and each command group is a module of its own."""
from .main import main

__all__ = ["main"]
