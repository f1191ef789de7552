"""What a refused request gets, written once for every endpoint (the JSON API, WHIP and WHEP, NDI).

An error a request causes maps to one status wherever it is raised: bad SDP 400, an unknown NDI
source 404, a control value out of range (a too-long prompt, a NaN, an unknown option) 422, no room
for another stream 503 with ``Retry-After``. Each endpoint only chooses the body's form (JSON
``{"detail": ...}`` or plain text for WHIP/WHEP clients).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.server.control.messages import ControlError
from app.server.media.ndi import NdiError
from app.server.media.sdp import OfferError
from app.server.serving.session import CapacityError

# Most specific first: a subclass takes its own status before its base's.
STATUSES: tuple[tuple[type[Exception], int], ...] = (
    (OfferError, 400),
    (NdiError, 404),
    (ControlError, 422),
    (CapacityError, 503),
)
REFUSED: tuple[type[Exception], ...] = tuple(kind for kind, _ in STATUSES)


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str
    headers: dict[str, str] | None = None


def refusal_for(exc: Exception, retry_after_s: float) -> Refusal:
    """The status, plain-words reason and headers for ``exc`` (one of ``REFUSED``)."""
    for kind, status in STATUSES:
        if isinstance(exc, kind):
            headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
            return Refusal(status, str(exc), headers)
    raise TypeError(f"{type(exc).__name__} is not a refusal") from exc
