// Programs view: runs of @function programs (requests sharing a session_id), calls in order.

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
      el("p", { class: "muted" }, `${s.calls.length} calls · ${s.cached_tokens} of ${s.prompt_tokens} prompt tokens from the cache (${percent(s.cached_tokens, s.prompt_tokens)})`),
      el("table", { class: "grid" },
        el("tr", {}, ["#", "rid", "state", "prompt", "cached", "", "out", "TTFT", "e2e"].map((h) => el("th", {}, h))),
        s.calls.map((c, i) => el("tr", { class: "clickable", onclick: () => this.app.openRequest(c.rid) },
          el("td", {}, i + 1), el("td", {}, c.rid.slice(0, 12)), el("td", {}, c.state), el("td", {}, c.prompt_tokens),
          el("td", {}, c.cached_tokens), el("td", {}, cacheBar(c.cached_tokens, c.prompt_tokens)),
          el("td", {}, c.completion_tokens), el("td", {}, seconds(c.ttft)), el("td", {}, seconds(c.e2e))))))));
  }
}
