"""Device and mixed-precision choices shared by training and evaluation."""

from __future__ import annotations

import argparse
import contextlib
import platform
from functools import lru_cache
from pathlib import Path

import torch

from .errors import UserError

AMP_CHOICES = ("auto", "bf16", "fp16", "none")


# CPU flags of native bf16 arithmetic: x86 AVX512-BF16 and AMX-BF16, Arm's BF16 extension (as Linux names them).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPUINFO = Path("/proc/cpuinfo")


@lru_cache(maxsize=4)
def cpu_supports_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """True when this CPU has native bf16 arithmetic (a flag of ``NATIVE_BF16_FLAGS`` in ``cpuinfo``); oneDNN's own
    check also says yes for plain AVX512, where emulated bf16 trains at half fp32's speed. False if unreadable."""
    try:
        lines = cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return False
    fields = (ln.partition(":") for ln in lines)
    flags = {f for key, _, value in fields if key.strip() in ("flags", "Features") for f in value.split()}
    return bool(flags & NATIVE_BF16_FLAGS) and torch.backends.mkldnn.is_available()


def device_name(device: torch.device) -> str:
    """The GPU's or the CPU's model name (CPU: with the threads in use), for run records and benchmarks."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.exists() else []
    return f"CPU {names[0] if names else platform.processor()}, {torch.get_num_threads()} threads"


def precision_name(amp_dtype: torch.dtype | None) -> str:
    """How run records name an autocast dtype (``None``, no autocast: ``float32``)."""
    return str(amp_dtype or torch.float32).replace("torch.", "")


def parse_device(text: str | None) -> torch.device:
    """The one device check: ``None``/``'auto'`` is CUDA when available, else CPU; anything else must be a torch
    device that exists on this machine. A ValueError names the fix."""
    if text in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {text!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(f"{device.type} is not available on this machine; use --device cpu or auto")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ValueError(f"{text} does not exist: this machine has {count} {device.type} device(s), "
                         f"{device.type}:0..{device.type}:{count - 1}")
    return device


def device_arg(text: str) -> str:
    """An argparse ``type`` for ``--device``: :func:`parse_device`'s check at parse time."""
    try:
        parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def resolve_device(device: str | None = None) -> torch.device:
    """:func:`parse_device`, its refusal a one-line user error; on CUDA, float32 is made exact (:func:`exact_fp32`)."""
    try:
        found = parse_device(device)
    except ValueError as e:
        raise UserError(f"--device {device}: {e}") from None
    if found.type == "cuda":
        exact_fp32()
    return found


def exact_fp32() -> None:
    """Float32 on CUDA as IEEE float32 (TF32 off for matrix products and cuDNN convolutions), so what is said to run
    in fp32 does, the float32 parts under autocast included. Process-wide, as PyTorch's flags are."""
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"


def fp32_precision(device: torch.device) -> str | None:
    """What float32 matrix products and convolutions run in on ``device``: "ieee", "tf32", or None on a CPU."""
    if device.type != "cuda":
        return None
    parts = {torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision}
    return "tf32" if "tf32" in parts else "ieee"


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype for ``amp`` on ``device``; ``None`` means full fp32. ``auto``: bf16 on GPUs of compute
    capability 8.0+ (``is_bf16_supported`` also says yes where it is emulated) and CPUs with native bf16, fp16 on
    older GPUs, else fp32."""
    if amp not in AMP_CHOICES:
        raise ValueError(f"unknown amp mode {amp!r}; use one of {', '.join(AMP_CHOICES)}")
    if amp == "none":
        return None
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    return torch.bfloat16 if device.type == "cpu" and cpu_supports_bf16() else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype`` on ``device`` (a no-op for None), without its cache of cast weights, which a
    CUDA graph must not record (each weight is cast once per pass anyway)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


def inference_batch_size(device: torch.device) -> int:
    """Default batch of the evaluation passes: 512 on a GPU; 128 on a CPU, where the attention then stays in the
    caches (1.25-1.33x the images/s of 512: ``scripts/bench_models.py --infer-batches 128 256 512``)."""
    return 512 if device.type == "cuda" else 128
