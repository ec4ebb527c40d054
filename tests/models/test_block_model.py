"""GGUF models built from their blocks (block_model.py): the same weights as the float route, a
record cache that is used only while it matches, and the real tiers' shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from wafer.models import block_model
from wafer.models.gguf_loader import GGUFFile
from wafer.models.loader import default_model_path, load_model
from wafer.models.quant import HEAD_BITS, BlockLinear, apply_compute_path


def records(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.packed for name, m in model.named_modules() if isinstance(m, BlockLinear)}


def test_default_model_records_equal_the_float_route(smollm_f32):
    """SmolLM2's Q4_1 blocks read directly are exactly what quantising their float32 values gives
    (quant.py's route before this one), so its answers on the default path do not change."""
    import copy

    direct = load_model(compute="q4")
    assert direct.compute == "q4"
    via_float = apply_compute_path(copy.deepcopy(smollm_f32.model), "q4")
    a, b = records(direct.model), records(via_float)
    assert a.keys() == b.keys() and len(a) == 4 * direct.config.num_layers + 1
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert direct.num_parameters == smollm_f32.num_parameters
    ids = torch.tensor([1, 504, 3575, 282])
    assert torch.equal(direct.model.embed_tokens(ids), smollm_f32.model.embed_tokens(ids))


def test_q8_holds_4_bit_blocks_exactly(smollm_f32):
    """On q8, the file's 4-bit blocks become 8-bit records with their own codes: the layer computes
    with the file's exact weights (only the activations are quantised), where quantising the float
    values to 8 bits again would add an error of its own."""
    import copy

    from wafer.models.blockquant import quantize_activations

    direct = load_model(compute="q8")
    via_float = apply_compute_path(copy.deepcopy(smollm_f32.model), "q8")
    w = smollm_f32.model.layers[3].mlp.down_proj.weight.detach()
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0))
    exact = quantize_activations(x) @ w.T
    err_direct = (direct.model.layers[3].mlp.down_proj(x) - exact).abs().max().item()
    err_float = (via_float.layers[3].mlp.down_proj(x) - exact).abs().max().item()
    assert err_direct < 1e-4 * exact.abs().max().item()
    assert err_float > 10 * err_direct


def test_record_cache_is_read_back_and_keyed_by_the_file(tmp_path, monkeypatch):
    import shutil

    gguf = tmp_path / "model.gguf"
    shutil.copy(default_model_path(), gguf)
    cache = tmp_path / "records"
    monkeypatch.setenv("WAFER_RECORD_CACHE", str(cache))
    monkeypatch.setattr(block_model, "CACHE_MIN_BYTES", 0)
    first = load_model(str(gguf), compute="q4")
    images = list(cache.glob("*.bin"))
    assert len(images) == 1 and images[0].stat().st_size > 50e6

    converted = []
    monkeypatch.setattr(block_model, "_convert", lambda *a: converted.append(a))
    second = load_model(str(gguf), compute="q4")
    assert not converted  # read from the cache
    if Path("/proc/self/maps").exists():  # mapped from the file, not copied; padded to whole 2 MB pages
        assert str(images[0]) in Path("/proc/self/maps").read_text()
        assert images[0].stat().st_size % (2 << 20) == 0
    for (name, a), b in zip(records(first.model).items(), records(second.model).values()):
        assert torch.equal(a, b), name

    os.utime(gguf, ns=(1, 1))  # the file changed: its old records must not be used
    monkeypatch.undo()
    monkeypatch.setenv("WAFER_RECORD_CACHE", str(cache))
    monkeypatch.setattr(block_model, "CACHE_MIN_BYTES", 0)
    third = load_model(str(gguf), compute="q4")
    assert [p.name for p in cache.glob("*.bin")] != [images[0].name]  # replaced, not added to
    assert len(list(cache.glob("*.bin"))) == 1
    assert torch.equal(next(iter(records(third.model).values())), next(iter(records(first.model).values())))


def test_a_truncated_cache_is_converted_again(tmp_path, monkeypatch):
    import shutil

    gguf = tmp_path / "model.gguf"
    shutil.copy(default_model_path(), gguf)
    monkeypatch.setenv("WAFER_RECORD_CACHE", str(tmp_path / "records"))
    monkeypatch.setattr(block_model, "CACHE_MIN_BYTES", 0)
    good = load_model(str(gguf), compute="q4")
    [image] = (tmp_path / "records").glob("*.bin")
    with open(image, "r+b") as f:
        f.truncate(1000)
    again = load_model(str(gguf), compute="q4")
    for a, b in zip(records(good.model).values(), records(again.model).values()):
        assert torch.equal(a, b)


