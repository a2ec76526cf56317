//! The wallet's library: a small client of the ledger REST API, shared by the `kvasir-wallet`
//! command line and by the gateway, which submits credits through it.

pub mod client;
pub mod keyfile;
