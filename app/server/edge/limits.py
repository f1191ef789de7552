"""Per-message limits on what clients send: control-message size and rate (data channel and
WebSocket text), WebSocket frame size and rate, and incoming image size (decoded downscaled).

Request bodies, origins and streams per client are limited at the edge (app/server/edge/security.py);
the total number of streams by --max-streams and the serving policy's admission (session.py,
scheduler.py).
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable

import cv2
import numpy as np
from PIL import Image

from app.server.media.frame_path import ChunkAssembler

Clock = Callable[[], float]
# cv2.imdecode's reduced modes decode a JPEG at 1/2, 1/4 or 1/8 size for little more than the
# cost of reading it: a huge frame never becomes a huge array.
REDUCED = ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4), (2, cv2.IMREAD_REDUCED_COLOR_2))


class MessageLimitError(ValueError):
    """A client message over a size or rate limit; the text goes back to the client."""


class RateLimit:
    """Token bucket: ``rate`` messages per second on average, bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: float, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._last = clock()
        self.refused = 0

    def allow(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        self.refused += 1
        return False


class MessageGuard:
    """Size and rate limits of one client's messages of one kind (control text, or video frames)."""

    def __init__(self, kind: str, max_bytes: int, rate: float, burst: float, clock: Clock = time.monotonic) -> None:
        self.kind = kind
        self.max_bytes = max_bytes
        self.rate = RateLimit(rate, burst, clock)

    def check(self, message: str | bytes) -> None:
        """MessageLimitError saying which limit ``message`` is over; counts it against the rate."""
        size = len(message.encode("utf-8") if isinstance(message, str) else message)
        if size > self.max_bytes:
            raise MessageLimitError(f"{self.kind} of {size} bytes is over the limit of {self.max_bytes} bytes")
        if not self.rate.allow():
            raise MessageLimitError(f"too many {self.kind}s: the limit is {self.rate.rate:g} per second")


def control_guard(max_bytes: int, per_second: float, clock: Clock = time.monotonic) -> MessageGuard:
    return MessageGuard("control message", max_bytes, per_second, 2 * per_second, clock)


def frame_guard(max_bytes: int, max_fps: float, clock: Clock = time.monotonic) -> MessageGuard:
    # Twice the output rate: a camera may run faster than the model; more is a flood.
    return MessageGuard("video frame", max_bytes, 2 * max_fps, 2 * max_fps, clock)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image's header, without decoding its pixels."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError... on garbage
        raise MessageLimitError(f"binary message of {len(data)} bytes is not a JPEG/PNG image") from exc
    return int(width), int(height)


def decode_frame(data: bytes, budget_px: int, max_pixels: int) -> tuple[np.ndarray, tuple[int, int]]:
    """JPEG/PNG bytes -> (uint8 RGB, the image's own (width, height) as it was sent).

    Images over ``max_pixels`` are refused before decoding (a decompression bomb); large JPEGs are
    decoded at a reduced scale that still holds ``budget_px`` pixels (the model's pixel budget, which
    no stream's size exceeds). Nothing is cropped or resized here: the engine thread resizes the frame
    once, straight to the size its chunk runs at (app/server/media/frame_path.py)."""
    width, height = image_size(data)
    if width < 1 or height < 1 or width * height > max_pixels:
        raise MessageLimitError(f"frame is {width}x{height}; frames may have at most {max_pixels} pixels")
    flag = cv2.IMREAD_COLOR
    for factor, reduced in REDUCED:
        if (width // factor) * (height // factor) >= budget_px:
            flag = reduced
            break
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flag)
    if image is None:
        raise MessageLimitError(f"binary message of {len(data)} bytes is not a decodable JPEG/PNG image")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB), (width, height)


class InputTimeout(RuntimeError):
    """A publisher sent no frame for too long: its stream ends."""


async def watch_input(assembler: ChunkAssembler, timeout_s: float, clock: Clock = time.monotonic) -> None:
    """Returns never; raises InputTimeout once no frame has arrived for ``timeout_s`` seconds.

    A client that vanishes without a goodbye (power loss, a killed process, a dropped network)
    is otherwise noticed only by ICE consent freshness (about 30 s in aioice), and a client that
    keeps ICE alive but sends nothing would hold its slot and engine state for ever. Run as a
    session task: its failure closes the session."""
    seen, since = assembler.received, clock()
    while True:
        await asyncio.sleep(min(1.0, timeout_s / 4))
        now = clock()
        if assembler.received != seen:
            seen, since = assembler.received, now
        elif now - since > timeout_s:
            raise InputTimeout(f"no input frame for {now - since:.1f} s (the limit is {timeout_s:g} s)")
