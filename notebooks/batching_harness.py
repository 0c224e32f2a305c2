"""The harness of notebook 06_dynamic_batching: its figures, the timed round-robin of the batching strategies, the
peak-memory loop, the stand-in for a loop and its meter, the runs of the controller under a changing budget, and the
short training runs of the shorter-first experiment. Nothing here is what the chapter teaches: every mechanism
(fill_batches, packing, the mask, the controller) is written in the chapter's cells and passed in."""

import copy
import time
from collections import Counter
from typing import Callable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

import verdict  # the paired ratios of timings (beside this module)
from minimind_lib import batching
from minimind_lib.data import pad_collate, trained_tokens
from minimind_lib.device import synchronize
from minimind_lib.memory import MemoryMeter
from minimind_lib.train import TrainConfig, accumulate_step, build_optimizer, evaluate, lr_at, resolve_amp

STRATEGIES = ["fixed", "longest", "token_budget", "packed", "packed_nomask"]


def length_histograms(datasets: dict, seq_len: int, title: str) -> None:
    """Histograms of the raw sample lengths of each dataset, seq_len marked."""
    fig, axes = plt.subplots(1, len(datasets), figsize=(11, 3.2))
    for ax, (name, ds) in zip(axes, datasets.items()):
        ax.hist(ds.raw_lengths(), bins=60, range=(0, 3 * seq_len), color="tab:blue")
        ax.axvline(seq_len, color="k", ls="--", label=f"seq_len={seq_len} (longer: truncated)")
        ax.set(xlabel="tokens per sample", ylabel="samples", title=f"{name} lengths")
        ax.legend()
    fig.suptitle(f"Sample lengths of data/ — {title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def mask_figure(row: dict, mask: torch.Tensor, seq_len: int, title: str) -> None:
    """A packed row's block-causal mask (left) and its position and document ids (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    axes[0].imshow(mask, cmap="Greys", interpolation="nearest")
    axes[0].set(title="block-causal mask of packed row 0\n(black: may attend)", xlabel="key position",
                ylabel="query position")
    axes[1].plot(row["position_ids"], label="position_ids")
    axes[1].plot(row["doc_ids"], label="doc_ids")
    axes[1].set(xlabel="position in row", ylabel="id", title="positions restart per document")
    axes[1].legend()
    fig.suptitle(f"Packing data/pretrain.jsonl into rows of {seq_len} — {title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def strategy_batches(ds, profile, pack: Callable, n_batches: int, seed: int = 0, whole: bool = False) -> dict:
    """n_batches micro-batches of each strategy, at most profile.max_tokens positions each, from the same shuffled
    samples; `pack` is the chapter's (whole: conversations never cut)."""
    bs, T = profile.batch_size, profile.seq_len
    perm = np.random.default_rng(seed).permutation(len(ds))
    chunks = [perm[i:i + bs] for i in range(0, len(ds), bs)][:n_batches]
    sampler = batching.TokenBudgetBatchSampler(ds.lengths, profile.max_tokens, seed=seed, seq_len=T)
    docs, need = [], 2 * n_batches * profile.max_tokens  # documents to fill n_batches packed micro-batches, with room
    for i in perm.tolist():
        docs.append(ds[i])
        need -= len(docs[-1]["input_ids"])
        if need <= 0:
            break
    rows, _ = pack(docs, T, whole=whole)
    row_list = [{k: v[r] for k, v in rows.items()} for r in range(len(rows["input_ids"]))]
    packed = [row_list[i:i + bs] for i in range(0, len(row_list), bs)][:n_batches]
    assert len(packed) == n_batches and all(len(p) == bs for p in packed)
    return {"fixed": [pad_collate([ds[int(i)] for i in c], seq_len=T, fixed=True) for c in chunks],
            "longest": [pad_collate([ds[int(i)] for i in c]) for c in chunks],
            "token_budget": [pad_collate([ds[i] for i in b]) for b in sampler.batches()[:n_batches]],
            "packed": [batching.collate_packed(p) for p in packed],
            "packed_nomask": [batching.collate_packed(p, block_mask=False) for p in packed]}


def train_round_robin(model, batches: dict, device, lr: float, reps: int, warmup: int = 1) -> dict:
    """One optimizer step per micro-batch for every strategy, the strategies in turns, from the same initial weights;
    each micro-batch's forward+backward timed `reps` times (the last repeat's gradients are the step's). Per strategy:
    losses, exact counts of trained tokens and positions, and useful tokens/s of each repeat (first `warmup`
    micro-batches not timed: one-off allocation costs)."""
    amp = resolve_amp("auto", device, model.config.hidden_size)
    runs = {}
    for name in batches:
        m = copy.deepcopy(model).to(device).train()
        runs[name] = {"model": m, "opt": build_optimizer(m, TrainConfig(lr=lr), device),
                      "seconds": [], "loss": [], "trained": [], "positions": []}
    for k in range(min(map(len, batches.values()))):
        for name, r in runs.items():
            batch, times = batches[name][k], []
            for _ in range(reps):
                r["opt"].zero_grad(set_to_none=True)
                synchronize(device)
                t0 = time.perf_counter()
                stats = accumulate_step(r["model"], [batch], amp_dtype=amp.dtype, device=device)
                synchronize(device)
                times.append(time.perf_counter() - t0)
            r["opt"].step()
            r["seconds"].append(times)
            r["loss"].append(stats["loss"])
            r["trained"].append(trained_tokens(batch["labels"]))
            r["positions"].append(batch["input_ids"].numel())
    out = {}
    for name, r in runs.items():
        s = slice(warmup, None)
        useful, positions = sum(r["trained"][s]), sum(r["positions"][s])
        out[name] = {"loss": r["loss"], "trained": r["trained"], "useful": useful, "positions": positions,
                     "useful_fraction": useful / positions,
                     "useful_tokens_per_s": useful / np.array(r["seconds"][s]).sum(axis=0)}
    return out


def speed_table(timing: dict) -> pd.DataFrame:
    """Per data set and strategy: counted positions and useful tokens, the linear cost model's speed-up over fixed
    ((1 - w_other) / (1 - w_fixed)) and the measured speed-up: verdict.ratios of the repeats, paired with fixed's."""
    rows = []
    for data, t in timing.items():
        f = t["fixed"]
        for strat, r in t.items():
            speedup = verdict.ratios(list(r["useful_tokens_per_s"]), list(f["useful_tokens_per_s"]))  # paired repeats
            rows.append({"data": data, "strategy": strat, "positions": r["positions"], "useful_tokens": r["useful"],
                         "wasted_fraction": 1 - r["useful_fraction"],
                         "linear_model": r["useful_fraction"] / f["useful_fraction"],
                         "measured_median": speedup["median"], "measured_min": speedup["min"],
                         "measured_max": speedup["max"]})
    return pd.DataFrame(rows)


def speed_figure(epoch_padding: dict, table: pd.DataFrame, reps: int, title: str) -> None:
    """Padding fraction of a whole epoch (left) and useful tokens/s over fixed with the linear model (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    x, w = np.arange(len(STRATEGIES)), 0.38
    for j, data in enumerate(["pretrain", "sft"]):
        t = table[table.data == data].set_index("strategy").loc[STRATEGIES]
        axes[0].bar(x + (j - 0.5) * w, [epoch_padding[data][s] for s in STRATEGIES], w, label=data)
        axes[1].bar(x + (j - 0.5) * w, t["measured_median"], w, label=f"{data}: measured (median, min-max of {reps})",
                    yerr=[t["measured_median"] - t["measured_min"], t["measured_max"] - t["measured_median"]],
                    capsize=3, error_kw={"ecolor": "dimgray", "lw": 1})
        axes[1].scatter(x + (j - 0.5) * w, t["linear_model"], color="red", marker="_", s=300, lw=2.5, zorder=3,
                        label="linear cost model (1-w_other)/(1-w_fixed)" if j else None)
    axes[0].set_ylabel("padding fraction (whole epoch)")
    axes[1].set_ylabel("useful tokens/s ÷ fixed")
    axes[1].axhline(1, color="k", lw=0.8)
    for ax in axes:
        ax.set_xticks(x, STRATEGIES, rotation=15)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below: the bars stay visible
    fig.suptitle(f"Padding and useful-token throughput, same model and memory per micro-batch — {title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def loss_figure(t: dict, title: str) -> None:
    """Training loss of each strategy per trained token (left) and per optimizer step (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
    style = {"fixed": dict(lw=4, alpha=0.5), "longest": dict(ls="--")}  # the same samples: their curves coincide
    for strat in STRATEGIES:
        axes[0].plot(np.cumsum(t[strat]["trained"]), t[strat]["loss"], marker=".", label=strat, **style.get(strat, {}))
        axes[1].plot(np.arange(len(t[strat]["loss"])), t[strat]["loss"], marker=".", label=strat,
                     **style.get(strat, {}))
    axes[0].set(xlabel="trained tokens seen", ylabel="training loss (mean per trained token)")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"pretrain: training loss by batching strategy, per token and per step — {title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def peak_per_step(model, batches: list, device) -> np.ndarray:
    """Peak bytes of forward+backward of each batch, one step each, from a copy of `model`."""
    m = copy.deepcopy(model).to(device).train()
    meter, peaks = MemoryMeter(device), []
    for batch in batches:
        with meter.track(m):
            meter.reset_peak()
            accumulate_step(m, [batch], device=device)
        m.zero_grad(set_to_none=True)
        peaks.append(meter.peak())
    return np.array(peaks)


def memory_figure(padded: dict, peaks: dict, names: dict, max_tokens: int, top: int, title: str) -> None:
    """Padded tokens of every batch of an epoch (left, dotted: max_tokens) and the measured peaks (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    axes[0].hist([padded["fixed"], padded["budget"]], bins=np.linspace(0, top, 41),
                 label=[names["fixed"], names["budget"]])
    axes[0].axvline(max_tokens, color="k", ls=":", lw=1)
    axes[0].set(xlabel="padded tokens per batch (one epoch)", ylabel="batches")
    for key, marker in (("fixed", "o"), ("budget", "s")):
        axes[1].plot(peaks[key] / 2**20, marker=marker, label=names[key])
    n = len(peaks["fixed"])
    axes[1].set(xlabel="step", ylabel="peak MiB (forward+backward)", xticks=range(n),
                ylim=(0, 1.15 * max(p.max() for p in peaks.values()) / 2**20))
    for ax in axes:  # legends below the axes: they cover no bar and no line
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1)
    fig.suptitle(f"sft: padded tokens per batch (left, dotted: max_tokens) and peak memory per step (right) — {title}",
                 fontsize=9)
    plt.tight_layout()
    plt.show()


class Indexed:
    """The dataset with each sample's index as "sid": proves later that no sample is lost or repeated."""

    def __init__(self, ds):
        self.ds, self.lengths = ds, ds.lengths

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return {**self.ds[i], "sid": int(i)}


def collate_ids(b: list) -> dict:
    """pad_collate, keeping the samples' ids."""
    return {**pad_collate(b), "sid": [s["sid"] for s in b]}


class StandIn:
    """accumulate_fn + meter for the controller's check: "out of memory" when 100 bytes per padded token of a
    micro-batch pass the step's budget; records the sample ids of the micro-batches that ran."""

    def __init__(self, budgets: list[int]):
        self.budgets, self.step, self.value, self.trained = budgets, 0, 0, []

    @property
    def budget_bytes(self):
        return self.budgets[self.step]

    def begin(self, step):  # train.fit resets the meter's peak at the start of every step
        self.step, self.value = step, 0

    def __call__(self, micro):
        need = 100 * max(mb["input_ids"].numel() for mb in micro)
        self.value = max(self.value, need)
        if need > self.budget_bytes:
            raise torch.OutOfMemoryError(f"stand-in: {need} bytes > budget {self.budget_bytes}")
        self.trained.append([mb["sid"] for mb in micro])
        return {"loss_sum": 0.0, "n_tokens": 1}

    def peak(self):
        return self.value

    def reset_peak(self):
        self.value = 0

    def zero_grad(self, set_to_none=True):
        pass


def run_controller(fit: Callable, model, make_controller: Callable, budgets: list, n_steps: int, steps, cfg,
                   max_tokens: int, seq_len: int, device) -> tuple:
    """`fit` over token-budget `steps` through a controller; the budget of step s is budgets[s] (set by a callback
    before each next step). Returns the metrics frame, the controller and the sample ids of successful attempts."""
    meter, trained = MemoryMeter(device, budget_bytes=budgets[0]), []
    ctl = make_controller(max_tokens=max_tokens, meter=meter, seq_len=seq_len, check_every=1, collate_fn=collate_ids)
    run_step = ctl.run_step

    def recorded(step, accumulate_fn, zero_grad=None):
        def accumulate(micro, **kw):
            out = accumulate_fn(micro, **kw)  # raises on OOM: then nothing is recorded
            trained.extend(i for mb in micro for i in mb["sid"])
            return out
        return run_step(step, accumulate, zero_grad=zero_grad)

    ctl.run_step = recorded
    set_budget = lambda step, row: meter.set_budget(budgets[min(step + 1, n_steps - 1)])  # noqa: E731
    try:
        frame = fit(copy.deepcopy(model), steps, cfg(max_steps=n_steps), device=device, controller=ctl,
                    callbacks=[set_budget])
    finally:
        meter.set_budget(None)  # on CUDA the cap is process-wide: lift it
    return frame, ctl, trained


def one_row_peak(fit: Callable, model, data, length: int, cfg, max_tokens: int, seq_len: int, device) -> int:
    """Peak of a step of two micro-batches of one full-length row cut to `length` (step 1: AdamW's state exists)."""
    row = next(s for s in (data[i] for i in range(len(data))) if len(s["input_ids"]) == seq_len)
    row = {**row, "input_ids": row["input_ids"][:length], "labels": row["labels"][:length]}
    frame, _, _ = run_controller(fit, model, batching.AdaptiveBatchController, [None, None], 2, [[[row], [row]]] * 2,
                                 cfg, max_tokens, seq_len, device)
    return frame["peak_memory_bytes"].iloc[1]


def timeline_figure(frame: pd.DataFrame, plain: pd.DataFrame, events: list, seq_of_step: list, budgets: list,
                    start_tokens: int, start_accum: int, seq_len: int, title: str) -> None:
    """The controller's sizes, micro-batches per step and peaks against the budget, its events marked."""
    fig, axes = plt.subplots(4, 1, figsize=(11, 9.5), sharex=True, gridspec_kw={"height_ratios": [0.25, 1.5, 1, 1]})
    labels_ax, axes = axes[0], axes[1:]
    x, n = frame["step"].to_numpy(), len(frame)
    axes[0].step(x, frame["max_tokens"], where="post", marker="o", label="max_tokens per micro-batch")
    axes[0].step(x, [seq_len if s is None else s for s in seq_of_step], where="post", marker="s",
                 label="seq_len (longest row)")
    axes[0].axhline(start_tokens, color="gray", ls=":", label=f"start: max_tokens = {start_tokens}")
    axes[0].set(ylabel="tokens", ylim=(0, 1.1 * start_tokens))
    axes[1].step(x, frame["accum_steps"], where="post", marker="o", color="tab:green", label="micro-batches")
    axes[1].axhline(start_accum, color="gray", ls=":", label=f"start: accum_steps = {start_accum}")
    axes[1].set_ylabel("micro-batches\nper optimizer step")
    axes[2].step(x, np.array(budgets) / 2**20, where="post", color="r", ls="--", label="budget")
    axes[2].step(x, 0.8 * np.array(budgets) / 2**20, where="post", color="orange", ls=":", label="high water (80%)")
    axes[2].plot(x, frame["peak_memory_bytes"] / 2**20, marker="o", label="peak of the step, with the controller")
    axes[2].plot(x, plain["peak_memory_bytes"] / 2**20, marker="x", ls="", color="gray", label="peak without a budget")
    axes[2].set(ylabel="MiB", xlabel="optimizer step (events: at the first step they change)")
    colors = {"shrink": "tab:purple", "oom_halve": "red", "oom_seq_cut": "darkred", "grow_seq_len": "tab:cyan",
              "grow": "tab:green"}
    for ax in axes:
        for e in events:
            ax.axvline(e.step, color=colors[e.kind], alpha=0.3, lw=3)
        ax.legend(fontsize=7, loc="upper right")
    labels_ax.set_ylim(0, 1)
    labels_ax.axis("off")
    for step, kinds in pd.DataFrame([e.__dict__ for e in events]).groupby("step")["kind"]:
        label = "\n".join(f"{c}x {k}" if c > 1 else k for k, c in Counter(kinds).items())
        labels_ax.text(step, 0.05, label, fontsize=7, ha="center", va="bottom", color=colors[kinds.iloc[0]])
    axes[0].set_xticks(range(n + 1))
    axes[0].set_xlim(-0.5, n + 0.5)
    fig.suptitle(f"AdaptiveBatchController under a memory budget that changes — {title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def train_in_order(model, ds, batches_of_indices: list, val_batches: list, lr: float, device) -> float:
    """One optimizer step per batch (warmup then cosine, clip 1.0) from a copy of `model`: the validation loss."""
    torch.manual_seed(0)
    m = copy.deepcopy(model).to(device).train()
    opt = build_optimizer(m, TrainConfig(lr=lr), device)
    n_steps = len(batches_of_indices)
    for step, idx in enumerate(batches_of_indices):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=lr, min_lr=lr / 10, warmup_steps=max(1, n_steps // 10), max_steps=n_steps)
        accumulate_step(m, [pad_collate([ds[i] for i in idx])], device=device)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return evaluate(m, val_batches, device=device)["loss"]


def random_batch_padding(datasets: dict, batch_size: int, seq_len: int) -> dict:
    """Per dataset: the padding fraction of one epoch in random batches, padded to seq_len ("fixed") and to each
    batch's longest row ("longest"), printed with the lengths' mean and median."""
    from minimind_lib.data import padding_fraction
    out = {}
    for name, ds in datasets.items():
        lengths = ds.lengths  # after truncation to seq_len
        perm = np.random.default_rng(0).permutation(len(lengths))
        batches = [lengths[perm[i:i + batch_size]] for i in range(0, len(lengths), batch_size)]
        out[name] = {"fixed": padding_fraction(batches, seq_len=seq_len), "longest": padding_fraction(batches)}
        print(f"{name}: mean {lengths.mean():.0f} tokens, median {np.median(lengths):.0f}; padding of one epoch in "
              f"random batches of {batch_size}: fixed {out[name]['fixed']:.1%}, to the longest row "
              f"{out[name]['longest']:.1%}")
    return out


def whole_epoch_padding(epoch_padding: dict, pre_sampler, sft, packed_pre, profile):
    """Adds the token budget's and packing's padding of a whole epoch to `epoch_padding` (sft packed whole); returns
    the PackStats of the sft packing."""
    epoch_padding["pretrain"]["token_budget"] = pre_sampler.stats["padding_fraction"]
    epoch_padding["sft"]["token_budget"] = batching.TokenBudgetBatchSampler(
        sft.lengths, profile.max_tokens, seq_len=profile.seq_len).stats["padding_fraction"]
    epoch_padding["pretrain"]["packed"] = packed_pre.stats.padding_fraction  # stream-packed
    sft_stats = batching.pack_sequences([sft[i] for i in range(len(sft))], profile.seq_len, whole=True)[1]
    epoch_padding["sft"]["packed"] = sft_stats.padding_fraction  # conversations whole: the ends of rows stay empty
    for data in epoch_padding:
        epoch_padding[data]["packed_nomask"] = epoch_padding[data]["packed"]  # the same rows, without the mask
    return sft_stats


def speed_summary(epoch_padding: dict, table: pd.DataFrame) -> None:
    """One line per data set: the epoch's padding and the measured speed-ups with the linear model's."""
    for data in ["pretrain", "sft"]:
        p, t = epoch_padding[data], table[table.data == data].set_index("strategy")
        said = [f"{s.replace('_', ' ')} {t.loc[s, 'measured_median']:.2f}x (min {t.loc[s, 'measured_min']:.2f}x, max "
                f"{t.loc[s, 'measured_max']:.2f}x; linear model {t.loc[s, 'linear_model']:.2f}x)"
                for s in ("token_budget", "packed")]
        print(f"{data}: padding over the epoch: fixed {p['fixed']:.1%}, longest {p['longest']:.1%}, token budget "
              f"{p['token_budget']:.1%}, packed {p['packed']:.2%}. On this run, useful tokens/s vs fixed: "
              + "; ".join(said))


def sft_epoch_batches(sft, max_tokens: int, seq_len: int) -> tuple[int, dict, dict]:
    """The fixed batch size that holds max_tokens real tokens on average, and one epoch of sft batches (indices) and
    their padded tokens (exact), random batches of that size beside token-budget batches (seed 1)."""
    bs_eq = max(1, int(round(max_tokens / sft.lengths.mean())))
    perm = np.random.default_rng(1).permutation(len(sft))
    idx = {"fixed": [perm[k:k + bs_eq] for k in range(0, len(sft) - bs_eq + 1, bs_eq)]}
    sampler = batching.TokenBudgetBatchSampler(sft.lengths, max_tokens, seed=1, seq_len=seq_len)
    idx["budget"] = sampler.batches()
    padded = {"fixed": np.array([bs_eq * int(sft.lengths[b].max()) for b in idx["fixed"]]),  # lengths already cut
              "budget": np.array([len(b) * int(sampler.lengths[b].max()) for b in idx["budget"]])}
    return bs_eq, idx, padded


def plain_run(fit: Callable, model, data, frame: pd.DataFrame, cfg, n_steps: int, max_tokens: int, seq_len: int,
              accum_steps: int, device) -> tuple[pd.DataFrame, list]:
    """notebook 04's loop over a DataLoader of the same token-budget micro-batches without a budget, each step's rows
    cut where the controller's run (`frame`) cut them; returns its metrics and the seq_len of each step."""
    seq_of_step = [None if pd.isna(s) else int(s) for s in frame["seq_len"]]
    served = iter(range(10**9))

    def collate_cut(b):
        return pad_collate(b, seq_len=seq_of_step[next(served) // accum_steps])

    sampler = batching.TokenBudgetBatchSampler(data.lengths, max_tokens, seed=0, seq_len=seq_len)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collate_cut)
    plain = fit(copy.deepcopy(model), loader, cfg(max_steps=n_steps, accum_steps=accum_steps), device=device,
                meter=MemoryMeter(device))
    return plain, seq_of_step
