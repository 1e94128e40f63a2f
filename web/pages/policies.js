// Policies: the policy set in force (router, the engines' prefill scheduler and KV water
// marks, the P/D autoscaler) and its editor, with the API's validation message shown next to
// the field it names; the SLO targets; and the history of versions with who made each and a
// one-click rollback (a PUT of the old version's whole set, which makes a new version, so the
// history stays append-only).

import { get, put, ApiError } from '../api.js';
import { h, replace, errorBox, every } from '../dom.js';

export const title = 'Policies';

// The router being edited, kept for the what-if page so that "try it first" carries it over.
export const DRAFT_KEY = 'fleetplane.draftRouter';
// The edited scheduling ({prefill_scheduler, kv_high_water, kv_low_water}), for the what-if.
export const DRAFT_SCHEDULING_KEY = 'fleetplane.draftScheduling';

// The policy's fields, in the order of the form; each has a message box `${field}-message`.
const FIELDS = ['router', 'prefill_scheduler', 'kv_high_water', 'kv_low_water', 'autoscaler'];

// A share as an operator reads it (0.72, not 0.7200000000000001); null: off.
function water(x) {
  return x === null || x === undefined ? 'off' : String(Number(x.toFixed(3)));
}

// An engine's scheduling in one line: "fair, KV high-water 0.9 / low 0.6".
export function schedulingText(s) {
  if (!s) return 'not reported yet';
  const marks = s.kv_high_water === null || s.kv_high_water === undefined
    ? 'no KV high-water mark' : `KV high-water ${water(s.kv_high_water)} / low ${s.kv_low_water == null ? '80% of it' : water(s.kv_low_water)}`;
  return `${s.prefill_scheduler}, ${marks}`;
}

