"""OpenAI's request models for /v1/completions and /v1/chat/completions. They are strict (no "5"
for 5) and reject unknown fields, as OpenAI does; range checks live here so a bad value is a 400
before anything reaches the engine."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticCustomError

from devharness.sampling_params import INT64_MAX, INT64_MIN

# What the engine can carry: token ids, counts and top_k fit an int32 (the msgpack step messages and
# torch's int64 tensors would take more, but no vocabulary or context is that large); seed is an int64.
INT32_MAX = 2**31 - 1


def _valid_unicode(s: str) -> str:
    """JSON's \\ud800 escapes give Python strings with lone surrogates, which no tokenizer, UTF-8
    encoder or JSON response can take: refuse them here, naming the field."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_unicode", f"must be valid Unicode text, but has a lone surrogate "
                                  f"(U+{ord(s[e.start]):04X}) at index {e.start}") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]


class _Strict(BaseModel):
    # allow_inf_nan: Python's json.loads takes the NaN / Infinity literals; no float here may be one.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=INT32_MAX)
    user: Text | None = None
    # Accepted so standard clients work, but only at their neutral values (api._check_common refuses others).
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # token id (as a decimal string) -> bias in [-100, 100], as OpenAI documents it
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$")],
                     Annotated[float, Field(ge=-100, le=100)]] | None = None
    # devharness extensions (vLLM's names)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    return_token_ids: bool = False


class CompletionRequest(SamplingRequest):
    prompt: Text | list[TokenId]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Count | None = None
    suffix: Text | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) are ignored: the chat template renders role and content.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


FIELD_NAMES = frozenset(f for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
                        for f in m.model_fields)
