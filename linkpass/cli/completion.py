"""`linkpass completion bash` (or zsh, fish) and `linkpass man`: shell completion and manual
pages, both made from the argparse parser itself, so they cannot drift from the commands.

Completion knows every subcommand, every flag and the values of flags with choices; files where a
flag takes a FILE or DIR; and link and host names, which it asks the coordinator for through the
hidden `linkpass __complete links` (or hosts): names one a line, within about a second, and
nothing at all when the coordinator cannot be asked, since completion must never hang or print
errors into the command line.
"""
from __future__ import annotations

import argparse
import contextlib
import io
from dataclasses import dataclass, field

from ..console.output import EXIT_OK

SHELLS = ("bash", "zsh", "fish")
COMPLETE_TIMEOUT_S = 1.0  # `__complete`: per connect and read; a Tab must not stall the shell
# flags that say which coordinator to ask and as whom: completion passes them on to `__complete`
CLIENT_FLAGS = ("--coordinator", "--token-file", "--context", "--config-file", "--ca-file", "--cert-file",
                "--key-file")


@dataclass
class Option:
    flags: list[str]
    help: str
    value: str | None  # None: a switch; else "choices:a b c", "file", "dir", "hosts", "links" or "any"
    metavar: str = ""


@dataclass
class Command:
    path: tuple[str, ...]
    parser: argparse.ArgumentParser
    help: str
    subcommands: dict[str, str] = field(default_factory=dict)  # visible ones: name -> help
    options: list[Option] = field(default_factory=list)
    positionals: list[tuple[str, str, str | None]] = field(default_factory=list)  # (name, help, value kind)

    @property
    def name(self) -> str:
        return " ".join(("linkpass", *self.path))


def _value_kind(action: argparse.Action) -> str | None:
    if action.nargs in (0, "?") and action.option_strings:
        return None  # a switch, or a flag whose value may be left out (--watch [SECONDS]): nothing to wait for
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "choices:" + " ".join(str(c) for c in action.choices)
    kind = getattr(action, "complete", None)  # set where a command registers the argument
    if kind:
        return kind
    metavar = str(action.metavar or "")
    dest = action.dest or ""
    if metavar == "FILE" or dest.endswith("_file") or dest in ("config", "topology"):
        return "file"
    if metavar == "DIR" or dest.endswith("dir"):
        return "dir"
    return "any"


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help_text: str = "") -> list[Command]:
    """Every visible command below (and with) `parser`, depth first. A subcommand registered
    without help (`__complete`) is hidden, as argparse hides it from the list."""
    fmt = parser._get_formatter()
    cmd = Command(path, parser, help_text or (parser.description or "").split("\n\n")[0])
    out = [cmd]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            shown = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if name in shown:
                    cmd.subcommands[name] = shown[name] or ""
                    out += commands(sub, (*path, name), shown[name] or "")
        elif action.help == argparse.SUPPRESS:
            continue
        elif action.option_strings:
            help_ = fmt._expand_help(action) if action.help else ""
            cmd.options.append(Option(list(action.option_strings), help_, _value_kind(action), _metavar(action)))
        else:
            help_ = fmt._expand_help(action) if action.help else ""
            cmd.positionals.append((str(action.metavar or action.dest), help_, _value_kind(action)))
    return out


