//! Size and time limits that genesis, blocks and transactions all check, beneath the three.

/// The latest time a block (or genesis) may carry, 9999-12-31T23:59:59.999Z in ms since the
/// Unix epoch: beyond any real clock, it keeps `u64::MAX` out of a chain, whose times never
/// go back, so one such block would freeze the chain's clock for good.
pub const MAX_TIMESTAMP_MS: u64 = 253_402_300_799_999;

/// What a block takes beyond its transactions' bytes (header, signature, length prefixes),
/// counted generously so that a block filled to `max_block_bytes` never exceeds it.
pub const BLOCK_OVERHEAD_BYTES: u64 = 512;

/// Largest encoded transaction accepted from outside, but for evidence.
pub const MAX_TX_BYTES: usize = 2048;
/// Largest encoded evidence transaction: it quotes a whole dispatch request and its answer
/// (a 64-row step of a 2048-wide model, routed to 8 experts, is about 4.5 MiB).
pub const MAX_EVIDENCE_TX_BYTES: usize = 6 << 20;
