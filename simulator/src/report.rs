//! What a simulation hands back: JSON reports and terminal tables comparing routers.
//!
//! A [`Report`] holds one [`RunReport`] per router run on the same workload and fleet; a
//! [`MaxRateReport`] holds, per router, the highest rate scale that still met the SLO and the
//! summary of the run at that scale. Both serialize to JSON ([`write_json`]) and render as
//! aligned plain-text tables ([`comparison_table`], [`max_rate_table`]).

use crate::metrics::Summary;
use crate::sim::Decision;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One run: a router on the workload, and what came out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub router: String,
    pub summary: Summary,
    /// A sample of the router's decisions with their reasons.
    #[serde(default)]
    pub decisions: Vec<Decision>,
}

/// The runs of one comparison, in the order they were asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub runs: Vec<RunReport>,
    /// The cost model's fit to the engine's measured profile (`--profile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<cost::Calibration>,
    /// The cost model against steps an engine served (`--check-steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_check: Option<cost::StepCheck>,
}

/// The highest load a router sustained within the SLO.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MaxRateRun {
    pub router: String,
    /// Multiplier on the trace's arrival rate (1.0 = as recorded).
    pub max_rate_scale: f64,
    /// The run at `max_rate_scale`.
    pub summary: Summary,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MaxRateReport {
    pub runs: Vec<MaxRateRun>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("serializing report for {}: {error}", .path.display())]
    Serialize { path: PathBuf, error: serde_json::Error },
    #[error("writing report {}: {error}", .path.display())]
    Write { path: PathBuf, error: std::io::Error },
}

/// Writes `report` to `path` as pretty-printed JSON with a trailing newline.
pub fn write_json(path: &Path, report: &impl Serialize) -> Result<(), ReportError> {
    let mut text = serde_json::to_string_pretty(report)
        .map_err(|error| ReportError::Serialize { path: path.to_path_buf(), error })?;
    text.push('\n');
    std::fs::write(path, text).map_err(|error| ReportError::Write { path: path.to_path_buf(), error })
}

/// A row of the comparison table: its label (with the unit), how to read the value from a
/// summary, and how many decimals to print.
struct Row {
    label: &'static str,
    value: fn(&Summary) -> f64,
    decimals: usize,
}

const ROWS: &[Row] = &[
    Row { label: "requests", value: |s| s.requests as f64, decimals: 0 },
    Row { label: "rejected", value: |s| s.rejected as f64, decimals: 0 },
    Row { label: "TTFT mean (ms)", value: |s| s.ttft_ms.mean, decimals: 1 },
    Row { label: "TTFT p50 (ms)", value: |s| s.ttft_ms.p50, decimals: 1 },
    Row { label: "TTFT p90 (ms)", value: |s| s.ttft_ms.p90, decimals: 1 },
    Row { label: "TTFT p95 (ms)", value: |s| s.ttft_ms.p95, decimals: 1 },
    Row { label: "TTFT p99 (ms)", value: |s| s.ttft_ms.p99, decimals: 1 },
    Row { label: "TTFT short mean (ms)", value: |s| s.ttft_ms_short.mean, decimals: 1 },
    Row { label: "TTFT short p99 (ms)", value: |s| s.ttft_ms_short.p99, decimals: 1 },
    Row { label: "TTFT long mean (ms)", value: |s| s.ttft_ms_long.mean, decimals: 1 },
    Row { label: "TTFT long p99 (ms)", value: |s| s.ttft_ms_long.p99, decimals: 1 },
    Row { label: "TTFT short-output p99 (ms)", value: |s| s.ttft_ms_short_output.p99, decimals: 1 },
    Row { label: "TPOT mean (ms)", value: |s| s.tpot_ms.mean, decimals: 2 },
    Row { label: "TPOT p50 (ms)", value: |s| s.tpot_ms.p50, decimals: 2 },
    Row { label: "TPOT p90 (ms)", value: |s| s.tpot_ms.p90, decimals: 2 },
    Row { label: "TPOT p99 (ms)", value: |s| s.tpot_ms.p99, decimals: 2 },
    Row { label: "E2E p50 (ms)", value: |s| s.e2e_ms.p50, decimals: 1 },
    Row { label: "E2E p99 (ms)", value: |s| s.e2e_ms.p99, decimals: 1 },
    Row { label: "queue p99 (ms)", value: |s| s.queue_ms.p99, decimals: 1 },
    Row { label: "SLO attainment (%)", value: |s| s.slo_attainment * 100.0, decimals: 1 },
    Row { label: "  short-output (%)", value: |s| s.slo_attainment_short_output * 100.0, decimals: 1 },
    Row { label: "goodput (req/s)", value: |s| s.goodput_rps, decimals: 2 },
    Row { label: "input (tok/s)", value: |s| s.throughput_tok_s.input, decimals: 0 },
    Row { label: "output (tok/s)", value: |s| s.throughput_tok_s.output, decimals: 0 },
    Row { label: "cache hit (%)", value: |s| s.cache_hit_rate * 100.0, decimals: 1 },
    Row { label: "  from L1 (%)", value: |s| s.hit_rate_by_tier.l1 * 100.0, decimals: 1 },
    Row { label: "  from L2 (%)", value: |s| s.hit_rate_by_tier.l2 * 100.0, decimals: 1 },
    Row { label: "  from L3 (%)", value: |s| s.hit_rate_by_tier.l3 * 100.0, decimals: 1 },
    Row { label: "infinite-cache hit (%)", value: |s| s.max_hit_rate.unwrap_or(f64::NAN) * 100.0, decimals: 1 },
    Row { label: "GPU-hours (h)", value: |s| s.gpu_hours, decimals: 3 },
    Row { label: "GPU busy (s)", value: |s| s.gpu_busy_s, decimals: 0 },
    Row { label: "  prefill share (%)", value: |s| s.prefill_time_share * 100.0, decimals: 1 },
    Row { label: "cost ($/Mtok)", value: |s| s.cost_per_mtok, decimals: 3 },
    Row { label: "preemptions", value: |s| s.preemptions as f64, decimals: 0 },
    Row { label: "prefill yields", value: |s| s.yields as f64, decimals: 0 },
    Row { label: "long-output requests", value: |s| s.long_output_requests as f64, decimals: 0 },
    Row { label: "evictions", value: |s| s.evictions as f64, decimals: 0 },
    Row { label: "re-routes", value: |s| s.reroutes as f64, decimals: 0 },
    Row { label: "ended (runaway)", value: |s| s.ended_runaway as f64, decimals: 0 },
    Row { label: "admission paused (s)", value: |s| s.admission_paused_s, decimals: 1 },
    Row { label: "paused wait p99 (ms)", value: |s| s.paused_wait_ms.p99, decimals: 1 },
];

