"""Build the data folder: items (toy generator or the user's own files) -> tokenizer -> train/eval JSONL.

``data.source`` picks where the items come from: ``toy`` (the generator, the default), ``jsonl``
(OpenAI chat-format JSONL) or ``hf`` (the same through Hugging Face ``datasets``: local json/jsonl or
parquet files); :mod:`distillgates.data.openai_format` converts rows. The splits are the given
``eval_path`` file, or a seeded ``eval_fraction`` of ``path``.

The folder is built next to the old one and swapped in only when complete, so a bad row (or any
failure) leaves the previous good ``data/`` as it was.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distillgates.config import Config
from distillgates.data.chat import chat_format, template_chat_format
from distillgates.data.dataset import TOP_UP, DatasetError, write_dataset
from distillgates.data.shapes import bucket_of
from distillgates.io import atomic_write_text, staging_dir, swap_in_dir
from distillgates.tokenizer import (
    chat_template_text,
    encode,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)


@dataclass
class DataBuild:
    """Paths and facts of a data build."""

    tokenizer_dir: Path
    train: Path
    eval: Path
    tokenizer_fingerprint: str
    dataset_sha256: dict[str, str]  # split -> sha256 of the file
    dropped: dict[str, list[str]]  # split -> ids longer than the largest shape (not written)
    shape_counts: dict[str, dict[int, int]] = field(default_factory=dict)  # split -> shape -> items
    skipped: list[dict[str, str]] | None = None  # data.invalid_rows: skip: {"where", "reason"} per skipped row

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


SKIPPED_ROWS = "skipped_rows.jsonl"
"""The data folder's list of skipped rows (``data.invalid_rows: skip``), one ``{"where", "reason"}`` per line."""


