"""Is my run healthy, and what did it learn? Notebooks 07_pretrain and 08_sft, `python -m
minimind_lib compare|eval`.

1. Health: a profile's reference band (assets/bands/<profile>.json: tools/make_reference.py, >= 5
seeds of real runs) holds the validation loss against trained tokens; `judge` says inside, above,
below or diverged, and `doctor` names the likely cause. 2. The ladder (`evaluate_model`): bits per
byte per language, top-k accuracy, n-gram baselines, a two-choice continuation test, the reply
format after SFT.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from .checkpoint import (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, RunError, applied, load_run,
                         read_run_config, with_tokens_seen)
from .checks import require
from .corpus import PAYLOAD, JsonlReader, tokenize_samples
from .data import holdout_indices, pad_collate
from .export import WEIGHTS_FILE, read_hf
from .fileio import file_fingerprint
from .generate import chat_reply
from .paths import ASSETS_DIR, DATA_DIR, find_data_file
from .profiles import get_profile
from .tokenizer import load_tokenizer

BAND_FORMAT, BAND_VERSION, BANDS_DIR = "minimind-band", 1, ASSETS_DIR / "bands"
SPIKE_FACTOR = 10.0  # a gradient norm this many times the run's median (after warmup) is a spike
# a loss this far above ln(vocab), the loss of uniform guessing, after training began: diverged
BLOWUP_NATS = 0.5
NUMBERS = ("step", "loss", "tokens", "val_loss", "grad_norm")  # the metrics.csv columns read


# ----------------------------------------------------------------------------------- 1. health:
# band and doctor
def comparable(cfg: dict) -> dict:
    """What a run's validation loss measures besides training: model, tokenizer, validation data and
    batches."""
    held_out = cfg["stage"] != "pretrain" and not cfg.get("val_data")  # 5% of the training file
    # notebooks 07/08 record the file, the CLI its fingerprint too
    path = cfg.get("data" if held_out else "val_data")
    fingerprint = cfg.get("data_fingerprint" if held_out else "val_data_fingerprint")
    if not fingerprint and path and Path(path).is_file():
        fingerprint = file_fingerprint(path)
    extra = {}
    if held_out:
        extra["max_samples"] = cfg.get("max_samples")
    return {"stage": cfg["stage"], "model": cfg["model"],
            "tokenizer": cfg["tokenizer"]["fingerprint"],
            "seq_len": cfg.get("seq_len"), "max_tokens": cfg.get("max_tokens"),
            "val_batches": cfg.get("val_batches"),
            "validation data": fingerprint or None, **extra}


def load_band(cfg: dict) -> tuple[dict, dict]:
    """(band file, its stage) covering a run's config; RunError saying why none does (nothing is
    guessed)."""
    path, stage = BANDS_DIR / f"{cfg.get('profile')}.json", cfg["stage"]
    if path.is_file():
        band = json.loads(path.read_text(encoding="utf-8"))
    else:
        band = {"stages": {}}
    ref = band["stages"].get(stage)
    if ref is None:
        raise RunError(f"no reference band for profile {cfg.get('profile')!r}, stage {stage!r} "
                       "(bands: "
                       f"{sorted(p.stem for p in BANDS_DIR.glob('*.json'))}; "
                       "tools/make_reference.py makes one)")
    mine = comparable(cfg)  # once: it may hash the validation file
    key = next((k for k, value in ref["comparable"].items() if mine.get(k) != value), None)
    if key:
        raise RunError(
            f"{'a run of another tokenizer' if key == 'tokenizer' else f'{key} differs'}: this run "
            "has "
            f"{key} = {mine.get(key)!r:.160}, the {band['profile']} band's runs had "
            f"{ref['comparable'][key]!r:.160}; no band covers this run, so no verdict"
        )
    return band, ref


def read_metrics(run_dir: str | Path) -> pd.DataFrame:
    """A run's metrics.csv (step -1: before training) with tokens_seen: the tokens of the steps it
    kept, cumulated."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run logged no checkpoint (a run that "
                                "stopped with an error "
                                f"before its first one writes none; the error message says why)")
    try:
        df = pd.read_csv(path)
    except (ValueError, UnicodeDecodeError) as e:  # pandas' parser errors are ValueErrors
        raise RunError(f"{path}: not a metrics table ({e})") from None
    missing = sorted(set(NUMBERS) - set(df.columns))
    require(not missing, f"{path}: lacks column(s) {missing}: not a metrics table this program "
            "wrote", RunError)
    check_rows(path, len(df.columns))
    for column in NUMBERS:  # a hand-edited cell: named, not a traceback later
        values = pd.to_numeric(df[column], errors="coerce")
        bad = df.index[values.isna() & df[column].notna()]
        if len(bad):
            first = int(bad[0])
        else:
            first = -1
        require(first < 0, f"{path}:{first + 2}: column {column!r} holds "
                f"{df[column].get(first)!r}, not a number (a hand-edited cell?), so no verdict",
                RunError)
        df[column] = values
    return with_tokens_seen(df)


