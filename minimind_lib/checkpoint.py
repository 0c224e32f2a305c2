"""Checkpoints: a model's weights (`save_checkpoint`, `load_checkpoint`: notebook 03_model's model,
MiniMind's .pth files), the whole training state that resumes notebook 04_gradient_accumulation's
loop (train.fit: model, optimizer, GradScaler, step, data position `DataStream`, controller, RNGs),
and the run directory notebook 07 writes (config.json, model.pth, tokenizer/: `start_run_dir`,
`load_run`) with the checks before a run writes there (`check_out_dir`, `check_resume`) and its stop
on SIGINT/SIGTERM. Everything is read back with weights_only=True."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from .checks import require
from .corpus import tokenizer_fingerprint
from .fileio import PREFIX, TMP_PREFIX, atomic_open, atomic_write_text, check_utf8_path
from .lora import apply_lora, load_lora, merge_lora
from .model import MiniMindConfig, MiniMindForCausalLM
from .tokenizer import (
    CONFIG_FILE as TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    check_vocab,
    load_tokenizer,
)


# ----------------------------------------------------------------------------------- model weights
# (notebook 03)
# A checkpoint is untrusted input: weights_only=True, never arbitrary unpickling.
_STRIP_PREFIXES = ("module.", "_orig_mod.")  # added by DistributedDataParallel and torch.compile
# recomputed, never loaded
_ROTARY_KEYS = ("model.freqs_cos", "model.freqs_sin", "freqs_cos", "freqs_sin")


def save_checkpoint(state_dict_or_model, path) -> Path:
    """Write a state dict (or a model's) atomically: temp file in the same folder, fsync, os.replace
    (never half)."""
    if isinstance(state_dict_or_model, nn.Module):
        state = state_dict_or_model.state_dict()
    else:
        state = state_dict_or_model
    path = Path(path)
    with atomic_open(path, "wb") as f:
        torch.save(state, f)
    return path


def _clean_state_dict(state: dict, path) -> dict:
    """Strip DDP/compile prefixes and rotary buffers, refill a missing tied lm_head; warn about each
    change."""
    if isinstance(state.get("model"), dict) and not any(isinstance(v, torch.Tensor)
                                                        for v in state.values()):
        warnings.warn(f"{path}: a training checkpoint; using its 'model' entry", stacklevel=3)
        state = state["model"]
    # they nest in either order: module._orig_mod.x
    while any(k.startswith(_STRIP_PREFIXES) for k in state):
        for prefix in _STRIP_PREFIXES:
            n = sum(k.startswith(prefix) for k in state)
            if n:
                warnings.warn(f"{path}: stripped prefix {prefix!r} from {n} keys (DDP / "
                              "torch.compile)", stacklevel=3)
                state = {k.removeprefix(prefix): v for k, v in state.items()}
    dropped = [k for k in state if k in _ROTARY_KEYS]
    if dropped:
        warnings.warn(f"{path}: ignored rotary tables {dropped} (recomputed from the config)",
                      stacklevel=3)
        state = {k: v for k, v in state.items() if k not in _ROTARY_KEYS}
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        warnings.warn(f"{path}: no lm_head.weight; using the tied model.embed_tokens.weight",
                      stacklevel=3)
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    return state


def load_weights_only(path, what: str = "checkpoint", map_location: Any = "cpu") -> Any:
    """torch.load(weights_only=True) of a file, errors naming it (never torch's advice to unpickle
    it anyway)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    # truncated file, not a torch file, or pickled objects weights_only refuses
    except Exception as e:
        raise ValueError(f"cannot read {what} {path} (corrupt or not a checkpoint: "
                         f"{type(e).__name__}): a checkpoint "
                         "holds tensors and plain values only; pickled objects are refused "
                         "because loading them "
                         f"could run code") from None


def check_state_dict(state: dict, model: nn.Module, path="state dict") -> None:
    """Raise a ValueError naming the first missing, unexpected or mis-shaped key (vocab size said
    plainly)."""
    expected = model.state_dict()
    emb = state.get("model.embed_tokens.weight")
    vocab = expected["model.embed_tokens.weight"].shape[0]
    if isinstance(emb, torch.Tensor) and emb.dim() == 2 and emb.shape[0] != vocab:
        raise ValueError(f"{path}: vocab size mismatch: checkpoint has {emb.shape[0]} tokens "
                         f"(model.embed_tokens.weight {list(emb.shape)}), the model has "
                         f"vocab_size={vocab}")
    missing, unexpected = [k for k in expected if k not in state], [k for k in state
                                                                    if k not in expected]
    if missing:
        raise ValueError(f"{path}: missing key {missing[0]!r} (and {len(missing) - 1} more)")
    if unexpected:
        raise ValueError(f"{path}: unexpected key {unexpected[0]!r} (and {len(unexpected) - 1} "
                         "more)")
    for key, want in expected.items():
        got = state[key]
        if not isinstance(got, torch.Tensor):
            raise ValueError(f"{path}: key {key!r} holds a {type(got).__name__}, not a tensor")
        if got.shape != want.shape:
            raise ValueError(f"{path}: shape mismatch at {key!r}: expected {list(want.shape)}, got "
                             f"{list(got.shape)}")
        # int weights would load silently
        if not got.is_floating_point() or not bool(torch.isfinite(got).all()):
            raise ValueError(f"{path}: {key!r} holds "
                             f"{'NaN/inf values' if got.is_floating_point() else got.dtype}; "
                             f"refused: a model's weights are finite floating-point numbers")


def load_checkpoint(path, model: nn.Module | None = None, map_location="cpu") -> dict:
    """The cleaned state dict of a checkpoint (ours or MiniMind's .pth, weights_only); loaded
    strictly into `model`."""
    path, state = Path(path), load_weights_only(path, "checkpoint", map_location)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}, not a state dict")
    state = _clean_state_dict(state, path)
    if model is not None:
        check_state_dict(state, model, path)
        model.load_state_dict(state, strict=True)
    return state


