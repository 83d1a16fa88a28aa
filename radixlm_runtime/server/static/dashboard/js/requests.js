// Requests view: running, queued and recent requests; a request's prompt with its cached prefix.

import { getJSON, postJSON } from "./api.js";
import { $, cacheBar, el, fill, kv, oneLine, seconds } from "./dom.js";

const COLUMNS = ["rid", "state", "prio", "session", "prompt", "cached", "", "out", "TTFT", "ITL", "e2e", "finish", "prompt text"];

export class RequestsView {
  constructor(app) {
    this.app = app;
  }

  async refresh() {
    const snap = await getJSON("/dashboard/api/requests?max_recent=200");
    fill($("live-count"), `(${snap.live_total}; ${snap.num_compiling} compiling a constraint)`);
    fill($("live-table"), this.header(true), snap.live.map((r) => this.row(r, true)));
    fill($("recent-table"), this.header(false), snap.recent.map((r) => this.row(r, false)));
  }

  header(live) {
    return el("tr", {}, [...COLUMNS, live ? "" : null].filter((h) => h !== null).map((h) => el("th", {}, h)));
  }

  row(r, live) {
    const finish = r.finish ? r.finish.type ?? JSON.stringify(r.finish) : "";
    return el("tr", { class: "clickable", dataset: { rid: r.rid }, onclick: () => this.open(r.rid) },
      el("td", { title: r.rid }, r.rid.slice(0, 12)), el("td", {}, r.state), el("td", {}, r.priority),
      el("td", { title: r.session_id ?? "" }, r.session_id ? r.session_id.slice(0, 20) : ""),
      el("td", {}, r.prompt_tokens), el("td", {}, r.cached_tokens), el("td", {}, cacheBar(r.cached_tokens, r.prompt_tokens)),
      el("td", {}, r.completion_tokens), el("td", {}, seconds(r.ttft)), el("td", {}, seconds(r.itl)), el("td", {}, seconds(r.e2e)),
      el("td", {}, finish), el("td", { class: "muted" }, oneLine(r.preview).slice(0, 80)),
      live ? el("td", {}, el("button", { onclick: (e) => { e.stopPropagation(); this.abort(r.rid); } }, "abort")) : null);
  }

  async abort(rid) {
    try {
      await postJSON("/abort_request", { rid });
      this.app.setStatus(`abort sent for ${rid}`);
    } catch (e) {
      this.app.setStatus(`abort failed: ${e.message}`);
    }
  }

  async open(rid) {
    const panel = $("request-detail");
    try {
      const { request: r } = await getJSON(`/dashboard/api/request/${encodeURIComponent(rid)}`);
      const shown = r.prompt_shown_tokens < r.prompt_tokens ? ` (first ${r.prompt_shown_tokens} tokens shown)` : "";
      fill(panel,
        el("h2", {}, `Request ${r.rid}`),
        kv([
          ["state", r.state], ["priority", String(r.priority)], ["session", r.session_id ?? "—"],
          ["prompt tokens", `${r.prompt_tokens}, ${r.cached_tokens} from the cache`],
          ["output tokens", `${r.completion_tokens} of at most ${r.max_new_tokens}`],
          ["TTFT / ITL / e2e", `${seconds(r.ttft)} / ${seconds(r.itl)} / ${seconds(r.e2e)}`],
          ["finish", r.finish ? JSON.stringify(r.finish) : "—"],
        ]),
        el("h2", {}, `Prompt${shown}`, " ", el("span", { class: "badge", title: "green: from the cache" }, "cached"), " ",
          el("span", { class: "badge" }, "computed")),
        r.cached_text === null ? el("p", { class: "muted" }, "[redacted]")
          : el("div", { class: "prompt", id: "request-prompt" }, el("span", { class: "cached" }, r.cached_text), el("span", { class: "uncached" }, r.uncached_text)),
        el("h2", {}, "Output"),
        el("div", { class: "prompt" }, r.output_text === null ? "[redacted]" : r.output_text));
    } catch (e) {
      fill(panel, el("p", { class: "error" }, String(e.message)));
    }
  }
}
