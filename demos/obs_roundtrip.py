"""The OBS -> diffcast -> OBS round trip, scripted: what OBS does, done by aiortc, against a server.

1. Publishes like OBS Studio's WHIP output (Opus + H.264 42e01f, Bearer token) to /whip.
2. Pulls the stylized result back like OBS would see it: over WHEP, the protocol behind both the
   Browser Source page (/view/<stream-id>) and `diffcast virtualcam --source stream:<id>`.
3. Prints the exact OBS settings for the same server, and how many stylized frames came back.

    diffcast serve --model tiny-random --allow-loopback-candidates --token s3cret-0123456789ab &
    .venv/bin/python demos/obs_roundtrip.py --server http://127.0.0.1:8080 --token s3cret-0123456789ab

The step-by-step guide with the real OBS is docs/obs.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpSender, RTCSessionDescription  # noqa: E402
from aiortc.mediastreams import AudioStreamTrack  # noqa: E402

from app.client import CodedCamera, http  # noqa: E402
from app.server.media.ice import allow_loopback_candidates  # noqa: E402
from app.virtualcam import whep_frames  # noqa: E402

OBS_VIDEO = ("video/H264", "42e01f")  # OBS's WHIP output: H.264 constrained baseline, level 3.1


async def publish_like_obs(server: str, token: str | None, prompt: str) -> tuple[RTCPeerConnection, str, str]:
    """WHIP publish with OBS's codecs forced; returns the peer, the session's Location (its own URL,
    which ends the session on DELETE) and the stream id (what viewers need)."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    audio = pc.addTransceiver(AudioStreamTrack(), direction="sendonly")
    video = pc.addTransceiver(CodedCamera((640, 360), fps=30), direction="sendonly")
    audio.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType == "audio/opus"])
    video.setCodecPreferences([
        c for c in RTCRtpSender.getCapabilities("video").codecs
        if (c.mimeType, c.parameters.get("profile-level-id")) == OBS_VIDEO
    ])
    await pc.setLocalDescription(await pc.createOffer())
    headers = {"Content-Type": "application/sdp"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    url = f"{server}/whip?prompt={prompt.replace(' ', '%20')}"
    status, head, body = await asyncio.to_thread(http, "POST", url, pc.localDescription.sdp.encode(), headers)
    if status != 201:
        await pc.close()
        raise SystemExit(f"WHIP publish refused: {status} {body.decode(errors='replace').strip()}")
    await pc.setRemoteDescription(RTCSessionDescription(sdp=body.decode(), type="answer"))
    return pc, head.get("Location") or head["location"], head.get("X-Diffcast-Stream-Id") or head["x-diffcast-stream-id"]


def pull(server: str, stream_id: str, token: str | None, frames: int) -> tuple[int, float]:
    start = time.monotonic()
    count = 0
    for _ in whep_frames(server, stream_id, token):
        count += 1
        if count >= frames:
            break
    return count, time.monotonic() - start


async def main_async(args: argparse.Namespace) -> int:
    server = args.server.rstrip("/")
    pc, location, stream_id = await publish_like_obs(server, args.token, args.prompt)
    print(f"1. published like OBS (Opus + H.264 42e01f) -> stream {stream_id}")
    count, seconds = await asyncio.to_thread(pull, server, stream_id, args.token, args.frames)
    print(f"2. pulled {count} stylized frames back over WHEP in {seconds:.1f} s ({count / seconds:.1f} fps incl. start-up)")
    await asyncio.to_thread(http, "DELETE", server + location)  # the session URL is the credential
    await pc.close()
    token_query = f"?token={args.token}" if args.token else ""
    print(
        "3. the same with OBS Studio >= 30:\n"
        f"   Settings -> Stream: Service 'WHIP', Server '{server}/whip', Bearer Token '{args.token or ''}'\n"
        "   Settings -> Output (Advanced) -> Streaming: Video Encoder x264 (or any H.264), Profile baseline,\n"
        "   Keyframe Interval 1 s, Tune zerolatency; then 'Start Streaming'.\n"
        f"   Watch it: add a Browser Source with URL {server}/view/<stream-id>{token_query}\n"
        "   (the stream id is in the X-Diffcast-Stream-Id header of OBS's 201, and the second part of its Location; the dashboard at "
        f"{server}/dashboard lists it),\n"
        f"   or: diffcast virtualcam --source stream:<stream-id> --server {server}"
        + (f" --token {args.token}" if args.token else "")
        + " and add a Video Capture Device source."
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="http://127.0.0.1:8080")
    parser.add_argument("--token", default=None, help="the server's --token (OBS's 'Bearer Token')")
    parser.add_argument("--prompt", default="oil painting")
    parser.add_argument("--frames", type=int, default=60, help="stylized frames to pull back")
    args = parser.parse_args()
    if urlparse(args.server).hostname in ("127.0.0.1", "localhost"):
        allow_loopback_candidates()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
