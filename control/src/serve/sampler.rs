//! The task that samples the live fleet once a second into the console's history ([`super::history::History`]).

use super::app::App;
use super::history::{FlowSample, PoolSample, Sample};
use super::live_fleet::MemberState;
use super::lock::lock;
use super::metrics::Outcome;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// Gateway outcomes counted per second, as `metrics::Metrics::request` names them.
const OUTCOMES: [&str; 4] = ["ok", "failed", "rejected", "unavailable"];

/// Samples the fleet once a second, for as long as the process runs.
pub async fn run(app: Arc<App>) {
    let mut ticker = tokio::time::interval(SAMPLE_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_counts = [0u64; OUTCOMES.len()];
    loop {
        ticker.tick().await;
        // From memory (targets set through another replica arrive within 2 s): a sample
        // never waits on the database, so samples stay a second apart through an outage.
        let slo = lock(&app.known).slo;
        let counts = OUTCOMES.map(|o| app.metrics.requests.get_or_create(&Outcome { outcome: o.to_string() }).get());
        let requests = OUTCOMES
            .iter()
            .zip(counts.iter().zip(last_counts))
            .map(|(o, (n, last))| (*o, n.saturating_sub(last)))
            .collect();
        last_counts = counts;
        let sample = sample(&app, slo, requests);
        app.history.push(sample);
    }
}

fn sample(app: &App, slo: (f64, f64), requests: BTreeMap<&'static str, u64>) -> Sample {
    let (window, engines) = app.recorder.window(Instant::now(), slo);
    let hub = app.lock_hub();
    let mut pools = BTreeMap::<String, PoolSample>::new();
    let mut kv_sums = BTreeMap::<&str, f64>::new();
    for m in hub.fleet.members() {
        let p = pools.entry(m.pool.clone()).or_default();
        match m.state {
            MemberState::Serving => {
                p.serving += 1;
                p.waiting += m.load.waiting;
                p.running += m.load.running;
                let use_share = f64::from(m.load.kv_used_blocks) / f64::from(m.load.kv_total_blocks.max(1));
                *kv_sums.entry(m.pool.as_str()).or_default() += use_share;
            }
            MemberState::Draining => p.draining += 1,
            MemberState::Down => p.down += 1,
        }
    }
    for (pool, sum) in kv_sums {
        if let Some(p) = pools.get_mut(pool) {
            p.kv_use_mean = Some(sum / f64::from(p.serving.max(1)));
        }
    }
    let controller = &hub.controller;
    let status = controller.pools();
    if let Some(st) = status {
        for (name, size) in [("prefill", st.prefill), ("decode", st.decode)] {
            if size.starting > 0 {
                pools.entry(name.to_string()).or_default().starting = size.starting;
            }
        }
    }
    let finite = |x: f64| x.is_finite().then_some(x);
    let queued = hub.flow.queued();
    let flow = FlowSample {
        rule: hub.flow_label(),
        queued: engine::Class::ALL.iter().map(|c| (c.name(), queued[c.index()])).collect(),
        shed: engine::Class::ALL
            .iter()
            .map(|&c| (c.name(), app.metrics.flow_count(c, "shed") + app.metrics.flow_count(c, "queue_full")))
            .collect(),
    };
    Sample {
        at_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        router: controller.router_name(),
        pools,
        requests,
        in_flight: app.metrics.in_flight.get(),
        window,
        engines,
        index_blocks: controller.wants_kv_events().then(|| controller.fleet().index().blocks()),
        flow,
        load_p: status.and_then(|s| finite(s.loads.load_p)),
        load_d: status.and_then(|s| finite(s.loads.load_d)),
    }
}
