"""`diffcast serve --lora`: the served LoRAs in /api/config, strengths changed live by control messages
(the output changes), clear errors for bad strengths, names and flags."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import websockets
from _dit_fixtures import write_random_lora
from conftest import running_server

from app.cli import build_parser, main
from app.client import pattern_frame
from app.server.app import create_app
from app.server.config import LoRASpec, ServerConfig, lora_specs
from app.server.control import messages as control
from app.server.control.messages import ControlError, StreamOptions, parse_control
from app.server.media.frame_path import encode_jpeg
from app.server.serving.engine_bridge import InProcessFactory
from engine.models.lora import MAX_LORA_STRENGTH
from engine.models.wan_dit import CONFIGS, CausalWanDiT


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora") / "ink.safetensors"
    write_random_lora(path, CausalWanDiT(CONFIGS["tiny"]), ("ffn.0", "ffn.2", "self_attn.o", "cross_attn.v"),
                      size=0.5)
    return path


@pytest.fixture(scope="module")
def lora_server(lora_file: Path) -> Iterator[str]:
    torch.set_num_threads(1)
    factory = InProcessFactory.load("tiny-random", loras=[LoRASpec("ink", str(lora_file), 0.0)])
    # fifo: every chunk at the stream's own fidelity, so two runs of one stream give the same frames.
    config = ServerConfig(allow_loopback_candidates=True, policy="fifo", max_streams=1)
    with running_server(create_app(config, factory)) as url:
        yield url


async def _stream(url: str, frames: int, updates_after: int | None = None,
                  updates: tuple[dict[str, Any], ...] = ()) -> tuple[list[bytes], list[dict[str, Any]]]:
    """One /ws stream of a still camera: the JPEG bytes of its first ``frames`` output frames, and its
    replies; ``updates`` are sent once ``updates_after`` frames have come back, after one bad update over
    HTTP (its answer is recorded as a reply of type "http")."""
    outputs: list[bytes] = []
    replies: list[dict[str, Any]] = []
    async with websockets.connect(url.replace("http", "ws") + "/ws?prompt=ink&steps=1&seed=3") as ws:
        hello = json.loads(await ws.recv())
        still = encode_jpeg(pattern_frame(0, (hello["width"], hello["height"])), 90)
        deadline = time.monotonic() + 120
        while len(outputs) < frames and time.monotonic() < deadline:
            await ws.send(still)
            due = time.monotonic() + 0.05
            try:
                while (left := due - time.monotonic()) > 0:
                    message = await asyncio.wait_for(ws.recv(), left)
                    if isinstance(message, bytes):
                        outputs.append(message)
                        if len(outputs) == updates_after:
                            async with httpx.AsyncClient() as client:
                                answer = await client.post(
                                    f"{url}/api/streams/{hello['stream_id']}/control",
                                    json={"type": "update", "loras": {"ink": 1.0, "nope": 1.0}},
                                    headers={"Authorization": f"Bearer {hello['owner_token']}"})
                            replies.append({**answer.json(), "type": "http", "status": answer.status_code})
                            for update in updates:
                                await ws.send(json.dumps({"type": "update", **update}))
                    else:
                        replies.append(json.loads(message))
            except TimeoutError:
                pass
    assert len(outputs) >= frames, f"only {len(outputs)} frames came back"
    return outputs[:frames], replies


async def test_strength_changes_live_and_the_output_follows(lora_server: str, lora_file: Path) -> None:
    config = httpx.get(lora_server + "/api/config").json()
    assert [(lora["name"], lora["rank"], lora["strength"]) for lora in config["loras"]] == [("ink", 2, 0.0)]
    assert "blocks.*.ffn.0" in config["loras"][0]["targets"]

    reference, _ = await _stream(lora_server, 24)  # the LoRA off throughout
    bad = ({"loras": {"nope": 1.0}}, {"loras": {"ink": MAX_LORA_STRENGTH * 2}}, {"loras": {"ink": 3.0}})
    changed, replies = await _stream(lora_server, 12, updates_after=3, updates=bad)

    http = [r for r in replies if r["type"] == "http"]
    assert len(http) == 1 and http[0]["status"] == 422 and "no LoRA named 'nope'" in http[0]["message"], http
    errors = [r["message"] for r in replies if r["type"] == "error"]
    assert any("no LoRA named 'nope'" in m for m in errors), errors
    assert any("loras.ink" in m and "less than or equal to 4" in m for m in errors), errors
    assert {"type": "ack", "applied": "update"} in replies
    assert any(r["type"] == "stats" and r["loras"] == {"ink": 0.0} for r in replies), replies  # the served default
    # Same seed, same still input: before the change the stream makes the reference's frames; once the
    # strength is up its chunks are new ones (were the LoRA ignored, they would be the reference's too).
    seen = set(reference)
    assert all(frame in seen for frame in changed[:3])
    assert any(frame not in seen for frame in changed[3:])


def test_control_messages_bound_the_strengths() -> None:
    assert control.MAX_LORA_STRENGTH == MAX_LORA_STRENGTH  # the edge states the engine's bound
    assert StreamOptions(loras={"ink": 0.5}).to_settings("oil", 100).loras == {"ink": 0.5}
    message = parse_control('{"type": "update", "loras": {"ink": -0.5, "film": 2}}', 50)
    assert message.changes() == {"loras": {"ink": -0.5, "film": 2.0}}  # type: ignore[union-attr]
    for text, reason in (('{"type": "update", "loras": {"ink": NaN}}', "not a number JSON allows"),
                         ('{"type": "update", "loras": {"ink": 5}}', "less than or equal to 4"),
                         ('{"type": "update", "loras": {"": 1}}', "at least 1 character"),
                         ('{"type": "update", "loras": {"ink": "strong"}}', "valid number"),
                         ('{"type": "update", "loras": [1]}', "valid dictionary")):
        with pytest.raises(ControlError, match=reason):
            parse_control(text, 50)


def test_serve_flags(lora_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser().parse_args(["serve", "--lora", f"ink={lora_file}", "--lora", "film=f.safetensors",
                                      "--lora-strength", "film=0.25"])
    assert ServerConfig.from_args(args).loras == (LoRASpec("ink", str(lora_file), 1.0),
                                                  LoRASpec("film", "f.safetensors", 0.25))
    for loras, strengths, message in ((["ink=a", "ink=b"], [], "names 'ink' twice"),
                                      (["ink=a"], ["ink=x"], "not a number"),
                                      (["ink=a"], ["film=1"], "no --lora loads")):
        with pytest.raises(ValueError, match=message):
            lora_specs(loras, strengths)
    args = build_parser().parse_args(["serve", "--lora", "ink"])
    with pytest.raises(SystemExit, match="--lora takes NAME=PATH"):
        args._run(args)
    bad = tmp_path / "bad.safetensors"
    write_random_lora(bad, CausalWanDiT(replace(CONFIGS["tiny"], ffn_dim=96)), ("ffn.0",))  # another model's shapes
    assert main(["serve", "--model", "tiny-random", "--lora", f"big={bad}", "--port", "0"]) == 2
    assert "does not fit" in caplog.text and "blocks.0.ffn.0" in caplog.text
