// DOM helpers that only ever write text: data never reaches innerHTML, so a prompt's "<script>"
// stays text.

/** el("td", {class: "x", title: t}, "text", childNode, ...): an element; strings become text nodes. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replaces node's children with the given ones. */
export function fill(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

export const $ = (id) => document.getElementById(id);

export function seconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms`;
  return `${s.toFixed(2)} s`;
}

export function age(s) {
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

export function percent(part, whole) {
  return whole ? `${((100 * part) / whole).toFixed(0)}%` : "–";
}

/** A small bar: the cached share of a prompt. */
export function cacheBar(cached, total) {
  const pct = total ? (100 * cached) / total : 0;
  const fillSpan = el("span");
  fillSpan.style.width = `${pct.toFixed(1)}%`;
  return el("span", { class: "bar", title: `${cached} of ${total} prompt tokens from the cache` }, fillSpan);
}

/** Text with newlines shown as ⏎ (for one-line previews); null means redacted. */
export function oneLine(text) {
  if (text === null || text === undefined) return "[redacted]";
  return text.replace(/\n/g, "⏎");
}

export function kv(pairs) {
  return el("dl", { class: "kv" }, pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}
