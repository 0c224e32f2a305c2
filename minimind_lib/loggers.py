"""Watch a run where learners already look (notebook 07_pretrain; `python -m minimind_lib
pretrain|sft --log tensorboard|wandb`): fit's metrics rows at metrics.csv's step numbers, every
number a scalar (NaN left out), the events as text; the run's config (its device too) when a logger
opens; what the caller adds at the end (the command line: compare's verdict and eval's ladder).

A run that checkpoints sends each row with the checkpoint that holds it, when metrics.csv gets it: a
resumed run continues the same curves, no step twice, and the steps a NaN rollback undid never show
(metrics.csv keeps them, marked rolled_back); a run without checkpoints sends them at fit's log
points. TensorBoard: event files in OUT/tensorboard/, flushed at every send, so a killed run leaves
them readable (`make tensorboard RUN=OUT`). Weights & Biases: offline unless WANDB_MODE says
otherwise, in OUT/wandb/, under the run_id in OUT/config.json, so a resumed run's invocations are
one run (`wandb sync OUT/wandb/offline-run-*` uploads them later, in order); its own process writes
that file in 32 KiB blocks and at the run's end (Ctrl-C and errors included), so a hard kill (kill
-9, power loss) loses its last block there, never in metrics.csv or TensorBoard. Neither package is
imported unless a run asks for it. A command takes the flag by `cli.add_log_option`, checks it with
`check_loggers` before it writes, and passes `open_loggers(...)` to `train.fit(loggers=...)`."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from .checks import require

LOGGERS = {"tensorboard": "requirements.txt", "wandb": "requirements-wandb.txt"}  # name: its pins


def check_loggers(names: Iterable[str], run_dir: str | Path) -> None:
    """Refuse an unknown logger, one whose package is missing, or its folder in run_dir a file."""
    for name in names:
        require(name in LOGGERS, f"--log {name!r}: not a logger; choose from {', '.join(LOGGERS)}")
        require(importlib.util.find_spec(name) is not None, f"--log {name}: the {name} package "
                f"is not installed; install it with: pip install -r {LOGGERS[name]}")
        folder = Path(run_dir) / name
        require(not folder.exists() or folder.is_dir(), f"{folder} is a file, not a directory: "
                f"--log {name} writes there; move it away or choose another --out")


def split(values: dict) -> tuple[dict, dict]:
    """(numbers, texts) of a row but its step: finite numbers as floats (True: 1.0), strings."""
    plain = {key: value for key, value in values.items() if key != "step"}
    found = {key: float(value) for key, value in plain.items() if isinstance(value, numbers.Real)}
    return ({key: value for key, value in found.items() if math.isfinite(value)},
            {key: value for key, value in plain.items() if isinstance(value, str) and value})


def flatten(values: dict, prefix: str = "") -> dict:
    """Nested dicts and lists as one level, keys joined by '/' (ladder/table/model/all/...)."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, list):
            value = dict(enumerate(value))
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class TensorBoardLogger:
    """Scalars and text in TensorBoard event files, run_dir/tensorboard/ (a file per invocation)."""

    def __init__(self, run_dir: Path, config: dict, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # here only: needs tensorboard

        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        text = json.dumps(config, indent=2, default=str)
        self.writer.add_text("config", f"```\n{text}\n```", step)

    def log(self, step: int, values: dict) -> None:
        scalars, texts = split(values)
        for key, value in scalars.items():  # float32: what TensorBoard's own reader shows
            self.writer.add_scalar(key, value, step)
        for key, text in texts.items():
            self.writer.add_text(key, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in run_dir/wandb/, offline unless WANDB_MODE says otherwise."""

    def __init__(self, run_dir: Path, config: dict, step: int) -> None:
        import wandb  # here only: a run that does not ask for it never imports it

        mode = os.environ.get("WANDB_MODE", "offline")
        if mode in ("offline", "dryrun"):  # no error reports over the network either, unless asked
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        settings = wandb.Settings(console="off", disable_git=True, x_save_requirements=False)
        self.run = wandb.init(dir=run_dir, id=config.get("run_id"), resume="allow", mode=mode,
                              project=os.environ.get("WANDB_PROJECT", "minimind"), config=config,
                              name="/".join(Path(run_dir).resolve().parts[-2:]), settings=settings)
        self.run.define_metric("*", step_metric="step")  # the x axis: metrics.csv's step

    def log(self, step: int, values: dict) -> None:
        scalars, texts = split(values)
        self.run.log({**scalars, **texts, "step": step})  # a row of its own, handed over at once

    def close(self) -> None:
        self.run.finish()


@contextlib.contextmanager
def open_loggers(names: Iterable[str], run_dir: str | Path, config: dict,
                 step: int = 0) -> Iterator[list]:
    """The named loggers of a run directory, opened at `step` with its config; closed on exit."""
    kinds = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger}
    with contextlib.ExitStack() as stack:
        opened = []
        for name in dict.fromkeys(names):  # a name given twice: one logger
            opened.append(kinds[name](Path(run_dir), config, step))
            stack.callback(opened[-1].close)
        yield opened


def send(loggers: Iterable[Any], rows: Iterable[dict]) -> None:
    """Each row to each logger, at the row's step."""
    for row in rows:
        for logger in loggers:
            logger.log(int(row["step"]), row)


class SendRows:
    """fit's callback for its loggers: each row at its checkpoint (buffered) or at once."""

    def __init__(self, loggers: Iterable[Any], buffered: bool) -> None:
        self.loggers, self.buffered, self.rows = list(loggers), buffered, []

    def __call__(self, step: int, row: dict) -> None:
        if "rollback_to_step_" in str(row.get("event", "")):  # rows since the checkpoint: undone
            self.rows = []
            return
        self.rows.append(row)  # the row itself: its checkpoint's tag reaches the loggers too
        if not self.buffered:
            self.after_checkpoint()

    def after_checkpoint(self) -> None:
        send(self.loggers, self.rows)
        self.rows = []
