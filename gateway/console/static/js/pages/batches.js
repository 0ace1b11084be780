// Batches (the Batch API): the batches running now across tenants, and one tenant's batches a
// page at a time with their status, progress, counts and output and error files to download;
// both refreshed every 5 s while a batch shown is unfinished.

import { api } from "../api.js";
import { h, replace, num, when, field } from "../dom.js";

const PAGE = 20;
const REFRESH_MS = 5000;
const MAX_TENANTS = 1000; // the picker's (the admin REST's largest page)
const MAX_RUNNING = 100; // batches running now, across tenants, shown at most
const UNFINISHED = ["validating", "in_progress", "finalizing", "cancelling"];
const COLUMNS = ["Batch", "Status", "Progress", "Completed", "Failed", "Created", "Files"];

// `params`: the tenant from the address (#/batches?tenant=ID), so that a tenant's batches can
// be bookmarked and linked from its page.
export async function renderBatches(main, params = new URLSearchParams()) {
  const chosen = params.get("tenant");
  const tenants = (await api.get("/admin/tenants", { limit: MAX_TENANTS })).data;
  const names = new Map(tenants.map((t) => [t.id, t.name]));
  const picker = tenantPicker(tenants, chosen);
  const stamp = h("p", { class: "muted", "aria-live": "off" });
  const running = h("div");
  const mine = h("div");
  replace(
    main,
    h("h1", {}, "Batches"),
    stamp,
    h("section", { class: "card", "aria-labelledby": "running-title" }, h("h2", { id: "running-title" }, "Running now"), running),
    picker,
    h("section", { "aria-labelledby": "tenant-batches-title" }, mine),
  );

  const state = { pages: [null] }; // the `after` cursor of each page of the tenant's seen
  let timer = null;
  let stopped = false;

  async function refresh() {
    clearTimeout(timer);
    let shown = [];
    try {
      const now = await api.get("/admin/batches", { status: UNFINISHED, limit: MAX_RUNNING });
      replace(
        running,
        now.data.length ? runningTable(now.data, names) : h("p", {}, "No batch is running."),
        now.has_more ? h("p", { class: "muted" }, `The newest ${MAX_RUNNING} of them.`) : null,
      );
      shown = now.data;
      if (chosen) shown = shown.concat(await showTenant());
      else replace(mine, h("h2", { id: "tenant-batches-title" }, "A tenant's batches"), h("p", {}, "Choose a tenant above to see its batches."));
      stamp.textContent = `Updated ${when(new Date().toISOString())}; refreshed every 5 s while a batch runs.`;
    } catch (error) {
      stamp.textContent = `Could not refresh: ${error.message}`;
    }
    if (!stopped && shown.some((b) => UNFINISHED.includes(b.status))) timer = setTimeout(refresh, REFRESH_MS);
  }

  async function showTenant() {
    const name = names.get(chosen) || chosen;
    const after = state.pages[state.pages.length - 1];
    let page;
    try {
      page = await api.get(`/admin/tenants/${encodeURIComponent(chosen)}/batches`, { limit: PAGE, after });
    } catch (error) {
      replace(mine, h("h2", { id: "tenant-batches-title" }, `Batches of ${name}`), h("p", { role: "alert" }, error.message));
      return [];
    }
    const previous = h("button", { type: "button", class: "secondary", disabled: state.pages.length === 1 }, "Previous");
    const next = h("button", { type: "button", class: "secondary", disabled: !page.has_more }, "Next");
    previous.addEventListener("click", () => { state.pages.pop(); refresh(); });
    next.addEventListener("click", () => { state.pages.push(page.last_id); refresh(); });
    replace(
      mine,
      h("h2", { id: "tenant-batches-title" }, `Batches of ${name}`),
      h(
        "table",
        { class: "data", "aria-label": `Batches of ${name}` },
        h("thead", {}, h("tr", {}, COLUMNS.map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", {}, page.data.length ? page.data.map(batchRow) : h("tr", {}, h("td", { colspan: COLUMNS.length }, "No batches yet."))),
      ),
      h("div", { class: "pager" }, previous, h("span", { class: "muted" }, `Page ${state.pages.length}`), next),
    );
    return page.data;
  }

  await refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

function tenantPicker(tenants, chosen) {
  const options = [...tenants].sort((a, b) => a.name.localeCompare(b.name)).map((t) => h("option", { value: t.id, selected: t.id === chosen }, t.name));
  if (chosen && !tenants.some((t) => t.id === chosen)) options.unshift(h("option", { value: chosen, selected: true }, chosen));
  const select = h("select", { name: "tenant" }, h("option", { value: "" }, "Choose a tenant"), options);
  const form = h(
    "form",
    { class: "card inline", "aria-label": "Choose a tenant" },
    field("Tenant", select),
    h("button", { type: "submit" }, "Show batches"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (select.value) location.hash = `#/batches?tenant=${encodeURIComponent(select.value)}`;
  });
  return form;
}

function runningTable(batches, names) {
  return h(
    "table",
    { class: "data", "aria-label": "Batches running now" },
    h("thead", {}, h("tr", {}, ["Tenant", "Batch", "Status", "Progress", "Created"].map((t) => h("th", { scope: "col" }, t)))),
    h(
      "tbody",
      {},
      batches.map((b) =>
        h(
          "tr",
          { "data-batch": b.id },
          h("td", {}, h("a", { href: `#/batches?tenant=${encodeURIComponent(b.tenant_id)}` }, names.get(b.tenant_id) || b.tenant_id)),
          h("td", { class: "mono" }, b.id),
          h("td", {}, badge(b.status)),
          h("td", {}, progress(b)),
          h("td", {}, created(b)),
        ),
      ),
    ),
  );
}

function batchRow(b) {
  const counts = b.request_counts;
  return h(
    "tr",
    { "data-batch": b.id },
    h("td", {}, h("div", { class: "mono" }, b.id), h("div", { class: "muted" }, b.endpoint)),
    h("td", {}, badge(b.status)),
    h("td", {}, progress(b)),
    h("td", { class: "num" }, num(counts.completed)),
    h("td", { class: "num" }, num(counts.failed)),
    h("td", {}, created(b)),
    h("td", {}, files(b)),
  );
}

function badge(status) {
  return h("span", { class: `badge batch-${status}` }, status.replace("_", " "));
}

// The lines answered (completed + failed) of the total, as a bar and as numbers.
function progress(b) {
  const counts = b.request_counts;
  const answered = counts.completed + counts.failed;
  return h(
    "span",
    { class: "meter-wrap" },
    h("progress", { max: Math.max(counts.total, 1), value: answered, "aria-label": `Progress of ${b.id}` }),
    h("span", { class: "count" }, `${num(answered)} / ${num(counts.total)}`),
  );
}

function created(b) {
  return when(new Date(b.created_at * 1000).toISOString());
}

// Links to the tenant's file through the admin REST: the browser saves it under its own name.
function files(b) {
  const link = (fileId, text) =>
    h("a", { href: `/admin/tenants/${encodeURIComponent(b.tenant_id)}/files/${encodeURIComponent(fileId)}/content`, download: true, "aria-label": `${text} file of ${b.id}` }, text);
  const links = [b.output_file_id && link(b.output_file_id, "Output"), b.error_file_id && link(b.error_file_id, "Errors")].filter(Boolean);
  return links.length ? links.flatMap((a, i) => (i ? [" · ", a] : [a])) : "—";
}
