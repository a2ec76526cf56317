//! The `--json` reports of the command line: one object on stdout, read by scripts and by
//! the test scenarios.

use std::path::PathBuf;

use kvasir_ledger::{Address, Amount, Hash};
use serde::{Deserialize, Serialize};

use crate::ledger::{AccountView, AmountView};

/// `kvasir-node genesis init --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenesisReport {
    /// What signatures on the chain commit to: its name and genesis hash, `NAME:HASH`.
    pub chain_id: String,
    pub genesis_hash: Hash,
    pub genesis: PathBuf,
    pub keys: Vec<PathBuf>,
}

/// `kvasir-node verify-chain --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    pub ok: bool,
    pub blocks: u64,
    pub transactions: u64,
    pub head_hash: Hash,
    pub state_root: Hash,
}

/// `kvasir-node dev --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevReport {
    pub tokens_identical: usize,
    pub logits_identical: bool,
    /// Requests the backbone sent to workers, and how many of them fell back to local.
    pub remote_requests: u64,
    pub fallbacks: u64,
    pub sessions: Vec<MeteredSession>,
    pub workers: Vec<DevWorker>,
    /// The ledger API's base URL.
    pub ledger: String,
    /// Remote answers the backbone recomputed, and how many of them were wrong.
    pub audits: u64,
    pub mismatches: u64,
    /// The workers caught answering wrongly, as the ledger judged the evidence.
    pub caught: Vec<DevCaught>,
    /// The order the backbone acted for, which paid the workers.
    pub market: DevMarket,
    /// Where the swarm runs: what a script needs to drive it while `dev --serve` keeps it up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swarm: Option<DevSwarm>,
}

/// The addresses and files of `dev`'s swarm.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevSwarm {
    /// The hub's backbone and worker listener, and its registry (`HOST:PORT`).
    pub hub: String,
    pub registry: String,
    /// The gateway's TLS listener (`HOST:PORT`), whose certificate is `ca`.
    pub gateway: String,
    pub ca: PathBuf,
    /// The chain's directory (genesis.json, keys/), the served model's checkpoint and the
    /// backbone's key.
    pub chain: PathBuf,
    pub model: PathBuf,
    pub backbone_key: PathBuf,
}

/// `dev`'s order as the generation left it (before dev closes it), its placements, and the
/// escrow it started with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevMarket {
    pub escrow_before: AmountView,
    pub order: crate::market::OrderView,
    pub placements: Vec<crate::market::PlacementView>,
}

/// A worker caught by an audit, and what the committed evidence did to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevCaught {
    pub address: Address,
    pub session_id: u64,
    pub request_id: u64,
    /// The session's pending rewards, returned to the rewards pool.
    pub cancelled: AmountView,
    /// Taken from its bond.
    pub slashed: AmountView,
    pub jailed_until: u64,
}

/// A session's metered bytes, as the hub's registry counted them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeteredSession {
    pub session_id: u64,
    /// The market order it was metered for (zero: none).
    #[serde(default)]
    pub order: u64,
    pub worker: Address,
    pub cumulative_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevWorker {
    pub address: Address,
    pub keyfile: PathBuf,
    pub relayed_bytes: u64,
    pub account: AccountView,
}

/// `kvasir-wallet new --json`, `kvasir-wallet address --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressReport {
    pub address: Address,
    pub keyfile: PathBuf,
}

/// What a signed transaction pays (`kvasir_ledger::fees`), as the wallet quoted it before
/// signing: its price at the base fee then and its tip, and the most its bid lets it pay if
/// the base fee rises before it is included.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeeReport {
    /// Its encoding's bytes, what it pays per.
    pub bytes: u64,
    /// Its price at the quoted base fee: burned.
    pub burned: Amount,
    /// Its tip: to the proposer.
    pub tip: Amount,
    /// The most it pays.
    pub at_most: Amount,
}

