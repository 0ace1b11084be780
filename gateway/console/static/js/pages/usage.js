// Usage (billing): tokens per day for a range, stacked by tenant, model, adapter, endpoint
// (chat, completions, responses, batch) or batch (the top 10 and "other"), with a table of the
// same numbers and a CSV of exactly what is shown. One request: /admin/usage, the ledger's own
// sums.

import uPlot from "../../vendor/uplot/uPlot.esm.js";
import { api } from "../api.js";
import { h, replace, num, showError, field } from "../dom.js";

const TOP = 10;
const DAY_MS = 86400000;
const COLORS = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#ea580c", "#4f46e5", "#6b7280"];
const GROUPS = { tenant: "Tenant", model: "Model", adapter: "Adapter", endpoint: "Endpoint", batch: "Batch" };
// What a null group is, by grouping: an adapter's is the base model, a batch's a request that
// came through the API itself, an endpoint's a row recorded before endpoints were.
const NULL_LABELS = { adapter: "(base model)", batch: "(interactive)", endpoint: "(unrecorded)" };

function isoDay(date) {
  return date.toISOString().slice(0, 10);
}

// The groups' labels: NULL_LABELS for a null group, "other" for the rest past the top.
function label(row, group) {
  if (row.other) return "other";
  const value = row[group];
  if (value === null || value === undefined) return NULL_LABELS[group] || "(none)";
  return value;
}

// `params`: the range and grouping from the address (#/usage?from=2026-01-01&to=...&group=model),
// so that a view can be bookmarked; the last 30 days by tenant otherwise.
export async function renderUsage(main, params = new URLSearchParams()) {
  const today = new Date();
  const from = h("input", { type: "date", name: "from", required: true, value: params.get("from") || isoDay(new Date(today - 29 * DAY_MS)), "data-param": "from" });
  const to = h("input", { type: "date", name: "to", required: true, value: params.get("to") || isoDay(today), "data-param": "to" });
  const group = h("select", { name: "group", "data-param": "group_by" }, Object.entries(GROUPS).map(([value, text]) => h("option", { value, selected: value === params.get("group") }, text)));
  const form = h(
    "form",
    { class: "card inline", "aria-label": "Usage range" },
    field("From", from),
    field("To (inclusive)", to),
    field("Stack by", group),
    h("button", { type: "submit" }, "Show"),
  );
  const chart = h("div", { class: "chart", role: "img", "aria-label": "Tokens per day" });
  const legend = h("ul", { class: "legend", "aria-label": "Chart legend" });
  const summary = h("p", { class: "muted", id: "usage-summary" });
  const tableWrap = h("div", { class: "table-wrap" });
  const csv = h("button", { type: "button", class: "secondary", disabled: true }, "Export CSV");
  replace(main, h("h1", {}, "Usage"), form, summary, chart, legend, h("p", {}, csv), tableWrap);

  let shown = null;
  csv.addEventListener("click", () => download(shown));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    load();
  });

  async function load() {
    showError(form, null);
    // `to` is inclusive on the page, exclusive in the API: the day after.
    const end = isoDay(new Date(Date.parse(to.value) + DAY_MS));
    let data;
    try {
      data = await api.get("/admin/usage", { from: from.value, to: end, group_by: ["day", group.value], top: TOP });
    } catch (error) {
      showError(form, error);
      return;
    }
    shown = tabulate(data.data, group.value, from.value, to.value);
    draw(chart, legend, shown);
    replace(tableWrap, table(shown));
    summary.textContent = `${num(shown.total)} tokens (prompt + completion) from ${from.value} to ${to.value}, UTC days.`;
    csv.disabled = false;
  }

  await load();
}

// Rows of (day, group) sums into a day x label grid, labels by their total, "other" last.
function tabulate(rows, group, fromDay, toDay) {
  const days = [];
  for (let t = Date.parse(fromDay); t <= Date.parse(toDay); t += DAY_MS) days.push(isoDay(new Date(t)));
  const totals = new Map();
  const cells = new Map();
  for (const row of rows) {
    const name = label(row, group);
    const tokens = row.prompt_tokens + row.completion_tokens;
    totals.set(name, (totals.get(name) || 0) + tokens);
    cells.set(`${row.day}\u0000${name}`, row);
  }
  const labels = [...totals.keys()].sort((a, b) => (a === "other") - (b === "other") || totals.get(b) - totals.get(a));
  const grid = labels.map((name) => days.map((day) => cells.get(`${day}\u0000${name}`) || null));
  const total = [...totals.values()].reduce((a, b) => a + b, 0);
  return { group, days, labels, grid, total };
}