def check_rows(path: Path, n_columns: int) -> None:
    """Refuse a metrics table cut short: its last row without an end of line, or a row with fields
    missing (pandas would read them as empty)."""
    with open(path, "rb") as f:
        f.seek(-1, 2)
        require(f.read(1) == b"\n", f"{path}: its last row is cut short (no end of line): the "
                "file is incomplete (a run writes it whole), so no verdict", RunError)
    with open(path, newline="", encoding="utf-8") as f:
        short = next((n for n, row in enumerate(csv.reader(f), 1) if len(row) != n_columns), 0)
    require(short == 0, f"{path}:{short}: not a row of {n_columns} fields: the file was cut or "
            "edited, so no verdict", RunError)


def validation_points(df: pd.DataFrame) -> pd.DataFrame:
    """The validation losses a run kept (not those of steps a NaN rollback undid), with their
    trained tokens."""
    kept = ~df.reindex(columns=["rolled_back"], fill_value=False)["rolled_back"]
    kept = kept.fillna(False).astype(bool)
    points = df[df["val_loss"].notna() & kept]
    return points[["step", "tokens_seen", "val_loss"]].reset_index(drop=True)


def final_gap(df: pd.DataFrame, window: int) -> float:
    """The last validation loss minus the mean training loss of the last `window` applied steps
    (overfitting)."""
    train = df[applied(df) & (df["step"] >= 0)]["loss"].tail(max(1, window))
    return float(validation_points(df)["val_loss"].iloc[-1] - train.mean())


def grad_spikes(df: pd.DataFrame, warmup: int) -> dict:
    """Gradient norms after warmup above SPIKE_FACTOR x their median: [(step, norm, ratio)], median,
    largest ratio."""
    g = df[(df["step"] >= warmup) & np.isfinite(df["grad_norm"])]
    if len(g):
        median = float(g["grad_norm"].median())
    else:
        median = math.nan
    spikes = [(int(s), float(n), n / median) for s, n in zip(g["step"], g["grad_norm"])
              if n > SPIKE_FACTOR * median]
    largest = math.nan
    if len(g):
        largest = float(g["grad_norm"].max() / median)
    return {"median": median, "max_over_median": largest,
            "spikes": spikes}