/// `kvasir-wallet transfer --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferReport {
    pub hash: Hash,
    pub height: u64,
    pub to: Address,
    pub amount: Amount,
    /// What it paid in fees; absent on a chain without fees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fee: Option<FeeReport>,
}

/// `kvasir-wallet bond --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BondReport {
    pub hash: Hash,
    pub height: u64,
    pub amount: Amount,
    /// What it paid in fees; absent on a chain without fees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fee: Option<FeeReport>,
}

/// `kvasir-wallet unbond --json`: `amount` returns to the balance at `release_height`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnbondReport {
    pub hash: Hash,
    pub height: u64,
    pub amount: Amount,
    pub release_height: u64,
    /// What it paid in fees; absent on a chain without fees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fee: Option<FeeReport>,
}

/// `kvasir-wallet offer|order …` that signs a transaction, `--json`: the transaction, the
/// height it was committed at, and the offer or order as it stands after it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarketTxReport {
    pub hash: Hash,
    pub height: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offer: Option<crate::market::OfferView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<crate::market::OrderView>,
    /// What it paid in fees; absent on a chain without fees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fee: Option<FeeReport>,
}

/// `kvasir-wallet order show --json`: the order and every placement it has had.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderReport {
    pub order: crate::market::OrderView,
    pub placements: Vec<crate::market::PlacementView>,
}

/// `kvasir-node bench flood --json`: the fee market under a flood (`bench flood --help`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FloodReport {
    pub seconds: u64,
    pub keys: usize,
    /// The flood's transfers the ledger admitted, and those it refused.
    pub flood_admitted: u64,
    pub flood_refused: u64,
    /// The gateway's crediting rounds during the flood, and the share of them that committed
    /// every credit they made.
    pub credit_rounds: u64,
    pub credit_rounds_committed: f64,
    /// For each piece of evidence reported during the flood, the blocks from the head it was
    /// admitted at to its block.
    pub evidence_blocks: Vec<u64>,
    /// The same for each honest transfer that tipped what the ledger suggested.
    pub honest_transfer_blocks: Vec<u64>,
    /// What the flood cost its keys (fees, burned and tipped), per minute, window by window.
    pub attacker_cost_kvr_per_min: Vec<Amount>,
    /// The base fee per byte before the flood, and the highest quoted during it.
    pub base_fee_start: Amount,
    pub base_fee_peak: Amount,
}

/// `kvasir-node model inspect --json`: what an operator reads before offering capacity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    /// The id the swarm and the market know the checkpoint by.
    pub model_id: String,
    /// `model_type` of config.json (`qwen3_moe`, `qwen2_moe`), or of its text model
    /// (`qwen3_5_moe_text`).
    pub family: String,
    pub layers: usize,
    /// Layers whose token mixer is a gated DeltaNet (linear attention, Qwen3.5); the others
    /// are full attention.
    #[serde(default)]
    pub linear_attention_layers: Vec<usize>,
    /// Layers routing to experts; the others are dense.
    pub moe_layers: Vec<usize>,
    pub experts_per_layer: usize,
    pub experts_per_token: usize,
    /// Every expert of every MoE layer.
    pub experts: usize,
    /// Stored bytes of one expert (gate, up and down), the largest if they differ.
    pub bytes_per_expert: u64,
    pub expert_bytes: u64,
    /// Bytes of the text model, what the engine loads.
    pub total_bytes: u64,
    /// Bytes the checkpoint holds beside the text model, which the engine leaves out (a
    /// multimodal checkpoint's vision tower, a multi-token-prediction head).
    #[serde(default)]
    pub skipped_bytes: u64,
    /// `expert_bytes / total_bytes`: how much of the model workers can hold.
    pub expert_share: f64,
    /// With `--experts`: the selection, how many experts it names, and their bytes (what a
    /// worker serving it holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<SliceReport>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceReport {
    pub experts: String,
    pub count: usize,
    pub bytes: u64,
}