/// Shown only when a run speculates.
const SPECULATION_ROW: Row = Row {
    label: "drafts accepted per step",
    value: |s| s.speculation.as_ref().map_or(0.0, |p| p.accepted_per_step),
    decimals: 2,
};

/// One column per router and one row per metric. With exactly two routers, a last column
/// gives the second's value over the first's (`-` where the first is zero).
pub fn comparison_table(runs: &[RunReport]) -> String {
    let mut header = vec!["metric".to_string()];
    header.extend(runs.iter().map(|r| r.router.clone()));
    let with_ratio = runs.len() == 2;
    if with_ratio {
        header.push(format!("{}/{}", runs[1].router, runs[0].router));
    }
    let speculates = runs.iter().any(|r| r.summary.speculation.is_some());
    let rows = ROWS
        .iter()
        .chain(speculates.then_some(&SPECULATION_ROW))
        .map(|row| {
            let values: Vec<f64> = runs.iter().map(|r| (row.value)(&r.summary)).collect();
            let mut cells = vec![row.label.to_string()];
            cells.extend(values.iter().map(|v| format!("{v:.*}", row.decimals)));
            if with_ratio {
                cells.push(ratio_cell(values[0], values[1]));
            }
            cells
        })
        .collect();
    render(header, rows)
}

/// One row per router: the highest rate scale within the SLO and the run at that scale.
pub fn max_rate_table(runs: &[MaxRateRun]) -> String {
    let header = [
        "router",
        "max rate (x)",
        "goodput (req/s)",
        "SLO attainment (%)",
        "TTFT p99 (ms)",
        "TPOT p99 (ms)",
        "output (tok/s)",
        "cost ($/Mtok)",
    ]
    .map(String::from)
    .to_vec();
    let rows = runs
        .iter()
        .map(|r| {
            let s = &r.summary;
            vec![
                r.router.clone(),
                format!("{:.2}", r.max_rate_scale),
                format!("{:.2}", s.goodput_rps),
                format!("{:.1}", s.slo_attainment * 100.0),
                format!("{:.1}", s.ttft_ms.p99),
                format!("{:.2}", s.tpot_ms.p99),
                format!("{:.0}", s.throughput_tok_s.output),
                format!("{:.3}", s.cost_per_mtok),
            ]
        })
        .collect();
    render(header, rows)
}

