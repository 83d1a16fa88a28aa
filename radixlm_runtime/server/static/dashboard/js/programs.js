// Programs view: runs of @function programs, as the call graph the frontend traced (each call under
// the one it follows), or, for clients that send only a session_id, its requests in order.

import { getJSON } from "./api.js";
import { $, cacheBar, el, fill, percent, seconds } from "./dom.js";

export class ProgramsView {
  constructor(app) {
    this.app = app;
  }

  async refresh() {
    const { sessions } = await getJSON("/dashboard/api/programs");
    if (!sessions.length) {
      fill($("programs"), el("p", { class: "muted" }, "No program runs yet: requests with a session_id appear here."));
      return;
    }
    fill($("programs"), sessions.map((s) => el("div", { class: "program", dataset: { session: s.session_id } },
      el("h2", {}, s.program, " ", el("span", { class: "muted" }, s.session_id), " ",
        s.pinned ? el("span", { class: "badge locked", title: "its KV stays pinned for the next call" }, "pinned") : null),
      el("p", { class: "muted" }, `${s.calls.length} requests · ${s.cached_tokens} of ${s.prompt_tokens} prompt tokens from the cache (${percent(s.cached_tokens, s.prompt_tokens)})`),
      s.call_graph ? this.graph(s.calls) : this.table(s.calls))));
  }

  // Calls in arrival order.
  table(calls) {
    return el("table", { class: "grid" },
      el("tr", {}, ["#", "rid", "state", "prompt", "cached", "", "out", "TTFT", "e2e"].map((h) => el("th", {}, h))),
      calls.map((c, i) => el("tr", { class: "clickable", onclick: () => this.app.openRequest(c.rid) },
        el("td", {}, i + 1), el("td", {}, c.rid.slice(0, 12)), el("td", {}, c.state), el("td", {}, c.prompt_tokens),
        el("td", {}, c.cached_tokens), el("td", {}, cacheBar(c.cached_tokens, c.prompt_tokens)),
        el("td", {}, c.completion_tokens), el("td", {}, seconds(c.ttft)), el("td", {}, seconds(c.e2e)))));
  }

  // The call graph as the frontend traced it: each call under the one it follows (a fork's branches
  // under the call before the fork), its requests (a select sends two) on one line.
  graph(calls) {
    const byCall = new Map();
    for (const c of calls) {
      const key = c.program_call ? c.program_call.call : c.rid;
      if (!byCall.has(key)) byCall.set(key, { info: c.program_call, requests: [] });
      byCall.get(key).requests.push(c);
    }
    const kids = new Map();
    const roots = [];
    for (const [key, node] of byCall) {
      const parent = node.info && node.info.parent;
      if (parent && byCall.has(parent)) {
        if (!kids.has(parent)) kids.set(parent, []);
        kids.get(parent).push(key);
      } else {
        roots.push(key);
      }
    }
    const rows = [];
    const walk = (key, depth) => {
      const node = byCall.get(key);
      const prompt = node.requests.reduce((n, c) => n + c.prompt_tokens, 0);
      const cached = node.requests.reduce((n, c) => n + c.cached_tokens, 0);
      const row = el("div", {
        class: "node-row clickable call", dataset: { call: key }, onclick: () => this.app.openRequest(node.requests[0].rid),
      },
      el("span", { class: "badge" }, node.info ? node.info.name || "call" : "request"),
      el("span", { class: "muted" }, key),
      el("span", {}, `${cached} / ${prompt} cached`), cacheBar(cached, prompt),
      node.requests.length > 1 ? el("span", { class: "muted" }, `${node.requests.length} requests`) : null);
      row.style.paddingLeft = `${depth * 1.2}em`; // through the CSSOM: the CSP refuses style attributes
      rows.push(row);
      for (const child of kids.get(key) || []) walk(child, depth + 1);
    };
    for (const key of roots) walk(key, 0);
    return el("div", { class: "call-graph" }, rows);
  }
}
