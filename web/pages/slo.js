// SLO and pools: engines per pool, SLO load, latency percentiles and attainment over the
// last minutes, from the server's once-a-second samples (GET /api/history).

import { get } from '../api.js';
import { h, replace, errorBox, every, pct, fmt, ms } from '../dom.js';
import { lineChart } from '../chart.js';
import * as history from '../history.js';

export const title = 'SLO & pools';

const NOT_MEASURED = 'not measured: the fleet is colocated (serve --mode pd computes the loads of its pools)';

// A series of the samples' `key`, or why it is missing when no sample has it.
function measured(label, key) {
  const points = history.series((s) => s[key]);
  return points.some(([, y]) => y !== null) ? { label, points } : { label, missing: NOT_MEASURED };
}

// Rows of a class or tenant table: requests finished in the window, TTFT p50/p99, attainment.
function groupCells(g) {
  return [
    h('td', { class: 'num' }, fmt(g?.finished ?? 0)),
    h('td', { class: 'num' }, ms(g?.ttft_ms?.p50)),
    h('td', { class: 'num' }, ms(g?.ttft_ms?.p99)),
    h('td', { class: 'num' }, pct(g?.slo_attainment)),
  ];
}

// Flow control and latency by request class and by tenant, from the newest sample.
function classesCard(sample, w) {
  const flow = sample?.flow;
  const byClass = sample?.window.by_class ?? {};
  const tenants = sample?.window.by_tenant ?? [];
  const head = (first, more) => h('thead', {}, h('tr', {},
    [first, `finished (last ${w} s)`, 'TTFT p50', 'TTFT p99', 'within SLO', ...more].map((c) => h('th', {}, c))));
  return h('div', { class: 'card', id: 'classes' },
    h('h2', {}, 'Classes and tenants'),
    h('p', { class: 'muted' }, `Flow control in force: ${flow?.rule ?? '—'}. Queued: waiting for room at the controller now; `
      + 'shed: refused by flow control since the server started (with 429 or 503 and Retry-After).'),
    h('table', { id: 'class-table' },
      head('class', ['queued', 'shed']),
      h('tbody', {}, ['interactive', 'standard', 'batch'].map((c) => h('tr', { 'data-class': c },
        h('td', {}, c), ...groupCells(byClass[c]),
        h('td', { class: 'num' }, fmt(flow?.queued?.[c] ?? 0)),
        h('td', { class: 'num' }, fmt(flow?.shed?.[c] ?? 0)))))),
    h('h3', {}, 'By tenant (the ten with the most requests)'),
    tenants.length === 0
      ? h('p', { class: 'muted' }, `No request finished in the last ${w} s.`)
      : h('table', { id: 'tenant-table' },
        head('tenant', []),
        h('tbody', {}, tenants.map((t) => h('tr', { 'data-tenant': t.tenant }, h('td', { class: 'mono' }, t.tenant), ...groupCells(t))))));
}

export function mount(el) {
  const charts = h('div', { class: 'charts' });
  const status = h('div');
  const targets = h('p', { class: 'muted' });
  const classes = h('div');
  replace(el, h('h1', {}, 'SLO & pools'), targets, status, classes, charts);
  let slo = null;
  return every(2000, async () => {
    try {
      [slo] = await Promise.all([slo ? Promise.resolve(slo) : get('/slo'), history.refresh()]);
      const w = history.windowLength();
      replace(targets, `SLO targets: TTFT ≤ ${slo.ttft_ms} ms, TPOT ≤ ${slo.tpot_ms} ms (edit them on the Policies page). `,
        `Latency and attainment are over the requests that finished in the last ${w} s, sampled every second.`);
      replace(classes, classesCard(history.latest(), w));
      const pools = history.pools();
      const hasPd = pools.includes('prefill') && pools.includes('decode');
      const pd = (s) => {
        const p = s.pools.prefill?.serving;
        const d = s.pools.decode?.serving;
        return p && d ? p / d : null;
      };
      replace(charts,
        lineChart({
          title: 'Serving engines per pool (dashed: starting)',
          series: [
            ...pools.map((p) => ({ label: p, points: history.series((s) => s.pools[p]?.serving ?? 0) })),
            ...(hasPd ? ['prefill', 'decode'].map((p) => ({
              label: `${p} starting`, dashed: true, points: history.series((s) => s.pools[p]?.starting ?? 0),
            })) : []),
          ],
        }),
        lineChart({
          title: 'SLO load (1.0 = at the target)',
          series: [measured('Load_P', 'load_p'), measured('Load_D', 'load_d')],
          reference: { y: 1, label: '1.0' },
        }),
        lineChart({
          title: 'P/D ratio (prefill engines per decode engine)',
          series: [hasPd
            ? { label: 'P/D', points: history.series(pd) }
            : { label: 'P/D', missing: `no prefill and decode pools: the fleet is colocated (pools: ${pools.join(', ') || 'none'})` }],
        }),
        lineChart({
          title: `TTFT percentiles (last ${w} s)`,
          yLabel: 'ms',
          series: ['p50', 'p90', 'p99'].map((q) => ({ label: `TTFT ${q}`, points: history.series((s) => s.window.ttft_ms?.[q]) })),
          reference: { y: slo.ttft_ms, label: `target ${slo.ttft_ms} ms` },
        }),
        lineChart({
          title: `TPOT percentiles (last ${w} s)`,
          yLabel: 'ms',
          series: ['p50', 'p90', 'p99'].map((q) => ({ label: `TPOT ${q}`, points: history.series((s) => s.window.tpot_ms?.[q]) })),
          reference: { y: slo.tpot_ms, label: `target ${slo.tpot_ms} ms` },
        }),
        lineChart({
          title: `SLO attainment (last ${w} s)`,
          series: [{ label: 'attainment', points: history.series((s) => s.window.slo_attainment) }],
          yMax: 1,
          format: (v) => pct(v, 0),
        }),
        lineChart({
          title: 'Gateway requests per second, by outcome',
          series: ['ok', 'failed', 'rejected', 'unavailable'].map((o) => ({ label: o, points: history.series((s) => s.requests[o] ?? 0) })),
        }));
      replace(status);
    } catch (e) {
      replace(status, errorBox(`Cannot read the history: ${e.message}`));
    }
  });
}
