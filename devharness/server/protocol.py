"""OpenAI's request models for /v1/completions and /v1/chat/completions. They are strict (no "5"
for 5) and reject unknown fields, as OpenAI does; range checks live here so a bad value is a 400
before anything reaches the engine."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    # Accepted so standard clients work, but only at their neutral values (api._check_common refuses others).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # devharness extensions (vLLM's names)
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) are ignored: the chat template renders role and content.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


FIELD_NAMES = frozenset(f for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
                        for f in m.model_fields)
