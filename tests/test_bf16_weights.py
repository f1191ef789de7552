"""Kept bf16 weight copies: the same numbers as autocast's own casts, and they follow the weights."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from engine.models.bf16_weights import keep_bf16_weights
from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.models.wan_vae import WanVAE, WanVAEConfig


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 36, 5))


def _double(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    return output * 2


def _bf16(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x)


def test_kept_copies_give_what_autocast_gives_and_follow_weight_changes() -> None:
    plain = _net()
    kept = copy.deepcopy(plain)
    assert keep_bf16_weights(kept) == 3
    x = torch.randn(2, 3, 6, 6)
    # Independent: the unmodified modules under torch's autocast, which casts the weights itself.
    assert torch.equal(_bf16(kept, x), _bf16(plain, x))
    assert not torch.equal(_bf16(kept, x).float(), kept(x))  # it did compute in bf16
    first = kept[0]._bf16_copies.weight
    _bf16(kept, x)
    assert kept[0]._bf16_copies.weight is first  # made once, not per forward
    # An in-place update (an optimiser step, load_state_dict) and a new tensor both show at once.
    with torch.no_grad():
        for net in (plain, kept):
            net[0].weight.mul_(-1.5)
    assert torch.equal(_bf16(kept, x), _bf16(plain, x))
    new, bias = torch.randn_like(plain[4].weight), torch.randn_like(plain[4].bias)
    for net in (plain, kept):
        net[4].weight = nn.Parameter(new.clone())
    assert torch.equal(_bf16(kept, x), _bf16(plain, x))
    for net in (plain, kept):
        net[4].bias = nn.Parameter(bias.clone())
    assert torch.equal(_bf16(kept, x), _bf16(plain, x))


def test_outside_bf16_inference_the_modules_run_as_before() -> None:
    plain = _net()
    kept = copy.deepcopy(plain)
    keep_bf16_weights(kept)
    x = torch.randn(2, 3, 6, 6)
    assert torch.equal(kept(x), plain(x))  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # training under autocast: gradients reach the weights
        kept(x).float().sum().backward()
        plain(x).float().sum().backward()
    assert kept[0].weight.grad is not None and plain[0].weight.grad is not None
    assert torch.equal(kept[0].weight.grad, plain[0].weight.grad)
    assert kept[0]._bf16_copies.weight is None  # no copy was needed


def test_hooks_state_dict_copies_and_pickles_keep_working() -> None:
    plain = _net()
    kept = copy.deepcopy(plain)
    keep_bf16_weights(kept)
    assert isinstance(kept[4], nn.Linear) and list(kept.state_dict()) == list(plain.state_dict())
    for net in (plain, kept):  # a forward hook (how LoRA side paths attach) still shapes the output
        net[4].register_forward_hook(_double)
    x = torch.randn(2, 3, 6, 6)
    assert torch.equal(_bf16(kept, x), _bf16(plain, x))
    for clone in (copy.deepcopy(kept), pickle.loads(pickle.dumps(kept))):
        with torch.no_grad():
            clone[0].weight.zero_()  # the clone computes with its own weights, not the original's copies
        assert not torch.equal(_bf16(clone, x), _bf16(kept, x))
        assert clone[0]._bf16_copies is not kept[0]._bf16_copies


def test_the_engines_models_compute_the_same_with_kept_copies() -> None:
    torch.manual_seed(0)
    dit = CausalWanDiT(CONFIGS["tiny"]).eval()
    vae = TinyVAE(TinyVAEConfig(latent_channels=CONFIGS["tiny"].in_channels, enc_channels=8, dec_channels=8)).eval()
    wan_vae = WanVAE(WanVAEConfig.tiny()).eval()
    kept_dit, kept_vae, kept_wan = (copy.deepcopy(m) for m in (dit, vae, wan_vae))
    assert keep_bf16_weights(kept_dit) > 0 and keep_bf16_weights(kept_vae) > 0
    keep_bf16_weights(kept_wan)
    # A subclass with a forward of its own (the Wan VAE's causal convolution) keeps it.
    assert all(type(a) is type(b) for a, b in zip(wan_vae.modules(), kept_wan.modules(), strict=True)
               if type(a) not in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    frames = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        z = vae.encode_chunk(frames, vae.new_encoder_cache())
        assert torch.equal(kept_vae.encode_chunk(frames, kept_vae.new_encoder_cache()), z)
        assert torch.equal(kept_vae.decode_chunk(z, kept_vae.new_decoder_cache()),
                           vae.decode_chunk(z, vae.new_decoder_cache()))
        zw = wan_vae.encode_chunk(frames, wan_vae.new_encoder_cache())
        assert torch.equal(kept_wan.encode_chunk(frames, kept_wan.new_encoder_cache()), zw)
    x = torch.randn(1, CONFIGS["tiny"].in_channels, 2, 4, 4)
    t = torch.full((1, 2), 500.0)
    context = torch.randn(1, 4, CONFIGS["tiny"].text_dim)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(kept_dit(x, t, kept_dit.encode_prompt(context)), dit(x, t, dit.encode_prompt(context)))
