"""Requests to prompt token ids, checked against the model: shared by every engine.

Pure tokenizer work, safe to call from any thread. A request that cannot run raises
:class:`JobInputError`, whose message says what is wrong and how to fix it.
"""

from __future__ import annotations

from typing import Any

from mlxq.errors import one_line
from mlxq.wire import ModelInfo, Request

# The key of the tiny generation an engine runs before its first real job.
WARMUP_KEY = "__mlxq_warmup__"


class JobInputError(ValueError):
    """A request this model cannot run; the message says what is wrong and how to fix it.
    ``prompt_tokens``: the prompt's length where it was tokenized (the failure's usage)."""

    def __init__(self, message: str, prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


def error_line(exc: BaseException) -> str:
    """An exception as one readable line, with a hint when memory ran out."""
    line = one_line(exc)
    if "memory" in line.lower() or "alloc" in line.lower():
        return f"{line} (out of memory: lower max_batch or prefill_step, or send shorter jobs)"
    return line


class PromptEncoder:
    """Encodes requests for one model: text, chat messages or token ids."""

    def __init__(self, tokenizer: Any, info: ModelInfo) -> None:
        self.tokenizer, self.info = tokenizer, info

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; raises :class:`JobInputError` if it cannot run."""
        tokens = self.prompt_tokens(request)
        self.check_tokens(tokens, request.max_tokens)
        return tokens

    def prompt_tokens(self, request: Request) -> list[int]:
        """The prompt's token ids, unchecked."""
        tok = self.tokenizer
        if request.messages is not None:
            return self._render_chat(request)
        if isinstance(request.prompt, str):
            # Like mlx_lm.generate: add BOS unless the text already starts with it.
            add_special = tok.bos_token is None or not request.prompt.startswith(tok.bos_token)
            return list(tok.encode(request.prompt, add_special_tokens=add_special))
        return list(request.prompt or [])

    def _render_chat(self, request: Request) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise JobInputError(
                f"model {self.info.name} has no chat template, so `messages` cannot be "
                "rendered: send `prompt` (text you formatted yourself, or token ids) instead"
            )
        messages = [{"role": m.role, "content": m.content} for m in request.messages or []]
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:
            raise JobInputError(
                f"the chat template of {self.info.name} rejected these messages "
                f"({error_line(exc)}): check the roles and their order"
            ) from exc
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def check_tokens(self, tokens: list[int], max_tokens: int) -> None:
        """Raise :class:`JobInputError` unless the tokens fit the vocabulary and context."""
        vocab, ctx = self.info.vocab_size, self.info.context_length
        if not tokens:
            raise JobInputError("the prompt encodes to no tokens: send non-empty text")
        for i, t in enumerate(tokens):
            if not 0 <= t < vocab:
                raise JobInputError(
                    f"prompt token id {t} at position {i} is outside the vocabulary of "
                    f"{self.info.name} (ids 0 to {vocab - 1}): tokenize with this model's "
                    "tokenizer"
                )
        n = len(tokens)
        if n + max_tokens > ctx:
            if n >= ctx:
                fix = f"shorten the prompt to under {ctx} tokens"
            elif max_tokens >= ctx:  # no prompt is short enough: only max_tokens can change
                fix = f"lower max_tokens to at most {ctx - n} (alone it exceeds the context)"
            else:
                fix = (
                    f"shorten the prompt to at most {ctx - max_tokens} tokens or lower "
                    f"max_tokens to at most {ctx - n}"
                )
            raise JobInputError(
                f"the prompt is {n} tokens and max_tokens is {max_tokens}, together "
                f"{n + max_tokens}, but the context of {self.info.name} is {ctx} tokens: {fix}",
                prompt_tokens=n,
            )
