"""Tests of minimind_lib.model: MiniMind2 key names, parameter count, logits equal an independent reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from minimind_lib.model import (
    MiniMindConfig,
    MiniMindForCausalLM,
    count_parameters,
    lm_loss,
)
from minimind_lib.checkpoint import load_checkpoint, save_checkpoint

KEYS_JSON = Path(__file__).resolve().parents[2] / "shared" / "minimind2_small_keys.json"

# MiniMind2-small's key names and shapes (from shared/minimind2_small_keys.json), written out here so that the
# test does not depend on a file outside the repository: 3 top-level keys + 9 per layer x 8 layers.
_LAYER_SHAPES = {
    "self_attn.q_proj.weight": [512, 512], "self_attn.k_proj.weight": [128, 512],
    "self_attn.v_proj.weight": [128, 512], "self_attn.o_proj.weight": [512, 512],
    "input_layernorm.weight": [512], "post_attention_layernorm.weight": [512],
    "mlp.gate_proj.weight": [1408, 512], "mlp.down_proj.weight": [512, 1408], "mlp.up_proj.weight": [1408, 512],
}
MINIMIND2_SMALL_SHAPES = {
    "model.embed_tokens.weight": [6400, 512], "model.norm.weight": [512], "lm_head.weight": [6400, 512],
    **{f"model.layers.{i}.{k}": v for i in range(8) for k, v in _LAYER_SHAPES.items()},
}


# ------------------------------------------------------------------------------------------------------------
# An independent reference, written from DESIGN.md as a plain function over a state dict (no shared code).


def reference_forward(sd: dict, input_ids: torch.Tensor, n_heads: int, n_kv: int, theta: float = 1e6,
                      eps: float = 1e-5, positions: torch.Tensor | None = None,
                      allowed: torch.Tensor | None = None) -> torch.Tensor:
    """MiniMind2 logits by the spec, with explicit softmax attention; allowed (B, T, T) bool overrides causal."""
    b, t = input_ids.shape
    emb = sd["model.embed_tokens.weight"]
    hidden = emb.shape[1]
    d = hidden // n_heads
    n_layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))

    def rmsnorm(x, w):
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x)

    pos = torch.arange(t).expand(b, t) if positions is None else positions
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = pos[..., None].float() * inv  # (B, T, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None, :]

    def rot(x):
        return torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)

    if allowed is None:
        allowed = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
    x = emb[input_ids]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        h = rmsnorm(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(b, t, n_heads, d)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(b, t, n_kv, d)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(b, t, n_kv, d)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k = k.repeat_interleave(n_heads // n_kv, dim=2)  # kv head j serves query heads j*rep .. j*rep+rep-1
        v = v.repeat_interleave(n_heads // n_kv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, hidden)
        x = x + att @ sd[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, sd[p + "post_attention_layernorm.weight"])
        g = h @ sd[p + "mlp.gate_proj.weight"].T
        u = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ sd[p + "mlp.down_proj.weight"].T
    return rmsnorm(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def random_state_dict(shapes: dict, seed: int = 0) -> dict:
    """Random weights of the given shapes (norm gains near 1), tied lm_head = embed_tokens."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in shapes.items():
        if k == "lm_head.weight":
            continue
        if k.endswith("norm.weight"):
            sd[k] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[k] = 0.05 * torch.randn(shape, generator=g)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


@pytest.fixture(scope="module")
def smoke():
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig.preset("smoke")).eval()


# ------------------------------------------------------------------------------------------------------------
# Shapes, names, counts


def test_minimind2_small_keys_and_shapes_match_minimind():
    model = MiniMindForCausalLM(MiniMindConfig.preset("minimind2-small"))
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert got == MINIMIND2_SMALL_SHAPES
    if KEYS_JSON.exists():  # the team's copy of MiniMind's key file, when present beside the repo
        assert got == json.loads(KEYS_JSON.read_text())
    assert "model.freqs_cos" not in got  # rotary tables are non-persistent buffers, as in MiniMind


def test_minimind2_small_parameter_count():
    model = MiniMindForCausalLM(MiniMindConfig.preset("minimind2-small"))
    assert sum(p.numel() for p in model.parameters()) == 25_829_888
    counts = count_parameters(model)
    assert counts["total"] == 25_829_888
    assert counts == {"embeddings": 6400 * 512, "attention": 8 * (2 * 512 * 512 + 2 * 128 * 512),
                      "mlp": 8 * 3 * 512 * 1408, "norms": 17 * 512, "total": 25_829_888}
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_config_defaults_presets_and_roundtrip():
    c = MiniMindConfig()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (512, 8, 8, 2)
    assert c.intermediate_size == 1408 and c.head_dim == 64 and c.rope_theta == 1e6
    assert MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2).intermediate_size == 192
    for name in ("minimind2-small", "cpu", "smoke"):
        cfg = MiniMindConfig.preset(name)
        assert cfg.vocab_size == 6400
        assert MiniMindConfig.from_dict(cfg.to_dict()) == cfg
    assert MiniMindConfig.preset("smoke", num_hidden_layers=3).num_hidden_layers == 3


