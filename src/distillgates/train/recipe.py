"""The distillation recipe (torchtune style: ``setup -> train -> cleanup``), YAML-driven.

One recipe serves one CPU process and ``torchrun`` on many GPUs: under ``torchrun``
(``WORLD_SIZE > 1``) it joins the process group (gloo on CPU, NCCL on CUDA), wraps the model
in DDP (or FSDP2 ``fully_shard`` when ``train.fsdp``), and each rank takes its slice of every
global batch, so the loss curve is the single-process one up to float reduction order.

Design choices:
- **Exact resume.** A step is a pure function of (weights, optimizer, scheduler, RNG, step):
  the sampler derives the batch from the step, the LR schedule is a ``LambdaLR`` of the step,
  QAT switches on at a step, and a checkpoint holds all of it (plus QAT observers and EMA),
  written atomically with a checksum (:func:`distillgates.io.save_checksummed`). On CPU a run
  killed and resumed ends bit-for-bit where an uninterrupted run does; the scalar log is cut
  back to the checkpoint so no step appears twice.
- **Teacher** offline (top-k KD set, :func:`distillgates.losses.kd_loss_topk`) or online
  (a teacher forward per batch, dense :func:`~distillgates.losses.kd_loss_dense`).
- **Latency losses.** The length loss needs to know whether the student *covers* the item; we
  use its teacher-forced argmax predictions over the assistant turns as the proxy for its
  output (no generation in the loop) and the scorer's coverage check.
- **On-policy** (``train.on_policy``, :mod:`distillgates.train.on_policy`): on a share of the steps the
  student samples its batch's conversations and learns the teacher's dense distribution on its own tokens
  (generalized JSD); the teacher is then needed as in online mode.
- **Late QAT** (:mod:`distillgates.train.qat`) for the last ``1 - start_fraction`` of steps at
  ``lr * lr_scale``; a probe writes ``qat_probe.json``.
- **Averaged weights** (``ema_decay``, off by default): an exponential moving average of the weights
  (``AveragedModel``) over the steps before QAT, which the model takes when QAT starts (or at the end). On the toy
  it moved the worst student seed's F1 lax 0.949 -> 0.958 and left a good one as it was (docs/benchmarks.md 11.1).
- Validation every ``eval_every`` steps: CE/KD per enumerated shape plus TTFT/TPS proxies of
  the PyTorch engine (``export=False``, tagged with the hardware key).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from distillgates import losses
from distillgates.config import Config, ModelConfig, ShapesConfig, SpeedConfig, TrainConfig, load_config, to_dict
from distillgates.data.chat import chat_format
from distillgates.data.shapes import ShapeSampler
from distillgates.devices import autocast_dtype, resolve_device
from distillgates.hf import save_hf
from distillgates.io import atomic_write_json, atomic_write_text, load_checksummed, save_checksummed
from distillgates.model import Transformer, save_model
from distillgates.rundir import RunDir
from distillgates.train.data import Batch, Row, build_row, collate, read_kd_set
from distillgates.train.on_policy import on_policy_step, sample_rows
from distillgates.train.qat import QAT, probe
from distillgates.train.schedule import warmup_cosine

CKPT_NAME = "checkpoint.pt"
HF_DIR_NAME = "hf"  # the trained model in Hugging Face format (RunDir.hf_model_dir)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> Dist:
    """Join the ``torchrun`` process group when ``WORLD_SIZE > 1`` (gloo on CPU, NCCL on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def lr_lambda(cfg: TrainConfig) -> Any:
    """:func:`~distillgates.train.schedule.warmup_cosine` as a ``LambdaLR`` factor, times ``qat.lr_scale``
    once QAT starts."""
    qat_start = qat_start_step(cfg)

    def factor(step: int) -> float:
        f = warmup_cosine(step, peak=1.0, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                          min_lr_ratio=cfg.min_lr_ratio)  # fmt: skip
        if qat_start is not None and step >= qat_start:
            f *= cfg.qat.lr_scale
        return f

    return factor


def qat_start_step(cfg: TrainConfig) -> int | None:
    return int(cfg.steps * cfg.qat.start_fraction) if cfg.qat.enabled else None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int, deterministic: bool, device: str) -> None:
    """Seed every RNG; in deterministic mode on CUDA also pin deterministic kernels.

    CPU kernels used here are deterministic already, and ``use_deterministic_algorithms``
    costs seconds of imports (it loads ``torch._dynamo``), so it is only switched on for CUDA.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic and device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


class Recipe:
    """``setup() -> train() -> cleanup()``; see the module docstring.

    Args:
        train_cfg: the ``train:`` section (or ``drafter_train:``).
        model_cfg: the student (or drafter) architecture.
        shapes: enumerated shapes and production mix (drives the Dirichlet shape sampler).
        tokenizer: ``PreTrainedTokenizerFast`` of the run.
        train_items, eval_items: dataset items.
        out_dir: where checkpoints, the log, the model and the QAT probe go.
        kd_records: offline KD records by item id (``teacher_mode: offline``).
        teacher: what scores the batches (``teacher_mode: online``, on-policy): a
            :class:`~distillgates.teacher.local.LocalTeacher`, an HF causal LM, a :class:`Transformer` or a callable
            ``input_ids (B, T) -> logits (B, T, V)`` (:func:`teacher_fn`).
        init_teacher: the teacher as a :class:`Transformer` (``init_from: teacher``).
        init_model: the pretrained model itself (``init_from: hf:<dir>``), trained in place; its
            config must be ``model_cfg``.
        device: ``auto``/``cpu``/``cuda``/``cuda:<n>``/``mps`` (:func:`distillgates.devices.resolve_device`).
        max_steps: stop early after this many steps (tests, time-boxed runs); the schedule still
            follows ``train_cfg.steps``.
        progress: show a ``rich`` progress bar (rank 0).
    """

    def __init__(
        self,
        train_cfg: TrainConfig,
        model_cfg: ModelConfig,
        shapes: ShapesConfig,
        tokenizer: Any,
        train_items: list[dict[str, Any]],
        eval_items: list[dict[str, Any]],
        out_dir: str | Path,
        kd_records: dict[str, dict[str, Any]] | None = None,
        teacher: Any = None,
        device: str = "auto",
        init_teacher: Transformer | None = None,
        init_model: Transformer | None = None,
        max_steps: int | None = None,
        progress: bool = True,
        speed_prompts: int = 4,
        qat_int4_block: int | None = None,
    ) -> None:
        self.cfg, self.model_cfg, self.shapes = train_cfg, model_cfg, shapes
        self.tokenizer, self.train_items, self.eval_items = tokenizer, train_items, eval_items
        self.out_dir = Path(out_dir)
        self.kd_records = kd_records
        self.teacher: Any = None if teacher is None else teacher_fn(teacher, split_head=bool(train_cfg.loss_chunk))
        self.device = resolve_device(device)
        self.max_steps = max_steps
        self.progress = progress
        self.speed_prompts = speed_prompts
        self.qat_int4_block = qat_int4_block  # QAT grid: int4 per block of this many inputs, None: int8 per channel
        if train_cfg.teacher_mode == "offline" and kd_records is None and train_cfg.kd.weight > 0:
            raise ValueError("teacher_mode 'offline' needs a KD set (kd_path); got none")
        if train_cfg.teacher_mode == "online" and teacher is None and train_cfg.kd.weight > 0:
            raise ValueError("teacher_mode 'online' needs a teacher; got none")
        if train_cfg.on_policy.share > 0 and (teacher is None or train_cfg.kd.weight <= 0):
            raise ValueError("train.on_policy needs a teacher that scores the student's tokens (a local teacher of the "
                             "student's vocabulary) and kd.weight > 0")
        if train_cfg.init_from == "teacher" and init_teacher is None:
            raise ValueError("train.init_from 'teacher' needs the teacher model; got none")
        if train_cfg.pretrained is not None and (init_model is None or init_model.config != model_cfg):
            raise ValueError(f"train.init_from {train_cfg.init_from!r} needs the converted checkpoint as init_model")
        self.init_teacher, self.init_model = init_teacher, init_model

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.cfg
        self.dist = init_distributed(self.device)
        if self.device.startswith("cuda"):
            self.device = f"cuda:{self.dist.local_rank}"
            torch.cuda.set_device(self.device)
        seed_everything(cfg.seed, cfg.deterministic, self.device)
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        fmt = chat_format(tok)
        self.assistant_id = fmt.assistant_header_ids  # the tokens that open an assistant turn (toy: one)
        self.end_id = fmt.end_of_turn_id
        early_n = cfg.early_tool.first_n_tokens if cfg.early_tool.weight > 0 else 0
        kd = self.kd_records if cfg.teacher_mode == "offline" else None
        self.rows = [
            build_row(item, tok, self.shapes.lengths, (kd or {}).get(item["id"]), early_n, cfg.length.mask_excess)
            for item in self.train_items
        ]
        missing = sum(1 for item in self.train_items if kd is not None and item["id"] not in kd)
        if kd is not None and missing == len(self.train_items):
            raise ValueError("no training item has a KD record (ids of the KD set and the dataset differ)")
        self.eval_rows = [build_row(item, tok, self.shapes.lengths) for item in self.eval_items]
        per_step = self.dist.world * cfg.grad_accum
        if cfg.batch_size % per_step:
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by world_size*grad_accum = {per_step}")
        # batch_at(step) is a pure function of (seed, step): the data position is the step itself
        self.sampler = ShapeSampler([r.length for r in self.rows], self.shapes, cfg.batch_size, cfg.steps, cfg.seed)
        init = self._teacher_layers() if cfg.init_from == "teacher" else None
        if init is not None:  # the student attends as the teacher's kept layers did (Gemma 3's sliding windows)
            from distillgates.train.init import kept_layer_types

            assert self.init_teacher is not None
            self.model_cfg = kept_layer_types(self.model_cfg, self.init_teacher.config, init["layers"])
        self.model = self.init_model if self.init_model is not None else Transformer(self.model_cfg)
        if not (self.out_dir / CKPT_NAME).exists():  # a resume loads its own
            if init is not None:
                self._init_from_teacher(init)
            elif cfg.pretrained is not None and self.dist.main:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_json(self.out_dir / "init.json", {"from": cfg.init_from})
        self.model.to(self.device)
        if cfg.fsdp and self.dist.world > 1:
            if cfg.qat.enabled:
                raise ValueError("train.fsdp with train.qat.enabled is not supported: QAT swaps modules after sharding")
            from torch.distributed.fsdp import fully_shard

            # shard before building the optimizer: fully_shard replaces the parameters (DTensors)
            fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.qat: QAT | None = None
        self.qat_reference: Transformer | None = None
        self.ema = (AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay))
                    if cfg.ema_decay else None)  # until QAT starts; None after
        self.step = 0
        self.log_path = self.out_dir / "train_log.jsonl"
        self.ckpt_path = self.out_dir / CKPT_NAME
        if self.ckpt_path.exists():
            self._resume()
        elif self.dist.main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.log_path, "")
        self.init_teacher = None  # its layers are copied: a Gemma 3 270M teacher is 1 GiB the steps do not need
        self._wrap()

    def _teacher_layers(self) -> dict[str, Any]:
        """Which teacher blocks the depth-pruned student keeps (:mod:`distillgates.train.init`): ``init.json``'s
        choice on a resume, else ``train.init_layers`` or the most influential blocks on the first 32 rows."""
        from distillgates.train.init import block_influence, select_layers

        assert self.init_teacher is not None
        if (self.out_dir / CKPT_NAME).exists() and (self.out_dir / "init.json").exists():
            return json.loads((self.out_dir / "init.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]
        probe_ids = [torch.tensor([r.ids]) for r in self.rows[:32]]
        influence = block_influence(self.init_teacher, probe_ids)
        layers = self.cfg.init_layers or select_layers(influence, self.model_cfg.n_layers)
        return {"from": "teacher", "layers": list(layers), "block_influence": influence, "probe_items": len(probe_ids)}

    def _init_from_teacher(self, init: dict[str, Any]) -> None:
        """Depth-pruned teacher init of the kept blocks ``init["layers"]``; the choice goes to ``init.json``."""
        from distillgates.train.init import init_from_teacher

        assert self.init_teacher is not None
        init_from_teacher(self.model, self.init_teacher, init["layers"])
        if self.dist.main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.out_dir / "init.json", init)

    def _wrap(self) -> None:
        """The module the training forward calls: QAT graph or model, under DDP/FSDP if distributed; with
        ``train.loss_chunk`` it returns the final hidden states and the head's weight (:meth:`compute_loss`)."""
        split = bool(self.cfg.loss_chunk)
        module: Any = self.qat.training_forward(split) if self.qat is not None else self.model
        if split and self.qat is None:
            module = _HeadSplit(module)
        if self.dist.world > 1 and not self.cfg.fsdp:  # FSDP sharded the model at setup
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.dist.local_rank] if self.device != "cpu" else None
            module = DistributedDataParallel(module, device_ids=ids)
        self.forward_module = module

    def _start_qat(self) -> None:
        self._take_ema()
        self.qat_reference = copy.deepcopy(self.model).eval()
        self.qat = QAT(self.model, ema=self.cfg.qat.ema, int4_block=self.qat_int4_block)

    def _take_ema(self) -> None:
        """The model takes the moving average's weights (in place: the optimizer keeps its parameters)."""
        if self.ema is not None:
            with torch.no_grad():
                for p, averaged in zip(self.model.parameters(), self.ema.module.parameters()):
                    p.copy_(averaged)
            self.ema = None

    # ------------------------------------------------------------------ checkpoints

    @property
    def _sharded(self) -> bool:
        return self.cfg.fsdp and self.dist.world > 1

    def _model_state(self) -> dict[str, Any]:
        """The full (unsharded) model state; under FSDP a collective every rank must call."""
        if not self._sharded:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _optimizer_state(self) -> dict[str, Any]:
        if not self._sharded:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def _checkpoint(self) -> None:
        model_state, optimizer_state = self._model_state(), self._optimizer_state()  # collectives under FSDP
        if not self.dist.main:
            return
        state = {
            "step": self.step,
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "qat": self.qat.state_dict() if self.qat is not None else None,
            "qat_reference": self.qat_reference.state_dict() if self.qat_reference is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "train_config": to_dict(self.cfg),
            "model_config": to_dict(self.model_cfg),
        }
        save_checksummed(state, self.ckpt_path)

    def _resume(self) -> None:
        state = load_checksummed(self.ckpt_path, map_location=self.device)
        if state["model_config"] != to_dict(self.model_cfg):
            raise ValueError(f"{self.ckpt_path}: checkpoint was written for another model config")
        if self._sharded:  # every rank reads the full state and keeps its shards
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, state["model"], options=options)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if self.ema is not None:  # None in the checkpoint: QAT had started (or it was written without an average)
            if state.get("ema") is None:
                self.ema = None
            else:
                self.ema.load_state_dict(state["ema"])
        if state["qat"] is not None:
            self.qat_reference = Transformer(self.model_cfg).to(self.device)
            self.qat_reference.load_state_dict(state["qat_reference"])
            self.qat_reference.eval()
            self.qat = QAT(self.model, ema=self.cfg.qat.ema, int4_block=self.qat_int4_block)
            self.qat.load_state_dict(state["qat"])
        set_rng_state(state["rng"])
        if self.dist.main and self.log_path.exists():  # drop log lines of steps after the checkpoint
            kept = [ln for ln in self.log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= self.step]
            atomic_write_text(self.log_path, "".join(f"{ln}\n" for ln in kept))

    # ------------------------------------------------------------------ losses

    def _forward(self, input_ids: Tensor) -> Any:
        """Logits ``(R, L, V)``; with ``train.loss_chunk`` the final hidden states and the head's weight
        (:meth:`_wrap`)."""
        dtype = autocast_dtype(self.device, self.cfg.mixed_precision)
        if dtype is None:
            return self.forward_module(input_ids)
        with torch.autocast(torch.device(self.device).type, dtype=dtype):
            return self.forward_module(input_ids)

    def _needs_length_penalty(self, pred: Tensor, batch: Batch) -> Tensor:
        """Per row: the student's teacher-forced prediction ``pred (R, L)`` misses required args/evidence."""
        fmt = chat_format(self.tokenizer)
        pred = pred.long().cpu()  # (R, L)
        out = torch.zeros(pred.shape[0], dtype=torch.bool)
        for i, item in enumerate(batch.items):
            turns: list[list[int]] = []
            for t in batch.turn_mask[i].nonzero().flatten().tolist():
                if batch.turn_start[i, t]:
                    turns.append([])
                turns[-1].append(int(pred[i, t]))
            text = "".join(fmt.assistant_header + self.tokenizer.decode(t) for t in turns)
            calls, answer = fmt.parse_transcript(text)
            out[i] = not losses.coverage_met(item, calls, answer)
        return out

    def _position_stats(self, hidden: Tensor, head: Tensor, batch: Batch, input_ids: Tensor) -> dict[str, Tensor]:
        """What :meth:`compute_loss` needs per position, ``train.loss_chunk`` positions at a time, from the final
        hidden states ``(R, L, d)`` and the head's weight ``(V, d)``: no ``(R, L, V)`` logits."""
        cfg, dev = self.cfg, self.device
        teacher = topk_ids = topk_logprobs = None
        teacher_head = None
        if cfg.kd.weight > 0 and self._dense_teacher(batch):
            with torch.no_grad():
                teacher = self.teacher(input_ids)  # (R, L, V) logits, cast to fp32 per chunk, or (hidden, head)
            if isinstance(teacher, tuple):
                teacher, teacher_head = teacher
        elif cfg.kd.weight > 0 and batch.kd_ids is not None and batch.kd_logprobs is not None:
            topk_ids, topk_logprobs = batch.kd_ids.to(dev), batch.kd_logprobs.to(dev)
        kind, beta = self._divergence(batch)
        return losses.position_stats(
            hidden, batch.targets.to(dev), cfg.loss_chunk, head=head,
            early_targets=batch.early_targets.to(dev) if cfg.early_tool.weight > 0 else None,
            stop_ids=[self.end_id] if cfg.length.weight > 0 else (),
            topk_ids=topk_ids, topk_logprobs=topk_logprobs, teacher_logits=teacher, teacher_head=teacher_head,
            kind=kind, temperature=cfg.kd.temperature, beta=beta,
            argmax=cfg.length.weight > 0 and cfg.length.exempt_when_covered,
            positions=(batch.turn_mask | (batch.early_mask > 0)).to(dev),  # every loss reads these alone
        )  # fmt: skip

    def _dense_teacher(self, batch: Batch) -> bool:
        """The teacher's logits on the batch itself: online mode, and every on-policy batch."""
        return self.cfg.teacher_mode == "online" or batch.on_policy

    def _divergence(self, batch: Batch) -> tuple[str, float]:
        """KD kind and beta: ``kd.kind`` on the training rows, the generalized JSD on the student's samples."""
        return ("jsd", self.cfg.on_policy.beta) if batch.on_policy else (self.cfg.kd.kind, 0.5)

    def compute_loss(self, batch: Batch, epoch: float) -> tuple[Tensor, dict[str, float]]:
        """Weighted loss of one micro-batch and its logged components.

        ``log_softmax`` over the vocabulary is computed once and shared by CE, process,
        early-tool and the stop probability; KD at temperature T needs its own. With
        ``train.loss_chunk`` all of them come from :func:`distillgates.losses.position_stats`
        (chunked over positions, the LM head too: no ``(R, L, V)`` logits nor their fp32 log-softmax).
        """
        cfg = self.cfg
        dev = self.device
        input_ids = batch.input_ids.to(dev)
        per_pos: dict[str, Tensor] = {}
        if cfg.loss_chunk:
            hidden, head = self._forward(input_ids)  # (R, L, d), (V, d)
            per_pos = self._position_stats(hidden, head, batch, input_ids)
            nll = per_pos["nll"]  # (R, L)
        else:
            logits = self._forward(input_ids).float()  # (R, L, V)
            log_probs = logits.log_softmax(-1)  # (R, L, V)
            nll = losses.token_nll(log_probs, batch.targets.to(dev))  # (R, L)
        comp: dict[str, Tensor] = {}
        if not batch.on_policy:  # a sampled row has no reference to imitate
            comp["ce"] = losses.masked_mean(nll, batch.ce_mask.to(dev))
        if cfg.process_weight > 0 and not batch.on_policy:
            comp["process"] = losses.masked_mean(nll, batch.process_mask.to(dev))
        if cfg.kd.weight > 0:
            if "kd" in per_pos:
                mask = batch.ce_mask if self._dense_teacher(batch) else batch.kd_mask
                comp["kd"] = losses.masked_mean(per_pos["kd"], mask.to(dev))
            elif self._dense_teacher(batch):
                with torch.no_grad():
                    t_logits = self.teacher(input_ids).float()  # (R, L, V)
                mask = batch.ce_mask.to(dev)  # dense teacher on the same rows: every generated position
                kind, beta = self._divergence(batch)
                comp["kd"] = losses.kd_loss_dense(logits, t_logits, mask, kind, cfg.kd.temperature, beta)
            elif batch.kd_ids is not None and batch.kd_logprobs is not None:
                comp["kd"] = losses.kd_loss_topk(
                    logits, batch.kd_ids.to(dev), batch.kd_logprobs.to(dev), batch.kd_mask.to(dev),
                    cfg.kd.kind, cfg.kd.temperature,
                )
            else:
                comp["kd"] = nll.sum() * 0.0  # no KD record in this batch
        if cfg.length.weight > 0:
            target_len, grad_mask = batch.teacher_len, None
            if cfg.length.target == "evidence":
                target_len, grad_mask = evidence_targets(batch)
            if cfg.length.exempt_when_covered:
                needs = self._needs_length_penalty(per_pos["pred"] if per_pos else logits.detach().argmax(-1), batch)
            else:
                needs = torch.ones(batch.input_ids.shape[0], dtype=torch.bool)
            comp["length"], expected_len = losses.length_loss(
                per_pos["stop_prob"] if per_pos else losses.stop_probability(log_probs, [self.end_id]),
                batch.turn_mask.to(dev),
                batch.turn_start.to(dev),
                target_len.to(dev),
                needs.to(dev),
                hinge=cfg.length.hinge,
                max_new_tokens=cfg.length.max_new_tokens,
                slope=cfg.length.slope,
                cap=cfg.length.cap,
                grad_mask=None if grad_mask is None else grad_mask.to(dev),
            )
        early_w = losses.ramp(cfg.early_tool.weight, epoch, cfg.early_tool.ramp_epochs)
        if cfg.early_tool.weight > 0:
            early_nll = per_pos["early_nll"] if per_pos else losses.token_nll(log_probs, batch.early_targets.to(dev))
            comp["early_tool"] = losses.masked_mean(early_nll, batch.early_mask.to(dev) * batch.tool.to(dev)[:, None])
        weights = {
            "ce": cfg.ce_weight,
            "process": cfg.process_weight,
            "kd": cfg.kd.weight,
            "length": cfg.length.weight,
            "early_tool": early_w,
        }
        total, logged = losses.combine(comp, {k: v for k, v in weights.items() if k in comp})
        logged["early_tool_weight"] = early_w
        if cfg.length.weight > 0:
            logged["expected_len"] = float(expected_len.mean())
            logged["teacher_len"] = float(batch.teacher_len.mean())
            logged["needs_length_penalty"] = float(needs.float().mean())
        return total, logged

    # ------------------------------------------------------------------ train

    def _micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of global step ``step`` (rank r takes every world-th chunk); on an on-policy
        step (:func:`~distillgates.train.on_policy.on_policy_step`) the student's samples of those rows."""
        indices = self.sampler.batch_at(step).indices
        chunks = self.cfg.grad_accum * self.dist.world
        size = len(indices) // chunks
        mine = [indices[(a * self.dist.world + self.dist.rank) * size :][:size] for a in range(self.cfg.grad_accum)]
        on_policy = on_policy_step(self.cfg, step)
        batches = []
        for idx in mine:
            rows = [self.rows[i] for i in idx]
            if on_policy:
                rows, _ = sample_rows(self.model, self.tokenizer, rows, self.cfg.on_policy, self.cfg.seed, step,
                                      self.shapes.lengths)  # fmt: skip
            batch = collate(rows, self.pad_id, self.assistant_id, self.end_id)
            batch.on_policy = on_policy
            batches.append(batch)
        return batches

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        last = cfg.steps if self.max_steps is None else min(cfg.steps, self.max_steps)
        qat_start = qat_start_step(cfg)
        bar = _progress(self.progress and self.dist.main, last, self.step)
        tokens, t0 = 0, time.perf_counter()
        self.model.train()
        while self.step < last:
            step_t0 = time.perf_counter()
            if qat_start is not None and self.step >= qat_start and self.qat is None:
                self._start_qat()
                self._wrap()
            epoch = self.step * cfg.batch_size / len(self.rows)
            logged: dict[str, float] = {}
            self.optimizer.zero_grad(set_to_none=True)
            micro = self._micro_batches(self.step)
            for j, batch in enumerate(micro):
                sync = j == len(micro) - 1 or self.dist.world == 1
                ctx = self.forward_module.no_sync() if not sync and hasattr(self.forward_module, "no_sync") else _null()
                with ctx:
                    loss, parts = self.compute_loss(batch, epoch)
                    (loss / len(micro)).backward()
                for k, v in parts.items():
                    logged[k] = logged.get(k, 0.0) + v / len(micro)
                tokens += batch.n_tokens
            if not all(torch.isfinite(p.grad).all() for p in self.model.parameters() if p.grad is not None):
                raise FloatingPointError(f"non-finite gradient at step {self.step}")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
            lr = self.scheduler.get_last_lr()[0]  # the LR this step uses
            self.optimizer.step()
            self.scheduler.step()
            if self.qat is not None:
                self.qat.step()
            elif self.ema is not None:
                self.ema.update_parameters(self.model)  # the first update copies the weights
            self.step += 1
            if self.dist.world > 1:
                logged = _all_reduce_mean(logged, self.device)
            if self.dist.main:
                record = {"step": self.step, "lr": lr, "grad_norm": float(grad_norm),
                          "qat": self.qat is not None, "on_policy": micro[0].on_policy, "shape": micro[0].shape,
                          "step_s": round(time.perf_counter() - step_t0, 4), **logged}  # wall seconds, sampling too
                if self.step % cfg.log_every == 0 or self.step == last or self.step == 1:
                    record["tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
                with open(self.log_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                if not self.progress:  # without a bar, one plain line per step (logs, subprocess tests)
                    print(f"step {self.step} loss {logged['total']:.6f}", flush=True)
            if bar is not None:
                bar.update(1, loss=logged["total"])
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                self.validate()
            if cfg.ckpt_every and self.step % cfg.ckpt_every == 0:
                self._checkpoint()
        if bar is not None:
            bar.close()
        return {"steps": self.step, "tokens": tokens}

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """CE per enumerated shape on the eval rows and TTFT/TPS proxies (rank 0 writes the log)."""
        model = self.model
        was_training = model.training
        model.eval()
        by_shape: dict[str, list[float]] = {}
        rows = self.eval_rows[:64]
        for shape in sorted({r.shape for r in rows}):
            group = [r for r in rows if r.shape == shape]
            for b in range(0, len(group), 16):
                batch = collate(group[b : b + 16], self.pad_id, self.assistant_id, self.end_id)
                ids, targets, mask = (t.to(self.device) for t in (batch.input_ids, batch.targets, batch.ce_mask))
                if self.cfg.loss_chunk:  # the head a chunk at a time, as in training
                    hidden, head = model(ids, split_head=True)
                    nll = losses.position_stats(hidden, targets, self.cfg.loss_chunk, head=head,
                                                positions=mask > 0)["nll"]  # fmt: skip
                    ce = losses.masked_mean(nll, mask)
                else:
                    ce = losses.ce_loss(model(ids).float(), targets, mask)
                by_shape.setdefault(str(shape), []).append(float(ce))
        result: dict[str, Any] = {
            "step": self.step,
            "val": {"ce_by_shape": {k: sum(v) / len(v) for k, v in by_shape.items()}},
        }
        if self.speed_prompts and self.eval_items and self.dist.main:
            result["val"]["speed"] = self.speed_proxy()
        model.train(was_training)
        if self.dist.main:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(result) + "\n")
        return result

    def speed_proxy(self) -> dict[str, Any]:
        """TTFT/TPS of the PyTorch engine on a copy of the model (``export=False``, hardware key)."""
        from distillgates.hardware import detect_hardware, profile_key
        from distillgates.runtime.torch_engine import TorchEngine
        from distillgates.speed import measure_speed

        engine = TorchEngine(copy.deepcopy(self.model).cpu())
        prompts = [chat_format(self.tokenizer).prompt(item) for item in self.eval_items[: self.speed_prompts]]
        longest = max(len(self.tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
        budget = min(self.cfg.length.max_new_tokens, self.model_cfg.max_seq_len - longest - 1)  # fits the cache
        speed_cfg = SpeedConfig(n_prompts=len(prompts), warmup=1, repeats=1, max_new_tokens=budget)
        report = measure_speed(
            engine, self.tokenizer, prompts, speed_cfg, model_config=self.model_cfg, export=False,
            hardware_profile_key=profile_key(detect_hardware()), stop_ids=[self.end_id],
        )
        return {k: report[k] for k in ("backend", "export", "hardware_profile_key", "ttft_ms", "tps")}

    # ------------------------------------------------------------------ cleanup

    def cleanup(self) -> Path:
        """Finalize QAT (+ probe), save the final model (config travels with weights) and its Hugging Face
        copy with the run's tokenizer (``hf/``: ``from_pretrained`` works on it)."""
        self.optimizer.zero_grad(set_to_none=True)  # training is over: the gradients and AdamW's state (three
        self.optimizer.state.clear()  # times the weights) go before the copies below (QAT finalize, probe, hf/)
        self._take_ema()  # no QAT: the saved weights are the average
        final = self.model
        extra: dict[str, Any] = {"train_config": to_dict(self.cfg), "steps": self.step}
        if self.qat is not None and self.qat_reference is not None:
            final, meta = self.qat.finalize()
            extra["quantization"] = meta
            if self.dist.main:
                probe_rows, dev = (self.eval_rows or self.rows)[:16], self.device
                batches = [
                    collate(probe_rows[i : i + 8], self.pad_id, self.assistant_id, self.end_id).input_ids.to(dev)
                    for i in range(0, len(probe_rows), 8)
                ]
                pre_post = probe(self.qat_reference, final, batches)  # model entering QAT vs grid model leaving it
                quant_only = probe(self.model, final, batches)  # same latent weights, float vs the QAT grid
                report = {**pre_post, "quantization_only": quant_only, "qat_start_step": qat_start_step(self.cfg),
                          "steps": self.step}
                atomic_write_json(self.out_dir / "qat_probe.json", report)
        path = self.out_dir / "model.pt"
        if self._sharded:  # gather the shards into a plain model (QAT is refused with FSDP at setup)
            full = self._model_state()
            final = Transformer(self.model_cfg)
            if self.dist.main:
                final.load_state_dict(full)
        if self.dist.main:
            save_model(path, final.cpu(), **extra)
            save_hf(final, self.out_dir / HF_DIR_NAME, self.tokenizer)
        if self.dist.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return path


def evidence_targets(batch: Batch) -> tuple[Tensor, Tensor]:
    """Length target and stop-gradient mask of ``length.target: evidence``.

    Target = assistant-turn positions up to the last required evidence token of the answer, plus
    one for ``<|end|>`` (the shortest complete answer of the reference); only turn positions
    after that evidence get stop gradient. Rows without answer evidence keep the teacher's
    length and the full gradient.
    """
    pos = torch.arange(batch.input_ids.shape[1])[None]  # (1, L)
    has = batch.evidence_end >= 0  # (R,)
    upto = batch.turn_mask & (pos <= batch.evidence_end[:, None])  # (R, L)
    target = torch.where(has, upto.float().sum(-1) + 1.0, batch.teacher_len)  # (R,)
    grad_mask = torch.where(has[:, None], pos > batch.evidence_end[:, None], torch.ones_like(upto))  # (R, L)
    return target, grad_mask


class _HeadSplit(nn.Module):
    """``idx -> (final hidden states, head weight)`` of a model (``train.loss_chunk``; what DDP and FSDP then wrap)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return cast("tuple[Tensor, Tensor]", self.model(idx, split_head=True))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _all_reduce_mean(values: dict[str, float], device: str) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist(), strict=True))


def _progress(enabled: bool, total: int, start: int) -> Any:
    from distillgates.progress import ProgressBar

    return ProgressBar("train", total, completed=start, enabled=enabled, loss=float("nan"))


# ---------------------------------------------------------------------- entry points


def train_student(
    cfg: Config,
    role: str,
    run_dir: str | Path | RunDir,
    kd_path: str | Path | None = None,
    teacher: Any = None,
    **options: Any,
) -> Path:
    """Distill ``role`` ("student" or "drafter") into ``<run_dir>/<role>/model.pt``: the :class:`Recipe` of
    :func:`build_recipe` (same arguments) set up, trained and saved. Resumes from ``<role>/checkpoint.pt`` when
    present.

    Returns:
        the path of the saved model.
    """
    recipe = build_recipe(cfg, role, run_dir, kd_path, teacher, **options)
    recipe.setup()
    recipe.train()
    return recipe.cleanup()


def build_recipe(
    cfg: Config,
    role: str,
    run_dir: str | Path | RunDir,
    kd_path: str | Path | None = None,
    teacher: Any = None,
    *,
    tokenizer: Any = None,
    train_items: list[dict[str, Any]] | None = None,
    eval_items: list[dict[str, Any]] | None = None,
    max_steps: int | None = None,
    progress: bool = True,
    device: str = "auto",
) -> Recipe:
    """The :class:`Recipe` that distills ``role`` ("student" or "drafter") into ``<run_dir>/<role>/``, not yet set up.

    Reads the tokenizer, the datasets and the offline KD set from the run directory
    (:class:`~distillgates.rundir.RunDir`) unless given; ``teacher`` (online mode) is a
    ``LocalTeacher``/HF model/callable returning logits.
    """
    if role not in ("student", "drafter"):
        raise ValueError(f"role must be 'student' or 'drafter', got {role!r}")
    model_cfg = getattr(cfg, role)
    train_cfg = cfg.train_section(role)
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    tokenizer = tokenizer if tokenizer is not None else run.tokenizer()
    init_model = None
    if train_cfg.pretrained is not None:  # the checkpoint's architecture (the section, if any, must agree)
        from distillgates.checkpoints import checkpoint_dir
        from distillgates.train.init import pretrained_student

        init_model = pretrained_student(checkpoint_dir(train_cfg.pretrained), max(cfg.shapes.lengths), tokenizer,
                                        model_cfg, f"train.init_from {train_cfg.init_from!r}")  # fmt: skip
        model_cfg = init_model.config
    if model_cfg is None:
        raise ValueError(f"config has no '{role}' section")
    train_items = train_items if train_items is not None else run.items("train")
    eval_items = eval_items if eval_items is not None else run.items("eval")
    kd_records = None
    if train_cfg.teacher_mode == "offline" and train_cfg.kd.weight > 0:
        kd_records = read_kd_set(kd_path or run.kd_set, tokenizer)
    if isinstance(getattr(teacher, "path", None), Path):  # a LocalTeacher: its logits index the run's vocabulary
        from distillgates.train.init import check_vocabulary

        check_vocabulary(teacher.path, tokenizer, f"train.teacher_mode 'online' ({teacher.path})")
    return Recipe(
        train_cfg, model_cfg, cfg.shapes, tokenizer, train_items, eval_items, run.model_dir(role),
        kd_records=kd_records, teacher=teacher, device=device, max_steps=max_steps, progress=progress,
        speed_prompts=min(cfg.speed.n_prompts, 4),
        init_teacher=_init_teacher(cfg, run, tokenizer) if train_cfg.init_from == "teacher" else None,
        init_model=init_model, qat_int4_block=cfg.student_qat_int4_block if role == "student" else None,
    )


def _init_teacher(cfg: Config, run: RunDir, tokenizer: Any) -> Transformer:
    """The local teacher (``teacher.path``, else the run's toy teacher) as a :class:`Transformer`; its
    vocabulary must be the run's (``tokenizer``)."""
    from transformers import AutoModelForCausalLM

    from distillgates.hf import from_hf
    from distillgates.train.init import check_vocabulary

    if cfg.teacher is None or cfg.teacher.kind != "local":
        raise ValueError("train.init_from 'teacher' needs a local teacher (teacher.kind: local)")
    path = run.teacher_model_dir(cfg)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"train.init_from 'teacher': no teacher model at {path} (run the teacher step first)")
    check_vocabulary(path, tokenizer, f"train.init_from 'teacher' ({path})")
    return from_hf(AutoModelForCausalLM.from_pretrained(path).float())


def teacher_fn(teacher: Any, split_head: bool = False) -> Any:
    """``input_ids (B, T) -> logits (B, T, V)`` of a LocalTeacher (its HF model), an HF causal LM, a
    :class:`Transformer` or such a callable (returned as is).

    With ``split_head`` (``train.loss_chunk``): ``input_ids -> (final hidden states (B, T, d), head weight (V, d))``
    where the teacher's logits are their product, so :func:`~distillgates.losses.position_stats` applies the
    teacher's head a chunk at a time too (a Gemma 3 teacher's logits of an 8 x 512 batch are 4 GiB in fp32). A
    Transformer always splits; an HF model when its logits were checked to be its base model's last hidden state
    times its output embedding (not so under logit softcapping or scaling: it then gives its logits).
    """
    from transformers import PreTrainedModel

    from distillgates.teacher.local import LocalTeacher

    model = teacher.model if isinstance(teacher, LocalTeacher) else teacher
    if isinstance(model, Transformer):
        model.eval()
        return (lambda ids: model(ids, split_head=True)) if split_head else (lambda ids: model(ids))
    if isinstance(model, PreTrainedModel):
        model.eval()
        device = model.device
        if split_head and (split := _hf_split_head(model)) is not None:
            return split
        return lambda ids: model(input_ids=ids.to(device), use_cache=False).logits
    return teacher


def _hf_split_head(model: Any) -> Any:
    """``input_ids -> (last hidden state, output embedding weight)`` of an HF causal LM, or None where its logits
    are not their product (checked on 8 tokens: softcapping, a scale, a bias)."""
    base, head, device = model.base_model, model.get_output_embeddings(), model.device
    if base is model or not isinstance(head, nn.Linear) or head.bias is not None:
        return None

    def split(ids: Tensor) -> tuple[Tensor, Tensor]:
        return base(input_ids=ids.to(device), use_cache=False).last_hidden_state, head.weight

    probe = torch.arange(8, device=device)[None] % head.weight.shape[0]  # (1, 8)
    with torch.no_grad():
        hidden, weight = split(probe)
        logits = model(input_ids=probe, use_cache=False).logits
    return split if torch.allclose(hidden @ weight.T, logits, rtol=1e-4, atol=1e-4) else None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``distillgates train CONFIG --run-dir DIR [--role student|drafter] [--kd PATH]``."""
    p = subparsers.add_parser("train", help="distill the student (or drafter) from the KD set or a teacher")
    p.add_argument("config", type=Path, help="pipeline YAML (e.g. configs/toy.yaml)")
    p.add_argument("--run-dir", dest="run_dir", type=Path, required=True)
    p.add_argument("--role", dest="role", choices=("student", "drafter"), default="student")
    p.add_argument("--kd", dest="kd_path", type=Path, default=None, help="offline KD set (default run_dir/kd/kd.jsonl)")
    p.add_argument("--teacher", dest="teacher", type=Path, default=None,
                   help="online mode: local HF teacher directory (default run_dir/teacher)")
    p.add_argument("--max-steps", dest="max_steps", type=int, default=None)
    p.add_argument("--device", dest="device", default="auto")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    teacher = None
    train_cfg = cfg.train_section(args.role)
    if train_cfg.teacher_mode == "online":
        from distillgates.teacher.local import LocalTeacher

        teacher = LocalTeacher(args.teacher or args.run_dir / "teacher")
    path = train_student(cfg, args.role, args.run_dir, kd_path=args.kd_path, teacher=teacher,
                         max_steps=args.max_steps, progress=args.progress, device=args.device)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m distillgates.train CONFIG --run-dir DIR`` (what ``torchrun`` launches)."""
    parser = argparse.ArgumentParser(prog="distillgates-train")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["train", *(argv if argv is not None else __import__("sys").argv[1:])])
    return int(args.func(args))


__all__ = ["Recipe", "Row", "add_parser", "build_recipe", "main", "run", "teacher_fn", "train_student"]
