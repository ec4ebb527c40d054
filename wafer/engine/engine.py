"""LLMEngine: add requests, step them together, read what each step produced.

Single-threaded by design: the server steps it on its event loop through AsyncEngine (the only
way the server, the router and the agents reach it), which calls `add`, `abort`, `step` and
`snapshot`; `generate` is the blocking convenience for scripts and tests.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from wafer.engine import defaults
from wafer.engine.constraints import Constraints, mask_logits
from wafer.engine.kv_cache import BLOCK, KV_DTYPES, KVCache, plan_blocks
from wafer.engine.pipeline import PipelineExecutor, StageError, StageFailure, StageSpec, measured_costs
from wafer.engine.runner import ModelRunner
from wafer.engine.sampler import Sampler, best, token_logprob
from wafer.engine.scheduler import MIN_CHUNK, ScheduledSeq, Scheduler
from wafer.engine.sequence import SamplingParams, Sequence, SequenceOutput, Status, TokenLogprob
from wafer.engine.speculative import (
    DraftLength,
    DraftModelProposer,
    NgramProposer,
    Proposer,
    SpeculativeConfig,
    SpecStats,
    rejection_sample,
)
from wafer.engine.step_cost import StepCosts, positions_of
from wafer.models.llama import LlamaModel
from wafer.models.loader import LoadedModel
from wafer.models.tokenizer import IncrementalDetokenizer

log = logging.getLogger("wafer.engine")


@dataclass
class EngineConfig:
    max_running: int = defaults.MAX_RUNNING
    max_model_len: int | None = None  # default: the model's context length
    # Bytes of KV the cache may hold (default: default_kv_budget(), or less when every running
    # sequence fits at max_model_len). The pool takes memory only as its blocks are first written.
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"  # f32, bf16, int8 or fp8 (scales per position and head); see kv_dtype()
    max_batched_tokens: int = defaults.MAX_BATCHED_TOKENS  # per step: decode tokens plus prefill chunks
    prefix_caching: bool = True  # reuse the KV of earlier requests' shared prompt prefixes
    # Seconds of prompt work a step may take (None: no limit). The server sets it so that one
    # request's long prompt delays the others' tokens, and its own loop, by a bounded time.
    prefill_step_seconds: float | None = None
    seed: int | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Stages the model's layers run in (pipeline.py): 1 is this process alone.
    pipeline_parallel: int = 1
    # Seconds a step may take through the stages before the pipeline counts as broken.
    pipeline_timeout: float = 120.0
    # Where rank 0's store listens for the stages; spawn: this process starts them (else torchrun).
    pipeline_host: str = "127.0.0.1"
    pipeline_port: int | None = None
    pipeline_spawn: bool = True


def kv_dtype(name: str, loaded: LoadedModel) -> torch.dtype:
    """The KV cache's element type. `auto`: bfloat16 on the CPU's quantised paths (q4, q8, int8),
    where it measured as fast as float32 at short contexts and faster at long ones (1.28x at 2,048
    tokens, 1.77x at 8,128), for half the memory and no loss (perplexity 0.9982x f32 KV's over 2,048
    tokens); int8 is faster still but costs 0.4%, so it is asked for, not chosen. Elsewhere the
    model's activation dtype: the f32 path stays the exact reference, and a GPU model's is bf16."""
    activations = loaded.model.norm.weight.dtype
    if name == "auto":
        if activations == torch.float32 and loaded.compute in ("q4", "q8", "int8"):
            return torch.bfloat16
        return activations
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_DTYPES)}, not {name!r}")
    if name == "fp8" and loaded.model.norm.weight.device.type == "cpu" and loaded.compute in ("q4", "q8"):
        # The fused step reads f32, bf16 and int8 rows; fp8 is for GPUs (as vLLM offers it), where
        # it halves bf16's bytes, and runs on the CPU's Python paths too.
        raise ValueError(f"kv_cache_dtype fp8 runs on CUDA and on the CPU's f32 and int8 paths, not with this "
                         f"model's {loaded.compute} path on the CPU (its fused step reads f32, bf16 or int8 KV: "
                         "use int8 for a quarter of f32's bytes)")
    return KV_DTYPES[name]


def default_kv_budget() -> int:
    """A quarter of the machine's memory: room for the weights, the other models of a server, and
    the rest of the system (vLLM takes a share of the GPU's memory the same way)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@dataclass
class EngineStats:
    steps: int = 0
    batched_steps: int = 0  # steps that advanced more than one sequence
    prompt_tokens: int = 0
    generated_tokens: int = 0
    last_batch_size: int = 0  # sequences advanced by the most recent step
    last_forward_seconds: float = 0.0  # of the most recent step: scheduling and the forward pass, before its tokens are picked
    last_mask_seconds: float = 0.0  # of the most recent step: its grammars' masks, part of picking the tokens
    max_batch_size: int = 0  # the most sequences one step has advanced
    spec: SpecStats = field(default_factory=SpecStats)


@dataclass(frozen=True)
class EngineSnapshot:
    """What an engine says of itself at one moment: all that the server's metrics and health read."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV blocks live sequences hold
    kv_peak_usage: float
    kv_capacity_bytes: int
    kv_written_bytes: int  # of the blocks written at least once (kv_cache.KVCache.written_bytes)
    prefix_hit_rate: float
    last_batch_size: int
    num_preemptions: int
    spec: SpecStats
    fault: str | None = None  # why the engine cannot serve now (a pipeline stage is down), if it cannot
    pipeline: dict | None = None  # stages, restarts and transfer time, with pipeline stages


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 draft: LoadedModel | None = None) -> None:
        """`draft`: the proposing model when `config.speculative.method` is "draft"."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        ctx = loaded.config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or ctx, ctx)
        self.kv_dtype = kv_dtype(self.config.kv_cache_dtype, loaded)
        budget = self.config.kv_cache_memory or default_kv_budget()
        # The most tokens a sequence computes in a step (a prompt chunk, a verified draft) sizes
        # what layers with a window hold.
        self.max_step = max(self.config.max_batched_tokens, self.config.speculative.num_tokens + 1)
        num_blocks, self.window_pool = plan_blocks(loaded.config, self.kv_dtype, self.config.max_running,
                                                   self.max_model_len, budget, self.max_step)
        # One sequence must always fit, so that preemption can always make progress.
        self.max_model_len = min(self.max_model_len, num_blocks * BLOCK)
        self.kv = KVCache.for_model(loaded.model, self.config.max_running, self.max_model_len, num_blocks,
                                    self.kv_dtype, self.max_step, self.window_pool)
        self.scheduler = Scheduler(self.kv, self.config.max_running, self.config.max_batched_tokens,
                                   self.config.prefix_caching)
        self.pipeline: PipelineExecutor | None = None
        self._in_flight: deque[_Flight] = deque()
        self.sampler = Sampler(self.config.seed)
        self.stats = EngineStats()
        self.seqs: dict[int, Sequence] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self.constraints = Constraints(self.tokenizer)
        self.proposer = self._make_proposer(draft)
        # Prompt lookup needs no model, so a request may ask for it (`prompt_lookup`) where the engine
        # does not speculate; not through stages, whose buffers are sized without drafts.
        self.lookup_on_request = self._lookup_on_request(self.config)
        if self.lookup_on_request:
            self.proposer = NgramProposer(self.config.speculative)
        # Last: the stages are processes, which nothing would stop if a later part of this raised.
        if self.config.pipeline_parallel > 1:
            self.pipeline = self._make_pipeline(loaded, num_blocks)
        self.runner = self.pipeline.runner if self.pipeline is not None else ModelRunner(loaded.model, self.kv)
        spec = self.config.speculative
        # Lookup asked for by a request always chooses its length: where it does not pay it goes quiet.
        adaptive = (spec.enabled and spec.adaptive) or self.lookup_on_request
        if adaptive and self.pipeline is not None:
            log.info("pipeline stages: speculation proposes a fixed %d tokens (adaptive lengths measure whole "
                     "steps, which stages overlap)", spec.num_tokens)
        self.draft_length = DraftLength(spec.num_tokens) if adaptive and self.pipeline is None else None
        self._step_k: int | None = None  # the draft length this step was given, when DraftLength chose it
        self._kept = False  # the last step verified drafts and kept every one whole: DraftLength's context
        self.step_cost = StepCosts()  # what a step's tokens cost, learned from its prompt steps (step_cost.py)

    @staticmethod
    def _lookup_on_request(config: EngineConfig) -> bool:
        return not config.speculative.enabled and config.pipeline_parallel == 1

    def _make_proposer(self, draft: LoadedModel | None) -> Proposer | None:
        spec = self.config.speculative
        if spec.method == "ngram":
            return NgramProposer(spec)
        if spec.method != "draft":
            return None
        if draft is None:
            raise ValueError("speculative method 'draft' needs a draft model")
        if (draft.tokenizer.tokenizer.get_vocab() != self.tokenizer.tokenizer.get_vocab()
                or draft.config.vocab_size != self.loaded.config.vocab_size):
            raise ValueError(f"draft model {draft.name} cannot propose for {self.loaded.name}: their tokenizers "
                             "differ (speculative decoding needs the same vocabulary)")
        return DraftModelProposer(draft.model, self.kv.num_slots, self.max_model_len, self.config.seed)

    def _make_pipeline(self, loaded: LoadedModel, num_blocks: int) -> PipelineExecutor:
        """Split the model's layers among the stages, keep the first range here, and start the rest."""
        from wafer.models.stage import keep_stage, layer_costs, split_layers

        cfg = self.config
        model = loaded.model
        if not isinstance(model, LlamaModel) or model.rotary.cos.device.type != "cpu" or loaded.path.is_dir():
            raise ValueError("pipeline stages run Llama-family GGUF models on the CPU")
        # The machine's cores, shared among the stages it starts: each process computes on its share.
        # (Stages that torchrun starts on other machines take their own machine's, and rank 0 keeps its.)
        threads = max(1, len(os.sched_getaffinity(0)) // cfg.pipeline_parallel) if cfg.pipeline_spawn else 0
        # Contiguous layer ranges of equal cost, measured on a stage's threads where the fused step
        # runs (else by the bytes of weights each layer reads).
        costs = measured_costs(model, self.kv_dtype, threads or torch.get_num_threads()) or layer_costs(model)
        ranges = split_layers(*costs, cfg.pipeline_parallel)
        # Receive buffers that hold a whole step of max_batched_tokens (drafts included) and its
        # logits at max_running rows; a larger message goes in two transfers.
        drafts = cfg.max_running * cfg.speculative.num_tokens if cfg.speculative.method != "off" else 0
        hidden_bytes = (cfg.max_batched_tokens + drafts) * model.config.hidden_size * 4
        spec = StageSpec(str(loaded.path), loaded.compute, ranges, self.kv_dtype, self.kv.num_slots,
                         self.max_model_len, num_blocks, threads, self.max_step, self.window_pool,
                         step_capacity=2 * hidden_bytes + (1 << 16),
                         logits_capacity=cfg.max_running * model.config.vocab_size * 4 + (1 << 12))
        keep_stage(model, *ranges[0])
        self._threads_before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        log.info("pipeline of %d stages, layers %s", cfg.pipeline_parallel, ranges)
        return PipelineExecutor(ModelRunner(model, self.kv), spec, cfg.pipeline_parallel, cfg.pipeline_host,
                                cfg.pipeline_port, cfg.pipeline_spawn, cfg.pipeline_timeout)

    def close(self) -> None:
        """Stop the pipeline's stages, if any."""
        if self.pipeline is not None:
            self.pipeline.close()
            torch.set_num_threads(self._threads_before)

    def snapshot(self) -> EngineSnapshot:
        kv = self.kv
        pipe = self.pipeline
        info = None
        if pipe is not None:
            info = {"stages": pipe.world, "layers": pipe.spec.ranges, "restarts": pipe.restarts,
                    "transfer_seconds": round(pipe.transfer_seconds, 3), "stage_pids": pipe.stage_pids()}
        return EngineSnapshot(len(self.scheduler.running), len(self.scheduler.waiting), kv.usage, kv.peak_usage,
                              kv.capacity_bytes, kv.written_bytes, kv.prefix_hit_rate, self.stats.last_batch_size,
                              self.scheduler.num_preemptions, copy.deepcopy(self.stats.spec),
                              pipe.fault if pipe is not None and not pipe.ready else None, info)

    # --- requests -------------------------------------------------------------------------
    def check(self, prompt_ids: list[int]) -> None:
        """Raises ValueError for a prompt this engine cannot take, whatever its load."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_model_len}")

    def add(self, prompt_ids: list[int], params: SamplingParams, arrival_time: float | None = None) -> Sequence:
        self.check(prompt_ids)
        seq = Sequence(list(prompt_ids), params)
        if params.compiled is not None:
            seq.matcher = params.compiled.deep_copy()
        elif params.grammar is not None:
            seq.matcher = self.constraints.matcher(params.grammar)  # GrammarError is a ValueError
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.seqs[seq.seq_id] = seq
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq_id: int) -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.seqs.pop(seq.seq_id, None)
        self._detok.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the step ---------------------------------------------------------------------------
    # In inference mode, as the server steps: the logits are inference tensors (the forward pass makes
    # them so), and a grammar's mask changes them in place, which torch refuses outside the mode.
    @torch.inference_mode()
    def step(self) -> list[SequenceOutput]:
        """One forward pass over the scheduled sequences and a token (or several) for each: schedule,
        run, process the outputs. A failure that belongs to one sequence (its sampling parameters,
        its grammar, its forward rows) ends that sequence alone, with finish_reason "error"; the
        others go on."""
        if self.pipeline is not None:
            return self._step_pipelined()
        started = time.perf_counter()
        generated = self.stats.generated_tokens
        scheduled = self._schedule()
        if not scheduled:
            return []
        # A step of decoding alone tells what its draft length yields; prompt work, or a draft model
        # catching up on tokens decoded without it (a cost of switching lengths, not of one), would blur it.
        measured = self._step_k is not None and all(item.samples and item.count == 1 + len(item.draft)
                                                    and item.start >= item.seq.num_prompt for item in scheduled)
        failed: list[SequenceOutput] = []
        scheduled, logits = self._forward(scheduled, failed)
        if not scheduled:
            return failed
        self._draft_follows_prompt(scheduled)
        kept_before, spec = self._kept, self.stats.spec
        drafted, accepted = spec.draft_tokens, spec.accepted_tokens
        outputs = self._process(scheduled, logits, failed, time.perf_counter() - started)
        if self.draft_length is not None:
            self._kept = spec.draft_tokens > drafted and spec.accepted_tokens - accepted == spec.draft_tokens - drafted
        if measured:
            catch_up = self.proposer.catch_up_seconds if isinstance(self.proposer, DraftModelProposer) else 0.0
            self.draft_length.record(self._step_k, self.stats.generated_tokens - generated,  # type: ignore[union-attr, arg-type]
                                     time.perf_counter() - started - catch_up, len(scheduled), kept_before)
        return outputs

    # --- the step through pipeline stages ---------------------------------------------------------
    def _step_pipelined(self) -> list[SequenceOutput]:
        """Fill the pipeline with up to one step per stage, each over other sequences, then process
        the oldest step's logits. A step that raised on a stage is run again one sequence at a time;
        a stage that is gone fails every running sequence (their KV is lost with it) and the stages
        are started again, while the waiting requests wait."""
        pipe = self.pipeline
        assert pipe is not None
        failed: list[SequenceOutput] = []
        if not pipe.ready:  # the stages are starting again: the waiting requests wait
            pipe.retry()
            time.sleep(0.01)
            return failed
        try:
            pipe.check()
            while len(self._in_flight) < pipe.depth:
                busy = {item.seq.seq_id for flight in self._in_flight for item in flight.scheduled}
                share = -(-max(len(self.scheduler.running) + len(self.scheduler.waiting), 1) // pipe.depth)
                scheduled = self._schedule(busy, share)
                if not scheduled:
                    break
                self._submit(scheduled, failed)
            if not self._in_flight:
                return failed
            flight = self._in_flight.popleft()
            try:
                logits = pipe.result()
            except StageError as e:
                self._run_alone(flight.scheduled, e, failed)
                return failed
        except StageFailure as e:
            self._pipeline_failed(e, failed)
            return failed
        return self._process(flight.scheduled, logits, failed, time.perf_counter() - flight.started)

    def _submit(self, scheduled: list[ScheduledSeq], failed: list[SequenceOutput]) -> None:
        step = self.runner.prepare(scheduled)
        step.argmax_only = all(_argmax_only(item.seq) for item in scheduled if item.samples)
        try:
            self.pipeline.submit(step)  # type: ignore[union-attr]
        except StageError as e:
            self._run_alone(scheduled, e, failed)
            return
        self._in_flight.append(_Flight(scheduled, time.perf_counter()))

    def _run_alone(self, scheduled: list[ScheduledSeq], error: Exception, failed: list[SequenceOutput]) -> None:
        """A step that raised: each of its sequences goes again on its own (writing its KV again, to
        the same places); one that fails alone is failed."""
        live = [item for item in scheduled if not item.seq.finished]
        if len(scheduled) == 1:
            for item in live:
                self._fail(item.seq, error, failed)
            return
        log.error("a pipelined step of %d sequences failed (%s); running them one by one", len(scheduled), error)
        for item in live:
            self._submit([item], failed)

    def _pipeline_failed(self, error: StageFailure, failed: list[SequenceOutput]) -> None:
        log.error("%s; failing %d running sequences and restarting the stages", error, len(self.scheduler.running))
        self._in_flight.clear()
        for seq in list(self.scheduler.running):
            self._fail(seq, error, failed)
        self.kv.forget_prefixes()
        self.pipeline.restart()  # type: ignore[union-attr]

    def _schedule(self, busy: frozenset[int] | set[int] = frozenset(), max_seqs: int | None = None
                  ) -> list[ScheduledSeq]:
        """The sequences of this step, with their drafts to verify where speculation is on."""
        cap, per_position = self._prefill_cap()
        if cap is not None:  # the drafts' rows come after the prompt chunks are chosen: room for them
            cap = max(MIN_CHUNK, int(cap - self._draft_reserve(per_position)))
        scheduled = self.scheduler.schedule(cap, busy, max_seqs, per_position)
        for seq in self.scheduler.preempted:  # recomputed later from its tokens: the draft's KV goes too
            if self.proposer is not None:
                self.proposer.release(seq.seq_id)
        self.scheduler.preempted.clear()
        self._step_k = None
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.catch_up_seconds = 0.0
        if scheduled and self._speculating:
            try:
                self._attach_drafts(scheduled)
            except Exception:  # speculation is an optimisation: this step goes without it
                log.exception("proposing drafts failed; this step decodes without them")
                self._step_k = None  # and says nothing of what its length yields
                for item in scheduled:
                    if item.draft:
                        item.count -= len(item.draft)
                        item.rows, item.draft, item.draft_probs = 1, [], None
        return scheduled

    def _process(self, scheduled: list[ScheduledSeq], logits: torch.Tensor, outputs: list[SequenceOutput],
                 seconds: float) -> list[SequenceOutput]:
        """The step's bookkeeping, then a token for each sequence that reached its end (verified drafts
        give several); `outputs` already holds the sequences the forward pass failed."""
        self.stats.steps += 1
        self.stats.last_batch_size = len(scheduled)
        self.stats.last_forward_seconds = seconds
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(scheduled))
        if len(scheduled) > 1:
            self.stats.batched_steps += 1
        self.constraints.new_step()
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        verifying: list[tuple[ScheduledSeq, int]] = []
        row = 0
        for item in scheduled:
            seq = item.seq
            if seq.finished:  # aborted while its step was in flight (pipeline stages)
                row += item.rows if item.samples else 0
                continue
            if item.samples:
                if item.draft:
                    verifying.append((item, row))
                else:
                    plain.append(item.seq)
                    plain_rows.append(row)
                row += item.rows
            seq.num_cached = item.start + item.count - len(item.draft)
            self.kv.set_length(seq.slot, seq.num_cached)  # type: ignore[arg-type]
            if item.start < seq.num_prompt:
                self.stats.prompt_tokens += min(item.count, seq.num_prompt - item.start)
        self._time_prefill(scheduled, seconds)
        self.stats.last_mask_seconds = 0.0
        if plain:
            rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
            constrained = [(i, seq) for i, seq in enumerate(plain) if seq.matcher is not None]
            if constrained:
                masking = time.perf_counter()
                for i, seq in constrained:
                    self._guard(seq, outputs, mask_logits, rows[i], seq.matcher,  # type: ignore[arg-type]
                                seq.params.max_tokens - (len(seq.tokens) - seq.num_prompt))
                self.stats.last_mask_seconds = time.perf_counter() - masking
            for seq, token, lp in self._sample(rows, plain, outputs):
                if (out := self._guard(seq, outputs, self._append, seq, token, lp)) is not None:
                    outputs.append(out)
        for item, row in verifying:
            if (out := self._guard(item.seq, outputs, self._verify, item, logits[row : row + item.rows])) is not None:
                outputs.append(out)
        return outputs

    # --- how much prompt a step may take ----------------------------------------------------------
    def _draft_reserve(self, per_position: float) -> float:
        """The prompt work (tokens at position 0) that the drafts this step may verify could cost:
        K rows for each decoder that may draft, each at its position. A step's length bounds every
        stream's wait, and the drafts, attached after the prompt chunks are chosen, would add to it
        (as in vLLM, where speculated tokens count against the step's token budget)."""
        if not self._speculating:
            return 0.0
        k = self.config.speculative.num_tokens
        return sum(k * (1.0 + per_position * len(seq.tokens)) for seq in self.scheduler.running
                   if len(seq.tokens) - seq.num_cached == 1 and self._wants_drafts(seq))

    def _prefill_cap(self) -> tuple[int | None, float]:
        """The prompt work a step may take, in tokens at position 0, and what a position adds to a
        token's cost in those (the scheduler's prefill_cap and per_position); no cap before a prompt
        step has been timed."""
        fit = self.step_cost.coefficients(torch.get_num_threads())
        if self.config.prefill_step_seconds is None or fit is None:
            return None, 0.0
        a, b = fit
        return max(MIN_CHUNK, int(self.config.prefill_step_seconds * torch.get_num_threads() / a)), b / a

    def _time_prefill(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """Learn the cost of a token from steps of some prompt work (step_cost.py)."""
        prompt = sum(max(0, min(item.count, item.seq.num_prompt - item.start)) for item in scheduled)
        if prompt >= MIN_CHUNK:
            self.step_cost.observe(torch.get_num_threads(), sum(item.count for item in scheduled),
                                   sum(positions_of(item.start, item.count) for item in scheduled),
                                   seconds * torch.get_num_threads())

    # --- failures of one sequence -----------------------------------------------------------------
    def _forward(self, scheduled: list[ScheduledSeq], failed: list[SequenceOutput]
                 ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """The model's logits for the scheduled sequences. Should the batch fail, each sequence is
        run alone (writing its KV again, to the same places) and those that fail alone are failed."""
        try:
            return scheduled, self.runner.run(scheduled)
        except Exception as e:
            if len(scheduled) == 1:
                self._fail(scheduled[0].seq, e, failed)
                return [], torch.empty(0)
            log.exception("a batched step of %d sequences failed; running them one by one", len(scheduled))
        kept, parts = [], []
        for item in scheduled:
            try:
                parts.append(self.runner.run([item]))
                kept.append(item)
            except Exception as e:
                self._fail(item.seq, e, failed)
        return kept, (torch.cat(parts) if parts else torch.empty(0))

    def _sample(self, rows: torch.Tensor, seqs: list[Sequence], failed: list[SequenceOutput]
                ) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """A token for each live row, in one batched call; row by row if that call fails."""
        live = [i for i, seq in enumerate(seqs) if not seq.finished]
        if len(live) == len(seqs):
            try:
                tokens, lps = self.sampler(rows, seqs)
                return list(zip(seqs, tokens, lps))
            except Exception:
                log.exception("batched sampling failed; sampling row by row")
        out = []
        for i in live:
            try:
                tokens, lps = self.sampler(rows[i : i + 1], [seqs[i]])
                out.append((seqs[i], tokens[0], lps[0]))
            except Exception as e:
                self._fail(seqs[i], e, failed)
        return out

    def _guard(self, seq: Sequence, failed: list[SequenceOutput], fn, *args):  # type: ignore[no-untyped-def]
        """fn(*args), or None with `seq` failed alone if it raises (or had failed already)."""
        if seq.finished:
            return None
        try:
            return fn(*args)
        except Exception as e:
            self._fail(seq, e, failed)
            return None

    def _fail(self, seq: Sequence, error: Exception, failed: list[SequenceOutput]) -> None:
        log.error("sequence %d failed in the step and ends alone: %r", seq.seq_id, error, exc_info=error)
        if not seq.finished:
            seq.finish_reason = "error"
            self._release(seq)
        failed.append(SequenceOutput(seq.seq_id, [], "", True, "error", [], seq.num_prompt,
                                     len(seq.tokens) - seq.num_prompt, seq.num_cached_prompt,
                                     error=f"{type(error).__name__}: {error}"))

    # --- speculative decoding -------------------------------------------------------------------
    def _draft_follows_prompt(self, scheduled: list[ScheduledSeq]) -> None:
        if not isinstance(self.proposer, DraftModelProposer):
            return
        # Only sequences that may speculate: not under a grammar, not a single token, and not while
        # more run than speculate (they catch up at their first proposal, if one comes).
        if not self._speculating:
            return
        prompt = [item for item in scheduled if item.start < item.seq.num_prompt and not item.seq.finished
                  and item.seq.matcher is None and item.seq.params.max_tokens > 1]
        try:
            self.proposer.follow_prompt(prompt)
        except Exception:  # an optimisation: the first proposal catches up instead
            log.exception("the draft model failed on a prompt chunk; it catches up when it next proposes")
            for item in prompt:
                self.proposer.release(item.seq.seq_id)

    @property
    def _speculating(self) -> bool:
        """Whether this step may propose drafts: a proposer, and no more sequences running than speculate."""
        return self.proposer is not None and len(self.scheduler.running) <= self.config.speculative.max_running

    def _wants_drafts(self, seq: Sequence) -> bool:
        """Not under a grammar; where the engine does not speculate, only if the request asked."""
        return seq.matcher is None and (not self.lookup_on_request or seq.params.prompt_lookup)

    def _may_draft(self, item: ScheduledSeq) -> bool:
        return item.count == 1 and item.samples and self._wants_drafts(item.seq)

    def _attach_drafts(self, scheduled: list[ScheduledSeq]) -> None:
        """Give each decoding sequence that may speculate a proposal to verify in this step."""
        if not any(self._may_draft(item) for item in scheduled):
            return  # prompt work alone, or none asked for drafts: nothing to propose, no length to choose
        k = self.config.speculative.num_tokens
        if self.draft_length is not None:
            k = self._step_k = self.draft_length.choose(len(scheduled), self._kept)
            if k == 0:
                return
        items, limits = [], []
        for item in scheduled:
            seq = item.seq
            if not self._may_draft(item):
                continue
            # No point proposing past max_tokens or the context: the last token is the target's own.
            room = min(k, seq.params.max_tokens - (len(seq.tokens) - seq.num_prompt) - 1,
                       self.max_model_len - len(seq.tokens) - 1)
            # Drafts only take blocks that are free: they never preempt anyone.
            end = seq.num_cached + 1
            room = min(room, self.kv.room(seq.slot, end + max(room, 0)) - end)  # type: ignore[arg-type]
            if room > 0:
                self.kv.reserve(seq.slot, end + room)  # type: ignore[arg-type]
                items.append(item)
                limits.append(room)
        if not items:
            return
        for item, draft in zip(items, self.proposer.propose([i.seq for i in items], limits)):  # type: ignore[union-attr]
            if draft.tokens:
                item.draft, item.draft_probs = draft.tokens, draft.probs
                item.count += len(draft.tokens)
                item.rows = 1 + len(draft.tokens)

    def _verify(self, item: ScheduledSeq, rows: torch.Tensor) -> SequenceOutput:
        """Turn the target's logits over [last token, draft...] into 1 to len(draft)+1 tokens."""
        seq, draft = item.seq, item.draft
        p = seq.params
        start_len = len(seq.tokens)
        q = item.draft_probs
        raw_lp = torch.log_softmax(rows, dim=-1) if p.logprobs is not None else None
        fast = p.greedy and not p.needs_processing
        argmax = best(rows).tolist() if fast else []
        outs: list[SequenceOutput] = []
        accepted = 0
        for i in range(len(draft) + 1):
            proposed = draft[i] if i < len(draft) else None
            if fast:
                token = argmax[i]
            elif p.greedy or proposed is None:  # greedy keeps a draft only if it is the argmax anyway
                token = self.sampler.sample_row(rows[i], seq)
            else:
                token, _ = rejection_sample(self.sampler.processed(rows[i], seq), proposed,
                                            q[i] if q is not None else None,  # type: ignore[index]
                                            self.sampler.generator_for(seq))
            # KV holds the sequence's last token and the draft tokens accepted so far.
            seq.num_cached = start_len + i
            lp = token_logprob(raw_lp[i], token, p.logprobs) if raw_lp is not None else None  # type: ignore[arg-type]
            outs.append(self._append(seq, token, lp))
            if token != proposed or seq.finished:
                break
            accepted += 1
        self.stats.spec.record(len(draft), accepted)
        if not seq.finished:
            self.kv.set_length(seq.slot, seq.num_cached)  # type: ignore[arg-type]
            self.proposer.verified(seq, start_len, accepted, len(draft))  # type: ignore[union-attr]
        return _merge(outs)

    def _append(self, seq: Sequence, token: int, lp) -> SequenceOutput:  # type: ignore[no-untyped-def]
        p = seq.params
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        if lp is not None:
            seq.logprobs.append(lp)
        n_out = len(seq.tokens) - seq.num_prompt
        detok = self._detok[seq.seq_id]
        is_eos = token in self.tokenizer.eos_ids and not p.ignore_eos
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
        if is_eos or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        else:
            before = len(seq.text)
            seq.text += detok.push(token)
            if p.stop:
                self._check_stop_strings(seq, before)
        if seq.finish_reason is None and seq.matcher is not None and seq.matcher.is_stopped():
            seq.finish_reason = "stop"  # the grammar is complete: only end-of-sequence could follow
        if seq.finish_reason is None and (n_out >= p.max_tokens or len(seq.tokens) >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if seq.finish_reason == "length":
                seq.text += detok.flush()
            self._release(seq)
            end = len(seq.text)
        else:
            # Hold back what could still turn out to be the start of a stop string.
            hold = max((len(s) for s in p.stop), default=1) - 1
            end = max(seq.emitted, len(seq.text) - hold)
        delta = seq.text[seq.emitted : end]
        seq.emitted = end
        return SequenceOutput(
            seq_id=seq.seq_id,
            new_token_ids=[token],
            text=delta,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            logprobs=[lp] if lp is not None else [],
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=n_out,
            num_cached_tokens=seq.num_cached_prompt,
            queue_time=(seq.first_scheduled_time - seq.arrival_time) if seq.first_scheduled_time else None,
        )

    def _check_stop_strings(self, seq: Sequence, before: int) -> None:
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, before - longest + 1)
        hits = [(i, s) for s in seq.params.stop if (i := seq.text.find(s, search_from)) >= 0]
        if hits:
            i, s = min(hits)
            seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
            seq.finish_reason = "stop"

    # --- blocking convenience -----------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion together; sequences come back in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(p, sp) for p, sp in zip(prompts, plist)]
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        return seqs

    @torch.inference_mode()
    def warmup(self) -> None:
        """Before the first request rather than under it: a first step (kernels, thread pools, first
        allocations), and the grammar engine's view of the vocabulary (half a second to build,
        holding the GIL, which would stall every stream under the first request with a schema)."""
        self.generate([[self.tokenizer.bos_id or 0] * 4], SamplingParams(max_tokens=2, temperature=0))
        self.constraints.llt  # noqa: B018 (built on first use)


def _argmax_only(seq: Sequence) -> bool:
    """Whether this sequence's next tokens are its logits' argmax and nothing else of them is read."""
    p = seq.params
    return p.greedy and not p.needs_processing and p.logprobs is None and seq.matcher is None


@dataclass
class _Flight:
    """A step sent through the pipeline stages, whose logits have not come back yet."""

    scheduled: list[ScheduledSeq]
    started: float


def _merge(outs: list[SequenceOutput]) -> SequenceOutput:
    """One step's output for a sequence that gained several tokens."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    return SequenceOutput(
        seq_id=last.seq_id,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        text="".join(o.text for o in outs),
        finished=last.finished,
        finish_reason=last.finish_reason,
        logprobs=[lp for o in outs for lp in o.logprobs],
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        queue_time=outs[0].queue_time,
    )
