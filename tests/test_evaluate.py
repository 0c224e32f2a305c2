"""Run health and the evaluation ladder (minimind_lib.evaluate; `compare` and `eval`): real runs of the smoke profile
against the committed smoke band, a run with a huge lr, the doctor on altered metrics, bits per byte and the n-gram
baselines by hand, the two-choice test before and after a workshop-profile pretraining, a transformers export, and
every exit code of both commands."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from minimind_lib import cli, evaluate as ev, pipeline
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.paths import DATA_DIR, REPO_DIR

sys.path.insert(0, str(REPO_DIR / "tools"))
import make_reference  # noqa: E402

torch.set_num_threads(1)  # small models; the CI machine's 2 cores are shared
QUIET = dict(progress=False, log=lambda msg: None)


def run_cli(args: list) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The smoke profile's pretraining and SFT as the CLI runs them (seed 1337, not one of the band's seeds), and a
    smoke pretraining at lr 10 (stopped after 6 steps)."""
    base = tmp_path_factory.mktemp("evaluate")
    common = dict(cache_dir=base / "cache", **QUIET)
    pre = pipeline.pretrain(out=base / "pre", profile="smoke", sample_every=0, **common)
    sft = pipeline.sft(out=base / "sft", init=base / "pre", profile="smoke", **common)
    pipeline.pretrain(out=base / "huge_lr", profile="smoke", lr=10.0, stop_after=6, sample_every=0, **common)
    return {"base": base, "pre": base / "pre", "sft": base / "sft", "huge_lr": base / "huge_lr", "pre_result": pre,
            "sft_result": sft}


@pytest.fixture(scope="module")
def workshop_run(tmp_path_factory):
    """The workshop profile's pretraining, as notebook 07 and the CLI run it (the one long run of this file)."""
    base = tmp_path_factory.mktemp("workshop")
    return pipeline.pretrain(out=base / "pre", profile="workshop", sample_every=0, cache_dir=base / "cache",
                             **QUIET).out_dir


@pytest.fixture(scope="module")
def held_out_docs():
    return ev._records(DATA_DIR / "pretrain_val.jsonl", "pretrain")


# ----------------------------------------------------------------------------------- bands and verdicts
@pytest.mark.parametrize("profile", ["smoke", "workshop", "cpu"])
def test_committed_bands_come_from_five_seeds_of_real_runs(profile):
    band = json.loads((ev.BANDS_DIR / f"{profile}.json").read_text(encoding="utf-8"))
    assert band["format"] == ev.BAND_FORMAT and band["profile"] == profile
    assert band["n_seeds"] == len(band["seeds"]) >= 5
    assert {"command", "date", "device", "cpu", "threads", "torch"} <= set(band["made_by"])
    for stage in ("pretrain", "sft"):
        b = band["stages"][stage]
        assert len(b["seed_curves"]) == band["n_seeds"] and b["comparable"]["stage"] == stage
        q = b["quantiles"]
        assert np.all(np.array(q["0.0"]) <= np.array(q["0.5"])) and np.all(np.array(q["0.5"]) <= np.array(q["1.0"]))
        assert np.all(np.array(b["lower"]) < np.array(b["upper"])) and len(b["tokens"]) == len(b["mean"])
        assert b["tokens"] == sorted(b["tokens"]) and b["tokens"][0] == 0  # step -1: before training


def test_healthy_smoke_runs_are_inside_their_band(runs):
    for stage in ("pre", "sft"):
        verdict = ev.compare_run(runs[stage])
        assert verdict["verdict"] == "inside" and verdict["exit_code"] == 0, verdict["summary"]
        assert verdict["summary"].startswith("inside the smoke band") and "5 seeds" in verdict["summary"]
        assert not [f for f in verdict["findings"] if f["diverged"]]
    code, out, _ = run_cli(["compare", runs["pre"]])
    assert code == 0 and out.startswith("inside the smoke band for pretrain")


