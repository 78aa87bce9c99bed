"""The CLI's settings: flag > environment > config file (a context) > default, for the
coordinator, the token and each TLS file; the config file's location and checks."""
from __future__ import annotations

import os

import pytest

from linkpass.cli import settings as S
from linkpass.core.constants import COORDINATOR_URL


FLAGS = {"coordinator": "https://flag:9470", "token-file": "/flag/token", "ca-file": "/flag/ca.crt",
         "cert-file": "/flag/cli.crt", "key-file": "/flag/cli.key"}
ENV = {"LINKPASS_COORDINATOR": "https://env:9470", "LINKPASS_TOKEN": "env-token", "LINKPASS_CA_FILE": "/env/ca.crt",
       "LINKPASS_CERT_FILE": "/env/cli.crt", "LINKPASS_KEY_FILE": "/env/cli.key"}
CONFIG = """\
current-context: lab
contexts:
  lab:
    coordinator: https://ctx:9470
    token-file: /ctx/token
    ca-file: /ctx/ca.crt
    cert-file: /ctx/cli.crt
    key-file: /ctx/cli.key
  other:
    coordinator: https://other:9470
"""
NONE = {k: None for k in S.FIELDS}


@pytest.fixture
def home(tmp_path):
    """An environment with nothing set but an empty config folder and state directory."""
    return {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "LINKPASS_STATE_DIR": str(tmp_path / "st")}


def config(text: str = CONFIG, path: str = "/home/u/.config/linkpass/config.yaml") -> S.CliConfig:
    return S.parse_config(text, path)


def values(r: S.Resolved) -> dict:
    return {"coordinator": r.coordinator.value, "token": r.token.value, "token-file": r.token_file.value,
            "ca-file": r.ca_file.value, "cert-file": r.cert_file.value, "key-file": r.key_file.value}


def test_flags_beat_everything(home):
    r = S.resolve(FLAGS, {**home, **ENV}, config())
    assert values(r) == {"coordinator": "https://flag:9470", "token": None, "token-file": "/flag/token",
                         "ca-file": "/flag/ca.crt", "cert-file": "/flag/cli.crt", "key-file": "/flag/cli.key"}
    assert r.coordinator.source == "--coordinator" and r.token_source() == "token from --token-file /flag/token"


def test_environment_beats_the_config_file(home):
    r = S.resolve(NONE, {**home, **ENV}, config())
    assert values(r) == {"coordinator": "https://env:9470", "token": "env-token", "token-file": None,
                         "ca-file": "/env/ca.crt", "cert-file": "/env/cli.crt", "key-file": "/env/cli.key"}
    assert r.token_source() == "token from $LINKPASS_TOKEN"


def test_the_config_file_beats_the_defaults(home):
    r = S.resolve(NONE, home, config())
    assert values(r) == {"coordinator": "https://ctx:9470", "token": None, "token-file": "/ctx/token",
                         "ca-file": "/ctx/ca.crt", "cert-file": "/ctx/cli.crt", "key-file": "/ctx/cli.key"}
    assert r.context == "lab" and r.coordinator.source.startswith("context lab")


def test_defaults(home, tmp_path):
    r = S.resolve(NONE, home, S.CliConfig("/nowhere"))
    assert values(r) == {"coordinator": COORDINATOR_URL, "token": None, "token-file": None, "ca-file": None,
                         "cert-file": None, "key-file": None}
    assert r.token_source() == "no token sent (none given, none found)"
    # on the coordinator's host: its reader token, lab CA and the CLI's certificate
    lab = tmp_path / "st" / "tls"
    lab.mkdir(parents=True)
    for name in ("ca.crt", "cli.crt", "cli.key"):
        (lab / name).write_text("x")
    (tmp_path / "st" / "reader.token").write_text("r\n")
    r = S.resolve(NONE, home, S.CliConfig("/nowhere"))
    assert values(r)["token-file"] == str(tmp_path / "st" / "reader.token")
    assert r.token_source() == f"token from the default file {tmp_path / 'st' / 'reader.token'}"
    assert (r.ca_file.value, r.cert_file.value, r.key_file.value) == (str(lab / "ca.crt"), str(lab / "cli.crt"),
                                                                      str(lab / "cli.key"))
    # your own token file beats the coordinator's reader token
    (tmp_path / "xdg" / "linkpass").mkdir(parents=True)
    (tmp_path / "xdg" / "linkpass" / "token").write_text("mine\n")
    mine = str(tmp_path / "xdg" / "linkpass" / "token")
    assert S.resolve(NONE, home, S.CliConfig("/nowhere")).token_file.value == mine


@pytest.mark.parametrize("field", S.FIELDS)
def test_each_setting_alone_follows_the_order(home, field):
    """One setting given at every level, the others at none: each level in turn is taken away."""
    env_key = S.ENV_OF["token" if field == "token-file" else field]
    env_value = ENV[env_key]
    flag = {**NONE, field: FLAGS[field]}
    want_env = ("token", env_value) if field == "token-file" else (field, env_value)
    assert values(S.resolve(flag, {**home, env_key: env_value}, config()))[field] == FLAGS[field]
    assert values(S.resolve(NONE, {**home, env_key: env_value}, config()))[want_env[0]] == want_env[1]
    assert values(S.resolve(NONE, home, config()))[field] == config().contexts["lab"][field]


