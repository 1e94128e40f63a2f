//! A short memory of the live fleet for the console: once a second the sampler reads the fleet
//! (engines by pool and state, KV use, the global prefix index) and what the gateway saw in
//! the last [`WINDOW`] (request outcomes, TTFT and TPOT percentiles, SLO attainment, the
//! share of prompt tokens each cache tier served), and keeps the last [`CAPACITY`] samples in
//! a ring served at `GET /api/history`.
//!
//! Prometheus already has cumulative counters and histograms, but a histogram's buckets give
//! no percentiles over the last seconds, so the gateway also reports every finished request
//! to a [`Recorder`]: a bounded queue of recent requests from which a window's percentiles are
//! computed exactly.
//!
//! Load_P and Load_D (SLO load of the prefill and decode pools) come from the controller of a
//! disaggregated fleet (`serve --mode pd`); a colocated fleet's samples carry them as `null`,
//! and the console says "not measured".

use super::lock::lock;
use engine::{Class, InstanceId};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Samples kept: 15 minutes at one a second.
pub const CAPACITY: usize = 900;
/// Span of the gateway statistics of one sample: long enough for percentiles to mean
/// something at a few requests a second, short enough to show a change within seconds.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Most finished requests kept for the window; above this the oldest go first, so memory
/// stays bounded at any request rate (the percentiles then cover the newest requests).
const RECENT_LIMIT: usize = 50_000;
/// Tenants a sample shows: those with the most requests finished in the window.
pub const TENANTS_SHOWN: usize = 10;

/// What the gateway knows of one request once its last token is sent.
#[derive(Clone, Debug)]
pub struct Finished {
    pub ttft_ms: f64,
    /// Mean time between output tokens after the first; none for a one-token output.
    pub tpot_ms: Option<f64>,
    pub prompt_tokens: u32,
    /// Prompt tokens served from each cache tier (L1 GPU, L2 host, L3 shared).
    pub cached_tokens: [u32; 3],
    /// The engine that finished it (the last one, for a request placed again).
    pub instance: InstanceId,
    pub class: Class,
    pub tenant: String,
}

/// Finished requests of the recent past, fed by the gateway, read by the sampler.
#[derive(Default)]
pub struct Recorder {
    recent: Mutex<VecDeque<(Instant, Finished)>>,
}

impl Recorder {
    pub fn finished(&self, request: Finished) {
        let mut recent = lock(&self.recent);
        if recent.len() == RECENT_LIMIT {
            recent.pop_front();
        }
        recent.push_back((Instant::now(), request));
    }

    /// Forgets requests older than the window and summarises the rest, in all and per
    /// engine.
    pub(super) fn window(&self, now: Instant, slo: (f64, f64)) -> (WindowStats, BTreeMap<u32, EngineWindow>) {
        let mut recent = lock(&self.recent);
        while recent.front().is_some_and(|(at, _)| now.duration_since(*at) > WINDOW) {
            recent.pop_front();
        }
        let mut engines = BTreeMap::<u32, (u64, u64, u64)>::new();
        for (_, r) in recent.iter() {
            let e = engines.entry(r.instance.0).or_default();
            e.0 += 1;
            e.1 += u64::from(r.prompt_tokens);
            e.2 += r.cached_tokens.iter().map(|&c| u64::from(c)).sum::<u64>();
        }
        let engines = engines
            .into_iter()
            .map(|(id, (finished, prompt, cached))| {
                let cached_share = (prompt > 0).then(|| cached as f64 / prompt as f64);
                (id, EngineWindow { finished, cached_share })
            })
            .collect();
        let mut stats = WindowStats::of(recent.iter().map(|(_, r)| r), slo);
        for class in Class::ALL {
            let of_class = GroupWindow::of(recent.iter().map(|(_, r)| r).filter(|r| r.class == class), slo);
            if of_class.finished > 0 {
                stats.by_class.insert(class.name(), of_class);
            }
        }
        let mut tenants = BTreeMap::<&str, Vec<&Finished>>::new();
        for (_, r) in recent.iter() {
            tenants.entry(r.tenant.as_str()).or_default().push(r);
        }
        let mut tenants: Vec<(&str, Vec<&Finished>)> = tenants.into_iter().collect();
        // Most requests first (ties by name: the map's order, kept by a stable sort).
        tenants.sort_by_key(|(_, rs)| std::cmp::Reverse(rs.len()));
        stats.by_tenant = tenants
            .into_iter()
            .take(TENANTS_SHOWN)
            .map(|(tenant, rs)| TenantWindow {
                tenant: tenant.to_string(),
                window: GroupWindow::of(rs.into_iter(), slo),
            })
            .collect();
        (stats, engines)
    }
}

/// A group's (a class's, a tenant's) requests in the window.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GroupWindow {
    pub finished: u64,
    pub ttft_ms: Option<Percentiles>,
    /// Within the fleet's SLO targets.
    pub slo_attainment: Option<f64>,
}

