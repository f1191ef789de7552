"""Parcels: a stream's state parked in host buffers and unparked anywhere, bit-identical, each part where it
must live. The device tests use torch's "meta" device as the other device: a CPU-only machine has no
second real device, and meta, like CUDA, is a device whose tensors OpenCV and torch.Generator refuse."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from _runtime_fixtures import clip, fidelity, tiny_runtime

from engine.sampling import NoiseSource
from engine.streaming.parcel import Parcel, ParcelError, park, unpark
from engine.streaming.stabilizer import StabilizerConfig
from engine.streaming.state import StreamState, tensors_in


def _running_stream() -> tuple[object, StreamState, list[torch.Tensor]]:
    rt = tiny_runtime(stabilizer=StabilizerConfig())
    chunks = clip(6)
    state = rt.open("a", "thermal", (32, 32), fidelity(), seed=5)
    for c in chunks[:3]:
        rt.run_chunk(state, c)
    return rt, state, chunks


def test_unpark_onto_another_device_keeps_host_parts_on_the_host() -> None:
    """The H100 crash: restoring onto a GPU moved the noise generator's state there (torch.load's
    map_location), and with it the stabilizer's history and the motion controller's last frame, which
    OpenCV and the CPU-side controller read. Every other tensor goes to the target device."""
    _, state, _ = _running_stream()
    assert state.stabilizer.prev_in is not None and state.noise_controller.last_frame is not None
    moved = unpark(park(state), "meta")
    assert isinstance(moved, StreamState)
    assert moved.noise.generator.device.type == "cpu"
    assert torch.equal(moved.noise.generator.get_state(), state.noise.generator.get_state())
    host = [moved.stabilizer.prev_in, moved.stabilizer.prev_out, moved.noise_controller.last_frame]
    assert all(t is not None and t.device.type == "cpu" for t in host)
    torch.testing.assert_close(moved.stabilizer.prev_out, state.stabilizer.prev_out, rtol=0, atol=0)
    on_device = [t for t in tensors_in(moved) if not any(t is h for h in host)]
    assert len(on_device) == len(list(tensors_in(state))) - len(host) > 0
    assert all(t.device.type == "meta" for t in on_device)


def test_noise_source_pickles_its_generator_state_as_host_bytes() -> None:
    """Pickled, the generator state is bytes, so no device mapping of the tensors around it can move it
    (torch.load(map_location="meta") took the old tensor form off the host)."""
    source = NoiseSource(11)
    source.randn((3,))
    assert isinstance(source.__getstate__()["rng_state"], bytes)
    moved = torch.load(_saved(source), weights_only=False, map_location="meta")
    torch.testing.assert_close(moved.randn((4,)), source.randn((4,)), rtol=0, atol=0)
    twin = NoiseSource.from_state_dict(source.state_dict())  # the tensor form still restores
    torch.testing.assert_close(twin.randn((4,)), source.randn((4,)), rtol=0, atol=0)


def _saved(obj: object) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


def test_parked_stream_with_chunks_in_flight_goes_on_bit_identical() -> None:
    """A stream parked between two denoising steps (its chunk in flight shares the state object) and its
    twin that never left: the same frames from there on, through a pickle too (Ray's transport)."""
    rt, state, chunks = _running_stream()
    twin = unpark(park(state))
    chunk = rt.enter_chunk(state, chunks[3])
    twin_chunk = rt.enter_chunk(twin, chunks[3])
    rt.denoise_step([chunk])
    rt.denoise_step([twin_chunk])
    parcel = pickle.loads(pickle.dumps(park((twin, [twin_chunk]))))
    back, (back_chunk,) = unpark(parcel)
    assert back_chunk.state is back, "the chunk in flight still points at its stream's state"
    rt.run_to_end([chunk])
    rt.run_to_end([back_chunk])
    torch.testing.assert_close(rt.finish_chunk(back_chunk).frames, rt.finish_chunk(chunk).frames, rtol=0, atol=0)
    for c in chunks[4:]:
        torch.testing.assert_close(rt.run_chunk(back, c).frames, rt.run_chunk(state, c).frames, rtol=0, atol=0)


def test_views_stay_shared_and_a_small_view_copies_only_its_bytes() -> None:
    base = torch.arange(1000, dtype=torch.float32)
    pair = {"a": base[10:20], "b": base[15:40].view(5, 5), "alone": torch.ones(3, dtype=torch.float16)}
    parcel = park(pair)
    assert parcel.nbytes < 0.2 * base.numel() * 4, "copied the whole storage for a small view"
    back = unpark(parcel)
    for key in pair:
        torch.testing.assert_close(back[key], pair[key], rtol=0, atol=0)
    back["a"][5:] = -1.0  # elements 15..19 of the base: the first row of "b"
    assert torch.equal(back["b"][0], torch.full((5,), -1.0)), "views no longer share their storage"
    whole = park({"x": base, "y": base[1:]})
    assert whole.nbytes == base.numel() * 4 and len(whole.buffers) == 1


def test_parcel_counts_the_state_bytes_and_unparks_twice() -> None:
    _, state, _ = _running_stream()
    parcel = park(state)
    assert parcel.nbytes >= state.nbytes() > 0
    assert parcel.nbytes < 1.1 * state.nbytes() + 4096
    first, second = unpark(parcel), unpark(parcel)
    first.kv[0].k[0].fill_(0.0)
    assert second.kv[0].k[0].abs().sum() > 0, "two unparks share memory"


def test_bad_parcels_are_refused_in_plain_words() -> None:
    with pytest.raises(ParcelError, match="expected a Parcel"):
        unpark(b"not a parcel")  # type: ignore[arg-type]
    good = park({"x": torch.ones(2)})
    with pytest.raises(ParcelError, match="cannot unpark"):
        unpark(Parcel(good.skeleton[:-3], good.records, good.buffers))
    with pytest.raises(ParcelError, match="names tensor"):
        unpark(Parcel(good.skeleton, [], good.buffers))
