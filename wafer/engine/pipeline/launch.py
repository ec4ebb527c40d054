"""Starting an engine's pipeline: the model's layers split among the stages by cost, the first
range kept in this process, the others' processes started (or awaited, under torchrun)."""

from __future__ import annotations

import logging
import os

import torch

from wafer.engine.config import EngineConfig
from wafer.engine.executor import Fail
from wafer.engine.kv_cache import KVCache
from wafer.engine.model_runner import ModelRunner
from wafer.engine.pipeline.costs import measured_costs
from wafer.engine.pipeline.executor import PipelineExecutor
from wafer.engine.pipeline.spec import StageSpec
from wafer.engine.pipeline.steps import PipelineSteps
from wafer.models.llama import LlamaModel
from wafer.models.loader import LoadedModel
from wafer.models.stage import keep_stage, layer_costs, split_layers

log = logging.getLogger("wafer.engine")


def start_pipeline(loaded: LoadedModel, cfg: EngineConfig, kv: KVCache, max_model_len: int, num_blocks: int,
                   max_step: int, window_pool: int, fail: Fail) -> PipelineSteps:
    """Split the model's layers among the stages, keep the first range here, and start the rest
    (their KV pools laid out as `kv`'s: `num_blocks`, `max_step` and `window_pool` as it was made with)."""
    model = loaded.model
    if not isinstance(model, LlamaModel) or model.rotary.cos.device.type != "cpu" or loaded.path.is_dir():
        raise ValueError("pipeline stages run Llama-family GGUF models on the CPU")
    # The machine's cores, shared among the stages it starts: each process computes on its share.
    # (Stages that torchrun starts on other machines take their own machine's, and rank 0 keeps its.)
    threads = max(1, len(os.sched_getaffinity(0)) // cfg.pipeline_parallel) if cfg.pipeline_spawn else 0
    # Contiguous layer ranges of equal cost, measured on a stage's threads where the fused step
    # runs (else by the bytes of weights each layer reads).
    costs = measured_costs(model, kv.dtype, threads or torch.get_num_threads()) or layer_costs(model)
    ranges = split_layers(*costs, cfg.pipeline_parallel)
    # Receive buffers that hold a whole step of max_batched_tokens (drafts included) and its
    # logits at max_running rows; a larger message goes in two transfers.
    drafts = cfg.max_running * cfg.speculative.num_tokens if cfg.speculative.method != "off" else 0
    hidden_bytes = (cfg.max_batched_tokens + drafts) * model.config.hidden_size * 4
    spec = StageSpec(str(loaded.path), loaded.compute, ranges, kv.dtype, kv.blocks.num_slots,
                     max_model_len, num_blocks, threads, max_step, window_pool,
                     step_capacity=2 * hidden_bytes + (1 << 16),
                     logits_capacity=cfg.max_running * model.config.vocab_size * 4 + (1 << 12))
    keep_stage(model, *ranges[0])
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    log.info("pipeline of %d stages, layers %s", cfg.pipeline_parallel, ranges)
    pipe = PipelineExecutor(ModelRunner(model, kv), spec, cfg.pipeline_parallel, cfg.pipeline_host,
                            cfg.pipeline_port, cfg.pipeline_spawn, cfg.pipeline_timeout)
    return PipelineSteps(pipe, fail, threads_before)
