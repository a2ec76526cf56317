//! What the ledger and the dispatch protocol (`kvasir-wire`) share, beneath both: ed25519
//! keys and bech32 addresses (`keys`), blake3 hashes (`hash`), the intent prefix every
//! signature commits to (`intent`), a worker's signed answer (`answer`), and the one grammar
//! of expert selections (`selection`). A worker built on the wire compiles these and no
//! storage engine.

#![forbid(unsafe_code)]

pub mod answer;
pub mod codec;
pub mod hash;
pub mod intent;
pub mod keys;
pub mod selection;

pub use hash::Hash;
pub use keys::{Address, Keypair};
