"""Each step's draft length, chosen by measured yield."""

from __future__ import annotations


class DraftLength:
    """Each step's draft length, chosen by what steps with each length yielded: tokens per second of
    the whole step, proposing included. Whether speculation pays depends on the machine and the
    text: where verifying a row costs nearly as much as a step (a model bound by compute, as on two
    cores) or the drafts are seldom right, fewer tokens, or none, decode faster than K; where rows
    are cheap (bound by memory bandwidth), K does. A hill climb over a few lengths: the best measured
    length, and every `explore`-th step one of its neighbours, so that a change of text or load is
    followed. Yields are moving averages, so one noisy step moves them only part way.

    They are kept per context: the number of sequences in the step, whose cost and yield change
    with it, and whether the step before kept its drafts whole. An answer that copies its input
    runs in stretches: after a draft kept whole the next is likely kept too (a long draft pays),
    after one cut short the text has turned from its source (a short one, or none, does). One climb
    over both would chase whichever stretch it is in and lag behind the other."""

    def __init__(self, k_max: int, explore: int = 6, alpha: float = 0.3) -> None:
        self.lengths = sorted({0, k_max, *(k for k in (1, 2, 4, 8, 16) if k < k_max)})
        # (sequences in the step, the step before kept its drafts whole) -> length -> yield
        self.by_context: dict[tuple[int, bool], dict[int, float]] = {}
        self.chosen: dict[int, int] = {k: 0 for k in self.lengths}  # steps given each length
        self.explore, self.alpha = explore, alpha
        self.steps = 0
        self._upward = False

    def yields(self, batch: int = 1, kept: bool = False) -> dict[int, float]:
        return self.by_context.get((batch, kept), {})

    def best(self, batch: int = 1, kept: bool = False) -> int:
        """The length of the highest measured yield in this context; K until one is measured."""
        ys = self.yields(batch, kept)
        return max(ys, key=ys.__getitem__) if ys else self.lengths[-1]

    def choose(self, batch: int = 1, kept: bool = False) -> int:
        self.steps += 1
        i = self.lengths.index(self.best(batch, kept))
        if self.steps % self.explore:
            k = self.lengths[i]
        else:
            self._upward = not self._upward
            j = i + 1 if self._upward else i - 1
            if not 0 <= j < len(self.lengths):  # at an end: the one neighbour there is
                j = i - 1 if self._upward else i + 1
            k = self.lengths[j]
        self.chosen[k] += 1
        return k

    def record(self, k: int, tokens: int, seconds: float, batch: int = 1, kept: bool = False) -> None:
        """A step of `batch` sequences decoded with draft length k in context `kept` (as chosen):
        `tokens` new tokens in `seconds`."""
        if seconds <= 0 or k not in self.lengths:
            return
        y = tokens / seconds
        ys = self.by_context.setdefault((batch, kept), {})
        old = ys.get(k)
        ys[k] = y if old is None else old + self.alpha * (y - old)
