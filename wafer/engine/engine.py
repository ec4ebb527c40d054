"""LLMEngine: add requests, step them together, read what each step produced.

Single-threaded by design: the server runs it in one thread of its own and talks to it through
`add`, `abort` and `step`; `generate` is the blocking convenience for scripts and tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wafer.engine.constraints import Constraints, mask_logits
from wafer.engine.kv_cache import KVCache
from wafer.engine.runner import ModelRunner
from wafer.engine.sampler import Sampler
from wafer.engine.scheduler import Scheduler
from wafer.engine.sequence import SamplingParams, Sequence, SequenceOutput, Status
from wafer.models.loader import LoadedModel
from wafer.models.tokenizer import IncrementalDetokenizer


@dataclass
class EngineConfig:
    max_running: int = 16
    max_model_len: int | None = None  # default: the model's context length
    max_batched_tokens: int = 512  # per step: decode tokens plus prefill chunks
    prefix_caching: bool = True  # reuse the KV of earlier requests' shared prompt prefixes
    seed: int | None = None


@dataclass
class EngineStats:
    steps: int = 0
    batched_steps: int = 0  # steps that advanced more than one sequence
    prompt_tokens: int = 0
    generated_tokens: int = 0
    last_batch_size: int = 0  # sequences advanced by the most recent step


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        ctx = loaded.config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or ctx, ctx)
        self.kv = KVCache(loaded.config, self.config.max_running, self.max_model_len)
        self.scheduler = Scheduler(self.kv, self.config.max_running, self.config.max_batched_tokens,
                                   self.config.prefix_caching)
        self.runner = ModelRunner(loaded.model, self.kv)
        self.sampler = Sampler(self.config.seed)
        self.stats = EngineStats()
        self.seqs: dict[int, Sequence] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self.constraints = Constraints(self.tokenizer)

    # --- requests -------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, arrival_time: float | None = None) -> Sequence:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_model_len}")
        seq = Sequence(list(prompt_ids), params)
        if params.grammar is not None:
            seq.matcher = self.constraints.matcher(params.grammar)  # GrammarError is a ValueError
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.seqs[seq.seq_id] = seq
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        self._detok.pop(seq_id, None)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

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
    def step(self) -> list[SequenceOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        logits = self.runner.run(scheduled)
        self.stats.steps += 1
        self.stats.last_batch_size = len(scheduled)
        if len(scheduled) > 1:
            self.stats.batched_steps += 1
        sampling = [item.seq for item in scheduled if item.samples]
        for i, seq in enumerate(sampling):
            if seq.matcher is not None:
                mask_logits(logits[i], seq.matcher)
        tokens, lps = self.sampler(logits, sampling) if sampling else ([], [])
        for item in scheduled:
            item.seq.num_cached = item.start + item.count
            self.kv.set_length(item.seq.slot, item.seq.num_cached)  # type: ignore[arg-type]
            if item.start < item.seq.num_prompt:
                self.stats.prompt_tokens += min(item.count, item.seq.num_prompt - item.start)
        outputs = []
        for seq, token, lp in zip(sampling, tokens, lps):
            outputs.append(self._append(seq, token, lp))
        return outputs

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
            self.scheduler.finish(seq)
            self.seqs.pop(seq.seq_id, None)
            self._detok.pop(seq.seq_id, None)
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
        self.generate([[self.tokenizer.bos_id or 0] * 4], SamplingParams(max_tokens=2, temperature=0))
