// Metrics over time: the server samples its counters once a second; the page fetches only the
// samples it has not seen and draws the chosen window (uPlot, vendored).

import { getJSON } from "./api.js";
import { $, el, fill } from "./dom.js";

const KEPT = 3600;

function rate(samples, key) {
  return samples.map((s, i) => {
    if (i === 0) return null;
    const dt = s.t - samples[i - 1].t;
    return dt > 0 ? (s[key] - samples[i - 1][key]) / dt : null;
  });
}

function hitRate(samples) {
  return samples.map((s, i) => {
    if (i === 0) return null;
    const prompt = s.prompt_tokens - samples[i - 1].prompt_tokens;
    return prompt > 0 ? (100 * (s.cached_tokens - samples[i - 1].cached_tokens)) / prompt : null;
  });
}

const CHARTS = [
  { title: "Throughput", series: [["generated tok/s", (s) => rate(s, "generated_tokens"), "#2563eb"],
    ["prompt tok/s", (s) => rate(s, "prompt_tokens"), "#9333ea"], ["requests/s", (s) => rate(s, "finished_requests"), "#16a34a"]] },
  { title: "Requests", series: [["running", (s) => s.map((x) => x.num_running), "#2563eb"],
    ["queued", (s) => s.map((x) => x.num_waiting), "#ea580c"], ["compiling constraint", (s) => s.map((x) => x.num_compiling), "#9333ea"],
    ["in flight (HTTP)", (s) => s.map((x) => x.inflight), "#6b7280"]] },
  { title: "Cache hit rate (%)", series: [["prompt tokens from cache, per interval", hitRate, "#16a34a"],
    ["cumulative", (s) => s.map((x) => (x.prompt_tokens ? (100 * x.cached_tokens) / x.prompt_tokens : null)), "#6b7280"]] },
  { title: "KV pool (% of slots)", series: [["in use", (s) => s.map((x) => (100 * (x.max_total_tokens - x.free_tokens)) / (x.max_total_tokens || 1)), "#2563eb"],
    ["held by the tree", (s) => s.map((x) => (100 * x.cached_tokens_in_tree) / (x.max_total_tokens || 1)), "#16a34a"],
    ["protected (locked)", (s) => s.map((x) => (100 * x.protected_tokens) / (x.max_total_tokens || 1)), "#b91c1c"]] },
];

export class MetricsView {
  constructor(app) {
    this.app = app;
    this.samples = [];
    this.plots = null;
    $("metrics-window").addEventListener("change", () => this.draw());
  }

  async refresh() {
    const since = this.samples.length ? this.samples[this.samples.length - 1].t : 0;
    const { samples } = await getJSON(`/dashboard/api/metrics?since=${since}`);
    this.samples.push(...samples);
    if (this.samples.length > KEPT) this.samples.splice(0, this.samples.length - KEPT);
    this.draw();
  }

  draw() {
    const windowS = Number($("metrics-window").value);
    const last = this.samples.length ? this.samples[this.samples.length - 1].t : 0;
    const shown = this.samples.filter((s) => s.t >= last - windowS);
    const latest = shown[shown.length - 1];
    fill($("metrics-summary"), latest
      ? `${shown.length} samples · running ${latest.num_running}, queued ${latest.num_waiting}, ${latest.cached_tokens_in_tree} tokens in the tree`
      : "no samples yet");
    if (!window.uPlot) return;
    if (!this.plots) this.plots = CHARTS.map((c) => this.makePlot(c));
    const xs = shown.map((s) => s.t);
    CHARTS.forEach((c, i) => this.plots[i].setData([xs, ...c.series.map(([, f]) => f(shown))]));
  }

  makePlot(chart) {
    const box = el("div", { class: "chart" });
    $("charts").append(box);
    const opts = {
      title: chart.title, width: 520, height: 220,
      series: [{}, ...chart.series.map(([label, , stroke]) => ({ label, stroke, width: 1.5, spanGaps: true }))],
      axes: [{}, { size: 50 }],
    };
    return new window.uPlot(opts, [[], ...chart.series.map(() => [])], box);
  }
}