def test_plan_keeps_the_files_precision():
    """On q4, 4-bit types get 4-bit records and wider ones 8-bit; the head (Q8_0) HEAD_BITS; on q8 all 8."""
    f = GGUFFile(default_model_path())
    q4 = block_model.plan(f.config, f, "q4")
    assert {lp.fmt for lp in q4[:-1]} == {4} and q4[-1].fmt == HEAD_BITS and q4[-1].module == "lm_head"
    assert {lp.fmt for lp in block_model.plan(f.config, f, "q8")} == {8}
    assert q4[0].parts[0].endswith("q_proj.weight") and len(q4[0].parts) == 3


def test_plan_gives_k_quants_records_of_their_own():
    """Qwen2.5-Coder-0.5B's Q4_K_M file: its down projections are Q4_K in some layers and Q6_K in
    others, and get K4 and K6 records; its Q5_0 layers (gate and up, o) 5-bit ones; qkv (Q5_0 beside
    a Q8_0 V in some layers) 8-bit ones. The same on q4 and q8, but for the Q8_0 head: HEAD_BITS on q4."""
    from gguf import GGMLQuantizationType as T

    from wafer.models import catalog
    from wafer.models.gguf_blocks import K4, K6

    entry = catalog.find("Qwen2.5-Coder-0.5B-Instruct")
    path = catalog.installed_path(entry) if entry is not None else None
    if path is None:
        pytest.skip("Qwen2.5-Coder-0.5B is not installed (make setup installs it)")
    f = GGUFFile(path)
    q4 = block_model.plan(f.config, f, "q4")
    for lp in q4:
        types = {f.raw(p)[1] for p in lp.parts}
        want = {frozenset({T.Q4_K}): K4, frozenset({T.Q6_K}): K6, frozenset({T.Q5_0}): 5}.get(frozenset(types), 8)
        want = HEAD_BITS if lp.module == "lm_head" else want
        assert lp.fmt == want, (lp.module, types)
    assert {lp.fmt for lp in q4 if lp.module.endswith("down_proj")} == {K4, K6}
    assert {lp.fmt for lp in q4 if lp.module.endswith(("gate_up_proj", "o_proj"))} == {5}
    assert q4[-1].fmt == HEAD_BITS and {lp.fmt for lp in q4 if lp.module.endswith("qkv_proj")} <= {5, 8}
    q8 = block_model.plan(f.config, f, "q8")
    assert [lp.fmt for lp in q8[:-1]] == [lp.fmt for lp in q4[:-1]] and q8[-1].fmt == 8


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parts_that_end_mid_group_and_rope_rows(tmp_path, arch):
    """Q, K and V of 8 rows each (a KV head of dim 8) stack mid-group; llama's Q and K rows come
    permuted in the file. The direct records still equal the float route's."""
    import copy

    from gguf import GGMLQuantizationType

    from tests.tiny import hf_to_gguf, make_hf_model

    hf = make_hf_model(tmp_path / "hf", arch, hidden_size=96, intermediate_size=128, num_attention_heads=12,
                       num_key_value_heads=1)
    path = hf_to_gguf(hf, tmp_path / "m.gguf", GGMLQuantizationType.Q4_1)
    direct = load_model(str(path), compute="q4")
    via_float = apply_compute_path(copy.deepcopy(load_model(str(path), compute="f32").model), "q4")
    a, b = records(direct.model), records(via_float)
    assert direct.model.layers[0].self_attn.qkv_proj.out_features == 96 + 8 + 8
    for name in a:
        if name != "lm_head":  # the head keeps Q4_1's codes directly, quantised again to HEAD_BITS on the float route
            assert torch.equal(a[name], b[name]), name
    # The head holds the file's 4-bit values exactly in 4-bit records: only the activations are rounded.
    from wafer.models.blockquant import quantize_activations

    w = load_model(str(path), compute="f32").model.lm_head.weight.detach()
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    exact = quantize_activations(x) @ w.T
    assert (direct.model.lm_head(x) - exact).abs().max() < 1e-4 * exact.abs().max()