def test_config_errors():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        MiniMindConfig.preset("huge")
    with pytest.raises(ValueError, match="not divisible by num_attention_heads"):
        MiniMindConfig(hidden_size=100, num_attention_heads=8)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads=3"):
        MiniMindConfig(num_attention_heads=8, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"unknown MiniMindConfig field\(s\) \['hiden_size'\]"):
        MiniMindConfig.from_dict({"hiden_size": 3})


# ------------------------------------------------------------------------------------------------------------
# Logits equivalence with the reference


def test_logits_match_reference_random_small(smoke):
    x = torch.randint(0, 6400, (2, 24), generator=torch.Generator().manual_seed(1))
    sd = {k: v.detach() for k, v in smoke.state_dict().items()}
    with torch.no_grad():
        ours = smoke(x).logits
    ref = reference_forward(sd, x, n_heads=4, n_kv=2)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_logits_match_reference_minimind2_small_shapes():
    sd = random_state_dict(MINIMIND2_SMALL_SHAPES)
    # max_position_embeddings only sizes the (non-persistent) RoPE tables: the state dict is MiniMind2-small's
    model = MiniMindForCausalLM(MiniMindConfig.preset("minimind2-small", max_position_embeddings=64)).eval()
    model.load_state_dict(sd, strict=True)  # a MiniMind2 .pth state dict loads strictly
    x = torch.randint(0, 6400, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(x).logits
    torch.testing.assert_close(ours, reference_forward(sd, x, n_heads=8, n_kv=2), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------------
# Loss, causality, masks, positions


def test_loss_mean_is_sum_over_count(smoke):
    torch.manual_seed(3)
    x = torch.randint(0, 6400, (3, 16))
    labels = x.clone()
    labels[0, :5] = -100
    labels[2, 10:] = -100
    out = smoke(x, labels=labels)
    s = lm_loss(out.logits, labels, reduction="sum")
    n = (labels[:, 1:] != -100).sum()
    torch.testing.assert_close(out.loss, s / n)
    assert out.loss.dtype == torch.float32
    # untrained (std 0.02 init): close to uniform over the vocabulary
    assert abs(out.loss.item() - math.log(6400)) < 0.5


def test_lm_loss_errors():
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        lm_loss(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=torch.long), reduction="none")
    with pytest.raises(ValueError, match="disagree on"):
        lm_loss(torch.zeros(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))


def test_causal_future_token_does_not_change_past(smoke):
    x = torch.randint(0, 6400, (1, 16), generator=torch.Generator().manual_seed(4))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % 6400
    with torch.no_grad():
        a, b = smoke(x).logits, smoke(y).logits
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_padding_mask_matches_unpadded(smoke):
    g = torch.Generator().manual_seed(5)
    short, full = torch.randint(3, 6400, (7,), generator=g), torch.randint(3, 6400, (12,), generator=g)
    batch = torch.stack([torch.cat([short, torch.zeros(5, dtype=torch.long)]), full])
    mask = torch.stack([torch.cat([torch.ones(7), torch.zeros(5)]), torch.ones(12)]).long()
    with torch.no_grad():
        padded = smoke(batch, attention_mask=mask).logits
        torch.testing.assert_close(padded[0, :7], smoke(short[None]).logits[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(padded[1], smoke(full[None]).logits[0], atol=1e-5, rtol=1e-4)
        # left padding: the pad rows have no real key; they must stay finite (no NaN)
        left = smoke(torch.cat([torch.zeros(5, dtype=torch.long), short])[None],
                     attention_mask=torch.cat([torch.zeros(5), torch.ones(7)]).long()[None]).logits
    assert torch.isfinite(left).all()


def test_block_mask_and_position_ids_equal_separate_forwards(smoke):
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(3, 6400, (n,), generator=g) for n in (5, 8, 3)]
    row = torch.cat(docs)[None]
    doc_id = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])
    t = len(doc_id)
    block = (doc_id[:, None] == doc_id[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        packed = smoke(row, attention_mask=block[None, None], position_ids=positions).logits[0]
        start = 0
        for d in docs:
            torch.testing.assert_close(packed[start:start + len(d)], smoke(d[None]).logits[0], atol=1e-5, rtol=1e-4)
            start += len(d)
    sd = {k: v.detach() for k, v in smoke.state_dict().items()}
    ref = reference_forward(sd, row, 4, 2, positions=positions, allowed=block[None])
    torch.testing.assert_close(packed, ref[0], atol=1e-5, rtol=1e-4)


def test_kv_cache_matches_full_forward(smoke):
    x = torch.randint(0, 6400, (2, 14), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = smoke(x).logits
        first = smoke(x[:, :9], use_cache=True)
        rest = smoke(x[:, 9:], past_key_values=first.past_key_values, use_cache=True)  # a chunk with a cache
        step = smoke(x[:, 13:], past_key_values=smoke(x[:, :13], use_cache=True).past_key_values)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step.logits[:, 0], full[:, 13], atol=1e-5, rtol=1e-4)
    k, v = rest.past_key_values[0]
    assert k.shape == v.shape == (2, 14, 2, 16)  # (B, past+T, n_kv_heads, head_dim)
    assert len(rest.past_key_values) == 2


def test_mask_and_position_errors(smoke):
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"padding attention_mask has shape \(1, 5\)"):
        smoke(x, attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="4-D attention_mask must be bool"):
        smoke(x, attention_mask=torch.ones(1, 1, 4, 4))
    with pytest.raises(ValueError, match=r"block attention_mask has shape \(1, 1, 3, 3\)"):
        smoke(x, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be \\(B, T\\) padding or"):
        smoke(x, attention_mask=torch.ones(1, 4, 4))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=2048"):
        smoke(torch.zeros(1, 2049, dtype=torch.long))
    with pytest.raises(ValueError, match=r"position_ids range \[0, 5000\]"):
        smoke(x, position_ids=torch.tensor([[0, 1, 2, 5000]]))


def test_backward_reaches_every_parameter(smoke):
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    x = torch.randint(0, 6400, (2, 8))
    model(x, labels=x).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_roundtrip_atomic(tmp_path, smoke):
    path = save_checkpoint(smoke, tmp_path / "sub" / "m.pth")
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    other = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    load_checkpoint(path, other)
    x = torch.randint(0, 6400, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(x).logits, smoke(x).logits)
    assert other.lm_head.weight is other.model.embed_tokens.weight  # still tied after loading


def test_checkpoint_minimind_style_prefixes_and_half(tmp_path, smoke):
    # MiniMind saves bare state dicts in half precision; DDP / torch.compile add key prefixes.
    sd = {"_orig_mod.module." + k: v.half() for k, v in smoke.state_dict().items()}
    torch.save(sd, tmp_path / "pretrain_64.pth")
    other = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    with pytest.warns(UserWarning, match="stripped prefix 'module.'"):
        load_checkpoint(tmp_path / "pretrain_64.pth", other)
    torch.testing.assert_close(other.model.norm.weight, smoke.model.norm.weight.half().float())


def test_checkpoint_errors(tmp_path, smoke):
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    with pytest.raises(FileNotFoundError, match="checkpoint not found: .*nope.pth"):
        load_checkpoint(tmp_path / "nope.pth", model)
    bad = tmp_path / "corrupt.pth"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="cannot read checkpoint .*corrupt.pth"):
        load_checkpoint(bad, model)
    sd = smoke.state_dict()
    torch.save({k: v for k, v in sd.items() if k != "model.norm.weight"}, tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="missing.pth: missing key 'model.norm.weight'"):
        load_checkpoint(tmp_path / "missing.pth", model)
    torch.save({**sd, "model.extra.weight": torch.zeros(1)}, tmp_path / "extra.pth")
    with pytest.raises(ValueError, match="unexpected key 'model.extra.weight'"):
        load_checkpoint(tmp_path / "extra.pth", model)
    wide = MiniMindForCausalLM(MiniMindConfig.preset("smoke", intermediate_size=256))
    torch.save(wide.state_dict(), tmp_path / "wide.pth")
    with pytest.raises(ValueError, match=r"shape mismatch at 'model.layers.0.mlp.gate_proj.weight': "
                                         r"expected \[192, 64\], got \[256, 64\]"):
        load_checkpoint(tmp_path / "wide.pth", model)
    big_vocab = MiniMindForCausalLM(MiniMindConfig.preset("smoke", vocab_size=6500))
    torch.save(big_vocab.state_dict(), tmp_path / "vocab.pth")
    with pytest.raises(ValueError, match="vocab size mismatch: checkpoint has 6500 tokens"):
        load_checkpoint(tmp_path / "vocab.pth", model)
    torch.save({"w": torch.nn.Linear(2, 2)}, tmp_path / "pickled.pth")  # an object: weights_only refuses it
    with pytest.raises(ValueError, match="cannot read checkpoint .*pickled.pth"):
        load_checkpoint(tmp_path / "pickled.pth", model)


def test_bf16_weights_and_autocast_run_with_fp32_loss():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    x = torch.randint(0, 6400, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels=x)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    half = MiniMindForCausalLM(MiniMindConfig.preset("smoke")).to(torch.bfloat16)
    out = half(x, labels=x)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


def test_load_checkpoint_takes_model_entry_of_training_checkpoint(tmp_path, smoke):
    torch.save({"format": "minimind_lib.train", "step": 3, "model": smoke.state_dict()}, tmp_path / "train.pt")
    other = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    with pytest.warns(UserWarning, match="a training checkpoint; using its 'model' entry"):
        state = load_checkpoint(tmp_path / "train.pt", other)
    assert set(state) == set(smoke.state_dict())
    torch.testing.assert_close(other.model.norm.weight, smoke.model.norm.weight)