export function mount(el) {
  const current = h('div', { class: 'card', id: 'policy-current' });
  const router = h('input', { id: 'router', list: 'router-names', autocomplete: 'off', size: 28 });
  const names = h('datalist', { id: 'router-names' });
  const prefill = h('select', { id: 'prefill-scheduler' });
  const high = h('input', { id: 'kv-high-water', type: 'number', step: 'any', placeholder: 'off' });
  const low = h('input', { id: 'kv-low-water', type: 'number', step: 'any', placeholder: '80% of high-water' });
  const autoscaler = h('select', { id: 'autoscaler' });
  const messages = Object.fromEntries(FIELDS.map((f) => [f, h('div', { id: `${f}-message`, class: 'field-message', 'aria-live': 'polite' })]));
  const policyMsg = h('div', { id: 'policy-message', 'aria-live': 'polite' });
  const ttft = h('input', { id: 'ttft-ms', type: 'number', step: 'any' });
  const tpot = h('input', { id: 'tpot-ms', type: 'number', step: 'any' });
  const sloMsg = h('div', { id: 'slo-message', 'aria-live': 'polite' });
  const historyBody = h('tbody');
  const status = h('div');

  const number = (input) => (input.value.trim() === '' ? null : Number(input.value));
  const edited = () => ({
    router: router.value.trim(),
    prefill_scheduler: prefill.value,
    kv_high_water: number(high),
    kv_low_water: number(low),
    autoscaler: autoscaler.value === '' ? null : autoscaler.value,
  });
  const keepDraft = () => {
    const p = edited();
    sessionStorage.setItem(DRAFT_KEY, p.router);
    sessionStorage.setItem(DRAFT_SCHEDULING_KEY, JSON.stringify(
      { prefill_scheduler: p.prefill_scheduler, kv_high_water: p.kv_high_water, kv_low_water: p.kv_low_water }));
  };

  // A 400 naming a field goes next to that field; anything else under the form.
  const showError = (e) => {
    const field = e instanceof ApiError && e.status === 400 && FIELDS.includes(e.param) ? e.param : null;
    if (field) replace(messages[field], errorBox(e.message));
    replace(policyMsg, errorBox(field ? `Not saved: ${field} is not valid (see above).` : `Not saved: ${e.message}`));
  };

  const savePolicy = async (policy) => {
    FIELDS.forEach((f) => replace(messages[f]));
    replace(policyMsg, h('p', { class: 'muted' }, 'saving…'));
    try {
      const res = await put('/policies', policy);
      replace(policyMsg, h('p', { class: 'ok' },
        `Saved as version ${res.version}: ${res.policy.router}, ${res.policy.prefill_scheduler} prefill are in force.`));
      await refresh(true);
    } catch (e) {
      showError(e);
    }
  };

  const field = (name, label, input) => h('div', {}, h('label', { for: input.id }, label), input, messages[name]);
  // novalidate: the server's checks, shown next to each field, are the only ones.
  const policyForm = h('form', { class: 'card', id: 'policy-form', novalidate: true },
    h('h2', {}, 'Policy set'),
    field('router', 'Router', router), names,
    field('prefill_scheduler', 'Prefill scheduler (every engine)', prefill),
    h('div', { class: 'columns' },
      field('kv_high_water', 'KV high-water mark (share, empty: off)', high),
      field('kv_low_water', 'KV low-water mark (share)', low)),
    field('autoscaler', 'Autoscaler (serve --mode pd)', autoscaler),
    h('div', { class: 'buttons' },
      h('button', { type: 'submit' }, 'Save and apply'),
      h('button', { type: 'button', class: 'secondary', onclick: () => {
        keepDraft();
        location.hash = '#/whatif';
      } }, 'Try it in the what-if first')),
    policyMsg);
  policyForm.addEventListener('submit', (ev) => {
    ev.preventDefault();
    savePolicy(edited());
  });
  policyForm.addEventListener('input', keepDraft);

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
      replace(sloMsg, errorBox(e instanceof ApiError && e.status === 400 ? e.message : `Not saved: ${e.message}`));
    }
  });

  replace(el, h('h1', {}, 'Policies'), status, current,
    h('div', { class: 'columns' }, policyForm, sloForm),
    h('div', { class: 'card' }, h('h2', {}, 'History'),
      h('table', { id: 'policy-history' },
        h('thead', {}, h('tr', {}, ['version', 'router', 'prefill', 'KV high / low', 'autoscaler', 'author', 'when (UTC)', '']
          .map((c) => h('th', {}, c)))),
        historyBody)));

  let filled = false;
  // `fill`: put the policy in force into the editor (first load, and after a save).
  async function refresh(fill = false) {
    const [p, hist, slo] = await Promise.all([get('/policies'), get('/policies/history'), filled ? null : get('/slo')]);
    const cli = p.valid.command_line_autoscaler;
    replace(current,
      h('h2', {}, 'In force'),
      h('p', {}, 'Router ', h('strong', { id: 'policy-in-force' }, p.in_force.router),
        p.in_force.autoscaler ? ` · autoscaler ${p.in_force.autoscaler}` : '',
        ` · version ${p.version} by ${p.author}${p.created_at ? ` at ${p.created_at.replace('T', ' ')}` : ''}`),
      h('ul', { id: 'engines-in-force' }, p.in_force.engines.length === 0
        ? h('li', { class: 'muted' }, 'No engine registered.')
        : p.in_force.engines.map((e) => h('li', { 'data-engine': e.name }, `${e.name}: ${schedulingText(e.scheduling)}`))));
    replace(names, p.valid.router.map((n) => h('option', { value: n })));
    if (!filled || fill) {
      const keep = (select, options) => {
        const v = select.value;
        replace(select, options);
        select.value = v;
      };
      keep(prefill, p.valid.prefill_scheduler.map((n) => h('option', { value: n }, n)));
      keep(autoscaler, [h('option', { value: '' }, cli ? `command line's (${cli})` : 'none (colocated fleet)'),
        p.valid.autoscaler.map((n) => h('option', { value: n }, n))]);
      const draft = filled ? null : sessionStorage.getItem(DRAFT_KEY);
      router.value = draft || p.policy.router;
      prefill.value = p.policy.prefill_scheduler;
      high.value = p.policy.kv_high_water ?? '';
      low.value = p.policy.kv_low_water ?? '';
      autoscaler.value = p.policy.autoscaler ?? '';
      if (!filled) {
        ttft.value = slo.ttft_ms;
        tpot.value = slo.tpot_ms;
      }
      filled = true;
    }
    const latest = hist.versions[0]?.version;
    replace(historyBody, hist.versions.length === 0
      ? h('tr', {}, h('td', { colspan: 8, class: 'empty' }, 'No stored version: the command line\'s router and the engines\' own scheduling are in force.'))
      : hist.versions.map((v) => {
        const q = v.policy;
        return h('tr', { 'data-version': v.version },
          h('td', {}, v.version), h('td', {}, q.router), h('td', { class: 'prefill' }, q.prefill_scheduler ?? 'fcfs'),
          h('td', {}, `${water(q.kv_high_water)} / ${q.kv_high_water == null ? '—' : (q.kv_low_water ?? 'default')}`),
          h('td', {}, q.autoscaler ?? 'command line\'s'), h('td', {}, v.author),
          h('td', {}, v.created_at.replace('T', ' ').replace('Z', '')),
          h('td', {}, v.version === latest ? h('span', { class: 'badge serving' }, 'current')
            : h('button', { type: 'button', class: 'secondary rollback', onclick: () => savePolicy(q) },
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
