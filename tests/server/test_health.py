"""/health names what computes each model (path, kernel variant, CPU features) and carries the
warning of any fallback, so that a slow path is never silent."""

from __future__ import annotations

import dataclasses

import httpx

from tests.serving import MODEL, start_server
from wafer.kernels import build as kernels


def test_health_names_the_compute_path_and_kernels(server):
    body = httpx.get(server.base_url + "/health").json()
    (model,) = body["models"]
    best = kernels.runnable()[0].name
    assert model["name"] == MODEL and model["path"] == "q4"
    assert model["kernels"].startswith(f"wafer {best} (") and kernels.machine() in model["kernels"]
    assert model["warning"] is None and body["warnings"] == []


def test_health_carries_a_fallbacks_warning(smollm):
    slow = dataclasses.replace(smollm, compute="int8", kernels="PyTorch", warning="wafer's kernels could not be built")
    s = start_server(slow)
    try:
        body = httpx.get(s.base_url + "/health").json()
        assert body["status"] == "ok"
        assert body["warnings"] == [f"{MODEL}: wafer's kernels could not be built"]
        assert body["models"][0]["path"] == "int8"
    finally:
        s.stop()
