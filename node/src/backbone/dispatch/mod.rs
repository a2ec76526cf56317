//! Experts dispatched to workers through the hub: the network executor (`remote`), which asks
//! the worker that `choice` picks over the hub link (`hub_link`), checks the signed answer,
//! falls back to local weights, audits a sample (`audit`) and follows the order's placements
//! (`placements`); `provable` keeps each request small enough to be quoted as evidence.

mod audit;
mod choice;
mod hub_link;
mod placements;
mod provable;
mod remote;

pub use audit::{Auditor, Reporting};
pub use placements::Placements;
pub use remote::{RemoteExperts, SignedAnswer};