def test_a_huge_lr_is_reported_diverged_with_the_reason(runs):
    verdict = ev.compare_run(runs["huge_lr"])
    assert verdict["verdict"] == "diverged" and verdict["exit_code"] == 1
    blowup = [f for f in verdict["findings"] if f["cause"] == "loss blow-up"]
    assert blowup and blowup[0]["diverged"] and "above ln 6400" in blowup[0]["evidence"]
    assert any(note.startswith("lr: this run 10.0") for note in verdict["notes"])
    code, out, _ = run_cli(["compare", runs["huge_lr"], "--json"])
    assert code == 1 and json.loads(out)["verdict"] == "diverged"


def test_compare_json_writes_an_infinite_loss_as_null_with_its_reason(runs, tmp_path):
    run = tmp_path / "inf"
    shutil.copytree(runs["huge_lr"], run, ignore=shutil.ignore_patterns("last.pt"))
    metrics = pd.read_csv(run / "metrics.csv")
    metrics.loc[metrics.index[metrics["val_loss"].notna()][-1], "val_loss"] = math.inf  # an overflowed evaluation
    metrics.to_csv(run / "metrics.csv", index=False)

    def refuse(constant):  # as jq and JSON.parse do
        raise ValueError(f"not JSON: {constant}")
    code, out, err = run_cli(["compare", run, "--json"])
    result = json.loads(out, parse_constant=refuse)
    where = [k for k, v in result["nulls"].items() if v == "inf: not a number JSON holds, written as null"]
    assert code == 1 and result["verdict"] == "diverged" and where and where[0].startswith("points["), err
    assert result["points"][int(where[0][7:].split("]")[0])]["val_loss"] is None


def altered(result, **changes) -> pd.DataFrame:
    """A copy of a run's metrics with columns changed after step -1 (before training stays as it was)."""
    df = result.metrics.copy()
    for column, change in changes.items():
        df.loc[df["step"] >= 0, column] = change(df.loc[df["step"] >= 0, column])
    return df


def test_above_and_below_say_from_how_many_tokens(runs):
    res = runs["pre_result"]
    above = ev.judge(altered(res, val_loss=lambda v: v + 0.5), res.config)
    first_val = int(ev.validation_points(res.metrics)["tokens_seen"].iloc[1])
    assert above["verdict"] == "above" and above["exit_code"] == 1
    assert f"from {first_val:,} tokens on" in above["summary"]
    below = ev.judge(altered(res, val_loss=lambda v: v - 0.5), res.config)
    assert below["verdict"] == "below" and below["exit_code"] == 0
    assert "better than every reference seed" in below["summary"]


def test_the_doctor_names_each_cause_with_its_evidence(runs):
    res = runs["pre_result"]
    df = res.metrics.copy()
    steps = df.index[df["step"] >= 0]
    df.loc[steps[5], "event"] = "nonfinite_loss_skipped"
    df.loc[steps[6], "event"] = "rollback_to_step_6;lr_scale=0.5"
    df.loc[steps[7], "event"] = "scaler_skip(scale 65536->32768)"
    df["scale"] = 32768.0
    df.loc[steps[20], "grad_norm"] = 100 * df.loc[steps, "grad_norm"].median()
    found = {f["cause"]: f for f in ev.doctor(df, res.config)}
    assert "the lr backed off to 0.5 x 0.003" in found["NaN/inf losses or gradients"]["evidence"]
    assert found["NaN/inf losses or gradients"]["diverged"]
    assert "skipped 1 step(s)" in found["fp16 overflow"]["evidence"] and "32768" in found["fp16 overflow"]["evidence"]
    assert found["gradient-norm spikes"]["evidence"].startswith("step 20: ")
    skipped = df.assign(applied=np.where(df["step"] >= 3, False, df["applied"]))
    assert "most steps skipped" in {f["cause"] for f in ev.doctor(skipped, res.config)}
    _, ref = ev.load_band(res.config)
    overfit = altered(res, loss=lambda v: v - 2.0)  # training loss far below the validation loss
    assert "overfitting" in {f["cause"] for f in ev.doctor(overfit, res.config, ref)}


def edited_run(runs, tmp_path, name: str, edit) -> Path:
    run = tmp_path / name
    shutil.copytree(runs["pre"], run, ignore=shutil.ignore_patterns("last.pt"))
    cfg = json.loads((run / "config.json").read_text())
    edit(cfg)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


