"""The Gradio playground at /playground, mounted into the live FastAPI server.

Three tabs share one set of controls (prompt, presets, a second prompt to blend with, noise,
steps, seed):

- Webcam: the page's own WebRTC client (web/playground.js importing web/rtc.js and
  web/wsclient.js) inside a ``gr.HTML`` block. fastrtc breaks on Gradio 6 (docs/architecture.md, "Library facts"), and our
  client already does WHIP-less offer/answer, the data channel and the WebSocket fallback.
  Control changes go to the stream from the browser (client-side ``js`` handlers), exactly as
  the page sends them.
- Video file: upload, stylize with ``engine.video_io.stylize_file`` (progress from its tqdm bar),
  download.
- Text to video: ``Stream.generate()`` chunk by chunk, each chunk shown as it arrives; disabled,
  with the reason shown, for a model whose capabilities lack it (the embedded default).

Engine work from the file and text tabs runs chunk by chunk on the server's one engine thread
(the engine is not thread-safe), so it takes turns with live streams instead of racing them.

The playground is under the service's rules (app/server/edge/security.py): with ``--api-token`` it
needs the token (a browser logs in once at /login); its prompts and numbers get the checks control
messages get (``control_message``); uploads are bounded in size there and in count here
(``UploadQuota``), and deleted when their job ends (or, if none uses them, by Gradio's
``delete_cache`` after ``upload_ttl_s``, which also ages out the outputs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from starlette.types import Message, Receive, Scope, Send

from app.server.config import ServerConfig
from app.server.control.messages import MAX_STEPS, MIN_NOISE_SCALE, UpdateMessage, control_message
from app.server.edge.security import PLAYGROUND_UPLOAD, refuse

if TYPE_CHECKING:
    import gradio as gr
    from fastapi import FastAPI

    from engine.pipeline import Pipeline, Stream, StreamParams

log = logging.getLogger(__name__)

PATH = "/playground"
MAX_T2V_CHUNKS = 64
# Jobs (stylize, generate) waiting in Gradio's queue; more are told the queue is full.
MAX_QUEUED_JOBS = 8
# Gradio's delete_cache sweep interval, seconds.
CACHE_SWEEP_S = 60

# The widget's markup comes from web/playground.js; Gradio only hands it a container.
LIVE_JS = "import('/web/playground.js').then((module) => module.mount(element));"

# Client-side handler: copy the Gradio controls into the widget and, when live, send them.
APPLY_JS = """
(prompt, prompt2, blend, blendMode, noise, steps, seed) => {
  const options = { prompt, prompt2, blend, noise_scale: noise, steps, seed: Math.trunc(seed || 0) };
  if (window.diffcastPlayground && window.diffcastPlayground.apply) window.diffcastPlayground.apply(options);
  else window.diffcastPlaygroundPending = options;
}
"""

# Runs once on load: the widget starts with what the controls show.
INIT_JS = """
(prompt, prompt2, blend, blendMode, noise, steps, seed) => {
  const options = { prompt, prompt2, blend, noise_scale: noise, steps, seed: Math.trunc(seed || 0) };
  const wait = () => window.diffcastPlayground && window.diffcastPlayground.ready
    ? window.diffcastPlayground.setOptions(options) : setTimeout(wait, 100);
  wait();
}
"""

CSS = """
.diffcast-live .dc-bar { display: flex; gap: .6rem; align-items: center; flex-wrap: wrap; margin-bottom: .5rem; }
.diffcast-live .dc-bar a { margin-left: auto; font-size: .85rem; }
.diffcast-live .dc-now { font-size: .85rem; opacity: .8; }
.diffcast-live button { padding: .45rem .9rem; border-radius: .4rem; border: 1px solid #8884; cursor: pointer; }
.diffcast-live button.primary { background: #7c5cff; color: #fff; border-color: #7c5cff; }
.diffcast-live button:disabled { opacity: .45; cursor: default; }
.diffcast-live .badge { font-size: .8rem; padding: .15rem .55rem; border-radius: 999px; background: #8883; }
.diffcast-live .badge[data-state="live"] { background: #2fbf71; color: #04170c; }
.diffcast-live .badge[data-state="connecting"] { background: #f2a541; color: #1d1202; }
.diffcast-live .badge[data-state="error"] { background: #e5484d; color: #fff; }
.diffcast-live .notice { padding: .5rem .7rem; border-left: 3px solid #f2a541; background: #f2a54122; }
.diffcast-live .dc-stage { display: grid; grid-template-columns: 1fr 1fr; gap: .6rem; }
.diffcast-live .pane { margin: 0; background: #000; border-radius: .5rem; overflow: hidden; position: relative; aspect-ratio: var(--aspect, 1); }
.diffcast-live .pane video, .diffcast-live .pane canvas { width: 100%; height: 100%; object-fit: contain; display: block; }
.diffcast-live figcaption { position: absolute; left: .5rem; bottom: .3rem; font-size: .75rem; color: #aaa; }
.diffcast-live .stats dl { display: grid; grid-template-columns: repeat(6, 1fr); gap: .4rem; margin: .6rem 0 0; }
.diffcast-live .stats dl > div { border: 1px solid #8883; border-radius: .4rem; padding: .35rem .5rem; }
.diffcast-live dt { font-size: .7rem; opacity: .7; text-transform: uppercase; }
.diffcast-live dd { margin: .1rem 0 0; font-variant-numeric: tabular-nums; }
@media (max-width: 700px) {
  .diffcast-live .dc-stage { grid-template-columns: 1fr; }
  .diffcast-live .stats dl { grid-template-columns: repeat(2, 1fr); }
}
"""


class EngineThreadStream:
    """A `Stream` whose chunks run on the engine thread (blocking the caller, not the engine)."""

    def __init__(self, stream: Stream, executor: Executor) -> None:
        self._stream = stream
        self._executor = executor

    def process(self, frames: np.ndarray) -> np.ndarray:
        return self._executor.submit(self._stream.process, frames).result()

    def generate(self) -> np.ndarray:
        return self._executor.submit(self._stream.generate).result()


class EngineThreadPipeline:
    """The slice of `Pipeline` that `stylize_file` uses, with every engine call on the engine thread."""

    def __init__(self, pipe: Pipeline, executor: Executor) -> None:
        self._pipe = pipe
        self._executor = executor
        self.default_size = pipe.default_size
        self.stream_size = pipe.stream_size  # pure arithmetic on the model's sizes: no engine call
        self.with_knobs = pipe.with_knobs  # reads the model's config: no engine call either
        self.first_chunk_frames = pipe.first_chunk_frames
        self.chunk_frames = pipe.chunk_frames

    def open_stream(self, params: StreamParams) -> EngineThreadStream:
        stream = self._executor.submit(self._pipe.open_stream, params).result()
        return EngineThreadStream(stream, self._executor)


@dataclass(frozen=True)
class Controls:
    """The shared playground controls, as Gradio hands them to a handler."""

    prompt: str
    prompt2: str
    blend: float
    blend_mode: str
    noise_scale: float
    steps: int
    seed: int

    def params(self, max_prompt_chars: int, size: tuple[int, int] | None = None) -> StreamParams:
        """StreamParams after the checks a control message gets (prompt length and characters,
        finite numbers in range); ValueError (shown in the UI) otherwise."""
        from engine.pipeline import StreamParams

        prompt = self.prompt.strip()
        second = self.prompt2.strip()
        if not 0.0 <= self.blend <= 1.0:  # also refuses NaN
            raise ValueError(f"the blend weight must be between 0 and 1, got {self.blend}")
        blended = bool(second) and self.blend > 0
        if blended and self.blend_mode not in ("linear", "slerp"):
            raise ValueError(f"blend mode must be linear or slerp, got {self.blend_mode!r}")
        message = control_message({
            "type": "update", "prompt": [prompt, second] if blended else prompt,
            "prompt_weights": [1.0 - self.blend, self.blend] if blended else None,
            "noise_scale": self.noise_scale, "steps": self.steps, "seed": self.seed,
        }, max_prompt_chars)
        assert isinstance(message, UpdateMessage) and message.noise_scale is not None
        return StreamParams(
            prompt=message.prompt if isinstance(message.prompt, str) else tuple(message.prompt or ()),
            prompt_weights=tuple(message.prompt_weights) if message.prompt_weights is not None else None,
            blend_mode=cast(Any, self.blend_mode), noise_scale=message.noise_scale, steps=int(self.steps),
            seed=int(self.seed), size=size,
        )


def finite(value: Any, name: str) -> float:
    """A number from a Gradio input (any JSON a client sends); ValueError unless finite."""
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a number, got {value!r}") from exc
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


class Playground:
    """The handlers behind the file and text-to-video tabs. Outputs go under ``out_dir`` (Gradio's
    cache, whose ``delete_cache`` ages them out); ``max_prompt_chars`` as for control messages."""

    def __init__(self, pipe: Pipeline | None, executor: Executor, out_dir: Path, max_prompt_chars: int) -> None:
        from engine.devices import resolve_precision

        self.pipe = EngineThreadPipeline(pipe, executor) if pipe is not None else None
        self.capabilities = pipe.capabilities if pipe is not None else None
        # As `diffcast stylize --precision auto`: bf16 where the processor has bf16 units.
        self.precision = resolve_precision("auto", pipe.runtime.device) if pipe is not None else "fp32"
        self.out_dir = out_dir
        self.max_prompt_chars = max_prompt_chars

    def unavailable(self, mode: str) -> str | None:
        """Why a tab's mode cannot run here (no local pipeline, or a model without it); None if it can."""
        if self.capabilities is None:
            return "this server's engine is not a local pipeline; file and text tabs are unavailable"
        return self.capabilities.reason(mode)

    def _out_path(self, suffix: str) -> Path:
        # One directory per job keeps parallel jobs apart and the download's file name readable.
        directory = self.out_dir / f"diffcast-{secrets.token_hex(8)}"
        directory.mkdir(parents=True)
        return directory / f"stylized{suffix}"

    def _require(self, mode: str) -> EngineThreadPipeline:
        reason = self.unavailable(mode)
        if reason is not None:
            raise ValueError(reason)
        assert self.pipe is not None  # capabilities come with a pipeline
        return self.pipe

    def stylize(self, video: str | None, controls: Controls) -> str:
        """Uploaded video path -> stylized .mp4 path (same frame count, the input's aspect at the model's
        pixel budget: ``Pipeline.stream_size``)."""
        from engine.video_io import stylize_file

        pipe = self._require("v2v")
        if not video:
            raise ValueError("upload a video file first")
        if not Path(video).is_file():
            raise ValueError("the uploaded video is gone (an upload is deleted once a job used it): upload it again")
        params = pipe.with_knobs(controls.params(self.max_prompt_chars), precision=self.precision)
        dst = self._out_path(".mp4")
        try:
            frames = stylize_file(cast("Pipeline", pipe), Path(video), dst, params, progress=True)
        finally:
            Path(video).unlink(missing_ok=True)  # done with it: it does not wait for the cache's sweep
        log.info("playground: stylized %s (%d frames) -> %s", video, frames, dst)
        return str(dst)

    def text_to_video(self, chunks: int, controls: Controls) -> Iterator[tuple[np.ndarray, str | None]]:
        """Yields (latest frame, None) per chunk, then (last frame, path of the whole clip)."""
        from engine.video_io import VideoWriter

        pipe = self._require("t2v")
        if not 1 <= chunks <= MAX_T2V_CHUNKS:
            raise ValueError(f"chunks must be between 1 and {MAX_T2V_CHUNKS}, got {chunks}")
        params = controls.params(self.max_prompt_chars).with_(mode="t2v")
        stream = pipe.open_stream(pipe.with_knobs(params, precision=self.precision))
        dst = self._out_path(".mp4")
        writer = VideoWriter(dst, 16.0, pipe.default_size)
        last = np.zeros((pipe.default_size[1], pipe.default_size[0], 3), np.uint8)
        try:
            for _ in range(int(chunks)):
                frames = stream.generate()
                for frame in frames:
                    writer.write(frame)
                last = frames[-1]
                yield last, None
        finally:
            writer.close()
        yield last, str(dst)


def build_blocks(config: ServerConfig, playground: Playground) -> gr.Blocks:
    import gradio as gr

    def controls_of(*values: Any) -> Controls:
        prompt, prompt2, blend, mode, noise, steps, seed = values
        return Controls(str(prompt or ""), str(prompt2 or ""), finite(blend, "blend"), str(mode),
                        finite(noise, "noise"), int(finite(steps, "steps")), int(finite(seed or 0, "seed")))

    # Gradio finds the progress tracker by a gr.Progress default; track_tqdm relays stylize_file's bar.
    track_tqdm = gr.Progress(track_tqdm=True)

    def stylize(video: str | None, *values: Any, progress: gr.Progress = track_tqdm) -> tuple[str, str]:
        try:
            out = playground.stylize(video, controls_of(*values))
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc
        return out, out

    def generate(chunks: float, *values: Any) -> Iterator[tuple[np.ndarray, str | None]]:
        try:
            yield from playground.text_to_video(int(finite(chunks, "chunks")), controls_of(*values))
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc

    # delete_cache: uploads no job used and outputs leave after upload_ttl_s (and all at shutdown).
    with gr.Blocks(title="diffcast playground", analytics_enabled=False,
                   delete_cache=(CACHE_SWEEP_S, config.upload_ttl_s)) as blocks:
        gr.Markdown("## diffcast playground\nLive webcam, video files and text-to-video on the same engine.")
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                prompt = gr.Textbox(
                    config.default_prompt, label="Prompt", max_length=config.max_prompt_chars, elem_id="dc-prompt"
                )
                preset = gr.Dropdown(list(config.presets), value=None, label="Presets", elem_id="dc-preset")
                prompt2 = gr.Textbox("", label="Blend with (optional second prompt)", elem_id="dc-prompt2")
                blend = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Blend weight of the second prompt", elem_id="dc-blend")
                blend_mode = gr.Radio(["linear", "slerp"], value="linear", label="Blend mode (file / text tabs)")
                noise_default, steps_default = config.stream_defaults()
                noise = gr.Slider(MIN_NOISE_SCALE, 1.0, value=noise_default, step=0.05, label="Noise", elem_id="dc-noise")
                steps = gr.Slider(1, MAX_STEPS, value=steps_default, step=1, label="Steps", elem_id="dc-steps")
                seed = gr.Number(0, precision=0, minimum=0, label="Seed")
                apply = gr.Button("Apply to live stream", variant="primary", elem_id="dc-apply")
            controls = [prompt, prompt2, blend, blend_mode, noise, steps, seed]
            with gr.Column(scale=3):
                with gr.Tabs():
                    with gr.Tab("Webcam", id="webcam"):
                        gr.HTML("", js_on_load=LIVE_JS, elem_id="dc-live")
                    with gr.Tab("Video file", id="file"):
                        with gr.Row():
                            video_in = gr.Video(sources=["upload"], label="Input video", elem_id="dc-video-in")
                            video_out = gr.Video(label="Stylized", interactive=False, elem_id="dc-video-out")
                        stylize_button = gr.Button("Stylize", variant="primary", elem_id="dc-stylize")
                        download = gr.File(label="Download", interactive=False, elem_id="dc-download")
                    with gr.Tab("Text to video", id="t2v"):
                        t2v_off = playground.unavailable("t2v")
                        if t2v_off is not None:
                            gr.Markdown(f"**Text to video is off:** {t2v_off}", elem_id="dc-t2v-off")
                        chunks = gr.Slider(1, MAX_T2V_CHUNKS, value=8, step=1, label="Chunks to generate",
                                           interactive=t2v_off is None)
                        generate_button = gr.Button("Generate", variant="primary", elem_id="dc-generate",
                                                    interactive=t2v_off is None)
                        with gr.Row():
                            t2v_frame = gr.Image(label="Streaming", interactive=False, elem_id="dc-t2v-frame")
                            t2v_video = gr.Video(label="Clip", interactive=False, elem_id="dc-t2v-video")

        preset.change(None, inputs=[preset, prompt], outputs=prompt, js="(p, current) => p || current").then(
            None, inputs=controls, js=APPLY_JS
        )
        for trigger in (apply.click, prompt.submit, blend.release, noise.release, steps.release):
            trigger(None, inputs=controls, js=APPLY_JS)
        seed.submit(None, inputs=controls, js=APPLY_JS)
        blocks.load(None, inputs=controls, js=INIT_JS)
        stylize_button.click(stylize, inputs=[video_in, *controls], outputs=[video_out, download])
        generate_button.click(generate, inputs=[chunks, *controls], outputs=[t2v_frame, t2v_video])
    return blocks.queue(max_size=MAX_QUEUED_JOBS)


def _gradio_app(config: ServerConfig, pipe: Pipeline | None, executor: Executor) -> FastAPI:
    """A FastAPI app holding the playground mounted at /playground (built off the event loop)."""
    import gradio as gr
    from fastapi import FastAPI
    from gradio.utils import get_upload_folder

    playground = Playground(pipe, executor, Path(get_upload_folder()), config.max_prompt_chars)
    holder = FastAPI()
    gr.mount_gradio_app(holder, build_blocks(config, playground), path=PATH, css=CSS, footer_links=[],
                        max_file_size=config.max_upload_bytes)
    return holder


class UploadQuota:
    """The playground's uploads on disk: at most ``limit`` files at once.

    The edge (app/server/edge/security.py) bounds each upload's size; this bounds how many are kept. An
    upload that would pass the limit is refused (429) and what it brought deleted at once. Files
    leave when the job that used them deletes them, or when Gradio's delete_cache ages them out.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: set[Path] = set()

    @property
    def held(self) -> int:
        self._held = {path for path in self._held if path.exists()}
        return len(self._held)

    def _refusal(self) -> str:
        return (f"the playground already keeps {self.limit} uploads (--max-uploads); one is freed when a job "
                "that used it ends")

    async def __call__(self, app: FastAPI, scope: Scope, receive: Receive, send: Send) -> None:
        if self.held >= self.limit:
            await refuse(scope, receive, send, 429, self._refusal(), {"Retry-After": str(CACHE_SWEEP_S)})
            return
        messages: list[Message] = []

        async def hold(message: Message) -> None:
            messages.append(message)  # until the body says which files were stored

        await app(scope, receive, hold)
        start = next((m for m in messages if m["type"] == "http.response.start"), None)
        if start is not None and start["status"] == 200:
            body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
            stored = {Path(path) for path in json.loads(body)}
            # Counted after the upload, with no await in between: concurrent uploads cannot both pass.
            if self.held + len(stored) > self.limit:
                for path in stored:
                    path.unlink(missing_ok=True)
                await refuse(scope, receive, send, 429, self._refusal(), {"Retry-After": str(CACHE_SWEEP_S)})
                return
            self._held |= stored
        for message in messages:
            await send(message)


class LazyPlayground:
    """The ASGI app behind /playground: imports Gradio and builds the Blocks on the first request.

    Gradio costs seconds to import and most of a second per Blocks; paying that in every
    `create_app` (every server test, every CLI start) for a page few requests reach is waste.
    The first request builds it in a worker thread, so live streams on the event loop keep running.
    """

    def __init__(self, build: Callable[[], FastAPI], uploads: UploadQuota) -> None:
        self._build = build
        self._uploads = uploads
        self._app: FastAPI | None = None
        self._lifespan: AbstractAsyncContextManager[Any] | None = None
        self._lock = asyncio.Lock()

    async def _ready(self) -> FastAPI:
        async with self._lock:
            if self._app is None:
                holder = await asyncio.to_thread(self._build)
                # Gradio's startup (its queue) runs in the holder's lifespan, on this event loop.
                lifespan = holder.router.lifespan_context(holder)
                await lifespan.__aenter__()
                self._lifespan, self._app = lifespan, holder
            return self._app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = await self._ready()
        # Our Mount already appended /playground to root_path; the holder mounts Gradio at
        # /playground itself, so hand it the parent's root_path back.
        root = str(scope.get("root_path", ""))
        if root.endswith(PATH):
            scope = {**scope, "root_path": root[: -len(PATH)]}
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == PLAYGROUND_UPLOAD:
            await self._uploads(app, scope, receive, send)
            return
        await app(scope, receive, send)

    async def close(self) -> None:
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
            self._lifespan = self._app = None


def mount_playground(app: FastAPI, config: ServerConfig, pipe: Pipeline | None, executor: Executor) -> None:
    """Mount the playground at /playground; ``pipe`` None disables the file and text tabs."""
    lazy = LazyPlayground(lambda: _gradio_app(config, pipe, executor), UploadQuota(config.max_uploads))
    app.mount(PATH, lazy)
    outer = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(parent: Any) -> AsyncIterator[Any]:
        async with outer(parent) as state:
            try:
                yield state
            finally:
                await lazy.close()

    app.router.lifespan_context = lifespan
