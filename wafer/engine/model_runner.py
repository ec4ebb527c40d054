"""Run the model on one scheduled step: flatten the sequences into one batch and get logits.

A step is prepared (the scheduled sequences become a StepBatch of plain tensors: the tokens, their
positions and cache blocks, the rows whose logits are wanted) and then executed on the model. A
pipeline stage (the pipeline package) executes the same StepBatch on its own layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wafer.engine.cuda_graph import GraphedDecode
from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import BLOCK
from wafer.engine.scheduler import ScheduledSeq
from wafer.models.attention import (
    AttentionBatch,
    PrefillChunk,
    causal_masks,
    decode_masks,
)
from wafer.engine.speculative.draft_tree import remap_rows, tree_masks
from wafer.kernels.fused_decode import FusedDecode
from wafer.models.llama import LlamaModel


@dataclass
class StepBatch:
    """One step's tokens and where they go, in the order they are computed: all a model (or one
    pipeline stage of it) needs besides its weights and its KV pools."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] the KV slot of each token's sequence
    rows: torch.Tensor | None  # the rows whose logits are wanted (None: every row)
    tables: torch.Tensor | None  # [groups, slots, max_blocks] each slot's blocks (the fused step's)
    attention: AttentionBatch | None  # the Python model's view of the same (None on the fused step)
    # Only each row's argmax is wanted (every row greedy, without logprobs, penalties or grammar): a
    # pipeline's last stage then sends the tokens back instead of the logits.
    argmax_only: bool = False
    # The fused step's draft trees: per token [base, KV positions of rotary positions base...] (FusedDecode)
    remap: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.ids.numel() if self.rows is None else self.rows.numel()


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, cuda_graphs: bool = True) -> None:
        self.model = model
        self.kv = kv
        self.windows = set(model.config.windows)
        self.device = kv.device
        # A pipeline stage runs its own layers on the pools of those layers.
        first, _, _ = getattr(model, "stage", (0, 0, 0))
        self.caches = kv.layers[first : first + len(model.layers)]
        # One C++ call per step where the compute path allows it (q4 and q8 on wafer's kernels).
        self.fused = (FusedDecode.build(model, self.caches, kv.blocks.layer_group[first : first + len(model.layers)])
                      if self.device.type == "cpu" else None)
        # On a GPU, decode steps of up to 64 sequences replay CUDA graphs.
        self.graphed = (GraphedDecode(model, kv, min(kv.blocks.num_slots, 64))
                        if cuda_graphs and self.device.type == "cuda" else None)

    def run(self, scheduled: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        """Logits in the order of `scheduled` filtered to those that sample: one row per such item,
        or `rows` rows for an item that asks for more (a draft to verify) (with all_logits: every token, in
        batch order: the order of `scheduled` on the fused path; elsewhere single-token items go first so
        they attend together)."""
        if (self.graphed is not None and not all_logits and len(scheduled) <= self.graphed.max_batch
                and all(s.count == 1 and s.samples for s in scheduled)):
            for item in scheduled:
                self.kv.blocks.reserve(item.slot, item.start + item.count)
            logits = self.graphed([s.input_ids()[0] for s in scheduled], [s.start for s in scheduled],
                                  [s.slot for s in scheduled])
            return logits.cpu()  # sampling and detokenising stay on the host
        return self.execute(self.prepare(scheduled, all_logits))

    def prepare(self, scheduled: list[ScheduledSeq], all_logits: bool = False) -> StepBatch:
        """The step as plain tensors, its KV blocks taken (the scheduler has made room)."""
        for item in scheduled:
            self.kv.blocks.reserve(item.slot, item.start + item.count)
        if self.fused is not None:
            return self._prepare_fused(scheduled, all_logits)
        singles = [s for s in scheduled if s.count == 1]
        chunks = [s for s in scheduled if s.count > 1]
        order = singles + chunks
        ids: list[int] = []
        positions: list[int] = []  # rotary
        places: list[int] = []  # in the KV cache
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        tables = self.kv.blocks.tables
        for item in order:
            seq, start, n = item.seq, item.start, item.count
            if n > 1:
                ctx = start + n
                masks = (causal_masks(start, n, self.windows) if item.tree is None
                         else tree_masks(start, n - len(item.draft), item.tree, self.windows))
                # (a copy: a view would carry the whole table wherever the step is pickled, to a stage)
                prefills.append(PrefillChunk(len(ids), n, tables[:, seq.slot, : -(-ctx // BLOCK)].clone(), ctx, masks))
            ids.extend(item.input_ids())
            positions.extend(item.positions())
            places.extend(range(start, start + n))
            slots.extend([item.slot] * n)
        lengths = [s.start + 1 for s in singles]
        nblk = -(-max(lengths, default=0) // BLOCK)
        pos = torch.tensor(positions, dtype=torch.long)
        place = torch.tensor(places, dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long)
        batch = AttentionBatch(
            write_blocks=tables[:, slot_t, place // BLOCK],
            write_offsets=place % BLOCK,
            positions=pos,
            num_decode=len(singles),
            decode_tables=tables[:, [s.seq.slot for s in singles], :nblk],
            decode_len=nblk * BLOCK,
            decode_masks=decode_masks(lengths, nblk * BLOCK, self.windows) if singles else {},
            prefills=prefills,
            groups=self.kv.blocks.window_group,
        )
        # Logits rows in the caller's order of `scheduled`, for the items that sample.
        ends: dict[int, int] = {}
        offset = 0
        for item in order:
            offset += item.count
            ends[id(item)] = offset - 1
        rows = [r for item in scheduled if item.samples
                for r in range(ends[id(item)] - item.rows + 1, ends[id(item)] + 1)]
        return StepBatch(torch.tensor(ids, dtype=torch.long), pos, slot_t,
                         None if all_logits else torch.tensor(rows, dtype=torch.long), None, batch)

    def _prepare_fused(self, scheduled: list[ScheduledSeq], all_logits: bool) -> StepBatch:
        """The fused step computes every token on its own (its row's activations, its own attention
        over its slot up to its position, after all the step's keys are written), so a draft verified
        there gives bitwise the logits that decoding it token by token would, and a prompt's KV
        entries are the same however it was chunked: tokens stay in the order of `scheduled`. A draft
        tree's nodes take their rotary positions and, where their path does not lie in place, say
        where its KV rows are (`remap`): each node's attention then reads, in the order of its
        positions, the rows decoding its path would have written."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        remap: dict[int, list[int]] = {}  # token index -> its remap row
        for item in scheduled:
            if item.tree is not None:
                own = item.count - len(item.draft)
                for i, r in enumerate(remap_rows(item.start + own, item.tree)):
                    remap[len(ids) + own + i] = r
            ids.extend(item.input_ids())
            positions.extend(item.positions())
            slots.extend([item.slot] * item.count)
            if item.samples:
                rows.extend(range(len(ids) - item.rows, len(ids)))
        return StepBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                         torch.tensor(slots, dtype=torch.long),
                         torch.arange(len(ids)) if all_logits else torch.tensor(rows, dtype=torch.long),
                         self.kv.blocks.tables, None, remap=_remap_tensor(positions, remap))

    def execute(self, step: StepBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The step on this runner's model: logits [step.num_rows, vocab], or hidden states [N, hidden]
        from a pipeline stage without the head; a stage without the embedding starts from `hidden`."""
        if self.fused is not None:
            assert step.tables is not None, "a step prepared for the Python model cannot run the fused step"
            rows = step.rows if step.rows is not None else torch.arange(step.ids.numel())
            return self.fused(step.ids, step.positions, step.slots, step.tables, rows, hidden, step.remap)
        assert step.attention is not None, "a step prepared for the fused step cannot run the Python model"
        batch = step.attention.to(self.device)
        args = [step.ids.to(self.device), batch.positions, batch, self.caches,
                None if step.rows is None else step.rows.to(self.device)]
        if hidden is not None:  # a pipeline stage's (a Llama-family model)
            args.append(hidden.to(self.device, self.model.norm.weight.dtype))
        return self.model(*args).cpu()


def _remap_tensor(positions: list[int], remap: dict[int, list[int]]) -> torch.Tensor | None:
    """[tokens, width] of the remap rows (a token without one: base past its own position), or None
    where no token has one (every draft a chain)."""
    if not remap:
        return None
    width = max(len(r) for r in remap.values())
    out = torch.zeros(len(positions), width, dtype=torch.long)
    out[:, 0] = torch.tensor(positions, dtype=torch.long) + 1
    for i, r in remap.items():
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out
