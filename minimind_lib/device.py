"""The device, as notebook 00_setup shows it: which one the course runs on and what it can honestly
do, and the autocast it gets (resolve_amp, notebook 05_mixed_precision).

A format is "supported" when autocast runs in it here (tried), "native" when the hardware has it
(not emulated)."""

import os
import platform
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from . import WAIT_POLICY_SOURCE  # the package's first lines set the policy, before torch loads
from .checks import require

# /proc/cpuinfo flags: x86 AVX512, AMX; Arm
_NATIVE_CPU_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16", "bf16"},
                     # x86 AVX512, AMX; Arm half-precision SIMD
                     torch.float16: {"avx512_fp16", "amx_fp16", "asimdhp"}}


def get_device(prefer: str | None = None) -> torch.device:
    """The best device available: cuda > mps > cpu (or `prefer`, or env MINIMIND_DEVICE). CUDA, set
    up before it first allocates: expandable segments (PYTORCH_ALLOC_CONF, unless it or the older
    PYTORCH_CUDA_ALLOC_CONF is set): one segment that grows by mapping pages, so memory a batch of
    one shape frees serves the next shape and reserved memory stays near allocated (notebook 06);
    TF32 for fp32 matmuls (Ampere on, fp32 accumulation; notebook 05)."""
    if torch.cuda.is_available():
        best = "cuda"
    else:
        best = "mps" if torch.backends.mps.is_available() else "cpu"
    device = torch.device(prefer or os.environ.get("MINIMIND_DEVICE") or best)
    present = device.type not in ("cuda", "mps") or getattr(torch, device.type).is_available()
    require(present, f"device {device} is not available on this machine (torch "
            f"{torch.__version__}); pass --device cpu or leave --device out to use the best one "
            f"present")
    user_set = {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ)
    if device.type == "cuda" and not torch.cuda.is_initialized() and not user_set:  # read once
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def _cpuinfo(prefixes: tuple[str, ...]) -> list[str] | None:
    """The values of the /proc/cpuinfo lines starting with `prefixes` (None where the OS has no
    /proc, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            return [line.split(":", 1)[1].strip() for line in f if line.startswith(prefixes)]
    except OSError:
        return None


def cpu_native_flags(dtype: torch.dtype) -> tuple[str, ...] | None:
    """The CPU's /proc/cpuinfo flags that do `dtype` (bf16 or fp16) arithmetic in hardware (None: no
    /proc)."""
    flags = _cpuinfo(("flags", "Features"))
    if flags is None:
        return None
    return tuple(sorted(set(" ".join(flags).split()) & _NATIVE_CPU_FLAGS[dtype]))


@lru_cache(maxsize=None)
def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether the CPU has arithmetic instructions for `dtype` (bf16 or fp16), from its
    /proc/cpuinfo flags."""
    # None: no /proc (Apple silicon has fp16, and bf16 from M2 on: a stated guess)
    flags = cpu_native_flags(dtype)
    if flags is None:
        return platform.machine() == "arm64"
    return bool(flags)


def device_name(device: torch.device) -> str:
    """Human-readable name of the device (GPU model or CPU model)."""
    if device.type in ("cuda", "mps"):
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        return f"Apple {platform.machine()} (MPS)"
    return next(iter(_cpuinfo(("model name",)) or []),
                "") or platform.processor() or platform.machine()


@lru_cache(maxsize=None)
def autocast_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a matmul under torch.autocast(device_type, dtype) runs here and comes out in `dtype`.
    """
    try:
        with torch.autocast(device_type, dtype=dtype):
            return (
                torch.ones(4, 4, device=device_type) @ torch.eye(4, device=device_type)
            ).dtype == dtype
    except (RuntimeError, TypeError):  # autocast refuses this dtype on this device type
        return False


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast runs on this device at all (it may still be slow: see bf16_native)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return autocast_runs(device.type, torch.bfloat16)


def bf16_native(device: torch.device) -> bool:
    """Whether bf16 runs in hardware here; on a CPU without it, autocast emulates bf16 and is slower
    than fp32."""
    if device.type == "cuda":
        # Ampere and later have bf16 tensor cores
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "mps":
        return bf16_supported(device)
    return cpu_has_native(torch.bfloat16)


def total_memory_bytes(device: torch.device) -> int:
    """Total memory of the device: the GPU's on CUDA, Metal's recommended maximum on MPS, else the
    machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "mps":
        return torch.mps.recommended_max_memory()
    # 0: Windows
    if hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0


def device_report(device: torch.device | None = None, profile: Any = None) -> dict:
    """Facts about the device and the profile (profiles.Profile, if given), as a JSON-ready dict."""
    device = device or get_device()
    return {"device": device.type, "device_name": device_name(device), "profile": getattr(profile,
                                                                                          "name",
                                                                                          None),
            "torch": torch.__version__, "bf16_supported": bf16_supported(device),
            "bf16_native": bf16_native(device),
            # most CPUs emulate it (notebook 05)
            "fp16_supported": autocast_runs(device.type, torch.float16),
            # every GPU has fp16 math
            "fp16_native": device.type in ("cuda", "mps") or cpu_has_native(torch.float16),
            "total_memory_bytes": total_memory_bytes(device),
            "cpu_threads": torch.get_num_threads(),
            "omp_wait_policy": wait_policy()}


def wait_policy() -> str:
    """How OpenMP threads wait, as torch loaded it, and who set it (notebook 00)."""
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    values = " ".join(f"{name}={os.environ.get(name, 'unset')}" for name in names)
    return f"{values} (from {WAIT_POLICY_SOURCE})"


