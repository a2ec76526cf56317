//! The one-shot commands: `genesis init` (a fresh chain and its keys), `verify-chain` (replay
//! a stored chain), `model synth|pin|inspect` and `generate` (the engine on the command
//! line). Each runs, prints its result and exits; none keeps a service up. They may touch the ledger crate
//! (genesis, stores) and the engine, never a running role.

pub mod genesis;
mod inspect;
pub mod model;
pub mod verify;
