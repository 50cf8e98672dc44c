"""Model settings that name a file rather than a Hugging Face checkpoint directory: GGUF files, converted once.

Kept apart from :mod:`distillgates.hf` (which imports the model): the data step reads a GGUF file's tokenizer
through here, and its code fingerprint must not cover the model's code.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from distillgates.config import sha256_json
from distillgates.io import sha256_file, staging_dir


def cache_root() -> Path:
    """Where converted inputs are kept across runs: ``$DISTILLGATES_CACHE``, else ``$XDG_CACHE_HOME/distillgates``
    (``~/.cache/distillgates``)."""
    if root := os.environ.get("DISTILLGATES_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "distillgates"


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def checkpoint_dir(path: str | Path) -> Path:
    """The Hugging Face checkpoint directory of a model setting: ``path`` itself, or for a ``.gguf`` file its
    dequantised conversion (:func:`gguf_checkpoint`)."""
    return gguf_checkpoint(path) if is_gguf(path) else Path(path)


@functools.lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file, hashed once per process while its size and modification time stay the same (a run asks
    for the teacher's directory several times; a GGUF file is hundreds of MB)."""
    return sha256_file(path)


def gguf_checkpoint(file: str | Path) -> Path:
    """A GGUF file as a normal Hugging Face checkpoint directory (float32 safetensors, its tokenizer and chat
    template), converted once by ``transformers`` (dequantised, through the ``gguf`` package) into
    :func:`cache_root` ``/gguf/<name>-<sha256 of the file and the transformers version>``.

    ``from_pretrained(..., gguf_file=...)`` gives a model ``save_pretrained`` refuses ("quantized with gguf"):
    its weights are already dequantised, so the GGUF quantizer and ``quantization_config`` are dropped and what
    is saved is an ordinary checkpoint that every step loads like any other.

    Raises:
        FileNotFoundError: no such file.
        ImportError: the ``gguf`` package is missing (the ``gguf`` extra: ``pip install 'distillgates[gguf]'``).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such GGUF file")
    stat = file.stat()
    key = sha256_json({"file": _digest(str(file.resolve()), stat.st_size, stat.st_mtime_ns),
                       "transformers": transformers.__version__})[:16]
    out = cache_root() / "gguf" / f"{file.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError as err:
        raise ImportError(f"{file}: reading a GGUF file needs the gguf package (pip install 'distillgates[gguf]')") \
            from err  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    # dequantised on load: nothing of GGUF's quantization is left to serialize
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = staging_dir(out)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)  # a concurrent conversion that finished first wins; this one is the same
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
