"""LoRA at run time: every key layout against an independent merged-weights forward, per-row strengths,
the runtime's batches and live changes, and the errors for LoRAs that do not fit.

No LoRA file can be downloaded here, so the fixtures are made at test time on the tiny Wan config: a PEFT
adapter saved by peft itself on diffusers' WanTransformer3DModel (the diffusers/PEFT layout), the same
factors converted to original Wan names (``diffusion_model.…lora_down/lora_up/alpha``) and to kohya's
flattened names, and a hand-made original-layout LoRA. The reference is always a plain forward of a copy
of the model whose weights have the LoRA merged in (W' = W + s·ΔW, with peft's own merge for the PEFT one).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from _dit_fixtures import diffusers_wan, dit_single_thread, write_random_lora  # noqa: F401  (autouse fixture)
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from engine.checkpoint import diffusers_to_original, diffusers_to_original_key
from engine.lora_files import load_lora
from engine.models.lora import MAX_LORA_STRENGTH, LoRABank, LoRAError
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.pipeline import Pipeline, StreamParams

CFG = CONFIGS["tiny"]
PEFT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "proj_out", "time_embedder.linear_1",
                "text_embedder.linear_1"]
Deltas = dict[str, torch.Tensor]  # original weight name -> ΔW at strength 1


@pytest.fixture(scope="module")
def peft_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Deltas]:
    """A PEFT adapter directory written by peft on diffusers' Wan transformer, and the weight deltas
    peft's own merge_and_unload adds (renamed to original Wan names by the checkpoint mapping)."""
    torch.manual_seed(3)
    model = diffusers_wan(CFG)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=2, target_modules=PEFT_TARGETS,
                                                  init_lora_weights=False))
    with torch.no_grad():  # peft's random init is kaiming-sized; smaller factors keep the forward tame
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)
    directory = tmp_path_factory.mktemp("peft")
    peft_model.save_pretrained(str(directory))
    merged = peft_model.merge_and_unload().state_dict()
    changed = {k: merged[k] - base[k] for k in base if not torch.equal(merged[k], base[k])}
    assert len(changed) == CFG.num_layers * 10 + 3  # 8 attention + 2 FFN per block, head, time, text
    return directory, diffusers_to_original(changed)


def original_layout(peft_file: Path, alpha: float, kohya: bool) -> dict[str, torch.Tensor]:
    """The PEFT factors under original Wan names: ``diffusion_model.<module>.lora_down/lora_up/alpha``, or
    kohya's ``lora_unet_<module with underscores>``."""
    out = {}
    for key, tensor in load_file(str(peft_file)).items():
        module, kind = key.removeprefix("base_model.model.").rsplit(".", 2)[:2]
        original = diffusers_to_original_key(module + ".weight")
        assert original is not None, key
        name = original.removesuffix(".weight")
        name = "lora_unet_" + name.replace(".", "_") if kohya else "diffusion_model." + name
        out[f"{name}.{'lora_down' if kind == 'lora_A' else 'lora_up'}.weight"] = tensor
        out[f"{name}.alpha"] = torch.tensor(alpha)
    return out


@pytest.fixture(scope="module")
def hand_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Deltas]:
    """A rank-2 LoRA in the original layout on the FFN and cross-attention K/V, alpha 1 (scale 1/2)."""
    path = tmp_path_factory.mktemp("hand") / "hand.safetensors"
    return path, write_random_lora(path, CausalWanDiT(CFG), ("ffn.0", "ffn.2", "cross_attn.k", "cross_attn.v"))


@pytest.fixture(scope="module")
def base_model() -> CausalWanDiT:
    torch.manual_seed(0)
    return CausalWanDiT(CFG).eval()


def merged(model: CausalWanDiT, *terms: tuple[float, Deltas]) -> CausalWanDiT:
    """An independent copy of ``model`` with ``sum(s * ΔW)`` added to its weights."""
    out = copy.deepcopy(model)
    state = out.state_dict()
    with torch.no_grad():
        for strength, deltas in terms:
            for key, delta in deltas.items():
                state[key] += strength * delta
    return out


