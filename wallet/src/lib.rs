//! The wallet's library. Key files, which it used to open, are the `kvasir-keyfile` crate's.

#![forbid(unsafe_code)]