def doctor(df: pd.DataFrame, cfg: dict, ref: dict | None = None) -> list[dict]:
    """The likely causes of trouble in a run's metrics, each {"cause", "evidence", "diverged"} (ref:
    the band's)."""
    steps, found = df[df["step"] >= 0], []
    events = [e for ev in steps.get("event", pd.Series(dtype=str)).fillna("").astype(str)
              for e in ev.split(";") if e]
    add = lambda cause, evidence, diverged=False: found.append(  # noqa: E731
        {"cause": cause, "evidence": evidence, "diverged": diverged})
    rollbacks = sum(e.startswith(("rollback_to_step_", "no_checkpoint_to_roll_back_to"))
                    for e in events)
    scales, nonfinite = [e[9:] for e in events if e.startswith("lr_scale=")], sum("nonfinite" in e
                                                                                  for e in events)
    # fit rolls back to last.pt after max_bad_steps NaN/inf steps in a row, lr lowered
    if rollbacks or nonfinite:
        add("NaN/inf losses or gradients",
            f"{nonfinite} non-finite step(s) skipped, {rollbacks} rollback(s)" + (
            f"; the lr backed off to {scales[-1]} x {cfg['train']['lr']:g}" if scales else ""),
            rollbacks > 0)
    skips = [e for e in events if e.startswith("scaler_skip")]
    if skips:
        add("fp16 overflow",
            f"the GradScaler skipped {len(skips)} step(s) (first: {skips[0]}); its scale at the "
            "end: "
            f"{steps['scale'].dropna().iloc[-1]:g}")
    n_skipped = int((~applied(steps)).sum())
    if n_skipped > len(steps) / 2:
        add("most steps skipped", f"{n_skipped} of {len(steps)} optimizer steps changed no weight",
            True)
    limit, val = (
        math.log(cfg["model"]["vocab_size"]) + BLOWUP_NATS,
        validation_points(df)["val_loss"],
    )
    blown = steps[(steps["loss"] > limit) | (steps["val_loss"] > limit)]
    if len(blown):
        row = blown.iloc[0]
        add("loss blow-up",
            f"loss {np.nanmax([row['loss'], row['val_loss']]):.4g} at step {int(row['step'])}, "
            "above "
            f"ln {cfg['model']['vocab_size']} + {BLOWUP_NATS} = {limit:.2f} (ln vocab: guessing "
            "uniformly), lr "
            f"{cfg['train']['lr']:g}; last validation loss "
            f"{val.iloc[-1] if len(val) else math.nan:.4g}", True)
    g = grad_spikes(df, cfg["train"].get("warmup_steps", 0))
    if g["spikes"]:
        add("gradient-norm spikes",
            ", ".join(f"step {s}: {n:.3g} = {r:.0f}x the run's median {g['median']:.3g}"
                                              for s, n,
                                              r in g["spikes"][:3]) + f" ({len(g['spikes'])} in "
                                                                      "all)")
    if ref is None:
        return found
    gap = final_gap(df, cfg["train"].get("eval_every") or 1)
    if gap > max(ref["gap"]["upper"], 0):
        add("overfitting",
            f"the last validation loss is {gap:.3f} above the training loss, the band allows "
            f"{ref['gap']['upper']:.3f} (its seeds: up to {max(ref['gap']['per_seed']):.3f}): more "
            "data, fewer steps")
    return found


def judge(df: pd.DataFrame, cfg: dict) -> dict:
    """The verdict on a run (metrics, config) against its band: inside, above or below (from N
    tokens on), diverged."""
    band, ref = load_band(cfg)
    val = validation_points(df)
    if val.empty:
        raise RunError("the run logged no validation loss, so there is nothing to compare (pass "
                       "--val-data)")
    findings, tokens = doctor(df, cfg, ref), np.asarray(ref["tokens"])
    # a stage added to the file later (make_reference.py --add) records its own seeds and machine
    mb, seeds = ref.get("made_by", band["made_by"]), ref.get("seeds", band["seeds"])
    # 10% past the band's end at most: no extrapolation
    val = val[val["tokens_seen"] <= 1.1 * tokens[-1]]
    val = val.assign(**{k: np.interp(val["tokens_seen"], tokens, ref[k]) for k in ("lower",
                                                                                   "upper")},
                     median=np.interp(val["tokens_seen"], tokens, ref["quantiles"]["0.5"]))
    side = (val["val_loss"] > val["upper"]).to_numpy(int) - (
        val["val_loss"] < val["lower"]
    ).to_numpy(int)
    # of the last run
    start = len(side) - next((i for i, s in enumerate(side[::-1]) if s != side[-1]), len(side))
    last = val.iloc[-1]
    covers = (f"the {band['profile']} band for {cfg['stage']} ({len(seeds)} seeds of the profile's "
              f"run on {mb['device']}, {mb['cpu']}, {mb['threads']} threads, {ref['dtype']}, torch "
              f"{mb['torch']}, {mb['date']})")
    unit = "pairs" if cfg["stage"] == "dpo" else "tokens"  # a DPO run counts pairs (notebook 10)
    at = (f"validation loss {last['val_loss']:.3f} at {int(last['tokens_seen']):,} {unit}, the "
          "band allows "
          f"{last['lower']:.3f} to {last['upper']:.3f} (seeds' median {last['median']:.3f})")
    verdict = "diverged" if any(f["diverged"] for f in findings) else {0: "inside", 1: "above",
                                                                       -1: "below"}[side[-1]]
    if verdict in ("above", "below"):
        since = f" from {int(val['tokens_seen'].iloc[start]):,} {unit} on"
    else:
        since = ""
    if verdict == "diverged":
        summary = "diverged: " + "; ".join(f"{f['cause']} ({f['evidence']})" for f in findings
                                           if f["diverged"])
    else:
        summary = f"{verdict} {covers}{since}: {at}" + ("; better than every reference seed (more "
                                                        "steps or another lr?)"
                                                        if verdict == "below" else "")
    notes = [f"{k}: this run {cfg['train'].get(k)!r}, the band's runs {v!r}" for k,
             v in ref["training"].items()
             # what the run changed (the band's device and dtype: in the summary)
             if cfg["train"].get(k) != v]
    return {"verdict": verdict, "exit_code": int(verdict in ("above", "diverged")),
            "summary": summary,
            "findings": findings, "notes": notes, "points": val.round(4).to_dict("records"),
            "band": {"profile": band["profile"], "stage": cfg["stage"], "seeds": seeds,
                     "made_by": mb,
                     "dtype": ref["dtype"], "method": band["method"]}}