def test_compare_refuses_what_no_band_covers(runs, tmp_path):
    cases = {"no such run": (tmp_path / "missing", "run directory not found"),
             "gpu": (edited_run(runs, tmp_path, "gpu", lambda c: c.update(profile="gpu")), "no reference band for "
                     "profile 'gpu'"),
             "tokenizer": (edited_run(runs, tmp_path, "tok", lambda c: c["tokenizer"].update(fingerprint="0" * 16)),
                           "a run of another tokenizer"),
             "sizes": (edited_run(runs, tmp_path, "seq", lambda c: c.update(seq_len=64)), "no band covers this run")}
    no_metrics = edited_run(runs, tmp_path, "nometrics", lambda c: None)
    (no_metrics / "metrics.csv").unlink()
    cases["no metrics"] = (no_metrics, "metrics.csv not found")
    for name, (run, message) in cases.items():
        code, out, err = run_cli(["compare", run])
        assert code == 2 and message in err and out == "", name


# ----------------------------------------------------------------------------------- the ladder
def test_bits_per_byte_and_accuracy_by_hand(runs):
    model, tok, _ = ev.load_model(runs["pre"])
    docs = [{"text": "To be, or not to be, that is the question.", "source": "a"},
            {"text": "床前明月光，疑是地上霜。举头望明月，低头思故乡。", "source": "b"},
            {"text": "ROMEO. But soft, what light through yonder window breaks? It is the east.", "source": "a"}]
    seq_len, nats, n_bytes, hits1, n = 8, {}, {}, 0, 0
    for d in docs:  # every target scored alone, with the context of its window of seq_len tokens
        ids = [tok.bos_token_id, *tok.encode(d["text"], add_special_tokens=False)]
        for t in range(1, len(ids)):
            start = (t - 1) // (seq_len - 1) * (seq_len - 1)
            with torch.no_grad():
                logits = model(torch.tensor([ids[start:t]])).logits[0, -1].double()
            lang = ev.language(d["text"])
            nats[lang] = nats.get(lang, 0.0) + float(torch.logsumexp(logits, 0) - logits[ids[t]])
            hits1, n = hits1 + int(logits.argmax() == ids[t]), n + 1
        n_bytes[ev.language(d["text"])] = n_bytes.get(ev.language(d["text"]), 0) + len(d["text"].encode("utf-8"))
    table = ev.text_ladder(model, tok, docs, seq_len, ["a tiny training text", "床前"])["model"]
    for lang in ("English", "Chinese"):
        assert table[f"language: {lang}"]["bits_per_byte"] == pytest.approx(
            nats[lang] / math.log(2) / n_bytes[lang], abs=2e-4)
    assert table["all"]["bits_per_byte"] == pytest.approx(sum(nats.values()) / math.log(2) / sum(n_bytes.values()),
                                                          abs=2e-4)
    assert table["all"]["tokens"] == n and table["all"]["top1"] == pytest.approx(hits1 / n, abs=1e-4)
    assert set(table) >= {"source: a", "source: b"} and table["source: b"]["bytes"] == n_bytes["Chinese"]


def test_the_ngram_baselines_by_hand():
    rng = np.random.default_rng(0)
    vocab, train = 50, rng.integers(0, 20, 400)  # tokens 20..49 never seen
    prev, nxt = rng.integers(0, 50, 60), rng.integers(0, 50, 60)
    got = ev.ngram_scores(train, prev, nxt, vocab)
    uni = np.array([(np.sum(train == w) + 1) / (len(train) + vocab) for w in range(vocab)])
    for i, (v, w) in enumerate(zip(prev, nxt)):
        follow = train[1:][train[:-1] == v]
        seen, types = len(follow), len(set(follow.tolist()))
        row = np.array([(np.sum(follow == x) + types * uni[x]) / (seen + types) if seen else uni[x]
                        for x in range(vocab)])
        assert got["bigram (Witten-Bell)"][0][i] == pytest.approx(-math.log(row[w]))
        assert got["bigram (Witten-Bell)"][1][i] == np.sum(row > row[w])
        assert got["unigram (add-one)"][0][i] == pytest.approx(-math.log(uni[w]))
        assert got["unigram (add-one)"][1][i] == np.sum(uni > uni[w])
        assert row.sum() == pytest.approx(1.0)


