"""The course's two training runs, pretraining and SFT, as functions: used by notebooks 07/08 and by the CLI.

`pretrain(...)` and `sft(...)` build everything a run needs from their arguments (or a profile):
tokenizer -> jsonl streamed once into a memmap cache -> token-budget batches -> model -> TrainConfig,
then call `train.fit` (the one training loop) and write a *run directory*:

    OUT/config.json   what the run was: model config, train config, data, batching, tokenizer fingerprint
    OUT/model.pth     the weights as a bare state dict with MiniMind's key names (loads in MiniMind's own code)
    OUT/tokenizer/    a copy of the tokenizer the model was trained with
    OUT/metrics.csv   one row per optimizer step (loss, lr, tokens, tokens/s, memory, val loss, ...)
    OUT/last.pt       the full training state (model, optimizer, RNGs, data position) for --resume
    OUT/samples.jsonl greedy sample generations at intervals during the run
    OUT/summary.json  steps, tokens, wall time, tokens/s, peak memory, final validation loss

Under `torchrun --nproc_per_node=N -m minimind_lib pretrain|sft ...` (WORLD_SIZE > 1) the same run trains with
DistributedDataParallel (distributed.fit_distributed: per step, the losses and gradients of one process on the same
data, as long as the run stays within one epoch of the data); rank 0 tokenizes the cache first and alone writes OUT.

Nothing in OUT is overwritten by a run that fails its checks: every input (data path, tokenizer, vocab,
init checkpoint, resume checkpoint and its config) is validated before the first byte is written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .fileio import atomic_write_text

RUN_FORMAT = "minimind-run"
RUN_VERSION = 1
CONFIG_FILE = "config.json"
MODEL_FILE = "model.pth"
TOKENIZER_DIR = "tokenizer"
METRICS_FILE = "metrics.csv"
STATE_FILE = "last.pt"
SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
RUN_FILES = (CONFIG_FILE, MODEL_FILE, METRICS_FILE, STATE_FILE, SAMPLES_FILE, SUMMARY_FILE)

# Fixed prompts for the sample generations during pretraining (one per language of the bundled corpus).
DEFAULT_SAMPLE_PROMPTS = ("ROMEO.\n", "床前明月光，")
# Settings that fix the order and shape of the data: resuming with a different value would silently train on
# different batches than the saved position refers to, so it is an error.
RESUME_KEYS = ("stage", "model", "data", "val_data", "seq_len", "max_tokens", "val_batches", "max_samples", "batching",
               "long_docs", "init")
# A pretraining document longer than seq_len is split into rows (no text thrown away); a conversation is one
# sample, truncated (counted), never split.
LONG_DOCS_BY_KIND = {"pretrain": "chunk", "sft": "truncate"}
SMALL_FILE_BYTES = 32 * 2**20  # below this, tokenize in this process (worker start-up costs more than it saves)


class RunError(ValueError):
    """A run cannot start: bad input, or it would overwrite or contradict an existing run directory."""


@dataclass
class RunResult:
    """What a pretrain/sft call produced: the trained model, its tokenizer, metrics and the run directory."""

    out_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    metrics: Any  # pandas.DataFrame, one row per optimizer step (the whole run, across resumes)
    config: dict
    summary: dict
    samples: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- small helpers


def default_runs_dir() -> Path:
    """Where notebooks put their runs: the repository's git-ignored runs/ folder (MINIMIND_RUNS_DIR overrides)."""
    from .paths import REPO_DIR

    return Path(os.environ.get("MINIMIND_RUNS_DIR", REPO_DIR / "runs"))


def run_dir_for(profile_name: str, stage: str) -> Path:
    """runs/<profile>/<stage>: the run directory notebook 07 writes and notebook 08 starts from."""
    return default_runs_dir() / profile_name / stage


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


