"""`diffcast stylize` writes a valid video with the input's frame count at the requested size, and on
the shipped default model that video is a stylisation of the input (not black, not the input, not
frozen, not noise; two looks differ)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
from _output_checks import (
    assert_looks_differ,
    assert_stylized,
    assert_undistorted,
    circles_clip,
    held_out_clip,
)

from app.cli import main
from engine.video_io import VideoWriter, read_frames


def _make_clip(path: Path, frames: int, size: tuple[int, int]) -> None:
    writer = VideoWriter(path, 16.0, size)
    w, h = size
    for i in range(frames):
        img = np.zeros((h, w, 3), dtype=np.uint8)
        img[:, (i * 4) % w : (i * 4) % w + 16] = 255  # a moving bar
        img[..., 2] = 80
        writer.write(img)
    writer.close()


def _probe(path: Path) -> tuple[int, int, int]:
    with av.open(str(path)) as c:
        frames = list(c.decode(video=0))
        return len(frames), frames[0].width, frames[0].height


def test_stylize_writes_every_frame_at_the_requested_size(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.mp4", tmp_path / "out.mp4"
    _make_clip(src, 11, (96, 80))  # 1 + 4 + 4 + a partial chunk of 2
    code = main(["stylize", str(src), str(dst), "--prompt", "oil painting", "--model", "tiny-random",
                 "--size", "64x64", "--steps", "1", "--seed", "3"])
    assert code == 0
    assert _probe(dst) == (11, 64, 64)


def _decode(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_stylize_on_the_default_model_stylizes_the_file(tmp_path: Path) -> None:
    src = tmp_path / "in.mp4"
    writer = VideoWriter(src, 16.0, (160, 128))
    for frame in held_out_clip(3, frames=11):  # 1 + 4 + 4 + a partial chunk of 2
        writer.write(frame)
    writer.close()
    decoded, _, _ = read_frames(src, (128, 128))  # what the command reads, resized as it resizes
    source = np.stack(list(decoded))
    outs = []
    for look in ("pencil sketch", "thermal camera"):
        dst = tmp_path / f"{look}.mp4"
        assert main(["stylize", str(src), str(dst), "--prompt", look, "--size", "128x128"]) == 0
        outs.append(_decode(dst))
        assert outs[-1].shape == (11, 128, 128, 3)
        assert_stylized(outs[-1], source)
    assert_looks_differ(*outs)


def test_stylize_runs_the_precision_it_is_given(tmp_path: Path) -> None:
    """--precision reaches the engine: bf16 and fp32 renders of one file differ, by far less than the
    look itself changes the picture; auto is bf16 exactly where the processor has bf16 units."""
    from engine.devices import has_bf16_units

    src = tmp_path / "in.mp4"
    writer = VideoWriter(src, 16.0, (128, 128))
    for frame in held_out_clip(3, frames=9):
        writer.write(frame)
    writer.close()
    outs = {}
    for precision in ("fp32", "bf16", "auto"):
        dst = tmp_path / f"{precision}.mp4"
        assert main(["stylize", str(src), str(dst), "--prompt", "pencil sketch", "--size", "128x128",
                     "--precision", precision]) == 0
        outs[precision] = _decode(dst).astype(np.float64)
    source = np.stack(list(read_frames(src, (128, 128))[0])).astype(np.float64)
    gap = np.abs(outs["bf16"] - outs["fp32"]).mean()
    assert 0 < gap < 0.1 * np.abs(outs["fp32"] - source).mean()
    chosen, other = ("bf16", "fp32") if has_bf16_units("cpu") else ("fp32", "bf16")
    # Nearer the processor's precision than the other by far (fp32 renders vary run to run by ~0.05).
    assert np.abs(outs["auto"] - outs[chosen]).mean() < 0.3 * np.abs(outs["auto"] - outs[other]).mean()


def test_stylize_keeps_the_files_aspect(tmp_path: Path) -> None:
    """Without --size a 4:3 file comes out 4:3 at the default model's pixel budget (288x224,
    docs/default-model.md), undistorted (its circles stay circles) and stylised."""
    src, dst = tmp_path / "in.mp4", tmp_path / "out.mp4"
    clip = circles_clip((320, 240), frames=9)
    writer = VideoWriter(src, 16.0, (320, 240))
    for frame in clip:
        writer.write(frame)
    writer.close()
    assert main(["stylize", str(src), str(dst), "--prompt", "oil painting"]) == 0
    out = _decode(dst)
    assert out.shape == (9, 224, 288, 3)
    assert_undistorted(out, np.stack(list(read_frames(src)[0])))


def test_stylize_rejects_missing_input_and_bad_size(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["stylize", str(tmp_path / "missing.mp4"), str(tmp_path / "o.mp4"), "--prompt", "x"]) == 2
    src = tmp_path / "in.mp4"
    _make_clip(src, 3, (64, 64))
    assert main(["stylize", str(src), str(tmp_path / "o.mp4"), "--prompt", "x", "--model", "tiny-random",
                 "--size", "63x64"]) == 2


def _decoded(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.float32)


def test_stylize_applies_loras_and_refuses_bad_ones(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    from _dit_fixtures import write_random_lora

    from engine.models.wan_dit import CONFIGS, CausalWanDiT

    src = tmp_path / "in.mp4"
    _make_clip(src, 5, (64, 64))
    lora = tmp_path / "ink.safetensors"
    write_random_lora(lora, CausalWanDiT(CONFIGS["tiny"]), ("ffn.0", "ffn.2", "self_attn.o"), size=0.5)
    base = ["--prompt", "oil painting", "--model", "tiny-random", "--size", "64x64", "--steps", "1", "--seed", "3"]
    outs = {}
    for label, extra in (("none", []), ("off", ["--lora", f"ink={lora}", "--lora-strength", "ink=0"]),
                         ("on", ["--lora", f"ink={lora}", "--lora-strength", "ink=2"])):
        dst = tmp_path / f"{label}.mp4"
        assert main(["stylize", str(src), str(dst), *base, *extra]) == 0
        outs[label] = _decoded(dst)
    assert np.abs(outs["off"] - outs["none"]).max() <= 2  # strength 0: the base model (codec noise at most)
    assert np.abs(outs["on"] - outs["none"]).mean() > 5  # the LoRA changes the look
    for extra, message in ((["--lora", f"ink={tmp_path / 'missing.safetensors'}"], "file not found"),
                           (["--lora", "ink"], "--lora takes NAME=PATH"),
                           (["--lora", f"ink={lora}", "--lora-strength", "ink=nan"], "finite"),
                           (["--lora", f"ink={lora}", "--lora-strength", "ink=9"], "finite number in"),
                           (["--lora-strength", "ink=1"], "no --lora loads")):
        caplog.clear()
        assert main(["stylize", str(src), str(tmp_path / "bad.mp4"), *base, *extra]) == 2
        assert message in caplog.text, (extra, caplog.text)
