"""The coordinator's refusals: their kinds, by name, and the exceptions that carry them. A refusal's
message is written for the person reading it and may change; its `kind` is what a program
matches (the HTTP answer carries both: `{"error": message, "kind": kind}`). Pure.
"""
from __future__ import annotations

BAD_REQUEST = "bad_request"  # a field is wrong; the message names it
NOT_FOUND = "not_found"  # no such link, host, drain
NOT_REGISTERED = "not_registered"  # a report from an agent the coordinator does not know: register again
REFUSED = "refused"  # a safety guard said no (blast radius, last path)
MOVED = "moved"  # the agent belongs to another shard (its URL in the answer)
UNAVAILABLE = "unavailable"  # what the request needs is away for now: back off and retry
# who may ask, checked by the endpoint before any of the above
UNAUTHENTICATED = "unauthenticated"  # no valid token: none, an unknown one or a revoked one (HTTP 401)
FORBIDDEN = "forbidden"  # the token may not do this: its role (the answer's `needs_role` names the one
#                          that may), or an agent's token speaking for another host (HTTP 403)
THROTTLED = "throttled"  # too many requests from this token, or refused ones from this address: slow down
KINDS = (BAD_REQUEST, NOT_FOUND, NOT_REGISTERED, REFUSED, MOVED, UNAVAILABLE, UNAUTHENTICATED, FORBIDDEN, THROTTLED)


class CoordinatorError(ValueError):
    """A caller's request cannot be done; the message says why and what would work (for a
    person), `kind` what it is (for a program), `status` the HTTP status it is answered with."""

    status = 400
    kind = BAD_REQUEST

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class NotFound(CoordinatorError):
    status = 404
    kind = NOT_FOUND


class Refused(CoordinatorError):
    """A safety guard said no (blast radius, last path)."""

    status = 409
    kind = REFUSED


class Moved(CoordinatorError):
    """The agent belongs to another coordinator shard: it registers and reports there (`url`)."""

    status = 307
    kind = MOVED

    def __init__(self, message: str, url: str, shard: int):
        super().__init__(message)
        self.doc = {"url": url, "shard": shard}


class Unavailable(CoordinatorError):
    """What the request needs is away for now (a shard's root): the caller backs off and retries."""

    status = 503
    kind = UNAVAILABLE
