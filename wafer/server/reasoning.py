"""Reasoning effort: the budget in tokens each level gets, whether a model thinks natively (its chat
template has a thinking switch and `<think>` tags), and what an explicit reasoning turn asks of a
model that does not.

A budget is the table's (wafer.toml `[reasoning]`, else REASONING_BUDGETS) capped so that the answer
keeps at least ANSWER_RESERVE tokens, or a quarter of the output limit when that is smaller: like
OpenAI's, `max_completion_tokens` counts reasoning and answer together, and a reasoning that ate the
whole limit would leave an empty reply.
"""

from __future__ import annotations

from dataclasses import dataclass

from wafer.config import REASONING_BUDGETS

EFFORTS = (*REASONING_BUDGETS, "ultra")
ANSWER_RESERVE = 256
OPEN, CLOSE = "<think>", "</think>"
# What a budget that ran out appends, as Qwen3's template writes a finished thought into history.
FORCED_CLOSE = f"\n{CLOSE}\n\n"

THINK_NOTE = ("Before answering, think through the request step by step: what is asked, what you know, "
              "and how to get there. Write only your reasoning now; the answer comes next.")
ANSWER_NOTE = ("Now write your answer to the user's last message, using the reasoning above. Do not repeat "
               "the reasoning.")
# Stands for the reasoning in a rendered template, so its tokens can be spliced in unchanged.
SLOT = "\x00wafer-reasoning\x00"


def level(effort: str) -> str:
    """The budget table's level for a request's effort: `ultra` reasons as `max` here (its
    sub-agents are the Responses API's)."""
    return "max" if effort == "ultra" else effort


def budget(effort: str, table: dict[str, int], limit: int) -> int:
    """Reasoning tokens allowed for `effort` when reasoning and answer together may take `limit`."""
    reserve = min(ANSWER_RESERVE, max(1, limit // 4))
    return max(0, min(table.get(level(effort), REASONING_BUDGETS[level(effort)]), limit - reserve))


def thinks_natively(template_source: str) -> bool:
    """A template that switches thinking with `enable_thinking` and writes `<think>` tags (Qwen3,
    SmolLM3): the model reasons in its own format and wafer only has to open, bound and close it."""
    return "enable_thinking" in template_source and OPEN in template_source and CLOSE in template_source


def opened(prompt: str) -> str:
    """The prompt with the thinking open: templates that leave `<think>` for the model to write get it
    written for them, so the reasoning starts at the first generated token."""
    return prompt if prompt.rstrip().endswith(OPEN) else prompt + OPEN + "\n"


@dataclass
class ReasoningPlan:
    """How one request reasons, then answers. The answer's prompt is `before` + the reasoning's tokens
    + `after`: the reasoning goes back to the model as the very tokens it generated (no decoding and
    encoding again), and the engine's prefix cache holds all of it from the reasoning turn, so the
    answer's prefill is little more than `after`."""

    effort: str
    budget: int  # tokens the reasoning turn may generate; 0: no reasoning turn
    limit: int  # reasoning and answer tokens together
    think_ids: list[int]  # the reasoning turn's prompt
    before: list[int]
    after: list[int]
    close: list[int]  # native thinking: what ends a thought the budget cut; else empty
    native: bool

    @property
    def prompt_tokens(self) -> int:
        """The request's prompt before any reasoning: everything the answer reads but the reasoning."""
        return len(self.before) + len(self.after)

    def answer_prompt(self, generated: list[int], closed: bool, eos_ids: list[int]) -> Answer:
        """The answer's prompt after the reasoning turn generated `generated` (`closed`: it ended with
        the model's own `</think>`). An end-of-sequence token ends the thought but is not kept in it."""
        if self.budget == 0:
            return Answer(self.before, 0, self.prompt_tokens)
        if self.native and closed:
            return Answer(self.before + generated, len(generated), self.prompt_tokens)
        kept = generated[:-1] if generated and generated[-1] in eos_ids else generated
        return Answer(self.before + kept + self.close + self.after, len(generated),
                      self.prompt_tokens + len(self.close))


@dataclass
class Answer:
    ids: list[int]  # the answer's prompt
    reasoning_tokens: int  # what the reasoning turn generated
    # usage's prompt tokens: all the answer reads but the reasoning, a forced `</think>` included (the
    # model read it, it did not write it)
    prompt_tokens: int