def read_run_config(run_dir: str | Path) -> dict:
    """OUT/config.json of a run directory, validated; FileNotFoundError/RunError name the file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a run directory (it needs {CONFIG_FILE}, "
                                f"{MODEL_FILE} and {TOKENIZER_DIR}/)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("format") != RUN_FORMAT:
        raise RunError(f"{path}: not a minimind run config (format={cfg.get('format') if isinstance(cfg, dict) else None!r}, "
                       f"expected {RUN_FORMAT!r})")
    for key in ("model", "train", "tokenizer", "stage"):
        if key not in cfg:
            raise RunError(f"{path}: lacks key {key!r}")
    return cfg


def load_run(run_dir: str | Path, device: torch.device | str | None = None):
    """(model, tokenizer, config) of a run directory; clear errors for a missing/corrupt checkpoint or vocab mismatch."""
    from .corpus import tokenizer_fingerprint
    from .model import MiniMindConfig, MiniMindForCausalLM, load_checkpoint
    from .tokenizer import check_vocab, load_tokenizer

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    model_path = run_dir / MODEL_FILE
    if not model_path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {model_path} (did the run in {run_dir} finish?)")
    tok = load_tokenizer(run_dir / TOKENIZER_DIR)
    mcfg = MiniMindConfig.from_dict(cfg["model"])
    try:
        check_vocab(tok, mcfg.vocab_size)
    except ValueError as e:
        raise RunError(f"{run_dir}: {e}") from None
    fp = cfg["tokenizer"].get("fingerprint")
    if fp and fp != tokenizer_fingerprint(tok):
        raise RunError(f"{run_dir / TOKENIZER_DIR}: this tokenizer is not the one the model was trained with "
                       f"(fingerprint {tokenizer_fingerprint(tok)}, {CONFIG_FILE} says {fp})")
    model = MiniMindForCausalLM(mcfg)
    load_checkpoint(model_path, model)  # weights_only=True; names the file on a corrupt or mismatched checkpoint
    if device is not None:
        model.to(device)
    model.eval()
    return model, tok, cfg


def _cache_prefix(cache_dir: Path, data_path: Path, kind: str) -> Path:
    """Memmap prefix for a source file: its stem plus a hash of its absolute path (two data.jsonl never collide)."""
    h = hashlib.sha1(str(data_path.resolve()).encode()).hexdigest()[:8]
    return cache_dir / f"{data_path.stem}.{kind}.{h}"


def _memmap_dataset(path: Path, tok, kind: str, seq_len: int, cache_dir: Path, max_samples: int | None,
                    progress: bool):
    """Tokenize `path` once into the memmap cache (reused while the file and tokenizer are unchanged); the dataset."""
    from .corpus import tokenize_to_memmap
    from .data import PretrainDataset, SFTDataset

    prefix = _cache_prefix(cache_dir, path, kind)
    workers = 0 if path.stat().st_size < SMALL_FILE_BYTES else None
    info = tokenize_to_memmap(path, tok, prefix, kind=kind, num_workers=workers, max_samples=max_samples,
                              progress=progress)
    cls = PretrainDataset if kind == "pretrain" else SFTDataset
    ds = cls(str(prefix), tok, seq_len, vocab_size=tok.vocab_size, long_docs=LONG_DOCS_BY_KIND[kind])
    if len(ds) == 0:
        raise RunError(f"{path}: no samples to train on")
    return ds, info


def _loader(ds, max_tokens: int, seq_len: int, pad_id: int, seed: int, shuffle: bool = True,
            pin_memory: bool = False):
    """A DataLoader of token-budget micro-batches (rows x longest row <= max_tokens), padded to the longest row.

    pin_memory=True (for a CUDA device) collates into page-locked memory, so the loop's non_blocking copies to
    the GPU overlap with compute instead of waiting for a staging copy."""
    from torch.utils.data import DataLoader

    from .batching import TokenBudgetBatchSampler
    from .data import pad_collate

    if max_tokens < seq_len:
        raise RunError(f"max_tokens={max_tokens} is smaller than seq_len={seq_len}: a full-length sample would not "
                       f"fit one micro-batch; raise --max-tokens or lower the sequence length")
    sampler = TokenBudgetBatchSampler(ds.lengths, max_tokens, shuffle=shuffle, seed=seed, seq_len=seq_len)
    return DataLoader(ds, batch_sampler=sampler, collate_fn=functools.partial(pad_collate, pad_id=pad_id),
                      pin_memory=pin_memory), sampler


def _val_batches(ds, max_tokens: int, seq_len: int, pad_id: int, n_batches: int) -> list[dict]:
    """The first n_batches token-budget batches of the validation set, in a fixed order (the same every eval)."""
    loader, _ = _loader(ds, max_tokens, seq_len, pad_id, seed=0, shuffle=False)
    out = []
    for b in loader:
        out.append(b)
        if len(out) >= n_batches:
            break
    return out


def _check_out_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber an existing run unless resuming it or told to overwrite."""
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if resume:
        if not (out / STATE_FILE).is_file():
            raise FileNotFoundError(f"--resume: no training state {out / STATE_FILE} to resume from")
        if not (out / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"--resume: {out / CONFIG_FILE} not found; {out} is not a run directory")
        return
    if existing and not overwrite:
        raise RunError(f"{out} already holds a run ({', '.join(existing)}); pass --resume to continue it, "
                       f"--overwrite to replace it, or choose another --out")


