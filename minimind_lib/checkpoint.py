"""Training-state checkpoints: everything needed to resume a run as if it had never stopped.

A training checkpoint holds the model, the optimizer, the GradScaler, the step (the LR schedule is a pure
function of it), the data position, an optional batch controller's state and every RNG state (torch CPU and
CUDA, numpy, python). It is written atomically by model.py's `save_checkpoint` (temp file in the same folder,
flush + fsync, os.replace) and read with `torch.load(weights_only=True)`, so everything in it is a tensor or a
plain Python value: RNG states are stored as tensors and lists, never as pickled objects.
(Model weights alone: `minimind_lib.model.save_checkpoint` / `load_checkpoint`; `load_checkpoint` also accepts a
training checkpoint and takes its "model" entry.)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

FORMAT = "minimind-train-state"
VERSION = 1
REQUIRED_KEYS = ("format", "version", "model", "optimizer", "step", "data", "rng", "config")


# --------------------------------------------------------------------------------------------- RNG states


def get_rng_state() -> dict:
    """Every RNG state as weights_only-loadable values (tensors, ints, floats, lists, strings)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "numpy": {"name": str(np_name), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "python": {"version": int(py_version), "state": [int(x) for x in py_state],
                   "gauss_next": None if py_gauss is None else float(py_gauss)},
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict) -> None:
    """Restore the RNG states saved by get_rng_state."""
    torch.set_rng_state(state["torch_cpu"].cpu())
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    cuda = state.get("torch_cuda") or []
    if cuda and torch.cuda.is_available():
        # A run resumed on fewer GPUs restores the ones it has.
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda[: torch.cuda.device_count()]])


# --------------------------------------------------------------------------------------------- save / load


def atomic_save(obj: Any, path: str | Path) -> Path:
    """Write `obj` with torch.save atomically (the model's writer: temp file in the same dir, fsync, os.replace)."""
    from .model import save_checkpoint

    return save_checkpoint(obj, path)


def _config_dict(cfg: Any) -> dict:
    """A TrainConfig (or dict) as plain types."""
    if cfg is None:
        return {}
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


def save_training_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, cfg: Any,
                        step: int, scaler: torch.amp.GradScaler | None = None, data_state: dict | None = None,
                        controller: Any = None, extra: dict | None = None) -> Path:
    """Write a resumable training checkpoint to `path` atomically; refuses non-finite weights."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"refusing to write checkpoint {path}: parameter {bad[0]!r} (and {len(bad) - 1} more) "
                         f"holds NaN/inf")
    state = {
        "format": FORMAT,
        "version": VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": int(step),
        "data": dict(data_state or {"epoch": 0, "offset": 0}),
        "controller": controller.state_dict() if controller is not None and hasattr(controller, "state_dict") else None,
        "rng": get_rng_state(),
        "config": _config_dict(cfg),
        "extra": dict(extra or {}),
    }
    return atomic_save(state, path)


def read_training_state(path: str | Path, map_location: Any = "cpu") -> dict:
    """Read and validate a training checkpoint (weights_only=True); clear errors for missing/corrupt files."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated, not a torch file, or holds objects weights_only refuses
        first = (str(e).splitlines() or [""])[0][:300]
        raise ValueError(f"cannot read training checkpoint {path} (corrupt or not a checkpoint): "
                         f"{type(e).__name__}: {first}") from e
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a training checkpoint")
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a training checkpoint (format={state.get('format')!r}, expected {FORMAT!r}); "
                         f"model weights load with minimind_lib.model.load_checkpoint")
    for key in REQUIRED_KEYS:
        if key not in state:
            raise ValueError(f"{path}: training checkpoint lacks key {key!r}")
    if state["version"] != VERSION:
        raise ValueError(f"{path}: checkpoint version {state['version']} is not supported (expected {VERSION})")
    return state


def check_config(saved: dict, cfg: Any, path: str | Path, fields: tuple[str, ...] | None = None) -> None:
    """Raise ValueError naming the first field where the resumed config differs from the checkpoint's."""
    current = _config_dict(cfg)
    fields = fields if fields is not None else tuple(getattr(cfg, "RESUME_FIELDS", tuple(current)))
    for name in fields:
        if name not in saved or name not in current:
            continue
        a, b = saved[name], current[name]
        if isinstance(a, (list, tuple)):
            a, b = list(a), list(b)
        if a != b:
            raise ValueError(f"cannot resume from {path}: config field {name!r} differs "
                             f"(checkpoint {saved[name]!r}, now {current[name]!r})")


def load_training_state(path: str | Path, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                        scaler: torch.amp.GradScaler | None = None, controller: Any = None, cfg: Any = None,
                        map_location: Any = "cpu", restore_rng: bool = True) -> dict:
    """Load a training checkpoint into model/optimizer/scaler/controller (and RNGs); return step, data, rng, extra.

    With `cfg`, the fields that shape optimisation (TrainConfig.RESUME_FIELDS) must match the checkpoint's.
    """
    from .model import check_state_dict

    path = Path(path)
    state = read_training_state(path, map_location=map_location)
    if cfg is not None:
        check_config(state["config"], cfg, path)
    check_state_dict(state["model"], model, path)
    model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}: optimizer state does not fit this optimizer: {e}") from e
    if scaler is not None:
        if state["scaler"] is None:
            raise ValueError(f"{path}: checkpoint has no GradScaler state but this run uses fp16 + GradScaler "
                             f"(config field 'amp' differs?)")
        scaler.load_state_dict(state["scaler"])
    if controller is not None and state.get("controller") is not None and hasattr(controller, "load_state_dict"):
        controller.load_state_dict(state["controller"])
    if restore_rng:
        set_rng_state(state["rng"])
    return {"step": int(state["step"]), "data": state["data"], "rng": state["rng"], "config": state["config"],
            "extra": state.get("extra", {}), "path": str(path)}
