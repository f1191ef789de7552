"""torch.compile for the DiT's forward and the stream VAE, at the shapes a profile names only.

Opt-in (``diffcast bench engine --compile``, ``diffcast profile --compile``; the server's knob is the
same call). :func:`compile_pipeline` puts a :class:`ShapeGate` in front of each compiled call site (the
DiT's block stack, ``CausalWanDiT._run``; the VAE's encoder and decoder), then warms every named shape up:
it runs chunks at that shape until the KV window rolls, and the gates admit the keys they see from then
on, the steady state's; the compile happens there, and its wall time is the engine's cold start
(``cold_start_s`` in the report). After the warm-up a gate runs a call compiled only when its key was
admitted; any other key (a stream's first chunks while its KV window fills, a size no profile names, a
batch of another size) runs eager, with one log line per new key, so no shape a server meets later
ever triggers a compile in the serving loop (``dynamic=False``: no dynamic-shape graphs either).

Calls that cannot compile run eager whatever their key: bf16 autocast over fp32 weights (the cached bf16
weight copies of engine/models/bf16_weights.py take a lock, which torch.compile cannot trace), fp8
linears (their weight cache likewise), and a DiT with LoRAs loaded (their side path is a forward hook
reading a context variable). On a GPU that leaves the bf16-weights path every benchmark runs.

Compiled code is cached on disk between runs (inductor's FX graph cache, under ``cache_dir``: by default
``$XDG_CACHE_HOME/diffcast/torch-compile``, else ``~/.cache/diffcast/torch-compile``), so the second cold
start skips the code generation; tracing still happens at every start. Untested on CUDA here: the GPU
figures are the GPU check's (demos/gpu_check.py, phase ``compile``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.fidelity import FidelityConfig
from engine.models.fp8 import fp8_linears_active
from engine.models.lora import LoRABank
from engine.models.tiny_vae import TinyVAE
from engine.models.wan_dit import attention_kernel
from engine.models.wan_vae import WanVAE
from engine.profiler import release

log = logging.getLogger(__name__)

DEFAULT_BACKEND = "inductor"


# The models read a few context variables in their forwards (the attention backend, fp8 linears, a LoRA
# forward's rows), and dynamo cannot trace ``ContextVar.get``: a read inside the DiT's block loop made it
# skip the whole block stack and compile each linear apart (25 graphs for the embedded model). Traced
# here, a read is the value at trace time, a constant with no guard: sound because a gate's key holds
# every such value a compiled call depends on (the attention kernel), or sends the call eager (fp8
# linears, LoRAs). Only dynamo's tracing sees this; every eager read is the context variable's own.
@torch.compiler.assume_constant_result
def _context_value(var: contextvars.ContextVar[Any]) -> Any:
    return var.get()


@torch._dynamo.decorators.substitute_in_graph(contextvars.ContextVar.get, skip_signature_check=True)
def _traced_get(self: contextvars.ContextVar[Any], *default: Any) -> Any:
    return _context_value(self)

WARMUP_PROMPT = "oil painting"


def default_cache_dir() -> Path:
    """Where compiled code is kept between runs: ``$XDG_CACHE_HOME/diffcast/torch-compile``, else
    ``~/.cache/diffcast/torch-compile``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "diffcast" / "torch-compile"


@dataclass(frozen=True)
class CompileShape:
    """One shape the engine runs compiled: ``batch`` streams at engine size ``size`` (pixels, on the model's
    grid), ``precision``, KV window ``window`` (None: the runtime's), attention ``sparsity``. ``steps`` is
    the step count the warm-up runs (every step of a chunk runs the same forward shape)."""

    size: tuple[int, int]
    steps: int = 1
    batch: int = 1
    precision: str = "fp32"
    window: int | None = None
    sparsity: float = 0.0

    def label(self) -> str:
        window = "" if self.window is None else f" window {self.window}"
        sparse = f" sparsity {self.sparsity:g}" if self.sparsity else ""
        return f"{self.size[0]}x{self.size[1]} x{self.batch} {self.precision}{window}{sparse}"

    def warmed_by(self) -> CompileShape:
        """The shape whose warm-up compiles this one's graphs: the same with one step."""
        return replace(self, steps=1)


