"""Temporal stabilizer: a motion-compensated recursive filter on the decoded output frames.

A causal video diffusion model flickers where its input does not change: fresh V2V noise every
chunk, a jump at every chunk boundary, and the VAE's own wobble all add frame-to-frame changes the
camera never saw. A per-frame filter would show none of them. The stabilizer removes what the input
does not explain, frame by frame, using only the past (so it adds no latency):

    flow      = optical flow from input frame t to t−1          (DIS, on grey, at most 320 px a side)
    residual  = max over RGB |in_t − warp(in_{t−1}, flow)|, blurred   (where the flow fails: occlusion, light)
    change    = max over RGB |out_t − warp(y_{t−1}, flow)|, blurred   (what the model changed there)
    m         = strength · exp(−(residual / motion_tolerance)²) · exp(−(change / change_tolerance)²)
    m         = 0 everywhere if mean(residual) > cut_residual          (a scene cut: no usable history)
    y_t       = out_t + m · (warp(y_{t−1}, flow) − out_t)              (y = stabilised output)

Where the flow explains the input and the model's change is small (flicker), y follows the
motion-compensated history; where the input really changed (occlusion, a cut, a light switch) or the
output changed a lot (a new prompt, a new object), the model's frame passes through. In a static
region ``strength`` = 0.9 averages over ~19 frames, cutting white flicker about 4.4x.

The state (previous input frame, previous stabilised output) lives in the stream's state as tensors, so
it moves with the stream between workers like the KV cache does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import cv2
import numpy as np
import torch

from engine.frames import tensor_to_frames


@dataclass(frozen=True)
class StabilizerConfig:
    strength: float = 0.9  # weight of the motion-compensated history where nothing contradicts it
    motion_tolerance: float = 0.1  # input residual (0–1 units) at which the history's weight falls to 1/e
    change_tolerance: float = 0.3  # output change (0–1 units) at which the history's weight falls to 1/e
    cut_residual: float = 0.04  # mean input residual above which a frame is a scene cut (history dropped)
    flow_max_side: int = 320  # optical flow is estimated on frames scaled down to at most this side

    def __post_init__(self) -> None:
        if not 0.0 <= self.strength < 1.0:
            raise ValueError(f"stabilizer strength must be in [0, 1), got {self.strength}")
        if self.motion_tolerance <= 0 or self.change_tolerance <= 0 or self.cut_residual <= 0:
            raise ValueError("stabilizer tolerances must be positive")
        if self.flow_max_side < 16:
            raise ValueError(f"flow_max_side must be >= 16, got {self.flow_max_side}")


@dataclass(frozen=True)
class LookStabilizers:
    """A setting per look, for a model that serves every prompt as a blend of its looks' prototypes.

    Looks differ in how much their raw frames flicker next to their teachers' (a tone curve barely,
    night vision's noise and pop art's posterised edges 3–4x), so one history weight over-smooths some
    and under-steadies others. ``looks`` are the looks' unit text embeddings (the model's pooled
    conditioning), ``settings`` each one's setting. Look anchoring conditions a stream on a slerp of
    two prototypes, so the stream's conditioning lies on the arc between two looks: the pair whose
    plane holds it, and its angles to the two, give the blend exactly; the setting is interpolated the
    same way (a prompt on one look gets that look's).
    """

    looks: tuple[tuple[float, ...], ...]
    settings: tuple[StabilizerConfig, ...]
    _unit: torch.Tensor = field(init=False, repr=False, compare=False)  # ``looks`` normalised, [looks, dim]
    _cos: torch.Tensor = field(init=False, repr=False, compare=False)  # cosines between looks, [looks, looks]

    def __post_init__(self) -> None:
        if len(self.looks) != len(self.settings) or len(self.looks) < 2:
            raise ValueError(f"need at least 2 looks with one setting each, got {len(self.looks)} looks for "
                             f"{len(self.settings)} settings")
        # Asked for on every chunk of every stream: built once.
        unit = torch.nn.functional.normalize(torch.tensor(self.looks, dtype=torch.float64), dim=-1)
        object.__setattr__(self, "_unit", unit)
        object.__setattr__(self, "_cos", unit @ unit.T)

    def for_conditioning(self, conditioning: torch.Tensor) -> StabilizerConfig:
        """The setting for a stream conditioned on ``conditioning`` ([..., dim]; its rows' mean)."""
        e = conditioning.detach().double().cpu().reshape(-1, conditioning.shape[-1]).mean(dim=0)
        if e.shape[0] != self._unit.shape[1]:
            raise ValueError(f"the stabilizer's looks are {self._unit.shape[1]}-d embeddings, the stream's "
                             f"conditioning {e.shape[0]}-d")
        sim = self._unit @ torch.nn.functional.normalize(e, dim=0)
        i, j = self._pair(sim)
        # Angles to the two looks; on the slerp from i to j at t they are t·Ω and (1 − t)·Ω.
        to_i, to_j = (float(torch.arccos(sim[k].clamp(-1.0, 1.0))) for k in (i, j))
        t = to_i / (to_i + to_j) if to_i + to_j > 0 else 0.0
        a, b = self.settings[i], self.settings[j]
        # A share under 1 % is float rounding of a prompt on one look (the anchoring's look list drops
        # such shares too): that look's setting exactly.
        if t < 0.01 or a == b:
            return a
        return StabilizerConfig(
            strength=a.strength + t * (b.strength - a.strength),
            motion_tolerance=a.motion_tolerance + t * (b.motion_tolerance - a.motion_tolerance),
            change_tolerance=a.change_tolerance + t * (b.change_tolerance - a.change_tolerance),
            cut_residual=a.cut_residual + t * (b.cut_residual - a.cut_residual),
            flow_max_side=a.flow_max_side if t < 0.5 else b.flow_max_side,
        )

    def _pair(self, sim: torch.Tensor) -> tuple[int, int]:
        """The two looks whose arc the unit conditioning (cosines ``sim`` to every look) lies on, the
        nearer first: the pair whose plane leaves the least of it out, with both looks' shares of it
        non-negative (between them, not beyond one). Not simply the two nearest looks: a third look can
        be nearer than the far end of the arc when the conditioning sits close to one end."""
        c = self._cos
        si, sj = sim[:, None], sim[None, :]
        det = (1.0 - c * c).clamp_min(1e-12)
        share_i, share_j = (si - c * sj) / det, (sj - c * si) / det
        left_out = 1.0 - (si * si + sj * sj - 2.0 * c * si * sj) / det
        usable = (share_i >= -1e-6) & (share_j >= -1e-6) & (1.0 - c * c > 1e-9)
        usable.fill_diagonal_(False)
        left_out = torch.where(usable, left_out, torch.full_like(left_out, float("inf")))
        if not bool(torch.isfinite(left_out).any()):  # no pair between (degenerate looks): the nearest two
            top = torch.topk(sim, 2).indices
            return int(top[0]), int(top[1])
        k = int(left_out.argmin())
        i, j = divmod(k, left_out.shape[1])
        return (i, j) if sim[i] >= sim[j] else (j, i)


@dataclass
class StabilizerState:
    """The last input frame (uint8 [H, W, 3]) and the last stabilised output (float32 [H, W, 3], 0–255)."""

    host_fields: ClassVar[tuple[str, ...]] = ("prev_in", "prev_out")  # OpenCV reads them: host memory (parcel.py)

    prev_in: torch.Tensor | None = None
    prev_out: torch.Tensor | None = None

    def reset(self) -> None:
        self.prev_in = None
        self.prev_out = None


_local = threading.local()


def _flow_estimator() -> Any:  # cv2.DISOpticalFlow; its stubs do not allow calc(..., None)
    # One DIS instance per thread: calc() keeps scratch buffers, so threads must not share one.
    dis = getattr(_local, "dis", None)
    if dis is None:
        dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST)  # type: ignore[attr-defined]
        _local.dis = dis
    return dis


class TemporalStabilizer:
    """Stateless operator; the per-stream history is a :class:`StabilizerState`."""

    def __init__(self, config: StabilizerConfig) -> None:
        self.config = config
        self._grids: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, state: StabilizerState, inputs: torch.Tensor, outputs: torch.Tensor,
                 config: StabilizerConfig | None = None) -> torch.Tensor:
        """Input and output chunks [3, T, H, W] of one size -> the stabilised output chunk, at ``config``
        (the stream's setting, e.g. its look's; None: the operator's own). ``inputs``: float in [-1, 1]
        or the camera's uint8 (the runtime keeps a chunk's fitted camera bytes); ``outputs``: float in
        [-1, 1]. The result is float in [-1, 1], laid out [T, H, W, 3] in memory (a permuted view): the
        fit to the stream's size and the conversion to bytes read it as they are, without a transpose."""
        if config is None:
            config = self.config
        if inputs.shape != outputs.shape:
            raise ValueError(f"stabilizer needs input and output chunks of one shape, got {tuple(inputs.shape)} "
                             f"and {tuple(outputs.shape)}")
        if inputs.dtype == torch.uint8:
            inp = inputs.cpu().permute(1, 2, 3, 0).contiguous().numpy()
        else:
            inp = tensor_to_frames(inputs)
        # 0-255 floats, contiguous [T, H, W, 3] (OpenCV's layout): clamped straight into that layout, then
        # scaled in place (tensor_to_frames' arithmetic, without its rounding).
        out_hwc = torch.empty((*outputs.shape[1:], outputs.shape[0]), dtype=torch.float32)
        torch.clamp(outputs.detach().float().cpu(), -1, 1, out=out_hwc.permute(3, 0, 1, 2))
        out = out_hwc.add_(1.0).mul_(127.5).numpy()
        if state.prev_in is not None and tuple(state.prev_in.shape) != inp.shape[1:]:
            state.reset()
        prev_in = None if state.prev_in is None else state.prev_in.numpy()
        prev_out = None if state.prev_out is None else state.prev_out.numpy()
        # Each frame's grey is the next frame's previous grey: converted once.
        grays = [cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY) for frame in inp]
        prev_gray = None if prev_in is None else cv2.cvtColor(prev_in, cv2.COLOR_RGB2GRAY)
        result = np.empty_like(out)
        for t in range(inp.shape[0]):
            if prev_in is None or prev_out is None or prev_gray is None:
                result[t] = out[t]
            else:
                result[t] = self._frame(config, prev_in, prev_out, prev_gray, inp[t], out[t], grays[t])
            prev_in, prev_out, prev_gray = inp[t], result[t], grays[t]
        if len(inp):  # only the chunk's last frame is history for the next chunk
            state.prev_in = torch.from_numpy(inp[-1].copy())
            state.prev_out = torch.from_numpy(result[-1].copy())
        return torch.from_numpy(result).permute(3, 0, 1, 2).div_(127.5).sub_(1.0).to(outputs.device, outputs.dtype)

    def _frame(self, cfg: StabilizerConfig, prev_in: np.ndarray, prev_out: np.ndarray, prev_gray: np.ndarray,
               inp: np.ndarray, out: np.ndarray, gray: np.ndarray) -> np.ndarray:
        h, w = inp.shape[:2]
        mx, my = self._sample_grid(cfg, gray, prev_gray)
        warped_in = cv2.remap(prev_in, mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        residual = _channel_max(cv2.absdiff(inp, warped_in))
        if cv2.mean(residual)[0] > 255.0 * cfg.cut_residual:
            return out
        warped_out = cv2.remap(prev_out, mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        change = _channel_max(cv2.absdiff(out, warped_out))
        # Both in 0–255 units: fold the 1/255 into the tolerances.
        r = cv2.GaussianBlur(residual.astype(np.float32), (5, 5), 0) * (1.0 / (255.0 * cfg.motion_tolerance))
        c = cv2.GaussianBlur(change, (5, 5), 0) * (1.0 / (255.0 * cfg.change_tolerance))
        weight = np.exp(-(r * r + c * c)) * np.float32(cfg.strength)
        weight[(mx < 0) | (mx > w - 1) | (my < 0) | (my > h - 1)] = 0.0  # history from outside the frame
        return out + cv2.merge([weight, weight, weight]) * (warped_out - out)

    def _sample_grid(self, cfg: StabilizerConfig, gray: np.ndarray,
                     prev_gray: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each pixel of frame t came from in frame t−1 (absolute coordinates, float32 maps)."""
        h, w = gray.shape
        scale = min(1.0, cfg.flow_max_side / max(h, w))
        if scale < 1.0:
            size = (max(8, round(w * scale)), max(8, round(h * scale)))
            small = cv2.resize(gray, size, interpolation=cv2.INTER_AREA)
            small_prev = cv2.resize(prev_gray, size, interpolation=cv2.INTER_AREA)
            flow = _flow_estimator().calc(small, small_prev, None)
            flow = cv2.resize(flow, (w, h), interpolation=cv2.INTER_LINEAR)
            flow[..., 0] *= w / size[0]
            flow[..., 1] *= h / size[1]
        else:
            flow = _flow_estimator().calc(gray, prev_gray, None)
        if (h, w) not in self._grids:
            gy, gx = np.mgrid[0:h, 0:w].astype(np.float32)
            self._grids[(h, w)] = (gx, gy)
        gx, gy = self._grids[(h, w)]
        return gx + flow[..., 0], gy + flow[..., 1]


def _channel_max(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] -> [H, W], the largest channel (cv2 on split planes: numpy's axis reduce is 10x slower)."""
    a, b, c = cv2.split(image)
    return cv2.max(cv2.max(a, b), c)