def _metavar(action: argparse.Action) -> str:
    """The value's name as --help shows it: METAVAR, {a,b,c} for choices, [X] when optional."""
    if action.nargs == 0:
        return ""
    if action.metavar:
        name = str(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        name = action.dest.upper()
    return f"[{name}]" if action.nargs == "?" else name


def _takes_value(opt: Option) -> bool:
    return opt.value is not None


# ---- bash --------------------------------------------------------------------------------------
def _case(rows: list[tuple[str, str]], indent: str = "        ") -> str:
    return "\n".join(f'{indent}{key}) echo {_sh(value)};;' for key, value in rows)


def _sh(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def bash(parser: argparse.ArgumentParser) -> str:
    cmds = commands(parser)
    subs = [(_sh(" ".join(c.path)), " ".join(c.subcommands)) for c in cmds if c.subcommands]
    opts = [(_sh(" ".join(c.path)), " ".join(f for o in c.options for f in o.flags)) for c in cmds]
    values = [(_sh(f"{' '.join(c.path)}|{f}"), o.value) for c in cmds for o in c.options if _takes_value(o)
              for f in o.flags]
    pos = [(_sh(f"{' '.join(c.path)}|{i}"), kind) for c in cmds for i, (_, _, kind) in enumerate(c.positionals)
           if kind and kind != "any"]
    return f'''# bash completion for linkpass (generated by `linkpass completion bash`)
# install: linkpass completion bash > /etc/bash_completion.d/linkpass   (or source it from ~/.bashrc)

_linkpass_subcommands() {{
    case "$1" in
{_case(subs)}
    esac
}}

_linkpass_options() {{
    case "$1" in
{_case(opts)}
    esac
}}

# what an option's value is: choices:WORDS, file, dir, hosts, links or any; nothing for a switch
_linkpass_value() {{
    case "$1|$2" in
{_case(values)}
    esac
}}

_linkpass_positional() {{
    case "$1|$2" in
{_case(pos)}
    esac
}}

_linkpass_complete_kind() {{
    case "$1" in
        choices:*) COMPREPLY=( $(compgen -W "${{1#choices:}}" -- "$2") );;
        file) compopt -o filenames 2>/dev/null; local IFS=$'\\n'; COMPREPLY=( $(compgen -f -- "$2") );;
        dir) compopt -o filenames 2>/dev/null; local IFS=$'\\n'; COMPREPLY=( $(compgen -d -- "$2") );;
        hosts|links) COMPREPLY=( $(compgen -W "$(command linkpass __complete "$1" "${{_linkpass_conn[@]}}" \\
                                                2>/dev/null)" -- "$2") );;
    esac
}}

_linkpass() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" cmd="" npos=0 want="" i=1 w kind subs
    local -a _linkpass_conn=()
    while [ "$i" -lt "$COMP_CWORD" ]; do
        w="${{COMP_WORDS[$i]}}"
        if [[ "$w" == -* ]]; then
            kind="$(_linkpass_value "$cmd" "$w")"
            if [ -n "$kind" ]; then
                [ "${{COMP_WORDS[$((i + 1))]}}" = "=" ] && i=$((i + 1))  # --flag=value, split at "="
                if [ $((i + 1)) -ge "$COMP_CWORD" ]; then
                    want="$kind"
                else
                    case " {' '.join(CLIENT_FLAGS)} " in
                        *" $w "*) _linkpass_conn+=("$w" "${{COMP_WORDS[$((i + 1))]}}");;
                    esac
                fi
                i=$((i + 1))
            fi
        elif [ "$w" != "=" ]; then
            subs=" $(_linkpass_subcommands "$cmd") "
            if [ "$npos" -eq 0 ] && [[ "$subs" == *" $w "* ]]; then
                cmd="${{cmd:+$cmd }}$w"
            else
                npos=$((npos + 1))
            fi
        fi
        i=$((i + 1))
    done
    [ "$cur" = "=" ] && cur=""
    COMPREPLY=()
    if [ -n "$want" ]; then
        _linkpass_complete_kind "$want" "$cur"
    elif [[ "$cur" == -* ]]; then
        COMPREPLY=( $(compgen -W "$(_linkpass_options "$cmd")" -- "$cur") )
    else
        subs="$(_linkpass_subcommands "$cmd")"
        if [ -n "$subs" ] && [ "$npos" -eq 0 ]; then
            COMPREPLY=( $(compgen -W "$subs" -- "$cur") )
        else
            kind="$(_linkpass_positional "$cmd" "$npos")"
            [ -n "$kind" ] && _linkpass_complete_kind "$kind" "$cur"
        fi
    fi
    return 0
}}

complete -F _linkpass linkpass
'''


# ---- zsh ---------------------------------------------------------------------------------------
def _zq(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _zitem(name: str, help_: str) -> str:
    """One `_describe` entry, NAME:HELP (a colon in the name escaped)."""
    return _zq(name.replace(":", "\\:") + ":" + " ".join(help_.split()))


def zsh(parser: argparse.ArgumentParser) -> str:
    cmds = commands(parser)
    subs = "\n".join(f"        {_zq(' '.join(c.path))}) "
                     f"reply=({' '.join(_zitem(n, h) for n, h in c.subcommands.items())});;"
                     for c in cmds if c.subcommands)
    opts = "\n".join(f"        {_zq(' '.join(c.path))}) "
                     f"reply=({' '.join(_zitem(f, o.help) for o in c.options for f in o.flags)});;"
                     for c in cmds)
    values = "\n".join(f"        {_zq(' '.join(c.path) + '|' + f)}) REPLY={_zq(o.value)};;"
                       for c in cmds for o in c.options if _takes_value(o) for f in o.flags)
    pos = "\n".join(f"        {_zq(' '.join(c.path) + '|' + str(i))}) REPLY={_zq(kind)};;"
                    for c in cmds for i, (_, _, kind) in enumerate(c.positionals) if kind and kind != "any")
    return f'''#compdef linkpass
# zsh completion for linkpass (generated by `linkpass completion zsh`)
# install: linkpass completion zsh > "${{fpath[1]}}/_linkpass"   (then start a new shell)

_linkpass_subcommands() {{
    reply=()
    case "$1" in
{subs}
    esac
}}

_linkpass_options() {{
    reply=()
    case "$1" in
{opts}
    esac
}}

_linkpass_value() {{
    REPLY=""
    case "$1|$2" in
{values}
    esac
}}

_linkpass_positional() {{
    REPLY=""
    case "$1|$2" in
{pos}
    esac
}}

_linkpass_complete_kind() {{
    case "$1" in
        choices:*) compadd -- ${{=1#choices:}};;
        file) _files;;
        dir) _files -/;;
        hosts|links) compadd -- ${{(f)"$(command linkpass __complete "$1" "${{(@)conn}}" 2>/dev/null)"}};;
    esac
}}

_linkpass() {{
    local cmd="" want="" w kind
    local -i i=2 npos=0
    local -a reply conn
    local REPLY
    while (( i < CURRENT )); do
        w="${{words[i]}}"
        if [[ "$w" == -* ]]; then
            _linkpass_value "$cmd" "${{w%%=*}}"
            kind="$REPLY"
            if [[ -n "$kind" && "$w" != *=* ]]; then
                if (( i + 1 >= CURRENT )); then
                    want="$kind"
                elif [[ " {' '.join(CLIENT_FLAGS)} " == *" $w "* ]]; then
                    conn+=("$w" "${{words[i + 1]}}")
                fi
                (( i++ ))
            fi
        else
            _linkpass_subcommands "$cmd"
            if (( npos == 0 )) && (( ${{reply[(I)${{(b)w}}:*]}} )); then
                cmd="${{cmd:+$cmd }}$w"
            else
                (( npos++ ))
            fi
        fi
        (( i++ ))
    done
    if [[ -n "$want" ]]; then
        _linkpass_complete_kind "$want"
    elif [[ "$PREFIX" == -* ]]; then
        _linkpass_options "$cmd"
        _describe -t options 'option' reply
    else
        _linkpass_subcommands "$cmd"
        if (( ${{#reply}} && npos == 0 )); then
            _describe -t commands 'command' reply
        else
            _linkpass_positional "$cmd" "$npos"
            [[ -n "$REPLY" ]] && _linkpass_complete_kind "$REPLY"
        fi
    fi
}}

if [[ "$funcstack[1]" == "_linkpass" ]]; then
    _linkpass "$@"
else
    compdef _linkpass linkpass
fi
'''


# ---- fish --------------------------------------------------------------------------------------
def _fq(text: str) -> str:
    return "'" + " ".join(text.split()).replace("\\", "\\\\").replace("'", "\\'") + "'"


def fish(parser: argparse.ArgumentParser) -> str:
    cmds = commands(parser)
    subs = " ".join(_fq(f"{' '.join(c.path)}|{n}") for c in cmds for n in c.subcommands)
    valued = " ".join(_fq(f"{' '.join(c.path)}|{f}") for c in cmds for o in c.options if _takes_value(o)
                      for f in o.flags)
    lines = [
        "# fish completion for linkpass (generated by `linkpass completion fish`)",
        "# install: linkpass completion fish > ~/.config/fish/completions/linkpass.fish",
        "",
        f"set -g __linkpass_subs {subs}",
        f"set -g __linkpass_valued {valued}",
        "",
        "# the command the line is in (words joined by spaces; empty at the top), then the number of",
        "# positional words after it",
        "function __linkpass_where",
        "    set -l words (commandline -opc)",
        "    set -e words[1]",
        "    set -l cmd ''",
        "    set -l npos 0",
        "    set -l skip 0",
        "    for w in $words",
        "        if test $skip -eq 1",
        "            set skip 0",
        "            continue",
        "        end",
        "        switch $w",
        "            case '-*'",
        "                if contains -- \"$cmd|$w\" $__linkpass_valued",
        "                    set skip 1",
        "                end",
        "            case '*'",
        "                if test $npos -eq 0; and contains -- \"$cmd|$w\" $__linkpass_subs",
        "                    set cmd (string trim -- \"$cmd $w\")",
        "                else",
        "                    set npos (math $npos + 1)",
        "                end",
        "        end",
        "    end",
        "    echo $cmd",
        "    echo $npos",
        "end",
        "",
        "function __linkpass_is",
        "    set -l where (__linkpass_where)",
        "    test \"$where[1]\" = \"$argv[1]\"",
        "    and begin",
        "        test (count $argv) -lt 2",
        "        or test \"$where[2]\" = \"$argv[2]\"",
        "    end",
        "end",
        "",
        "function __linkpass_names",
        "    set -l conn",
        "    set -l words (commandline -opc)",
        "    for i in (seq (count $words))",
        f"        if contains -- $words[$i] {' '.join(CLIENT_FLAGS)}; and test $i -lt (count $words)",
        "            set conn $conn $words[$i] $words[(math $i + 1)]",
        "        end",
        "    end",
        "    command linkpass __complete $argv[1] $conn 2>/dev/null",
        "end",
        "",
        "complete -c linkpass -f",
    ]
    for c in cmds:
        here = "'" + " ".join(c.path) + "'"  # command words: no quote or $ in them
        for name, help_ in c.subcommands.items():
            lines.append(f"complete -c linkpass -n \"__linkpass_is {here} 0\" -a {_fq(name)} -d {_fq(help_)}")
        for o in c.options:
            parts = []
            for f in o.flags:
                parts.append(f"-l {f[2:]}" if f.startswith("--") else f"-s {f[1:]}" if len(f) == 2 else f"-o {f[1:]}")
            how = ""
            if o.value is not None:
                how = (" -x -a " + _fq(o.value[len("choices:"):]) if o.value.startswith("choices:")
                       else " -r -F" if o.value in ("file", "dir")
                       else f" -x -a '(__linkpass_names {o.value})'" if o.value in ("hosts", "links") else " -x")
            lines.append(f"complete -c linkpass -n \"__linkpass_is {here}\" {' '.join(parts)}{how} -d {_fq(o.help)}")
        for i, (_, _, kind) in enumerate(c.positionals):
            if kind in ("hosts", "links"):
                lines.append(f"complete -c linkpass -n \"__linkpass_is {here} {i}\" -a '(__linkpass_names {kind})'")
            elif kind and kind.startswith("choices:"):
                lines.append(f"complete -c linkpass -n \"__linkpass_is {here} {i}\" -a {_fq(kind[8:])}")
            elif kind in ("file", "dir"):
                lines.append(f"complete -c linkpass -n \"__linkpass_is {here} {i}\" -F")
    return "\n".join(lines) + "\n"


SCRIPTS = {"bash": bash, "zsh": zsh, "fish": fish}


# ---- the commands ------------------------------------------------------------------------------
def complete_main(argv: list[str]) -> int:
    """`linkpass __complete links` (or hosts) and the connection flags of the line: kept out of the
    CLI's parser (so out of its help, its errors and the generated scripts) and quick: only what
    it needs is imported. Whatever fails (bad arguments, no coordinator, no token, a timeout) ends
    quietly with no names, since the output lands in the user's command line."""
    p = complete_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = p.parse_args(argv)
    except SystemExit:
        return EXIT_OK
    return run_complete(args)


def complete_parser() -> argparse.ArgumentParser:
    from .coordinator_client import client_args
    from .parser import Parser

    p = Parser(prog="linkpass __complete", add_help=False)
    p.add_argument("what", choices=("links", "hosts"))
    client_args(p)
    return p


def run_complete(args) -> int:
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from .coordinator_client import make_client

            client = make_client(args, timeout_s=COMPLETE_TIMEOUT_S)
            try:
                if args.what == "hosts":
                    names = [r["name"] for r in client.get("/v1/agents")]
                else:
                    names = [r["link"] for r in client.get("/v1/links")]
            finally:
                client.close()
        for name in sorted(set(names)):
            out.write(f"{name}\n")
    except Exception:  # noqa: BLE001 - silence is the contract here
        return EXIT_OK
    print(out.getvalue(), end="")
    return EXIT_OK
