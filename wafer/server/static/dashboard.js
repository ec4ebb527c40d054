// Polls /dashboard/data once a second and draws line charts on canvases; no libraries.
"use strict";
const HISTORY = 300;
// Each chart's unit (its axis is labelled in it) and what it says while it has nothing to show.
const CHARTS = {
  tps: { unit: "tok/s", empty: "no tokens generated yet" },
  ttft: { unit: "s", empty: "no requests finished in the last 60 s" },
  e2e: { unit: "s", empty: "no requests finished in the last 60 s" },
  rw: { unit: "count", empty: "no requests running or waiting" },
  kv: { unit: "%", empty: "KV cache empty" },
  err: { unit: "count", empty: "no errors" },
};
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

// A round step (1, 2 or 5 times a power of ten) that splits [0, max] into at most four parts;
// counts never get a step under one.
function niceStep(max, unit) {
  const raw = max / 4;
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
  return unit === "count" ? Math.max(1, Math.ceil(step)) : step;
}

// A tick's label in the series' unit, with as many decimals as the step needs and no more.
function tickLabel(v, step, unit, top) {
  const decimals = (s) => Math.max(0, -Math.floor(Math.log10(s) + 1e-9));
  if (unit === "s") {
    if (top < 1) return (v * 1000).toFixed(decimals(step * 1000)) + " ms";
    return v.toFixed(decimals(step)) + " s";
  }
  if (unit === "count") return String(Math.round(v));
  const text = v.toFixed(decimals(step));
  return unit === "%" ? text + "%" : text + " " + unit;
}

function draw(name) {
  const { unit, empty } = CHARTS[name];
  const canvas = document.getElementById("c_" + name);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px sans-serif";
  const all = series[name].flat().filter((v) => Number.isFinite(v));
  const peak = Math.max(0, ...all);
  if (peak <= 0) {  // nothing yet, or only zeros: a scale for them would be made up
    ctx.fillStyle = "#6b7280"; ctx.textAlign = "center"; ctx.textBaseline = "middle";
    ctx.fillText(empty, w / 2, h / 2);
    return;
  }
  const step = niceStep(peak, unit);
  const top = step * Math.max(1, Math.ceil(peak / step - 1e-9));
  const left = 56;
  ctx.strokeStyle = "#2a2f3a"; ctx.fillStyle = "#9aa0a6"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let v = 0; v <= top + step / 2; v += step) {
    const y = h - 14 - (h - 24) * v / top;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText(tickLabel(v, step, unit, top), left - 6, y);
  }
  series[name].forEach((s, k) => {
    ctx.strokeStyle = COLORS[k]; ctx.lineWidth = 1.5; ctx.beginPath();
    let started = false;
    s.forEach((v, i) => {
      if (!Number.isFinite(v)) { started = false; return; }
      const x = left + (w - left) * i / (HISTORY - 1);
      const y = h - 14 - (h - 24) * v / top;
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    });
    ctx.stroke();
  });
}

// A duration for the tiles: milliseconds below a second, seconds above.
function duration(v) {
  if (v === null || v === undefined) return "–";
  if (v < 0.01) return (v * 1000).toFixed(1) + " ms";
  if (v < 1) return (v * 1000).toFixed(0) + " ms";
  return v.toFixed(2) + " s";
}

// A table's rows, one per key of `rows` (sorted), each the cells `cells` makes; left as it is while empty.
function table(selector, rows, cells) {
  const keys = Object.keys(rows || {}).sort();
  if (!keys.length) return;
  document.querySelector(selector + " tbody").replaceChildren(...keys.map((k) => {
    const row = document.createElement("tr");
    cells(k, rows[k]).forEach((v) => {
      const cell = document.createElement("td");
      cell.textContent = v;
      row.appendChild(cell);
    });
    return row;
  }));
}

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
    document.getElementById("ttft").textContent = duration(d.ttft_p50) + " / " + duration(d.ttft_p95);
    document.getElementById("e2e").textContent = duration(d.e2e_p50) + " / " + duration(d.e2e_p95);
    document.getElementById("rw").textContent = d.running + " / " + d.waiting;
    document.getElementById("kv").textContent = (100 * d.kv_cache_usage).toFixed(1) + "%";
    document.getElementById("req").textContent = d.requests_total;
    document.getElementById("err").textContent = errors;
    table("#agents", d.agents, (m, a) => [m, a.responses || 0, a.turns || 0, a.tokens_read || 0,
      a.tokens_written || 0, (a.seconds || 0).toFixed(1), (a.cost_usd || 0).toFixed(4)]);
    table("#tenants", d.tenants, (t, a) => [t, a.requests || 0, a.input_tokens || 0, a.output_tokens || 0,
      (a.cost_usd || 0).toFixed(4), a.errors || 0, a.rate_limited || 0]);
    const sp = d.speculation;
    if (sp && sp.drafts) {
      document.getElementById("spec").textContent = sp.drafts + " drafts in " + sp.steps + " decoding steps (" +
        (100 * sp.drafts / Math.max(1, sp.steps)).toFixed(0) + "% drafted), " +
        (sp.accepted_tokens / sp.drafts).toFixed(2) + " tokens kept per drafted step";
      table("#spec_methods", sp.methods, (m, a) => [m, a.drafts, a.draft_tokens, a.accepted_tokens,
        (a.accepted_tokens / Math.max(1, a.drafts)).toFixed(2),
        (100 * a.accepted_tokens / Math.max(1, a.draft_tokens)).toFixed(0) + "%"]);
    }
    push("tps", [tps]); push("ttft", [d.ttft_p50, d.ttft_p95]); push("e2e", [d.e2e_p50, d.e2e_p95]);
    push("rw", [d.running, d.waiting]); push("kv", [100 * d.kv_cache_usage]); push("err", [errors]);
    Object.keys(series).forEach(draw);
  } catch (e) {
    // The server may be restarting; try again on the next tick.
  }
}

tick();
setInterval(tick, 1000);
