//! The Kvasir ledger: KVR amounts, ed25519 accounts, signed transactions with a three-stage
//! check, blocks hash-chained with blake3, an authenticated state root, and storage behind a
//! trait (sled on disk).
//!
//! Data flows one way: transactions pass `tx::check_stateless`, wait in the `mempool`, are
//! packed by `apply::produce_block`, and every node replays them with the pure
//! `apply::apply_block` before `store::Storage::commit` persists block and state atomically.

#![forbid(unsafe_code)]

pub mod amount;
pub mod apply;
pub mod block;
pub mod certificate;
mod error;
pub mod fees;
pub mod fraction;
pub mod genesis;
mod limits;
pub mod market;
pub mod mempool;
mod receipt;
pub mod state;
pub mod store;
mod tree;
pub mod tx;
pub mod verify;

// Shared with the dispatch protocol, beneath both (see `kvasir-primitives`); re-exported so
// that a path into the ledger names the same types.
pub use kvasir_primitives::{answer, hash, intent, keys};

pub use amount::{Amount, AmountError, BASE_UNITS_PER_KVR};
pub use apply::{
    apply_block, check_clock, produce_block, BlockError, Produced, MAX_CLOCK_DRIFT_MS,
};
pub use block::{Block, BlockHeader};
pub use certificate::{Certificate, CertificateError};
pub use genesis::Genesis;
pub use hash::Hash;
pub use keys::{Address, Keypair};
pub use state::{Account, ChangeSet, State};
pub use store::{MemoryStore, SledStore, Storage, StoreError};
pub use tx::{check_stateless, Receipt, SignedReceipt, SignedTx, Tx, TxError, TxKind, VerifiedTx};
pub use verify::{verify_chain, VerifyError, VerifyReport};
