"""Train, save, load and fingerprint the byte-level BPE tokenizer of the toy task.

Design choices:
- Byte-level BPE (GPT-2 style, HF ``tokenizers``): every unicode string round-trips exactly,
  there is no unknown token and no normalizer that could rewrite text.
- The chat special tokens of the prompt wrapper are registered as special added tokens, so each
  is one id and never split or merged by BPE.
- No post-processor adds ``<|bos|>``: the rendered conversation already carries it, so
  ``encode(render_conversation(item))`` is the model input as is.
- The toy chat format is this tokenizer's chat template (:data:`TOY_CHAT_TEMPLATE`), rendered by
  ``apply_chat_template`` like any other (:mod:`distillgates.data.chat`).
- Pre-tokenization is GPT-2's regex with ``_`` counted as a letter, so identifiers such as
  ``get_weather`` or ``from_currency`` can become one token (shorter tool calls in a tiny vocab).
- ``trim_offsets=False``: offsets cover the leading space of a token, so character spans map to
  token masks without gaps (process-step targets rely on it).
- Training is single-threaded and fed in a fixed order so the same corpus gives the same merges
  (tokenizers' parallel word counting can break ties differently between runs).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built: the constants stay cheap to import
    from transformers import PreTrainedTokenizerFast

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL_CALL = "<|tool_call|>"
TOOL_RESULT = "<|tool_result|>"
END = "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, TOOL_CALL, TOOL_RESULT, END)
"""Chat special tokens; their ids are 0..8 in this order in every tokenizer trained here."""

# The toy chat format as a Jinja chat template (OpenAI messages: assistant ``tool_calls`` in the OpenAI
# ``{"function": {...}}`` or the flat ``{"name", "arguments"}`` form, ``tool`` messages). Layout:
#   <|bos|><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>
#   {preamble}<|tool_call|>{"name":...,"arguments":{...}}<|end|><|tool_result|>{result}<|end|><|assistant|>
#   {answer}<|end|><|eos|>
# The call JSON is compact with keys name, arguments (canonical_call); a conversation that ends on an
# assistant answer ends with <|eos|>. ``tools`` are not rendered: the system message lists them.
TOY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}<|system|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'user' %}<|user|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'tool' %}<|tool_result|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' %}<|assistant|>"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{%- if loop.first %}{{ message.content or '' }}{% endif %}"
    "<|tool_call|>{{ {'name': call.name, 'arguments': call.arguments} | tojson(separators=(',', ':')) }}<|end|>"
    "{%- endfor %}"
    "{%- else %}{{ message.content }}<|end|>{% if loop.last and not add_generation_prompt %}{{ eos_token }}{% endif %}"
    "{%- endif %}"
    "{%- else %}{{ raise_exception('unknown role ' ~ message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

CHATML_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                                          "<tool_response>", "</tool_response>")  # fmt: skip
"""Special tokens of the ChatML template (Qwen2.5's, which also writes its tool tags as single tokens)."""

# ChatML turns with Hermes tool calls, in the style of Qwen2.5's template: each call as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, results in a user turn as
# <tool_response>...</tool_response> (consecutive results share one turn). Unlike Qwen's it does not list
# ``tools`` itself: the system message lists them compactly, as in the toy format (Qwen's full JSON schemas
# would quadruple the own-data example's prompts: 412 instead of 76 tokens, median).
CHATML_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.function.name + '\", \"arguments\": ' "
    "+ (tool_call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


GEMMA_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
"""Special tokens of Gemma's turn format (single tokens in Gemma 3's vocabulary, ids 0, 1, 2, 105, 106 there)."""

# Gemma 3's turns (its own template: <start_of_turn>user|model ... <end_of_turn>, the system message opening the
# first user turn, since Gemma has no system role) with Hermes tool calls, as the chatml template writes them:
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> in a model turn, results in a user turn as
# <tool_response>...</tool_response>. Gemma's own template renders no tool calls (a tool-calling fine-tune such as
# FunctionGemma brings its own format, a .jinja file with tokenizer.tool_call_format).
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set first_user_prefix = messages[0].content + '\n\n' %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<start_of_turn>' + ('model' if message.role == 'assistant' else 'user') + '\n' "
    "+ (first_user_prefix if loop.first else '') + message.content + '<end_of_turn>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<start_of_turn>model' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.function.name + '\", \"arguments\": ' "
    "+ (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<end_of_turn>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}{{- '<start_of_turn>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}{{- '<end_of_turn>\n' }}{%- endif %}"
    "{%- else %}{{- raise_exception('unknown role ' ~ message.role) }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template a trained tokenizer can carry, with the special tokens it writes."""

    template: str
    special_tokens: tuple[str, ...]  # ids 0..n-1 in this order
    bos: str | None
    eos: str
    pad: str


CHAT_TEMPLATES = {
    "toy": ChatTemplate(TOY_CHAT_TEMPLATE, SPECIAL_TOKENS, BOS, EOS, PAD),
    "chatml": ChatTemplate(CHATML_CHAT_TEMPLATE, CHATML_SPECIAL_TOKENS, None, "<|im_end|>", "<|endoftext|>"),
    "gemma": ChatTemplate(GEMMA_CHAT_TEMPLATE, GEMMA_SPECIAL_TOKENS, "<bos>", "<eos>", "<pad>"),
}
"""Templates of trained tokenizers (``tokenizer.chat_template``); a tokenizer directory brings its own."""

def chat_template_text(value: str, where: str) -> str:
    """The chat template a setting names: a built-in template (:data:`CHAT_TEMPLATES`) or a ``.jinja`` file.

    Raises:
        ValueError: neither (``where``, the setting, is named).
        FileNotFoundError: the ``.jinja`` file does not exist.
    """
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value].template
    if not value.endswith(".jinja"):
        raise ValueError(f"{where}: expected one of {', '.join(CHAT_TEMPLATES)} or a .jinja file, got {value!r}")
    path = Path(value)
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no template file {path}")
    return path.read_text()