def compare_run(run_dir: str | Path) -> dict:
    """`python -m minimind_lib compare RUN`: judge a run directory (config.json, metrics.csv)
    against its band; a metrics.csv with fewer trained tokens than summary.json says: refused."""
    cfg, df, summary = read_run_config(run_dir), read_metrics(run_dir), Path(run_dir) / SUMMARY_FILE
    done = None
    if summary.is_file():
        done = json.loads(summary.read_text(encoding="utf-8")).get("tokens")
    if len(df):
        seen = int(df["tokens_seen"].iloc[-1])
    else:
        seen = 0
    require(not isinstance(done, int) or seen >= done, f"{Path(run_dir) / METRICS_FILE}: holds "
            f"{seen:,} trained tokens, {summary} says the run trained {done:,}: rows are missing, "
            f"so no verdict", RunError)
    return {"run": str(run_dir), **judge(df, cfg)}


# ----------------------------------------------------------------------------------- 2. the
# evaluation ladder
# 95% normal quantile; two-choice passage/continuation tokens
Z95, HALF, MIN_TWO_CHOICE_DOCS = 1.959964, 32, 20


def language(text: str) -> str:
    """"Chinese" when CJK characters outnumber Latin letters, "English" when Latin letters are as
    many, else "other"."""
    cjk = sum("\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" for c in text)
    latin = sum(c.isascii() and c.isalpha() for c in text)
    if cjk > latin:
        return "Chinese"
    return "English" if latin else "other"


def share(k: float, n: int) -> dict:
    """k out of n, its share and the share's Wilson 95% interval (sound near 0 and 1 and for small
    n)."""
    center, d = (k / n + Z95 ** 2 / (2 * n)), 1 + Z95 ** 2 / n
    half = Z95 * math.sqrt(k / n * (1 - k / n) / n + Z95 ** 2 / (4 * n * n))
    return {"count": k, "of": n, "share": round(k / n, 4),
            "interval95": [round((center - half) / d, 4), round((center + half) / d, 4)]}


def load_model(path: str | Path, device: str = "cpu") -> tuple[torch.nn.Module, Any, dict | None]:
    """(model, tokenizer, run config) of a run directory, or of a transformers export (config None:
    transformers' own Llama/Qwen3 classes compute its numbers, loaded by AutoModelForCausalLM
    without remote code). An export is first checked as import-hf checks it, and loaded only when
    transformers found every weight and nothing else."""
    if not (Path(path) / WEIGHTS_FILE).exists():
        return load_run(path, device=device)
    _, tok = read_hf(path)  # config.json, tokenizer, weights: an error names the file and the fault
    from transformers import AutoModelForCausalLM  # here only: the course runs without transformers
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                       output_loading_info=True)
    wrong = {k: sorted(map(str, v))[:3] for k, v in info.items() if v}  # missing, unexpected keys
    require(not wrong, f"{Path(path) / WEIGHTS_FILE}: transformers did not load it as written "
            f"({wrong}): its numbers would be another model's", RunError)
    return model.to(device).eval(), tok, None


