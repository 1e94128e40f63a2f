// Policies: the routing policy in force and its editor, the SLO targets, and the history of
// policy versions with who made each and a one-click rollback (a PUT of the old policy,
// which makes a new version, so the history stays append-only).

import { get, put, ApiError } from '../api.js';
import { h, replace, errorBox, every } from '../dom.js';

export const title = 'Policies';

// The router being edited, kept for the what-if page so that "try it first" carries it over.
export const DRAFT_KEY = 'fleetplane.draftRouter';

function fieldError(box, e, param) {
  const inline = e instanceof ApiError && (e.param === param || e.status === 400);
  replace(box, errorBox(inline ? e.message : `Not saved: ${e.message}`));
}

export function mount(el) {
  const current = h('div', { class: 'card', id: 'policy-current' });
  const router = h('input', { id: 'router', list: 'router-names', autocomplete: 'off', size: 28 });
  const names = h('datalist', { id: 'router-names' });
  const routerMsg = h('div', { id: 'router-message', 'aria-live': 'polite' });
  const ttft = h('input', { id: 'ttft-ms', type: 'number', step: 'any' });
  const tpot = h('input', { id: 'tpot-ms', type: 'number', step: 'any' });
  const sloMsg = h('div', { id: 'slo-message', 'aria-live': 'polite' });
  const historyBody = h('tbody');
  const status = h('div');

  const savePolicy = async (value, where) => {
    replace(where, h('p', { class: 'muted' }, 'saving…'));
    try {
      const res = await put('/policies', { router: value });
      replace(where, h('p', { class: 'ok' }, `Saved as version ${res.version}: ${res.policy.router} is in force.`));
      await refresh();
    } catch (e) {
      fieldError(where, e, 'router');
    }
  };

  const routerForm = h('form', { class: 'card', id: 'policy-form' },
    h('h2', {}, 'Routing policy'),
    h('label', { for: 'router' }, 'Router'), router, names,
    h('div', { class: 'buttons' },
      h('button', { type: 'submit' }, 'Save and apply'),
      h('button', { type: 'button', class: 'secondary', onclick: () => {
        sessionStorage.setItem(DRAFT_KEY, router.value.trim());
        location.hash = '#/whatif';
      } }, 'Try it in the what-if first')),
    routerMsg);
  routerForm.addEventListener('submit', (ev) => {
    ev.preventDefault();
    savePolicy(router.value.trim(), routerMsg);
  });
  router.addEventListener('input', () => sessionStorage.setItem(DRAFT_KEY, router.value.trim()));

  const sloForm = h('form', { class: 'card', id: 'slo-form' },
    h('h2', {}, 'SLO targets'),
    h('label', { for: 'ttft-ms' }, 'TTFT target (ms)'), ttft,
    h('label', { for: 'tpot-ms' }, 'TPOT target (ms)'), tpot,
    h('div', { class: 'buttons' }, h('button', { type: 'submit' }, 'Save targets')),
    sloMsg);
  sloForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    try {
      const res = await put('/slo', { ttft_ms: Number(ttft.value), tpot_ms: Number(tpot.value) });
      replace(sloMsg, h('p', { class: 'ok' }, `Saved: TTFT ≤ ${res.ttft_ms} ms, TPOT ≤ ${res.tpot_ms} ms.`));
    } catch (e) {
      fieldError(sloMsg, e, e.param);
    }
  });

  replace(el, h('h1', {}, 'Policies'), status, current,
    h('div', { class: 'columns' }, routerForm, sloForm),
    h('div', { class: 'card' }, h('h2', {}, 'History'),
      h('table', { id: 'policy-history' },
        h('thead', {}, h('tr', {}, ['version', 'router', 'author', 'when (UTC)', ''].map((c) => h('th', {}, c)))),
        historyBody)));

  let filled = false;
  async function refresh() {
    const [p, hist, slo] = await Promise.all([get('/policies'), get('/policies/history'), filled ? null : get('/slo')]);
    replace(current,
      h('h2', {}, 'In force'),
      h('p', {}, h('strong', { id: 'policy-in-force' }, p.in_force.router),
        ` · version ${p.version} by ${p.author}${p.created_at ? ` at ${p.created_at.replace('T', ' ')}` : ''}`));
    replace(names, p.valid.router.map((n) => h('option', { value: n })));
    if (!filled) {
      router.value = sessionStorage.getItem(DRAFT_KEY) || p.policy.router;
      ttft.value = slo.ttft_ms;
      tpot.value = slo.tpot_ms;
      filled = true;
    }
    const latest = hist.versions[0]?.version;
    replace(historyBody, hist.versions.length === 0
      ? h('tr', {}, h('td', { colspan: 5, class: 'empty' }, 'No stored version: the router given on the command line is in force.'))
      : hist.versions.map((v) => {
        return h('tr', { 'data-version': v.version },
          h('td', {}, v.version), h('td', {}, v.policy.router), h('td', {}, v.author),
          h('td', {}, v.created_at.replace('T', ' ').replace('Z', '')),
          h('td', {}, v.version === latest ? h('span', { class: 'badge serving' }, 'current')
            : h('button', { type: 'button', class: 'secondary rollback', onclick: () => savePolicy(v.policy.router, routerMsg) },
              `Roll back to v${v.version}`)));
      }));
  }

  return every(3000, async () => {
    try {
      await refresh();
      replace(status);
    } catch (e) {
      replace(status, errorBox(`Cannot read the policy: ${e.message}`));
    }
  });
}