# GPT-2's split pattern, changed so tool arguments are copied token for token:
# - words and numbers do NOT absorb their leading space (GPT-2 has " ?\p{L}+"): "Paris" in
#   "weather in Paris?" is the same token as in {"city":"Paris"}, so the model learns an identity copy
#   instead of a " Paris" -> "Paris" mapping per value (costs ~12% more tokens);
# - "_" joins letters (identifiers such as get_weather stay one pre-token);
# - numbers keep inner separators ("2025-01-15", "10:30", "0.32") so a date can be one token.
_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)|[\p{L}_]+|\p{N}+(?:[-:.,]\p{N}+)*| ?[^\s\p{L}\p{N}_]+|\s+(?!\S)|\s+"""


@cache
def gpt2_byte_decoder() -> dict[str, int]:
    """Printable character -> byte of GPT-2's ``bytes_to_unicode`` (the ByteLevel alphabet).

    A byte-level BPE vocabulary spells every token in this alphabet, so a token's raw bytes are
    ``bytes(gpt2_byte_decoder()[c] for c in piece)``.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 768, min_frequency: int = 2,
                    chat_template: str = "toy") -> PreTrainedTokenizerFast:  # fmt: skip
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    Args:
        texts: training corpus (e.g. the rendered train conversations); consumed in order.
        vocab_size: total vocabulary including the 256 byte symbols and the special tokens.
        min_frequency: a pair must occur this often to be merged.
        chat_template: the template it carries (:data:`CHAT_TEMPLATES`), whose specials it registers.

    Raises:
        ValueError: if ``vocab_size`` cannot hold the bytes and special tokens.
    """
    specials = CHAT_TEMPLATES[chat_template].special_tokens
    floor = 256 + len(specials)
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be >= {floor} (256 bytes + the chat specials), got {vocab_size}")
    # Rayon parallelism in word counting is the source of run-to-run differences; pin it off.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(list(texts), trainer=trainer)
    return wrap_tokenizer(backend, chat_template)


def wrap_tokenizer(backend: Tokenizer, chat_template: str = "toy") -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers.Tokenizer`` with bos/eos/pad, the chat specials and the chat template set."""
    from transformers import PreTrainedTokenizerFast

    spec = CHAT_TEMPLATES[chat_template]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        extra_special_tokens=[t for t in spec.special_tokens if t not in (spec.bos, spec.eos, spec.pad)],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
        chat_template=spec.template,
    )


