// The console's shell: the session, the sign-in page and the routes (#/tenants, #/tenants/ID,
// #/usage, #/batches, #/adapters, #/engines).

import { api, setSession } from "./api.js";
import { h, replace, showError, field } from "./dom.js";
import { renderTenants, renderTenant } from "./pages/tenants.js";
import { renderUsage } from "./pages/usage.js";
import { renderAdapters } from "./pages/adapters.js";
import { renderEngines } from "./pages/engines.js";
import { renderBatches } from "./pages/batches.js";

const main = document.getElementById("main");
let session = null;
let leavePage = null; // the current page's clean-up (the engines and batches pages' timers)

const routes = [
  [/^#\/tenants\/([\w-]+)$/, (m) => renderTenant(main, m[1]), "tenants", "Tenant"],
  [/^#\/tenants$/, () => renderTenants(main), "tenants", "Tenants"],
  [/^#\/usage(?:\?(.*))?$/, (m) => renderUsage(main, new URLSearchParams(m[1] || "")), "usage", "Usage"],
  [/^#\/batches(?:\?(.*))?$/, (m) => renderBatches(main, new URLSearchParams(m[1] || "")), "batches", "Batches"],
  [/^#\/adapters$/, () => renderAdapters(main), "adapters", "Adapters"],
  [/^#\/engines$/, () => renderEngines(main), "engines", "Engines"],
];

async function route() {
  if (leavePage) leavePage();
  leavePage = null;
  if (!session || !session.signed_in) return renderSignIn();
  if (!location.hash || location.hash === "#/") location.replace("#/tenants");
  for (const [pattern, render, section, title] of routes) {
    const match = location.hash.match(pattern);
    if (!match) continue;
    document.title = `${title} · loragate console`;
    for (const link of document.querySelectorAll("#nav a")) {
      if (link.dataset.section === section) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    leavePage = (await render(match)) || null;
    return;
  }
  replace(main, h("h1", {}, "Not found"), h("p", {}, "No such page. ", h("a", { href: "#/tenants" }, "Tenants")));
}

function showSignedIn() {
  const signedIn = Boolean(session && session.signed_in);
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("who").hidden = !signedIn;
  document.getElementById("who-name").textContent = signedIn ? `Signed in as ${session.subject || "admin"}` : "";
}

async function loadSession() {
  session = await api.get("/console/api/session");
  setSession(session, signedOut);
  showSignedIn();
}

function signedOut() {
  session = { signed_in: false, oauth: session ? session.oauth : false };
  setSession(session);
  showSignedIn();
  route();
}

function renderSignIn() {
  document.title = "Sign in · loragate console";
  const token = h("textarea", { name: "token", rows: 4, required: true, "data-param": "token", autocomplete: "off", spellcheck: "false" });
  const form = h(
    "form",
    { class: "card narrow", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title" }, "Sign in"),
    field("Admin token", token, "A JWT with scope admin: `loragate admin token`, or your identity provider's."),
    h("button", { type: "submit" }, "Sign in"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(form, null);
    try {
      session = await api.post("/console/api/session", { token: token.value.trim() });
      setSession(session, signedOut);
      showSignedIn();
      route();
    } catch (error) {
      if (error.param === null) error.param = "token";
      showError(form, error);
    }
  });
  const oauth = session && session.oauth
    ? h("p", { class: "card narrow" }, h("a", { class: "button", href: "/console/oauth/start" }, "Sign in with your identity provider"))
    : null;
  // The identity provider's sign-in came back refused: say why, once.
  const params = new URLSearchParams(location.search);
  const refused = params.get("oauth_error");
  if (refused) {
    history.replaceState(null, "", location.pathname + location.hash);
    showError(form, { message: `Sign-in with the identity provider failed: ${refused}` });
  }
  replace(main, form, oauth);
  token.focus();
}

document.getElementById("sign-out").addEventListener("click", async () => {
  await api.delete("/console/api/session").catch(() => null);
  signedOut();
});
window.addEventListener("hashchange", route);

loadSession().then(route, (error) => replace(main, h("p", { role: "alert" }, `The console cannot reach the server: ${error.message}`)));
