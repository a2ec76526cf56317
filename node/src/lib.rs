//! The Kvasir node. Each role is a folder holding its private helpers: `hub` (relay,
//! registry, receipts), `gateway` (splice, proxy, crediting), `backbone` (hub link, network
//! executor, HTTP serving), `worker`, `ledger` (the ledger service and its REST API) and `dev`
//! (the whole swarm on loopback). One-shot commands (`genesis init`, `verify-chain`, `model`,
//! `generate`) are in `commands`; `bench` measures the hot paths. What the roles share: the
//! dispatch protocol (`wire`), WebSocket links carrying it (`link`), accept loops that strangers
//! cannot stop (`listen`), TLS (`tls`), model loading
//! (`engine`), expert selections (`spec`) and stop signals (`shutdown`). The `kvasir-node`
//! binary is a thin command line over this library; the scenarios in `tests/` use `wire` and
//! `link` to play misbehaving peers against the real processes.

// No unsafe code in the production build; the `bench-reference` build allows it in its one
// call into the `gemm` crate (`bench::decode`).
#![cfg_attr(not(feature = "bench-reference"), forbid(unsafe_code))]
#![cfg_attr(feature = "bench-reference", deny(unsafe_code))]
// Without its consensus engine (the fuzz targets' build) the ledger role cannot run, so its
// service and REST API are unused there.
#![cfg_attr(not(feature = "consensus"), allow(dead_code, unused_imports))]

pub mod answers;
pub mod backbone;
pub mod bench;
pub mod bonds;
pub mod commands;
pub mod dev;
pub mod engine;
pub mod gateway;
pub mod hub;
pub mod ledger;
pub mod link;
pub mod listen;
pub mod metrics;
pub mod shutdown;
pub mod spec;
pub mod tls;
pub mod wire;
pub mod worker;