def template_tokenizer(chat_template: str = "toy") -> PreTrainedTokenizerFast:
    """A tokenizer of just the template's specials: renders and parses text before a vocabulary is trained."""
    backend = Tokenizer(models.BPE())
    backend.add_special_tokens(list(CHAT_TEMPLATES[chat_template].special_tokens))
    return wrap_tokenizer(backend, chat_template)


def save_tokenizer(tok: PreTrainedTokenizerFast, path: str | Path) -> Path:
    """``save_pretrained`` into directory ``path``; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    return path


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Load a Hugging Face tokenizer directory (``AutoTokenizer``, local files only) with its chat template, or
    with ``chat_template`` (a template's text) in place of its own (a base checkpoint, such as Gemma 3's GGUF, may
    have none).

    A toy tokenizer (the nine chat specials, no template of its own: one saved before the toy format
    became a template) gets :data:`TOY_CHAT_TEMPLATE`; its specials must be single tokens.

    Raises:
        FileNotFoundError: if ``path`` holds no ``tokenizer.json`` (a fast tokenizer: masks need its offsets).
        ValueError: if the tokenizer has no chat template, or a toy special is missing or split.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path}: no tokenizer.json (expected a save_pretrained directory)")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not isinstance(tok, PreTrainedTokenizerFast):  # offsets (masks) need the fast tokenizer
        raise ValueError(f"{path}: {type(tok).__name__} is not a fast tokenizer (tokenizer.json)")
    vocab = tok.get_vocab()
    if chat_template is not None:
        tok.chat_template = chat_template
    if tok.chat_template is None and all(t in vocab for t in SPECIAL_TOKENS):
        tok.chat_template = TOY_CHAT_TEMPLATE
    if tok.chat_template is None:
        raise ValueError(f"{path}/tokenizer_config.json: chat_template: the tokenizer has no chat template "
                         "(save one with the tokenizer, e.g. chat_template.jinja)")  # fmt: skip
    if tok.chat_template == TOY_CHAT_TEMPLATE:
        for token in SPECIAL_TOKENS:
            ids = tok.encode(token, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"{path}/tokenizer.json: special token {token!r} encodes to {len(ids)} ids, "
                                 "expected 1")  # fmt: skip
    return tok


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of ``text`` exactly as rendered (no bos/eos added)."""
    return tok.encode(text, add_special_tokens=False)


def decode(tok: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """Exact inverse of :func:`encode` (special tokens kept, no space clean-up)."""
    text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)  # a flat id list decodes to one string
    return text


def tokenizer_fingerprint(tok: PreTrainedTokenizerFast | Tokenizer) -> str:
    """sha256 of the canonical serialization (tokenizer JSON with sorted keys, no whitespace).

    Stable across save/load; changes with any change of vocabulary, merges, specials or
    pre/post-processing, and with the chat template (the toy's is implied by its specials, so a toy
    tokenizer's fingerprint is the same with or without it).
    """
    backend = tok if isinstance(tok, Tokenizer) else tok.backend_tokenizer
    canonical = json.dumps(json.loads(backend.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    template = None if isinstance(tok, Tokenizer) else tok.chat_template
    if template is not None and template != TOY_CHAT_TEMPLATE:
        canonical += json.dumps({"chat_template": template}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
