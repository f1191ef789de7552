"""Checks on incoming SDP offers, so bad input gets a 400 that says exactly what is wrong."""

from __future__ import annotations

from aiortc.sdp import SessionDescription

# A browser's or OBS's offer is 2-10 KB; more is not an offer we want to parse.
MAX_SDP_BYTES = 32768
SENDING = {"sendrecv", "sendonly"}
RECEIVING = {"sendrecv", "recvonly"}


class OfferError(ValueError):
    """The SDP offer cannot be used; the message is the reason given to the client."""


def check_offer(sdp: str, *, publish: bool) -> None:
    """A publisher's offer must send video; a viewer's (WHEP) offer must receive video."""
    if not sdp.strip():
        raise OfferError("empty SDP offer")
    size = len(sdp.encode("utf-8", "replace"))
    if size > MAX_SDP_BYTES:
        raise OfferError(f"SDP offer of {size} bytes is over the limit of {MAX_SDP_BYTES} bytes")
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError("malformed SDP: an SDP offer starts with 'v=0'")
    try:
        description = SessionDescription.parse(sdp)
    except Exception as exc:  # aiortc raises ValueError/IndexError/KeyError on garbage
        raise OfferError(f"malformed SDP: {type(exc).__name__}: {exc}") from exc
    video = [m for m in description.media if m.kind == "video"]
    if not video:
        raise OfferError("the offer has no video track (no m=video section)")
    wanted = SENDING if publish else RECEIVING
    if not any((m.direction or "sendrecv") in wanted for m in video):
        role = "send" if publish else "receive"
        directions = ", ".join(str(m.direction) for m in video)
        raise OfferError(f"the offer's video does not {role} (direction {directions})")
    for m in video:
        if m.ice is None or not m.ice.usernameFragment or not m.ice.password:
            raise OfferError("malformed SDP: the video section has no a=ice-ufrag / a=ice-pwd")
        if not m.dtls or not m.dtls.fingerprints:
            raise OfferError("malformed SDP: the video section has no a=fingerprint")
