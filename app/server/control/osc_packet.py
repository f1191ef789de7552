"""OSC packets read under bounds, before anything else sees them (docs/osc.md#hostile-input).

python-osc's parser is not safe on hostile UDP input, and the server reads packets on its event
loop: a bundle element of negative size made it loop forever (the whole server hung), a string
that is not UTF-8 raised UnicodeDecodeError and 1,200 nested bundles RecursionError instead of its
ParseError, and it logs a root-logger warning for every unknown type tag or element. Checking a
packet means walking every element and argument, since each one's place depends on the sizes of
those before it: that walk is the reading, so this module does both in one pass, with every size
checked against the bytes that are there and every count bounded. Whatever is wrong is an
:class:`OscPacketError` that says what, and nothing else is raised.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

# A control message the stream's size limit admits (max_message_bytes, 4096 bytes of JSON) is
# under 5 KB as OSC; a packet bundles a few. UDP allows 64 KB: reading that much is wasted work.
MAX_PACKET_BYTES = 16384
MAX_DEPTH = 8  # bundles inside bundles; controllers send one level
MAX_MESSAGES = 64  # per packet; the queue of messages waiting to be applied holds 256
MAX_ARGUMENTS = 128  # per message: a blend of 62 prompts, far past any controller's
# An address is ASCII without spaces or control characters (OSC 1.0), and short: an unknown one is
# echoed in the log line and the answer.
ADDRESS = re.compile(rb"/[\x21-\x7e]{0,127}")
BUNDLE = b"#bundle\0"

# Types a control takes, with their data's struct format (T and F carry none).
READ = {"i": ">i", "f": ">f", "h": ">q", "d": ">d"}
# Types no control takes: read past (their size is known), answered with a refusal that names them.
UNSUPPORTED = {"b": "blob", "S": "symbol", "c": "character", "r": "RGBA colour", "m": "MIDI message",
               "t": "time tag", "N": "nil", "I": "impulse", "[": "array"}
WIDTH = {"c": 4, "r": 4, "m": 4, "t": 8, "N": 0, "I": 0, "[": 0}


class OscPacketError(ValueError):
    """A packet that is not well-formed OSC within the bounds above; the text says what is wrong."""


@dataclass(frozen=True)
class Unsupported:
    """An argument of a type no control takes (blob, MIDI, array, ...): its tag, its value unread."""

    tag: str

    @property
    def name(self) -> str:
        return UNSUPPORTED[self.tag]


@dataclass(frozen=True)
class Message:
    """One OSC message: its address and its arguments (str, int, float, bool or Unsupported)."""

    address: str
    params: tuple[object, ...]


def read_packet(data: bytes) -> list[Message]:
    """The messages of a packet (a message, or a bundle of messages and bundles) in order;
    :class:`OscPacketError` when any part of it is malformed or past a bound."""
    if len(data) > MAX_PACKET_BYTES:
        raise OscPacketError(f"the packet has {len(data)} bytes; the limit is {MAX_PACKET_BYTES}")
    if len(data) % 4:
        raise OscPacketError(f"the packet has {len(data)} bytes, not a multiple of 4")
    messages: list[Message] = []
    _element(data, 0, len(data), 0, messages)
    return messages


def _element(data: bytes, start: int, end: int, depth: int, out: list[Message]) -> None:
    """The message or bundle in data[start:end] (both multiples of 4), appended to ``out``."""
    if data.startswith(b"/", start, end):
        if len(out) == MAX_MESSAGES:
            raise OscPacketError(f"the packet holds more than {MAX_MESSAGES} messages")
        out.append(_message(data, start, end))
        return
    if not data.startswith(BUNDLE, start, end):
        raise OscPacketError("an element is neither a message ('/...') nor a bundle ('#bundle')")
    if depth == MAX_DEPTH:
        raise OscPacketError(f"bundles are nested more than {MAX_DEPTH} deep")
    pos = start + len(BUNDLE) + 8  # the time tag is not waited for
    if pos > end:
        raise OscPacketError("a bundle ends inside its time tag")
    while pos < end:
        (size,) = struct.unpack_from(">i", data, pos)  # end - pos is a positive multiple of 4
        pos += 4
        if size <= 0 or size % 4 or size > end - pos:
            raise OscPacketError(f"a bundle element claims {size} bytes where {end - pos} are left "
                                 "(sizes are positive multiples of 4)")
        _element(data, pos, pos + size, depth + 1, out)
        pos += size


def _message(data: bytes, start: int, end: int) -> Message:
    raw, pos = _string(data, start, end, "the address")
    if not ADDRESS.fullmatch(raw):
        raise OscPacketError("the address is not '/' and up to 127 printable ASCII characters")
    address = raw.decode("ascii")
    if pos == end:  # OSC 1.0 lets a message without arguments leave out its type tags
        return Message(address, ())
    tags, pos = _string(data, pos, end, "the type tags")
    if not tags.startswith(b","):
        raise OscPacketError(f"the type tags of {address} do not start with ','")
    if len(tags) - 1 > MAX_ARGUMENTS:
        raise OscPacketError(f"{address} has {len(tags) - 1} arguments; the limit is {MAX_ARGUMENTS}")
    params: list[object] = []
    depth = 0  # inside an array: its elements are read past, the array is one Unsupported value
    for tag in tags[1:].decode("latin-1"):
        if tag == "]":
            depth -= 1
            if depth < 0:
                raise OscPacketError(f"the type tags of {address} close an array that was not opened")
            continue
        value, pos = _argument(tag, data, pos, end, address)
        if depth == 0:
            params.append(value)
        if tag == "[":
            depth += 1
    if depth:
        raise OscPacketError(f"the type tags of {address} leave an array open")
    if pos != end:
        raise OscPacketError(f"{address} has {end - pos} bytes after its last argument")
    return Message(address, tuple(params))


def _argument(tag: str, data: bytes, pos: int, end: int, address: str) -> tuple[object, int]:
    """The value of one argument at ``pos`` and where the next one starts."""
    if tag in READ:
        fmt = READ[tag]
        size = struct.calcsize(fmt)
        _need(size, pos, end, address)
        return struct.unpack_from(fmt, data, pos)[0], pos + size
    if tag in "TF":
        return tag == "T", pos
    if tag == "s":
        raw, pos = _string(data, pos, end, f"a string of {address}")
        try:
            return raw.decode("utf-8"), pos
        except UnicodeDecodeError:
            raise OscPacketError(f"a string of {address} is not UTF-8") from None
    if tag == "S":
        return Unsupported(tag), _string(data, pos, end, f"a symbol of {address}")[1]
    if tag == "b":
        _need(4, pos, end, address)
        (size,) = struct.unpack_from(">i", data, pos)
        padded = -(-size // 4) * 4
        if size < 0 or padded > end - pos - 4:
            raise OscPacketError(f"a blob of {address} claims {size} bytes where {end - pos - 4} are left")
        return Unsupported(tag), pos + 4 + padded
    if tag in WIDTH:
        _need(WIDTH[tag], pos, end, address)
        return Unsupported(tag), pos + WIDTH[tag]
    raise OscPacketError(f"{address} has an argument of unknown OSC type {ascii(tag)}")


def _need(size: int, pos: int, end: int, address: str) -> None:
    if size > end - pos:
        raise OscPacketError(f"an argument of {address} needs {size} bytes where {end - pos} are left")


def _string(data: bytes, pos: int, end: int, what: str) -> tuple[bytes, int]:
    """A NUL-terminated string padded to 4 bytes: its bytes and where the next field starts."""
    nul = data.find(b"\0", pos, end)
    if nul < 0:
        raise OscPacketError(f"{what} has no terminating NUL")
    return data[pos:nul], pos + ((nul - pos) // 4 + 1) * 4