def _check_resume(out: Path, run_cfg: dict, train_cfg) -> dict:
    """Compare the new run's settings with the saved run before anything is written; returns the saved state."""
    from .checkpoint import check_config, read_training_state

    saved = read_run_config(out)
    for key in RESUME_KEYS:
        if saved.get(key) != run_cfg.get(key):
            raise RunError(f"cannot resume {out}: {key!r} differs (run: {saved.get(key)!r:.200}, now: "
                           f"{run_cfg.get(key)!r:.200}); use the run's settings or start a new --out")
    if saved["tokenizer"].get("fingerprint") != run_cfg["tokenizer"]["fingerprint"]:
        raise RunError(f"cannot resume {out}: the tokenizer differs from the run's ({saved['tokenizer']} vs "
                       f"{run_cfg['tokenizer']})")
    state = read_training_state(out / STATE_FILE)  # clear error for a missing or corrupt last.pt
    try:
        check_config(state["config"], train_cfg, out / STATE_FILE)
    except ValueError as e:
        raise RunError(str(e) + "; use the run's settings (see its config.json) or start a new --out") from None
    return state


class _RunHooks:
    """fit callbacks: checkpoint at chosen steps, stop early, sample generations, running metrics.csv.

    fit writes last.pt when (done steps) % cfg.ckpt_every == 0; to also checkpoint exactly at the last step
    and at `stop_after`, the hook lowers cfg.ckpt_every to 1 for the one step that must be saved
    (ckpt_every is not a resume field, so the saved config is unaffected).
    """

    def __init__(self, cfg, start_step: int, stop_after: int | None, sample_every: int, sample_fn, on_ckpt):
        self.cfg, self.every = cfg, cfg.ckpt_every
        self.targets = {cfg.max_steps} | ({stop_after} if stop_after else set())
        self.stop_after, self.sample_every, self.sample_fn, self.on_ckpt = stop_after, sample_every, sample_fn, on_ckpt
        self.rows: list[dict] = []
        self._arm(start_step + 1)

    def _arm(self, next_done: int) -> None:
        self.cfg.ckpt_every = 1 if next_done in self.targets else self.every

    def __call__(self, step: int, row: dict):
        self.rows.append(dict(row))
        done = step + (0 if row.get("skipped") else 1)
        if "ckpt" in str(row.get("event", "")).split(";"):
            self.on_ckpt(self.rows)
        if self.sample_fn is not None and not row.get("skipped") and self.sample_every and done % self.sample_every == 0:
            self.sample_fn(done)
        self._arm(done + 1)
        if self.stop_after is not None and done >= self.stop_after:
            return "stop"
        return None


