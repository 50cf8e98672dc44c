"""Local Hugging Face teacher: any ``AutoModelForCausalLM`` directory plus its tokenizer.

Gives what distillation needs from a white-box teacher: dense logits for a batch (online KD),
top-k log-probs (offline KD sets), and greedy/temperature generation that records the top-k
log-probs of every generated position. Generation is a plain loop over the HF KV cache
(``past_key_values``) so stop ids and per-step log-probs stay in our hands.

A teacher whose tokenizer is not the student's (another :func:`~distillgates.tokenizer.tokenizer_fingerprint`)
is used for KD through :class:`StudentTokensTeacher` (:func:`local_teacher` picks): its turns come back
in the student's chat format, on the student's tokens, its top-k moved onto them through bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from distillgates.config import sha256_json
from distillgates.data.chat import ChatFormat, chat_format
from distillgates.io import sha256_file
from distillgates.teacher.base import BatchTeacher, TurnResult
from distillgates.teacher.tokens import TeacherToken, TokenBytes, map_position, map_turn
from distillgates.tokenizer import chat_template_text, load_tokenizer, tokenizer_fingerprint


@dataclass
class Generation:
    """Output of :meth:`LocalTeacher.generate` (stop token excluded from ``token_ids``)."""

    text: str
    token_ids: list[int]
    topk_ids: list[list[int]]  # per generated position, k ids by descending log-prob
    topk_logprobs: list[list[float]]
    token_logprobs: list[float]  # log-prob of each chosen token
    finish_reason: str  # "stop" or "length"
    stop_topk_ids: list[int]  # top-k at the position that produced the stop id ([] on "length")
    stop_topk_logprobs: list[float]


def _weights_digest(path: Path) -> str:
    """sha256 over the weight files: the model id changes whenever the weights do."""
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors or *.bin weights found")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + sha256_file(f).encode())
    return h.hexdigest()


class LocalTeacher(BatchTeacher):
    """A causal LM loaded from a ``save_pretrained`` directory."""

    def __init__(self, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 tokenizer: Any = None) -> None:  # fmt: skip
        """``tokenizer``: the one to render and parse with (default: the checkpoint's own)."""
        from transformers import AutoModelForCausalLM

        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise FileNotFoundError(f"{self.path}: not a model directory (config.json missing)")
        # transformers types PreTrainedModel.to (@wraps(Module.to)) as taking the model as its first argument
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.path)
        self.chat_format = chat_format(self.tokenizer)
        self.device = torch.device(device)
        self.model_id = f"local:{self.path.name}:{_weights_digest(self.path)[:16]}"
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.end_id = self.chat_format.end_of_turn_id

    def __repr__(self) -> str:
        return f"LocalTeacher({self.model_id!r})"

    @torch.no_grad()
    def logits(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Dense logits ``(B, T, V)`` (right padding; padded positions are garbage)."""
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=_maybe(attention_mask, self.device))
        return out.logits.float()  # (B, T, V)

    @torch.no_grad()
    def topk_logprobs(self, input_ids: Tensor, k: int, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Top-k log-probs of the next-token distribution at every position: ``(values, ids)``, each (B, T, k)."""
        logprobs = F.log_softmax(self.logits(input_ids, attention_mask), dim=-1)  # (B, T, V)
        values, ids = logprobs.topk(k, dim=-1)  # (B, T, k)
        return values, ids

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: list[int] | tuple[int, ...] = (),
        temperature: float = 0.0,
        top_k: int = 20,
        seed: int = 0,
    ) -> Generation:
        """Greedy (``temperature == 0``) or sampled generation recording top-k log-probs per step.

        Stops at the first id in ``stop_ids`` (excluded from the output), after ``max_new_tokens``
        or at the model's ``max_position_embeddings``, whichever comes first.
        """
        return self.generate_batch([prompt_ids], max_new_tokens, stop_ids, temperature, top_k, seed)[0]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: list[int] | tuple[int, ...] = (),
        temperature: float = 0.0,
        top_k: int = 20,
        seed: int = 0,
    ) -> list[Generation]:
        """:meth:`generate` for several prompts at once (left padding, one KV cache).

        Rows finish independently; the loop ends when every row hit a stop id or its budget.
        """
        generator = torch.Generator().manual_seed(seed)
        B, T = len(prompts), max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts], device=self.device)  # (B, T)
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=self.device)  # (B, T)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        budget = min(max_new_tokens, self.max_positions - T)
        stop = torch.tensor(sorted(set(stop_ids)) or [-1], device=self.device)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        rows: list[dict[str, Any]] = [{"ids": [], "top": [], "lp": [], "chosen": [], "stop": None} for _ in prompts]
        past = None
        for _ in range(max(budget, 0)):
            out = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True
            )
            past = out.past_key_values
            logprobs = F.log_softmax(out.logits[:, -1].float(), dim=-1)  # (B, V)
            values, top = logprobs.topk(top_k, dim=-1)  # (B, k)
            if temperature > 0:
                probs = F.softmax(logprobs / temperature, dim=-1)  # (B, V)
                next_ids = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(self.device)  # (B,)
            else:
                next_ids = top[:, 0]  # (B,)
            chosen = logprobs.gather(-1, next_ids[:, None]).squeeze(-1)  # (B,)
            is_stop = torch.isin(next_ids, stop)  # (B,)
            for b in (~done).nonzero().flatten().tolist():
                row = rows[b]
                if is_stop[b]:
                    row["stop"] = (top[b].tolist(), values[b].tolist())
                else:
                    row["ids"].append(int(next_ids[b]))
                    row["top"].append(top[b].tolist())
                    row["lp"].append(values[b].tolist())
                    row["chosen"].append(float(chosen[b]))
            done |= is_stop
            if bool(done.all()):
                break
            input_ids = next_ids[:, None]  # (B, 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)  # (B, T+n)
            positions = positions[:, -1:] + 1  # (B, 1)
        return [
            Generation(
                text=self._decode(r["ids"]),
                token_ids=r["ids"],
                topk_ids=r["top"],
                topk_logprobs=r["lp"],
                token_logprobs=r["chosen"],
                finish_reason="stop" if r["stop"] is not None else "length",
                stop_topk_ids=r["stop"][0] if r["stop"] is not None else [],
                stop_topk_logprobs=r["stop"][1] if r["stop"] is not None else [],
            )
            for r in rows
        ]

    def complete_batch(
        self, conversations: list[list[dict[str, Any]]], *, max_new_tokens: int, top_k: int, temperature: float = 0.0,
        tools: list[list[dict[str, Any]] | None] | None = None,
    ) -> list[TurnResult]:  # fmt: skip
        """One assistant turn for each conversation and its item's ``tools``, rendered by the tokenizer's chat
        template (the built-in ones list the tools in the system message, so they ignore ``tools``), stopping
        at its end-of-turn token (toy: ``<|end|>``), in one batched generation."""
        prompts = self.prompts(conversations, tools)
        gens = self.generate_batch(prompts, max_new_tokens, [self.end_id], temperature=temperature, top_k=top_k)
        return [self.turn_result(p, gen, max_new_tokens, top_k, temperature) for p, gen in zip(prompts, gens)]

    def prompts(
        self, conversations: list[list[dict[str, Any]]], tools: list[list[dict[str, Any]] | None] | None = None
    ) -> list[list[int]]:
        """Token ids of each conversation (and its ``tools``) rendered by this teacher's chat template, up to
        the generation prompt."""
        tools = tools or [None] * len(conversations)
        return [self.encode(self.chat_format.render(m, t, add_generation_prompt=True))
                for m, t in zip(conversations, tools, strict=True)]  # fmt: skip

    def turn_result(
        self, prompt_ids: list[int], gen: Generation, max_new_tokens: int, top_k: int, temperature: float
    ) -> TurnResult:
        """The :class:`TurnResult` of one generation (this teacher's text, ids and top-k)."""
        request = {
            "model": self.model_id,
            "prompt_ids": prompt_ids,
            "max_new_tokens": max_new_tokens,
            "top_k": top_k,
            "temperature": temperature,
        }
        return TurnResult(
            text=gen.text,
            token_ids=gen.token_ids,
            topk_ids=gen.topk_ids,
            topk_logprobs=gen.topk_logprobs,
            finish_reason=gen.finish_reason,
            request_id="local-" + sha256_json(request)[:24],  # deterministic: same request, same id
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(gen.token_ids) + (gen.finish_reason == "stop"),
            stop_topk_ids=gen.stop_topk_ids,
            stop_topk_logprobs=gen.stop_topk_logprobs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return cast(str, text)  # one sequence -> one string


def _maybe(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


# --------------------------------------------------------------------------------------
# A teacher with another tokenizer


def teacher_tokenizer(path: str | Path, tokenizer: Any, chat_template: str | None = None) -> Any:
    """The tokenizer the local teacher at ``path`` renders and parses with, for a run with ``tokenizer``.

    Its template: ``chat_template`` (``teacher.chat_template``: a built-in name or a ``.jinja`` file) when
    given; else a teacher with the run's vocabulary renders with the run's template (the run's
    ``tokenizer.chat_template``, which may replace the checkpoint's own); else its own.
    """
    if chat_template is not None:
        return load_tokenizer(path, chat_template_text(chat_template, "teacher.chat_template"))
    # the run's template stands in until the vocabularies are compared (a base checkpoint may have no template)
    if load_tokenizer(path, tokenizer.chat_template).get_vocab() == tokenizer.get_vocab():
        return tokenizer
    return load_tokenizer(path)  # another vocabulary renders with its own template


def local_teacher(path: str | Path, tokenizer: Any, chat_template: str | None = None, device: str = "cpu"
                  ) -> LocalTeacher | StudentTokensTeacher:  # fmt: skip
    """The local teacher at ``path`` (on ``device``) for a student with ``tokenizer``: the teacher itself when
    its tokenizer is the student's (same :func:`~distillgates.tokenizer.tokenizer_fingerprint`), else the
    teacher seen on the student's tokens and in its chat format (:class:`StudentTokensTeacher`); its template
    as :func:`teacher_tokenizer` picks it.
    """
    teacher = LocalTeacher(path, device=device, tokenizer=teacher_tokenizer(path, tokenizer, chat_template))
    if tokenizer_fingerprint(teacher.tokenizer) == tokenizer_fingerprint(tokenizer):
        return teacher
    return StudentTokensTeacher(teacher, tokenizer)


class StudentTokensTeacher(BatchTeacher):
    """A :class:`LocalTeacher` whose tokenizer is not the student's, as the KD builder needs it: each turn in
    the student's chat format, on the student's tokens, with the teacher's top-k moved onto them through
    bytes (what the API teacher does, :mod:`.http`). The teacher writes its turn in its own format (its
    template renders the conversation); :func:`student_turn` does the rest."""

    def __init__(self, teacher: LocalTeacher, tokenizer: Any) -> None:
        self.teacher = teacher
        self.tokenizer = tokenizer  # the student's
        self.chat_format = chat_format(tokenizer)
        self.token_bytes = TokenBytes(tokenizer)
        self.teacher_bytes = TokenBytes(teacher.tokenizer)
        # the teacher's tokenizer (and template) shape its turns: a KD checkpoint or cache of another never matches
        self.model_id = f"{teacher.model_id}:tokenizer:{tokenizer_fingerprint(teacher.tokenizer)[:16]}"

    def __repr__(self) -> str:
        return f"StudentTokensTeacher({self.model_id!r})"

    def complete_batch(
        self, conversations: list[list[dict[str, Any]]], *, max_new_tokens: int, top_k: int, temperature: float = 0.0,
        tools: list[list[dict[str, Any]] | None] | None = None,
    ) -> list[TurnResult]:  # fmt: skip
        t = self.teacher
        prompts = t.prompts(conversations, tools)
        gens = t.generate_batch(prompts, max_new_tokens, [t.end_id], temperature=temperature, top_k=top_k)
        return [student_turn(gen, t.turn_result(p, gen, max_new_tokens, top_k, temperature), t.chat_format,
                             self.teacher_bytes, self.chat_format, self.token_bytes)
                for p, gen in zip(prompts, gens)]  # fmt: skip


def student_turn(
    gen: Generation, base: TurnResult, teacher_fmt: ChatFormat, teacher_bytes: TokenBytes, student_fmt: ChatFormat,
    student_bytes: TokenBytes,
) -> TurnResult:  # fmt: skip
    """A teacher's generated turn (in its chat format ``teacher_fmt``) as the student's: parsed into content and
    calls by the teacher's parser, rendered by the student's template
    (:meth:`~distillgates.data.chat.ChatFormat.assistant_text`), the calls kept structured (the next prompt
    renders them in the teacher's format), and the teacher's top-k moved onto the student's tokens through
    bytes (:func:`~distillgates.teacher.tokens.map_turn`). As for an API teacher, a turn that is several turns
    in the student's format, or whose text the teacher's bytes do not spell (calls written otherwise), is
    text-only (``token_ids`` None). A call that does not parse leaves the whole text as an answer (what a
    server's parser returns). The stop position's top-k is moved too: the teacher's end of turn is the
    student's."""
    parsed = teacher_fmt.parse_turn(gen.text)
    if parsed.calls and all(c is not None for c in parsed.calls):
        content = parsed.preamble
        calls = [{"id": f"call_{j}", "name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}
                 for j, c in enumerate(parsed.calls) if c is not None]  # fmt: skip
    else:
        content, calls = gen.text, []
    text = student_fmt.assistant_text(content, calls)
    out = replace(base, text=text, token_ids=None, topk_ids=[], topk_logprobs=[], tool_calls=calls, content=content,
                  stop_topk_ids=[], stop_topk_logprobs=[])  # fmt: skip
    by = teacher_bytes.by_id
    if len(student_fmt.split_turns(text)) == 1:
        steps = zip(gen.token_ids, gen.token_logprobs, gen.topk_ids, gen.topk_logprobs)
        tokens = [TeacherToken(by[i], lp, [(by[j], v) for j, v in zip(top, lps)]) for i, lp, top, lps in steps]
        map_turn(out, tokens, student_fmt.tokenizer, student_bytes)
    end = teacher_fmt.end_of_turn_id
    if end in gen.stop_topk_ids:  # the stop token is among the top-k (always when greedy)
        lp = gen.stop_topk_logprobs[gen.stop_topk_ids.index(end)]
        stop = TeacherToken(by[end], lp, [(by[j], v) for j, v in zip(gen.stop_topk_ids, gen.stop_topk_logprobs)])
        out.stop_topk_ids, out.stop_topk_logprobs, _ = map_position(student_fmt.end_of_turn_id, stop, b"",
                                                                    student_bytes)  # fmt: skip
    return out
