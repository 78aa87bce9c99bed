"""Where the commands that ask the coordinator get its address, your token and the TLS files.

Each setting is taken from the first of these that has it:

    1. the command line      --coordinator, --token-file, --ca-file, --cert-file, --key-file
    2. the environment       $LINKPASS_COORDINATOR, $LINKPASS_TOKEN (the token itself),
                             $LINKPASS_CA_FILE, $LINKPASS_CERT_FILE, $LINKPASS_KEY_FILE
    3. the config file       the context's coordinator, token-file, ca-file, cert-file, key-file
    4. built-in defaults     https://127.0.0.1:9470; the token in $XDG_CONFIG_HOME/linkpass/token,
                             else the coordinator's local reader.token; its lab CA and cli.crt/.key

The config file is $XDG_CONFIG_HOME/linkpass/config.yaml (~/.config/linkpass/config.yaml), or
--config-file / $LINKPASS_CONFIG:

    current-context: prod
    contexts:
      prod:
        coordinator: https://coord.prod.example:9470
        token-file: ~/.config/linkpass/prod.token     # relative paths: from the file's folder
        ca-file: /etc/linkpass/tls/ca.crt
        cert-file: ~/.config/linkpass/cli.crt         # mutual TLS, with key-file
        key-file: ~/.config/linkpass/cli.key
      lab:
        coordinator: https://127.0.0.1:9470

The context is --context NAME, else $LINKPASS_CONTEXT, else current-context. A context named on
purpose (--context or $LINKPASS_CONTEXT) that an environment variable would contradict is refused
rather than silently overridden: a drain must not reach another fleet than the one named.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import urlparse

from ..coordinator.startup import DEFAULT_STATE_DIR
from ..control.tls import LOCAL_CLIENT, lab_dir, lab_paths
from ..core.constants import COORDINATOR_URL

FIELDS = ("coordinator", "token-file", "ca-file", "cert-file", "key-file")
ENV_OF = {"coordinator": "LINKPASS_COORDINATOR", "token": "LINKPASS_TOKEN", "ca-file": "LINKPASS_CA_FILE",
          "cert-file": "LINKPASS_CERT_FILE", "key-file": "LINKPASS_KEY_FILE"}
ENV_CONFIG, ENV_CONTEXT = "LINKPASS_CONFIG", "LINKPASS_CONTEXT"
FLAG_OF = {"coordinator": "--coordinator", "token-file": "--token-file", "ca-file": "--ca-file",
           "cert-file": "--cert-file", "key-file": "--key-file"}
_SKIP = "--config-file /dev/null skips the file"


class ConfigError(ValueError):
    """A config file, context or setting that cannot be used; the message names the file, the
    field and the fix."""


def config_dir(env: Mapping[str, str]) -> str:
    base = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".config")
    return os.path.join(base, "linkpass")


def config_path(flag: str | None, env: Mapping[str, str]) -> tuple[str, bool]:
    """The config file and whether it was named (--config-file, $LINKPASS_CONFIG): a named file
    must exist, the default one may be missing."""
    if flag:
        return flag, True
    if env.get(ENV_CONFIG):
        return env[ENV_CONFIG], True
    return os.path.join(config_dir(env), "config.yaml"), False


@dataclass
class CliConfig:
    path: str
    current: str | None = None
    contexts: dict[str, dict[str, str]] = field(default_factory=dict)


def load_config(path: str, named: bool) -> CliConfig:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        if named:
            raise ConfigError(f"{path}: no such config file; create it (docs/cli.md has the format) or drop "
                              f"--config-file / ${ENV_CONFIG}") from None
        return CliConfig(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror}); fix its permissions, or "
                          f"{_SKIP}") from None
    return parse_config(text, path)


def parse_config(text: str, path: str) -> CliConfig:
    """The file's contexts, checked whole: a wrong field is named before anything is used."""
    from ..formats import yaml_doc as yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc}); fix the "
                          f"file, or {_SKIP}") from None
    if doc is None:
        return CliConfig(path)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with current-context and contexts, got "
                          f"{type(doc).__name__}; {_SKIP}")
    for key in doc:
        if key not in ("current-context", "contexts"):
            raise ConfigError(f"{path}: {key}: unknown field; the file has current-context and contexts "
                              "(each context: " + ", ".join(FIELDS) + ")")
    raw = doc.get("contexts") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: contexts: expected a mapping of context name to its settings, e.g. "
                          "contexts: {prod: {coordinator: https://coord:9470}}")
    base = os.path.dirname(os.path.abspath(path))
    contexts: dict[str, dict[str, str]] = {}
    for name, ctx in raw.items():
        at = f"{path}: contexts.{name}"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{at}: a context's name must be text")
        if not isinstance(ctx, dict):
            raise ConfigError(f"{at}: expected a mapping of " + ", ".join(FIELDS) + f", got {_shown(ctx)}")
        out = {}
        for key, value in ctx.items():
            if key not in FIELDS:
                raise ConfigError(f"{at}.{key}: unknown field; a context has " + ", ".join(FIELDS))
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{at}.{key}: expected text, got {_shown(value)}")
            if key == "coordinator":
                check_url(value, f"{at}.coordinator")
                out[key] = value.strip()
            else:  # a file: ~ expanded, relative to the config file's folder
                out[key] = os.path.join(base, os.path.expanduser(value.strip()))
        contexts[name] = out
    current = doc.get("current-context")
    if current is not None and (not isinstance(current, str) or current not in contexts):
        raise ConfigError(f"{path}: current-context: no context named {_shown(current)}; "
                          + (f"the file has {', '.join(contexts)}" if contexts else "the file has no contexts"))
    return CliConfig(path, current, contexts)


