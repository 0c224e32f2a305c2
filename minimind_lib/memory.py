"""Memory, built in notebook 03_model: measure it (MemoryMeter, CUDA and CPU), impose a budget,
predict it.

CUDA's and MPS's allocators count exactly. On a CPU, inside ``with meter.track(...)``, a
TorchDispatchMode adds each new storage an op outputs and subtracts it when a weakref says it is
freed; tensors that existed before are found by walking the objects passed to ``track``. Live tensor
bytes, as ``torch.cuda.memory_allocated`` counts them, not RSS. Unseen: scratch memory inside a
kernel, and tensors created outside ``track`` that were not passed to it.

What the batch controller of notebook 06 decides on (``peak_in_use``, ``end_window``): memory the
allocator cannot give back. Its cache can: before an out-of-memory error the CUDA allocator frees
its unused cached blocks and retries, so reserved memory, which falls only on ``empty_cache()``,
stays at its highest after a shrink and would make every later check shrink again. A step's peak is
its allocated peak plus the split blocks that fragmentation holds (free parts of segments still in
use, which no retry can free); the CUDA context and other processes are read from the driver once
per decision. MPS keeps no peak: at each decision its cache is released, so the driver's allocation
until the next one is that window's high-water mark."""

import contextlib
import weakref
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import device as device_module
from .checks import require
from .model import MiniMindForCausalLM, chunked_lm_loss, count_parameters, lm_loss

class OutOfMemory(torch.OutOfMemoryError):
    """Raised when tracked live bytes exceed a MemoryMeter's budget: a torch.OutOfMemoryError, as a
    GPU raises."""


