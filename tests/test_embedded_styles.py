"""Far prompts and prompts naming two looks on the shipped default model: held to the prompt lists kept
in the repository."""

from __future__ import annotations

import pytest
import torch

from engine.capabilities import look_name
from engine.embedded.styles import FAR_BELOW, NOT_SHIPPED, prompt_list, two_look_prompts
from engine.pipeline import Pipeline


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    torch.set_num_threads(1)
    return Pipeline.load()


def test_the_lists_are_big_enough() -> None:
    assert len(prompt_list("unrelated")) >= 50
    assert len(prompt_list("shipped")) >= 50


def test_the_shipped_checkpoint_uses_the_documented_threshold(pipe: Pipeline) -> None:
    assert pipe.styles is not None and pipe.styles.too_far_below == FAR_BELOW


def test_unrelated_prompts_get_a_notice_naming_only_shipped_looks(pipe: Pipeline) -> None:
    prompts = prompt_list("unrelated")
    notices = {p: pipe.prompt_notice((p,)) for p in prompts}
    missed = [p for p, n in notices.items() if n is None]
    assert len(missed) <= 0.05 * len(prompts), f"no notice for {missed}"
    assert "underwater scene" not in missed
    looks = pipe.capabilities.looks
    for notice in filter(None, notices.values()):
        assert all(name.replace("_", " ") not in notice.split("nearest:")[1] for name in NOT_SHIPPED), notice
        named = notice.split("Try one of: ")[1].split(", ")
        assert sorted(named) == sorted(looks), notice  # every shipped look, and nothing else
        assert notice.split("nearest: ")[1].split(" (")[0] in looks


def test_shipped_phrasings_and_paraphrases_get_no_notice(pipe: Pipeline) -> None:
    prompts = prompt_list("shipped")
    flagged = [p for p in prompts if pipe.prompt_notice((p,)) is not None]
    assert len(flagged) <= 0.05 * len(prompts), f"flagged: {flagged}"


def test_a_blend_with_one_near_prompt_gets_no_notice(pipe: Pipeline) -> None:
    assert pipe.prompt_notice(("underwater scene", "watercolor")) is None
    assert pipe.prompt_notice(("underwater scene", "a cat sitting on a windowsill")) is not None


def test_every_look_asked_for_by_its_own_name_gets_no_notice(pipe: Pipeline) -> None:
    """The notice lists the looks by name, so typing a listed name must never be called far."""
    assert pipe.styles is not None
    flagged = [n for n in pipe.capabilities.looks if pipe.prompt_notice((n,)) is not None]
    assert not flagged, flagged


def test_prompts_naming_two_looks_are_served_half_and_half(pipe: Pipeline) -> None:
    """The anchoring of each prompt is compared with the looks the list names for it (written by hand),
    not with what the code chose before; a prompt served as one look, or as a look it does not name,
    counts as missed."""
    pairs = two_look_prompts()
    assert len(pairs) >= 30
    prompts = pipe.runtime.prompts
    assert prompts.anchors is not None
    looks = set(pipe.capabilities.looks)
    missed = []
    for prompt, named in pairs:
        assert {look_name(n) for n in named} <= looks, f"{prompt!r} names a look the model does not ship: {named}"
        weights = dict(prompts.looks([prompt]))
        if set(weights) != set(named) or min(weights.values()) < 0.3:
            missed.append((prompt, weights))
    assert len(missed) <= 0.1 * len(pairs), missed


def test_no_shipped_phrasing_or_unrelated_prompt_names_two_looks(pipe: Pipeline) -> None:
    """A shipped look's own phrasing keeps its look ("black and white pencil drawing" is not noir and a
    pencil sketch), and an unrelated prompt is not turned into two looks (it keeps its notice)."""
    for name in ("shipped", "unrelated"):
        named = [(p, pipe.runtime.prompts.named_looks(p)) for p in prompt_list(name)]
        assert not [pair for pair in named if pair[1] is not None], name


def test_prompt_looks_mixes_the_prompts_looks_by_their_weights(pipe: Pipeline) -> None:
    looks = dict(pipe.prompt_looks(("pencil sketch and watercolor", "thermal camera"), [1, 1]))
    assert looks == pytest.approx({"pencil sketch": 0.25, "watercolor": 0.25, "thermal": 0.5}, abs=0.01)
    with pytest.raises(ValueError, match="all be zero"):
        pipe.prompt_looks(("pop art",), [0])
    with pytest.raises(ValueError, match="2 prompts but 1 weights"):
        pipe.prompt_looks(("pop art", "noir"), [1])
