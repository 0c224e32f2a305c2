"""LoRA and DPO (notebook 10): LoRA at init is the base model, merging keeps the logits, MiniMind's LoRA file both
ways, the DPO loss against a direct computation, MiniMind's dpo.jsonl and DPODataset both ways, the lora and dpo
commands (their files, resume, bad inputs: exit 2) and the PEFT adapter export.

MiniMind's code is not installed here: the few functions below (MM_*) are written from its released files
(jingyaogong/minimind, commit d65ef2c: model/model_lora.py, dataset/lm_dataset.py DPODataset), as the facts say them."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minimind_lib import cli
from minimind_lib.checkpoint import load_run, load_weights_only
from minimind_lib.corpus import encode_sft, validate_record
from minimind_lib.data import PairDataset, pad_collate, pair_collate
from minimind_lib.dpo import DPO, dpo_loss, pair_logps, preference_report, sequence_logps
from minimind_lib.lora import apply_lora, load_lora, lora_layers, lora_state, lora_targets, merge_lora
from minimind_lib.model import IGNORE_INDEX, MiniMindConfig, MiniMindForCausalLM
from minimind_lib.paths import DATA_DIR
from minimind_lib.tokenizer import load_tokenizer
from minimind_lib.train import accumulate_step

torch.set_num_threads(1)
TINY = ["--profile", "smoke", "--seq-len", "64", "--max-tokens", "256", "--accum", "2", "--max-samples", "64",
        "--val-batches", "1", "--no-progress"]


def small_model(seed: int = 0) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(MiniMindConfig.preset("smoke")).eval()


def randomize_b(model: nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora.B.weight.copy_(torch.randn(m.lora.B.weight.shape, generator=g) * 0.2)


# ----------------------------------------------------------------------------------------------------------- LoRA
def test_lora_at_init_is_the_base_model_and_trains_only_its_adapters():
    model, x = small_model(), torch.randint(0, 6400, (2, 12))
    base = model(x).logits
    apply_lora(model, rank=4, alpha=8)
    assert torch.equal(model(x).logits, base)  # B = 0: exactly the base model
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == {f"model.layers.{i}.self_attn.{p}_proj.lora.{ab}.weight" for i in range(2)
                              for p in "qo" for ab in "AB"}
    assert sum(trainable.values()) == 2 * 2 * (64 * 4 + 4 * 64)


def test_the_update_is_alpha_over_rank_times_b_a():
    torch.manual_seed(0)
    layer, x = nn.Linear(16, 16, bias=False), torch.randn(3, 16)
    for alpha in (4.0, 16.0):
        m = copy.deepcopy(layer)
        holder = nn.Module()
        holder.add_module("model", nn.Module())
        from minimind_lib.lora import LoRALinear
        lora = LoRALinear(m, rank=4, alpha=alpha)
        with torch.no_grad():
            lora.lora.B.weight.normal_()
        want = x @ layer.weight.T + (alpha / 4) * x @ lora.lora.A.weight.T @ lora.lora.B.weight.T
        assert torch.allclose(lora(x), want, atol=1e-6)


def test_minimind_rule_adapts_the_square_layers_of_minimind2_small():
    with torch.device("meta"):
        model = MiniMindForCausalLM(MiniMindConfig.preset("minimind2-small"))
    names = lora_targets(model)
    assert len(names) == 16 and all(n.endswith(("q_proj", "o_proj")) for n in names)  # k/v: 512 -> 128
    assert len(lora_targets(model, ("q_proj", "k_proj", "v_proj", "o_proj"))) == 32
    with pytest.raises(ValueError, match="no Linear"):
        lora_targets(model, ("qkv",))


def test_merged_logits_equal_the_adapted_ones():
    model, x = small_model(), torch.randint(0, 6400, (2, 12))
    apply_lora(model, rank=4, alpha=8)
    randomize_b(model)
    adapted = model(x).logits
    merge_lora(model)
    assert not lora_layers(model) and set(model.state_dict()) == set(small_model().state_dict())
    assert torch.allclose(model(x).logits, adapted, atol=1e-5)


# MiniMind's model/model_lora.py, as its facts say it: every square Linear gets `lora` (A: N(0, 0.02), B: 0) and
# computes W x + B(A(x)); save_lora writes `<name>.lora.A.weight` / `.lora.B.weight` in fp16, a `module.` stripped;
# load_lora loads each module's keys strictly.
class MMLoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)
        self.A.weight.data.normal_(mean=0.0, std=0.02)
        self.B.weight.data.zero_()

    def forward(self, x):
        return self.B(self.A(x))


def mm_apply_lora(model: nn.Module, rank: int) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.shape[0] == module.weight.shape[1]:
            lora = MMLoRA(module.weight.shape[0], module.weight.shape[1], rank)
            setattr(module, "lora", lora)
            original_forward = module.forward

            def forward_with_lora(x, layer1=original_forward, layer2=lora):
                return layer1(x) + layer2(x)
            module.forward = forward_with_lora


def mm_load_lora(model: nn.Module, path: Path) -> None:
    state_dict = torch.load(path, map_location="cpu")
    state_dict = {(k[7:] if k.startswith("module.") else k): v for k, v in state_dict.items()}
    for name, module in model.named_modules():
        if hasattr(module, "lora"):
            lora_state = {k.replace(f"{name}.lora.", ""): v for k, v in state_dict.items() if f"{name}.lora." in k}
            module.lora.load_state_dict(lora_state)


def mm_save_lora(model: nn.Module, path: Path) -> None:
    state_dict = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora"):
            clean_name = name[7:] if name.startswith("module.") else name
            state_dict.update({f"{clean_name}.lora.{k}": v.cpu().half() for k, v in module.lora.state_dict().items()})
    torch.save(state_dict, path)


def test_our_lora_file_loads_into_minimind_and_computes_the_same(tmp_path):
    ours, x = small_model(), torch.randint(0, 6400, (2, 12))
    apply_lora(ours, rank=4, alpha=12)  # a scale of 3: the file's B carries it for MiniMind's unscaled layers
    randomize_b(ours)
    torch.save(lora_state(ours), tmp_path / "lora.pth")
    theirs = small_model()
    mm_apply_lora(theirs, rank=4)
    mm_load_lora(theirs, tmp_path / "lora.pth")
    assert torch.allclose(theirs(x).logits, ours(x).logits, atol=1e-5)
    keys = torch.load(tmp_path / "lora.pth", weights_only=True)
    assert keys["model.layers.0.self_attn.q_proj.lora.A.weight"].shape == (4, 64)
    assert keys["model.layers.0.self_attn.q_proj.lora.B.weight"].shape == (64, 4)


def test_minimind_lora_file_loads_into_ours(tmp_path):
    theirs, x = small_model(), torch.randint(0, 6400, (2, 12))
    mm_apply_lora(theirs, rank=4)
    with torch.no_grad():
        for name, module in theirs.named_modules():
            if hasattr(module, "lora"):
                module.lora.B.weight.normal_(std=0.2)
    mm_save_lora(theirs, tmp_path / "mm_lora.pth")  # fp16 values
    state = {"module." + k: v for k, v in torch.load(tmp_path / "mm_lora.pth").items()}  # as saved under DDP
    mm_load_lora(theirs, tmp_path / "mm_lora.pth")  # MiniMind's model with the fp16-rounded values, as ours gets
    ours = apply_lora(small_model(), rank=4)
    load_lora(ours, state)
    assert torch.allclose(ours(x).logits, theirs(x).logits, atol=1e-5)


def test_a_lora_file_of_another_rank_or_layers_is_refused():
    model = apply_lora(small_model(), rank=4)
    state = lora_state(model)
    other = lora_state(apply_lora(small_model(), rank=2))
    with pytest.raises(ValueError, match=r"lora.A.weight is \[2, 64\], this model's LoRA layer has shape \[4, 64\]"):
        load_lora(model, other)
    with pytest.raises(ValueError, match="has no key 'model.layers.1.self_attn.o_proj.lora.A.weight'"):
        load_lora(model, {k: v for k, v in state.items() if "layers.1.self_attn.o_proj" not in k})
    with pytest.raises(ValueError, match="has a key no LoRA layer here has: 'model.layers.0.mlp"):
        load_lora(model, {**state, "model.layers.0.mlp.up_proj.lora.A.weight": torch.zeros(4, 64)})


# ----------------------------------------------------------------------------------------------------------- DPO
def direct_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row: the sum over t of log softmax(logits[t])[labels[t + 1]] where labels[t + 1] != -100, one at a time."""
    out = []
    for row_logits, row_labels in zip(logits, labels):
        total = 0.0
        for t in range(len(row_labels) - 1):
            if row_labels[t + 1] != IGNORE_INDEX:
                total += float(torch.log_softmax(row_logits[t].double(), -1)[row_labels[t + 1]])
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def test_sequence_logps_and_the_loss_against_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, 50, generator=g)
    labels = torch.randint(0, 50, (4, 9), generator=g)
    labels[:, :3] = IGNORE_INDEX  # the prompt
    labels[1, 7:] = IGNORE_INDEX  # padding
    got = sequence_logps(logits, labels)
    assert torch.allclose(got.double(), direct_logps(logits, labels), atol=1e-4)
    pi_c, pi_r, ref_c, ref_r, beta = got[0], got[1], got[2], got[3], 0.15
    z = beta * ((float(pi_c) - float(pi_r)) - (float(ref_c) - float(ref_r)))
    assert math.isclose(float(dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)), -math.log(1 / (1 + math.exp(-z))),
                        rel_tol=1e-5)