impl GroupWindow {
    fn of<'a>(requests: impl Iterator<Item = &'a Finished>, slo: (f64, f64)) -> GroupWindow {
        let w = WindowStats::of(requests, slo);
        GroupWindow { finished: w.finished, ttft_ms: w.ttft_ms, slo_attainment: w.slo_attainment }
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TenantWindow {
    pub tenant: String,
    #[serde(flatten)]
    pub window: GroupWindow,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles; none of an empty set.
    fn of(values: &mut [f64]) -> Option<Percentiles> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let rank = |q: f64| values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Some(Percentiles { p50: rank(0.50), p90: rank(0.90), p99: rank(0.99) })
    }
}

/// The gateway's view of the last [`WINDOW`].
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WindowStats {
    pub seconds: u64,
    /// Requests that finished in the window.
    pub finished: u64,
    pub ttft_ms: Option<Percentiles>,
    pub tpot_ms: Option<Percentiles>,
    /// Finished requests within both SLO targets, over finished requests (none without any).
    pub slo_attainment: Option<f64>,
    /// Prompt tokens served from any cache tier over all prompt tokens (token-weighted).
    pub cached_share: Option<f64>,
    /// `cached_share` split by tier: L1, L2, L3 (they add up to it).
    pub cached_share_by_tier: Option<[f64; 3]>,
    /// The same by request class, for the classes with requests in the window.
    pub by_class: BTreeMap<&'static str, GroupWindow>,
    /// By tenant: the [`TENANTS_SHOWN`] with the most requests in the window, most first.
    pub by_tenant: Vec<TenantWindow>,
}

impl WindowStats {
    fn of<'a>(requests: impl Iterator<Item = &'a Finished>, (ttft_slo_ms, tpot_slo_ms): (f64, f64)) -> WindowStats {
        let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
        let (mut prompt, mut cached, mut met) = (0u64, [0u64; 3], 0u64);
        for r in requests {
            ttft.push(r.ttft_ms);
            tpot.extend(r.tpot_ms);
            prompt += u64::from(r.prompt_tokens);
            for (sum, c) in cached.iter_mut().zip(r.cached_tokens) {
                *sum += u64::from(c);
            }
            met += u64::from(r.ttft_ms <= ttft_slo_ms && r.tpot_ms.is_none_or(|t| t <= tpot_slo_ms));
        }
        let finished = ttft.len() as u64;
        let share = |tokens: u64| tokens as f64 / prompt as f64;
        WindowStats {
            seconds: WINDOW.as_secs(),
            finished,
            ttft_ms: Percentiles::of(&mut ttft),
            tpot_ms: Percentiles::of(&mut tpot),
            slo_attainment: (finished > 0).then(|| met as f64 / finished as f64),
            cached_share: (prompt > 0).then(|| share(cached.iter().sum())),
            cached_share_by_tier: (prompt > 0).then(|| cached.map(share)),
            by_class: BTreeMap::new(),
            by_tenant: Vec::new(),
        }
    }
}

/// What one engine finished in the window.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EngineWindow {
    pub finished: u64,
    /// Prompt tokens it served from any cache tier over its prompt tokens.
    pub cached_share: Option<f64>,
}

/// One pool's engines at one instant.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PoolSample {
    pub serving: u32,
    /// Asked of the actuator and not registered yet (P/D pools only).
    pub starting: u32,
    pub draining: u32,
    pub down: u32,
    /// Mean over serving engines of KV blocks in use over KV blocks (none without any).
    pub kv_use_mean: Option<f64>,
    pub waiting: u32,
    pub running: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Sample {
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub router: &'static str,
    pub pools: BTreeMap<String, PoolSample>,
    /// Gateway requests that ended in the last second, by outcome.
    pub requests: BTreeMap<&'static str, u64>,
    pub in_flight: i64,
    pub window: WindowStats,
    /// The window per engine (by instance id), for engines that finished a request in it.
    pub engines: BTreeMap<u32, EngineWindow>,
    /// Blocks in the global prefix index; none when the router reads no KV events.
    pub index_blocks: Option<usize>,
    /// Flow control at the controller.
    pub flow: FlowSample,
    /// SLO load of the prefill and decode pools as of the controller's last scaling tick
    /// (P/D fleets only; none while a pool has no engine to measure).
    pub load_p: Option<f64>,
    pub load_d: Option<f64>,
}

/// What flow control holds and has refused.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FlowSample {
    /// The rule in force with its parameters (`none`: every request is placed at once).
    pub rule: String,
    /// Requests waiting for room at the controller, by class.
    pub queued: BTreeMap<&'static str, usize>,
    /// Requests refused by flow control since the process started (shed, queue full), by
    /// class.
    pub shed: BTreeMap<&'static str, u64>,
}

