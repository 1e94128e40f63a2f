// The console's shell: the login page, the navigation, and a hash route per page
// (#/fleet, #/slo, ...). A page module exports `title` and `mount(el)`; mount returns a
// function that stops what the page started (its polling) when the operator leaves it.

import { token, login, clearToken, unauthorized, ApiError } from './api.js';
import { h, replace, errorBox } from './dom.js';
import * as fleet from './pages/fleet.js';
import * as slo from './pages/slo.js';
import * as cache from './pages/cache.js';
import * as scaling from './pages/scaling.js';
import * as policies from './pages/policies.js';
import * as whatif from './pages/whatif.js';
import * as runs from './pages/runs.js';

const PAGES = { fleet, slo, cache, scaling, policies, whatif, runs };
const main = document.getElementById('main');
const nav = document.getElementById('nav');
const logout = document.getElementById('logout');
let stop = null;

function leave() {
  if (stop) stop();
  stop = null;
}

function showLogin(message) {
  leave();
  nav.replaceChildren();
  logout.hidden = true;
  const input = h('input', { id: 'token', type: 'password', autocomplete: 'off', required: true, size: 48 });
  const status = h('div', { id: 'login-status' }, message ? errorBox(message) : null);
  const form = h('form', { id: 'login', class: 'card narrow' },
    h('h1', {}, 'Log in'),
    h('p', {}, 'The admin token of this control plane (printed by ',
      h('code', {}, 'fleetplane serve'), ' or ', h('code', {}, 'fleetplane demo'),
      ', or set by FLEETPLANE_ADMIN_TOKEN). It is kept for this tab only.'),
    h('label', { for: 'token' }, 'Admin token'), input,
    h('button', { type: 'submit' }, 'Log in'), status);
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    replace(status, h('p', { class: 'muted' }, 'checking…'));
    try {
      await login(input.value.trim());
      if (!location.hash || location.hash === '#/login') location.hash = '#/fleet';
      route();
    } catch (e) {
      const why = e instanceof ApiError && e.status === 401 ? 'this control plane does not know this token'
        : e instanceof ApiError && e.status === 403 ? 'this token is not an admin token'
          : e.message;
      replace(status, errorBox(`Refused: ${why} (${e.status || 'no answer'}).`));
    }
  });
  replace(main, form);
  input.focus();
}

function route() {
  if (!token()) {
    showLogin();
    return;
  }
  const name = (location.hash.match(/^#\/(\w+)/) || [])[1];
  const page = PAGES[name] ? name : 'fleet';
  leave();
  logout.hidden = false;
  replace(nav, Object.entries(PAGES).map(([key, p]) =>
    h('a', { href: `#/${key}`, class: key === page ? 'active' : '' }, p.title)));
  const el = h('section', { id: `page-${page}` });
  replace(main, el);
  stop = PAGES[page].mount(el);
}

logout.addEventListener('click', () => {
  clearToken();
  showLogin();
});
unauthorized.addEventListener('unauthorized', () => {
  clearToken();
  showLogin('Your token was refused by the control plane (401): log in again.');
});
window.addEventListener('hashchange', route);
route();
