// Operator dashboard: polls /api/dashboard about once a second, keeps a short history, draws it.
const POLL_MS = 1000;
const HISTORY = 120; // samples (~2 minutes)
const COLORS = ["#7c5cff", "#2fbf71", "#f2a541", "#e5484d", "#3fb6e0", "#d66bd6", "#c8c85a", "#8a90a0"];
const token = new URLSearchParams(window.location.search).get("token");
const headers = token ? { Authorization: `Bearer ${token}` } : {};

const $ = (id) => document.getElementById(id);
const state = { polls: 0, last: null, history: [], errors: 0 };
window.diffcastDashboard = state;

const colorOf = new Map();
function color(streamId) {
  if (!colorOf.has(streamId)) colorOf.set(streamId, COLORS[colorOf.size % COLORS.length]);
  return colorOf.get(streamId);
}

const ms = (seconds) => (seconds === null || seconds === undefined ? "–" : `${Math.round(seconds * 1000)} ms`);
const esc = (text) => String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

function cell(text, cls = "") {
  const td = document.createElement("td");
  if (cls) td.className = cls;
  td.textContent = text;
  return td;
}

function renderWorkers(workers) {
  $("workers").replaceChildren(
    ...workers.map((w) => {
      const row = document.createElement("tr");
      const load = document.createElement("td");
      const pct = Math.min(100, Math.round(w.load * 100));
      load.innerHTML = `<span class="load"><span style="width:${pct}%"></span></span> ${pct}%`;
      const mine = document.createElement("td");
      mine.innerHTML = (w.stream_ids || []).map((id) => `<span style="color:${color(id)}">●</span> ${esc(id.slice(0, 8))}`).join(" ");
      row.dataset.worker = w.id;
      row.append(cell(w.draining ? `${w.id} (draining)` : w.id), cell(w.device), cell(w.model), cell(w.policy || "–"),
        cell(`${w.streams} / ${w.max_streams}`), load, cell(w.threads ?? "–"), cell(w.tiers.URGENT), cell(w.tiers.NORMAL), cell(w.tiers.RELAXED), mine);
      return row;
    }),
  );
}

function renderActions(actions) {
  $("no-actions").hidden = actions.length > 0;
  $("actions").replaceChildren(
    ...actions.slice(0, 12).map((a) => {
      const row = document.createElement("tr");
      const detail = Object.entries(a).filter(([k]) => !["t", "action", "stream", "worker"].includes(k))
        .map(([k, v]) => `${k} ${v}`).join(", ");
      row.append(cell(new Date(a.t * 1000).toLocaleTimeString()), cell(a.action), cell(a.stream ? a.stream.slice(0, 8) : "–"),
        cell(a.worker ?? "–"), cell(detail));
      return row;
    }),
  );
}

function renderStreams(streams) {
  $("no-streams").hidden = streams.length > 0;
  $("streams").replaceChildren(
    ...streams.map((s) => {
      const row = document.createElement("tr");
      row.dataset.stream = s.stream_id;
      const id = document.createElement("td");
      id.innerHTML = `<span style="color:${color(s.stream_id)}">●</span> <a href="/view/${esc(s.stream_id)}" target="_blank">${esc(s.stream_id.slice(0, 8))}</a>`;
      const tier = document.createElement("td");
      tier.innerHTML = `<span class="tier" data-tier="${esc(s.tier)}">${esc(s.tier)}</span>`;
      const latency = s.latency_p50_ms === null ? "–" : `${Math.round(s.latency_p50_ms)} / ${Math.round(s.latency_p95_ms)} ms`;
      // The stream's size, and the camera frames' as they arrive when they differ (a publisher
      // sending more pixels than the stream uses: docs/obs.md).
      const camera = s.input_width && (s.input_width !== s.width || s.input_height !== s.height)
        ? ` ← ${s.input_width}x${s.input_height}` : "";
      row.append(id, cell(s.kind), cell(`${s.width}x${s.height}${camera}`, "size"), tier, cell(ms(s.slack_s)),
        cell(ms(s.credit_s)), cell(Number(s.fps).toFixed(1)),
        cell(latency), cell(s.fidelity), cell(`${Math.round(s.chunk_ms)} ms`), cell(s.dropped_frames), cell(s.viewers),
        cell(s.prompt, "prompt"));
      return row;
    }),
  );
}