def forward(model: CausalWanDiT, bank: LoRABank | None = None, rows: list[Mapping[str, float]] | None = None,
            batch: int = 1) -> torch.Tensor:
    """Prompt encoding and a two-frame forward at per-row timesteps, with the bank's strengths ``rows``."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(batch, CFG.in_channels, 2, 8, 8, generator=g)
    context = torch.randn(batch, 5, CFG.text_dim, generator=g)
    t = torch.tensor([[300.0, 700.0]] * batch)
    with bank.rows(rows) if bank is not None and rows is not None else nullcontext():
        return model(x, t, model.encode_prompt(context))


def installed(model: CausalWanDiT, *loras: tuple[str, Path | dict[str, torch.Tensor]]) -> LoRABank:
    bank = LoRABank(model)
    for name, source in loras:
        load_lora(source if isinstance(source, Path) else _saved(source, name), bank, name)
    return bank


def _saved(tensors: dict[str, torch.Tensor], name: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / f"{name}.safetensors"
    save_file(tensors, str(path))
    return path


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


# -- layouts against the merged-weights forward ----------------------------------------------------------


def test_peft_adapter_matches_peft_merged_weights(base_model: CausalWanDiT, peft_lora: tuple[Path, Deltas]) -> None:
    directory, deltas = peft_lora
    bank = installed(base_model, ("look", directory))  # the directory: adapter_model.safetensors + config
    assert bank.info() == [{"name": "look", "rank": 4, "layers": 23, "targets": [
        "blocks.*.cross_attn.k", "blocks.*.cross_attn.o", "blocks.*.cross_attn.q", "blocks.*.cross_attn.v",
        "blocks.*.ffn.0", "blocks.*.ffn.2", "blocks.*.self_attn.k", "blocks.*.self_attn.o", "blocks.*.self_attn.q",
        "blocks.*.self_attn.v", "head.head", "text_embedding.0", "time_embedding.0"]}]
    plain = forward(base_model)
    for strength in (1.0, 0.6):
        out = forward(base_model, bank, [{"look": strength}])
        assert_matches(out, forward(merged(base_model, (strength, deltas))))
        assert (out - plain).abs().max() > 1e-2  # the LoRA changes the output
    assert torch.equal(forward(base_model, bank, [{"look": 0.0}]), plain)  # strength 0: the base weights exactly
    assert torch.equal(forward(base_model), plain)  # outside a rows() block nothing is added


@pytest.mark.parametrize("kohya", [False, True], ids=["original", "kohya"])
def test_original_and_kohya_names_match_the_same_merge(base_model: CausalWanDiT, peft_lora: tuple[Path, Deltas],
                                                       kohya: bool) -> None:
    directory, deltas = peft_lora
    config = json.loads((directory / "adapter_config.json").read_text())
    tensors = original_layout(directory / "adapter_model.safetensors", config["lora_alpha"], kohya)
    bank = installed(base_model, ("look", tensors))
    assert_matches(forward(base_model, bank, [{"look": 0.8}]), forward(merged(base_model, (0.8, deltas))))


def test_diffusers_file_with_transformer_prefix_and_alpha_keys(base_model: CausalWanDiT,
                                                               peft_lora: tuple[Path, Deltas]) -> None:
    directory, deltas = peft_lora
    tensors = {k.replace("base_model.model.", "transformer."): v
               for k, v in load_file(str(directory / "adapter_model.safetensors")).items()}
    tensors.update({k.replace(".lora_A.weight", ".alpha"): torch.tensor(2.0) for k in list(tensors) if "lora_A" in k})
    bank = installed(base_model, ("look", tensors))  # a file alone: its alpha keys give the scale
    assert_matches(forward(base_model, bank, [{"look": 1.0}]), forward(merged(base_model, (1.0, deltas))))


def test_two_loras_mix_as_the_sum_of_their_merges(base_model: CausalWanDiT, peft_lora: tuple[Path, Deltas],
                                                  hand_lora: tuple[Path, Deltas]) -> None:
    bank = installed(base_model, ("a", peft_lora[0]), ("b", hand_lora[0]))
    expected = forward(merged(base_model, (0.7, peft_lora[1]), (-0.5, hand_lora[1])))
    assert_matches(forward(base_model, bank, [{"a": 0.7, "b": -0.5}]), expected)
    assert_matches(forward(base_model, bank, [{"b": 1.0}]), forward(merged(base_model, (1.0, hand_lora[1]))))


def test_rows_of_one_forward_keep_their_own_loras(base_model: CausalWanDiT, peft_lora: tuple[Path, Deltas],
                                                  hand_lora: tuple[Path, Deltas]) -> None:
    bank = installed(base_model, ("a", peft_lora[0]), ("b", hand_lora[0]))
    rows: list[Mapping[str, float]] = [{"a": 1.0}, {"b": 0.5}, {}]
    references = [merged(base_model, (1.0, peft_lora[1])), merged(base_model, (0.5, hand_lora[1])), base_model]
    together = forward(base_model, bank, rows, batch=3)
    g = torch.Generator().manual_seed(11)  # the same draws forward() made for its three rows
    x = torch.randn(3, CFG.in_channels, 2, 8, 8, generator=g)
    context = torch.randn(3, 5, CFG.text_dim, generator=g)
    t = torch.tensor([[300.0, 700.0]])
    expected = [ref(x[i : i + 1], t, ref.encode_prompt(context[i : i + 1])) for i, ref in enumerate(references)]
    for i, row in enumerate(rows):
        assert_matches(together[i : i + 1], expected[i])
        with bank.rows([row]):
            assert_matches(base_model(x[i : i + 1], t, base_model.encode_prompt(context[i : i + 1])), expected[i])
    assert not torch.allclose(expected[0], expected[2]) and not torch.allclose(expected[1], expected[2])


# -- the runtime: streams, batches, live changes ---------------------------------------------------------


@pytest.fixture(scope="module")
def pipe(peft_lora: tuple[Path, Deltas], hand_lora: tuple[Path, Deltas]) -> Pipeline:
    pipe = Pipeline.load("tiny-random")
    pipe.load_lora("a", peft_lora[0], strength=0.0)
    pipe.load_lora("b", hand_lora[0], strength=0.0)
    return pipe


def _chunks(pipe: Pipeline, n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    sizes = [pipe.first_chunk_frames] + [pipe.chunk_frames] * (n - 1)
    return [rng.integers(0, 256, (k, 128, 128, 3), dtype=np.uint8) for k in sizes]


def test_streams_with_different_loras_batch_like_they_run_alone(pipe: Pipeline) -> None:
    from engine.frames import frames_to_tensor

    params = [StreamParams("oil painting", loras={"a": 1.0}), StreamParams("oil painting", loras={"b": 0.8}),
              StreamParams("oil painting")]
    batched = [pipe.open_stream(p) for p in params]
    alone = [pipe.open_stream(p) for p in params]
    for chunk in _chunks(pipe):
        tensor = frames_to_tensor(chunk, len(chunk))
        together = pipe.runtime.run_chunks([s.state for s in batched], [tensor] * 3)
        single = [s.runtime.run_chunk(s.state, tensor) for s in alone]
        for t, s in zip(together, single, strict=True):
            torch.testing.assert_close(t.frames, s.frames, rtol=1e-4, atol=1e-4)
    outs = [s.frames for s in single]
    assert not torch.allclose(outs[0], outs[2], atol=1e-3) and not torch.allclose(outs[1], outs[2], atol=1e-3)


def test_strength_changes_live_without_reload(pipe: Pipeline) -> None:
    chunks = _chunks(pipe, 4)
    on, off = pipe.open_stream(StreamParams("oil painting", loras={"a": 1.0})), pipe.open_stream(
        StreamParams("oil painting", loras={"a": 1.0}))
    weights = {k: v.clone() for k, v in pipe.runtime.dit.state_dict().items()}
    for chunk in chunks[:2]:
        assert np.array_equal(on.process(chunk), off.process(chunk))
    off.update(loras={"a": 0.0, "b": 0.5})
    assert off.params.loras == {"a": 0.0, "b": 0.5} and off.state.loras == {"b": 0.5}
    assert off.stats()["loras"] == {"b": 0.5}
    with pipe.loras.rows([{"b": 0.5}]):
        expected_prompt = pipe.runtime.dit.encode_prompt(off.state.embedding)
    assert torch.equal(off.state.prompt.k[0], expected_prompt.k[0])  # cross-attention K/V re-encoded
    assert not np.array_equal(on.process(chunks[2]), off.process(chunks[2]))
    assert all(torch.equal(v, weights[k]) for k, v in pipe.runtime.dit.state_dict().items())  # base untouched
    off.reset()  # a reset keeps the stream's current strengths
    assert off.state.loras == {"b": 0.5}


def test_pipeline_default_strength_and_info(pipe: Pipeline, hand_lora: tuple[Path, Deltas]) -> None:
    assert [(i["name"], i["rank"], i["strength"]) for i in pipe.lora_info()] == [("a", 4, 0.0), ("b", 2, 0.0)]
    assert pipe.open_stream(StreamParams("x")).state.loras == {}
    with pytest.raises(LoRAError, match="already loaded"):
        pipe.load_lora("a", hand_lora[0])


# -- errors ----------------------------------------------------------------------------------------------


def _error(base_model: CausalWanDiT, tensors: dict[str, torch.Tensor]) -> str:
    with pytest.raises(LoRAError) as info:
        installed(base_model, ("bad", tensors))
    return str(info.value)


def test_loras_that_do_not_fit_are_refused_naming_key_and_shape(base_model: CausalWanDiT) -> None:
    down, up = torch.zeros(4, CFG.dim), torch.zeros(CFG.dim, 4)
    key = "diffusion_model.blocks.0.self_attn.q"
    unknown = _error(base_model, {"diffusion_model.blocks.9.self_attn.q.lora_down.weight": down,
                                  "diffusion_model.blocks.9.self_attn.q.lora_up.weight": up})
    assert "layers this model lacks" in unknown and "blocks.9.self_attn.q" in unknown
    norm = _error(base_model, {"blocks.0.self_attn.norm_q.lora_A.weight": down})
    assert "blocks.0.self_attn.norm_q" in norm
    shape = _error(base_model, {f"{key}.lora_down.weight": torch.zeros(4, 32), f"{key}.lora_up.weight": up})
    assert "blocks.0.self_attn.q" in shape and "[4, 32]" in shape and "64 -> 64" in shape
    rank = _error(base_model, {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": torch.zeros(CFG.dim, 8)})
    assert "rank mismatch" in rank and "[64, 8]" in rank
    half = _error(base_model, {f"{key}.lora_down.weight": down})
    assert "no up factor" in half
    assert "holds no LoRA tensors" in _error(base_model, {})
    foreign = _error(base_model, {"blocks.0.self_attn.q.weight": torch.zeros(CFG.dim, CFG.dim),
                                  f"{key}.diff_b": torch.zeros(CFG.dim)})
    assert "not LoRA factors" in foreign and "blocks.0.self_attn.q.weight" in foreign and "diff_b" in foreign


def test_unreadable_files(base_model: CausalWanDiT, tmp_path: Path) -> None:
    bank = LoRABank(base_model)
    with pytest.raises(LoRAError, match="file not found"):
        load_lora(tmp_path / "missing.safetensors", bank, "x")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAError, match="cannot read safetensors"):
        load_lora(tmp_path / "junk.safetensors", bank, "x")


def test_strengths_are_checked(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams("x"))
    for bad, message in (({"a": float("nan")}, "finite"), ({"a": MAX_LORA_STRENGTH + 1}, "finite number in"),
                         ({"zzz": 1.0}, "no LoRA named 'zzz'")):
        with pytest.raises(LoRAError, match=message):
            stream.update(loras=bad, noise_scale=0.5)
        assert stream.params.noise_scale == 0.8 and stream.state.loras == {}  # a refused update changes nothing
    with pytest.raises(LoRAError, match="no LoRA named"):
        pipe.open_stream(StreamParams("x", loras={"zzz": 1.0}))


def test_a_look_transition_glides_the_lora_strengths_chunk_by_chunk(pipe: Pipeline) -> None:
    """A gradual update (what a cue sends) takes the LoRA strengths along with the prompt: each chunk
    of the transition runs, and encodes its prompt, at the strengths between the two looks."""
    chunks = _chunks(pipe, 3)
    stream = pipe.open_stream(StreamParams("oil painting", loras={"a": 1.0}))
    stream.process(chunks[0])
    stream.update(prompt="ink wash", loras={"a": 0.0, "b": 0.5}, transition_chunks=2)
    assert stream.state.loras == {"a": 1.0}, "nothing jumps before the next chunk"
    stream.process(chunks[1])
    assert stream.state.loras == pytest.approx({"a": 0.5, "b": 0.25})
    with pipe.loras.rows([{"a": 0.5, "b": 0.25}]):
        expected_prompt = pipe.runtime.dit.encode_prompt(stream.state.embedding)
    torch.testing.assert_close(stream.state.prompt.k[0], expected_prompt.k[0], rtol=0, atol=0)
    stream.process(chunks[2])
    assert stream.state.loras == {"b": 0.5} and stream.state.transition is None