def config_shapes(runtime: Any, size: tuple[int, int], configs: Iterable[FidelityConfig],
                  batches: Iterable[int] = (1,)) -> list[CompileShape]:
    """The shapes fidelity configs run at for streams of ``size``: each config's engine size, precision,
    window and sparsity, for every batch size in ``batches``; step-batch configs are left out (they run
    eager)."""
    shapes: list[CompileShape] = []
    for config in configs:
        if config.step_batch:
            continue
        engine_size = runtime.engine_size(size, config)
        for batch in batches:
            shape = CompileShape(engine_size, config.steps, batch, config.precision, config.kv_window_frames,
                                 config.attention_sparsity)
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def signature(value: Any) -> Hashable:
    """What a call site's compiled graph depends on: tensors' shape, dtype, strides and device; dicts
    and sequences by content; plain values as they are; any other object by its type only (a gated
    call's own key function names what it reads of such an object)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.stride(), value.device)
    if isinstance(value, dict):
        return ("dict", tuple((k, signature(v)) for k, v in sorted(value.items())))
    if isinstance(value, list | tuple):
        return tuple(signature(v) for v in value)
    if value is None or isinstance(value, int | float | str | bool):
        return value
    return type(value).__name__


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    kind = device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


# A key function returns the call's key and, for a call that cannot run compiled, why.
KeyFn = Callable[..., tuple[Hashable, str | None]]


class ShapeGate:
    """``eager`` behind a gate: calls whose key was admitted run ``compiled``, every other call ``eager``.

    ``mode``: "quiet" (warm-up before the steady state: eager, keys noted without a log line), "admit"
    (the steady state of a warm-up: every eligible key is admitted, and compiled on its first call) or
    "serve" (after the warm-up: admitted keys compiled, others eager with one log line per new key)."""

    def __init__(self, name: str, eager: Callable[..., Any], compiled: Callable[..., Any], key: KeyFn) -> None:
        self.name = name
        self.eager = eager
        self.compiled = compiled
        self._key = key
        self.mode = "quiet"
        self.admitted: set[Hashable] = set()
        self._noted: set[Hashable] = set()
        self._lock = threading.Lock()  # the engine's lanes call one runtime's gates from several threads
        self.compiled_calls = 0
        self.eager_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, reason = self._key(*args, **kwargs)
        with self._lock:
            if reason is None and self.mode == "admit":
                self.admitted.add(key)
            run_compiled = reason is None and key in self.admitted
            if run_compiled:
                self.compiled_calls += 1
            else:
                self.eager_calls += 1
                if key not in self._noted:
                    self._noted.add(key)
                    if self.mode == "serve":
                        shapes = ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
                        log.info("%s runs eager at a shape it was not compiled for (%s): input %s, key #%d", self.name,
                                 reason or "no profile names it", shapes, len(self._noted))
        return self.compiled(*args, **kwargs) if run_compiled else self.eager(*args, **kwargs)


@dataclass
class CompileReport:
    """What :func:`compile_pipeline` did: the cold start (the warm-up, compiles included) per shape."""

    backend: str
    cache_dir: str
    sites: list[str] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)  # the torch thread counts compiled for
    cold_start_s: float = 0.0
    shapes: list[dict[str, Any]] = field(default_factory=list)
    graphs: int = 0  # graphs the backend compiled (a graph break makes two of one call)

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "cache_dir": self.cache_dir, "sites": self.sites, "threads": self.threads,
                "cold_start_s": round(self.cold_start_s, 2),
                "graphs": self.graphs, "shapes": self.shapes}


class CompiledRuntime:
    """The gates installed on one runtime's DiT and VAE (:func:`compile_pipeline`); :meth:`remove` puts
    the eager calls back."""

    def __init__(self, backend: str) -> None:
        self.gates: list[ShapeGate] = []
        self._installed: list[tuple[Any, str]] = []  # (object, attribute) each gate shadows
        self.graphs = 0
        inner = torch._dynamo.lookup_backend(backend)

        def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
            self.graphs += 1
            return inner(gm, inputs)

        self._backend = counting

    def gate(self, owner: Any, attribute: str, name: str, key: KeyFn) -> None:
        """Shadow ``owner.attribute`` (a bound method) with a gate over it and its compiled twin."""
        eager = getattr(owner, attribute)
        compiled = torch.compile(eager, backend=self._backend, dynamic=False)
        gate = ShapeGate(name, eager, compiled, key)
        owner.__dict__[attribute] = gate  # an instance attribute: the method's callers find the gate first
        self.gates.append(gate)
        self._installed.append((owner, attribute))

    def set_mode(self, mode: str) -> None:
        for gate in self.gates:
            gate.mode = mode

    def remove(self) -> None:
        for owner, attribute in self._installed:
            del owner.__dict__[attribute]
        self.gates, self._installed = [], []

    def stats(self) -> dict[str, dict[str, int]]:
        return {g.name: {"admitted": len(g.admitted), "compiled_calls": g.compiled_calls,
                         "eager_calls": g.eager_calls} for g in self.gates}


def _dit_key(dit: Any) -> KeyFn:
    """``CausalWanDiT._run``'s key: what its graph reads (tokens, the token grid, the prompt's K/V, the
    KV cache's buffers and the slice this forward writes, the sparse layout, a mask, the attention kernel)
    and the global state dynamo guards a graph on that changes here (autocast, the torch thread count,
    which a CPU lane's thread budget moves: unkeyed, a move recompiled every graph mid-run, a 66 s chunk on
    the 2-core box); not the cache's frame bookkeeping, which changes every chunk outside the graph."""
    bank = LoRABank.of(dit)

    def key(tokens: torch.Tensor, e: torch.Tensor, e0: torch.Tensor, grid: tuple[int, int, int], prompt: Any,
            sa: Any) -> tuple[Hashable, str | None]:
        autocast = _autocast_dtype(tokens.device)
        cache = sa.cache
        k = (signature(tokens), signature(e), signature(e0), grid, signature(prompt.k[0]),
             None if cache is None else signature(cache.k[0]), sa.write, sa.sparse, sa.mask is None, autocast,
             attention_kernel(tokens, sa.mask), torch.get_num_threads())
        return k, _dit_reason(dit, bank, autocast)

    return key