# ----------------------------------------------------------------------------------- the training
# state (notebook 04)
FORMAT, VERSION = "minimind-train-state", 1


def get_rng_state() -> dict:
    """Every RNG state (torch CPU and CUDA, numpy, python) as weights_only-loadable tensors, numbers
    and lists."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    # []: no GPU
    return {"torch_cpu": torch.get_rng_state(), "torch_cuda": torch.cuda.get_rng_state_all(),
            "numpy": {"name": str(np_name), "keys": torch.from_numpy(np_keys.astype(np.int64)),
                      "pos": int(np_pos),
                      "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
            "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss}}


def set_rng_state(state: dict) -> None:
    """Restore the RNG states saved by get_rng_state (a run resumed on fewer GPUs restores the ones
    it has)."""
    torch.set_rng_state(state["torch_cpu"].cpu())
    n, p = state["numpy"], state["python"]
    np.random.set_state((n["name"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    torch.cuda.set_rng_state_all([s.cpu() for s in state["torch_cuda"][:torch.cuda.device_count()]])


class DataStream:
    """Endless iteration over a re-iterable source (list, DataLoader), epoch by epoch, at a
    resumable position."""

    def __init__(self, source: Iterable) -> None:
        # no iter(): it starts a loader's workers
        self.source, self.epoch, self.offset, self._it = source, 0, 0, None

    def next(self) -> Any:
        """The next item; starts a new epoch when the current one ends (StopIteration for a spent
        generator)."""
        if self._it is None:
            self.load_state_dict(self.state_dict())
        try:
            item = next(self._it)
        except StopIteration:
            # a generator cannot restart; a list or a DataLoader can
            if hasattr(self.source, "__next__"):
                raise
            if self.offset == 0:
                raise ValueError(
                    "the training data is empty: an epoch yielded no batches"
                ) from None
            self.load_state_dict({"epoch": self.epoch + 1, "offset": 0})
            item = next(self._it)
        self.offset += 1
        return item

    def state_dict(self) -> dict:
        """Position (epoch, items drawn from it) as plain ints, stored in checkpoints."""
        return {"epoch": int(self.epoch), "offset": int(self.offset)}

    def load_state_dict(self, state: dict) -> None:
        """Move to a position: start its epoch (set_epoch on the source or its sampler), skip
        `offset` items."""
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        for obj in (self.source, getattr(self.source, "sampler", None), getattr(self.source,
                                                                                "batch_sampler",
                                                                                None)):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(self.epoch)
        self._it = iter(self.source)
        for _ in range(self.offset):
            next(self._it)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and all GPUs)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def nonfinite_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters holding NaN/inf, read from the device in one go (not one host sync
    per parameter)."""
    named = list(model.named_parameters())
    if named:
        finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
    else:
        finite = []
    return [name for (name, _), ok in zip(named, finite) if not ok]


