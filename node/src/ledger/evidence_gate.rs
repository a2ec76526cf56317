//! The line evidence waits in for its recomputation. Checking evidence means recomputing
//! experts (up to a second of a validator's cores), so one piece is recomputed at a time;
//! the others wait their turn in arrival order rather than bouncing off a lock, so a flood
//! of honest answers dressed up as evidence (refused, but only after the recomputation)
//! cannot keep real evidence out by winning every race for the lock.
//!
//! Bounds: at most one piece per reporting key is in line or being recomputed; the line
//! holds at most `capacity`; nobody waits longer than `patience`. Past any of these the
//! evidence is refused as busy, and its reporter submits it again. Evidence against a
//! worker already in line still queues: the worker itself, reporting its own honest
//! answers, cannot hold the one place that would shut out evidence against it.
//!
//! What this does not stop: reporting costs nothing, so a flood of honest answers from
//! enough throwaway keys keeps the line full, and real evidence then gets in only when a
//! place frees up (its reporter retries until the challenge window ends). A reporter
//! deposit, forfeit when evidence proves nothing, is the cure still to come.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvasir_ledger::Address;

pub struct EvidenceGate {
    line: Mutex<Line>,
    turn: Condvar,
    capacity: usize,
    patience: Duration,
}

#[derive(Default)]
struct Line {
    /// Tickets in arrival order, each with the key that reported it.
    waiting: VecDeque<(u64, Address)>,
    /// The reporter whose evidence is being recomputed.
    holder: Option<Address>,
    next_ticket: u64,
}

/// Why evidence could not take its turn.
#[derive(Debug, PartialEq, Eq)]
pub struct Busy;

/// The turn to recompute; the next in line goes when it is dropped.
pub struct Turn<'a> {
    gate: &'a EvidenceGate,
}

impl EvidenceGate {
    pub fn new(capacity: usize, patience: Duration) -> EvidenceGate {
        EvidenceGate {
            line: Mutex::default(),
            turn: Condvar::new(),
            capacity,
            patience,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for the turn of evidence reported by `reporter`.
    pub fn enter(&self, reporter: Address) -> Result<Turn<'_>, Busy> {
        let mut line = self.lock();
        let named = |(_, r): &(u64, Address)| *r == reporter;
        if line.holder == Some(reporter)
            || line.waiting.iter().any(named)
            || line.waiting.len() >= self.capacity
        {
            return Err(Busy);
        }
        let ticket = line.next_ticket;
        line.next_ticket += 1;
        line.waiting.push_back((ticket, reporter));
        let deadline = Instant::now() + self.patience;
        loop {
            if line.holder.is_none() && line.waiting.front().map(|(t, _)| *t) == Some(ticket) {
                line.waiting.pop_front();
                line.holder = Some(reporter);
                return Ok(Turn { gate: self });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                line.waiting.retain(|(t, _)| *t != ticket);
                // The one behind may be first now.
                self.turn.notify_all();
                return Err(Busy);
            }
            line = self
                .turn
                .wait_timeout(line, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.gate.lock().holder = None;
        self.gate.turn.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_ledger::Keypair;
    use std::sync::Arc;

    fn reporter(i: u8) -> Address {
        Keypair::from_seed(&[i; 32]).address()
    }

    #[test]
    fn evidence_takes_its_turn_in_arrival_order() {
        let gate = Arc::new(EvidenceGate::new(8, Duration::from_secs(30)));
        let first = gate.enter(reporter(1)).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let waiters: Vec<_> = (2..5)
            .map(|i| {
                let (line, order) = (gate.clone(), order.clone());
                let waiter = std::thread::spawn(move || {
                    let _turn = line.enter(reporter(i)).unwrap();
                    order.lock().unwrap().push(i);
                });
                // In line before the next one comes.
                while gate.lock().waiting.len() < usize::from(i - 1) {
                    std::thread::yield_now();
                }
                waiter
            })
            .collect();
        drop(first);
        for waiter in waiters {
            waiter.join().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![2, 3, 4]);
    }

    #[test]
    fn one_place_per_reporter_a_bounded_line_and_bounded_patience() {
        let gate = EvidenceGate::new(1, Duration::from_millis(50));
        let turn = gate.enter(reporter(1)).unwrap();
        // The same reporter again, while its evidence is recomputed: refused at once.
        assert!(matches!(gate.enter(reporter(1)), Err(Busy)));
        std::thread::scope(|s| {
            let waiting = s.spawn(|| gate.enter(reporter(2)).map(|_| ()));
            while gate.lock().waiting.is_empty() {
                std::thread::yield_now();
            }
            // The line is full, and a reporter already in it has no second place.
            assert!(matches!(gate.enter(reporter(3)), Err(Busy)));
            assert!(matches!(gate.enter(reporter(2)), Err(Busy)));
            // Never its turn within its patience: it leaves the line.
            assert_eq!(waiting.join().unwrap(), Err(Busy));
        });
        assert!(gate.lock().waiting.is_empty());
        drop(turn);
        drop(gate.enter(reporter(3)).unwrap());
        assert!(gate.lock().holder.is_none());
    }
}
