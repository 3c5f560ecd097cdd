// The conversation: kept in the page, sent whole with every message, the reply streamed into it.
// Stop aborts the fetch; the server notices the closed connection and frees its slot.

import { call, events } from "./api.js";
import { $, el } from "./dom.js";

export function startChat(modelName) {
  const conversation = [];
  let controller = null;
  const form = $("composer");
  const prompt = $("prompt");

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = prompt.value.trim();
    if (text && !controller) {
      prompt.value = "";
      send(text);
    }
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", () => {
    conversation.length = 0;
    $("messages").replaceChildren();
  });

  async function send(text) {
    conversation.push({ role: "user", content: text });
    bubble("user", text);
    const reply = bubble("assistant", "");
    reply.classList.add("streaming");
    controller = new AbortController();
    setBusy(true);
    $("error").textContent = "";
    let content = "";
    let usage = null;
    let first = null;
    let ended = "";
    try {
      const response = await call("/v1/chat/completions", { body: request(), signal: controller.signal });
      for await (const event of events(response)) {
        const delta = event.choices?.[0]?.delta?.content;
        if (delta) {
          first ??= performance.now();
          content += delta;
          reply.querySelector(".text").textContent = content;
          reply.scrollIntoView({ block: "end" });
        }
        if (event.usage) usage = event.usage;
      }
    } catch (e) {
      ended = e.name === "AbortError" ? "stopped" : "failed";
      if (ended === "failed") $("error").textContent = e.message;
    }
    reply.classList.replace("streaming", ended || "done");
    reply.querySelector(".meta").textContent = [ended, speed(usage, first)].filter(Boolean).join(" · ");
    if (content) {
      conversation.push({ role: "assistant", content });
    } else {
      // Nothing came back: the message is taken out again and returned to the box, to edit or resend.
      conversation.pop();
      reply.previousElementSibling.remove();
      reply.remove();
      if (!prompt.value) prompt.value = text;
    }
    controller = null;
    setBusy(false);
  }

  function request() {
    const body = {
      model: modelName(),
      messages: conversation,
      stream: true,
      stream_options: { include_usage: true },
    };
    // An empty box leaves the server's default; anything else is sent as typed, for the server to judge.
    for (const [field, id] of [["temperature", "temperature"], ["max_tokens", "max-tokens"]]) {
      const value = $(id).value;
      if (value !== "") body[field] = Number(value);
    }
    return body;
  }
}

function bubble(role, text) {
  const item = el("li", "", { class: `message ${role}` });
  item.append(el("div", text, { class: "text" }), el("span", "", { class: "meta" }));
  $("messages").append(item);
  return item;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("new-chat").disabled = busy; // stop first: the reply in flight belongs to this conversation
}

// "16 tokens, 41.2 t/s": the reply's decode speed as this page saw it (first token to last).
function speed(usage, first) {
  if (!usage) return "";
  const seconds = first === null ? 0 : (performance.now() - first) / 1000;
  const rate = usage.completion_tokens > 1 && seconds > 0 ? (usage.completion_tokens - 1) / seconds : null;
  return `${usage.completion_tokens} tokens` + (rate ? `, ${rate.toFixed(1)} t/s` : "");
}
