"""Cue lists over real HTTP and OSC against a real server and stream: the set as a file (GET, PUT),
firing by name through the control path with the owner checks, bad sets refused with nothing changed,
and fired cues in the recording's prompt timeline."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from test_recordings import call, wait_for
from test_server_osc import OscPeer, free_udp_port, http_control, stream_stats

from app.client import CodedCamera, http, open_session

SET = {"cues": [
    {"name": "ink", "prompt": "ink wash", "noise_scale": 0.6, "transition_s": 1.5},
    {"name": "blend 2", "prompt": ["oil painting", "neon"], "prompt_weights": [0.7, 0.3], "transition_s": 0.0},
]}


def _put(url: str, sid: str, token: str | None, text: str) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, _, raw = http("PUT", f"{url}/api/streams/{sid}/cues", text.encode(), headers)
    return status, json.loads(raw)


async def test_cues_are_set_fired_and_recorded_with_the_owner_checks(
    live_server: Callable[..., AbstractContextManager[str]], tmp_path: Path
) -> None:
    port = free_udp_port()
    with live_server(osc_port=port, record_dir=str(tmp_path / "rec")) as url:
        session = await open_session(url, CodedCamera((128, 128), fps=10), prompt="oil painting")
        osc = OscPeer(port)
        try:
            sid, owner, viewer = session.stream_id, session.owner_token, session.viewer_token
            cues = f"{url}/api/streams/{sid}/cues"
            assert (await call("GET", cues, token=owner)) == (200, b'{"cues":[]}')
            status, body = await asyncio.to_thread(_put, url, sid, owner, json.dumps(SET))
            assert status == 200 and body == SET
            status, raw = await call("GET", cues, token=owner)
            assert status == 200 and json.loads(raw) == SET
            # The owner's alone, as the control route.
            assert (await call("GET", cues))[0] == 401
            assert (await call("GET", cues, token=viewer))[0] == 403
            assert (await asyncio.to_thread(_put, url, sid, viewer, json.dumps({"cues": []})))[0] == 403

            # Bad sets: a clear reason each, and the set in place stays.
            one = SET["cues"][0]
            bad = {
                '{"cues": [{"name": "x", "prompt": "ink", "noise_scale": NaN}]}': "not a number JSON allows",
                json.dumps({"cues": [{**one, "noise_scale": 5.0}]}): "noise_scale",
                json.dumps({"cues": [{**one, "transition_s": 61}]}): "transition_s",
                json.dumps({"cues": [{**one, "name": f"c{i}"} for i in range(65)]}): "at most 64",
                json.dumps({"cues": [one, one]}): "the name 'ink' is used twice",
                json.dumps({"cues": [{**one, "name": "a\nb"}]}): "printable",
                json.dumps({"cues": [{**one, "name": ""}]}): "name",
                json.dumps({"cues": [{**one, "prompt_weights": [1.0, 2.0]}]}): "1 prompts but 2 prompt_weights",
                json.dumps({"cues": [{**one, "volume": 2}]}): "volume: is not a known field",
            }
            for text, reason in bad.items():
                status, body = await asyncio.to_thread(_put, url, sid, owner, text)
                assert status == 422 and reason in body["detail"], (text[:80], body)
            assert json.loads((await call("GET", cues, token=owner))[1]) == SET

            # Fired over HTTP, through the control route, while recording.
            assert (await asyncio.to_thread(http_control, url, sid, owner, {"type": "update", "record": True}))[0] == 200
            assert await asyncio.to_thread(http_control, url, sid, owner, {"type": "cue", "name": "ink"}) == (200, "")
            assert stream_stats(url, sid)["prompt"] == "ink wash"
            status, reason = await asyncio.to_thread(http_control, url, sid, owner, {"type": "cue", "name": "nope"})
            assert status == 422 and "no cue 'nope'" in reason
            _, refused = await asyncio.to_thread(http_control, url, sid, viewer, {"type": "cue", "name": "blend 2"})
            assert refused.startswith("a viewer token can only watch")
            # Over OSC: the same owner check, the same reason.
            assert await osc.send("/diffcast/cue", sid, viewer, "blend 2") == \
                ["/diffcast/error", "/diffcast/cue", sid, refused]
            assert stream_stats(url, sid)["prompt"] == "ink wash"
            assert await osc.send("/diffcast/cue", sid, owner, "blend 2") == ["/diffcast/ack", "/diffcast/cue", sid]
            assert stream_stats(url, sid)["prompt"] == "oil painting + neon"
            assert (await asyncio.to_thread(http_control, url, sid, owner, {"type": "update", "record": False}))[0] == 200

            recordings = f"{url}/api/streams/{sid}/recordings"

            def finished() -> bool:
                status, _, raw = http("GET", recordings, None, {"Authorization": f"Bearer {owner}"})
                return status == 200 and len(json.loads(raw)) == 1 and json.loads(raw)[0]["recording"] is False

            await wait_for(finished)
            listing = json.loads((await call("GET", recordings, token=owner))[1])
            sidecar = json.loads((await call("GET", f"{recordings}/{listing[0]['prompts']}", token=owner))[1])
            assert [m["prompt"] for m in sidecar["prompts"]] == \
                ["oil painting", "cue ink: ink wash", "cue blend 2: oil painting + neon"]
        finally:
            osc.client.close()
            await session.close()
