"""LLMEngine: add requests, step them together, read what each step produced.

Single-threaded by design: the server steps it on its event loop through AsyncEngine (the only
way the server, the router and the agents reach it), which calls `add`, `abort`, `step` and
`snapshot`; `generate` is the blocking convenience for scripts and tests.

A step is the work of its parts: the scheduler picks the sequences and their tokens (blocks from
the block manager, prompt work within the prompt budget), the speculator attaches drafts, the
executor runs the forward pass (here, or through pipeline stages), and the sampler, the speculator's
verification and the output processor turn the logits into tokens and text.
"""

from __future__ import annotations

import logging
import time

import torch

from wafer.engine.config import EngineConfig
from wafer.engine.constraints import Constraints
from wafer.engine.executor import Executor, LocalExecutor
from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import BLOCK, default_kv_budget, kv_dtype, plan_blocks
from wafer.engine.model_runner import ModelRunner
from wafer.engine.output_processor import OutputProcessor, failed_output
from wafer.engine.pipeline.executor import PipelineExecutor
from wafer.engine.pipeline.launch import start_pipeline
from wafer.engine.pipeline.spec import StageFailure
from wafer.engine.background_pace import BackgroundPace
from wafer.engine.prompt_budget import PromptBudget
from wafer.engine.sampler import Sampler
from wafer.engine.scheduler import MIN_CHUNK, ScheduledSeq, Scheduler
from wafer.engine.sequence import SamplingParams, Sequence, SequenceOutput, Status
from wafer.engine.speculative.speculator import Speculator, StepMark, lookup_on_request, make_proposer
from wafer.engine.stats import EngineSnapshot, EngineStats
from wafer.engine.token_picker import TokenPicker
from wafer.models.loader import LoadedModel

