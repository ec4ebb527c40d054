"""Speculative decoding: propose several tokens cheaply, verify them in one step of the real model.

Two proposers. `NgramProposer` looks the sequence's last few tokens up in its own prompt and
output and proposes what followed them there (prompt lookup: no extra model, strong when the answer
copies its input). `DraftModelProposer` runs a smaller model with the same vocabulary for K steps.
Verification keeps the target's output exact: greedy sequences keep a draft token only where it is
the target's argmax; sampled ones use rejection sampling (over a node's candidates in turn, against
the residual), which leaves the target's distribution unchanged (Leviathan et al. 2023; Chen et al.
2023; Miao et al. 2024).

A draft may be a tree of candidates sharing their prefixes, verified in the same one pass (a chain
is its one-path case). config.py holds its settings, ngram.py and draft_model.py the proposers,
draft_length.py the choice of each step's length, draft_tree.py a draft's shape (positions, masks,
where an accepted path's KV goes), verification.py the acceptance rule, grammatical.py the cut of
a draft under a grammar (tool calls, `response_format`; verification masks each row it samples),
and speculator.py what the engine asks of them in a step.
"""
