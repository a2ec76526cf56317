//! A dishonest worker, for tests and the demo only: it computes the right answer, then on a
//! given fraction of its answers signs a wrong one instead, so that audits, evidence and
//! slashing can be seen to work against a real process. Enabled only by hidden flags
//! (`--dishonest-fraction`, `--dishonest-kind`) that `--help` does not list and that print
//! a warning at start, so no operator turns it on by accident.

use std::sync::atomic::{AtomicU64, Ordering};

use kvasir_inference::moe::{ExpertError, ExpertExecutor, ExpertRequest};

/// How a lie is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lie {
    /// Every partial value zero: the cheapest answer, paid as if computed.
    Zeros,
    /// One bit of one value flipped: the smallest possible lie.
    Flip,
    /// Another expert's output (or, for a one-expert request, another row's).
    Swap,
}

/// Lies on exactly `fraction` of its answers, evenly spread (at 0.01, the 100th, the 200th,
/// …): the audits are what is random, so a test knows how many answers a catch takes.
pub struct Liar {
    fraction: f64,
    lie: Lie,
    answers: AtomicU64,
}

impl Liar {
    pub fn new(fraction: f64, lie: Lie) -> Liar {
        Liar {
            fraction: fraction.clamp(0.0, 1.0),
            lie,
            answers: AtomicU64::new(0),
        }
    }

    /// Whether answer number `n` (from 1) is a lie: when `n * fraction` reaches a new whole.
    fn lies_on(&self, n: u64) -> bool {
        let whole = |n: u64| (n as f64 * self.fraction).floor() as u64;
        whole(n) > whole(n - 1)
    }

    /// Maybe corrupts `partials` (one vector per expert of a request, `hidden` values per
    /// listed row); whether it did.
    pub fn corrupt(&self, partials: &mut [Vec<f32>], hidden: usize) -> bool {
        let n = self.answers.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.lies_on(n) || partials.iter().all(Vec::is_empty) {
            return false;
        }
        match self.lie {
            Lie::Zeros => partials.iter_mut().for_each(|p| p.fill(0.0)),
            Lie::Flip => flip(partials),
            Lie::Swap => swap(partials, hidden),
        }
        true
    }
}

/// Honest experts behind a liar: what a dishonest worker answers with, through the same
/// `kvasir_wire::answer` as an honest one.
pub struct Lying {
    pub honest: Box<dyn ExpertExecutor + Send>,
    pub liar: Liar,
    /// Values per row, for `Lie::Swap`.
    pub hidden: usize,
}

impl ExpertExecutor for Lying {
    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.honest.holds(layer, expert)
    }

    fn evaluate(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let mut partials = self.honest.evaluate(layer, requests)?;
        if self.liar.corrupt(&mut partials, self.hidden) {
            tracing::debug!("lying on an answer of layer {layer}");
        }
        Ok(partials)
    }
}

fn flip(partials: &mut [Vec<f32>]) {
    if let Some(value) = partials.iter_mut().find_map(|p| p.first_mut()) {
        *value = f32::from_bits(value.to_bits() ^ 1);
    }
}

/// Gives the first expert the next one's output when they are the same size; otherwise
/// rotates the first expert's rows; a single row of a single expert gets a flipped bit.
fn swap(partials: &mut [Vec<f32>], hidden: usize) {
    if let Some(i) = (1..partials.len()).find(|&i| partials[i].len() == partials[0].len()) {
        let other = partials[i].clone();
        if other != partials[0] {
            partials[0] = other;
            return;
        }
    }
    let first = &mut partials[0];
    if hidden > 0 && first.len() >= 2 * hidden {
        first.rotate_left(hidden);
        return;
    }
    flip(partials);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lie_changes_the_answer_and_honesty_changes_nothing() {
        let answer = vec![vec![1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0, 7.0, 8.0]];
        for lie in [Lie::Zeros, Lie::Flip, Lie::Swap] {
            let mut told = answer.clone();
            assert!(Liar::new(1.0, lie).corrupt(&mut told, 2));
            assert_ne!(told, answer, "{lie:?}");
        }
        let mut one = vec![vec![1.0, 2.0]];
        assert!(Liar::new(1.0, Lie::Swap).corrupt(&mut one, 2));
        assert_ne!(one, vec![vec![1.0, 2.0]]);
        let mut told = answer.clone();
        assert!(!Liar::new(0.0, Lie::Zeros).corrupt(&mut told, 2));
        assert_eq!(told, answer);
    }

    #[test]
    fn a_liar_lies_on_exactly_its_fraction() {
        for (fraction, first, count) in [(0.01, 100, 10), (0.1, 10, 100), (1.0, 1, 1000)] {
            let liar = Liar::new(fraction, Lie::Flip);
            let lies: Vec<u64> = (1..=1000).filter(|n| liar.lies_on(*n)).collect();
            assert_eq!((lies[0], lies.len()), (first, count), "{fraction}");
        }
    }
}
