//! Simulations submitted through the API: validated at once, run in the background on the
//! simulator (one at a time, off the async threads), results and chart kept in the database.

use super::app::App;
use crate::simulate::run_routers;
use indicatif::{MultiProgress, ProgressDrawTarget};
use serde_json::json;
use simulator::plot::{plot_cdfs, CdfSeries};
use simulator::report::{Report, RunReport};
use simulator::scenario::{RouterEntry, Scenario, Settings};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Parses and checks a scenario's text.
pub fn validate(text: &str) -> Result<Settings, String> {
    let scenario: Scenario = toml::from_str(text).map_err(|e| format!("the scenario is not valid TOML: {e}"))?;
    scenario.resolve().map_err(|e| e.to_string())
}

/// KV water marks a what-if sets for the runs written `router@…+hw` (the policy editor's).
#[derive(Debug, Clone, Copy, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaterMarks {
    pub kv_high_water: f64,
    #[serde(default)]
    pub kv_low_water: Option<f64>,
}

/// The scenario's text with its `routers` replaced (names, or tables of a name and the
/// router's parameters) and, given water marks, its `[scheduler]` high- and low-water marks
/// (comments are lost: the stored text is the one that ran).
pub fn with_routers(text: &str, routers: &[RouterEntry], marks: Option<WaterMarks>) -> Result<String, String> {
    let mut table: toml::Table = toml::from_str(text).map_err(|e| format!("the scenario is not valid TOML: {e}"))?;
    let list = routers.iter().map(toml::Value::try_from).collect::<Result<_, _>>();
    let list = list.map_err(|e| format!("cannot write a router entry: {e}"))?;
    table.insert("routers".into(), toml::Value::Array(list));
    if let Some(m) = marks {
        let scheduler = table.entry("scheduler").or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(scheduler) = scheduler else {
            return Err("`scheduler` is not a table".to_string());
        };
        scheduler.insert("kv_high_water".into(), toml::Value::Float(m.kv_high_water));
        match m.kv_low_water {
            Some(low) => scheduler.insert("kv_low_water".into(), toml::Value::Float(low)),
            None => scheduler.remove("kv_low_water"),
        };
    }
    toml::to_string(&table).map_err(|e| format!("cannot write the scenario back: {e}"))
}

/// The repository's example scenarios, copied into the binary so that a console served from
/// anywhere offers them; `examples/` in the working directory, when there, is read instead
/// (it may hold an operator's own).
const EXAMPLES: [(&str, &str); 27] = [
    ("agentic-sessions-pressure.toml", include_str!("../../../examples/agentic-sessions-pressure.toml")),
    ("agentic-sessions.toml", include_str!("../../../examples/agentic-sessions.toml")),
    ("agentic-tiers.toml", include_str!("../../../examples/agentic-tiers.toml")),
    ("arxiv-tiers.toml", include_str!("../../../examples/arxiv-tiers.toml")),
    ("azure-conversation.toml", include_str!("../../../examples/azure-conversation.toml")),
    ("azure-tiers.toml", include_str!("../../../examples/azure-tiers.toml")),
    ("classes-interactive-batch.toml", include_str!("../../../examples/classes-interactive-batch.toml")),
    ("classes-two-tenants.toml", include_str!("../../../examples/classes-two-tenants.toml")),
    ("cuda-fidelity.toml", include_str!("../../../examples/cuda-fidelity.toml")),
    ("long-context-layouts.toml", include_str!("../../../examples/long-context-layouts.toml")),
    ("long-input-fair.toml", include_str!("../../../examples/long-input-fair.toml")),
    ("long-input-mooncake.toml", include_str!("../../../examples/long-input-mooncake.toml")),
    ("live-fidelity.toml", include_str!("../../../examples/live-fidelity.toml")),
    ("long-output-burst.toml", include_str!("../../../examples/long-output-burst.toml")),
    ("mooncake-conversation.toml", include_str!("../../../examples/mooncake-conversation.toml")),
    ("mooncake-tiers.toml", include_str!("../../../examples/mooncake-tiers.toml")),
    ("mooncake-tiers-chunks.toml", include_str!("../../../examples/mooncake-tiers-chunks.toml")),
    ("mooncake-tiers-h200.toml", include_str!("../../../examples/mooncake-tiers-h200.toml")),
    ("pd-servegen.toml", include_str!("../../../examples/pd-servegen.toml")),
    ("pd-shift.toml", include_str!("../../../examples/pd-shift.toml")),
    ("router-no-prefix-long.toml", include_str!("../../../examples/router-no-prefix-long.toml")),
    ("router-short-output.toml", include_str!("../../../examples/router-short-output.toml")),
    ("router-system-prompts-bursty.toml", include_str!("../../../examples/router-system-prompts-bursty.toml")),
    ("sharegpt-tiers.toml", include_str!("../../../examples/sharegpt-tiers.toml")),
    ("spec-decoding.toml", include_str!("../../../examples/spec-decoding.toml")),
    ("synthetic-shared-prefix.toml", include_str!("../../../examples/synthetic-shared-prefix.toml")),
    ("vllm-fidelity.toml", include_str!("../../../examples/vllm-fidelity.toml")),
];