def _dit_reason(dit: Any, bank: LoRABank, autocast: torch.dtype | None) -> str | None:
    if bank.loras:
        return "LoRAs loaded"
    if fp8_linears_active():
        return "fp8 linears"
    if autocast is not None and autocast != dit.dtype:
        return f"{autocast} autocast over {dit.dtype} weights"
    return None


def _vae_key(weights_dtype: torch.dtype) -> KeyFn:
    """A VAE call's key: every argument's :func:`signature`, the autocast state and the thread count."""

    def key(*args: Any, **kwargs: Any) -> tuple[Hashable, str | None]:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        autocast = _autocast_dtype(device)
        k = (signature(args), signature(kwargs), autocast, torch.get_num_threads())
        reason = f"{autocast} autocast over {weights_dtype} weights" if autocast not in (None, weights_dtype) else None
        return k, reason

    return key


SITES = ("dit", "vae.encode", "vae.decode")


def install(runtime: Any, backend: str = DEFAULT_BACKEND, sites: Sequence[str] = SITES) -> CompiledRuntime:
    """Gates on ``runtime``'s call sites named in ``sites`` (of :data:`SITES`: the DiT's block stack, the
    VAE's encoder, its decoder), nothing admitted yet (every call eager until a warm-up)."""
    unknown = set(sites) - set(SITES)
    if unknown:
        raise ValueError(f"no compiled call site {sorted(unknown)}; the sites are {', '.join(SITES)}")
    compiled = CompiledRuntime(backend)
    dit, vae = runtime.dit, runtime.vae
    targets: dict[str, tuple[Any, str, KeyFn]] = {"dit": (dit, "_run", _dit_key(dit))}
    if isinstance(vae, TinyVAE):
        key = _vae_key(next(vae.parameters()).dtype)
        targets.update({"vae.encode": (vae, "encode_groups", key), "vae.decode": (vae, "decode_groups", key)})
    elif isinstance(vae, WanVAE):
        key = _vae_key(next(vae.parameters()).dtype)
        targets.update({"vae.encode": (vae.encoder, "forward", key), "vae.decode": (vae.decoder, "forward", key)})
    else:
        log.info("compile: the %s VAE runs eager (no compiled call site for it)", type(vae).__name__)
    for name in sites:
        if name in targets:
            owner, attribute, site_key = targets[name]
            compiled.gate(owner, attribute, name, site_key)
    return compiled


