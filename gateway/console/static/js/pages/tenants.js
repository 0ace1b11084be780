// Tenants: a paged, searchable list (the server pages and searches), create, and a tenant's
// page with its limits, its status, its keys and a link to its batches.

import { api } from "../api.js";
import { h, replace, num, when, toast, showError, field } from "../dom.js";

const PAGE = 20;
// [field, label, its least value, what empty means, a hint]
const LIMITS = [
  ["rpm_limit", "Requests per minute", 1, "unlimited"],
  ["tpm_limit", "Tokens per minute", 1, "unlimited"],
  ["max_concurrency", "Concurrent requests", 1, "unlimited"],
  ["monthly_token_quota", "Monthly token quota", 0, "unlimited"],
  ["batch_token_limit", "Queued batch tokens", 0, "server default", "Prompt + max_tokens of its unfinished batches' lines; empty: --batch-token-limit."],
];

export async function renderTenants(main) {
  const state = { q: "", pages: [null] }; // pages: the `after` cursor of each page seen
  const search = h("input", { type: "search", name: "q", maxlength: 64, placeholder: "Name or id" });
  const body = h("tbody");
  const pager = h("div", { class: "pager" });
  const searchForm = h("form", { role: "search", class: "inline" }, field("Search tenants", search), h("button", { type: "submit" }, "Search"));
  searchForm.addEventListener("submit", (event) => {
    event.preventDefault();
    state.q = search.value.trim();
    state.pages = [null];
    load();
  });

  async function load() {
    const after = state.pages[state.pages.length - 1];
    const page = await api.get("/admin/tenants", { limit: PAGE, after, q: state.q });
    replace(body, page.data.length ? page.data.map(row) : h("tr", {}, h("td", { colspan: 6 }, state.q ? "No tenant matches." : "No tenants yet.")));
    const previous = h("button", { type: "button", class: "secondary", disabled: state.pages.length === 1 }, "Previous");
    const next = h("button", { type: "button", class: "secondary", disabled: !page.has_more }, "Next");
    previous.addEventListener("click", () => { state.pages.pop(); load(); });
    next.addEventListener("click", () => { state.pages.push(page.last_id); load(); });
    replace(pager, previous, h("span", { class: "muted" }, `Page ${state.pages.length}`), next);
  }

  replace(
    main,
    h("h1", {}, "Tenants"),
    createForm(),
    searchForm,
    h(
      "table",
      { class: "data", "aria-label": "Tenants" },
      h("thead", {}, h("tr", {}, ["Name", "Status", "Weight", "Limits", "Tokens this month", "Created"].map((t) => h("th", { scope: "col" }, t)))),
      body,
    ),
    pager,
  );
  await load();
}

function row(tenant) {
  const limits = LIMITS.filter(([name]) => tenant[name] !== null).map(([name, label]) => `${label.toLowerCase()} ${num(tenant[name])}`);
  return h(
    "tr",
    { "data-tenant": tenant.id },
    h("td", {}, h("a", { href: `#/tenants/${tenant.id}` }, tenant.name), h("div", { class: "muted mono" }, tenant.id)),
    h("td", {}, h("span", { class: `badge ${tenant.status}` }, tenant.status)),
    h("td", { class: "num" }, tenant.weight),
    h("td", {}, limits.length ? limits.join(", ") : "unlimited"),
    h("td", { class: "num" }, num(tenant.month_tokens)),
    h("td", {}, when(tenant.created_at)),
  );
}

function createForm() {
  const name = h("input", { name: "name", required: true, maxlength: 64, "data-param": "name", autocomplete: "off" });
  const form = h(
    "form",
    { class: "card inline", "aria-labelledby": "create-tenant" },
    h("h2", { id: "create-tenant" }, "New tenant"),
    field("Name", name, "Letters, digits, - and _."),
    h("button", { type: "submit" }, "Create tenant"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(form, null);
    try {
      const tenant = await api.post("/admin/tenants", { name: name.value.trim() });
      toast(`Tenant ${tenant.name} created`);
      location.hash = `#/tenants/${tenant.id}`;
    } catch (error) {
      showError(form, error);
    }
  });
  return form;
}

export async function renderTenant(main, tenantId) {
  const tenant = await api.get(`/admin/tenants/${encodeURIComponent(tenantId)}`);
  const status = h("span", { class: `badge ${tenant.status}`, id: "tenant-status" }, tenant.status);
  const toggle = h("button", { type: "button", class: tenant.status === "active" ? "danger" : "" }, tenant.status === "active" ? "Suspend tenant" : "Reactivate tenant");
  toggle.addEventListener("click", async () => {
    const next = tenant.status === "active" ? "suspended" : "active";
    await api.patch(`/admin/tenants/${tenant.id}`, { status: next });
    toast(next === "active" ? "Tenant reactivated" : "Tenant suspended");
    await renderTenant(main, tenantId);
  });
  const keys = h("section", { "aria-labelledby": "keys-title" });
  replace(
    main,
    h("p", {}, h("a", { href: "#/tenants" }, "← Tenants")),
    h("h1", {}, tenant.name, " ", status),
    h("p", { class: "muted mono" }, tenant.id),
    h("p", { class: "actions" }, toggle, h("a", { href: `#/batches?tenant=${encodeURIComponent(tenant.id)}` }, "Its batches")),
    limitsForm(tenant, main),
    keys,
  );
  await renderKeys(keys, tenant);
}

