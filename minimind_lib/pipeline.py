"""The runs of notebooks 07_pretrain and 08_sft as two functions, `pretrain` and `sft`, for the
command line.

A run is the sequence of steps notebook 07 writes in cells, each a function here, in the same order:
1. the data (`memmap_dataset`, `validation_batches`; SFT holds out 5%), 2. the optimizer steps
(`train_steps`), 3. the adaptive batch controller of notebook 06 (`make_controller`; on every device
an OOM halves the micro-batch and retries the same samples), 4. the loop (`train.fit`, with a
`Recorder` callback), 5. the run directory: config.json, model.pth (MiniMind's key names),
tokenizer/, metrics.csv, last.pt (for --resume), samples.jsonl, summary.json. Under `torchrun
--nproc_per_node=N -m minimind_lib pretrain|sft ...` the same run trains with DDP (notebook 09):
rank 0 fills the cache first and alone writes OUT; no controller (every rank would have to agree on
each change of size). Every input is validated before OUT is written.

Steps 1-3 live in rundata.py. Notebook 10_lora_dpo's runs take the same steps: `lora` (SFT through
LoRA adapters, saved apart as lora.pth) and `dpo` (preference pairs against a frozen reference).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import secrets
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd
import torch

from . import distributed as D
from .checkpoint import (LORA_FILE, METRICS_FILE, MODEL_FILE, RUN_FORMAT, RUN_VERSION, SAMPLES_FILE,
                         STATE_FILE, SUMMARY_FILE, RunError, check_out_dir, check_resume,
                         applied, check_target, load_run, read_run_config, save_checkpoint,
                         start_run_dir, stop_on_signals, with_tokens_seen)
from .checks import require
from .corpus import tokenizer_fingerprint
from .data import LONG_DOCS_BY_KIND, holdout_split, memmap_dataset  # noqa: F401 (notebook 08's)
from .device import get_device
from .dpo import DPO
from .fileio import atomic_write_text, exclusive_dir, file_fingerprint
from .generate import chat_reply, generate
from .loggers import check_loggers, flatten, open_loggers, send
from .lora import apply_lora, lora_layers, lora_state, merge_lora
from .model import MiniMindConfig, MiniMindForCausalLM
from .paths import DATA_DIR, REPO_DIR, find_data_file
from .profiles import Profile, get_profile
from .rundata import (CHECK_EVERY, COLLATE, KIND, datasets, make_controller,  # noqa: F401
                      train_steps, validation_batches)  # validation_batches: notebooks 07, 08
from .tokenizer import check_vocab, load_tokenizer
from .train import TrainConfig, evaluate, fit, resolve_amp

DEFAULT_SAMPLE_PROMPTS = ("ROMEO.\n", "床前明月光，")  # one per language of the bundled corpus


@dataclass
class RunSettings:
    """Every option of a run: the keyword arguments of pretrain/sft (None: the profile's value)."""

    stage: str
    data: Any = None  # jsonl file (default data/pretrain.jsonl or data/sft.jsonl)
    out: Any = None  # the run directory
    profile: Any = None  # a Profile or its name (default: the selected one)
    config: str | None = None  # model preset (pretrain; SFT takes the init run's model)
    tokenizer_dir: Any = None
    init: Any = None  # sft, lora, dpo: the run to start from (dpo: also its frozen reference)
    seq_len: int | None = None
    max_tokens: int | None = None  # padded tokens per micro-batch
    accum_steps: int | None = None  # micro-batches per optimizer step
    steps: int | None = None
    lr: float | None = None
    eval_every: int | None = None
    ckpt_every: int | None = None
    max_samples: int | None = None  # None: the profile's cap; 0: every sample
    on_error: str = "raise"  # a bad data line: "raise", or "skip" it (counted, examples logged)
    val_data: Any = None
    val_batches: int = 4
    amp: str = "auto"  # "auto" | "bf16" | "fp16" | "off"
    compile: bool | None = None  # torch.compile the model's trunk (None: the profile's; not DDP)
    loss_chunk: int | None = None  # positions per chunk of the chunked loss (0: off; not DDP)
    device: Any = None
    cache_dir: Any = None  # memmap cache (default: beside OUT)
    resume: bool = False
    overwrite: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) after N steps of the `steps` schedule
    # else a run with skipped steps or no final evaluation raises (after writing)
    allow_skipped_steps: bool = False
    sample_every: int | None = None  # 0: no samples
    sample_prompts: Sequence[str] | None = None
    seed: int = 1337
    lora_rank: int | None = None  # lora: the adapters' rank (default 8); dpo: None trains all
    lora_alpha: float | None = None  # their scale: alpha / rank (default alpha = rank, MiniMind's)
    merge: bool = False  # lora: also write model.pth, the adapters folded in (dpo always does)
    beta: float = 0.1  # dpo: the loss's beta (MiniMind's dpo_loss default)
    progress: bool = True
    log: Callable[[str], None] = print
    loggers: Sequence[str] = ()  # "tensorboard", "wandb": where the metrics also go (loggers.py)
    report: Callable[[Path], dict] | None = None  # its last numbers (the CLI's: verdict, ladder)


