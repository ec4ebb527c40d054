"""Grammar-constrained decoding with llguidance: a sequence whose parameters carry a grammar only
ever samples tokens the grammar allows, so tool arguments and JSON parse by construction.

A grammar alone cannot stop a reply at `max_tokens` in the middle of a JSON value. So the matcher
also keeps the shortest way to finish the grammar from where the output stands (found by asking
llguidance which bytes it allows, cheapest first), and when the tokens left come close to that
completion's length it narrows the mask: first to tokens that cannot lengthen it (more characters of
the same string value, more digits of the same number), then to the completion itself.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from llguidance import LLMatcher, LLTokenizer

from wafer.models.tokenizer import TextTokenizer

# The tagged call format of tools.py; a JSON value that starts right after it is one to close.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# Tokens of slack kept between the tokens left and the completion's length. One sampled token can
# lengthen the completion (a new key opened, a nested object begun) by more than one token; inside
# this window such tokens are no longer offered, so the completion always still fits.
WINDOW = 12
# Beyond this many tokens left nothing is computed: a completion longer than that is not looked for.
HORIZON = 1024
_MAX_COMPLETION_BYTES = 2048
# Steps of the search for a completion, lookahead included: it runs in the engine's step, which holds
# the server's loop, so a grammar whose completion is long or hard to find (a string of minLength
# 10**6, hundreds of required keys) costs at most about 35 ms and no forcing, not the step's whole
# time. A step costs 4 to 17 us on a 2-core EPYC; the tool calls of the tests need 300 to 400.
_SEARCH_FUEL = 2_000
# And of all the searches of one engine step together: beyond it a sequence's search waits for the
# next step (and goes first there), so that several constrained sequences near their ends at once (a
# request's n choices) do not each add their 35 ms to the step. The token sampled meanwhile is not
# restricted, so only a sequence whose last completion left it twice WINDOW of slack may wait: a first
# search, or one with less slack, runs whatever the step has spent (max_tokens equal to the shortest
# call leaves none).
_STEP_FUEL = 2_000
# And the CPU seconds one search may take (of the thread that steps the engine: the machine's other
# load does not count). Most steps of a search are one llguidance call of microseconds, but where a
# grammar's forced bytes nest without end (`{"a":{"a":...`) each takes 10 to 25 ms, and a search of a
# few hundred of them held every stream's step for 0.3 to 1 s. A search's time counts against the
# step's fuel as the fuel it could have spent in it.
_SEARCH_SECONDS = 0.025
# A search the sequence cannot wait for (its tokens left are about all its completion needs: the
# next token must already be on a way to finish) has this many times as long: given up, it would
# leave invalid output, and it runs once, at the limit (a busy machine's other jobs slow the CPU's
# caches, and a search of a few ms took over 25 there).
_BINDING_SEARCH_FACTOR = 8
# A search that found nothing is not run again at the next token but after 1, 2, 4, ... tokens, at
# most this many: a grammar it cannot finish costs one search now and then, not one a token.
_RETRY_TOKENS = 64
_LOOKAHEAD = 4  # characters tried where the grammar allows several and none is forced
_PRINTABLE = [chr(c) for c in range(0x30, 0x7F)] + [chr(c) for c in range(0x20, 0x30)]


class GrammarError(ValueError):
    """The grammar (or the JSON Schema it came from) cannot be compiled."""


class GrammarTooCostly(Exception):
    """A request's grammar cost more than the engine gives it: llguidance's limits on one step's work
    stopped its matcher, or its masks took more than its time budget. It ends that request alone."""


class Constraints:
    """The llguidance view of one tokenizer; makes a matcher per constrained sequence."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._llt: LLTokenizer | None = None
        self._safe: dict[str, torch.Tensor] | None = None
        self._char_tokens: dict[str, int] | None = None
        self.step_fuel = _STEP_FUEL  # what the completion searches of this step may still spend

    def new_step(self) -> None:
        self.step_fuel = _STEP_FUEL

    @property
    def llt(self) -> LLTokenizer:
        if self._llt is None:  # about a second to build: only when a grammar is first used
            self._llt = LLTokenizer(self.tokenizer.tokenizer.to_str(), n_vocab=self.tokenizer.vocab_size,
                                    eos_token=self.tokenizer.eos_ids)
            self._safe = _safe_tokens(self._llt)  # with it, so that building the vocabulary early builds both
        return self._llt

    def check(self, grammar: str) -> None:
        error = LLMatcher.validate_grammar(grammar, self.llt)
        if error and not error.startswith("WARNING"):
            raise GrammarError(error)

    def matcher(self, grammar: str) -> GrammarMatcher:
        m = LLMatcher(self.llt, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return GrammarMatcher(m, self)

    def is_special(self, text: str) -> bool:
        """Whether text is one special token of this tokenizer (as Qwen2.5's `<tool_call>`)."""
        ids = self.llt.tokenize_str(text)
        return len(ids) == 1 and self.llt.is_special_token(ids[0])

    def token_bytes(self, token: int) -> bytes:
        return self.llt.decode_bytes([token])

    def char_tokens(self) -> dict[str, int]:
        """The single token of each printable ASCII character (byte-level vocabularies have them all)."""
        if self._char_tokens is None:
            found = {}
            for ch in _PRINTABLE:
                ids = self.llt.tokenize_str(ch)
                if len(ids) == 1:
                    found[ch] = ids[0]
            self._char_tokens = found
        return self._char_tokens

    def safe(self, kind: str) -> torch.Tensor:
        """Tokens that keep a value's completion as it is: for "string", any text without a quote,
        backslash or control byte; for "number", digits only."""
        if self._safe is None:
            self._safe = _safe_tokens(self.llt)
        return self._safe[kind]


def _safe_tokens(llt: LLTokenizer) -> dict[str, torch.Tensor]:
    string = torch.zeros(llt.vocab_size, dtype=torch.bool)
    number = torch.zeros(llt.vocab_size, dtype=torch.bool)
    for t in range(llt.vocab_size):
        if llt.is_special_token(t):
            continue
        b = llt.decode_bytes([t])
        if b and b'"' not in b and b"\\" not in b and min(b) >= 0x20:
            string[t] = True
            number[t] = b.isdigit()
    return {"string": string, "number": number}


@dataclass
class JsonScan:
    """Where the output stands in the JSON it writes, byte by byte: enough to tell a string value or
    a number being written (whose completion more of the same does not change) from the rest.

    JSON starts at the output's first non-blank byte if that is `{` or `[` (a bare call, a
    `response_format` reply), after a ```json fence that opens the output, or at the first `{`
    after each CALL_OPEN."""

    in_json: bool = False
    may_open: bool = True  # a `{` here starts JSON
    tail: bytes = b""  # the last bytes outside JSON, to spot CALL_OPEN
    stack: list[int] = field(default_factory=list)
    expect: str = "value"  # key | colon | value | after
    in_string: str = ""  # "" | "key" | "value"
    escaped: bool = False
    in_number: bool = False
    in_literal: bool = False

    def feed(self, data: bytes) -> bool:
        """Take the bytes of one token; False if they only extended a string value or a number."""
        changed = False
        for b in data:
            changed |= self._byte(b)
        return changed

    def kind(self) -> str | None:
        if self.in_json and self.in_string == "value" and not self.escaped:
            return "string"
        if self.in_json and self.in_number:
            return "number"
        return None

    def priority(self) -> str:
        """Characters to try first when completing from here, cheapest first."""
        if not self.in_json:
            return "{<["
        if self.in_string:
            return '"'
        if self.in_number:
            return "}],0"
        if self.expect == "key":
            return '}"'
        if self.expect == "colon":
            return ":"
        if self.expect == "after":
            return "}],"
        return '0"nft[{-'

    def _byte(self, b: int) -> bool:
        if not self.in_json:
            if b in b" \n\r\t":
                return True
            if b in b"{[" and self.may_open:
                self.in_json, self.stack, self.expect = True, [b], ("key" if b == ord("{") else "value")
                return True
            self.tail = (self.tail + bytes([b]))[-len(CALL_OPEN):]
            # After the tag, or after a ```json fence that opens the reply.
            self.may_open = self.tail == CALL_OPEN.encode() or self.tail in (b"```", b"```json")
            return True
        if self.in_string:
            if self.escaped or b == ord("\\"):  # an escape's completion differs until it ends
                self.escaped = not self.escaped
                return True
            if b == ord('"'):
                self.expect = "colon" if self.in_string == "key" else "after"
                self.in_string = ""
                return True
            return self.in_string == "key"
        if self.in_number:
            if b in b"0123456789":
                return False
            if b in b".eE+-":
                return True
            self.in_number, self.expect = False, "after"
        if self.in_literal:
            if b in b"truefalsn":
                return True
            self.in_literal, self.expect = False, "after"
        if b in b"{[":
            self.stack.append(b)
            self.expect = "key" if b == ord("{") else "value"
        elif b in b"}]":
            if self.stack:
                self.stack.pop()
            self.expect = "after"
            if not self.stack:  # the value is complete; a bare call may be followed by another
                self.in_json, self.tail = False, b""
        elif b == ord('"'):
            self.in_string = "key" if self.expect == "key" else "value"
        elif b == ord(":"):
            self.expect = "value"
        elif b == ord(","):
            self.expect = "key" if self.stack and self.stack[-1] == ord("{") else "value"
        elif b in b"-0123456789":
            self.in_number = True
        elif b in b"tfn":
            self.in_literal = True
        return True


class GrammarMatcher:
    """An llguidance matcher that also follows the output's JSON, to finish it within max_tokens."""

    def __init__(self, inner: LLMatcher, constraints: Constraints) -> None:
        self.inner = inner
        self.constraints = constraints
        self.scan = JsonScan()
        self._completion: list[int] | None = None
        self._stale = True
        self._fuel = _SEARCH_FUEL
        self._waited = False  # its search was put off to this step: it goes now, whatever is left
        self._failed = 0  # searches in a row that found nothing
        self._since_failed = 0  # tokens consumed since the last of them
        self._deadline = (0.0, 0.0)  # of the search under way: (perf_counter, thread_time)
        # CPU seconds its masks, searches and draft cuts have taken in engine steps (TokenPicker's count).
        self.seconds = 0.0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)

    def deep_copy(self) -> GrammarMatcher:
        """A matcher in the same state (a grammar compiled once serves each sequence of a request)."""
        twin = GrammarMatcher(self.inner.deep_copy(), self.constraints)
        twin.scan = copy.deepcopy(self.scan)
        twin._completion, twin._stale = self._completion, self._stale
        return twin

    def prime(self) -> None:
        """Search for the completion from here now, outside the engine's step and its fuel: where a
        request is prepared, so that a sequence's first search, which cannot wait, is not one more in
        a step beside every other stream's work."""
        if self._stale:
            self._completion, self._stale = self._complete(), False

    def in_json(self) -> bool:
        """Whether the output stands inside the JSON the grammar holds (a call, a `response_format`
        reply): there the sampler copies values from the prompt without a repetition penalty."""
        return self.scan.in_json

    def consume_token(self, token: int) -> bool:
        ok = self.inner.consume_token(token)
        if self.scan.feed(self.constraints.token_bytes(token)):
            self._stale = True
        self._since_failed += 1
        return ok

    def completion(self, tokens_left: int | None = None) -> list[int] | None:
        """The tokens of the shortest way found to finish the grammar from here ([] if it may end
        here; None if none was found, or if this step's searches have spent their fuel and the
        tokens left, against the last completion, allow a wait: then the next step's search is this
        one's first)."""
        if self._stale:
            if self._failed and self._since_failed < min(2 ** (self._failed - 1), _RETRY_TOKENS):
                return None  # the last search found nothing, a moment ago
            # An empty last completion (the grammar could end there, as a lazy tool grammar before
            # its call opens) tells nothing of the one after the next token.
            may_wait = (tokens_left is not None and bool(self._completion)
                        and tokens_left > len(self._completion) + 2 * WINDOW)
            if may_wait and self.constraints.step_fuel <= 0 and not self._waited:
                self._waited = True
                return None
            self._waited = False
            started = time.thread_time()
            binding = tokens_left is not None and not may_wait
            self._completion, self._stale = self._complete(_BINDING_SEARCH_FACTOR if binding else 1), False
            spent = (time.thread_time() - started) / _SEARCH_SECONDS * _SEARCH_FUEL
            self.constraints.step_fuel -= max(_SEARCH_FUEL - self._fuel, int(spent))
            self._failed = self._failed + 1 if self._completion is None else 0
            self._since_failed = 0
        return self._completion

    def _complete(self, time_factor: int = 1) -> list[int] | None:
        self._fuel = _SEARCH_FUEL
        seconds = _SEARCH_SECONDS * time_factor
        self._deadline = (time.perf_counter() + seconds, time.thread_time() + seconds)
        m = self.inner.deep_copy()
        if m.is_accepting():
            return []
        if m.is_stopped():
            return None
        found = self._greedy(m, copy.deepcopy(self.scan), lookahead=True)
        if found is None:
            return None
        out, tokens = found
        # One tokenization of the whole completion is usually shorter than the pieces'.
        whole = self.constraints.llt.tokenize_bytes(out)
        if len(whole) < len(tokens) and self.inner.deep_copy().try_consume_tokens(whole) == len(whole):
            return whole
        return tokens

    def _greedy(self, m: LLMatcher, scan: JsonScan, lookahead: bool) -> tuple[bytes, list[int]] | None:
        """Bytes and tokens that finish the grammar from m's state: forced bytes as they come, else the
        cheapest allowed character. With lookahead, where several are allowed (which tool, which
        value), each of the first few is finished greedily and the shortest is taken."""
        llt, chars = self.constraints.llt, self.constraints.char_tokens()
        out, tokens = bytearray(), []
        while not m.is_accepting():
            self._fuel -= 1
            if len(out) > _MAX_COMPLETION_BYTES or self._fuel < 0 or self._out_of_time():
                return None
            forced = m.compute_ff_bytes()
            if len(out) + len(forced) > _MAX_COMPLETION_BYTES:  # before tokenizing and scanning them all
                return None
            if forced:
                ids = llt.tokenize_bytes(forced)
            else:
                options = []
                for ch in scan.priority() + "".join(_PRINTABLE):
                    t = chars.get(ch)
                    if t is not None and m.validate_tokens([t]) == 1:
                        options.append((ch, t))
                        if not lookahead or len(options) == _LOOKAHEAD or (ch == '"' and scan.in_string):
                            break
                if not options:
                    return None
                best = options[0]
                if len(options) > 1:
                    lengths = []
                    for ch, t in options:
                        m2, scan2 = m.deep_copy(), copy.deepcopy(scan)
                        m2.consume_token(t)
                        scan2.feed(ch.encode())
                        rest = self._greedy(m2, scan2, lookahead=False)
                        lengths.append(len(rest[0]) if rest is not None else _MAX_COMPLETION_BYTES)
                    best = options[lengths.index(min(lengths))]
                ids, forced = [best[1]], best[0].encode()
            if not ids or m.try_consume_tokens(ids) != len(ids):
                return None
            scan.feed(forced)
            out += forced
            tokens += ids
        return bytes(out), tokens

    def _out_of_time(self) -> bool:
        """Whether the search has had its CPU time: read only once its wall time is up (that clock
        costs a tenth of the CPU clock, and the CPU time cannot be up before it)."""
        return time.perf_counter() > self._deadline[0] and time.thread_time() > self._deadline[1]

    def restrict(self, logits: torch.Tensor, tokens_left: int) -> None:
        """Near the end of the budget, leave only what still lets the grammar finish in time."""
        if tokens_left > HORIZON:
            return
        if self._stale and self._completion and tokens_left > 2 * (len(self._completion) + WINDOW) + 16:
            return  # far from the end by the last count: one token seldom doubles a completion
        plan = self.completion(tokens_left)
        if not plan or tokens_left > len(plan) + WINDOW:
            return
        if logits[plan[0]] == float("-inf"):  # kept from before more of a value was written
            self._stale = True
            plan = self.completion(tokens_left)
            if not plan:
                return
        keep = torch.zeros(logits.numel(), dtype=torch.bool)
        kind = self.scan.kind()
        # Only a value that could end right here (a free string, a whole number) keeps its
        # completion as more of it is written; a tool's name or an enum's value picks a branch.
        head = self.constraints.token_bytes(plan[0])[:1]
        if kind is not None and head not in ((b'"',) if kind == "string" else (b"}", b"]", b",")):
            kind = None
        if tokens_left > len(plan) and kind is not None:
            safe = self.constraints.safe(kind)
            n = min(safe.numel(), keep.numel())
            keep[:n] = safe[:n]
        keep[plan[0]] = True
        logits.masked_fill_(~keep, float("-inf"))


