"""The hyper-parameters of notebook 04_gradient_accumulation's training loop (train.fit), in one
dataclass that checkpoints store and --resume compares: the learning rate and its schedule,
accumulation, AdamW, clipping, mixed precision (notebook 05), logging, validation and checkpoint
cadence, NaN rollbacks."""

from dataclasses import asdict, dataclass
from typing import Any

from .device import AMP_MODES

NORMALIZATIONS = ("token", "naive")


@dataclass
class TrainConfig:
    """Hyper-parameters of one training run (all `fit` needs besides model, data and device)."""
    lr: float = 1e-3  # peak learning rate
    min_lr: float | None = None  # floor of the cosine decay; None: lr / 10
    warmup_steps: int = 10  # linear warmup, in optimizer steps
    max_steps: int = 100  # optimizer steps of the run (the cosine reaches min_lr here)
    accum_steps: int = 1  # micro-batches per optimizer step (ignored when a controller splits it)
    weight_decay: float = 0.1  # applied to 2-D weights only (matmuls, embeddings), never to norms
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global grad norm; None or 0: measure the norm, do not clip
    amp: str = "auto"  # "auto" | "bf16" | "fp16" | "off" (see resolve_amp)
    normalization: str = "token"  # "token": sum / the step's tokens (exact); "naive": means / k
    seed: int = 1337
    log_every: int = 10  # steps between reads of the device (metrics rows, bad steps, callbacks)
    loss_chunk: int = 0  # > 0: the head and the loss that many positions at a time (forward_loss)
    eval_every: int = 0  # validation every N optimizer steps (0: at the end only, if val_batches)
    ckpt_every: int = 0  # training-state checkpoint every N optimizer steps (0: never)
    ckpt_dir: str | None = None  # checkpoints: ckpt_dir/last.pt (every ckpt_every steps, and last)
    max_bad_steps: int = 3  # NaN/inf steps in a row before rolling back to the last checkpoint
    lr_backoff: float = 0.5  # LR multiplier applied at each rollback
    max_rollbacks: int = 3  # rollbacks before giving up with an error
    progress: bool = True  # tqdm progress bar

    # they shape the optimisation: a run resumes only with the values it was saved with
    RESUME_FIELDS = ("lr", "min_lr", "warmup_steps", "max_steps", "accum_steps", "weight_decay",
                     "betas", "eps", "grad_clip", "amp", "normalization", "seed")

    def __post_init__(self) -> None:
        rules = [("amp", self.amp in AMP_MODES, f"one of {AMP_MODES}"), ("lr", self.lr > 0, "> 0"),
                 ("normalization", self.normalization in NORMALIZATIONS,
                  f"one of {NORMALIZATIONS}")]
        rules += [(name, int(getattr(self, name)) >= low, f">= {low}") for name, low in (
            ("max_steps", 1), ("accum_steps", 1), ("max_bad_steps", 1), ("warmup_steps", 0),
            ("log_every", 0), ("eval_every", 0), ("ckpt_every", 0), ("loss_chunk", 0))]
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be {rule}")
        self.betas = tuple(float(b) for b in self.betas)
        self.min_lr = self.lr / 10 if self.min_lr is None else self.min_lr

    @classmethod
    def from_profile(cls, profile: Any, **overrides: Any) -> "TrainConfig":
        """A config sized by a profile (lr, steps, accumulation, eval cadence), with overrides."""
        steps = overrides.pop("max_steps", profile.train_steps)
        return cls(**{"lr": profile.lr, "max_steps": steps, "accum_steps": profile.accum_steps,
                      "warmup_steps": max(1, steps // 10), "eval_every": profile.eval_every,
                      "loss_chunk": profile.loss_chunk, **overrides})

    def to_dict(self) -> dict:
        """The config as plain types (stored in checkpoints, compared on resume)."""
        return {**asdict(self), "betas": list(self.betas)}