def pair_batch(tok, n: int = 4) -> list[dict]:
    pairs = [json.loads(line) for line in (DATA_DIR / "dpo.jsonl").open(encoding="utf-8")][:n]
    samples = []
    for p in pairs:
        (ci, cm), (ri, rm) = encode_sft(tok, p["chosen"]), encode_sft(tok, p["rejected"])
        c, r = ({"input_ids": torch.as_tensor(i[:48]), "labels": torch.where(torch.as_tensor(m[:48]) == 1,
                                                                             torch.as_tensor(i[:48]), IGNORE_INDEX)}
                for i, m in ((ci, cm), (ri, rm)))
        samples.append({**c, "rejected_ids": r["input_ids"], "rejected_labels": r["labels"]})
    return samples


def test_dpo_starts_at_ln2_counts_pairs_and_accumulates_exactly():
    tok = load_tokenizer(None)
    samples = pair_batch(tok)
    policy, reference = small_model(1), small_model(1)
    objective = DPO(reference, beta=0.1)
    whole = pair_collate(samples, tok.pad_token_id)
    assert objective.count(whole) == 4 and len(whole["input_ids"]) == 8  # chosen rows first, then rejected
    loss_sum, _ = objective.loss_sum(policy, whole, None)
    assert math.isclose(float(loss_sum.detach()) / 4, math.log(2), rel_tol=1e-6)  # the policy is its reference
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    grads = []
    for micro in ([whole], [pair_collate(samples[:1], 0), pair_collate(samples[1:], 0)]):
        policy.zero_grad()
        stats = accumulate_step(policy, micro, objective=objective)
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
        assert stats["n_tokens"] == 4  # pairs
    assert torch.allclose(grads[0], grads[1], atol=1e-6)  # one micro-batch or two: the same mean over pairs