def save_training_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                        cfg: Any, step: int, scaler: torch.amp.GradScaler | None = None,
                        data_state: dict | None = None, controller: Any = None,
                        extra: dict | None = None) -> Path:
    """Write a resumable training checkpoint to `path` atomically; refuses non-finite weights."""
    bad = nonfinite_parameters(model)
    first = bad[0] if bad else None
    require(not bad, f"refusing to write {path}: parameter {first!r} (and {len(bad) - 1} more) "
            "holds NaN/inf")
    state = {"format": FORMAT, "version": VERSION, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "scaler": None, "step": int(step),
             "data": dict(data_state or {"epoch": 0, "offset": 0}), "controller": None,
             "rng": get_rng_state(), "config": cfg.to_dict(), "extra": dict(extra or {})}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if hasattr(controller, "state_dict"):
        state["controller"] = controller.state_dict()
    return save_checkpoint(state, path)


def read_training_state(path: str | Path, map_location: Any = "cpu") -> dict:
    """Read and validate a training checkpoint (weights_only=True); clear errors for missing/corrupt
    files."""
    state = load_weights_only(path, "training checkpoint", map_location)
    if isinstance(state, dict):
        found = state.get("format")
    else:
        found = type(state).__name__
    if found != FORMAT:
        raise ValueError(f"{path}: not a training checkpoint (format={found!r}); for weights use "
                         "load_checkpoint")
    missing = [key for key in ("model", "optimizer", "step", "data", "rng", "config")
               if key not in state]
    require(not missing, f"{path}: an incomplete training checkpoint; missing keys: {missing}")
    return state


def check_config(saved: dict, cfg: Any, path: str | Path) -> None:
    """Raise ValueError naming the first field of cfg.RESUME_FIELDS (a TrainConfig's) that differs
    from `saved`."""
    if cfg is None:
        current = {}
    else:
        current = cfg.to_dict()
    for name in getattr(cfg, "RESUME_FIELDS", current):
        if name in saved and name in current and saved[name] != current[name]:
            raise ValueError(f"cannot resume from {path}: config field {name!r} differs "
                             f"(checkpoint {saved[name]!r}, now {current[name]!r})")


def load_training_state(path: str | Path, model: nn.Module, *,
                        optimizer: torch.optim.Optimizer | None = None,
                        scaler: torch.amp.GradScaler | None = None, controller: Any = None,
                        cfg: Any = None, map_location: Any = "cpu") -> dict:
    """Load a training checkpoint into model, optimizer, scaler and controller (its RNG states
    are returned: the caller decides whether to set them); checks it fits them and cfg."""
    state = read_training_state(path, map_location=map_location)
    check_config(state["config"], cfg, path)  # cfg=None: nothing to compare
    check_state_dict(state["model"], model, path)
    model.load_state_dict(state["model"], strict=True)
    if scaler is not None and state["scaler"] is None:
        raise ValueError(f"{path}: checkpoint has no GradScaler state but this run uses one (is "
                         "'amp' fp16 now?)")
    for key, obj in (("optimizer", optimizer), ("scaler", scaler), ("controller", controller)):
        if hasattr(obj, "load_state_dict") and state.get(key) is not None:
            try:
                obj.load_state_dict(state[key])
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}: the {key} state does not fit this {key}: {e}") from e
    return {"step": int(state["step"]), "data": state["data"], "rng": state["rng"],
            "extra": state.get("extra", {})}


def applied(df: Any) -> Any:
    """True for the metrics rows of optimizer steps that updated the weights and that no NaN
    rollback undid (a row without the column: False)."""
    flags = df.reindex(columns=["applied", "rolled_back"], fill_value=False)
    flags = flags.fillna(False).astype(bool)
    return flags["applied"] & ~flags["rolled_back"]


