"""What the engine hands back: vLLM's RequestOutput / CompletionOutput, built incrementally with
detokenization and stop strings applied (OutputProcessor, vLLM v1's name: one RequestTracker per request)."""
from __future__ import annotations

from dataclasses import dataclass, field

from devharness.engine.request import Request, RequestStatus
from devharness.engine.stop_strings import StopMatcher
from devharness.protocol.messages import TokenLogprobs
from devharness.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None              # with finish_reason "error": what failed, on which rank
    error_kind: str | None = None         # protocol/errors.py's NON_FINITE where the numerics check ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)   # tokens added by the step that made this output
    new_text: str = ""
    # With SamplingParams.prompt_logprobs: one per prompt token, the first None (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    queued_s: float = 0.0   # seconds it waited to be scheduled so far (arrival to admission, and again after preemptions)


class RequestTracker:
    """Per-request text state: incremental detokenizer and stop-string search."""

    def __init__(self, req: Request, prompt: str | None, tokenizer: Tokenizer | None):
        self.req = req
        self.prompt = prompt
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.sampling.skip_special_tokens) \
            if tokenizer is not None else None
        self.stops = StopMatcher(req.sampling.stop) if req.sampling.stop else None
        self.text = ""
        self.logprobs: list[TokenLogprobs] | None = [] if req.sampling.logprobs is not None else None
        self.stopped_by_string = False

    def add_token(self, token: int | None, logprobs: TokenLogprobs | None) -> str:
        """Append a token's text; returns the new text (trimmed at a stop string, which then ends the request)."""
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detok is None or token is None:
            return ""
        sp = self.req.sampling
        if self.req.status is RequestStatus.FINISHED_STOPPED and not sp.include_stop_str_in_output and (
                token in self.req.stop_token_ids or not sp.ignore_eos and token in self.req.eos_token_ids):
            return ""   # the stop token's text, as vLLM leaves it out
        delta = self.detok.add([token])
        # As vLLM: stop strings are looked for once the output has more than min_tokens tokens.
        if not delta or not self.stops or len(self.req.output_token_ids) <= sp.min_tokens:
            self.text += delta
            return delta
        # A stop string may straddle the previous text and the delta: search the delta and the tail before it.
        old_len = len(self.text)
        back = min(old_len, self.stops.longest - 1)
        found = self.stops.find(self.text[old_len - back:] + delta, back)
        candidate = self.text + delta
        if found is None:
            self.text = candidate
            return delta
        best = (found[0] + old_len - back, found[1])
        self.text = candidate[:best[0] + (len(best[1]) if sp.include_stop_str_in_output else 0)]
        self.req.stop_reason = best[1]
        self.stopped_by_string = True
        return self.text[old_len:]

    def make_output(self, new_tokens: list[int], new_text: str) -> RequestOutput:
        r = self.req
        # Copied like the token ids: the engine thread keeps appending while a caller reads this output.
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        comp = CompletionOutput(0, self.text, list(r.output_token_ids), r.finish_reason, r.stop_reason, logprobs,
                                r.error, r.error_kind)
        prompt_logprobs = list(r.prompt_logprobs) if r.prompt_logprobs is not None else None
        return RequestOutput(r.req_id, self.prompt, r.prompt_token_ids, [comp], r.status.finished,
                             r.num_cached_tokens or 0, new_tokens, new_text, prompt_logprobs, r.queued_s)


class OutputProcessor:
    """The engine's requests' text: a RequestTracker per unfinished request, which turns each step's sampled tokens
    into RequestOutputs (detokenized, stop strings found). Engine thread."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._trackers: dict[str, RequestTracker] = {}   # in the order the requests were added

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._trackers

    def add(self, req: Request, prompt: str | None) -> None:
        self._trackers[req.req_id] = RequestTracker(req, prompt, self.tokenizer)

    def abort(self, request_id: str) -> None:
        self._trackers.pop(request_id, None)

    def clear(self) -> None:
        self._trackers.clear()

    def request_ids(self) -> list[str]:
        """The unfinished requests' ids, in the order they were added."""
        return list(self._trackers)

    def process(self, results, finish_stopped) -> list[RequestOutput]:
        """A step's (request, token or None, logprobs) results as RequestOutputs; `finish_stopped(request_id)` ends a
        request whose text reached a stop string (the scheduler's to do)."""
        outputs = []
        for req, tok, lp in results:
            tracker = self._trackers.get(req.req_id)
            if tracker is None:
                continue
            new_text = tracker.add_token(tok, lp)
            if tracker.stopped_by_string and not req.status.finished:
                finish_stopped(req.req_id)
            outputs.append(tracker.make_output([] if tok is None else [tok], new_text))
            if req.status.finished:
                del self._trackers[req.req_id]
        return outputs