def source_items(cfg: Config, skipped: list[dict[str, str]] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``{"train": items, "eval": items}`` from ``cfg.data`` (generated, or read and split).

    Args:
        skipped: collects the rows left out under ``data.invalid_rows: skip`` (required then).

    Raises:
        DatasetError: a bad row (``invalid_rows: error``), or a file whose skipped share exceeds
            ``data.max_skipped_share``.
    """
    data = cfg.data
    if data.source == "toy":
        from distillgates.data.generator import generate_items

        return {
            split: generate_items(data.seed, n, data.locales, split=split, verbose_share=data.verbose_share)
            for split, n in (("train", data.n_train), ("eval", data.n_eval))
        }
    from distillgates.data.openai_format import read_items, split_items

    assert data.path is not None  # DataConfig.__post_init__
    assert (skipped is not None) == (data.invalid_rows == "skip")

    def read(path: str) -> list[dict[str, Any]]:
        if skipped is None:
            return read_items(path, data.source, data.map_schema_types)
        mine: list[dict[str, str]] = []
        items = read_items(path, data.source, data.map_schema_types, skipped=mine)
        skipped.extend(mine)
        if len(mine) > data.max_skipped_share * (len(items) + len(mine)):
            first = mine[0]
            raise DatasetError(f"{path}: <file>: {len(mine)} of {len(items) + len(mine)} rows are invalid, more than "
                               f"data.max_skipped_share {data.max_skipped_share}; the first: {first['where']}: "
                               f"{first['reason']}")  # fmt: skip
        return items

    items = read(data.path)
    if data.eval_path:
        return {"train": items, "eval": read(data.eval_path)}
    train, held_out = split_items(items, data.eval_fraction, data.seed)
    return {"train": train, "eval": held_out}


TOP_UP_TRIES = 200
"""``data.eval_min_per_shape``: generated candidates per wanted item before a shape that too few items fit is an
error (the toy's rarest, 128 tokens, takes ~60)."""


def top_up_eval(cfg: Config, items: list[dict[str, Any]], shape_of: Callable[[dict[str, Any]], int | None]) \
        -> list[dict[str, Any]]:
    """``items`` (the toy's first ``n_eval`` eval items) and, while an enumerated shape holds fewer than
    ``data.eval_min_per_shape`` items that expect a tool call (the items integration F1 and its drift gates are
    over), the next generated eval items that expect one and fit such a shape, in index order, marked
    :data:`TOP_UP`.

    Raises:
        ValueError: a shape still short after ``TOP_UP_TRIES`` candidates per wanted item (naming the setting).
    """
    from distillgates.data.generator import generate_item

    data, lengths = cfg.data, cfg.shapes.lengths
    want = data.eval_min_per_shape
    held = {shape: 0 for shape in lengths}
    for item in items:
        if item["tool_should_be_used"] and (shape := shape_of(item)) is not None:
            held[shape] += 1
    out, index, limit = list(items), data.n_eval, data.n_eval + TOP_UP_TRIES * want * len(lengths)
    while any(n < want for n in held.values()):
        if index >= limit:
            short = {shape: n for shape, n in held.items() if n < want}
            raise ValueError(f"data.eval_min_per_shape: {want}: after {index - data.n_eval} more generated eval items "
                             f"the shapes {short} (shape: tool items) still hold fewer: lower it or change "
                             "shapes.lengths")  # fmt: skip
        item = generate_item(data.seed, index, data.locales, "eval", data.verbose_share)
        index += 1
        if item["tool_should_be_used"] and (shape := shape_of(item)) is not None and held[shape] < want:
            held[shape] += 1
            out.append({**item, TOP_UP: True})
    return out


def input_files(cfg: Config) -> tuple[Path, ...]:
    """The user's files the build reads, data and a ``.jinja`` template (their content is part of the data step's
    fingerprint)."""
    template = cfg.tokenizer.chat_template
    data = tuple(Path(p) for p in (cfg.data.path, cfg.data.eval_path) if cfg.data.source != "toy" and p)
    return (*data, Path(template)) if template and template.endswith(".jinja") else data


def student_tokenizer(cfg: Config, train_items: list[dict[str, Any]]) -> PreTrainedTokenizerFast:
    """``tokenizer.path`` (a Hugging Face tokenizer directory with a chat template, local files only, or a GGUF
    file's), its template replaced by ``tokenizer.chat_template`` when set, or a byte-level BPE trained on the
    train conversations rendered in ``tokenizer.chat_template`` (default ``toy``).
    ``tokenizer.tool_call_format`` is stored with it (``tokenizer_config.json``), so every stage parses
    calls the same way."""
    tcfg = cfg.tokenizer
    if tcfg.path is not None:
        from distillgates.checkpoints import checkpoint_dir

        # the config's template replaces the checkpoint's own (or stands in for a missing one)
        template = chat_template_text(tcfg.chat_template, "tokenizer.chat_template") if tcfg.chat_template else None
        tok = load_tokenizer(checkpoint_dir(tcfg.path), template)
    else:
        fmt = template_chat_format(tcfg.chat_template or "toy")
        texts = (fmt.conversation(item) for item in train_items)
        tok = train_tokenizer(texts, tcfg.vocab_size, tcfg.min_frequency, tcfg.chat_template or "toy")
    if tcfg.tool_call_format is not None:
        tok.init_kwargs["tool_call_format"] = tcfg.tool_call_format
    return tok


def build_data(cfg: Config, out_dir: str | Path) -> DataBuild:
    """Read or generate the items, train the tokenizer on the train conversations, write both splits.

    ``out_dir/tokenizer`` (save_pretrained), ``out_dir/train.jsonl``, ``out_dir/eval.jsonl``.
    Items whose rendered conversation exceeds the largest enumerated shape are dropped (and
    listed in the result): a model never sees a sequence it cannot be exported for.

    Raises:
        DatasetError: a bad row (file, line, field); ``out_dir`` is then left untouched.
    """
    out_dir = Path(out_dir)
    skipped: list[dict[str, str]] | None = [] if cfg.data.invalid_rows == "skip" else None
    splits = source_items(cfg, skipped)
    ids = {split: {item["id"] for item in items} for split, items in splits.items()}
    if overlap := sorted(ids["train"] & ids["eval"]):
        raise DatasetError(f"{cfg.data.eval_path}: id: {len(overlap)} eval ids are training ids, e.g. {overlap[0]!r}")
    tok = student_tokenizer(cfg, splits["train"])
    fmt = chat_format(tok)
    if cfg.data.eval_min_per_shape:  # the tokenizer is the train split's: topping up the eval split leaves it as is
        splits["eval"] = top_up_eval(
            cfg, splits["eval"], lambda item: bucket_of(len(encode(tok, fmt.conversation(item))), cfg.shapes.lengths))
    staging = staging_dir(out_dir, "new-")
    try:
        save_tokenizer(tok, staging / "tokenizer")
        fingerprint = tokenizer_fingerprint(tok)
        shas, dropped, counts = {}, {}, {}
        for split, items in splits.items():
            shapes = [bucket_of(len(encode(tok, fmt.conversation(item))), cfg.shapes.lengths) for item in items]
            dropped[split] = [item["id"] for item, shape in zip(items, shapes) if shape is None]
            counts[split] = {shape: shapes.count(shape) for shape in cfg.shapes.lengths}
            kept = [item for item, shape in zip(items, shapes) if shape is not None]
            shas[split] = write_dataset(staging / f"{split}.jsonl", kept, fingerprint, cfg.data.seed)
        if skipped is not None:
            atomic_write_text(staging / SKIPPED_ROWS, "".join(json.dumps(row) + "\n" for row in skipped))
        swap_in_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return DataBuild(out_dir / "tokenizer", out_dir / "train.jsonl", out_dir / "eval.jsonl", fingerprint, shas,
                     dropped, counts, skipped)  # fmt: skip
