"""A bearer token read from its file (agents' token_file, the CLI's --token-file): the whole file,
whitespace around it stripped. The coordinator's side of tokens (hashing, roles, agent tokens)
is coordinator/auth.py's."""
from __future__ import annotations


class TokenFileError(ValueError):
    """A token file that holds no token; the message names the file."""


def read_token(path: str) -> str:
    """The token in `path`; OSError when it cannot be read, TokenFileError when it is empty."""
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise TokenFileError(f"{path}: the token file is empty")
    return token
