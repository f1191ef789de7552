"""Fuzzing the edge: schemathesis over the HTTP API's OpenAPI document with every check (the
document says what the server answers; no 5xx, no hang), and hypothesis over SDP offer checks and
control-message parsing (only their own errors, never a crash).

The serving policy's invariants have their own hypothesis tests (tests/test_serving_*.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _security_fixtures import tiny_factory  # noqa: F401
from conftest import running_server
from hypothesis import given, settings
from hypothesis import strategies as st

from app.server.control.messages import ControlError, options_from_query, parse_control
from app.server.media.sdp import OfferError, check_offer

MAX_RESPONSE_S = 5.0
HOOKS = Path(__file__).with_name("_schemathesis_hooks.py")
# The SDP bodies and the prompt have rules a JSON schema cannot state (the SDP grammar and what
# aiortc can negotiate; Unicode categories and --max-prompt-chars for prompts): a schema-valid
# request may still get the 400 or 422 that the document lists for them.
SCHEMATHESIS_CONFIG = f"""
hooks = "{HOOKS.stem}"

[[operations]]
include-path-regex = '^/(api/offer|whip|whep/\\{{stream_id\\}})$'
include-method = "POST"

[operations.checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "422", "429", "5xx"]
"""


@pytest.mark.parametrize("credential", ["admin", "none"])
def test_openapi_document_matches_the_answers(tiny_factory: Any, tmp_path: Path, credential: str) -> None:  # noqa: F811
    """`schemathesis run --checks all` against a real server: every answer is documented (status,
    media type, headers, schema, Allow), schema-valid requests are accepted and invalid ones
    refused, no 5xx and none slower than MAX_RESPONSE_S. As the admin (requests reach every
    handler) and with no credential (the edge's refusals)."""
    from app.server.app import create_app
    from app.server.config import ServerConfig

    config_file = tmp_path / "schemathesis.toml"
    config_file.write_text(SCHEMATHESIS_CONFIG)
    app = create_app(ServerConfig(max_streams=2, api_token="fuzz-admin-0123456789"), factory=tiny_factory)
    headers = ["-H", "Authorization: Bearer fuzz-admin-0123456789"] if credential == "admin" else []
    with running_server(app) as url:
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config_file), "run",
             f"{url}/openapi.json", "--checks", "all", "--max-examples", "15", "--generation-deterministic",
             "--max-response-time", str(MAX_RESPONSE_S), "--request-timeout", "30", "--no-color", *headers],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(HOOKS.parent)}, capture_output=True, text=True,
            timeout=300,
        )
    summary = result.stdout[-6000:]
    assert result.returncode == 0, summary
    assert re.search(r"Tested: +[12][0-9]\b", summary) and " passed" in summary and "failure" not in summary, summary


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


@given(mutated_offers())
@settings(max_examples=150, deadline=None)
def test_offers_that_pass_the_checks_negotiate(sdp: str) -> None:
    """What check_offer lets through, aiortc can apply and answer; the only refusal left to it is
    a codec profile it lacks (OperationError, which the gateway answers with a 400)."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.exceptions import OperationError

    try:
        check_offer(sdp, publish=True)
    except OfferError:
        return

    async def negotiate() -> None:
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            await pc.createAnswer()
        except OperationError:
            pass
        finally:
            await pc.close()

    asyncio.run(negotiate())


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
