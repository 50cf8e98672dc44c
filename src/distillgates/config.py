"""Dataclass configs loaded from YAML with validation.

Every YAML in ``configs/`` is a (partial) :class:`Config`: a mapping of named sections
(``student``, ``drafter``, ``teacher``, ``data``, ``shapes``, ``train``, ``export``,
``speed``, ``gates``, ...). ``hardware_profiles.yaml`` has its own schema
(:mod:`distillgates.hardware`).

Design choices:
- One loader (:func:`from_dict`) turns nested mappings into nested dataclasses using the
  type hints; an unknown key, a wrong type or a failed ``__post_init__`` check raises
  :class:`ConfigError` naming the file, the line and the dotted field path.
- Impossible combinations are checked in ``__post_init__`` (litgpt ``args.py`` style), so a
  config built in Python is validated exactly like one read from YAML.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent."""


# --------------------------------------------------------------------------------------
# Model


@dataclass
class RopeScaling:
    """Optional RoPE frequency scaling (Llama-3 style or plain linear)."""

    kind: str = "llama3"  # "linear" or "llama3"
    factor: float = 8.0  # context extension factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_seq_len: int = 8192  # llama3 only: context the base model was trained on

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"kind must be 'linear' or 'llama3', got {self.kind!r}")
        if self.factor <= 0:
            raise ValueError(f"factor must be > 0, got {self.factor}")


@dataclass
class ModelConfig:
    """Llama-style decoder with grouped-query attention."""

    vocab_size: int
    d_model: int  # residual width
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA: n_heads % n_kv_heads == 0)
    ffn_hidden: int  # SwiGLU hidden width
    max_seq_len: int  # KV cache length and RoPE table size
    head_dim: int | None = None  # defaults to d_model // n_heads (Qwen3 and Mistral may set it otherwise)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5  # RMSNorm epsilon (fp16-safe: not below 1e-6)
    tie_embeddings: bool = True  # share token embedding and LM head
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2/2.5); o_proj never has one
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    embed_scale: bool = False  # token embeddings times sqrt(d_model) (Gemma 3, like the fields below)
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU, tanh-approximated gelu)
    sandwich_norm: bool = False  # an RMSNorm also on the attention's and the MLP's output, before each residual add
    query_pre_attn_scalar: int | None = None  # attention scores times this ** -0.5 (None: head_dim ** -0.5)
    sliding_window: int | None = None  # a sliding layer's query attends keys less than this many positions back
    layer_types: list[str] | None = None  # per layer: full_attention or sliding_attention (None: all full)
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (None: rope_theta)
    # the embeddings times this, and each block's addition to the residual stream: the export's fp16 headroom fix
    # (distillgates.export.headroom.scale_residual), which leaves the logits as they are
    residual_scale: float = 1.0
    gradient_checkpointing: bool = False  # recompute blocks in backward (torch.utils.checkpoint)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
            self.head_dim = self.d_model // self.n_heads
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation: expected silu or gelu_tanh, got {self.activation!r}")
        if self.layer_types is not None:
            unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if len(self.layer_types) != self.n_layers or unknown:
                raise ValueError(f"layer_types: expected {self.n_layers} of full_attention or sliding_attention, "
                                 f"got {len(self.layer_types)}{' with ' + ', '.join(unknown) if unknown else ''}")
            if "sliding_attention" in self.layer_types and (self.sliding_window or 0) <= 0:
                raise ValueError("layer_types has sliding_attention layers: sliding_window must be > 0")

    @property
    def residual_norm_eps(self) -> float:
        """The epsilon of the norms that read the residual stream: ``norm_eps`` times ``residual_scale**2``, so that
        with a power-of-two scale they compute exactly what the unscaled model's do."""
        return self.norm_eps * self.residual_scale**2

    def gemma_features(self) -> list[str]:
        """The Gemma 3 fields this config sets (each off by default), in field order."""
        names = ("embed_scale", "activation", "sandwich_norm", "query_pre_attn_scalar", "sliding_window", "layer_types",
                 "rope_local_theta")  # fmt: skip
        return [name for name in names if getattr(self, name) not in (None, False, "silu")]

    def sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends a sliding window (``layer_types``)."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @property
    def ring_len(self) -> int | None:
        """The sliding layers' exported KV state length when their window is narrower than ``max_seq_len``: a ring of
        ``sliding_window`` slots (position ``p`` in slot ``p mod sliding_window``); None when no layer has one."""
        window = self.sliding_window or 0
        rings = self.layer_types is not None and "sliding_attention" in self.layer_types and window < self.max_seq_len
        return window if rings else None

    def state_len(self, layer: int) -> int:
        """Positions the exported KV state of layer ``layer`` holds (:attr:`ring_len` for a sliding layer)."""
        return self.ring_len if self.ring_len is not None and self.sliding(layer) else self.max_seq_len

    @property
    def n_params(self) -> int:
        """Parameter count computed from the shape (no allocation)."""
        hd = self.head_dim or self.d_model // self.n_heads
        attn = self.d_model * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        attn += hd * (self.n_heads + 2 * self.n_kv_heads) if self.attention_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        mlp = 3 * self.d_model * self.ffn_hidden
        per_layer = attn + mlp + (4 if self.sandwich_norm else 2) * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.vocab_size * self.d_model + self.n_layers * per_layer + self.d_model + head

    def kv_cache_bytes(self, seq_len: int, bytes_per_elem: int = 2, batch: int = 1) -> int:
        """KV bytes = 2 (K and V) * layers * kv_heads * head_dim * seq_len * bytes * batch."""
        return 2 * self.n_layers * self.n_kv_heads * (self.head_dim or 0) * seq_len * bytes_per_elem * batch


# --------------------------------------------------------------------------------------
# Pipeline sections


# the chat templates built in (distillgates.tokenizer.CHAT_TEMPLATES: a test keeps the two lists equal)
BUILTIN_CHAT_TEMPLATES = ("toy", "chatml", "gemma")


