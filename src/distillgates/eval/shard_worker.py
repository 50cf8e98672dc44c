"""One rank of a sharded eval: ``python -m distillgates.eval.shard_worker SPEC OUT_DIR``.

Rank and world size come from ``RANK``/``WORLD_SIZE`` (set by :func:`launch_shards` or by
``torchrun --nproc-per-node N -m distillgates.eval.shard_worker SPEC OUT_DIR``). Writes
``OUT_DIR/shard-<rank>-of-<n>.jsonl`` atomically.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from distillgates.eval.evaluate import run_spec
from distillgates.eval.sharding import shard_path, write_outputs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m distillgates.eval.shard_worker SPEC_JSON OUT_DIR", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with open(args[0]) as f:
        spec = json.load(f)
    torch.set_num_threads(int(spec.get("threads", 1)))  # the unsharded run's count: the same kernels
    outputs = run_spec(spec, rank, world_size)
    write_outputs(shard_path(args[1], rank, world_size), outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
