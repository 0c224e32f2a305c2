"""Tests of minimind_lib.pipeline (the runs behind notebooks 07/08 and the CLI) and the chat box (notebooks/chat_box.py)."""

from __future__ import annotations

import sys
from pathlib import Path
import json
import math
import shutil

import pytest
import torch

from minimind_lib import checkpoint, pipeline
from minimind_lib.generate import chat, chat_prompt_ids, chat_reply
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))  # course material
from chat_box import ChatBox  # noqa: E402

torch.set_num_threads(1)

TINY = dict(profile="smoke", seq_len=32, max_tokens=128, accum_steps=1, max_samples=48, val_batches=1, progress=False,
            log=lambda msg: None)


@pytest.fixture(scope="module")
def pre(tmp_path_factory):
    base = tmp_path_factory.mktemp("pipe")
    result = pipeline.pretrain(out=base / "pre", steps=3, cache_dir=base / "cache", sample_every=2,
                               sample_prompts=["ROMEO.\n"], **TINY)
    return result


@pytest.fixture(scope="module")
def sft_run(pre):
    return pipeline.sft(out=pre.out_dir.parent / "sft", init=pre.out_dir, steps=2, cache_dir=pre.out_dir.parent / "cache",
                        **TINY)


def test_pretrain_result_and_metrics(pre):
    df = pre.metrics
    assert df["step"].tolist() == [-1, 0, 1, 2]
    first = df.iloc[0]  # the validation loss before training, at 0 tokens seen
    assert first["tokens_seen"] == 0 and abs(first["val_loss"] - math.log(6400)) < 0.3
    for col in ("loss", "lr", "tokens", "tokens_per_s", "tokens_seen", "peak_memory_bytes", "val_loss", "grad_norm"):
        assert col in df.columns, col
    assert df["tokens_seen"].is_monotonic_increasing
    assert not df["loss"].iloc[1:].isna().any()
    assert pre.summary["steps"] == 3 and pre.summary["tokens"] == int(df["tokens"].sum())
    assert pre.summary["initial_val_loss"] == pytest.approx(first["val_loss"])
    assert pre.summary["final_val_loss"] == pytest.approx(df["val_loss"].dropna().iloc[-1])
    # Peak memory is read from CUDA's allocator; a CPU run reports none rather than a guess.
    assert pre.summary["peak_memory_bytes"] is None and df["peak_memory_bytes"].isna().all()
    assert json.loads((pre.out_dir / "summary.json").read_text())["tokens"] == pre.summary["tokens"]


def test_pretraining_chunks_long_documents_and_sft_truncates(pre, sft_run):
    # seq_len 32 over data/pretrain.jsonl: many documents are longer; pretraining splits them, cuts nothing
    stats = json.loads((pre.out_dir / "config.json").read_text())
    assert stats["long_docs"] == "chunk"
    assert stats["data_stats"]["n_chunked"] > 0 and stats["data_stats"]["n_truncated"] == 0
    assert stats["data_stats"]["n_samples"] > stats["data_stats"]["n_documents"] == 48
    sft_cfg = json.loads((sft_run.out_dir / "config.json").read_text())
    assert sft_cfg["long_docs"] == "truncate" and sft_cfg["data_stats"]["n_chunked"] == 0


