// The dashboard shell: asks for the API key when the server needs one, then refreshes the visible
// view on a timer (one feed request per interval, none while the tab is hidden).

import { AuthError, getJSON, hasKey, setKey } from "./api.js";
import { $, fill } from "./dom.js";
import { CacheView } from "./cache.js";
import { MetricsView } from "./metrics.js";
import { Playground } from "./playground.js";
import { ProgramsView } from "./programs.js";
import { RequestsView } from "./requests.js";

class App {
  constructor() {
    this.model = null;
    this.views = {
      cache: new CacheView(this), requests: new RequestsView(this), programs: new ProgramsView(this),
      metrics: new MetricsView(this), playground: new Playground(this),
    };
    this.active = "cache";
    this.timer = null;
    for (const button of document.querySelectorAll("#tabs button")) {
      button.addEventListener("click", () => this.show(button.dataset.view));
    }
    $("refresh").addEventListener("change", () => this.schedule(0));
    document.addEventListener("visibilitychange", () => this.schedule(0));
    $("login-form").addEventListener("submit", (e) => {
      e.preventDefault();
      setKey($("api-key").value);
      this.start();
    });
  }

  async start() {
    try {
      if (!hasKey() && (await getJSON("/dashboard/auth")).api_key_required) throw new AuthError("no key yet");
      const overview = await getJSON("/dashboard/api/overview");
      this.model = overview.model;
      fill($("model"), `${overview.model}${overview.redact ? " · text redacted" : ""}`);
      $("login").hidden = true;
      $("app").hidden = $("tabs").hidden = $("refresh-ctl").hidden = false;
      this.show(this.active);
    } catch (e) {
      if (!(e instanceof AuthError)) throw e;
      const refused = hasKey();
      setKey(null);
      $("app").hidden = $("tabs").hidden = true;
      $("login").hidden = false;
      fill($("login-error"), refused ? "That key was refused." : "");
    }
  }

  show(view) {
    this.active = view;
    for (const button of document.querySelectorAll("#tabs button")) button.classList.toggle("active", button.dataset.view === view);
    for (const name of Object.keys(this.views)) $(`view-${name}`).hidden = name !== view;
    this.schedule(0);
  }

  /** Refreshes the active view after delay ms, then every interval; one timer at a time. */
  schedule(delay) {
    clearTimeout(this.timer);
    this.timer = null;
    const interval = Number($("refresh").value);
    if (document.hidden || (delay > 0 && !interval)) return;
    this.timer = setTimeout(() => this.tick(), delay);
  }

  async tick() {
    try {
      await this.views[this.active].refresh();
      this.setStatus(`updated ${new Date().toLocaleTimeString()}`);
    } catch (e) {
      if (e instanceof AuthError) { this.start(); return; }
      this.setStatus(`error: ${e.message}`);
    }
    const interval = Number($("refresh").value);
    if (interval && this.active !== "playground") this.schedule(interval);
  }

  setStatus(text) {
    fill($("status"), text);
  }

  openRequest(rid) {
    this.show("requests");
    this.views.requests.open(rid);
  }
}

new App().start();