/// One row per run with pools (disaggregated, autoscaled or with a time series): SLO
/// attainment, GPU-hours, scaling, and the time to meet the SLO again after each shift of the
/// workload. Empty when no run has pools.
pub fn pools_table(runs: &[RunReport]) -> String {
    let with_pools: Vec<(&RunReport, &crate::pools::PoolsReport)> =
        runs.iter().filter_map(|r| r.summary.pools.as_ref().map(|p| (r, p))).collect();
    if with_pools.is_empty() {
        return String::new();
    }
    let header = [
        "run",
        "mode",
        "autoscaler",
        "start-up (s)",
        "SLO attainment (%)",
        "GPU-hours (h)",
        "scaling events",
        "transfers",
        "restore after each shift, by arrival (s)",
        "by finish, in the time series' windows (s)",
        "most reversals per pool and phase",
    ]
    .map(String::from)
    .to_vec();
    let rows = with_pools
        .iter()
        .map(|(r, p)| {
            vec![
                r.router.clone(),
                p.mode.clone(),
                p.autoscaler.clone(),
                format!("{:.0}", p.startup_s),
                format!("{:.2}", r.summary.slo_attainment * 100.0),
                format!("{:.2}", r.summary.gpu_hours),
                p.scaling_events.to_string(),
                p.transfers.to_string(),
                shifts_cell(&p.restore_s),
                shifts_cell(&p.restore_by_finish_s),
                p.direction_changes.iter().flatten().max().copied().unwrap_or(0).to_string(),
            ]
        })
        .collect();
    render(header, rows)
}

