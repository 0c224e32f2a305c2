"""Notebook 09's demo harness: one DDP job per rank under torchrun, and a launcher of N local ranks.

    torchrun --nproc_per_node=2 notebooks/ddp_demo.py JOB.json      (gloo on CPU, NCCL on GPUs)

JOB.json is one job or a list of jobs that share the process group. A training job trains a MiniMind model with
the library's `distributed.fit_distributed` on real pretraining samples (data/pretrain.jsonl) or on synthetic ones
(the tests), and every rank writes OUT/result_rank{r}.pt: its per-step losses, token counts, micro-batches, the
bytes DDP's gradient all-reduces sent per step, the gradients of chosen steps, and copies of rank 0's checkpoints. A
"measure" job times one step's compute against DDP's communication instead. Run alone (no torchrun), a job is
the one-process reference. Notebook 09 and tests/test_distributed.py launch it with `launch`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from minimind_lib import distributed as D
from minimind_lib.data import IGNORE_INDEX, PretrainDataset, pad_collate, trained_tokens
from minimind_lib.device import synchronize
from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM
from minimind_lib.paths import DATA_DIR
from minimind_lib.tokenizer import load_tokenizer
from minimind_lib.train import TrainConfig, accumulate_step

# --------------------------------------------------------------------------------------------- launching


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchResult:
    """What a launch did: exit codes, the seconds it took, every process's output."""

    returncodes: list[int]
    seconds: float
    outputs: list[str]
    timed_out: bool = False
    pids: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every process exited with 0 in time."""
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the process group `proc` leads (SIGTERM, then SIGKILL), even if the leader has exited already:
    torchrun's workers are in the same group and must not outlive it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


def launch(args: Sequence[str], nproc: int = 2, *, timeout_s: float = 120.0, launcher: str = "torchrun",
           env: dict | None = None, log_dir: str | Path | None = None, threads: int = 1) -> LaunchResult:
    """Run `python <args...>` as `nproc` local ranks on 127.0.0.1 (args may start with "-m" or "-c").

    launcher="torchrun": one `python -m torch.distributed.run --nproc_per_node=N` (what a learner types);
    launcher="env": N plain processes with the RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* variables torchrun sets.
    Every process starts in its own session and its whole group is killed at the end, on timeout or on error."""
    if launcher not in ("torchrun", "env"):
        raise ValueError(f"launcher={launcher!r}; choose 'torchrun' or 'env'")
    if int(nproc) < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="minimind_ddp_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if launcher == "torchrun":
        cmds = [[sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
                 "--master_addr=127.0.0.1", f"--master_port={port}", *args]]
        envs = [base]
    else:
        cmds = [[sys.executable, *args] for _ in range(nproc)]
        envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                 "LOCAL_WORLD_SIZE": str(nproc)} for r in range(nproc)]
    procs: list[subprocess.Popen] = []
    logs = [log_dir / f"launch_{i}.log" for i in range(len(cmds))]
    t0, timed_out = time.perf_counter(), False
    try:
        for cmd, e, log in zip(cmds, envs, logs):
            with open(log, "wb") as fh:
                procs.append(subprocess.Popen(cmd, env=e, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True))
        while any(p.poll() is None for p in procs):
            if time.perf_counter() > t0 + timeout_s:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # one rank failed: give the others a moment to report, then stop them
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill_group(p)
    outputs = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    rcs = [p.returncode if p.returncode is not None else -9 for p in procs]
    return LaunchResult(rcs, time.perf_counter() - t0, outputs, timed_out, [p.pid for p in procs])


# --------------------------------------------------------------------------------------------- the job


def synthetic_samples(n: int, *, min_len: int = 4, max_len: int = 48, vocab: int = 6400, seed: int = 0,
                      masked_frac: float = 0.3) -> list[dict]:
    """Deterministic variable-length samples; in `masked_frac` of them a prefix is -100 (SFT-like masks)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        ids = torch.from_numpy(rng.integers(3, vocab, size=length)).long()
        labels = ids.clone()
        if rng.random() < masked_frac and length > 1:  # a 1-token sample has no label to mask
            labels[: int(rng.integers(1, length))] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def job_samples(spec: dict) -> list[dict]:
    """spec["synthetic"] (synthetic_samples' arguments) or spec["pretrain"] ({"seq_len", "n"}: data/pretrain.jsonl)."""
    if "synthetic" in spec:
        return synthetic_samples(**spec["synthetic"])
    if "pretrain" not in spec:
        raise ValueError(f"job spec has neither 'synthetic' nor 'pretrain' samples (keys: {sorted(spec)})")
    ds = PretrainDataset(DATA_DIR / "pretrain.jsonl", load_tokenizer(), int(spec["pretrain"]["seq_len"]),
                         max_samples=int(spec["pretrain"]["n"]))
    return [ds[i] for i in range(len(ds))]


