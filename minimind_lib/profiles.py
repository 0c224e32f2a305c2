"""Profiles, shown in notebook 00_setup: the sizes every notebook and the CLI read, so one notebook
runs in seconds in CI (``smoke``), a minute in class (``workshop``), minutes on a laptop (``cpu``),
as MiniMind2-small on a GPU (``gpu``; ``gpu-check``: the same model, fewer steps, for
benchmarks/gpu_check.sh)."""

import os
from dataclasses import asdict, dataclass, replace

import torch


@dataclass(frozen=True)
class Profile:
    """The sizes of one way of running the course: one micro-batch size and one accumulation for
    every notebook."""
    name: str
    model: str  # a preset name for MiniMindConfig.preset
    seq_len: int  # longest row fed to the model, in tokens
    # rows per micro-batch; a token-budget micro-batch holds max_tokens = batch_size x seq_len
    batch_size: int
    accum_steps: int  # micro-batches per optimizer step
    lr: float  # peak learning rate (SFT uses half of it: it starts from a trained model)
    train_steps: int  # optimizer steps of the short experiments of notebooks 04-06
    # optimizer steps of the pretraining run (notebook 07, `python -m minimind_lib pretrain`)
    pretrain_steps: int
    sft_steps: int  # optimizer steps of the SFT run (notebook 08, `python -m minimind_lib sft`)
    eval_every: int  # optimizer steps between validation passes
    max_samples: int | None  # cap on samples read from data/ (None: all of them)
    dpo_steps: int  # optimizer steps of the DPO run (notebook 10, `python -m minimind_lib dpo`)
    dpo_lr: float  # its peak lr: small, as the SFT model it starts from must keep what it knows
    compile: bool = False  # torch.compile the model's trunk (a GPU: fused norms, RoPE, SwiGLU)
    loss_chunk: int = 0  # > 0: the head and the loss that many positions at a time (TrainConfig)
    row_multiple: int = 1  # compiled: rows padded to a multiple of this (a few shapes, not many)

    @property
    def max_tokens(self) -> int:
        """Padded tokens (rows x longest row) of one micro-batch: the same memory as batch_size full
        rows."""
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict:  # a plain dict for JSON and tables, max_tokens included
        return {**asdict(self), "max_tokens": self.max_tokens}

    def stage(self, stage: str) -> tuple[int, float]:
        """(steps, lr) of a run's stage: SFT at half the lr (it starts from a trained model), LoRA
        at the full one (only its small adapters move), DPO at dpo_lr."""
        sizes = {"pretrain": (self.pretrain_steps, self.lr), "sft": (self.sft_steps, self.lr / 2),
                 "lora": (self.sft_steps, self.lr), "dpo": (self.dpo_steps, self.dpo_lr)}
        if stage not in sizes:
            raise ValueError(f"stage={stage!r} is not valid; choose one of {list(sizes)}")
        return sizes[stage]


PROFILES: dict[str, Profile] = {
    # CI on 2 CPU cores: every notebook in about a minute; proves the code runs, not that it learns
    # well.
    "smoke": Profile(name="smoke", model="smoke", seq_len=128, batch_size=4, accum_steps=2, lr=3e-3,
                     train_steps=12, pretrain_steps=24, sft_steps=16, eval_every=6,
                     max_samples=2000, dpo_steps=8, dpo_lr=2e-4, row_multiple=32),
    # A classroom of 2-core laptops: each notebook in ~90 s; the smoke model on 25x smoke's tokens
    # writes words.
    "workshop": Profile(name="workshop", model="smoke", seq_len=128, batch_size=4, accum_steps=4,
                        lr=1e-2, train_steps=24, pretrain_steps=300, sft_steps=60, eval_every=50,
                        max_samples=4000, dpo_steps=24, dpo_lr=2e-4,
                        row_multiple=32),
    # A learner's laptop CPU: minutes per notebook, the loss visibly falls; pretraining is 100 x 4 x
    # 1024 = 410k tokens.
    "cpu": Profile(name="cpu", model="cpu", seq_len=256, batch_size=4, accum_steps=4, lr=2e-3,
                   train_steps=60, pretrain_steps=100, sft_steps=50, eval_every=10,
                   max_samples=None, dpo_steps=30, dpo_lr=5e-5, row_multiple=64),
    # MiniMind2-small at seq 512, sized by the bundled data: 300 x 32768 = 9.8M padded tokens is
    # ~4 epochs of data/pretrain.jsonl (2.30M tokens), 50 x 32768 ~2.5 of data/sft.jsonl (0.66M).
    # Real training: bring more data. 64 rows a step in one micro-batch: plan_micro_batches'
    # choice for GPU_PLAN_BYTES with the chunked loss (tests/test_gpu_path.py); compiled, rows
    # padded to 128, 256, 384 or 512 tokens.
    "gpu": Profile(name="gpu", model="minimind2-small", seq_len=512, batch_size=64, accum_steps=1,
                   lr=1e-3, train_steps=200, pretrain_steps=300, sft_steps=50, eval_every=25,
                   max_samples=None, dpo_steps=50, dpo_lr=5e-6,  # dpo_lr: not measured on a GPU
                   compile=True, loss_chunk=4096, row_multiple=128),
    # benchmarks/gpu_check.sh: gpu's model and rows, 200 x 32768 = 6.6M tokens, checkpoints last.
    "gpu-check": Profile(name="gpu-check", model="minimind2-small", seq_len=512, batch_size=64,
                         accum_steps=1, lr=1e-3, train_steps=40, pretrain_steps=200, sft_steps=30,
                         eval_every=200, max_samples=None, dpo_steps=20, dpo_lr=5e-6,
                         compile=True, loss_chunk=4096, row_multiple=128),
}
# What the gpu profiles' micro-batch is planned for: 60% of a free 16 GB T4, the controller's 80%
# less what the estimate leaves out (the CUDA context, the allocator's rounding, workspaces).
GPU_PLAN_BYTES = int(0.6 * 16e9)


def select_profile_name(env: dict[str, str] | None = None,
                        cuda_available: bool | None = None) -> str:
    """Name of the profile to use: MINIMIND_PROFILE, else smoke under CI, else gpu with CUDA, else
    cpu."""
    env = os.environ if env is None else env
    requested = env.get("MINIMIND_PROFILE", "").strip().lower()
    if requested:
        if requested not in PROFILES:
            raise ValueError(f"MINIMIND_PROFILE={requested!r} is not a profile; choose one of "
                             f"{sorted(PROFILES)}")
        return requested
    if env.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return "smoke"
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return "gpu" if cuda_available else "cpu"


def get_profile(name: str | None = None, **overrides) -> Profile:
    """The named profile (or the selected one), with optional field overrides."""
    if name is None:
        name = select_profile_name()
    else:
        name = name
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    if overrides:
        return replace(PROFILES[name], **overrides)
    return PROFILES[name]
