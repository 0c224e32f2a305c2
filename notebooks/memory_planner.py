"""Notebook 03's memory planner harness: measuring a training step's peak in a fresh process, a cost model of how
long that takes, and the planner's widget.

The plan itself (what is alive at the peak: weights, gradients, AdamW states, activations, logits) is the
notebook's `plan_memory`, passed in; this module only measures it, times it and draws it.

How the peak is measured: two optimizer steps in a fresh Python process, with as many threads as the notebook's
PyTorch uses. On CUDA the peak is the allocator's (`torch.cuda.max_memory_allocated`). On a CPU, which has no
allocator counter, it is the process's peak resident memory over its baseline: Linux keeps that peak in
/proc/self/status (`VmHWM`), and writing `5` to /proc/self/clear_refs resets it to the current size just before the
model is built; `MALLOC_MMAP_THRESHOLD_=65536` hands large blocks back to the system when freed, so the resident size
follows the live tensors instead of the C allocator's cache.

How long a measurement takes, predicted (the cost model): two optimizer steps' FLOPs (`forward_flops_per_token`: 2
per multiply-add of every weight matrix a token passes through, plus attention over half a row on average; a
training step about three forwards, four with checkpointing) over this device's rate on a matmul of
MiniMind2-small's FFN shape in that precision, times an assumed efficiency of 0.5, plus the fresh process's
start-up (measured by the notebook's checks). After a measurement the widget prints both times.
"""

import functools
import io
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from minimind_lib.memory import estimate_memory
from minimind_lib.model import PRESETS, MiniMindConfig, MiniMindForCausalLM, count_parameters

CARDS_GB = (8, 12, 16, 24, 80)
PRECISIONS = {"fp32": "off", "bf16 autocast": "bf16", "fp16 autocast": "fp16"}  # the widget's label -> amp
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PARTS = ("weights", "grads", "optimizer", "activations", "logits")  # plan_memory's parts, in the bars' order
STARTUPS: list[float] = []  # seconds each measuring process took beyond its two steps (Python, torch, warm-up)
EFFICIENCY = 0.5  # the share of the matmul rate a whole training step reaches: an assumption, stated

MEASURE = textwrap.dedent("""
    import json, sys, time, torch
    from torch.utils.checkpoint import checkpoint
    from minimind_lib.model import MiniMindConfig, MiniMindForCausalLM, lm_loss
    preset, batch, seq_len, amp, accum, ckpt, device, threads = json.loads(sys.argv[1])
    torch.set_num_threads(threads)  # as many as the notebook's PyTorch uses
    def status(field):  # bytes, from this process's /proc/self/status (kB there)
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
    def train(cfg, steps, report=False):
        torch.manual_seed(0)
        model = MiniMindForCausalLM(cfg).to(device)
        if ckpt:  # activation checkpointing: each layer's forward runs again in backward
            for layer in model.model.layers:
                layer.forward = lambda *a, _f=layer.forward: checkpoint(_f, *a, use_reentrant=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(steps):
            for micro in range(accum):
                x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
                with torch.autocast(device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp),
                                    enabled=amp != "off"):
                    logits = model(x).logits
                (lm_loss(logits, x) / accum).backward()
                del logits
                if report:  # one line per micro-batch: the widget's progress bar reads them as they come
                    print(json.dumps({"done": step * accum + micro + 1, "of": steps * accum}), flush=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
    train(MiniMindConfig.preset("smoke", num_hidden_layers=1), 1)  # warm up kernels and autograd threads first
    if device == "cuda":
        torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    else:
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := the current resident size
        base = status("VmRSS:")
    start = time.monotonic()
    train(MiniMindConfig.preset(preset), 2, report=True)
    if device == "cuda":
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() if device == "cuda" else status("VmHWM:")) - base
    print(json.dumps({"peak": peak, "seconds": time.monotonic() - start}))
""")


def measurable(device: torch.device) -> bool:
    """Whether this notebook can read a peak counter on `device`: CUDA's allocator, or Linux's VmHWM on a CPU."""
    return device.type == "cuda" or (device.type == "cpu" and os.path.exists("/proc/self/clear_refs"))


def _collect(stream, into: list) -> None:  # a thread's loop: every line of a process's output, as it comes
    for line in stream:
        into.append(line)


