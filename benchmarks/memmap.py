"""Benchmark: tokenize once into a memmap vs tokenize inside __getitem__ (MiniMind's way).

`python -m benchmarks memmap --json [--data data/pretrain.jsonl] [--max-samples N]`

Each side runs in its own fresh (spawned) process so that their peak RSS do not pollute each other:
- memmap: `tokenize_to_memmap` (worker processes) once, then one pass over a memmap-backed PretrainDataset
  and N random reads;
- getitem: a lazy PretrainDataset (texts in memory, tokenized on every access): one pass and N random reads.
Throughputs are tokens served (after truncation to seq_len) per second, compared only as ratios of one run.
Also the cost of `file_fingerprint`, the whole-content SHA-1 that the cache and `--resume` take of a data file, on a
file of --hash-bytes (default 1 GB; written here, so it is read from the page cache): median and spread of 3 repeats.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import tempfile
import time

import numpy as np
import torch

from minimind_lib.corpus import tokenize_to_memmap
from minimind_lib.data import PretrainDataset
from minimind_lib.device import get_device
from minimind_lib.fileio import file_fingerprint
from minimind_lib.paths import DATA_DIR
from minimind_lib.cli import NON_NEGATIVE, POSITIVE, number
from minimind_lib.profiles import PROFILES, get_profile
from minimind_lib.tokenizer import load_tokenizer


def _status_kb(field: str) -> int | None:
    """A field of /proc/self/status in kB (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM; ru_maxrss where /proc is missing) in MiB."""
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS; close enough to flag
    return kb / 1024


def _anon_mb() -> float:
    """Anonymous (non file-backed) resident memory in MiB: what memmapped pages do not count towards."""
    kb = _status_kb("RssAnon")
    return (kb if kb is not None else 0) / 1024


def _read(ds, order) -> tuple[int, float, float]:
    """Tokens served, seconds and the largest anonymous RSS seen while reading ds in `order`."""
    tokens, anon_max, t0 = 0, _anon_mb(), time.perf_counter()
    for k, i in enumerate(order):
        tokens += len(ds[int(i)]["input_ids"])
        if k % 256 == 0:
            anon_max = max(anon_max, _anon_mb())
    return tokens, time.perf_counter() - t0, max(anon_max, _anon_mb())


def _child(side: str, args: dict, queue) -> None:
    """Run one side of the benchmark in a fresh process and put its figures on `queue`."""
    try:
        torch.set_num_threads(1)
        tok = load_tokenizer(args["tokenizer"])
        base_anon = _anon_mb()
        out: dict = {}
        t0 = time.perf_counter()
        if side == "memmap":
            info = tokenize_to_memmap(args["data"], tok, os.path.join(args["tmp"], "bench"), num_workers=args["num_workers"],
                                      max_samples=args["max_samples"], force=True, progress=False)
            out["build_s"] = time.perf_counter() - t0
            out["raw_tokens"] = info.n_tokens
            out["num_workers"] = info.num_workers
            ds = PretrainDataset(info.prefix, tok, args["seq_len"])
        else:
            ds = PretrainDataset(args["data"], tok, args["seq_len"], lazy=True, max_samples=args["max_samples"])
            out["build_s"] = time.perf_counter() - t0  # reading the texts into memory
        out["n_samples"] = len(ds)
        if not len(ds):
            raise ValueError(f"{args['data']}: no samples to read")
        tokens, read_s, anon_read = _read(ds, range(len(ds)))
        rng = np.random.default_rng(0)
        r_tokens, r_s, anon_rand = _read(ds, rng.integers(0, len(ds), args["random_reads"]))
        out.update(tokens=tokens, read_s=read_s, random_tokens=r_tokens, random_s=r_s,
                   peak_rss_mb=_peak_rss_mb(), anon_growth_mb=max(anon_read, anon_rand) - base_anon,
                   children_peak_rss_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
        queue.put((side, out))
    except BaseException as e:  # report, don't hang the parent
        queue.put((side, {"error": f"{type(e).__name__}: {e}"}))


def _hash_cost(n_bytes: int, tmp: str, repeats: int = 3) -> dict:
    """Seconds file_fingerprint takes on an n_bytes file of random bytes: median and spread of `repeats`."""
    path, block = os.path.join(tmp, "hash.bin"), np.random.default_rng(0).bytes(1 << 22)
    with open(path, "wb") as f:
        for start in range(0, n_bytes, len(block)):
            f.write(block[: n_bytes - start])
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        file_fingerprint(path)
        seconds.append(time.perf_counter() - t0)
    os.remove(path)
    return {"fingerprint_bytes": n_bytes, "fingerprint_s_median": float(np.median(seconds)),
            "fingerprint_s_spread": max(seconds) - min(seconds)}


def _run_side(side: str, args: dict) -> dict:
    """One side in a fresh spawned interpreter: its peak RSS cannot include the other side's."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: peak RSS of one side cannot include the other's
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(side, args, queue))
    proc.start()
    _, out = queue.get()
    proc.join()
    if "error" in out:
        raise RuntimeError(f"memmap benchmark, {side} side failed: {out['error']}")
    return out


