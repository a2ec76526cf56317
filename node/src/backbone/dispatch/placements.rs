//! Dispatch follows the market: a backbone acting for an order sends an expert's rows only
//! to workers whose operator key holds a live placement of that expert under the order, as
//! the ledger says. A thread re-reads the order's live placements as blocks arrive; an
//! expert without a live placement (none yet, its placement closed, or the order paused or
//! closed) is computed locally, so the output never changes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvasir_api::Client;
use kvasir_ledger::market::Selection;
use kvasir_ledger::Address;

use crate::backbone::lock;

/// How often the order's placements are read again (about a block).
const REFRESH: Duration = Duration::from_millis(500);

/// The experts each operator is placed for under the order.
pub(super) type Placed = HashMap<Address, Vec<Selection>>;

/// Reads one order's live placements from one ledger.
pub struct Placements {
    ledger: Client,
    order: u64,
}

impl Placements {
    pub fn new(url: &str, order: u64) -> Placements {
        Placements {
            ledger: Client::new(url),
            order,
        }
    }

    /// The order's live placements, page by page; none while the order is paused (its
    /// escrow cannot pay the next block) or closed. An error leaves the last reading standing.
    fn read(&self) -> anyhow::Result<Placed> {
        let mut placed = Placed::new();
        let order = self.ledger.order(self.order)?;
        if order.state == "paused" || order.state == "closed" {
            return Ok(placed);
        }
        for placement in self.ledger.order_placements(self.order, true)? {
            let experts: Selection = placement
                .experts
                .parse()
                .map_err(|e| anyhow::anyhow!("placement {}: {e}", placement.id))?;
            placed.entry(placement.operator).or_default().push(experts);
        }
        Ok(placed)
    }

    /// Keeps `placed` to the order's live placements until its owner is gone.
    pub(super) fn follow(self, placed: Weak<Mutex<Placed>>) {
        let mut failing = false;
        while let Some(shared) = placed.upgrade() {
            match self.read() {
                Ok(now) => {
                    *lock(&shared) = now;
                    failing = false;
                }
                Err(e) if !failing => {
                    tracing::warn!("reading the placements of order {}: {e:#}", self.order);
                    failing = true;
                }
                Err(_) => {}
            }
            drop(shared);
            std::thread::sleep(REFRESH);
        }
    }
}

/// Whether `worker` is placed for `(layer, expert)` in `placed`.
pub(super) fn is_placed(placed: &Placed, worker: &Address, layer: u16, expert: u16) -> bool {
    placed
        .get(worker)
        .is_some_and(|selections| selections.iter().any(|s| s.contains((layer, expert))))
}

/// A fresh, empty reading to share with the follower thread.
pub(super) fn shared() -> Arc<Mutex<Placed>> {
    Arc::new(Mutex::new(Placed::new()))
}
