"""The control path between agents, the CLI and the coordinator, as every end of it uses it:

- `bodies.py` (pure): what a caller may send the coordinator, parsed whole into frozen
  requests, and the coordinator's refusals, each with a `kind` callers match;
- `answers.py` (pure): the coordinator's answer to an agent, checked whole before any of it is
  applied;
- `errors.py` (pure): the refusal kinds, by name;
- `reports.py` (pure): what an agent reports next, from what it sent before;
- `client.py`: the HTTP/JSON client (agents, the CLI, benchmarks);
- `tls.py`: the client's TLS context and the lab CA's file layout;
- `tokens.py`: reading a bearer token from its file.

The coordinator (`linkpass.coordinator`) serves this protocol; the agent, the doctor and the
CLI speak it without importing the coordinator.
"""
