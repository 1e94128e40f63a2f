// Scaling events: what the controller decided for each pool and why, newest first: who
// decided, the pool's size before and after, and the SLO loads that caused it.

import { get } from '../api.js';
import { h, replace, errorBox, every } from '../dom.js';

export const title = 'Scaling';

const num = (v) => (typeof v === 'number' ? +v.toFixed(3) : v);

function fields(r) {
  return Object.entries(r).map(([k, v]) => `${k}: ${typeof v === 'number' ? num(v) : JSON.stringify(v)}`).join(' · ');
}

// An autoscaler's decision reads as a sentence with its loads; anything else as its fields.
function reason(r) {
  if (r === null || r === undefined) return [];
  if (typeof r !== 'object') return [String(r)];
  if (r.loads && r.from !== undefined) {
    const l = r.loads;
    return [
      `${r.from} → ${r.to} engines: ${r.why || 'no reason given'} (${r.by})`,
      h('div', { class: 'loads' },
        `Load_P ${num(l.load_p)} (TTFT pred ${num(l.ttft_pred_ms)} ms, actual ${num(l.ttft_actual_ms)} ms, util ${num(l.util_p)})`,
        ` · Load_D ${num(l.load_d)} (TPOT pred ${num(l.tpot_pred_ms)} ms, actual ${num(l.tpot_actual_ms)} ms, util ${num(l.util_d)})`),
    ];
  }
  return [fields(r)];
}

export function mount(el) {
  const body = h('div');
  replace(el, h('h1', {}, 'Scaling events'), body);
  return every(5000, async () => {
    try {
      const { events } = await get('/scaling-events');
      if (events.length === 0) {
        replace(body, h('p', { class: 'empty', id: 'no-scaling-events' },
          'No scaling events yet. Pools are sized by the leader of a P/D fleet with an actuator ',
          '(serve --mode pd --actuator local --autoscaler slo-load); each event shows the loads that caused it.'));
        return;
      }
      replace(body, h('ol', { class: 'timeline' }, events.map((e) =>
        h('li', {},
          h('time', {}, e.at.replace('T', ' ').replace('Z', ' UTC')),
          h('strong', {}, ` ${e.action} `), `pool ${e.pool}`,
          e.instance !== null ? ` · instance #${e.instance}` : '',
          h('div', { class: 'muted' }, ...reason(e.reason), ` · on ${e.replica}`)))));
    } catch (e) {
      replace(body, errorBox(`Cannot read the scaling events: ${e.message}`));
    }
  });
}