const EXAMPLES_DIR: &str = "examples";

/// Example scenarios by name, each with its text and whether its trace (if it reads one) is
/// found. A relative trace path is relative to the scenario's file, but a scenario sent
/// through the API has no file: such paths are made absolute here, in the text.
pub fn examples() -> Vec<serde_json::Value> {
    let dir = Path::new(EXAMPLES_DIR);
    let mut files: Vec<(String, String)> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                .filter_map(|p| {
                    let name = p.file_name()?.to_str()?.to_string();
                    Some((name, std::fs::read_to_string(&p).ok()?))
                })
                .collect()
        })
        .unwrap_or_default();
    if files.is_empty() {
        files = EXAMPLES.iter().map(|(n, t)| (n.to_string(), t.to_string())).collect();
    }
    files.sort();
    files.into_iter().map(|(name, text)| example(dir, name, text)).collect()
}

fn example(dir: &Path, name: String, text: String) -> serde_json::Value {
    let scenario: Scenario = match toml::from_str(&text) {
        Ok(s) => s,
        Err(e) => return json!({"name": name, "text": text, "error": format!("not a valid scenario: {e}")}),
    };
    // Every file the workload reads: a trace, or a phased workload's length table and
    // ServeGen aggregate.
    let w = scenario.workload;
    let phased = w.phased.map(|p| (p.lengths, p.servegen.map(|g| g.path)));
    let (lengths, servegen) = phased.map_or((None, None), |(l, g)| (Some(l), g));
    let files: Vec<PathBuf> = [w.trace, lengths, servegen].into_iter().flatten().collect();
    if files.is_empty() {
        return json!({"name": name, "text": text, "trace": null, "trace_found": null});
    }
    let mut text = text;
    let mut first: Option<PathBuf> = None;
    let mut missing: Option<PathBuf> = None;
    for file in files {
        let Some(written) = file.to_str() else {
            return json!({"name": name, "text": text, "error": "a file path of the workload is not UTF-8"});
        };
        let resolved = if file.is_relative() { dir.join(&file) } else { file.clone() };
        // A file that exists gets its canonical path (no `..`); one that does not, an absolute one.
        let found = resolved.is_file();
        let absolute = std::fs::canonicalize(&resolved).or_else(|_| std::path::absolute(&resolved)).unwrap_or(resolved);
        // The path appears in the text as a TOML basic string; replacing that string keeps
        // the file's comments, which a parse and re-serialisation would drop.
        if let Some(abs) = absolute.to_str().filter(|_| file.is_relative()) {
            text = text.replacen(&format!("\"{written}\""), &toml::Value::String(abs.into()).to_string(), 1);
        }
        if !found && missing.is_none() {
            missing = Some(absolute.clone());
        }
        first.get_or_insert(absolute);
    }
    // `trace` names the missing file if one is, for the console's message.
    let shown = missing.as_ref().or(first.as_ref());
    json!({"name": name, "text": text, "trace": shown, "trace_found": missing.is_none()})
}

/// Runs `id` in the background; the state and result land in the database.
pub fn spawn(app: Arc<App>, id: i64, scenario: String) {
    tokio::spawn(async move {
        let Ok(_permit) = app.simulations.acquire().await else { return };
        if let Err(e) = app.store.simulation_state(id, "running").await {
            tracing::warn!(simulation = id, "cannot mark it running: {}", control::describe(&*e));
        }
        let outcome = tokio::task::spawn_blocking(move || run(&scenario))
            .await
            .unwrap_or_else(|e| Err(format!("the simulation panicked: {e}")));
        if let Err(e) = app.store.finish_simulation(id, outcome).await {
            tracing::warn!(simulation = id, "cannot store its result: {}", control::describe(&*e));
        }
    });
}

