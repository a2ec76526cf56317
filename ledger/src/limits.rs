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

/// The most bytes one pinned expert's weights may take (gate, up and down as stored). On a
/// format-2 chain evidence carries the disputed expert, so this bounds evidence on every
/// chain: a bf16 expert of a 4096-wide model with 2048-wide experts is 48 MiB, a quantized
/// one a quarter of that.
pub const MAX_PINNED_EXPERT_BYTES: u64 = 96 << 20;
/// The longest config.json an evidence transaction may carry with its expert.
pub const MAX_EXPERT_CONFIG_BYTES: usize = 64 << 10;
/// The longest Merkle path from an expert to its pin's root: 2^40 experts.
pub const MAX_EXPERT_PATH: usize = 40;
/// What an evidence transaction carrying an expert takes beyond the bodies and the weights.
/// (A kilobyte for the rest: addresses, ids, the model id, signatures, lengths, the fee bid.)
pub const EXPERT_PROOF_OVERHEAD: usize = MAX_EXPERT_CONFIG_BYTES + 32 * MAX_EXPERT_PATH + 1024;
/// The largest evidence transaction any chain takes from outside: the bodies, the largest
/// expert a pin may have and its proof. Each chain bounds its own by its largest pinned
/// expert (`Genesis::max_evidence_bytes`).
pub const MAX_EXPERT_EVIDENCE_TX_BYTES: usize =
    MAX_EVIDENCE_TX_BYTES + MAX_PINNED_EXPERT_BYTES as usize + EXPERT_PROOF_OVERHEAD;
