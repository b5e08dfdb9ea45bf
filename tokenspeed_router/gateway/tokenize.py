"""Prompt text and chat messages -> the token ids the engine will cache.

The router hashes token ids (DESIGN §4), so it must see exactly the tokens
the engine sees. Two sources:

* :class:`EngineTokenizer` (``--tokenizer engine``, the default) asks a
  worker's own ``POST /tokenize`` (vLLM and SGLang accept ``{"prompt"}``;
  vLLM also ``{"messages"}``, applying its chat template). One extra round
  trip, but never a mismatch. Answers are cached briefly (see
  :class:`_TokenCache` for why that is safe).
* :class:`LocalTokenizer` (``--tokenizer PATH``) loads a Hugging Face
  ``tokenizer.json`` with the ``tokenizers`` library and renders the chat
  template of ``tokenizer_config.json`` with jinja2 (sandboxed), as
  ``transformers.apply_chat_template`` does: zero round trips. Needs the
  ``tokenizer`` extra.

A tokenizer that fails raises :class:`TokenizeError`; the gateway then routes
the request on load alone and counts it (a prompt still gets answered).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tokenspeed_router.errors import ConfigError, TokenspeedError
from tokenspeed_router.gateway.http1 import Http1Pool, UpstreamError

__all__ = [
    "EngineTokenizer",
    "LocalTokenizer",
    "PromptTokenizer",
    "TokenizeError",
    "load_tokenizer",
]

logger = logging.getLogger(__name__)

#: body fields of a chat request that change what the chat template renders
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
    "add_special_tokens",
)
#: above this many characters, local tokenization runs off the event loop
_INLINE_CHARS = 8192


class TokenizeError(TokenspeedError):
    """A prompt could not be tokenized (engine answer, template error).

    ``client_error``: the input itself was refused (the engine answered 4xx,
    or no engine was named to ask), so an API that asked on a client's behalf
    answers 400, not 502.
    """

    def __init__(self, message: str, *, client_error: bool = False) -> None:
        super().__init__(message)
        self.client_error = client_error


class PromptTokenizer(Protocol):
    """What the gateway asks of a tokenizer; ``url`` is an engine it may ask."""

    async def completion_tokens(self, text: str, body: dict[str, Any], url: str | None) -> list[int]: ...

    async def chat_tokens(self, body: dict[str, Any], url: str | None) -> list[int]: ...


class _TokenCache:
    """A small LRU of recent tokenizations with a TTL.

    Safe because the key is everything the engine's answer depends on (the
    model name, the text or the messages with every template field) and all
    workers of one model tokenize alike; the TTL bounds how long an engine
    redeployed with another tokenizer under the same model name can be
    answered from memory. It saves the round trip for retried and repeated
    prompts (benchmarks, health checks, regenerate buttons).
    """

    def __init__(self, max_entries: int = 4096, ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()
        self._max = max_entries
        self._ttl_s = ttl_s
        self._clock = clock

    def get(self, key: str) -> list[int] | None:
        hit = self._entries.get(key)
        if hit is None:
            return None
        if hit[0] < self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return hit[1]

    def put(self, key: str, tokens: list[int]) -> None:
        self._entries[key] = (self._clock() + self._ttl_s, tokens)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)


def _token_answer(data: Any, url: str) -> list[int]:
    tokens = data.get("tokens", data.get("input_ids")) if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise TokenizeError(f"{url}/tokenize answered without a list of token ids")
    return tokens


class EngineTokenizer:
    """Tokenize with the engine's own ``POST /tokenize`` (vLLM / SGLang shapes)."""

    def __init__(self, pool: Callable[[], Http1Pool], timeout_s: float = 10.0) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._cache = _TokenCache()

    async def _ask(self, url: str | None, payload: dict[str, Any]) -> list[int]:
        if url is None:
            raise TokenizeError("no worker with a url to ask for /tokenize", client_error=True)
        key = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            status, content = await self._pool().fetch(b"POST", url, "/tokenize", json.dumps(payload).encode(),
                                                       timeout_s=self._timeout_s)
        except (UpstreamError, OSError) as err:
            raise TokenizeError(f"{url}/tokenize: {type(err).__name__}: {err}") from err
        if status != 200:
            raise TokenizeError(f"{url}/tokenize answered {status}: {content[:200]!r}",
                                client_error=400 <= status < 500)
        try:
            tokens = _token_answer(json.loads(content), url)
        except ValueError as err:
            raise TokenizeError(f"{url}/tokenize answered invalid JSON") from err
        self._cache.put(key, tokens)
        return tokens

    async def completion_tokens(self, text: str, body: dict[str, Any], url: str | None) -> list[int]:
        payload: dict[str, Any] = {"prompt": text}
        if body.get("model") is not None:
            payload["model"] = body["model"]
        if "add_special_tokens" in body:
            payload["add_special_tokens"] = body["add_special_tokens"]
        return await self._ask(url, payload)

    async def chat_tokens(self, body: dict[str, Any], url: str | None) -> list[int]:
        payload: dict[str, Any] = {"messages": body["messages"]}
        if body.get("model") is not None:
            payload["model"] = body["model"]
        for name in CHAT_TEMPLATE_FIELDS:
            if name in body:
                payload[name] = body[name]
        return await self._ask(url, payload)


