// What-if: the edited router and scheduling (the router's parameters, prefill scheduler, KV
// high-water mark, step budget, from the policies page) against the ones in force, on the
// same arrivals of a scenario in the simulator (POST /api/simulations with both runs written
// `router@prefill+hw|nohw+bN` with their parameters, and the water marks), compared side by
// side; "apply" puts the edited ones in force on the live fleet (the autoscaler unchanged).

import { get, post, put } from '../api.js';
import { h, replace, errorBox } from '../dom.js';
import { comparisonTable, cdfChart, runsOf } from '../report.js';
import { DRAFT_KEY, DRAFT_SCHEDULING_KEY, schedulingText, routerLabel } from './policies.js';

export const title = 'What-if';

const POLL_MS = 1000;

export function mount(el) {
  let stopped = false;
  let timer = null;
  const pick = h('select', { id: 'scenario-pick' }, h('option', { value: '' }, 'loading the examples…'));
  const traceNote = h('p', { class: 'muted', id: 'trace-note' });
  const text = h('textarea', { id: 'scenario-text', rows: 16, cols: 80, spellcheck: 'false',
    placeholder: 'Pick an example above, or paste a scenario (TOML, as fleetplane simulate --scenario reads it).' });
  const current = h('input', { id: 'current-router', readonly: true, size: 24 });
  const edited = h('input', { id: 'edited-router', list: 'whatif-router-names', autocomplete: 'off', size: 24 });
  const names = h('datalist', { id: 'whatif-router-names' });
  const currentScheduling = h('p', { id: 'current-scheduling', class: 'muted' });
  const editedScheduling = h('p', { id: 'edited-scheduling', class: 'muted' });
  // Each side's router parameters and scheduling ({router, router_params, prefill_scheduler,
  // kv_high_water, kv_low_water, max_batch_tokens}).
  let inForce = null;
  let edit = null;
  const message = h('div', { id: 'whatif-message', 'aria-live': 'polite' });
  const result = h('div', { id: 'whatif-result' });
  let examples = [];

  const form = h('form', { class: 'card', id: 'whatif-form' },
    h('label', { for: 'scenario-pick' }, 'Scenario'), pick, traceNote,
    h('label', { for: 'scenario-text' }, 'Scenario text (editable)'), text,
    h('div', { class: 'columns' },
      h('div', {}, h('label', { for: 'current-router' }, 'Router in force'), current, currentScheduling),
      h('div', {}, h('label', { for: 'edited-router' }, 'Edited router'), edited, names, editedScheduling)),
    h('div', { class: 'buttons' }, h('button', { type: 'submit', id: 'run-whatif' }, 'Run both in the simulator')),
    message);
  replace(el, h('h1', {}, 'What-if'),
    h('p', { class: 'muted' }, 'Runs the scenario twice on the simulator, once with the router and scheduling in force and once with the edited ones, on the same arrivals. ',
      'Max rate under the SLO is not computed here (it takes many runs): use ', h('code', {}, 'fleetplane max-rate --scenario FILE'), '.'),
    form, result);

  pick.addEventListener('change', () => {
    const ex = examples.find((x) => x.name === pick.value);
    if (!ex) return;
    text.value = ex.text;
    replace(traceNote, ex.error ? errorBox(ex.error)
      : ex.trace_found === false ? errorBox(`Its trace ${ex.trace} is not on this server: the run will fail unless you change [workload].`)
        : ex.trace ? `Trace: ${ex.trace}` : 'Synthetic workload: runs anywhere. Lower `requests` for a quicker run.');
  });

  (async () => {
    try {
      const [list, policy] = await Promise.all([get('/scenarios'), get('/policies')]);
      examples = list.scenarios;
      replace(pick, h('option', { value: '' }, '— paste below, or pick an example —'),
        examples.map((x) => h('option', { value: x.name }, x.trace_found === false ? `${x.name} (trace missing)` : x.name)));
      current.value = policy.in_force.router;
      inForce = sideOf(policy.policy);
      const draft = sessionStorage.getItem(DRAFT_SCHEDULING_KEY);
      edit = draft ? { ...inForce, ...JSON.parse(draft) } : inForce;
      currentScheduling.textContent = `${routerLabel(inForce.router, inForce.router_params)}; scheduling: ${schedulingText(inForce)}`;
      editedScheduling.textContent = `Scheduling: ${schedulingText(edit)} (edit it on the Policies page)`;
      edited.value = sessionStorage.getItem(DRAFT_KEY) || '';
      replace(names, policy.valid.router.map((n) => h('option', { value: n })));
    } catch (e) {
      replace(message, errorBox(`Cannot load the examples or the policy: ${e.message}`));
    }
  })();

  async function watch(id, routers, marks) {
    if (stopped) return;
    let sim;
    try {
      sim = await get(`/simulations/${id}`);
    } catch (e) {
      replace(message, errorBox(`Cannot read simulation ${id}: ${e.message}`));
      return;
    }
    if (sim.state === 'queued' || sim.state === 'running') {
      replace(message, h('p', { class: 'muted', id: 'whatif-state' }, `Simulation ${id} ${sim.state}…`));
      timer = setTimeout(() => watch(id, routers, marks), POLL_MS);
      return;
    }
    if (sim.state === 'failed') {
      replace(message, errorBox(`Simulation ${id} failed: ${sim.error}`));
      return;
    }
    replace(message, h('p', { class: 'ok', id: 'whatif-state' }, `Simulation ${id} done.`));
    const runs = runsOf(sim).map((r, k) => ({ ...r, label: `${k === 0 ? 'in force' : 'edited'}: ${r.label}` }));
    const applyMsg = h('div', { id: 'apply-message', 'aria-live': 'polite' });
    const apply = h('button', { type: 'button', id: 'apply-edited', onclick: async () => {
      try {
        // Only the router and scheduling change: the rest of the policy set in force stays.
        // The router runs with the parameters the comparison gave it.
        const { policy } = await get('/policies');
        const router = edited.value.trim();
        const { prefill_scheduler, kv_high_water, kv_low_water, max_batch_tokens } = edit;
        const res = await put('/policies', { ...policy, prefill_scheduler, kv_high_water, kv_low_water,
          max_batch_tokens, router, router_params: paramsFor(router, edit, inForce) });
        replace(applyMsg, h('p', { class: 'ok' }, `Applied: ${res.policy.router} is in force (version ${res.version}).`));
        current.value = res.policy.router;
      } catch (e) {
        replace(applyMsg, errorBox(`Not applied: ${e.message}`));
      }
    } }, `Apply ${routers[1]} to the live fleet`);
    const marksNote = marks && hasHw(inForce) && hasHw(edit) && inForce.kv_high_water !== edit.kv_high_water
      ? h('p', { class: 'muted' }, `Both runs used the edited water marks (${marks.kv_high_water}): a scenario has one pair.`) : null;
    replace(result, h('div', { class: 'card' }, h('h2', {}, `Comparison (simulation ${id})`), comparisonTable(runs),
      marksNote, h('div', { class: 'buttons' }, apply), applyMsg));
    try {
      result.firstChild.append(h('h3', {}, 'TTFT and TPOT distributions'), await cdfChart(id));
    } catch (e) {
      result.firstChild.append(errorBox(`No chart: ${e.message}`));
    }
  }

  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    clearTimeout(timer);
    replace(result);
    if (!edited.value.trim()) {
      replace(message, errorBox('Name the edited router to compare with the one in force.'));
      return;
    }
    const sides = [[current.value.trim(), inForce], [edited.value.trim(), edit]];
    const routers = sides.map(([router, s]) => runName(router, s));
    const entries = sides.map(([router, s], k) => {
      const params = paramsFor(router, s, inForce);
      return Object.keys(params).length === 0 ? routers[k] : { ...params, name: routers[k] };
    });
    if (JSON.stringify(entries[0]) === JSON.stringify(entries[1])) {
      replace(message, errorBox(`The edited policy is the one in force (${routers[0]}): change the router or the scheduling to compare.`));
      return;
    }
    sessionStorage.setItem(DRAFT_KEY, edited.value.trim());
    // A scenario has one pair of water marks: the edited ones when set, else those in force.
    const source = hasHw(edit) ? edit : hasHw(inForce) ? inForce : null;
    const marks = source ? { kv_high_water: source.kv_high_water, kv_low_water: source.kv_low_water ?? null } : null;
    try {
      const { id } = await post('/simulations', { scenario: text.value, routers: entries, water_marks: marks });
      replace(message, h('p', { class: 'muted', id: 'whatif-state' }, `Simulation ${id} queued…`));
      watch(id, routers, marks);
    } catch (e) {
      replace(message, errorBox(e.message));
    }
  });

  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

function sideOf(p) {
  return { router: p.router, router_params: p.router_params || {}, prefill_scheduler: p.prefill_scheduler,
    kv_high_water: p.kv_high_water ?? null, kv_low_water: p.kv_low_water ?? null, max_batch_tokens: p.max_batch_tokens ?? null };
}

// The parameters `router` runs with on a side: the side's own when they are for that router,
// else those in force when it is the router in force, else its defaults (cache-aware's
// weights would be refused by dynamo-kv).
function paramsFor(router, s, inForce) {
  if (router === s.router) return s.router_params || {};
  return router === inForce.router ? inForce.router_params || {} : {};
}

function hasHw(s) {
  return s !== null && s.kv_high_water !== null && s.kv_high_water !== undefined;
}

// A run as the scenario writes it: the router on the fleet with this scheduling (and this
// step budget, when the side sets one; else the scenario's).
function runName(router, s) {
  const budget = s.max_batch_tokens == null ? '' : `+b${s.max_batch_tokens}`;
  return `${router}@${s.prefill_scheduler}+${hasHw(s) ? 'hw' : 'nohw'}${budget}`;
}
