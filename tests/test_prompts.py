import pytest
import torch

from engine.streaming.prompts import (
    LookAnchors,
    PromptTransition,
    blend,
    prompt_cuts,
    seconds_to_chunks,
    slerp,
)


def test_linear_blend_is_the_weighted_mean() -> None:
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    out = blend([a, b], [3.0, 1.0], "linear")
    torch.testing.assert_close(out, 0.75 * a + 0.25 * b)


def test_slerp_endpoints_and_norm() -> None:
    a, b = torch.randn(16), torch.randn(16)
    torch.testing.assert_close(slerp(a, b, 0.0), a)
    torch.testing.assert_close(slerp(a, b, 1.0), b)
    mid = slerp(a, b, 0.5)
    assert mid.norm().item() == pytest.approx(0.5 * (a.norm() + b.norm()).item(), rel=1e-5)


def test_slerp_of_orthogonal_unit_vectors_is_on_the_circle() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    out = slerp(a, b, 0.5)
    torch.testing.assert_close(out, torch.tensor([2**-0.5, 2**-0.5]))


def test_slerp_blend_of_many_prompts_single_weight_returns_it() -> None:
    e = [torch.randn(3, 5) for _ in range(3)]
    torch.testing.assert_close(blend(e, [0.0, 1.0, 0.0], "slerp"), e[1])


@pytest.mark.parametrize(
    ("weights", "message"),
    [([1.0], "2 prompts but 1 weights"), ([-1.0, 2.0], "non-negative"), ([0.0, 0.0], "all be zero")],
)
def test_bad_weights_say_what_is_wrong(weights: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        blend([torch.zeros(2), torch.ones(2)], weights)


def test_transition_reaches_the_target_in_k_chunks() -> None:
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    tr = PromptTransition(a, b, chunks=3, mode="linear")
    steps = [tr.next_embedding() for _ in range(3)]
    torch.testing.assert_close(steps[0], a + (b - a) / 3)
    assert tr.finished
    torch.testing.assert_close(steps[-1], b)


def _anchors() -> LookAnchors:
    protos = torch.nn.functional.normalize(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)), dim=-1)
    return LookAnchors(("a", "b", "c", "d"), protos, temperature=0.03)


def test_a_prompt_on_a_look_is_served_as_that_look() -> None:
    anchors = _anchors()
    near_b = torch.nn.functional.normalize(anchors.prototypes[1] + 0.05 * anchors.prototypes[2], dim=0)
    (name, weight), _ = anchors.weights(near_b)
    assert name == "b" and weight > 0.99
    torch.testing.assert_close(anchors.anchor(near_b[None])[0], anchors.prototypes[1], atol=1e-3, rtol=0)


def test_a_prompt_between_two_looks_is_their_interpolation() -> None:
    anchors = _anchors()
    a, c = anchors.prototypes[0], anchors.prototypes[2]
    middle = torch.nn.functional.normalize(a + c, dim=0)
    weights = dict(anchors.weights(middle))
    assert set(weights) == {"a", "c"} and abs(weights["a"] - 0.5) < 1e-4
    # The served embedding is the slerp midpoint of the two prototypes, computed here independently.
    omega = torch.arccos(torch.dot(a, c))
    expected = (torch.sin(omega / 2) / torch.sin(omega)) * (a + c)
    torch.testing.assert_close(anchors.anchor(middle[None])[0], expected, atol=1e-4, rtol=0)
    # Leaning towards one look moves the blend towards it.
    leaning = torch.nn.functional.normalize(0.6 * a + 0.4 * c, dim=0)
    assert dict(anchors.weights(leaning))["a"] > 0.6


def test_anchoring_needs_looks_and_a_positive_temperature() -> None:
    protos = torch.eye(2)
    with pytest.raises(ValueError, match="temperature"):
        LookAnchors(("a", "b"), protos, 0.0)
    with pytest.raises(ValueError, match="2 looks"):
        LookAnchors(("a",), protos[:1], 0.03)


def test_cuts_split_at_every_word_and_drop_the_joining_words() -> None:
    # "a" alone is a joining word: no part is left of the first cut.
    assert prompt_cuts("a pencil sketch with watercolor") == [
        ("a pencil", "sketch with watercolor"), ("a pencil sketch", "watercolor")]
    assert ("oil painting", "watercolor") in prompt_cuts("Oil painting x watercolor")
    assert ("thermal", "cartoon") in prompt_cuts("thermal + cartoon")
    assert ("pencil sketch", "pop art") in prompt_cuts("pencil sketch, pop art")
    assert prompt_cuts("cartoon") == [] and prompt_cuts("and") == []
    assert prompt_cuts(" ".join(["word"] * 17)) == []  # a description, not a list of looks


