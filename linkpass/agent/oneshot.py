"""The path-check routes under the name the agent's daemon still imports them by; they live in
pathcheck_routes.py. Goes once daemon.py imports `PathCheckRoutes` from there."""
from .pathcheck_routes import PathCheckRoutes as OneShot, live_paths

__all__ = ["OneShot", "live_paths"]
