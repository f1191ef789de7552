"""A model declares what it can do, and every surface follows: the Python API, `diffcast stylize`,
`diffcast serve` (/api/config, stream openings, far-prompt notices)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _security_fixtures import Api, publisher_offer

from engine.capabilities import ModelCapabilities, UnsupportedModeError
from engine.pipeline import DEFAULT_MODEL, Pipeline, StreamParams, model_capabilities


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    torch.set_num_threads(1)
    return Pipeline.load()


def test_the_embedded_model_declares_v2v_only_its_looks_and_its_operating_point(pipe: Pipeline) -> None:
    config = json.loads(DEFAULT_MODEL.with_suffix(".json").read_text())
    caps = pipe.capabilities
    assert caps == model_capabilities("default") == model_capabilities(str(DEFAULT_MODEL))
    assert caps.modes == ("v2v",)
    assert caps.looks == tuple(name.replace("_", " ") for name in config["prototypes"]) and "neon" not in caps.looks
    assert (caps.noise_scale, caps.steps) == (config["sampler"]["noise_scale"], config["sampler"]["default_num_steps"])


def test_wan_shaped_models_declare_both_modes() -> None:
    assert ModelCapabilities.from_config({"format": "something-else"}).modes == ("v2v", "t2v")
    assert Pipeline.load("tiny-random").capabilities.supports("t2v")
    assert ModelCapabilities.from_config({"format": "diffcast-embedded/1", "modes": ["v2v", "t2v"]}).supports("t2v")
    with pytest.raises(ValueError, match="unknown modes"):
        ModelCapabilities.from_config({"modes": ["x2y"]})


def test_the_api_refuses_text_to_video_with_the_reason(pipe: Pipeline) -> None:
    with pytest.raises(UnsupportedModeError, match="cannot do text-to-video: it was trained only to restyle"):
        pipe.open_stream(StreamParams(prompt="oil painting", mode="t2v"))


def test_the_api_defaults_are_the_models_operating_point(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="oil painting"))
    assert (stream.params.noise_scale, stream.params.steps) == (pipe.capabilities.noise_scale, pipe.capabilities.steps)
    assert stream.state.fidelity.steps == pipe.capabilities.steps
    explicit = pipe.open_stream(StreamParams(prompt="oil painting", steps=2, noise_scale=0.5))
    assert (explicit.params.noise_scale, explicit.params.steps) == (0.5, 2)


def test_a_far_prompt_gets_a_notice_on_the_stream(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="underwater scene"))
    assert stream.notice is not None and "watercolor" in stream.notice and "neon" not in stream.notice
    stream.update(prompt="watercolor")
    assert stream.notice is None and stream.stats()["notice"] is None


async def _served(**config: Any) -> Api:
    from app.server.app import create_app
    from app.server.config import ServerConfig
    from app.server.serving.engine_bridge import InProcessFactory

    factory = InProcessFactory.load("default")
    return Api(create_app(ServerConfig(allow_loopback_candidates=True, **config), factory=factory))


async def test_serve_lists_capabilities_and_notices_far_prompts() -> None:
    api = await _served()
    try:
        caps = (await api.client.get("/api/config")).json()["capabilities"]
        assert caps["modes"] == ["v2v"] and "pencil sketch" in caps["looks"]
        assert "trained only to restyle" in caps["unsupported"]["t2v"]
        refused = await api.offer(mode="t2v")
        assert refused.status_code == 422 and "a live stream is video-to-video" in refused.json()["detail"]
        pc, sdp = await publisher_offer()
        api.peers.append(pc)
        whip = await api.client.post("/whip?mode=t2v", content=sdp, headers={"Content-Type": "application/sdp"})
        assert whip.status_code == 422 and "a live stream is video-to-video" in whip.text, whip.text
        far = await api.offer(prompt="underwater scene")
        assert far.status_code == 200, far.text
        notice = far.json()["notice"]
        assert "far from every look" in notice and "neon" not in notice.split("nearest:")[1]
        assert far.json()["looks"] and all(item["look"] in caps["looks"] for item in far.json()["looks"])
        stream_id, owner = far.json()["stream_id"], far.json()["owner_token"]
        url, auth = f"/api/streams/{stream_id}/control", {"Authorization": f"Bearer {owner}"}
        near = await api.client.post(url, json={"type": "update", "prompt": "pop art"}, headers=auth)
        assert near.status_code == 200 and near.json().get("notice") is None, near.text
        assert near.json()["looks"][0]["look"] == "pop art" and near.json()["looks"][0]["share"] > 0.9, near.text
        # The reply says what a prompt is served as: one naming two looks gets both, half each; explicit
        # weights mix the prompts' looks by them.
        both = await api.client.post(url, json={"type": "update", "prompt": "pencil sketch and watercolor"},
                                     headers=auth)
        assert both.json()["looks"] == [{"look": "pencil sketch", "share": 0.5}, {"look": "watercolor", "share": 0.5}]
        mixed = await api.client.post(url, json={"type": "update", "prompt": ["pop art", "thermal camera"],
                                                 "prompt_weights": [3, 1]}, headers=auth)
        shares = {item["look"]: item["share"] for item in mixed.json()["looks"]}
        assert abs(shares["pop art"] - 0.75) < 0.02 and abs(shares["thermal"] - 0.25) < 0.02, mixed.text
        again = await api.client.post(url, json={"type": "update", "prompt": "a bowl of ramen"}, headers=auth)
        assert again.status_code == 200 and "far from every look" in again.json()["notice"], again.text
        # The data channel and /ws carry the same messages to the same handler: the same answers.
        session = api.app.state.manager.get(stream_id)
        by_channel = await session.handle_text(json.dumps({"type": "update", "prompt": "a bowl of ramen"}), 500)
        assert by_channel["type"] == "ack" and "far from every look" in by_channel["notice"], by_channel
        near_by_channel = await session.handle_text(json.dumps({"type": "update", "prompt": "pop art"}), 500)
        assert "notice" in near_by_channel and near_by_channel["notice"] is None  # clears the page's notice
        no_prompt = await session.handle_text(json.dumps({"type": "update", "seed": 3}), 500)
        assert "notice" not in no_prompt  # nothing about the prompt changed
        switch = await api.client.post(url, json={"type": "update", "mode": "t2v"}, headers=auth)
        assert switch.status_code == 422 and "mode" in switch.json()["message"], switch.text  # fixed at opening
    finally:
        await api.close()


def test_stylize_refuses_a_model_without_video_to_video(tmp_path: Path, camera_clip: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from app.cli import main

    # A checkpoint that declares text-to-video only: the shipped weights under a config saying so.
    config = json.loads(DEFAULT_MODEL.with_suffix(".json").read_text())
    (tmp_path / "t2v.json").write_text(json.dumps({**config, "modes": ["t2v"]}))
    (tmp_path / "t2v.safetensors").symlink_to(DEFAULT_MODEL)
    argv = ["stylize", str(camera_clip), str(tmp_path / "out.mp4"), "--prompt", "cartoon",
            "--model", str(tmp_path / "t2v.safetensors")]
    assert main(argv) == 2
    assert "this model cannot do video-to-video" in caplog.text
    assert not (tmp_path / "out.mp4").exists()