def _fmt(n: int) -> str:
    """Bytes as a short human string."""
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of live CPU/MPS storages created by ops (and registered tensors); raises
    past a budget."""

    def __init__(self, meter: "MemoryMeter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        meter, before = self.meter, self.meter._current
        # most ops output one tensor
        for t in tree_flatten(out)[0]:  # a tensor is a tree of one leaf
            if isinstance(t, torch.Tensor):
                meter._add(t)
        if meter._current > before:
            meter._check_budget(before, f"{func} tried to allocate")
        return out


class MemoryMeter:
    """Current and peak memory of one device; on CPU measured inside ``with meter.track(model,
    optimizer):``. budget_bytes: on CUDA and MPS a per-process memory fraction (the allocator raises
    torch.OutOfMemoryError); on CPU the first op whose output takes the tracked live bytes over it
    raises ``OutOfMemory``."""

    def __init__(self, device: torch.device | str = "cpu", budget_bytes: int | None = None):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.counted_by_allocator = self.device.type in ("cuda", "mps")  # no per-op dispatch mode
        # set_per_process_memory_fraction needs an index
        if self.is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.budget_bytes, self._current, self._peak = None, 0, 0
        # StorageImpl address -> (weakref, nbytes)
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        if budget_bytes is not None:
            self.set_budget(budget_bytes)

    def set_budget(self, budget_bytes: int | None) -> None:
        """Impose (or with None lift) a memory budget on this device."""
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive or None, got {budget_bytes}")
        had_budget = self.budget_bytes is not None
        self.budget_bytes = budget_bytes
        # On CUDA and MPS the allocator enforces it. Lifting touches the device only when this
        # meter had set a cap: a meter never undoes a cap set elsewhere (notebook 00's smaller GPU).
        if self.counted_by_allocator and (budget_bytes is not None or had_budget):
            total = device_module.total_memory_bytes(self.device)
            if budget_bytes is None:
                fraction = 1.0
            else:
                fraction = min(1.0, budget_bytes / total)
            if self.is_cuda:
                torch.cuda.set_per_process_memory_fraction(fraction, self.device)
            else:
                torch.mps.set_per_process_memory_fraction(fraction)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type != self.device.type or t.is_sparse:
            return
        try:
            st = t.untyped_storage()
        # tensors without a storage (e.g. some subclasses)
        except (RuntimeError, NotImplementedError):
            return
        key, nbytes = st._cdata, st.nbytes()
        if key in self._storages or nbytes == 0:
            return
        self._storages[key] = (weakref.ref(st, lambda _ref, key=key: self._free(key)), nbytes)
        self._current += nbytes

    def _free(self, key: int) -> None:
        self._current -= self._storages.pop(key, (None, 0))[1]

    def _check_budget(self, before: int, what: str) -> None:
        """Update the peak; raise OutOfMemory if `what` took the live bytes from `before` over the
        budget."""
        self._peak = max(self._peak, self._current)
        if self.budget_bytes is not None and self._current > max(self.budget_bytes, before):
            new, live, budget = self._current - before, self._current, self.budget_bytes
            raise OutOfMemory(f"{self.device.type.upper()} out of memory (MemoryMeter budget): "
                              f"{what} {new} bytes "
                              f"({_fmt(new)}); live {live} bytes ({_fmt(live)}) exceeds the budget "
                              f"of {budget} bytes "
                              f"({_fmt(budget)})")

    @contextlib.contextmanager
    def track(self, *objs: Any) -> Iterator["MemoryMeter"]:
        """Measure the code inside; `objs` (model, optimizer, batch) are walked first so they count:
        pass them on every call, as new gradients and optimizer states may exist since the last. On
        CUDA and MPS the allocator counts: nothing runs per op."""
        if self.counted_by_allocator:
            yield self
            return
        before = self._current  # tensors that exist already: parameters, gradients, states, batch
        for t in _tensors_of(objs):
            self._add(t)
        self._check_budget(before, "registered tensors need")
        with _LiveBytes(self):
            yield self

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        self._peak = self._current
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def current(self) -> int:
        """Bytes live now (CUDA, MPS: allocated by tensors; CPU: tracked live tensor bytes)."""
        if self.device.type == "mps":
            return torch.mps.current_allocated_memory()
        if self.is_cuda:
            return torch.cuda.memory_allocated(self.device)
        return self._current

    def peak(self) -> int:
        """Highest current() since the last reset_peak() (MPS keeps no peak: its driver's
        allocation, cache included, which is at least that)."""
        if self.device.type == "mps":
            return torch.mps.driver_allocated_memory()
        if self.is_cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return self._peak

    def peak_reserved(self) -> int:
        """Peak reserved bytes since reset_peak() (CUDA: allocated + the allocator's cache; MPS: the
        driver's allocation; CPU: peak()), the second memory curve of a run's metrics."""
        if self.is_cuda:
            return torch.cuda.max_memory_reserved(self.device)
        return self.peak_in_use()

    def peak_in_use(self) -> int:
        """The peak an OOM depends on since reset_peak(), without the driver (read per step: no
        device call). CUDA: allocated plus the fragmentation that holds memory no retry frees (the
        allocator's peak inactive split blocks), not reserved bytes (its cache, freed before an
        OOM). MPS: the driver's allocation (end_window releases the cache). CPU: peak()."""
        if self.is_cuda:
            split = torch.cuda.memory_stats(self.device).get("inactive_split_bytes.all.peak", 0)
            return torch.cuda.max_memory_allocated(self.device) + split
        return self.peak()

    def end_window(self) -> int:
        """At a controller's decision point: the bytes that others hold on the device (CUDA: the
        context and other processes, the driver's used memory minus this process's reserved; one
        driver call). MPS: the cache is released, so that the driver's count restarts at the live
        tensors (returns 0). CPU: 0."""
        if self.device.type == "mps":
            torch.mps.empty_cache()
        if not self.is_cuda:
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return max(total - free - torch.cuda.memory_reserved(self.device), 0)

    def __repr__(self) -> str:
        budget = None
        if self.budget_bytes is not None:
            budget = _fmt(self.budget_bytes)
        return (f"MemoryMeter(device={self.device}, current={_fmt(self.current())}, "
                f"peak={_fmt(self.peak())}, budget={budget})")


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor a module, optimizer, tensor or (nested) container holds right now."""
    if isinstance(obj, torch.Tensor):
        yield from (obj,) if obj.grad is None else (obj, obj.grad)
    elif isinstance(obj, nn.Module):
        yield from _tensors_of([*obj.parameters(), *obj.buffers()])
    # its parameters (with their grads), then their states
    elif isinstance(obj, torch.optim.Optimizer):
        params = [p for group in obj.param_groups for p in group["params"]]
        yield from _tensors_of([params, list(obj.state.values())])
    elif isinstance(obj, (dict, list, tuple)):
        values = obj
        if isinstance(obj, dict):
            values = obj.values()
        for v in values:
            yield from _tensors_of(v)


# ---- Prediction: what one training step holds, counted from the model's shapes
_AMP_BYTES = {"off": 4, "bf16": 2, "fp16": 2}
_OPTIMIZERS = {  # name: (fp32 states per parameter, how to make one)
    "adamw": (2, lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
}


def _check_step_args(batch_size: int, seq_len: int, amp: str, optimizer: str,
                     accum_steps: int = 1) -> None:
    for name, value, choices in (("amp", amp, _AMP_BYTES), ("optimizer", optimizer, _OPTIMIZERS)):
        if value not in choices:
            raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    if min(batch_size, seq_len, accum_steps) <= 0:
        raise ValueError("batch_size, seq_len and accum_steps must be positive, got "
                         f"batch_size={batch_size}, "
                         f"seq_len={seq_len}, accum_steps={accum_steps}")


# Counts (N = batch_size*seq_len tokens, C hidden, F ffn width, V vocab, P parameters, s =
# activation bytes):
# - params 4P (fp32 master weights) and the RoPE tables 2 * max_pos * head_dim * 4; grads 4P;
# AdamW's exp_avg and exp_avg_sq 8P. Under autocast add 2P of low-precision
# weight copies.
# - activations saved for backward, per layer (read off the forward code with
# saved_tensors_hooks): each of the two RMSNorms saves its input x and the normalised x (fp32,
# for the gain's gradient), and the projection after it saves the norm's output (s bytes): 2 *
# (4 + 4 + s) NC; attention saves q, the repeated k and v and its output (4NC * s; k and v are
# N*n_kv*D each when not repeated); SwiGLU saves gate, silu(gate), up and their product (4NF *
# s). The final norm adds (4 + 4 + s) NC. Mixture of experts (E of width F, k per token): P
# holds all E; N*k routed rows save 4F, input and output (2C at s, 3C under autocast) and
# index_add's fp32 copy (4C) each.
# - the head: the logits (NV * s, when the caller holds them until backward: logits_held, as
# notebook 03's step; the library's accumulate_step does not), cross-entropy's fp32 log-softmax
# (4NV), and at the start of backward the gradients of the log-probs and of the logits (2 * 4NV)
# while those still live. With loss_chunk (the chunked linear + cross-entropy,
# model.chunked_lm_loss): one chunk's logits, fp32 (4cV, and the autocast output cV * s), the
# gradients of the hidden states and of the head it keeps (4NC, 4VC) and the head's transient
# (VC * (4 + s)).
# - accumulation (accum_steps > 1, batch_size rows per micro-batch): micro-batches 2..k start
# their backward with the gradients of the earlier ones held (4P). The peak is the larger of:
# the start of backward (params + buffers + optimizer states of earlier steps + activations +
# head, + grads when accumulating), and the optimizer step (params + grads + states). Ignored:
# kernel workspaces, the allocator's rounding, transients inside backward, small bookkeeping
# tensors (RMSNorm's rsqrt, attention's logsumexp). fp32 is checked against MemoryMeter counts
# in tests/test_memory.py (within 1-3% for the presets); under autocast the count is rougher
# (3-8% low at large batches: some CPU ops keep fp32 activations).
def estimate_memory(config, batch_size: int, seq_len: int, amp: str = "off",
                    optimizer: str = "adamw",
                    accum_steps: int = 1, logits_held: bool = True, loss_chunk: int = 0) -> dict:
    """Predict the bytes of one training step (fwd + bwd + optimizer) of a MiniMind model,
    analytically (the counts: the comment above)."""
    _check_step_args(batch_size, seq_len, amp, optimizer, accum_steps)
    c, n, s = config, batch_size * seq_len, _AMP_BYTES[amp]
    C, F, V, L = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    kv = c.num_key_value_heads * c.head_dim
    # MiniMind-3: q/k norm gains
    q, qk = c.num_attention_heads * c.head_dim, 2 * c.head_dim if c.qk_norm else 0
    E, k, Fe = (c.num_experts, c.num_experts_per_tok,
                c.moe_intermediate_size) if c.use_moe else (0, 0, 0)
    ffn = E * (3 * C * Fe + C) if c.use_moe else 3 * C * F  # experts and router, or gate, up, down
    # tied embedding / lm_head + per layer q,o + k,v + FFN + 2 norms (+ q/k norms) + the final norm
    P = V * C + L * (2 * C * q + 2 * C * kv + ffn + 2 * C + qk) + C
    params, grads, opt_states = 4 * P, 4 * P, _OPTIMIZERS[optimizer][0] * 4 * P
    buffers = 2 * c.max_position_embeddings * c.head_dim * 4
    amp_weight_copies = 0 if amp == "off" else 2 * P
    kv_saved = 2 * n * (C if c.num_attention_heads != c.num_key_value_heads else kv)
    # input, normalised input (fp32), output as the next matmul's input
    norm_saved = n * C * (4 + 4 + s)
    # each q/k norm saves its input and normalised input
    qk_saved = n * (q + kv) * (4 + 4) if c.qk_norm else 0
    if not c.use_moe:
        ffn_saved = 4 * n * F * s
    else:
        routed_in_out = 2 if amp == "off" else 3
        ffn_saved = n * k * ((4 * Fe + routed_in_out * C) * s + 4 * C) + n * (4 * E + 36 * k + 4)
    activations = L * (2 * norm_saved + qk_saved + (2 * n * C + kv_saved) * s
                       + ffn_saved) + norm_saved
    head = n * V * (s if logits_held else 0) + n * V * 4 + 2 * n * V * 4
    if loss_chunk:
        extra = 0 if amp == "off" else s  # under autocast the matmul's output, before its fp32 copy
        head = min(loss_chunk, n) * V * (4 + extra) + 4 * n * C + 4 * V * C + V * C * (4 + extra)
    backward_start = params + buffers + opt_states + amp_weight_copies + activations + head
    backward_start += grads if accum_steps > 1 else 0
    return {"params_bytes": params, "buffers_bytes": buffers, "grads_bytes": grads,
            "optimizer_bytes": opt_states,
            "amp_weight_copies_bytes": amp_weight_copies, "activations_bytes": activations,
            "head_bytes": head,
            "peak_bytes": max(backward_start, params + buffers + grads + opt_states), "n_params": P,
            # those a token's forward uses (MoE: k of E experts)
            "n_active_params": P - L * (E - k) * 3 * C * Fe}


def plan_micro_batches(config, seq_len: int, rows_per_step: int, budget_bytes: int,
                       amp: str = "bf16", loss_chunk: int = 0) -> tuple[int, int]:
    """(rows per micro-batch, micro-batches per step) for a step of rows_per_step full rows: the
    fewest micro-batches (fewer launches, one optimizer step's overhead shared by more rows) whose
    step estimate_memory puts within budget_bytes; the rows split evenly, so the micro-batch count
    divides rows_per_step."""
    for k in (k for k in range(1, rows_per_step + 1) if rows_per_step % k == 0):
        est = estimate_memory(config, rows_per_step // k, seq_len, amp, accum_steps=k,
                              logits_held=False, loss_chunk=loss_chunk)
        if est["peak_bytes"] <= budget_bytes:
            return rows_per_step // k, k
    raise ValueError(f"budget_bytes={budget_bytes}: not even one row of {seq_len} tokens fits")


def measure_step_memory(config, batch_size: int, seq_len: int, amp: str = "off",
                        optimizer: str = "adamw",
                        device: torch.device | str = "cpu", fake: bool = False, seed: int = 0,
                        accum_steps: int = 1, logits_held: bool = True,
                        loss_chunk: int = 0) -> dict:
    """Measure one steady-state training step (fwd + bwd + optimizer step) of a fresh model with a
    MemoryMeter. fake=True runs on FakeTensors (storages without arithmetic or real memory): the
    same count, for sizes this machine cannot hold. amp autocasts the forward (a GradScaler would
    not change memory). accum_steps micro-batches of batch_size rows; logits_held keeps each
    micro-batch's logits until its backward (False: train.accumulate_step)."""
    _check_step_args(batch_size, seq_len, amp, optimizer, accum_steps)
    # each expert's row count is data-dependent: a fake tensor has no values to route
    require(not (fake and config.use_moe), "measure_step_memory(fake=True) cannot route tokens "
            "to experts (use_moe): measure for real")
    device = torch.device(device)
    tensors = contextlib.nullcontext()
    if fake:  # fake tensors: bytes are device-independent
        device, tensors = torch.device("cpu"), FakeTensorMode()
    meter = MemoryMeter(device)
    with tensors:
        torch.manual_seed(seed)
        model = MiniMindForCausalLM(config)
        if not fake:  # a fake model stays as made
            model = model.to(device)
        opt = _OPTIMIZERS[optimizer][1](list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        # creates the optimizer states: measure a steady-state step, as every later step of a run is
        opt.step()
        opt.zero_grad(set_to_none=True)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
        meter.reset_peak()
        with meter.track(model, opt, x):
            for _ in range(accum_steps):  # the same rows each time: only their count matters here
                dtype = torch.float16 if amp == "fp16" else torch.bfloat16
                with torch.autocast(device.type, dtype=dtype, enabled=amp != "off"):
                    if loss_chunk:  # the chunked linear + cross-entropy: no logits at all
                        hidden = model.model(x)[0]
                        loss = chunked_lm_loss(hidden, model.lm_head.weight, x, loss_chunk)
                        logits = None
                    else:
                        logits = model(x).logits
                if loss_chunk:
                    loss = loss / accum_steps
                else:
                    loss = lm_loss(logits, x) / accum_steps
                if not logits_held:  # only the graph keeps what backward needs
                    logits = None
                loss.backward()
                del logits, loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"peak_bytes": int(meter.peak()), "current_bytes": int(meter.current()),
                "n_params": count_parameters(model)["total"], "batch_size": batch_size,
                "seq_len": seq_len, "amp": amp, "optimizer": optimizer, "device": device.type,
                "fake": fake}
