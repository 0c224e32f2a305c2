"""Make a profile's reference band from real runs: `python tools/make_reference.py PROFILE [--seeds 5] [--add dpo]`.

Runs the profile's pretraining, then its SFT, then its DPO on data/dpo.jsonl (through minimind_lib.pipeline, as
`python -m minimind_lib pretrain`, `sft` and `dpo` do) once per seed, and writes minimind_lib/assets/bands/PROFILE.json: for each stage, the validation loss of
every seed against trained tokens, its quantiles on a common token grid, and the 95% prediction interval for one more
seed (mean +- t * sd * sqrt(1 + 1/n), n seeds) that `compare` and notebooks 07/08 judge a run against. The file records
the seeds, the dtype, the torch threads, the device and CPU, torch's version, the date and this command. The runs go
to a temporary folder (or --work DIR, which must not exist yet), removed at the end unless --keep. With --reuse,
--work names the folder of an earlier invocation's --keep: a seed's stage that finished there (its summary.json
written) is read back instead of trained again, and the folder is left as it was (a run the code of the day would
train differently is the user's to rule out: compare one seed's metrics.csv with a fresh run's).
--add STAGE trains every stage up to STAGE and writes STAGE alone into the profile's existing band file: its other
stages stay as they were, and STAGE's entry records its own seeds, machine and date (notebook 10's DPO band was added
so, beside 07's and 08's). A DPO run's validation loss is the mean DPO loss of its held-out pairs, its tokens pairs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from minimind_lib import pipeline
from minimind_lib.checkpoint import read_run_config
from minimind_lib.device import device_name
from minimind_lib.evaluate import BAND_FORMAT, BAND_VERSION, BANDS_DIR, comparable, final_gap, grad_spikes, read_metrics
from minimind_lib.fileio import atomic_write_text
from minimind_lib.profiles import PROFILES, get_profile

QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)  # drawn as the band (0.5: the median seed); judged: the prediction interval


def t_quantile(p: float, dof: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `dof` degrees of freedom: bisection on its integrated density."""
    log_c = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    def cdf(x: float) -> float:
        xs = np.linspace(0.0, x, 20001)
        return 0.5 + np.trapezoid(np.exp(log_c - (dof + 1) / 2 * np.log1p(xs ** 2 / dof)), xs)
    lo, hi = 0.0, 100.0
    for _ in range(60):
        lo, hi = (lo, (lo + hi) / 2) if cdf((lo + hi) / 2) > p else ((lo + hi) / 2, hi)
    return (lo + hi) / 2


def curve(metrics) -> tuple[list[int], list[float]]:
    """(tokens_seen, val_loss) of a run's validation points, step -1 (before training) first; refuses a run that
    was rolled back or has a non-finite loss (a band from a diverged run would be wrong)."""
    points = metrics[metrics["val_loss"].notna()]
    if "rolled_back" in metrics and metrics["rolled_back"].fillna(False).astype(bool).any():
        raise SystemExit("a reference run was rolled back after NaN steps: not a healthy run, no band made")
    if not np.isfinite(points["val_loss"]).all() or not np.isfinite(metrics["loss"].iloc[1:]).all():
        raise SystemExit("a reference run has a non-finite loss: not a healthy run, no band made")
    return [int(t) for t in points["tokens_seen"]], [float(v) for v in points["val_loss"]]


def stage_band(runs: list[dict], t95: float) -> dict:
    """One stage's band: seeds' curves interpolated onto the median token count of each validation point."""
    tokens = np.median(np.array([r["tokens"] for r in runs], dtype=float), axis=0).round()
    losses = np.array([np.interp(tokens, r["tokens"], r["val_loss"]) for r in runs])
    n, mean, sd = len(runs), losses.mean(0), losses.std(0, ddof=1)
    half = t95 * sd * math.sqrt(1 + 1 / n)
    gaps = np.array([r["gap"] for r in runs])
    r4 = lambda a: [round(float(x), 4) for x in a]
    first = runs[0]
    return {"dtype": first["dtype"], "amp_reason": first["amp_reason"], "comparable": first["comparable"],
            "training": first["training"], "tokens": [int(t) for t in tokens],
            "quantiles": {str(q): r4(np.quantile(losses, q, axis=0)) for q in QUANTILES},
            "mean": r4(mean), "lower": r4(mean - half), "upper": r4(mean + half),
            "gap": {"per_seed": r4(gaps),
                    "upper": round(float(gaps.mean() + t95 * gaps.std(ddof=1) * math.sqrt(1 + 1 / n)), 4)},
            "grad_norm_max_over_median": r4([r["grad_ratio"] for r in runs]),
            "seed_curves": {str(r["seed"]): {"tokens": r["tokens"], "val_loss": r4(r["val_loss"])} for r in runs},
            "wall_time_s": [r["wall_time_s"] for r in runs]}


def finished_run(run_dir: Path) -> tuple[SimpleNamespace, float] | None:
    """(metrics and config, as pipeline returns them; its wall time) of a run that finished in run_dir, else None."""
    if not (summary := run_dir / "summary.json").is_file():
        return None
    return (SimpleNamespace(metrics=read_metrics(run_dir), config=read_run_config(run_dir)),
            json.loads(summary.read_text())["wall_time_s"])


STAGES = ("pretrain", "sft", "dpo")  # each starts from the one before


