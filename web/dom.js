// A tiny DOM builder and number formatting shared by the pages.

// h('div', {class: 'x', onclick: f}, child, ...): children are nodes, strings or arrays;
// null and false are skipped so that conditional parts read naturally.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else if (k === 'value') el.value = v;
    else el.setAttribute(k, v === true ? '' : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

export function fmt(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return '—';
  if (Math.abs(x) >= 1e6) return `${(x / 1e6).toFixed(digits)}M`;
  if (Math.abs(x) >= 1e4) return `${(x / 1e3).toFixed(digits)}k`;
  return Number.isInteger(x) ? String(x) : x.toFixed(digits);
}

export function pct(x, digits = 1) {
  return x === null || x === undefined ? '—' : `${(100 * x).toFixed(digits)}%`;
}

export function ms(x) {
  return x === null || x === undefined ? '—' : `${fmt(x, x < 10 ? 2 : 1)} ms`;
}

// An error message in place, with the role screen readers announce.
export function errorBox(message) {
  return h('p', { class: 'error', role: 'alert' }, message);
}

// Runs `task` now and again `ms` after each run ends (never two at once, so a slow server
// is not piled on); returns the function that stops it.
export function every(ms, task) {
  let timer = null;
  let stopped = false;
  const run = async () => {
    try {
      await task();
    } finally {
      if (!stopped) timer = setTimeout(run, ms);
    }
  };
  run();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