def main(argv: list[str]) -> dict:
    """Measure both sides and return one JSON-ready dict."""
    p = argparse.ArgumentParser(prog="python -m benchmarks memmap", description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(DATA_DIR / "pretrain.jsonl"), help="a pretrain jsonl file")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the bundled one)")
    p.add_argument("--profile", default=None, choices=sorted(PROFILES), help="default: MINIMIND_PROFILE / auto")
    p.add_argument("--max-samples", type=POSITIVE, default=None, help="cap on samples (default: the profile's)")
    p.add_argument("--seq-len", type=number(int, 2), default=None, help="default: the profile's seq_len")
    p.add_argument("--num-workers", type=NON_NEGATIVE, default=None, help="tokenize_to_memmap workers (default: the library's rule)")
    p.add_argument("--random-reads", type=POSITIVE, default=1000)
    p.add_argument("--hash-bytes", type=POSITIVE, default=10**9, help="size of the file file_fingerprint hashes (1 GB)")
    a = p.parse_args(argv)
    profile = get_profile(a.profile)
    if not os.path.isfile(a.data):  # before the temporary folder and the worker processes
        raise FileNotFoundError(f"benchmark data not found: {a.data} (pass --data)")
    with tempfile.TemporaryDirectory(prefix="minimind-bench-memmap-") as tmp:
        args = {"data": a.data, "tokenizer": a.tokenizer, "tmp": tmp, "num_workers": a.num_workers,
                "max_samples": a.max_samples if a.max_samples is not None else profile.max_samples,
                "seq_len": profile.seq_len if a.seq_len is None else a.seq_len, "random_reads": a.random_reads}
        mm = _run_side("memmap", args)
        gi = _run_side("getitem", args)
        hashing = _hash_cost(a.hash_bytes, tmp)
    tps = lambda n, s: n / s if s > 0 else float("nan")  # noqa: E731
    mm_read, gi_read = tps(mm["tokens"], mm["read_s"]), tps(gi["tokens"], gi["read_s"])
    return {
        "data": args["data"], "n_samples": mm["n_samples"], "raw_tokens": mm["raw_tokens"], "tokens": mm["tokens"],
        "seq_len": args["seq_len"], "max_samples": args["max_samples"], "num_workers": mm["num_workers"],
        "tokens_per_s_memmap_build": tps(mm["raw_tokens"], mm["build_s"]),
        "tokens_per_s_memmap": mm_read,
        "tokens_per_s_getitem": gi_read,
        "ratio": mm_read / gi_read,  # per epoch, once the memmap exists
        "ratio_first_epoch": tps(mm["tokens"], mm["build_s"] + mm["read_s"]) / gi_read,  # build included
        "tokens_per_s_memmap_random": tps(mm["random_tokens"], mm["random_s"]),
        "tokens_per_s_getitem_random": tps(gi["random_tokens"], gi["random_s"]),
        "random_reads": args["random_reads"],
        "peak_rss_mb_memmap": mm["peak_rss_mb"], "peak_rss_mb_getitem": gi["peak_rss_mb"],
        "peak_rss_mb_memmap_workers": mm["children_peak_rss_mb"],
        "anon_growth_mb_memmap": mm["anon_growth_mb"], "anon_growth_mb_getitem": gi["anon_growth_mb"],
        **hashing, "device": get_device().type, "profile": profile.name,
    }
