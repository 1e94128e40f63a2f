// The one way the console talks to the server: every call carries the admin token kept in
// sessionStorage (gone when the tab closes), and every failure becomes an ApiError holding the
// API's message and the field it names, so pages can show it next to that field.

const KEY = 'fleetplane.adminToken';

export function token() {
  return sessionStorage.getItem(KEY);
}

export function setToken(value) {
  sessionStorage.setItem(KEY, value);
}

export function clearToken() {
  sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(status, body, fallback) {
    const e = body && body.error ? body.error : {};
    super(e.message || fallback || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || null;
    this.param = e.param || null;
  }
}

// Pages that get a 401 mid-session (token revoked, server restarted with another token)
// send the operator back to the login page through this event.
export const unauthorized = new EventTarget();

// `text`: a body sent as it is, of Content-Type `type` (a file's text), instead of `body` as JSON.
async function request(path, { method = 'GET', body, text, type, as = 'json', bearer } = {}) {
  const headers = { Authorization: `Bearer ${bearer ?? token() ?? ''}` };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  if (text !== undefined) headers['Content-Type'] = type;
  let res;
  try {
    res = await fetch(`/api${path}`, {
      method,
      headers,
      body: text !== undefined ? text : body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    throw new ApiError(0, null, `the control plane cannot be reached (${e.message})`);
  }
  if (!res.ok) {
    let data = null;
    try {
      data = await res.json();
    } catch {
      // Not every failure has a JSON body (a proxy's 502, say); the status says enough.
    }
    const err = new ApiError(res.status, data);
    if (res.status === 401 && bearer === undefined) unauthorized.dispatchEvent(new Event('unauthorized'));
    throw err;
  }
  if (res.status === 204) return null;
  return as === 'text' ? res.text() : res.json();
}

export const get = (path, opts) => request(path, opts);
export const getText = (path) => request(path, { as: 'text' });
export const put = (path, body) => request(path, { method: 'PUT', body });
export const post = (path, body) => request(path, { method: 'POST', body });
export const postText = (path, text, type) => request(path, { method: 'POST', text, type });

// Checks a token before keeping it: 401 means unknown, 403 a token that is not an admin's.
export async function login(candidate) {
  await request('/fleet', { bearer: candidate });
  setToken(candidate);
}
