"""The serving defaults, in one place: EngineConfig, AsyncEngine, `wafer serve`'s options,
wafer.toml's engine options and the `wafer generate`/`chat` engine all take theirs from here."""

MAX_RUNNING = 16  # sequences decoded together
MAX_WAITING = 64  # requests queued before a 429
MAX_MODEL_LEN = 4096  # context per served sequence (an engine made without one takes the model's)
# Tokens a step computes, decode tokens and prompt chunks together. Small, so that a step is short
# before the engine has learned the cost of a token; PREFILL_STEP_SECONDS bounds it after that.
MAX_BATCHED_TOKENS = 256
# A served step takes at most about this long of prompts' work: the streams wait that long for their
# next token while a long prompt is read in, and the loop that steps the engine (and answers every
# other request) is held that long (issue 19 bounds it at 100 ms, the step's own overhead included).
PREFILL_STEP_SECONDS = 0.05