# llguidance's errors when its limits on one step's work stop a matcher (Earley items, lexer fuel,
# lexer states): the grammar is too costly to follow from there, not the output wrong.
_LIMIT_ERRORS = ("Too many items", "fuel", "too complex", "Too Complex", "max_lexer_states")


def check_limits(matcher: LLMatcher | GrammarMatcher) -> None:
    """Raises GrammarTooCostly where llguidance's limits stopped the matcher (at its last token): the
    sequence could only end there, cut short and read as complete."""
    if matcher.is_error():
        error = (matcher.get_error().strip().splitlines() or [""])[0]
        if any(key in error for key in _LIMIT_ERRORS):
            raise GrammarTooCostly(f"the grammar of this request's schema is too costly to follow: llguidance "
                                   f"stopped it ({error}); simplify the schema (deep or recursive nesting, "
                                   "many optional keys)")


def mask_logits(logits: torch.Tensor, matcher: LLMatcher | GrammarMatcher, tokens_left: int | None = None) -> None:
    """Set every token the grammar forbids next to -inf, in place (one row); with the tokens left
    before max_tokens, also every token after which the grammar could no longer finish in time."""
    allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    check_limits(matcher)
    n = min(allowed.numel(), logits.numel())
    logits[:n].masked_fill_(allowed[:n] == 0, float("-inf"))
    if logits.numel() > n:
        logits[n:] = float("-inf")
    if tokens_left is not None and isinstance(matcher, GrammarMatcher):
        matcher.restrict(logits, tokens_left)
