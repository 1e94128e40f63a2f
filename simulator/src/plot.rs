//! Charts of a comparison: TTFT and TPOT CDFs, one line per router.
//!
//! Text is laid out with plotters' `ab_glyph` support and a font compiled into the binary
//! (DejaVu Sans, `assets/fonts/`), so plotting needs no fontconfig and no system font.
//! The format follows the file extension: `.svg` (vector) or `.png` (bitmap).

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The font every label uses, registered with plotters as `sans-serif`.
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

const SIZE_PX: (u32, u32) = (1400, 560);
const CAPTION_PX: u32 = 24;
const LABEL_PX: u32 = 16;
const DESC_PX: u32 = 18;

/// Draws `$draw(&root, $data)` into `$path`, SVG or PNG by its extension. A macro, not a
/// function: each backend is another type, and the drawing functions are generic over it.
macro_rules! render {
    ($path:expr, $size:expr, $draw:ident, $data:expr) => {{
        let path: &Path = $path;
        let extension = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        let draw_error = |message: String| PlotError::Draw { path: path.to_path_buf(), message };
        match extension.as_deref() {
            Some("svg") => {
                register_font(path)?;
                let root = SVGBackend::new(path, $size).into_drawing_area();
                $draw(&root, $data).map_err(|e| draw_error(e.to_string()))?;
                root.present().map_err(|e| draw_error(e.to_string()))
            }
            Some("png") => {
                register_font(path)?;
                let root = BitMapBackend::new(path, $size).into_drawing_area();
                $draw(&root, $data).map_err(|e| draw_error(e.to_string()))?;
                root.present().map_err(|e| draw_error(e.to_string()))
            }
            _ => Err(PlotError::UnsupportedFormat { path: path.to_path_buf() }),
        }
    }};
}

/// One router's distributions, as `(ms, cumulative fraction)` points (see
/// [`crate::metrics::Metrics::ttft_cdf`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CdfSeries {
    pub label: String,
    pub ttft: Vec<(f64, f64)>,
    pub tpot: Vec<(f64, f64)>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("plotting {}: unsupported file extension (supported: .svg, .png)", .path.display())]
    UnsupportedFormat { path: PathBuf },
    #[error("plotting {}: the embedded font could not be loaded", .path.display())]
    Font { path: PathBuf },
    #[error("plotting {}: {message}", .path.display())]
    Draw { path: PathBuf, message: String },
}

/// Draws two panels side by side, the TTFT CDF (log time axis) and the TPOT CDF (linear), with
/// one line per series and a legend, into `path` (`.svg` or `.png`).
pub fn plot_cdfs(path: &Path, series: &[CdfSeries]) -> Result<(), PlotError> {
    render!(path, SIZE_PX, draw_cdfs, series)
}

/// Registers the embedded font once per process; later calls reuse the outcome.
fn register_font(path: &Path) -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(PlotError::Font { path: path.to_path_buf() })
    }
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn draw_cdfs<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, series: &[CdfSeries]) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));

    let ttft: Vec<(&str, &[(f64, f64)])> = series.iter().map(|s| (s.label.as_str(), s.ttft.as_slice())).collect();
    // Log axis: TTFT spans orders of magnitude between a cache hit and a queued long prompt.
    // Points at zero (impossible on a log axis) are drawn at its left edge.
    let (lo, hi) = positive_bounds(&ttft);
    let x_lo = lo / 1.2;
    draw_panel(
        &panels[0],
        "TTFT CDF",
        "time to first token (ms, log scale)",
        {
            let (bold, light) = log_ticks(x_lo, hi * 1.2);
            (x_lo..hi * 1.2).log_scale().with_key_points(bold).with_light_points(light)
        },
        &ttft,
        |x| x.max(x_lo),
    )?;

    let tpot: Vec<(&str, &[(f64, f64)])> = series.iter().map(|s| (s.label.as_str(), s.tpot.as_slice())).collect();
    let (_, hi) = positive_bounds(&tpot);
    draw_panel(&panels[1], "TPOT CDF", "time per output token (ms)", 0.0..hi * 1.05, &tpot, |x| x)
}

/// Smallest positive and largest x over all curves, with defaults (1 ms to 1 s) when there is
/// nothing to draw, and a decade of room when every point sits at one value.
fn positive_bounds(curves: &[(&str, &[(f64, f64)])]) -> (f64, f64) {
    let xs = || curves.iter().flat_map(|(_, points)| points.iter().map(|p| p.0));
    let lo = xs().filter(|x| *x > 0.0).fold(f64::INFINITY, f64::min);
    let hi = xs().fold(0.0, f64::max);
    if !lo.is_finite() || hi <= 0.0 {
        return (1.0, 1000.0);
    }
    if hi <= lo {
        return (lo / 10.0_f64.sqrt(), lo * 10.0_f64.sqrt());
    }
    (lo, hi)
}

