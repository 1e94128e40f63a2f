//! Progress on stderr, shown only for runs that last more than a second (and only on a
//! terminal: indicatif hides itself otherwise).

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use simulator::sim::Progress;
use std::time::{Duration, Instant};

const SHOW_AFTER: Duration = Duration::from_secs(1);

/// One spinner per run, created lazily.
pub struct RunProgress<'a> {
    multi: &'a MultiProgress,
    label: String,
    started: Instant,
    bar: Option<ProgressBar>,
}

impl<'a> RunProgress<'a> {
    pub fn new(multi: &'a MultiProgress, label: impl Into<String>) -> Self {
        RunProgress { multi, label: label.into(), started: Instant::now(), bar: None }
    }

    pub fn update(&mut self, p: Progress) {
        if self.bar.is_none() && self.started.elapsed() < SHOW_AFTER {
            return;
        }
        let bar = self.bar.get_or_insert_with(|| {
            let b = self.multi.add(ProgressBar::new_spinner());
            b.set_style(
                ProgressStyle::with_template("{spinner} {elapsed} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        bar.set_message(format!("{}: {} requests, {:.0} s simulated", self.label, p.arrivals, p.now.as_secs_f64()));
    }
}

impl Drop for RunProgress<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}