def job_model(spec: dict) -> MiniMindForCausalLM:
    """The job's model, seeded: every rank starts from the same weights (DDP would broadcast rank 0's anyway)."""
    torch.manual_seed(int(spec.get("model_seed", 0)))
    return MiniMindForCausalLM(MiniMindConfig.preset(spec.get("model", "smoke")))


def build_job(spec: dict, info: D.DistInfo) -> tuple[torch.nn.Module, list[dict], D.DistributedTokenBudgetSampler,
                                                       TrainConfig]:
    """The seeded model, the samples, this rank's sampler (its steps of samples) and the TrainConfig of a job."""
    samples = job_samples(spec)
    model = job_model(spec)
    sampler = D.DistributedTokenBudgetSampler([int(s["input_ids"].numel()) for s in samples],
                                              int(spec.get("max_tokens", 256)), int(spec.get("accum_steps", 4)),
                                              num_replicas=info.world_size, rank=info.rank,
                                              seed=int(spec.get("sampler_seed", 0)), seq_len=spec.get("seq_len"),
                                              dataset=samples)
    # log_every=1: the callbacks count each step's all-reduced bytes as it ends (fit's default reads every 10 steps)
    train = {"progress": False, "amp": "off", "warmup_steps": 1, "max_steps": 4, "lr": 1e-3, "log_every": 1,
             **spec.get("train", {})}
    return model, samples, sampler, TrainConfig(**train)


def counting_allreduce_hook(state: dict, bucket):  # no annotation on bucket: DDP inspects the hook's signature
    """DDP's own gradient averaging (divide by world size, all-reduce SUM), adding the bytes it sends to
    state["bytes"]. (Bytes, not calls: DDP regroups its buckets after the first backward, the bytes stay.)"""
    buf = bucket.buffer().div_(dist.get_world_size())
    state["bytes"] += buf.numel() * buf.element_size()
    return dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True).get_future().then(lambda f: f.value()[0])


def train_job(spec: dict, info: D.DistInfo, out_dir: Path) -> dict:
    """Train one job on this rank; the rank's per-step results (and captured gradients)."""
    model, _, sampler, cfg = build_job(spec, info)
    capture, grads, snapshots, hook, sent = {int(s) for s in spec.get("capture_grads", [])}, {}, [], {"bytes": 0}, []

    def grab(step: int, m: torch.nn.Module) -> None:  # after the step's backward, before the optimizer
        if step in capture:
            grads[step] = {n: p.grad.detach().cpu().clone() for n, p in m.named_parameters() if p.grad is not None}

    def after_step(step: int, row: dict) -> None:
        sent.append(hook["bytes"])
        hook["bytes"] = 0
        done["steps"] = step + 1

    def keep_snapshot() -> None:  # fit keeps one last.pt (and rewrites it at the end): a copy of each periodic one
        if cfg.ckpt_every and done["steps"] % cfg.ckpt_every == 0:
            snapshots.append(shutil.copyfile(Path(cfg.ckpt_dir) / "last.pt", out_dir / f"ckpt_step{done['steps']}.pt").name)

    done, after_step.after_checkpoint = {"steps": 0}, keep_snapshot  # fit calls it on rank 0 once last.pt is written

    df = D.fit_distributed(model, sampler, cfg, info=info, grad_callback=grab, resume_from=spec.get("resume_from"),
                           callbacks=[after_step], comm_hook=(hook, counting_allreduce_hook))
    if df.empty:
        raise ValueError(f"job trained no step: resume_from={spec.get('resume_from')} is at max_steps={cfg.max_steps}?")
    return {"steps": df["step"].tolist(), "losses": df["loss"].tolist(), "tokens": df["tokens"].tolist(),
            "rank_tokens": df["rank_tokens"].tolist(), "rank_micro_batches": df["rank_micro_batches"].tolist(),
            "allreduce_bytes": sent if info.distributed else [], "grads": grads, "snapshots": snapshots}


