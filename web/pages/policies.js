// Policies: the policy set in force (router, the engines' prefill scheduler and KV water
// marks, the P/D autoscaler, flow control, each with its parameters) and its editor, with the API's
// validation message shown next to the field it names; "apply tuned policy", a policy file
// as `fleetplane tune` writes it sent as it is; the SLO targets; and the history of versions
// with who made each and a one-click rollback (a PUT of the old version's whole set, which
// makes a new version, so the history stays append-only).

import { get, put, postText, ApiError } from '../api.js';
import { h, replace, errorBox, every } from '../dom.js';

export const title = 'Policies';

// The router being edited, kept for the what-if page so that "try it first" carries it over.
export const DRAFT_KEY = 'fleetplane.draftRouter';
// The edited scheduling ({prefill_scheduler, kv_high_water, kv_low_water}), for the what-if.
export const DRAFT_SCHEDULING_KEY = 'fleetplane.draftScheduling';

// The policy's fields, in the order of the form; each has a message box `${field}-message`.
const FIELDS = ['router', 'router_params', 'prefill_scheduler', 'prefill_params', 'kv_high_water', 'kv_low_water',
  'max_batch_tokens', 'autoscaler', 'autoscaler_params', 'flow', 'flow_params'];

// Parameters as an operator writes them: "copy_weight=2, hot_slack=4" (empty: none).
export function paramsText(params) {
  return Object.entries(params || {}).map(([k, v]) => `${k}=${v}`).join(', ');
}

// The inverse of paramsText; a value that is not a number goes as null, for the server to
// name (it is the only checker).
function parseParams(text) {
  const pairs = text.split(',').map((p) => p.trim()).filter((p) => p !== '').map((p) => {
    const [k, v = ''] = p.split('=');
    const n = v.trim() === '' ? NaN : Number(v);
    return [k.trim(), Number.isFinite(n) ? n : null];
  });
  return Object.fromEntries(pairs);
}

// A router with the parameters a policy gives it: "cache-aware(copy_weight=2)".
export function routerLabel(router, params) {
  const p = Object.entries(params || {}).map(([k, v]) => `${k}=${v}`).join(',');
  return p === '' ? router : `${router}(${p})`;
}

// The policy field a 400's `param` falls under (`router_params.copy_weight`: router_params).
function fieldOf(e) {
  const field = e instanceof ApiError && e.status === 400 && e.param ? e.param.split('.')[0] : null;
  return FIELDS.includes(field) ? field : null;
}

// A share as an operator reads it (0.72, not 0.7200000000000001); null: off.
function water(x) {
  return x === null || x === undefined ? 'off' : String(Number(x.toFixed(3)));
}

// An engine's scheduling in one line: "fair, KV high-water 0.9 / low 0.6; step budget 8192".
export function schedulingText(s) {
  if (!s) return 'not reported yet';
  const marks = s.kv_high_water === null || s.kv_high_water === undefined
    ? 'no KV high-water mark' : `KV high-water ${water(s.kv_high_water)} / low ${s.kv_low_water == null ? '80% of it' : water(s.kv_low_water)}`;
  const fair = paramsText(s.prefill_params);
  const budget = s.max_batch_tokens == null ? '' : `; step budget ${s.max_batch_tokens}`;
  return `${s.prefill_scheduler}, ${marks}${fair ? `; ${fair}` : ''}${budget}`;
}

