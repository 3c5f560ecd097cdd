// Where the loaded model lives, drawn from /placement (the plan the server loaded with, as
// `llmx plan --json` gives it): the layer ranges per device, each device's bill, a map of every
// layer's parts by device, and the tensors of the layer picked on the map.

import { getJson } from "./api.js";
import { $, el } from "./dom.js";

const ROLES = { attn: "attention", ffn: "dense FFN", experts: "experts", shared: "shared exp", other: "other" };
const GiB = 2 ** 30;

export async function showPlacement() {
  const plan = await getJson("/placement");
  const colour = colours(plan.devices.map((d) => d.device));
  summary(plan, colour);
  devices(plan);
  layerMap(plan, colour, (layer) => tensors(plan, layer, colour));
  tensors(plan, null, colour);
}

// cpu grey, each GPU its own colour; a part split over GPUs is drawn striped.
function colours(names) {
  const gpus = names.filter((n) => n !== "cpu");
  return (device) => {
    if (!device) return "none";
    if (device.includes("+")) return "split";
    return device === "cpu" ? "cpu" : `gpu${gpus.indexOf(device) % 8}`;
  };
}

function summary(plan, colour) {
  const ranges = el("ul", "", { class: "ranges" });
  for (const [device, span] of plan.layer_ranges) {
    const item = el("li", "", { "data-device": device });
    item.append(el("span", device, { class: `chip ${colour(device)}` }), ` ${span}`);
    ranges.append(item);
  }
  const line = `${plan.model} · ctx ${plan.ctx} · offloaded ${plan.offloaded.layers}/${plan.offloaded.of} layers to GPU`;
  const options = plan.options.length ? el("code", plan.options.join(" ")) : "";
  const remarks = [...plan.notes.map((n) => `note: ${n}`), ...plan.warnings.map((w) => `warning: ${w}`)];
  $("placement-summary").replaceChildren(line, el("br"), options, ranges, ...remarks.map((r) => el("p", r)));
}

function devices(plan) {
  const table = $("devices");
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  for (const h of ["device", "weights", "KV", "compute", "free"]) head.append(el("th", h));
  const body = table.createTBody();
  for (const d of plan.devices) {
    const row = body.insertRow();
    row.dataset.device = d.device;
    const free = d.total ? gib(d.free) : "?";
    for (const cell of [d.device, gib(d.weights), gib(d.kv), gib(d.compute), free]) row.append(el("td", cell));
    row.title = [d.label, d.bus_id].filter(Boolean).join(" ");
  }
}

// One strip per part (attention, FFN, ..., KV cache), one cell per layer, coloured by device.
function layerMap(plan, colour, pick) {
  const roles = Object.keys(ROLES).filter((r) => plan.layers.some((row) => row.nbytes[r]));
  const grid = el("div", "", { class: "map" });
  grid.style.setProperty("--columns", plan.layers.length);
  const strip = (label, cell) => {
    grid.append(el("span", label, { class: "label" }));
    for (const row of plan.layers) grid.append(cell(row));
  };
  const cellOf = (row, device, bytes, what) => {
    const name = typeof row.layer === "number" ? `layer ${row.layer}` : `${row.layer}`;
    const cell = el("button", "", {
      type: "button",
      class: `cell ${colour(device)}`,
      "data-layer": row.layer,
      "data-device": device,
      title: device ? `${name} ${what}: ${mib(bytes)} on ${device}` : `${name}: no ${what}`,
    });
    cell.addEventListener("click", () => {
      for (const c of grid.querySelectorAll(".cell")) c.classList.toggle("picked", c.dataset.layer === `${row.layer}`);
      pick(row.layer);
    });
    return cell;
  };
  // the axis: input, every tenth layer, output
  const tick = (layer) => ({ input: "in", output: "out" })[layer] ?? (layer % 10 ? "" : `${layer}`);
  strip("layer", (row) => el("span", tick(row.layer), { class: "tick" }));
  for (const r of roles) strip(ROLES[r], (row) => cellOf(row, row.devices[r], row.nbytes[r], ROLES[r]));
  strip("KV cache", (row) => cellOf(row, row.kv_device, row.kv_bytes, "KV cache"));
  $("layer-map").replaceChildren(grid);
}

// The tensors of one layer ("input"/"output": those outside the repeating layers), or all of them
// grouped by device when no layer is picked.
function tensors(plan, layer, colour) {
  const all = Object.entries(plan.tensors);
  const inLayer =
    layer === null
      ? all
      : typeof layer === "number"
        ? all.filter(([name]) => name.startsWith(`blk.${layer}.`))
        : all.filter(([name]) => !name.startsWith("blk."));
  const title =
    layer === null
      ? `${all.length} tensors`
      : typeof layer === "number"
        ? `layer ${layer}'s tensors`
        : "tensors outside the layers";
  const groups = Map.groupBy(inLayer, ([, device]) => device);
  const out = [el("h3", title)];
  for (const [device, list] of groups) {
    const group = el("details", "", { "data-device": device });
    if (layer !== null) group.open = true;
    const head = el("summary", "");
    head.append(el("span", device, { class: `chip ${colour(device)}` }), ` ${list.length} tensors`);
    group.append(head, el("ul", "", { class: "names" }));
    for (const [name] of list) group.lastChild.append(el("li", name));
    out.push(group);
  }
  $("tensors").replaceChildren(...out);
}

function gib(n) {
  return `${(n / GiB).toFixed(2)} GiB`;
}

function mib(n) {
  return n >= 2 ** 20 ? `${(n / 2 ** 20).toFixed(1)} MiB` : `${Math.ceil(n / 1024)} KiB`;
}