function tokensOf(cell) {
  return cell ? cell.prompt_tokens + cell.completion_tokens : 0;
}

function draw(container, legend, shown) {
  container.replaceChildren();
  const xs = shown.days.map((day) => Date.parse(day) / 1000);
  // Stacked: series i is the sum of groups 0..i, drawn from the top down so each covers the
  // ones above it in the stack.
  const stacks = [];
  let running = xs.map(() => 0);
  for (const row of shown.grid) {
    running = running.map((sum, i) => sum + tokensOf(row[i]));
    stacks.push(running);
  }
  const order = stacks.map((_, i) => i).reverse();
  const bars = uPlot.paths.bars({ size: [0.8, 60] });
  const width = Math.max(320, container.clientWidth || 960);
  const plot = new uPlot(
    {
      width,
      height: 320,
      legend: { show: false },
      cursor: { drag: { x: false, y: false } },
      // Half a day of room each side, so that the first and last bars are whole.
      scales: { x: { time: true, range: (u, min, max) => [min - 43200, max + 43200] }, y: { range: (u, min, max) => [0, Math.max(1, max) * 1.05] } },
      // Ticks on whole days (a week or a month apart on long ranges), labelled as dates.
      axes: [{ incrs: [86400, 7 * 86400, 30 * 86400], values: (u, ticks) => ticks.map((t) => isoDay(new Date(t * 1000))) }, { size: 70, values: (u, ticks) => ticks.map((t) => num(t)) }],
      series: [
        {},
        ...order.map((i) => ({
          label: shown.labels[i],
          stroke: COLORS[i % COLORS.length],
          fill: COLORS[i % COLORS.length],
          paths: bars,
          points: { show: false },
        })),
      ],
    },
    // A day without tokens draws no bar (null), not a flat one.
    [xs, ...order.map((i) => stacks[i].map((v) => v || null))],
    container,
  );
  replace(
    legend,
    shown.labels.map((name, i) =>
      h("li", {}, h("span", { class: `swatch c${i % COLORS.length}`, "aria-hidden": "true" }), name),
    ),
  );
  return plot;
}

function table(shown) {
  const labelFor = GROUPS[shown.group];
  const rows = [];
  shown.days.forEach((day, d) => {
    shown.labels.forEach((name, g) => {
      const cell = shown.grid[g][d];
      if (!cell) return;
      rows.push(
        h(
          "tr",
          {},
          h("td", {}, day),
          h("td", {}, name),
          h("td", { class: "num" }, num(cell.num_requests)),
          h("td", { class: "num" }, num(cell.prompt_tokens)),
          h("td", { class: "num" }, num(cell.completion_tokens)),
          h("td", { class: "num" }, num(tokensOf(cell))),
        ),
      );
    });
  });
  return h(
    "table",
    { class: "data", "aria-label": "Usage by day" },
    h("thead", {}, h("tr", {}, ["Day", labelFor, "Requests", "Prompt tokens", "Completion tokens", "Total tokens"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: 6 }, "No usage in this range."))),
  );
}

// The table's rows as CSV, built from the same cells the chart and table show.
function download(shown) {
  const lines = [["day", shown.group, "num_requests", "prompt_tokens", "completion_tokens", "total_tokens"].join(",")];
  shown.days.forEach((day, d) => {
    shown.labels.forEach((name, g) => {
      const cell = shown.grid[g][d];
      if (!cell) return;
      lines.push([day, quote(name), cell.num_requests, cell.prompt_tokens, cell.completion_tokens, tokensOf(cell)].join(","));
    });
  });
  const blob = new Blob([lines.join("\r\n") + "\r\n"], { type: "text/csv" });
  const link = h("a", { href: URL.createObjectURL(blob), download: `usage-${shown.group}-${shown.days[0]}-${shown.days.at(-1)}.csv` });
  document.body.append(link);
  link.click();
  link.remove();
}

function quote(value) {
  const text = String(value);
  return /[",\r\n]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
}
