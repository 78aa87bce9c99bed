"""`linkpass demo`: the main job (see run.py)."""
from .run import register  # noqa: F401
