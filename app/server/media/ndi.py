"""NDI's runtime (cyndilib, the ``ndi`` extra, which ships libndi 6) and what NDI input and output
share: the errors, the source names a server publishes, and the pixel formats it takes.

cyndilib is imported only when a server turns NDI on, so a server without the extra runs as before.
Two facts about cyndilib 0.1.3 shape the threads (docs/ndi.md, "How diffcast uses the runtime"):
``Receiver.receive(timeout)`` holds the GIL for its whole wait (it would stall the event loop), and
with a zero timeout it returns almost no frames; a ``FrameSync`` is polled instead, which never
waits. ``Sender.write_video_async`` copies the frame and releases the GIL while libndi sends.
"""

from __future__ import annotations

import fnmatch
import importlib
import threading
from types import ModuleType

import numpy as np

MISSING = "NDI needs the ndi extra: pip install 'diffcast[ndi]' (cyndilib, which ships the NDI runtime)"
NDI_OUT_OFF = ("NDI output is off on this server (the operator turns it on with diffcast serve --ndi-out: "
               "NDI has no viewer authentication, anyone on the network can watch)")
# What a stream is published as when its client gives no label.
DEFAULT_LABEL = "diffcast"


class NdiError(ValueError):
    """NDI cannot do what was asked (runtime missing, source unknown or gone, format unsupported);
    the text says why in plain words."""


def runtime() -> ModuleType:
    """cyndilib, imported on first use; NdiError when the extra is not installed."""
    try:
        return importlib.import_module("cyndilib")
    except ImportError as exc:
        raise NdiError(MISSING) from exc


def allowed(source: str, patterns: tuple[str, ...]) -> bool:
    """Whether the operator's ``--ndi-allow`` patterns (shell-style, case-sensitive) admit ``source``."""
    return any(fnmatch.fnmatchcase(source, pattern) for pattern in patterns)


class SourceNames:
    """The NDI names this server's streams publish under: a stream's label, made distinct (NDI
    receivers pick a source by name, so two streams labelled alike would be one source)."""

    def __init__(self) -> None:
        self._taken: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, label: str) -> str:
        with self._lock:
            name, n = label, 1
            while name in self._taken:
                n += 1
                name = f"{label} {n}"
            self._taken.add(name)
            return name

    def release(self, name: str) -> None:
        with self._lock:
            self._taken.discard(name)


# FourCC codes (little-endian ASCII) of the 8-bit RGB layouts a receiver asked for RGBX_RGBA gets;
# libndi converts every other format to these, but a frame in any other layout is refused, never guessed.
RGBA = int.from_bytes(b"RGBA", "little")
RGBX = int.from_bytes(b"RGBX", "little")
BGRA = int.from_bytes(b"BGRA", "little")
BGRX = int.from_bytes(b"BGRX", "little")


def fourcc_name(code: int) -> str:
    text = int(code).to_bytes(4, "little").decode("latin-1")
    return text if text.isprintable() else f"0x{int(code):08x}"


def rgb_image(data: np.ndarray, fourcc: int, width: int, height: int, stride: int) -> np.ndarray:
    """A received frame's bytes -> [height, width, 3] uint8 RGB; NdiError for a layout it is not."""
    if fourcc not in (RGBA, RGBX, BGRA, BGRX):
        raise NdiError(f"the NDI source sends video as {fourcc_name(fourcc)}, which diffcast does not take "
                       "(it takes 8-bit RGBA, RGBX, BGRA or BGRX; libndi converts the usual camera formats)")
    if width < 1 or height < 1 or stride < 4 * width or data.size < stride * height:
        raise NdiError(f"the NDI source sent a {width}x{height} frame of {data.size} bytes (line stride {stride}): "
                       "not a whole frame")
    pixels = data[: stride * height].reshape(height, stride // 4, 4)[:, :width]
    return np.ascontiguousarray(pixels[..., 2::-1] if fourcc in (BGRA, BGRX) else pixels[..., :3])


def rgbx_bytes(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8 RGB -> the flat RGBX bytes an NDI sender takes."""
    height, width = image.shape[:2]
    out = np.empty((height, width, 4), np.uint8)
    out[..., :3] = image
    out[..., 3] = 255
    return out.reshape(-1)
