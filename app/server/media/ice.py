"""ICE configuration: no public STUN by default, configurable STUN/TURN, optional loopback candidates."""

from __future__ import annotations

import logging
from collections.abc import Callable

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer

from app.server.config import ServerConfig

log = logging.getLogger(__name__)

_original_host_addresses: Callable[[bool, bool], list[str]] | None = None


def rtc_configuration(config: ServerConfig) -> RTCConfiguration:
    """aiortc's default is a public STUN server, which delays every answer by seconds offline."""
    servers = [
        RTCIceServer(urls=url, username=config.ice_username, credential=config.ice_credential)
        for url in config.ice_servers
    ]
    return RTCConfiguration(iceServers=servers)


def browser_ice_servers(config: ServerConfig) -> list[dict[str, object]]:
    """The same servers in the shape of the browser's RTCConfiguration.iceServers."""
    servers: list[dict[str, object]] = []
    for url in config.ice_servers:
        entry: dict[str, object] = {"urls": url}
        if config.ice_username is not None:
            entry["username"] = config.ice_username
            entry["credential"] = config.ice_credential or ""
        servers.append(entry)
    return servers


def allow_loopback_candidates() -> None:
    """Make aioice offer 127.0.0.1 as a host candidate (it drops loopback addresses by default).

    Process-wide and idempotent. Needed on loopback-only machines and for local tests.
    """
    global _original_host_addresses
    if _original_host_addresses is not None:
        return
    original = aioice.ice.get_host_addresses
    _original_host_addresses = original

    def with_loopback(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        addresses = original(use_ipv4, use_ipv6)
        if use_ipv4 and "127.0.0.1" not in addresses:
            addresses = ["127.0.0.1", *addresses]
        return addresses

    aioice.ice.get_host_addresses = with_loopback
    log.info("ICE: loopback host candidates enabled")


def strip_candidates(sdp: str) -> str:
    """Remove every ICE candidate from an SDP (test knob that makes connectivity impossible)."""
    lines = [line for line in sdp.splitlines() if not line.startswith(("a=candidate", "a=end-of-candidates"))]
    return "\r\n".join(lines) + "\r\n"