@dataclass
class TokenizerConfig:
    """The student's tokenizer and chat template: a tokenizer directory (``path``) or a trained byte-level BPE.

    Without ``path`` the data step trains the BPE on the train conversations rendered in ``chat_template``.
    """

    vocab_size: int = 1024
    min_frequency: int = 2
    # the template everything renders with: a built-in (toy | chatml | gemma, distillgates.tokenizer.CHAT_TEMPLATES;
    # gemma: Gemma 3's turns with Hermes tool calls) or a .jinja file (with ``path`` only); None: a trained
    # tokenizer's toy, a tokenizer directory's own. The template must write tool calls its parser reads back
    # (checked by the data step)
    chat_template: str | None = None
    path: str | None = None  # a save_pretrained directory with a chat template (local files only), or a .gguf file
    tool_call_format: str | None = None  # toy | hermes | llama3; None: detected from the chat template

    def __post_init__(self) -> None:
        builtin = self.chat_template is None or self.chat_template in BUILTIN_CHAT_TEMPLATES
        if not builtin and not (self.path and str(self.chat_template).endswith(".jinja")):
            raise ValueError(f"tokenizer.chat_template: expected {', '.join(BUILTIN_CHAT_TEMPLATES)} or (with path) "
                             f"a .jinja file, got {self.chat_template!r}")
        if self.tool_call_format not in (None, "toy", "hermes", "llama3"):
            raise ValueError(f"tokenizer.tool_call_format: expected toy, hermes or llama3, "
                             f"got {self.tool_call_format!r}")


@dataclass
class ShapesConfig:
    """Enumerated sequence shapes shared by data bucketing, training, export and eval slices."""

    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])
    mix: list[float] = field(default_factory=lambda: [0.4, 0.4, 0.15, 0.05])  # production share per length
    concentration_start: float = 2.0  # Dirichlet concentration at step 0 (low: noisy, near-uniform draws)
    concentration_end: float = 200.0  # concentration once annealed (high: draws close to the production mix)
    anneal_fraction: float = 0.5  # share of training steps over which base and concentration anneal
    rare_every: int = 10  # every N steps the shape probabilities are up-weighted toward rare shapes (0: off)

    def __post_init__(self) -> None:
        if self.concentration_start <= 0 or self.concentration_end <= 0:
            raise ValueError("concentration_start and concentration_end must be > 0")
        if not 0.0 < self.anneal_fraction <= 1.0:
            raise ValueError(f"anneal_fraction must be in (0, 1], got {self.anneal_fraction}")
        if self.rare_every < 0:
            raise ValueError(f"rare_every must be >= 0, got {self.rare_every}")
        if not self.lengths:
            raise ValueError("lengths must not be empty")
        if sorted(set(self.lengths)) != list(self.lengths):
            raise ValueError(f"lengths must be strictly increasing, got {self.lengths}")
        if len(self.mix) != len(self.lengths):
            raise ValueError(f"mix has {len(self.mix)} entries but lengths has {len(self.lengths)}")
        if any(p < 0 for p in self.mix) or abs(sum(self.mix) - 1.0) > 1e-6:
            raise ValueError(f"mix must be non-negative and sum to 1, got {self.mix}")


@dataclass
class DataConfig:
    """Where the items come from: the toy generator (default) or the user's OpenAI chat-format files."""

    # toy: the generator; jsonl: OpenAI chat-format JSONL; hf: the same through Hugging Face datasets
    # (local json/jsonl/parquet, nothing downloaded). Format: docs/user-guide.md "Your own data"
    source: str = "toy"
    path: str | None = None  # the rows (jsonl/hf); relative to the working directory
    eval_path: str | None = None  # given eval rows; without it a seeded eval_fraction of path is held out
    eval_fraction: float = 0.1  # share of the rows held out for eval (seeded shuffle) when eval_path is not given
    seed: int = 0  # the toy generator's seed (items are a pure function of seed, split, index); the split's too
    n_train: int = 2000
    n_eval: int = 200
    # toy: after the n_eval items, further generated eval items that expect a tool call are kept for each
    # enumerated shape holding fewer than this many of them (0: off), so every shape's drift gate is powered
    # (docs/gates.md "Sizing an eval set"); the train split and the tokenizer do not change
    eval_min_per_shape: int = 0
    locales: list[str] = field(default_factory=lambda: ["en", "de"])
    # share of references in the chatty style (preamble before the call, filler after the facts): the teacher
    # learns to talk like a big chat model; the student's latency losses make it terse
    verbose_share: float = 0.5
    # a row of your own files that cannot be read: error (stop the data step naming file:line: field) or skip
    # (leave it out, list it with its reason in data/skipped_rows.jsonl and print the count)
    invalid_rows: str = "error"
    max_skipped_share: float = 0.05  # invalid_rows: skip: a file with a larger share of skipped rows fails the step
    # map the non-JSON-Schema types of real-world function schemas: dict->object, float->number, tuple->array,
    # any->no type constraint (off: such a schema is an error naming its file:line: field)
    map_schema_types: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.verbose_share <= 1.0:
            raise ValueError(f"verbose_share must be in [0, 1], got {self.verbose_share}")
        if self.invalid_rows not in ("error", "skip"):
            raise ValueError(f"invalid_rows must be error/skip, got {self.invalid_rows!r}")
        if self.eval_min_per_shape < 0:
            raise ValueError(f"eval_min_per_shape must be >= 0, got {self.eval_min_per_shape}")
        if self.eval_min_per_shape and self.source != "toy":
            raise ValueError(f"eval_min_per_shape generates toy eval items: needs source 'toy', got {self.source!r}")
        if not 0.0 <= self.max_skipped_share < 1.0:
            raise ValueError(f"max_skipped_share must be in [0, 1), got {self.max_skipped_share}")
        if self.source not in ("toy", "jsonl", "hf"):
            raise ValueError(f"source must be toy/jsonl/hf, got {self.source!r}")
        if self.source != "toy" and not self.path:
            raise ValueError(f"source {self.source!r} needs path (the OpenAI-format rows)")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")


@dataclass
class ToyTeacherTrainConfig:
    """How the pipeline trains the toy teacher (``teacher.train``; read by :mod:`distillgates.teacher.toy`)."""

    steps: int = 600
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 30  # linear warmup, then cosine to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    value_weight: float = 1.0  # loss weight of argument-value and integration tokens (the facts)
    curriculum_steps: int = 0  # first N steps without the system prompt (see teacher/toy.py)
    copy_steps: int = 0  # first N steps on synthetic copy rows, before the curriculum (teacher/toy.py)
    ema_decay: float = 0.0  # > 0: save an exponential moving average of the weights over the last phase's steps

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0:
            raise ValueError("steps and batch_size must be > 0")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.ema_decay and self.copy_steps + self.curriculum_steps >= self.steps:
            raise ValueError("ema_decay averages the steps after copy_steps + curriculum_steps: there are none")
        if self.value_weight <= 0 or self.curriculum_steps < 0 or self.copy_steps < 0:
            raise ValueError("value_weight must be > 0, curriculum_steps and copy_steps >= 0")


