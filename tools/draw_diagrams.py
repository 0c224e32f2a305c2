"""Draw the course's diagrams as SVG into notebooks/figures/: `python tools/draw_diagrams.py [--out DIR]`.

Four pictures a person would rather look at than read: the model's data flow (03), the accumulation timeline (04),
padded vs token-budget vs packed batches with the block-causal mask (06), and DDP's all-reduce (09). Drawn from
code with matplotlib, deterministic (fixed SVG ids, no date), so tests/test_workshop_kit.py can check that the
committed files are what this script draws.
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "notebooks" / "figures"
COLORS = {"data": "#dbe9f6", "norm": "#fde2c8", "attn": "#d5efd5", "mlp": "#e8dcf3", "out": "#f6d5d5",
          "pad": "#d9d9d9", "step": "#fff2b3", "grad": "#cfe3f7"}
DOC_COLORS = ("#8ecae6", "#ffb703", "#90be6d", "#f28482", "#b8a1e3", "#f6bd60")


def box(ax, x: float, y: float, w: float, h: float, text: str, color: str, size: int = 9) -> None:
    """A rounded box centred at (x, y) with a label."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=color, ec="#444444", lw=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=size)


def arrow(ax, start: tuple, end: tuple, text: str = "", color: str = "#333333", style: str = "-|>") -> None:
    """An arrow from start to end, with an optional label beside its middle."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, lw=1.2))
    if text:
        ax.text((start[0] + end[0]) / 2 + 0.12, (start[1] + end[1]) / 2, text, fontsize=7.5, va="center",
                color="#555555")


def model_flow(ax) -> None:
    """03: token ids -> embedding -> 8 x (norm, GQA attention, residual, norm, SwiGLU, residual) -> norm -> logits."""
    ax.set(xlim=(0, 10), ylim=(0, 13.6))
    steps = [(12.9, "token ids", COLORS["data"], "(B, T) integers < 6400"),
             (11.7, "embed_tokens", COLORS["data"], "(B, T, 512)"),
             (10.3, "RMSNorm (input_layernorm)", COLORS["norm"], ""),
             (9.1, "attention: q 8 heads, k/v 2 heads (GQA)\nRoPE on q, k · causal SDPA · o_proj", COLORS["attn"], ""),
             (7.7, "+  (residual)", "white", ""),
             (6.6, "RMSNorm (post_attention_layernorm)", COLORS["norm"], ""),
             (5.4, "SwiGLU: down(silu(gate(x)) * up(x))\n512 -> 1408 -> 512", COLORS["mlp"], ""),
             (4.0, "+  (residual)", "white", ""),
             (2.7, "RMSNorm (model.norm)", COLORS["norm"], "(B, T, 512)"),
             (1.5, "lm_head (tied to embed_tokens)", COLORS["out"], ""),
             (0.4, "logits", COLORS["out"], "(B, T, 6400): next-token scores")]
    for y, label, color, shape in steps:
        box(ax, 4.2, y, 5.4 if "\n" in label else 4.6, 0.85 if "\n" in label else 0.6, label, color, 8.5)
        if shape:
            ax.text(7.2, y, shape, fontsize=8, va="center", color="#555555")
    for (y0, *_), (y1, *_) in zip(steps, steps[1:]):
        arrow(ax, (4.2, y0 - 0.35), (4.2, y1 + 0.35))
    ax.add_patch(Rectangle((1.0, 3.6), 6.4, 7.2, fill=False, ls="--", ec="#777777"))
    ax.text(7.3, 3.8, "decoder layer\nx 8 (model.layers.{i})", fontsize=8.5, color="#555555", va="center")
    for top, bottom in ((10.8, 7.7), (7.3, 4.0)):  # the residual paths skip the norm and the sublayer
        ax.add_patch(FancyArrowPatch((1.6, top), (1.6, bottom), arrowstyle="-|>", mutation_scale=10,
                                     connectionstyle="arc3,rad=0", color="#999999", lw=1))
        ax.plot([1.6, 1.75], [bottom, bottom], color="#999999", lw=1)
    ax.text(0.2, 7.4, "skip\n(x +)", fontsize=7.5, color="#777777")
    ax.set_title("MiniMind2-small: how one batch flows through the model (notebook 03)", fontsize=10)


def accumulation_timeline(ax, k: int = 3, steps: int = 2) -> None:
    """04: k micro-batches (forward, backward: gradients add up), then one optimizer step, per optimizer step."""
    ax.set(xlim=(-0.5, steps * (k + 1.4) + 0.3), ylim=(-1.9, 3.3))
    x = 0.0
    for s in range(steps):
        start = x
        for m in range(k):
            box(ax, x + 0.45, 2.2, 0.85, 0.55, f"fwd {m + 1}", COLORS["data"], 8)
            box(ax, x + 0.45, 1.3, 0.85, 0.55, f"bwd {m + 1}", COLORS["attn"], 8)
            ax.add_patch(Rectangle((x + 0.1, -0.2), 0.7, 0.25 * (m + 1), fc=COLORS["grad"], ec="#444444"))
            ax.text(x + 0.45, -0.55, f"+ n{m + 1} tokens", ha="center", fontsize=7.5)
            x += 1.0
        box(ax, x + 0.55, 1.75, 1.0, 1.4, "optimizer\nstep\n(grad / N,\nclip, AdamW)", COLORS["step"], 7.5)
        ax.text(x + 0.55, -0.55, "zero_grad", ha="center", fontsize=7.5)
        ax.annotate("", xy=(x + 1.1, -1.15), xytext=(start, -1.15), arrowprops=dict(arrowstyle="<->", color="#555"))
        ax.text((start + x + 1.1) / 2, -1.55, f"optimizer step {s + 1}: one effective batch, N = n1 + ... + n{k}",
                ha="center", fontsize=8)
        x += 1.4
    ax.text(-0.4, 0.5, "gradient\nbuffer", fontsize=7.5, color="#555555", ha="right", va="center")
    ax.text(-0.4, 2.9, "time ->", fontsize=8, color="#555555")
    ax.set_title(f"Gradient accumulation: {k} micro-batches per optimizer step; each backward adds the sum of its "
                 "token losses, the step divides by all N tokens (notebook 04)", fontsize=9)


def batch_grid(ax, x0: float, rows: list[list[int]], title: str, width: int) -> None:
    """Rows of tokens as cells: colour = document, grey = padding."""
    for r, row in enumerate(rows):
        col = 0
        for doc, length in enumerate(row):
            color = DOC_COLORS[length[0] % len(DOC_COLORS)] if isinstance(length, tuple) else None
            n = length[1] if isinstance(length, tuple) else length
            for _ in range(n):
                ax.add_patch(Rectangle((x0 + col, -r), 1, -0.9, fc=color or DOC_COLORS[r % len(DOC_COLORS)],
                                       ec="white", lw=0.6))
                col += 1
        for c in range(col, width):
            ax.add_patch(Rectangle((x0 + c, -r), 1, -0.9, fc=COLORS["pad"], ec="white", lw=0.6))
    ax.text(x0 + max(width, 7) / 2, 0.4, title, ha="center", va="bottom", fontsize=8.5)


def batches_and_mask(fig) -> None:
    """06: the same documents as a padded batch, as token-budget batches, and packed, with the block-causal mask."""
    lengths = [12, 3, 7, 5, 11, 4]
    ax, ax_mask = fig.add_axes([0.02, 0.05, 0.66, 0.8]), fig.add_axes([0.71, 0.1, 0.27, 0.66])
    real = sum(lengths)
    ax.set(xlim=(-0.5, 44), ylim=(-8.6, 3.5))
    batch_grid(ax, 0, [[(i, n)] for i, n in enumerate(lengths)], f"padded: 6 rows x 12\n({real} of 72 real)", 12)
    budget = sorted(range(len(lengths)), key=lambda i: lengths[i])
    short, long_ = budget[:4], budget[4:]
    batch_grid(ax, 14, [[(i, lengths[i])] for i in short],
               f"token budget 28: 4 rows x 7\n({sum(lengths[i] for i in short)} of 28 real)", 7)
    for r, i in enumerate(long_):  # the second micro-batch, drawn below the first
        for c in range(12):
            color = DOC_COLORS[i % len(DOC_COLORS)] if c < lengths[i] else COLORS["pad"]
            ax.add_patch(Rectangle((14 + c, -(4.6 + r)), 1, -0.9, fc=color, ec="white", lw=0.6))
    ax.text(20, -7.9, f"then 2 rows x 12 ({sum(lengths[i] for i in long_)} of 24 real):\nrows x longest <= 28",
            ha="center", fontsize=8)
    packed = [[(0, 12), (1, 3), (2, 5)], [(2, 2), (3, 5), (4, 8)], [(4, 3), (5, 4)]]
    assert sum(n for row in packed for _, n in row) == real
    batch_grid(ax, 28, packed, f"packed: 3 rows x 20\n({real} of 60 real)", 20)
    ax.text(38, -3.6, "a document may continue in the next row", ha="center", fontsize=8)
    ax.axis("off")
    row = [0] * 12 + [1] * 3 + [2] * 5  # the first packed row: documents 0, 1, 2
    n = len(row)
    for q in range(n):
        for kk in range(n):
            allowed = kk <= q and row[kk] == row[q]
            ax_mask.add_patch(Rectangle((kk, -q), 1, -1, fc=DOC_COLORS[row[q]] if allowed else "white",
                                        ec="#eeeeee", lw=0.4))
    ax_mask.set(xlim=(0, n), ylim=(-n, 0), xticks=[], yticks=[], xlabel="key position", ylabel="query position")
    ax_mask.set_title("block-causal mask of packed row 1:\na token sees only earlier tokens of its own document",
                      fontsize=8)
    fig.suptitle("Three ways to batch the same 6 documents (notebook 06); colour = document, grey = padding",
                 fontsize=10)


def ddp_allreduce(ax, world: int = 3) -> None:
    """09: each rank computes gradients on its own data; all-reduce sums them; every rank takes the same step."""
    ax.set(xlim=(0, 10), ylim=(0, 7.4))
    xs = [1.8 + i * 3.2 for i in range(world)]
    for i, x in enumerate(xs):
        box(ax, x, 6.6, 2.4, 0.6, f"rank {i}: its shard of the data", COLORS["data"], 8)
        box(ax, x, 5.5, 2.4, 0.6, "same weights: fwd + bwd", COLORS["attn"], 8)
        box(ax, x, 4.4, 2.4, 0.6, f"local grad g{i}, {i + 1}00 tokens", COLORS["grad"], 8)
        box(ax, x, 1.8, 2.4, 0.7, "g = (g0 + g1 + g2) / N\nidentical on every rank", COLORS["grad"], 8)
        box(ax, x, 0.6, 2.4, 0.6, "optimizer step (same result)", COLORS["step"], 8)
        arrow(ax, (x, 6.25), (x, 5.85))
        arrow(ax, (x, 5.15), (x, 4.75))
        arrow(ax, (x, 4.05), (x, 3.45))
        arrow(ax, (x, 2.1 - 0.95), (x, 0.95))
    box(ax, 5.0, 3.0, 9.2, 0.8, "all-reduce (sum): every rank sends and receives pieces of the gradient\n"
        "(NCCL on GPUs, gloo on CPUs), overlapped with the backward pass, bucket by bucket;\n"
        "N = the global token count (100 + 200 + 300), all-reduced the same way", "#ffffff", 8)
    for x in xs:
        arrow(ax, (x, 2.6), (x, 2.2))
    ax.set_title(f"DDP with {world} ranks: one optimizer step (notebook 09)", fontsize=10)


def draw_all(out: Path = OUT) -> list[Path]:
    """Draw every diagram into `out`; return the written SVG paths."""
    plt.rcParams.update({"svg.hashsalt": "minimind-course", "svg.fonttype": "none", "font.family": "DejaVu Sans"})
    out.mkdir(parents=True, exist_ok=True)
    jobs = {"03_model_flow.svg": ((7.5, 9.0), model_flow), "04_accumulation_timeline.svg": ((11, 4.2),
            accumulation_timeline), "09_ddp_allreduce.svg": ((10, 6.2), ddp_allreduce)}
    written = []
    for name, (size, draw) in jobs.items():
        fig, ax = plt.subplots(figsize=size)
        draw(ax)
        ax.axis("off")
        written.append(save(fig, out / name))
    fig = plt.figure(figsize=(12, 4.2))
    batches_and_mask(fig)
    written.append(save(fig, out / "06_batching_and_mask.svg"))
    return written


def save(fig, path: Path) -> Path:
    """Write a figure as reproducible SVG (no date in the metadata) and close it."""
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": "tools/draw_diagrams.py"}, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and draw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    for path in draw_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
