"""Checks on incoming SDP offers, so bad input gets a 400 that says exactly what is wrong.

aiortc's SDP parser assumes well-formed input: a malformed line raises whatever Python raises
there (KeyError, IndexError, AssertionError, StopIteration, AttributeError), and structural
problems (two sections under one mid, a section without a=setup, no codec it can receive) fail
later inside ``setRemoteDescription`` with AttributeError or OperationError. So every line aiortc
reads is checked here first, in the form aiortc reads it, and so is the structure the gateway and
aiortc rely on; each refusal names the line or section and what is wrong, in plain words.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from aiortc.codecs import CODECS
from aiortc.sdp import DIRECTIONS, DTLS_SETUP_ROLE, FMTP_INT_PARAMETERS, SessionDescription

log = logging.getLogger(__name__)

# A browser's or OBS's offer is 2-10 KB; more is not an offer we want to parse.
MAX_SDP_BYTES = 32768
SENDING = {"sendrecv", "sendonly"}
RECEIVING = {"sendrecv", "recvonly"}
# The gateway takes one video track, optionally audio (OBS sends Opus; it is drained) and a data
# channel for control messages; aiortc answers any other kind as if it were a data channel.
KINDS = ("video", "audio", "application")
# The DTLS fingerprint hashes aiortc can verify (aiortc.rtcdtlstransport.X509_DIGEST_ALGORITHMS).
FINGERPRINT_HASHES = {"sha-256", "sha-384", "sha-512"}
# (codec name, clock rate) aiortc can receive, per kind: VP8 and H264 video; Opus, G722, PCMU, PCMA.
RECEIVABLE = {
    kind: {(c.mimeType.split("/", 1)[1].lower(), c.clockRate) for c in CODECS[kind] if not c.mimeType.endswith("/rtx")}
    for kind in ("audio", "video")
}
FORBIDDEN_PAYLOAD_TYPES = range(72, 77)  # they collide with RTCP packet types (RFC 5761)
CONNECTION = re.compile(r"^IN (IP4|IP6) ([^ ]+)$")  # aiortc's c= pattern, on the text after "c="
MEDIA_LINE = re.compile(r"^m=([^ ]+) ([0-9]+) ([A-Z/]+) (.+)$")  # aiortc's m= pattern
SHOWN_CHARS = 60


class OfferError(ValueError):
    """The SDP offer cannot be used; the message is the reason given to the client."""


@dataclass
class Section:
    """The session part (kind None) or one m= section, with its a= lines as (line number, name, value)."""

    kind: str | None
    number: int  # line number of its m= line (0 for the session part)
    fmt: list[str] = field(default_factory=list)
    profile: str = ""
    attributes: list[tuple[int, str, str | None]] = field(default_factory=list)

    def values(self, name: str) -> list[str | None]:
        return [value for _, attr, value in self.attributes if attr == name]

    def has(self, name: str) -> bool:
        return any(attr == name for _, attr, _ in self.attributes)

    @property
    def label(self) -> str:
        return f"the m={self.kind} section (line {self.number})"


def _int(text: str | None, low: int, high: int) -> bool:
    """Whether ``text`` is what aiortc's ``int()`` reads as a number, and within [low, high]."""
    try:
        return text is not None and low <= int(text) <= high
    except ValueError:
        return False


def _candidate(value: str) -> str | None:
    bits = value.split()
    if len(bits) < 8 or bits[6] != "typ":
        return "a candidate is '<foundation> <component> <transport> <priority> <address> <port> typ <type> ...'"
    if not (_int(bits[1], 1, 256) and _int(bits[3], 0, 2**32 - 1) and _int(bits[5], 0, 65535)):
        return "the component, priority and port of a candidate must be numbers in range"
    for i in range(8, len(bits) - 1, 2):
        if bits[i] == "rport" and not _int(bits[i + 1], 0, 65535):
            return "rport must be a port number"
    return None


def _extmap(value: str) -> str | None:
    bits = value.split()
    ext_id = bits[0].split("/") if len(bits) == 2 else []
    if len(ext_id) not in (1, 2) or not _int(ext_id[0], 1, 255):
        return "a=extmap is '<id 1-255>[/<direction>] <uri>'"
    return None


def _rtcp(value: str) -> str | None:
    port, space, address = value.partition(" ")
    if not _int(port, 0, 65535) or (space and not CONNECTION.match(address)):
        return "a=rtcp is '<port>[ IN IP4|IP6 <address>]'"
    return None


