"""One status per refusal, whichever endpoint raised it (app/server/edge/refusals.py)."""

from __future__ import annotations

import pytest

from app.server.control.messages import ControlError
from app.server.control.recordings import RecordingError
from app.server.edge.refusals import REFUSED, refusal_for
from app.server.media.ndi import NdiError
from app.server.media.sdp import OfferError
from app.server.serving.session import CapacityError


@pytest.mark.parametrize(("exc", "status"), [
    (OfferError("malformed SDP: line 3"), 400),
    (NdiError("no NDI source 'X (Y)'"), 404),
    (ControlError("prompt is 501 characters long; the limit is 500"), 422),
    (RecordingError("no recording"), 422),  # a ControlError: its base's status
    (CapacityError("the server is full"), 503),
])
def test_each_refusal_has_one_status_and_says_why(exc: Exception, status: int) -> None:
    answer = refusal_for(exc, retry_after_s=7)
    assert answer.status == status and answer.reason == str(exc)
    assert answer.headers == ({"Retry-After": "7"} if status == 503 else None)
    assert isinstance(exc, REFUSED)


def test_other_errors_are_not_refusals() -> None:
    with pytest.raises(TypeError, match="ValueError is not a refusal"):
        refusal_for(ValueError("a bug"), retry_after_s=1)