def _summary(df, cfg_dict: dict, wall: float, device: torch.device, profile: str | None) -> dict:
    """Headline numbers of the run from its own metrics (nothing here is estimated)."""
    import pandas as pd

    val = df["val_loss"].dropna() if "val_loss" in df else pd.Series(dtype=float)
    peak = df["peak_memory_bytes"].max() if "peak_memory_bytes" in df and len(df) else float("nan")
    train_time = float(df["step_time"].sum()) if "step_time" in df and len(df) else float("nan")
    tokens = int(df["tokens"].sum()) if len(df) else 0
    return {
        "stage": cfg_dict["stage"], "profile": profile, "device": str(device),
        "model_preset": cfg_dict.get("model_preset"), "steps": int(df["step"].max()) + 1 if len(df) else 0,
        "tokens": tokens, "wall_time_s": round(wall, 2), "train_time_s": round(train_time, 2),
        "tokens_per_s": round(tokens / train_time, 1) if train_time and train_time > 0 else float("nan"),
        "tokens_per_s_wall": round(tokens / wall, 1) if wall > 0 else float("nan"),
        "peak_memory_bytes": None if peak != peak else int(peak),
        "initial_val_loss": float(val.iloc[0]) if len(val) else None,
        "final_val_loss": float(val.iloc[-1]) if len(val) else None,
        "final_val_ppl": float(math.exp(min(val.iloc[-1], 50))) if len(val) else None,
        "final_train_loss": float(df["loss"].iloc[-1]) if len(df) else None,
        "amp": df.attrs.get("amp"),
    }


# --------------------------------------------------------------------------------------------- planning a run

def plan_run(profile: Any = None, stage: str = "pretrain") -> dict:
    """Sizes of a stage's run (steps, accum, max_tokens, eval_every) as the profile gives them, and why."""
    from .profiles import get_profile

    if stage not in ("pretrain", "sft"):
        raise ValueError(f"stage={stage!r}; choose 'pretrain' or 'sft'")
    prof = profile if hasattr(profile, "pretrain_steps") else get_profile(profile)
    steps = prof.pretrain_steps if stage == "pretrain" else prof.sft_steps
    plan = {"steps": steps, "accum": prof.accum_steps, "max_tokens": prof.max_tokens, "eval_every": prof.eval_every}
    reason = (f"profile {prof.name}: {plan['steps']} steps x {plan['accum']} micro-batches x {plan['max_tokens']} "
              f"tokens = {plan['steps'] * plan['accum'] * plan['max_tokens']:,} padded tokens at most "
              f"(the command line runs the same sizes)")
    return {**plan, "profile": prof.name, "stage": stage, "reason": reason}


def plan_kwargs(plan: dict) -> dict:
    """The keyword arguments of pretrain/sft that a plan sets."""
    return {k: plan[k] for k in ("steps", "accum", "max_tokens", "eval_every")}


# --------------------------------------------------------------------------------------------- the shared run


def _run(stage: str, **kwargs: Any) -> RunResult:
    """One run; under torchrun (WORLD_SIZE > 1) the same run with DistributedDataParallel, one rank per process.

    Every rank builds the same model and validates the same inputs; each trains its share of every global
    optimizer step (distributed.fit_distributed: the losses and gradients of one process on the same data), and
    rank 0 alone writes the run directory. The process group is torn down at the end, also on error.
    """
    from . import distributed as D

    _, world, _ = D.env_ranks()
    if world <= 1:
        return _run_impl(stage, dinfo=None, **kwargs)
    device = kwargs.get("device")
    backend = "gloo" if device is not None and torch.device(device).type != "cuda" else None
    dinfo = D.setup(backend=backend, device=device)
    try:
        return _run_impl(stage, dinfo=dinfo, **kwargs)
    finally:
        D.teardown()


