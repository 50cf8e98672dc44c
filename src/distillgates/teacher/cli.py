"""``distillgates teacher {train,eval,serve}`` (the lead wires :func:`add_parser` into the main CLI).

- ``train``: the toy teacher recipe on a dataset directory (``train.jsonl``, ``eval.jsonl``,
  ``tokenizer/``) -> ``save_pretrained`` dir + ``teacher_eval.json``.
- ``eval``: re-score a teacher directory on eval items.
- ``serve``: the loopback OpenAI-compatible server backed by a local teacher (demos, HTTP teacher
  runs against a local model). The server key, if any, is read from an env var, never an argument.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from distillgates.config import load_config


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("teacher", help="train / evaluate / serve the local teacher")
    sub = parser.add_subparsers(dest="teacher_command", required=True)

    train = sub.add_parser("train", help="train the toy teacher (cfg.teacher) and evaluate it on held-out items")
    train.add_argument("config", help="pipeline YAML")
    train.add_argument("--data-dir", required=True, help="dir with train.jsonl, eval.jsonl and tokenizer/")
    train.add_argument("--out", required=True, help="teacher output directory")

    ev = sub.add_parser("eval", help="tool selection / JSON validity of a teacher on eval items")
    ev.add_argument("config", help="pipeline YAML")
    ev.add_argument("--teacher-dir", required=True)
    ev.add_argument("--data", required=True, help="eval JSONL")

    serve = sub.add_parser("serve", help="OpenAI-compatible chat-completions server on 127.0.0.1")
    serve.add_argument("--teacher-dir", required=True)
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", default="toy-teacher")
    serve.add_argument("--api-key-env", default=None, help="env var holding the key clients must send")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from distillgates.teacher.kd import load_items
    from distillgates.teacher.local import LocalTeacher

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.teacher_command == "train":
        from transformers import AutoTokenizer

        from distillgates.teacher.toy import build_toy_teacher

        cfg = load_config(args.config)
        data = Path(args.data_dir)
        tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
        report = build_toy_teacher(
            cfg, tokenizer, load_items(data / "train.jsonl"), load_items(data / "eval.jsonl"), args.out
        )
        print(json.dumps({k: report[k] for k in ("n", "tool_selection", "json_validity", "arg_match_strict")}))
        return 0
    if args.teacher_command == "eval":
        from distillgates.teacher.toy import evaluate_teacher

        metrics = evaluate_teacher(LocalTeacher(args.teacher_dir), load_config(args.config), load_items(args.data))
        print(json.dumps(metrics, indent=2))
        return 0
    from distillgates.teacher.server import TeacherServer

    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    server = TeacherServer(LocalTeacher(args.teacher_dir), port=args.port, api_key=key, model_name=args.model_name)
    print(f"serving {args.model_name} at {server.base_url} (Ctrl-C to stop)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0