@torch.no_grad()
def token_scores(model: torch.nn.Module, rows: list[np.ndarray], last: int = 0,
                 batch: int = 16) -> list[tuple]:
    """Per row of ids: each next token's loss (nats, fp32) and rank among the predictions, counted
    up to 5 (5: not in the top 5); last > 0: only the last `last` tokens of rows of one length (no
    logits for the others)."""
    out, device = [], next(model.parameters()).device
    # right-padded: a causal model's real positions never see the padding
    for i in range(0, len(rows), batch):
        ids = pad_collate([{"input_ids": torch.as_tensor(r)} for r in rows[i : i + batch]])[
            "input_ids"
        ].to(device)
        logits = model(ids, logits_to_keep=last + 1 if last else 0).logits[:, :-1].float()
        target = ids[:, -logits.shape[1]:]
        nll = F.cross_entropy(logits.flatten(0, 1), target.flatten(),
                              reduction="none").view(target.shape)
        # topk: a third of sort
        rank = (logits.topk(5, dim=-1).values > logits.gather(-1, target[..., None])).sum(-1)
        out += [(n[:len(r) - 1], k[:len(r) - 1]) for n, k, r in zip(nll.cpu().numpy(),
                                                                    rank.cpu().numpy(),
                                                                   rows[i:i + batch])]
    return out


def ngram_scores(train: np.ndarray, prev: np.ndarray, nxt: np.ndarray, vocab: int) -> dict[str,
                                                                                           tuple]:
    """Loss and rank of each next token under a unigram (add-one smoothing) and a bigram model of
    `train` (Witten-Bell: P(w|v) = (c(v,w) + T(v) P(w)) / (c(v) + T(v)), v seen c(v) times with T(v)
    distinct followers)."""
    uni = (np.bincount(train, minlength=vocab) + 1.0) / (len(train) + vocab)
    # the bigrams v * vocab + w
    codes, counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)
    ptr, cum = (
        np.searchsorted(codes, np.arange(vocab + 1) * vocab),
        np.concatenate([[0], np.cumsum(counts)]),
    )
    nll, rank, order = np.empty(len(nxt)), np.empty(len(nxt), np.int64), np.argsort(prev,
                                                                                    kind="stable")
    bounds = np.searchsorted(prev[order], np.arange(vocab + 1))
    for v in np.unique(prev):  # one dense row P(. | v) per distinct previous token
        seen, followers = cum[ptr[v + 1]] - cum[ptr[v]], ptr[v + 1] - ptr[v]
        row = uni * followers
        row[codes[ptr[v]:ptr[v + 1]] % vocab] += counts[ptr[v]:ptr[v + 1]]
        row, at = row / (seen + followers) if seen else uni, order[bounds[v]:bounds[v + 1]]
        nll[at], rank[at] = -np.log(row[nxt[at]]), (row[None, :] > row[nxt[at], None]).sum(1)
    return {"unigram (add-one)": (-np.log(uni[nxt]), vocab - np.searchsorted(np.sort(uni),
                                                                             uni[nxt], "right")),
            "bigram (Witten-Bell)": (nll, rank)}


def ladder_row(nll: np.ndarray, rank: np.ndarray, n_bytes: int) -> dict:
    """Loss, bits per byte (total nats / (ln 2 x UTF-8 bytes)), top-1 and top-5 accuracy of scored
    tokens."""
    return {"loss": round(float(nll.mean()), 4),
            "bits_per_byte": round(float(nll.sum() / math.log(2) / n_bytes), 4),
            "top1": round(float((rank < 1).mean()), 4), "top5": round(float((rank < 5).mean()), 4),
            "tokens": len(nll), "bytes": n_bytes}


def text_ids(tok: Any, docs: list[dict]) -> list[np.ndarray]:
    """[bos] + the tokens of each document's text (no [eos]: it would add nats for no byte)."""
    flat, lengths, _ = tokenize_samples("pretrain", [d["text"] for d in docs], tok)
    return [s[:-1] for s in np.split(flat, np.cumsum(lengths)[:-1])]


