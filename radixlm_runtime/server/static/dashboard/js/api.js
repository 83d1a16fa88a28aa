// The feeds, with the API key (kept in this tab's sessionStorage) as a Bearer header.

const KEY = "radixlm-dashboard-key";

export class AuthError extends Error {}

export const hasKey = () => sessionStorage.getItem(KEY) !== null;

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}`, ...extra } : extra;
}

async function check(response) {
  if (response.status === 401) throw new AuthError("the API key is missing or wrong");
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try {
      const body = await response.json();
      message = body?.error?.message ?? JSON.stringify(body);
    } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

export async function getJSON(path, signal) {
  return (await check(await fetch(path, { headers: headers(), signal }))).json();
}

export async function postJSON(path, body, signal) {
  const response = await fetch(path, {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal,
  });
  return (await check(response)).json();
}

/** POSTs body and calls onEvent(parsed JSON) for each server-sent event until [DONE]. */
export async function postStream(path, body, onEvent, signal) {
  const response = await check(await fetch(path, {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal,
  }));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}
