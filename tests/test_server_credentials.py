"""Credentials resist guessing (app/server/edge/security.py GuessThrottle): wrong tokens earn their client
address a growing wait (429 + Retry-After) on every route that checks one, a burst over TLS gets
only a handful checked, other addresses are never held up (behind a proxy: the address the
trusted proxy names), and admin tokens shorter than 16 characters are refused at start-up."""

from __future__ import annotations

import asyncio
import collections
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from _security_fixtures import (  # noqa: F401
    Api,
    asgi_api,
    bearer,
    publisher_offer,
    served,
    tiny_factory,
    viewer_offer,
)
from conftest import running_server

from app.server.config import MIN_TOKEN_CHARS, ServerConfig, TokenTooShortError
from app.server.edge.logs import mint_secret
from app.server.edge.security import (
    FIRST_WAIT_S,
    FORGET_S,
    FREE_FAILURES,
    MAX_ADDRESSES,
    MAX_WAIT_S,
    GuessThrottle,
    Throttled,
)

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]
ROOT = Path(__file__).resolve().parents[1]
ADMIN = "admin-token-0123456789"
WHIP_TOKEN = "whip-token-0123456789"
LOGIN = {"Content-Type": "application/x-www-form-urlencoded"}


def login_body(token: str) -> bytes:
    return f"token={token}&next=/".encode()


def test_wrong_tokens_earn_their_address_a_growing_wait() -> None:
    now = [0.0]
    guesses = GuessThrottle(clock=lambda: now[0])

    def waits(host: str) -> int:
        try:
            guesses.check(host)
        except Throttled as throttled:
            return int(throttled.headers["Retry-After"])
        return 0

    for _ in range(FREE_FAILURES - 1):  # typos cost nothing
        guesses.failed("198.51.100.1", "wrong")
        assert waits("198.51.100.1") == 0
    waited = []
    for _ in range(10):
        guesses.failed("198.51.100.1", "wrong")
        waited.append(waits("198.51.100.1"))
        assert waits("198.51.100.2") == 0  # never anyone else
        now[0] += waited[-1]
        assert waits("198.51.100.1") == 0  # the wait is over: the next try is checked
    assert waited == [min(MAX_WAIT_S, FIRST_WAIT_S * 2**n) for n in range(10)]
    # Capabilities the server minted (another stream's token, an ended stream's) are not guesses.
    for _ in range(3 * FREE_FAILURES):
        guesses.failed("198.51.100.3", mint_secret(24))
    assert waits("198.51.100.3") == 0
    # One IPv6 subscriber (a /64) is one address; IPv4-mapped IPv6 is the IPv4 address.
    for n in range(FREE_FAILURES):
        guesses.failed(f"2001:db8:1:2::{n + 1}", "wrong")
        guesses.failed("::ffff:192.0.2.9", "wrong")
    assert waits("2001:db8:1:2:ffff::9") > 0 and waits("192.0.2.9") > 0
    assert waits("2001:db8:1:3::1") == 0
    # Forgotten after a quiet while; and a flood of addresses cannot grow the table without bound.
    now[0] += FORGET_S + MAX_WAIT_S
    guesses.failed("198.51.100.1", "wrong")
    assert waits("198.51.100.1") == 0
    for _ in range(FREE_FAILURES):
        guesses.failed("198.51.100.4", "wrong")
    assert waits("198.51.100.4") > 0
    for n in range(MAX_ADDRESSES):
        guesses.failed(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}", "wrong")
    assert waits("198.51.100.4") == 0  # the longest quiet went first