/// Every router of the scenario on the same arrivals (side by side, as `simulate` runs them);
/// the report's JSON and a CDF chart.
fn run(text: &str) -> Result<(serde_json::Value, String), String> {
    let mut settings = validate(text)?;
    if settings.routers.len() > 1 {
        // The runs side by side read the same trace.
        settings.keep_trace().map_err(|e| e.to_string())?;
    }
    let hidden = MultiProgress::with_draw_target(ProgressDrawTarget::hidden());
    let outputs = run_routers(&settings, &settings.routers, settings.rate_scale, true, None, &hidden)
        .map_err(|e| e.describe())?;
    let series: Vec<CdfSeries> = outputs
        .iter()
        .map(|o| CdfSeries { label: o.router.clone(), ttft: o.ttft_cdf.clone(), tpot: o.tpot_cdf.clone() })
        .collect();
    let runs: Vec<RunReport> = outputs
        .into_iter()
        .map(|o| RunReport { router: o.router, summary: o.summary, decisions: o.decisions })
        .collect();
    let dir = std::env::temp_dir().join(format!("fleetplane-sim-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot make a folder for the chart: {e}"))?;
    let path = dir.join("cdf.svg");
    let chart = plot_cdfs(&path, &series)
        .map_err(|e| e.to_string())
        .and_then(|()| std::fs::read_to_string(&path).map_err(|e| format!("cannot read the chart back: {e}")));
    let _ = std::fs::remove_dir_all(&dir);
    let result = serde_json::to_value(Report { runs, calibration: settings.calibration.clone(), step_check: None })
        .map_err(|e| e.to_string())?;
    Ok((result, chart?))
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_scenario_is_embedded() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .map(|d| d.filter_map(Result::ok).filter_map(|e| e.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        on_disk.retain(|n| n.ends_with(".toml"));
        on_disk.sort();
        let mut embedded: Vec<String> = EXAMPLES.iter().map(|(n, _)| n.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded, "list every examples/*.toml in EXAMPLES, so that the console offers it anywhere");
    }

    #[test]
    fn a_relative_trace_path_is_made_absolute_in_the_text() {
        let text = "# keep me\n[workload]\ntrace = \"../t.jsonl\"\nformat = \"mooncake\"\n";
        let v = example(Path::new("/srv/examples"), "x.toml".into(), text.into());
        assert_eq!(v["text"], "# keep me\n[workload]\ntrace = \"/srv/examples/../t.jsonl\"\nformat = \"mooncake\"\n");
        assert_eq!(v["trace_found"], false);
    }

    #[test]
    fn a_relative_length_table_is_made_absolute_and_a_missing_one_named() {
        let text = "[workload.phased]\nlengths = \"../l.csv\"\nphases = []\n";
        let v = example(Path::new("/srv/examples"), "x.toml".into(), text.into());
        assert_eq!(v["text"], "[workload.phased]\nlengths = \"/srv/examples/../l.csv\"\nphases = []\n");
        assert_eq!((v["trace"].as_str(), &v["trace_found"]), (Some("/srv/examples/../l.csv"), &json!(false)));
    }

    #[test]
    fn routers_are_replaced_and_the_rest_kept() {
        let text = "seed = 3\nrouters = [\"round-robin\"]\n[fleet]\ninstances = 2\n";
        let out = with_routers(text, &["cache-aware".into(), "power-of-two".into()], None).expect("valid");
        let s: Scenario = toml::from_str(&out).expect("parses");
        assert_eq!(s.routers, Some(vec!["cache-aware".into(), "power-of-two".into()]));
        assert_eq!((s.seed, s.fleet.instances), (Some(3), Some(2)));
        assert_eq!(s.scheduler.kv_high_water, None);
    }

    #[test]
    fn a_policys_router_parameters_and_step_budget_reach_its_run() {
        let text = "[workload.synthetic]\nrequests = 10\narrival = { kind = \"poisson\", rate_rps = 1.0 }\n\
                    input = { kind = \"constant\", tokens = 100 }\noutput = { kind = \"constant\", tokens = 10 }\n";
        let tuned = RouterEntry::with_params("cache-aware@fcfs+nohw+b878", &[("copy_weight".to_string(), 2.5)].into());
        let out = with_routers(text, &["cache-aware@fcfs+nohw".into(), tuned], None).expect("valid");
        let runs = validate(&out).expect("resolves").routers;
        assert_eq!(runs.iter().map(|r| r.max_batch_tokens).collect::<Vec<_>>(), [8192, 878]);
        assert_eq!(runs[1].router.changed(), [("copy_weight".to_string(), 2.5)].into());
        assert!(runs[0].router.changed().is_empty());
    }

    #[test]
    fn the_edited_water_marks_go_into_the_scheduler_section() {
        let text = "[scheduler]\nprefill = \"fair\"\nkv_low_water = 0.1\n";
        let marks = WaterMarks { kv_high_water: 0.85, kv_low_water: None };
        let out = with_routers(text, &["round-robin@fcfs+hw".into()], Some(marks)).expect("valid");
        let s: Scenario = toml::from_str(&out).expect("parses");
        assert_eq!((s.scheduler.kv_high_water, s.scheduler.kv_low_water), (Some(0.85), None));
        assert_eq!(s.scheduler.prefill.as_deref(), Some("fair"), "the rest of the section is kept");
    }
}