function renderTotals(data) {
  const t = data.totals;
  $("total-streams").textContent = `${t.streams} / ${t.max_streams}`;
  $("total-fps").textContent = Number(t.output_fps).toFixed(1);
  $("total-viewers").textContent = String(t.viewers);
  $("total-tiers").textContent = `${t.tiers.URGENT} / ${t.tiers.NORMAL} / ${t.tiers.RELAXED}`;
  const load = data.workers.reduce((sum, w) => sum + w.load, 0);
  $("total-load").textContent = `${Math.round(load * 100)}%`;
}

const TIER_COLORS = { URGENT: "#e5484d", NORMAL: "#f2a541", RELAXED: "#2fbf71" };
const perStream = (key) => (sample) => sample.streams.map((s) => [s.stream_id, s[key], color(s.stream_id)]);
const perTier = (sample) => Object.entries(TIER_COLORS).map(([tier, c]) => [tier, sample.totals.tiers[tier], c]);

// One line per series over the history; y from 0 to the largest value seen (at least `floor`).
// `seriesOf(sample)` gives [id, value, color] rows: one per stream, or one per tier.
function drawChart(canvas, seriesOf, floor) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, width, height);
  const pad = { left: 34, right: 6, top: 6, bottom: 14 };
  const series = new Map();
  let top = floor;
  const colors = new Map();
  state.history.forEach((sample, i) => {
    for (const [id, value, c] of seriesOf(sample)) {
      if (!series.has(id)) series.set(id, []);
      series.get(id).push([i, value]);
      colors.set(id, c);
      top = Math.max(top, value);
    }
  });
  const x = (i) => pad.left + (i / Math.max(1, HISTORY - 1)) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - (v / top) * (height - pad.top - pad.bottom);
  ctx.strokeStyle = "#2a2e38";
  ctx.fillStyle = "#8a90a0";
  ctx.font = "10px system-ui, sans-serif";
  for (const frac of [0, 0.5, 1]) {
    const value = top * frac;
    ctx.beginPath();
    ctx.moveTo(pad.left, y(value));
    ctx.lineTo(width - pad.right, y(value));
    ctx.stroke();
    ctx.fillText(value >= 10 ? value.toFixed(0) : value.toFixed(2), 2, y(value) + 3);
  }
  ctx.fillText(`last ${state.history.length} s`, pad.left, height - 2);
  for (const [id, points] of series) {
    ctx.strokeStyle = colors.get(id);
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    points.forEach(([i, v], n) => (n ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    ctx.stroke();
  }
}

function render(data) {
  renderTotals(data);
  renderWorkers(data.workers);
  renderActions(data.actions || []);
  renderStreams(data.streams);
  drawChart($("chart-slack"), perStream("slack_s"), 0.5);
  drawChart($("chart-fidelity"), perStream("fidelity_steps"), 4);
  drawChart($("chart-tiers"), perTier, 2);
  drawChart($("chart-fps"), perStream("fps"), 10);
}

async function poll() {
  try {
    const response = await fetch("/api/dashboard", { headers });
    if (response.status === 401 && !token) {
      // The server has --api-token: log in once (an HttpOnly cookie), then come back.
      window.location.assign(`/login?next=${encodeURIComponent(window.location.pathname)}`);
      return;
    }
    if (!response.ok) throw new Error(`${response.status} ${(await response.json().catch(() => ({}))).detail || ""}`);
    const data = await response.json();
    state.last = data;
    state.polls += 1;
    state.history.push(data);
    if (state.history.length > HISTORY) state.history.shift();
    render(data);
    $("status").textContent = "live";
    $("status").dataset.state = "live";
    $("notice").hidden = true;
  } catch (error) {
    state.errors += 1;
    $("status").textContent = "offline";
    $("status").dataset.state = "error";
    $("notice").textContent = `Could not read /api/dashboard: ${error.message}`;
    $("notice").hidden = false;
  }
}

poll();
setInterval(poll, POLL_MS);
