//! The REST contract of Kvasir, in one place: every body the ledger API, the hub's registry
//! and the backbone take or give, and the `--json` reports of the command line, as serde types
//! with their OpenAPI schemas; and `Client`, the blocking client the wallet, the gateway's
//! crediting, `dev` and the test scenarios share. A renamed field is a compile error on both
//! sides, never a `null` read at run time.
//!
//! Amounts travel as base-unit strings next to their exact decimal (`AmountView`), hashes as
//! hex, addresses as `kvr1...` text; errors as `{error, message}` (`ErrorBody`).

#![forbid(unsafe_code)]

pub mod client;
pub mod generation;
pub mod ledger;
pub mod market;
mod object;
pub mod openai;
pub mod registry;
pub mod reports;
pub mod schema;

pub use client::{Client, ClientError};
pub use ledger::{AmountView, ErrorBody};
pub use object::Object;
