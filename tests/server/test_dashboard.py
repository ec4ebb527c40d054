"""The dashboard in a real headless Chromium: live figures, no console errors."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.serving import MODEL

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).resolve().parents[2] / "bench" / "out" / "dashboard.png"


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
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.base_url + "/dashboard")
            page.wait_for_function("parseFloat(document.getElementById('tps').textContent) > 0", timeout=30000)
            page.wait_for_timeout(3000)
            tps = float(page.inner_text("#tps"))
            requests_done = int(page.inner_text("#req"))
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            browser.close()
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert tps > 0 and requests_done > 0
    assert errors == []
