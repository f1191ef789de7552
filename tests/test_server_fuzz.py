"""Fuzzing the edge: schemathesis over the HTTP API's OpenAPI document (no 5xx, no hang), and
hypothesis over SDP offer checks and control-message parsing (only their own errors, never a crash).

The serving policy's invariants have their own hypothesis tests (tests/test_serving_*.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from _security_fixtures import tiny_factory  # noqa: F401
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from app.server.control import ControlError, options_from_query, parse_control
from app.server.sdp import OfferError, check_offer

ADMIN = {"Authorization": "Bearer fuzz-admin"}
MAX_RESPONSE_S = 5.0


@pytest.fixture
def api_schema(tiny_factory: Any) -> Iterator[Any]:  # noqa: F811
    from app.server.app import create_app
    from app.server.config import ServerConfig

    app = create_app(ServerConfig(max_streams=2, api_token="fuzz-admin"), factory=tiny_factory)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    asyncio.run(app.state.manager.close_all())


def test_http_api_never_answers_5xx_or_hangs(api_schema: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        def call(case: Any) -> None:
            # As the admin, so requests get past the edge checks into every handler.
            t0 = time.monotonic()
            response = case.call(headers=ADMIN)
            elapsed = time.monotonic() - t0
            case.validate_response(response, checks=[not_a_server_error])
            assert elapsed < MAX_RESPONSE_S, f"{case.method} {case.path}: {elapsed:.1f} s"

        call()


def _valid_offer() -> str:
    from _security_fixtures import publisher_offer

    async def make() -> str:
        pc, sdp = await publisher_offer()
        await pc.close()
        return sdp

    return asyncio.run(make())


VALID_OFFER = _valid_offer()
LINES = VALID_OFFER.split("\r\n")


@st.composite
def mutated_offers(draw: st.DrawFn) -> str:
    """A real aiortc offer with lines dropped, duplicated, truncated or replaced by junk."""
    lines = list(LINES)
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["drop", "dup", "cut", "junk", "swap"]))
        if action == "drop":
            del lines[i]
        elif action == "dup":
            lines.insert(i, lines[i])
        elif action == "cut":
            lines[i] = lines[i][: draw(st.integers(0, max(0, len(lines[i]) - 1)))]
        elif action == "junk":
            lines[i] = draw(st.text(max_size=40))
        else:
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        if not lines:
            break
    return "\r\n".join(lines)


@given(st.one_of(st.text(max_size=300), mutated_offers()), st.booleans())
@settings(max_examples=300, deadline=None)
def test_sdp_checks_raise_only_offer_errors(sdp: str, publish: bool) -> None:
    try:
        check_offer(sdp, publish=publish)
    except OfferError as exc:
        assert str(exc)  # a reason for the client


def test_the_valid_offer_passes() -> None:
    check_offer(VALID_OFFER, publish=True)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
control_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["update", "pause", "resume", "reset", "jump"])},
    optional={"prompt": st.one_of(st.text(max_size=60), st.lists(st.text(max_size=20), max_size=3), json_values),
              "prompt_weights": st.one_of(st.lists(st.floats(allow_nan=True), max_size=3), json_values),
              "steps": json_values, "noise_scale": json_values, "seed": json_values,
              "transition_chunks": json_values},
)


@given(st.one_of(st.text(max_size=200), json_values.map(json.dumps), control_like.map(json.dumps)))
@settings(max_examples=400, deadline=None)
def test_control_parsing_raises_only_control_errors(text: str) -> None:
    try:
        message = parse_control(text, max_prompt_chars=50)
    except ControlError as exc:
        assert str(exc)
        return
    assert message.type in ("update", "pause", "resume", "reset")


@given(st.dictionaries(st.sampled_from(["prompt", "steps", "noise_scale", "seed", "other"]), st.text(max_size=20)))
@settings(max_examples=200, deadline=None)
def test_stream_options_raise_only_control_errors(query: dict[str, str]) -> None:
    try:
        options_from_query(query).to_settings("oil painting", 50)
    except ControlError as exc:
        assert str(exc)
