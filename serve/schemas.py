"""The OpenAI request bodies the server accepts, checked strictly (a string where a number belongs is a 400, not a
guess), and the replies it writes.

Fields that change what is generated are honoured or refused: `n` > 1, `logprobs`, `logit_bias`, `tools`, `echo`,
`suffix` and a JSON `response_format` get a 400 that names them, rather than an answer that silently ignores them.
Fields that only describe the caller (`user`, `metadata`, `store`, ...) are accepted and ignored. llama.cpp's
server's sampling extras (`top_k`, `min_p`, `repeat_penalty`) are accepted too, and its `return_tokens`: the reply's
token ids beside its text (`tokens` in the choice; streamed, in each chunk, the ids whose text it carries), which is
how a client checks that two replies are the same token for token.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from edge.generate import Stats
from edge.sampling import MAX_PENALTY, MIN_PENALTY, SamplingConfig

MAX_STOP_STRINGS = 16
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}  # edge's reasons -> OpenAI's

COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI's; chat replies run to their end or the context's


class Refused(Exception):
    """A request the server will not run: the status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class ResponseFormat(Strict):
    type: str = "text"


class ContentPart(Strict):
    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self, index: int) -> dict[str, str]:
        """{"role", "content"} as chat templates read them; OpenAI's "developer" is the system role."""
        if self.role == "tool":
            raise Refused(400, "tool messages are not supported (no function calling)", f"messages.{index}.role")
        if self.content is None:
            raise Refused(400, "a message needs text content (no function calling)", f"messages.{index}.content")
        if isinstance(self.content, str):
            text = self.content
        else:
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise Refused(400, f"content parts of type {part.type!r} are not supported: this model reads "
                                       "text only", f"messages.{index}.content")
            text = "".join(part.text or "" for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class GenerationRequest(Strict):
    """The fields /v1/chat/completions and /v1/completions share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False)
    repeat_penalty: float | None = Field(None, ge=MIN_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    return_tokens: bool | None = False

    @field_validator("stop", "logit_bias", mode="before")
    @classmethod
    def _few_items(cls, value: Any, info: ValidationInfo) -> Any:
        """Counted before their items are validated: pydantic checks each item of a list (and writes an error for
        each bad one, 4 s a million), all of it on the event loop, so a body of millions of stop items held the server
        for minutes."""
        if not isinstance(value, list | dict):
            return value
        if info.field_name == "logit_bias" and value:  # refused whatever it holds (refuse_unsupported)
            raise ValueError("logit_bias is not supported")
        if info.field_name == "stop" and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(value)})")
        return value

    def sampling(self, defaults: SamplingConfig) -> SamplingConfig:
        """The request's sampling; what it leaves out comes from `defaults` (the pair's: the model's recommended
        sampling, else llama.cpp's defaults, as llama-server does; OpenAI's temperature 1 with no top-p cut wanders
        on small models)."""
        given = {name: getattr(self, name) for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                                        "presence_penalty", "frequency_penalty", "seed")}
        return dataclasses.replace(defaults, **{name: value for name, value in given.items() if value is not None})

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise Refused(400, f"at most {MAX_STOP_STRINGS} stop strings (got {len(stops)})", "stop")
        if any(not stop for stop in stops):
            raise Refused(400, "a stop string must not be empty", "stop")
        return stops

    def refuse_unsupported(self) -> None:
        """A 400 for each field whose meaning the server cannot honour."""
        if self.n not in (None, 1):
            raise Refused(400, f"n={self.n}: this server makes one choice per request (n=1); send several "
                               "requests instead", "n")
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            raise Refused(400, "logprobs are not supported", "logprobs")
        if self.logit_bias:
            raise Refused(400, "logit_bias is not supported", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools or self.functions:
            raise Refused(400, "tools (function calling) are not supported", "tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise Refused(400, f"response_format {self.response_format.type!r} is not supported (text only)",
                          "response_format")

    def template_messages(self) -> list[dict[str, str]]:
        return [message.as_template_message(index) for index, message in enumerate(self.messages)]

    def reply_tokens(self) -> int | None:
        """The most tokens asked for; None: until the reply ends or the context is full."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise Refused(400, "echo is not supported", "echo")
        if self.suffix:
            raise Refused(400, "suffix (fill in the middle) is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise Refused(400, f"best_of={self.best_of}: this server makes one completion per request", "best_of")

    def one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids: one prompt per request (a list of several is a batch, refused)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise Refused(400, f"one prompt per request (got a batch of {len(prompt)})", "prompt")
            prompt = prompt[0]
        return prompt  # type: ignore[return-value]

    def reply_tokens(self) -> int:
        return self.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS


def usage(stats: Stats, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens the KV caches already held."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": stats.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def edge_stats(stats: Stats) -> dict[str, Any]:
    """What the reply cost: tokens per target pass, passes, draft and verify seconds (`edge_spec` in a response)."""
    return stats.as_dict()


class Reply:
    """The id, time and model every object of one response carries."""

    def __init__(self, kind: Literal["chat", "text"], model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def whole(self, text: str, finish_reason: str, completion_tokens: int, stats: Stats,
              tokens: list[int] | None = None) -> dict[str, Any]:
        """The whole reply; with `tokens` (return_tokens), its token ids in the choice."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            name = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            name = "text_completion"
        if tokens is not None:
            choice["tokens"] = tokens
        return self._object(name, [choice], usage=usage(stats, completion_tokens), edge_spec=edge_stats(stats))

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              tokens: list[int] | None = None, **extra: Any) -> dict[str, Any]:
        """One streamed piece: text (chat: a delta), or the last piece with the finish reason; with `tokens`
        (return_tokens), the token ids generated since the last piece."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            name = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            name = "text_completion"
        if tokens is not None:
            choice["tokens"] = tokens
        return self._object(name, [choice], **extra)

    def usage_chunk(self, stats: Stats, completion_tokens: int) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._object(name, [], usage=usage(stats, completion_tokens))
