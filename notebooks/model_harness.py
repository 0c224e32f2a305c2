"""Notebook 03's harness: batches of real text for its measurements, and its figures.

Nothing here is model code: the notebook's modules and measurements are passed in, so what is drawn is what the
learner's code computed.
"""

import math

import matplotlib.pyplot as plt
import torch

from minimind_lib.data import PretrainDataset, pad_collate
from minimind_lib.memory import estimate_memory
from minimind_lib.paths import DATA_DIR
from minimind_lib.tokenizer import load_tokenizer


def pretrain_batches(n: int, batch_size: int, seq_len: int, seed: int, max_samples: int = 1000) -> list[dict]:
    """n batches of real rows of data/pretrain.jsonl drawn with `seed`, padded to seq_len (labels -100 on pads)."""
    data = PretrainDataset(DATA_DIR / "pretrain.jsonl", load_tokenizer(), seq_len=seq_len, max_samples=max_samples)
    g = torch.Generator().manual_seed(seed)
    return [pad_collate([data[int(i)] for i in torch.randint(0, len(data), (batch_size,), generator=g)],
                        seq_len=seq_len, fixed=True) for _ in range(n)]


def rope_plot(cos: torch.Tensor, head_dim: int, theta: float, seq_len: int, max_positions: int, title: str) -> None:
    """Left: each pair's wavelength in tokens; right: the cos table of the first half of the columns."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].semilogy(2 * math.pi / freqs, "o-", ms=3)
    axes[0].axhline(seq_len, color="C1", ls="--", label=f"profile seq_len {seq_len}")
    axes[0].axhline(max_positions, color="C2", ls=":", label=f"max positions {max_positions}")
    axes[0].set(xlabel=f"pair index i (dims i and i+{head_dim // 2})", ylabel="wavelength in tokens",
                title=f"RoPE wavelengths, θ = {theta:g}")
    axes[0].legend()
    im = axes[1].imshow(cos[:, : head_dim // 2].T, aspect="auto", cmap="RdBu", interpolation="nearest")
    axes[1].set(xlabel="position t", ylabel="pair index i", title="cos(t · θ^(-2i/d)): fast pairs on top, slow below")
    fig.colorbar(im, ax=axes[1])
    fig.suptitle(f"RoPE frequencies of MiniMind2-small — {title}", fontsize=9)
    plt.tight_layout()
    plt.show()


def init_plot(stream: dict, curves: dict, inits: tuple, seeds: tuple, ln_v: float, setting: str, title: str) -> None:
    """Left: the residual stream's RMS through the layers at step 0; middle: the first steps' training loss of
    every initialisation and seed; right: the two that start at 0.02, closer."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {inits[0]: dict(color="C3"), inits[1]: dict(color="C0"), inits[2]: dict(color="C2", ls="--")}
    n_steps = len(curves[inits[0], seeds[0]])
    steps = range(1, n_steps + 1)
    for init in inits:
        axes[0].plot(stream[init], marker="o", ms=4, label=init, **styles[init])
        mean = [sum(curves[init, s][i] for s in seeds) / len(seeds) for i in range(n_steps)]
        for ax in axes[1:] if init != inits[0] else axes[1:2]:
            for s in seeds:
                ax.plot(steps, curves[init, s], lw=0.7, alpha=0.4, **styles[init])
            ax.plot(steps, mean, lw=2, label=f"{init}: mean of {len(seeds)} seeds (thin: each)", **styles[init])
    axes[1].axhline(ln_v, color="k", ls=":", lw=1, label="ln(6400)")
    axes[0].set(yscale="log", xlabel="0: after the embedding; i: after layer i", ylabel="RMS of the residual stream",
                title="MiniMind2-small at step 0, seed 0")
    axes[1].set(yscale="log", xlabel="optimizer step", ylabel="training loss", title=setting)
    axes[2].set(xlabel="optimizer step", ylabel="training loss", title="the two 0.02 initialisations, closer")
    fig.suptitle(f"Three initialisations of your CausalLM — {title}", fontsize=10)
    for ax in axes:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    plt.tight_layout()
    plt.show()


def peak_bars(plan: dict, parts: tuple, measured: float, setting: str, title: str) -> None:
    """One bar of the parts alive at the estimated peak, one of the measured peak (MiB)."""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    left = 0.0
    for part, color in zip(parts, plt.cm.tab10.colors):
        if plan.get(part):
            ax.barh(["estimate"], [plan[part] / 2**20], left=left, color=color, label=part)
            left += plan[part] / 2**20
    ax.barh(["measured"], [measured / 2**20], color="gray", label="measured peak (step 2)")
    ax.set(xlabel="MiB", title=f"{setting}: what is alive at the peak\n{title}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    plt.tight_layout()
    plt.show()


def batch_plot(config, fake: dict, real_peak: int, device_type: str, title: str) -> None:
    """The estimated peak of an fp32 AdamW step against the batch, with the fake-tensor counts and the real one."""
    batches = list(range(1, 129))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(batches, [estimate_memory(config, b, 512)["peak_bytes"] / 1e9 for b in batches], label="analytic estimate")
    ax.plot(list(fake), [v / 1e9 for v in fake.values()], "o", label="fake-tensor measurement")
    ax.plot([1], [real_peak / 1e9], "r*", ms=12, label=f"real measurement ({device_type})")
    ax.axhline(24, color="k", ls="--", label="24 GB")
    ax.set(xlabel="batch size (rows of 512 tokens)", ylabel="peak GB of one fp32 AdamW step",
           title=f"MiniMind2-small training step memory vs batch\n{title}")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
