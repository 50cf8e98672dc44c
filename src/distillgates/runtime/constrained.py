"""Constrained JSON decoding of tool calls: a token mask derived from the tools' JSON Schemas.

Once a call opens in the student's chat family (:class:`~distillgates.data.chat.CallSyntax`: toy
``<|tool_call|>``, Hermes ``<tool_call>``, Llama 3 ``<|python_tag|>`` or a bare ``{`` turn) the model may
only emit tokens that keep the text a prefix of a call ``{"name":"<tool>","arguments":{...}}`` that is
canonical JSON as the family's template writes it (toy: compact, the data format
``json.dumps(call, separators=(",", ":"), ensure_ascii=False)``; Hermes and Llama 3: ``json.dumps``'
spaced separators, Llama 3 with ``parameters``) and valid against the tool's ``parameters`` schema;
then only the family's closer and what may follow it (toy: ``<|end|>``; Hermes: ``\\n</tool_call>``,
then the end of the turn or another call). So every constrained call parses with the family's parser
and passes :func:`distillgates.data.tools.validate_call`. :class:`ToolCallConstraint` is the JSON
automaton, :class:`TurnConstraint` the turn around it, :class:`ToolCallProcessor` the logits processor.

Design choices:
- A byte-level pushdown automaton (a stack of small hashable frames, one per open JSON value)
  over the schema: object keys from ``properties`` (each at most once, required ones before
  ``}``), strings (canonical escapes, bounded length, optional ``enum``/``pattern``), numbers
  (bounded digits, ``minimum``/``maximum`` checked by interval arithmetic on every prefix, so
  a prefix is only allowed if some completion is in range), booleans, ``enum``/``const``,
  nested objects and arrays (bounded items). Bytes, not characters: byte-level BPE tokens may
  split a UTF-8 character, and a token is allowed iff its bytes keep the prefix valid.
- No dead ends: every reachable state has a valid next byte, and every byte is a token (the
  vocabulary must hold all byte tokens, as byte-level BPE does), so a masked decode always
  finishes. Every length is bounded, so it finishes within a bounded number of tokens.
- Masks: the vocabulary's token bytes are decoded once per tokenizer into a byte trie; the
  allowed set of a state is a trie walk that prunes at the first invalid byte, cached by state.
  Inside a free string (the common, wide case) the mask is one vectorised comparison
  (``plain_chars <= budget``) plus a walk over the few tokens that hold a quote, backslash,
  control byte or a partial UTF-8 character.
- Pattern support is a small regex subset (anchored sequences of literals, ``\\d``/``\\w``,
  classes and ``? * + {n,m}`` quantifiers, ASCII only); anything else raises
  :class:`UnsupportedSchemaError` up front rather than emitting calls that might not validate.
- Strings never contain ``<|`` nor the family's tags (``CallSyntax.reserved``): decoded text such as
  ``<|end|>`` would re-tokenize as a chat special token, ``</tool_call>`` end the call for the parser.
- The turn is a byte automaton too, over each token's text (a special token's by its content): the
  trigger may be one special token or several ordinary ones, and a token may run from the trigger into
  the JSON or from the JSON into the closer; free text is masked only where a token would open a call
  and go on wrongly (no mask at all where no token does).
- Numbers never use exponents and stay within float round-trip precision (<= 15 digits), so the
  emitted text is exactly what ``json.dumps`` writes for the parsed value.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

import torch
from jsonschema import Draft202012Validator
from torch import Tensor

from distillgates.data.chat import CallSyntax
from distillgates.tokenizer import gpt2_byte_decoder

State = tuple[tuple[Any, ...], ...]
"""Automaton state: a stack of frames (top last); hashable, used as the mask-cache key."""


class UnsupportedSchemaError(ValueError):
    """A tool schema uses a JSON Schema feature the constraint cannot guarantee."""


class ConstraintViolation(ValueError):
    """A token outside the mask was fed (the caller did not apply the processor)."""


# --------------------------------------------------------------------------------------
# Vocabulary: token bytes, byte trie, plain-string fast path


def _plain_chars(data: bytes) -> int:
    """Characters of ``data`` if it can sit raw inside a JSON string (complete UTF-8, no quote,
    backslash or control byte), else -1."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return -1
    if any(c in '"\\<' or ord(c) < 0x20 for c in text):
        return -1
    return len(text)


class _Trie:
    __slots__ = ("children", "ids")

    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.ids: list[int] = []

    def add(self, data: bytes, token_id: int) -> None:
        node = self
        for b in data:
            node = node.children.setdefault(b, _Trie())
        node.ids.append(token_id)


class TokenVocab:
    """Decoded bytes of every token (``None`` for special tokens) and the tries the masks walk.

    ``special_bytes``: the text of each special token (``<tool_call>`` where a tokenizer has it as one):
    the call syntax around the JSON may use them, the JSON itself never does.
    """

    def __init__(self, token_bytes: Sequence[bytes | None], special_bytes: Mapping[int, bytes] | None = None) -> None:
        self.token_bytes = list(token_bytes)
        self.size = len(self.token_bytes)
        self.special_bytes = dict(special_bytes or {})
        self.trie = _Trie()  # all non-special tokens
        self.nonplain_trie = _Trie()  # tokens that cannot sit raw inside a string
        self.special_trie = _Trie()  # special tokens by their text
        self.brace_trie = _Trie()  # tokens with a "}" before their last byte: they may close a call and go on
        for i, text in self.special_bytes.items():
            self.special_trie.add(text, i)
        plain = torch.full((self.size,), -1, dtype=torch.int32)
        for i, data in enumerate(self.token_bytes):
            if not data:
                continue
            self.trie.add(data, i)
            if b"}" in data[:-1]:
                self.brace_trie.add(data, i)
            plain[i] = _plain_chars(data)
            if plain[i] < 0:
                self.nonplain_trie.add(data, i)
        self.plain_chars = plain  # (V,) characters of a plain token, -1 otherwise
        singles = {d[0] for d in self.token_bytes if d is not None and len(d) == 1}
        needed = set(range(0x20, 0x7F)) | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF5))
        if missing := sorted(needed - singles):
            raise ValueError(
                f"vocabulary lacks single-byte tokens for {len(missing)} bytes (e.g. {missing[:8]}); constrained "
                "decoding needs every byte as a token (byte-level BPE with the full initial alphabet)"
            )

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenVocab:
        """Token bytes of a HF ``PreTrainedTokenizerFast`` or a ``tokenizers.Tokenizer``.

        Byte-level vocabularies map through the GPT-2 byte table; others (SentencePiece style)
        map ``▁`` to a space and ``<0xNN>`` to its byte.
        """
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        spec = json.loads(backend.to_str())
        byte_level = "ByteLevel" in json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        size = backend.get_vocab_size(with_added_tokens=True)
        byte_decoder = gpt2_byte_decoder()
        out: list[bytes | None] = []
        special_bytes = {}
        for i in range(size):
            piece = backend.id_to_token(i)
            if piece is None or i in special:
                out.append(None)
                if piece is not None:
                    special_bytes[i] = piece.encode("utf-8")
            elif byte_level and all(c in byte_decoder for c in piece):
                out.append(bytes(byte_decoder[c] for c in piece))
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("▁", " ").encode("utf-8"))
        return cls(out, special_bytes)


