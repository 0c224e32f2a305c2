"""Smoke tests of `python -m benchmarks throughput` and of the baseline / lever helpers (not the figures)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.baseline import BaselineRecipe, get_lr, minimind_rows
from benchmarks import throughput as T
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, lm_loss

TINY = ["--profile", "smoke", "--steps", "1", "--repeats", "1", "--batch", "2", "--accum", "2", "--seq", "32",
        "--max-samples", "40", "--threads", "1"]


def _sample(n: int, start: int = 5) -> dict:
    ids = torch.arange(start, start + n)
    return {"input_ids": ids, "labels": ids.clone()}


def test_main_baseline_keys_and_types():
    r = T.main(TINY + ["--baseline"])
    for key in ("tokens_per_s", "achieved_flops_per_s", "matmul_peak_flops_per_s", "fraction_of_matmul_peak",
                "ours_tokens_per_s", "baseline_tokens_per_s", "ratio_useful_tokens_per_s"):
        assert isinstance(r[key], float) and r[key] > 0, key
    assert isinstance(r["model_flops_per_token"], int)
    runs = r["ratio_useful_tokens_per_s_runs"]  # every paired ratio, one per repeat, and their spread
    assert len(runs) == r["repeats"] == 1 and r["ratio_useful_tokens_per_s_min"] <= r["ratio_useful_tokens_per_s"]
    assert r["ratio_useful_tokens_per_s"] <= r["ratio_useful_tokens_per_s_max"]
    assert r["spec_peak_flops_per_s"] is None and r["mfu"] is None and r["baseline_mfu"] is None  # a CPU: no spec
    assert isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 0
    assert isinstance(r["baseline_peak_memory_bytes"], int) and r["baseline_peak_memory_bytes"] > 0
    assert r["device"] == "cpu" and r["profile"] == "smoke" and r["config"]["preset"] == "smoke"
    # same samples, same shift: both recipes train exactly the same tokens
    assert r["trained_tokens_per_repeat"] == r["baseline_trained_tokens_per_repeat"]
    cfg = MiniMindConfig.preset("smoke")
    n = r["n_params"]
    assert r["model_flops_per_token"] == 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * 32
    json.dumps(r)  # JSON-ready


def test_main_pack_strategy_without_baseline():
    r = T.main(TINY + ["--strategy", "pack", "--no-memory"])
    assert r["strategy"] == "pack" and isinstance(r["tokens_per_s"], float) and r["peak_memory_bytes"] is None
    assert "ratio_useful_tokens_per_s" not in r
    assert r["doc_attention"] == "dense"  # FlexAttention only on CUDA


def test_default_repeats_and_the_spec_peak_table(monkeypatch):
    assert T.parse_args([]).repeats == 5  # a median of 2 paired ratios would be their mean
    for name, want in [("NVIDIA H100 80GB HBM3", (989e12, "bf16")), ("NVIDIA H200", (989e12, "bf16")),
                       ("NVIDIA H100 PCIe", (756e12, "bf16")), ("NVIDIA H100 NVL", (835e12, "bf16")),
                       ("NVIDIA A100-SXM4-80GB", (312e12, "bf16")), ("NVIDIA GeForce RTX 4090", (165e12, "bf16")),
                       ("NVIDIA GeForce RTX 3090", (71e12, "bf16")), ("Tesla T4", (65e12, "fp16")),
                       ("NVIDIA L4", (121e12, "bf16")), ("NVIDIA L40S", (362e12, "bf16")), ("NVIDIA L40", (None, None)),
                       ("NVIDIA A10G", (70e12, "bf16")), ("NVIDIA A10", (125e12, "bf16")),
                       ("NVIDIA GeForce RTX 5090", (209.5e12, "bf16")), ("NVIDIA GeForce RTX 5070 Ti", (87.9e12, "bf16")),
                       ("NVIDIA GeForce RTX 5070", (61.7e12, "bf16")), ("AMD EPYC 7B13", (None, None))]:
        assert T.spec_peak(name) == want, name
    monkeypatch.setattr(T, "device_name", lambda device: "NVIDIA H100 80GB HBM3")  # mfu: achieved over the spec
    r = T.main(TINY + ["--no-memory"])
    assert r["spec_peak_flops_per_s"] == 989e12 and r["mfu"] == r["achieved_flops_per_s"] / 989e12
    assert r["fraction_of_matmul_peak"] == r["achieved_flops_per_s"] / r["matmul_peak_flops_per_s"]


def test_ablation_separates_padding_dtype_optimizer_loss_micro_batch_and_compile():
    r = T.main(TINY[:4] + ["--repeats", "2"] + TINY[6:] + ["--ablation"])
    assert r["benchmark"] == "throughput-ablation" and r["rungs"] == ["recipe", "loop", "padding", "dtype", "optimizer",
                                                                     "chunked_loss", "micro_batch", "compile"]
    assert len(set(r["trained_tokens_per_repeat"].values())) == 1  # every rung trains the same tokens
    assert r["amp"]["recipe"] == r["amp"]["loop"] == "fp32" and r["optimizer"]["optimizer"] == "fused"
    assert r["optimizer"]["dtype"] != "fused"  # each rung changes one thing
    assert r["micro_batch_rows_and_accum"] == [4, 1] and r["micro_batches_per_step"]["micro_batch"] == 1
    assert r["loss_chunk"] > 0 and r["peak_memory_bytes"]["compile"] is None and r["compile_warmup_seconds"] > 0
    assert r["compile"] == "compiled" or r["compile"].startswith("compile unavailable")
    for lever, v in r["levers"].items():
        assert len(v["ratio_runs"]) == 2 and v["ratio_min"] <= v["ratio"] <= v["ratio_max"], lever
    assert len(r["ratio_ours_vs_recipe_runs"]) == 2 and r["product_of_median_ratios"] > 0
    json.dumps(r)


def test_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "throughput", "--json", *TINY, "--no-memory"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["benchmark"] == "throughput"


@pytest.mark.parametrize("argv, match", [
    (["--steps", "0"], r"--steps=0 must be >= 1"),
    (["--seq", "1"], r"--seq=1 must be >= 2"),
    (["--max-tokens", "4", "--seq", "32", "--profile", "smoke"], r"--max-tokens=4 is smaller than --seq=32"),
    (["--profile", "smoke", "--config", "nope"], r"unknown model preset 'nope'"),
])
def test_bad_arguments(argv, match):
    with pytest.raises(ValueError, match=match):
        T.main(argv)


def test_missing_data_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pretrain data not found: .*nope\.jsonl"):
        T.main(TINY + ["--data", str(tmp_path / "nope.jsonl")])


def test_minimind_rows_match_minimind_dataset():
    rows = minimind_rows([_sample(5), _sample(3)], max_length=6, pad_id=0)
    assert rows["X"].shape == rows["Y"].shape == rows["loss_mask"].shape == (2, 5)
    assert rows["X"][0].tolist() == [5, 6, 7, 8, 9] and rows["Y"][0].tolist() == [6, 7, 8, 9, 0]
    assert rows["loss_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert T.micro_batch_tokens([rows]) == 4 + 2  # (len - 1) per sample, as data.trained_tokens of the labels
    long = minimind_rows([_sample(9)], max_length=4)
    assert long["X"][0].tolist() == [5, 6, 7] and int(long["loss_mask"].sum()) == 3  # truncation=True
    with pytest.raises(ValueError, match="max_length=1 is too short"):
        minimind_rows([_sample(3)], max_length=1)
    with pytest.raises(ValueError, match="got no samples"):
        minimind_rows([], max_length=4)


def test_get_lr_is_minimind_schedule():
    assert get_lr(0, 100, 1e-3) == pytest.approx(1.1e-3)
    assert get_lr(100, 100, 1e-3) == pytest.approx(1e-4)


def test_baseline_recipe_steps_and_checks_accumulation():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    before = model.lm_head.weight.detach().clone()
    recipe = BaselineRecipe(model, torch.device("cpu"), accumulation_steps=2, total_steps=4)
    mb = minimind_rows([_sample(6), _sample(4)], max_length=8)
    out = recipe.train_step([mb, mb])
    assert out["n_tokens"] == 2 * (5 + 3) and out["loss"] > 0
    assert not torch.equal(before, model.lm_head.weight) and recipe.step == 2
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True) after the step
    with pytest.raises(ValueError, match="accumulation_steps=2 micro-batches, got 1"):
        recipe.train_step([mb])


def test_ours_budget_batches_keep_every_token_and_the_budget():
    samples = [_sample(n) for n in (30, 3, 17, 8, 25, 2)]
    mbs = T.ours_micro_batches(samples, seq_len=32, max_tokens=40, strategy="budget", pad_id=0)
    assert all(mb["input_ids"].numel() <= 40 for mb in mbs)
    assert all("attention_mask" not in mb for mb in mbs)  # right padding under causal attention needs no mask
    assert T.micro_batch_tokens(mbs) == sum(n - 1 for n in (30, 3, 17, 8, 25, 2))
    packed = T.ours_micro_batches(samples, seq_len=32, max_tokens=64, strategy="pack", pad_id=0)
    assert all(mb["input_ids"].shape[1] == 32 and mb["block_mask"] == "auto" for mb in packed)  # made on the device
    with pytest.raises(ValueError, match="strategy='x'"):
        T.ours_micro_batches(samples, 32, 40, "x", 0)


def test_no_padding_mask_is_exact_for_right_padding():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    from minimind_lib.data import pad_collate

    mb = pad_collate([_sample(9), _sample(4)])
    with_mask = lm_loss(model(mb["input_ids"], attention_mask=mb["attention_mask"]).logits, mb["labels"], "sum")
    without = lm_loss(model(mb["input_ids"]).logits, mb["labels"], "sum")
    assert torch.allclose(with_mask, without, rtol=1e-5)


def test_activation_checkpointing_same_grads_same_keys():
    torch.manual_seed(0)
    a = MiniMindForCausalLM(MiniMindConfig.preset("smoke"))
    import copy

    b = copy.deepcopy(a)
    assert T.enable_activation_checkpointing(b) == 2
    assert list(a.state_dict()) == list(b.state_dict())
    ids = torch.randint(3, 6400, (2, 12))
    for m in (a, b):
        m(ids, labels=ids).loss.backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name


def test_try_compile_degrades_gracefully(monkeypatch):
    monkeypatch.setattr(T.shutil, "which", lambda name: None)
    model = torch.nn.Linear(2, 2)
    out, status = T.try_compile(model, torch.device("cpu"))
    assert out is model and status.startswith("compile unavailable: no C++ compiler")


def test_levers_smoke():
    r = T.main(["--profile", "smoke", "--levers", "--batch", "2", "--seq", "32", "--accum", "1", "--steps", "1",
                "--max-samples", "40", "--threads", "1", "--lever-repeats", "1"])
    lv = r["levers"]
    assert set(lv) >= {"fused_adamw", "sdpa_backend", "chunked_cross_entropy", "activation_checkpointing",
                       "torch_compile", "pinned_memory", "dataloader_workers"}
    assert lv["chunked_cross_entropy"]["loss_rel_diff"] < 1e-4
    assert lv["torch_compile"]["status"].startswith("not measured")
    assert r["device"] == "cpu" and r["profile"] == "smoke"


def test_levers_only_subset_and_unknown_name():
    r = T.main(["--profile", "smoke", "--levers", "--only", "activation_checkpointing", "--batch", "2", "--seq", "32",
                "--accum", "1", "--steps", "1", "--max-samples", "40", "--threads", "1", "--lever-repeats", "1"])
    assert list(r["levers"]) == ["activation_checkpointing"]
    curve = r["levers"]["activation_checkpointing"]["curve"]
    assert [p["checkpointed_layers"] for p in curve] == [0, 1, 2] and curve[0]["seconds_ratio"] == 1.0
    assert curve[-1]["peak_memory_bytes"] < curve[0]["peak_memory_bytes"]  # recomputing saves memory
    with pytest.raises(ValueError, match=r"--only: unknown lever\(s\) \['nope'\]"):
        T.main(["--profile", "smoke", "--levers", "--only", "nope", "--max-samples", "40"])


def test_compile_failure_at_first_step_falls_back_to_eager(monkeypatch):
    class Broken(torch.nn.Module):
        def forward(self, *a, **kw):
            raise RuntimeError("backend exploded")

    monkeypatch.setattr(T, "try_compile", lambda model, device, dynamic=None: (Broken(), "compiled"))
    r = T.main(TINY + ["--compile", "--no-memory"])
    assert r["compile"] == "compile unavailable: RuntimeError: backend exploded"
    assert isinstance(r["tokens_per_s"], float)  # reported, never compared: a speed depends on the machine's load


def test_measure_dataloader_reports_samples_per_s(tmp_path):
    # moved from tests/test_data.py with measure_dataloader (a benchmark harness, not library code)
    import functools
    import warnings

    from minimind_lib.data import PretrainDataset, pad_collate
    from minimind_lib.tokenizer import Tokenizer

    texts = ["To be, or not to be, that is the question.", "床前明月光，疑是地上霜。", "Hello there! How can I help?"] * 4
    tok = Tokenizer.train(texts, vocab_size=300)
    path = tmp_path / "pre.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    ds = PretrainDataset(path, tok, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TOKENIZERS_PARALLELISM fork warning or similar
        r = T.measure_dataloader(ds, functools.partial(pad_collate, pad_id=tok.pad_token_id), batch_size=4, epochs=1)
    assert r["samples"] == len(ds) and isinstance(r["samples_per_s"], float) and r["num_workers"] == 0
