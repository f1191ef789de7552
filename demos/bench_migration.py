"""Migration cost on a local Ray cluster: state bytes, transfer time and the stream's residual wait.

Two worker actors (one torch thread each) serve one live stream; the stream is moved back and forth
between them at chunk boundaries through the Ray object store (engine.cluster). Per move it reports:

  state      bytes of the serialised StreamState (KV caches, sinks, VAE caches, noise, prompt cache)
  export     source actor: serialise the state            import  destination: deserialise + install
  transfer   object-store put/get and actor calls (hold - export - import)
  hold       the stream could not run: chunk boundary -> installed on the new worker
  residual   how much later the stream's next chunk finished than an unmoved chunk would have:
             hold + (first chunk on the new worker - median chunk time)

for the tiny test model and a larger random-weight config (dim 512, 12 layers, 256x256 frames),
beside SlackServe's Table 5 (GPU-to-GPU, layer-streamed: 31.8 ms average transfer, 4.4 ms residual).

    .venv/bin/python demos/bench_migration.py                  # both configs, 8 moves each
    .venv/bin/python demos/bench_migration.py --configs tiny --moves 20 --json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.cluster.controller import ClusterConfig, ClusterController, connect  # noqa: E402
from engine.models.tiny_vae import TinyVAE, TinyVAEConfig  # noqa: E402
from engine.models.wan_dit import CausalWanDiT, WanDiTConfig  # noqa: E402
from engine.pipeline import StreamParams  # noqa: E402

SLACKSERVE_TRANSFER_MS = 31.8  # SlackServe Table 5 (appendix D): average state transfer
SLACKSERVE_RESIDUAL_MS = 4.4  # ... and the part of it on the stream's critical path

LARGER_DIT = WanDiTConfig(dim=512, ffn_dim=2048, num_heads=8, num_layers=12, text_dim=384, text_len=32, freq_dim=64)
LARGER_SIZE = (256, 256)


@dataclass
class Result:
    config: str
    moves: int
    state_mb: float
    chunk_ms: float  # median chunk time without a move
    export_ms: float
    import_ms: float
    transfer_ms: float
    hold_ms: float
    residual_ms: float


def write_larger_model(root: Path) -> Path:
    """A random-weight model in the diffcast file format (what `Pipeline.load(path)` reads)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    dit = CausalWanDiT(LARGER_DIT)
    vae_cfg = TinyVAEConfig(latent_channels=LARGER_DIT.in_channels)
    vae = TinyVAE(vae_cfg)
    tensors = {f"dit.{k}": v.contiguous() for k, v in dit.state_dict().items()}
    tensors |= {f"vae.{k}": v.contiguous() for k, v in vae.state_dict().items()}
    path = root / "larger.safetensors"
    save_file(tensors, str(path))
    config = {"dit": asdict(LARGER_DIT), "vae": vae_cfg.to_dict(), "size": list(LARGER_SIZE), "text_encoder": "minilm"}
    path.with_suffix(".json").write_text(json.dumps(config))
    return path


def measure(name: str, model: str, size: tuple[int, int], moves: int) -> Result:
    controller = ClusterController.start(ClusterConfig(model=model, workers=2, threads_per_worker=1))
    try:
        rng = np.random.default_rng(0)
        width, height = size

        def chunk(n: int = 4) -> np.ndarray:
            return rng.integers(0, 256, (n, height, width, 3), dtype=np.uint8)

        controller.open(1, StreamParams(prompt="oil painting", seed=0), worker_id=0)
        controller.process(1, chunk(1))
        plain: list[float] = []
        after: list[float] = []
        stats = []
        for _ in range(2):  # warm both ends' kernels before timing
            t0 = time.perf_counter()
            controller.process(1, chunk())
            plain.append(time.perf_counter() - t0)
        for _ in tqdm(range(moves), desc=f"{name}: moves", unit="move"):
            stats.append(controller.migrate(1, dst=1 - controller.placement()[1]))
            t0 = time.perf_counter()
            controller.process(1, chunk())
            after.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            controller.process(1, chunk())
            plain.append(time.perf_counter() - t0)
        base = statistics.median(plain)
        mean = statistics.fmean
        return Result(
            config=name,
            moves=moves,
            state_mb=stats[0].nbytes / 1e6,
            chunk_ms=1000 * base,
            export_ms=1000 * mean(s.export_s for s in stats),
            import_ms=1000 * mean(s.import_s for s in stats),
            transfer_ms=1000 * mean(s.transfer_s for s in stats),
            hold_ms=1000 * mean(s.hold_s for s in stats),
            residual_ms=1000 * mean(s.hold_s + max(0.0, a - base) for s, a in zip(stats, after, strict=True)),
        )
    finally:
        controller.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,larger", help="comma-separated: tiny, larger")
    parser.add_argument("--moves", type=int, default=8, help="migrations per config")
    parser.add_argument("--object-store-mb", type=int, default=1024, help="Ray object store size (default 1024)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(names) - {"tiny", "larger"}
    if unknown or not names:
        parser.error(f"--configs takes tiny and/or larger, got {args.configs!r}")
    if args.moves < 1:
        parser.error(f"--moves must be at least 1, got {args.moves}")
    logging.basicConfig(level=logging.WARNING)
    connect(num_cpus=3, object_store_mb=args.object_store_mb)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name == "tiny":
                results.append(measure("tiny", "tiny-random", (128, 128), args.moves))
            else:
                results.append(measure("larger", str(write_larger_model(Path(tmp))), LARGER_SIZE, args.moves))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    print(f"{'config':<12}{'state MB':>10}{'chunk ms':>10}{'export':>9}{'import':>9}{'transfer':>10}{'hold':>8}"
          f"{'residual':>10}")
    for r in results:
        print(f"{r.config:<12}{r.state_mb:>10.2f}{r.chunk_ms:>10.0f}{r.export_ms:>9.1f}{r.import_ms:>9.1f}"
              f"{r.transfer_ms:>10.1f}{r.hold_ms:>8.1f}{r.residual_ms:>10.1f}")
    print(f"{'SlackServe':<12}{'':>10}{'':>10}{'':>9}{'':>9}{SLACKSERVE_TRANSFER_MS:>10.1f}{'':>8}"
          f"{SLACKSERVE_RESIDUAL_MS:>10.1f}   (Table 5: GPU-to-GPU, layer-streamed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
