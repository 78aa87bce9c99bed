"""A minimal valid agent config, a test fleet key, and the command line that runs `linkpass`."""
from __future__ import annotations

import sys

LINKPASS = [sys.executable, "-m", "linkpass.cli"]
KEY = bytes(range(32))

GOOD = """
agent_id: 1
name: h0
fleet_key_file: /tmp/k
service: 198.18.0.1
nics: [{plane: 0, ifname: p0, addr: 198.18.64.1}]
peers: [{name: h1, agent_id: 2, service: 198.18.0.2, nics: {0: 198.18.64.3}}]
"""