def describe(profile: Any = None, device: torch.device | None = None) -> str:
    """One line naming the device (a CPU with its bf16/fp16 instruction flags: notebook 05) and
    profile, for titles."""
    device, named = (
        device or get_device(),
        f", profile={profile.name}" if profile is not None else "",
    )
    if device.type == "cpu":
        flags = [cpu_native_flags(dt) for dt in (torch.bfloat16, torch.float16)]
    else:
        flags = [None]
    if None in flags:
        isa = ""
    else:
        isa = f"; {' '.join(flags[0] + flags[1]) or 'no bf16/fp16 instructions'}"
    version = torch.__version__.split("+")[0]
    return f"{device.type} ({device_name(device)}{isa}){named}, torch {version}"


def empty_cache(device: torch.device | None = None) -> None:
    """Give the allocator's cached blocks back to the driver, on `device` or (None) on every GPU
    backend present."""
    if device is None:
        kind = None
    else:
        kind = torch.device(device).type
    if kind in (None, "cuda"):
        torch.cuda.empty_cache()  # a no-op before CUDA's first use
    if kind == "mps" or (kind is None and torch.backends.mps.is_available()):
        torch.mps.empty_cache()


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued kernels (GPUs run asynchronously: time only after this)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ---- Autocast and the GradScaler (notebook 05_mixed_precision; train.py imports them from here)
AMP_MODES = ("auto", "bf16", "fp16", "off")


@dataclass(frozen=True)
class AmpSettings:
    """What autocast does on this device: the dtype (None: fp32, no autocast), whether a GradScaler,
    and why."""
    dtype: torch.dtype | None
    use_scaler: bool
    reason: str

    @property
    def name(self) -> str:
        """'bf16', 'fp16' or 'fp32'."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[self.dtype]


# notebook 05, steps timed in turns on a 2-core AMD EPYC with AVX512-BF16 and no AMX: bf16 ahead
# of fp32 in every paired repeat from hidden 256 (median x0.78 there, x0.63 at 512; x1.02 at 64).
# An Intel Xeon with AMX measured bf16 slower at every width: auto takes bf16 on a CPU only where
# it was measured faster.
CPU_BF16_MIN_HIDDEN = 256
CPU_BF16_MEASURED = ("avx512_bf16",)  # that CPU's bf16 instructions (cpu_native_flags), exactly


def resolve_amp(amp: str, device: torch.device | str,
                hidden_size: int | None = None) -> AmpSettings:
    """Autocast dtype, GradScaler and why, for `amp` ("auto"|"bf16"|"fp16"|"off") on `device`; on a
    CPU, auto picks bf16 only on the kind of CPU where notebook 05 measured it faster (bf16
    instructions CPU_BF16_MEASURED) and for a model of hidden_size >= CPU_BF16_MIN_HIDDEN."""
    device = torch.device(device)
    if amp not in AMP_MODES:
        raise ValueError(f"amp={amp!r}; choose one of {AMP_MODES}")
    if amp == "off":
        return AmpSettings(None, False, "amp='off': fp32")
    if amp == "bf16":  # bf16 has fp32's exponent range: no GradScaler needed
        if not bf16_supported(device):
            raise ValueError(f"amp='bf16' requested but {device} does not support bf16 "
                             f"(try amp='fp16' or 'auto')")
        if device.type == "cuda" and not bf16_native(device):  # a T4: torch emulates it
            warnings.warn(f"amp='bf16' on {device}, a GPU without bf16 tensor cores (compute "
                          f"capability < 8.0): it runs emulated, slower than fp32; amp='auto' "
                          f"picks fp16 with a GradScaler there", stacklevel=2)
        return AmpSettings(torch.bfloat16, False, "amp='bf16' requested")
    if amp == "fp16":  # the scaler is what makes fp16 safe; torch.amp has it on CPU and MPS too
        return AmpSettings(torch.float16, True, "amp='fp16' requested: fp16 autocast + GradScaler")
    native = bf16_native(device)  # CUDA: compute capability >= 8.0 (a T4's 7.5 has none); MPS: yes
    if device.type in ("cuda", "mps") and native:
        return AmpSettings(torch.bfloat16, False, f"auto: {device.type} with bf16 -> bf16 autocast")
    if device.type in ("cuda", "mps"):
        return AmpSettings(torch.float16, True,
                           f"auto: {device.type} without bf16 -> fp16 autocast + GradScaler")
    flags = cpu_native_flags(torch.bfloat16) or ()
    measured = native and flags == CPU_BF16_MEASURED
    if measured and hidden_size is not None and hidden_size >= CPU_BF16_MIN_HIDDEN:
        return AmpSettings(torch.bfloat16, False, f"auto: CPU with {flags[0]}, hidden size "
                           f"{hidden_size} >= {CPU_BF16_MIN_HIDDEN} -> bf16 autocast")
    why = "model size not given"
    if not native:
        why = "no bf16 instructions on this CPU: emulated bf16 is slower"
    elif not measured:
        why = (f"bf16 instructions {' '.join(flags) or 'unknown'}: notebook 05 measured bf16 "
               f"faster only with {' '.join(CPU_BF16_MEASURED)} alone (an AMX Xeon: slower)")
    elif hidden_size is not None:
        why = (f"hidden size {hidden_size} < {CPU_BF16_MIN_HIDDEN}, the bar that notebook 05's "
               f"width sweep set on an AVX512-BF16 CPU, where bf16 won every run only from "
               f"{CPU_BF16_MIN_HIDDEN}")
    return AmpSettings(None, False, f"auto: {device.type} -> fp32 ({why})")
