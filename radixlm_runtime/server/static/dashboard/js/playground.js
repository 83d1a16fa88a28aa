// Playground: a chat or raw completion, streamed, with sampling parameters, an optional constraint
// and tools; the answer says how many prompt tokens came from the cache.

import { postStream } from "./api.js";
import { $, el, fill } from "./dom.js";

export class Playground {
  constructor(app) {
    this.app = app;
    this.controller = null;
    $("pg-form").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("pg-stop").addEventListener("click", () => this.controller?.abort());
    $("pg-constraint").addEventListener("change", () => { $("pg-constraint-box").hidden = !$("pg-constraint").value; });
    for (const radio of document.querySelectorAll("input[name=pg-mode]")) radio.addEventListener("change", () => this.mode());
  }

  refresh() {}

  mode() {
    const chat = document.querySelector("input[name=pg-mode]:checked").value === "chat";
    for (const node of document.querySelectorAll(".chat-only")) node.hidden = !chat;
    return chat;
  }

  constraint() {
    const kind = $("pg-constraint").value;
    if (!kind) return null;
    const text = $("pg-constraint-text").value;
    return { kind, text, value: kind === "json_schema" ? JSON.parse(text) : text };
  }

  chatBody(constraint) {
    const messages = [];
    if ($("pg-system").value.trim()) messages.push({ role: "system", content: $("pg-system").value });
    messages.push({ role: "user", content: $("pg-prompt").value });
    const body = {
      model: this.app.model, messages, stream: true, stream_options: { include_usage: true },
      max_tokens: Number($("pg-max").value), temperature: Number($("pg-temp").value), top_p: Number($("pg-top-p").value),
    };
    const tools = $("pg-tools").value.trim();
    if (tools) body.tools = JSON.parse(tools);
    if (constraint?.kind === "json_schema") body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: constraint.value } };
    else if (constraint) body[constraint.kind] = constraint.value;
    return body;
  }

  rawBody(constraint) {
    const sampling = {
      max_new_tokens: Number($("pg-max").value), temperature: Number($("pg-temp").value), top_p: Number($("pg-top-p").value),
    };
    if (constraint) sampling[constraint.kind] = constraint.kind === "json_schema" ? constraint.text : constraint.value;
    return { text: $("pg-prompt").value, stream: true, sampling_params: sampling };
  }

  async send() {
    const output = $("pg-output");
    fill(output);
    fill($("pg-cached"));
    fill($("pg-error"));
    fill($("pg-tools-out"));
    this.controller = new AbortController();
    $("pg-send").disabled = true;
    $("pg-stop").disabled = false;
    const chat = this.mode();
    const toolCalls = [];
    let usage = null;
    try {
      const constraint = this.constraint();
      if (chat) {
        await postStream("/v1/chat/completions", this.chatBody(constraint), (chunk) => {
          if (chunk.error) throw new Error(chunk.error.message ?? JSON.stringify(chunk.error));
          if (chunk.usage) usage = chunk.usage;
          const delta = chunk.choices?.[0]?.delta ?? {};
          if (delta.reasoning_content) output.append(document.createTextNode(delta.reasoning_content));
          if (delta.content) output.append(document.createTextNode(delta.content));
          for (const call of delta.tool_calls ?? []) {
            const slot = (toolCalls[call.index ?? 0] ??= { name: "", arguments: "" });
            if (call.function?.name) slot.name += call.function.name;
            if (call.function?.arguments) slot.arguments += call.function.arguments;
            this.showTools(toolCalls);
          }
        }, this.controller.signal);
        if (usage) this.showUsage(usage.prompt_tokens, usage.prompt_tokens_details?.cached_tokens ?? 0);
      } else {
        let meta = null;
        await postStream("/generate", this.rawBody(constraint), (chunk) => {
          if (chunk.error) throw new Error(chunk.error.message ?? JSON.stringify(chunk.error));
          fill(output, chunk.text);
          meta = chunk.meta_info;
        }, this.controller.signal);
        if (meta) this.showUsage(meta.prompt_tokens, meta.cached_tokens);
      }
    } catch (e) {
      if (e.name !== "AbortError") fill($("pg-error"), String(e.message));
    } finally {
      $("pg-send").disabled = false;
      $("pg-stop").disabled = true;
      this.controller = null;
    }
  }

  showUsage(prompt, cached) {
    const el_ = $("pg-cached");
    el_.dataset.cached = cached;
    fill(el_, `${prompt} prompt tokens, ${cached} from the cache`);
  }

  showTools(calls) {
    fill($("pg-tools-out"), el("h2", {}, "Tool calls"),
      calls.map((c) => el("div", { class: "program" }, el("strong", {}, c.name), el("pre", { class: "prompt" }, c.arguments))));
  }
}
