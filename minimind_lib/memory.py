"""Memory, built in notebook 03_model: measure it (MemoryMeter, CUDA and CPU), impose a budget, predict it.

CUDA's allocator counts exactly. On a CPU (or MPS), inside ``with meter.track(...)``, a TorchDispatchMode adds each
new storage an op outputs and subtracts it when a weakref says it is freed; tensors that existed before are found by
walking the objects passed to ``track``. Live tensor bytes, as ``torch.cuda.memory_allocated`` counts them, not RSS.
Unseen: scratch memory inside a kernel, and tensors created outside ``track`` that were not passed to it."""

import contextlib
import weakref
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .model import MiniMindForCausalLM, count_parameters, lm_loss

class OutOfMemory(torch.OutOfMemoryError):
    """Raised when tracked live bytes exceed a MemoryMeter's budget: a torch.OutOfMemoryError, as a GPU raises."""


def _fmt(n: int) -> str:
    """Bytes as a short human string."""
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of live CPU/MPS storages created by ops (and registered tensors); raises past a budget."""

    def __init__(self, meter: "MemoryMeter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        meter, before = self.meter, self.meter._current
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:  # most ops output one tensor
            if isinstance(t, torch.Tensor):
                meter._add(t)
        if meter._current > before:
            meter._check_budget(before, f"{func} tried to allocate")
        return out


class MemoryMeter:
    """Current and peak memory of one device; on CPU measured inside ``with meter.track(model, optimizer):``.
    budget_bytes: on CUDA a per-process memory fraction (the allocator raises torch.OutOfMemoryError); on CPU the
    first op whose output takes the tracked live bytes over it raises ``OutOfMemory``."""

    def __init__(self, device: torch.device | str = "cpu", budget_bytes: int | None = None):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda and self.device.index is None:  # set_per_process_memory_fraction needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.budget_bytes, self._current, self._peak = None, 0, 0
        self._storages: dict[int, tuple[weakref.ref, int]] = {}  # StorageImpl address -> (weakref, nbytes)
        if budget_bytes is not None:
            self.set_budget(budget_bytes)

    def set_budget(self, budget_bytes: int | None) -> None:
        """Impose (or with None lift) a memory budget on this device."""
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive or None, got {budget_bytes}")
        had_budget = self.budget_bytes is not None
        self.budget_bytes = budget_bytes
        # On CUDA the allocator enforces it. Lifting touches the device only when this meter had set a cap, so a
        # meter never undoes a cap set elsewhere (notebook 00's emulated smaller GPU, another meter).
        if self.is_cuda and (budget_bytes is not None or had_budget):
            total = torch.cuda.get_device_properties(self.device).total_memory
            fraction = 1.0 if budget_bytes is None else min(1.0, budget_bytes / total)
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type != self.device.type or t.is_sparse:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. some subclasses)
            return
        key, nbytes = st._cdata, st.nbytes()
        if key in self._storages or nbytes == 0:
            return
        self._storages[key] = (weakref.ref(st, lambda _ref, key=key: self._free(key)), nbytes)
        self._current += nbytes

    def _free(self, key: int) -> None:
        self._current -= self._storages.pop(key, (None, 0))[1]

    def _check_budget(self, before: int, what: str) -> None:
        """Update the peak; raise OutOfMemory if `what` took the live bytes from `before` over the budget."""
        self._peak = max(self._peak, self._current)
        if self.budget_bytes is not None and self._current > max(self.budget_bytes, before):
            new, live, budget = self._current - before, self._current, self.budget_bytes
            raise OutOfMemory(f"{self.device.type.upper()} out of memory (MemoryMeter budget): {what} {new} bytes "
                              f"({_fmt(new)}); live {live} bytes ({_fmt(live)}) exceeds the budget of {budget} bytes "
                              f"({_fmt(budget)})")

    @contextlib.contextmanager
    def track(self, *objs: Any) -> Iterator["MemoryMeter"]:
        """Measure the code inside; `objs` (model, optimizer, batch) are walked first so they count: pass them on
        every call, as new gradients and optimizer states may exist since the last. On CUDA the allocator counts."""
        if not self.is_cuda:  # count the tensors that exist already: parameters, gradients, optimizer states, batch
            before = self._current
            for t in _tensors_of(objs):
                self._add(t)
            self._check_budget(before, "registered tensors need")
        with contextlib.nullcontext() if self.is_cuda else _LiveBytes(self):
            yield self

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        self._peak = self._current
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def current(self) -> int:
        """Bytes live now (CUDA: allocated; CPU: tracked live tensor bytes)."""
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else self._current

    def peak(self) -> int:
        """Highest current() since the last reset_peak()."""
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else self._peak

    def peak_reserved(self) -> int:
        """Peak reserved bytes since reset_peak() (CUDA: allocated + the allocator's cache; MPS: the
        driver's allocation; CPU: peak()), the second memory curve of a run's metrics."""
        return torch.cuda.max_memory_reserved(self.device) if self.is_cuda else self.peak_in_use()

    def peak_in_use(self) -> int:
        """The peak an OOM depends on, since reset_peak() (the controller's checks). CUDA: the allocator's peak
        reserved bytes (its cache, fragmented by batches whose shape changes every step) plus what else holds the card
        (driver-used memory minus reserved: the CUDA context, other processes); allocated bytes, peak(), miss both and
        can read 70% of a full card. MPS: the driver's allocation (no peak kept). CPU: peak()."""
        if self.is_cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            outside = total - free - torch.cuda.memory_reserved(self.device)  # context + other processes
            return torch.cuda.max_memory_reserved(self.device) + max(outside, 0)
        return torch.mps.driver_allocated_memory() if self.device.type == "mps" else self.peak()

    def __repr__(self) -> str:
        return (f"MemoryMeter(device={self.device}, current={_fmt(self.current())}, peak={_fmt(self.peak())}, "
                f"budget={None if self.budget_bytes is None else _fmt(self.budget_bytes)})")


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor a module, optimizer, tensor or (nested) container holds right now."""
    if isinstance(obj, torch.Tensor):
        yield from (obj,) if obj.grad is None else (obj, obj.grad)
    elif isinstance(obj, nn.Module):
        yield from _tensors_of([*obj.parameters(), *obj.buffers()])
    elif isinstance(obj, torch.optim.Optimizer):  # its parameters (with their grads), then their states
        params = [p for group in obj.param_groups for p in group["params"]]
        yield from _tensors_of([params, list(obj.state.values())])
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors_of(v)


# ---- Prediction: what one training step holds, counted from the model's shapes
_AMP_BYTES = {"off": 4, "bf16": 2, "fp16": 2}
_OPTIMIZERS = {  # name: (fp32 states per parameter, how to make one)
    "adamw": (2, lambda ps: torch.optim.AdamW(ps, lr=1e-3)), "adam": (2, lambda ps: torch.optim.Adam(ps, lr=1e-3)),
    "sgd": (0, lambda ps: torch.optim.SGD(ps, lr=1e-3)),
    "sgd_momentum": (1, lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))}


def _check_step_args(batch_size: int, seq_len: int, amp: str, optimizer: str, accum_steps: int = 1) -> None:
    for name, value, choices in (("amp", amp, _AMP_BYTES), ("optimizer", optimizer, _OPTIMIZERS)):
        if value not in choices:
            raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    if min(batch_size, seq_len, accum_steps) <= 0:
        raise ValueError(f"batch_size, seq_len and accum_steps must be positive, got batch_size={batch_size}, "
                         f"seq_len={seq_len}, accum_steps={accum_steps}")


def estimate_memory(config, batch_size: int, seq_len: int, amp: str = "off", optimizer: str = "adamw",
                    accum_steps: int = 1, logits_held: bool = True) -> dict:
    """Predict the bytes of one training step (fwd + bwd + optimizer) of a MiniMind model, analytically.

    Counts (N = batch_size*seq_len tokens, C hidden, F ffn width, V vocab, P parameters, s = activation bytes):
    - params 4P (fp32 master weights) and the RoPE tables 2 * max_pos * head_dim * 4; grads 4P;
      AdamW's exp_avg and exp_avg_sq 8P (SGD 0, momentum 4P). Under autocast add 2P of low-precision weight copies.
    - activations saved for backward, per layer (read off the forward code with saved_tensors_hooks): each of the
      two RMSNorms saves its input x and the normalised x (fp32, for the gain's gradient), and the projection after
      it saves the norm's output (s bytes): 2 * (4 + 4 + s) NC; attention saves q, the repeated k and v and its
      output (4NC * s; k and v are N*n_kv*D each when not repeated); SwiGLU saves gate, silu(gate), up and their
      product (4NF * s). The final norm adds (4 + 4 + s) NC. Mixture of experts (E of width F, k per token): P holds all
      E; N*k routed rows save 4F, input and output (2C at s, 3C under autocast) and index_add's fp32 copy (4C) each.
    - the head: the logits (NV * s, when the caller holds them until backward: logits_held, as notebook 03's step;
      the library's accumulate_step does not), cross-entropy's fp32 log-softmax (4NV), and at the start of backward
      the gradients of the log-probs and of the logits (2 * 4NV) while those still live.
    - accumulation (accum_steps > 1, batch_size rows per micro-batch): micro-batches 2..k start their backward with
      the gradients of the earlier ones held (4P).
    The peak is the larger of: the start of backward (params + buffers + optimizer states of earlier steps +
    activations + head, + grads when accumulating), and the optimizer step (params + grads + states). Ignored:
    kernel workspaces, the allocator's rounding, transients inside backward, small bookkeeping tensors (RMSNorm's
    rsqrt, attention's logsumexp). fp32 is checked against MemoryMeter counts in tests/test_memory.py (within 1-3%
    for the presets); under autocast the count is rougher (3-8% low at large batches: some CPU ops keep fp32
    activations)."""
    _check_step_args(batch_size, seq_len, amp, optimizer, accum_steps)
    c, n, s = config, batch_size * seq_len, _AMP_BYTES[amp]
    C, F, V, L, kv = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers, c.num_key_value_heads * c.head_dim
    q, qk = c.num_attention_heads * c.head_dim, 2 * c.head_dim if c.qk_norm else 0  # MiniMind-3: q/k norm gains
    E, k, Fe = (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) if c.use_moe else (0, 0, 0)
    ffn = E * (3 * C * Fe + C) if c.use_moe else 3 * C * F  # experts and router, or gate, up, down
    # tied embedding / lm_head + per layer q,o + k,v + FFN + 2 norms (+ q/k norms) + the final norm
    P = V * C + L * (2 * C * q + 2 * C * kv + ffn + 2 * C + qk) + C
    params, grads, opt_states = 4 * P, 4 * P, _OPTIMIZERS[optimizer][0] * 4 * P
    buffers = 2 * c.max_position_embeddings * c.head_dim * 4
    amp_weight_copies = 0 if amp == "off" else 2 * P
    kv_saved = 2 * n * (C if c.num_attention_heads != c.num_key_value_heads else kv)
    norm_saved = n * C * (4 + 4 + s)  # input, normalised input (fp32), output as the next matmul's input
    qk_saved = n * (q + kv) * (4 + 4) if c.qk_norm else 0  # each q/k norm saves its input and normalised input
    ffn_saved = 4 * n * F * s if not c.use_moe else (
        n * k * ((4 * Fe + (2 if amp == "off" else 3) * C) * s + 4 * C) + n * (4 * E + 36 * k + 4))
    activations = L * (2 * norm_saved + qk_saved + (2 * n * C + kv_saved) * s + ffn_saved) + norm_saved
    head = n * V * (s if logits_held else 0) + n * V * 4 + 2 * n * V * 4
    backward_start = params + buffers + opt_states + amp_weight_copies + activations + head
    backward_start += grads if accum_steps > 1 else 0
    return {"params_bytes": params, "buffers_bytes": buffers, "grads_bytes": grads, "optimizer_bytes": opt_states,
            "amp_weight_copies_bytes": amp_weight_copies, "activations_bytes": activations, "head_bytes": head,
            "peak_bytes": max(backward_start, params + buffers + grads + opt_states), "n_params": P,
            "n_active_params": P - L * (E - k) * 3 * C * Fe}  # those a token's forward uses (MoE: k of E experts)


def measure_step_memory(config, batch_size: int, seq_len: int, amp: str = "off", optimizer: str = "adamw",
                        device: torch.device | str = "cpu", fake: bool = False, seed: int = 0,
                        accum_steps: int = 1, logits_held: bool = True) -> dict:
    """Measure one steady-state training step (fwd + bwd + optimizer step) of a fresh model with a MemoryMeter.
    fake=True runs on FakeTensors (storages without arithmetic or real memory): the same count, for sizes this machine
    cannot hold. amp autocasts the forward (a GradScaler would not change memory). accum_steps micro-batches of
    batch_size rows; logits_held keeps each micro-batch's logits until its backward (False: train.accumulate_step)."""
    _check_step_args(batch_size, seq_len, amp, optimizer, accum_steps)
    if fake and config.use_moe:  # each expert's row count is data-dependent: a fake tensor has no values to route
        raise ValueError("measure_step_memory(fake=True) cannot route tokens to experts (use_moe): measure for real")
    device = torch.device("cpu") if fake else torch.device(device)  # fake tensors: bytes are device-independent
    meter = MemoryMeter(device)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(seed)
        model = MiniMindForCausalLM(config) if fake else MiniMindForCausalLM(config).to(device)  # fake: no .to
        opt = _OPTIMIZERS[optimizer][1](list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # creates the optimizer states: measure a steady-state step, as every later step of a run is
        opt.zero_grad(set_to_none=True)
        x = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
        meter.reset_peak()
        with meter.track(model, opt, x):
            for _ in range(accum_steps):  # the same rows each time: only their count matters here
                with torch.autocast(device.type, dtype=torch.float16 if amp == "fp16" else torch.bfloat16,
                                    enabled=amp != "off"):
                    logits = model(x).logits
                loss = lm_loss(logits, x) / accum_steps
                logits = logits if logits_held else None  # not held: only the graph keeps what backward needs
                loss.backward()
                del logits, loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"peak_bytes": int(meter.peak()), "current_bytes": int(meter.current()),
                "n_params": count_parameters(model)["total"], "batch_size": batch_size, "seq_len": seq_len,
                "amp": amp, "optimizer": optimizer, "device": device.type, "fake": fake}
