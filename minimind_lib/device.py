"""Which device the course runs on, and what that device can honestly do (bf16, fp16, memory)."""

from __future__ import annotations

import os
import platform
from functools import lru_cache

import torch

from .profiles import Profile, get_profile


def get_device(prefer: str | None = None) -> torch.device:
    """The best device available: cuda > mps > cpu (or `prefer`, or env MINIMIND_DEVICE)."""
    prefer = prefer or os.environ.get("MINIMIND_DEVICE")
    if prefer:
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU's model name as the OS reports it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 instructions (AVX512-BF16, AMX or Arm BF16), so bf16 autocast can be fast."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.machine() == "arm64"  # Apple silicon (M2 and later) has bf16; a guess we state as such
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def device_name(device: torch.device) -> str:
    """Human-readable name of the device (GPU model or CPU model)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple {platform.machine()} (MPS)"
    return cpu_name()


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 autocast runs on this device at all (it may still be slow: see bf16_native)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type in ("cpu", "mps")


def bf16_native(device: torch.device) -> bool:
    """Whether bf16 runs in hardware here; on a CPU without it, autocast emulates bf16 and is slower than fp32."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return major >= 8  # Ampere and later have bf16 tensor cores
    if device.type == "mps":
        return bf16_supported(device)
    return cpu_has_native_bf16()


def fp16_supported(device: torch.device) -> bool:
    """Whether fp16 autocast is worth using here (GPUs; CPUs emulate it slowly)."""
    return device.type in ("cuda", "mps")


def total_memory_bytes(device: torch.device) -> int:
    """Total memory of the device: the GPU's memory on CUDA, the machine's RAM otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def device_report(device: torch.device | None = None, profile: Profile | None = None) -> dict:
    """Facts about the device and the selected profile, as a JSON-ready dict."""
    device = device or get_device()
    profile = profile or get_profile()
    return {
        "device": device.type,
        "device_name": device_name(device),
        "profile": profile.name,
        "torch": torch.__version__,
        "bf16_supported": bf16_supported(device),
        "bf16_native": bf16_native(device),
        "fp16_supported": fp16_supported(device),
        "total_memory_bytes": total_memory_bytes(device),
        "cpu_threads": torch.get_num_threads(),
    }


def describe(profile: Profile | None = None, device: torch.device | None = None) -> str:
    """One line naming device and profile, for a notebook's first cell and every figure title."""
    device = device or get_device()
    profile = profile or get_profile()
    return f"{device.type} ({device_name(device)}), profile={profile.name}, torch {torch.__version__.split('+')[0]}"


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued kernels (GPUs run asynchronously: time only after this)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def memory_fraction_for(target_bytes: int, total_bytes: int) -> float:
    """The fraction of a device's memory that leaves `target_bytes` usable (for set_per_process_memory_fraction)."""
    if target_bytes <= 0 or total_bytes <= 0:
        raise ValueError(f"memory sizes must be positive, got target={target_bytes} total={total_bytes}")
    if target_bytes > total_bytes:
        raise ValueError(
            f"cannot emulate {target_bytes / 2**30:.1f} GiB on a device with {total_bytes / 2**30:.1f} GiB"
        )
    return target_bytes / total_bytes


def emulate_gpu_memory(target_bytes: int, device: torch.device | None = None) -> float | None:
    """Cap this process's CUDA memory at `target_bytes` (a smaller GPU on a bigger one); None on non-CUDA devices."""
    device = device or get_device()
    if device.type != "cuda":
        return None  # on CPU, minimind_lib.memory.MemoryMeter(budget_bytes=...) imposes a budget instead
    if device.index is None:  # set_per_process_memory_fraction needs an index: "cuda" is the current device
        device = torch.device("cuda", torch.cuda.current_device())
    fraction = memory_fraction_for(target_bytes, total_memory_bytes(device))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
