"""`diffcast serve --gpus N`: the live service with the DiT's blocks split over N pipeline ranks.

The engine side (spawning the ranks, the ring of micro-steps) is `engine.parallel`; this module
starts it with the service as rank 0's program, and the service drives the ring through
`RankFactory` (app/server/serving/engine_bridge.py) while ranks 1..N-1 serve their stages.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from app.server.config import ServerConfig
from app.server.serving.engine_bridge import RankFactory
from engine.parallel.launch import LoadedModel, loaded_pipeline, run_ring
from engine.parallel.ring import RingOptions, RingRuntime

log = logging.getLogger(__name__)

# The block scheduler checks every this many micro-steps (a few seconds of video); a move drains the
# ring once, so checks must be rare enough for that bubble not to matter.
REBALANCE_EVERY = 64


@dataclass(frozen=True)
class ServeProgram:
    """Rank 0's program: the web service on a :class:`RankFactory` until it is stopped (picklable:
    the spawned rank receives it)."""

    config: ServerConfig
    log_level: int = logging.INFO  # the serving process's (`diffcast serve -v`: DEBUG)

    def __call__(self, ring: RingRuntime) -> None:
        # Imported here: every rank unpickles this program, and only rank 0 needs the web stack.
        from app.server.app import serve

        logging.getLogger().setLevel(self.log_level)  # the service logs as in one process (ranks log warnings)
        factory = RankFactory(ring, loaded_pipeline(self.config.model, ring.rt.device))
        try:
            serve(self.config, factory)
        finally:
            # The engine thread may still be running chunks through the ring: the ring's shutdown
            # (run_ring, after this program) must not talk to the ranks at the same time.
            factory.close()


def serve_ranks(config: ServerConfig, ranks: int, threads: int = 1) -> None:
    """Start ``ranks`` pipeline ranks (gloo CPU ranks for ``--device cpu``) and serve from rank 0."""
    device = "cuda" if config.device.startswith("cuda") else "cpu"

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM must stop the ranks too (run_ring stops them on an exception), not orphan them.
    signal.signal(signal.SIGTERM, interrupted)
    try:
        loras = tuple((lora.name, lora.path, lora.strength) for lora in config.loras)
        run_ring(LoadedModel(config.model, loras, config.dtype, config.vae), ServeProgram(config, logging.getLogger().getEffectiveLevel()), ranks,
                 device=device, threads=threads,
                 options=RingOptions(rebalance_every=REBALANCE_EVERY), timeout_s=24 * 3600.0)
    except KeyboardInterrupt as exc:
        log.info("stopped (%s); the pipeline ranks are down", exc)
