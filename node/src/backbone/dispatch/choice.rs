//! Which worker session serves an expert: the lowest-numbered session in the hub's directory
//! that holds it for this model, passing over sessions that recently failed (`shun`), keys
//! caught answering wrongly (`catch`), workers the ledger says may not serve (`with_bond_check`)
//! and, acting for an order, workers not placed for the expert (`with_placements`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvasir_ledger::keys::Address;
use kvasir_wire::spec::ExpertSpec;
use kvasir_wire::DirectoryEntry;

use super::hub_link::HubLink;
use super::placements::{self, Placed, Placements};
use crate::backbone::lock;
use crate::bonds::BondCheck;

/// How long a session that failed or gave an answer not usable is passed over: one that
/// always fails would otherwise keep its experts from the other sessions that hold them (the
/// lowest session is chosen), at the cost of a fallback each step; one that failed once,
/// honestly, is used again soon. A session that stalls (each stall costs a whole dispatch
/// timeout) is passed over while it lasts.
pub(super) const SHUN: Duration = Duration::from_secs(30);
/// How often the sessions in the directory are checked against the ledger: new ones within
/// this, and every one again every `RECHECK_EVERY` rounds (a key jailed or unbonded since).
const STANDING_INTERVAL: Duration = Duration::from_millis(200);
const RECHECK_EVERY: u32 = 50;

pub(super) struct Choice {
    /// The experts sent out at all; the rest are computed here.
    remote: ExpertSpec,
    model_id: String,
    /// Sessions passed over until the time given, or while they last (`None`): each failed
    /// an answer (`shun`).
    shunned: Mutex<HashMap<u64, Option<Instant>>>,
    /// Worker keys caught answering wrongly: none of their sessions is dispatched to again.
    caught: Mutex<HashSet<Address>>,
    /// With a bond check, the sessions whose worker the ledger says may serve (see
    /// `check_bonds`); without, every session may.
    standing: Option<Arc<Mutex<HashMap<u64, bool>>>>,
    /// Acting for an order: the experts each operator is placed for (see `placements`);
    /// without an order, every session may serve what it holds.
    placed: Option<Arc<Mutex<Placed>>>,
}

impl Choice {
    /// Sessions of `model_id` serve the `remote` experts, any session may.
    pub fn new(remote: ExpertSpec, model_id: String) -> Choice {
        Choice {
            remote,
            model_id,
            shunned: Mutex::new(HashMap::new()),
            caught: Mutex::new(HashSet::new()),
            standing: None,
            placed: None,
        }
    }

    /// The experts sent out at all.
    pub fn remote(&self) -> &ExpertSpec {
        &self.remote
    }

    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Only sessions whose worker `bonds` says may serve, as it judges the sessions of
    /// `link`'s directory (on a thread of its own; a session not yet checked is not chosen).
    pub fn with_bond_check(mut self, link: HubLink, bonds: BondCheck) -> Choice {
        let standing = Arc::new(Mutex::new(HashMap::new()));
        let weak = Arc::downgrade(&standing);
        std::thread::spawn(move || check_bonds(link, weak, bonds));
        self.standing = Some(standing);
        self
    }

    /// Only workers placed for the order `placements` reads (followed on a thread of its own;
    /// until the first reading, none is chosen).
    pub fn with_placements(mut self, placements: Placements) -> Choice {
        let placed = placements::shared();
        let weak = Arc::downgrade(&placed);
        std::thread::spawn(move || placements.follow(weak));
        self.placed = Some(placed);
        self
    }

    /// The live session that serves `(layer, expert)`, and its worker: the lowest-numbered
    /// one in `directory` that holds it and may be chosen.
    pub fn session_for(
        &self,
        directory: &[DirectoryEntry],
        layer: usize,
        expert: usize,
    ) -> Option<(u64, Address)> {
        if !self.remote.contains(layer, expert) {
            return None;
        }
        let shunned = lock(&self.shunned);
        let now = Instant::now();
        let passed_over = |session: &u64| {
            shunned
                .get(session)
                .is_some_and(|until| until.is_none_or(|until| now < until))
        };
        let caught = lock(&self.caught);
        let standing = self.standing.as_ref().map(|s| lock(s));
        let may_serve = |session: &u64| {
            standing
                .as_ref()
                .is_none_or(|s| s.get(session).copied().unwrap_or(false))
        };
        let placed = self.placed.as_ref().map(|p| lock(p));
        let (layer, expert) = (layer as u16, expert as u16);
        let is_placed = |worker: &Address| {
            placed
                .as_ref()
                .is_none_or(|p| placements::is_placed(p, worker, layer, expert))
        };
        directory
            .iter()
            .filter(|e| e.model_id == self.model_id && !passed_over(&e.session))
            .filter(|e| !caught.contains(&e.worker) && may_serve(&e.session))
            .filter(|e| e.experts.contains(&(layer, expert)) && is_placed(&e.worker))
            .map(|e| (e.session, e.worker))
            .min_by_key(|(session, _)| *session)
    }

    /// Passes `session` over for `time`, or while it lasts (`None`). Sessions whose time is
    /// up, and those not among `connected`, are forgotten here: the map holds no more than
    /// the sessions connected and those shunned within the last `SHUN`.
    pub fn shun(&self, session: u64, time: Option<Duration>, connected: &[(u64, Address)]) {
        let now = Instant::now();
        let connected: HashSet<u64> = connected.iter().map(|(session, _)| *session).collect();
        let mut shunned = lock(&self.shunned);
        shunned.retain(|session, until| match until {
            Some(until) => now < *until,
            None => connected.contains(session),
        });
        shunned.insert(session, time.map(|time| now + time));
        tracing::warn!("session {session} is passed over for {time:?} (None: while it lasts)");
    }

    /// Whether `session` is passed over now or later (for tests).
    #[cfg(test)]
    pub fn is_shunned(&self, session: u64) -> bool {
        lock(&self.shunned).contains_key(&session)
    }

    /// `session` is passed over no longer (for tests).
    #[cfg(test)]
    pub fn forgive(&self, session: u64) {
        lock(&self.shunned).remove(&session);
    }

    /// No session of `worker`'s key is chosen again: it was caught answering wrongly.
    pub fn catch(&self, worker: Address) {
        lock(&self.caught).insert(worker);
    }
}

/// Keeps `standing` to the directory's sessions as `bonds` judges their workers, until the
/// `Choice` that owns `standing` is gone.
fn check_bonds(link: HubLink, standing: Weak<Mutex<HashMap<u64, bool>>>, bonds: BondCheck) {
    let mut round = 0u32;
    loop {
        let Some(standing) = standing.upgrade() else {
            return;
        };
        let sessions = link.sessions();
        let recheck = round.is_multiple_of(RECHECK_EVERY);
        let known = lock(&standing).clone();
        let mut next = HashMap::with_capacity(sessions.len());
        for (session, worker) in sessions {
            let ok = match known.get(&session) {
                Some(ok) if !recheck => *ok,
                _ => match bonds.standing(&worker) {
                    Ok(()) => true,
                    Err(why) => {
                        if known.get(&session) != Some(&false) {
                            tracing::warn!("not dispatching to session {session}: {why}");
                        }
                        false
                    }
                },
            };
            next.insert(session, ok);
        }
        *lock(&standing) = next;
        drop(standing);
        round = round.wrapping_add(1);
        std::thread::sleep(STANDING_INTERVAL);
    }
}
