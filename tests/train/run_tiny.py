"""Subprocess entry for trainer tests: ``python -m tests.train.run_tiny ROOT OUT [json overrides]``.

Run from the repository root as a module (it imports the test conftests), in one process or under
``torchrun -m`` (DDP); artefacts in ROOT must already exist (the test fixture builds them). Prints
``step N loss X`` lines (rank 0) as it trains.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from distillgates.train.recipe import train_student  # noqa: E402

from .conftest import build_artifacts, tiny_config  # noqa: E402


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    overrides = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    max_steps = overrides.pop("max_steps", None)  # stop early (an interrupted run), schedule unchanged
    art = build_artifacts(root)
    cfg = tiny_config(len(art["tokenizer"]), **overrides)
    train_student(cfg, "student", out, kd_path=art["kd_path"], tokenizer=art["tokenizer"],
                  train_items=art["train"], eval_items=art["eval"], progress=False, device="cpu",
                  max_steps=max_steps)


if __name__ == "__main__":
    main()
