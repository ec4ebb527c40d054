"""How much an engine runs at once: wafer.toml's integer engine options and `wafer serve`'s flags
of the same names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineSettings:
    max_running: int = 16  # sequences decoded together
    max_waiting: int = 64  # requests queued before a 429
    max_model_len: int = 4096  # context per served sequence (an engine made without one takes the model's)
    # Tokens a step computes, decode tokens and prompt chunks together. Small, so that a step is short
    # before the engine has learned the cost of a token; prefill_step_ms bounds it after that.
    max_batched_tokens: int = 256
    # Milliseconds of prompt work a served step may take (0: only max_batched_tokens bounds it): the
    # streams wait that long for their next token while a long prompt is read in, and the loop that
    # steps the engine, and answers every other request, is held that long.
    prefill_step_ms: int = 50
    # Milliseconds of grammar work (llguidance's masks and the search for a way to close the JSON
    # within max_tokens; CPU time) a request with tools or a response_format may take per token it
    # generates, counting at least 50 tokens (0: no limit). Each of them holds every stream's step;
    # past it the request ends alone with a 400 (code grammar_too_costly), its neighbours unaffected.
    grammar_ms_per_token: int = 20
    pipeline_parallel: int = 1  # stage processes the model's layers run in; 1 is this process alone
