"""Build the toy data end to end: items -> tokenizer -> train/eval JSONL with headers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from distillgates.config import Config
from distillgates.data.chat import render_conversation
from distillgates.data.dataset import write_dataset
from distillgates.data.generator import generate_items
from distillgates.data.shapes import bucket_of
from distillgates.tokenizer import encode, save_tokenizer, tokenizer_fingerprint, train_tokenizer


@dataclass
class ToyData:
    """Paths and facts of a toy data build."""

    tokenizer_dir: Path
    train: Path
    eval: Path
    tokenizer_fingerprint: str
    dataset_sha256: dict[str, str]  # split -> sha256 of the file
    dropped: dict[str, list[str]]  # split -> ids longer than the largest shape (not written)
    shape_counts: dict[str, dict[int, int]] = field(default_factory=dict)  # split -> shape -> items


def build_toy_data(cfg: Config, out_dir: str | Path) -> ToyData:
    """Generate items, train the tokenizer on the train conversations, write both splits.

    ``out_dir/tokenizer`` (save_pretrained), ``out_dir/train.jsonl``, ``out_dir/eval.jsonl``.
    Items whose rendered conversation exceeds the largest enumerated shape are dropped (and
    listed in the result): a model never sees a sequence it cannot be exported for.
    """
    out_dir = Path(out_dir)
    data = cfg.data
    splits = {
        "train": generate_items(data.seed, data.n_train, data.locales, split="train", verbose_share=data.verbose_share),
        "eval": generate_items(data.seed, data.n_eval, data.locales, split="eval", verbose_share=data.verbose_share),
    }
    tok = train_tokenizer(
        (render_conversation(item) for item in splits["train"]), cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency
    )
    tokenizer_dir = save_tokenizer(tok, out_dir / "tokenizer")
    fingerprint = tokenizer_fingerprint(tok)
    shas, dropped, counts = {}, {}, {}
    for split, items in splits.items():
        shapes = [bucket_of(len(encode(tok, render_conversation(item))), cfg.shapes.lengths) for item in items]
        dropped[split] = [item["id"] for item, shape in zip(items, shapes) if shape is None]
        counts[split] = {shape: shapes.count(shape) for shape in cfg.shapes.lengths}
        kept = [item for item, shape in zip(items, shapes) if shape is not None]
        shas[split] = write_dataset(out_dir / f"{split}.jsonl", kept, fingerprint, data.seed)
    return ToyData(tokenizer_dir, out_dir / "train.jsonl", out_dir / "eval.jsonl", fingerprint, shas, dropped, counts)
