"""OpenAI's request models for /v1/completions and /v1/chat/completions, with vLLM's extensions. Known fields
are strict (no "5" for 5) and range-checked here, so a bad value is a 400 before anything reaches the engine.
Unknown fields are let through, as vLLM does (its clients send fields of other versions): `unknown_fields`
names them, and the routes log them and name them in a response header."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticCustomError

from devharness.config import (MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                               MAX_STOP_TOKEN_IDS)
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
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM: with include_usage, the usage so far in every chunk


# OpenAI caps n at 128; the server also caps choices per request (n times the prompts) at MAX_CHOICES (config.py,
# with the other bounds on what one request may ask for; the total length of the stop strings, and the logprobs of
# a reply, are checked in api.py).
MAX_N = 128
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class SamplingRequest(_Strict):
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: Text | None = None
    # Accepted so standard clients work, but only at their neutral values (api._check_common refuses others).
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # token id (as a decimal string) -> bias in [-100, 100], as OpenAI documents it
    logit_bias: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,9})$")],
                               Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's extensions, with vLLM's names and meanings
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    repetition_penalty: float = Field(1.0, gt=0)
    prompt_logprobs: TopLogprobs | None = None
    return_token_ids: bool = False

    def unknown_fields(self) -> list[str]:
        """The request's fields this server does not know (it ignores them), stream_options' as stream_options.x."""
        names = list(self.model_extra or ())
        if self.stream_options is not None:
            names += [f"stream_options.{k}" for k in self.stream_options.model_extra or ()]
        return names


class CompletionRequest(SamplingRequest):
    # What /openapi.json shows as a request (clients' docs, and schemathesis's first example).
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        {"prompt": ["Hello", "The sky is"], "max_tokens": 4, "n": 2, "seed": 7, "min_tokens": 2}]})
    # One prompt (text or token ids) or a batch of them: one choice each (n each with n > 1).
    prompt: Text | list[TokenId] | Annotated[list[Text], Field(max_length=MAX_CHOICES)] | \
        Annotated[list[list[TokenId]], Field(max_length=MAX_CHOICES)]
    # 0 only with echo or prompt_logprobs: the prompt scored, nothing generated (api.create_completion checks)
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    logprobs: TopLogprobs | None = None
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
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None   # more variables for the chat template


FIELD_NAMES = frozenset(f for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
                        for f in m.model_fields)
