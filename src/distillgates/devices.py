"""The device the pipeline trains and runs its local teacher on (the config's ``device``), and the autocast there.

``auto`` takes CUDA, then Apple's MPS, then the CPU. A device named in the config that torch does not see is an
error, never a silent fallback to the CPU. ``mixed_precision: auto`` autocasts to bf16 where the device computes
bf16 natively (CUDA compute capability 8 and up, MPS on macOS 14 and up) and computes float32 elsewhere: the
checkpoints, the KD set and the figures then differ between devices by float noise only.
"""

from __future__ import annotations

import torch


def resolve_device(name: str = "auto") -> str:
    """``auto`` -> ``cuda``, ``mps`` or ``cpu`` (the first torch sees); any other name is checked and returned."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name.startswith("cuda"):
        index = int(name.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"device: {name!r}, but torch {torch.__version__} sees "
                             f"{torch.cuda.device_count()} CUDA device(s); use auto or cpu")  # fmt: skip
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device: 'mps', but torch {torch.__version__} sees no MPS device; use auto or cpu")
    return name


def bf16_native(device: str) -> bool:
    """Whether ``device`` computes bf16 natively (the ``auto`` precision autocasts to it there)."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device == "mps" and torch.backends.mps.is_macos_or_newer(14, 0)


def autocast_dtype(device: str, mixed_precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype of ``mixed_precision`` (auto/no/bf16/fp16) on ``device``; None: float32.

    ``fp16`` on the CPU is float32 (no fp16 CPU autocast); ``bf16`` is honoured everywhere it is asked for.
    """
    if mixed_precision == "auto":
        return torch.bfloat16 if bf16_native(device) else None
    if mixed_precision == "bf16":
        return torch.bfloat16
    if mixed_precision == "fp16" and device != "cpu":
        return torch.float16
    return None
