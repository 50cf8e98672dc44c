"""What every teacher returns, and the chat rendering shared by the local teacher and the server.

Design choices:
- A teacher is anything with ``model_id``, ``tokenizer`` and ``complete(messages, ...)``: one
  assistant turn from OpenAI-style messages. The KD builder drives multi-turn conversations
  through that one call, so the local HF teacher and an HTTP API teacher are interchangeable.
- ``TurnResult.text`` never contains the final stop token (OpenAI semantics: the stop sequence is
  not part of the content). It is the turn in the student's chat format: a local teacher's own
  text (with another tokenizer: its turn parsed and rendered by the student's template, as an
  API's, :class:`distillgates.teacher.local.StudentTokensTeacher`); an API's assistant message
  (``content`` and structured ``tool_calls``) rendered by the student's template
  (:meth:`distillgates.data.chat.ChatFormat.assistant_text`: the toy writes one call per turn, so
  several calls are several turns joined by its end-of-turn token). The API's
  message is also kept as it came (``content``, ``tool_calls`` with their ids), so the next request
  can repeat it and answer the calls by id.
- ``stop_topk_*`` carries the teacher's distribution at the stop position when the teacher can
  give it (local teacher), so the student still learns when to stop.
- Messages render through the student's chat format (:class:`distillgates.data.chat.ChatFormat`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


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
    # an API's structured calls, in order: [{"id", "name", "arguments" (the JSON string as returned)}];
    # several are parallel calls of one assistant message. [] for a local teacher (calls are text).
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    content: str = ""  # an API's message content as returned (with tool_calls: their preamble)

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
        self,
        messages: list[dict[str, Any]],
        *,
        max_new_tokens: int,
        top_k: int,
        temperature: float = 0.0,
        tools: list[dict[str, Any]] | None = None,
    ) -> TurnResult:
        """One assistant turn. ``tools``: the item's tools (flat OpenAI function format,
        :func:`distillgates.data.tools.item_tools`); an API teacher sends them, a local teacher reads
        them from the system prompt."""
        ...


class BatchTeacher(ABC):
    """A teacher that completes many conversations in one batched generation (the local ones):
    :meth:`complete` is :meth:`complete_batch` of one."""

    def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        max_new_tokens: int,
        top_k: int,
        temperature: float = 0.0,
        tools: list[dict[str, Any]] | None = None,
    ) -> TurnResult:
        return self.complete_batch([messages], max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature,
                                   tools=[tools])[0]  # fmt: skip

    @abstractmethod
    def complete_batch(
        self, conversations: list[list[dict[str, Any]]], *, max_new_tokens: int, top_k: int, temperature: float = 0.0,
        tools: list[list[dict[str, Any]] | None] | None = None,
    ) -> list[TurnResult]:  # fmt: skip
        """:meth:`Teacher.complete` for several conversations (``tools``: each one's)."""