def _number(low: int, high: int, what: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        return None if _int(value, low, high) else f"must be {what} ({low}-{high})"

    return check


def _pair(what: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        first, space, rest = value.partition(" ")
        return None if space and rest and _int(first, 0, 2**32 - 1) else f"is '{what}'"

    return check


def _ssrc(value: str) -> str | None:
    ssrc, _, desc = value.partition(" ")
    if not _int(ssrc, 0, 2**32 - 1) or ":" not in desc:
        return "a=ssrc is '<ssrc> <attribute>:<value>'"
    return None


def _ssrc_group(value: str) -> str | None:
    bits = value.split()
    return None if bits and all(_int(b, 0, 2**32 - 1) for b in bits[1:]) else "a=ssrc-group is '<semantics> <ssrc> ...'"


def _fmtp(value: str) -> str | None:
    pt, space, params = value.partition(" ")
    if not space or not _int(pt, 0, 127):
        return "a=fmtp is '<payload type> <parameters>'"
    for param in params.split(";"):
        key, equals, setting = param.partition("=")
        if equals and key in FMTP_INT_PARAMETERS and not _int(setting, 0, 2**32 - 1):
            return f"the fmtp parameter {key} must be a number"
        if equals and key == "profile-level-id" and not re.fullmatch(r"[0-9a-fA-F]{6}", setting):
            return "profile-level-id must be 6 hexadecimal digits"
    return None


def _rtpmap(value: str) -> str | None:
    pt, space, desc = value.partition(" ")
    bits = desc.split("/")
    if not space or not _int(pt, 0, 127) or len(bits) < 2 or len(bits) > 3:
        return "a=rtpmap is '<payload type 0-127> <codec>/<clock rate>[/<channels>]'"
    if not _int(bits[1], 1, 2**32 - 1) or (len(bits) == 3 and not _int(bits[2], 1, 255)):
        return "the clock rate and channels of a=rtpmap must be positive numbers"
    return None


def _rtcp_fb(value: str) -> str | None:
    return None if len(value.split(" ", 2)) >= 2 else "a=rtcp-fb is '<payload type or *> <feedback type>'"


def _fingerprint(value: str) -> str | None:
    bits = value.split()
    return None if len(bits) == 2 and bits[0] else "a=fingerprint is '<hash function> <fingerprint>'"


def _setup(value: str) -> str | None:
    return None if value in DTLS_SETUP_ROLE else f"a=setup must be one of {', '.join(DTLS_SETUP_ROLE)}"


def _any(value: str) -> str | None:
    return None


# What aiortc reads from each attribute's value, and the check that it can (None: any text).
ATTRIBUTE_CHECKS: dict[str, Callable[[str], str | None]] = {
    "fingerprint": _fingerprint,
    "setup": _setup,
    "group": _any,
    "msid-semantic": _any,
    "candidate": _candidate,
    "extmap": _extmap,
    "max-message-size": _number(0, 2**32 - 1, "a number of bytes"),
    "rtcp": _rtcp,
    "rtpmap": _rtpmap,
    "sctpmap": _pair("<port> <description>"),
    "sctp-port": _number(0, 65535, "a port number"),
    "ssrc-group": _ssrc_group,
    "ssrc": _ssrc,
    "fmtp": _fmtp,
    "rtcp-fb": _rtcp_fb,
    "mid": lambda value: None if value.strip() else "a=mid must name the section",
}


def _shown(line: str) -> str:
    return line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS] + "..."


def _sections(lines: list[str]) -> list[Section]:
    """The session part and the m= sections; OfferError naming the first malformed line."""
    sections = [Section(None, 0)]
    for number, line in enumerate(lines, 1):
        reason = None
        if not line.strip():
            continue
        if not re.match(r"[a-z]=", line):
            reason = "an SDP line is '<letter>=<value>'"
        elif line.startswith("m="):
            match = MEDIA_LINE.match(line)
            if match is None:
                reason = "an m= line is 'm=<media> <port> <protocol> <formats>'"
            else:
                kind, port, profile, fmt = match.groups()
                sections.append(Section(kind, number, fmt.split(), profile))
                if not _int(port, 0, 65535):
                    reason = "the port must be 0-65535"
                elif kind in ("audio", "video") and not all(
                    _int(pt, 0, 127) and int(pt) not in FORBIDDEN_PAYLOAD_TYPES for pt in fmt.split()
                ):
                    reason = "the formats of an audio or video section are RTP payload types 0-127 (not 72-76)"
        elif line.startswith("c=") and not CONNECTION.match(line[2:]):
            reason = "a c= line is 'c=IN IP4|IP6 <address>'"
        elif line.startswith("v=") and not _int(line.strip()[2:], 0, 0):
            reason = "the SDP version is 0"
        elif line.startswith("a="):
            name, colon, value = line[2:].partition(":")
            check = ATTRIBUTE_CHECKS.get(name)
            if check is not None:
                reason = check(value) if colon else f"a={name} needs a value (a={name}:<value>)"
            sections[-1].attributes.append((number, name, value if colon else None))
        if reason is not None:
            raise OfferError(f"malformed SDP: line {number} ({_shown(line)!r}): {reason}")
    return sections


def _check_structure(session: Section, media: list[Section]) -> None:
    """What aiortc and the gateway assume of the sections as a whole."""
    for kind in KINDS:
        count = sum(1 for m in media if m.kind == kind)
        if count > 1:
            raise OfferError(f"the offer has {count} m={kind} sections; the server takes at most one of each kind")
    other = next((m for m in media if m.kind not in KINDS), None)
    if other is not None:
        raise OfferError(f"{other.label} is of a kind the server does not take (it takes video, audio and a data channel)")
    mids: dict[str, Section] = {}
    for m in media:
        mid = (m.values("mid") or [None])[-1]  # aiortc keeps the last
        if mid is None:
            raise OfferError(f"{m.label} has no a=mid")
        if mid in mids:
            raise OfferError(f"{m.label} has the same a=mid:{mid} as {mids[mid].label}; each section needs its own mid")
        mids[mid] = m
    for group in session.values("group"):
        semantics, *items = (group or "").split() or [""]
        unknown = [item for item in items if item not in mids]
        if semantics == "BUNDLE" and unknown:
            raise OfferError(f"a=group:BUNDLE names mid {unknown[0]}, which no section has")
    for m in media:
        _check_transport(session, m)
        payload_types = {int((value or "").partition(" ")[0]) for value in m.values("rtpmap")}
        for number, name, value in m.attributes:
            if name == "fmtp" and int((value or "").partition(" ")[0]) not in payload_types:
                raise OfferError(f"malformed SDP: line {number}: a=fmtp for a payload type without an a=rtpmap")
        if m.kind in ("audio", "video"):
            _check_codecs(m)
        elif m.profile == "DTLS/SCTP" and not (m.fmt and _int(m.fmt[0], 0, 65535)):
            raise OfferError(f"{m.label} (legacy DTLS/SCTP) must give the SCTP port as its format")


def _inherited(session: Section, m: Section, name: str) -> list[str | None]:
    return m.values(name) or session.values(name)


def _check_transport(session: Section, m: Section) -> None:
    if not any(_inherited(session, m, "ice-ufrag")) or not any(_inherited(session, m, "ice-pwd")):
        raise OfferError(f"malformed SDP: {m.label} has no a=ice-ufrag / a=ice-pwd")
    fingerprints = [(v or "").split()[0].lower() for v in m.values("fingerprint") + session.values("fingerprint")]
    if not fingerprints:
        raise OfferError(f"malformed SDP: {m.label} has no a=fingerprint")
    if not FINGERPRINT_HASHES.intersection(fingerprints):
        raise OfferError(f"{m.label} has no a=fingerprint the server can check "
                         f"(it checks {', '.join(sorted(FINGERPRINT_HASHES))})")
    if not _inherited(session, m, "setup"):
        raise OfferError(f"malformed SDP: {m.label} has no a=setup (DTLS role)")
    if m.kind in ("audio", "video") and not m.has("rtcp-mux"):
        raise OfferError(f"{m.label} has no a=rtcp-mux; the server needs RTP and RTCP on one port")
    if m.kind in ("audio", "video") and not any(m.has(d) for d in DIRECTIONS):
        raise OfferError(f"{m.label} has no direction (a=sendrecv, a=sendonly, a=recvonly or a=inactive)")


def _check_codecs(m: Section) -> None:
    receivable = RECEIVABLE[str(m.kind)]
    offered = set()
    for value in m.values("rtpmap"):
        name, clock = (value or "").partition(" ")[2].split("/")[:2]
        offered.add((name.lower(), int(clock)))
    if not offered & receivable:
        accepted = ", ".join(sorted(f"{name.upper()}/{clock}" for name, clock in receivable))
        raise OfferError(f"{m.label} offers no codec the server can receive (it receives {accepted})"
                         + ("; leave audio out if it cannot be sent in one of these" if m.kind == "audio" else ""))


def check_offer(sdp: str, *, publish: bool) -> None:
    """An offer aiortc can parse and apply: a publisher's must send video; a viewer's (WHEP)
    must receive video."""
    if not sdp.strip():
        raise OfferError("empty SDP offer")
    size = len(sdp.encode("utf-8", "replace"))
    if size > MAX_SDP_BYTES:
        raise OfferError(f"SDP offer of {size} bytes is over the limit of {MAX_SDP_BYTES} bytes")
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError("malformed SDP: an SDP offer starts with 'v=0'")
    session, *media = _sections(sdp.splitlines())  # aiortc splits lines the same way
    video = [m for m in media if m.kind == "video"]
    if not video:
        raise OfferError("the offer has no video track (no m=video section)")
    _check_structure(session, media)
    try:
        description = SessionDescription.parse(sdp)
    except Exception:  # every line aiortc reads was checked above: a case the checks miss
        log.warning("aiortc could not parse an offer that passed the SDP checks", exc_info=True)
        raise OfferError("malformed SDP: the offer cannot be parsed") from None
    directions = [str(m.direction) for m in description.media if m.kind == "video"]
    wanted = SENDING if publish else RECEIVING
    if not any(direction in wanted for direction in directions):
        role = "send" if publish else "receive"
        raise OfferError(f"the offer's video does not {role} (direction {', '.join(directions)})")
