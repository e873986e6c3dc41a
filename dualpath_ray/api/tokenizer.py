"""A model's Hugging Face tokenizer files, for the OpenAI-compatible endpoint.

Reads `tokenizer.json` with the `tokenizers` library and `tokenizer_config.json` for the special
tokens and the chat template. A chat template is rendered as `transformers` renders it (jinja2's
sandbox with trim_blocks and lstrip_blocks, `raise_exception`, the special tokens as variables);
a tokenizer without one uses `DEFAULT_CHAT_TEMPLATE`, one line per message:

    <|role|>
    content
    ...
    <|assistant|>

(the last line only with add_generation_prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerError(ValueError):
    """The tokenizer files are missing or do not fit the model; the message names the file."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class HFTokenizer:
    """Encode, decode and chat-format text with a model's tokenizer files."""

    backend: Any  # tokenizers.Tokenizer
    chat_template: str
    bos_token: str | None
    eos_token: str | None
    source: str

    @classmethod
    def from_dir(cls, directory: str | Path, vocab_size: int) -> HFTokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json` when present) and check every id
        fits the model's vocabulary."""
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(
                f"{path}: no tokenizer file; put the model's Hugging Face tokenizer.json in model.weights_dir "
                "or pass --tokenizer DIR"
            )
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises its own exception type
            raise TokenizerError(f"{path}: not a readable tokenizer ({exc})") from None
        if backend.get_vocab_size(with_added_tokens=True) > vocab_size:
            raise TokenizerError(
                f"{path}: {backend.get_vocab_size(with_added_tokens=True)} tokens do not fit model.vocab_size "
                f"= {vocab_size}; use the model's own tokenizer"
            )
        config = cls._read_config(directory / TOKENIZER_CONFIG_FILE)
        template = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if not isinstance(template, str):
            raise TokenizerError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template must be one template string")
        return cls(backend, template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")), str(path))

    @staticmethod
    def _read_config(path: Path) -> dict[str, Any]:
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{path}: must be a JSON object")
        return config

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=True))

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token of the vocabulary in characters, as the vocabulary spells it
        (byte-level and byte-fallback spellings are at least as long as the text they decode
        to). A text of more than max_context times this many characters cannot fit the context
        whatever it encodes to, except for characters the tokenizer drops (a whitespace-splitting
        pre-tokenizer's spaces), which count here too."""
        return max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def max_prompt_chars(self, max_context: int) -> int:
        """The most characters a prompt that fits `max_context` tokens can have."""
        return max_context * self.max_token_chars

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a completion: the eos token, when the tokenizer has one."""
        if self.eos_token is None:
            return ()
        token = self.backend.token_to_id(self.eos_token)
        return () if token is None else (int(token),)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, rendered with the tokenizer's chat template."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise TokenizerError(f"{self.source}: the chat template rejected the messages: {exc}") from None


class IncrementalDetokenizer:
    """Text of a growing token sequence, piece by piece: each call returns only the new text.
    Text ending in an incomplete UTF-8 sequence (decoded as U+FFFD) is held back until the
    tokens that complete it arrive."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = ""

    def push(self, tokens: Sequence[int], final: bool = False) -> str:
        self.tokens.extend(int(t) for t in tokens)
        text = self.tokenizer.decode(self.tokens)
        if not final and text.endswith("\ufffd"):
            return ""
        new = text[len(self.emitted):] if text.startswith(self.emitted) else text
        self.emitted = text
        return new