def text_ladder(model: torch.nn.Module, tok: Any, docs: list[dict], seq_len: int,
                train_texts: list[str] | None = None) -> dict:
    """ladder_row per scorer (model, n-grams of train_texts) and group (all, language, source) of
    every token after [bos], scored in windows of seq_len tokens that overlap by one, as training
    chunks text."""
    ids = text_ids(tok, docs)
    rows = [(k, s[a:a + seq_len]) for k, s in enumerate(ids) for a in range(0, max(1, len(s) - 1),
                                                                            seq_len - 1)]
    doc_of = np.repeat([k for k, _ in rows], [len(r) - 1 for _, r in rows])
    prev, nxt = np.concatenate([r[:-1] for _, r in rows]), np.concatenate([r[1:] for _, r in rows])
    model_scores = token_scores(model, [r for _, r in rows])  # per window: (nll, top-k hits)
    scorers = {"model": tuple(map(np.concatenate, zip(*model_scores)))}
    if train_texts:  # the unigram and bigram baselines, counted on the training text
        train_ids = tokenize_samples("pretrain", train_texts, tok)[0]
        scorers.update(ngram_scores(train_ids, prev, nxt, model.config.vocab_size))
    n_bytes, langs = np.array([len(d["text"].encode()) for d in docs]), [language(d["text"])
                                                                         for d in docs]
    groups = {"all": np.ones(len(docs), bool), **{f"language: {v}": np.array(langs) == v
                                                  for v in sorted(set(langs))},
              **{f"source: {v}": np.array([str(d.get("source")) == v for d in docs])
                 for v in sorted(
                  {str(d["source"]) for d in docs if "source" in d})}}
    return {name: {g: ladder_row(nll[m[doc_of]], rank[m[doc_of]], int(n_bytes[m].sum())) for g,
                   m in groups.items()}
            for name, (nll, rank) in scorers.items()}


def pair_share(correct: np.ndarray) -> dict:
    """`share` over pairs: correct holds pair i's two answers at 2i, 2i + 1 (1 right, 0.5 a tie).

    A pair scores their mean: its two questions share both texts, so they are not independent.
    A score in [0, 1] varies at most as a coin of the same mean, so Wilson's interval is safe."""
    score = np.asarray(correct, dtype=float).reshape(-1, 2).mean(1)
    return {**share(float(score.sum()), len(score)), "both_right": int((score == 1).sum())}


def two_choice(model: torch.nn.Module, tok: Any, docs: list[dict], half: int = HALF) -> dict:
    """Own continuation or that of another document of its language, scored by how much the passage
    raises each one's log-likelihood, log p(c | passage) - log p(c | [bos]) (plain log p(c |
    passage) favours text that is easy anyway: reported beside). Each pair is asked both ways, so
    ignoring the passage scores 50% (a tie counts half); the share and its interval count pairs
    (pair_share)."""
    ids, langs = text_ids(tok, docs), [language(d["text"]) for d in docs]
    ok = [k for k, s in enumerate(ids) if len(s) > 2 * half]
    if len(ok) < MIN_TWO_CHOICE_DOCS:
        raise RunError(f"the two-choice test needs at least {MIN_TWO_CHOICE_DOCS} held-out "
                       "documents of more than "
                       f"{2 * half} tokens; the data has {len(ok)} (of {len(ids)} documents)")
    by_lang = [[k for k in ok if langs[k] == lang] for lang in sorted({langs[k] for k in ok})]
    pairs = [(g[i], g[i + 1]) for g in by_lang for i in range(0, len(g) - 1, 2)]
    rows, alone = [], []
    for a, b in pairs:  # each pair asked both ways: own then other continuation, for a then for b
        for passage, continuation in ((a, a), (a, b), (b, b), (b, a)):
            cont = ids[continuation][half + 1:2 * half + 1]
            rows.append(np.concatenate([ids[passage][:half + 1], cont]))  # [bos] + passage + cont
            alone.append(np.concatenate([ids[continuation][:1], cont]))  # [bos] + cont
    scores = token_scores(model, rows, half) + token_scores(model, alone, half)
    ll = np.array([-nll.sum() for nll, _ in scores])
    ll = ll.reshape(2, -1, 2)  # (with passage, alone) x question (pair i: 2i, 2i+1) x (own, other)
    with_passage, without = ll[0], ll[1]
    own_gain = with_passage[:, 0] - without[:, 0]
    other_gain = with_passage[:, 1] - without[:, 1]
    gain = own_gain - other_gain  # > 0: the passage raised its own continuation more
    result = pair_share((gain > 0) + 0.5 * (gain == 0))
    low, high = result["interval95"]
    verdict = "not distinguishable from chance (50% is inside the interval)"
    if low > 0.5:
        verdict = "above chance"
    elif high < 0.5:
        verdict = "below chance"
    plain = pair_share(with_passage[:, 0] > with_passage[:, 1])
    return {**result, "pairs": len(pairs), "questions": len(gain), "chance": 0.5, "tokens": half,
            "verdict": verdict, "plain_log_likelihood": plain}


