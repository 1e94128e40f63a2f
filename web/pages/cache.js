// Cache: the share of prompt tokens each tier served, the global prefix index's size and KV
// use per pool, over the last minutes (GET /api/history), and the prompt prefixes recent
// requests share most (GET /api/prefixes).

import { get } from '../api.js';
import { h, replace, errorBox, every, pct, fmt } from '../dom.js';
import { lineChart } from '../chart.js';
import * as history from '../history.js';

export const title = 'Cache';

export function mount(el) {
  const charts = h('div', { class: 'charts' });
  const status = h('div');
  const now = h('div', { class: 'summary' });
  const prefixes = h('div', { class: 'card', id: 'top-prefixes' });
  replace(el, h('h1', {}, 'Cache'), now, status, charts, prefixes);
  return every(2000, async () => {
    try {
      const [top] = await Promise.all([get('/prefixes'), history.refresh()]);
      replace(prefixes, h('h2', {}, 'Top shared prefixes'),
        top.prefixes.length === 0
          ? h('p', { class: 'muted' }, `No prompt prefix shared by two of the last ${fmt(top.requests)} requests.`)
          : h('table', {},
            h('thead', {}, h('tr', {}, ['prefix', 'tokens', 'requests', 'tokens a cache saves'].map((c) => h('th', {}, c)))),
            h('tbody', {}, top.prefixes.map((p) => h('tr', {},
              h('td', { class: 'mono' }, p.id),
              h('td', { class: 'num' }, fmt(p.tokens)),
              h('td', { class: 'num' }, fmt(p.requests)),
              h('td', { class: 'num' }, fmt(p.tokens * (p.requests - 1))))))),
        h('p', { class: 'muted' }, `Of the last ${fmt(top.requests)} requests (at most ${fmt(top.window)}): prompt prefixes that start several requests, `
          + 'counted at 1, 2, 4, … blocks; one that a longer prefix shares with as many requests is left out.'));
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
