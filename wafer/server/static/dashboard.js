// Polls /dashboard/data once a second and draws line charts on canvases; no libraries.
"use strict";
const HISTORY = 300;
const series = { tps: [[]], ttft: [[], []], e2e: [[], []], rw: [[], []], kv: [[]], err: [[]] };
const COLORS = ["#4fc3f7", "#ffb74d"];
let prev = null;

function push(name, values) {
  values.forEach((v, i) => {
    const s = series[name][i];
    s.push(v === null || v === undefined ? NaN : v);
    if (s.length > HISTORY) s.shift();
  });
}

function draw(name) {
  const canvas = document.getElementById("c_" + name);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, w, h);
  const all = series[name].flat().filter((v) => !Number.isNaN(v));
  const floor = name === "err" || name === "rw" ? 1 : 1e-9;  // counts: at least a scale of one
  const max = Math.max(floor, ...all) * 1.1;
  ctx.strokeStyle = "#2a2f3a"; ctx.fillStyle = "#9aa0a6"; ctx.font = "11px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const y = h - 14 - (h - 24) * i / 4;
    ctx.beginPath(); ctx.moveTo(40, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText((max * i / 4).toPrecision(3), 2, y + 4);
  }
  series[name].forEach((s, k) => {
    ctx.strokeStyle = COLORS[k]; ctx.lineWidth = 1.5; ctx.beginPath();
    let started = false;
    s.forEach((v, i) => {
      if (Number.isNaN(v)) { started = false; return; }
      const x = 40 + (w - 40) * i / (HISTORY - 1);
      const y = h - 14 - (h - 24) * v / max;
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    });
    ctx.stroke();
  });
}

function fmt(v) { return v === null || v === undefined ? "–" : v.toFixed(3); }

async function tick() {
  try {
    const r = await fetch("/dashboard/data", { cache: "no-store" });
    const d = await r.json();
    let tps = 0;
    if (prev) {
      const dt = d.time - prev.time;
      if (dt > 0) tps = Math.max(0, (d.generation_tokens_total - prev.generation_tokens_total) / dt);
    }
    prev = d;
    const errors = Object.values(d.errors).reduce((a, b) => a + b, 0);
    document.getElementById("model").textContent = d.model;
    document.getElementById("tps").textContent = tps.toFixed(1);
    document.getElementById("ttft").textContent = fmt(d.ttft_p50) + " / " + fmt(d.ttft_p95);
    document.getElementById("e2e").textContent = fmt(d.e2e_p50) + " / " + fmt(d.e2e_p95);
    document.getElementById("rw").textContent = d.running + " / " + d.waiting;
    document.getElementById("kv").textContent = (100 * d.kv_cache_usage).toFixed(1) + "%";
    document.getElementById("req").textContent = d.requests_total;
    document.getElementById("err").textContent = errors;
    push("tps", [tps]); push("ttft", [d.ttft_p50, d.ttft_p95]); push("e2e", [d.e2e_p50, d.e2e_p95]);
    push("rw", [d.running, d.waiting]); push("kv", [100 * d.kv_cache_usage]); push("err", [errors]);
    Object.keys(series).forEach(draw);
  } catch (e) {
    // The server may be restarting; try again on the next tick.
  }
}

tick();
setInterval(tick, 1000);
