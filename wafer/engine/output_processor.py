"""What a sequence's new tokens mean to whoever reads it: text by incremental detokenising, stop
tokens and stop strings, the finish reason, and the text held back that may yet start a stop
string."""

from __future__ import annotations

from collections.abc import Callable

from wafer.engine.constraints import check_limits
from wafer.engine.sequence import Sequence, SequenceOutput, TokenLogprob
from wafer.engine.stats import EngineStats
from wafer.models.tokenizer import IncrementalDetokenizer, TextTokenizer


class OutputProcessor:
    def __init__(self, tokenizer: TextTokenizer, max_model_len: int, stats: EngineStats,
                 release: Callable[[Sequence], None]) -> None:
        """`release`: called with a sequence as it finishes, before its output is made."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stats = stats
        self.release = release
        self._detok: dict[int, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer)

    def drop(self, seq_id: int) -> None:
        self._detok.pop(seq_id, None)

    def append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> SequenceOutput:
        """Add `token` to the sequence and say what it adds to the text, and whether it ends there."""
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
            check_limits(seq.matcher)  # the sequence fails alone rather than end as if complete
        if is_eos or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        else:
            before = len(seq.text)
            seq.text += detok.push(token)
            if p.stop:
                _check_stop_strings(seq, before)
        if seq.finish_reason is None and seq.matcher is not None and seq.matcher.is_stopped():
            seq.finish_reason = "stop"  # the grammar is complete: only end-of-sequence could follow
        if seq.finish_reason is None and (n_out >= p.max_tokens or len(seq.tokens) >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if seq.finish_reason == "length":
                seq.text += detok.flush()
            self.release(seq)
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


def _check_stop_strings(seq: Sequence, before: int) -> None:
    """Cut the text at the first stop string that the text from `before` on completes."""
    longest = max(len(s) for s in seq.params.stop)
    search_from = max(0, before - longest + 1)
    hits = [(i, s) for s in seq.params.stop if (i := seq.text.find(s, search_from)) >= 0]
    if hits:
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        seq.finish_reason = "stop"


def failed_output(seq: Sequence, error: Exception) -> SequenceOutput:
    """The last output of a sequence that failed in a step and ends alone."""
    return SequenceOutput(seq.seq_id, [], "", True, "error", [], seq.num_prompt, len(seq.tokens) - seq.num_prompt,
                          seq.num_cached_prompt, error=f"{type(error).__name__}: {error}")


def merge(outs: list[SequenceOutput]) -> SequenceOutput:
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
