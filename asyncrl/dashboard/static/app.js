// asyncrl live dashboard: one EventSource, a store of series by metric name, uPlot charts.
// window.asyncrlDashboard exposes the store and the charts' data (the browser test reads it).
"use strict";

const COLORS = ["#2563eb", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04", "#db2777"];

// kind "lines": time series of the named metrics; "hist": the latest step's buckets of a prefix;
// "pattern": one line per metric name matching a regex (per-replica load).
const PANELS = [
  {id: "throughput", title: "Tokens/s: generated vs trained", kind: "lines",
   series: ["throughput/generated_tokens_per_s", "throughput/trained_tokens_per_s"]},
  {id: "reward", title: "Reward", kind: "lines", series: ["train/reward_mean"]},
  {id: "staleness", title: "Staleness of the latest step (responses by versions behind)", kind: "hist",
   prefix: "staleness/hist/", buckets: 9, also: ["staleness/mean", "staleness/max"]},
  {id: "stream", title: "Stream depth and credit", kind: "lines",
   series: ["stream/depth", "stream/credit", "stream/unacked"]},
  {id: "idle", title: "Idle ratios", kind: "lines",
   series: ["fully_async/trainer/idle_ratio", "fully_async/rollouter/idle_ratio"]},
  {id: "sync", title: "Weight sync durations (s)", kind: "lines",
   series: ["timing_s/param_sync", "timing_s/param_sync_pause", "timing_s/param_sync_transfer",
            "timing_s/param_sync_resume"]},
  {id: "lengths", title: "Response length (tokens); truncations marked", kind: "lines",
   series: ["response_length/p50", "response_length/p90", "response_length/max", "response_length/truncated"],
   marks: "response_length/truncated"},
  {id: "partial", title: "Partial rollouts: ages of the latest step", kind: "hist",
   prefix: "fully_async/partial/age_hist/", buckets: 5,
   also: ["fully_async/partial/total_partial_num", "fully_async/partial/max_partial_span"]},
  {id: "replicas", title: "Per-replica load (running requests)", kind: "pattern",
   pattern: /^engine\/(\d+)\/running$/, also: ["engine/queued", "engine/kv_tokens"]},
  {id: "loss", title: "Loss and grad norm", kind: "lines", series: ["train/loss", "train/grad_norm"]},
  {id: "agent", title: "Agent loops: turns per conversation, tool calls per turn, tool errors, Env.step s per turn",
   kind: "lines", series: ["agent/turns_mean", "agent/tool_calls_per_turn", "agent/tool_errors", "agent/env_step_s_per_turn"]},
];

const store = {series: new Map(), received: 0, lastStep: -1};
const charts = new Map();   // panel id -> {plot, key}
const dirty = new Set(PANELS.map(p => p.id));

function add(rows) {
  for (const [name, value, step, version, time] of rows) {
    let s = store.series.get(name);
    if (!s) { s = {t: [], v: [], step: []}; store.series.set(name, s); }
    s.t.push(time); s.v.push(value); s.step.push(step);
    if (step > store.lastStep) store.lastStep = step;
  }
  store.received += rows.length;
  PANELS.forEach(p => dirty.add(p.id));
}

function latest(name) {
  const s = store.series.get(name);
  return s && s.v.length ? s.v[s.v.length - 1] : undefined;
}

function fmt(v) {
  if (v === undefined) return "–";
  const a = Math.abs(v);
  return a !== 0 && (a < 0.01 || a >= 1e5) ? v.toExponential(2) : (Number.isInteger(v) ? String(v) : v.toFixed(3));
}

function seriesNames(p) {
  if (p.kind === "pattern") {
    return [...store.series.keys()].filter(n => p.pattern.test(n))
      .sort((a, b) => +a.match(p.pattern)[1] - +b.match(p.pattern)[1]);
  }
  if (p.kind === "hist") return Array.from({length: p.buckets}, (_, k) => p.prefix + k);
  return p.series;
}

// The chart's data: aligned [x, ...ys] (what uPlot draws); exposed for the browser test.
function panelData(p) {
  const names = seriesNames(p);
  if (p.kind === "hist") {
    const xs = names.map((_, k) => k);
    return [xs, names.map(n => latest(n) ?? 0)];
  }
  const tables = names.map(n => {
    const s = store.series.get(n) || {t: [], v: []};
    return [s.t, s.v];
  });
  if (!tables.length) return [[]];
  return uPlot.join(tables);
}

function makeChart(p, el, names) {
  const width = Math.max(300, el.clientWidth || 440);
  let opts;
  if (p.kind === "hist") {
    const last = p.buckets - 1;
    opts = {
      width, height: 200, legend: {show: false},
      scales: {x: {time: false, range: [-0.5, last + 0.5]}},
      axes: [{values: (u, ticks) => ticks.map(t => Number.isInteger(t) ? (t === last ? "≥" + t : String(t)) : "")},
             {}],
      series: [{}, {label: "responses", fill: "#2563eb88", stroke: "#2563eb",
                    paths: uPlot.paths.bars({size: [0.7, 60]}), points: {show: false}}],
    };
  } else {
    const series = [{}];
    names.forEach((n, i) => {
      const c = COLORS[i % COLORS.length];
      if (p.marks === n) {
        series.push({label: n.split("/").pop(), stroke: "#dc2626", scale: "marks", paths: () => null,
                     points: {show: true, size: 9, fill: "#dc2626", stroke: "#dc2626"}});
      } else {
        series.push({label: n.replace(/^.*?\//, ""), stroke: c, width: 1.5, spanGaps: true});
      }
    });
    const axes = [{}, {}];
    if (p.marks) axes.push({scale: "marks", side: 1, grid: {show: false}, label: "truncated"});
    opts = {width, height: 200, series, axes, scales: {x: {time: true}}, legend: {live: false}};
  }
  return new uPlot(opts, panelData(p), el);
}

function render() {
  for (const p of PANELS) {
    if (!dirty.has(p.id)) continue;
    dirty.delete(p.id);
    const root = document.querySelector(`[data-panel="${p.id}"]`);
    const names = seriesNames(p);
    const shown = p.kind === "hist" ? names.concat(p.also || []) : names.concat(p.also || []);
    const have = shown.filter(n => store.series.has(n));
    root.querySelector(".latest").innerHTML = have.map(n =>
      `<span data-series="${n}">${n.replace(p.prefix || /^$/, "")}: <b>${fmt(latest(n))}</b></span>`).join("");
    const el = root.querySelector(".chart");
    const hasData = names.some(n => store.series.has(n));
    root.dataset.points = String(names.reduce((a, n) => a + (store.series.get(n)?.v.length || 0), 0));
    if (!hasData) {
      if (!charts.has(p.id)) el.innerHTML = '<div class="empty">no data yet</div>';
      continue;
    }
    const key = names.join(",");
    let c = charts.get(p.id);
    if (!c || c.key !== key) {
      if (c) c.plot.destroy();
      el.innerHTML = "";
      c = {plot: makeChart(p, el, names), key};
      charts.set(p.id, c);
    } else {
      c.plot.setData(panelData(p));
    }
  }
}

function build() {
  const main = document.getElementById("panels");
  for (const p of PANELS) {
    const div = document.createElement("section");
    div.className = "panel";
    div.dataset.panel = p.id;
    div.dataset.points = "0";
    div.innerHTML = `<h2>${p.title}</h2><div class="latest"></div><div class="chart"></div>`;
    main.appendChild(div);
  }
}

function connect() {
  const status = document.getElementById("status");
  const es = new EventSource("/events");
  es.addEventListener("history", ev => {
    store.series.clear(); store.received = 0; store.lastStep = -1;
    add(JSON.parse(ev.data));
    status.textContent = "live";
  });
  es.addEventListener("metrics", ev => add(JSON.parse(ev.data)));
  es.onerror = () => { status.textContent = "disconnected: retrying…"; };
  setInterval(() => {
    render();
    status.dataset.received = String(store.received);
    if (status.textContent !== "disconnected: retrying…" && store.received)
      status.textContent = `live · ${store.received} events · step ${store.lastStep}`;
  }, 500);
}

fetch("/info").then(r => r.json()).then(info => {
  document.getElementById("title").textContent = info.title;
  document.title = `asyncrl · ${info.title}`;
});
build();
connect();

window.asyncrlDashboard = {
  store, charts, panels: PANELS,
  panelData: id => panelData(PANELS.find(p => p.id === id)),
  latest,
};
