"""Stub HTTP servers' answers."""
from __future__ import annotations

import json


def send_json(handler, code: int, doc) -> None:
    """Answer a stub HTTP server's request (a BaseHTTPRequestHandler) with `doc` as JSON."""
    data = json.dumps(doc).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
