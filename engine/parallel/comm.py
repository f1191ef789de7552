"""Point-to-point messages between pipeline ranks: a small metadata dict plus named tensors.

A message goes out as three parts on one ordered channel per (sender, receiver) pair: its length,
the pickled metadata (which also lists every tensor's name, shape and dtype), then the tensors.
Sends are asynchronous (``isend``); their buffers stay referenced until the transfer completes.
On CUDA (NCCL) the sends are issued on a separate communication stream, after it has waited for
the compute stream, so the next micro-step's compute overlaps the transfer of the previous one
(StreamDiffusionV2 §4.3 "asynchronous communication overlap"). On CPU (gloo) the same code path
runs without streams.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Message:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Channel:
    """Sends and receives :class:`Message` objects for one rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.comm_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: list[tuple[list[Any], list[torch.Tensor]]] = []

    def send(self, dst: int, message: Message) -> None:
        names = list(message.tensors)
        tensors = [message.tensors[n].contiguous() for n in names]
        specs = [(n, tuple(t.shape), t.dtype) for n, t in zip(names, tensors, strict=True)]
        blob = pickle.dumps((message.meta, specs))
        header = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)
        parts = [header, payload, *tensors]
        if self.comm_stream is not None:
            # The transfer must wait for the kernels that produce the tensors, but compute must not
            # wait for the transfer: the comm stream waits on compute, not the other way round.
            self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.comm_stream):
                works = [dist.isend(t, dst) for t in parts]
            for t in parts:
                t.record_stream(self.comm_stream)
        else:
            works = [dist.isend(t, dst) for t in parts]
        self._pending.append((works, parts))
        self._reap()

    def recv(self, src: int) -> Message:
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(header, src)
        payload = torch.empty(int(header.item()), dtype=torch.uint8, device=self.device)
        dist.recv(payload, src)
        meta, specs = pickle.loads(payload.cpu().numpy().tobytes())
        tensors = {n: torch.empty(shape, dtype=dtype, device=self.device) for n, shape, dtype in specs}
        for t in tensors.values():
            # Blocking receives, in order: gloo and NCCL both match messages of one pair in issue order.
            dist.recv(t, src)
        return Message(meta, tensors)

    def flush(self) -> None:
        """Wait until every send has completed."""
        for works, _ in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()

    def _reap(self) -> None:
        still = []
        for works, parts in self._pending:
            if not all(w.is_completed() for w in works):
                still.append((works, parts))
        self._pending = still
