//! The Kvasir node's roles. Each role is a folder holding its private helpers: `hub` (relay,
//! registry, receipts), `gateway` (splice, proxy, crediting), `backbone` (`dispatch` to the
//! hub's workers, `serve` to users), `worker`, `ledger` (the ledger service and its REST API)
//! and `dev` (the whole swarm on loopback). One-shot commands (`genesis init`, `verify-chain`,
//! `model`, `generate`) are in `commands`. What the roles share here: accept loops that
//! strangers cannot stop (`listen`), model loading (`engine`), recomputed answers (`answers`),
//! bond checks (`bonds`), metrics and stop signals (`shutdown`).
//!
//! Beneath the roles, in crates of their own: the dispatch protocol, its link and TLS
//! (`kvasir-wire`), the dev chain and the process launcher (`kvasir-devnet`). The
//! `kvasir-node` binary is a thin command line over this library, and holds the benches.

#![forbid(unsafe_code)]
// Without its consensus engine (the fuzz targets' build) the ledger role cannot run, so its
// service and REST API are unused there.
#![cfg_attr(not(feature = "consensus"), allow(dead_code, unused_imports))]

pub mod answers;
pub mod backbone;
pub mod bonds;
pub mod commands;
pub mod dev;
pub mod engine;
pub mod expert_evidence;
pub mod gateway;
pub mod hub;
pub mod ledger;
pub mod listen;
pub mod metrics;
pub mod shutdown;
pub mod worker;
