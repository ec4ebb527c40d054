"""Speculative decoding: propose several tokens cheaply, verify them in one step of the real model.

Two proposers. `NgramProposer` looks the sequence's last few tokens up in its own prompt and
output and proposes what followed them there (prompt lookup: no extra model, strong when the answer
copies its input). `DraftModelProposer` runs a smaller model with the same vocabulary for K steps.
Verification keeps the target's output exact: greedy sequences keep a draft token only where it is
the target's argmax; sampled ones use standard rejection sampling, which leaves the target's
distribution unchanged (Leviathan et al. 2023; Chen et al. 2023).

config.py holds its settings, ngram.py and draft_model.py the proposers, draft_length.py the choice of
each step's length, verification.py the acceptance rule, and speculator.py what the engine asks of
them in a step.
"""
