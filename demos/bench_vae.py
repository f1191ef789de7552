"""The stream VAEs a Wan model can serve with, side by side in one run: the Wan 2.1 VAE, the TAEHV tiny VAE
(engine/models/taehv.py) and Wan's encoder with the tiny decoder (engine/vae_choice.py), at their real
widths with random weights (speed and memory do not depend on the weights' values; quality does, and is
not measured here). Per size: the median and fastest time of a steady-state chunk's encode (4 frames) and
decode (1 latent frame, 4 frames out), each stream's encoder and decoder cache bytes, and the weights' bytes.

    .venv/bin/python demos/bench_vae.py --sizes 128x128,256x256 --threads 2
    .venv/bin/python demos/bench_vae.py --device cuda --dtype bf16 --sizes 832x480
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.commands.arguments import parse_size  # noqa: E402
from engine.devices import resolve_device, resolve_dtype, weight_bytes  # noqa: E402
from engine.models.taehv import TAEHVConfig  # noqa: E402
from engine.models.wan_vae import WanVAEConfig  # noqa: E402
from engine.random_model import build_taehv, build_vae  # noqa: E402
from engine.streaming.state import tensors_in  # noqa: E402
from engine.vae import StreamVAE  # noqa: E402
from engine.vae_choice import SplitVAE  # noqa: E402


def _mb(n: int) -> float:
    return round(n / 2**20, 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(vae: StreamVAE, size: tuple[int, int], chunks: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """A stream's first chunk, one warm chunk, then ``chunks`` timed ones (encode and decode apart)."""
    w, h = size
    g = torch.Generator(device=device).manual_seed(0)
    enc, dec = vae.new_encoder_cache(), vae.new_decoder_cache()
    enc_s, dec_s = [], []
    for k in range(chunks + 2):
        frames = torch.rand(1, 3, 1 if k == 0 else 4, h, w, generator=g, device=device, dtype=dtype) * 2 - 1
        _sync(device)
        t0 = time.perf_counter()
        z = vae.encode_chunk(frames, enc)
        _sync(device)
        t1 = time.perf_counter()
        out = vae.decode_chunk(z, dec)
        _sync(device)
        t2 = time.perf_counter()
        assert out.shape == frames.shape
        if k >= 2:
            enc_s.append(t1 - t0)
            dec_s.append(t2 - t1)
    return {
        "size": f"{w}x{h}",
        "encode_ms": round(statistics.median(enc_s) * 1000, 1),
        "decode_ms": round(statistics.median(dec_s) * 1000, 1),
        # The fastest chunk too: on a shared machine the median carries the neighbours' load.
        "encode_best_ms": round(min(enc_s) * 1000, 1),
        "decode_best_ms": round(min(dec_s) * 1000, 1),
        "encoder_cache_mb": _mb(sum(t.numel() * t.element_size() for t in tensors_in(enc))),
        "decoder_cache_mb": _mb(sum(t.numel() * t.element_size() for t in tensors_in(dec))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="128x128,256x256", help="comma-separated WxH list")
    parser.add_argument("--chunks", type=int, default=3, help="timed chunks per row (after two warm ones)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    wan = build_vae(WanVAEConfig(), device, dtype)
    tiny = build_taehv(TAEHVConfig(), device, dtype)
    vaes: dict[str, StreamVAE] = {"wan": wan, "tiny": tiny, "wan-encoder-tiny-decoder": SplitVAE(wan, tiny)}
    rows = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        for name, vae in vaes.items():
            rows.append({"vae": name, **measure(vae, size, args.chunks, device, dtype)})
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
    report = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "weights_mb": {"wan": _mb(weight_bytes(wan)), "tiny": _mb(weight_bytes(tiny))},
              "weights": "random (speed and memory only)", "results": rows}
    print(json.dumps(report if args.json else {k: v for k, v in report.items() if k != "results"}))


if __name__ == "__main__":
    main()
