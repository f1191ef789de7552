"""Hostile OSC packets, from a seed, for tests/test_osc_fuzz.py and demos/fuzz_edge.py: the server's
control messages mutated byte by byte, bundles with negative, zero, odd and oversized element sizes,
deep nesting, bad UTF-8, huge counts, types no control takes, oversized packets and random bytes.
Some carry the real stream id and owner token, so mutants that still parse reach the stream's checks.

Every reply a packet asks for goes to port 0, the port it was sent from: a mutant must not make the
server answer some other program's port on this machine (a flipped byte of a reply port 0 can still
make a low or a 256-multiple port; valid messages here never carry another).
"""

from __future__ import annotations

import random
import re
import struct
from collections.abc import Callable, Iterator

BUNDLE_HEAD = b"#bundle\0" + b"\0" * 7 + b"\x01"  # time tag 1: "immediately"
SIZES = [-4, -1, -(2**31), 0, 1, 2, 3, 5, 6, 7, 2**31 - 1, 65536]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\x80"]
MAX_UDP_PAYLOAD = 65507  # IPv4: sendto refuses more
INTERESTING_BYTES = [0x00, 0xFF, 0x80, 0x7F, ord("/"), ord("#"), ord(","), ord("["), ord("]"), ord("b"),
                     ord("i"), ord("s")]
# What the server's log says per refusal, and how it counts the refusals it did not log.
REFUSAL_LINE = re.compile(r"OSC packet from .* was dropped|OSC .* refused: |OSC message .* dropped: "
                          r"|OSC message .* could not be handled")
HELD_LINE = re.compile(r"(\d+) more OSC refusals were not logged")


def osc_string(raw: bytes) -> bytes:
    """NUL-terminated and padded to 4 bytes."""
    return raw + b"\0" * (4 - len(raw) % 4)


def encode(address: str, *values: object) -> bytes:
    """An OSC message (str, int, float, bool and bytes values: s, i, f, T/F, b)."""
    tags, payload = b",", b""
    for value in values:
        if isinstance(value, bool):
            tags += b"T" if value else b"F"
        elif isinstance(value, int):
            tags, payload = tags + b"i", payload + struct.pack(">i", value)
        elif isinstance(value, float):
            tags, payload = tags + b"f", payload + struct.pack(">f", value)
        elif isinstance(value, bytes):
            tags, payload = tags + b"b", payload + struct.pack(">i", len(value)) + value + b"\0" * (-len(value) % 4)
        else:
            tags, payload = tags + b"s", payload + osc_string(str(value).encode())
    return osc_string(address.encode()) + osc_string(tags) + payload


def raw_message(address: bytes, tags: bytes, *fields: bytes) -> bytes:
    """An OSC message from its parts as they are: no check, no encoding."""
    return osc_string(address) + osc_string(b"," + tags) + b"".join(fields)


def bundle(*elements: bytes) -> bytes:
    return BUNDLE_HEAD + b"".join(struct.pack(">i", len(e)) + e for e in elements)


def count_refusals(log_lines: list[str]) -> tuple[int, int]:
    """(refusals logged one line each, refusals the budget held back) in a server's log."""
    logged = sum(1 for line in log_lines if REFUSAL_LINE.search(line))
    held = sum(int(m.group(1)) for line in log_lines if (m := HELD_LINE.search(line)))
    return logged, held


