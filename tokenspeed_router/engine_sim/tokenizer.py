"""The engine simulator's built-in tokenizer and chat template (dependency-free, deterministic).

Text is split on whitespace; each word is one token:

* a word of ASCII digits whose value is below :data:`NUMBER_LIMIT` (10**9)
  is that integer (``"17 4 99"`` -> ``[17, 4, 99]``), so a load generator can
  write text whose token ids it knows exactly (e.g. a Mooncake hash id turned
  into a run of numbered words);
* any other word is ``NUMBER_LIMIT + xxh3_64(word) % NUMBER_LIMIT`` — stable
  across processes and machines (no per-process hash seed).

All ids are below 2**31, like real vocabularies. Decoding is not needed by
anything and is not offered.

The chat template is fixed: each message renders as ``<|ROLE|> CONTENT
<|end|>`` and ``add_generation_prompt`` appends ``<|assistant|>``; the text
is then tokenized as above. Content may be a string or a list of parts
(``{"type": "text", "text": ...}``); other parts are ignored.

``skew=True`` (the ``--fault-tokenizer-skew`` knob) makes :meth:`tokenize`
answers start with an extra ``<s>`` token that the engine never caches, the
way a BOS token or chat template differing between router and engine shifts
every block: a router that trusts ``/tokenize`` then predicts the wrong blocks.

``chat_template_skew=True`` (``--fault-chat-template``) makes chat messages
that ``/tokenize`` and ``/render`` see render with another template
(``[ROLE]: CONTENT``, no end markers) than the one chat requests are cached
under, as an engine serving ``--chat-template`` while the router's tokenizer
applies the model's default one: text prompts agree, chat prompts do not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

__all__ = ["NUMBER_LIMIT", "ChatTemplateError", "SimTokenizer"]

#: Numeric words below this are their own token id; hashed words land in [NUMBER_LIMIT, 2 * NUMBER_LIMIT).
NUMBER_LIMIT = 1_000_000_000

_SKEW_PREFIX = "<s>"


class ChatTemplateError(ValueError):
    """A chat message is not a mapping with a string role and text content."""


class SimTokenizer:
    """Word-level tokenizer plus the fixed chat template (see the module docstring)."""

    def __init__(self, *, skew: bool = False, chat_template_skew: bool = False) -> None:
        self.skew = skew
        self.chat_template_skew = chat_template_skew
        self._cache: dict[str, int] = {}

    def word_id(self, word: str) -> int:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        if word.isascii() and word.isdigit() and int(word) < NUMBER_LIMIT:
            token = int(word)
        else:
            token = NUMBER_LIMIT + xxhash.xxh3_64_intdigest(word.encode()) % NUMBER_LIMIT
        if len(self._cache) < 1_000_000:
            self._cache[word] = token
        return token

    def encode(self, text: str) -> list[int]:
        """The token ids the engine computes and caches for ``text``."""
        return [self.word_id(w) for w in text.split()]

    def render_chat(
        self, messages: Sequence[Any], *, add_generation_prompt: bool = True, shown: bool = False
    ) -> str:
        """Apply the fixed chat template; raises :class:`ChatTemplateError` on malformed messages.

        ``shown``: the rendering ``/tokenize`` reports (another template under ``chat_template_skew``).
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        parts: list[str] = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{i}] must be an object")
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
            text = _content_text(message.get("content"), i)
            parts.append(f"[{role}]: {text}" if shown and self.chat_template_skew
                         else f"<|{role}|> {text} <|end|>")
        if add_generation_prompt:
            parts.append("[assistant]:" if shown and self.chat_template_skew else "<|assistant|>")
        return "\n".join(parts)

    def encode_chat(
        self, messages: Sequence[Any], *, add_generation_prompt: bool = True, shown: bool = False
    ) -> list[int]:
        """Token ids of the rendered chat (what a chat request caches; ``shown``: what /tokenize says)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, shown=shown))

    def tokenize(self, tokens: list[int]) -> list[int]:
        """What ``/tokenize`` and ``/render`` report for ``tokens`` (differs only under ``skew``)."""
        if self.skew:
            return [self.word_id(_SKEW_PREFIX), *tokens]
        return tokens

    def output_text(self, token_id: int) -> str:
        """Text of a generated token: a numbered word, so outputs stay tokenizable."""
        return f" {token_id}"


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError(f"messages[{index}].content text part needs a string")
                texts.append(text)
        return " ".join(texts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of parts")