def with_tokens_seen(df: Any) -> Any:
    """The metrics with tokens_seen: the trained tokens of the steps applied so far."""
    return df.assign(tokens_seen=df["tokens"].where(applied(df), 0).cumsum())


# ----------------------------------------------------------------------------------- the run
# directory (notebook 07)
RUN_FORMAT, RUN_VERSION = "minimind-run", 1
CONFIG_FILE, MODEL_FILE, TOKENIZER_DIR, METRICS_FILE = (
    "config.json",
    "model.pth",
    "tokenizer",
    "metrics.csv",
)
STATE_FILE, SAMPLES_FILE, SUMMARY_FILE = "last.pt", "samples.jsonl", "summary.json"
LORA_FILE = "lora.pth"  # a LoRA run's adapters, in MiniMind's keys (notebook 10: lora.lora_state)
RUN_FILES = (CONFIG_FILE, MODEL_FILE, METRICS_FILE, STATE_FILE, SAMPLES_FILE, SUMMARY_FILE,
             LORA_FILE)
LOG_DIRS = ("tensorboard", "wandb")  # what --log writes into a run directory (loggers.py)
# config.json's settings that fix the order and shape of the data: resuming with another value would
# train on
# other batches than the saved position refers to, so it is an error.
RESUME_KEYS = ("stage", "model", "data", "val_data", "seq_len", "max_tokens", "val_batches",
               "max_samples", "batching",
               "long_docs", "init", "on_error", "data_fingerprint", "val_data_fingerprint", "lora",
               "dpo")


class RunError(ValueError):
    """A run cannot start: bad input, or it would overwrite or contradict an existing run directory.
    """


def read_run_config(run_dir: str | Path) -> dict:
    """OUT/config.json of a run directory, validated; FileNotFoundError/RunError name the file."""
    run_dir, path = Path(run_dir), Path(run_dir) / CONFIG_FILE
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is a file, not a run directory" if run_dir.exists()
                                else f"run directory not found: {run_dir}")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a run directory (it needs "
                                f"{CONFIG_FILE}, "
                                f"{MODEL_FILE} and {TOKENIZER_DIR}/)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: not valid JSON ({e})") from None
    if isinstance(cfg, dict):
        found = cfg.get("format")
    else:
        found = None
    if found != RUN_FORMAT:
        raise RunError(f"{path}: not a minimind run config (format={found!r}, expected "
                       f"{RUN_FORMAT!r})")
    missing = [key for key in ("model", "train", "tokenizer", "stage") if key not in cfg]
    if missing:
        raise RunError(f"{path}: lacks key {missing[0]!r}")
    return cfg


def check_out_dir(out: Path, resume: bool, overwrite: bool, resumable: bool = True) -> None:
    """Refuse to clobber an existing run unless resuming it or told to overwrite, and to replace a
    tokenizer/ that holds files this program does not write there (they are the user's); resumable:
    the command has --resume."""
    tok_dir, ours = out / TOKENIZER_DIR, {TOKENIZER_FILE, TOKENIZER_CONFIG_FILE}
    if tok_dir.exists() and (not (out / CONFIG_FILE).is_file() or not tok_dir.is_dir()
                             or {p.name for p in tok_dir.iterdir()} - ours):
        raise RunError(f"{tok_dir} exists and is not a tokenizer this program wrote (only "
                       f"{sorted(ours)} in a run "
                       f"directory); a run would replace it: move it away or choose another --out")
    # a run stopped before its first checkpoint has config.json only: it starts again from step 0
    if resume:
        if not (out / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"--resume: no run config {out / CONFIG_FILE} to resume from; "
                                    f"{out} is not a run "
                                    f"to resume")
        return
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and overwrite:
        try:
            read_run_config(out)
        except (FileNotFoundError, RunError) as e:
            raise RunError(
                f"--overwrite replaces a run of this program only, and {out} is none ({e}); "
                "nothing was "
                f"removed: move {', '.join(existing)} away or choose another --out"
            ) from None
    if existing and not overwrite:
        raise RunError(f"{out} already holds a run ({', '.join(existing)}); pass "
                       f"{'--resume to continue it, ' * resumable}"
                       f"--overwrite to replace it, or choose another --out")


