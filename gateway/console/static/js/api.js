// The admin REST as the console calls it: the session's cookie goes with every request, and a
// request that changes state carries the CSRF token the session API handed out.

let csrfToken = null;
let onSignedOut = () => {};

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.param = error.param || null;
    this.code = error.code || null;
  }
}

export function setSession(state, signedOut) {
  csrfToken = state && state.signed_in ? state.csrf_token : null;
  if (signedOut) onSignedOut = signedOut;
}

async function call(method, path, { params, json, form } = {}) {
  const url = new URL(path, location.origin);
  for (const [name, value] of Object.entries(params || {})) {
    for (const item of [].concat(value)) {
      if (item !== null && item !== undefined && item !== "") url.searchParams.append(name, item);
    }
  }
  const headers = { Accept: "application/json" };
  if (method !== "GET" && csrfToken) headers["X-CSRF-Token"] = csrfToken;
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form) {
    body = form;
  }
  const response = await fetch(url, { method, headers, body, credentials: "same-origin" });
  if (response.status === 204) return null;
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const error = new ApiError(response.status, data);
    if (response.status === 401 && !path.startsWith("/console/api/session")) onSignedOut();
    throw error;
  }
  return data;
}

export const api = {
  get: (path, params) => call("GET", path, { params }),
  post: (path, json) => call("POST", path, { json }),
  patch: (path, json) => call("PATCH", path, { json }),
  delete: (path) => call("DELETE", path),
  upload: (path, form) => call("POST", path, { form }),
};
