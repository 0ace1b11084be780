// Adapters: upload (drag and drop, or file pickers), list by owner and base model, delete, and
// which engines hold each one resident now.

import { api } from "../api.js";
import { h, replace, num, when, toast, showError, field } from "../dom.js";

const CONFIG = "adapter_config.json";
const WEIGHTS = "adapter_model.safetensors";

export async function renderAdapters(main) {
  const owner = h("input", { name: "tenant_id", maxlength: 64, placeholder: "every owner" });
  const list = h("div");
  const filter = h("form", { class: "inline", role: "search" }, field("Owner (tenant id)", owner), h("button", { type: "submit" }, "Filter"));
  filter.addEventListener("submit", (event) => {
    event.preventDefault();
    load();
  });

  async function load() {
    const adapters = await api.get("/admin/adapters", { tenant_id: owner.value.trim() });
    replace(list, table(adapters.data, load));
  }

  replace(main, h("h1", {}, "Adapters"), uploadForm(load), filter, list);
  await load();
}

function table(adapters, reload) {
  const rows = adapters.map((adapter) => {
    const remove = h("button", { type: "button", class: "danger small" }, "Delete");
    remove.addEventListener("click", async () => {
      if (!confirm(`Delete adapter ${adapter.name}? Requests naming it will get 404.`)) return;
      await api.delete(`/admin/adapters/${adapter.id}`);
      toast(`Adapter ${adapter.name} deleted`);
      await reload();
    });
    const resident = (adapter.resident_on || []).map((r) => `${r.model} #${r.replica}`);
    return h(
      "tr",
      { "data-adapter": adapter.id },
      h("td", {}, adapter.name, h("div", { class: "muted mono" }, adapter.id)),
      h("td", { class: "mono" }, adapter.tenant_id ?? "public"),
      h("td", {}, adapter.base_model),
      h("td", { class: "num" }, adapter.rank),
      h("td", { class: "num" }, num(adapter.size_bytes)),
      h("td", {}, resident.length ? resident.join(", ") : "—"),
      h("td", {}, when(adapter.created_at)),
      h("td", {}, remove),
    );
  });
  return h(
    "table",
    { class: "data", "aria-label": "Adapters" },
    h("thead", {}, h("tr", {}, ["Name", "Owner", "Base model", "Rank", "Bytes", "Resident on", "Created", ""].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: 8 }, "No adapters."))),
  );
}

function uploadForm(reload) {
  const name = h("input", { name: "name", required: true, maxlength: 128, "data-param": "name", autocomplete: "off" });
  const tenant = h("input", { name: "tenant_id", maxlength: 64, "data-param": "tenant_id", placeholder: "none: public" });
  const base = h("input", { name: "base_model", maxlength: 256, "data-param": "base_model", placeholder: "the only model served" });
  const config = h("input", { type: "file", name: CONFIG, accept: ".json,application/json", "data-param": CONFIG });
  const weights = h("input", { type: "file", name: WEIGHTS, accept: ".safetensors", "data-param": WEIGHTS });
  const chosen = h("p", { class: "muted", "aria-live": "polite" }, "Drop adapter_config.json and adapter_model.safetensors here, or choose them below.");
  const files = h(
    "fieldset",
    { class: "drop", "data-param": "adapter" },
    h("legend", {}, "Adapter files"),
    chosen,
    field(CONFIG, config),
    field(WEIGHTS, weights),
  );
  const dropped = {};
  const describe = () => {
    const names = [CONFIG, WEIGHTS].filter((n) => dropped[n] || (n === CONFIG ? config : weights).files.length);
    chosen.textContent = names.length ? `Chosen: ${names.join(", ")}` : chosen.textContent;
  };
  config.addEventListener("change", () => { delete dropped[CONFIG]; describe(); });
  weights.addEventListener("change", () => { delete dropped[WEIGHTS]; describe(); });
  files.addEventListener("dragover", (event) => { event.preventDefault(); files.classList.add("over"); });
  files.addEventListener("dragleave", () => files.classList.remove("over"));
  files.addEventListener("drop", (event) => {
    event.preventDefault();
    files.classList.remove("over");
    for (const file of event.dataTransfer.files) {
      if (file.name.endsWith(".json")) dropped[CONFIG] = file;
      else if (file.name.endsWith(".safetensors")) dropped[WEIGHTS] = file;
    }
    describe();
  });
  const form = h(
    "form",
    { class: "card", "aria-labelledby": "upload-title" },
    h("h2", { id: "upload-title" }, "Upload an adapter"),
    h("div", { class: "grid" }, field("Name", name), field("Owner (tenant id)", tenant), field("Base model", base)),
    files,
    h("button", { type: "submit" }, "Upload"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(form, null);
    const data = new FormData();
    data.append("name", name.value.trim());
    if (tenant.value.trim()) data.append("tenant_id", tenant.value.trim());
    if (base.value.trim()) data.append("base_model", base.value.trim());
    const configFile = dropped[CONFIG] || config.files[0];
    const weightsFile = dropped[WEIGHTS] || weights.files[0];
    if (configFile) data.append(CONFIG, configFile, CONFIG);
    if (weightsFile) data.append(WEIGHTS, weightsFile, WEIGHTS);
    try {
      const adapter = await api.upload("/admin/adapters", data);
      toast(`Adapter ${adapter.name} uploaded`);
      form.reset();
      await reload();
    } catch (error) {
      // The server names the file at fault at the start of its message: show it there.
      const file = [CONFIG, WEIGHTS].find((name) => error.message.startsWith(name));
      if (error.param === "adapter" && file) error.param = file;
      showError(form, error);
    }
  });
  return form;
}