def measure_peak(preset: str, batch: int, seq_len: int, amp: str, accum: int, checkpointing: bool,
                 device: torch.device, on_progress: Callable | None = None) -> dict | None:
    """Peak bytes of 2 optimizer steps in a fresh process over its baseline, the seconds the steps took and the
    seconds of the whole process ("wall"); None without a peak counter. on_progress(seconds, micro-batches done, of
    how many) is called about twice a second while it runs."""
    if not measurable(device):
        return None
    args = json.dumps([preset, batch, seq_len, amp, accum, checkpointing, device.type, torch.get_num_threads()])
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    out, err = [], []
    readers = [threading.Thread(target=_collect, args=pipe, daemon=True)
               for pipe in ((proc.stdout, out), (proc.stderr, err))]
    for reader in readers:
        reader.start()
    start = time.monotonic()
    while True:
        try:
            proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() - start > 900:
                proc.kill()
                raise RuntimeError("the measuring process ran over 900 s; stopped") from None
            if on_progress is not None:
                done = [json.loads(line) for line in list(out) if line.startswith('{"done"')]
                on_progress(time.monotonic() - start, *((done[-1]["done"], done[-1]["of"]) if done else (0, 2 * accum)))
    for reader in readers:
        reader.join()
    if proc.returncode:
        raise RuntimeError(f"the measuring process failed:\n{''.join(err)[-2000:]}")
    result = {**json.loads(out[-1]), "wall": time.monotonic() - start}
    STARTUPS.append(result["wall"] - result["seconds"])
    return result


def forward_flops_per_token(c: MiniMindConfig, seq_len: int) -> int:
    """2 FLOPs per multiply-add of each weight matrix a token passes through (the embedding lookup is free, the tied
    head is a matmul; an MoE token passes through its k experts), plus q.k and attention.v at an average context of
    seq_len / 2 (causal): 2 * 2 * (seq_len / 2) * heads * head_dim per layer."""
    with torch.device("meta"):
        norms = count_parameters(MiniMindForCausalLM(c))["norms"]  # gains: not matmuls
    matrices = estimate_memory(c, 1, seq_len)["n_active_params"] - norms
    return 2 * matrices + 2 * c.num_hidden_layers * seq_len * c.num_attention_heads * c.head_dim


def step_flops(c: MiniMindConfig, batch: int, seq_len: int, accum: int = 1, checkpointing: bool = False) -> int:
    """One optimizer step: the forward, backward about twice it, and with checkpointing the forward once more."""
    return accum * batch * seq_len * forward_flops_per_token(c, seq_len) * (4 if checkpointing else 3)


@functools.cache
def matmul_flops_per_second(device_type: str, amp: str) -> float:
    """This device's rate on a matmul of MiniMind2-small's FFN shape (tokens x 512 @ 512 x 1408) under `amp`, the
    best of 3 after a warm-up."""
    n, best = 16384 if device_type == "cuda" else 2048, math.inf
    a, b = torch.randn(n, 512, device=device_type), torch.randn(512, 1408, device=device_type)
    for _ in range(4):
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device_type, dtype=AMP_DTYPES.get(amp), enabled=amp != "off"):
            a @ b
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 512 * 1408 / best


def expected_seconds(preset: str, batch: int, seq_len: int, amp: str, accum: int, checkpointing: bool,
                     device: torch.device) -> float:
    """The cost model's prediction for a measurement: a prediction, not a promise."""
    work = 2 * step_flops(MiniMindConfig.preset(preset), batch, seq_len, accum, checkpointing)
    startup = statistics.median(STARTUPS) if STARTUPS else 0.0
    return startup + work / (EFFICIENCY * matmul_flops_per_second(device.type, amp))


def draw_plan(plan: dict, setting: str, title: str, measured: float | None = None, device_type: str = "") -> Figure:
    """The plan's parts alive at the peak (left) and the peak against the cards (right)."""
    gb = 1e9
    fig = Figure(figsize=(12, 3.3))
    ax_parts, ax_cards = fig.subplots(1, 2, gridspec_kw={"width_ratios": (3, 2)})
    left = 0.0
    for part, color in zip(PARTS, plt.cm.tab10.colors):
        if plan.get(part):  # what is alive at the moment of the peak
            ax_parts.barh(["estimate"], [plan[part] / gb], left=left, color=color, label=part)
            left += plan[part] / gb
    bars = {"estimate": plan["peak"] / gb}
    if measured is not None:
        ax_parts.barh(["measured"], [measured / gb], color="gray", label=f"measured peak ({device_type})")
        bars["measured"] = measured / gb
    ax_parts.set(xlabel="GB", xlim=(0, 1.15 * max(bars.values())), title=f"alive at the peak: the {plan['moment']}")
    ax_parts.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    ax_cards.barh(list(bars), list(bars.values()), color=["C3", "gray"][:len(bars)])
    ax_cards.plot(list(bars.values()), list(bars), "D", color="k", ms=4, clip_on=False)  # seen however short
    for card in CARDS_GB:
        ax_cards.axvline(card, color="k", ls=":", lw=0.8)
        ax_cards.text(card, 1.01, str(card), transform=ax_cards.get_xaxis_transform(), ha="center", fontsize=8)
    ax_cards.set(xlabel="GB (dotted: cards of 8, 12, 16, 24 and 80 GB)",
                 xlim=(0, 1.1 * max(CARDS_GB[-1], *bars.values())))
    ax_cards.set_title("the peak against the cards", pad=14)
    fig.suptitle(f"{setting}: peak ~{plan['peak'] / gb:.2f} GB\n{title}", fontsize=9)
    fig.tight_layout()
    return fig


