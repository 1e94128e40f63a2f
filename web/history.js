// The live time series of GET /api/history, polled and kept here so that the SLO and cache
// pages share one copy: each poll asks only for samples newer than the last one held.

import { get } from './api.js';

let samples = [];
let capacity = 900;
let windowSeconds = 10;

export async function refresh() {
  const since = samples.length ? samples[samples.length - 1].at_ms : 0;
  const res = await get(`/history?since_ms=${since}`);
  capacity = res.capacity;
  windowSeconds = res.window_seconds;
  // Two pages may poll at once (one leaving, one arriving): keep only samples newer than
  // the last held when this answer arrives, so none is added twice.
  const last = samples.length ? samples[samples.length - 1].at_ms : 0;
  samples = samples.concat(res.samples.filter((s) => s.at_ms > last)).slice(-capacity);
  return samples;
}

export function windowLength() {
  return windowSeconds;
}

// [[atMs, value], ...] of one field of every sample.
export function series(pick) {
  return samples.map((sample) => [sample.at_ms, pick(sample) ?? null]);
}

export function pools() {
  const names = new Set();
  for (const sample of samples) for (const p of Object.keys(sample.pools)) names.add(p);
  return [...names].sort();
}

export function latest() {
  return samples[samples.length - 1] ?? null;
}