@dataclass
class RunResult:
    """What a pretrain/sft call produced: the trained model, its tokenizer, metrics and the run
    directory."""

    out_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    # one row per optimizer step (the whole run, across resumes); step -1: before training
    metrics: pd.DataFrame
    config: dict
    summary: dict
    samples: list[dict] = field(default_factory=list)


# ----------------------------------------------------------------------------------- run
# directories and sizes
def run_dir_for(profile_name: str, stage: str) -> Path:
    """runs/<profile>/<stage> (MINIMIND_RUNS_DIR overrides runs/): the run notebook 07 writes and 08
    starts from."""
    return Path(os.environ.get("MINIMIND_RUNS_DIR", REPO_DIR / "runs")) / profile_name / stage


def plan_run(profile: Any = None, stage: str = "pretrain") -> dict:
    """Sizes of a stage's run as the profile gives them (steps, accum_steps, max_tokens,
    eval_every), and why."""
    if isinstance(profile, Profile):
        prof = profile
    else:
        prof = get_profile(profile)
    plan = {"steps": prof.stage(stage)[0], "accum_steps": prof.accum_steps,
            "max_tokens": prof.max_tokens, "eval_every": prof.eval_every}
    reason = (f"profile {prof.name}: {plan['steps']} steps x {plan['accum_steps']} micro-batches x "
              f"{plan['max_tokens']} tokens = "
              f"{plan['steps'] * plan['accum_steps'] * plan['max_tokens']:,} padded "
              f"tokens at most (the command line runs the same sizes)")
    return {**plan, "profile": prof.name, "stage": stage, "reason": reason}


def plan_kwargs(plan: dict) -> dict:
    """The keyword arguments of pretrain/sft that a plan sets."""
    return {k: plan[k] for k in ("steps", "accum_steps", "max_tokens", "eval_every")}


