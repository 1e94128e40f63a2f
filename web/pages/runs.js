// Simulation runs: the stored runs, newest first; one run's numbers and CDF chart, or the
// runs of two or more simulations side by side.

import { get } from '../api.js';
import { h, replace, errorBox, every } from '../dom.js';
import { comparisonTable, cdfChart, runsOf } from '../report.js';

export const title = 'Simulations';

export function mount(el) {
  const selected = new Set();
  const listBody = h('tbody');
  const status = h('div');
  const detail = h('div', { id: 'run-detail' });
  const compareBtn = h('button', { type: 'button', id: 'compare-selected', disabled: true, onclick: () => compare() }, 'Compare selected');

  replace(el, h('h1', {}, 'Simulation runs'), status,
    h('div', { class: 'card' },
      h('table', { id: 'runs' },
        h('thead', {}, h('tr', {}, ['', 'id', 'state', 'submitted by', 'submitted (UTC)', 'finished (UTC)', ''].map((c) => h('th', {}, c)))),
        listBody),
      h('div', { class: 'buttons' }, compareBtn, h('span', { class: 'muted' }, ' tick two or more finished runs'))),
    detail);

  async function show(id) {
    replace(detail, h('p', { class: 'muted' }, `loading simulation ${id}…`));
    try {
      const sim = await get(`/simulations/${id}`);
      const card = h('div', { class: 'card' }, h('h2', {}, `Simulation ${id}`), comparisonTable(runsOf(sim)));
      replace(detail, card);
      card.append(h('h3', {}, 'TTFT and TPOT distributions'), await cdfChart(id));
    } catch (e) {
      replace(detail, errorBox(`Cannot show simulation ${id}: ${e.message}`));
    }
  }

  async function compare() {
    const ids = [...selected].sort((a, b) => a - b);
    replace(detail, h('p', { class: 'muted' }, `loading simulations ${ids.join(', ')}…`));
    try {
      const sims = await Promise.all(ids.map((id) => get(`/simulations/${id}`)));
      const runs = sims.flatMap((sim) => runsOf(sim).map((r) => ({ ...r, label: `#${sim.id} ${r.label}` })));
      const card = h('div', { class: 'card', id: 'comparison' }, h('h2', {}, `Simulations ${ids.join(', ')} compared`),
        h('p', { class: 'muted' }, 'Runs of different scenarios compare different workloads: read each column with its scenario in mind.'),
        comparisonTable(runs));
      replace(detail, card);
      for (const id of ids) card.append(h('h3', {}, `Simulation ${id}`), await cdfChart(id));
    } catch (e) {
      replace(detail, errorBox(`Cannot compare: ${e.message}`));
    }
  }

  return every(3000, async () => {
    try {
      const { simulations } = await get('/simulations');
      replace(listBody, simulations.length === 0
        ? h('tr', {}, h('td', { colspan: 7, class: 'empty' }, 'No simulation has run yet: start one on the What-if page.'))
        : simulations.map((s) => {
          const done = s.state === 'done';
          const box = h('input', { type: 'checkbox', class: 'pick', 'data-id': s.id, disabled: !done, checked: selected.has(s.id) });
          box.addEventListener('change', () => {
            if (box.checked) selected.add(s.id);
            else selected.delete(s.id);
            compareBtn.disabled = selected.size < 2;
          });
          return h('tr', { 'data-simulation': s.id },
            h('td', {}, box), h('td', {}, s.id),
            h('td', {}, h('span', { class: `badge ${s.state}`, title: s.error || '' }, s.state)),
            h('td', {}, s.submitted_by), h('td', {}, s.submitted_at.replace('T', ' ').replace('Z', '')),
            h('td', {}, (s.finished_at || '').replace('T', ' ').replace('Z', '')),
            h('td', {}, done ? h('button', { type: 'button', class: 'secondary', onclick: () => show(s.id) }, 'Show') : (s.error || '')));
        }));
      compareBtn.disabled = selected.size < 2;
      replace(status);
    } catch (e) {
      replace(status, errorBox(`Cannot list the simulations: ${e.message}`));
    }
  });
}