@dataclass
class LoRAConfig:
    """LoRA adapters of a teacher fine-tune (``teacher.finetune.lora``; peft's ``LoraConfig``), merged when saved."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"  # peft's names: "all-linear" or module names (q_proj, ...)

    def __post_init__(self) -> None:
        if self.r <= 0 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"r and alpha must be > 0 and dropout in [0, 1), got {self.r}, {self.alpha}, "
                             f"{self.dropout}")


@dataclass
class FinetuneConfig:
    """Supervised fine-tuning of a pretrained local teacher on the training rows before KD (``teacher.finetune``;
    :mod:`distillgates.teacher.finetune`, on TRL's ``SFTTrainer``): loss on the assistant turns only."""

    method: str = "lora"  # "lora" (peft adapters, merged into the saved weights) or "full"
    steps: int = 100
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 2e-4
    warmup_steps: int = 10  # linear warmup, then cosine decay
    weight_decay: float = 0.0
    gradient_checkpointing: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.method not in ("lora", "full"):
            raise ValueError(f"method must be lora or full, got {self.method!r}")
        if self.steps <= 0 or self.batch_size <= 0 or self.grad_accum <= 0 or self.lr <= 0:
            raise ValueError("steps, batch_size, grad_accum and lr must be > 0")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be in [0, steps ({self.steps}))")


@dataclass
class TeacherCheckConfig:
    """The check a local teacher passes before the KD step (``teacher.check``): it answers held-out tool items
    (the eval split's first ``items`` that expect a call) and is refused, with its figures, when too few of its
    replies call a tool."""

    items: int = 32  # 0: no check
    min_call_rate: float = 0.5  # share of those items whose reply makes a tool call

    def __post_init__(self) -> None:
        if self.items < 0 or not 0.0 <= self.min_call_rate <= 1.0:
            raise ValueError(f"items must be >= 0 and min_call_rate in [0, 1], got {self.items}, {self.min_call_rate}")


@dataclass
class APIConfig:
    """An OpenAI-compatible chat-completions client (``teacher.api``; read by :mod:`distillgates.teacher.http`)."""

    base_url: str | None = None  # e.g. http://127.0.0.1:8000/v1
    model_name: str | None = None  # served model name
    api_key_env: str = "DISTILLGATES_API_KEY"  # name of the env var holding the key (never the key)
    timeout_s: float = 60.0
    max_retries: int = 5
    rate_limit_rps: float = 0.0  # 0: unlimited
    determinism: bool = False  # temperature 0, top_p 1, no retries; any retry is an error
    backoff_base_s: float = 0.5  # full-jitter exponential backoff base and cap
    backoff_max_s: float = 30.0
    # ask for top-k log-probs (``logprobs``/``top_logprobs``); false for servers without them: the KD
    # set then holds the teacher's text only and training uses sequence-level KD on it
    logprobs: bool = True


@dataclass
class TeacherConfig:
    """Which teacher: a local Hugging Face model (given, or the toy teacher the pipeline trains) or an API."""

    kind: str = "local"  # "local" (AutoModelForCausalLM dir) or "openai" (chat completions)
    path: str | None = None  # local: model directory or .gguf file (None: the pipeline trains the toy teacher)
    # local: the template the teacher renders with (toy | chatml | gemma | a .jinja file); None: the run's template
    # when the teacher has the run's vocabulary, else its own
    chat_template: str | None = None
    model: ModelConfig | None = None  # local toy teacher architecture (trained from scratch)
    train: ToyTeacherTrainConfig = field(default_factory=ToyTeacherTrainConfig)  # the toy teacher's training
    finetune: FinetuneConfig | None = None  # local teacher.path: fine-tune it on the training rows first
    check: TeacherCheckConfig = field(default_factory=TeacherCheckConfig)  # local: refused before KD without calls
    api: APIConfig = field(default_factory=APIConfig)  # kind "openai": the client

    def __post_init__(self) -> None:
        if self.kind not in ("local", "openai"):
            raise ValueError(f"kind must be 'local' or 'openai', got {self.kind!r}")
        if self.kind == "openai" and not self.api.base_url:
            raise ValueError("api.base_url is required when kind is 'openai'")
        if self.finetune is not None and not (self.kind == "local" and self.path):
            raise ValueError("finetune needs a pretrained local teacher (kind: local and path)")
        if self.chat_template not in (None, *BUILTIN_CHAT_TEMPLATES) and not self.chat_template.endswith(".jinja"):
            raise ValueError(f"chat_template: expected {', '.join(BUILTIN_CHAT_TEMPLATES)} or a .jinja file, got "
                             f"{self.chat_template!r}")


@dataclass
class KDConfig:
    """The KD set: how the teacher plays the training conversations (``kd``; read by :mod:`distillgates.teacher.kd`)."""

    items: int = 0  # the teacher answers the first N training items (0: all); the rest train on references
    top_k: int = 20  # top-k log-probs kept per position
    temperature: float = 0.0  # generation temperature (0: greedy); forced to 0 by teacher.api.determinism
    max_new_tokens: int = 96  # per generated assistant turn
    max_turns: int = 4  # assistant turns per conversation (calls + answer)
    batch_size: int = 32  # local teacher: conversations generated together
    ckpt_every: int = 256  # checkpoint every N items (rounded up to batch_size)
    budget_tokens: int = 0  # 0: unlimited
    budget_usd: float = 0.0  # 0: unlimited
    usd_per_1k_prompt_tokens: float = 0.0  # budget accounting (cost = tokens * price)
    usd_per_1k_completion_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.top_k <= 0:
            raise ValueError(f"top_k must be > 0, got {self.top_k}")
        if self.max_new_tokens <= 0 or self.max_turns <= 0 or self.batch_size <= 0 or self.ckpt_every <= 0:
            raise ValueError("max_new_tokens, max_turns, batch_size and ckpt_every must be > 0")
        if self.items < 0:
            raise ValueError(f"items must be >= 0 (0: every training item), got {self.items}")


@dataclass
class KDLossConfig:
    kind: str = "forward"  # "forward" KL, "reverse" KL or "jsd"
    temperature: float = 2.0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("forward", "reverse", "jsd"):
            raise ValueError(f"kind must be forward/reverse/jsd, got {self.kind!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass
class LengthLossConfig:
    weight: float = 0.0
    hinge: float = 0.15  # relative excess length tolerated before the penalty starts
    slope: float = 1.0  # penalty per unit of relative excess beyond the hinge
    cap: float | None = None  # a row's penalty at most this (then no gradient from it); None: uncapped
    max_new_tokens: int = 64  # generation budget per turn: the tail of a student that never stops
    exempt_when_covered: bool = True  # no penalty for rows whose student prediction covers args/evidence
    # "teacher": target = the teacher's length (spec default); "evidence": target = the reference up to its last
    # required evidence value, and only positions after that evidence get the stop gradient (cuts filler only)
    target: str = "teacher"
    # do not imitate what the latency losses call excess: tool items are trained without the preamble before
    # the first call and without the filler after the sentence of the answer's last required evidence (that
    # sentence, then the end of the turn; target "evidence")
    mask_excess: bool = False

    def __post_init__(self) -> None:
        if self.mask_excess and self.target != "evidence":
            raise ValueError("mask_excess needs target: evidence (it masks what that target counts as excess)")
        if self.target not in ("teacher", "evidence"):
            raise ValueError(f"target must be teacher/evidence, got {self.target!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.slope <= 0:
            raise ValueError(f"slope must be > 0, got {self.slope}")
        if self.cap is not None and self.cap <= 0:
            raise ValueError(f"cap must be > 0 (or null: uncapped), got {self.cap}")


@dataclass
class EarlyToolLossConfig:
    weight: float = 0.0  # target weight after the ramp
    ramp_epochs: float = 1.0  # ramp 0 -> weight over this many epochs
    first_n_tokens: int = 32  # CE toward the teacher's tool-call prefix within the first N tokens


@dataclass
class OnPolicyConfig:
    """On-policy distillation (``train.on_policy``; :mod:`distillgates.train.on_policy`): on a share of the steps the
    student samples each conversation of its batch from the prompt (the batch decoded together), tools answered by
    the item's fixtures as in eval, and learns the teacher's distribution on its own tokens (generalized JSD). Needs
    a local teacher that shares the student's vocabulary (an API teacher cannot score given tokens)."""

    share: float = 0.0  # fraction of steps whose batch the student samples (0: off-policy only)
    beta: float = 0.5  # generalized JSD: 0 forward KL(teacher || student), 1 reverse KL, 0.5 the symmetric JSD
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0
    max_new_tokens: int = 64  # per sampled assistant turn
    max_turns: int = 4  # tool calls per sampled conversation
    # on-policy steps are drawn from step int(start_fraction * train.steps) on: an off-policy phase first (0: from
    # the first step)
    start_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        if not 0.0 <= self.start_fraction < 1.0:
            raise ValueError(f"start_fraction must be in [0, 1), got {self.start_fraction}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if self.temperature <= 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"need temperature > 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        if self.max_new_tokens <= 0 or self.max_turns <= 0:
            raise ValueError("max_new_tokens and max_turns must be > 0")


@dataclass
class QATConfig:
    """Late QAT of the grid ``export.quantize`` writes: int4 per block for int4, else int8 per channel."""

    enabled: bool = False
    start_fraction: float = 0.8  # QAT runs for the last (1 - start_fraction) of steps
    lr_scale: float = 0.1
    ema: float = 0.0  # 0: no EMA of weights during QAT

    def __post_init__(self) -> None:
        if not 0.0 < self.start_fraction < 1.0:
            raise ValueError(f"start_fraction must be in (0, 1), got {self.start_fraction}")


@dataclass
class TrainConfig:
    """Distillation recipe."""

    steps: int = 400
    batch_size: int = 16  # global batch (split across ranks under torchrun)
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 0
    deterministic: bool = True
    # "auto": bf16 autocast where the device computes bf16 natively (distillgates.devices.autocast_dtype), else
    # float32; "no"; "bf16"/"fp16": autocast on the device (fp16 is float32 on CPU)
    mixed_precision: str = "auto"
    teacher_mode: str = "offline"  # "offline" (KD set) or "online" (teacher forward per batch)
    ce_weight: float = 1.0
    process_weight: float = 0.0
    kd: KDLossConfig = field(default_factory=KDLossConfig)
    length: LengthLossConfig = field(default_factory=LengthLossConfig)
    early_tool: EarlyToolLossConfig = field(default_factory=EarlyToolLossConfig)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    qat: QATConfig = field(default_factory=QATConfig)
    # > 0: an exponential moving average of the weights, updated every step before QAT; the model takes its weights
    # when QAT starts (or at the end without QAT)
    ema_decay: float = 0.0
    ckpt_every: int = 100
    eval_every: int = 100
    log_every: int = 10
    fsdp: bool = False
    # positions per chunk of the LM head and the vocabulary-sized losses (losses.position_stats: the (B, T, V)
    # logits never exist, the student's nor an online teacher's, each chunk's are recomputed in backward, and only
    # the positions a loss reads meet the head; for 32k-262k vocabularies); 0: the whole micro-batch's logits at once
    loss_chunk: int = 0
    # "scratch"; "teacher": start from the local teacher's embeddings and its most influential
    # layers (the student must have the teacher's width; see distillgates/train/init.py); or
    # "hf:<dir>": a local Hugging Face checkpoint (Llama/SmolLM, Mistral, Qwen2/2.5, Qwen3, Gemma 3) whose
    # architecture becomes the model's (see distillgates/hf.py); "gguf:<file>": a GGUF file of one, dequantised
    init_from: str = "scratch"
    init_layers: list[int] | None = None  # teacher layers to keep (None: by block influence)

    def __post_init__(self) -> None:
        if self.init_from not in ("scratch", "teacher") and self.pretrained is None:
            raise ValueError(f"init_from must be scratch, teacher, hf:<checkpoint dir> or gguf:<file>, "
                             f"got {self.init_from!r}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be auto/no/bf16/fp16, got {self.mixed_precision!r}")
        if self.teacher_mode not in ("offline", "online"):
            raise ValueError(f"teacher_mode must be offline/online, got {self.teacher_mode!r}")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps})")
        if self.grad_accum <= 0 or self.batch_size <= 0:
            raise ValueError("batch_size and grad_accum must be > 0")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0 (0: off), got {self.loss_chunk}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.ema_decay and self.fsdp:
            raise ValueError("train.ema_decay with train.fsdp is not supported: it averages the unsharded weights")
        if self.on_policy.share > 0 and self.fsdp:
            raise ValueError("train.on_policy with train.fsdp is not supported: the student samples from an unsharded "
                             "copy of itself")

    @property
    def pretrained(self) -> Path | None:
        """The checkpoint of ``init_from: hf:<dir>`` or ``gguf:<file>`` (:func:`distillgates.checkpoints.checkpoint_dir`
        makes a directory of either), else None."""
        prefix, _, rest = self.init_from.partition(":")
        if prefix == "gguf" and rest.strip() and not rest.lower().endswith(".gguf"):
            raise ValueError(f"init_from {self.init_from!r}: expected gguf:<file>.gguf")
        return Path(rest) if prefix in ("hf", "gguf") and rest.strip() else None


@dataclass
class ExportConfig:
    """Core ML export, and Core AI's beside it."""

    # "coreml": model.mlpackage (Core ML: macOS 15 / iOS 18 and later); "coreai": model.aimodel alone (Core AI:
    # converted by coreai-torch, compressed by coreai-opt, run and gated on Linux by Core AI's runtime; macOS / iOS
    # 27 and later; needs the coreai extra); "both": the two, where the coreai extra is installed (else the asset is
    # recorded as skipped, with the reason, and the coreai gates skip saying so)
    target: str = "coreml"
    # target both/coreai: drawn eval items (a seeded random sample of this many) decoded greedily through
    # model.aimodel by Core AI's runtime (the coreai_eval step), compared with the PyTorch engine's outputs, and
    # correcting the eval's figures for the coreai quality gates; 0: not run. On Linux the runtime is a
    # single-threaded reference implementation: size it for the machine
    coreai_eval_items: int = 32
    # Core AI runtime worker processes the coreai_eval step decodes those items in, in parallel (the Linux runtime
    # is single-threaded: one per core)
    coreai_eval_workers: int = 2
    compute_precision: str = "fp16"  # "fp16" or "fp32"
    quantize: str = "none"  # "none", "int8", "int4", "palettize4", "palettize6", "palettize8"
    int4_block_size: int = 32  # int4: input channels per block sharing one scale (per-block, macOS 15)
    layout: str = "standard"  # "standard" or "ane" ((B, C, 1, S) tensors, 1x1 convs)
    minimum_deployment_target: str = "macOS15"  # stateful KV cache needs macOS 15
    compute_units: str = "ALL"
    palettize_mode: str = "uniform"  # Core ML's: "uniform" or "kmeans" (needs scikit-learn); Core AI's is k-means
    # palettize*: 0, one palette per weight tensor; N, one per N output channels (Apple's iOS presets: 8 or 32)
    palettize_group_size: int = 0
    # int4 post-training: "none" (data-free, max|block| / 7) or "clip_search" (each block's scale from a clipping
    # search minimising its output error on calibration rows of the training data); not with train.qat
    calibration: str = "none"
    calibration_rows: int = 32  # training rows (the first) the fp16 headroom scan and clip_search run on
    # auto: with fp16 compute, when the scan finds the residual stream above half fp16's limit, export it scaled by a
    # power of two (logits unchanged: distillgates.export.headroom); none: as trained
    fp16_scaling: str = "auto"

    def __post_init__(self) -> None:
        if self.target not in ("coreml", "coreai", "both"):
            raise ValueError(f"target must be coreml/coreai/both, got {self.target!r}")
        if self.target != "coreml" and self.layout != "standard":
            raise ValueError(f"target {self.target!r} with layout {self.layout!r}: the Core AI target converts layout "
                             "standard only (set layout standard, or target coreml)")
        if self.coreai_eval_items < 0:
            raise ValueError(f"coreai_eval_items must be >= 0, got {self.coreai_eval_items}")
        if self.coreai_eval_workers < 1:
            raise ValueError(f"coreai_eval_workers must be >= 1, got {self.coreai_eval_workers}")
        if self.calibration not in ("none", "clip_search"):
            raise ValueError(f"calibration must be none/clip_search, got {self.calibration!r}")
        if self.calibration != "none" and (self.quantize != "int4" or self.layout != "standard"):
            raise ValueError(f"calibration {self.calibration!r} calibrates int4 weights of layout standard, got "
                             f"quantize {self.quantize!r}, layout {self.layout!r}")
        if self.fp16_scaling not in ("auto", "none"):
            raise ValueError(f"fp16_scaling must be auto/none, got {self.fp16_scaling!r}")
        if self.calibration_rows < 1:
            raise ValueError(f"calibration_rows must be >= 1, got {self.calibration_rows}")
        if self.palettize_mode not in ("uniform", "kmeans"):
            raise ValueError(f"palettize_mode must be uniform/kmeans, got {self.palettize_mode!r}")
        if self.compute_units not in ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE"):
            raise ValueError(f"compute_units must be ALL/CPU_ONLY/CPU_AND_GPU/CPU_AND_NE, got {self.compute_units!r}")
        if self.compute_precision not in ("fp16", "fp32"):
            raise ValueError(f"compute_precision must be fp16/fp32, got {self.compute_precision!r}")
        if self.quantize not in ("none", "int8", "int4", "palettize4", "palettize6", "palettize8"):
            raise ValueError(f"quantize must be none/int8/int4/palettize4/palettize6/palettize8, got {self.quantize!r}")
        if self.int4_block_size < 1:
            raise ValueError(f"int4_block_size must be >= 1, got {self.int4_block_size}")
        version = re.fullmatch(r"(?:macOS|iOS)(\d+)", self.minimum_deployment_target)
        if version is None or int(version[1]) < (15 if self.minimum_deployment_target.startswith("macOS") else 18):
            raise ValueError(f"minimum_deployment_target must be macOS15/iOS18 or later (stateful KV cache, "
                             f"multifunction package, int4 per-block weights), got {self.minimum_deployment_target!r}")
        if self.layout not in ("standard", "ane"):
            raise ValueError(f"layout must be standard/ane, got {self.layout!r}")

        if self.palettize_group_size < 0:
            raise ValueError(f"palettize_group_size must be >= 0, got {self.palettize_group_size}")

@dataclass
class SpeedConfig:
    """Speed harness settings."""

    n_prompts: int = 8
    # untimed generations first: a process's first decode compiles (a minute or more at SmolLM2-135M on 2 cores)
    warmup: int = 2
    repeats: int = 3
    max_new_tokens: int = 48
    # "torch"; "coreml": export/model.mlpackage (macOS); "coreai": export/model.aimodel in the speed worker's own
    # process (macOS 27: Core AI's OS framework; off macOS refused, its reference runtime times nothing real)
    engine: str = "torch"
    # speculative speedup: fresh speed worker processes, each decoding every prompt plainly and speculatively back to
    # back; the speedup's interval is over these processes (K - 1 degrees of freedom). 8 x 32: the toy's TTFT gate
    # (true ratio ~1.0, minimum 0.9) with the modes in blocks of 8 came out inconclusive in 3 of 12 decisions at
    # 6 x 16, in 0 of 10 at 8 x 32, and at 8 x 32 on CI (docs/gates.md)
    speculative_workers: int = 8
    speculative_samples: int = 32  # prompts per process, each decoded in both modes (then the drafter alone as often)
    # eval prompts decoded speculatively, untimed: identical output, acceptance, the per-item rollback rate's p95
    speculative_items: int = 32

    def __post_init__(self) -> None:
        if self.engine not in ("torch", "coreml", "coreai"):
            raise ValueError(f"engine must be torch/coreml/coreai, got {self.engine!r}")
        if self.speculative_items < 1:
            raise ValueError(f"speculative_items must be >= 1, got {self.speculative_items}")
        if self.n_prompts < 1 or self.repeats < 1:
            raise ValueError(f"n_prompts and repeats must be >= 1, got {self.n_prompts} and {self.repeats}")
        if self.warmup < 1:
            raise ValueError(f"warmup: {self.warmup} would time the first generation, whose first decode compiles "
                             "(a minute or more at SmolLM2-135M on 2 cores); need >= 1")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens: {self.max_new_tokens} gives no TPS sample (TPS excludes the first "
                             "token); need >= 2")
        if self.speculative_workers < 3:
            raise ValueError(f"speculative_workers: {self.speculative_workers} processes cannot decide a speedup (its "
                             "interval over processes has workers - 1 degrees of freedom: 1 df gives a t factor of "
                             "6.3); need >= 3")
        if self.speculative_samples < 8:
            raise ValueError(f"speculative_samples: {self.speculative_samples} samples per process do not cover the "
                             "speed worker's 8 prompts once; need >= 8")


DEFAULT_PII_PATTERNS: dict[str, str] = {
    "email": r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+",
    "phone": r"\+\d[\d\s()/-]{6,}\d|\b0\d{2,4}[\s/-]?\d{5,}\b",  # international "+49 170 ..." or national "0170 ..."
    "id": r"\b(?=[A-Z0-9-]*\d)[A-Z]{1,4}[-]?\d{4,}\b|\b\d{8,}\b",
}


@dataclass
class PrivacyConfig:
    """What the scorer's privacy check counts as a leak (``eval.privacy``)."""

    # name -> regex; a match in a user message is PII the output must not repeat (besides the item's pii list)
    pii_patterns: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_PII_PATTERNS))
    # "tool" or "tool.argument": PII in that tool's (argument's) call is no leak: a ticketing tool may take the
    # user's email. The final answer is always checked.
    allow: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, pattern in self.pii_patterns.items():
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"pii_patterns.{name}: not a valid regex: {err}") from err
        for entry in self.allow:
            if not isinstance(entry, str) or not entry or entry.count(".") > 1:
                raise ValueError(f"allow: expected 'tool' or 'tool.argument', got {entry!r}")


