"""The dashboard in a real headless Chromium: live figures, no console errors, charts that say when
they have nothing to show and label their axes in their series' units."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.serving import MODEL, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).resolve().parents[2] / "bench" / "out" / "dashboard.png"
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"]
# Records every text each canvas drew since it was last cleared: what a reader of the chart sees,
# whatever the page does to draw it.
RECORD_CANVAS_TEXT = """
window.__drawn = {};
const P = CanvasRenderingContext2D.prototype, clear = P.clearRect, fill = P.fillText;
P.clearRect = function (...a) { window.__drawn[this.canvas.id] = []; return clear.apply(this, a); };
P.fillText = function (text, ...a) {
  (window.__drawn[this.canvas.id] ||= []).push(String(text));
  return fill.call(this, text, ...a);
};
"""


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
def test_dashboard_shows_live_tokens_per_second(server):
    from playwright.sync_api import sync_playwright

    stop = threading.Event()

    def load():
        while not stop.is_set():
            httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24,
                "ignore_eos": True})

    workers = [threading.Thread(target=load) for _ in range(2)]
    for w in workers:
        w.start()
    errors: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.base_url + "/dashboard")
            tps = page.wait_for_function("parseFloat(document.getElementById('tps').textContent) || null",
                                         timeout=30000).json_value()
            # Until a request has finished, however long the machine's other load makes one take.
            requests_done = page.wait_for_function("parseInt(document.getElementById('req').textContent) || null",
                                                   timeout=120000).json_value()
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            browser.close()
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert tps > 0 and requests_done > 0
    assert errors == []


@pytest.fixture()
def idle_server(smollm):
    s = start_server(smollm)
    yield s
    s.stop()


def tile_seconds(text: str) -> list[float]:
    """'412 ms / 1.50 s' as seconds."""
    out = []
    for part in text.split("/"):
        value, unit = part.split()
        out.append(float(value) / (1000 if unit == "ms" else 1))
    return out


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
def test_charts_say_when_empty_and_label_axes_in_units(idle_server):
    from playwright.sync_api import sync_playwright

    server = idle_server
    empty_state = {"c_tps": "no tokens generated yet", "c_ttft": "no requests finished in the last 60 s",
                   "c_e2e": "no requests finished in the last 60 s", "c_rw": "no requests running or waiting",
                   "c_kv": "KV cache empty", "c_err": "no errors"}
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.add_init_script(RECORD_CANVAS_TEXT)
        page.goto(server.base_url + "/dashboard")
        page.wait_for_function(f"Object.keys(window.__drawn).length === {len(empty_state)}", timeout=30000)
        page.wait_for_timeout(2500)  # a few polls of an idle server: every series all zero or empty
        idle = page.evaluate("window.__drawn")
        # An idle server's charts: the empty state alone, no scale made up for zeros (1.10e-9, ...).
        assert idle == {k: [v] for k, v in empty_state.items()}, idle

        for i in range(2):
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=120, json={
                    "model": MODEL, "stream": True, "max_tokens": 24, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Story {i}: " + "once upon a time " * 60}]}) as r:
                assert r.status_code == 200
                r.read()
        page.wait_for_function("(window.__drawn.c_ttft || []).length > 1", timeout=30000)
        page.wait_for_timeout(1500)
        drawn = page.evaluate("window.__drawn")
        data = httpx.get(server.base_url + "/dashboard/data").json()
        tiles = {k: page.inner_text("#" + k) for k in ("ttft", "e2e")}
        browser.close()
    for chart in ("c_ttft", "c_e2e"):
        assert drawn[chart] and all(re.fullmatch(r"\d+(\.\d+)? (ms|s)", t) for t in drawn[chart]), drawn[chart]
    assert drawn["c_tps"] and all(re.fullmatch(r"\d+(\.\d+)? tok/s", t) for t in drawn["c_tps"]), drawn["c_tps"]
    assert drawn["c_err"] == ["no errors"]
    for chart, texts in drawn.items():
        assert not any(re.search(r"\de[-+]?\d", t) for t in texts), (chart, texts)
    # The tiles show the same percentiles as /dashboard/data, to the digits they print.
    for key, text in tiles.items():
        for shown, exact in zip(tile_seconds(text), (data[f"{key}_p50"], data[f"{key}_p95"])):
            half_digit = 0.005 if exact >= 1 else 0.0005  # '1.23 s' or '412 ms'
            assert abs(shown - exact) <= half_digit + 1e-9, (key, text, exact)
    assert errors == []
