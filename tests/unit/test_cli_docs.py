"""docs/cli.md says what the CLI does: its exit-code table is the code's, the commands it gives
as examples exit as the table says, and its config file example is one the CLI accepts."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

from linkpass.cli import manpage, settings
from linkpass.console.output import EXIT_MEANING, EXIT_OK, EXIT_UNKNOWN


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = open(os.path.join(ROOT, "docs", "cli.md")).read()


def exit_table() -> dict[int, str]:
    section = DOC.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (\w+) \|", section, re.M)}


def test_the_exit_code_table_is_the_codes():
    assert exit_table() == EXIT_MEANING
    assert [code for code, _ in manpage.EXIT_STATUS] == list(EXIT_MEANING)
    assert all(meaning.startswith(EXIT_MEANING[code]) for code, meaning in manpage.EXIT_STATUS)


def linkpass(*argv: str, env: dict | None = None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LINKPASS_")}
    return subprocess.run([sys.executable, "-m", "linkpass", *argv], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**clean, "NO_COLOR": "1", "XDG_CONFIG_HOME": "/nonexistent",
                                         "LINKPASS_STATE_DIR": "/nonexistent", **(env or {})})


def test_the_examples_exit_as_the_table_says():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"https://127.0.0.1:{s.getsockname()[1]}"  # closed again before it is asked
    for argv, want in ((["--help"], EXIT_OK), (["status", "--help"], EXIT_OK), (["--version"], EXIT_OK),
                       (["status", "-o", "xml"], EXIT_UNKNOWN), (["drain"], EXIT_UNKNOWN),
                       (["status", "--coordinator", nobody, "-o", "json"], EXIT_UNKNOWN),
                       (["links", "--config-file", "/nonexistent/config.yaml"], EXIT_UNKNOWN)):
        out = linkpass(*argv)
        assert out.returncode == want, (argv, out.stderr)
        assert "Traceback" not in out.stderr
        if want != EXIT_OK:
            assert out.stdout == "" and "error:" in out.stderr, argv


def test_the_config_example_is_accepted():
    block = re.search(r"\n((?: {4}.*\n|\n)*? {4}current-context: prod\n(?: {4}.*\n)+)", DOC).group(1)
    yaml_text = textwrap.dedent("".join(line for line in block.splitlines(keepends=True)
                                        if not line.strip().startswith("linkpass ")))
    cfg = settings.parse_config(yaml_text, "/home/u/.config/linkpass/config.yaml")
    assert cfg.current == "prod" and set(cfg.contexts) == {"prod", "lab"}
    assert set(cfg.contexts["prod"]) == set(settings.FIELDS)


def test_the_precedence_table_names_every_variable_and_flag():
    section = DOC.split("## Where the coordinator", 1)[1].split("\n## ", 1)[0]
    for name in (*settings.ENV_OF.values(), settings.ENV_CONTEXT):
        assert f"${name}" in section, name
    for flag in settings.FLAG_OF.values():
        assert f"`{flag} " in section, flag
    assert f"${settings.ENV_CONFIG}" in DOC
