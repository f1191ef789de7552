"""A server killed (SIGKILL) while it records: the next server on the same directory finishes the
recording, which is then listed for its owner, downloads, plays, deletes and counts once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from contextlib import AbstractContextManager
from pathlib import Path

import av
import numpy as np
from _security_fixtures import serve_command
from test_recordings import call, control, decode, publish, thumb, wait_for

from app.avsync import BeepMicrophone
from app.client import CodedCamera, pattern_frame
from app.server.control.recorder import (
    INTERRUPTED,
    MP4_OPTIONS,
    VIDEO_CODEC,
    VIDEO_TIME_BASE,
    finish_leftovers,
)
from app.server.control.recordings import RecordingStore


def serve(record_dir: Path, *flags: str) -> AbstractContextManager[tuple[str, subprocess.Popen[bytes]]]:
    """`diffcast serve --model tiny-random --record-dir DIR` in a subprocess, once it answers."""
    return serve_command("--threads", "1", "--allow-loopback-candidates", "--record-dir", str(record_dir), *flags)


def test_a_recording_survives_a_killed_server(tmp_path: Path) -> None:
    record_dir = tmp_path / "rec"

    async def record_then_kill(url: str, process: subprocess.Popen[bytes]) -> tuple[str, str, list[np.ndarray]]:
        pc, answer, received = await publish(url, CodedCamera((128, 128), fps=15), BeepMicrophone(every_s=1.0, first_s=0.3))
        sid, owner = answer["stream_id"], answer["owner_token"]
        await wait_for(lambda: len(received.frames) > 10, 120)
        assert (await control(url, sid, owner, {"type": "update", "record": True}))[0] == 200
        started = time.monotonic()
        await asyncio.sleep(2.0)
        assert (await control(url, sid, owner, {"type": "update", "prompt": "charcoal drawing"}))[0] == 200
        await asyncio.sleep(3.0)  # the timeline is written within a second of a change
        process.send_signal(signal.SIGKILL)  # no drain, no lifespan: the recording is cut where it is
        killed = time.monotonic()
        process.wait()
        await pc.close()
        return sid, owner, received.between(started, killed)

    with serve(record_dir) as (url, process):
        sid, owner, shown = asyncio.run(record_then_kill(url, process))
    leftovers = sorted(p.name for p in (record_dir / sid).iterdir())
    assert [name for name in leftovers if name.endswith(".mp4.part")], leftovers  # killed mid-recording
    left_bytes = sum(p.stat().st_size for p in (record_dir / sid).iterdir())

    # Room for the recording once, not twice: a leftover counted beside its finished file leaves no room.
    max_gb = 1.5 * left_bytes / 1024**3
    with serve(record_dir, "--record-max-gb", repr(max_gb)) as (url, _):
        recordings = f"{url}/api/streams/{sid}/recordings"
        status, raw = asyncio.run(call("GET", recordings, token=owner))
        listing = json.loads(raw)
        assert status == 200 and len(listing) == 1, listing
        item = listing[0]
        assert item["recording"] is False and item["ended"] == "interrupted" and item["audio"] is True, item
        assert asyncio.run(call("GET", recordings, token="x" * 32))[0] == 404  # still its owner's only

        status, mp4 = asyncio.run(call("GET", f"{recordings}/{item['name']}", token=owner))
        assert status == 200 and item["bytes"] == len(mp4)
        frames, peak, _ = decode(mp4)
        assert len(frames) == item["frames"] > 0
        # About every playout tick until the kill: the last fragment (at most a second) may be lost.
        assert 0.4 * len(shown) - 5 <= len(frames) <= 1.4 * len(shown) + 5, (len(frames), len(shown))
        assert peak > 0.1, "the beeps of the input are not in the recording"
        inputs = [thumb(pattern_frame(i, (128, 128))) for i in range(0, 160, 4)]
        for image in frames[len(frames) // 4 :: max(1, len(frames) // 8)]:
            assert image.std() > 2, "a flat (black) frame"
            to_output = min(float(np.abs(image - seen).mean()) for seen in shown)
            to_input = min(float(np.abs(image - source).mean()) for source in inputs)
            assert to_output < to_input / 2, (to_output, to_input)
        status, raw = asyncio.run(call("GET", f"{recordings}/{item['prompts']}", token=owner))
        sidecar = json.loads(raw)
        assert [m["prompt"] for m in sidecar["prompts"]] == ["ink wash", "charcoal drawing"], sidecar
        assert 0 < sidecar["duration_s"] and sidecar["frames"] == len(frames)

        on_disk = sorted(p.name for p in (record_dir / sid).iterdir())
        assert on_disk == sorted(["owner", item["name"], item["prompts"]]), on_disk
        store = RecordingStore(record_dir, 1, lambda _: None)
        assert store.used_bytes() == sum(p.stat().st_size for p in (record_dir / sid).iterdir())

        async def record_again() -> tuple[int, dict[str, object]]:
            pc, answer, received = await publish(url, CodedCamera((64, 64), fps=15), None)
            await wait_for(lambda: len(received.frames) > 2, 120)
            reply = await control(url, answer["stream_id"], answer["owner_token"], {"type": "update", "record": True})
            await pc.close()
            return reply

        status, reply = asyncio.run(record_again())
        assert status == 200, reply  # the quota counts the recovered recording once

        assert asyncio.run(call("DELETE", f"{recordings}/{item['name']}", token=owner))[0] == 204
        assert json.loads(asyncio.run(call("GET", recordings, token=owner))[1]) == []
        assert sorted(p.name for p in (record_dir / sid).iterdir()) == ["owner"]


def test_leftovers_cut_anywhere_keep_their_whole_fragments(tmp_path: Path) -> None:
    """A file cut at any byte (inside a moof, an mdat, the header) keeps exactly its whole
    fragments, plays, and has a sidecar saying so; one without a whole fragment is removed."""
    whole = tmp_path / "whole.mp4"
    with av.open(str(whole), "w", format="mp4", options=MP4_OPTIONS) as container:
        video = container.add_stream(VIDEO_CODEC, rate=30)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        video.codec_context.time_base = VIDEO_TIME_BASE
        for i in range(90):  # 3 s: a fragment at least every second
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 2 * i, np.uint8), format="rgb24")
            frame.pts, frame.time_base = i * 3000, VIDEO_TIME_BASE
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
    data = whole.read_bytes()
    counts = []
    for cut in [*range(0, len(data), max(1, len(data) // 60)), len(data)]:
        directory = tmp_path / f"cut{cut}"
        directory.mkdir()
        (directory / "r.mp4.part").write_bytes(data[:cut])
        (directory / "r.json.part").write_text("{")  # torn: the file's own facts stand in
        finished = finish_leftovers(directory)
        if not finished:
            assert list(directory.iterdir()) == []  # no frame to keep
            counts.append(0)
            continue
        facts = json.loads((directory / "r.json").read_text())
        with av.open(str(directory / "r.mp4")) as container:
            decoded = sum(1 for _ in container.decode(video=0))
        assert decoded == facts["frames"] > 0 and facts["ended"] == INTERRUPTED and facts["recording"] == "r"
        assert sorted(p.name for p in directory.iterdir()) == ["r.json", "r.mp4"]
        counts.append(decoded)
    # Fragments of a second (30 frames): cuts land before the first, inside each, and after the last.
    assert counts == sorted(counts) and set(counts) == {0, 30, 60, 90}, counts
