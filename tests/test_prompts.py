import pytest
import torch

from engine.streaming.prompts import PromptTransition, blend, slerp


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
