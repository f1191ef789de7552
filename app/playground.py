"""The Gradio playground at /playground, mounted into the live FastAPI server.

Three tabs share one set of controls (prompt, presets, a second prompt to blend with, noise,
steps, seed):

- Webcam: the page's own WebRTC client (web/playground.js importing web/rtc.js and
  web/wsclient.js) inside a ``gr.HTML`` block. fastrtc breaks on Gradio 6 (DESIGN.md §4), and our
  client already does WHIP-less offer/answer, the data channel and the WebSocket fallback.
  Control changes go to the stream from the browser (client-side ``js`` handlers), exactly as
  the page sends them.
- Video file: upload, stylize with ``engine.video_io.stylize_file`` (progress from its tqdm bar),
  download.
- Text to video: ``Stream.generate()`` chunk by chunk, each chunk shown as it arrives.

Engine work from the file and text tabs runs chunk by chunk on the server's one engine thread
(the engine is not thread-safe), so it takes turns with live streams instead of racing them.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from starlette.types import Receive, Scope, Send

from app.server.config import ServerConfig
from app.server.control import MAX_STEPS, MIN_NOISE_SCALE

if TYPE_CHECKING:
    import gradio as gr
    from fastapi import FastAPI

    from engine.pipeline import Pipeline, Stream, StreamParams

log = logging.getLogger(__name__)

PATH = "/playground"
MAX_T2V_CHUNKS = 64

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
.diffcast-live .pane { margin: 0; background: #000; border-radius: .5rem; overflow: hidden; position: relative; aspect-ratio: 1; }
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

    def params(self, size: tuple[int, int] | None = None) -> StreamParams:
        """StreamParams; ValueError (shown in the UI) when a value is out of range."""
        from engine.pipeline import StreamParams

        prompt = self.prompt.strip()
        second = self.prompt2.strip()
        if not prompt:
            raise ValueError("the prompt is empty")
        if second and self.blend > 0:
            if self.blend_mode not in ("linear", "slerp"):
                raise ValueError(f"blend mode must be linear or slerp, got {self.blend_mode!r}")
            return StreamParams(
                prompt=(prompt, second), prompt_weights=(1.0 - self.blend, self.blend),
                blend_mode=cast(Any, self.blend_mode), noise_scale=self.noise_scale,
                steps=int(self.steps), seed=int(self.seed), size=size,
            )
        return StreamParams(
            prompt=prompt, noise_scale=self.noise_scale, steps=int(self.steps), seed=int(self.seed), size=size
        )


def _out_path(suffix: str) -> Path:
    # Gradio serves files from its temp/cache directories; mkdtemp keeps parallel jobs apart.
    return Path(tempfile.mkdtemp(prefix="diffcast-")) / f"stylized{suffix}"


class Playground:
    """The handlers behind the file and text-to-video tabs."""

    def __init__(self, pipe: Pipeline | None, executor: Executor) -> None:
        self.pipe = EngineThreadPipeline(pipe, executor) if pipe is not None else None

    def _require_pipe(self) -> EngineThreadPipeline:
        if self.pipe is None:
            raise ValueError("this server's engine is not a local pipeline; file and text tabs are unavailable")
        return self.pipe

    def stylize(self, video: str | None, controls: Controls) -> str:
        """Uploaded video path -> stylized .mp4 path (same frame count, the model's size)."""
        from engine.video_io import stylize_file

        pipe = self._require_pipe()
        if not video:
            raise ValueError("upload a video file first")
        dst = _out_path(".mp4")
        frames = stylize_file(cast("Pipeline", pipe), Path(video), dst, controls.params(), progress=True)
        log.info("playground: stylized %s (%d frames) -> %s", video, frames, dst)
        return str(dst)

    def text_to_video(self, chunks: int, controls: Controls) -> Iterator[tuple[np.ndarray, str | None]]:
        """Yields (latest frame, None) per chunk, then (last frame, path of the whole clip)."""
        from engine.video_io import VideoWriter

        pipe = self._require_pipe()
        if not 1 <= chunks <= MAX_T2V_CHUNKS:
            raise ValueError(f"chunks must be between 1 and {MAX_T2V_CHUNKS}, got {chunks}")
        stream = pipe.open_stream(controls.params().with_(mode="t2v"))
        dst = _out_path(".mp4")
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
        return Controls(prompt or "", prompt2 or "", float(blend), str(mode), float(noise), int(steps), int(seed or 0))

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
            yield from playground.text_to_video(int(chunks), controls_of(*values))
        except ValueError as exc:
            raise gr.Error(str(exc)) from exc

    with gr.Blocks(title="diffcast playground", analytics_enabled=False) as blocks:
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
                        chunks = gr.Slider(1, MAX_T2V_CHUNKS, value=8, step=1, label="Chunks to generate")
                        generate_button = gr.Button("Generate", variant="primary", elem_id="dc-generate")
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
    return blocks


def _gradio_app(config: ServerConfig, playground: Playground) -> FastAPI:
    """A FastAPI app holding the playground mounted at /playground (built off the event loop)."""
    import gradio as gr
    from fastapi import FastAPI

    holder = FastAPI()
    gr.mount_gradio_app(holder, build_blocks(config, playground), path=PATH, css=CSS, footer_links=[])
    return holder


class LazyPlayground:
    """The ASGI app behind /playground: imports Gradio and builds the Blocks on the first request.

    Gradio costs seconds to import and most of a second per Blocks; paying that in every
    `create_app` (every server test, every CLI start) for a page few requests reach is waste.
    The first request builds it in a worker thread, so live streams on the event loop keep running.
    """

    def __init__(self, build: Callable[[], FastAPI]) -> None:
        self._build = build
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
        await app(scope, receive, send)

    async def close(self) -> None:
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)
            self._lifespan = self._app = None


def mount_playground(app: FastAPI, config: ServerConfig, pipe: Pipeline | None, executor: Executor) -> None:
    """Mount the playground at /playground; ``pipe`` None disables the file and text tabs."""
    lazy = LazyPlayground(lambda: _gradio_app(config, Playground(pipe, executor)))
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