@dataclass
class EvalConfig:
    """How the pipeline's eval step runs the student (and a local teacher), and what the scorer counts."""

    # tokens per assistant turn: the check and eval steps refuse one shorter than a held-out reference's turn in the
    # run's tokenizer (such an item fails whatever the model does)
    max_new_tokens: int = 96
    max_calls: int = 4  # tool calls allowed per item (refused, as above, below a held-out reference's calls)
    # the student decodes tool calls with the runtime's constrained JSON decoding (runtime/constrained.py),
    # as a deployment that turns it on would: every call that ends within the turn's token budget and the
    # context then parses and matches its tool's schema (part of the student's runner fingerprint)
    constrained_tool_calls: bool = False
    # torch threads of the student's eval and of each of the determinism check's shard workers: the same
    # kernels (reduction order), so the reported outputs are the check's unsharded arm, compared bit for bit
    threads: int = 1
    # items the student's engine decodes together (eval/runners.py run_items_batched: continuous batching
    # over the static cache's rows); 1: one item at a time. Greedy outputs equal batch 1's up to float ties;
    # not with constrained_tool_calls. Above 1 it is part of the student's runner fingerprint
    batch_size: int = 1
    # a tool call no fixture answers: "error" (an error result for the model) or "mock" (mock_result, counted
    # apart as mocked_calls); a counted miss of the fixture hit-rate either way
    missing_fixture: str = "error"
    mock_result: dict[str, Any] = field(default_factory=lambda: {"status": "ok"})  # the model's result of a mock
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        if self.missing_fixture not in ("error", "mock"):
            raise ValueError(f"missing_fixture must be error/mock, got {self.missing_fixture!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.batch_size > 1 and self.constrained_tool_calls:
            raise ValueError("batch_size > 1 cannot decode with constrained_tool_calls (one constraint per item and "
                             "token): set one of them back (batch_size: 1 or constrained_tool_calls: false)")
        if self.max_new_tokens < 1 or self.max_calls < 1:
            raise ValueError(f"max_new_tokens and max_calls must be >= 1, got {self.max_new_tokens}, {self.max_calls}")


@dataclass
class GatesConfig:
    """Gate thresholds (defaults from DESIGN.md; a config may tighten them)."""

    f1_lax_min: float = 0.90
    tool_selection_min: float = 0.90
    json_validity_min: float = 0.98
    fixture_hit_rate_min: float = 0.95
    f1_drift_min: float = -0.01  # mean per-item ΔF1 (lax, strict) vs baseline below this fails if significant
    privacy_ok_rate_min: float = 1.0
    controls_with_integration_max: int = 0
    median_tokens_ratio_max: float = 0.85  # student / teacher
    shape_drift_max: float = 0.01  # per-shape mean per-item F1 lax drop above this fails if significant
    qat_cosine_min: float = 0.999
    export_cosine_min: float = 0.999
    ane_residency_min: float = 0.80
    ane_residency_drop_max: float = 0.10
    coreml_cosine_min: float = 0.999
    coreai_cosine_min: float = 0.999  # coreai_parity: the .aimodel run by Core AI's runtime vs eager, per function
    coreai_top1_min: float = 0.95  # coreai_parity: share of parity cases whose argmax is eager's
    # coreai_parity: share of eval items the asset decodes as PyTorch does (fp16 compute can flip near-ties: the
    # toy's 32 items are all identical; on coreai-opt's own int8 grid 31, the other's answer as correct)
    coreai_outputs_identical_min: float = 0.9
    speed_regression_max: float = 0.05
    ttfa_p95_tokens_max: float = 25.0
    prompt_cache_ttft_reduction_min: float = 0.30
    prompt_cache_hit_rate_min: float = 0.95
    speculative_speedup_min: float = 1.0
    speculative_acceptance_min: float = 0.3
    # the documents ask 1.33 (TTFT -25%), which exact speculative decoding cannot give: its first token is the worker's
    # (docs/gates.md); the gate shows that drafting costs TTFT at most 1/0.9 - 1 = 11%
    speculative_ttft_speedup_min: float = 0.9
    speculative_rollback_p95_max: float = 0.10  # per item: verifications that rejected a draft / worker steps
    peak_memory_fraction_max: float = 0.75  # speed_targets: the speed worker's peak resident memory / the machine's RAM
    significance_alpha: float = 0.05  # drift gates: one-sided test level; speed: the session's false-alarm bound
    # gate checks (by name, e.g. privacy_ok_rate) that may be "not measured" (an empty slice) or "underpowered"
    # (a drift gate that cannot detect 3x its tolerance) under CI: waived, they skip with the reason instead of failing
    waive: list[str] = field(default_factory=list)


@dataclass
class Config:
    """A pipeline config: every section optional so partial YAMLs (one model) load too."""

    name: str = "unnamed"
    seed: int = 0
    threads: int = 0  # torch intra-op threads for the pipeline; 0 = torch's default (all cores)
    # where training, the local teacher (fine-tuning, KD, its eval) compute: auto (cuda, then mps, then cpu), cpu,
    # cuda, cuda:<n> or mps. The student's eval, export and speed run on CPU whatever it says.
    device: str = "auto"
    student: ModelConfig | None = None
    drafter: ModelConfig | None = None
    teacher: TeacherConfig | None = None
    kd: KDConfig = field(default_factory=KDConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    drafter_train: TrainConfig | None = None
    export: ExportConfig = field(default_factory=ExportConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gates: GatesConfig = field(default_factory=GatesConfig)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "mps") and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:<n> or mps, got {self.device!r}")
        for role in ("student", "drafter"):
            model = getattr(self, role)
            if model is not None and model.max_seq_len < max(self.shapes.lengths):
                raise ValueError(
                    f"{role}.max_seq_len ({model.max_seq_len}) is below the largest enumerated shape "
                    f"({max(self.shapes.lengths)})"
                )
        if self.student and self.drafter and self.student.vocab_size != self.drafter.vocab_size:
            raise ValueError("drafter.vocab_size must equal student.vocab_size (speculative decoding)")
        if self.train.qat.enabled and self.export.quantize.startswith("palettize"):
            raise ValueError(f"train.qat.enabled: QAT trains the int8 or int4 grid of export.quantize, and "
                             f"export.quantize {self.export.quantize!r} has none (use int8/int4, or qat.enabled false)")
        if self.train.qat.enabled and self.export.calibration != "none":
            raise ValueError(f"train.qat.enabled with export.calibration {self.export.calibration!r}: QAT'd weights "
                             f"lie on their int4 grid already, calibration would move them (choose one)")
        if self.speed.engine == "coreml" and self.export.target == "coreai":
            raise ValueError("speed.engine coreml times export/model.mlpackage, and export.target coreai writes none: "
                             "set export.target coreml/both, or speed.engine torch")
        if self.speed.engine == "coreai" and self.export.target == "coreml":
            raise ValueError("speed.engine coreai times export/model.aimodel, and export.target coreml writes none: "
                             "set export.target coreai/both, or speed.engine torch")
        if self.train.on_policy.share > 0 and self.teacher is not None and self.teacher.kind == "openai":
            raise ValueError("train.on_policy needs the teacher's log-probs of the student's own tokens; teacher.kind "
                             "openai is an OpenAI-compatible chat API, which returns log-probs of the tokens it "
                             "samples only (scoring given tokens needs e.g. vLLM's prompt_logprobs, which the client "
                             "does not speak): use a local teacher (teacher.kind local) or train.on_policy.share 0")

    def train_section(self, role: str) -> TrainConfig:
        """The recipe ``role`` trains with: ``drafter_train`` for the drafter when given, else ``train``."""
        return self.drafter_train if role == "drafter" and self.drafter_train is not None else self.train

    @property
    def student_qat_int4_block(self) -> int | None:
        """The student's QAT grid (it follows ``export.quantize``): int4 per block of this many input channels,
        or None for int8 per channel (``int8``, ``none``). The drafter, not exported, keeps int8."""
        return self.export.int4_block_size if self.export.quantize == "int4" else None

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of this config (cache key for pipeline steps)."""
        return sha256_json(to_dict(self))


# --------------------------------------------------------------------------------------
# Loading


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key (``__lines__``)."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict[Hashable, Any]:
    mapping = loader.construct_mapping(node, deep=True)
    mapping["__lines__"] = {k.value: k.start_mark.line + 1 for k, _ in node.value}  # 1-based
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _strip_lines(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_lines(v) for k, v in value.items() if k != "__lines__"}
    if isinstance(value, list):
        return [_strip_lines(v) for v in value]
    return value


def _where(source: str, path: str, line: int | None) -> str:
    return f"{source}:{line}: {path}" if line else f"{source}: {path}"


def _check_type(value: Any, hint: Any, source: str, path: str, line: int | None) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(value, inner[0], source, path, line)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value, source, path, line)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{_where(source, path, line)}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_type(v, args[0], source, f"{path}[{i}]", line) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(source, path, line)}: expected a mapping, got {type(value).__name__}")
        return _strip_lines(value)
    if hint is Any:
        return _strip_lines(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (hint in (int, float) and isinstance(value, bool)) or not isinstance(value, hint):
        raise ConfigError(
            f"{_where(source, path, line)}: expected {hint.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def from_dict(cls: type, data: Any, source: str = "<dict>", path: str = "", line: int | None = None) -> Any:
    """Build dataclass ``cls`` from a mapping, validating keys and types.

    Raises:
        ConfigError: naming ``source`` (file), the line and the dotted field path.
    """
    prefix = f"{path}." if path else ""
    if not isinstance(data, dict):
        raise ConfigError(f"{_where(source, path or '<root>', line)}: expected a mapping, got {type(data).__name__}")
    lines = data.get("__lines__", {})
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key == "__lines__":
            continue
        key_line = lines.get(key, line)
        if key not in names:
            raise ConfigError(
                f"{_where(source, prefix + str(key), key_line)}: unknown key "
                f"(expected one of: {', '.join(sorted(names))})"
            )
        kwargs[key] = _check_type(value, hints[key], source, prefix + key, key_line)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{_where(source, path or '<root>', line)}: missing required field(s): {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{_where(source, path or cls.__name__, line)}: {err}") from err


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file keeping key line numbers; a syntax error names the file and line."""
    path = Path(path)
    try:
        return yaml.load(path.read_text(), Loader=_LineLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err


def load_config(path: str | Path) -> Config:
    """Load and validate a pipeline config YAML (a model trained from the teacher inherits its shared fields:
    :func:`inherit_teacher_fields`)."""
    data = read_yaml(path)
    data = data if data is not None else {}
    if isinstance(data, dict):
        inherit_teacher_fields(data, str(path))
    return from_dict(Config, data, source=str(path))


TEACHER_SHARED_FIELDS = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "tie_embeddings",
                         "rope_theta", "rope_scaling", "norm_eps", "attention_bias", "qk_norm", "embed_scale",
                         "activation", "sandwich_norm", "query_pre_attn_scalar", "sliding_window",
                         "rope_local_theta")  # fmt: skip
"""What a model initialised from the teacher (``init_from: teacher``, depth pruning) must share with it."""


def _teacher_architecture(data: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The teacher's architecture as a model section: its checkpoint's (``teacher.path``, a directory or GGUF
    file) or its ``teacher.model`` section; None for an API teacher or none given."""
    teacher = data.get("teacher")
    if not isinstance(teacher, dict) or teacher.get("kind", "local") != "local":
        return None
    if teacher.get("path"):
        from transformers import AutoConfig

        from distillgates.checkpoints import checkpoint_dir
        from distillgates.hf import model_config_from_hf

        folder = checkpoint_dir(teacher["path"])
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{_where(source, 'teacher.path', teacher.get('__lines__', {}).get('path'))}: "
                              f"no checkpoint at {teacher['path']} (config.json or a .gguf file)")  # fmt: skip
        return to_dict(model_config_from_hf(AutoConfig.from_pretrained(folder, local_files_only=True)))
    model = teacher.get("model")
    return to_dict(from_dict(ModelConfig, model, source, "teacher.model")) if isinstance(model, dict) else None


def inherit_teacher_fields(data: dict[str, Any], source: str) -> None:
    """A ``student``/``drafter`` section trained from the teacher (its ``init_from: teacher``) takes every field
    of :data:`TEACHER_SHARED_FIELDS` it does not set from the teacher (a GGUF checkpoint's ``norm_eps`` is
    9.999999747378752e-06, 1e-5 read through float32: nobody should have to restate it), and ``max_seq_len``
    (when unset) from the largest enumerated shape. Runs on the YAML mapping before validation.

    Raises:
        ConfigError: a field the section sets that differs from the teacher's (naming the section's key and
            line); floats equal at float32 precision count as the same and take the teacher's value.
    """
    shapes = data.get("shapes") if isinstance(data.get("shapes"), dict) else {}
    for role, train_key in (("student", "train"), ("drafter", "drafter_train" if "drafter_train" in data else "train")):
        section, train = data.get(role), data.get(train_key)
        if not isinstance(section, dict) or not isinstance(train, dict) or train.get("init_from") != "teacher":
            continue
        teacher = _teacher_architecture(data, source)
        if teacher is None:
            continue
        lines = section.get("__lines__", {})
        for name in TEACHER_SHARED_FIELDS:
            if name not in section:
                section[name] = teacher.get(name)
                continue
            mine, theirs = section[name], teacher.get(name)
            if isinstance(mine, float | int) and isinstance(theirs, float) and not isinstance(mine, bool) \
                    and math.isclose(mine, theirs, rel_tol=1e-6):  # fmt: skip
                section[name] = theirs
            elif _strip_lines(mine) != theirs:
                raise ConfigError(
                    f"{_where(source, f'{role}.{name}', lines.get(name))}: {mine!r}, but {train_key}.init_from "
                    f"'teacher' makes the {role} a pruned copy of the teacher, whose {name} is {theirs!r} "
                    "(drop the key: it is inherited)")  # fmt: skip
        section.setdefault("max_seq_len", max((shapes or {}).get("lengths") or ShapesConfig().lengths))


def load_model_config(path: str | Path, role: str = "student") -> ModelConfig:
    """Load one model section (``student``/``drafter``) from a YAML file."""
    model = getattr(load_config(path), role)
    if model is None:
        raise ConfigError(f"{path}: {role}: section is missing")
    return model


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain JSON-able dict (recursively)."""
    return dataclasses.asdict(cast("DataclassInstance", obj)) if dataclasses.is_dataclass(obj) else obj


def sha256_json(obj: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()
