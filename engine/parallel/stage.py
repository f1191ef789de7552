"""One pipeline rank's share of the model and of every stream: its blocks, their caches, its compute.

:class:`Stage` runs a micro-step through the rank's blocks (rank 0 also embeds, the last rank also
runs the head, x̂₀, re-noise and VAE decode) and moves blocks on a rebalance; :class:`StageWorker`
is the loop of ranks 1..N-1. The schedule and the driver on rank 0 are in
:mod:`engine.parallel.ring`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from engine.models.wan_dit import KVCache, PromptCache
from engine.parallel.comm import Channel, Message
from engine.parallel.partition import check_ranges
from engine.sampling import renoise, x0_from_velocity
from engine.streaming.rescale import rescale_kv_cache, rescale_vae_cache, token_grid
from engine.streaming.runtime import StreamRuntime, resize_window

WeightsMode = Literal["all", "own"]


class _Clock:
    """Elapsed compute time: perf_counter on CPU, CUDA events on GPU (no device-wide sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def measure(self, into: list[float]) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            into.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            yield
            into.append(time.perf_counter() - t0)


class Stage:
    """One rank's part of the model and of every stream's state (its blocks' caches)."""

    def __init__(self, runtime: StreamRuntime, rank: int, world: int, ranges: Sequence[range],
                 weights: WeightsMode = "all") -> None:
        self.rt = runtime
        self.dit = runtime.dit
        self.rank, self.world = rank, world
        self.ranges = check_ranges(ranges, len(self.dit.blocks))
        if len(self.ranges) != world:
            raise ValueError(f"{len(self.ranges)} block ranges for {world} ranks")
        self.weights = weights
        self.device = self.dit.device
        self.first, self.last = rank == 0, rank == world - 1
        self.kv: dict[tuple[str, int], KVCache] = {}
        self.text: dict[tuple[str, int], Tensor] = {}  # text tokens per (stream, prompt version)
        self.text_loras: dict[tuple[str, int], dict[str, float]] = {}  # the LoRA strengths they were made with
        self.prompts: dict[tuple[str, int], PromptCache] = {}  # this rank's blocks' cross-attention K/V
        self.decoders: dict[str, Any] = {}
        self.clock = _Clock(self.device)
        if weights == "own":
            for i in range(len(self.dit.blocks)):
                if i not in self.blocks:
                    self.dit.blocks[i].to_empty(device="meta")

    @property
    def blocks(self) -> range:
        return self.ranges[self.rank]

    # -- per-stream state ---------------------------------------------------------------------------

    def cache_for(self, row: dict[str, Any]) -> KVCache:
        """The (stream, step) cache of this rank's blocks, created, re-windowed or converted to the row's
        geometry and storage (fp8 at precision fp8-kv), as ``StreamRuntime._fit_caches`` does."""
        key = (row["sid"], row["step"])
        frame_tokens, window, sink, precision = row["geom"]
        dtype = self.rt.kv_dtype(precision)
        cache = self.kv.get(key)
        if cache is None:
            cache = self.kv[key] = self.dit.new_kv_cache(1, frame_tokens, window, sink, dtype=dtype,
                                                         layers=len(self.blocks))
        if cache.window_frames != window:
            cache = self.kv[key] = resize_window(cache, window)
        if cache.dtype != dtype:
            cache = self.kv[key] = cache.to(dtype=dtype)
        return cache

    def fit(self, meta: dict[str, Any]) -> None:
        """A stream's new step count or engine size between its chunks (:meth:`RingRuntime._refit`): its
        pending sink decisions, then its caches rescaled (``rescale_state``'s order), then the step
        caches fitted (``StreamRuntime._fit_caches``). A stream with no caches yet gets zeros lazily."""
        sid, steps = meta["sid"], meta["steps"]
        self._apply_refresh(meta["refresh"])
        if meta["sizes"] is not None:
            old, new = (tuple(size) for size in meta["sizes"])
            sc = self.rt.vae.spatial_compression
            grids = token_grid(self.dit.config, sc, old), token_grid(self.dit.config, sc, new)
            for key in [k for k in self.kv if k[0] == sid]:
                self.kv[key] = rescale_kv_cache(self.kv[key], self.dit.config, *grids)
            if sid in self.decoders:
                self.decoders[sid] = rescale_vae_cache(self.decoders[sid], old, new)
        have = sorted(step for s, step in self.kv if s == sid)
        for step in have[steps:]:
            del self.kv[(sid, step)]
        if have:
            for step in range(len(have), steps):
                self.kv[(sid, step)] = self.kv[(sid, step - 1)].to(self.device)

    def _apply_refresh(self, decisions: Sequence[tuple[str, int, int, int]]) -> None:
        for sid, step, worst, newest in decisions:
            cache = self.kv[(sid, step)]
            cache.copy_frame(newest, worst)

    def add_prompt(self, sid: str, version: int, text: Tensor, loras: dict[str, float]) -> None:
        self.text[(sid, version)] = text
        self.text_loras[(sid, version)] = loras
        self.prompts[(sid, version)] = self._prompt_kv((sid, version))

    def _prompt_kv(self, key: tuple[str, int]) -> PromptCache:
        with self.rt.loras.rows([self.text_loras[key]]):
            return self.dit.prompt_kv(self.text[key], self.blocks)

    def forget(self, sid: str, versions: Sequence[int] | None = None) -> None:
        """Drop a stream's prompt versions (all of its state when ``versions`` is None)."""
        for key in [k for k in self.text if k[0] == sid and (versions is None or k[1] in versions)]:
            del self.text[key], self.prompts[key], self.text_loras[key]
        if versions is None:
            for key in [k for k in self.kv if k[0] == sid]:
                del self.kv[key]
            self.decoders.pop(sid, None)

    # -- one micro-step -----------------------------------------------------------------------------

    def compute(self, msg: Message) -> Message:
        """Run this rank's part of a micro-step; returns the message for the next rank (or the return)."""
        meta, ts = msg.meta, msg.tensors
        timing: dict[str, list[float]] = {"total": [], "blocks": []}
        out: dict[str, Tensor] = {}
        with self.clock.measure(timing["total"]):
            for sid, version, loras in meta["prompts"]:
                self.add_prompt(sid, version, ts[f"ctx.{sid}.{version}"], loras)
            for sid, versions in meta["drop_prompts"]:
                self.forget(sid, versions)
            self._apply_refresh(meta["refresh"])
            ret: dict[str, Any] = {"op": "return", "m": meta["m"], "continue": [], "finished": [], "refresh": []}
            for gi, group in enumerate(meta["groups"]):
                self._group(gi, group, ts, out, meta["sink"], ret, timing["blocks"])
        other = timing["total"][0] - sum(timing["blocks"]) + (meta.get("enter_s", 0.0) if self.first else 0.0)
        timings = [*meta["timings"], (self.rank, sum(timing["blocks"]), other)]
        if self.last:
            ret["timings"] = timings
            return Message(ret, out)
        for name, t in ts.items():
            if name.startswith(("ctx.", "noise.", "guide.")):
                out[name] = t
        return Message({**meta, "timings": timings}, out)

    def _group(self, gi: int, group: dict[str, Any], ts: dict[str, Tensor], out: dict[str, Tensor],
               sink: dict[int, list[Any]], ret: dict[str, Any], block_times: list[float]) -> None:
        rows: list[dict[str, Any]] = group["rows"]
        x = ts[f"x.{gi}"]
        with self._precision(group["precision"]), self.rt.loras.rows([r["loras"] for r in rows]):
            if self.first:
                t = torch.tensor([r["t"] for r in rows], dtype=torch.float32, device=self.device)
                tokens, e, e0, grid = self.dit.embed(x, t[:, None].expand(-1, x.shape[2]))
                group["grid"] = grid
            else:
                tokens, e, e0, grid = ts[f"tok.{gi}"], ts[f"e.{gi}"], ts[f"e0.{gi}"], tuple(group["grid"])
            caches = [self.cache_for(r) for r in rows]
            cache = caches[0] if len(rows) == 1 else KVCache.concat(caches)
            prompts = [self.prompts[(r["sid"], r["ver"])] for r in rows]
            prompt = prompts[0] if len(rows) == 1 else PromptCache.concat(prompts)
            with self.clock.measure(block_times):
                tokens = self.dit.run_blocks(tokens, e0, grid, prompt, self.blocks, cache,
                                             start_frame=[r["frame"] for r in rows], rope_start=[r["rope"] for r in rows],
                                             sparsity=group["sparsity"],
                                             sparse_block_tokens=self.rt.config.sparse_block_tokens)
            if len(rows) > 1:
                for r, part in zip(rows, cache.split(), strict=True):
                    self.kv[(r["sid"], r["step"])] = part
            for r in rows:
                if r["tau"] is not None:
                    self._sink_partials(r, x.shape[2], sink)
            if self.last:
                v = self.dit.head_out(tokens, e, grid)
                self._tail(rows, x, v, ts, out, sink, ret, group["precision"])
            else:
                out.update({f"tok.{gi}": tokens, f"e.{gi}": e, f"e0.{gi}": e0, f"x.{gi}": x})

    def _tail(self, rows: list[dict[str, Any]], x: Tensor, v: Tensor, ts: dict[str, Tensor],
              out: dict[str, Tensor], sink: dict[int, list[Any]], ret: dict[str, Any], precision: str) -> None:
        """Last rank: x̂₀, re-noise the rows that go on, decode the rows that are done, sink decisions."""
        rt = self.rt
        t = torch.tensor([r["t"] for r in rows], dtype=torch.float32, device=self.device)
        sigma = rt.schedule.sigma(t).to(self.device).view(-1, 1, 1, 1, 1)
        x0 = x0_from_velocity(x, v.to(x.dtype), sigma)
        for i, r in enumerate(rows):
            key = r["key"]
            if not r["last"]:
                next_sigma = float(rt.schedule.sigma(r["t_next"]))
                out[f"xn.{key}"] = renoise(x0[i : i + 1], ts[f"noise.{key}"], next_sigma)
                ret["continue"].append(key)
            else:
                decoder = self.decoders.setdefault(r["sid"], rt.vae.new_decoder_cache())
                out[f"frames.{key}"] = rt.decode_latents(x0[i : i + 1], decoder, r["deblock"], ts.get(f"guide.{key}"),
                                                         precision)
                ret["finished"].append(key)
            if key in sink:
                decision = _sink_decision(sink[key], r["tau"])
                if decision is not None:
                    ret["refresh"].append((r["sid"], r["step"], decision, sink[key][3]))

    def _sink_partials(self, row: dict[str, Any], chunk_frames: int, sink: dict[int, list[Any]]) -> None:
        """Add this rank's blocks to the cosine similarities of each sink frame with the newest frame.

        Mirrors :func:`engine.streaming.runtime.refresh_sinks`: the features are the per-frame mean
        keys and values of every block, concatenated; dot products and squared norms add up over ranks.
        """
        cache = self.kv[(row["sid"], row["step"])]
        sinks, newest = cache.sink_frames, cache.local_end - 1
        if sinks == 0 or newest < sinks or cache.local_end < sinks + chunk_frames:
            return  # every rank sees the same fill level, so all of them skip this row
        mean_k, mean_v = cache.frame_means()
        feats = torch.cat([mean_k, mean_v], dim=-1).permute(1, 2, 0, 3, 4).flatten(2).double()[0]  # [frames, D]
        new = feats[newest]
        dots = (feats[:sinks] @ new).tolist()
        norms = feats[:sinks].pow(2).sum(-1).tolist()
        acc = sink.setdefault(row["key"], [[0.0] * sinks, [0.0] * sinks, 0.0, newest])
        acc[0] = [a + b for a, b in zip(acc[0], dots, strict=True)]
        acc[1] = [a + b for a, b in zip(acc[1], norms, strict=True)]
        acc[2] += float(new.pow(2).sum())

    @contextlib.contextmanager
    def _precision(self, precision: str) -> Iterator[None]:
        with self.rt.precision(precision):
            yield

    # -- moving blocks ------------------------------------------------------------------------------

    def rebalance(self, new_ranges: Sequence[range], channel: Channel) -> None:
        """Swap to ``new_ranges``: blocks that change owner travel with their KV caches (and weights)."""
        new = check_ranges(new_ranges, len(self.dit.blocks))
        old, me = self.ranges, self.rank
        for q in range(self.world):
            outgoing = [b for b in old[me] if b in new[q]] if q != me else []
            if outgoing:
                channel.send(q, self._pack_blocks(outgoing))
        received: dict[int, tuple[dict[tuple[str, int], dict[str, Tensor]], dict[str, Tensor]]] = {}
        for q in range(self.world):
            if q != me and any(b in new[me] for b in old[q]):
                received.update(self._unpack_blocks(channel.recv(q)))
        channel.flush()
        mine = {b: j for j, b in enumerate(old[me])}

        def moved(key: tuple[str, int], name: str, layers: list[Tensor]) -> list[Tensor]:
            return [layers[mine[b]] if b in mine else received[b][0][key][name] for b in new[me]] if layers else []

        for key, cache in list(self.kv.items()):
            # Keys, values and, in fp8, their scales: each block's tensors of every list travel together.
            self.kv[key] = dataclasses.replace(cache, k=moved(key, "k", cache.k), v=moved(key, "v", cache.v),
                                               k_scale=moved(key, "k_scale", cache.k_scale),
                                               v_scale=moved(key, "v_scale", cache.v_scale))
        for b, (_, weights) in received.items():
            if not weights:  # weights="all": the rank has the block's weights already
                continue
            block = self.dit.blocks[b]
            block.to_empty(device=self.device)
            block.load_state_dict(weights, strict=True)
        if self.weights == "own":
            for b in old[me]:
                if b not in new[me]:
                    self.dit.blocks[b].to_empty(device="meta")
        self.ranges = new
        for key in self.text:
            self.prompts[key] = self._prompt_kv(key)

    def _pack_blocks(self, blocks: list[int]) -> Message:
        mine = {b: j for j, b in enumerate(self.blocks)}
        tensors: dict[str, Tensor] = {}
        keys = list(self.kv)
        for b in blocks:
            for n, key in enumerate(keys):
                for name, layers in self.kv[key].buffer_lists().items():
                    if layers:
                        tensors[f"{name}.{b}.{n}"] = layers[mine[b]]
            if self.weights == "own":
                for name, w in self.dit.blocks[b].state_dict().items():
                    tensors[f"w.{b}.{name}"] = w
        fills = [(self.kv[k].local_end, self.kv[k].global_end) for k in keys]
        return Message({"op": "blocks", "blocks": blocks, "keys": keys, "fills": fills}, tensors)

    def _unpack_blocks(self, msg: Message) -> dict[int, tuple[dict[tuple[str, int], dict[str, Tensor]], dict[str, Tensor]]]:
        meta, ts = msg.meta, msg.tensors
        keys = [tuple(k) for k in meta["keys"]]
        if set(keys) != set(self.kv):
            raise RuntimeError(f"rank {self.rank}: block transfer carries caches {sorted(keys)}, this rank has {sorted(self.kv)}")
        for key, (local_end, global_end) in zip(keys, meta["fills"], strict=True):
            cache = self.kv[key]
            if (cache.local_end, cache.global_end) != (local_end, list(global_end)):
                raise RuntimeError(f"rank {self.rank}: cache {key} fill level differs between ranks")
        out = {}
        for b in meta["blocks"]:
            kv = {key: {name: ts[f"{name}.{b}.{n}"] for name, layers in self.kv[key].buffer_lists().items() if layers}
                  for n, key in enumerate(keys)}
            prefix = f"w.{b}."
            weights = {name[len(prefix):]: t for name, t in ts.items() if name.startswith(prefix)}
            out[b] = (kv, weights)
        return out


def _sink_decision(acc: list[Any], tau: float) -> int | None:
    """The sink frame to replace (least similar, if below ``tau``) from summed dot products and norms."""
    dots, norms, new_norm, _ = acc
    eps = 1e-8  # torch.nn.functional.cosine_similarity's default
    sims = [d / math.sqrt(max(n * new_norm, eps * eps)) for d, n in zip(dots, norms, strict=True)]
    worst = min(range(len(sims)), key=lambda j: sims[j])
    return worst if sims[worst] < tau else None


class StageWorker:
    """Ranks 1..N-1: receive a micro-step from the previous rank, run the blocks, pass it on."""

    def __init__(self, runtime: StreamRuntime, channel: Channel, rank: int, world: int, ranges: Sequence[range],
                 weights: WeightsMode = "all") -> None:
        self.stage = Stage(runtime, rank, world, ranges, weights)
        self.channel = channel
        self.rank, self.world = rank, world

    def serve(self) -> None:
        prev, nxt = self.rank - 1, (self.rank + 1) % self.world
        while True:
            msg = self.channel.recv(prev)
            op = msg.meta["op"]
            if op == "step":
                self.channel.send(nxt, self.stage.compute(msg))
                continue
            if self.rank + 1 < self.world:
                self.channel.send(self.rank + 1, msg)  # control messages travel down the chain
            if op == "rebalance":
                self.stage.rebalance([range(a, b) for a, b in msg.meta["ranges"]], self.channel)
            elif op == "forget":
                self.stage.forget(msg.meta["sid"])
            elif op == "fit":
                self.stage.fit(msg.meta)
            elif op == "stop":
                break
            else:
                raise RuntimeError(f"rank {self.rank}: unknown message {op!r}")
        self.channel.flush()
