// Scaling events: what the controller decided for each pool and why, newest first.

import { get } from '../api.js';
import { h, replace, errorBox, every } from '../dom.js';

export const title = 'Scaling';

function reason(r) {
  if (r === null || r === undefined) return '';
  if (typeof r !== 'object') return String(r);
  return Object.entries(r).map(([k, v]) => `${k}: ${typeof v === 'number' ? +v.toFixed(3) : JSON.stringify(v)}`).join(' · ');
}

export function mount(el) {
  const body = h('div');
  replace(el, h('h1', {}, 'Scaling events'), body);
  return every(5000, async () => {
    try {
      const { events } = await get('/scaling-events');
      if (events.length === 0) {
        replace(body, h('p', { class: 'empty', id: 'no-scaling-events' },
          'No scaling events yet. The live controller does not scale pools yet (no scaling policy emits commands), ',
          'so this timeline stays empty until one does; each event will show the loads that caused it.'));
        return;
      }
      replace(body, h('ol', { class: 'timeline' }, events.map((e) =>
        h('li', {},
          h('time', {}, e.at.replace('T', ' ').replace('Z', ' UTC')),
          h('strong', {}, ` ${e.action} `), `pool ${e.pool}`,
          e.instance !== null ? ` · instance #${e.instance}` : '',
          h('div', { class: 'muted' }, reason(e.reason), ` · by ${e.replica}`)))));
    } catch (e) {
      replace(body, errorBox(`Cannot read the scaling events: ${e.message}`));
    }
  });
}
