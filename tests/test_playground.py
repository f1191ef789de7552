"""The Gradio playground at /playground, driven in headless Chromium with a fake camera."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import test_browser_page
from _output_checks import aspect_views, assert_stylized

from app.client import http, pattern_frame
from app.playground import Controls
from engine.devices import resolve_precision
from engine.pipeline import StreamParams
from engine.video_io import VideoWriter

W = "window.diffcastPlayground"


# The page test's Chromium fixture (fake camera from the generated clip, the flags in docs/architecture.md).
page = test_browser_page.page


def _wait(page: Any, expression: str, timeout_s: float = 40) -> None:
    page.wait_for_function(expression, timeout=timeout_s * 1000)


@pytest.mark.browser
def test_webcam_tab_streams_stylized_frames(page: Any, live_server: Callable[..., AbstractContextManager[str]]) -> None:
    # Explicit presets: a model trained on a few looks would otherwise offer its own style names.
    with live_server(presets=("claymation", "oil painting")) as url:
        page.goto(f"{url}/playground/")
        _wait(page, f"{W} && {W}.ready")
        page.click("[data-dc=start]")
        _wait(page, f"{W}.status === 'live'")
        assert page.evaluate(f"{W}.transport") == "webrtc"
        # Stylized frames from the fake camera arrive and keep arriving.
        _wait(page, f"{W}.outputFrames > 10")
        before = page.evaluate(f"{W}.outputFrames")
        page.wait_for_timeout(2000)
        assert page.evaluate(f"{W}.outputFrames") > before
        # The server made them from this camera: it counts frames in and frames shown.
        _wait(page, f"{W}.stats && {W}.stats.frames_in > 10 && {W}.stats.frames_out > 5")
        for cell in ("fps", "latency", "slack", "fidelity", "dropped", "frames"):
            assert page.text_content(f"[data-dc={cell}]") not in ("", "–"), cell
        # Gradio controls drive the live stream: a preset, then a two-prompt blend and steps.
        page.click("#dc-preset input")
        page.get_by_role("option", name="claymation").click()
        _wait(page, f"{W}.stats.prompt === 'claymation'", 15)
        page.fill("#dc-prompt2 textarea, #dc-prompt2 input", "charcoal drawing")
        for slider, value in (("#dc-blend", "0.5"), ("#dc-steps", "1")):
            page.fill(f"{slider} input[type=number]", value)
            page.press(f"{slider} input[type=number]", "Enter")
        page.click("#dc-apply")
        _wait(page, f"{W}.stats.prompt === 'claymation + charcoal drawing' && {W}.stats.steps === 1", 15)
        assert page.evaluate(f"{W}.errors") == []
        # Pause and resume, as on the page.
        page.click("[data-dc=pause]")
        _wait(page, f"{W}.stats.paused === true", 10)
        page.click("[data-dc=pause]")
        _wait(page, f"{W}.stats.paused === false", 10)
        # The widget links the stream's WHEP viewer page.
        stream_id = page.evaluate(f"{W}.streamId")
        assert page.get_attribute("[data-dc=view-link]", "href").startswith(f"/view/{stream_id}?token=")
        page.click("[data-dc=stop]")
        _wait(page, f"{W}.status === 'idle'", 10)


@pytest.mark.browser
def test_with_an_api_token_a_browser_logs_in_once(page: Any, live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server(api_token="s3cret-api-token") as url:
        page.goto(f"{url}/playground/")
        # Sent to the login form; a wrong token keeps it there, the right one leads back.
        page.wait_for_selector("input[name=token]")
        assert "/login?next=" in page.url
        page.fill("input[name=token]", "wrong")
        page.click("button[type=submit]")
        page.wait_for_selector("#failed:not([hidden])")
        page.fill("input[name=token]", "s3cret-api-token")
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/playground/")
        # The cookie stands for the token: Gradio's own requests and the webcam's stream work.
        _wait(page, f"{W} && {W}.ready")
        page.click("[data-dc=start]")
        _wait(page, f"{W}.status === 'live' && {W}.outputFrames > 5")
        assert page.evaluate("document.cookie") == ""  # HttpOnly: page scripts never see it
        page.click("[data-dc=stop]")
        _wait(page, f"{W}.status === 'idle'", 10)


def _write_clip(path: Path, frames: int, size: tuple[int, int]) -> Path:
    writer = VideoWriter(path, 16.0, size)
    for i in range(frames):
        writer.write(pattern_frame(i, size))
    writer.close()
    return path


@pytest.mark.browser
def test_file_tab_returns_a_stylized_video(
    page: Any, live_server: Callable[..., AbstractContextManager[str]], engine_factory: Any, tmp_path: Path
) -> None:
    clip = _write_clip(tmp_path / "input.mp4", frames=10, size=(160, 120))
    with live_server() as url:
        page.goto(f"{url}/playground/")
        page.get_by_role("tab", name="Video file").click()
        page.set_input_files("#dc-video-in input[type=file]", str(clip))
        page.wait_for_selector("#dc-video-in video", timeout=20_000)
        page.click("#dc-stylize")
        link = page.wait_for_selector("#dc-download a[href]", timeout=45_000)
        href = urllib.parse.urljoin(page.url, link.get_attribute("href"))
        status, _, body = http("GET", href)
    assert status == 200
    out = tmp_path / "out.mp4"
    out.write_bytes(body)
    with av.open(str(out)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    # Every input frame comes back, at the input's 4:3 aspect on the model's pixel budget (288x224 on the
    # default model's 256x256, docs/default-model.md), as a stylisation of the input (not black, not the
    # input merely resized, not frozen, not noise).
    width, height = (288, 224) if engine_factory.size == (256, 256) else (144, 112)  # tiny-random: 128x128
    assert len(frames) == 10
    assert frames[0].shape == (height, width, 3)
    undistorted, _ = aspect_views(np.stack([pattern_frame(i, (160, 120)) for i in range(10)]), (width, height))
    assert_stylized(np.stack(frames), undistorted)


def test_controls_validate_and_blend() -> None:
    blended = Controls("oil painting", " ink wash ", 0.25, "slerp", 0.7, 3, 5).params(500)
    assert blended.prompts == ("oil painting", "ink wash")
    assert blended.prompt_weights == (0.75, 0.25) and blended.blend_mode == "slerp"
    single = Controls("oil painting", "ink wash", 0.0, "linear", 0.7, 3, 5).params(500)
    assert single.prompts == ("oil painting",) and single.prompt_weights is None
    with pytest.raises(ValueError, match="prompt is empty"):
        Controls("  ", "", 0.0, "linear", 0.8, 2, 0).params(500)
    with pytest.raises(ValueError, match="blend mode"):
        Controls("a", "b", 0.5, "cubic", 0.8, 2, 0).params(500)
    with pytest.raises(ValueError, match="noise_scale"):
        Controls("a", "", 0.0, "linear", 0.05, 2, 0).params(500)


def test_text_to_video_streams_chunks_then_the_clip(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from app.playground import Playground
    from engine.pipeline import Pipeline

    pipe = Pipeline.load("tiny-random")  # declares text-to-video (the embedded default does not)
    with ThreadPoolExecutor(max_workers=1) as engine_thread:
        playground = Playground(pipe, engine_thread, tmp_path, 500)
        updates = list(playground.text_to_video(3, Controls("a red fox", "", 0.0, "linear", 0.8, 2, 0)))
    # One preview per chunk, then the whole clip.
    assert [path is None for _, path in updates] == [True, True, True, False]
    width, height = pipe.default_size
    assert all(frame.shape == (height, width, 3) for frame, _ in updates)
    with av.open(str(updates[-1][1])) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    # As many frames as three chunks of a text-to-video stream opened here directly.
    direct = pipe.open_stream(StreamParams(prompt="a red fox", mode="t2v"))
    assert len(frames) == sum(len(direct.generate()) for _ in range(3))
    assert frames[0].shape == (height, width, 3)
    with pytest.raises(ValueError, match="chunks must be between"):
        next(playground.text_to_video(0, Controls("a", "", 0.0, "linear", 0.8, 2, 0)))
    with pytest.raises(ValueError, match="not a local pipeline"):
        Playground(None, engine_thread, tmp_path, 500).stylize("x.mp4", Controls("a", "", 0.0, "linear", 0.8, 2, 0))


def test_text_to_video_is_off_with_its_reason_on_a_model_without_it(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from app.playground import Playground, build_blocks
    from app.server.config import ServerConfig
    from engine.pipeline import Pipeline

    with ThreadPoolExecutor(max_workers=1) as engine_thread:
        playground = Playground(Pipeline.load(), engine_thread, tmp_path, 500)
        reason = playground.unavailable("t2v")
        assert reason is not None and "cannot do text-to-video" in reason
        with pytest.raises(ValueError, match="cannot do text-to-video"):
            next(playground.text_to_video(2, Controls("a red fox", "", 0.0, "linear", 0.8, 2, 0)))
        components = {c["props"].get("elem_id"): c["props"] for c in build_blocks(ServerConfig(), playground)
                      .config["components"]}
    assert components["dc-generate"]["interactive"] is False
    assert reason in components["dc-t2v-off"]["value"]
    assert components["dc-stylize"].get("interactive") is not False


def test_stylize_deletes_its_upload_when_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload is the job's input, kept no longer than the job (Gradio's cache sweep would keep
    it for upload_ttl_s): a re-run asks for a new upload, and the output stays for download. The job
    runs at the precision `diffcast stylize --precision auto` picks on this processor."""
    from concurrent.futures import ThreadPoolExecutor

    import engine.video_io
    from app.playground import Playground
    from engine.pipeline import Pipeline

    # (Its output is not compared with the command's: bf16 convolutions round differently with
    # another OpenMP thread count, and the tab runs on its engine thread.)
    precisions = []
    stylize_file = engine.video_io.stylize_file

    def recording(pipe: Any, src: Path, dst: Path, params: StreamParams, **kwargs: Any) -> int:
        precisions.append(params.fidelity.precision if params.fidelity else None)
        return stylize_file(pipe, src, dst, params, **kwargs)

    monkeypatch.setattr(engine.video_io, "stylize_file", recording)

    clip = _write_clip(tmp_path / "upload.mp4", frames=5, size=(64, 48))
    source = np.stack([pattern_frame(i, (64, 48)) for i in range(5)])
    with ThreadPoolExecutor(max_workers=1) as engine_thread:
        playground = Playground(Pipeline.load(), engine_thread, tmp_path / "cache", 500)
        controls = Controls("oil painting", "", 0.0, "linear", 0.2, 1, 0)  # the model's operating point
        with pytest.raises(ValueError, match="limit is 500"):  # refused before the job: the upload stays
            playground.stylize(str(clip), Controls("x" * 501, "", 0.0, "linear", 0.8, 2, 0))
        assert clip.exists()
        out = Path(playground.stylize(str(clip), controls))
        assert out.is_file() and out.is_relative_to(tmp_path / "cache") and not clip.exists()
        with av.open(str(out)) as container:  # the shipped model's look of the upload
            got = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        assert_stylized(got, source)
        with pytest.raises(ValueError, match="upload it again"):
            playground.stylize(str(clip), controls)
    assert precisions == [resolve_precision("auto", "cpu")]