fn draw_panel<DB, X>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    x_desc: &str,
    x_spec: X,
    curves: &[(&str, &[(f64, f64)])],
    place_x: impl Fn(f64) -> f64,
) -> DrawResult<DB>
where
    DB: DrawingBackend,
    X: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FAMILY, CAPTION_PX))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(72)
        .build_cartesian_2d(x_spec, 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("fraction of requests")
        .axis_desc_style((FAMILY, DESC_PX))
        .label_style((FAMILY, LABEL_PX))
        .x_label_formatter(&|x| format_ms(*x))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()?;
    for (i, (label, points)) in curves.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.iter().map(|&(x, q)| (place_x(x), q)), color.stroke_width(2)))?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
    }
    if !curves.is_empty() {
        draw_legend(&mut chart)?;
    }
    Ok(())
}

/// The legend box, in the lower right corner.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> DrawResult<DB> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FAMILY, LABEL_PX))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
}

/// Most shifts marked on a time-series plot.
pub const MAX_MARKED_SHIFTS: usize = 24;

/// One run's time series (see [`crate::timeline`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineSeries {
    pub label: String,
    pub points: Vec<crate::timeline::TimelinePoint>,
    /// Where the workload shifts, in seconds (drawn as vertical lines, up to
    /// [`MAX_MARKED_SHIFTS`] of them).
    pub shifts_s: Vec<f64>,
}

/// Draws four panels over time, one line per run: SLO attainment per window, GPUs held,
/// prefill and decode instances (dashed: decode; colocated instances as prefill), and the
/// SLO loads `Load_P` (solid) and `Load_D` (dashed), into `path` (`.svg` or `.png`).
pub fn plot_timeline(path: &Path, series: &[TimelineSeries]) -> Result<(), PlotError> {
    render!(path, (1400, 1200), draw_timeline, series)
}

/// A curve of one panel: its points, and whether it is drawn dashed.
type Curve<'a> = (String, Vec<(f64, f64)>, bool, usize);

fn draw_timeline<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, series: &[TimelineSeries]) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let panels = root.split_evenly((4, 1));
    let t_max = series.iter().flat_map(|s| s.points.iter().map(|p| p.t_s)).fold(1.0, f64::max);
    // A workload that shifts at every window (ServeGen's shape) would hide the curves behind
    // its marks: only a few shifts are drawn.
    let shifts: Vec<f64> =
        series.first().map(|s| s.shifts_s.clone()).filter(|s| s.len() <= MAX_MARKED_SHIFTS).unwrap_or_default();
    let pick = |f: &dyn Fn(&crate::timeline::TimelinePoint) -> Option<f64>, dashed: bool, suffix: &str| {
        series
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let pts: Vec<(f64, f64)> = s.points.iter().filter_map(|p| f(p).map(|v| (p.t_s, v))).collect();
                (format!("{}{suffix}", s.label), pts, dashed, i)
            })
            .filter(|c| !c.1.is_empty())
            .collect::<Vec<Curve>>()
    };
    let attainment = pick(&|p| Some(p.slo_attainment * 100.0), false, "");
    let gpus = pick(&|p| Some(f64::from(p.gpus)), false, "");
    let mut instances = pick(&|p| Some(f64::from(p.prefill + p.colocated)), false, " P");
    instances.extend(pick(&|p| (p.decode > 0).then_some(f64::from(p.decode)), true, " D"));
    let mut loads = pick(&|p| p.load_p.map(|l| l.min(5.0)), false, " Load_P");
    loads.extend(pick(&|p| p.load_d.map(|l| l.min(5.0)), true, " Load_D"));
    let y_max = |c: &[Curve], floor: f64| c.iter().flat_map(|c| c.1.iter().map(|p| p.1)).fold(floor, f64::max) * 1.1;
    draw_time_panel(&panels[0], "SLO attainment per window", "%", 0.0..101.0, t_max, &attainment, &shifts)?;
    draw_time_panel(&panels[1], "GPUs held", "GPUs", 0.0..y_max(&gpus, 1.0), t_max, &gpus, &shifts)?;
    let top = y_max(&instances, 1.0);
    draw_time_panel(
        &panels[2],
        "instances: prefill (solid), decode (dashed)",
        "instances",
        0.0..top,
        t_max,
        &instances,
        &shifts,
    )?;
    let top = y_max(&loads, 1.2);
    draw_time_panel(
        &panels[3],
        "SLO load (capped at 5): Load_P (solid), Load_D (dashed)",
        "load",
        0.0..top,
        t_max,
        &loads,
        &shifts,
    )
}