class OscFuzzer:
    """``packets(n)`` yields (kind, packet) pairs; the same seed gives the same packets."""

    def __init__(self, seed: int, stream_id: str = "s" * 22, owner_token: str = "t" * 32) -> None:
        self.rng = random.Random(seed)
        self.stream_id, self.owner_token = stream_id, owner_token
        self.kinds: list[Callable[[], bytes]] = [
            self.mutated, self.mutated, self.mutated, self.bundle_sizes, self.deep, self.bad_utf8,
            self.huge_counts, self.unsupported_types, self.oversized, self.random_bytes,
        ]

    def packets(self, count: int) -> Iterator[tuple[str, bytes]]:
        for _ in range(count):
            kind = self.rng.choice(self.kinds)
            yield kind.__name__, kind()[:MAX_UDP_PAYLOAD]

    def _ids(self) -> tuple[str, str]:
        """The real stream and owner half the time, else look-alikes."""
        if self.rng.random() < 0.5:
            return self.stream_id, self.owner_token
        return "".join(self.rng.choice("abcXYZ09-_") for _ in range(22)), "x" * self.rng.choice([0, 1, 32, 300])

    def _id_fields(self) -> tuple[bytes, bytes]:
        sid, token = self._ids()
        return osc_string(sid.encode()), osc_string(token.encode())

    def valid(self) -> bytes:
        """One of the server's control messages, or a bundle of them; none names a reply port."""
        sid, token = self._ids()
        r = self.rng
        messages = [
            encode("/diffcast/prompt", sid, token, r.choice(["ink wash", "charcoal", "", "é漢😀", "x" * 600])),
            encode("/diffcast/blend", sid, token, "oil", r.random(), "neon", r.random()),
            encode("/diffcast/noise", sid, token, r.choice([0.6, 2.0, -1.0, float("nan"), float("inf")])),
            encode("/diffcast/steps", sid, token, r.choice([1, 2, 9, -1, 2**31 - 1])),
            encode("/diffcast/seed", sid, token, r.randrange(-(2**31), 2**31)),
            encode("/diffcast/stabilize", sid, token, r.random() < 0.5),
            encode("/diffcast/record", sid, token, r.random() < 0.5),
            encode(r.choice(["/diffcast/pause", "/diffcast/resume"]), sid, token),
            # Never from the owner: a reset can end a live stream today ("this chunk needs 4 frames, got
            # 1"; over HTTP too, a bug outside OSC, reported in issue 35's round).
            encode("/diffcast/reset", sid if token != self.owner_token else sid + "x", token),
            encode("/diffcast/volume", sid, token, 1),
        ]
        return bundle(*r.sample(messages, r.randint(1, 4))) if r.random() < 0.2 else r.choice(messages)

    def mutated(self) -> bytes:
        data = bytearray(self.valid())
        r = self.rng
        for _ in range(r.randint(1, 4)):
            choice, i = r.random(), r.randrange(len(data) + 1)
            if choice < 0.3 and i < len(data):
                data[i] ^= 1 << r.randrange(8)
            elif choice < 0.5 and i < len(data):
                data[i] = r.choice(INTERESTING_BYTES)
            elif choice < 0.65:
                data[i:i] = bytes(r.randrange(256) for _ in range(r.choice([1, 2, 4, 8])))
            elif choice < 0.75:
                del data[i:i + r.choice([1, 2, 4])]
            elif choice < 0.85:
                del data[i:]
            else:  # an aligned 32-bit field (a size, a count, a value) set to a hostile number
                j = r.randrange(max(1, len(data) // 4)) * 4
                data[j:j + 4] = struct.pack(">i", r.choice(SIZES + [len(data), -len(data)]))
        return bytes(data)

    def bundle_sizes(self) -> bytes:
        """A bundle whose element claims a size it does not have (the issue's hang: -4)."""
        element = self.valid() if self.rng.random() < 0.5 else b"abcd"
        size = self.rng.choice(SIZES + [len(element) + 4, len(element) * 2, len(element) - 4])
        head = BUNDLE_HEAD if self.rng.random() < 0.8 else BUNDLE_HEAD[:8]  # or without its time tag
        return head + struct.pack(">i", size) + element

    def deep(self) -> bytes:
        """Bundles nested 7 to 1,200 deep around a message or a bad size."""
        core = self.valid() if self.rng.random() < 0.7 else struct.pack(">i", -4) + b"abcd"
        packet = core
        for _ in range(self.rng.choice([7, 8, 9, 20, 100, 700, 1200])):
            packet = bundle(packet)
        return packet

    def bad_utf8(self) -> bytes:
        """Bytes that are not UTF-8 in the address, the type tags, the stream id or a prompt."""
        sid, token = self._id_fields()
        bad = self.rng.choice(BAD_UTF8)
        return self.rng.choice([
            raw_message(b"/diffcast/" + bad, b"sss", sid, token, osc_string(b"x")),
            raw_message(b"/diffcast/seed", b"ss" + bad, sid, token, b"\0" * 4),
            raw_message(b"/diffcast/prompt", b"sss", osc_string(bad + b"id"), token, osc_string(b"x")),
            raw_message(b"/diffcast/prompt", b"sss", sid, token, osc_string(b"ink " + bad)),
        ])

    def huge_counts(self) -> bytes:
        r = self.rng
        sid, token = self._id_fields()
        choice = r.randrange(5)
        if choice == 0:  # thousands of type tags, few or no bytes behind them
            tag = r.choice([b"T", b"i", b"N", b"s", b"[", b"]", b"I"])
            return raw_message(b"/diffcast/seed", tag * r.choice([129, 1000, 8000]))
        if choice == 1:  # a bundle of hundreds of messages
            return bundle(*[raw_message(b"/diffcast/pause", b"ss", sid, token)] * r.choice([65, 200, 300]))
        if choice == 2:  # a blob that claims more than the packet, or a negative size
            size = r.choice([2**31 - 1, -1, -(2**31), 65536, 17])
            return raw_message(b"/diffcast/prompt", b"ssb", sid, token, struct.pack(">i", size), b"abcd")
        if choice == 3:  # arrays opened and never closed, or closed too often
            brackets = r.choice([b"[" * 50, b"]", b"[]]", b"[[i]"])
            return raw_message(b"/diffcast/seed", b"ss" + brackets, sid, token, b"\0" * 4)
        pairs = r.choice([63, 64, 100])
        return raw_message(b"/diffcast/blend", b"ss" + b"sf" * pairs, sid, token,
                           (osc_string(b"oil") + struct.pack(">f", 0.5)) * pairs)

    def unsupported_types(self) -> bytes:
        """Types no control takes (a blob, MIDI, an array, nil, a time tag) from the owner; the
        server answers each with a refusal that names the type."""
        sid, token = self._id_fields()
        tag, payload = self.rng.choice([(b"b", struct.pack(">i", 3) + b"abc\0"), (b"m", b"\x00\x90\x40\x7f"),
                                        (b"[sf]", osc_string(b"oil") + struct.pack(">f", 0.5)), (b"N", b""),
                                        (b"t", b"\0" * 8), (b"c", b"\0\0\0A"), (b"r", b"\xff\0\0\xff"),
                                        (b"S", osc_string(b"sym")), (b"I", b"")])
        return raw_message(b"/diffcast/prompt", b"ss" + tag + b"i", sid, token, payload, struct.pack(">i", 0))

    def oversized(self) -> bytes:
        sid, token = self._ids()
        return encode("/diffcast/prompt", sid, token, "x" * self.rng.choice([16400, 30000, 60000]))

    def random_bytes(self) -> bytes:
        r = self.rng
        data = bytes(r.randrange(256) for _ in range(r.choice([0, 1, 3, 4, 16, 64, 500, 1500])))
        prefix = r.choice([b"", b"/", b"/diffcast/prompt\0\0\0\0,", b"#bundle\0", BUNDLE_HEAD])
        packet = prefix + data
        return packet + b"\0" * (-len(packet) % 4) if r.random() < 0.7 else packet
