"""Finding pyverbs, lazily.

pyverbs is not a PyPI dependency: the PyPI sdist bundles rdma-core, fails to build with
Cython >= 3.1 and then needs matching rdma-core libraries at run time. It comes from the
operating system's rdma-core instead (Debian: `apt-get install python3-pyverbs`), which
installs it for the system Python under /usr/lib/python3/dist-packages. LinkPass runs in its
own venv, so `load_pyverbs()` first tries a normal import and then loads *only* the pyverbs
package from the system directories (never the rest of dist-packages).

Nothing imports this module unless an RDMA feature is used; on hosts without RDMA the rest of
LinkPass works unchanged.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

SYSTEM_DIRS = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages")


class RdmaUnavailable(RuntimeError):
    """pyverbs or an RDMA device is missing; the message says how to get it."""


def load_pyverbs(search_dirs: tuple[str, ...] = SYSTEM_DIRS) -> ModuleType:
    if "pyverbs" in sys.modules:
        return sys.modules["pyverbs"]
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    tried = []
    for base in search_dirs:
        pkg = os.path.join(base, "pyverbs", "__init__.py")
        tried.append(os.path.dirname(pkg))
        if not os.path.exists(pkg):
            continue
        spec = importlib.util.spec_from_file_location("pyverbs", pkg,
                                                      submodule_search_locations=[os.path.dirname(pkg)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules["pyverbs"]
            raise RdmaUnavailable(f"found pyverbs in {base} but it does not load into Python "
                                  f"{sys.version_info.major}.{sys.version_info.minor} ({exc}); the system "
                                  "package must be built for this Python version") from exc
        return module
    raise RdmaUnavailable("pyverbs is not installed: install the OS package (Debian/Ubuntu: "
                          "`apt-get install python3-pyverbs`, from rdma-core); looked in " + ", ".join(tried))


def device_names() -> list[str]:
    """Names of the RDMA devices, or RdmaUnavailable saying why there are none."""
    pv = load_pyverbs()
    device = importlib.import_module("pyverbs.device")
    try:
        devices = device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError when the kernel has no RDMA subsystem
        raise RdmaUnavailable(f"no RDMA devices: {exc} (kernel without RDMA support, or no rdma_rxe/mlx5 device)") from exc
    del pv
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