def check_url(url: str, where: str) -> None:
    u = urlparse(url.strip())
    if u.scheme not in ("https", "http") or not u.hostname:
        raise ConfigError(f"{where}: expected a URL like https://HOST:9470, got {url!r}")
    try:
        u.port
    except ValueError:
        raise ConfigError(f"{where}: {url!r} has no valid port; like https://HOST:9470") from None


def _shown(v) -> str:
    return repr(v) if isinstance(v, str) else "nothing" if v is None else f"{type(v).__name__} {v!r}"


@dataclass
class Setting:
    value: str | None
    source: str  # where it came from, for messages: "--token-file", "$LINKPASS_TOKEN", "context prod", ...


@dataclass
class Resolved:
    coordinator: Setting
    token_file: Setting   # a file holding the token (None: the token is in `token`, or there is none)
    token: Setting        # the token itself, from $LINKPASS_TOKEN
    ca_file: Setting
    cert_file: Setting
    key_file: Setting
    context: str | None
    config: str           # the config file looked at
    state_dir: str        # the coordinator's, for the local defaults and hints

    def token_source(self) -> str:
        """Where the token sent came from, for the message of a refusal."""
        if self.token.value:
            return f"token from {self.token.source}"
        if self.token_file.value:
            where = "the default file" if self.token_file.source == "default" else self.token_file.source
            return f"token from {where} {self.token_file.value}"
        return "no token sent (none given, none found)"


def resolve(flags: Mapping[str, str | None], env: Mapping[str, str], config: CliConfig,
            context: str | None = None) -> Resolved:
    """Every setting by precedence: `flags` (keys as FIELDS; None when not given) > `env` >
    the context of `config` > defaults. `context`: the --context flag."""
    named = context or env.get(ENV_CONTEXT) or None
    name = named or config.current
    if named and named not in config.contexts:
        have = ", ".join(config.contexts) or "none"
        how = "--context" if context else f"${ENV_CONTEXT}"
        raise ConfigError(f"{how} {named}: no such context in {config.path} (contexts: {have}); add it under "
                          "contexts:, or name one the file has")
    ctx = config.contexts.get(name, {}) if name else {}
    state_dir = env.get("LINKPASS_STATE_DIR") or DEFAULT_STATE_DIR

    def pick(key: str) -> Setting:
        if flags.get(key):
            return Setting(flags[key], FLAG_OF[key])
        env_key = ENV_OF[key]
        in_env = env.get(env_key, "").strip()
        if in_env:
            same = in_env == ctx.get(key) or (key != "coordinator" and os.path.abspath(in_env) == ctx.get(key))
            if named and ctx.get(key) and not same:
                raise ConfigError(f"${env_key} ({in_env}) contradicts context {named}'s {key} ({ctx[key]}); "
                                  f"unset ${env_key}, or give {FLAG_OF[key]} to override the context on purpose")
            return Setting(in_env, f"${env_key}")
        if ctx.get(key):
            return Setting(ctx[key], f"context {name}'s {key} ({config.path})")
        return Setting(None, "default")

    url = pick("coordinator")
    if url.value is None:
        url = Setting(COORDINATOR_URL, "default")
    elif url.source.startswith("$"):
        check_url(url.value, url.source)

    # the token: --token-file beats $LINKPASS_TOKEN beats the context's token-file
    token, token_file = Setting(None, "default"), Setting(None, "default")
    env_token = env.get(ENV_OF["token"], "").strip()
    if flags.get("token-file"):
        token_file = Setting(flags["token-file"], "--token-file")
    elif env_token:
        if named and ctx.get("token-file"):
            raise ConfigError(f"$LINKPASS_TOKEN contradicts context {named}'s token-file ({ctx['token-file']}); "
                              "unset $LINKPASS_TOKEN, or give --token-file to override the context on purpose")
        token = Setting(env_token, "$LINKPASS_TOKEN")
    elif ctx.get("token-file"):
        token_file = Setting(ctx["token-file"], f"context {name}'s token-file")
    else:
        for path in (os.path.join(config_dir(env), "token"), os.path.join(state_dir, "reader.token")):
            if os.access(path, os.R_OK):
                token_file = Setting(path, "default")
                break

    ca, cert, key = pick("ca-file"), pick("cert-file"), pick("key-file")
    lab = lab_dir(state_dir)  # on the coordinator's host: the lab CA it made, and the CLI's certificate
    if ca.value is None and os.access(lab_paths(lab, "ca")[0], os.R_OK):
        ca = Setting(lab_paths(lab, "ca")[0], "default")
    if cert.value is None and key.value is None:
        c, k = lab_paths(lab, LOCAL_CLIENT)
        if os.access(c, os.R_OK) and os.access(k, os.R_OK):
            cert, key = Setting(c, "default"), Setting(k, "default")
    return Resolved(url, token_file, token, ca, cert, key, name, config.path, state_dir)


def from_args(args, env: Mapping[str, str] | None = None) -> Resolved:
    """`resolve` for a parsed command line (its --config-file and --context too)."""
    env = os.environ if env is None else env
    path, named = config_path(getattr(args, "config_file", None), env)
    flags = {"coordinator": getattr(args, "coordinator", None), "token-file": getattr(args, "token_file", None),
             "ca-file": getattr(args, "ca_file", None), "cert-file": getattr(args, "cert_file", None),
             "key-file": getattr(args, "key_file", None)}
    return resolve(flags, env, load_config(path, named), getattr(args, "context", None))
