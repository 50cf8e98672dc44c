"""``distillgates serve``: the loopback OpenAI-compatible server backed by a local teacher.

For demos and for API-teacher runs against a local model: point ``teacher.api.base_url`` of a
config with ``teacher.kind: openai`` at it. The server key, if any, is read from an env var,
never an argument.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a local teacher as an OpenAI-compatible chat-completions API on 127.0.0.1",
        description="Serve a save_pretrained teacher directory (e.g. runs/toy/teacher) at "
        "http://127.0.0.1:PORT/v1 with top-k logprobs, for configs with teacher.kind: openai.",
    )
    parser.add_argument("--teacher-dir", default="runs/toy/teacher", help="save_pretrained teacher dir")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", default="toy-teacher", help="model name clients send")
    parser.add_argument("--api-key-env", default=None, help="env var holding the key clients must send")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from distillgates.teacher.local import LocalTeacher
    from distillgates.teacher.server import TeacherServer

    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    server = TeacherServer(LocalTeacher(args.teacher_dir), port=args.port, api_key=key, model_name=args.model_name)
    print(f"serving {args.model_name} at {server.base_url} (Ctrl-C to stop)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0
