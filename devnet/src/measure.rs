//! The arithmetic of `kvasir-node bench dispatch`'s figures, apart from the runs that
//! measure them so that it is tested where the benches' other shared parts are (the node's
//! binary, where the benches live, has no test harness): a run's point, the mean between two
//! readings of a histogram, the round trips a remote step exposes, and how many
//! micro-batches cover a link's waits.

use std::time::Duration;

/// One number of concurrent streams, measured local and remote.
pub struct Point {
    pub streams: usize,
    pub micro_batches: usize,
    /// Aggregate tokens per second, all experts local and with the remote ones.
    pub local: f64,
    pub remote: f64,
    /// Mean seconds from sending a request to its answer over the timed steps of the best
    /// remote run, as the backbone measures it: the injected RTT, the relay path, the worker's
    /// queue and compute (the backbone reads an answer once it has computed its local
    /// experts, which with every expert of a layer remote is none). `None`: no request.
    pub round_trip: Option<f64>,
}

impl Point {
    pub fn remote_vs_local(&self) -> f64 {
        self.remote / self.local
    }
}

/// The mean duration (seconds) of what a histogram observed between two `totals` readings;
/// `None` if nothing was.
pub fn mean_between(before: (u64, Duration), after: (u64, Duration)) -> Option<f64> {
    let count = after.0.checked_sub(before.0).filter(|n| *n > 0)?;
    Some(after.1.saturating_sub(before.1).as_secs_f64() / count as f64)
}

/// The round trips one remote step exposes, `added / (link x layers)`, split in two: the
/// part its requests' round trips take beyond the injected `link` (relay path and worker),
/// and the rest, the step's own compute taking longer than all local (after a wait, caches
/// and idle CPUs are cold).
pub struct Exposed {
    pub total: f64,
    /// `None` when no request was timed.
    pub relay: Option<f64>,
}

impl Exposed {
    pub fn of(point: &Point, link: f64, remote_layers: usize) -> Exposed {
        let streams = point.streams as f64;
        let added = streams / point.remote - streams / point.local;
        let waits = link * remote_layers as f64;
        Exposed {
            total: added / waits,
            relay: point
                .round_trip
                .map(|round_trip| (round_trip - link) * remote_layers as f64 / waits),
        }
    }

    /// What the step's own compute adds, in round trips: the rest beyond the one per layer.
    pub fn compute(&self) -> Option<f64> {
        self.relay.map(|relay| self.total - 1.0 - relay)
    }
}

/// Most micro-batches `auto_micro_batches` picks.
pub const MAX_AUTO_MICRO_BATCHES: usize = 8;

/// Micro-batches for `streams` when not given. One micro-batch's step waits `link` at each
/// remote layer; while it waits the others compute, (m - 1)/m of a local step of
/// `local_step` seconds between them, which covers the waits when m is at least
/// `local_step / (local_step - waits)`. When no number can (the waits are longer than a
/// local step) or it is over the cap, the cap; never more than the streams.
pub fn auto_micro_batches(
    streams: usize,
    local_step: f64,
    link: f64,
    remote_layers: usize,
) -> usize {
    let waits = link * remote_layers as f64;
    let spare = local_step - waits;
    let covering = if spare > 0.0 {
        (local_step / spare).ceil() as usize
    } else {
        MAX_AUTO_MICRO_BATCHES
    };
    covering
        .clamp(1, MAX_AUTO_MICRO_BATCHES)
        .min(streams.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_cover_the_waits_within_the_cap_and_the_streams() {
        // 200 ms of compute a step, 6 layers at 13.5 ms: two cover (100 ms > 81 ms).
        assert_eq!(auto_micro_batches(256, 0.200, 0.0135, 6), 2);
        // 91 ms against 81 ms would need 10: the cap.
        assert_eq!(auto_micro_batches(256, 0.091, 0.0135, 6), 8);
        // Waits longer than a step: the cap, and never more than the streams.
        assert_eq!(auto_micro_batches(64, 0.027, 0.0135, 6), 8);
        assert_eq!(auto_micro_batches(3, 0.027, 0.0135, 6), 3);
        assert_eq!(auto_micro_batches(1, 0.002, 0.0135, 1), 1);
        // Nothing remote to wait for: one.
        assert_eq!(auto_micro_batches(256, 0.091, 0.0135, 0), 1);
    }

    #[test]
    fn exposed_round_trips_split_into_relay_and_compute() {
        // Two requests of 15 and 17 ms observed between the readings.
        let before = (3, Duration::from_millis(40));
        let after = (5, Duration::from_millis(72));
        assert!((mean_between(before, after).unwrap() - 0.016).abs() < 1e-12);
        // Nothing observed: no mean, not a mean of zero.
        assert_eq!(mean_between(after, after), None);
        // Local steps of 1 ms, remote of 16 ms, one remote layer at 13 ms with 14 ms round
        // trips: 15 ms added is 15/13 round trips, 1/13 of them in the relay.
        let point = Point {
            streams: 1,
            micro_batches: 1,
            local: 1000.0,
            remote: 62.5,
            round_trip: Some(0.014),
        };
        let exposed = Exposed::of(&point, 0.013, 1);
        assert!((exposed.total - 15.0 / 13.0).abs() < 1e-9);
        assert!((exposed.relay.unwrap() - 1.0 / 13.0).abs() < 1e-9);
        assert!((exposed.compute().unwrap() - 1.0 / 13.0).abs() < 1e-9);
        let untimed = Point {
            round_trip: None,
            ..point
        };
        assert_eq!(Exposed::of(&untimed, 0.013, 1).compute(), None);
    }
}