@contextlib.contextmanager
def _inductor_cache(cache_dir: Path) -> Iterator[None]:
    """Inductor's on-disk caches under ``cache_dir`` for the compiles inside (it reads the variable at every
    lookup); the previous setting back afterwards."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def compile_pipeline(pipe: Any, shapes: Sequence[CompileShape], backend: str = DEFAULT_BACKEND,
                     cache_dir: Path | None = None, sites: Sequence[str] = SITES,
                     threads: Sequence[int] | None = None) -> tuple[CompiledRuntime, CompileReport]:
    """Compile ``pipe``'s runtime at ``shapes`` (the call sites in ``sites``): install the gates, warm each
    shape up (its steady-state keys admitted and compiled), then serve. The report's ``cold_start_s`` is
    the whole warm-up. ``threads``: every torch thread count the engine's steps may run on (a CPU lane's
    thread budget moves between 1 and its threads), each compiled apart, since a compiled graph is
    guarded on the count (dynamo's global state); default the count now."""
    runtime = pipe.runtime
    cache_dir = cache_dir or default_cache_dir()
    counts = list(dict.fromkeys(threads or [torch.get_num_threads()]))
    # One graph per admitted key and call site; dynamo's default of 8 would send a server with more named
    # shapes back to eager for the rest.
    unique = list(dict.fromkeys(s.warmed_by() for s in shapes))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(unique) * len(counts) + 1)
    compiled = install(runtime, backend, sites)
    report = CompileReport(backend, str(cache_dir), sites=list(sites), threads=counts)
    start = time.perf_counter()
    before = torch.get_num_threads()
    try:
        with _inductor_cache(cache_dir):
            for shape in unique:
                report.shapes.append({"shape": shape.label(), **_warm_up(pipe, compiled, shape, counts)})
                log.info("compile: %s warmed up in %.1f s", shape.label(), report.shapes[-1]["warmup_s"])
    except BaseException:
        compiled.remove()
        raise
    finally:
        torch.set_num_threads(before)
    compiled.set_mode("serve")
    report.cold_start_s = time.perf_counter() - start
    report.graphs = compiled.graphs
    log.info("compile: %d shapes x %d thread counts, %d graphs, cold start %.1f s (%s backend, cache %s)",
             len(unique), len(counts), compiled.graphs, report.cold_start_s, backend, cache_dir)
    return compiled, report


def _warm_up(pipe: Any, compiled: CompiledRuntime, shape: CompileShape, threads: Sequence[int]) -> dict[str, Any]:
    """Chunks at ``shape`` until the KV window has filled and rolled (quiet, on the fewest threads: they
    are never slow beside other programs), then at each thread count two more with the gates admitting:
    the first compiles, the second runs what it compiled."""
    runtime = pipe.runtime
    window = shape.window or runtime.config.kv_window_frames
    fidelity = FidelityConfig(steps=shape.steps, kv_window_frames=window, precision=shape.precision,
                              attention_sparsity=shape.sparsity)
    states = [runtime.open(f"compile{i}", WARMUP_PROMPT, shape.size, fidelity, seed=i) for i in range(shape.batch)]
    generator = torch.Generator().manual_seed(0)
    # The first chunk, then enough to fill the window, then the window rolls: the steady state's shapes.
    steady = 1 + math.ceil(window / runtime.config.chunk_latent_frames)
    width, height = shape.size

    def chunk(k: int) -> float:
        frames = pipe.first_chunk_frames if k == 0 else pipe.chunk_frames
        clips = [torch.rand(3, frames, height, width, generator=generator) * 2 - 1 for _ in states]
        t0 = runtime.clock()
        runtime.run_chunks(states, clips)
        return runtime.clock() - t0

    compiled.set_mode("quiet")
    torch.set_num_threads(min(threads))
    start = time.perf_counter()
    eager = [chunk(k) for k in range(steady)]
    compiled.set_mode("admit")
    per_count = {}
    for n in threads:
        torch.set_num_threads(n)
        first, second = chunk(steady), chunk(steady)
        per_count[str(n)] = {"compile_chunk_s": round(first, 2), "compiled_chunk_ms": round(1000 * second, 1)}
    compiled.set_mode("quiet")
    states.clear()  # the warm-up's streams go before the next shape's
    release(runtime.device)
    return {"warmup_s": round(time.perf_counter() - start, 2), "eager_chunk_ms": round(1000 * eager[-1], 1),
            "threads": per_count}