export function mount(el) {
  const current = h('div', { class: 'card', id: 'policy-current' });
  const router = h('input', { id: 'router', list: 'router-names', autocomplete: 'off', size: 28 });
  const names = h('datalist', { id: 'router-names' });
  const paramsInput = (id) => h('input', { id, autocomplete: 'off', size: 36, placeholder: 'name=value, … (empty: defaults)' });
  const routerParams = paramsInput('router-params');
  const prefillParams = paramsInput('prefill-params');
  const autoscalerParams = paramsInput('autoscaler-params');
  const flowParams = paramsInput('flow-params');
  const flow = h('select', { id: 'flow' });
  // What the form does not edit (class priority, the classes' SLOs) is kept as loaded.
  let loaded = {};
  const prefill = h('select', { id: 'prefill-scheduler' });
  const high = h('input', { id: 'kv-high-water', type: 'number', step: 'any', placeholder: 'off' });
  const low = h('input', { id: 'kv-low-water', type: 'number', step: 'any', placeholder: '80% of high-water' });
  const budget = h('input', { id: 'max-batch-tokens', type: 'number', step: '1', placeholder: 'the engines\' own' });
  const autoscaler = h('select', { id: 'autoscaler' });
  const messages = Object.fromEntries(FIELDS.map((f) => [f, h('div', { id: `${f}-message`, class: 'field-message', 'aria-live': 'polite' })]));
  const policyMsg = h('div', { id: 'policy-message', 'aria-live': 'polite' });
  const ttft = h('input', { id: 'ttft-ms', type: 'number', step: 'any' });
  const tpot = h('input', { id: 'tpot-ms', type: 'number', step: 'any' });
  const sloMsg = h('div', { id: 'slo-message', 'aria-live': 'polite' });
  const tunedFile = h('input', { id: 'tuned-file', type: 'file', accept: '.toml,.json,application/toml,application/json,text/plain' });
  const tunedText = h('textarea', { id: 'tuned-text', rows: 8, spellcheck: 'false',
    placeholder: 'router = "cache-aware"\n\n[router_params]\ncopy_weight = 2.0' });
  const tunedMsg = h('div', { id: 'tuned-message', 'aria-live': 'polite' });
  const historyBody = h('tbody');
  const status = h('div');

  const number = (input) => (input.value.trim() === '' ? null : Number(input.value));
  const edited = () => ({
    router: router.value.trim(),
    router_params: parseParams(routerParams.value),
    prefill_scheduler: prefill.value,
    prefill_params: parseParams(prefillParams.value),
    kv_high_water: number(high),
    kv_low_water: number(low),
    max_batch_tokens: number(budget),
    autoscaler: autoscaler.value === '' ? null : autoscaler.value,
    autoscaler_params: parseParams(autoscalerParams.value),
    flow: flow.value === '' ? null : flow.value,
    flow_params: parseParams(flowParams.value),
    class_priority: loaded.class_priority ?? null,
    class_slo: loaded.class_slo ?? {},
  });
  const keepDraft = () => {
    const p = edited();
    sessionStorage.setItem(DRAFT_KEY, p.router);
    sessionStorage.setItem(DRAFT_SCHEDULING_KEY, JSON.stringify({
      router: p.router, router_params: p.router_params, prefill_scheduler: p.prefill_scheduler,
      kv_high_water: p.kv_high_water, kv_low_water: p.kv_low_water, max_batch_tokens: p.max_batch_tokens }));
  };

  // A 400 naming a field goes next to that field; anything else under the form.
  const showError = (e) => {
    const field = fieldOf(e);
    if (field) replace(messages[field], errorBox(e.param === field ? e.message : `${e.param}: ${e.message}`));
    replace(policyMsg, errorBox(field ? `Not saved: ${field} is not valid (see above).` : `Not saved: ${e.message}`));
  };

  const savePolicy = async (policy) => {
    FIELDS.forEach((f) => replace(messages[f]));
    replace(policyMsg, h('p', { class: 'muted' }, 'saving…'));
    try {
      const res = await put('/policies', policy);
      replace(policyMsg, h('p', { class: 'ok' },
        `Saved as version ${res.version}: ${routerLabel(res.policy.router, res.policy.router_params)}, ${res.policy.prefill_scheduler} prefill are in force.`));
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
    field('router_params', 'Router parameters', routerParams),
    field('prefill_scheduler', 'Prefill scheduler (every engine)', prefill),
    field('prefill_params', 'Fair prefill parameters', prefillParams),
    h('div', { class: 'columns' },
      field('kv_high_water', 'KV high-water mark (share, empty: off)', high),
      field('kv_low_water', 'KV low-water mark (share)', low)),
    field('max_batch_tokens', 'Step budget (tokens a step computes; empty: the engines\' own)', budget),
    field('autoscaler', 'Autoscaler (serve --mode pd)', autoscaler),
    field('autoscaler_params', 'Autoscaler parameters', autoscalerParams),
    field('flow', 'Flow control (queues by class and tenant ahead of routing; docs/FLOW.md)', flow),
    field('flow_params', 'Flow parameters', flowParams),
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

  // A tuned policy goes as the file's text: the server reads TOML or JSON and names the key
  // at fault, so the file is applied exactly as `fleetplane tune` wrote it.
  const tunedForm = h('form', { class: 'card', id: 'tuned-form', novalidate: true },
    h('h2', {}, 'Apply tuned policy'),
    h('p', { class: 'muted' }, 'A policy file as fleetplane tune writes it (TOML or JSON): choose it, or paste its text.'),
    h('label', { for: 'tuned-file' }, 'Policy file'), tunedFile,
    h('label', { for: 'tuned-text' }, 'Its text'), tunedText,
    h('div', { class: 'buttons' }, h('button', { type: 'submit' }, 'Apply tuned policy')),
    tunedMsg);
  tunedFile.addEventListener('change', async () => {
    const file = tunedFile.files[0];
    if (file) tunedText.value = await file.text();
  });
  tunedForm.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const text = tunedText.value;
    replace(tunedMsg, h('p', { class: 'muted' }, 'applying…'));
    try {
      const type = text.trimStart().startsWith('{') ? 'application/json' : 'application/toml';
      const res = await postText('/policies/file', text, type);
      const q = res.policy;
      replace(tunedMsg, h('p', { class: 'ok' }, `Applied as version ${res.version}: ${routerLabel(q.router, q.router_params)}`,
        `, ${q.prefill_scheduler} prefill${paramsText(q.prefill_params) ? ` (${paramsText(q.prefill_params)})` : ''}.`));
      await refresh(true);
    } catch (e) {
      replace(tunedMsg, errorBox(e instanceof ApiError && e.param ? `Not applied: ${e.param}: ${e.message}` : `Not applied: ${e.message}`));
    }
  });

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
    h('div', { class: 'columns' }, policyForm, h('div', {}, tunedForm, sloForm)),
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
      h('p', {}, 'Router ', h('strong', { id: 'policy-in-force' }, p.in_force.router_label),
        p.in_force.autoscaler ? ` · autoscaler ${p.in_force.autoscaler}` : '',
        p.policy.flow && p.policy.flow !== 'none' ? ` · flow ${p.policy.flow}` : '',
        ` · version ${p.version} by ${p.author}${p.created_at ? ` at ${p.created_at.replace('T', ' ')}` : ''}`),
      h('p', { id: 'policy-params' }, ['router_params', 'prefill_params', 'autoscaler_params', 'flow_params']
        .filter((k) => paramsText(p.policy[k]) !== '')
        .map((k, i) => [i > 0 ? ' · ' : '', `${k}: `, h('code', { 'data-params': k }, paramsText(p.policy[k]))]),
      p.in_force.autoscaler_params && paramsText(p.in_force.autoscaler_params)
        ? h('p', { class: 'muted' }, `Autoscaler in force: ${paramsText(p.in_force.autoscaler_params)}`) : ''),
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
      keep(flow, p.valid.flow.map((n) => h('option', { value: n }, n)));
      loaded = p.policy;
      const draft = filled ? null : sessionStorage.getItem(DRAFT_KEY);
      router.value = draft || p.policy.router;
      routerParams.value = draft && draft !== p.policy.router ? '' : paramsText(p.policy.router_params);
      prefillParams.value = paramsText(p.policy.prefill_params);
      autoscalerParams.value = paramsText(p.policy.autoscaler_params);
      flowParams.value = paramsText(p.policy.flow_params);
      flow.value = p.policy.flow ?? 'none';
      prefill.value = p.policy.prefill_scheduler;
      high.value = p.policy.kv_high_water ?? '';
      low.value = p.policy.kv_low_water ?? '';
      budget.value = p.policy.max_batch_tokens ?? '';
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
          h('td', {}, v.version), h('td', { class: 'router' }, routerLabel(q.router, q.router_params)),
          h('td', { class: 'prefill' }, [q.prefill_scheduler ?? 'fcfs',
            paramsText(q.prefill_params) ? ` (${paramsText(q.prefill_params)})` : '']),
          h('td', {}, `${water(q.kv_high_water)} / ${q.kv_high_water == null ? '—' : (q.kv_low_water ?? 'default')}`),
          h('td', {}, [q.autoscaler ?? 'command line\'s',
            paramsText(q.autoscaler_params) ? ` (${paramsText(q.autoscaler_params)})` : '']), h('td', {}, v.author),
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
