// Fleet overview: the engines by pool and state (starting, serving, draining, down) with
// their load, polled every 1.5 s.

import { get } from '../api.js';
import { h, replace, fmt, pct, errorBox, every } from '../dom.js';
import * as history from '../history.js';

export const title = 'Fleet';

const STATES = ['serving', 'draining', 'down'];

// KV use as a bar against all KV blocks, with a mark at the engine's KV high-water mark when
// its scheduling has one (engines report it in their load reports): colours change as use
// nears the mark, since above it the engine stops admitting.
function kvBar(load, scheduling) {
  const total = load.kv_total_blocks || 0;
  const share = total ? load.kv_used_blocks / total : 0;
  const mark = scheduling?.kv_high_water;
  const limit = mark || 1;
  const level = share >= 0.9 * limit ? 'high' : share >= 0.7 * limit ? 'mid' : 'low';
  const title = `${load.kv_used_blocks} of ${total} KV blocks in use; ${load.kv_cached_blocks} cached`
    + (mark ? `; high-water mark ${(100 * mark).toFixed(0)}%` : '; no high-water mark');
  return h('div', { class: 'kv', title },
    h('div', { class: `kv-fill ${level}`, style: `width:${(100 * share).toFixed(1)}%` }),
    mark ? h('div', { class: 'kv-mark', style: `left:${(100 * mark).toFixed(1)}%` }) : null,
    h('span', { class: 'kv-label' }, `${(100 * share).toFixed(1)}%` + (mark ? ` / ${(100 * mark).toFixed(0)}%` : '')));
}

// `recent`: what the engine finished in the history's last window (none if nothing).
function instanceRow(i, recent) {
  const l = i.load;
  return h('tr', { class: `state-${i.state}`, 'data-instance': i.name },
    h('td', {}, h('strong', {}, i.name), ' ', h('span', { class: `badge kind-${i.kind}`, title: 'engine kind' }, i.kind),
      h('div', { class: 'muted' }, `#${i.id} · ${i.address}`)),
    h('td', {}, h('span', { class: `badge ${i.state}` }, i.state), l.admission_paused ? h('span', { class: 'badge paused' }, 'admission paused') : null),
    h('td', {}, `${i.model}`, h('div', { class: 'muted' }, i.executor)),
    h('td', { class: 'num' }, fmt(l.running)),
    h('td', { class: 'num' }, fmt(l.waiting)),
    h('td', { class: 'num' }, fmt(l.prefill_tokens_left)),
    h('td', { class: 'num' }, fmt(l.decode_tokens_left)),
    h('td', {}, kvBar(l, i.scheduling)),
    h('td', { class: 'num hit-rate' }, recent ? pct(recent.cached_share) : '—',
      h('div', { class: 'muted' }, `${recent ? recent.finished : 0} finished`)),
    h('td', { class: 'num' }, `${i.seconds_since_seen.toFixed(1)} s`));
}

// `starting`: engines the actuator was asked for that have not registered yet (P/D pools).
function poolTable(pool, instances, recent, starting) {
  const byState = STATES.map((s) => instances.filter((i) => i.state === s));
  const counts = [...(starting ? [`${starting} starting`] : []), ...STATES.map((s, k) => `${byState[k].length} ${s}`)];
  return h('div', { class: 'card', 'data-pool': pool },
    h('h2', {}, `Pool ${pool}`,
      h('span', { class: 'muted' }, ` · ${counts.join(' · ')}`)),
    h('table', { class: 'instances' },
      h('thead', {}, h('tr', {}, ['engine', 'state', 'model', 'running', 'queue', 'prefill tokens left', 'decode tokens left', 'KV use / high-water mark', `cache hit rate (${history.windowLength()} s)`, 'seen'].map((c) => h('th', {}, c)))),
      h('tbody', {}, byState.flat().map((i) => instanceRow(i, recent[i.id])))));
}

export function mount(el) {
  const summary = h('div', { class: 'summary' });
  const pools = h('div', { id: 'pools' });
  const status = h('div');
  replace(el, h('h1', {}, 'Fleet'), summary, status, pools,
    h('p', { class: 'muted' }, 'Updated every 1.5 s. KV bars are drawn against all KV blocks; the dark line is the engine\'s KV high-water mark (the policy\'s, as the engine reports it), above which it stops admitting. ',
      'Cache hit rate: prompt tokens served from any cache tier over prompt tokens, of the requests each engine finished in the last window.'));
  return every(1500, async () => {
    try {
      const [f, list] = await Promise.all([get('/fleet'), get('/instances'), history.refresh()]);
      const recent = history.latest()?.engines ?? {};
      const counts = f.instances || {};
      replace(summary,
        h('div', { class: 'stat' }, h('span', {}, 'router'), h('strong', { id: 'router-in-force' }, f.router_label)),
        h('div', { class: 'stat' }, h('span', {}, 'serving'), h('strong', { id: 'serving-count' }, counts.serving || 0)),
        h('div', { class: 'stat' }, h('span', {}, 'draining'), h('strong', {}, counts.draining || 0)),
        h('div', { class: 'stat' }, h('span', {}, 'down'), h('strong', {}, counts.down || 0)),
        h('div', { class: 'stat' }, h('span', {}, 'replica'), h('strong', {}, `${f.replica}${f.leader ? ' (leader)' : ''}`)),
        h('div', { class: 'stat' }, h('span', {}, 'pending DB writes'), h('strong', {}, f.pending_database_writes)));
      const byPool = new Map();
      for (const i of list.instances) {
        if (!byPool.has(i.pool)) byPool.set(i.pool, []);
        byPool.get(i.pool).push(i);
      }
      for (const v of byPool.values()) v.sort((a, b) => a.name.localeCompare(b.name));
      replace(pools, byPool.size === 0
        ? h('p', { class: 'empty' }, 'No engine has registered yet. Start one with ', h('code', {}, 'fleetplane engine --control GRPC_ADDRESS'), '.')
        : [...byPool.keys()].sort().map((p) => poolTable(p, byPool.get(p), recent, history.latest()?.pools?.[p]?.starting)));
      replace(status);
    } catch (e) {
      replace(status, errorBox(`Cannot read the fleet: ${e.message}`));
    }
  });
}
