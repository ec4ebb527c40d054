"""The real default model: wafer against transformers' load of the same GGUF file."""

from __future__ import annotations

import torch

from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.sequence import SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain how a bicycle works to a child.",
    "Give me three tips for writing clean Python code.",
    "What is 17 times 23? Show your reasoning.",
]


def test_greedy_tokens_match_transformers(smollm_f32, smollm_hf, hf_tok):
    smollm = smollm_f32
    eos = smollm.tokenizer.eos_ids[0]
    prompts = []
    for q in CHATS:
        msgs = [{"role": "user", "content": q}]
        text = smollm.chat_template.render(msgs)
        assert text == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = smollm.tokenizer.encode(text, add_special_tokens=False)
        assert ids == hf_tok(text, add_special_tokens=False).input_ids
        prompts.append(ids)
    engine = LLMEngine(smollm, EngineConfig(max_running=8, max_model_len=1024))
    # EOS is suppressed on both sides so that every prompt yields 32 comparable tokens.
    params = SamplingParams(max_tokens=32, temperature=0, logit_bias={eos: -1e9})
    ours = [s.output_ids for s in engine.generate(prompts, params)]
    for ids, got in zip(prompts, ours):
        ref = smollm_hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert got == ref[0, len(ids):].tolist()