def _run_impl(stage: str, *, dinfo, data, out, profile, config, max_tokens, accum, amp, steps, resume, overwrite, lr,
              seq_len, val_data, val_batches, cache_dir, device, tokenizer_dir, init, stop_after, sample_every,
              sample_prompts, ckpt_every, max_samples, progress, seed, measure_memory, eval_every,
              log: Callable[[str], None]) -> RunResult:
    import pandas as pd

    from . import distributed as D

    from .corpus import tokenizer_fingerprint
    from .device import get_device
    from .generate import generate
    from .model import MiniMindConfig, MiniMindForCausalLM, save_checkpoint
    from .paths import DATA_DIR
    from .profiles import get_profile
    from .tokenizer import check_vocab, load_tokenizer
    from .train import TrainConfig, fit, resolve_amp

    prof = profile if hasattr(profile, "pretrain_steps") else get_profile(profile)
    if dinfo is not None:  # data parallel: this rank's device (cuda:LOCAL_RANK under NCCL, the CPU under gloo)
        device = dinfo.device
    else:
        device = torch.device(device) if device is not None else get_device()
    main = dinfo is None or dinfo.is_main  # the one process that logs and writes files
    if not main:
        log = lambda msg: None  # noqa: E731
    kind = "pretrain" if stage == "pretrain" else "sft"
    default_data = DATA_DIR / ("pretrain.jsonl" if kind == "pretrain" else "sft.jsonl")
    data = Path(data) if data is not None else default_data
    if out is None:
        raise RunError("an output directory is needed (--out DIR)")
    out = Path(out)
    if not data.is_file():
        raise FileNotFoundError(f"data file not found: {data}" + (" (a directory, not a jsonl file)" if data.is_dir() else ""))
    if kind == "pretrain" and val_data is None and (DATA_DIR / "pretrain_val.jsonl").is_file():
        val_data = DATA_DIR / "pretrain_val.jsonl"
    if val_data is not None and not Path(val_data).is_file():
        raise FileNotFoundError(f"validation data file not found: {val_data}")

    # Model, tokenizer and (SFT) initial weights: all loaded and checked before anything is written.
    init_cfg = None
    if stage == "sft":
        if init is None:
            raise RunError("sft needs --init DIR, the pretraining run directory to start from")
        init_model, tok, init_cfg = load_run(init)
        mcfg = init_model.config
        preset = init_cfg.get("model_preset")
    else:
        tok = load_tokenizer(tokenizer_dir)
        preset = config or prof.model
        mcfg = MiniMindConfig.preset(preset)
        init_model = None
    try:
        check_vocab(tok, mcfg.vocab_size)
    except ValueError as e:
        raise RunError(f"tokenizer/model vocab mismatch: {e}") from None
    _check_out_dir(out, resume, overwrite)

    seq_len = int(seq_len or prof.seq_len)
    max_tokens = int(max_tokens or max(prof.max_tokens, seq_len))
    accum = int(accum or prof.accum_steps)
    n_steps = int(steps or (prof.pretrain_steps if stage == "pretrain" else prof.sft_steps))
    base_lr = float(lr or (prof.lr if stage == "pretrain" else prof.lr / 2))  # SFT: gentler, it starts trained
    max_samples = prof.max_samples if max_samples is None else (max_samples or None)
    eval_every = int(eval_every or prof.eval_every)
    cfg = TrainConfig(lr=base_lr, max_steps=n_steps, accum_steps=accum, warmup_steps=max(1, n_steps // 10),
                      amp=amp, eval_every=eval_every, ckpt_every=int(ckpt_every or eval_every),
                      ckpt_dir=str(out), seed=seed, progress=progress)
    amp_settings = resolve_amp(amp, device)
    fp = tokenizer_fingerprint(tok)
    run_cfg = {
        "format": RUN_FORMAT, "version": RUN_VERSION, "stage": stage, "profile": prof.name,
        "model_preset": preset, "model": mcfg.to_dict(), "train": cfg.to_dict(),
        "tokenizer": {"fingerprint": fp, "vocab_size": int(tok.vocab_size)},
        "data": str(data.resolve()), "val_data": str(Path(val_data).resolve()) if val_data else None,
        "seq_len": seq_len, "max_tokens": max_tokens, "val_batches": int(val_batches), "max_samples": max_samples,
        "batching": "token_budget", "long_docs": LONG_DOCS_BY_KIND[kind], "init": str(Path(init).resolve()) if init else None,
        "device": str(device), "amp": {"mode": amp, "resolved": amp_settings.name, "reason": amp_settings.reason},
        "torch": torch.__version__,
    }
    if dinfo is not None:
        run_cfg["world_size"] = dinfo.world_size
    saved_state = _check_resume(out, run_cfg, cfg) if resume else None
    if saved_state is not None:  # a DDP checkpoint counts global steps and holds the controller's counters
        saved_ddp = isinstance(saved_state.get("controller"), dict) and "world_size" in saved_state["controller"]
        if saved_ddp != (dinfo is not None):
            raise RunError(f"cannot resume {out}: it was trained {'with' if saved_ddp else 'without'} torchrun "
                           f"(data parallel), this run is {'with' if dinfo is not None else 'without'}; its data "
                           f"position means something else (resuming with another number of ranks >= 2 works)")

    # Data: stream each jsonl once into a memmap cache (constant memory for MiniMind's 1.6 GB file).
    cache_dir = Path(cache_dir) if cache_dir is not None else out.parent / "cache"
    if not main:  # data parallel: rank 0 tokenizes into the cache, the other ranks then open it
        D.barrier()
        progress = False
    ds, info = _memmap_dataset(data, tok, kind, seq_len, cache_dir, max_samples, progress)
    log(f"{stage}: {data.name}: {ds.stats.summary()} ({'cache reused' if info.reused else f'tokenized in {info.seconds:.1f} s'})")
    val_list = None
    if val_data is not None:
        vds, _ = _memmap_dataset(Path(val_data), tok, kind, seq_len, cache_dir, None, progress)
        val_list = _val_batches(vds, max_tokens, seq_len, tok.pad_token_id, val_batches)
    elif stage == "sft":
        # No separate SFT validation file: hold out a fixed 5% of the conversations (never trained on).
        from torch.utils.data import Subset

        n_val = max(1, len(ds) // 20)
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()
        val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
        vsub = _LengthSubset(ds, val_idx)
        ds = _LengthSubset(ds, train_idx)
        val_list = _val_batches(vsub, max_tokens, seq_len, tok.pad_token_id, val_batches)
        run_cfg["sft_val_holdout"] = n_val
    if dinfo is not None and main:
        D.barrier()  # the caches are complete: the other ranks may open them
    if dinfo is None:
        loader, sampler = _loader(ds, max_tokens, seq_len, tok.pad_token_id, seed=seed,
                                  pin_memory=torch.device(device).type == "cuda")
    else:
        if max_tokens < seq_len:
            _loader(ds, max_tokens, seq_len, tok.pad_token_id, seed=seed)  # raises its RunError
        # The same token-budget micro-batches as _loader (same seed), `accum` per global step, dealt to the ranks.
        loader = D.distributed_step_source(ds, max_tokens, accum, seq_len=seq_len, seed=seed, info=dinfo)
        sampler = loader.base
    run_cfg["data_stats"] = {**ds.stats.to_dict(), "batches_per_epoch": len(sampler)} if hasattr(ds, "stats") else None

    torch.manual_seed(seed)  # the same seed, the same initial weights
    model = MiniMindForCausalLM(mcfg)
    if init_model is not None:
        model.load_state_dict(init_model.state_dict())
        del init_model

    # From here on the run directory is written (by rank 0 alone under torchrun).
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            for name in RUN_FILES:  # --overwrite: a stale last.pt/metrics must not survive into the new run
                if (out / name).exists():
                    (out / name).unlink()
        _write_json(out / CONFIG_FILE, run_cfg)
        tok_tmp = out / f".{TOKENIZER_DIR}.tmp-{os.getpid()}"
        tok.save(tok_tmp)
        if (out / TOKENIZER_DIR).exists():
            shutil.rmtree(out / TOKENIZER_DIR)
        os.replace(tok_tmp, out / TOKENIZER_DIR)

    prior = pd.DataFrame()
    start_step = 0
    if resume:
        start_step = int(saved_state["step"])
        if (out / METRICS_FILE).is_file():
            prior = pd.read_csv(out / METRICS_FILE)
            prior = prior[prior["step"] < start_step]
        log(f"{stage}: resuming {out} at step {start_step} of {n_steps}")
    prior_tokens = int(prior["tokens"].sum()) if len(prior) else 0
    samples: list[dict] = []
    if (out / SAMPLES_FILE).is_file() and resume:
        samples = [json.loads(l) for l in (out / SAMPLES_FILE).read_text(encoding="utf-8").splitlines() if l.strip()]
        samples = [s for s in samples if s["step"] <= start_step]

    def frame(rows: list[dict]) -> "pd.DataFrame":
        df = pd.concat([prior, pd.DataFrame(rows)], ignore_index=True) if rows else prior.copy()
        if len(df):
            df["tokens_seen"] = df["tokens"].cumsum()
        return df

    def on_ckpt(rows: list[dict]) -> None:  # metrics.csv always matches the last checkpoint
        if main:
            frame(rows).to_csv(out / METRICS_FILE, index=False)

    prompts = list(sample_prompts if sample_prompts is not None else DEFAULT_SAMPLE_PROMPTS)

    def sample_fn(done: int) -> None:
        for p in prompts:
            if stage == "sft":
                from .chat_widget import chat_reply

                text = chat_reply(model, tok, [{"role": "user", "content": p}], temperature=0.0, max_new_tokens=24)
            else:
                text = generate(model, tok, p, max_new_tokens=24, temperature=0.0)
            samples.append({"step": done, "prompt": p, "text": text})
        atomic_write_text(out / SAMPLES_FILE, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))

    if sample_every is None:  # a handful of sample points: generating token by token is slow on a CPU
        sample_every = max(eval_every, -(-n_steps // 4))
    hooks = _RunHooks(cfg, start_step, stop_after, int(sample_every),
                      sample_fn if prompts and main else None, on_ckpt)
    log(f"{stage}: {n_steps} steps x {accum} micro-batches of <= {max_tokens} tokens (seq_len {seq_len}), "
        f"lr {base_lr:g}, {amp_settings.reason}, device {device}"
        + (f", {dinfo.world_size} ranks ({dinfo.backend})" if dinfo is not None else ""))
    meter = None
    if measure_memory and device.type == "cpu" and dinfo is None:
        from .memory import MemoryMeter

        # On CPU live tensors are counted by a dispatch mode, which slows every op: measure every k-th step only
        # (with token budgets the steps are alike). CUDA's allocator counts for free: fit measures every step.
        meter = _EveryNthMeter(MemoryMeter(device), every=max(1, n_steps // 25))
    t0 = time.perf_counter()
    if not resume and val_list and main:
        # The validation loss before any training: the baseline every later value is compared with
        # (about ln(vocab) = ln 6400 = 8.76 for a fresh model, whose predictions are nearly uniform).
        from .train import evaluate

        model.to(device)
        ev = evaluate(model, val_list, device=device, amp_dtype=amp_settings.dtype)
        prior = pd.DataFrame([{"step": -1, "loss": float("nan"), "lr": 0.0, "tokens": 0, "wall_time": 0.0,
                               "val_loss": ev["loss"], "val_ppl": ev["ppl"], "event": "eval_before_training"}])
        log(f"{stage}: validation loss before training {ev['loss']:.3f} (perplexity {ev['ppl']:.0f})")
    if dinfo is None:
        df = fit(model, loader, cfg, device=device, val_batches=val_list, callbacks=[hooks], meter=meter,
                 resume_from=out / STATE_FILE if resume else None)
    else:
        df = D.fit_distributed(model, loader, cfg, info=dinfo, val_batches=val_list, pad_id=tok.pad_token_id,
                               callbacks=[hooks], resume_from=out / STATE_FILE if resume else None)
    wall = time.perf_counter() - t0
    cfg.ckpt_every = hooks.every
    attrs = dict(df.attrs)
    full = frame(hooks.rows)
    full.attrs.update(attrs)
    if len(full):
        full["tokens_seen"] = full["tokens"].cumsum()

    if main:
        save_checkpoint(model, out / MODEL_FILE)  # bare state dict, MiniMind's key names
        full.to_csv(out / METRICS_FILE, index=False)
    summary = _summary(full, run_cfg, wall, device, prof.name)
    if dinfo is not None:
        summary["world_size"] = dinfo.world_size
    if resume and wall > 0:  # this invocation's tokens over this invocation's time
        summary["tokens_per_s_wall"] = round((summary["tokens"] - prior_tokens) / wall, 1)
    summary.update(resumed_from_step=start_step if resume else None,
                   stopped_early=bool(stop_after and len(full) and int(full["step"].max()) + 1 < n_steps),
                   prior_tokens=prior_tokens)
    if main:
        _write_json(out / SUMMARY_FILE, summary)
    model.eval()
    return RunResult(out_dir=out, model=model, tokenizer=tok, metrics=full, config=run_cfg, summary=summary,
                     samples=samples)


class _EveryNthMeter:
    """A MemoryMeter that measures one optimizer step in `every` (NaN peak for the others)."""

    def __init__(self, meter, every: int):
        self.meter, self.every, self.calls, self.active = meter, int(every), 0, False

    def track(self, *objs):
        import contextlib

        self.active = self.calls % self.every == 0
        self.calls += 1
        return self.meter.track(*objs) if self.active else contextlib.nullcontext()

    def reset_peak(self) -> None:
        if self.active:
            self.meter.reset_peak()

    def peak(self) -> float:
        return float(self.meter.peak()) if self.active else float("nan")


class _LengthSubset(torch.utils.data.Dataset):
    """A subset of a dataset that keeps its `lengths` (token-budget batching needs them)."""

    def __init__(self, ds, indices: Sequence[int]):
        self.ds, self.indices = ds, list(indices)
        self.lengths = ds.lengths[self.indices]
        self.stats = ds.stats

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.ds[self.indices[i]]


def _common(kwargs: dict) -> dict:
    base = dict(data=None, out=None, profile=None, config=None, max_tokens=None, accum=None, amp="auto",
                steps=None, resume=False, overwrite=False, lr=None, seq_len=None, val_data=None, val_batches=4,
                cache_dir=None, device=None, tokenizer_dir=None, init=None, stop_after=None, sample_every=None,
                sample_prompts=None, ckpt_every=None, max_samples=None, progress=True, seed=1337, measure_memory=True, eval_every=None, log=print)
    unknown = sorted(set(kwargs) - set(base))
    if unknown:
        raise TypeError(f"unknown argument(s) {unknown}; known: {sorted(base)}")
    base.update(kwargs)
    return base


def pretrain(data: str | Path | None = None, out: str | Path | None = None, **kwargs: Any) -> RunResult:
    """Pretrain a MiniMind model on a {"text"} jsonl file (default data/pretrain.jsonl) into run directory `out`.

    Sizes come from the profile (`profile=` name or Profile; default: the selected one) unless given:
    config (model preset), seq_len, max_tokens (per micro-batch), accum, steps, lr, amp ("auto"|"bf16"|"fp16"|"off").
    resume=True continues OUT/last.pt (same settings required); overwrite=True replaces an existing run;
    stop_after=N stops (with a checkpoint) after N steps of a schedule that spans `steps`.
    """
    return _run("pretrain", **_common(dict(kwargs, data=data, out=out)))


def sft(data: str | Path | None = None, out: str | Path | None = None, *, init: str | Path | None = None,
        **kwargs: Any) -> RunResult:
    """Supervised fine-tuning on a {"conversations"} jsonl file (default data/sft.jsonl), from run directory `init`.

    Chat template, assistant-only loss (labels -100 elsewhere); 5% of the conversations are held out for the
    validation loss. Other arguments as for `pretrain` (lr defaults to half the profile's).
    """
    kwargs.setdefault("sample_prompts", ())
    return _run("sft", **_common(dict(kwargs, data=data, out=out, init=init)))