def _png(fig: Figure):
    from IPython.display import Image
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    return Image(png.getvalue(), format="png")


def planner(plan_memory: Callable, device: torch.device, title: str, default_amp: str = "off") -> None:
    """The widget: a configuration's plan drawn (once at first, so the picture is there where widgets are not),
    redrawn in place when a control changes; Measure runs the same configuration in a fresh process."""
    import ipywidgets as W
    from IPython.display import Pretty, display

    wide = {"description_width": "initial"}  # show each control's whole label
    label = {amp: name for name, amp in PRECISIONS.items()}[default_amp]
    controls = dict(preset=W.Dropdown(options=list(PRESETS), value="minimind2-small", description="preset", style=wide),
                    batch=W.IntSlider(value=8, min=1, max=128, description="batch", style=wide),
                    seq_len=W.Dropdown(options=[128, 256, 512, 1024, 2048], value=512, description="seq_len",
                                       style=wide),
                    precision=W.Dropdown(options=list(PRECISIONS), value=label, description="precision", style=wide),
                    accum=W.IntSlider(value=1, min=1, max=16, description="gradient accumulation", style=wide),
                    checkpointing=W.Checkbox(value=False, description="activation checkpointing", indent=False))
    measure = W.Button(icon="play", disabled=not measurable(device), layout=W.Layout(width="auto"))
    progress = W.IntProgress(value=0, min=0, max=2, layout=W.Layout(width="140px"))
    status = W.Label()

    def chosen() -> dict:
        v = {name: w.value for name, w in controls.items()}
        return {"preset": v["preset"], "batch": v["batch"], "seq_len": v["seq_len"], "amp": PRECISIONS[v["precision"]],
                "accum": v["accum"], "checkpointing": v["checkpointing"]}

    def picture(measured: float | None = None):
        c = chosen()
        plan = plan_memory(MiniMindConfig.preset(c["preset"]), c["batch"], c["seq_len"], c["amp"], c["accum"],
                           c["checkpointing"])
        setting = (f"{c['preset']}, batch {c['batch']} x seq {c['seq_len']}, amp {c['amp']}, accum {c['accum']}, "
                   f"checkpointing {'on' if c['checkpointing'] else 'off'}")
        fits = "; ".join(f"{card} GB: {'fits' if plan['peak'] <= card * 1e9 else 'no'}" for card in CARDS_GB)
        if measured is not None:
            fits += f"; measured {measured / 1e9:.3f} GB vs estimated {plan['peak'] / 1e9:.3f} GB"
        return _png(draw_plan(plan, setting, title, measured, device.type)), Pretty(fits)

    def describe_button() -> None:
        measure.description = (f"Measure on {device.type} (about {expected_seconds(**chosen(), device=device):.0f} s "
                               "by the cost model)" if measurable(device) else
                               f"no peak counter to read on {device.type}: estimate only")

    def redraw(*_, measured: float | None = None) -> None:
        image, fits = picture(measured)
        plot.update(image)
        summary.update(fits)
        describe_button()

    def on_measure(_) -> None:
        c = chosen()
        expected = expected_seconds(**c, device=device)
        measure.disabled, measure.icon = True, "hourglass-half"

        def show(seconds: float, done: int, of: int) -> None:
            progress.max, progress.value = of, done
            status.value = f"{seconds:.0f} s of about {expected:.0f} s expected; micro-batch {done} of {of} measured"
        try:
            result = measure_peak(**c, device=device, on_progress=show)
            progress.value = progress.max
            status.value = f"measured in {result['wall']:.0f} s; the cost model expected about {expected:.0f} s"
            redraw(measured=result["peak"])
        except RuntimeError as e:
            status.value = "the measurement failed (the error is below the plot)"
            summary.update(Pretty(str(e)))
        finally:
            measure.disabled, measure.icon = False, "play"
            describe_button()

    measure.on_click(on_measure)
    display(W.VBox([W.HBox(list(controls.values())[:3]), W.HBox(list(controls.values())[3:]),
                    W.HBox([measure, progress, status])]))
    image, fits = picture()
    plot = display(image, display_id=True)  # the one picture: a change of a control updates it in place
    summary = display(fits, display_id=True)
    describe_button()
    for w in controls.values():
        w.observe(redraw, names="value")