def chat_ladder(model: torch.nn.Module, tok: Any, convs: list[list[dict]], seq_len: int,
                reply_tokens: int,
                replies: int) -> dict:
    """After SFT: the assistant-token loss (cut at seq_len, as SFT trains) and, for `replies` first
    questions, the greedy reply: ended with <|im_end|> within reply_tokens? in the question's
    language (by script)?"""
    flat, lengths, mask = tokenize_samples("sft", convs, tok)
    cut = np.cumsum(lengths)[:-1]
    scored = token_scores(model, [s[:seq_len] for s in np.split(flat, cut)])
    nll = np.concatenate([n[m[1:seq_len] == 1] for (n, _), m in zip(scored, np.split(mask, cut))])
    asked = []  # those with a question right before the first answer
    for conv in convs:
        first = next(i for i, turn in enumerate(conv) if turn["role"] == "assistant")
        if first and conv[first - 1]["role"] == "user":
            asked.append(conv[:first])
    asked = asked[:replies]
    ended = same = 0
    for messages in asked:
        details, question = {}, language(messages[-1]["content"] or "")
        reply = chat_reply(model, tok, messages, temperature=0.0, max_new_tokens=reply_tokens,
                           details=details)
        ended, same = ended + details["ended"], same + (question != "other"
                                                        and language(reply) == question)
    why = (f"no assistant token within the first {seq_len} tokens of any of the {len(convs)} "
           f"conversations: a longer --seq-len")
    out = {"conversations": len(convs), "assistant_tokens": len(nll), "assistant_loss": None}
    if len(nll):
        out["assistant_loss"] = round(float(nll.mean()), 4)
    else:
        out["assistant_loss_missing"] = why
    out["reply_budget"] = reply_tokens
    if asked:
        out["ended_with_im_end"] = share(ended, len(asked))
        out["same_language"] = share(same, len(asked))
    return out


def _records(path: str | Path, kind: str, max_samples: int | None = None) -> list[dict]:
    """The records of a jsonl file of `kind` (a bad line: an error naming file:line); RunError when
    none is usable."""
    reader = JsonlReader(path, kind=kind, max_samples=max_samples)
    records = [r for r in reader if kind == "sft" or r["text"].strip()]
    if not records:
        raise RunError(f"{path}: no usable {PAYLOAD[kind]} ({reader.report()}, {reader.n_blank} "
                       "blank)")
    return records


def held_out(cfg: dict | None, data: str | Path | None,
             tok: Any = None) -> tuple[Path, list | None]:
    """(held-out text, held-out conversations or None) of a run's config (None: an export).

    `data`, a jsonl of {"text"} or of {"conversations"}, replaces the text or the conversations;
    tok: the run's tokenizer (default: the bundled one), which says the conversations that train."""
    first = None
    if data is not None:
        first = next(iter(JsonlReader(data)), None)
    kind = next((k for k, key in PAYLOAD.items() if isinstance(first, dict) and key in first), None)
    if data is not None and kind is None:
        raise RunError(f"{data}: no usable text: " + ("no record in the file" if first is None else
                                                      "its first record holds neither 'text' nor "
                                                      "'conversations'"))
    cfg, convs = cfg or {}, None
    pre, sft = cfg.get("stage") == "pretrain", cfg.get("stage") == "sft"
    text = None
    if kind == "pretrain":
        text = data
    elif pre:
        text = cfg.get("val_data")
    if kind == "sft" or (sft and cfg.get("val_data")):
        convs = _records(data if kind == "sft" else cfg["val_data"], "sft")
    elif sft:  # the run's own held-out 5% of its SFT file, drawn as the run drew it
        every = _records(cfg["data"], "sft", cfg.get("max_samples"))
        convs = [r["conversations"] for r in every]
        _, lengths, mask = tokenize_samples("sft", convs, tok or load_tokenizer())
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # each one's first place in `mask`
        trains = [mask[a + 1:a + min(n, cfg["seq_len"])].any() for a, n in zip(starts, lengths)]
        convs = [every[i] for i in holdout_indices(len(every), cfg["train"]["seed"], trains)[1]]
    return Path(text or DATA_DIR / "pretrain_val.jsonl"), convs


