"""ModelRunner: a worker's per-request state, the step's input tensors, the forward and sampling."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from devharness.config import ModelConfig, SchedulerConfig
from devharness.debug import state as debug_state
from devharness.debug.kv_checksums import KvChecksums
from devharness.distributed import collectives
from devharness.distributed.parallel_state import ParallelInfo
from devharness.protocol.messages import (EMPTY_OUTPUT, ModelRunnerOutput, PromptLogprobs, RequestError, SchedulerOutput,
                                         TokenLogprobs)
from devharness.kernels import Kernels, kernels_for
from devharness.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from devharness.model.decoder import DecoderForCausalLM, stage_layer_range
from devharness.model.hooks import HookSet
from devharness.model.loader import ModelSource, iter_weights, load_weights
from devharness.model.registry import build_model
from devharness.model.sampler import LogitBias, SamplingBatch, add_logit_bias, process_logits, sample, token_seed
from devharness.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Prompt rows turned into logits at once for prompt logprobs: [rows, vocab] floats stay a few tens of MB.
PROMPT_LOGITS_ROWS = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestState:
    """What a worker keeps of one request between steps (the scheduler sends only changes)."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    sampling_seed: int
    block_generations: list[int] = field(default_factory=list)   # with the KV sanitizer (check_kv_generations)
    eos_token_ids: list[int] = field(default_factory=list)   # while SamplingParams.min_tokens masks them
    logit_bias: LogitBias | None = None   # SamplingParams.logit_bias as tensors, made at its first sampling


class _Rows(NamedTuple):
    """One request's rows in a step: positions start..end of its token ids, in its first num_blocks blocks."""

    state: RequestState
    start: int
    end: int
    token_ids: list[int]
    num_blocks: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_req_ids: list[str]
    sample_token_index: torch.Tensor   # rows of the step's hidden states to turn into logits
    req_rows: dict[str, tuple[int, int, int]]   # request id -> (its first row, its rows, its first row's position)
    # (request id, its first row in the step, the position of that row, rows): prompt rows whose next token is a
    # prompt token, of requests that asked for prompt logprobs
    prompt_rows: list[tuple[str, int, int, int]]


