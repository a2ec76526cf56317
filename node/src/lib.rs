//! The Kvasir node: one module per role (`worker`, `gateway`, `hub`, `backbone`, `dev`), the
//! dispatch protocol (`wire`) they share, and the benchmarks. The `kvasir-node` binary is a
//! thin command line over this library; the scenarios in `tests/` use `wire` and `link` to
//! play misbehaving peers against the real processes.

pub mod api;
pub mod backbone;
pub mod bench;
pub mod crediting;
pub mod dev;
pub mod gateway;
pub mod genesis;
pub mod hub;
pub mod launch;
pub mod ledger;
pub mod link;
pub mod model;
pub mod registry;
pub mod shutdown;
pub mod spec;
pub mod tls;
pub mod verify;
pub mod wire;
pub mod worker;