def pretraining_texts(cfg: dict | None) -> tuple[list[str], str]:
    """The documents the n-gram baselines count, and a sentence saying what they are.

    The training set of the pretraining run the weights come from (its own, or an SFT run's init
    run, followed back); else (an export, an init run that is gone) the whole bundled file."""
    cfg, init = cfg or {}, None
    for _ in range(8):  # an SFT run of an SFT run: the init's init (bounded: a cycle ends)
        if cfg.get("stage") != "sft" or not cfg.get("init"):
            break
        if not (Path(cfg["init"]) / CONFIG_FILE).is_file():
            break
        init = cfg["init"]
        cfg = read_run_config(init)
    if cfg.get("stage") == "pretrain":
        records = _records(cfg["data"], "pretrain", cfg.get("max_samples"))
        texts = [r["text"] for r in records]
        run = "this run" if init is None else f"the pretraining run {init}"
        return texts, f"{cfg['data']} ({len(texts)} documents: the training set of {run})"
    if cfg.get("init"):
        why = f"{cfg['init']} is not a pretraining run here"
    else:
        why = "the model names no pretraining run"
    path = find_data_file("pretrain")
    texts = [r["text"] for r in _records(path, "pretrain")]
    return texts, f"{path} ({len(texts)} documents, the whole file: {why})"


def evaluate_model(path: str | Path, data: str | Path | None = None, seq_len: int | None = None,
                   reply_tokens: int = 64, replies: int = 100, device: str = "cpu") -> dict:
    """`python -m minimind_lib eval PATH`: the ladder of a run or a transformers export, fp32 (data:
    see held_out; seq_len, the context: the run's, for an export the selected profile's)."""
    model, tok, cfg = load_model(path, device)
    # import-hf's runs record no training
    trained = cfg if (cfg or {}).get("stage") in ("pretrain", "sft") else None
    seq_len = seq_len or (trained or {}).get("seq_len") or get_profile().seq_len
    text, convs = held_out(trained, data, tok)
    docs = _records(text, "pretrain")
    train_texts, baselines_from = pretraining_texts(trained)
    result = {"model": str(path), "kind": "transformers" if cfg is None else "run",
              "text_data": str(text), "context": seq_len, "documents": len(docs),
              "baselines_from": baselines_from,
              "table": text_ladder(model, tok, docs, seq_len, train_texts),
              "two_choice": two_choice(model, tok, docs)}
    if convs is not None:
        result["chat"] = chat_ladder(model, tok, [r["conversations"] for r in convs], seq_len,
                                     reply_tokens, replies)
        missing = "assistant_loss_missing" in result["chat"]
        result["exit_code"] = 3 if missing else 0  # 3: a measurement is missing
    return result


def ladder_table(result: dict) -> pd.DataFrame:
    """The text rungs of an evaluate_model result as a table: one row per scorer (model, baselines)
    and group."""
    return pd.DataFrame([{"scorer": scorer, "group": group, **row} for scorer,
                         groups in result["table"].items()
                         for group, row in groups.items()])


def describe_ladder(r: dict) -> str:
    """An evaluate_model result as text: the table, the two-choice test and the reply format, with
    intervals."""
    def pct(s: dict) -> str:
        low, high = s["interval95"]
        return f"{s['share']:.1%} of {s['of']} (95% interval {low:.1%}-{high:.1%})"
    t, c = r["two_choice"], r.get("chat", {})
    lines = [f"{r['model']} ({r['kind']}): {r['documents']} documents of {r['text_data']}, "
             f"context {r['context']} tokens; baselines from {r['baselines_from']}",
             ladder_table(r).to_string(index=False),
             f"two-choice continuation ({t['tokens']} tokens, {t['pairs']} pairs, each asked both "
             f"ways and counted once): {pct(t)}, both ways right in {t['both_right']}, chance 50%: "
             f"{t['verdict']} (plain log-likelihood: {pct(t['plain_log_likelihood'])})"]
    if c:
        missing = c.get("assistant_loss_missing")
        loss = f": none ({missing})" if missing else f" {c['assistant_loss']:.3f}"
        replies = ""
        if "ended_with_im_end" in c:
            replies = (f"; greedy replies ending with <|im_end|> within {c['reply_budget']} "
                       f"tokens: {pct(c['ended_with_im_end'])}; in the question's language: "
                       f"{pct(c['same_language'])}")
        lines.append(f"after SFT, {c['conversations']} held-out conversations: assistant-token "
                     f"loss{loss}{replies}")
    return "\n".join(lines)