def test_a_burst_of_wrong_logins_over_tls_gets_a_handful_checked(tiny_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    from app.server.app import create_app
    from app.server.edge.tls import self_signed

    pair = self_signed(tmp_path / "tls")
    config = ServerConfig(api_token=ADMIN, https=True, ssl_certfile=str(pair.certfile), ssl_keyfile=str(pair.keyfile))
    attempts = 300
    with running_server(create_app(config, factory=tiny_factory)) as url:
        async def burst() -> tuple[collections.Counter[int], set[str], float, httpx.Response]:
            async with httpx.AsyncClient(verify=False, limits=httpx.Limits(max_connections=32), timeout=60) as client:
                started = time.monotonic()
                answers = await asyncio.gather(*[client.post(f"{url}/api/login", content=login_body(f"guess-{n}"),
                                                             headers=LOGIN) for n in range(attempts)])
                took = time.monotonic() - started
                # Then one more guess whenever the address may try again: it is compared, and a
                # longer wait starts; the right token just after it waits as well.
                while (await client.post(f"{url}/api/login", content=login_body("guess"),
                                         headers=LOGIN)).status_code == 429:
                    await asyncio.sleep(0.25)
                right = await client.post(f"{url}/api/login", content=login_body(ADMIN), headers=LOGIN)
            return (collections.Counter(a.status_code for a in answers),
                    {a.headers.get("retry-after", "") for a in answers if a.status_code == 429}, took, right)

        statuses, retry_after, took, right = asyncio.run(burst())
        # Only the first few were compared at all (303 back to the form): the free ones, then one
        # each time a wait (1 s, 2 s, 4 s ...) was over while the burst lasted; the rest got 429.
        checked = statuses[303]
        assert FREE_FAILURES <= checked <= FREE_FAILURES + math.ceil(math.log2(took + 1)), (statuses, took)
        assert statuses[429] == attempts - checked, statuses
        assert retry_after and all(value.isdigit() and int(value) >= 1 for value in retry_after), retry_after
        # The right token from the waiting address waits too: were it compared, the answer would
        # tell a guesser when it is right (docs/security.md).
        assert right.status_code == 429 and "wrong credentials" in right.json()["detail"], right.text

        async def from_another_address() -> tuple[httpx.Response, httpx.Response]:
            transport = httpx.AsyncHTTPTransport(verify=False, local_address="127.0.0.2")
            async with httpx.AsyncClient(transport=transport, timeout=60) as client:
                login = await client.post(f"{url}/api/login", content=login_body(ADMIN), headers=LOGIN)
                listing = await client.get(f"{url}/api/streams", headers=bearer(ADMIN))
            return login, listing

        login, listing = asyncio.run(from_another_address())
        assert login.status_code == 303 and login.headers["location"] == "/" and "set-cookie" in login.headers
        assert listing.status_code == 200


async def test_every_credential_check_counts_and_waits(asgi_api: ApiFactory, tmp_path: Path) -> None:  # noqa: F811
    async with asgi_api(max_streams=4, max_streams_per_client=4, api_token=ADMIN, token=WHIP_TOKEN,
                        record_dir=str(tmp_path / "rec")) as admin:
        stream = await admin.create(headers=bearer(WHIP_TOKEN))
        sid = stream.stream_id
        publisher, publisher_sdp = await publisher_offer()
        viewer, viewer_sdp = await viewer_offer()
        admin.peers += [publisher, viewer]
        sdp = {"Content-Type": "application/sdp"}
        # (method, path, body, headers, the right token, what it gets): every place a token is compared.
        checks: list[tuple[str, str, str, dict[str, str], str, int]] = [
            ("GET", "/api/streams", "", {}, ADMIN, 200),  # the edge: admin tokens
            ("GET", "/api/dashboard", "", {}, ADMIN, 200),
            ("GET", "/playground/config", "", {}, ADMIN, 200),
            ("POST", f"/api/streams/{sid}/control", '{"type": "pause"}', {}, stream.owner, 200),  # stream tokens
            ("GET", f"/api/streams/{sid}/recordings", "", {}, stream.owner, 200),  # the recordings' owner check
            ("POST", "/whip", publisher_sdp, sdp, WHIP_TOKEN, 201),  # creation, then the WHIP --token
            ("POST", f"/whep/{sid}", viewer_sdp, sdp, WHIP_TOKEN, 201),  # public viewing: the WHIP --token
        ]
        for n, (method, path, body, headers, right, right_status) in enumerate(checks):
            guesser = admin.at(f"198.51.100.{n + 1}")
            for _ in range(FREE_FAILURES):
                response = await guesser.client.request(method, path, content=body, headers={**headers, **bearer("wrong")})
                assert response.status_code in (401, 404), (path, response.status_code, response.text)
            for token in ("wrong", right):
                response = await guesser.client.request(method, path, content=body, headers={**headers, **bearer(token)})
                assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1, (path, response.text)
                assert "too many wrong credentials" in response.text
            # Someone else, with the right token, the same moment.
            bystander = admin.at(f"192.0.2.{n + 1}")
            response = await bystander.client.request(method, path, content=body, headers={**headers, **bearer(right)})
            assert response.status_code == right_status, (path, response.status_code, response.text)
            # No credential, nothing compared: the waiting address still gets what is public.
            assert (await guesser.client.get("/api/config")).status_code == 200
        # The login form: after the free tries the right token waits too.
        guesser = admin.at("198.51.100.100")
        for _ in range(FREE_FAILURES):
            response = await guesser.client.post("/api/login", content=login_body("wrong"), headers=LOGIN)
            assert response.status_code == 303 and "failed=1" in response.headers["location"]
        response = await guesser.client.post("/api/login", content=login_body(ADMIN), headers=LOGIN)
        assert response.status_code == 429 and response.headers["retry-after"] == "1"


async def test_tokens_the_server_minted_never_hold_anyone_up(asgi_api: ApiFactory) -> None:  # noqa: F811
    """Another stream's owner token, or the token of a stream that ended (a page polling its stats
    after the end: told it ended, 410), grants nothing but is no guess: no wait, and the admin token
    still works."""
    async with asgi_api(max_streams=4, max_streams_per_client=4, api_token=ADMIN, private_viewing=True) as api:
        mine, other = await api.create(headers=bearer(ADMIN)), await api.create(headers=bearer(ADMIN))
        assert (await api.client.delete(f"/api/streams/{mine.stream_id}", headers=bearer(mine.owner))).status_code == 204
        for _ in range(3 * FREE_FAILURES):
            response = await api.client.get(f"/api/streams/{mine.stream_id}", headers=bearer(mine.owner))
            assert response.status_code == 410 and "stopped by its owner" in response.json()["detail"]
            response = await api.client.delete(f"/api/streams/{other.stream_id}", headers=bearer(mine.viewer))
            assert response.status_code == 404
        assert (await api.client.get("/api/streams", headers=bearer(ADMIN))).status_code == 200


@pytest.mark.parametrize("trusted", [False, True])
def test_behind_a_proxy_the_wait_is_the_named_clients_own(tiny_factory: Any, trusted: bool) -> None:  # noqa: F811
    """With --forwarded-allow-ips the proxy's X-Forwarded-For is the address that waits; from an
    untrusted peer the header is a claim, and changing it escapes nothing."""
    forwarded = ("127.0.0.1",) if trusted else ()
    with served(tiny_factory, api_token=ADMIN, forwarded_allow_ips=forwarded) as (url, _):
        def listing(client_address: str, token: str) -> int:
            headers = {**bearer(token), "X-Forwarded-For": client_address}
            return httpx.get(f"{url}/api/streams", headers=headers, timeout=30).status_code

        assert [listing(f"198.51.100.{n}", "wrong") for n in range(FREE_FAILURES)] == [401] * FREE_FAILURES
        assert listing("198.51.100.200", "wrong") == (401 if trusted else 429)
        assert listing("203.0.113.5", ADMIN) == (200 if trusted else 429)
        if trusted:  # the named client's own failures hold it up
            assert [listing("198.51.100.7", "wrong") for _ in range(FREE_FAILURES)] == [401] * FREE_FAILURES
            assert listing("198.51.100.7", ADMIN) == 429
            assert listing("198.51.100.8", ADMIN) == 200


def test_short_admin_tokens_are_refused_at_start_up() -> None:
    for field in ("api_token", "token"):
        with pytest.raises(TokenTooShortError, match=f"at least {MIN_TOKEN_CHARS}"):
            ServerConfig(**{field: "x" * (MIN_TOKEN_CHARS - 1)})
        assert getattr(ServerConfig(**{field: "x" * MIN_TOKEN_CHARS}), field)
    result = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--model", "tiny-random", "--api-token", "a"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--api-token is too short (1 characters): an admin token needs at least 16" in result.stderr
    assert "Traceback" not in result.stderr