log = logging.getLogger("wafer.engine")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 draft: LoadedModel | None = None) -> None:
        """`draft`: the proposing model when `config.speculative.method` is "draft"."""
        self.loaded = loaded
        self.config = cfg = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        ctx = loaded.config.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or ctx, ctx)
        self.kv_dtype = kv_dtype(cfg.kv_cache_dtype, loaded)
        budget = cfg.kv_cache_memory or default_kv_budget()
        # The most tokens a sequence computes in a step (a prompt chunk, a verified draft) sizes
        # what layers with a window hold.
        self.max_step = max(cfg.max_batched_tokens, cfg.speculative.num_tokens + 1)
        num_blocks, self.window_pool = plan_blocks(loaded.config, self.kv_dtype, cfg.max_running,
                                                   self.max_model_len, budget, self.max_step)
        # One sequence must always fit, so that preemption can always make progress.
        self.max_model_len = min(self.max_model_len, num_blocks * BLOCK)
        self.kv = KVCache.for_model(loaded.model, cfg.max_running, self.max_model_len, num_blocks,
                                    self.kv_dtype, self.max_step, self.window_pool)
        self.blocks = self.kv.blocks
        self.scheduler = Scheduler(self.blocks, cfg.max_running, cfg.max_batched_tokens, cfg.prefix_caching)
        self.budget = PromptBudget(cfg.prefill_step_seconds)
        self.pace = BackgroundPace()  # batch decoders a step takes beside interactive work
        self.sampler = Sampler(cfg.seed)
        self.stats = EngineStats()
        self.seqs: dict[int, Sequence] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.stats, self._release)
        self.constraints = Constraints(self.tokenizer)
        on_request = lookup_on_request(cfg.speculative, cfg.pipeline_parallel)
        proposer = make_proposer(cfg.speculative, loaded, draft, on_request, self.blocks.num_slots,
                                 self.max_model_len, cfg.seed)
        self.speculator = Speculator(cfg.speculative, proposer, on_request, self.blocks, self.max_model_len,
                                     self.stats.spec, cfg.pipeline_parallel > 1,
                                     self.kv if cfg.pipeline_parallel == 1 else None)
        self.picker = TokenPicker(self.sampler, self.speculator, self.outputs, self.stats, self._fail,
                                  cfg.grammar_seconds_per_token)
        # Last: the stages are processes, which nothing would stop if a later part of this raised.
        self.executor: Executor
        self.pipeline: PipelineExecutor | None = None
        if cfg.pipeline_parallel > 1:
            steps = start_pipeline(loaded, cfg, self.kv, self.max_model_len, num_blocks, self.max_step,
                                   self.window_pool, self._fail)
            self.executor, self.pipeline, self.runner = steps, steps.pipe, steps.pipe.runner
        else:
            self.runner = ModelRunner(loaded.model, self.kv)
            self.executor = LocalExecutor(self.runner, self._fail)

    def close(self) -> None:
        """Stop the pipeline's stages, if any."""
        self.executor.close()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.of(self.scheduler, self.blocks, self.stats, self.pipeline)

    # --- requests -------------------------------------------------------------------------
    def check(self, prompt_ids: list[int]) -> None:
        """Raises ValueError for a prompt this engine cannot take, whatever its load."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_model_len}")

    def add(self, prompt_ids: list[int], params: SamplingParams, arrival_time: float | None = None,
            background: bool = False) -> Sequence:
        """`background`: batch work, which runs only where interactive sequences leave room."""
        self.check(prompt_ids)
        seq = Sequence(list(prompt_ids), params, background=background)
        if params.compiled is not None:
            seq.matcher = params.compiled.deep_copy()
        elif params.grammar is not None:
            seq.matcher = self.constraints.matcher(params.grammar)  # GrammarError is a ValueError
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.seqs[seq.seq_id] = seq
        self.outputs.add(seq)
        self.scheduler.add(seq)
        if not background:
            self.pace.interactive()
        return seq

    def abort(self, seq_id: int) -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.seqs.pop(seq.seq_id, None)
        self.outputs.drop(seq.seq_id)
        self.speculator.release(seq.seq_id, seq)

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
        """Send steps while the executor has room (one here; one per stage through pipeline stages,
        each over other sequences), then process the oldest one's logits: a token (or several) for
        each of its sequences. A failure that belongs to one sequence (its sampling parameters, its
        grammar, its forward rows) ends that sequence alone, with finish_reason "error"; the others
        go on. A stage that is gone fails every running sequence, and the stages start again while
        the waiting requests wait."""
        failed: list[SequenceOutput] = []
        executor = self.executor
        if not executor.ready:  # the stages are starting again: the waiting requests wait
            executor.retry()
            time.sleep(0.01)
            return failed
        started, generated = time.perf_counter(), self.stats.generated_tokens
        mark: StepMark | None = None
        try:
            executor.check()
            while len(executor.in_flight) < executor.depth:
                busy = {item.seq.seq_id for flight in executor.in_flight for item in flight.scheduled}
                # Steps in flight at once share the sequences among them.
                share = -(-max(self.num_running + self.num_waiting, 1) // executor.depth) if executor.depth > 1 else None
                scheduled = self._schedule(busy, share)
                if not scheduled:
                    break
                mark = self.speculator.mark(scheduled)
                executor.submit(scheduled, started, failed)
                if executor.depth == 1:
                    break  # one forward pass a step, even one whose every sequence failed
            flight = executor.result(failed)
        except StageFailure as e:
            log.error("%s; failing %d running sequences and restarting the stages", e, len(self.scheduler.running))
            for seq in list(self.scheduler.running):
                self._fail(seq, e, failed)
            self.blocks.forget_prefixes()
            executor.restart()
            return failed
        if flight is None or flight.logits is None:
            return failed
        if self.pipeline is None:  # (through stages the next steps are already out)
            self.speculator.follow_prompt(flight.scheduled, len(self.scheduler.running))
        outputs = self._process(flight.scheduled, flight.logits, failed, time.perf_counter() - flight.started)
        if mark is not None:
            self.speculator.learn(mark, self.stats.generated_tokens - generated, time.perf_counter() - started,
                                  len(flight.scheduled))
        return outputs

    def _schedule(self, busy: set[int], max_seqs: int | None) -> list[ScheduledSeq]:
        """The sequences of this step, with their drafts to verify where speculation is on."""
        cap, per_position = self.budget.cap()
        if cap is not None:  # the drafts' rows come after the prompt chunks are chosen: room for them
            cap = max(MIN_CHUNK, int(cap - self.speculator.reserve(self.scheduler.running, per_position)))
        scheduled = self.scheduler.schedule(cap, busy, max_seqs, per_position, self.pace.rows())
        for seq in self.scheduler.preempted:  # recomputed later from its tokens: the draft's KV goes too
            self.speculator.release(seq.seq_id)
        self.scheduler.preempted.clear()
        self.speculator.attach(scheduled, len(self.scheduler.running))
        return scheduled

    def _process(self, scheduled: list[ScheduledSeq], logits: torch.Tensor, outputs: list[SequenceOutput],
                 seconds: float) -> list[SequenceOutput]:
        """The step's bookkeeping, then a token for each sequence that reached its end (verified drafts
        give several); `outputs` already holds the sequences the forward pass failed."""
        self.stats.record_step(len(scheduled), seconds)
        self.constraints.new_step()
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        verifying: list[tuple[ScheduledSeq, torch.Tensor]] = []
        row = 0
        for item in scheduled:
            seq = item.seq
            if seq.finished or seq.slot is None:  # aborted while its step was in flight (pipeline stages)
                row += item.rows if item.samples else 0
                continue
            if item.samples:
                if item.draft:
                    verifying.append((item, logits[row : row + item.rows]))
                else:
                    plain.append(item.seq)
                    plain_rows.append(row)
                row += item.rows
            seq.num_cached = item.start + item.count - len(item.draft)
            self.blocks.set_length(seq.slot, seq.num_cached)
            if item.start < seq.num_prompt:
                self.stats.prompt_tokens += min(item.count, seq.num_prompt - item.start)
        self.budget.observe(scheduled, seconds)
        self.pace.observe(scheduled, seconds)
        rows = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
        self.picker.pick(plain, rows, verifying, outputs)
        return outputs

    def _fail(self, seq: Sequence, error: Exception, failed: list[SequenceOutput]) -> None:
        log.error("sequence %d failed in the step and ends alone: %r", seq.seq_id, error, exc_info=error)
        if not seq.finished:
            seq.finish_reason = "error"
            self._release(seq)
        failed.append(failed_output(seq, error))

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