def test_two_choice_is_at_chance_untrained_and_above_it_after_workshop_pretraining(workshop_run, held_out_docs):
    model, tok, _ = ev.load_model(workshop_run)
    torch.manual_seed(1337)  # the weights the workshop run started from
    untrained = ev.two_choice(MiniMindForCausalLM(MiniMindConfig.preset("smoke")).eval(), tok, held_out_docs)
    trained = ev.two_choice(model, tok, held_out_docs)
    assert untrained["of"] == trained["of"] == trained["pairs"] > 150 and trained["questions"] == 2 * trained["pairs"]
    low, high = untrained["interval95"]
    assert low < 0.5 < high and untrained["verdict"].startswith("not distinguishable from chance")
    assert trained["interval95"][0] > 0.5 and trained["verdict"] == "above chance"


def test_the_two_choice_interval_counts_pairs_not_questions():
    one_each = ev.pair_share(np.tile([1.0, 0.0], 100))  # each of 100 pairs right one way only: what ignoring gives
    assert one_each == {**ev.share(50.0, 100), "both_right": 0}  # 50%, its interval over 100 pairs, not 200 answers
    width = lambda s: s["interval95"][1] - s["interval95"][0]  # noqa: E731
    assert width(one_each) > 1.4 * width(ev.share(100, 200))
    mixed = ev.pair_share([1, 1, 1, 0, 0.5, 0, 0, 0])  # pairs scoring 1, 1/2, 1/4 (a tie and a miss), 0
    assert (mixed["count"], mixed["of"], mixed["both_right"]) == (1.75, 4, 1)


def test_the_baselines_count_the_pretraining_the_model_started_from(runs, tmp_path):
    cap = runs["pre_result"].config["max_samples"]  # the smoke profile's: fewer documents than the file holds
    pre_texts, pre_where = ev.pretraining_texts(runs["pre_result"].config)
    sft_texts, sft_where = ev.pretraining_texts(runs["sft_result"].config)  # through its init run
    assert sft_texts == pre_texts and len(pre_texts) <= cap
    assert pre_where.endswith(f"({len(pre_texts)} documents: the training set of this run)")
    assert sft_where.endswith(f"the training set of the pretraining run {runs['pre'].resolve()})")
    gone = {**runs["sft_result"].config, "init": str(tmp_path / "gone")}  # its pretraining run deleted since
    texts, where = ev.pretraining_texts(gone)
    assert len(texts) > cap and "the whole file" in where and str(tmp_path / "gone") in where
    texts, where = ev.pretraining_texts(None)  # an export: it names no run
    assert len(texts) > cap and "names no pretraining run" in where


def test_the_wilson_interval():
    assert ev.share(0, 10)["interval95"] == [0.0, 0.2775] and ev.share(5, 10)["interval95"] == [0.2366, 0.7634]
    assert ev.share(5, 10)["share"] == 0.5 and ev.share(5, 10)["of"] == 10


def test_eval_cli_reports_the_ladder_and_nothing_is_written(runs, tmp_path, held_out_docs):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in held_out_docs[:40]), encoding="utf-8")
    before = snapshot(runs["sft"])
    code, out, _ = run_cli(["eval", runs["sft"], "--data", small, "--replies", 3, "--json"])
    result = json.loads(out)
    assert code == 0 and snapshot(runs["sft"]) == before
    assert result["documents"] == 40 and set(result["table"]) == {"model", "unigram (add-one)", "bigram (Witten-Bell)"}
    assert {"all", "language: English", "language: Chinese"} <= set(result["table"]["model"])
    chat = result["chat"]  # the SFT run's own held-out 5%, the conversations its validation loss came from
    assert chat["conversations"] == runs["sft_result"].config["sft_val_holdout"]
    assert chat["ended_with_im_end"]["of"] == 3
    assert "the training set of the pretraining run" in result["baselines_from"]  # the run its SFT started from
    code, text, _ = run_cli(["eval", runs["sft"], "--data", small, "--replies", 1])
    assert code == 0 and "bits_per_byte" in text and "two-choice continuation" in text and "after SFT" in text


