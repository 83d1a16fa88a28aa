// Cache view: the radix tree as it is now, one row per node, children most recently used first.

import { getJSON } from "./api.js";
import { $, age, el, fill, kv, oneLine, seconds } from "./dom.js";

// Rows drawn at most; the rest are counted (collapse nodes or search to narrow).
const MAX_ROWS = 2000;
// Levels open before anyone clicks.
const OPEN_DEPTH = 3;

export class CacheView {
  constructor(app) {
    this.app = app;
    this.snapshot = null;
    this.toggled = new Set();
    this.selected = null;
    this.query = null;
    $("tree-max").addEventListener("change", () => this.refresh());
    $("tree-collapse").addEventListener("change", () => this.render());
    $("tree-search-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.query = $("tree-search").value.trim() || null;
      this.refresh();
    });
  }

  async refresh() {
    const params = new URLSearchParams({ max_nodes: $("tree-max").value });
    if (this.query) params.set("q", this.query);
    this.snapshot = await getJSON(`/dashboard/api/tree?${params}`);
    this.render();
  }

  render() {
    const snap = this.snapshot;
    if (!snap) return;
    if (!snap.enabled) {
      fill($("tree"), el("p", { class: "muted" }, "The radix cache is disabled on this server (--disable-radix-cache)."));
      return;
    }
    const nodes = new Map(snap.nodes.map((n) => [n.id, { ...n, kids: [], subtree: n.tokens }]));
    let root = null;
    for (const n of nodes.values()) {
      if (n.parent === null) root = n;
      else nodes.get(n.parent)?.kids.push(n);
    }
    for (const n of [...snap.nodes].reverse()) {
      const node = nodes.get(n.id);
      if (node.parent !== null && nodes.has(node.parent)) nodes.get(node.parent).subtree += node.subtree;
    }
    const onPath = new Set();
    if (this.query) {
      for (const n of nodes.values()) {
        if (!n.match) continue;
        for (let p = nodes.get(n.parent); p; p = nodes.get(p.parent)) onPath.add(p.id);
      }
    }
    const minTokens = Number($("tree-collapse").value) || 0;
    const rows = [];
    let hidden = 0;
    const walk = (node) => {
      if (rows.length >= MAX_ROWS) { hidden += 1; return; }
      const big = node.kids.filter((k) => k.subtree >= minTokens);
      const small = node.kids.filter((k) => k.subtree < minTokens);
      const openByDefault = node.depth < OPEN_DEPTH || onPath.has(node.id);
      const open = this.toggled.has(node.id) ? !openByDefault : openByDefault;
      rows.push(this.row(node, open, small.length, small.reduce((sum, k) => sum + k.subtree, 0)));
      if (open) big.forEach(walk);
    };
    if (root) walk(root);
    const matches = this.query ? snap.nodes.filter((n) => n.match).length : null;
    fill($("tree-summary"),
      `${snap.total_tokens} tokens cached of ${snap.max_total_tokens} (${snap.evictable_tokens} evictable, ${snap.protected_tokens} protected)` +
        (snap.host_tier_tokens ? `; host tier ${snap.host_tokens} of ${snap.host_tier_tokens}` : "") +
        (snap.disk_tier_tokens ? `; disk tier ${snap.disk_tokens} of ${snap.disk_tier_tokens}` : ""),
      ` · ${snap.nodes.length} nodes${snap.truncated ? " (truncated: raise the node limit)" : ""}`,
      ` · snapshot ${age(Math.max(0, Date.now() / 1000 - snap.taken_at))}`,
      matches === null ? "" : ` · ${matches} nodes match "${this.query}"`,
      hidden ? ` · ${hidden} more rows not drawn` : "");
    fill($("tree"), rows);
  }

  row(node, open, small, smallTokens) {
    const isRoot = node.parent === null;
    const hasKids = node.kids.length > 0;
    const lock = isRoot ? null : node.lock_ref > 0
      ? el("span", { class: "badge locked", title: `pinned by ${[...node.locked_by, ...(node.other_locks ? [`${node.other_locks} more (sessions)`] : [])].join(", ")}` }, `locked ×${node.lock_ref}`)
      : el("span", { class: "badge evictable" }, "evictable");
    const row = el("div", {
      class: `node-row${node.match ? " match" : ""}${this.selected === node.id ? " selected" : ""}`,
      role: "treeitem",
      dataset: { nodeId: node.id, hits: node.hits, tokens: node.tokens },
      onclick: () => this.select(node.id),
    },
    el("span", { class: "toggle", onclick: (e) => { e.stopPropagation(); this.toggle(node.id); } }, hasKids ? (open ? "▾" : "▸") : ""),
    el("span", { class: "badge" }, isRoot ? "root" : `${node.tokens} tok`),
    el("span", { class: "badge hits", title: "requests admitted with a cached prefix through this node" }, `${node.hits} hits`),
    lock,
    isRoot || node.tier === "device" ? null
      : el("span", { class: "badge", title: "where its KV is: the device pool, the host tier, the disk tier, or several" }, node.tier),
    el("span", { class: "text" }, isRoot ? "" : oneLine(node.text)),
    el("span", { class: "muted" }, isRoot ? "" : age(node.age_s)),
    small ? el("span", { class: "muted" }, `+${small} small (${smallTokens} tok)`) : null,
    node.omitted_children ? el("span", { class: "muted" }, `+${node.omitted_children} not fetched`) : null);
    row.style.paddingLeft = `${6 + 14 * node.depth}px`;
    return row;
  }

  toggle(id) {
    if (this.toggled.has(id)) this.toggled.delete(id);
    else this.toggled.add(id);
    this.render();
  }

  async select(id) {
    this.selected = id;
    this.render();
    const panel = $("node-detail");
    try {
      const { node, requests } = await getJSON(`/dashboard/api/node/${id}`);
      fill(panel,
        el("h2", {}, `Node ${node.id}`),
        kv([
          ["tokens", `${node.tokens} (ends at token ${node.prefix_tokens})`],
          ["hits", String(node.hits)],
          ["last access", age(node.age_s)],
          ["lock refs", node.lock_ref ? `${node.lock_ref}: ${node.locked_by.join(", ") || "—"}${node.other_locks ? ` + ${node.other_locks} session pin(s) or unnamed` : ""}` : "0"],
          ["state", node.evictable ? "evictable (LRU)" : "protected (pinned)"],
          ["tier", node.tier],
        ]),
        el("div", { class: "prompt" },
          node.prefix_text === null ? "[redacted]" : el("span", { class: "muted" }, node.prefix_text ? `…${node.prefix_text.slice(-300)}` : ""),
          node.text === null ? "" : el("span", { class: "cached" }, node.text)),
        el("h2", {}, `Requests that used it (${requests.length})`),
        requests.length ? el("table", { class: "grid" },
          el("tr", {}, ["rid", "state", "prompt", "cached", "TTFT", "e2e"].map((h) => el("th", {}, h))),
          requests.map((r) => el("tr", { class: "clickable", onclick: () => this.app.openRequest(r.rid) },
            el("td", {}, r.rid.slice(0, 12)), el("td", {}, r.state), el("td", {}, r.prompt_tokens),
            el("td", {}, r.cached_tokens), el("td", {}, seconds(r.ttft)), el("td", {}, seconds(r.e2e)))))
          : el("p", { class: "muted" }, "None among the live and recent requests."));
    } catch (e) {
      fill(panel, el("p", { class: "error" }, String(e.message)));
    }
  }
}
