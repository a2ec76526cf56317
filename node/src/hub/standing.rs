//! Keeping connected workers to the rule they were admitted by: a key serves only while the
//! ledger says it has at least `min_bond` bonded and is not jailed. The hello checks it once
//! (`bonds::BondCheck`); a key that unbonds below it or is jailed for a wrong answer while
//! connected would otherwise go on serving and being metered. So a thread asks the ledger
//! again, every `--bond-recheck-ms`, once per distinct connected key (never under the links
//! lock: the requests block), and every session of a key that is refused is expelled
//! (`Hub::expel`): out of the directory as if it had disconnected, told why. The backbone of
//! a market order is held to its order the same way: once the order closes it is dropped
//! (`Hub::recheck_order`).
//!
//! A key whose standing cannot be read (the ledger unreachable, `Refused::Unknown`) is kept
//! while its standing was last confirmed within `UNKNOWN_GRACE`: a ledger restart or a
//! network blip must not drop the whole swarm at once, and new hellos are still refused
//! meanwhile, so no unbonded key gets in. Past the grace it is expelled with that reason,
//! because a key that unbonded or was convicted during a long outage must not keep serving
//! unchecked; it is admitted again at its next hello once the ledger answers.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kvasir_ledger::Address;

use super::Hub;
use crate::bonds::{BondCheck, Refused};

/// How often connected keys are re-checked unless `--bond-recheck-ms` says otherwise: a key
/// convicted or unbonded serves at most about this long after the ledger commits it, and the
/// ledger gets one account read per connected key in that time.
pub(super) const DEFAULT_RECHECK_MS: u64 = 2_000;
/// How long a connected key whose standing cannot be read keeps serving.
const UNKNOWN_GRACE: Duration = Duration::from_secs(30);

/// When each connected key's standing was last confirmed. Only connected keys are kept (each
/// round forgets the others), so it is bounded by the sessions.
#[derive(Default)]
struct Confirmed(HashMap<Address, Instant>);

impl Confirmed {
    /// Which of `sessions` (session, key) to expel and why, given each key's standing as the
    /// ledger gave it this round, at `now`. A key not seen before counts as confirmed now: it
    /// was, at its hello, within the last round.
    fn judge(
        &mut self,
        sessions: &[(u64, Address)],
        standing: &HashMap<Address, Result<(), Refused>>,
        now: Instant,
    ) -> Vec<(u64, Refused)> {
        let connected: BTreeSet<Address> = sessions.iter().map(|(_, key)| *key).collect();
        self.0.retain(|key, _| connected.contains(key));
        for key in connected {
            let confirmed = self.0.entry(key).or_insert(now);
            if matches!(standing.get(&key), Some(Ok(()))) {
                *confirmed = now;
            }
        }
        let refused = |key: &Address| match standing.get(key)? {
            Ok(()) => None,
            Err(Refused::Unknown { .. })
                if self
                    .0
                    .get(key)
                    .is_some_and(|at| now.saturating_duration_since(*at) <= UNKNOWN_GRACE) =>
            {
                None
            }
            Err(why) => Some(why.clone()),
        };
        sessions
            .iter()
            .filter_map(|(session, key)| Some((*session, refused(key)?)))
            .collect()
    }
}

impl Hub {
    /// Re-checks every connected key against `bonds` every `every`, for ever: the standing
    /// thread's body.
    pub(super) fn watch_standing(&self, bonds: &BondCheck, every: Duration) {
        let mut confirmed = Confirmed::default();
        loop {
            std::thread::sleep(every);
            let sessions = self.links().sessions();
            // One request per key, however many sessions it holds, outside the lock.
            let keys: BTreeSet<Address> = sessions.iter().map(|(_, key)| *key).collect();
            let standing = keys
                .into_iter()
                .map(|key| (key, bonds.standing(&key)))
                .collect();
            for (session, why) in confirmed.judge(&sessions, &standing, Instant::now()) {
                let message = why.to_string();
                if self.expel(session, why) {
                    tracing::warn!(session, "worker dropped: {message}");
                }
            }
            self.recheck_order();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_ledger::{Amount, Keypair};

    fn unbonded(key: Address) -> Refused {
        Refused::Unbonded {
            key,
            bonded: Amount::ZERO,
            min_bond: Amount::from_base_units(10),
        }
    }

    fn unknown(key: Address) -> Refused {
        Refused::Unknown {
            key,
            reason: "connection refused".into(),
        }
    }

    #[test]
    fn every_session_of_an_unbonded_or_jailed_key_is_expelled_and_only_those() {
        let [good, poor, convict] = [(); 3].map(|()| Keypair::generate().address());
        let sessions = [(1, good), (2, poor), (3, convict), (4, poor), (5, good)];
        let jailed = Refused::Jailed {
            key: convict,
            until: 90,
        };
        let standing = HashMap::from([
            (good, Ok(())),
            (poor, Err(unbonded(poor))),
            (convict, Err(jailed.clone())),
        ]);
        let expelled = Confirmed::default().judge(&sessions, &standing, Instant::now());
        assert_eq!(
            expelled,
            vec![(2, unbonded(poor)), (3, jailed), (4, unbonded(poor))]
        );
    }

    #[test]
    fn an_unreadable_standing_is_tolerated_for_the_grace_then_expelled() {
        let [steady, newcomer] = [(); 2].map(|()| Keypair::generate().address());
        let mut confirmed = Confirmed::default();
        let start = Instant::now();
        let ok = HashMap::from([(steady, Ok(()))]);
        assert!(confirmed.judge(&[(1, steady)], &ok, start).is_empty());
        // The ledger goes quiet; a key that arrives meanwhile was confirmed at its hello.
        let sessions = [(1, steady), (2, newcomer)];
        let quiet = |at: Duration| {
            let standing = HashMap::from([
                (steady, Err(unknown(steady))),
                (newcomer, Err(unknown(newcomer))),
            ]);
            (standing, start + at)
        };
        let (standing, at) = quiet(Duration::from_secs(10));
        assert!(confirmed.judge(&sessions, &standing, at).is_empty());
        let (standing, at) = quiet(UNKNOWN_GRACE + Duration::from_secs(1));
        assert_eq!(
            confirmed.judge(&sessions, &standing, at),
            vec![(1, unknown(steady))]
        );
        let (standing, at) = quiet(UNKNOWN_GRACE + Duration::from_secs(11));
        assert_eq!(
            confirmed.judge(&sessions[1..], &standing, at),
            vec![(2, unknown(newcomer))]
        );
    }

    #[test]
    fn a_confirmation_renews_the_grace_and_keys_that_left_are_forgotten() {
        let [steady, gone] = [(); 2].map(|()| Keypair::generate().address());
        let mut confirmed = Confirmed::default();
        let start = Instant::now();
        let ok = HashMap::from([(steady, Ok(())), (gone, Ok(()))]);
        confirmed.judge(&[(1, steady), (2, gone)], &ok, start);
        let later = start + UNKNOWN_GRACE;
        confirmed.judge(&[(1, steady)], &ok, later);
        assert_eq!(confirmed.0.len(), 1, "a key no longer connected is kept");
        let quiet = HashMap::from([(steady, Err(unknown(steady)))]);
        let within = later + UNKNOWN_GRACE;
        assert!(confirmed.judge(&[(1, steady)], &quiet, within).is_empty());
    }
}
