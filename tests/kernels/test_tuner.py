"""The tuner: it keeps the fastest of its candidates, a tuning made for another CPU or other kernels
is not used, a tuned model computes exactly what the untuned one does, and the machine probes
measure something real."""

from __future__ import annotations

import json
import time

import pytest
import torch

from wafer.kernels import build, tuner, tuning
from wafer.kernels.tuning import Shape, ShapeTuning, Tuning


@pytest.fixture(scope="module")
def active():
    s = build.status()
    assert s.variant is not None, s.problem  # every CPU builds at least the portable variant
    return build.load(s.variant), s.variant


@pytest.fixture(scope="module")
def smollm_shapes(smollm):
    shapes = tuner.shapes_of(smollm.model)
    assert shapes, "the default compute path runs the block kernels"
    return shapes


@pytest.fixture
def clean_table(active):
    module, _ = active
    yield module
    tuning.apply(module, build.tuned(build.status().variant))


def test_the_tuner_keeps_the_fastest_candidate_when_the_others_are_made_slow(active, smollm_shapes):
    """Real kernel runs; every candidate but one does its work five times over (by a margin that the
    noise of a shared machine's neighbours does not close)."""
    module, _ = active
    shape, packed = max(smollm_shapes.items(), key=lambda kv: kv[1].numel())
    run = tuner.stream_runner(module, packed, shape, total=32 << 20)
    cands = tuner.candidates(packed)
    for fast in (cands[0], cands[-1]):
        def slowed(ahead: int, fast: int = fast) -> float:
            return sum(run(ahead) for _ in range(1 if ahead == fast else 5))

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a busy neighbour then slows a run by its share of one core, not by a barrier's wait
        try:
            times = tuner.time_candidates(slowed, cands, rounds=5)
        finally:
            torch.set_num_threads(threads)
        assert tuner.choose(times, tuner.default_ahead(packed)) == fast


def test_the_default_stays_unless_another_is_clearly_faster():
    steady = [1.0, 1.0, 1.0, 1.0, 1.0]
    assert tuner.choose({0: [0.99] * 5, 4096: steady}, 4096) == 4096  # within the margin
    assert tuner.choose({0: [0.90] * 5, 4096: steady}, 4096) == 0
    assert tuner.choose({0: [1.2] * 5, 4096: steady, 16384: [0.5] * 5}, 4096) == 16384
    # faster at the median, but the rounds overlap: a busy machine's noise, not a faster distance
    assert tuner.choose({0: [0.6, 0.7, 0.8, 1.1, 1.3], 4096: [0.9, 1.0, 1.0, 1.2, 1.4]}, 4096) == 4096


def test_candidates_hold_none_and_the_kernels_own_default(active, smollm_shapes, clean_table):
    module = clean_table
    module.set_prefetch([])
    for shape, packed in smollm_shapes.items():
        assert tuner.default_ahead(packed) == module.prefetch_ahead(shape.fmt, shape.out, shape.inp)
        assert tuner.candidates(packed)[0] == 0 and tuner.default_ahead(packed) in tuner.candidates(packed)
    assert tuner.default_ahead(smollm_shapes[Shape(4, 576, 1536)]) == 48 * 320  # 1536 / 32 records of 320 bytes


def _tuning(name: str, ahead: int, **key_changes: str) -> Tuning:
    key = {**tuning.key_for(name, build.fingerprint(build.BY_NAME[name])), **key_changes}
    return Tuning(key=key, threads=2, read_gbps={1: 10.0}, int8_ops={1: 1e11},
                  shapes=[ShapeTuning(Shape(4, 576, 1536), ahead, 48 * 320, 1.2)])


@pytest.mark.parametrize("change", [{"model_name": "Some Other CPU"}, {"model": "999"}, {"flags": "0" * 16},
                                    {"kernels": "0" * 16}, {"variant": "portable-x"},
                                    {"format": "0"}])
def test_a_tuning_made_elsewhere_is_ignored(tmp_path, active, change):
    _, variant = active
    path = tuning.path_in(tmp_path, variant)
    mine = tuning.key_for(variant, build.fingerprint(build.BY_NAME[variant]))
    tuning.save(path, _tuning(variant, 512, **change))
    assert tuning.load(path, mine) is None
    tuning.save(path, _tuning(variant, 512))
    loaded = tuning.load(path, mine)
    assert loaded is not None and loaded.shapes[0].ahead == 512


def test_an_unreadable_tuning_is_ignored(tmp_path, active):
    _, variant = active
    path = tuning.path_in(tmp_path, variant)
    path.write_text("{not json")
    assert tuning.load(path, tuning.key_for(variant, "x")) is None
    path.write_text(json.dumps({"format": 1}))
    assert tuning.load(path, tuning.key_for(variant, "x")) is None


def test_a_saved_tuning_is_what_the_kernels_load_and_use(tmp_path, monkeypatch, active, clean_table):
    module, variant = active
    monkeypatch.setenv("WAFER_KERNELS_DIR", str(tmp_path))
    build.tuned.cache_clear()
    try:
        assert build.tuned(variant) is None
        tuning.save(tuning.path_in(build.build_dir(), variant), _tuning(variant, 768))
        build.tuned.cache_clear()
        t = build.tuned(variant)
        assert t is not None and t.shapes[0].ahead == 768
        tuning.apply(module, t)
        assert module.prefetch_ahead(4, 576, 1536) == 768
        assert module.prefetch_ahead(4, 576, 576) == 18 * 320  # untuned: one group's row
    finally:
        monkeypatch.undo()
        build.tuned.cache_clear()


