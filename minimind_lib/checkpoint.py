"""Resuming notebook 04_gradient_accumulation's loop (train.fit): checkpoints of the whole training state (model,
optimizer, GradScaler, step, data position: `DataStream`, controller, RNGs), read back with weights_only=True."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from .fileio import atomic_open
from .model import check_state_dict

FORMAT, VERSION = "minimind-train-state", 1


def get_rng_state() -> dict:
    """Every RNG state (torch CPU and CUDA, numpy, python) as weights_only-loadable tensors, numbers and lists."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {"torch_cpu": torch.get_rng_state(), "torch_cuda": torch.cuda.get_rng_state_all(),  # []: no GPU
            "numpy": {"name": str(np_name), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                      "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
            "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss}}


def set_rng_state(state: dict) -> None:
    """Restore the RNG states saved by get_rng_state (a run resumed on fewer GPUs restores the ones it has)."""
    torch.set_rng_state(state["torch_cpu"].cpu())
    n, p = state["numpy"], state["python"]
    np.random.set_state((n["name"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    torch.cuda.set_rng_state_all([s.cpu() for s in state["torch_cuda"][:torch.cuda.device_count()]])


class DataStream:
    """Endless iteration over a re-iterable source (list, DataLoader), epoch by epoch, at a resumable position."""

    def __init__(self, source: Iterable) -> None:
        self.source, self.epoch, self.offset, self._it = source, 0, 0, None  # no iter(): it starts a loader's workers

    def next(self) -> Any:
        """The next item; starts a new epoch when the current one ends (StopIteration for a spent generator)."""
        if self._it is None:
            self.load_state_dict(self.state_dict())
        try:
            item = next(self._it)
        except StopIteration:
            if hasattr(self.source, "__next__"):  # a generator cannot restart; a list or a DataLoader can
                raise
            if self.offset == 0:
                raise ValueError("the training data is empty: an epoch yielded no batches") from None
            self.load_state_dict({"epoch": self.epoch + 1, "offset": 0})
            item = next(self._it)
        self.offset += 1
        return item

    def state_dict(self) -> dict:
        """Position (epoch, items drawn from it) as plain ints, stored in checkpoints."""
        return {"epoch": int(self.epoch), "offset": int(self.offset)}

    def load_state_dict(self, state: dict) -> None:
        """Move to a position: start its epoch (set_epoch on the source or its sampler), skip `offset` items."""
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        for obj in (self.source, getattr(self.source, "sampler", None), getattr(self.source, "batch_sampler", None)):
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


def save_training_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, cfg: Any,
                        step: int, scaler: torch.amp.GradScaler | None = None, data_state: dict | None = None,
                        controller: Any = None, extra: dict | None = None) -> Path:
    """Write a resumable training checkpoint to `path` atomically; refuses non-finite weights."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"refusing to write {path}: parameter {bad[0]!r} (and {len(bad) - 1} more) holds NaN/inf")
    with atomic_open(path, "wb") as f:  # a temp file beside `path`, then os.replace: never half a checkpoint
        torch.save({"format": FORMAT, "version": VERSION, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "scaler": None if scaler is None else scaler.state_dict(),
                    "step": int(step), "data": dict(data_state or {"epoch": 0, "offset": 0}),
                    "controller": controller.state_dict() if hasattr(controller, "state_dict") else None,
                    "rng": get_rng_state(), "config": cfg.to_dict(), "extra": dict(extra or {})}, f)
    return Path(path)


def read_training_state(path: str | Path, map_location: Any = "cpu") -> dict:
    """Read and validate a training checkpoint (weights_only=True); clear errors for missing/corrupt files."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"training checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holds objects weights_only refuses
        raise ValueError(f"cannot read training checkpoint {path} (corrupt or not a checkpoint): {e!r:.300}") from e
    found = state.get("format") if isinstance(state, dict) else type(state).__name__
    if found != FORMAT:
        raise ValueError(f"{path}: not a training checkpoint (format={found!r}); for weights use model.load_checkpoint")
    missing = [key for key in ("model", "optimizer", "step", "data", "rng", "config") if key not in state]
    if missing or state.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported training checkpoint (version {state.get('version')!r}, expected "
                         f"{VERSION}; missing keys: {missing})")
    return state


def check_config(saved: dict, cfg: Any, path: str | Path) -> None:
    """Raise ValueError naming the first field of cfg.RESUME_FIELDS (a TrainConfig's) that differs from `saved`."""
    current = {} if cfg is None else cfg.to_dict()
    for name in getattr(cfg, "RESUME_FIELDS", current):
        if name in saved and name in current and saved[name] != current[name]:
            raise ValueError(f"cannot resume from {path}: config field {name!r} differs "
                             f"(checkpoint {saved[name]!r}, now {current[name]!r})")


def load_training_state(path: str | Path, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                        scaler: torch.amp.GradScaler | None = None, controller: Any = None, cfg: Any = None,
                        map_location: Any = "cpu", restore_rng: bool = True) -> dict:
    """Load a training checkpoint into model, optimizer, scaler, controller and RNGs; checks it fits them and cfg."""
    state = read_training_state(path, map_location=map_location)
    check_config(state["config"], cfg, path)  # cfg=None: nothing to compare
    check_state_dict(state["model"], model, path)
    model.load_state_dict(state["model"], strict=True)
    if scaler is not None and state["scaler"] is None:
        raise ValueError(f"{path}: checkpoint has no GradScaler state but this run uses one (is 'amp' fp16 now?)")
    for key, obj in (("optimizer", optimizer), ("scaler", scaler), ("controller", controller)):
        if hasattr(obj, "load_state_dict") and state.get(key) is not None:
            try:
                obj.load_state_dict(state[key])
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}: the {key} state does not fit this {key}: {e}") from e
    if restore_rng:
        set_rng_state(state["rng"])
    return {"step": int(state["step"]), "data": state["data"], "rng": state["rng"], "extra": state.get("extra", {})}
