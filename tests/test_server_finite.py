"""Finite numbers everywhere a number enters: one NaN or Infinity in prompt_weights used to be
accepted and turn the stream's frames black until a reset (control messages over every transport,
stream options, the playground's controls, and the engine's own parameters)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
from _security_fixtures import Api, asgi_api, bearer, publisher_offer, tiny_factory  # noqa: F401

from app.playground import Controls, finite
from app.server.control.messages import ControlError, options_from_query, parse_control
from engine.pipeline import StreamParams

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]
# JSON has no NaN or Infinity, but Python's json reads them; 1e400 is a valid JSON number that
# overflows to Infinity.
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400"]


@pytest.mark.parametrize("number", NON_FINITE)
def test_control_messages_refuse_non_finite_numbers(number: str) -> None:
    for template in ('{"type": "update", "prompt": ["a", "b"], "prompt_weights": [%s, 1]}',
                     '{"type": "update", "prompt": "a", "prompt_weights": [%s]}',
                     '{"type": "update", "noise_scale": %s}',
                     '{"type": "update", "steps": %s}'):
        with pytest.raises(ControlError):
            parse_control(template % number, 50)


def test_prompt_weights_whose_sum_overflows_are_refused() -> None:
    with pytest.raises(ControlError, match="finite sum"):
        parse_control('{"type": "update", "prompt": ["a", "b"], "prompt_weights": [1e308, 1e308]}', 50)
    assert parse_control('{"type": "update", "prompt": ["a", "b"], "prompt_weights": [1e307, 1e307]}', 50)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "NaN"])
def test_stream_options_refuse_non_finite_numbers(value: str) -> None:
    with pytest.raises(ControlError, match="noise_scale"):
        options_from_query({"noise_scale": value})


async def test_a_stream_never_receives_a_non_finite_weight(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=1) as api:
        stream = await api.create(prompt="oil painting")
        control = f"/api/streams/{stream.stream_id}/control"
        for number in NON_FINITE:
            text = '{"type": "update", "prompt": ["ink", "neon"], "prompt_weights": [' + number + ", 1]}"
            response = await api.client.post(control, content=text, headers=bearer(stream.owner))
            assert response.status_code == 422 and response.json()["type"] == "error", (number, response.text)
        stats = (await api.client.get(f"/api/streams/{stream.stream_id}")).json()
        assert stats["prompt"] == "oil painting"  # nothing was applied
        good = json.dumps({"type": "update", "prompt": ["ink", "neon"], "prompt_weights": [0.5, 0.5]})
        assert (await api.client.post(control, content=good, headers=bearer(stream.owner))).status_code == 200


@pytest.mark.parametrize("weights", [(math.nan, 1.0), (math.inf, 1.0), (1e308, 1e308), (-0.5, 1.0)])
def test_the_engine_refuses_weights_it_cannot_blend(weights: tuple[float, float], tiny_factory: Any) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="prompt weights"):
        StreamParams(prompt=("ink", "neon"), prompt_weights=weights)
    stream = tiny_factory.pipeline.open_stream(StreamParams(prompt="ink"))
    with pytest.raises(ValueError, match="prompt weights"):
        stream.update(prompt=["ink", "neon"], prompt_weights=list(weights))


def test_playground_controls_are_checked_like_control_messages() -> None:
    for value in ("nan", math.inf, "1e400", None, "x"):
        with pytest.raises(ValueError, match="blend"):
            finite(value, "blend")
    assert finite("0.25", "blend") == 0.25
    with pytest.raises(ValueError, match="blend weight"):
        Controls("ink", "neon", math.nan, "linear", 0.8, 2, 0).params(500)
    with pytest.raises(ValueError, match="noise_scale"):
        Controls("ink", "", 0.0, "linear", math.inf, 2, 0).params(500)
    # The prompt checks of control messages: length and control characters.
    with pytest.raises(ValueError, match="limit is 20"):
        Controls("x" * 21, "", 0.0, "linear", 0.8, 2, 0).params(20)
    with pytest.raises(ValueError, match="U\\+001B"):
        Controls("ink\x1b[2J", "", 0.0, "linear", 0.8, 2, 0).params(500)
    with pytest.raises(ValueError, match="U\\+202E"):
        Controls("ink", "\u202eneon", 0.5, "linear", 0.8, 2, 0).params(500)
    blended = Controls("ink", "neon", 0.25, "slerp", 0.7, 3, 5).params(500)
    assert blended.prompt_weights == (0.75, 0.25) and blended.blend_mode == "slerp"