def check_target(path: str | os.PathLike, flag: str) -> Path:
    """The directory a command writes: never '' or the working directory, where its files would mix
    with others, and named in UTF-8 (its JSON files record it)."""
    if not str(path).strip() or Path(path).resolve() == Path.cwd().resolve():
        raise RunError(f"{flag} {str(path)!r} is the working directory ({Path.cwd()}); name a "
                       "directory of its own")
    check_utf8_path(path, flag)
    return Path(path)


def check_other_files(out: Path, ours: Iterable[str], allowed: bool,
                      replaced: Iterable[str] = ()) -> None:
    """Refuse a directory holding files this program did not write (`ours`, its PREFIX files):
    written beside only when allowed, never over (`replaced`: the names the command writes; one that
    is a folder: refused before anything is replaced)."""
    folders = [out / name for name in replaced if (out / name).is_dir()] + [None]
    require(folders[0] is None, f"{folders[0]} is a folder where this command writes a file: "
            f"move it away or choose another directory", RunError)
    other = sorted(p.name for p in out.iterdir() if p.name not in set(ours)
                   and not p.name.startswith(PREFIX))
    clash = sorted(set(other) & set(replaced))
    if clash or other and not allowed:
        if clash:
            hint = f"it would replace {', '.join(clash)}"
        else:
            hint = "--allow-other-files writes beside them, kept"
        raise RunError(f"{out} holds {', '.join(other[:5])}{' ...' * (len(other) > 5)}, which this "
                       "command did not "
                       f"write ({hint}): move them away or choose another directory")


def check_resume(out: Path, run_cfg: dict, cfg: Any, dinfo: Any) -> dict | None:
    """Compare the new run's settings with the saved run before anything is written; returns the
    saved state (None: the run stopped before its first checkpoint, so it starts again from step 0
    with these same settings)."""
    saved = read_run_config(out)
    for key in RESUME_KEYS:
        # config.json of a run made before fingerprints, or before they hashed the whole file
        if key.endswith("fingerprint") and (key not in saved or (saved[key]
                                                                 or {}).keys() - {"size", "sha1"}):
            raise RunError(f"cannot resume {out}: its {CONFIG_FILE} records no {key} of the whole "
                           "file (written by an "
                           "older version), so the data file cannot be checked against the run's "
                           "position: start a "
                           f"new --out")
        if key.endswith("fingerprint") and saved.get(key) != run_cfg.get(key):
            raise RunError(f"cannot resume {out}: the file {run_cfg.get(key[:-12])} changed since "
                           "the run started "
                           f"(size and content: {saved.get(key)} then, {run_cfg.get(key)} now); "
                           "its saved position "
                           f"would point into other samples: restore the file or start a new --out")
        if saved.get(key) != run_cfg.get(key):
            raise RunError(f"cannot resume {out}: {key!r} differs (run: {saved.get(key)!r:.200}, "
                           "now: "
                           f"{run_cfg.get(key)!r:.200}); use the run's settings or start a new "
                           "--out")
    if saved["tokenizer"].get("fingerprint") != run_cfg["tokenizer"]["fingerprint"]:
        raise RunError(f"cannot resume {out}: the tokenizer differs from the run's "
                       f"({saved['tokenizer']} vs "
                       f"{run_cfg['tokenizer']})")
    # None: no checkpoint yet
    if (out / STATE_FILE).is_file():
        state = read_training_state(out / STATE_FILE)
    else:
        state = None
    if state is not None and int(state["step"]) >= cfg.max_steps and (out / SUMMARY_FILE).is_file():
        raise RunError(f"{out} is a finished run ({state['step']} of {cfg.max_steps} steps): "
                       "nothing to resume, "
                       f"nothing changed; train longer in a new --out (e.g. sft --init {out})")
    try:
        check_config(state["config"] if state else saved["train"], cfg, out / (STATE_FILE if state
                                                                               else CONFIG_FILE))
    except ValueError as e:
        raise RunError(str(e) + "; use the run's settings (see its config.json) or start a new "
                                "--out") from None
    if state is None:
        return None
    saved_ddp = "world_size" in (state.get("controller") or {})  # a DDP state counts global steps
    if saved_ddp != (dinfo is not None):
        raise RunError(f"cannot resume {out}: it was trained {'with' if saved_ddp else 'without'} "
                       "torchrun (data "
                       f"parallel), this run is {'with' if dinfo else 'without'}; its data "
                       "position means something "
                       f"else (resuming with another number of ranks >= 2 works)")
    return state