def _special(value: Any) -> str | None:
    """``bos_token`` as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class LocalTokenizer:
    """A Hugging Face tokenizer loaded from disk (``tokenizer.json`` + ``tokenizer_config.json``)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ConfigError(
                "--tokenizer PATH needs the 'tokenizers' and 'jinja2' packages: "
                "pip install 'tokenspeed-router[tokenizer]'"
            ) from err
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ConfigError(f"--tokenizer {str(path)!r}: no tokenizer.json there")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as err:  # the Rust library raises plain Exception subclasses
            raise ConfigError(f"--tokenizer {str(path)!r}: cannot load {file}: {err}") from err
        config: dict[str, Any] = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(f"--tokenizer {str(path)!r}: {config_file}: {err}") from err
        self._templates = self._load_templates(config.get("chat_template"), path)
        self._specials = {
            "bos_token": _special(config.get("bos_token")),
            "eos_token": _special(config.get("eos_token")),
            "unk_token": _special(config.get("unk_token")),
            "pad_token": _special(config.get("pad_token")),
        }

    @staticmethod
    def _load_templates(value: Any, path: str | Path) -> dict[str, Any]:
        if value is None:
            return {}
        if isinstance(value, str):
            sources = {"default": value}
        elif isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
            sources = {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t}
        else:
            raise ConfigError(f"--tokenizer {str(path)!r}: chat_template must be a string or a list")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            return {name: env.from_string(src) for name, src in sources.items()}
        except TemplateError as err:
            raise ConfigError(f"--tokenizer {str(path)!r}: chat template does not compile: {err}") from err

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt text the chat template makes of ``body`` (like ``apply_chat_template``)."""
        from jinja2 import TemplateError

        given = body.get("chat_template")
        if isinstance(given, str):
            raise TokenizeError("a per-request 'chat_template' needs --tokenizer engine")
        template = self._templates.get("tool_use" if body.get("tools") else "default") or self._templates.get(
            "default")
        if template is None:
            raise TokenizeError("the local tokenizer has no chat template (tokenizer_config.json)")
        given_kwargs = body.get("chat_template_kwargs")
        kwargs: dict[str, Any] = given_kwargs if isinstance(given_kwargs, dict) else {}
        try:
            return str(template.render(
                messages=body["messages"],
                tools=body.get("tools"),
                documents=body.get("documents"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                **self._specials,
                **kwargs,
            ))
        except TemplateError as err:
            raise TokenizeError(f"chat template: {err}") from err
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise TokenizeError(f"chat template could not render these messages: {err}") from err

    async def completion_tokens(self, text: str, body: dict[str, Any], url: str | None) -> list[int]:
        special = body.get("add_special_tokens", True) is not False
        if len(text) <= _INLINE_CHARS:
            return self.encode_text(text, special)
        return await asyncio.to_thread(self.encode_text, text, special)

    async def chat_tokens(self, body: dict[str, Any], url: str | None) -> list[int]:
        text = self.render_chat(body)
        special = body.get("add_special_tokens", False) is True  # the template writes BOS itself
        if len(text) <= _INLINE_CHARS:
            return self.encode_text(text, special)
        return await asyncio.to_thread(self.encode_text, text, special)


def load_tokenizer(setting: str, pool: Callable[[], Http1Pool]) -> PromptTokenizer:
    """``--tokenizer engine`` or ``--tokenizer PATH`` (a ConfigError names what is wrong)."""
    if setting == "engine":
        return EngineTokenizer(pool)
    return LocalTokenizer(setting)
