"""Pipeline parallelism: a model's layers in N stage processes, tokens flowing from stage to stage.

Rank 0 is the engine's own process: it schedules, samples and runs the first stage (the embedding
and the first layers). Ranks 1..N-1 each hold a contiguous range of the layers (the last one the
head) and their own KV pools, with the same blocks as rank 0's cache, whose tables travel with each
step. Activations go from rank to rank, and the logits (or, for a step that only wants each row's
argmax, the tokens) from the last rank back to rank 0, with torch.distributed's point-to-point
operations on a gloo process group (NCCL's would serve GPUs).

Up to N steps are in flight at once, each over different sequences (the engine splits the running
batch): while the last stage computes one step, the first computes the next, so that every stage
works while the others do. Results come back in the order the steps went out.

On one machine rank 0 starts the other stages itself (PipelineExecutor's `spawn`); across machines
`torchrun` starts them (`python -m wafer.engine.pipeline`: stage.py). A stage that dies or hangs fails
the steps in flight (StageFailure); rank 0 then starts the stages it owns again.
"""
