"""Frame IDs drawn into pixels: a band of large black/white blocks at the top of a frame.

Used to measure glass-to-glass latency from outside the server: a client draws the ID of each
frame it sends, the server (with ``trace_stamp``) copies the band of each input frame onto the
output frame made from it, and the client reads the ID back off what it receives. The layout is
relative to the frame size, so it survives resizing; blocks are large enough to survive VP8/H264.
Two guard blocks (white first, black last) reject frames that carry no code.
"""

from __future__ import annotations

import numpy as np

BLOCKS = 16  # across the frame width: 1 white guard + 14 data bits + 1 black guard
DATA_BITS = BLOCKS - 2
MAX_ID = 1 << DATA_BITS
BAND_FRACTION = 3 / 32  # band height relative to frame height


def band_height(height: int) -> int:
    return max(8, round(height * BAND_FRACTION))


def _edges(width: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, width, BLOCKS + 1).round().astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(BLOCKS)]


def draw_id(image: np.ndarray, frame_id: int) -> None:
    """Draw ``frame_id % MAX_ID`` into the top band of an [H, W, 3] uint8 image, in place."""
    value = frame_id % MAX_ID
    bits = [1] + [(value >> (DATA_BITS - 1 - i)) & 1 for i in range(DATA_BITS)] + [0]
    rows = band_height(image.shape[0])
    for bit, (x0, x1) in zip(bits, _edges(image.shape[1]), strict=True):
        image[:rows, x0:x1] = 255 if bit else 0


def read_id(image: np.ndarray) -> int | None:
    """The ID drawn by `draw_id`, or None when the guard blocks are not there."""
    rows = band_height(image.shape[0])
    y0, y1 = rows // 4, rows - rows // 4
    levels = []
    for x0, x1 in _edges(image.shape[1]):
        pad = (x1 - x0) // 4
        levels.append(float(image[y0:y1, x0 + pad : x1 - pad].mean()))
    if levels[0] < 170 or levels[-1] > 85:
        return None
    value = 0
    for level in levels[1:-1]:
        value = (value << 1) | int(level >= 128)
    return value


def copy_band(source: np.ndarray, target: np.ndarray) -> None:
    """Copy the code band of ``source`` onto ``target``, in place: the band's pixels where the two are of
    one size, else the ID read off ``source`` drawn again at ``target``'s size (a chunk's input at the
    engine size, its output at the stream's)."""
    if source.shape == target.shape:
        rows = band_height(source.shape[0])
        target[:rows] = source[:rows]
        return
    frame_id = read_id(source)
    if frame_id is not None:
        draw_id(target, frame_id)
