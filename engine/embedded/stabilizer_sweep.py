"""Choose the temporal stabilizer's settings for an embedded model on *training* clips.

    python -m engine.embedded.stabilizer_sweep [--config engine/weights/default.json] [--clips 16] [--threads 2]
        [--per-look] [--save scores.json | --load scores.json]

Each clip streams once per look through the product's path (``evaluate.stylize_stream``: 1 frame, then
4 at a time), which yields the model's decoded frames before the stabilizer; every candidate setting
then runs over those frames as the runtime runs it (chunk by chunk, one history per stream from its
first frame) and is scored against the teachers as the evaluation scores the shipped output: mean PSNR
over looks and clips, and the warp error over the teachers' (DIS flow on the input, ``warp_error``).
The stabilizer trades the two: a longer history cuts flicker and, once the model is steadier than its
teachers, also averages away detail the teachers have. The pick is the setting with the best PSNR
whose warp ratio stays under ``--max-warp-ratio`` (a margin under the 1x target, since held-out clips
may flicker more). ``--per-look`` also picks a setting per look (``runtime.stabilizer_looks``):
the best mean PSNR under the same all-looks ceiling with no look over ``--look-max-warp-ratio``
(``pick_per_look``). Held-out clips are left for ``engine.embedded.evaluate``, which scores the pick.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.embedded.clips import render_clip, train_specs
from engine.embedded.evaluate import chunk_spans, input_flows, psnr, style_prompts, stylize_stream, warp_error
from engine.embedded.model import DEFAULT_CONFIG
from engine.embedded.teachers import stylize_clip
from engine.frames import frames_to_tensor, tensor_to_frames
from engine.pipeline import Pipeline
from engine.streaming.stabilizer import StabilizerConfig, StabilizerState, TemporalStabilizer

CLIP_FRAMES = 17  # the held-out clips' length: 1 + 4 chunks of 4


@dataclass(frozen=True)
class SweepRow:
    config: StabilizerConfig | None  # None: the stabilizer off (the model's decoded frames)
    psnr: float  # dB against the teachers, mean over looks and clips
    warp_ratio: float  # mean warp error over the teachers' mean warp error (all looks and clips)
    worst_look: str
    worst_psnr: float


def candidates(base: StabilizerConfig, strengths: list[float], motion: list[float],
               change: list[float]) -> list[StabilizerConfig]:
    """Every combination of the three knobs, the rest of ``base`` kept (cut threshold, flow size)."""
    return [replace(base, strength=s, motion_tolerance=m, change_tolerance=c)
            for s, m, c in itertools.product(strengths, motion, change)]


def stabilized(config: StabilizerConfig, frames: np.ndarray, decoded: np.ndarray,
               spans: list[tuple[int, int]]) -> np.ndarray:
    """``decoded`` (uint8 [T, H, W, 3], the model's frames) through a fresh stabilizer at ``config``,
    chunk by chunk as ``StreamRuntime.finish_frames`` runs it, with ``frames`` the stream's input."""
    stabilizer, state = TemporalStabilizer(config), StabilizerState()
    chunks = [tensor_to_frames(stabilizer(state, frames_to_tensor(frames[a:b]), frames_to_tensor(decoded[a:b])))
              for a, b in spans]
    return np.concatenate(chunks)


@dataclass(frozen=True)
class SweepScores:
    """Per option (None: the stabilizer off) and look, per clip: (PSNR, output warp error, teacher warp error)."""

    options: tuple[StabilizerConfig | None, ...]
    scores: tuple[dict[str, list[tuple[float, float, float]]], ...]

    def rows(self) -> list[SweepRow]:
        """Each option over every look: mean PSNR over looks and clips, warp ratio over all of them."""
        rows = []
        for option, by_look in zip(self.options, self.scores, strict=True):
            per_look = {look: float(np.mean([s[0] for s in runs])) for look, runs in by_look.items()}
            every = [s for runs in by_look.values() for s in runs]
            worst = min(per_look, key=lambda look: per_look[look])
            rows.append(SweepRow(option, float(np.mean(list(per_look.values()))),
                                 float(np.mean([s[1] for s in every]) / np.mean([s[2] for s in every])),
                                 worst, per_look[worst]))
        return rows

    def look_rows(self, look: str) -> list[SweepRow]:
        """Each option on one look's clips (``worst_look`` is that look)."""
        rows = []
        for option, by_look in zip(self.options, self.scores, strict=True):
            runs = by_look[look]
            db = float(np.mean([s[0] for s in runs]))
            rows.append(SweepRow(option, db, float(np.mean([s[1] for s in runs]) / np.mean([s[2] for s in runs])),
                                 look, db))
        return rows


def sweep(pipe: Pipeline, prompts: dict[str, str], configs: list[StabilizerConfig], clips: int) -> SweepScores:
    """Score the stabilizer off and each of ``configs`` on ``clips`` training clips (spread over the
    training sources and motions) x every look."""
    specs = train_specs(CLIP_FRAMES)
    picked = [specs[i] for i in np.linspace(0, len(specs) - 1, clips).round().astype(int)]
    options: tuple[StabilizerConfig | None, ...] = (None, *configs)
    scores: tuple[dict[str, list[tuple[float, float, float]]], ...] = tuple(
        {style: [] for style in prompts} for _ in options)
    for ci, spec in enumerate(tqdm(picked, desc="sweep clips")):
        frames = render_clip(spec)
        flows = input_flows(frames)
        spans = chunk_spans(pipe, frames.shape[0])
        for style, prompt in prompts.items():
            teacher = stylize_clip(frames, style)
            warp_teacher = warp_error(teacher, flows)
            decoded = stylize_stream(pipe, frames, prompt, seed=ci).raw
            for k, option in enumerate(options):
                out = decoded if option is None else stabilized(option, frames, decoded, spans)
                scores[k][style].append((psnr(out, teacher), warp_error(out, flows), warp_teacher))
    return SweepScores(options, scores)


def pick(rows: list[SweepRow], max_warp_ratio: float) -> SweepRow | None:
    """The best PSNR among the settings whose warp ratio is at most ``max_warp_ratio``."""
    ok = [r for r in rows if r.config is not None and r.warp_ratio <= max_warp_ratio]
    return max(ok, key=lambda r: r.psnr) if ok else None


def pick_per_look(scores: SweepScores, max_warp_ratio: float, look_max_warp_ratio: float) -> dict[str, SweepRow]:
    """A setting per look: the best mean PSNR over looks whose warp ratio over all looks stays at most
    ``max_warp_ratio`` (the one-setting pick's ceiling) and whose every look's own ratio stays at most
    ``look_max_warp_ratio``.

    The all-looks ratio is the looks' summed warp error over the teachers' sum, so each look spends
    from one budget: a Lagrange multiplier on it prices a look's flicker, each look takes its best
    PSNR minus that price, and a bisection finds the lowest price that meets the budget. Looks whose
    teachers flicker least (a tone curve) thus keep more of their detail than the same setting
    everywhere would leave them, and looks that flicker most get the longer history. A look no setting
    keeps under its own ceiling gets its steadiest setting; a budget no choice meets gets the steadiest
    choice the price can buy."""
    looks = list(scores.scores[0])
    teacher = sum(s[2] for runs in scores.scores[0].values() for s in runs)
    rows = {look: [r for r in scores.look_rows(look) if r.config is not None] for look in looks}
    # Summed output warp error of each (look, option), the all-looks ratio's numerator terms.
    spent: dict[str, dict[StabilizerConfig | None, float]] = {
        look: {option: float(sum(s[1] for s in by_look[look]))
               for option, by_look in zip(scores.options, scores.scores, strict=True) if option is not None}
        for look in looks}
    allowed = {}
    for look in looks:
        ok = [r for r in rows[look] if r.warp_ratio <= look_max_warp_ratio]
        allowed[look] = ok or [min(rows[look], key=lambda r: r.warp_ratio)]

    def choose(price: float) -> dict[str, SweepRow]:
        return {look: max(allowed[look], key=lambda r: r.psnr / len(looks) - price * spent[look][r.config] / teacher)
                for look in looks}

    def ratio(picks: dict[str, SweepRow]) -> float:
        return sum(spent[look][r.config] for look, r in picks.items()) / teacher

    picks = choose(0.0)
    if ratio(picks) <= max_warp_ratio:
        return picks
    low, high = 0.0, 1.0
    while ratio(choose(high)) > max_warp_ratio and high < 1e6:
        high *= 2.0
    for _ in range(60):
        mid = (low + high) / 2.0
        low, high = (low, mid) if ratio(choose(mid)) <= max_warp_ratio else (mid, high)
    return choose(high)


def overall(scores: SweepScores, picks: dict[str, SweepRow]) -> tuple[float, float]:
    """Mean PSNR over looks and the all-looks warp ratio of a setting per look."""
    k = {option: i for i, option in enumerate(scores.options)}
    chosen = [(look, scores.scores[k[row.config]][look]) for look, row in picks.items()]
    warp = sum(s[1] for _, runs in chosen for s in runs) / sum(s[2] for _, runs in chosen for s in runs)
    return float(np.mean([row.psnr for row in picks.values()])), float(warp)


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--clips", type=int, default=6, help="training clips (17 frames each), spread over the split")
    parser.add_argument("--strengths", type=_floats, default=[0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95])
    parser.add_argument("--motion-tolerances", type=_floats, default=[0.07, 0.1, 0.15])
    parser.add_argument("--change-tolerances", type=_floats, default=[0.1, 0.15, 0.2, 0.3])
    parser.add_argument("--max-warp-ratio", type=float, default=0.75,
                        help="the pick's ceiling on the warp ratio (the target is 1x on held-out clips, "
                             "which flicker more than training clips)")
    parser.add_argument("--per-look", action="store_true",
                        help="also pick a setting per look (runtime.stabilizer_looks)")
    parser.add_argument("--look-max-warp-ratio", type=float, default=1.0,
                        help="with --per-look: each look's own ceiling (its output's flicker over its teacher's)")
    parser.add_argument("--save", type=Path, default=None, help="write the per-clip scores to this JSON file")
    parser.add_argument("--load", type=Path, default=None,
                        help="read per-clip scores written by --save instead of streaming the clips")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(args.config.with_suffix(".safetensors"))
    base = pipe.runtime.config.stabilizer or StabilizerConfig()
    configs = candidates(base, args.strengths, args.motion_tolerances, args.change_tolerances)
    if args.load is not None:
        scores = load_scores(args.load)
    else:
        scores = sweep(pipe, style_prompts(args.config), configs, args.clips)
        if args.save is not None:
            save_scores(scores, args.save)
    rows = scores.rows()
    print("| strength / motion / change tolerance | mean PSNR | warp ratio | worst look |")
    print("| --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: -r.psnr):
        print(f"| {_name(r.config, base)} | {r.psnr:.2f} | {r.warp_ratio:.3f} | {r.worst_look} {r.worst_psnr:.2f} |")
    best = pick(rows, args.max_warp_ratio)
    if best is None or best.config is None:
        print(f"\nno setting keeps the warp ratio under {args.max_warp_ratio:g}")
    else:
        print(f"\npick (best PSNR at warp ratio <= {args.max_warp_ratio:g}): {_name(best.config, base)}: "
              f"{best.psnr:.2f} dB, warp ratio {best.warp_ratio:.3f}")
    if not args.per_look:
        return
    picks = pick_per_look(scores, args.max_warp_ratio, args.look_max_warp_ratio)
    print(f"\nper look (best mean PSNR at an all-looks warp ratio <= {args.max_warp_ratio:g} and each look's "
          f"<= {args.look_max_warp_ratio:g}); PSNR / warp ratio:")
    print("| look | model's frames | the config's | pick | setting |")
    print("| --- | --- | --- | --- | --- |")
    for look, row in picks.items():
        own = {r.config: r for r in scores.look_rows(look)}
        raw, current = own[None], own.get(base)
        shown = f"{current.psnr:.2f} / {current.warp_ratio:.2f}" if current is not None else "—"
        print(f"| {look} | {raw.psnr:.2f} / {raw.warp_ratio:.2f} | {shown} | {row.psnr:.2f} / {row.warp_ratio:.2f} "
              f"| {_name(row.config, base)} |")
    mean_db, warp = overall(scores, picks)
    print(f"\nper-look picks: mean {mean_db:.2f} dB, warp ratio {warp:.3f}; as runtime.stabilizer_looks "
          f"(over runtime.stabilizer = {_name(base, base)}):")
    print(json.dumps({look: _knobs(r.config) for look, r in picks.items() if r.config is not None and r.config != base}))


def _name(config: StabilizerConfig | None, base: StabilizerConfig) -> str:
    if config is None:
        return "none (the model's frames)"
    text = f"{config.strength:g} / {config.motion_tolerance:g} / {config.change_tolerance:g}"
    return text + (" (the config's)" if config == base else "")


def _knobs(config: StabilizerConfig) -> dict[str, float]:
    return {"strength": config.strength, "motion_tolerance": config.motion_tolerance,
            "change_tolerance": config.change_tolerance}


def save_scores(scores: SweepScores, path: Path) -> None:
    """The per-clip scores as JSON, so another ceiling can be tried without streaming again."""
    options = [None if o is None else asdict(o) for o in scores.options]
    path.write_text(json.dumps({"options": options, "scores": list(scores.scores)}))


def load_scores(path: Path) -> SweepScores:
    data = json.loads(path.read_text())
    options = tuple(None if o is None else StabilizerConfig(**o) for o in data["options"])
    scores = tuple({look: [(float(a), float(b), float(c)) for a, b, c in runs] for look, runs in by_look.items()}
                   for by_look in data["scores"])
    return SweepScores(options, scores)


if __name__ == "__main__":
    main()
