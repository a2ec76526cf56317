//! The dev chain and the process launcher, outside the roles: `kvasir-node dev`, its
//! benches and the test scenarios all make chains and start roles through here.
//!
//! - `chain`: a chain's files (genesis and role keys), fresh from a template or the
//!   published dev chain's, and the rule that keeps the dev chain off public addresses.
//! - `process`: one role as a child process, read line by line, stopped on drop.
//! - `roles`: each role's command line, written once.
//! - `loopback`: hub, gateway, validators and workers together on loopback.
//! - `funding`: funding and bonding worker keys before a hub admits them.
//! - `crash`: SIGKILL at random instants, for the stores' crash tests.
//! - `measure`: the arithmetic of the dispatch bench's figures.

#![forbid(unsafe_code)]

pub mod chain;
pub mod crash;
pub mod funding;
pub mod loopback;
pub mod measure;
pub mod process;
pub mod roles;

pub use loopback::Loopback;
pub use process::{current_exe, Mode, Process};
