// Engines: each served model's replicas and what they are doing, from one request every 5 s.

import { api } from "../api.js";
import { h, replace, num, when } from "../dom.js";

const REFRESH_MS = 5000;

export async function renderEngines(main) {
  const body = h("div");
  const stamp = h("p", { class: "muted", "aria-live": "off" });
  replace(main, h("h1", {}, "Engines"), stamp, body);
  let timer = null;
  let stopped = false;

  async function refresh() {
    try {
      const engines = await api.get("/admin/engines");
      replace(body, engines.data.length ? engines.data.map(model) : h("p", {}, "No models are served."));
      stamp.textContent = `Updated ${when(new Date().toISOString())}; refreshed every 5 s.`;
    } catch (error) {
      stamp.textContent = `Could not refresh: ${error.message}`;
    }
    if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
  }

  await refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

function model(entry) {
  const replicas = entry.replicas.map((replica) =>
    h(
      "tr",
      { "data-replica": replica.id },
      h("td", { class: "mono" }, replica.id),
      h("td", {}, h("span", { class: `badge ${replica.state}` }, replica.state)),
      h("td", { class: "num" }, num(replica.num_waiting)),
      h("td", { class: "num" }, num(replica.num_running)),
      h("td", {}, meter(replica.kv_cache_usage)),
      h("td", {}, replica.resident_adapters.length ? replica.resident_adapters.map((a) => a.name || a.id).join(", ") : "—"),
      h("td", { class: "num" }, num(replica.cold_starts)),
    ),
  );
  return h(
    "section",
    { class: "card", "data-model": entry.model, "aria-labelledby": `model-${entry.model}` },
    h("h2", { id: `model-${entry.model}` }, entry.model),
    h("p", { class: "muted" }, `Routing: ${entry.routing}. Requests held for a cold start: ${num(entry.pending_requests)}. Cold starts: ${num(entry.cold_starts)}.`),
    h(
      "table",
      { class: "data", "aria-label": `${entry.model} replicas` },
      h("thead", {}, h("tr", {}, ["Replica", "State", "Waiting", "Running", "KV cache", "Resident adapters", "Cold starts"].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, replicas.length ? replicas : h("tr", {}, h("td", { colspan: 7 }, "No replica."))),
    ),
  );
}

function meter(fraction) {
  const percent = Math.round((fraction || 0) * 1000) / 10;
  return h("span", { class: "meter-wrap" },
    h("meter", { min: 0, max: 1, value: fraction || 0, "aria-label": "KV cache usage" }),
    ` ${percent}%`);
}