/// The last [`CAPACITY`] samples.
#[derive(Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    pub(super) fn push(&self, sample: Sample) {
        let mut samples = lock(&self.samples);
        if samples.len() == CAPACITY {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// Samples taken after `since_ms` (all of them for 0), oldest first.
    pub fn since(&self, since_ms: u64) -> Vec<Sample> {
        let samples = lock(&self.samples);
        samples.iter().filter(|s| s.at_ms > since_ms).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished(ttft_ms: f64, tpot_ms: Option<f64>, prompt_tokens: u32, cached_tokens: [u32; 3]) -> Finished {
        let (class, tenant) = (Class::Standard, "default".to_string());
        Finished { ttft_ms, tpot_ms, prompt_tokens, cached_tokens, instance: InstanceId(1), class, tenant }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(Percentiles::of(&mut v), Some(Percentiles { p50: 50.0, p90: 90.0, p99: 99.0 }));
        assert_eq!(Percentiles::of(&mut [7.0]), Some(Percentiles { p50: 7.0, p90: 7.0, p99: 7.0 }));
        assert_eq!(Percentiles::of(&mut []), None);
    }

    #[test]
    fn a_window_counts_attainment_and_cached_shares_by_tier() {
        let requests = [
            finished(100.0, Some(10.0), 100, [50, 0, 0]),
            finished(3000.0, Some(10.0), 100, [0, 20, 0]), // TTFT over the target
            finished(100.0, Some(500.0), 100, [0, 0, 10]), // TPOT over the target
            finished(100.0, None, 100, [0, 0, 0]),         // one output token: no TPOT
        ];
        let w = WindowStats::of(requests.iter(), (2000.0, 100.0));
        assert_eq!(w.finished, 4);
        assert_eq!(w.slo_attainment, Some(0.5));
        assert_eq!(w.cached_share, Some(0.2));
        assert_eq!(w.cached_share_by_tier, Some([0.125, 0.05, 0.025]));
        assert_eq!(w.tpot_ms.map(|p| p.p50), Some(10.0));
    }

    #[test]
    fn the_window_splits_cached_shares_by_engine() {
        let r = Recorder::default();
        r.finished(Finished { instance: InstanceId(1), ..finished(10.0, None, 100, [40, 10, 0]) });
        r.finished(Finished { instance: InstanceId(2), ..finished(10.0, None, 100, [0, 0, 0]) });
        r.finished(Finished { instance: InstanceId(2), ..finished(10.0, None, 300, [0, 0, 100]) });
        let (all, engines) = r.window(Instant::now(), (2000.0, 100.0));
        assert_eq!(all.finished, 3);
        assert_eq!(engines[&1], EngineWindow { finished: 1, cached_share: Some(0.5) });
        assert_eq!(engines[&2], EngineWindow { finished: 2, cached_share: Some(0.25) });
    }

    #[test]
    fn the_window_splits_latency_by_class_and_by_tenant_busiest_first() {
        let r = Recorder::default();
        let of = |class, tenant: &str, ttft_ms| Finished {
            class,
            tenant: tenant.to_string(),
            ..finished(ttft_ms, None, 10, [0; 3])
        };
        r.finished(of(Class::Interactive, "light", 100.0));
        r.finished(of(Class::Batch, "heavy", 5000.0));
        r.finished(of(Class::Batch, "heavy", 3000.0));
        let (all, _) = r.window(Instant::now(), (2000.0, 100.0));
        assert_eq!(all.by_class.keys().copied().collect::<Vec<_>>(), ["batch", "interactive"], "classes seen only");
        assert_eq!(all.by_class["batch"].finished, 2);
        assert_eq!(all.by_class["batch"].slo_attainment, Some(0.0));
        assert_eq!(all.by_class["interactive"].ttft_ms.map(|p| p.p99), Some(100.0));
        let tenants: Vec<(&str, u64)> = all.by_tenant.iter().map(|t| (t.tenant.as_str(), t.window.finished)).collect();
        assert_eq!(tenants, [("heavy", 2), ("light", 1)]);
    }

    #[test]
    fn an_empty_window_has_no_statistics_rather_than_zeros() {
        let w = WindowStats::of([].iter(), (2000.0, 100.0));
        assert_eq!((w.finished, w.ttft_ms, w.slo_attainment, w.cached_share), (0, None, None, None));
    }

    #[test]
    fn the_recorder_and_the_ring_are_bounded() {
        let r = Recorder::default();
        for _ in 0..RECENT_LIMIT + 10 {
            r.finished(finished(1.0, None, 1, [0; 3]));
        }
        assert_eq!(r.recent.lock().map(|q| q.len()).unwrap_or(0), RECENT_LIMIT);
        let h = History::default();
        for at_ms in 1..=(CAPACITY as u64 + 5) {
            h.push(Sample {
                at_ms,
                router: "round-robin",
                pools: BTreeMap::new(),
                requests: BTreeMap::new(),
                in_flight: 0,
                window: WindowStats::of([].iter(), (1.0, 1.0)),
                engines: BTreeMap::new(),
                index_blocks: None,
                flow: FlowSample { rule: "none".to_string(), queued: BTreeMap::new(), shed: BTreeMap::new() },
                load_p: None,
                load_d: None,
            });
        }
        assert_eq!(h.since(0).len(), CAPACITY);
        assert_eq!(h.since(CAPACITY as u64).len(), 5);
    }
}
