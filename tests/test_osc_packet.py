"""The OSC packet reader (app/server/control/osc_packet.py): what python-osc writes it reads back; what is
malformed or past a bound it refuses with an OscPacketError that says what, and nothing else."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from _osc_fuzz import OscFuzzer, bundle, raw_message
from hypothesis import given, settings
from hypothesis import strategies as st
from pythonosc.osc_bundle_builder import IMMEDIATELY, OscBundleBuilder
from pythonosc.osc_message_builder import OscMessageBuilder

from app.server.control.osc_packet import (
    MAX_ARGUMENTS,
    MAX_DEPTH,
    MAX_MESSAGES,
    MAX_PACKET_BYTES,
    Message,
    OscPacketError,
    Unsupported,
    read_packet,
)


def built(address: str, *args: tuple[Any, str | None]) -> bytes:
    builder = OscMessageBuilder(address)
    for value, tag in args:
        builder.add_arg(value, tag)
    return bytes(builder.build().dgram)


def nest(packet: bytes, depth: int) -> bytes:
    for _ in range(depth):
        packet = bundle(packet)
    return packet


def test_reads_what_python_osc_writes() -> None:
    message = built("/diffcast/blend", ("sid", None), ("tok", None), ("oil é漢", None), (0.5, "f"), ("neon", None),
                    (0.25, "d"), (2**40, "h"), (-7, "i"), (True, None), (False, None), (b"\x01\x02\x03", "b"),
                    ([1, "x"], None), ((0, 0x90, 64, 127), "m"), (None, "N"), (0, None))
    assert read_packet(message) == [Message("/diffcast/blend", (
        "sid", "tok", "oil é漢", 0.5, "neon", 0.25, 2**40, -7, True, False, Unsupported("b"), Unsupported("["),
        Unsupported("m"), Unsupported("N"), 0))]
    assert Unsupported("[").name == "array"
    inner = OscBundleBuilder(IMMEDIATELY)
    inner.add_content(OscMessageBuilder("/diffcast/pause").build())
    outer = OscBundleBuilder(IMMEDIATELY)
    outer.add_content(OscMessageBuilder("/diffcast/resume").build())
    outer.add_content(inner.build())
    outer.add_content(OscMessageBuilder("/diffcast/reset").build())
    assert [m.address for m in read_packet(bytes(outer.build().dgram))] == \
        ["/diffcast/resume", "/diffcast/pause", "/diffcast/reset"]
    assert read_packet(b"/diffcast/pause\0") == [Message("/diffcast/pause", ())]  # no type tags: OSC 1.0 allows
    assert read_packet(bundle()) == []


@pytest.mark.parametrize(("packet", "reason"), [
    (b"", "neither a message"),
    (b"/a\0", "not a multiple of 4"),
    (b"x" * (MAX_PACKET_BYTES + 4), f"the packet has {MAX_PACKET_BYTES + 4} bytes; the limit is {MAX_PACKET_BYTES}"),
    (b"#bundle\0" + b"\0" * 8 + struct.pack(">i", -4) + b"abcd", "a bundle element claims -4 bytes where 4 are left"),
    (bundle() + struct.pack(">i", 0), "claims 0 bytes"),
    (bundle() + struct.pack(">i", 6) + b"/a\0\0,\0\0\0", "claims 6 bytes"),
    (bundle() + struct.pack(">i", 12) + b"/a\0\0,\0\0\0", "claims 12 bytes where 8 are left"),
    (bundle() + struct.pack(">i", 2**31 - 1) + b"/a\0\0", "claims 2147483647 bytes"),
    (b"#bundle\0\0\0\0\0", "a bundle ends inside its time tag"),
    (bundle(b"abcd"), "neither a message"),
    (nest(b"/a\0\0", MAX_DEPTH + 1), f"bundles are nested more than {MAX_DEPTH} deep"),
    (bundle(*[b"/a\0\0"] * (MAX_MESSAGES + 1)), f"the packet holds more than {MAX_MESSAGES} messages"),
    (b"/a b\0\0\0\0", "the address is not '/' and up to 127 printable ASCII characters"),
    (b"/\xc3\xa9\0", "the address is not"),
    (b"/" + b"a" * 128 + b"\0\0\0", "the address is not"),
    (b"/abc", "the address has no terminating NUL"),
    (b"/a\0\0ss\0\0", "the type tags of /a do not start with ','"),
    (raw_message(b"/a", b"T" * (MAX_ARGUMENTS + 1)), f"/a has {MAX_ARGUMENTS + 1} arguments; the limit is"),
    (raw_message(b"/a", b"s", b"\xff\0\0\0"), "a string of /a is not UTF-8"),
    (raw_message(b"/a", b"s", b"abcd"), "a string of /a has no terminating NUL"),
    (raw_message(b"/a", b"i"), "an argument of /a needs 4 bytes where 0 are left"),
    (raw_message(b"/a", b"d", b"\0" * 4), "needs 8 bytes where 4 are left"),
    (raw_message(b"/a", b"b", struct.pack(">i", -1)), "a blob of /a claims -1 bytes where 0 are left"),
    (raw_message(b"/a", b"b", struct.pack(">i", 5) + b"abcd"), "a blob of /a claims 5 bytes where 4 are left"),
    (raw_message(b"/a", b"x", b"\0" * 4), "/a has an argument of unknown OSC type 'x'"),
    (raw_message(b"/a", b"\xe9"), "unknown OSC type '\\xe9'"),
    (raw_message(b"/a", b"[T"), "the type tags of /a leave an array open"),
    (raw_message(b"/a", b"]"), "close an array that was not opened"),
    (raw_message(b"/a", b"i", b"\0" * 8), "/a has 4 bytes after its last argument"),
])
def test_malformed_packets_are_refused_with_a_reason(packet: bytes, reason: str) -> None:
    with pytest.raises(OscPacketError) as refused:
        read_packet(packet)
    assert reason in str(refused.value)


def test_the_bounds_admit_what_they_name() -> None:
    assert len(read_packet(nest(b"/a\0\0", MAX_DEPTH))) == 1
    assert len(read_packet(bundle(*[b"/a\0\0"] * MAX_MESSAGES))) == MAX_MESSAGES
    assert read_packet(raw_message(b"/a", b"T" * MAX_ARGUMENTS))[0].params == (True,) * MAX_ARGUMENTS
    assert read_packet(b"/" + b"a" * 127 + b"\0" * 4)[0].address == "/" + "a" * 127
    largest = raw_message(b"/a", b"s", b"x" * (MAX_PACKET_BYTES - 9) + b"\0")
    assert len(largest) == MAX_PACKET_BYTES and read_packet(largest)[0].params == ("x" * (MAX_PACKET_BYTES - 9),)
    # An array's elements are read past: the array is one value, whatever it holds.
    nested_array = raw_message(b"/a", b"[[is]b]T", struct.pack(">i", 1), b"x\0\0\0", struct.pack(">i", 0))
    assert read_packet(nested_array)[0].params == (Unsupported("["), True)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.one_of(st.binary(max_size=200),
                 st.binary(max_size=200).map(lambda b: b"/" + b + b"\0" * (-(len(b) + 1) % 4)),
                 st.binary(max_size=200).map(lambda b: bundle() + b + b"\0" * (-len(b) % 4)),
                 st.integers(0, 2**32).map(lambda seed: next(OscFuzzer(seed).packets(1))[1])))
def test_only_packet_errors_come_out(packet: bytes) -> None:
    try:
        messages = read_packet(packet)
    except OscPacketError:
        return
    for message in messages:
        assert message.address.startswith("/")
        assert all(isinstance(v, str | int | float | Unsupported) for v in message.params)
