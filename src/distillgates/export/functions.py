"""Names of the exported package and its functions: one owner, light (no coremltools import), so the
checklist and the runtime can import it.

The export writes one multifunction package, ``model.mlpackage``: a static ``prefill_<L>`` function
per enumerated prompt length ``L``, and ``decode`` (the default function); with ``export.target: both``
also ``model.aimodel``, Core AI's asset with the same functions (with ``coreai``, the asset alone).
"""

from __future__ import annotations

PACKAGE = "model"  # the package's name in contract.json; its file is ``model.mlpackage``
DECODE = "decode"
ASSET = f"{PACKAGE}.aimodel"  # the Core AI asset (export.target both or coreai)
# what gate_inputs.coreai_parity measured: the saved asset itself, every function, run by Core AI's runtime
COREAI_SOURCE = "model.aimodel run by Core AI's runtime (coreai-core; on Linux its reference runtime) vs eager PyTorch"


def prefill_function(length: int) -> str:
    """The function of the package that prefills a prompt padded to ``length`` tokens."""
    return f"prefill_{length}"


def function_names(lengths: list[int]) -> list[str]:
    """Every function of the package, in the package's order: one prefill per length, then decode."""
    return [prefill_function(n) for n in sorted(lengths)] + [DECODE]


def function_kind(name: str) -> str:
    """``prefill`` or ``decode``: which wrapper (inputs, logits semantics) a function was converted from."""
    return "decode" if name == DECODE else "prefill"
