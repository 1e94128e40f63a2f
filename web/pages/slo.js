// SLO and pools: engines per pool, SLO load, latency percentiles and attainment over the
// last minutes, from the server's once-a-second samples (GET /api/history).

import { get } from '../api.js';
import { h, replace, errorBox, every, pct } from '../dom.js';
import { lineChart } from '../chart.js';
import * as history from '../history.js';

export const title = 'SLO & pools';

const NOT_MEASURED = 'not measured: the fleet is colocated (serve --mode pd computes the loads of its pools)';

// A series of the samples' `key`, or why it is missing when no sample has it.
function measured(label, key) {
  const points = history.series((s) => s[key]);
  return points.some(([, y]) => y !== null) ? { label, points } : { label, missing: NOT_MEASURED };
}

export function mount(el) {
  const charts = h('div', { class: 'charts' });
  const status = h('div');
  const targets = h('p', { class: 'muted' });
  replace(el, h('h1', {}, 'SLO & pools'), targets, status, charts);
  let slo = null;
  return every(2000, async () => {
    try {
      [slo] = await Promise.all([slo ? Promise.resolve(slo) : get('/slo'), history.refresh()]);
      const w = history.windowLength();
      replace(targets, `SLO targets: TTFT ≤ ${slo.ttft_ms} ms, TPOT ≤ ${slo.tpot_ms} ms (edit them on the Policies page). `,
        `Latency and attainment are over the requests that finished in the last ${w} s, sampled every second.`);
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