def load_run(run_dir: str | Path, device: torch.device | str | None = None):
    """(model, tokenizer, config) of a run directory; clear errors for a missing/corrupt checkpoint
    or vocab mismatch. A LoRA run without model.pth (notebook 10): its lora.pth on the run it
    started from, folded in."""
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    has_model = (run_dir / MODEL_FILE).is_file()
    adapters = not has_model and (run_dir / LORA_FILE).is_file() and bool(cfg.get("lora"))
    if not ((run_dir / MODEL_FILE).is_file() or adapters):
        raise FileNotFoundError(f"checkpoint not found: {run_dir / MODEL_FILE} (did the run in "
                                f"{run_dir} finish?)")
    try:
        mcfg = MiniMindConfig.from_dict(cfg["model"])
    except (ValueError, TypeError) as e:  # TypeError: "model" is not an object
        raise RunError(f"{run_dir / CONFIG_FILE}: 'model': {e}") from None
    tok = load_tokenizer(run_dir / TOKENIZER_DIR)
    check_vocab(tok, mcfg.vocab_size)  # the message names its directory
    fp = cfg["tokenizer"].get("fingerprint")
    if fp and fp != tokenizer_fingerprint(tok):
        raise RunError(f"{run_dir / TOKENIZER_DIR}: this tokenizer is not the one the model was "
                       "trained with "
                       f"(fingerprint {tokenizer_fingerprint(tok)}, {CONFIG_FILE} says {fp})")
    model = MiniMindForCausalLM(mcfg)
    if adapters:  # the run it started from, with its adapters (as `lora` trained them) folded in
        model = apply_lora(load_run(cfg["init"])[0], cfg["lora"]["rank"], cfg["lora"]["alpha"])
        path = run_dir / LORA_FILE
        load_lora(model, load_weights_only(path, "LoRA file"), str(path))
        merge_lora(model)
    else:  # weights_only=True; names the file when corrupt or mismatched
        load_checkpoint(run_dir / MODEL_FILE, model)
    if device is not None:
        model = model.to(device)
    return model.eval(), tok, cfg


def start_run_dir(out: Path, run_cfg: dict, tok: Any, resume: bool,
                  keep: Iterable[str] = ()) -> None:
    """Write config.json and tokenizer/ (a fresh run first removes a replaced run's files but
    `keep`, written anew already; any run its stale temps)."""
    out.mkdir(parents=True, exist_ok=True)
    # a run directory of this program: TMP_PREFIX files are
    with contextlib.suppress(FileNotFoundError, RunError):
        read_run_config(out)  # what an interrupted write of ours left there
        for stale in out.glob(TMP_PREFIX + "*"):
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
    if not resume:  # --overwrite: a stale last.pt or metrics.csv must not survive into the new run
        for name in set(RUN_FILES) - set(keep):
            (out / name).unlink(missing_ok=True)
        for folder in [out / name for name in LOG_DIRS if (out / name).is_dir()]:
            shutil.rmtree(folder)  # nor the curves --log wrote for it
    atomic_write_text(out / CONFIG_FILE, json.dumps(run_cfg, indent=2, ensure_ascii=False,
                                                    default=str) + "\n")
    tmp = out / f"{TMP_PREFIX}{TOKENIZER_DIR}.{os.getpid()}"
    tok.save(tmp)
    if (out / TOKENIZER_DIR).exists():
        shutil.rmtree(out / TOKENIZER_DIR)
    os.replace(tmp, out / TOKENIZER_DIR)


@contextlib.contextmanager
def stop_on_signals(rec: Any) -> Iterator[None]:
    """While training, SIGINT/SIGTERM set rec.interrupted: the run's callback then stops it after
    the step, with a checkpoint (--resume continues it)."""
    def stop(signum: int, frame: Any) -> None:
        rec.interrupted = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
    # the only one that may set handlers
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    else:
        saved = {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
