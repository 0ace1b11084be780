// Building the page from data without innerHTML: every string lands as text, never as markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

const numberFormat = new Intl.NumberFormat("en-US");

export function num(value) {
  return value === null || value === undefined ? "—" : numberFormat.format(value);
}

export function when(iso) {
  if (!iso) return "—";
  return new Date(iso).toISOString().replace("T", " ").slice(0, 16) + " UTC";
}

let toastTimer = null;

export function toast(message) {
  const el = document.getElementById("toast");
  el.textContent = message;
  el.classList.add("shown");
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => el.classList.remove("shown"), 4000);
}

// A form's error: beside the field the server named (its `param`), else at the form's top.
export function showError(form, error) {
  for (const old of form.querySelectorAll(".field-error")) old.remove();
  for (const field of form.querySelectorAll("[aria-invalid]")) field.removeAttribute("aria-invalid");
  if (!error) return;
  const message = error.message || String(error);
  const field = error.param && form.querySelector(`[data-param="${CSS.escape(error.param)}"]`);
  const note = h("p", { class: "field-error", role: "alert" }, message);
  if (field) {
    const input = field.matches("input, select, textarea") ? field : field.querySelector("input");
    if (input) {
      note.id = `${input.id || input.name}-error`;
      input.setAttribute("aria-invalid", "true");
      input.setAttribute("aria-describedby", note.id);
    }
    field.closest(".field")?.append(note) ?? field.after(note);
  } else {
    form.prepend(note);
  }
}

export function field(label, input, hint) {
  const id = input.id || `f-${input.name}`;
  input.id = id;
  return h(
    "div",
    { class: "field" },
    h("label", { for: id }, label),
    input,
    hint ? h("p", { class: "hint" }, hint) : null,
  );
}