def test_sample_generations_at_intervals(pre):
    assert [s["step"] for s in pre.samples] == [2]
    assert pre.samples[0]["prompt"] == "ROMEO.\n" and isinstance(pre.samples[0]["text"], str)
    lines = (pre.out_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == pre.samples


def test_load_run_round_trip(pre):
    model, tok, cfg = checkpoint.load_run(pre.out_dir)
    assert cfg["stage"] == "pretrain" and tok.vocab_size == 6400
    for k, v in model.state_dict().items():
        assert torch.equal(v, pre.model.state_dict()[k].cpu())


def test_load_run_refuses_another_tokenizer(pre, tmp_path):
    from minimind_lib.tokenizer import Tokenizer

    run = tmp_path / "run"
    shutil.copytree(pre.out_dir, run)
    shutil.rmtree(run / "tokenizer")
    from minimind_lib.paths import DATA_DIR

    texts = [json.loads(line)["text"] for line in (DATA_DIR / "pretrain_val.jsonl").open()][:50]
    Tokenizer.train(texts, vocab_size=300).save(run / "tokenizer")
    with pytest.raises(ValueError, match="vocab_size=300.*vocab_size=6400"):
        checkpoint.load_run(run)


def test_load_run_refuses_a_different_tokenizer_of_the_same_size(pre, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(pre.out_dir, run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["tokenizer"]["fingerprint"] = "0" * 16
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not the one the model was trained with"):
        checkpoint.load_run(run)


def test_overwrite_replaces_a_run(pre, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(pre.out_dir, run)
    with pytest.raises(ValueError, match="already holds a run"):
        pipeline.pretrain(out=run, steps=1, cache_dir=pre.out_dir.parent / "cache", **TINY)
    result = pipeline.pretrain(out=run, steps=1, overwrite=True, cache_dir=pre.out_dir.parent / "cache",
                               sample_prompts=[], **TINY)
    assert result.summary["steps"] == 1 and not (run / "samples.jsonl").exists()


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="unknown argument"):
        pipeline.pretrain(out=tmp_path / "r", stepz=3)
    with pytest.raises(ValueError, match="max_tokens=16 is smaller than seq_len=32"):
        pipeline.pretrain(out=tmp_path / "r", **{**TINY, "max_tokens": 16})
    with pytest.raises(ValueError, match="sft needs --init"):
        pipeline.sft(out=tmp_path / "s", **TINY)
    with pytest.raises(FileNotFoundError, match="validation data file not found"):
        pipeline.pretrain(out=tmp_path / "r", val_data=tmp_path / "v.jsonl", **TINY)
    with pytest.raises(ValueError, match="unknown model preset"):
        pipeline.pretrain(out=tmp_path / "r", config="huge", **TINY)
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()


def test_run_dir_for(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIMIND_RUNS_DIR", str(tmp_path))
    assert pipeline.run_dir_for("smoke", "pretrain") == tmp_path / "smoke" / "pretrain"


def test_sft_holds_out_validation_and_trains_assistant_tokens(sft_run, pre):
    assert sft_run.config["stage"] == "sft" and sft_run.config["sft_val_holdout"] >= 1
    assert sft_run.config["init"] == str(pre.out_dir.resolve())
    df = sft_run.metrics
    assert df["step"].tolist() == [-1, 0, 1] and not df["val_loss"].isna().all()


def test_chat_functions_are_deterministic_with_a_seed(sft_run):
    m, tok = sft_run.model, sft_run.tokenizer
    a = chat("Hello!", m, tok, seed=3, max_new_tokens=10, temperature=1.0)
    b = chat("Hello!", m, tok, seed=3, max_new_tokens=10, temperature=1.0)
    assert a == b
    pieces = []
    c = chat_reply(m, tok, [{"role": "user", "content": "Hello!"}], seed=3, max_new_tokens=10, temperature=1.0,
                   stream=pieces.append)
    assert c == a and "".join(pieces).strip() == c
    info: dict = {}
    chat("Hello!", m, tok, seed=3, max_new_tokens=10, temperature=1.0, details=info)
    assert 1 <= info["n_tokens"] <= 10 and isinstance(info["ended"], bool)
    assert info["ended"] == (info["n_tokens"] < 10 or info["ended"])


def test_chat_history_and_prompt_ids(sft_run):
    tok = sft_run.tokenizer
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    history: list[dict] = []
    chat("hi", sft_run.model, tok, history=history, system="be brief", max_new_tokens=3, seed=0)
    assert [t["role"] for t in history] == ["system", "user", "assistant"]
    with pytest.raises(ValueError, match="must end with a 'user' turn"):
        chat_reply(sft_run.model, tok, [{"role": "assistant", "content": "x"}])


def test_chat_box_with_and_without_widget(sft_run):
    box = ChatBox(sft_run.model, sft_run.tokenizer, seed=5, max_new_tokens=6)
    plain = box.ask("Hello!")
    w = box.widget()
    assert len(w.children) == 3
    box._temp.value, box._top_p.value = 0.7, 0.9
    assert box.ask("Hello!") == plain  # same seed and sliders: same answer, now streamed into the widget
    assert "Hello!" in box._answer.value and box.transcript[-1] == ("Hello!", plain)


def test_a_real_run_recovers_from_an_out_of_memory_error_without_losing_a_sample(tmp_path, inject_oom):
    # The adaptive controller is part of every single-process run: an OOM in a forward pass (injected here on the
    # third multi-row micro-batch) halves the micro-batch and retries the same samples.
    calls = inject_oom(3)
    run = pipeline.pretrain(out=tmp_path / "run", steps=3, **TINY)
    batching = run.summary["batching"]
    assert calls["multi_row"] >= 3 and batching["oom_events_recovered"] == 1 and batching["samples_lost"] == 0
    assert batching["samples_seen"] == batching["samples_in"] > 0
    assert run.metrics["loss"].dropna().size == 3 and "oom" in ";".join(run.metrics["event"].fillna(""))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["batching"]["oom_events_recovered"] == 1


def test_plan_run_takes_the_profiles_stage_sizes():
    from minimind_lib.profiles import get_profile

    smoke = pipeline.plan_run("smoke", "pretrain")
    prof = get_profile("smoke")
    assert (smoke["steps"], smoke["accum_steps"], smoke["eval_every"]) == (prof.pretrain_steps, prof.accum_steps,
                                                                    prof.eval_every)
    assert smoke["max_tokens"] == prof.max_tokens
    assert "profile smoke" in smoke["reason"]
    gpu = pipeline.plan_run("gpu", "sft")
    g = get_profile("gpu")
    assert (gpu["steps"], gpu["accum_steps"], gpu["max_tokens"]) == (g.sft_steps, g.accum_steps, g.max_tokens)
    assert set(pipeline.plan_kwargs(gpu)) == {"steps", "accum_steps", "max_tokens", "eval_every"}
    with pytest.raises(ValueError, match="stage='ppo'"):
        pipeline.plan_run("smoke", "ppo")
