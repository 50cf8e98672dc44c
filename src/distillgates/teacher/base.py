"""What every teacher returns, and the chat rendering shared by the local teacher and the server.

Design choices:
- A teacher is anything with ``model_id``, ``tokenizer`` and ``complete(messages, ...)``: one
  assistant turn from OpenAI-style messages. The KD builder drives multi-turn conversations
  through that one call, so the local HF teacher and an HTTP API teacher are interchangeable.
- ``TurnResult.text`` never contains the stop token (OpenAI semantics: the stop sequence is not
  part of the content). ``stop_topk_*`` carries the teacher's distribution at the stop position
  when the teacher can give it (local teacher), so the student still learns when to stop.
- Message rendering follows the project chat format (contract.md "Chat format"):
  ``<|bos|><|system|>..<|end|><|user|>..<|end|><|assistant|>``; an assistant message renders as
  ``<|assistant|>{content}<|end|>`` and a ``tool`` message as ``<|tool_result|>{content}<|end|>``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from distillgates.tokenizer import ASSISTANT, BOS, END, SYSTEM, TOOL_RESULT, USER

_ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL_RESULT}


@dataclass
class TurnResult:
    """One generated assistant turn.

    ``token_ids``/``topk_*`` cover the tokens of ``text`` (stop token excluded); ``token_ids`` is
    None when the teacher's tokens could not be mapped onto the local tokenizer (API teacher
    with another vocabulary): the KD builder then re-tokenizes ``text`` and keeps no top-k.
    """

    text: str
    token_ids: list[int] | None
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    finish_reason: str  # "stop" (stop token reached) or "length"
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    stop_topk_ids: list[int] = field(default_factory=list)  # distribution at the stop position, if known
    stop_topk_logprobs: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnResult:
        return cls(**data)


class Teacher(Protocol):
    """The one call the KD builder needs."""

    model_id: str  # identifies weights/endpoint; part of every cache key
    tokenizer: Any  # the student's tokenizer (PreTrainedTokenizerFast)

    def complete(
        self, messages: list[dict[str, Any]], *, max_new_tokens: int, top_k: int, temperature: float = 0.0
    ) -> TurnResult: ...


def render_messages(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Chat-format text for OpenAI-style messages (roles system/user/assistant/tool).

    Raises:
        ValueError: on an unknown role or a non-string content, naming the message index.
    """
    parts = [BOS]
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in _ROLE_TOKENS:
            raise ValueError(f"messages[{i}].role: expected one of {sorted(_ROLE_TOKENS)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        parts.append(f"{_ROLE_TOKENS[role]}{content}{END}")
    if add_generation_prompt:
        parts.append(ASSISTANT)
    return "".join(parts)