def measure_comm_compute(model: torch.nn.Module, micro_batches: Sequence[dict], info: D.DistInfo,
                         reps: int = 3) -> dict:
    """Median seconds of one step's forward+backward without communication (no_sync), of the same step with
    DDP's gradient all-reduce, and of a bare all-reduce of the gradient's size. Every rank runs the same load."""
    ddp, dev = D.wrap_ddp(model.to(info.device), info), info.device
    n_tok = sum(trained_tokens(mb["labels"]) for mb in micro_batches) * info.world_size

    def timed(fn) -> float:
        D.barrier()
        synchronize(dev)
        t0 = time.perf_counter()
        fn()
        synchronize(dev)
        return time.perf_counter() - t0

    def step(sync: bool) -> None:  # accumulate_step runs no_sync() on all but the last micro-batch; this the last too
        with contextlib.nullcontext() if sync or ddp is model else ddp.no_sync():
            accumulate_step(ddp, micro_batches, device=dev, n_tokens_total=n_tok)
        model.zero_grad(set_to_none=True)

    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=dev)
    bare = (lambda: dist.all_reduce(flat)) if info.distributed else (lambda: None)
    runs = {"compute_s": lambda: step(False), "step_s": lambda: step(True), "allreduce_s": bare}
    for fn in runs.values():  # warm-up
        timed(fn)
    times = {k: float(np.median([timed(fn) for _ in range(reps)])) for k, fn in runs.items()}
    return {**times, "exposed_comm_s": max(0.0, times["step_s"] - times["compute_s"]), "grad_bytes": flat.numel() * 4,
            "n_params": flat.numel(), "tokens_per_rank": n_tok // info.world_size}


def measure_job(spec: dict, info: D.DistInfo) -> list[dict]:
    """measure_comm_compute for each per-rank token budget of spec["measure"]["max_tokens"] (full rows of seq_len)."""
    m = spec["measure"]
    model, seq_len, rows = job_model(spec), int(m.get("seq_len", 32)), []
    for max_tokens in m["max_tokens"]:
        rows_per_mb = max(1, int(max_tokens) // seq_len)  # full rows, every token trained
        mbs = [pad_collate(synthetic_samples(rows_per_mb, min_len=seq_len, max_len=seq_len, seed=100 + j,
                                             masked_frac=0))
               for j in range(int(m.get("micro_batches", 2)))]
        rows.append({"max_tokens": int(max_tokens), **measure_comm_compute(model, mbs, info, int(m.get("reps", 3)))})
    return rows


def run_job(spec: dict, info: D.DistInfo | None = None) -> dict:
    """Run one job on this rank and write its result to spec["out"]/result_rank{r}.pt; returns the result."""
    info = info or D.setup()
    torch.set_num_threads(int(spec.get("threads", 1)))
    out_dir = Path(spec["out"])
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size, "backend": info.backend or "none"}
    result.update({"measure": measure_job(spec, info)} if "measure" in spec else train_job(spec, info, out_dir))
    torch.save(result, out_dir / f"result_rank{info.rank}.pt")
    return result


def main(argv: list[str] | None = None) -> int:
    """`python notebooks/ddp_demo.py JOB.json`, under torchrun or alone."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="a JSON job spec, or a list of them (they share one process group)")
    path = Path(parser.parse_args(argv).job)
    if not path.is_file():
        print(f"error: job spec not found: {path}", file=sys.stderr)
        return 2
    specs = json.loads(path.read_text())
    info = D.setup()
    try:
        for spec in specs if isinstance(specs, list) else [specs]:
            run_job(spec, info)
            D.barrier()
    finally:
        D.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
