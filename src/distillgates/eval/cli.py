"""``distillgates eval`` and ``distillgates report`` (the lead wires them into the main CLI).

``eval`` evaluates one model on a dataset file (optionally sharded over N processes, with the
determinism check) and writes a validated report; ``report`` validates and renders one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from distillgates.eval.evaluate import build_runner, collect_fingerprints, item_lengths, load_spec_items
from distillgates.eval.report import build_report, read_report, render_report, report_markdown, write_report
from distillgates.eval.runners import run_items
from distillgates.eval.scorer import score
from distillgates.eval.sharding import determinism_check, launch_shards, merge_shards


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval", help="evaluate a model on an eval JSONL and write report.json")
    parser.add_argument("--dataset", required=True, help="eval JSONL (header + items)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (save_pretrained)")
    parser.add_argument("--model", default=None, help="model.pt (runner engine) or HF directory (runner hf)")
    parser.add_argument("--runner", choices=("engine", "hf", "openai"), default="engine")
    parser.add_argument("--base-url", default=None, help="openai runner: e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model-name", default=None, help="openai runner: served model name")
    parser.add_argument("--determinism", action="store_true", help="openai runner: temperature 0, no retries")
    parser.add_argument("--role", default="student", help="key under quality (student/teacher/...)")
    parser.add_argument("--lengths", type=int, nargs="*", default=None, help="enumerated shapes for the shape slice")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-calls", type=int, default=4)
    parser.add_argument("--constrained-tool-calls", action="store_true",
                        help="engine runner: decode tool calls under constrained JSON decoding")
    parser.add_argument("--limit", type=int, default=None, help="first N items only")
    parser.add_argument("--shards", type=int, default=0, help="also run N shard processes and check determinism")
    parser.add_argument("--out", required=True, help="report.json to write")
    parser.set_defaults(func=run_eval)
    return parser


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("report", help="validate and render a report.json")
    parser.add_argument("path")
    parser.add_argument("--markdown", default=None, help="also write the Markdown summary here")
    parser.set_defaults(func=run_report)
    return parser


def spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "dataset": args.dataset, "tokenizer": args.tokenizer, "model": args.model, "runner": args.runner,
        "max_new_tokens": args.max_new_tokens, "max_calls": args.max_calls, "limit": args.limit,
        "constrained_tool_calls": args.constrained_tool_calls,
    }  # fmt: skip
    if args.constrained_tool_calls and args.runner != "engine":
        raise ValueError("--constrained-tool-calls needs the engine runner")
    if args.runner == "openai":
        spec["teacher"] = {"base_url": args.base_url, "model_name": args.model_name, "determinism": args.determinism}
    elif not args.model:
        raise ValueError(f"--model is required for the {args.runner} runner")
    return spec


def run_eval(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    items, tokenizer, dataset_sha = load_spec_items(spec)
    runner = build_runner(spec, tokenizer)
    outputs = run_items(runner, items, max_calls=args.max_calls)
    lengths = args.lengths or None
    metrics = score(items, outputs, shapes=item_lengths(items, tokenizer) if lengths else None, lengths=lengths)
    fingerprints = collect_fingerprints(runner, items, tokenizer, dataset_sha)
    metrics["fingerprints"] = fingerprints
    gate_inputs = None
    if args.shards:
        out = Path(args.out).parent / "shards"
        out.mkdir(parents=True, exist_ok=True)
        spec_path = out / "spec.json"
        spec_path.write_text(json.dumps(spec))
        sharded = merge_shards(launch_shards(spec_path, out, args.shards))
        gate_inputs = {"determinism": determinism_check([i["id"] for i in items], sharded, outputs, args.shards)}
    report = build_report(fingerprints=fingerprints, quality={args.role: metrics}, gate_inputs=gate_inputs)
    write_report(args.out, report)
    from rich.console import Console

    Console().print(render_report(report))
    return 0


def run_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    report = read_report(args.path)
    Console().print(render_report(report))
    if args.markdown:
        from distillgates.io import atomic_write_text

        atomic_write_text(args.markdown, report_markdown(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distillgates-eval")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    add_report_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"distillgates: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
