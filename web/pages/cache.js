// Cache: the share of prompt tokens each tier served, the global prefix index's size and KV
// use per pool, over the last minutes (GET /api/history).

import { h, replace, errorBox, every, pct, fmt } from '../dom.js';
import { lineChart } from '../chart.js';
import * as history from '../history.js';

export const title = 'Cache';

export function mount(el) {
  const charts = h('div', { class: 'charts' });
  const status = h('div');
  const now = h('div', { class: 'summary' });
  replace(el, h('h1', {}, 'Cache'), now, status, charts,
    h('p', { class: 'muted' }, 'Top shared prefixes: not yet measured (the global prefix index does not report its most shared prefixes).'));
  return every(2000, async () => {
    try {
      await history.refresh();
      const w = history.windowLength();
      const last = history.latest();
      const tiers = last?.window.cached_share_by_tier;
      replace(now,
        h('div', { class: 'stat' }, h('span', {}, `hit rate (last ${w} s)`), h('strong', { id: 'hit-rate' }, pct(last?.window.cached_share))),
        ['L1 GPU', 'L2 host', 'L3 shared'].map((t, k) =>
          h('div', { class: 'stat' }, h('span', {}, t), h('strong', {}, tiers ? pct(tiers[k]) : '—'))),
        h('div', { class: 'stat' }, h('span', {}, 'index blocks'),
          h('strong', { id: 'index-blocks' }, last?.index_blocks === null || last?.index_blocks === undefined ? 'router reads no KV events' : fmt(last.index_blocks))));
      replace(charts,
        lineChart({
          title: `Prompt tokens served from cache, by tier (last ${w} s)`,
          series: [
            ...['L1 (GPU)', 'L2 (host)', 'L3 (shared)'].map((label, k) =>
              ({ label, points: history.series((s) => s.window.cached_share_by_tier?.[k]) })),
            { label: 'all tiers', points: history.series((s) => s.window.cached_share), dashed: true },
          ],
          yMax: 1,
          format: (v) => pct(v, 0),
        }),
        lineChart({
          title: 'Global prefix index (blocks)',
          series: [last && last.index_blocks === null
            ? { label: 'blocks', missing: `the router in force (${last.router}) reads no KV events, so there is no index` }
            : { label: 'blocks', points: history.series((s) => s.index_blocks) }],
          format: (v) => fmt(v, 0),
        }),
        lineChart({
          title: 'Mean KV use of serving engines, per pool',
          series: history.pools().map((p) => ({ label: p, points: history.series((s) => s.pools[p]?.kv_use_mean) })),
          yMax: 1,
          format: (v) => pct(v, 0),
        }));
      replace(status);
    } catch (e) {
      replace(status, errorBox(`Cannot read the history: ${e.message}`));
    }
  });
}
