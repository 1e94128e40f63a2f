// Comparison of simulation runs: one column per run (a router of a report), one row per
// number, the best of each row marked. Used by the what-if and simulation runs pages.

import { getText } from './api.js';
import { h, fmt, pct, ms } from './dom.js';

// Each row: label, how to read it off a run's summary, how to show it, and which way is better.
const ROWS = [
  ['requests finished', (s) => s.requests, fmt, null],
  ['rejected', (s) => s.rejected, fmt, 'low'],
  ['TTFT p50', (s) => s.ttft_ms.p50, ms, 'low'],
  ['TTFT p90', (s) => s.ttft_ms.p90, ms, 'low'],
  ['TTFT p99', (s) => s.ttft_ms.p99, ms, 'low'],
  ['TPOT p50', (s) => s.tpot_ms.p50, ms, 'low'],
  ['TPOT p90', (s) => s.tpot_ms.p90, ms, 'low'],
  ['TPOT p99', (s) => s.tpot_ms.p99, ms, 'low'],
  ['SLO attainment', (s) => s.slo_attainment, pct, 'high'],
  ['goodput (req/s)', (s) => s.goodput_rps, (v) => fmt(v, 2), 'high'],
  ['cache hit rate', (s) => s.cache_hit_rate, pct, 'high'],
  ['  from L1 (GPU)', (s) => s.hit_rate_by_tier.l1, pct, null],
  ['  from L2 (host)', (s) => s.hit_rate_by_tier.l2, pct, null],
  ['  from L3 (shared)', (s) => s.hit_rate_by_tier.l3, pct, null],
  ['GPU-hours', (s) => s.gpu_hours, (v) => fmt(v, 4), 'low'],
  ['cost per M tokens ($)', (s) => s.cost_per_mtok, (v) => fmt(v, 3), 'low'],
  // Absent (—) for a run without speculative decoding.
  ['drafts accepted per step', (s) => s.speculation?.accepted_per_step ?? null, (v) => fmt(v, 2), null],
];

// runs: [{label, summary}]
export function comparisonTable(runs) {
  const head = h('tr', {}, h('th', {}, ''), runs.map((r) => h('th', { scope: 'col' }, r.label)));
  const body = ROWS.map(([label, pick, show, better]) => {
    const values = runs.map((r) => {
      try {
        return pick(r.summary);
      } catch {
        return null; // A report from an older version may lack a field.
      }
    });
    const known = values.filter((v) => v !== null && v !== undefined);
    const best = better && known.length > 1 && new Set(known).size > 1
      ? (better === 'low' ? Math.min(...known) : Math.max(...known))
      : null;
    return h('tr', {}, h('th', { scope: 'row' }, label),
      values.map((v) => h('td', { class: v === best ? 'best' : '' }, show(v))));
  });
  const slo = runs[0]?.summary?.slo;
  return h('div', {},
    h('table', { class: 'compare' }, h('thead', {}, head), h('tbody', {}, body)),
    slo ? h('p', { class: 'muted' }, `SLO of the scenario: TTFT ≤ ${slo.ttft_ms} ms, TPOT ≤ ${slo.tpot_ms} ms. Best of each row in bold.`) : null);
}

// The run's CDF chart (server-drawn SVG), fetched with the token and shown as an image, so
// that nothing in it runs as script.
export async function cdfChart(id) {
  const svg = await getText(`/simulations/${id}/chart.svg`);
  const url = URL.createObjectURL(new Blob([svg], { type: 'image/svg+xml' }));
  return h('img', { class: 'cdf', src: url, alt: `TTFT and TPOT CDFs of simulation ${id}` });
}

export function runsOf(simulation) {
  return (simulation.result?.runs ?? []).map((r) => ({ label: r.router, summary: r.summary }));
}