def resolve_settings(s: RunSettings, prof: Profile) -> RunSettings:
    """The settings with every size filled in from the profile (arguments and command-line flags
    override it; 0 or a negative size is refused, not read as "the default")."""
    pre, given = s.stage == "pretrain", lambda value, default: default if value is None else value
    seq_len, eval_every = given(s.seq_len, prof.seq_len), given(s.eval_every, prof.eval_every)
    steps, lr = prof.stage(s.stage)
    # pretraining's held-out text, where the data folder has it
    default_val = DATA_DIR / "pretrain_val.jsonl"
    val_data = default_val if pre and s.val_data is None and default_val.is_file() else s.val_data
    data = s.data
    if data is None:
        data = find_data_file(KIND[s.stage])
    r = replace(
        s, seq_len=seq_len, max_tokens=given(s.max_tokens, max(prof.max_tokens, seq_len)),
        steps=given(s.steps, steps),
        accum_steps=given(s.accum_steps, prof.accum_steps), eval_every=eval_every,
                val_data=val_data,
        lr=given(s.lr, lr), ckpt_every=given(s.ckpt_every, eval_every),
        max_samples=prof.max_samples if s.max_samples is None else (s.max_samples or None),
        data=Path(data),
        sample_every=given(s.sample_every, max(eval_every, -(-given(s.steps, steps) // 4))),
        lora_rank=8 if s.stage == "lora" and s.lora_rank is None else s.lora_rank,
        sample_prompts=tuple(given(s.sample_prompts, DEFAULT_SAMPLE_PROMPTS)),
        compile=given(s.compile, prof.compile), loss_chunk=given(s.loss_chunk, prof.loss_chunk))
    for name, low in (("seq_len", 1), ("max_tokens", 1), ("accum_steps", 1), ("steps", 1),
                      ("eval_every", 1),
                      ("ckpt_every", 1), ("val_batches", 1), ("max_samples", 0), ("stop_after", 1),
                      ("sample_every", 0), ("lora_rank", 1), ("loss_chunk", 0)):
        value = getattr(s if name == "max_samples" else r, name)  # r.max_samples: None means "all"
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < low):
            raise RunError(f"{name}={value!r}: must be an integer >= {low}")
    for name in ("lr", "beta", "lora_alpha"):
        value = getattr(r, name)
        finite = isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        require(finite or (name == "lora_alpha" and value is None),
                f"{name}={value!r}: must be a finite number > 0", RunError)
    if r.max_tokens < r.seq_len:
        raise RunError(f"max_tokens={r.max_tokens} is smaller than seq_len={r.seq_len}: a "
                       "full-length sample would "
                       f"not fit one micro-batch; raise --max-tokens or lower the sequence length")
    return r


def train_config(s: RunSettings) -> TrainConfig:
    """The loop's TrainConfig for resolved settings (warmup: a tenth of the steps)."""
    # fit reads the device every log_every steps: at least at every step the Recorder acts on
    # (samples, stop_after)
    log_every = math.gcd(CHECK_EVERY, s.eval_every, s.ckpt_every, s.sample_every or 0, s.stop_after
                         or 0)
    return TrainConfig(
        lr=s.lr,
        max_steps=s.steps,
        accum_steps=s.accum_steps,
        warmup_steps=max(1, s.steps // 10),
        amp=s.amp,
        eval_every=s.eval_every,
        ckpt_every=s.ckpt_every,
        ckpt_dir=str(s.out),
        seed=s.seed,
        progress=s.progress,
        log_every=log_every,
        loss_chunk=s.loss_chunk,
    )


# ----------------------------------------------------------------------------------- checks before
# writing
def _inputs(s: RunSettings, prof: Profile, device: torch.device) -> tuple[Any, MiniMindConfig,
                                                                          str | None, dict | None]:
    """(tokenizer, model config, preset, SFT's initial weights): every input checked before anything
    is written."""
    # not '' (Path("") is ".") nor the working directory: a run is a folder
    check_target(s.out or "", "--out")
    check_loggers(s.loggers, s.out)
    for what, path in (("data", s.data), ("validation data", s.val_data)):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{what} file not found: {path}"
                                    + (" (a directory, not a jsonl file)" if Path(path).is_dir()
                                       else ""))
    if s.stage != "pretrain":
        flag = "--init" if s.stage == "sft" else "--from"
        require(s.init is not None, f"{s.stage} needs {flag} DIR, the run directory to start from",
                RunError)
        init_model, tok, init_cfg = load_run(s.init)  # refuses NaN/inf or integer weights
        mcfg, preset, init_state = (
            init_model.config,
            init_cfg.get("model_preset"),
            init_model.state_dict(),
        )
    else:
        tok, preset, init_state = load_tokenizer(s.tokenizer_dir), s.config or prof.model, None
        mcfg = MiniMindConfig.preset(preset)
        check_vocab(tok, mcfg.vocab_size)  # the message names the tokenizer's directory
    if s.seq_len > mcfg.max_position_embeddings:
        raise RunError(f"seq_len={s.seq_len} exceeds the model's max_position_embeddings="
                       f"{mcfg.max_position_embeddings}")
    return tok, mcfg, preset, init_state


def _run_config(s: RunSettings, prof: Profile, preset: str | None, mcfg: MiniMindConfig, tok: Any,
                device: torch.device, dinfo: Any, amp: Any) -> dict:
    """What config.json says the run is (amp: resolve_amp's choice; lora targets None: MiniMind's
    layers)."""
    lora = {"rank": s.lora_rank, "alpha": s.lora_alpha or s.lora_rank, "targets": None}
    val_data = val_fingerprint = init = None
    if s.val_data:
        val_data, val_fingerprint = str(Path(s.val_data).resolve()), file_fingerprint(s.val_data)
    if s.init:
        init = str(Path(s.init).resolve())
    return {"format": RUN_FORMAT, "version": RUN_VERSION, "stage": s.stage, "profile": prof.name,
            "model_preset": preset, "model": mcfg.to_dict(), "train": train_config(s).to_dict(),
            "tokenizer": {"fingerprint": tokenizer_fingerprint(tok),
                          "vocab_size": int(tok.vocab_size)},
            "data": str(s.data.resolve()), "val_data": val_data,
            "data_fingerprint": file_fingerprint(s.data), "on_error": s.on_error,
            "val_data_fingerprint": val_fingerprint,
            "seq_len": s.seq_len, "max_tokens": s.max_tokens, "val_batches": int(s.val_batches),
            "max_samples": s.max_samples, "batching": "token_budget",
            "long_docs": LONG_DOCS_BY_KIND[KIND[s.stage]],
            "init": init, "device": str(device),
            "lora": lora if s.lora_rank else None,
            "dpo": {"beta": s.beta} if s.stage == "dpo" else None,
            "amp": {"mode": s.amp, "resolved": amp.name, "reason": amp.reason},
            "torch": torch.__version__,
            "compile": {"trunk": s.compile, "row_multiple": prof.row_multiple if s.compile else 1},
            **({"world_size": dinfo.world_size} if dinfo is not None else {})}


# ----------------------------------------------------------------------------------- 4. the loop
# 5. the run directory
class Recorder:
    """fit's callback: keeps the metrics rows and samples (and puts them into every checkpoint, so
    --resume restores exactly those of its step), rewrites metrics.csv and samples.jsonl after every
    checkpoint, marks the rows a NaN rollback undid, generates samples every `sample_every` steps
    (before that step's checkpoint), stops after `stop_after` steps or on SIGINT/SIGTERM (fit then
    saves)."""

    def __init__(self, out: Path, s: RunSettings, saved_state: dict | None, model: Any, tok: Any,
                 write: bool) -> None:
        self.out, self.s, self.model, self.tok, self.write, self.rows = (
            out,
            s,
            model,
            tok,
            write,
            [],
        )
        self.prior, self.samples, self.interrupted = pd.DataFrame(), [], None
        if saved_state is not None:  # the rows and samples of the steps the checkpoint holds
            extra = saved_state.get("extra", {})
            self.prior = pd.read_csv(io.StringIO(extra["metrics_csv"])).query(
                f"step < {saved_state['step']}"
            )
            self.samples = list(extra.get("samples", []))

    def frame(self) -> pd.DataFrame:
        """The whole run's metrics: earlier invocations' rows, then this one's, with tokens_seen
        (rolled back: 0)."""
        if self.rows:
            df = pd.concat([self.prior, pd.DataFrame(self.rows)], ignore_index=True)
        else:
            df = self.prior.copy()
        if len(df):
            df = with_tokens_seen(df)
        return df

    def checkpoint_extra(self) -> dict:
        """fit's hook as it writes last.pt: the metrics and samples so far (fit calls back before it
        checkpoints)."""
        return {"metrics_csv": self.frame().to_csv(index=False), "samples": list(self.samples)}

    def after_checkpoint(self) -> None:
        """metrics.csv and samples.jsonl, atomically, after each checkpoint (fit's hook: last.pt;
        then model.pth): they always hold what it holds."""
        if self.write:
            atomic_write_text(self.out / METRICS_FILE, self.frame().to_csv(index=False))
        if self.write and self.samples:
            atomic_write_text(self.out / SAMPLES_FILE, "".join(json.dumps(r,
                                                                          ensure_ascii=False) + "\n"
                                                               for r in self.samples))

    def sample(self, done: int) -> None:
        """Every `sample_every` steps (once), greedy continuations (SFT: answers) of the fixed
        prompts."""
        s = self.s
        if (self.write and s.sample_prompts and s.sample_every and done % s.sample_every == 0
                and not (self.samples and self.samples[-1]["step"] == done)):
            for p in s.sample_prompts:
                if s.stage != "pretrain":
                    text = chat_reply(self.model, self.tok, [{"role": "user", "content": p}],
                                      temperature=0.0, max_new_tokens=24)
                else:
                    text = generate(self.model, self.tok, p, max_new_tokens=24, temperature=0.0)
                self.samples.append({"step": done, "prompt": p, "text": text})

    def __call__(self, step: int, row: dict) -> str | None:
        for event in str(row.get("event", "")).split(";"):
            # the steps since that checkpoint were undone: mark them
            if event.startswith("rollback_to_step_"):
                for r in self.rows:
                    r["rolled_back"] = r.get("rolled_back",
                                             False) or r["step"] >= int(event.rsplit("_", 1)[1])
                row["rolled_back"] = True
        self.rows.append(row)  # the row itself: fit adds this step's checkpoint to its event
        done = step + (0 if row.get("skipped") else 1)
        if not row.get("skipped"):  # before this step's checkpoint, which holds the samples
            self.sample(done)
        stop = self.interrupted or (self.s.stop_after is not None and done >= self.s.stop_after)
        return "stop" if stop else None


def eval_before_training(model: Any, val: list, device: torch.device, amp_dtype: Any,
                         objective: Any = None) -> pd.DataFrame:
    """The validation loss of the untrained model (about ln 6400 for a fresh one; DPO: ln 2, the
    model is its reference) as the metrics row of step -1."""
    ev = evaluate(model.to(device), val, device=device, amp_dtype=amp_dtype, objective=objective)
    return pd.DataFrame([{"step": -1, "loss": float("nan"), "lr": 0.0, "tokens": 0,
                          "wall_time": 0.0,
                          "val_loss": ev["loss"], "val_ppl": ev["ppl"],
                          "event": "eval_before_training"}])


def summarize(df: pd.DataFrame, wall: float) -> dict:
    """Headline numbers of a run from its own metrics (nothing here is estimated)."""
    columns = df.reindex(columns=["val_loss", "peak_memory_bytes", "step_time"])
    val, peak = columns["val_loss"].dropna(), columns["peak_memory_bytes"].max()
    train_time = float(columns["step_time"].sum())
    out = {"steps": 0, "skipped_steps": [], "tokens": 0, "wall_time_s": round(wall, 2),
           "train_time_s": round(train_time, 2), "tokens_per_s": math.nan,
           "tokens_per_s_wall": math.nan, "peak_memory_bytes": None, "initial_val_loss": None,
           "final_val_loss": None, "final_val_ppl": None, "final_train_loss": None,
           "amp": df.attrs.get("amp")}
    if len(df):
        done = applied(df)
        out["steps"], out["tokens"] = int(done.sum()), int(df["tokens"][done].sum())
        out["skipped_steps"] = [int(x) for x in df["step"][~done & (df["step"] >= 0)]]
        out["final_train_loss"] = float(df["loss"].iloc[-1])
    if train_time > 0:
        out["tokens_per_s"] = round(out["tokens"] / train_time, 1)
    if wall > 0:
        out["tokens_per_s_wall"] = round(out["tokens"] / wall, 1)
    if peak == peak:  # not NaN: a meter measured it
        out["peak_memory_bytes"] = int(peak)
    if len(val):
        out["initial_val_loss"], out["final_val_loss"] = float(val.iloc[0]), float(val.iloc[-1])
        out["final_val_ppl"] = math.exp(min(out["final_val_loss"], 50))
    return out


def _finish(rec: Recorder, df: pd.DataFrame, run_cfg: dict, wall: float, start_step: int,
            controller: Any,
            dinfo: Any) -> tuple[pd.DataFrame, dict]:
    """5. model.pth (MiniMind's key names), metrics.csv and summary.json; returns (metrics,
    summary)."""
    full = rec.frame()
    full.attrs.update(df.attrs)
    if rec.write and not lora_layers(rec.model):  # a LoRA run without merge: lora.pth alone
        save_checkpoint(rec.model, rec.out / MODEL_FILE)  # a bare state dict
    if rec.write:
        rec.after_checkpoint()
    if len(rec.prior):
        prior_tokens = int(rec.prior["tokens"][applied(rec.prior)].sum())
    else:
        prior_tokens = 0
    summary = {"stage": rec.s.stage, "profile": run_cfg["profile"], "device": run_cfg["device"],
               "model_preset": run_cfg["model_preset"], **summarize(full, wall),
               "prior_tokens": prior_tokens,
               "resumed_from_step": start_step if rec.s.resume else None,
               "stopped_early": bool(len(full) and int(full["step"].max()) + 1 < rec.s.steps),
               "interrupted_by": rec.interrupted}
    # not the GradScaler's fp16 skips
    if "skipped" in full:
        skips = int(full["skipped"].eq(True).sum())
    else:
        skips = 0
    summary["shortfalls"] = ([f"{skips} of the {rec.s.steps} steps were skipped, the weights "
                              "unchanged (NaN/inf or "
                              f"no trained tokens: metrics.csv's events say which)"] if skips
                             else []) + (
        [] if len(full) and full["val_loss"].notna().iloc[-1] else ["no final evaluation: no "
                                                                    "validation data"])
    if rec.s.resume and wall > 0:  # this invocation's tokens over this invocation's time
        summary["tokens_per_s_wall"] = round((summary["tokens"] - prior_tokens) / wall, 1)
    # what the controller did: OOMs recovered, samples lost (0), rows cut
    if controller is not None:
        summary["batching"] = {k: v for k, v in controller.stats.items() if k != "uncut_len"}
    if dinfo is not None:
        summary["world_size"] = dinfo.world_size
    if rec.write:
        atomic_write_text(rec.out / SUMMARY_FILE, json.dumps(summary, indent=2, default=str) + "\n")
    return full, summary


def _model(s: RunSettings, mcfg: MiniMindConfig, init_state: dict | None,
           device: torch.device) -> tuple[Any, Any]:
    """(the model to train, from init's weights, with LoRA adapters when lora_rank; its objective: a
    dpo run's DPO against a frozen copy of init, else None, the next-token loss)."""
    torch.manual_seed(s.seed)  # the same seed, the same initial weights (and LoRA's A)
    model, reference = MiniMindForCausalLM(mcfg), None
    if init_state is not None:
        model.load_state_dict(init_state)
    if s.stage == "dpo":
        reference = MiniMindForCausalLM(mcfg).to(device)
        reference.load_state_dict(init_state)
    if s.lora_rank:
        apply_lora(model, s.lora_rank, s.lora_alpha)
    if s.compile:  # the trunk (norms, RoPE, SwiGLU fused); the chunked loss stays eager
        model.model.compile()
    if reference is None:
        return model, None
    return model, DPO(reference, s.beta)


def _run(s: RunSettings, dinfo: Any = None) -> RunResult:
    """One run, the steps of notebook 07 in order; under torchrun (dinfo) one rank of it, rank 0
    writing OUT (and holding its lock: a second run into the same OUT is refused while this one
    lives)."""
    main = dinfo is None or dinfo.is_main  # the one process that logs and writes files
    prof = s.profile
    if not isinstance(prof, Profile):
        prof = get_profile(s.profile)
    if dinfo is None:
        device = get_device(s.device)
    else:
        device = dinfo.device
    s = resolve_settings(s, prof)
    if dinfo is not None:  # DDP syncs gradients through its wrapper's forward: the model as written
        s = replace(s, compile=False, loss_chunk=0)
    tok, mcfg, preset, init_state = _inputs(s, prof, device)
    out = Path(s.out)
    lock = contextlib.nullcontext()
    if main:
        lock = exclusive_dir(out)
    with lock, contextlib.ExitStack() as stack:
        check_out_dir(out, s.resume, s.overwrite)
        cfg, amp = train_config(s), resolve_amp(s.amp, device, mcfg.hidden_size)
        run_cfg = _run_config(s, prof, preset, mcfg, tok, device, dinfo, amp)
        saved_state = None
        if s.resume:
            saved_state = check_resume(out, run_cfg, cfg, dinfo)
        run_cfg["run_id"] = secrets.token_hex(4)  # the loggers' run (wandb's id), across resumes
        if saved_state is not None:
            run_cfg["run_id"] = read_run_config(out).get("run_id", run_cfg["run_id"])
        ds, val, n_held_out = datasets(s, tok, dinfo, s.log if main else _quiet)  # 1. data
        steps = train_steps(ds, s, dinfo)  # 2. the optimizer steps
        sampler = steps.base if dinfo is not None else steps.batch_sampler
        run_cfg["data_stats"] = {**ds.stats.to_dict(), "batches_per_epoch": len(sampler)}
        if n_held_out is not None:
            run_cfg["sft_val_holdout"] = n_held_out
        # 3. the controller (under DDP every rank would have to agree on each change of size: none)
        controller = None
        if dinfo is None:
            multiple = prof.row_multiple if s.compile else 1  # compiled: a few row lengths
            controller = make_controller(device, s.max_tokens, s.seq_len, tok.pad_token_id,
                                         COLLATE[s.stage], multiple)
        model, objective = _model(s, mcfg, init_state, device)
        # a resumed run that never checkpointed starts afresh (same settings, checked above)
        if main:
            start_run_dir(out, run_cfg, tok, saved_state is not None)
        start_step = 0
        if saved_state is not None:
            start_step = int(saved_state["step"])
        loggers = stack.enter_context(open_loggers(s.loggers if main else (), out, run_cfg,
                                                   start_step))
        rec = Recorder(out, s, saved_state, model, tok, write=main)
        run = _Started(s, out, main, device, dinfo, amp, cfg, run_cfg, saved_state, start_step, val,
                       controller, model, objective, loggers, rec)
        return _train(run, steps)


def _quiet(message: str) -> None:
    """The log of a rank that is not rank 0: nothing."""


@dataclass
class _Started:
    """What a run has set up when its loop starts."""
    s: RunSettings
    out: Path
    main: bool
    device: torch.device
    dinfo: Any
    amp: Any
    cfg: Any
    run_cfg: dict
    saved_state: dict | None
    start_step: int
    val: Any
    controller: Any
    model: Any
    objective: Any
    loggers: list
    rec: Any


def _train(r: _Started, steps: Any) -> RunResult:
    """The loop of a started run (notebook 07, step 4), then its checks and its files."""
    s, out, rec, log = r.s, r.out, r.rec, r.s.log if r.main else _quiet
    line = (f"{s.stage}: {s.steps} steps x {s.accum_steps} micro-batches of <= {s.max_tokens} "
            f"tokens (seq_len {s.seq_len}), lr {s.lr:g}, {r.amp.reason}, device {r.device}")
    if r.dinfo is not None:
        line += f", {r.dinfo.world_size} ranks ({r.dinfo.backend})"
    if s.resume and r.saved_state:
        line += f"; resuming {out} at step {r.start_step} of {s.steps}"
    elif s.resume:
        line += (f"; {out} holds no checkpoint yet: starting it again from step 0 with its "
                 "recorded settings")
    log(line)
    t0 = time.perf_counter()
    if r.saved_state is None and r.val and r.main:
        rec.prior = eval_before_training(r.model, r.val, r.device, r.amp.dtype, r.objective)
        log(f"{s.stage}: validation loss before training {rec.prior['val_loss'].iloc[0]:.3f}")
        send(r.loggers, rec.prior.to_dict("records"))
    resume_from = None
    if r.saved_state is not None:
        resume_from = out / STATE_FILE
    if r.dinfo is not None:  # 4. the loop
        df = D.fit_distributed(r.model, steps, r.cfg, info=r.dinfo, val_batches=r.val,
                               pad_id=rec.tok.pad_token_id, callbacks=[rec],
                               resume_from=resume_from,
                               loggers=r.loggers)
    else:
        with stop_on_signals(rec):
            df = fit(r.model, steps, r.cfg, device=r.device, val_batches=r.val,
                     controller=r.controller,
                     callbacks=[rec], resume_from=resume_from, loggers=r.loggers,
                     objective=r.objective)
    if r.main and r.val and rec.rows and math.isnan(rec.rows[-1]["val_loss"]):
        # fit validates after applied steps only: final_val_loss is the saved model's
        ev = evaluate(r.model, r.val, device=r.device, amp_dtype=r.amp.dtype, objective=r.objective)
        rec.rows[-1].update(val_loss=ev["loss"], val_ppl=ev["ppl"])
        send(r.loggers, [{k: rec.rows[-1][k] for k in ("step", "val_loss", "val_ppl")}])
    if r.main and lora_layers(r.model):  # the adapters apart, in MiniMind's keys
        save_checkpoint(lora_state(r.model), out / LORA_FILE)
    if s.merge or s.stage == "dpo":
        merge_lora(r.model)
    metrics, summary = _finish(rec, df, r.run_cfg, time.perf_counter() - t0, r.start_step,
                               r.controller,
                               r.dinfo)
    return _checked(r, metrics, summary)


def _checked(r: _Started, metrics: Any, summary: dict) -> RunResult:
    """The run's result, once its stop, shortfalls and report are said."""
    s, out = r.s, r.out
    if r.rec.interrupted:
        raise RunError(f"stopped by {r.rec.interrupted} after step "
                       f"{int(metrics['step'].max()) + 1} of "
                       f"{s.steps}: {out / STATE_FILE} holds it; continue with --resume")
    if r.main and summary["shortfalls"] and not s.allow_skipped_steps:
        raise RunError(f"{'; '.join(summary['shortfalls'])}; {out} holds the model and "
                       "summary.json: pass "
                       f"--allow-skipped-steps (allow_skipped_steps=True) to accept such a run")
    if r.main:
        for problem in summary["shortfalls"]:
            s.log(f"{s.stage}: warning: {problem}")
    if r.loggers and s.report is not None:  # compare's verdict, eval's ladder: at the last step
        send(r.loggers, [{**flatten(s.report(out)), "step": int(metrics["step"].max())}])
    return RunResult(out, r.model.eval(), r.rec.tok, metrics, r.run_cfg, summary, r.rec.samples)


def _run_maybe_distributed(stage: str, kwargs: dict) -> RunResult:
    """The run of keyword arguments `kwargs`; under torchrun (WORLD_SIZE > 1) one rank of it, the
    process group torn down at the end (also on error)."""
    known = {f.name for f in fields(RunSettings)} - {"stage"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown argument(s) {unknown}; known: {sorted(known)}")
    s = RunSettings(stage=stage, **kwargs)
    if D.env_ranks()[1] <= 1:
        return _run(s)
    require(stage in ("pretrain", "sft"), f"{stage} runs in one process: start it without torchrun",
            RunError)
    backend = "gloo" if s.device is not None and torch.device(s.device).type != "cuda" else None
    dinfo = D.setup(backend=backend, device=s.device)
    try:
        return _run(s, dinfo)
    finally:
        D.teardown()


def pretrain(data: str | Path | None = None, out: str | Path | None = None,
             **kwargs: Any) -> RunResult:
    """Pretrain a MiniMind model on a {"text"} jsonl file (default data/pretrain.jsonl) into run
    directory `out`.

    Sizes come from the profile (`profile=` name or Profile; default: the selected one) unless
    given: config (model preset), seq_len, max_tokens (per micro-batch), accum_steps, steps, lr, amp
    ("auto"|"bf16"|"fp16"|"off"); see RunSettings. resume=True continues OUT/last.pt (same settings
    required); overwrite=True replaces a run.
"""
    return _run_maybe_distributed("pretrain", dict(kwargs, data=data, out=out))


def sft(data: str | Path | None = None, out: str | Path | None = None, *,
        init: str | Path | None = None,
        **kwargs: Any) -> RunResult:
    """Supervised fine-tuning on a {"conversations"} jsonl file (default data/sft.jsonl), from run
    directory `init`.

    Chat template, assistant-only loss; 5% of the conversations are held out for the validation
    loss. Other arguments as for `pretrain` (lr defaults to half the profile's); no sample
    generations unless sample_prompts.
"""
    kwargs.setdefault("sample_prompts", ())
    return _run_maybe_distributed("sft", dict(kwargs, data=data, out=out, init=init))


def lora(data: str | Path | None = None, out: str | Path | None = None, *,
         init: str | Path | None = None, **kwargs: Any) -> RunResult:
    """SFT through LoRA adapters (notebook 10): `sft`'s run with `init`'s weights frozen and
    adapters of rank lora_rank (default 8) beside MiniMind's layers; OUT/lora.pth holds them in
    MiniMind's keys, OUT/model.pth with merge=True the model with them folded in."""
    kwargs = {"sample_prompts": (), **kwargs}
    return _run_maybe_distributed("lora", dict(kwargs, data=data, out=out, init=init))


def dpo(data: str | Path | None = None, out: str | Path | None = None, *,
        init: str | Path | None = None, **kwargs: Any) -> RunResult:
    """DPO (notebook 10) on MiniMind's {"chosen", "rejected"} pairs (default data/dpo.jsonl) from
    the run `init`, also the frozen reference; beta (default 0.1); lora_rank: adapters alone, folded
    in at the end. 5% of the pairs held out give the validation loss (ln 2 before training)."""
    kwargs = {"sample_prompts": (), **kwargs}
    return _run_maybe_distributed("dpo", dict(kwargs, data=data, out=out, init=init))