def test_without_a_reference_the_loss_is_the_policy_margin_alone():
    tok = load_tokenizer(None)
    batch = pair_collate(pair_batch(tok, 2), tok.pad_token_id)
    model = small_model(2)
    pi = sequence_logps(model(batch["input_ids"]).logits, batch["labels"])
    got, _ = DPO(None, beta=0.5).loss_sum(model, batch, None)
    assert torch.allclose(got, -F.logsigmoid(0.5 * (pi[:2] - pi[2:])).sum(), atol=1e-6)


def test_preference_report_of_pair_logps():
    tok = load_tokenizer(None)
    batches = [pair_collate(pair_batch(tok, 3), tok.pad_token_id)]
    model = small_model(3)
    logps = pair_logps(model, batches)
    assert logps.shape == (3, 2)
    same = preference_report(logps, logps, 0.1)
    assert same["margin"] == 0 and same["reward_accuracy"] == 0 and math.isclose(same["loss"], math.log(2), rel_tol=1e-6)
    shifted = preference_report(logps + torch.tensor([1.0, -1.0]), logps, 0.1)
    assert shifted["reward_accuracy"] == 1 and math.isclose(shifted["margin"], 0.2, rel_tol=1e-5)


# MiniMind's DPODataset, as its facts say it: each side rendered by the chat template (add_generation_prompt=False),
# tokenized, its loss mask from each "<|im_start|>assistant\n" to the "<|im_end|>\n" after it.
def mm_dpo_side(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tok.encode(text, add_special_tokens=False)
    bos, eos = tok.encode("<|im_start|>assistant\n", add_special_tokens=False), tok.encode("<|im_end|>\n",
                                                                                            add_special_tokens=False)
    mask, i = [0] * len(ids), 0
    while i < len(ids):
        if ids[i:i + len(bos)] == bos:
            start = end = i + len(bos)
            while end < len(ids) and ids[end:end + len(eos)] != eos:
                end += 1
            for j in range(start, min(end + len(eos), len(ids))):
                mask[j] = 1
            i = end + len(eos)
        else:
            i += 1
    return ids, mask


def test_the_bundled_pairs_read_as_minimind_dpodataset_reads_them():
    tok = load_tokenizer(None)
    lines = (DATA_DIR / "dpo.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) > 1000
    for line in lines[::97]:
        record = json.loads(line)
        assert set(record) == {"chosen", "rejected"}
        for side in ("chosen", "rejected"):
            ids, mask = encode_sft(tok, record[side])
            assert (list(ids), list(mask)) == mm_dpo_side(tok, record[side])
        assert "\n" not in record["chosen"][-1]["content"] and "\n" in record["rejected"][-1]["content"].strip()


def write_pairs(path: Path, pairs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    return path


def minimind_pair(q: str, good: str, bad: str) -> dict:
    """A line as MiniMind's dpo.jsonl writes it: each turn's content before its role."""
    return {"chosen": [{"content": q, "role": "user"}, {"content": good, "role": "assistant"}],
            "rejected": [{"content": q, "role": "user"}, {"content": bad, "role": "assistant"}]}


def test_minimind_dpo_jsonl_reads_unchanged(tmp_path):
    tok = load_tokenizer(None)
    path = write_pairs(tmp_path / "dpo.jsonl", [minimind_pair(f"q{i}?", "yes.", "no, never.") for i in range(6)])
    ds = PairDataset(path, tok, 64)
    assert len(ds) == 6 and ds[0]["input_ids"].tolist() == encode_sft(tok, json.loads(path.read_text().splitlines()[0])
                                                                       ["chosen"])[0].tolist()
    batch = pair_collate([ds[0], ds[1]], tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 4 and torch.equal(batch["input_ids"][2, :len(ds[0]["rejected_ids"])],
                                                            ds[0]["rejected_ids"])


@pytest.mark.parametrize("record,message", [
    (minimind_pair("q?", "", "no."), "key 'chosen': conversations[1]['content'] is empty"),
    (minimind_pair("q?", "same.", "same."), "'chosen' equals 'rejected'"),
    ({"chosen": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "x"}],
      "rejected": [{"role": "user", "content": "b?"}, {"role": "assistant", "content": "y"}]}, "differ before"),
    ({"chosen": [{"role": "user", "content": "a?"}, {"role": "assistant", "content": "x"}]}, "missing key 'rejected'"),
])
def test_bad_pairs_are_named(record, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_record(record, "dpo")


# ----------------------------------------------------------------------------------------------------------- CLI
def run_cli(args: list, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("lora_dpo")
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([str(a) for a in ["pretrain", "--out", base / "pre", "--steps", 2, "--cache", base / "cache"]
                         + TINY]) == 0
        assert cli.main([str(a) for a in ["sft", "--out", base / "sft", "--init", base / "pre", "--steps", 2,
                                          "--cache", base / "cache"] + TINY]) == 0
    return base / "sft"


def test_lora_writes_minimind_adapters_merges_and_exports(sft_run, tmp_path, capsys):
    out = tmp_path / "lora"
    code, printed, err = run_cli(["lora", "--from", sft_run, "--out", out, "--steps", 2, "--lora-rank", 4] + TINY,
                                 capsys)
    assert code == 0, err
    assert (out / "lora.pth").is_file() and not (out / "model.pth").exists()  # adapters apart
    state = load_weights_only(out / "lora.pth")
    assert len(state) == 8 and state["model.layers.0.self_attn.o_proj.lora.A.weight"].shape == (4, 64)
    folded, _, cfg = load_run(out)  # no model.pth: the adapters on the run they started from, folded in
    assert cfg["stage"] == "lora" and cfg["lora"] == {"rank": 4, "alpha": 4, "targets": None}
    merged_dir = tmp_path / "merged"
    code, _, err = run_cli(["lora", "--from", sft_run, "--out", merged_dir, "--steps", 2, "--lora-rank", 4,
                            "--merge"] + TINY, capsys)
    assert code == 0, err
    merged, _, _ = load_run(merged_dir)  # a plain model.pth, MiniMind's keys
    x = torch.randint(0, 6400, (1, 16))
    assert torch.allclose(merged(x).logits, folded(x).logits, atol=1e-5)  # same seed, same run: same model
    code, _, err = run_cli(["export", merged_dir, "--to", tmp_path / "hf"], capsys)
    assert code == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), err


def test_the_peft_adapter_loads_onto_the_export_with_equal_logits(sft_run, tmp_path, capsys):
    pytest.importorskip("peft")  # requirements.txt pins it (notebook 10): present in CI
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    out = tmp_path / "lora"
    assert run_cli(["lora", "--from", sft_run, "--out", out, "--steps", 2, "--lora-rank", 4, "--lora-alpha", 8]
                   + TINY, capsys)[0] == 0
    assert run_cli(["export", sft_run, "--to", tmp_path / "base_hf"], capsys)[0] == 0
    code, _, err = run_cli(["export", out, "--to", tmp_path / "adapter", "--adapter"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    os.environ["HF_HUB_OFFLINE"] = "1"
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf", local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter", local_files_only=True).eval()
    ours, _, _ = load_run(out)
    x = torch.randint(0, 6400, (2, 16))
    with torch.no_grad():
        assert torch.allclose(peft_model(x).logits, ours(x).logits, atol=1e-5)
    code, _, err = run_cli(["export", sft_run, "--to", tmp_path / "none", "--adapter"], capsys)
    assert code == 2 and "holds no LoRA adapters" in err


def test_dpo_from_sft_starts_at_ln2_and_resumes_exactly(sft_run, tmp_path, capsys):
    common = ["--from", sft_run, "--steps", 4] + TINY
    code, printed, err = run_cli(["dpo", "--out", tmp_path / "straight"] + common, capsys)
    assert code == 0, err
    summary = json.loads(printed)
    assert math.isclose(summary["initial_val_loss"], math.log(2), rel_tol=1e-6)
    cfg = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert cfg["dpo"]["beta"] == 0.1 and cfg["lora"] is None
    assert run_cli(["dpo", "--out", tmp_path / "resumed", "--stop-after", 2] + common, capsys)[0] == 0
    assert run_cli(["dpo", "--out", tmp_path / "resumed", "--resume"] + common, capsys)[0] == 0
    a = load_weights_only(tmp_path / "straight" / "model.pth")
    b = load_weights_only(tmp_path / "resumed" / "model.pth")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_dpo_through_lora_writes_the_adapters_and_a_merged_model(sft_run, tmp_path, capsys):
    out = tmp_path / "dpo_lora"
    code, _, err = run_cli(["dpo", "--out", out, "--from", sft_run, "--steps", 2, "--lora-rank", 2] + TINY, capsys)
    assert code == 0, err
    model, _, _ = load_run(out)
    assert not lora_layers(model) and len(load_weights_only(out / "lora.pth")) == 8


def test_dpo_bad_inputs_exit_2_naming_what_is_wrong(sft_run, tmp_path, capsys):
    cases = {
        "empty": ([minimind_pair("q?", "", "no.")], "conversations[1]['content'] is empty"),
        "equal": ([minimind_pair("q?", "same.", "same.")], "'chosen' equals 'rejected'"),
        "cut": ([minimind_pair("x" * 400, "yes.", "no.")], "pair 3 (counting from 1): its chosen reply lies beyond "
                                                            "seq_len=64"),
    }
    good = [minimind_pair(f"q{i}?", "yes.", "no.") for i in range(30)]
    for name, (pairs, message) in cases.items():
        path = write_pairs(tmp_path / f"{name}.jsonl", good[:2] + pairs + good[2:])
        code, _, err = run_cli(["dpo", "--data", path, "--from", sft_run, "--out", tmp_path / name] + TINY, capsys)
        assert code == 2 and message in err, (name, err)
        assert not (tmp_path / name / "model.pth").exists()
    code, _, err = run_cli(["dpo", "--from", tmp_path / "nowhere", "--out", tmp_path / "x"] + TINY, capsys)
    assert code == 2 and "run directory not found" in err and "nowhere" in err
    code, _, err = run_cli(["lora", "--from", tmp_path / "nowhere", "--out", tmp_path / "y"] + TINY, capsys)
    assert code == 2 and "run directory not found" in err
    with pytest.raises(SystemExit):
        cli.main(["dpo", "--from", str(sft_run), "--out", str(tmp_path / "z"), "--beta", "0"])


def test_dpo_under_bf16_autocast_trains_and_its_reference_runs_under_it_too(sft_run, tmp_path, capsys):
    from minimind_lib import device as device_module
    if not device_module.bf16_supported(torch.device("cpu")):
        pytest.skip("this CPU has no bf16")
    code, printed, err = run_cli(["dpo", "--out", tmp_path / "bf16", "--from", sft_run, "--steps", 2, "--amp", "bf16"]
                                 + TINY, capsys)
    assert code == 0, err
    summary = json.loads(printed)
    assert summary["amp"] == "bf16" and summary["final_val_loss"] < 1.0  # ln 2 at the start, bf16's rounding aside
