// Line charts as inline SVG, drawn from the console's time series: no chart library, so the
// console stays a handful of files the binary embeds.

import { h } from './dom.js';

const NS = 'http://www.w3.org/2000/svg';
export const COLORS = ['#2563eb', '#dc2626', '#16a34a', '#9333ea', '#ea580c', '#0891b2', '#ca8a04'];

function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

// The smallest of 1, 2, 5 times a power of ten at or above `v`, so that the axis reads in
// round numbers (and half of it, the middle tick, too).
function niceCeil(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * p).find((c) => c >= v) ?? 10 * p;
}

// series: [{label, points: [[atMs, y|null], ...], missing: 'why', dashed: bool}]; a null y breaks the line
// (no data in that window) rather than drawing a zero that was never measured. A series with
// `missing` is listed in the legend with its reason and draws nothing.
// reference: {y, label} draws a dashed target line (an SLO, or 1.0 for a load).
export function lineChart({ title, series, yLabel = '', yMax, reference, format = (v) => String(+v.toFixed(2)) }) {
  const width = 560;
  const height = 200;
  const pad = { left: 52, right: 12, top: 22, bottom: 26 };
  const drawn = series.filter((x) => !x.missing);
  const all = drawn.flatMap((x) => x.points).filter(([, y]) => y !== null && y !== undefined);
  const figure = h('figure', { class: 'chart' }, h('figcaption', {}, title, yLabel ? h('span', { class: 'muted' }, ` (${yLabel})`) : null));
  const legend = h('ul', { class: 'legend' });
  series.forEach((x, i) => {
    legend.append(
      h('li', { class: x.missing ? 'missing' : '' },
        h('span', { class: 'swatch', style: `background:${x.missing ? '#bbb' : COLORS[i % COLORS.length]}` }),
        x.missing ? `${x.label}: ${x.missing}` : x.label),
    );
  });
  if (all.length === 0) {
    figure.append(h('p', { class: 'empty' }, drawn.length ? 'no data in this period yet' : ''), legend);
    return figure;
  }
  const times = drawn.flatMap((x) => x.points.map(([t]) => t));
  const t0 = Math.min(...times);
  const t1 = Math.max(t0 + 1000, Math.max(...times));
  // Scaled to the data, not to the reference: a target far above the lines would flatten
  // them; it is then named above the chart instead of drawn.
  const top = yMax ?? niceCeil(Math.max(...all.map(([, y]) => y)));
  const x = (t) => pad.left + ((t - t0) / (t1 - t0)) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - (Math.min(v, top) / top) * (height - pad.top - pad.bottom);
  const svg = s('svg', { viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': title });
  for (const frac of [0, 0.5, 1]) {
    const v = top * frac;
    svg.append(s('line', { x1: pad.left, x2: width - pad.right, y1: y(v), y2: y(v), class: 'grid' }));
    svg.append(s('text', { x: pad.left - 6, y: y(v) + 4, 'text-anchor': 'end', class: 'tick' }, format(v)));
  }
  const span = Math.round((t1 - t0) / 1000);
  svg.append(s('text', { x: pad.left, y: height - 6, class: 'tick' }, `−${span} s`));
  svg.append(s('text', { x: width - pad.right, y: height - 6, 'text-anchor': 'end', class: 'tick' }, 'now'));
  if (reference && reference.y > top) {
    svg.append(s('text', { x: width - pad.right, y: 12, 'text-anchor': 'end', class: 'tick' }, `${reference.label} ↑ (above the chart)`));
  } else if (reference) {
    svg.append(s('line', { x1: pad.left, x2: width - pad.right, y1: y(reference.y), y2: y(reference.y), class: 'reference' }));
    svg.append(s('text', { x: width - pad.right, y: y(reference.y) - 4, 'text-anchor': 'end', class: 'tick' }, reference.label));
  }
  series.forEach((ser, i) => {
    if (ser.missing) return;
    let d = '';
    let pen = false;
    for (const [t, v] of ser.points) {
      if (v === null || v === undefined) {
        pen = false;
        continue;
      }
      d += `${pen ? 'L' : 'M'}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    }
    const attrs = { d, fill: 'none', stroke: COLORS[i % COLORS.length], 'stroke-width': 2 };
    // A total drawn over its parts would hide the part equal to it: dashes let both show.
    if (ser.dashed) attrs['stroke-dasharray'] = '6 4';
    svg.append(s('path', attrs));
  });
  figure.append(svg, legend);
  return figure;
}
