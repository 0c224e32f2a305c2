"""MiniMind-3's mixture of experts: the preset's keys and size, strict loading both ways, logits and the load-balancing
loss against a reference written from the spec, the aux loss in token-weighted accumulation, its metrics column, the
memory estimate with experts, and the tiny MoE through the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_minimind3 import reference_logits

from minimind_lib.checkpoint import load_checkpoint, save_checkpoint
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, MoEFeedForward, count_parameters

KEYS_MOE = Path(__file__).resolve().parents[2] / "shared" / "minimind3_moe_keys.json"
# MiniMind-3-MoE's key names and shapes (shared/minimind3_moe_keys.json, 171 keys), written out here so that the test
# does not depend on a file outside the repository: 3 top-level keys + 21 per layer x 8 layers.
_LAYER_SHAPES = {
    "self_attn.q_proj.weight": [768, 768], "self_attn.k_proj.weight": [384, 768], "self_attn.v_proj.weight": [384, 768],
    "self_attn.o_proj.weight": [768, 768], "self_attn.q_norm.weight": [96], "self_attn.k_norm.weight": [96],
    "input_layernorm.weight": [768], "post_attention_layernorm.weight": [768], "mlp.gate.weight": [4, 768],
    **{f"mlp.experts.{e}.{name}.weight": shape for e in range(4)
       for name, shape in (("gate_proj", [2432, 768]), ("down_proj", [768, 2432]), ("up_proj", [2432, 768]))},
}
MOE_SHAPES = {
    "model.embed_tokens.weight": [6400, 768], "model.norm.weight": [768], "lm_head.weight": [6400, 768],
    **{f"model.layers.{i}.{k}": v for i in range(8) for k, v in _LAYER_SHAPES.items()},
}


def tiny_moe(**overrides) -> MiniMindConfig:
    """MiniMind-3-MoE's layout at a size a CPU test runs in milliseconds."""
    return MiniMindConfig(**{**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=97, intermediate_size=96, qk_norm=True, rms_norm_eps=1e-6,
                                    max_position_embeddings=64, use_moe=True), **overrides})


def fresh(config: MiniMindConfig, seed: int = 0) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    model = MiniMindForCausalLM(config)
    with torch.no_grad():  # router weights large enough that the experts' scores are far apart (no near-ties)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


