//! Simulations submitted through the API: validated at once, run in the background on the
//! simulator (one at a time, off the async threads), results and chart kept in the database.

use super::App;
use simulator::plot::{plot_cdfs, CdfSeries};
use simulator::report::{Report, RunReport};
use simulator::scenario::{Scenario, Settings};
use simulator::sim::{self, SimConfig};
use std::sync::Arc;

/// Parses and checks a scenario's text.
pub fn validate(text: &str) -> Result<Settings, String> {
    let scenario: Scenario = toml::from_str(text).map_err(|e| format!("the scenario is not valid TOML: {e}"))?;
    scenario.resolve().map_err(|e| e.to_string())
}

/// Runs `id` in the background; the state and result land in the database.
pub fn spawn(app: Arc<App>, id: i64, scenario: String) {
    tokio::spawn(async move {
        let Ok(_permit) = app.simulations.acquire().await else { return };
        if let Err(e) = app.store.simulation_state(id, "running").await {
            tracing::warn!(simulation = id, "cannot mark it running: {e:#}");
        }
        let outcome = tokio::task::spawn_blocking(move || run(&scenario))
            .await
            .unwrap_or_else(|e| Err(format!("the simulation panicked: {e}")));
        if let Err(e) = app.store.finish_simulation(id, outcome).await {
            tracing::warn!(simulation = id, "cannot store its result: {e:#}");
        }
    });
}

/// Every router of the scenario on the same arrivals; the report's JSON and a CDF chart.
fn run(text: &str) -> Result<(serde_json::Value, String), String> {
    let settings = validate(text)?;
    let mut runs = Vec::new();
    let mut series = Vec::new();
    for (i, spec) in settings.routers.iter().enumerate() {
        let workload = settings.open_workload(settings.rate_scale).map_err(|e| e.to_string())?;
        let config = SimConfig { infinite_cache_bound: i == 0, ..settings.sim_config(spec) };
        let out = sim::run(&config, workload, &mut |_| {}).map_err(|e| e.to_string())?;
        series.push(CdfSeries { label: out.router.clone(), ttft: out.ttft_cdf.clone(), tpot: out.tpot_cdf.clone() });
        runs.push(RunReport { router: out.router, summary: out.summary, decisions: out.decisions });
    }
    let bound = runs.first().and_then(|r| r.summary.max_hit_rate);
    for r in &mut runs {
        r.summary.max_hit_rate = bound;
    }
    let dir = std::env::temp_dir().join(format!("fleetplane-sim-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot make a folder for the chart: {e}"))?;
    let path = dir.join("cdf.svg");
    let chart = plot_cdfs(&path, &series)
        .map_err(|e| e.to_string())
        .and_then(|()| std::fs::read_to_string(&path).map_err(|e| format!("cannot read the chart back: {e}")));
    let _ = std::fs::remove_dir_all(&dir);
    let result = serde_json::to_value(Report { runs }).map_err(|e| e.to_string())?;
    Ok((result, chart?))
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}