function limitsForm(tenant, main) {
  const inputs = {};
  const fields = LIMITS.map(([name, label, min, empty, hint]) => {
    inputs[name] = h("input", { name, type: "number", min, step: 1, value: tenant[name] ?? "", "data-param": name, placeholder: empty });
    return field(label, inputs[name], hint);
  });
  inputs.weight = h("input", { name: "weight", type: "number", min: 0.001, max: 1000, step: "any", value: tenant.weight, required: true, "data-param": "weight" });
  inputs.cache_group = h("input", { name: "cache_group", maxlength: 64, value: tenant.cache_group ?? "", "data-param": "cache_group", placeholder: "none" });
  inputs.allowed_models = h("input", { name: "allowed_models", value: (tenant.allowed_models || []).join(", "), "data-param": "allowed_models", placeholder: "every model" });
  const form = h(
    "form",
    { class: "card", "aria-labelledby": "limits-title" },
    h("h2", { id: "limits-title" }, "Limits"),
    h("div", { class: "grid" }, fields,
      field("Fairness weight", inputs.weight),
      field("Cache group", inputs.cache_group, "Tenants in one group share prefix-cache entries."),
      field("Allowed models", inputs.allowed_models, "Comma-separated; empty: every model.")),
    h("button", { type: "submit" }, "Save limits"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(form, null);
    const change = { weight: Number(inputs.weight.value) };
    for (const [name] of LIMITS) change[name] = inputs[name].value === "" ? null : Number(inputs[name].value);
    change.cache_group = inputs.cache_group.value.trim() || null;
    const models = inputs.allowed_models.value.split(",").map((m) => m.trim()).filter(Boolean);
    change.allowed_models = models.length ? models : null;
    try {
      await api.patch(`/admin/tenants/${tenant.id}`, change);
      toast("Limits saved");
      await renderTenant(main, tenant.id);
    } catch (error) {
      showError(form, error);
    }
  });
  return form;
}

async function renderKeys(section, tenant) {
  const list = await api.get(`/admin/tenants/${tenant.id}/keys`);
  const name = h("input", { name: "name", maxlength: 64, "data-param": "name", autocomplete: "off" });
  const expires = h("input", { name: "expires_at", type: "date", "data-param": "expires_at" });
  const shown = h("div", { "aria-live": "polite" });
  const form = h(
    "form",
    { class: "card inline", "aria-labelledby": "new-key" },
    h("h3", { id: "new-key" }, "New key"),
    field("Key name", name),
    field("Expires (optional)", expires),
    h("button", { type: "submit" }, "Create key"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(form, null);
    try {
      const created = await api.post(`/admin/tenants/${tenant.id}/keys`, {
        name: name.value.trim() || null,
        expires_at: expires.value ? `${expires.value}T00:00:00Z` : null,
      });
      await renderKeys(section, tenant);
      section.querySelector("[aria-live]").replaceChildren(keyOnce(created.key));
      section.querySelector(".key-once button").focus();
    } catch (error) {
      showError(form, error);
    }
  });
  const rows = list.data.map((key) => {
    const revoke = key.revoked_at ? null : h("button", { type: "button", class: "danger small" }, "Revoke");
    revoke?.addEventListener("click", async () => {
      if (!confirm(`Revoke key ${key.prefix}…? Requests with it will be refused.`)) return;
      await api.delete(`/admin/keys/${key.id}`);
      toast(`Key ${key.prefix}… revoked`);
      await renderKeys(section, tenant);
    });
    return h(
      "tr",
      { "data-key": key.id },
      h("td", { class: "mono" }, `${key.prefix}…`),
      h("td", {}, key.name ?? "—"),
      h("td", {}, when(key.created_at)),
      h("td", {}, when(key.last_used_at)),
      h("td", {}, when(key.expires_at)),
      h("td", {}, key.revoked_at ? h("span", { class: "badge suspended" }, "revoked") : h("span", { class: "badge active" }, "active")),
      h("td", {}, revoke),
    );
  });
  replace(
    section,
    h("h2", { id: "keys-title" }, "API keys"),
    form,
    shown,
    h(
      "table",
      { class: "data", "aria-label": "API keys" },
      h("thead", {}, h("tr", {}, ["Prefix", "Name", "Created", "Last used", "Expires", "State", ""].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: 7 }, "No keys yet."))),
    ),
  );
}

function keyOnce(key) {
  const value = h("input", { readonly: true, value: key, class: "mono wide", id: "new-key-value", "aria-label": "The new key" });
  const copy = h("button", { type: "button" }, "Copy");
  copy.addEventListener("click", async () => {
    value.select();
    try {
      await navigator.clipboard.writeText(key);
    } catch {
      document.execCommand("copy"); // no clipboard permission (plain http): the selection
    }
    toast("Key copied");
  });
  return h(
    "div",
    { class: "card key-once", role: "region", "aria-label": "New key" },
    h("p", {}, h("strong", {}, "This key is shown once."), " Copy it now: it cannot be read again."),
    h("div", { class: "inline" }, value, copy),
  );
}