# ------------------------------------------------------------------ the preset and its keys
def test_moe_preset_has_its_size_and_exact_keys():
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig.preset("minimind-3-moe"))
    assert count_parameters(model)["total"] == 198_416_640
    c = model.config
    assert (c.use_moe, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (True, 4, 1, 2432)
    assert (c.norm_topk_prob, c.router_aux_loss_coef, c.hidden_size, c.qk_norm) == (True, 5e-4, 768, True)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert len(MOE_SHAPES) == 171 and shapes == MOE_SHAPES
    if KEYS_MOE.is_file():  # the key list read off MiniMind-3's own model code, where it is at hand
        assert shapes == json.loads(KEYS_MOE.read_text())
    # dense minimind-3 + 3 more experts per layer + the router: 63,912,192 + 8 x (3 x 3 x 768 x 2432 + 4 x 768)
    assert 198_416_640 == 63_912_192 + 8 * (3 * 3 * 768 * 2432 + 4 * 768)


def test_moe_config_fields_defaults_and_errors():
    dense = MiniMindConfig.preset("minimind-3")
    assert dense.use_moe is False and dense.moe_intermediate_size == dense.intermediate_size == 2432
    assert MiniMindConfig.from_dict(MiniMindConfig.preset("minimind-3-moe").to_dict()).use_moe is True
    new = ("use_moe", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
           "router_aux_loss_coef")
    # a dense config.json reads as before MoE (so runs made before it resume), and such a config still loads
    assert not set(new) & set(dense.to_dict()) and MiniMindConfig.from_dict(dense.to_dict()) == dense
    assert set(new) <= set(MiniMindConfig.preset("minimind-3-moe").to_dict())
    assert tiny_moe(moe_intermediate_size=32).moe_intermediate_size == 32
    with pytest.raises(ValueError, match="num_experts_per_tok=5: must be an integer from 1 to num_experts=4"):
        tiny_moe(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts=0"):
        tiny_moe(num_experts=0)


def test_strict_load_both_ways(tmp_path):
    """A state dict built from MiniMind-3-MoE's key list alone (as its code saves it) loads into ours strictly; ours
    saves exactly those keys; the dense preset refuses MoE weights with the key named."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig.preset("minimind-3-moe"))
    g = torch.Generator().manual_seed(0)
    theirs = {k: torch.randn(s, generator=g) * 0.02 for k, s in MOE_SHAPES.items()}
    theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]  # tied, as MiniMind saves it
    model.load_state_dict(theirs, strict=True, assign=True)
    assert torch.equal(model.model.layers[5].mlp.experts[2].up_proj.weight,
                       theirs["model.layers.5.mlp.experts.2.up_proj.weight"])
    assert set(model.state_dict()) == set(MOE_SHAPES)
    small = MiniMindForCausalLM(tiny_moe())  # through a file, as a run's model.pth
    save_checkpoint(small, tmp_path / "moe.pth")
    again = MiniMindForCausalLM(tiny_moe())
    load_checkpoint(tmp_path / "moe.pth", again)
    assert all(torch.equal(a, b) for a, b in zip(small.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ValueError, match="missing key 'model.layers.0.mlp.gate_proj.weight'"):
        load_checkpoint(tmp_path / "moe.pth", MiniMindForCausalLM(tiny_moe(use_moe=False)))


# ------------------------------------------------------------------ a reference, written from the spec
def reference_moe(sd: dict, c: MiniMindConfig, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, aux) of MiniMind-3-MoE: the dense reference of tests/test_minimind3.py with, token by token,
    softmax router scores, the k best experts (sorted), their scores renormalised (+1e-20) when norm_topk_prob, output
    sum_e w_e * SwiGLU_e(h); per layer aux = coef * E * sum_e (picks of e / tokens) * (mean score of e over every
    position), summed over layers."""
    E, aux = c.num_experts, [torch.zeros(())]

    def moe_ffn(h, p):
        b, t, _ = h.shape
        h = h.reshape(b * t, -1)
        scores = torch.exp(h @ p("mlp.gate").T)
        scores = scores / scores.sum(-1, keepdim=True)
        out, picks = torch.zeros_like(h), torch.zeros(E)
        for n in range(b * t):
            best = sorted(range(E), key=lambda e: -float(scores[n, e]))[: c.num_experts_per_tok]
            w = scores[n, best]
            w = w / (w.sum() + 1e-20) if c.norm_topk_prob else w
            for e, we in zip(best, w):
                picks[e] += 1
                ex = lambda name: p(f"mlp.experts.{e}.{name}")
                out[n] += we * ((F.silu(h[n] @ ex("gate_proj").T) * (h[n] @ ex("up_proj").T)) @ ex("down_proj").T)
        aux[0] = aux[0] + c.router_aux_loss_coef * E * (picks / (b * t) * scores.mean(0)).sum()
        return out.view(b, t, -1)

    return reference_logits(sd, c, ids, moe_ffn), aux[0]


@pytest.mark.parametrize("k, norm", [(1, True), (2, True), (2, False), (3, False)])
def test_logits_and_aux_equal_the_reference(k, norm):
    c = tiny_moe(num_experts_per_tok=k, norm_topk_prob=norm, router_aux_loss_coef=0.1)
    model = fresh(c)
    ids = torch.randint(0, c.vocab_size, (2, 11), generator=torch.Generator().manual_seed(k))
    ref_logits, ref_aux = reference_moe({n: v.detach() for n, v in model.state_dict().items()}, c, ids)
    with torch.no_grad():
        out = model.train()(ids)  # dropout 0: training changes nothing but the aux loss
        assert torch.allclose(out.logits, ref_logits, atol=1e-5, rtol=1e-4), (out.logits - ref_logits).abs().max()
        assert torch.allclose(out.aux_loss, ref_aux, rtol=1e-5), (out.aux_loss, ref_aux)
        evaluated = model.eval()(ids)
    assert evaluated.aux_loss is None and torch.equal(evaluated.logits, out.logits)  # no aux loss outside training
    if k == 1 and norm:  # one expert, renormalised: its weight is 1, the output is exactly that expert's SwiGLU
        layer = model.model.layers[0].mlp
        h = torch.randn(5, c.hidden_size)
        with torch.no_grad():
            best = layer.gate(h).argmax(-1)
            assert torch.allclose(layer(h[None])[0], torch.stack([layer.experts[int(e)](r) for e, r in zip(best, h)]),
                                  atol=1e-6)


def test_aux_counts_padding_positions_and_is_minimal_when_balanced():
    c = tiny_moe(router_aux_loss_coef=1.0)
    layer = MoEFeedForward(c).train()
    with torch.no_grad():
        layer.gate.weight.zero_()  # every score 1/E: load sums to k, so aux = coef * E * k / E = k
    layer(torch.randn(3, 7, c.hidden_size))
    assert torch.allclose(layer.aux_loss, torch.tensor(1.0))
    model, ids = fresh(c), torch.randint(0, 97, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0  # right padding: the router still sees (and the aux counts) every position, as MiniMind-3's
    ref = reference_moe({n: v.detach() for n, v in model.state_dict().items()}, c, ids)[1]
    assert torch.allclose(model.train()(ids, attention_mask=mask).aux_loss, ref, rtol=1e-5)


def test_every_parameter_gets_a_gradient_even_an_unused_expert():
    """Data parallel training needs a gradient for every parameter each step: an expert no token chose gets zeros."""
    model = fresh(tiny_moe())
    ids = torch.randint(0, 97, (1, 1))  # one token, top-1: in each layer one expert works and three idle
    out = model.train()(ids)  # no labels: one token predicts nothing (its loss is undefined)
    (out.logits.sum() + out.aux_loss).backward()
    assert all(p.grad is not None for p in model.parameters())
    for layer in model.model.layers:
        used = [bool(e.up_proj.weight.grad.abs().sum() > 0) for e in layer.mlp.experts]
        assert sum(used) == 1, used
        assert layer.mlp.gate.weight.grad.abs().sum() > 0  # the router learns from the loss and the aux loss


def test_kv_cache_steps_equal_the_full_forward():
    model = fresh(tiny_moe(num_experts_per_tok=2)).eval()
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :7], use_cache=True)
        step = model(ids[:, 7:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(step.logits, full[:, 7:], atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ the aux loss in training
def micro_batches(lengths: list[list[int]], vocab: int = 97, seed: int = 0) -> list[dict]:
    """Collated micro-batches of random rows of the given lengths (right-padded, pads not trained)."""
    from minimind_lib.data import pad_collate
    g = torch.Generator().manual_seed(seed)
    return [pad_collate([{"input_ids": (ids := torch.randint(1, vocab, (n,), generator=g)), "labels": ids.clone()}
                         for n in rows]) for rows in lengths]


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_accumulated_aux_is_each_micro_batch_weighted_by_its_tokens():
    """accumulate_step trains sum_i (LM loss sum_i + n_i * aux_i) / N: the aux of each micro-batch, alone, weighted by
    its share n_i / N of the step's trained tokens; it reports the LM loss and the aux apart."""
    from minimind_lib.data import trained_tokens
    from minimind_lib.train import accumulate_step
    model = fresh(tiny_moe(router_aux_loss_coef=0.5)).train()
    mbs = micro_batches([[12, 5, 9], [3], [7, 7]])  # unequal token counts: weights 1/3 each would differ
    stats = accumulate_step(model, mbs)
    g_acc = grads(model)
    model.zero_grad(set_to_none=True)
    n = [trained_tokens(mb["labels"]) for mb in mbs]
    total, lm, aux = 0.0, 0.0, 0.0
    for mb, n_i in zip(mbs, n):  # each micro-batch alone, by the definition
        out = model(mb["input_ids"], attention_mask=mb["attention_mask"])
        lm_sum = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97), mb["labels"][:, 1:].reshape(-1), reduction="sum")
        total = total + (lm_sum + n_i * out.aux_loss) / sum(n)
        lm, aux = lm + lm_sum.item(), aux + n_i * out.aux_loss.item() / sum(n)
    total.backward()
    assert stats["n_tokens"] == sum(n) and math.isclose(stats["loss"], lm / sum(n), rel_tol=1e-5)
    assert math.isclose(stats["aux_loss"], aux, rel_tol=1e-5) and stats["aux_loss"] > 0
    torch.testing.assert_close(g_acc, grads(model), atol=1e-7, rtol=1e-4)
    model.zero_grad(set_to_none=True)  # "naive" is MiniMind-3's loop: (mean LM loss_i + aux_i) / k
    naive = accumulate_step(model, mbs, normalization="naive")
    with torch.no_grad():
        assert math.isclose(naive["aux_loss"], sum(model(mb["input_ids"]).aux_loss.item() for mb in mbs) / 3,
                            rel_tol=1e-5)
    assert not math.isclose(naive["aux_loss"], stats["aux_loss"], rel_tol=1e-3)  # the weighting matters here


def test_accumulated_equals_unaccumulated_aux():
    """One micro-batch of all rows, or the same rows split in micro-batches: the same loss, aux and gradient when the
    micro-batches are alike (here: copies), however many and however large."""
    from minimind_lib.train import accumulate_step
    model = fresh(tiny_moe(router_aux_loss_coef=0.5)).train()
    rows = [[9, 9, 9]]
    one = micro_batches(rows)[0]
    whole = {k: torch.cat([v] * 3) for k, v in one.items()}  # 9 rows in one micro-batch
    results = []
    for step in ([whole], [one, one, one], [{k: v[:6] for k, v in whole.items()}, one]):
        model.zero_grad(set_to_none=True)
        results.append((accumulate_step(model, step), grads(model)))
    (s0, g0), rest = results[0], results[1:]
    for s, g in rest:
        assert math.isclose(s["aux_loss"], s0["aux_loss"], rel_tol=1e-5)
        assert math.isclose(s["loss"], s0["loss"], rel_tol=1e-5)
        torch.testing.assert_close(g, g0, atol=1e-7, rtol=1e-4)
    with torch.no_grad():  # and the aux of that step is the model's own aux loss of the whole batch
        assert math.isclose(s0["aux_loss"], model(whole["input_ids"]).aux_loss.item(), rel_tol=1e-5)


def test_fit_logs_the_aux_loss_as_a_column_only_for_moe():
    from minimind_lib.train import TrainConfig, fit
    data = micro_batches([[16, 16], [16, 16], [16, 12]])
    cfg = TrainConfig(max_steps=3, accum_steps=1, warmup_steps=1, amp="off", progress=False, lr=1e-2)
    moe = fit(fresh(tiny_moe()), data, cfg, device="cpu")
    dense = fit(MiniMindForCausalLM(tiny_moe(use_moe=False)), data, cfg, device="cpu")
    assert "aux_loss" in moe and moe["aux_loss"].gt(0).all() and moe["aux_loss"].lt(0.01).all()  # >= coef * k per layer
    assert "aux_loss" not in dense


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("experts, k, amp", [(4, 1, "off"), (8, 3, "off"), (4, 2, "bf16")])
def test_memory_estimate_counts_the_experts(experts, k, amp):
    """estimate_memory against one real training step measured by MemoryMeter (fake tensors cannot route tokens)."""
    from minimind_lib.memory import estimate_memory, measure_step_memory
    c = tiny_moe(num_experts=experts, num_experts_per_tok=k, max_position_embeddings=128)
    real = measure_step_memory(c, 4, 64, amp=amp)
    est = estimate_memory(c, 4, 64, amp=amp)
    assert est["n_params"] == real["n_params"] == count_parameters(MiniMindForCausalLM(c))["total"]
    assert abs(est["peak_bytes"] / real["peak_bytes"] - 1) < 0.05  # stated tolerance 5% (seen: within 0.5-1.6%)
    dense = estimate_memory(tiny_moe(use_moe=False, max_position_embeddings=128), 4, 64, amp=amp)
    assert est["optimizer_bytes"] - dense["optimizer_bytes"] == 8 * 2 * ((experts - 1) * 3 * 64 * 96 + experts * 64)
    assert est["activations_bytes"] > dense["activations_bytes"]  # k routed copies of every token, and the router
    with pytest.raises(ValueError, match="cannot route tokens to experts"):
        measure_step_memory(c, 1, 8, fake=True)


def test_active_parameters_of_the_preset():
    from minimind_lib.memory import estimate_memory
    est = estimate_memory(MiniMindConfig.preset("minimind-3-moe"), 1, 8)
    # all 4 experts are stored, trained and held by AdamW; a token runs 1 of them (and the router): dense + router
    assert (est["n_params"], est["n_active_params"]) == (198_416_640, 63_912_192 + 8 * 4 * 768)
    assert est["optimizer_bytes"] == 8 * 198_416_640
    dense = estimate_memory(MiniMindConfig.preset("minimind-3"), 1, 8)
    assert dense["n_active_params"] == dense["n_params"] == 63_912_192


# ------------------------------------------------------------------ the command line, and MiniMind-3's scripts
TINY = ["--profile", "smoke", "--seq-len", "32", "--max-tokens", "128", "--accum", "2", "--max-samples", "48",
        "--val-batches", "1", "--no-progress"]


def readme_block(after: str, lang: str) -> str:
    """The first ```lang block of README.md after the line containing `after` (the commands the README shows)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rest = text[text.index(after):]
    start = rest.index(f"```{lang}\n") + len(lang) + 4
    return rest[start:rest.index("```", start)]


def test_tiny_moe_through_the_command_line_and_minimind3_scripts(tmp_path, monkeypatch, capsys):
    """pretrain/sft/chat with a MoE preset (a tiny one: the full preset trains too slowly for a test), the run handed
    over as README says (MiniMind-3's file name, loaded strictly the way eval_llm.py loads it), and a MiniMind-3 .pth
    (fp16, as MiniMind-3 saves it) made a run by README's snippet, then chat and sft --init on it."""
    import pandas as pd
    from minimind_lib import cli
    from minimind_lib import model as M
    from minimind_lib.checkpoint import load_run
    from minimind_lib.paths import ASSETS_DIR
    monkeypatch.setitem(M.PRESETS, "tiny-moe", {**M.PRESETS["smoke"], "use_moe": True, "num_experts_per_tok": 2})
    main = lambda *args: cli.main([str(a) for a in [*args, *TINY]])
    pre, sft = tmp_path / "runs" / "pre", tmp_path / "runs" / "sft"
    assert main("pretrain", "--config", "tiny-moe", "--out", pre, "--steps", 3) == 0
    assert main("sft", "--init", pre, "--out", sft, "--steps", 2) == 0
    for run in (pre, sft):
        metrics = pd.read_csv(run / "metrics.csv").query("step >= 0")
        assert len(metrics) and metrics["aux_loss"].between(1e-5, 1e-2).all()  # >= 5e-4 x k per layer, apart
    model, tok, cfg = load_run(sft)
    assert cfg["model"]["use_moe"] and isinstance(model.model.layers[0].mlp, MoEFeedForward)
    assert cli.main(["chat", "--ckpt", str(sft), "--prompt", "hello", "--temperature", "0", "--max-new-tokens", "4"]) == 0

    # the course run -> MiniMind-3: {weight}_{hidden}_moe.pth in out/, loaded with torch.load and strict=True
    commands = readme_block("**A course run in MiniMind-3's scripts.**", "bash")
    assert "minimind/out/full_sft_768_moe.pth" in commands and "--hidden_size 768 --num_hidden_layers 8 --use_moe 1" \
        in commands and "--config minimind-3-moe" in commands
    theirs_dir = tmp_path / "minimind" / "out"
    theirs_dir.mkdir(parents=True)
    (theirs_dir / f"full_sft_{cfg['model']['hidden_size']}_moe.pth").write_bytes((sft / "model.pth").read_bytes())
    theirs = M.MiniMindForCausalLM(M.MiniMindConfig.from_dict(cfg["model"]))
    theirs.load_state_dict(torch.load(theirs_dir / "full_sft_64_moe.pth", map_location="cpu"), strict=True)
    # the full preset is what MiniMind-3 builds from hidden 768, 8 layers and use_moe alone (its defaults)
    full = M.MiniMindConfig.preset("minimind-3-moe")
    assert (full.num_attention_heads, full.num_key_value_heads, full.vocab_size, full.intermediate_size, full.qk_norm,
            full.num_experts, full.num_experts_per_tok) == (8, 4, 6400, 64 * math.ceil(768 * math.pi / 64), True, 4, 1)

    # MiniMind-3 -> the course: its fp16 .pth made a run by README's snippet, then chat and sft --init
    torch.save({k: v.half() for k, v in model.state_dict().items()}, theirs_dir / "full_sft_64_moe.pth")
    snippet = readme_block("**A MiniMind-3 `.pth` as a course run**", "python")
    line = next(l for l in snippet.splitlines() if l.startswith("pth, tokenizer_dir, preset, out = "))
    mm3 = tmp_path / "runs" / "mm3moe"
    exec(snippet.replace(line, f"pth, tokenizer_dir, preset, out = {str(theirs_dir / 'full_sft_64_moe.pth')!r}, "
                               f"{str(ASSETS_DIR / 'tokenizer')!r}, 'tiny-moe', {str(mm3)!r}"), {})
    loaded, _, _ = load_run(mm3)
    assert all(torch.equal(a, b.half().float()) for a, b in zip(loaded.state_dict().values(),
                                                                model.state_dict().values()))
    assert cli.main(["chat", "--ckpt", str(mm3), "--prompt", "你好", "--temperature", "0", "--max-new-tokens", "4"]) == 0
    assert main("sft", "--init", mm3, "--out", tmp_path / "runs" / "mm3moe_sft", "--steps", 1) == 0


def test_full_moe_preset_is_a_cli_config(tmp_path, capsys):
    """--config minimind-3-moe reaches the model (stopped here by a bad --seq-len, before anything is written)."""
    from minimind_lib import cli
    assert "minimind-3-moe" in cli.build_parser()._subparsers._group_actions[0].choices["pretrain"].format_help()
    out = tmp_path / "x"
    args = ["--profile", "smoke", "--seq-len", 40000, "--max-tokens", 40000, "--no-progress"]  # rows of 40000 tokens
    code = cli.main([str(a) for a in ["pretrain", "--config", "minimind-3-moe", "--out", out, *args]])
    assert code == 2 and "seq_len=40000 exceeds the model's max_position_embeddings=32768" in capsys.readouterr().err
    assert not out.exists()