/// The sessions of closed-loop runs: how many completed, within the SLO, per GPU-hour, and
/// the cache they found (empty when no run has sessions).
pub fn sessions_table(runs: &[RunReport]) -> String {
    let header = [
        "run",
        "sessions",
        "completed",
        "within SLO",
        "failed",
        "cut",
        "turns",
        "mean session (s)",
        "within SLO per GPU-hour",
        "hit rate (%)",
        "bound (%)",
    ]
    .map(String::from)
    .to_vec();
    let rows: Vec<Vec<String>> = runs
        .iter()
        .filter_map(|r| {
            let s = r.summary.sessions?;
            Some(vec![
                r.router.clone(),
                s.started.to_string(),
                s.completed.to_string(),
                s.completed_within_slo.to_string(),
                s.failed.to_string(),
                s.cut.to_string(),
                s.turns.to_string(),
                format!("{:.1}", s.mean_duration_s),
                format!("{:.1}", s.per_gpu_hour),
                format!("{:.1}", r.summary.cache_hit_rate * 100.0),
                r.summary.max_hit_rate.map_or("-".into(), |b| format!("{:.1}", b * 100.0)),
            ])
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    render(header, rows)
}

/// One row per class and per tenant of each run with request classes: its requests, what
/// was shed, its SLO attainment against its class's targets, goodput and latencies. Empty
/// when no run has classes.
pub fn groups_table(runs: &[RunReport]) -> String {
    let header = [
        "run",
        "class / tenant",
        "requests",
        "shed",
        "SLO (ms)",
        "SLO attainment (%)",
        "goodput (req/s)",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TPOT p99 (ms)",
    ]
    .map(String::from)
    .to_vec();
    let mut rows = Vec::new();
    for r in runs {
        let classes = r.summary.classes.iter().map(|g| (g, true));
        for (g, is_class) in classes.chain(r.summary.tenants.iter().map(|g| (g, false))) {
            let slo = match g.slo {
                Some(s) => format!("{:.0} / {:.0}", s.ttft_ms, s.tpot_ms),
                None => "-".to_string(),
            };
            rows.push(vec![
                r.router.clone(),
                if is_class { g.name.clone() } else { format!("tenant {}", g.name) },
                (g.requests + g.rejected).to_string(),
                g.shed.to_string(),
                slo,
                format!("{:.1}", g.slo_attainment * 100.0),
                format!("{:.2}", g.goodput_rps),
                format!("{:.1}", g.ttft_ms.p50),
                format!("{:.1}", g.ttft_ms.p99),
                format!("{:.2}", g.tpot_ms.p99),
            ]);
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    render(header, rows)
}

/// Times per shift: each, or for many shifts the longest and how many were not 0.
fn shifts_cell(times_s: &[f64]) -> String {
    const LISTED: usize = 6;
    match times_s {
        [] => "-".to_string(),
        few if few.len() <= LISTED => few.iter().map(|s| format!("{s:.0}")).collect::<Vec<_>>().join(" / "),
        many => {
            let longest = many.iter().copied().fold(0.0, f64::max);
            let missed = many.iter().filter(|&&s| s > 0.0).count();
            format!("max {longest:.0} ({missed} of {} shifts > 0)", many.len())
        }
    }
}

fn ratio_cell(base: f64, other: f64) -> String {
    if base == 0.0 {
        "-".to_string()
    } else {
        format!("{:.2}x", other / base)
    }
}

/// Lays out a table: the first column left-aligned, the others right-aligned, a rule under
/// the header, two spaces between columns, no trailing spaces.
fn render(header: Vec<String>, rows: Vec<Vec<String>>) -> String {
    let columns = header.len();
    let mut widths = vec![0; columns];
    for line in std::iter::once(&header).chain(&rows) {
        for (width, cell) in widths.iter_mut().zip(line) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut push_line = |cells: &[String]| {
        let mut line = String::new();
        for (i, (cell, width)) in cells.iter().zip(&widths).enumerate() {
            let pad = width - cell.chars().count();
            if i == 0 {
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', pad));
            } else {
                line.push_str("  ");
                line.extend(std::iter::repeat_n(' ', pad));
                line.push_str(cell);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    };
    push_line(&header);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    push_line(&rule);
    for row in &rows {
        push_line(row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{FleetCost, Metrics};
    use crate::slo::Slo;

    fn summary() -> Summary {
        Metrics::new(Slo { ttft_ms: 200.0, tpot_ms: 50.0 }).summary(&FleetCost { gpus: 8, price_per_gpu_hour: 2.0 })
    }

    fn run(router: &str, goodput_rps: f64) -> RunReport {
        let mut summary = summary();
        summary.goodput_rps = goodput_rps;
        RunReport { router: router.to_string(), summary, decisions: Vec::new() }
    }

    #[test]
    fn comparison_table_has_a_column_per_router_and_a_row_per_metric() {
        let runs = [run("round_robin", 2.0), run("cache_aware", 3.0)];
        let table = comparison_table(&runs);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("metric"));
        for router in ["round_robin", "cache_aware", "cache_aware/round_robin"] {
            assert!(lines[0].contains(router), "{table}");
        }
        assert_eq!(lines.len(), 2 + ROWS.len(), "{table}");
        let goodput = lines.iter().find(|l| l.starts_with("goodput (req/s)")).expect("goodput row");
        let cells: Vec<&str> = goodput.split_whitespace().collect();
        assert_eq!(cells[cells.len() - 3..], ["2.00", "3.00", "1.50x"], "{table}");
        // Right-aligned columns: every line but the rule is as wide as the header at most.
        let width = lines[1].len();
        assert!(lines.iter().all(|l| l.len() <= width), "{table}");
    }

    #[test]
    fn comparison_table_of_three_routers_has_no_ratio_column() {
        let runs = [run("a", 1.0), run("b", 2.0), run("c", 0.0)];
        let table = comparison_table(&runs);
        let header = table.lines().next().expect("header");
        assert_eq!(header.split_whitespace().collect::<Vec<_>>(), ["metric", "a", "b", "c"]);
    }

    #[test]
    fn ratio_against_a_zero_baseline_is_a_dash() {
        let runs = [run("a", 0.0), run("b", 2.0)];
        let table = comparison_table(&runs);
        let goodput = table.lines().find(|l| l.starts_with("goodput")).expect("goodput row");
        assert!(goodput.ends_with(" -"), "{table}");
    }

    #[test]
    fn max_rate_table_has_a_row_per_router() {
        let runs = [
            MaxRateRun { router: "round_robin".to_string(), max_rate_scale: 1.5, summary: summary() },
            MaxRateRun { router: "cache_aware".to_string(), max_rate_scale: 2.25, summary: summary() },
        ];
        let table = max_rate_table(&runs);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(lines[2].starts_with("round_robin") && lines[2].contains("1.50"));
        assert!(lines[3].starts_with("cache_aware") && lines[3].contains("2.25"));
    }

    #[test]
    fn write_json_writes_pretty_json_with_a_trailing_newline() {
        let path = std::env::temp_dir().join(format!("fleetplane-report-{}-write.json", std::process::id()));
        let report = Report { runs: vec![run("round_robin", 1.0)], calibration: None, step_check: None };
        write_json(&path, &report).expect("report written");
        let text = std::fs::read_to_string(&path).expect("report read");
        std::fs::remove_file(&path).expect("report removed");
        assert!(text.starts_with("{\n  \"runs\": [") && text.ends_with("}\n"), "{text}");
        let back: Report = serde_json::from_str(&text).expect("report parses");
        assert_eq!(back, report);
    }

    #[test]
    fn write_json_error_names_the_path() {
        let path =
            std::env::temp_dir().join(format!("fleetplane-report-{}-missing", std::process::id())).join("report.json");
        let err = write_json(&path, &Report { runs: Vec::new(), calibration: None, step_check: None })
            .expect_err("no such directory");
        let message = err.to_string();
        assert!(message.starts_with("writing report "), "{message}");
        assert!(message.contains(&path.display().to_string()), "{message}");
    }
}
