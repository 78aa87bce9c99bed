"""An import-linter contract type that says what a module MAY import, instead of listing what it
may not: `lint-imports` loads it from pyproject.toml (`contract_types`).

    type = "only"
    source_modules  = the modules held to it (packages: their submodules too)
    allowed_modules = what of the project's own packages they may import besides their own
                      package; with `pure`, third-party packages they may import too
    pure            = no standard-library module that does I/O, reads a clock or the
                      environment, or runs the garbage collector (IO_MODULES), and no
                      third-party package but those allowed

A new package of the project, or a new I/O module in the standard library's list, needs no
change to any contract: whatever is not allowed is refused.
"""
from __future__ import annotations

import sys

from importlinter import Contract, ContractCheck, fields, output
from importlinter.application import contract_utils

# what pure code may not import: time comes in as an argument and randomness as a seed
# (random.Random(seed) stays allowed); files, sockets, processes, threads, the environment and
# the collector belong to the adapters
IO_MODULES = frozenset({
    "asyncio", "atexit", "concurrent", "ctypes", "datetime", "fcntl", "gc", "glob", "http", "io", "logging", "mmap",
    "multiprocessing", "os", "pathlib", "queue", "secrets", "select", "selectors", "shutil", "signal", "socket",
    "socketserver", "sqlite3", "ssl", "subprocess", "sys", "tempfile", "threading", "time", "urllib", "uuid",
    "webbrowser",
})


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def verdict(sources: list[str], imported: str, allowed: list[str], roots: list[str], pure: bool) -> bool:
    """Whether a module of `sources` (packages: their submodules too) may import `imported`."""
    if any(_within(imported, a) for a in (*sources, *allowed)):
        return True
    if imported in roots:
        return True  # a root package itself: its version, or a compiled module the graph cannot see
    top = imported.split(".")[0]
    if top in roots:
        return False  # the project's own code: only what is allowed
    if not pure:
        return True  # third-party and standard library: the protected contracts say who may
    return top in sys.stdlib_module_names and top not in IO_MODULES


class OnlyContract(Contract):
    type_name = "only"

    source_modules = fields.ListField(subfield=fields.ModuleField())
    allowed_modules = fields.ListField(subfield=fields.StringField(), required=False)
    pure = fields.BooleanField(required=False, default=False)
    ignore_imports = fields.SetField(subfield=fields.ImportExpressionField(), required=False)

    def check(self, graph, verbose: bool) -> ContractCheck:
        removal = contract_utils.remove_ignored_imports_and_report(
            graph=graph, ignore_imports=self.ignore_imports or set(),
            unmatched_alerting=contract_utils.AlertLevel.ERROR)
        roots = list(self.session_options["root_packages"])
        allowed = list(self.allowed_modules or [])
        pure = str(self.pure).lower() == "true"
        illegal = []
        sources = [m.name for m in self.source_modules]
        for source in self.source_modules:
            importers = {source.name} | (graph.find_descendants(source.name)
                                         if not graph.is_module_squashed(source.name) else set())
            for importer in sorted(importers):
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    if verdict(sources, imported, allowed, roots, pure):
                        continue
                    lines = [d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)]
                    illegal.append((importer, imported, lines))
        return ContractCheck(kept=not illegal, warnings=list(removal.warnings),
                             ignored_import_count=removal.ignored_import_count, metadata={"illegal": illegal})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported, lines in check.metadata["illegal"]:
            where = ", ".join(f"l.{n}" for n in lines)
            output.print_error(f"{importer} imports {imported} ({where}): not among what it may import")
            output.new_line()

