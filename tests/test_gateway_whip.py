"""WHIP (RFC 9725) ingest and WHEP playback against the live app, with real aiortc peers."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from aiortc import AudioStreamTrack, RTCConfiguration, RTCPeerConnection, RTCRtpSender, RTCSessionDescription

from app.client import CodedCamera, OutputProbe, http

SDP = {"Content-Type": "application/sdp"}


async def _offer(
    *, publish: bool, camera: CodedCamera | None = None, like_obs: bool = False
) -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    if publish:
        video = pc.addTransceiver(camera or CodedCamera((128, 128), fps=15), direction="sendonly")
        if like_obs:  # OBS publishes H264 (constrained baseline) video and Opus audio
            h264 = [c for c in RTCRtpSender.getCapabilities("video").codecs if c.mimeType == "video/H264"]
            video.setCodecPreferences(h264)
            pc.addTransceiver(AudioStreamTrack(), direction="sendonly")
    else:
        pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def _post(url: str, sdp: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    status, head, body = await asyncio.to_thread(http, "POST", url, sdp.encode(), headers or SDP)
    return status, head, body.decode()


async def test_whip_then_whep_exchange(live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server(max_streams=1, max_viewers=1, trace_stamp=True) as url:
        status, head, _ = await asyncio.to_thread(http, "OPTIONS", f"{url}/whip")
        assert status == 204 and head["accept-post"] == "application/sdp"

        camera = CodedCamera((128, 128), fps=15)
        publisher, offer = await _offer(publish=True, camera=camera, like_obs=True)
        assert "H264" in offer and "opus" in offer
        status, head, answer = await _post(f"{url}/whip?prompt=ink%20wash", offer)
        assert status == 201, answer
        assert head["content-type"].startswith("application/sdp")
        # The Location is the publisher's own session URL (its last part a capability), not the stream id.
        location = head["location"]
        stream_id = head["x-diffcast-stream-id"]
        assert re.fullmatch(rf"/whip/{stream_id}/[A-Za-z0-9_-]{{22}}", location), location
        # The stream's owner capability (docs/security.md): control, trickle and DELETE by stream id need it.
        owner = {"Authorization": f"Bearer {head['x-diffcast-owner-token']}"}
        assert "a=candidate" in answer  # complete answer: no trickle ICE
        await publisher.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))

        # Trickle ICE is not supported: 405 with Allow (RFC 9725 §4.3.1), for any session URL.
        status, head, _ = await asyncio.to_thread(
            http, "PATCH", url + location, b"a=end-of-candidates\r\n",
            {"Content-Type": "application/trickle-ice-sdpfrag", **owner},
        )
        assert status == 405 and "DELETE" in head["allow"]
        assert (await asyncio.to_thread(http, "PATCH", f"{url}/whip/nope", b"", owner))[0] == 405
        status, head, _ = await asyncio.to_thread(http, "PATCH", f"{url}/whip/{stream_id}", b"", owner)
        assert status == 405 and "DELETE" in head["allow"]
        # The same answer for a session URL that does not exist: PATCH reveals nothing.
        assert (await asyncio.to_thread(http, "PATCH", f"{url}/whip/{stream_id}/nope", b"", owner))[0] == 405

        # Over capacity: 503 + Retry-After.
        extra, extra_offer = await _offer(publish=True)
        status, head, body = await _post(f"{url}/whip", extra_offer)
        assert status == 503 and int(head["retry-after"]) > 0, body
        await extra.close()

        # WHEP: a recvonly viewer of the stream's stylized output.
        viewer, view_offer = await _offer(publish=False)
        probe = OutputProbe(camera)
        viewer.on("track", lambda track: asyncio.ensure_future(probe.consume(track)))
        status, head, view_answer = await _post(f"{url}/whep/{stream_id}", view_offer)
        assert status == 201, view_answer
        viewer_location = head["location"]
        assert viewer_location.startswith(f"/whep/{stream_id}/")
        await viewer.setRemoteDescription(RTCSessionDescription(sdp=view_answer, type="answer"))
        deadline = time.monotonic() + 40
        while len(probe.records) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        # The viewer sees output made from the publisher's frames (IDs carried by the trace stamp).
        assert len(probe.records) >= 5 and not probe.foreign_ids

        # One viewer per stream allowed here: the next one is told to come back later.
        second, second_offer = await _offer(publish=False)
        status, head, body = await _post(f"{url}/whep/{stream_id}", second_offer)
        assert status == 503 and "viewers" in body and int(head["retry-after"]) > 0
        await second.close()

        metrics = (await asyncio.to_thread(http, "GET", f"{url}/metrics"))[2].decode()
        assert f'diffcast_stream_viewers{{kind="whip",stream_id="{stream_id}"}} 1.0' in metrics
        assert "diffcast_streams 1.0" in metrics

        # WHIP streams have no data channel: control goes through the HTTP API.
        control_url = f"{url}/api/streams/{stream_id}/control"
        status, _, body = await asyncio.to_thread(http, "POST", control_url, b'{"type": "update", "steps": 1}', owner)
        assert status == 200 and json.loads(body) == {"type": "ack", "applied": "update"}
        status, _, body = await asyncio.to_thread(http, "POST", control_url, b'{"type": "jump"}', owner)
        assert status == 422 and b"type" in body
        assert json.loads((await asyncio.to_thread(http, "GET", f"{url}/api/streams/{stream_id}"))[2])["steps"] == 1

        assert (await asyncio.to_thread(http, "DELETE", url + viewer_location))[0] == 200
        assert (await asyncio.to_thread(http, "DELETE", url + viewer_location))[0] == 404
        # RFC 9725 §4.2: the client ends its session with DELETE on the Location; the URL is the credential.
        assert (await asyncio.to_thread(http, "DELETE", url + location))[0] == 200
        assert (await asyncio.to_thread(http, "DELETE", url + location))[0] == 404
        assert (await asyncio.to_thread(http, "GET", f"{url}/healthz"))[2].startswith(b'{"status":"ok","streams":0')
        metrics = (await asyncio.to_thread(http, "GET", f"{url}/metrics"))[2].decode()
        assert "diffcast_streams_opened_total 1.0" in metrics and "diffcast_streams 0.0" in metrics
        total_out = re.search(r"^diffcast_output_frames_total (\S+)$", metrics, re.M)
        assert total_out and float(total_out.group(1)) >= 5  # the closed stream still counts
        await asyncio.gather(publisher.close(), viewer.close())


async def test_whip_whep_errors(live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server(max_streams=2, token="s3cret-0123456789ab") as url:
        auth = {**SDP, "Authorization": "Bearer s3cret-0123456789ab"}
        pc, offer = await _offer(publish=True)
        status, head, _ = await _post(f"{url}/whip", offer)
        assert status == 401 and head["www-authenticate"] == "Bearer"
        assert (await asyncio.to_thread(http, "GET", f"{url}/api/streams"))[0] == 401
        assert (await asyncio.to_thread(http, "GET", f"{url}/api/streams", None, {"Authorization": "Bearer s3cret-0123456789ab"}))[0] == 200
        status, _, body = await _post(f"{url}/whip", offer, {"Content-Type": "text/plain", "Authorization": "Bearer s3cret-0123456789ab"})
        assert status == 415 and "application/sdp" in body
        status, _, body = await _post(f"{url}/whip", "hello", auth)
        assert status == 400 and "malformed SDP" in body
        status, _, body = await _post(f"{url}/whip", offer.replace("a=fingerprint", "a=x-fingerprint"), auth)
        assert status == 400 and "fingerprint" in body
        audio_only = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        audio_only.addTransceiver("audio", direction="sendonly")
        await audio_only.setLocalDescription(await audio_only.createOffer())
        status, _, body = await _post(f"{url}/whip", audio_only.localDescription.sdp, auth)
        assert status == 400 and "no video track" in body
        status, _, body = await _post(f"{url}/whip?prompt={'x' * 501}", offer, auth)
        assert status == 422 and "limit is 500" in body  # as on /api/offer: one status per refusal
        status, _, body = await _post(f"{url}/whep/unknown", offer, auth)
        assert status == 404
        # A viewer offer must receive video; a publisher offer sent to WHEP is refused.
        status, head, answer = await _post(f"{url}/whip", offer, auth)
        assert status == 201
        stream_id = head["x-diffcast-stream-id"]
        status, _, body = await _post(f"{url}/whep/{stream_id}", offer, auth)
        assert status == 400 and "does not receive" in body
        status, _, body = await asyncio.to_thread(
            http, "POST", f"{url}/api/offer", b'{"sdp": "v=0", "type": "offer", "prompt": "' + b"y" * 600 + b'"}',
            {"Content-Type": "application/json"},
        )
        assert status == 422 and b"limit is 500" in body
        await asyncio.gather(pc.close(), audio_only.close())