# --------------------------------------------------------------------------------------
# Schema -> nodes

_ANNOTATIONS = {"description", "title", "default", "examples", "$comment", "format", "deprecated", "readOnly"}
_SAFE_ASCII = frozenset(range(0x20, 0x7F)) - {ord('"'), ord("\\"), ord("<")}  # "<" could start "<|end|>"
_DIGITS = frozenset(range(ord("0"), ord("9") + 1))
_WORD = _DIGITS | frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("A"), ord("Z") + 1)) | {ord("_")}
_CLASS_ESCAPES = {"d": _DIGITS, "w": _WORD, "s": frozenset({ord(" ")})}
_SHORT_ESCAPES = frozenset(b'"\\bfnrt')  # what json.dumps writes after a backslash (never "\/")
_HEX = b"0123456789abcdef"


@dataclass(frozen=True)
class _Atom:
    chars: frozenset[int]
    lo: int
    hi: int | None  # None: unbounded


def _compile_pattern(pattern: str, where: str) -> tuple[_Atom, ...]:
    """Regex subset -> atom sequence; full matches of the atoms also satisfy ``re.search``."""
    s = pattern[1:] if pattern.startswith("^") else pattern
    s = s[:-1] if s.endswith("$") and not s.endswith("\\$") else s
    atoms: list[_Atom] = []
    i = 0

    def fail(why: str) -> UnsupportedSchemaError:
        return UnsupportedSchemaError(
            f"{where}: pattern {pattern!r}: {why} (supported: literals, \\d \\w \\s, [...], .)"
        )

    while i < len(s):
        c = s[i]
        if c in "()|^$":
            raise fail(f"{c!r} is not supported")
        if c == "\\":
            esc = s[i + 1 : i + 2]
            if esc in _CLASS_ESCAPES:
                chars = _CLASS_ESCAPES[esc]
            elif esc and not esc.isalnum():
                chars = frozenset({ord(esc)})
            else:
                raise fail(f"escape \\{esc} is not supported")
            i += 2
        elif c == "[":
            end = s.find("]", i + 2)
            if end < 0:
                raise fail("unterminated class")
            body, negate = s[i + 1 : end], s[i + 1 : i + 2] == "^"
            body = body[1:] if negate else body
            members: set[int] = set()
            j = 0
            while j < len(body):
                if body[j] == "\\" and body[j + 1 : j + 2] in _CLASS_ESCAPES:
                    members |= _CLASS_ESCAPES[body[j + 1]]
                    j += 2
                    continue
                ch = body[j + 1] if body[j] == "\\" else body[j]
                j += 2 if body[j] == "\\" else 1
                if body[j : j + 1] == "-" and j + 1 < len(body):
                    members |= set(range(ord(ch), ord(body[j + 1]) + 1))
                    j += 2
                else:
                    members.add(ord(ch))
            chars = _SAFE_ASCII - members if negate else frozenset(members)
            i = end + 1
        elif c == ".":
            chars, i = _SAFE_ASCII, i + 1
        elif c in "*+?{}":
            raise fail(f"quantifier {c!r} without an atom")
        else:
            chars, i = frozenset({ord(c)}), i + 1
        lo, hi = 1, 1  # type: int, int | None
        if i < len(s) and s[i] in "*+?{":
            if s[i] == "{":
                end = s.find("}", i)
                parts = s[i + 1 : end].split(",")
                if end < 0 or not parts[0].isdigit() or len(parts) > 2 or not (parts[-1].isdigit() or parts[-1] == ""):
                    raise fail("bad {n,m} quantifier")
                lo = int(parts[0])
                hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
                i = end + 1
            else:
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[s[i]]
                i += 1
            if i < len(s) and s[i] == "?":  # lazy: same language
                i += 1
        chars = chars & _SAFE_ASCII
        if lo > 0 and not chars:
            raise fail("needs characters outside printable ASCII without quote/backslash")
        atoms.append(_Atom(chars, lo, hi))
    return tuple(atoms)


class _Node:
    """One schema position. ``kind`` picks the step function; the rest are its parameters."""

    def __init__(self, kind: str, **params: Any) -> None:
        self.kind = kind
        self.__dict__.update(params)

    def __getattr__(self, name: str) -> Any:  # only reached for a missing parameter; typed as Any for mypy
        raise AttributeError(f"{self.__dict__.get('kind')} node has no parameter {name!r}")


# Frame modes
O_START, O_OPEN, O_KEY, O_COLON, O_AFTER, O_COMMA, O_COLON_SPACE, O_COMMA_SPACE = range(8)
A_START, A_OPEN, A_AFTER, A_COMMA, A_COMMA_SPACE = range(5)  # *_SPACE: the " " of spaced JSON after ":" / ","
S_START, S_BODY, S_ESC, S_UHEX, S_UTF8 = range(5)
C_LIT1, C_NAME, C_LIT2, C_CLOSE, C_DONE = range(5)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _key_bytes(key: str) -> bytes:
    return _json_bytes(key)[1:-1]


@dataclass(frozen=True)
class Bounds:
    """Bounds that make every constrained call finite (the schema's own bounds win when tighter)."""

    max_string_chars: int = 64
    max_int_digits: int = 9
    max_frac_digits: int = 6  # max_int_digits + max_frac_digits <= 15: the text round-trips through a float
    max_array_items: int = 8

    def __post_init__(self) -> None:
        if self.max_int_digits < 1 or self.max_frac_digits < 1 or self.max_int_digits + self.max_frac_digits > 15:
            raise ValueError("need max_int_digits, max_frac_digits >= 1 and their sum <= 15 (float round trip)")
        if self.max_string_chars < 1 or self.max_array_items < 1:
            raise ValueError("max_string_chars and max_array_items must be >= 1")