class ModelRunner:
    """Runs one rank's share of the model for each SchedulerOutput."""

    def __init__(self, src: ModelSource, model_cfg: ModelConfig, sched_cfg: SchedulerConfig,
                 info: ParallelInfo, max_model_len: int, device: torch.device | None = None,
                 layer_partition: list[int] | None = None):
        self.src, self.model_cfg, self.sched_cfg, self.info = src, model_cfg, sched_cfg, info
        self.layer_partition = layer_partition   # layers per pipeline stage (None: an even split; the engine always sets it at pp > 1)
        self.dtype = DTYPES[model_cfg.dtype]
        # Every tensor this runner makes lives here (worker/device.py picks a rank's GPU).
        self.device = device if device is not None else torch.device(model_cfg.device)
        self.block_size = sched_cfg.block_size
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self._block_refs: dict[int, int] = {}
        self._block_generation: dict[int, int] = {}   # the newest generation each block was handed at
        self._stale: set[str] = set()   # requests whose table may hold a block at an older generation than that
        self.model: DecoderForCausalLM | None = None
        self.num_kv_blocks = 0
        self.kv_checksums: KvChecksums | None = None   # with the KV sanitizer: what each full block holds
        # Requests that failed on their own in the step running now: req id -> message.
        self.failed: dict[str, str] = {}
        # Called with (req_id, exception) when one request fails; the worker pauses there in debug mode.
        self.on_request_error = None
        # Recording: each sampled row's (max logit, logsumexp) goes back with its token (ModelRunnerOutput).
        self.digest_logits = False
        # The kernels the model and the sampler run (devharness/kernels): one backend, debug mode or not.
        self.kernels: Kernels = kernels_for(model_cfg.kernels, self.device.type, model_cfg.batch_invariant)
        if self.kernels.backend != model_cfg.kernels:
            # The driver found the fast kernels buildable (it resolves the backend before starting workers): a rank
            # on another node that cannot build them must not run other numbers than its peers and the recording say.
            raise RuntimeError(f"rank {info.rank}: the {model_cfg.kernels} kernels cannot be built on this node; "
                               f"run with --kernels {self.kernels.backend}")
        self.packed_bytes = 0   # what the kernels' packed copies of the weights hold (load_model)
        # The hooks this runner's model calls (its own: the worker installs on them) and the watchers of its steps:
        # each has step_start(step, request ids) before a step's forward, rows(req id, "prepare" | "sample") as a
        # request's rows are prepared or sampled (raising fails that request alone) and request_done(req id) once
        # a failed request has left. Empty tuple: one check a step.
        self.hooks = HookSet()
        self.step_watchers: tuple = ()
        # Called on every rank of the last stage with the sampled rows' hidden states and the step's inputs, before
        # sampling (activation capture keeps their logits: `check` weighs a flipped token by its logit margin).
        self.head_watchers: tuple = ()
        # The numerics check (debug/numerics.py), installed by the worker on `hooks`: told of each step's start, its
        # sampled rows' logits and its end, where it reads the step's absmax once. None: off.
        self.numerics = None
        self._inputs: StepInputs | None = None   # the step running now's

    def load_model(self) -> None:
        arch = self.src.arch
        with torch.device(self.device):
            model = build_model(arch, self.info.pp_rank, self.info.pp_size, max_positions=self.max_model_len,
                                layer_partition=self.layer_partition)
        model.to(self.dtype)
        layer_range = stage_layer_range(arch.num_hidden_layers, self.info.pp_size, self.info.pp_rank,
                                        self.layer_partition)
        load_weights(model, iter_weights(self.src, self.dtype, layer_range, seed=self.model_cfg.seed,
                                         quantized=self.keeps_quantized()),
                     self.src.path or self.src.name)
        # RoPE tables stay float32 (cast per use), like the reference implementation.
        rot = model.model.rotary_emb
        rot.cos, rot.sin = rot.cos.float(), rot.sin.float()
        model.set_kernels(self.kernels)
        model.set_hooks(self.hooks)
        # The fast linear kernels run over packed copies of the weights: made now, not in the first step.
        self.packed_bytes = self.kernels.prepare(model.weights_by_op())
        self.model = model.eval()

    def keeps_quantized(self) -> bool:
        """Whether a GGUF file's Q4_1 and Q8_0 weights stay in their blocks: unless --dequantize, on the CPU in
        float32 where the fast kernels built (the quantized ops' C kernels; else every call would dequantize)."""
        if self.model_cfg.dequantize or self.src.kind != "gguf":
            return False
        if self.device.type != "cpu" or self.dtype != torch.float32:
            logger.info("%s: weights dequantized to %s (the quantized kernels run on the CPU in float32)",
                        self.src.name, self.dtype)
            return False
        from devharness.kernels import cpu
        if cpu.library() is None:
            logger.info("%s: weights dequantized (the quantized kernels did not build here)", self.src.name)
            return False
        return True

    def kv_cache_block_bytes(self) -> int:
        layers = self.model.attention_layers()
        a = layers[0]
        per_layer = 2 * self.block_size * a.num_kv_heads * a.head_dim * torch.finfo(self.dtype).bits // 8
        return per_layer * len(layers)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_kv_blocks = num_blocks
        rec = debug_state.current_recorder()
        if rec is not None:
            self._publish_batch(rec, rec.state.step, 0, 0)
        layers = self.model.attention_layers()
        a = layers[0]
        # One tensor holds every layer's keys and values ([layer, key|value, block, slot, head, dim]); each layer's
        # caches are views of it, so the KV checksums gather a block of every layer in one copy.
        kv = torch.zeros((len(layers), 2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim), dtype=self.dtype,
                         device=self.device)
        for n, a in enumerate(layers):
            a.k_cache, a.v_cache = kv[n, 0], kv[n, 1]
        if self.sched_cfg.kv_sanitizer:
            i = self.info
            self.kv_checksums = KvChecksums(kv, self.model.model.layer_range[0], self.block_size,
                                            f"rank {i.rank} (tp {i.tp_rank}, pp {i.pp_rank})", i.rank)

    # -- per-step ---------------------------------------------------------------------------

    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            st = self.requests.pop(rid, None)
            if st is not None:
                self._release_blocks(st.block_ids)
            self._stale.discard(rid)
            if self.kv_checksums is not None:
                self.kv_checksums.forget(rid)
        for r in so.new_requests:
            self.requests[r.req_id] = RequestState(list(r.token_ids), r.num_prompt_tokens, list(r.block_ids),
                                                   r.num_computed_tokens, r.sampling, r.sampling_seed,
                                                   list(r.block_generations), list(r.eos_token_ids))
            self._hold_blocks(r.block_ids)
            self._handed(r.req_id, r.block_ids, r.block_generations)
        for c in so.cached_requests:
            st = self.requests.get(c.req_id)
            if st is None:   # it failed here earlier: this worker no longer holds it
                self._fail_request(c.req_id, "updating its state", KeyError(f"unknown request {c.req_id!r}"))
                continue
            st.token_ids.extend(c.new_token_ids)
            st.block_ids.extend(c.new_block_ids)
            st.block_generations.extend(c.new_block_generations)
            st.num_computed_tokens = c.num_computed_tokens
            self._hold_blocks(c.new_block_ids)
            self._handed(c.req_id, c.new_block_ids, c.new_block_generations)

    # -- the KV sanitizer's check on this side: a block a request reads is still the one its table was handed --

    def _handed(self, rid: str, block_ids: list[int], generations: list[int]) -> None:
        """`rid`'s table got `block_ids` at `generations` (with the KV sanitizer; else none). A table's entry goes
        stale only here: handed at an older generation than the block's newest, or another table handed the block
        anew while this one holds it (then the block is held twice: its count here says so). Those requests are
        kept in `_stale`, for check_kv_generations to test when they read."""
        newest = self._block_generation
        for b, g in zip(block_ids, generations):
            now = newest.get(b, -1)
            if g > now:
                newest[b] = g
                if now >= 0 and self._block_refs[b] > 1:   # every other holder has it at `now` or older
                    self._stale.update(other for other, st in self.requests.items()
                                       if other != rid and b in st.block_ids)
            elif g < now:
                self._stale.add(rid)

    def check_kv_generations(self, so: SchedulerOutput) -> None:
        """With the KV sanitizer (the step message carries generations): every block a scheduled request's
        attention reads must still be at the generation its table was handed; one handed out again since (to
        another request) means the request reads a block that was freed under it. Fails the step, naming the
        request, block, layer and step. Only the tables _handed found possibly stale are walked."""
        if not self._stale:
            return
        for rid in so.num_scheduled_tokens:
            st = self.requests.get(rid) if rid in self._stale else None
            if st is None:
                continue
            for b, g in zip(st.block_ids, st.block_generations):
                now = self._block_generation.get(b, g)
                if now != g:
                    i, layer = self.info, self.model.model.layer_range[0]
                    raise RuntimeError(
                        f"KV sanitizer, rank {i.rank} (tp {i.tp_rank}, pp {i.pp_rank}), step {so.step}: request "
                        f"{rid} reads block {b} in layer {layer}'s attention, handed to it at generation {g}, but "
                        f"the block has since been handed out at generation {now}: it was freed and reused while "
                        f"the request held it (a use after free)")

    # Blocks in use, shared prefix blocks counted once: kept up to date per change, not recounted per step.
    def _hold_blocks(self, block_ids) -> None:
        for b in block_ids:
            self._block_refs[b] = self._block_refs.get(b, 0) + 1

    def _release_blocks(self, block_ids) -> None:
        for b in block_ids:
            if self._block_refs[b] == 1:
                del self._block_refs[b]
            else:
                self._block_refs[b] -= 1

    def _fail_request(self, rid: str, what: str, e: Exception) -> None:
        """One request's rows could not be prepared or sampled: it leaves the step and this worker.

        Failures here are decided by the step message and the state it built, which every rank has
        alike, so every rank drops the same rows and their batches keep agreeing."""
        i = self.info
        self.failed[rid] = (f"rank {i.rank} (tp {i.tp_rank}, pp {i.pp_rank}) failed {what} for request {rid!r}: "
                            f"{type(e).__name__}: {e}")
        logger.error("%s", self.failed[rid], exc_info=e)
        if self.on_request_error is not None:
            self.on_request_error(rid, e)

    def _request_rows(self, rid: str, n: int) -> "_Rows":
        """One request's `n` scheduled rows, checked against what the model and the cache hold: a bad value
        fails this request, not the forward of the whole batch."""
        for w in self.step_watchers:
            w.rows(rid, "prepare")
        st = self.requests[rid]
        start = st.num_computed_tokens
        end = start + n
        if n < 1 or end > len(st.token_ids) or end > self.max_model_len:
            raise ValueError(f"{n} tokens scheduled from position {start}, but it holds {len(st.token_ids)} "
                             f"tokens (max_model_len {self.max_model_len})")
        ids = st.token_ids[start:end]
        vocab = self.src.arch.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"token ids {[t for t in ids if not 0 <= t < vocab][:4]} are outside the vocabulary "
                             f"[0, {vocab})")
        bs, blocks = self.block_size, st.block_ids
        num_blocks = (end + bs - 1) // bs
        if len(blocks) < num_blocks or not all(0 <= b < self.num_kv_blocks for b in blocks[:num_blocks]):
            raise ValueError(f"its block table {blocks[:num_blocks]} does not cover {end} tokens in a cache of "
                             f"{self.num_kv_blocks} blocks")
        return _Rows(st, start, end, ids, num_blocks)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        rows = {}
        for rid, n in so.num_scheduled_tokens.items():
            if rid in self.failed:
                continue
            try:
                rows[rid] = self._request_rows(rid, n)
            except Exception as e:
                self._fail_request(rid, "preparing its inputs", e)
        # Decodes first, shortest context first (so each decode group pads little), then prefill chunks.
        order = sorted(rows, key=lambda rid: (rows[rid].end - rows[rid].start != 1,
                                              rows[rid].start if rows[rid].end - rows[rid].start == 1 else 0))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables, decode_lens, prefills = [], [], []
        sample_req_ids, sample_rows = [], []
        req_rows = {}
        prompt_rows = []
        for rid in order:
            st, start, end, row_ids, num_blocks = rows[rid]
            n = end - start
            req_rows[rid] = (len(ids), n, start)
            ids.extend(row_ids)
            positions.extend(range(start, end))
            blocks = st.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                decode_tables.append(blocks[:num_blocks])
                decode_lens.append(end)
            else:
                prefills.append(PrefillChunk(len(ids) - n, n, end, self._to_device(blocks[:num_blocks])))
            if end == len(st.token_ids):
                sample_req_ids.append(rid)
                sample_rows.append(len(ids) - 1)
            # Row p predicts token p + 1: the prompt's tokens 1 .. P - 1 are scored by rows 0 .. P - 2.
            scored = min(end, st.num_prompt_tokens - 1) - start
            if st.sampling.prompt_logprobs is not None and scored > 0:
                prompt_rows.append((rid, len(ids) - n, start, scored))
        groups = []
        # Rows per decode attention call, as the kernels ask (the fast one reads each row to its own length, so
        # padding costs it nothing: one call for all).
        size = self.kernels.decode_rows_per_call or max(1, len(decode_tables))
        for start in range(0, len(decode_tables), size):
            part = decode_tables[start:start + size]
            width = max(len(t) for t in part)
            groups.append(DecodeGroup(start, self._to_device([t + [0] * (width - len(t)) for t in part]),
                                      self._to_device(decode_lens[start:start + size])))
        meta = AttentionMetadata(self._to_device(slots), len(decode_tables), groups, prefills)
        return StepInputs(self._to_device(ids), self._to_device(positions), meta,
                          sample_req_ids, self._to_device(sample_rows), req_rows, prompt_rows)

    def _to_device(self, values: list) -> torch.Tensor:
        """A step input (int64) built on the host and copied to this runner's device. To a GPU it goes from
        pinned memory without blocking the host: the copy is queued on the stream the forward then runs on."""
        gpu = self.device.type == "cuda"
        host = torch.tensor(values, dtype=torch.long, device="cpu", pin_memory=gpu)
        return host.to(self.device, non_blocking=gpu)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. The output rank returns sampled tokens; every other rank returns None."""
        self.update_states(so)
        rec = debug_state.current_recorder()
        if not so.num_scheduled_tokens:   # a step that only drops finished requests
            self.failed.clear()
            if rec is not None:
                self._publish_batch(rec, so.step, 0, 0)
            return EMPTY_OUTPUT if self.info.is_output_rank else None
        if rec is not None:
            rec.begin_step(so.step, len(so.num_scheduled_tokens), so.total_num_scheduled_tokens)
        try:
            for w in self.step_watchers:
                w.step_start(so.step, so.num_scheduled_tokens.keys())
            numerics = self.numerics
            if numerics is not None:
                numerics.begin_step()
            self._inputs = None
            out = self._run(so, rec)
            if numerics is not None and self._inputs is not None:
                alarm = numerics.end_step(so.step, self._inputs.req_rows, self._inputs.sample_req_ids)
                if alarm is not None and out is not None:
                    out.numerics = alarm
            if self.kv_checksums is not None:
                out = self._check_kv(so, out)
            if self.failed and out is not None:
                out.failed = [RequestError(rid, msg) for rid, msg in self.failed.items()]
            return out
        finally:
            self._drop_failed()
            if rec is not None:
                rec.state.kv_blocks_used = len(self._block_refs)
                rec.end_step()

    def _check_kv(self, so: SchedulerOutput, out: ModelRunnerOutput | None) -> ModelRunnerOutput | None:
        """The KV checksums of this step (debug/kv_checksums.py), taken and checked once its forward ran on every
        rank alike. A mismatch goes back with the step's output, from any rank (one that returns no tokens returns
        an output then); the requests it names stay here until the driver drops them, as every rank's do."""
        alarms = self.kv_checksums.after_step(so.step, so.new_requests, so.cached_requests, so.num_scheduled_tokens,
                                              self.requests, self.failed)
        if not alarms:
            return out
        if out is None or out is EMPTY_OUTPUT:
            out = ModelRunnerOutput([], [])
        out.kv_alarms = alarms
        return out

    def _drop_failed(self) -> None:
        # The driver ends these requests when it reads this step's output; nothing more runs for them here.
        for rid in self.failed:
            for w in self.step_watchers:
                w.request_done(rid)
            st = self.requests.pop(rid, None)
            if st is not None:
                self._release_blocks(st.block_ids)
            self._stale.discard(rid)
            if self.kv_checksums is not None:
                self.kv_checksums.forget(rid)
        self.failed.clear()

    def _publish_batch(self, rec, step: int, num_reqs: int, num_tokens: int) -> None:
        rec.set_batch(step, num_reqs, num_tokens, len(self._block_refs), self.num_kv_blocks)

    def _run(self, so: SchedulerOutput, rec) -> ModelRunnerOutput | None:
        self.check_kv_generations(so)
        inp = self._inputs = self.prepare_inputs(so)
        if not len(inp.input_ids):   # every scheduled request failed (on every rank alike): nothing to run
            return ModelRunnerOutput([], []) if self.info.is_output_rank else None
        hidden = residual = None
        if not self.info.is_first_stage:
            n, h = len(inp.input_ids), self.src.arch.hidden_size
            hidden, residual = collectives.pp_recv([(n, h), (n, h)], self.dtype, self.device)
        if rec is not None:
            rec.set_phase("forward")
        out = self.model(inp.input_ids, inp.positions, inp.meta, hidden, residual)
        if not self.info.is_last_stage:
            collectives.pp_send(list(out))
            return None
        prompt_logprobs = self._prompt_logprobs(inp, out) if inp.prompt_rows else []
        rows = out[inp.sample_token_index]
        for watch in self.head_watchers:
            watch(rows, inp)
        if self.info.is_output_rank and not self.digest_logits and self._all_greedy(inp.sample_req_ids):
            # Greedy rows need only each row's largest logit: where the kernels give it without the logits.
            tokens = self.model.greedy_tokens(rows)
            if tokens is not None:
                if rec is not None:
                    rec.set_phase("sample")
                try:
                    for w in self.step_watchers:
                        for rid in inp.sample_req_ids:
                            w.rows(rid, "sample")
                    return ModelRunnerOutput(inp.sample_req_ids, tokens.tolist(), None,
                                             prompt_logprobs=prompt_logprobs)
                except Exception:
                    pass   # a watcher failed a row: the logits' path below finds which
        logits = self.model.compute_logits(rows)
        if self.numerics is not None:
            self.numerics.logits(logits)
        if not self.info.is_output_rank:
            return None
        if rec is not None:
            rec.set_phase("sample")
        try:
            result = self._sample(inp.sample_req_ids, logits)
            result.prompt_logprobs = prompt_logprobs
            return result
        except Exception:
            # Sampling involves no other rank: find the rows that fail, sample the rest again without them.
            good = []
            for row, rid in enumerate(inp.sample_req_ids):
                try:
                    self._sample([rid], logits[row:row + 1])
                    good.append(row)
                except Exception as e:
                    self._fail_request(rid, "sampling", e)
            result = self._sample([inp.sample_req_ids[row] for row in good], logits[good])
            result.prompt_logprobs = [p for p in prompt_logprobs if p.req_id not in self.failed]
            return result

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor) -> list[PromptLogprobs]:
        """The logprobs of the prompt tokens this step's rows predict, for requests that asked for them. Every rank
        of the last stage computes the logits (under tp they are gathered), PROMPT_LOGITS_ROWS rows at a time so that
        a long prefill chunk never holds its whole [rows, vocab]; the output rank scores them."""
        result = []
        for rid, row, start, n in inp.prompt_rows:
            st = self.requests[rid]
            k = st.sampling.prompt_logprobs
            scored: list[TokenLogprobs] = []
            for first in range(0, n, PROMPT_LOGITS_ROWS):
                count = min(PROMPT_LOGITS_ROWS, n - first)
                logits = self.model.compute_logits(hidden[row + first:row + first + count])
                if not self.info.is_output_rank:
                    continue
                rows = torch.log_softmax(logits.float(), dim=-1)
                targets = torch.tensor(st.token_ids[start + first + 1:start + first + 1 + count], device=rows.device)
                chosen = rows.gather(1, targets.unsqueeze(1))
                ranks = ((rows > chosen).sum(dim=1) + 1).tolist()
                top = rows.topk(k) if k else None
                top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if k else ([[]] * count, [[]] * count)
                scored += [TokenLogprobs(lp, ids, values, rank) for lp, ids, values, rank in
                           zip(chosen.squeeze(1).tolist(), top_ids, top_values, ranks)]
            if self.info.is_output_rank:
                result.append(PromptLogprobs(rid, start + 1, scored))
        return result

    def _all_greedy(self, req_ids: list[str]) -> bool:
        for rid in req_ids:   # a loop, not all(generator): up to a few hundred rows a step
            sampling = self.requests[rid].sampling
            if sampling.temperature != 0.0 or sampling.logprobs is not None or sampling.changes_logits:
                return False
        return True

    def _sample(self, req_ids: list[str], logits: torch.Tensor) -> ModelRunnerOutput:
        for w in self.step_watchers:
            for rid in req_ids:
                w.rows(rid, "sample")
        states = [self.requests[r] for r in req_ids]
        raw = None
        if any(s.sampling.changes_logits for s in states):
            raw, logits = logits, logits.float().clone()
            biased: list[int] = []
            for row, s in enumerate(states):
                if s.sampling.changes_logits:
                    process_logits(logits[row], s.token_ids, len(s.token_ids) - s.num_prompt_tokens, s.sampling,
                                   s.eos_token_ids)
                if s.sampling.logit_bias:
                    if s.logit_bias is None:
                        s.logit_bias = LogitBias.of(s.sampling.logit_bias, logits.device)
                    biased.append(row)
            add_logit_bias(logits, biased, [states[row].logit_bias for row in biased])
        batch = SamplingBatch(
            temperatures=[s.sampling.temperature for s in states],
            top_ks=[s.sampling.top_k for s in states],
            top_ps=[s.sampling.top_p for s in states],
            seeds=[token_seed(s.sampling_seed, len(s.token_ids) - s.num_prompt_tokens) for s in states],
            num_logprobs=[s.sampling.logprobs for s in states])
        tokens, logprobs = sample(logits, batch, self.kernels.argmax, raw)
        # What goes back leaves the device once per tensor (.tolist()), never element by element: on a GPU
        # each element read would wait for the device on its own.
        token_list = tokens.tolist()
        lp_out = None if logprobs is None else _token_logprobs([s.sampling.logprobs for s in states], tokens, logprobs)
        digest = None
        if self.digest_logits:
            rows = (raw if raw is not None else logits).float()
            digest = [tuple(r) for r in torch.stack([rows.amax(dim=-1), torch.logsumexp(rows, dim=-1)], 1).tolist()]
        return ModelRunnerOutput(req_ids, token_list, lp_out, logits_digest=digest)


def _token_logprobs(num_logprobs: list[int | None], tokens: torch.Tensor,
                    logprobs: torch.Tensor) -> list[TokenLogprobs | None]:
    """Each row's sampled token's logprob and its top-k (k per row; None: the row asked for none)."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    k_max = max((k for k in num_logprobs if k), default=0)
    top_ids = top_values = None
    if k_max:
        top = logprobs.topk(k_max)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [None if k is None else TokenLogprobs(chosen[i], top_ids[i][:k] if k else [], top_values[i][:k] if k else [])
            for i, k in enumerate(num_logprobs)]
