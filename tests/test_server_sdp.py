"""Offer checks (400 reasons) and ICE helpers, on SDP produced by a real aiortc peer."""

from __future__ import annotations

from collections.abc import Callable

import aioice.ice
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection

from app.client import CodedCamera
from app.server.media.ice import allow_loopback_candidates, strip_candidates
from app.server.media.sdp import OfferError, check_offer


async def _offer(direction: str) -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    if direction == "recvonly":
        pc.addTransceiver("video", direction="recvonly")
    else:
        pc.addTransceiver(CodedCamera((64, 64)), direction=direction)
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return str(sdp)


async def test_offer_directions() -> None:
    sending, receiving, both = await _offer("sendonly"), await _offer("recvonly"), await _offer("sendrecv")
    check_offer(sending, publish=True)
    check_offer(both, publish=True)
    check_offer(receiving, publish=False)
    check_offer(both, publish=False)
    with pytest.raises(OfferError, match="does not send"):
        check_offer(receiving, publish=True)
    with pytest.raises(OfferError, match="does not receive"):
        check_offer(sending, publish=False)


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda sdp: "", "empty SDP"),
        (lambda sdp: "hello world", "starts with 'v=0'"),
        (lambda sdp: sdp.replace("m=video", "m=text"), "no video track"),
        (lambda sdp: sdp.replace("a=ice-ufrag", "a=x-ufrag"), "ice-ufrag"),
        (lambda sdp: sdp.replace("a=fingerprint", "a=x-fingerprint"), "fingerprint"),
    ],
)
async def test_bad_offers_say_why(mangle: Callable[[str], str], reason: str) -> None:
    sdp = await _offer("sendonly")
    with pytest.raises(OfferError, match=reason):
        check_offer(mangle(sdp), publish=True)


async def test_candidates_and_loopback() -> None:
    allow_loopback_candidates()
    allow_loopback_candidates()  # idempotent: patched once
    addresses = aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False)
    assert addresses.count("127.0.0.1") == 1
    sdp = await _offer("sendonly")
    assert "a=candidate" in sdp and "127.0.0.1" in sdp
    stripped = strip_candidates(sdp)
    assert "a=candidate" not in stripped and "a=end-of-candidates" not in stripped
    check_offer(stripped, publish=True)  # still a usable offer, just without candidates