def run_seed(profile: str, seed: int, work: Path, reuse: bool = False, stages: tuple = STAGES) -> dict[str, dict]:
    """The profile's runs of `stages` for one seed, in order; per stage what the band needs from it."""
    out, found = {}, {}
    for stage in stages:
        t0 = time.perf_counter()
        kwargs = dict(profile=profile, seed=seed, progress=False, cache_dir=work / "cache", log=lambda msg: None)
        if reuse and (earlier := finished_run(work / f"seed{seed}" / stage)) is not None:
            result, wall = earlier
            t0 = time.perf_counter() - wall
            print(f"seed {seed} {stage}: read back from {work / f'seed{seed}' / stage} (--reuse)", flush=True)
        elif stage == "pretrain":
            result = pipeline.pretrain(out=work / f"seed{seed}" / stage, sample_every=0, **kwargs)
        else:  # sft from the seed's pretraining, dpo from its sft
            run = pipeline.sft if stage == "sft" else pipeline.dpo
            result = run(out=work / f"seed{seed}" / stage, init=work / f"seed{seed}" / STAGES[STAGES.index(stage) - 1],
                         **kwargs)
        tokens, val = curve(result.metrics)
        spikes = grad_spikes(result.metrics, result.config["train"]["warmup_steps"])
        found[stage] = {"seed": seed, "tokens": tokens, "val_loss": val, "dtype": result.config["amp"]["resolved"],
                        "amp_reason": result.config["amp"]["reason"], "comparable": comparable(result.config),
                        "training": {k: result.config["train"][k] for k in ("lr", "max_steps", "accum_steps",
                                                                              "warmup_steps", "eval_every")},
                        "gap": final_gap(result.metrics, result.config["train"]["eval_every"]),
                        "grad_ratio": spikes["max_over_median"], "wall_time_s": round(time.perf_counter() - t0, 1)}
        out[stage] = found[stage]
        print(f"seed {seed} {stage}: val loss {val[0]:.4f} -> {val[-1]:.4f} at {tokens[-1]:,} tokens "
              f"({found[stage]['wall_time_s']} s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", choices=sorted(PROFILES))
    parser.add_argument("--seeds", type=int, default=5, help="how many seeds (>= 5 for a committed band)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--out", default=None, help="band file (default minimind_lib/assets/bands/PROFILE.json)")
    parser.add_argument("--work", default=None, help="folder for the runs (must not exist; default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folder")
    parser.add_argument("--reuse", action="store_true", help="--work is an earlier --keep's folder: read back the "
                        "stages that finished there, train the rest, leave the folder")
    parser.add_argument("--add", choices=STAGES, default=None, help="write only this stage into the existing band "
                        "file (the stages before it are trained, as its runs start from them, and not written)")
    args = parser.parse_args(argv)
    if args.reuse and not (args.work and Path(args.work).is_dir()):
        parser.error("--reuse needs --work DIR, the folder an earlier --keep left")
    if args.seeds < 2:
        parser.error("--seeds: a band needs at least 2 seeds (5 or more for a committed one)")
    if args.work and not args.reuse and (Path(args.work).exists() or Path(args.work).is_symlink()):
        parser.error(f"--work {args.work} exists: name a folder that does not exist yet (this tool removes only what "
                     "it made), or pass --reuse to read back an earlier --keep's runs there")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix=f"band-{args.profile}-"))
    if args.work and not args.reuse:
        work.mkdir(parents=True)  # refuses an existing folder: this tool removes only what it made
    out = Path(args.out) if args.out else BANDS_DIR / f"{args.profile}.json"
    if args.add and not out.is_file():
        parser.error(f"--add {args.add}: no band file {out} to add it to (make the whole band first)")
    stages = STAGES[:STAGES.index(args.add) + 1] if args.add else STAGES
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        runs = [run_seed(args.profile, seed, work, args.reuse, stages) for seed in seeds]
    finally:
        if not (args.keep or args.reuse):
            shutil.rmtree(work, ignore_errors=True)
    t95 = t_quantile(0.975, len(seeds) - 1)
    made_by = {"command": " ".join(["python tools/make_reference.py", *(argv if argv is not None else sys.argv[1:])]),
               "date": started.strftime("%Y-%m-%d"), "device": "cpu", "cpu": device_name(torch.device("cpu")),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    if args.add:  # the file as it was, with this stage's band (and its own seeds and machine) added or replaced
        band = json.loads(out.read_text(encoding="utf-8"))
        band["stages"][args.add] = {**stage_band([r[args.add] for r in runs], t95), "seeds": seeds,
                                    "made_by": made_by, "profile_sizes": get_profile(args.profile).to_dict()}
    else:
        band = {"format": BAND_FORMAT, "version": BAND_VERSION, "profile": args.profile, "n_seeds": len(seeds),
                "seeds": seeds, "profile_sizes": get_profile(args.profile).to_dict(), "made_by": made_by,
                "method": f"per stage: each seed's validation loss interpolated (linearly in trained tokens) onto "
                          f"the median token count of every validation point; lower/upper: the 95% prediction "
                          f"interval for one more seed, mean +- t(0.975, {len(seeds) - 1}) = {t95:.3f} x sd x "
                          f"sqrt(1 + 1/{len(seeds)})",
                "stages": {stage: stage_band([r[stage] for r in runs], t95) for stage in stages}}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(band, indent=1, ensure_ascii=False) + "\n")
    for stage, b in ((s, band["stages"][s]) for s in ([args.add] if args.add else stages)):
        q = b["quantiles"]
        print(f"{stage}: final val loss min {q['0.0'][-1]} median {q['0.5'][-1]} max {q['1.0'][-1]}; "
              f"allowed {b['lower'][-1]}..{b['upper'][-1]}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
