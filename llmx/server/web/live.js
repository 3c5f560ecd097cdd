// The server as it runs: each slot's state (polled from /slots, llama-server's list) and the
// throughput counters /metrics keeps (polled as JSON from /stats).

import { getJson } from "./api.js";
import { $, el } from "./dom.js";

const POLL_MS = 1000;

export function pollServer(onError) {
  const tick = async () => {
    try {
      const [slots, stats] = await Promise.all([getJson("/slots"), getJson("/stats")]);
      showSlots(slots);
      showStats(stats);
    } catch (e) {
      onError(e);
    }
    setTimeout(tick, POLL_MS);
  };
  tick();
}

function showSlots(slots) {
  const table = $("slots");
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  for (const h of ["slot", "state", "context"]) head.append(el("th", h));
  const body = table.createTBody();
  for (const s of slots) {
    const row = body.insertRow();
    row.dataset.slot = s.id;
    row.dataset.state = s.is_processing ? "processing" : "idle";
    const used = s.is_processing ? s.n_past : 0;
    const bar = document.createElement("meter");
    bar.max = s.n_ctx;
    bar.value = used;
    const context = el("td", `${used}/${s.n_ctx} `);
    context.append(bar);
    row.append(el("td", s.id), el("td", row.dataset.state), context);
  }
}

// Speeds are the server's averages since it started: decode counts a step per token after each
// reply's first (which comes from its prompt's step).
function showStats(s) {
  const rate = (n, seconds) => (seconds > 0 ? `${(n / seconds).toFixed(1)} t/s` : "-");
  const items = [
    ["decode", "decode", rate(s.decode_steps, s.decode_seconds)],
    ["prompt", "prompt", rate(s.prompt_tokens, s.prompt_seconds)],
    ["generated", "tokens generated", s.generated_tokens],
    ["processing", "requests in generation", s.processing],
    ["deferred", "requests waiting", s.deferred],
  ];
  $("stats").replaceChildren(
    ...items.flatMap(([key, label, value]) => [el("dt", label), el("dd", value, { "data-stat": key })]),
  );
}