fn draw_time_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    y_desc: &str,
    y: std::ops::Range<f64>,
    t_max: f64,
    curves: &[Curve],
    shifts: &[f64],
) -> DrawResult<DB> {
    let (y_lo, y_hi) = (y.start, y.end);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FAMILY, LABEL_PX + 4))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..t_max, y)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc(y_desc)
        .axis_desc_style((FAMILY, LABEL_PX))
        .label_style((FAMILY, LABEL_PX))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format_ms(*y))
        .draw()?;
    for &s in shifts {
        chart.draw_series(LineSeries::new([(s, y_lo), (s, y_hi)], BLACK.mix(0.3)))?;
    }
    for (label, points, dashed, i) in curves {
        let color = Palette99::pick(*i).to_rgba();
        let style = color.stroke_width(2);
        let anno = if *dashed {
            chart.draw_series(DashedLineSeries::new(points.iter().copied(), 8, 5, style))?
        } else {
            chart.draw_series(LineSeries::new(points.iter().copied(), style))?
        };
        anno.label(label.as_str()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
    }
    if !curves.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FAMILY, LABEL_PX - 2))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

/// Labelled ticks at 1, 2 and 5 times each power of ten in `[lo, hi]` (only the powers of ten
/// when the range spans more than four decades), grid lines at the other multiples.
/// Plotters' own log ticks label only the powers of ten, often two labels per panel.
fn log_ticks(lo: f64, hi: f64) -> (Vec<f64>, Vec<f64>) {
    let first = lo.log10().floor() as i32;
    let last = hi.log10().ceil() as i32;
    let labelled: &[u32] = if last - first > 4 { &[1] } else { &[1, 2, 5] };
    let (mut bold, mut light) = (Vec::new(), Vec::new());
    for exponent in first..=last {
        let decade = 10f64.powi(exponent);
        for multiple in 1..=9u32 {
            let x = decade * f64::from(multiple);
            if x < lo || x > hi {
                continue;
            }
            if labelled.contains(&multiple) {
                bold.push(x);
            } else {
                light.push(x);
            }
        }
    }
    (bold, light)
}

