"""Control messages and stream options are checked at the edge with messages that say what is wrong."""

from __future__ import annotations

import pytest

from app.server.control.messages import (
    ControlError,
    PauseMessage,
    StreamOptions,
    UpdateMessage,
    options_from_query,
    parse_control,
)


def test_update_with_blend_and_transition() -> None:
    message = parse_control(
        '{"type": "update", "prompt": ["oil painting", "neon"], "prompt_weights": [0.7, 0.3], "transition_chunks": 3}',
        max_prompt_chars=50,
    )
    assert isinstance(message, UpdateMessage)
    assert message.changes() == {
        "prompt": ["oil painting", "neon"], "prompt_weights": [0.7, 0.3], "transition_chunks": 3
    }
    assert isinstance(parse_control('{"type": "pause"}', 50), PauseMessage)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{", "not JSON"),
        ('{"type": "jump"}', "type"),
        ('{"type": "update", "steps": 0}', "steps"),
        ('{"type": "update", "noise_scale": 0.1}', "noise_scale"),
        ('{"type": "update", "volume": 3}', "volume"),
        ('{"type": "update", "prompt": "' + "x" * 51 + '"}', "51 characters long; the limit is 50"),
        ('{"type": "update", "prompt": "  "}', "prompt is empty"),
        ('{"type": "update", "prompt": ["a", "b"], "prompt_weights": [1]}', "2 prompts but 1 prompt_weights"),
        ('{"type": "update", "prompt": ["a", "b"], "prompt_weights": [0, 0]}', "not all zero"),
        ('{"type": "update", "prompt_weights": [1]}', "without prompt"),
    ],
)
def test_bad_control_messages_say_why(text: str, reason: str) -> None:
    with pytest.raises(ControlError, match=reason):
        parse_control(text, max_prompt_chars=50)


def test_stream_options_from_query() -> None:
    settings = options_from_query({"prompt": "ink", "steps": "1", "unrelated": "x"}).to_settings("oil", 100)
    assert (settings.prompt, settings.steps, settings.noise_scale) == ("ink", 1, 0.8)
    assert StreamOptions().to_settings("oil", 100).prompt == "oil"
    assert StreamOptions().to_settings("oil", 100).stabilize is True
    assert options_from_query({"stabilize": "false"}).to_settings("oil", 100).stabilize is False
    assert parse_control('{"type": "update", "stabilize": false}', 50).changes() == {"stabilize": False}  # type: ignore[union-attr]
    with pytest.raises(ControlError, match="seed"):
        options_from_query({"seed": "-1"})