def test_eval_refuses_bad_input(runs, tmp_path, held_out_docs):
    few, blank, odd = tmp_path / "few.jsonl", tmp_path / "blank.jsonl", tmp_path / "odd.jsonl"
    few.write_text("".join(json.dumps(d) + "\n" for d in held_out_docs[:5]))
    blank.write_text("\n\n")
    odd.write_text('{"title": "no text here"}\n')
    other_tok = edited_run(runs, tmp_path, "tok", lambda c: c["tokenizer"].update(fingerprint="0" * 16))
    cases = [([tmp_path / "missing"], "run directory not found"),
             ([runs["pre"], "--data", few], "needs at least 20 held-out documents"),
             ([runs["pre"], "--data", blank], "no usable text"),
             ([runs["pre"], "--data", odd], "neither 'text' nor 'conversations'"),
             ([other_tok], "not the one the model was trained with")]
    for args, message in cases:
        before = snapshot(tmp_path)
        code, out, err = run_cli(["eval", *args])
        assert code == 2 and message in err and out == "" and snapshot(tmp_path) == before, (args, err)


def test_a_transformers_export_gives_the_same_numbers(runs, tmp_path, held_out_docs):
    pytest.importorskip("transformers")
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in held_out_docs[:40]), encoding="utf-8")
    assert run_cli(["export", runs["sft"], "--to", tmp_path / "hf"])[0] == 0
    ours = ev.evaluate_model(runs["sft"], small, replies=4, reply_tokens=12)
    theirs = ev.evaluate_model(tmp_path / "hf", small, seq_len=ours["context"])
    assert theirs["kind"] == "transformers" and "chat" not in theirs  # an export does not know its held-out split
    for group, row in ours["table"]["model"].items():
        for key, value in row.items():
            assert theirs["table"]["model"][group][key] == pytest.approx(value, abs=2e-4), (group, key)
    assert theirs["two_choice"]["count"] == ours["two_choice"]["count"]
    model, tok, cfg = ev.load_model(tmp_path / "hf")
    convs = [r["conversations"] for r in ev._records(DATA_DIR / "sft.jsonl", "sft", 12)]
    chat_hf = ev.chat_ladder(model, tok, convs, ours["context"], 12, 4)
    chat_run = ev.chat_ladder(*ev.load_model(runs["sft"])[:2], convs, ours["context"], 12, 4)
    assert chat_hf["assistant_loss"] == pytest.approx(chat_run["assistant_loss"], abs=2e-4)
    assert chat_hf["ended_with_im_end"] == chat_run["ended_with_im_end"]
    assert chat_hf["same_language"] == chat_run["same_language"]


# ----------------------------------------------------------------------------------- the band tool
def test_the_band_tool_t_quantile_and_prediction_interval():
    assert make_reference.t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-3)
    assert make_reference.t_quantile(0.975, 1) == pytest.approx(12.706, abs=1e-2)
    runs = [{"seed": s, "tokens": [0, 100, 200], "val_loss": [8.0, 6.0 + d, 5.0 + d], "gap": 0.1 * d,
             "grad_ratio": 2.0, "wall_time_s": 1.0, "dtype": "fp32", "amp_reason": "", "comparable": {}, "training": {}}
            for s, d in enumerate([0.0, 0.1, 0.2, 0.3, 0.4])]
    band = make_reference.stage_band(runs, make_reference.t_quantile(0.975, 4))
    assert band["tokens"] == [0, 100, 200] and band["mean"][-1] == pytest.approx(5.2)
    sd = np.std([5.0, 5.1, 5.2, 5.3, 5.4], ddof=1)
    assert band["upper"][-1] == pytest.approx(5.2 + 2.7764 * sd * math.sqrt(1.2), abs=1e-3)
    assert band["quantiles"]["1.0"][-1] == pytest.approx(5.4) and band["quantiles"]["0.0"][-1] == pytest.approx(5.0)