/// Tick labels without float noise: `0.25`, `5`, `1200`.
fn format_ms(x: f64) -> String {
    let text = format!("{x:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A `fleetplane tune` search: each trial's objective, in the order tried.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchPlot {
    pub title: String,
    pub y_label: String,
    /// `(trial, objective)`; trials that did not count are left out.
    pub trials: Vec<(f64, f64)>,
    /// The untuned policy's objective, drawn as a dashed line.
    pub untuned: Option<f64>,
    /// Higher is better (the best-so-far line follows the maximum).
    pub maximize: bool,
}

/// Draws a search: a dot per trial, the best so far, and the untuned policy's value, into
/// `path` (`.svg` or `.png`).
pub fn plot_search(path: &Path, plot: &SearchPlot) -> Result<(), PlotError> {
    render!(path, (1000, 560), draw_search, plot)
}

fn draw_search<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, plot: &SearchPlot) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let ys = || plot.trials.iter().map(|t| t.1).chain(plot.untuned);
    let (lo, hi) = (ys().fold(f64::INFINITY, f64::min), ys().fold(f64::NEG_INFINITY, f64::max));
    let (lo, hi) = if lo.is_finite() && hi > lo { (lo, hi) } else { (lo.min(0.0).min(hi), hi.max(1.0)) };
    let pad = (hi - lo) * 0.08;
    let x_max = plot.trials.iter().map(|t| t.0).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(root)
        .caption(&plot.title, (FAMILY, CAPTION_PX))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max + 1.0, (lo - pad)..(hi + pad))?;
    chart
        .configure_mesh()
        .x_desc("trial")
        .y_desc(plot.y_label.as_str())
        .axis_desc_style((FAMILY, DESC_PX))
        .label_style((FAMILY, LABEL_PX))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    let dots = Palette99::pick(0).to_rgba();
    chart
        .draw_series(plot.trials.iter().map(|&(x, y)| Circle::new((x, y), 4, dots.filled())))?
        .label("trial")
        .legend(move |(x, y)| Circle::new((x + 12, y), 4, dots.filled()));
    let mut best: Vec<(f64, f64)> = Vec::new();
    for &(x, y) in &plot.trials {
        let b = match best.last() {
            Some(&(_, b)) if (plot.maximize && b >= y) || (!plot.maximize && b <= y) => b,
            _ => y,
        };
        best.push((x, b));
    }
    let line = Palette99::pick(1).to_rgba();
    chart
        .draw_series(LineSeries::new(best, line.stroke_width(2)))?
        .label("best so far")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], line.stroke_width(2)));
    if let Some(u) = plot.untuned {
        let style = BLACK.stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(vec![(0.0, u), (x_max + 1.0, u)], 8, 6, style))?
            .label("untuned")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
    }
    draw_legend(&mut chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series() -> Vec<CdfSeries> {
        let cdf = |scale: f64| -> Vec<(f64, f64)> {
            (0..=200)
                .map(|i| {
                    let q = f64::from(i) / 200.0;
                    (scale * (1.0 + 50.0 * q * q * q), q)
                })
                .collect()
        };
        vec![
            CdfSeries { label: "round_robin".to_string(), ttft: cdf(20.0), tpot: cdf(0.5) },
            CdfSeries { label: "cache_aware".to_string(), ttft: cdf(5.0), tpot: cdf(0.4) },
        ]
    }

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("fleetplane-plot-{}-{name}", std::process::id()))
    }

    fn assert_plot_written(name: &str, series: &[CdfSeries]) {
        let path = temp_path(name);
        plot_cdfs(&path, series).expect("plot written");
        let bytes = std::fs::read(&path).expect("plot read");
        std::fs::remove_file(&path).expect("plot removed");
        assert!(bytes.len() > 1000, "{name}: only {} bytes", bytes.len());
    }

    #[test]
    fn plot_cdfs_writes_an_svg_with_a_legend() {
        let path = temp_path("legend.svg");
        plot_cdfs(&path, &series()).expect("plot written");
        let svg = std::fs::read_to_string(&path).expect("plot read");
        std::fs::remove_file(&path).expect("plot removed");
        for text in ["TTFT CDF", "TPOT CDF", "round_robin", "cache_aware", "(ms, log scale)"] {
            assert!(svg.contains(text), "svg lacks `{text}`");
        }
    }

    #[test]
    fn plot_cdfs_writes_a_png() {
        let path = temp_path("cdf.png");
        plot_cdfs(&path, &series()).expect("plot written");
        let bytes = std::fs::read(&path).expect("plot read");
        std::fs::remove_file(&path).expect("plot removed");
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a png");
        assert!(bytes.len() > 1000, "only {} bytes", bytes.len());
    }

    #[test]
    fn plot_cdfs_draws_empty_and_degenerate_series() {
        assert_plot_written("empty.svg", &[]);
        let flat = CdfSeries { label: "one request".to_string(), ttft: vec![(0.0, 0.0), (0.0, 1.0)], tpot: Vec::new() };
        assert_plot_written("flat.png", &[flat]);
    }

    #[test]
    fn plot_cdfs_rejects_other_extensions_naming_the_supported_ones() {
        let path = temp_path("cdf.jpg");
        let err = plot_cdfs(&path, &series()).expect_err("jpg is not supported");
        let message = err.to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert!(message.contains(".svg") && message.contains(".png"), "{message}");
        assert!(!path.exists());
    }

    #[test]
    fn plot_timeline_writes_four_panels_with_each_run_in_the_legend() {
        let point = |t_s: f64, prefill: u32, load: Option<f64>| crate::timeline::TimelinePoint {
            t_s,
            prefill,
            decode: prefill * 2,
            colocated: 0,
            starting: 1,
            draining: 0,
            gpus: prefill * 3,
            load_p: load,
            load_d: load.map(|l| l / 2.0),
            finished: 10,
            slo_attainment: 0.95,
        };
        let series = vec![
            TimelineSeries {
                label: "pd".into(),
                points: vec![point(10.0, 1, Some(0.5)), point(20.0, 3, Some(9.0))],
                shifts_s: vec![15.0],
            },
            TimelineSeries { label: "colocated".into(), points: vec![point(10.0, 4, None)], shifts_s: vec![15.0] },
            TimelineSeries { label: "empty".into(), points: Vec::new(), shifts_s: Vec::new() },
        ];
        let path = temp_path("timeline.svg");
        plot_timeline(&path, &series).expect("plot written");
        let text = std::fs::read_to_string(&path).expect("plot read");
        std::fs::remove_file(&path).expect("plot removed");
        for label in ["SLO attainment per window", "GPUs held", "pd Load_P", "colocated P", "pd D"] {
            assert!(text.contains(label), "{label} missing");
        }
    }
}
