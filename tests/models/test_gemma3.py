"""Gemma 3 270M, the second model family, against an independent reference: greedy output of
wafer's float32 path equals transformers' on the same GGUF (one prompt longer than the 512-token
window, so the windowed layers differ from global ones); the block-quantised paths' perplexity on
held text stays within 2% of float32's; and through the engine, a batch with chunked prefill gives
each sequence what it gets alone and whole (the runner's masks for both windows, in decode and in
prompt chunks)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from bench.quality import corpus_ids, perplexity
from tests.kernels.test_fused_decode import NATS, decode_logits
from tests.steps import advance, decode_items
from tests.tiny import hf_from_gguf
from wafer.engine.block_pool import HOLE
from wafer.engine.config import EngineConfig
from wafer.engine.engine import LLMEngine
from wafer.engine.kv_cache import KVCache
from wafer.engine.kv_layout import BLOCK, window_blocks
from wafer.engine.model_runner import ModelRunner
from wafer.engine.scheduler import ScheduledSeq
from wafer.engine.sequence import SamplingParams, Sequence
from wafer.kernels.build import runnable
from wafer.models import catalog
from wafer.kernels.fused_decode import FusedDecode
from wafer.models.gemma3 import Gemma3Model
from wafer.models.gguf_blocks import HEAD_BITS, K4, K6
from wafer.models.loader import LoadedModel, load_model
from wafer.models.quant import BlockLinear

pytestmark = pytest.mark.heavy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colours are"]
LONG_TOKENS = 900  # past the 512-token window
NEW_TOKENS = 32
PPL_TOKENS = 768  # one window of 768 tokens: positions past 512 see only the last 512 in 5 of 6 layers


@pytest.fixture(scope="module")
def path() -> Path:
    found = catalog.installed_path(catalog.find("gemma-3-270m"))  # type: ignore[arg-type]
    if found is None:
        pytest.skip("gemma-3-270m is not installed (`wafer models install`, which `make test` runs)")
    return found


@pytest.fixture(scope="module")
def f32(path) -> LoadedModel:
    loaded = load_model(str(path), compute="f32")
    yield loaded
    del loaded
    gc.collect()


@pytest.fixture(scope="module")
def prompts(f32) -> list[list[int]]:
    tok = f32.tokenizer
    short = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    return short + [[tok.bos_id] + corpus_ids(tok, LONG_TOKENS)]


def greedy(loaded: LoadedModel, prompts: list[list[int]], tokens: int = NEW_TOKENS, **config) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(**{"max_running": len(prompts), "max_model_len": 1024,
                                               "max_batched_tokens": 1024, "prefix_caching": False, **config}))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [s.output_ids for s in seqs]


def test_config_is_gemma3_270m(f32):
    c = f32.config
    assert isinstance(f32.model, Gemma3Model)
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    assert c.windows == ([512] * 5 + [None]) * 3
    assert c.rope_theta == 1e6 and c.extra["rope_local_theta"] == 1e4 and c.tie_word_embeddings


# The form of Gemma 3's instruction-tuned models' template: no system turn (a system message is
# folded into the first user turn), the assistant's turns under the role "model", text parts trimmed,
# images as <start_of_image>. The 270M file is a base model and carries no template; files that do
# are rendered by the generic Jinja renderer, held here against transformers' own.
GEMMA_IT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""


def test_a_gemma_chat_template_renders_as_transformers_does(f32):
    from transformers.utils.chat_template_utils import render_jinja_template

    from wafer.models.chat_template import ChatTemplate, TemplateError

    tok = f32.tokenizer
    bos = tok.bos_token
    template = ChatTemplate(GEMMA_IT_TEMPLATE, bos_token=bos)
    chat = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": " What is 2+2? "}]},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    mine = template.render(chat)
    theirs = render_jinja_template([chat], chat_template=GEMMA_IT_TEMPLATE, add_generation_prompt=True,
                                   bos_token=bos)
    theirs = theirs[0][0] if isinstance(theirs, tuple) else theirs
    assert mine == theirs
    assert mine.endswith("<end_of_turn>\n<start_of_turn>model\n") and "user\nAnswer briefly.\n\nWhat is 2+2?" in mine
    ids = tok.encode(mine, add_special_tokens=False)  # the template writes the BOS itself
    turn_ids = {tok.tokenizer.token_to_id("<start_of_turn>"), tok.tokenizer.token_to_id("<end_of_turn>")}
    assert None not in turn_ids and ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    # Three turns' markers and the reply's opening, each the vocabulary's own token, not spelled out.
    assert sum(i in turn_ids for i in ids) == 7
    with pytest.raises(TemplateError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_sentencepiece_without_space_prefix(f32):
    # Gemma's file sets tokenizer.ggml.add_space_prefix false: "The" at the start is not "▁The".
    tok = f32.tokenizer
    ids = tok.encode("The capital", add_special_tokens=True)
    assert ids[0] == tok.bos_id and [tok.id_to_token(i) for i in ids[1:]] == ["The", "▁capital"]
    assert tok.decode(tok.encode("  two spaces\n\nnewlines")) == "  two spaces\n\nnewlines"


def test_greedy_equals_transformers_on_five_prompts_one_past_the_window(path, f32, prompts):
    """Each of wafer's 32 greedy tokens is transformers' argmax after the prompt and the tokens
    before it (one forward pass over the whole text: what greedy decoding is, without 32 steps of
    transformers' per-token overhead); the long prompt is also decoded by transformers' generate."""
    assert len(prompts[-1]) > 800
    ours = greedy(f32, prompts)

    hf = hf_from_gguf(path)
    assert hf.config.sliding_window == 512 and hf.config.layer_types[5] == "full_attention"
    try:
        with torch.inference_mode():
            for prompt, mine in zip(prompts, ours):
                assert len(mine) == NEW_TOKENS and len(set(mine)) > 8  # real text, not one token repeated
                logits = hf(torch.tensor([prompt + mine]), logits_to_keep=NEW_TOKENS + 1).logits[0, :-1]
                ref = logits.argmax(-1).tolist()
                assert mine == ref, (len(prompt), f32.tokenizer.decode(mine), f32.tokenizer.decode(ref))
                print(f"{len(prompt)}-token prompt: {NEW_TOKENS} greedy tokens, each transformers' argmax")
            long = prompts[-1]
            ref = hf.generate(torch.tensor([long]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(long):].tolist()
            assert ours[-1] == ref
            print(f"{len(long)}-token prompt: equal to transformers' generate")
    finally:
        del hf
        gc.collect()


@pytest.fixture(scope="module")
def q4(path) -> LoadedModel:
    loaded = load_model(str(path), compute="q4")
    assert loaded.compute == "q4", loaded.warning
    formats = {m.fmt for m in loaded.model.modules() if isinstance(m, BlockLinear)}
    # the file's Q4_K, Q6_K and Q5_0 layers as they are; its Q8_0 ones (and Q5_0 beside them) in 8; the head in 6
    assert formats == {K4, K6, 5, 8, HEAD_BITS}
    return loaded


def test_q4_and_q8_perplexity_within_two_percent_of_f32(path, f32, q4):
    ids = [f32.tokenizer.bos_id] + corpus_ids(f32.tokenizer, PPL_TOKENS - 1)
    ref = perplexity(f32, ids, PPL_TOKENS, PPL_TOKENS)
    assert 1 < ref < 60  # the reference is sane for a small base model on English prose
    ppl = perplexity(q4, ids, PPL_TOKENS, 256)  # steps of 256 rows: the block kernels' batches
    assert ppl <= 1.02 * ref, ("q4", ppl, ref)
    q8 = load_model(str(path), compute="auto")  # the file's weights are mostly 5- and 8-bit: auto runs q8
    assert q8.compute == "q8", q8.warning
    ppl8 = perplexity(q8, ids, PPL_TOKENS, 256)
    print(f"perplexity on {len(ids)} tokens: f32 {ref:.4f}, q4 {ppl:.4f} ({ppl / ref:.4f}), q8 {ppl8:.4f} ({ppl8 / ref:.4f})")
    assert ppl8 <= 1.02 * ref, ("q8", ppl8, ref)


@pytest.fixture(scope="module")
def long_alone(q4, prompts) -> list[int]:
    """q4's 12 greedy tokens after the long prompt, alone in its engine and prefilled in one step: the
    reference of both tests below, computed once (a fresh engine each time gives the same tokens)."""
    return greedy(q4, [prompts[-1]], 12)[0]


@pytest.mark.parametrize("variant", [v.name for v in runnable()])
def test_fused_step_matches_the_python_model(path, prompts, variant):
    """The C++ step (decode.h) with Gemma's block (head norms, output norms, GeGLU, the windowed
    layers' own RoPE base and window) against gemma3.py on the same 8-bit weights, decoding past the
    window: every row within the quantisation noise of the bundled model's test, and some rows the
    same logits to float rounding, the long sequence's among them (it attends past the window). The
    other rows differ by up to ~3% of the largest logit where one path's rounding puts an activation
    on the other side of an int8 code: which rows do is chance (2 to 5 of 12 between builds that
    round differently), but a path that computed something else, even slightly, would have none."""
    q8 = load_model(str(path), compute="auto")
    kv = KVCache(q8.config, 1, 16)
    assert q8.compute == "q8" and FusedDecode.build(q8.model, kv.layers, kv.blocks.layer_group) is not None
    chosen = [prompts[-1][:600], prompts[0]]  # 600: the long one's decode steps attend past the window
    close = []
    for fused, python in decode_logits(q8, chosen, 8, variant, max_len=640):
        for i, (f, p) in enumerate(zip(fused, python)):
            lf, lp = f.log_softmax(-1), p.log_softmax(-1)
            top = lp.topk(10).indices
            assert (lf[top] - lp[top]).abs().max() < NATS
            # The fused step's choice is the reference's best within the noise bound (as in the bundled
            # model's test): where two tokens lie closer than that, either may come first.
            assert lp[int(f.argmax())] >= lp.max() - NATS
            if (f - p).abs().max() < 1e-3 * p.abs().max():
                close.append(i)
    assert len(close) >= 2 and 0 in close, close


def test_batched_with_chunked_prefill_equals_each_alone_and_whole(q4, prompts, long_alone):
    chosen = [prompts[-1], prompts[0]]
    alone = [long_alone, greedy(q4, [prompts[0]], 12)[0]]  # each prompt in one prefill step
    batched = greedy(q4, chosen, 12, max_batched_tokens=160)  # the 900-token prompt in chunks, beside decodes
    assert batched == alone


def test_prefix_cache_speculation_and_int8_kv_keep_the_greedy_output(q4, prompts, long_alone):
    """The default model's other engine paths on Gemma 3: a prompt that repeats a finished one's
    prefix references its blocks (across the 512-token window), n-gram speculation, and int8 KV
    (whose perplexity over twice the window stays within 0.5% of f32 KV's)."""
    from wafer.engine.speculative.config import SpeculativeConfig

    long, short = prompts[-1], prompts[0]
    want = long_alone
    engine = LLMEngine(q4, EngineConfig(max_running=2, max_model_len=1024, max_batched_tokens=1024))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.generate([long[:700] + short], params)
    again = engine.generate([long], params)[0]
    assert again.num_cached_prompt == 688 and again.output_ids == want
    spec = greedy(q4, [long], 12, speculative=SpeculativeConfig(method="ngram", num_tokens=4))
    assert spec == [want]
    ids = [q4.tokenizer.bos_id] + corpus_ids(q4.tokenizer, 1023)
    exact = perplexity(q4, ids, 1024, 512, torch.float32)
    rounded = perplexity(q4, ids, 1024, 512, torch.int8)
    assert rounded != exact and rounded <= 1.005 * exact, (rounded, exact)


def windowed_run(loaded: LoadedModel, prompt: list[int], windows: bool, chunk: int = 128,
                 steps: int = 6) -> tuple[list[torch.Tensor], KVCache]:
    """The prompt in chunks, then greedy decode steps, each followed by set_length as in the
    engine (where windowed layers give back what has left their window): each step's logits."""
    kv = KVCache(loaded.config, 1, 2048, max_step=chunk, window_pool=None if windows else 0)
    runner = ModelRunner(loaded.model, kv)
    seq = Sequence(list(prompt), SamplingParams())
    seq.slot, _ = kv.blocks.allocate()
    for start in range(0, len(prompt) - 1, chunk):
        n = min(chunk, len(prompt) - 1 - start)
        runner.run([ScheduledSeq(seq, start, n)])
        kv.blocks.set_length(seq.slot, start + n)
    seq.num_cached = len(prompt) - 1
    logits = []
    for _ in range(steps):
        out = runner.run(decode_items([seq]))
        logits.append(out[0])
        advance([seq], out)
        kv.blocks.set_length(seq.slot, seq.num_cached)
    return logits, kv


@pytest.mark.parametrize("which", ["q4", "f32"])  # the fused C++ step, and the Python model
def test_windowed_layers_hold_their_window_only_and_the_logits_do_not_change(f32, q4, which):
    """1,200 tokens, past two windows: the windowed layers give their blocks back as the window
    passes them (their pool, sized for the window, is smaller than the context), and every step's
    logits equal those of a cache that keeps every token in every layer."""
    loaded = q4 if which == "q4" else f32
    assert (ModelRunner(loaded.model, KVCache(loaded.config, 1, 16)).fused is not None) == (which == "q4")
    prompt = [loaded.tokenizer.bos_id] + corpus_ids(loaded.tokenizer, 1199)
    kept, whole = windowed_run(loaded, prompt, windows=False)
    got, kv = windowed_run(loaded, prompt, windows=True)
    for a, b in zip(got, kept):
        assert torch.equal(a, b)
    glob, windowed = kv.blocks.groups
    assert windowed.window == 512 and kv.blocks.layer_group.count(1) == 15
    assert windowed.num_blocks < kv.blocks.max_blocks  # the context could not fit without giving blocks back
    n = len(prompt) + 5
    held = [b for b in kv.blocks.blocks_of(0, 1) if b != HOLE]
    assert len(held) == -(-n // BLOCK) - windowed.needed_from(n) and len(kv.blocks.blocks_of(0, 0)) == -(-n // BLOCK)
    # At most: the global layers' every block, and the windowed layers' window and a chunk (0.60 of
    # the whole cache at this length; 32K tokens are the bench's).
    bound = -(-n // BLOCK) * glob.bytes_per_block + window_blocks(512, 128) * windowed.bytes_per_block
    assert kv.blocks.peak_bytes <= bound < 0.65 * whole.blocks.peak_bytes, (kv.blocks.peak_bytes, bound, whole.blocks.peak_bytes)


def test_served_through_the_openai_sdk_past_the_window_and_from_the_prefix_cache(q4, prompts, long_alone):
    """Gemma 3 behind the server, the official client: the long prompt's greedy answer equals the
    engine's, streamed and not, and sent again it is served from the prefix cache (its global
    layers' blocks and its windowed layers' last window)."""
    import openai

    from tests.serving import start_server

    server = start_server(q4, names=["gemma-3-270m"])
    try:
        # The engine sizes the windowed layers' pool for a window and a step (256 tokens) per slot.
        kv = server.engine.kv
        assert kv.blocks.groups[1].num_blocks == 16 * window_blocks(512, 256) < 16 * kv.blocks.max_blocks
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        long = prompts[-1]
        want = q4.tokenizer.decode(long_alone)
        first = client.completions.create(model="gemma-3-270m", prompt=long, max_tokens=12, temperature=0)
        assert first.choices[0].text == want and first.usage.prompt_tokens == len(long)
        again = client.completions.create(model="gemma-3-270m", prompt=long, max_tokens=12, temperature=0)
        assert again.choices[0].text == want
        assert again.usage.prompt_tokens_details.cached_tokens == (len(long) - 1) // BLOCK * BLOCK
        stream = client.completions.create(model="gemma-3-270m", prompt=long, max_tokens=12, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    finally:
        server.stop()
