"""Profiles: how big every experiment in the course is, chosen once, in one place.

A profile is data. Notebooks and the CLI read sizes from it and never hard-code them,
so the same notebook runs in seconds in CI (``smoke``), in minutes on a laptop (``cpu``)
and as the real MiniMind2-small on a GPU (``gpu``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch


@dataclass(frozen=True)
class RunSize:
    """One training run of notebooks 07/08 and the CLI: `steps` optimizer steps of `accum` micro-batches."""

    steps: int  # optimizer steps
    accum: int  # micro-batches per optimizer step
    max_tokens: int  # padded tokens (rows x longest row) per micro-batch
    eval_every: int  # optimizer steps between validation passes


@dataclass(frozen=True)
class Profile:
    """The sizes of one way of running the course."""

    name: str
    model: str  # a preset name for MiniMindConfig.preset
    seq_len: int  # longest row fed to the model, in tokens
    batch_size: int  # rows per micro-batch for fixed-size batching
    max_tokens: int  # padded tokens (rows x longest row) per micro-batch for token budgets
    accum_steps: int  # micro-batches per optimizer step in the accumulation demos
    train_steps: int  # optimizer steps of the short training demos (notebooks 04-06)
    pretrain: RunSize  # the pretraining run of notebook 07 and `python -m minimind_lib pretrain`
    sft: RunSize  # the SFT run of notebook 08 and `python -m minimind_lib sft`
    eval_every: int  # optimizer steps between validation passes
    lr: float  # peak learning rate
    max_samples: int | None  # cap on samples read from data/ (None: all of them)
    num_threads: int | None  # torch CPU threads (None: leave torch's default)

    def to_dict(self) -> dict:
        """The profile as a plain dict (for JSON and tables)."""
        return asdict(self)


PROFILES: dict[str, Profile] = {
    # CI on 2 CPU cores: every notebook in about a minute; proves the code runs, not that it learns well.
    "smoke": Profile(
        name="smoke", model="smoke", seq_len=128, batch_size=8, max_tokens=1024, accum_steps=4,
        train_steps=12, eval_every=10, lr=3e-3,
        pretrain=RunSize(steps=24, accum=2, max_tokens=128, eval_every=6),
        sft=RunSize(steps=16, accum=2, max_tokens=128, eval_every=4),
        max_samples=2000, num_threads=None,
    ),
    # A learner's laptop CPU: a few minutes per notebook, loss visibly falls.
    "cpu": Profile(
        name="cpu", model="cpu", seq_len=256, batch_size=16, max_tokens=4096, accum_steps=4,
        train_steps=60, eval_every=50, lr=2e-3,
        # sized so that notebooks 07 and 08 take a few minutes each on a quiet 2-core machine (a loaded one: far more)
        pretrain=RunSize(steps=200, accum=2, max_tokens=1024, eval_every=20),
        sft=RunSize(steps=100, accum=2, max_tokens=1024, eval_every=20),
        max_samples=None, num_threads=None,
    ),
    # The real MiniMind2-small (25,829,888 parameters) at MiniMind's sequence length.
    "gpu": Profile(
        name="gpu", model="minimind2-small", seq_len=512, batch_size=32, max_tokens=16384, accum_steps=4,
        train_steps=200, eval_every=200, lr=1e-3,
        # Sized by the bundled data, not by a guess of GPU speed: data/pretrain.jsonl is 2.30M tokens at seq 512
        # (long documents chunked), so 300 x 2 x 16384 = 9.8M padded tokens is ~4 epochs; data/sft.jsonl is
        # 0.66M tokens, so 100 x 2 x 8192 is ~2.5 epochs. Not yet timed on a GPU (benchmarks/gpu_check.sh is
        # that run); for real training bring MiniMind's 1.6 GB pretrain file and raise `steps`.
        pretrain=RunSize(steps=300, accum=2, max_tokens=16384, eval_every=25),
        sft=RunSize(steps=100, accum=2, max_tokens=8192, eval_every=20),
        max_samples=None, num_threads=None,
    ),
}


def select_profile_name(env: dict[str, str] | None = None, cuda_available: bool | None = None) -> str:
    """Name of the profile to use: MINIMIND_PROFILE, else smoke under CI, else gpu with CUDA, else cpu."""
    env = os.environ if env is None else env
    requested = env.get("MINIMIND_PROFILE", "").strip().lower()
    if requested:
        if requested not in PROFILES:
            raise ValueError(
                f"MINIMIND_PROFILE={requested!r} is not a profile; choose one of {sorted(PROFILES)}"
            )
        return requested
    if env.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return "smoke"
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return "gpu" if cuda_available else "cpu"


def get_profile(name: str | None = None, **overrides) -> Profile:
    """The named profile (or the selected one), with optional field overrides."""
    name = select_profile_name() if name is None else name
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    profile = PROFILES[name]
    return replace(profile, **overrides) if overrides else profile
