"""Peak training memory with and without ``train.loss_chunk`` (the LM head and the losses a chunk of positions at
a time): a SmolLM-135M-shaped student with random weights, or the student step of a real run.

Both arms run the real recipe (:class:`distillgates.train.recipe.Recipe`: CE, process, top-k KD,
length and early-tool losses, AdamW; QAT off) on the same toy rows, the same enumerated shapes and
the same seed; only ``train.loss_chunk`` differs. Each arm runs in its own fresh process (a
process's peak memory cannot be shared), alternating arms for ``--repeats`` rounds. Per arm:

- ``step_peak_mib``: peak resident memory during training steps 2-3 above the resident memory
  before them (the peak is reset through ``/proc/self/clear_refs`` after the first step, which
  allocates AdamW's state); this is what the losses change;
- ``process_peak_mib``: the process's whole peak (model, AdamW state, data and the step);
- ``step_s``: the mean wall seconds of steps 2-3 (the chunked head recomputes each chunk's logits in backward).

    .venv/bin/python benchmarks/bench_loss_memory.py [--chunk 128] [--batch 4] [--repeats 2]

With ``--run-dir RUN --config CONFIG`` the arms are the student step of a finished run (its data, KD set and
teacher, linked into a temporary run directory; the config's model, batch, shapes, QAT schedule and teacher mode:
an online config loads the teacher that scores each batch), built as ``distillgates student`` builds it
(:func:`~distillgates.train.recipe.build_recipe`), ``--steps`` steps each;
per arm the process's peak in setup (the teacher loaded, the student pruned from it), in the steps (the peak
reset after setup) and in cleanup (QAT finalize and probe, ``model.pt``, ``hf/``), and the mean step seconds:

    .venv/bin/python benchmarks/bench_loss_memory.py --run-dir RUN --config examples/gemma3/config.yaml \
        --steps 4 --qat-from 2 --threads 2

Linux only (``/proc``). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SMOLLM_135M = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden=1536,
                   rope_theta=10000.0, tie_embeddings=True)  # fmt: skip  # HuggingFaceTB/SmolLM-135M config.json


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def arm(chunk: int, batch: int, items: int, threads: int) -> dict[str, float]:
    """One arm in this process: set up the recipe, one step, reset the peak, two more steps."""
    from bench_train_throughput import kd_records

    from distillgates.config import ModelConfig, load_config
    from distillgates.data.chat import render_conversation
    from distillgates.data.generator import generate_items
    from distillgates.hardware import peak_rss_bytes, reset_peak_rss
    from distillgates.model import Transformer
    from distillgates.project import EMBEDDED_CONFIG
    from distillgates.tokenizer import train_tokenizer
    from distillgates.train.recipe import Recipe

    torch.set_num_threads(threads)
    cfg = load_config(EMBEDDED_CONFIG)  # the toy config the package ships
    cfg.train.qat.enabled, cfg.train.init_from = False, "scratch"  # random weights: no pruned teacher
    cfg.train.eval_every = cfg.train.ckpt_every = 0
    cfg.train.batch_size, cfg.train.loss_chunk = batch, chunk
    rows = generate_items(0, items)
    tok = train_tokenizer([render_conversation(i) for i in rows], vocab_size=cfg.tokenizer.vocab_size)
    student = ModelConfig(**SMOLLM_135M, max_seq_len=max(cfg.shapes.lengths))  # type: ignore[arg-type]
    torch.manual_seed(0)  # top-k teacher signal from a one-layer model of the same vocabulary (cheap)
    teacher = Transformer(ModelConfig(**{**SMOLLM_135M, "n_layers": 1, "d_model": 64, "n_heads": 2, "n_kv_heads": 1,
                                         "ffn_hidden": 128}, max_seq_len=student.max_seq_len)).eval()  # type: ignore[arg-type]
    records = kd_records(rows, tok, teacher, k=cfg.kd.top_k, max_len=student.max_seq_len)
    del teacher
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Recipe(cfg.train, student, cfg.shapes, tok, rows, [], tmp, kd_records=records, device="cpu",
                        progress=False, speed_prompts=0, max_steps=1)  # fmt: skip
        recipe.setup()
        recipe.train()  # step 1: AdamW state allocated
        before = _status_kib("VmRSS")
        reset_peak_rss()  # the peak from here: VmHWM reset to the current RSS
        recipe.max_steps = 3
        recipe.train()
        step_peak = peak_rss_bytes() / 1024 - before
        log = [json.loads(line) for line in (Path(tmp) / "train_log.jsonl").read_text().splitlines()]
        step_s = statistics.mean(r["step_s"] for r in log if r.get("step") in (2, 3) and "step_s" in r)
    return {"chunk": chunk, "step_peak_mib": step_peak / 1024, "process_peak_mib": peak_rss_bytes() / 2**20,
            "rss_before_steps_mib": before / 1024, "step_s": step_s}


def run_arm(chunk: int, run_dir: Path, config: Path, steps: int, qat_from: int | None,
            threads: int) -> dict[str, float]:  # fmt: skip
    """One arm on a finished run's student step (module docstring), in this process."""
    from distillgates.config import load_config
    from distillgates.hardware import peak_rss_bytes, reset_peak_rss
    from distillgates.pipeline import scoring_teacher
    from distillgates.rundir import RunDir
    from distillgates.train.recipe import build_recipe

    torch.set_num_threads(threads)
    cfg = load_config(config)
    cfg.train.loss_chunk, cfg.train.eval_every, cfg.train.ckpt_every = chunk, 0, 0
    if qat_from is not None:  # QAT from this step on (the schedule's other steps unchanged)
        cfg.train.qat.start_fraction = qat_from / cfg.train.steps
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("data", "kd", "teacher", "cache"):  # the run's inputs; the student step writes student/
            if (run_dir / name).exists():
                (Path(tmp) / name).symlink_to((run_dir / name).resolve())
        teacher = scoring_teacher(cfg, RunDir(tmp), "student")  # online / on-policy configs: the teacher's forward
        recipe = build_recipe(cfg, "student", tmp, teacher=teacher, max_steps=steps, progress=False)
        reset_peak_rss()
        recipe.setup()
        setup_peak = peak_rss_bytes()
        reset_peak_rss()
        recipe.train()
        steps_peak = peak_rss_bytes()
        reset_peak_rss()
        recipe.cleanup()
        log = [json.loads(line) for line in (Path(tmp) / "student" / "train_log.jsonl").read_text().splitlines()]
    return {"chunk": chunk, "setup_peak_mib": setup_peak / 2**20, "steps_peak_mib": steps_peak / 2**20,
            "cleanup_peak_mib": peak_rss_bytes() / 2**20,
            "step_s": statistics.mean(r["step_s"] for r in log if "step_s" in r)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=128, help="train.loss_chunk of the chunked arm")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, default=None, help="a finished run: measure its student step")
    parser.add_argument("--config", type=Path, default=None, help="the run's config (with --run-dir)")
    parser.add_argument("--steps", type=int, default=4, help="steps per arm (with --run-dir)")
    parser.add_argument("--qat-from", type=int, default=None, help="QAT from this step (with --run-dir)")
    parser.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one arm
    args = parser.parse_args()
    real = args.run_dir is not None
    if real and args.config is None:
        parser.error("--run-dir needs --config")
    if args.arm is not None:
        result = (run_arm(args.arm, args.run_dir, args.config, args.steps, args.qat_from, args.threads) if real
                  else arm(args.arm, args.batch, args.items, args.threads))  # fmt: skip
        print(json.dumps(result))
        return
    results: dict[int, list[dict[str, float]]] = {0: [], args.chunk: []}
    for _ in range(args.repeats):
        for chunk in (0, args.chunk):  # alternating arms, each in a fresh process
            cmd = [sys.executable, __file__, "--arm", str(chunk), "--threads", str(args.threads)]
            cmd += (["--run-dir", str(args.run_dir), "--config", str(args.config), "--steps", str(args.steps)]
                    + (["--qat-from", str(args.qat_from)] if args.qat_from is not None else []) if real
                    else ["--batch", str(args.batch), "--items", str(args.items)])  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[chunk].append(json.loads(out.strip().splitlines()[-1]))
    keys = [k for k in results[0][0] if k != "chunk"]
    summary = {chunk: {key: statistics.median(r[key] for r in runs) for key in keys} for chunk, runs in results.items()}
    plain, chunked = summary[0], summary[args.chunk]
    what = f"SmolLM-135M shape, vocab {SMOLLM_135M['vocab_size']}, batch {args.batch}, toy shapes"
    if real:
        qat = f", QAT from step {args.qat_from}" if args.qat_from is not None else ""
        what = f"student step of {args.run_dir} ({args.config}), {args.steps} steps{qat}"
    print(f"{what}, median of {args.repeats} fresh processes per arm")
    print(f"{'':26}{'unchunked':>12}{f'chunk {args.chunk}':>12}{'ratio':>8}")
    for key in keys:
        digits = 2 if key == "step_s" else 0
        print(f"{key:26}{plain[key]:12.{digits}f}{chunked[key]:12.{digits}f}{chunked[key] / plain[key]:8.2f}")
    print(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                      "runs": {str(k): v for k, v in results.items()}}))


if __name__ == "__main__":
    main()