def test_the_lab_client_certificate_is_not_mixed_with_a_given_key(home, tmp_path):
    lab = tmp_path / "st" / "tls"
    lab.mkdir(parents=True)
    for name in ("cli.crt", "cli.key"):
        (lab / name).write_text("x")
    r = S.resolve({**NONE, "key-file": "/mine.key"}, home, S.CliConfig("/nowhere"))
    assert (r.cert_file.value, r.key_file.value) == (None, "/mine.key")  # tls.py then names the missing one


def test_the_context_is_flag_then_environment_then_current(home):
    assert S.resolve(NONE, home, config(), context="other").coordinator.value == "https://other:9470"
    assert S.resolve(NONE, {**home, "LINKPASS_CONTEXT": "other"}, config()).coordinator.value == "https://other:9470"
    assert S.resolve(NONE, {**home, "LINKPASS_CONTEXT": "other"}, config(), context="lab").context == "lab"
    with pytest.raises(S.ConfigError, match=r"--context prod: no such context in .*\(contexts: lab, other\)"):
        S.resolve(NONE, home, config(), context="prod")
    with pytest.raises(S.ConfigError, match=r"\$LINKPASS_CONTEXT prod: no such context"):
        S.resolve(NONE, {**home, "LINKPASS_CONTEXT": "prod"}, config())


def test_a_named_context_contradicted_by_the_environment_is_refused(home):
    env = {**home, "LINKPASS_COORDINATOR": "https://env:9470"}
    # the file's current context: the environment overrides it, as the order says
    assert S.resolve(NONE, env, config()).coordinator.value == "https://env:9470"
    # a context named on purpose: the two disagree, and a guess could drain the wrong fleet
    with pytest.raises(S.ConfigError, match=r"\$LINKPASS_COORDINATOR \(https://env:9470\) contradicts context lab"):
        S.resolve(NONE, env, config(), context="lab")
    with pytest.raises(S.ConfigError, match=r"\$LINKPASS_TOKEN contradicts context lab's token-file"):
        S.resolve(NONE, {**home, "LINKPASS_TOKEN": "t"}, config(), context="lab")
    # ... unless they agree, or a flag settles it
    same = {**home, "LINKPASS_COORDINATOR": "https://ctx:9470"}
    assert S.resolve(NONE, same, config(), context="lab").coordinator.value == "https://ctx:9470"
    flag = {**NONE, "coordinator": "https://flag:9470"}
    assert S.resolve(flag, env, config(), context="lab").coordinator.value == "https://flag:9470"
    # a context that does not set the field leaves it to the environment
    assert S.resolve(NONE, {**home, "LINKPASS_TOKEN": "t"}, config(), context="other").token.value == "t"


def test_config_path(home):
    assert S.config_path("/x.yaml", {**home, "LINKPASS_CONFIG": "/y.yaml"}) == ("/x.yaml", True)
    assert S.config_path(None, {**home, "LINKPASS_CONFIG": "/y.yaml"}) == ("/y.yaml", True)
    assert S.config_path(None, home) == (os.path.join(home["XDG_CONFIG_HOME"], "linkpass", "config.yaml"), False)
    no_xdg = {"HOME": "/home/u"}
    assert S.config_path(None, no_xdg) == ("/home/u/.config/linkpass/config.yaml", False)


def test_a_missing_default_file_is_no_config_but_a_named_one_is_an_error(tmp_path):
    assert S.load_config(str(tmp_path / "none.yaml"), named=False).contexts == {}
    with pytest.raises(S.ConfigError, match="none.yaml: no such config file"):
        S.load_config(str(tmp_path / "none.yaml"), named=True)
    assert S.load_config(os.devnull, named=True).contexts == {}  # --config-file /dev/null: no file at all


def test_paths_in_the_file_are_relative_to_it_and_expand_home():
    c = config("contexts:\n  a: {token-file: a.token, ca-file: ~/ca.crt, coordinator: 'https://h:1'}\n",
               "/etc/linkpass/config.yaml")
    assert c.contexts["a"]["token-file"] == "/etc/linkpass/a.token"
    assert c.contexts["a"]["ca-file"] == os.path.expanduser("~/ca.crt")


@pytest.mark.parametrize("text,words", [
    ("- a\n", "expected a mapping with current-context and contexts"),
    ("context: {}\n", "context: unknown field"),
    ("contexts: {lab: https://x}\n", "contexts.lab: expected a mapping of coordinator, token-file"),
    ("contexts: {lab: {coordinator: 9470}}\n", "contexts.lab.coordinator: expected text, got int 9470"),
    ("contexts: {lab: {coordinator: 'x:9470'}}\n", "contexts.lab.coordinator: expected a URL"),
    ("contexts: {lab: {coordinator: 'https://x:port'}}\n", "has no valid port"),
    ("contexts: {lab: {ca-file: ''}}\n", "contexts.lab.ca-file: expected text"),
    ("current-context: lab\n", "current-context: no context named 'lab'; the file has no contexts"),
    ("contexts: {lab: {coordinator: 'https://x:1'}\n", "not valid YAML at line 2"),
])
def test_config_errors_name_the_file_and_field(text, words):
    with pytest.raises(S.ConfigError) as exc:
        config(text, "/c.yaml")
    assert str(exc.value).startswith("/c.yaml: ") and words in str(exc.value), str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_bad_coordinator_url_in_the_environment_is_named(home):
    with pytest.raises(S.ConfigError, match=r"\$LINKPASS_COORDINATOR: expected a URL like https://HOST:9470"):
        S.resolve(NONE, {**home, "LINKPASS_COORDINATOR": "coord:9470"}, config())