@pytest.mark.parametrize("variant", [v.name for v in build.runnable()])
def test_every_distance_computes_the_same_product(variant, smollm_shapes):
    module = build.load(variant)
    for shape, packed in smollm_shapes.items():
        x = torch.randn(3, shape.inp)
        want = module.block_linear(x, packed, shape.out, tuner.default_ahead(packed))
        for ahead in tuner.candidates(packed) + [64, 100_000]:
            assert torch.equal(module.block_linear(x, packed, shape.out, ahead), want), (shape, ahead)


def test_a_tuned_model_generates_what_the_untuned_one_does(smollm, smollm_shapes, clean_table):
    from wafer.engine.config import EngineConfig
    from wafer.engine.engine import LLMEngine
    from wafer.engine.sequence import SamplingParams

    module = clean_table
    prompt = smollm.tokenizer.encode("The lighthouse keeper looked at the sea and", add_special_tokens=False)

    def generate() -> tuple[list[int], list[float]]:
        engine = LLMEngine(smollm, EngineConfig(max_running=1, max_model_len=256, prefix_caching=False))
        seq = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, logprobs=1))[0]
        return list(seq.output_ids), [float(lp.logprob) for lp in seq.logprobs]

    module.set_prefetch([])
    untuned = generate()
    for ahead in (0, 64, 16384):
        module.set_prefetch([(s.fmt, s.out, s.inp, ahead) for s in smollm_shapes])
        assert all(module.prefetch_ahead(s.fmt, s.out, s.inp) == ahead for s in smollm_shapes)
        assert generate() == untuned, ahead


def test_the_probes_measure_the_machine(active):
    module, _ = active
    buf = torch.ones(64 << 20, dtype=torch.uint8)
    t0 = time.perf_counter()
    took = module.read_pass(buf)
    assert 0 < took <= time.perf_counter() - t0
    gbps = buf.numel() / took / 1e9
    assert 0.1 < gbps < 10_000  # a real read of 64 MiB, not an elided loop
    def seconds(iterations: int) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            assert module.int8_peak(iterations) > 0
            best = min(best, time.perf_counter() - t0)
        return best

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no waiting on another core's thread, which a busy machine would add
    try:
        seconds(1_000)
        assert seconds(1_000_000) > 4 * seconds(100_000)  # the loop runs as long as it is asked, not folded away
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def own_kernels_dir(tmp_path, monkeypatch):
    """A WAFER_KERNELS_DIR of this test's own, the variants' builds linked in: tunings go there."""
    real = build.build_dir()
    monkeypatch.setenv("WAFER_KERNELS_DIR", str(tmp_path))
    mine = build.build_dir()
    mine.mkdir(parents=True)
    for v in build.runnable():
        (mine / v.name).symlink_to(real / v.name)
    build.tuned.cache_clear()
    yield mine
    monkeypatch.undo()
    build.tuned.cache_clear()


def test_tuning_installed_shapes_saves_merges_and_shows_in_wafer_info(own_kernels_dir, smollm_shapes, clean_table,
                                                                       monkeypatch):
    import os
    import subprocess
    import sys

    monkeypatch.setattr(tuner, "STREAM_BYTES", 16 << 20)  # the same measurements, smaller
    monkeypatch.setattr(tuner, "PROBE_BYTES", 64 << 20)
    module = clean_table
    first, second = sorted(smollm_shapes, key=lambda s: s.out * s.inp)[:2]
    said: list[str] = []
    path = tuner.tune_installed({first: smollm_shapes[first]}, say=said.append)
    assert path == tuning.path_in(own_kernels_dir, build.status().variant) and path.exists()
    tuner.tune_installed({second: smollm_shapes[second]}, say=said.append)
    saved = build.tuned(build.status().variant)
    assert saved is not None and {s.shape for s in saved.shapes} == {first, second}  # the first kept
    assert saved.read_gbps[1] > 0 and saved.int8_ops[1] > 0
    for s in saved.shapes:
        assert module.prefetch_ahead(s.shape.fmt, s.shape.out, s.shape.inp) == s.ahead
    out = subprocess.run([sys.executable, "-m", "wafer.cli", "info"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "WAFER_KERNELS_DIR": os.environ["WAFER_KERNELS_DIR"]})
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("kernel tuning"))
    assert "tuned for this CPU: 2 linear shapes" in line
    assert f"{saved.read_gbps[1]:.1f} GB/s on 1 thread" in line and "int8 TOPS" in line


def test_a_read_pass_takes_each_distance_and_refuses_a_negative_one(active):
    module, _ = active
    buf = torch.ones(16 << 20, dtype=torch.uint8)
    for ahead in tuner.FIXED_DISTANCES:
        assert module.read_pass(buf, ahead) > 0
    with pytest.raises(RuntimeError, match="ahead"):
        module.read_pass(buf, -1)
