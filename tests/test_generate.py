"""Tests of minimind_lib.generate: KV-cached decoding equals uncached, sampling filters, stop tokens, streaming."""

from __future__ import annotations

import pytest
import torch

from minimind_lib.generate import generate, generate_ids, sample_next
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM


class FakeTokenizer:
    """Bytes as tokens 3..258 (0 pad, 1 bos, 2 eos): enough of the Tokenizer API for generate()."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def encode(self, text, add_special_tokens=False):
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens=False):
        data = bytes(i - 3 for i in ids if 3 <= i < 259)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id):
        return bytes([token_id - 3])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=300)).eval()


def test_cached_and_uncached_greedy_are_identical(model):
    prompt = torch.tensor([1, 50, 60, 70, 80])
    cached = generate_ids(model, prompt, max_new_tokens=20, temperature=0, use_cache=True)
    uncached = generate_ids(model, prompt, max_new_tokens=20, temperature=0, use_cache=False)
    assert cached.shape == (1, 20)
    assert torch.equal(cached, uncached)


def test_cached_and_uncached_sampling_identical_with_seed(model):
    prompt = torch.tensor([[1, 5, 6]])
    a = generate_ids(model, prompt, 12, temperature=1.0, top_k=50, top_p=0.9, seed=3, use_cache=True)
    b = generate_ids(model, prompt, 12, temperature=1.0, top_k=50, top_p=0.9, seed=3, use_cache=False)
    assert torch.equal(a, b)
    c = generate_ids(model, prompt, 12, temperature=1.0, seed=4)
    assert c.shape == (1, 12)


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    assert sample_next(logits, temperature=0).item() == 1
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws <= {1, 2} and len(draws) == 2
    draws = {sample_next(logits, 1.0, top_p=0.01, generator=g).item() for _ in range(50)}
    assert draws == {1}  # the nucleus always keeps the most likely token
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample_next(logits, temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        sample_next(logits, top_p=0)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        sample_next(logits, top_k=-2)


def test_stop_token_and_stream(model):
    prompt = torch.tensor([1, 10, 11])
    free = generate_ids(model, prompt, 10, temperature=0)[0].tolist()
    stop = free[3]
    seen = []
    stopped = generate_ids(model, prompt, 10, temperature=0, stop_token_ids=[stop], stream=seen.append)[0].tolist()
    assert stopped == free[: free.index(stop) + 1]  # ends with the stop token
    assert seen == stopped


def test_generate_text_with_fake_tokenizer(model):
    tok = FakeTokenizer()
    pieces = []
    text = generate(model, tok, "hi", max_new_tokens=8, temperature=0, stream=pieces.append)
    assert isinstance(text, str)
    assert "".join(pieces) == text  # the returned text is what was streamed, the held bytes flushed
    assert text == generate(model, tok, "hi", max_new_tokens=8, temperature=0, use_cache=False)


def test_generate_with_real_tokenizer_if_present():
    tokenizer_mod = pytest.importorskip("minimind_lib.tokenizer")
    try:
        tok = tokenizer_mod.load_tokenizer()
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"tokenizer asset not available: {e}")
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke")).eval()
    text = generate(model, tok, "To be", max_new_tokens=8, temperature=0.8, top_k=20, seed=0)
    assert isinstance(text, str)


def test_generate_ids_errors(model):
    with pytest.raises(ValueError, match="one sequence"):
        generate_ids(model, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate_ids(model, torch.zeros(1, 0, dtype=torch.long))


def test_generation_stops_at_context_limit():
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke", max_position_embeddings=16)).eval()
    with pytest.warns(UserWarning, match="generating 6 of the 50 new tokens"):
        out = generate_ids(model, torch.arange(1, 11), max_new_tokens=50, temperature=0)
    assert out.shape == (1, 6)  # 10 prompt tokens + 6 new = the 16 positions of the RoPE table
