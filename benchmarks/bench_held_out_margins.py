"""How near a model is to a greedy mistake on the held-out references: teacher-forced margins (issue #43).

A student that scores F1 lax 0.965 against its teacher's 1.000 differs from it by two items of 57, too few to
rank two recipes by: one seed's misses are another's near-misses. This diagnostic reads finer. It feeds each eval
item's reference conversation (tool results included) to the model once, teacher-forced, and at every assistant
token takes the margin: the reference token's log-probability less the best other token's. A negative margin is
a token greedy decoding would not write after the reference's own prefix, so an item has one exactly when greedy
decoding leaves its reference (the eval's misses are such items; a divergence the eval accepts, e.g. an argument
alternative, counts here too). Per item: CE over its assistant tokens, wrong tokens, the smallest margin; in all:
mean CE, wrong tokens, items with one, and items whose smallest margin is below 1 and 2 (nats).

Usage (from the repository root; ``RUN_DIR`` a pipeline build with its data, e.g. after ``distillgates eval``)::

    .venv/bin/python benchmarks/bench_held_out_margins.py RUN_DIR RUN_DIR/student/model.pt --out margins.json
    .venv/bin/python benchmarks/bench_held_out_margins.py RUN_DIR RUN_DIR/teacher   # a Hugging Face model dir
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from distillgates.io import atomic_write_json
from distillgates.rundir import RunDir


def load(path: Path) -> Any:
    """A ``model.pt`` of the recipe, or a Hugging Face model directory, as a :class:`Transformer`."""
    from distillgates.hf import load_hf
    from distillgates.model import load_model

    return load_hf(path) if path.is_dir() else load_model(path)


@torch.no_grad()
def margins(run: RunDir, model: Any) -> dict[str, Any]:
    from distillgates.data.chat import chat_format
    from distillgates.train.data import build_row, collate

    tok = run.tokenizer()
    fmt = chat_format(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    model.eval()
    lengths = [2**k for k in range(6, 20) if 2**k < model.config.max_seq_len] + [model.config.max_seq_len]
    items: dict[str, dict[str, Any]] = {}
    for item in run.items("eval"):
        row = build_row(item, tok, lengths)  # padded at the end: a causal model's logits do not see it
        batch = collate([row], pad, fmt.assistant_header_ids, fmt.end_of_turn_id)
        mask = batch.ce_mask[0].bool()
        logp = model(batch.input_ids).float().log_softmax(-1)[0][mask]
        target = batch.targets[0][mask][:, None]
        ref = logp.gather(-1, target)[:, 0]
        margin = ref - logp.scatter(-1, target, float("-inf")).max(-1).values
        items[item["id"]] = {"nll": float(-ref.sum()), "tokens": int(mask.sum()), "wrong": int((margin < 0).sum()),
                             "min_margin": round(float(margin.min()), 4)}  # fmt: skip
    tokens = sum(v["tokens"] for v in items.values())
    summary = {
        "ce": sum(v["nll"] for v in items.values()) / tokens, "tokens": tokens,
        "wrong_tokens": sum(v["wrong"] for v in items.values()),
        "items_wrong": sorted(k for k, v in items.items() if v["wrong"]),
        "items_margin_below_1": sum(v["min_margin"] < 1 for v in items.values()),
        "items_margin_below_2": sum(v["min_margin"] < 2 for v in items.values()),
    }  # fmt: skip
    return {"summary": summary, "items": items}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("model", type=Path, help="a recipe's model.pt, or a Hugging Face model directory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the per-item figures here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = margins(RunDir(args.run_dir), load(args.model))
    print(json.dumps({"model": str(args.model), **result["summary"]}))
    if args.out is not None:
        atomic_write_json(args.out, {"model": str(args.model), **result})


if __name__ == "__main__":
    main()
