//! Prometheus text exposition, written by hand (it is a few lines of text): counters and
//! gauges with their `# HELP` and `# TYPE` lines, and a histogram of durations with fixed
//! buckets that any thread can observe without a lock.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the duration buckets, in seconds: from a loopback round trip to a block
/// interval gone badly wrong.
const BUCKETS_S: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// A histogram of durations.
#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS_S.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, duration: Duration) {
        let seconds = duration.as_secs_f64();
        if let Some(i) = BUCKETS_S.iter().position(|bound| seconds <= *bound) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// How many durations were observed so far, and their sum (to the microsecond): two
    /// readings give the mean of what came between them. The two are read one after the
    /// other, so a reading is exact only while nothing is being observed.
    pub fn totals(&self) -> (u64, Duration) {
        let sum = self.sum_micros.load(Ordering::Relaxed);
        (
            self.count.load(Ordering::Relaxed),
            Duration::from_micros(sum),
        )
    }
}

/// One exposition, metric by metric.
#[derive(Default)]
pub struct Exposition(String);

impl Exposition {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.head(name, "counter", help);
        let _ = writeln!(self.0, "{name} {value}");
        self
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.head(name, "gauge", help);
        let _ = writeln!(self.0, "{name} {value}");
        self
    }

    /// A counter with one label, one line per label value.
    pub fn labelled_counter<'a>(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        values: impl IntoIterator<Item = (&'a str, u64)>,
    ) -> &mut Self {
        self.head(name, "counter", help);
        for (value, count) in values {
            let _ = writeln!(self.0, "{name}{{{label}=\"{value}\"}} {count}");
        }
        self
    }

    pub fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) -> &mut Self {
        self.head(name, "histogram", help);
        let mut cumulative = 0;
        for (bound, bucket) in BUCKETS_S.iter().zip(&histogram.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(self.0, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = histogram.count.load(Ordering::Relaxed);
        let sum = histogram.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(self.0, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(self.0, "{name}_sum {sum}\n{name}_count {count}");
        self
    }

    pub fn text(&mut self) -> String {
        std::mem::take(&mut self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_is_cumulative_with_help_and_type_lines() {
        let histogram = Histogram::default();
        for ms in [0, 3, 3, 40, 20_000] {
            histogram.observe(Duration::from_millis(ms));
        }
        let text = Exposition::default()
            .counter("kvasir_things_total", "Things.", 7)
            .histogram("kvasir_wait_seconds", "Waits.", &histogram)
            .text();
        assert!(text.contains("# HELP kvasir_things_total Things.\n# TYPE kvasir_things_total counter\nkvasir_things_total 7\n"));
        assert!(text.contains("kvasir_wait_seconds_bucket{le=\"0.001\"} 1\n"));
        assert!(text.contains("kvasir_wait_seconds_bucket{le=\"0.005\"} 3\n"));
        assert!(text.contains("kvasir_wait_seconds_bucket{le=\"10\"} 4\n"));
        assert!(text.contains("kvasir_wait_seconds_bucket{le=\"+Inf\"} 5\n"));
        assert!(text.contains("kvasir_wait_seconds_count 5\n"));
        assert!(text.contains("kvasir_wait_seconds_sum 20.046\n"));
    }
}
