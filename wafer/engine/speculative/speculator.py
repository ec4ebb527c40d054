"""What the engine asks of speculative decoding in a step: whether it may draft, the prompt work
its drafts may cost, a draft for each decoding sequence that may take one, their verification, and
what the step taught the draft length."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from wafer.engine.block_manager import BlockManager
from wafer.engine.kv_cache import KVCache
from wafer.engine.sampler import Sampler
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import Sequence, SequenceOutput
from wafer.engine.speculative.config import SpeculativeConfig
from wafer.engine.speculative.draft_length import DraftLength
from wafer.engine.speculative.draft_model import DraftModelProposer
from wafer.engine.speculative.draft_tree import DraftTree, accepted_moves
from wafer.engine.speculative.grammatical import grammatical
from wafer.engine.speculative.ngram import NgramProposer
from wafer.engine.speculative.picker import PickingProposer
from wafer.engine.speculative.proposer import Draft, Proposer
from wafer.engine.speculative.stats import SpecStats
from wafer.engine.speculative.suffix import SuffixProposer
from wafer.engine.speculative.verification import Append, Mask, verify
from wafer.models.loader import LoadedModel

log = logging.getLogger("wafer.engine")


def lookup_on_request(spec: SpeculativeConfig, pipeline_parallel: int) -> bool:
    """Whether a request may ask for prompt lookup (`prompt_lookup`): it needs no model, so it is
    offered where the engine does not speculate; not through stages, whose buffers are sized
    without drafts."""
    return not spec.enabled and pipeline_parallel == 1


def make_proposer(spec: SpeculativeConfig, target: LoadedModel, draft: LoadedModel | None, on_request: bool,
                  num_slots: int, max_model_len: int, seed: int | None) -> Proposer | None:
    """The proposer `spec` names (prompt lookup where requests may ask for it; a PickingProposer over
    several); None: no drafts. Raises ValueError for a draft model that is missing or whose
    vocabulary differs."""
    if on_request:
        return NgramProposer(spec)
    methods = spec.methods if spec.enabled else ()
    if not methods:
        return None
    model = None
    if "draft" in methods:
        if draft is None:
            raise ValueError("speculative method 'draft' needs a draft model")
        if (draft.tokenizer.tokenizer.get_vocab() != target.tokenizer.tokenizer.get_vocab()
                or draft.config.vocab_size != target.config.vocab_size):
            raise ValueError(f"draft model {draft.name} cannot propose for {target.name}: their tokenizers "
                             "differ (speculative decoding needs the same vocabulary)")
        model = DraftModelProposer(draft.model, num_slots, max_model_len, seed)
    ngram = NgramProposer(spec) if "ngram" in methods else None
    suffix = SuffixProposer(spec) if "suffix" in methods else None
    if len(methods) > 1:
        return PickingProposer(ngram, suffix, model)
    return ngram or suffix or model


def draft_model_of(proposer: Proposer | None) -> DraftModelProposer | None:
    """The draft model among the proposers, if one is."""
    if isinstance(proposer, PickingProposer):
        return proposer.draft
    return proposer if isinstance(proposer, DraftModelProposer) else None


@dataclass(frozen=True)
class StepMark:
    """What a step's lesson for the draft length is read against, taken when it was scheduled."""

    measured: bool  # the step decodes alone at a length DraftLength chose
    kept_before: bool  # the context it was chosen in
    drafted: int  # SpecStats' counts before the step
    accepted: int


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None, on_request: bool,
                 blocks: BlockManager, max_model_len: int, stats: SpecStats, pipelined: bool,
                 kv: KVCache | None = None) -> None:
        """`on_request`: drafts only for requests that ask (lookup_on_request). `kv`: the cache whose
        rows an accepted tree path moves in; None (pipeline stages, which hold the KV in their
        processes): trees are cut to their first path, a chain, whose rows lie in place."""
        self.config = config
        self.proposer = proposer
        self.on_request = on_request
        self.blocks = blocks
        self.kv = kv
        self.max_model_len = max_model_len
        self.stats = stats
        # Lookup asked for by a request always chooses its length: where it does not pay it goes quiet.
        adaptive = (config.enabled and config.adaptive) or on_request
        if adaptive and pipelined:
            log.info("pipeline stages: speculation proposes a fixed %d tokens (adaptive lengths measure whole "
                     "steps, which stages overlap)", config.num_tokens)
        self.draft_length = DraftLength(config.num_tokens) if adaptive and not pipelined else None
        self.step_k: int | None = None  # the draft length this step was given, when DraftLength chose it
        self.kept = False  # the last step verified drafts and kept every one whole: DraftLength's context
        self.model = draft_model_of(proposer)
        # Which proposer made each draft, for the counts by method (one proposer: its method).
        self.single = None if isinstance(proposer, PickingProposer) else (
            "ngram" if on_request else (config.methods[0] if config.methods else None))

    def active(self, num_running: int) -> bool:
        """Whether this step may propose drafts: a proposer, and no more sequences running than speculate."""
        return self.proposer is not None and num_running <= self.config.max_running

    def wants_drafts(self, seq: Sequence) -> bool:
        """Any sequence, a constrained one too (its drafts cut to what its grammar accepts); where the
        engine does not speculate, only if the request asked."""
        return not self.on_request or seq.params.prompt_lookup

    def _may_draft(self, item: ScheduledSeq) -> bool:
        return item.count == 1 and item.samples and self.wants_drafts(item.seq)

    def reserve(self, running: list[Sequence], per_position: float) -> float:
        """The prompt work (tokens at position 0) that the drafts this step may verify could cost:
        K rows for each decoder that may draft, each at its position. A step's length bounds every
        stream's wait, and the drafts, attached after the prompt chunks are chosen, would add to it
        (as in vLLM, where speculated tokens count against the step's token budget)."""
        if not self.active(len(running)):
            return 0.0
        k = self.config.num_tokens
        return sum(k * (1.0 + per_position * len(seq.tokens)) for seq in running
                   if len(seq.tokens) - seq.num_cached == 1 and self.wants_drafts(seq))

    def release(self, seq_id: int, finished: Sequence | None = None) -> None:
        """The sequence ended (`finished`: it, where it finished), or was preempted: whatever the
        proposer holds of it goes; a finished output joins what suffix drafts draw on."""
        if self.proposer is not None:
            self.proposer.release(seq_id)
            learn = getattr(self.proposer, "finished", None)
            if finished is not None and finished.finished and learn is not None:
                learn(finished)

    def method_of(self, seq_id: int) -> str | None:
        if self.single is not None:
            return self.single
        return getattr(self.proposer, "method_of", {}).get(seq_id)

    def attach(self, scheduled: list[ScheduledSeq], num_running: int) -> None:
        """Give each decoding sequence that may speculate a proposal to verify in this step. A failure
        to propose leaves the step without drafts: speculation is an optimisation."""
        self.step_k = None
        if self.model is not None:
            self.model.catch_up_seconds = 0.0
        if self.proposer is not None:
            self.stats.decode_steps += sum(1 for item in scheduled if item.count == 1 and item.samples)
        if not scheduled or not self.active(num_running):
            return
        try:
            self._attach(scheduled)
        except Exception:
            log.exception("proposing drafts failed; this step decodes without them")
            self.step_k = None  # and says nothing of what its length yields
            for item in scheduled:
                if item.draft:
                    item.count -= len(item.draft)
                    item.rows, item.draft, item.draft_probs, item.tree = 1, [], None, None

    def _attach(self, scheduled: list[ScheduledSeq]) -> None:
        if self.proposer is None or not any(self._may_draft(item) for item in scheduled):
            return  # prompt work alone, or none asked for drafts: nothing to propose, no length to choose
        k = self.config.num_tokens
        if self.draft_length is not None:
            k = self.step_k = self.draft_length.choose(len(scheduled), self.kept)
            if k == 0:
                return
        items, limits = [], []
        for item in scheduled:
            seq = item.seq
            if not self._may_draft(item) or seq.slot is None:
                continue
            # No point proposing past max_tokens or the context: the last token is the target's own.
            room = min(k, seq.params.max_tokens - (len(seq.tokens) - seq.num_prompt) - 1,
                       self.max_model_len - len(seq.tokens) - 1)
            # Drafts only take blocks that are free: they never preempt anyone.
            end = seq.num_cached + 1
            room = min(room, self.blocks.room(seq.slot, end + max(room, 0)) - end)
            if room > 0:
                self.blocks.reserve(seq.slot, end + room)
                items.append(item)
                limits.append(room)
        if not items:
            return
        for item, limit, draft in zip(items, limits, self.proposer.propose([i.seq for i in items], limits)):
            draft = self._shaped(draft, limit)
            if item.seq.matcher is not None and draft.tokens:
                draft = self._under_grammar(item.seq, draft)
            if draft.tokens:
                item.draft, item.draft_probs = draft.tokens, draft.probs
                item.tree = DraftTree.of(len(draft.tokens), draft.parents) if draft.parents is not None else None
                item.count += len(draft.tokens)
                item.rows = 1 + len(draft.tokens)

    def _shaped(self, draft: Draft, limit: int) -> Draft:
        """The draft as this engine verifies it: within its limit (ValueError past it, or for a
        malformed tree), a tree whose one path is a chain as the chain, and without a cache to move
        an accepted path's rows in (pipeline stages), a tree cut to its first path."""
        if len(draft.tokens) > limit:
            raise ValueError(f"a draft of {len(draft.tokens)} tokens past its limit of {limit}")
        if draft.parents is None:
            return draft
        tree = DraftTree.of(len(draft.tokens), draft.parents)
        if tree.is_chain:
            return Draft(draft.tokens, draft.probs)
        if self.kv is None:
            keep = tree.first_path()
            probs = draft.probs[keep] if draft.probs is not None else None
            return Draft([draft.tokens[i] for i in keep], probs)
        return draft

    def _under_grammar(self, seq: Sequence, draft: Draft) -> Draft:
        """The draft cut to what the sequence's grammar accepts from its state (grammatical.py), the
        CPU time charged to its grammar budget (TokenPicker checks it at the next mask). A draft
        cut to nothing is told to its proposer as one that kept nothing (a draft model forgets the
        KV of its proposal; a picker rests the method)."""
        started = time.thread_time()
        cut = grammatical(draft, seq.matcher)
        seq.matcher.seconds += time.thread_time() - started
        self.stats.grammar_cut_tokens += len(draft.tokens) - len(cut.tokens)
        if not cut.tokens and self.proposer is not None:
            self.proposer.verified(seq, len(seq.tokens), 0, 0)
        return cut

    def follow_prompt(self, scheduled: list[ScheduledSeq], num_running: int) -> None:
        """A draft model computes the prompt chunks the target computed in this step, for the
        sequences that may speculate: not a single token, and not while more run than speculate
        (they catch up at their first proposal, if one comes)."""
        if self.model is None or not self.active(num_running):
            return
        prompt = [item for item in scheduled if item.start < item.seq.num_prompt and not item.seq.finished
                  and item.seq.params.max_tokens > 1]
        try:
            self.model.follow_prompt(prompt)
        except Exception:  # an optimisation: the first proposal catches up instead
            log.exception("the draft model failed on a prompt chunk; it catches up when it next proposes")
            for item in prompt:
                self.model.release(item.seq.seq_id)

    def verify(self, item: ScheduledSeq, rows: torch.Tensor, sampler: Sampler, append: Append,
               mask: Mask | None = None) -> list[SequenceOutput]:
        """The target's logits over [last token, draft...] turned into 1 to (tree depth)+1 tokens;
        the accepted path's KV rows moved to follow the sequence's last token (in place on a chain).
        `mask`: a constrained sequence's grammar mask, applied to each row the walk samples from."""
        seq = item.seq
        start_len = len(seq.tokens)
        method = self.method_of(seq.seq_id)  # read first: a sequence that finishes in it is released
        outs, path = verify(item, rows, sampler, append, mask)
        self.stats.record(len(item.draft), len(path), method)
        if not seq.finished and seq.slot is not None and self.proposer is not None:
            src, dst = accepted_moves(start_len, path)
            if src:
                assert self.kv is not None, "a tree is verified only where its accepted rows can move"
                self.kv.move(seq.slot, src, dst)
            self.blocks.set_length(seq.slot, seq.num_cached)
            self.proposer.verified(seq, start_len, len(path), len(item.draft))
        return outs

    def mark(self, scheduled: list[ScheduledSeq]) -> StepMark:
        """A step of decoding alone tells what its draft length yields; prompt work, or a draft model
        catching up on tokens decoded without it (a cost of switching lengths, not of one), would blur it."""
        measured = self.step_k is not None and all(item.samples and item.count == 1 + len(item.draft)
                                                   and item.start >= item.seq.num_prompt for item in scheduled)
        return StepMark(measured, self.kept, self.stats.draft_tokens, self.stats.accepted_tokens)

    def learn(self, mark: StepMark, tokens: int, seconds: float, batch: int) -> None:
        """After the step: whether it kept its drafts whole, and (where it was measured) its yield."""
        if self.draft_length is None:
            return
        drafted, accepted = self.stats.draft_tokens - mark.drafted, self.stats.accepted_tokens - mark.accepted
        self.kept = drafted > 0 and accepted == drafted
        if mark.measured and self.step_k is not None:
            catch_up = self.model.catch_up_seconds if self.model is not None else 0.0
            self.draft_length.record(self.step_k, tokens, seconds - catch_up, batch, mark.kept_before)