# --------------------------------------------------------------------------------------
# The automaton


class ToolCallConstraint:
    """Byte automaton + token masks for ``{"name":..., "arguments":...}`` calls of ``tools``.

    Args:
        tools: OpenAI function format (``name``, ``parameters``), e.g. ``registry.TOOLS``.
        vocab: the tokenizer's :class:`TokenVocab`.
        end_id: id of ``<|end|>``, the only token allowed once the call is complete.
        bounds: length/digit bounds.
        cache_size: masks kept (LRU by state).
        arguments_key: the key after ``name`` (Llama 3: ``parameters``).
        spaced: ``json.dumps``' default separators ``", "``/``": "`` (Hugging Face ``tojson``) instead of
            the compact ``","``/``":"``.
        reserved: texts a string never contains (:attr:`distillgates.data.chat.CallSyntax.reserved`);
            each starts with ``<`` (the string fast path leaves every token with a ``<`` to the trie walk).
    """

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]],
        vocab: TokenVocab,
        end_id: int,
        bounds: Bounds | None = None,
        cache_size: int = 8192,
        arguments_key: str = "arguments",
        spaced: bool = False,
        reserved: Sequence[str] = ("<|",),
    ) -> None:
        self.vocab, self.end_id, self.bounds = vocab, end_id, bounds or Bounds()
        self.spaced = spaced
        item_sep, key_sep = (b", ", b": ") if spaced else (b",", b":")
        self.call_open = b'{"name"' + key_sep + b'"'
        self.call_args = b'"' + item_sep + _json_bytes(arguments_key) + key_sep
        if not reserved or any(not r.startswith("<") or len(r) < 2 for r in reserved):
            raise ValueError(f"reserved texts must start with '<' and have two characters or more, got {reserved}")
        self.reserved = tuple(r.encode("utf-8") for r in reserved)
        self._reserved_prefixes = {r[:i] for r in self.reserved for i in range(1, len(r))}
        self.nodes: list[_Node] = []
        self.tool_names = [_key_bytes(str(t["name"])) for t in tools]
        if len(set(self.tool_names)) != len(self.tool_names) or not tools:
            raise UnsupportedSchemaError("tools must be a non-empty list with unique names")
        self.tool_nodes = [
            self._compile(t.get("parameters", {"type": "object"}), f"{t['name']}.parameters") for t in tools
        ]
        for name, n in zip(tools, self.tool_nodes):
            if self.nodes[n].kind != "object":
                raise UnsupportedSchemaError(f"{name['name']}.parameters: the arguments must be an object schema")
        self._name_prefixes = {n[:i] for n in self.tool_names for i in range(len(n) + 1)}
        self._masks: OrderedDict[State, Tensor] = OrderedDict()
        self._cache_size = cache_size
        self.cache_hits = 0
        self.cache_misses = 0

    # ---- schema compilation ---------------------------------------------------------

    def _add(self, node: _Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _compile(self, schema: Mapping[str, Any], where: str) -> int:
        if not isinstance(schema, Mapping):
            raise UnsupportedSchemaError(f"{where}: expected a schema object, got {type(schema).__name__}")
        kind = schema.get("type")
        used_keywords = set(schema) - _ANNOTATIONS - {"type"}
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            check = Draft202012Validator(dict(schema))
            values = [v for v in values if _type_ok(v, kind) and check.is_valid(v)]
            if not values:
                raise UnsupportedSchemaError(f"{where}: enum/const has no value of type {kind!r}")
            return self._enum(values)
        allowed: set[str]
        if kind == "boolean":
            allowed = set()
            values = [True, False]
        elif kind == "null":
            allowed, values = set(), [None]
        elif kind == "string":
            allowed = {"minLength", "maxLength", "pattern"}
        elif kind in ("integer", "number"):
            allowed = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
        elif kind == "object":
            allowed = {"properties", "required", "additionalProperties"}
        elif kind == "array":
            allowed = {"items", "minItems", "maxItems"}
        else:
            raise UnsupportedSchemaError(f"{where}: type {kind!r} is not supported (need one JSON type)")
        if unsupported := sorted(used_keywords - allowed):
            raise UnsupportedSchemaError(f"{where}: keyword(s) {unsupported} not supported for type {kind!r}")
        if kind in ("boolean", "null"):
            return self._enum(values)
        if kind == "string":
            max_len = min(int(schema.get("maxLength", self.bounds.max_string_chars)), self.bounds.max_string_chars)
            min_len = int(schema.get("minLength", 0))
            if min_len > max_len:
                raise UnsupportedSchemaError(f"{where}: minLength {min_len} > length bound {max_len}")
            atoms = _compile_pattern(schema["pattern"], where) if "pattern" in schema else None
            extra: dict[str, Any] = {}
            if atoms is not None:
                min_rem, max_rem = _pattern_remaining(atoms)
                extra = {"min_rem": min_rem, "max_rem": max_rem, "start_pos": _closure(atoms, frozenset({(0, 0)}))}
            node = _Node("string", min_len=min_len, max_len=max_len, atoms=atoms, **extra)
            if atoms is not None and not self._pattern_viable(node, 0, node.start_pos):
                raise UnsupportedSchemaError(f"{where}: pattern cannot match within length {min_len}..{max_len}")
            return self._add(node)
        if kind in ("integer", "number"):
            b = self.bounds
            grid = Decimal(1) if kind == "integer" else Decimal(10) ** -b.max_frac_digits
            node = _Node(
                "number",
                integer=kind == "integer",
                digits=b.max_int_digits,
                frac=b.max_frac_digits,
                grid=grid,
                lo_grid=_grid_lo(schema, grid),
                hi_grid=_grid_hi(schema, grid),
            )
            if not _num_viable(node, False, "", None) and not _num_viable(node, True, "", None):
                raise UnsupportedSchemaError(f"{where}: no {kind} within the bounds and {b.max_int_digits} digits")
            return self._add(node)
        if kind == "array":
            max_items = min(int(schema.get("maxItems", self.bounds.max_array_items)), self.bounds.max_array_items)
            min_items = int(schema.get("minItems", 0))
            if min_items > max_items or "items" not in schema:
                raise UnsupportedSchemaError(f"{where}: need 'items' and minItems <= {max_items}")
            item = self._compile(schema["items"], f"{where}.items")
            return self._add(_Node("array", item=item, min_items=min_items, max_items=max_items))
        props = schema.get("properties", {})
        required = list(schema.get("required", []))
        if missing := [r for r in required if r not in props]:
            raise UnsupportedSchemaError(f"{where}: required {missing} not in properties")
        children = tuple(self._compile(v, f"{where}.properties.{k}") for k, v in props.items())
        keys = tuple(_key_bytes(k) for k in props)
        return self._add(
            _Node(
                "object",
                keys=keys,
                children=children,
                required=sum(1 << i for i, k in enumerate(props) if k in required),  # bitmask over keys
                all_keys=(1 << len(props)) - 1,
                key_prefixes=[{k[:j] for j in range(len(k) + 1)} for k in keys],
            )
        )

    def _enum(self, values: list[Any]) -> int:
        encoded = tuple(dict.fromkeys(_json_bytes(v) for v in values))
        prefixes = {v[:i] for v in encoded for i in range(1, len(v) + 1)}
        extendable = {v[:i] for v in encoded for i in range(len(v))}
        return self._add(_Node("enum", values=frozenset(encoded), prefixes=prefixes, extendable=extendable))

    # ---- stepping -------------------------------------------------------------------

    def initial_state(self) -> State:
        return ((-1, C_LIT1, 0),)

    def is_done(self, state: State) -> bool:
        return state[-1][0] == -1 and state[-1][1] == C_DONE

    def _init_frame(self, n: int) -> tuple[Any, ...]:
        node = self.nodes[n]
        if node.kind == "object":
            return (n, O_START, 0, None)
        if node.kind == "array":
            return (n, A_START, 0)
        if node.kind == "string":
            return (n, S_START, 0, None, node.start_pos if node.atoms is not None else None)
        return (n, b"")  # number / enum

    def step(self, state: State, b: int) -> State | None:
        """The state after byte ``b``, or ``None`` if ``b`` cannot continue a valid call."""
        top = state[-1]
        if top[0] == -1:
            return self._step_call(state, top, b)
        kind = self.nodes[top[0]].kind
        if kind == "string":
            return self._step_string(state, top, b)
        if kind == "number":
            return self._step_number(state, top, b)
        if kind == "enum":
            return self._step_enum(state, top, b)
        if kind == "object":
            return self._step_object(state, top, b)
        return self._step_array(state, top, b)

    def feed(self, state: State | None, data: bytes) -> State | None:
        for b in data:
            if state is None:
                return None
            state = self.step(state, b)
        return state

    def _step_call(self, state: State, top: tuple[Any, ...], b: int) -> State | None:
        _, mode, aux = top
        if mode == C_LIT1:
            if b != self.call_open[aux]:
                return None
            return ((-1, C_NAME, b""),) if aux + 1 == len(self.call_open) else ((-1, C_LIT1, aux + 1),)
        if mode == C_NAME:
            if b == 0x22 and aux in self.tool_names:
                return ((-1, C_LIT2, (self.tool_names.index(aux), 1)),)  # the quote is call_args[0]
            name = aux + bytes([b])
            return ((-1, C_NAME, name),) if name in self._name_prefixes else None
        if mode == C_LIT2:
            tool, pos = aux
            if b != self.call_args[pos]:
                return None
            if pos + 1 < len(self.call_args):
                return ((-1, C_LIT2, (tool, pos + 1)),)
            return ((-1, C_CLOSE, tool), self._init_frame(self.tool_nodes[tool]))
        if mode == C_CLOSE:
            return ((-1, C_DONE, aux),) if b == 0x7D else None
        return None  # C_DONE: only <|end|>, which is a token, not a byte

    def _step_object(self, state: State, top: tuple[Any, ...], b: int) -> State | None:
        n, mode, used, aux = top
        node = self.nodes[n]
        rest = state[:-1]
        if mode == O_START:
            return (*rest, (n, O_OPEN, used, None)) if b == 0x7B else None
        if mode in (O_OPEN, O_COMMA):
            if b == 0x22 and used != node.all_keys:
                return (*rest, (n, O_KEY, used, b""))
            if b == 0x7D and mode == O_OPEN and node.required & ~used == 0:
                return rest
            return None
        if mode == O_KEY:
            if b == 0x22:
                for i, key in enumerate(node.keys):
                    if key == aux and not used >> i & 1:
                        return (*rest, (n, O_COLON, used, i))
            prefix = aux + bytes([b])
            if any(not used >> i & 1 and prefix in p for i, p in enumerate(node.key_prefixes)):
                return (*rest, (n, O_KEY, used, prefix))
            return None
        if mode in (O_COLON, O_COLON_SPACE):
            if b != (0x20 if mode == O_COLON_SPACE else 0x3A):
                return None
            if mode == O_COLON and self.spaced:
                return (*rest, (n, O_COLON_SPACE, used, aux))
            return (*rest, (n, O_AFTER, used | 1 << aux, None), self._init_frame(node.children[aux]))
        if mode == O_COMMA_SPACE:
            return (*rest, (n, O_COMMA, used, None)) if b == 0x20 else None
        # O_AFTER
        if b == 0x2C and used != node.all_keys:
            return (*rest, (n, O_COMMA_SPACE if self.spaced else O_COMMA, used, None))
        if b == 0x7D and node.required & ~used == 0:
            return rest
        return None

    def _step_array(self, state: State, top: tuple[Any, ...], b: int) -> State | None:
        n, mode, count = top
        node = self.nodes[n]
        rest = state[:-1]
        if mode == A_START:
            return (*rest, (n, A_OPEN, 0)) if b == 0x5B else None
        if b == 0x5D and mode in (A_OPEN, A_AFTER) and count >= node.min_items:
            return rest
        if mode == A_AFTER:
            if b != 0x2C or count >= node.max_items:
                return None
            return (*rest, (n, A_COMMA_SPACE if self.spaced else A_COMMA, count))
        if mode == A_COMMA_SPACE:
            return (*rest, (n, A_COMMA, count)) if b == 0x20 else None
        if count >= node.max_items:  # A_OPEN with max_items == 0
            return None
        return self.step((*rest, (n, A_AFTER, count + 1), self._init_frame(node.item)), b)

    def _step_enum(self, state: State, top: tuple[Any, ...], b: int) -> State | None:
        n, buf = top
        node = self.nodes[n]
        text = buf + bytes([b])
        if text in node.prefixes:
            if text in node.values and text not in node.extendable:
                return state[:-1]  # complete and nothing longer: closed
            return (*state[:-1], (n, text))
        if buf in node.values:  # complete, and b belongs to the parent
            return self.step(state[:-1], b)
        return None

    def _step_number(self, state: State, top: tuple[Any, ...], b: int) -> State | None:
        n, text = top
        node = self.nodes[n]
        if b in b"-.0123456789":
            longer = text + bytes([b])
            if _num_prefix_ok(node, longer.decode()):
                return (*state[:-1], (n, longer))
        if text and _num_can_end(node, text.decode()):
            return self.step(state[:-1], b)
        return None

    def _step_string(self, state: State, top: tuple[Any, ...], b: int) -> State | None:
        n, mode, count, aux, pos = top
        node = self.nodes[n]
        rest = state[:-1]
        if mode == S_START:
            return (*rest, (n, S_BODY, 0, None, pos)) if b == 0x22 else None
        if node.atoms is not None:  # pattern strings: raw printable ASCII only
            if b == 0x22:
                return rest if (len(node.atoms), 0) in pos and count >= node.min_len else None
            if b not in _SAFE_ASCII:
                return None
            moved = _closure(node.atoms, _advance(node.atoms, pos, b))
            moved = frozenset(p for p in moved if self._pattern_pos_viable(node, count + 1, p))
            return (*rest, (n, S_BODY, count + 1, None, moved)) if moved else None
        if mode == S_BODY:
            if b == 0x22:
                return rest if count >= node.min_len else None
            if count >= node.max_len or b < 0x20:
                return None
            if b == 0x5C:
                return (*rest, (n, S_ESC, count, None, None))
            if b < 0x80:  # aux: the end of the string that may begin a reserved text ("<" of "<|end|>")
                text = (aux or b"") + bytes([b])
                if any(text.endswith(r) for r in self.reserved):
                    return None  # "<|end|>" would re-tokenize as a chat special token, "</tool_call>" end the call
                aux = next((text[i:] for i in range(len(text)) if text[i:] in self._reserved_prefixes), None)
                return (*rest, (n, S_BODY, count + 1, aux, None))
            utf8 = _utf8_lead(b)
            return (*rest, (n, S_UTF8, count + 1, utf8, None)) if utf8 else None
        if mode == S_ESC:
            if b in _SHORT_ESCAPES:
                return (*rest, (n, S_BODY, count + 1, None, None))
            return (*rest, (n, S_UHEX, count, b"", None)) if b == ord("u") else None
        if mode == S_UHEX:  # canonical \u00XX: only control characters without a short escape
            digits = aux + bytes([b])
            if len(digits) <= 2:
                ok = b == ord("0")
            elif len(digits) == 3:
                ok = b in b"01"
            else:
                ok = b in _HEX and int(digits, 16) not in (8, 9, 10, 12, 13)
            if not ok:
                return None
            return (*rest, (n, S_BODY, count + 1, None, None) if len(digits) == 4 else (n, S_UHEX, count, digits, None))
        # S_UTF8: aux = (remaining continuation bytes, lo, hi) for the next byte
        remaining, lo, hi = aux
        if not lo <= b <= hi:
            return None
        if remaining == 1:
            return (*rest, (n, S_BODY, count, None, None))
        return (*rest, (n, S_UTF8, count, (remaining - 1, 128, 191), None))

    def _pattern_pos_viable(self, node: _Node, count: int, p: tuple[int, int]) -> bool:
        i, k = p
        min_rem = max(0, node.atoms[i].lo - k) + node.min_rem[i + 1] if i < len(node.atoms) else 0
        if count + min_rem > node.max_len:
            return False
        if i == len(node.atoms):
            return count >= node.min_len
        hi, tail = node.atoms[i].hi, node.max_rem[i + 1]
        return hi is None or tail is None or count + (hi - k) + tail >= node.min_len

    def _pattern_viable(self, node: _Node, count: int, pos: frozenset[tuple[int, int]]) -> bool:
        return any(self._pattern_pos_viable(node, count, p) for p in pos)

    # ---- tokens and masks -----------------------------------------------------------

    def advance(self, state: State, token_id: int) -> State:
        """State after ``token_id``. Raises :class:`ConstraintViolation` if the mask forbids it."""
        data = self.vocab.token_bytes[token_id] if 0 <= token_id < self.vocab.size else None
        new = None if data is None or self.is_done(state) else self.feed(state, data)
        if new is None:
            raise ConstraintViolation(f"token {token_id} ({data!r}) is not allowed here; state top {state[-1]!r}")
        return new

    def allowed_mask(self, state: State) -> Tensor:
        """Bool mask (V_tokenizer,) of the tokens allowed in ``state`` (cached by state)."""
        mask = self._masks.get(state)
        if mask is not None:
            self.cache_hits += 1
            self._masks.move_to_end(state)
            return mask
        self.cache_misses += 1
        mask = self._compute_mask(state)
        if not mask.any():
            raise ConstraintViolation(f"no token can continue state {state!r} (vocabulary lacks a byte token?)")
        self._masks[state] = mask
        if len(self._masks) > self._cache_size:
            self._masks.popitem(last=False)
        return mask

    def _compute_mask(self, state: State) -> Tensor:
        mask = torch.zeros(self.vocab.size, dtype=torch.bool)
        if self.is_done(state):
            mask[self.end_id] = True
            return mask
        top = state[-1]
        trie = self.vocab.trie
        free_string = top[0] >= 0 and self.nodes[top[0]].kind == "string" and top[1] == S_BODY
        if free_string and top[3] is None and top[4] is None:  # no pattern, last char not "<"
            budget = self.nodes[top[0]].max_len - top[2]
            plain = self.vocab.plain_chars
            mask |= (plain >= 0) & (plain <= budget)  # (V,) raw characters that fit the length budget
            trie = self.vocab.nonplain_trie
        ids = _walk(trie, state, self.step)
        if ids:
            mask[torch.tensor(ids)] = True
        return mask


def _walk(trie: _Trie, state: Any, step: Callable[[Any, int], Any | None]) -> list[int]:
    """Ids of tokens in ``trie`` whose bytes all ``step`` validly from ``state`` (pruned DFS; None: invalid)."""
    ids: list[int] = []
    stack = [(trie, state)]
    while stack:
        node, st = stack.pop()
        for b, child in node.children.items():
            nxt = step(st, b)
            if nxt is None:
                continue
            ids.extend(child.ids)
            if child.children:
                stack.append((child, nxt))
    return ids


def _type_ok(value: Any, kind: str | None) -> bool:
    checks = {
        None: lambda v: True,
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    return kind in checks and checks[kind](value)


def _utf8_lead(b: int) -> tuple[int, int, int] | None:
    """(continuation bytes, lo, hi of the next byte) for a UTF-8 lead byte; strict (no overlong/surrogates)."""
    if 0xC2 <= b <= 0xDF:
        return (1, 0x80, 0xBF)
    if b == 0xE0:
        return (2, 0xA0, 0xBF)
    if b == 0xED:
        return (2, 0x80, 0x9F)
    if 0xE1 <= b <= 0xEF:
        return (2, 0x80, 0xBF)
    if b == 0xF0:
        return (3, 0x90, 0xBF)
    if 0xF1 <= b <= 0xF3:
        return (3, 0x80, 0xBF)
    if b == 0xF4:
        return (3, 0x80, 0x8F)
    return None


# ---- pattern NFA over atom positions (i, repetitions so far) --------------------------


def _closure(atoms: tuple[_Atom, ...], pos: frozenset[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    out = set(pos)
    stack = list(pos)
    while stack:
        i, k = stack.pop()
        if i < len(atoms) and k >= atoms[i].lo and (i + 1, 0) not in out:
            out.add((i + 1, 0))
            stack.append((i + 1, 0))
    return frozenset(out)


def _advance(atoms: tuple[_Atom, ...], pos: frozenset[tuple[int, int]], b: int) -> frozenset[tuple[int, int]]:
    out = set()
    for i, k in pos:
        if i < len(atoms) and b in atoms[i].chars:
            atom = atoms[i]
            if atom.hi is None:
                out.add((i, min(k + 1, atom.lo)))  # beyond lo the count no longer matters
            elif k < atom.hi:
                out.add((i, k + 1))
    return frozenset(out)


def _pattern_remaining(atoms: tuple[_Atom, ...]) -> tuple[list[int], list[int | None]]:
    """Suffix sums of minimum and maximum lengths (None: unbounded), index i = atoms[i:]."""
    min_rem = [0] * (len(atoms) + 1)
    max_rem: list[int | None] = [0] * (len(atoms) + 1)
    for i in range(len(atoms) - 1, -1, -1):
        min_rem[i] = min_rem[i + 1] + atoms[i].lo
        hi, tail = atoms[i].hi, max_rem[i + 1]
        max_rem[i] = None if hi is None or tail is None else hi + tail
    return min_rem, max_rem


# ---- numbers: canonical decimal text, range-checked on every prefix --------------------


def _dec(value: Any) -> Decimal:
    return Decimal(str(value))


def _grid_lo(schema: Mapping[str, Any], grid: Decimal) -> Decimal | None:
    """Smallest allowed multiple of ``grid`` (in grid units), or None."""
    out = None
    if "minimum" in schema:
        out = (_dec(schema["minimum"]) / grid).to_integral_value(ROUND_CEILING)
    if "exclusiveMinimum" in schema:
        ex = (_dec(schema["exclusiveMinimum"]) / grid).to_integral_value(ROUND_FLOOR) + 1
        out = ex if out is None else max(out, ex)
    return out


def _grid_hi(schema: Mapping[str, Any], grid: Decimal) -> Decimal | None:
    out = None
    if "maximum" in schema:
        out = (_dec(schema["maximum"]) / grid).to_integral_value(ROUND_FLOOR)
    if "exclusiveMaximum" in schema:
        ex = (_dec(schema["exclusiveMaximum"]) / grid).to_integral_value(ROUND_CEILING) - 1
        out = ex if out is None else min(out, ex)
    return out


def _split_number(text: str) -> tuple[bool, str, str | None]:
    neg = text.startswith("-")
    ip, dot, fp = (text[1:] if neg else text).partition(".")
    return neg, ip, fp if dot else None


def _num_prefix_ok(node: _Node, text: str) -> bool:
    neg, ip, fp = _split_number(text)
    if not (ip == "" or ip.isdigit()) or (fp is not None and not (fp == "" or fp.isdigit())):
        return False
    if ip == "":
        return fp is None and _num_viable(node, neg, ip, fp)
    if (len(ip) > 1 and ip[0] == "0") or len(ip) > node.digits:
        return False
    if fp is not None and (node.integer or len(fp) > node.frac):
        return False
    if node.integer and neg and ip == "0":
        return False  # "-0" is not canonical
    return _num_viable(node, neg, ip, fp)


def _num_can_end(node: _Node, text: str) -> bool:
    neg, ip, fp = _split_number(text)
    if ip == "" or (neg and ip == "0" and fp is None):
        return False
    if fp is not None and (fp == "" or (fp != "0" and fp[-1] == "0")):
        return False  # json.dumps never writes trailing zeros ("1.50") or a bare "1."
    if ip == "0" and fp not in (None, "0") and Decimal("0." + fp) < Decimal("0.0001"):
        return False  # json.dumps would write an exponent (1e-05)
    value = Decimal(text) / node.grid
    return (node.lo_grid is None or value >= node.lo_grid) and (node.hi_grid is None or value <= node.hi_grid)


def _num_viable(node: _Node, neg: bool, ip: str, fp: str | None) -> bool:
    """Does some canonical completion of the prefix end inside the bounds? Interval arithmetic on magnitudes."""
    g = node.grid
    pieces: list[tuple[Decimal, Decimal]] = []
    if ip == "":
        pieces.append((Decimal(1) if neg and node.integer else Decimal(0), Decimal(10) ** node.digits - g))
    elif ip == "0" and node.integer:
        pieces.append((Decimal(0), Decimal(0)))
    elif ip == "0":
        if fp in (None, "", "0"):
            pieces.append((Decimal(0), Decimal(0)))
        base = Decimal("0." + fp) if fp else Decimal(0)
        top = base + (Decimal(10) ** -len(fp) if fp else Decimal(1)) - g
        low = base if fp and fp[-1] != "0" else base + g
        pieces.append((max(low, Decimal("0.0001")), top))
    elif fp is None:
        p = int(ip)
        for j in range(node.digits - len(ip) + 1):
            scale = Decimal(10) ** j
            pieces.append((p * scale, p * scale + scale - g))
    else:
        base = Decimal(f"{ip}.{fp}") if fp else Decimal(ip)
        top = base + Decimal(10) ** -len(fp) - g if len(fp) < node.frac else base
        low = base + g if fp and fp != "0" and fp[-1] == "0" else base
        pieces.append((low, top))
    for lo, hi in pieces:
        if lo > hi:
            continue
        lo, hi = (-hi, -lo) if neg else (lo, hi)
        lo_g = max((lo / g).to_integral_value(ROUND_CEILING), node.lo_grid if node.lo_grid is not None else lo / g)
        hi_g = min((hi / g).to_integral_value(ROUND_FLOOR), node.hi_grid if node.hi_grid is not None else hi / g)
        if lo_g <= hi_g:
            return True
    return False


# --------------------------------------------------------------------------------------
# The turn: where calls open and what follows them

TurnState = tuple[int, Any]
"""(phase, position): a position in the trigger (FREE), a literal (OPEN, CLOSE, AFTER) or an automaton
:data:`State` (CALL); START (position 0) is the opening whitespace of a turn that may be a bare JSON call.
Hashable, the mask-cache key."""
FREE, OPEN, CALL, CLOSE, AFTER, START = range(6)
_WHITESPACE = b" \t\r\n"


class TurnConstraint:
    """A generated turn in a chat family's call syntax (:class:`~distillgates.data.chat.CallSyntax`),
    with every call's JSON under a :class:`ToolCallConstraint`.

    Free text until the text holds the trigger (``<|tool_call|>``, ``<tool_call>``: one special token or
    several ordinary ones, found in the decoded bytes); then the opener's rest, the JSON, the closer;
    then the end-of-turn token, or (families with parallel calls) the separator and the next call.
    Where a call may be the whole turn (Llama 3, ``opens_turn``), a turn whose first non-blank character is
    ``{`` is that call.
    A byte-level automaton over the tokens' text, like the JSON's: a token that finishes the trigger
    and goes on must go on validly, so free text is masked only where a token would do that.
    """

    def __init__(self, constraint: ToolCallConstraint, syntax: CallSyntax, end_of_turn_id: int,
                 cache_size: int = 8192) -> None:  # fmt: skip
        self.constraint, self.syntax, self.end_of_turn_id = constraint, syntax, end_of_turn_id
        self.vocab = constraint.vocab
        self.trigger = syntax.trigger.encode("utf-8")
        self.literals = {OPEN: syntax.open_rest.encode("utf-8"), CLOSE: syntax.closer.encode("utf-8"),
                         AFTER: None if syntax.separator is None else (syntax.separator + syntax.trigger
                                                                       + syntax.open_rest).encode("utf-8")}  # fmt: skip
        # a token may close the JSON and go on into the closer / separator (none in the toy: only <|end|> follows)
        self._text_after_call = bool(syntax.closer) or syntax.separator is not None
        self._trigger_prefixes = {self.trigger[:i] for i in range(len(self.trigger))}
        self._masks: OrderedDict[TurnState, Tensor | None] = OrderedDict()
        self._cache_size = cache_size

    def initial_state(self, inside_call: bool = False) -> TurnState:
        """The start of a turn; ``inside_call``: right after the trigger (the prompt opened the call)."""
        if inside_call:
            return self._settle((OPEN, 0))
        return (START, 0) if self.syntax.opens_turn else (FREE, 0)

    def _settle(self, state: TurnState) -> TurnState:
        """Leave a finished literal or call: OPEN -> CALL -> CLOSE -> AFTER (-> CALL)."""
        phase, pos = state
        literal = self.literals.get(phase)
        if phase in (OPEN, AFTER) and literal is not None and pos == len(literal):
            return (CALL, self.constraint.initial_state())
        if phase == CALL and self.constraint.is_done(pos):
            return self._settle((CLOSE, 0))
        if phase == CLOSE and pos == len(literal or b""):
            return (AFTER, 0)
        return state

    def step(self, state: TurnState, b: int, special: bool = False) -> TurnState | None:
        """The state after byte ``b`` (of a special token's text when ``special``), None if not allowed."""
        phase, pos = state
        if phase == START:
            if b in _WHITESPACE:
                return state
            if b == 0x7B and not special:  # "{": the turn is a call
                return self.step((CALL, self.constraint.initial_state()), b)
            return self.step((FREE, 0), b, special)
        if phase == FREE:
            if not self.trigger:
                return state
            text = self.trigger[:pos] + bytes([b])
            if text == self.trigger:
                return self._settle((OPEN, 0))
            return (FREE, next(len(text) - i for i in range(len(text) + 1) if text[i:] in self._trigger_prefixes))
        if phase == CALL:
            inner = None if special else self.constraint.step(pos, b)  # the JSON is ordinary tokens only
            return None if inner is None else self._settle((CALL, inner))
        literal = self.literals[phase]
        if literal is None or pos >= len(literal) or literal[pos] != b:
            return None
        return self._settle((phase, pos + 1))

    def advance(self, state: TurnState, token_id: int) -> TurnState:
        """State after ``token_id``. Raises :class:`ConstraintViolation` if the mask forbids it."""
        if token_id == self.end_of_turn_id and state == (AFTER, 0):
            return self.initial_state()  # the turn ended after its calls; a new one starts
        special = token_id in self.vocab.special_bytes
        data = self.vocab.special_bytes[token_id] if special else (
            self.vocab.token_bytes[token_id] if 0 <= token_id < self.vocab.size else None)  # fmt: skip
        new: TurnState | None = state
        for b in data or b"":
            new = self.step(new, b, special) if new is not None else None
        if new is None or (data is None and state[0] not in (FREE, START)):
            raise ConstraintViolation(f"token {token_id} ({data!r}) is not allowed here; state {state!r}")
        return new

    def allowed_mask(self, state: TurnState) -> Tensor | None:
        """Bool mask (V_tokenizer,) of the tokens allowed in ``state``; None: every token (free text)."""
        if state[0] == CALL and not self._text_after_call:
            return self.constraint.allowed_mask(state[1])  # the toy: exactly the JSON's mask (its own cache)
        if state in self._masks:
            self._masks.move_to_end(state)
            return self._masks[state]
        mask = self._compute_mask(state)
        if mask is not None and not mask.any():
            raise ConstraintViolation(f"no token can continue state {state!r}")
        self._masks[state] = mask
        if len(self._masks) > self._cache_size:
            self._masks.popitem(last=False)
        return mask

    def _compute_mask(self, state: TurnState) -> Tensor | None:
        phase, pos = state
        if phase in (FREE, START):
            forbidden = self._free_forbidden(state)
            if not forbidden:
                return None
            mask = torch.ones(self.vocab.size, dtype=torch.bool)
            mask[torch.tensor(forbidden)] = False
            return mask
        if phase == CALL:
            mask = self.constraint.allowed_mask(pos).clone()
            mask[_walk(self.vocab.brace_trie, state, self.step)] = True  # "}}\n" closes the call and goes on
            return mask
        mask = torch.zeros(self.vocab.size, dtype=torch.bool)
        special = _walk(self.vocab.special_trie, state, lambda st, b: self.step(st, b, special=True))
        mask[_walk(self.vocab.trie, state, self.step) + special] = True
        if state == (AFTER, 0):
            mask[self.end_of_turn_id] = True
        return mask

    def _free_forbidden(self, start: TurnState) -> list[int]:
        """Tokens of free text (or a turn's start) that would open a call (finish the trigger, or "{" first)
        and go on with text the call syntax does not allow."""
        head, out = self.trigger[: start[1]], []

        def opens(data: bytes, special: bool) -> bool:
            if start[0] == START and not special and data.lstrip(_WHITESPACE).startswith(b"{"):
                return True
            return bool(self.trigger) and self.trigger in head + data

        texts = [(i, d, False) for i, d in enumerate(self.vocab.token_bytes) if d and opens(d, False)]
        texts += [(i, d, True) for i, d in self.vocab.special_bytes.items() if opens(d, True)]
        for token_id, data, special in texts:
            state: TurnState | None = start
            for b in data:
                state = self.step(state, b, special) if state is not None else None
            if state is None:
                out.append(token_id)
        return out


# --------------------------------------------------------------------------------------
# The logits processor


class ToolCallProcessor:
    """``processor(generated_ids, logits (V,)) -> logits (V,)`` for the runtime's ``generate``.

    Tracks the :class:`TurnConstraint` over ``generated_ids`` (the tokens generated by this ``generate``
    call, not the prompt): untouched logits in free text; inside a call every token that would break
    it is masked; after the call only what the family allows (toy: ``<|end|>``; Hermes: ``\\n</tool_call>``,
    then ``<|im_end|>`` or another ``<tool_call>``); after the end-of-turn token free again. With
    ``prompt_opens_call`` the prompt itself ended with the trigger (a forced call), so generation starts
    inside it.
    """

    def __init__(self, turn: TurnConstraint, prompt_opens_call: bool = False) -> None:
        self.turn = turn
        self.prompt_opens_call = prompt_opens_call
        self._last: tuple[tuple[int, ...], TurnState] | None = None  # (tokens so far, state)

    @property
    def constraint(self) -> ToolCallConstraint:
        return self.turn.constraint

    def state(self, generated_ids: Sequence[int]) -> TurnState:
        """The turn's state after ``generated_ids``."""
        ids = tuple(generated_ids)
        if self._last is not None and ids[: len(self._last[0])] == self._last[0]:
            done, state = self._last
        else:
            done, state = (), self.turn.initial_state(self.prompt_opens_call)
        for token in ids[len(done) :]:
            state = self.turn.advance(state, token)
        self._last = (ids, state)
        return state

    def __call__(self, generated_ids: Sequence[int], logits: Tensor) -> Tensor:
        mask = self.turn.allowed_mask(self.state(generated_ids))
        if mask is None:
            return logits
        vocab = logits.shape[-1]
        if vocab < mask.numel():
            raise ValueError(f"logits have {vocab} entries but the tokenizer has {mask.numel()} tokens")
        if vocab > mask.numel():
            mask = torch.cat([mask, mask.new_zeros(vocab - mask.numel())])  # (V,) padded ids never allowed
        return logits.masked_fill(~mask.to(logits.device), float("-inf"))  # (V,)


_VOCABS: dict[int, tuple[Any, TokenVocab]] = {}  # id(backend) -> (backend kept alive, its vocab)
_TURNS: dict[tuple[int, str, Bounds, CallSyntax], TurnConstraint] = {}


def turn_constraint(
    tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None, bounds: Bounds | None = None
) -> TurnConstraint:
    """The (cached) turn constraint of ``tokenizer``'s chat format for ``tools`` (default: the registry's TOOLS).

    Raises:
        ValueError: when the tokenizer's chat template writes calls no constraint can follow
            (:attr:`~distillgates.data.chat.ChatFormat.call_syntax`).
    """
    from distillgates.data.chat import chat_format

    if tools is None:
        from distillgates.data.registry import TOOLS

        tools = TOOLS
    fmt = chat_format(tokenizer)
    syntax = fmt.call_syntax
    backend = tokenizer.backend_tokenizer
    if id(backend) not in _VOCABS:
        _VOCABS[id(backend)] = (backend, TokenVocab.from_tokenizer(backend))
    vocab = _VOCABS[id(backend)][1]
    bounds = bounds or Bounds()
    key = (id(vocab), json.dumps(list(tools), sort_keys=True, default=str), bounds, syntax)
    if key not in _TURNS:
        constraint = ToolCallConstraint(tools, vocab, fmt.end_of_turn_id, bounds, arguments_key=syntax.arguments_key,
                                        spaced=syntax.spaced, reserved=syntax.reserved)  # fmt: skip
        _TURNS[key] = TurnConstraint(constraint, syntax, fmt.end_of_turn_id)
    return _TURNS[key]


def tool_call_constraint(
    tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None, bounds: Bounds | None = None
) -> ToolCallConstraint:
    """The (cached) JSON constraint of ``tokenizer``'s chat format for ``tools`` (:func:`turn_constraint`)."""
    return turn_constraint(tokenizer, tools, bounds).constraint


def tool_call_processor(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]] | None = None,
    bounds: Bounds | None = None,
    prompt_opens_call: bool = False,
) -> ToolCallProcessor:
    """A logits processor constraining tool calls of ``tokenizer``'s model to ``tools``' schemas, in the
    call syntax of the tokenizer's chat template (toy, Hermes/ChatML, Llama 3 with ``<|python_tag|>``).

    Example::

        proc = tool_call_processor(tok)
        ids = list(engine.generate(prompt_ids, stop_ids=fmt.stop_ids, logits_processor=proc))
    """
    return ToolCallProcessor(turn_constraint(tokenizer, tools, bounds), prompt_opens_call)