def _parts(*pairs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.stack(pair) for pair in pairs])


def test_a_prompt_naming_two_looks_is_served_half_and_half() -> None:
    """The whole prompt leans to one look (a 95/5 softmax), but a cut of it names two: each part is
    nearer its own look than the whole is to any, so it is served as half of each."""
    anchors = _anchors()
    a, b, c = anchors.prototypes[0], anchors.prototypes[1], anchors.prototypes[2]
    whole = torch.nn.functional.normalize(a + 0.7 * b, dim=0)
    assert dict(anchors.weights(whole))["a"] > 0.95
    near = lambda p, q: torch.nn.functional.normalize(p + 0.2 * q, dim=0)  # noqa: E731
    cuts = _parts((near(c, b), near(c, a)), (near(a, c), near(b, a)), (near(a, b), near(a, c)))
    assert anchors.named(whole, cuts) == ("a", "b")
    assert dict(anchors.weights(whole, cuts)) == {"a": 0.5, "b": 0.5}
    served = anchors.anchor(whole[None], [cuts])[0]
    torch.testing.assert_close(served, slerp(a, b, 0.5))
    # Not named: both parts on one look, a part under the floor, a part farther than the whole prompt.
    assert anchors.named(whole, _parts((near(a, c), near(a, b)))) is None
    far_part = torch.nn.functional.normalize(torch.randn(16, generator=torch.Generator().manual_seed(3)), dim=0)
    assert anchors.named(whole, _parts((near(a, c), far_part))) is None
    on_a = torch.nn.functional.normalize(a + 0.01 * b, dim=0)
    assert anchors.named(on_a, _parts((near(a, c), near(b, c)))) is None
    assert anchors.named(whole, None) is None
    # A part less near its look than the whole prompt is to its own still names its look when it says
    # it much more clearly than the whole does ("thermal vaporwave": "thermal" is 0.63 from the thermal
    # look, the whole 0.77 from vaporwave and 0.54 from thermal).
    leaning = torch.nn.functional.normalize(a + 0.5 * b, dim=0)
    weak_b = torch.nn.functional.normalize(b + 0.6 * c, dim=0)
    sims = anchors.prototypes @ leaning
    assert float(weak_b @ b) < float(sims.max()) and float(weak_b @ b) - float(sims[1]) > 0.05
    assert anchors.named(leaning, _parts((weak_b, a))) == ("b", "a")


def test_a_transition_moves_loras_and_noise_with_the_text() -> None:
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    tr = PromptTransition(a, b, chunks=4, mode="linear", loras_source={"ink": 1.0}, loras_target={"clay": 0.5},
                          noise_source=0.4, noise_target=0.8)
    assert tr.noise_scale(ahead=1) == pytest.approx(0.5)  # what the controller uses before the first chunk
    tr.next_embedding()
    assert tr.loras() == pytest.approx({"ink": 0.75, "clay": 0.125})
    assert tr.noise_scale() == pytest.approx(0.5)
    for _ in range(3):
        tr.next_embedding()
    assert tr.loras() == {"clay": 0.5}, "the last chunk uses the target, the LoRA faded out dropped"
    assert tr.noise_scale() == 0.8
    still = PromptTransition(a, b, chunks=2)
    still.next_embedding()
    assert still.loras() is None and still.noise_scale() is None, "a prompt-only transition leaves them alone"
    with pytest.raises(ValueError, match="both its source and its target"):
        PromptTransition(a, b, chunks=2, noise_target=0.5)


@pytest.mark.parametrize(("seconds", "chunk_seconds", "chunks"), [(0.0, 0.25, 0), (0.75, 0.25, 3), (0.8, 0.25, 4),
                                                                  (0.01, 0.25, 1)])
def test_seconds_become_chunks_rounded_up(seconds: float, chunk_seconds: float, chunks: int) -> None:
    assert seconds_to_chunks(seconds, chunk_seconds) == chunks


@pytest.mark.parametrize(("seconds", "chunk_seconds"), [(float("nan"), 0.25), (-1.0, 0.25), (float("inf"), 0.25),
                                                        (1.0, 0.0)])
def test_bad_transition_lengths_are_refused(seconds: float, chunk_seconds: float) -> None:
    with pytest.raises(ValueError, match="seconds"):
        seconds_to_chunks(seconds, chunk_seconds)
