//! Genesis: the chain's parameters, initial allocations and authorities. The genesis hash is
//! blake3 over the canonical borsh encoding, so the same file gives the same hash anywhere,
//! whatever its JSON whitespace or key order.
//!
//! Parameters added after the first chains were published (`min_new_account`, the bond and
//! slashing parameters, `models`) are optional:
//! absent from a genesis file they take a default that changes nothing, and only a value set
//! away from that default enters the hash (appended after everything else), so every genesis
//! written before them keeps its hash.

use std::collections::BTreeSet;
use std::path::Path;

use borsh::BorshSerialize;
use serde::{Deserialize, Serialize};

use crate::amount::Amount;
use crate::fees::FeeParams;
use crate::fraction::Fraction;
use crate::hash::Hash;
use crate::keys::Address;
use crate::limits::{
    BLOCK_OVERHEAD_BYTES, EXPERT_PROOF_OVERHEAD, MAX_EVIDENCE_TX_BYTES, MAX_PINNED_EXPERT_BYTES,
    MAX_TIMESTAMP_MS, MAX_TX_BYTES,
};

/// Longest accepted chain id, in bytes.
pub const MAX_CHAIN_ID_LEN: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct Genesis {
    /// Milliseconds since the Unix epoch; the timestamp of block 0.
    pub genesis_time_ms: u64,
    pub params: ChainParams,
    pub allocations: Vec<Allocation>,
    pub authorities: Authorities,
    /// The models whose answers evidence can be checked against: a validator recomputes a
    /// disputed answer with one of these, and evidence naming any other is refused. Empty
    /// (the default): this chain accepts no evidence.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[borsh(skip)]
    pub models: Vec<ModelPin>,
}

/// A model pinned by its identity: the id the swarm uses, the blake3 of its config.json,
/// and a root over the hashes of every expert's weights (layer-major, ascending expert),
/// so a validator can check that the checkpoint it recomputes with is this one. On a
/// format-2 chain it also carries what the market and later work need without the model:
/// a short name, the model's shape and the reference arithmetic's version (a pin of a
/// format-1 chain has none of them, and keeps its encoding).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPin {
    pub id: String,
    pub config_hash: Hash,
    pub experts_root: Hash,
    /// What offers and orders may name the model by instead of its id (`small`,
    /// `qwen35-122b`): 1..=32 characters of [a-z0-9.-], unique among the chain's names and ids.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[borsh(skip)]
    pub name: String,
    /// Its layers and experts per layer: an offer's or order's selection must lie within.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[borsh(skip)]
    pub shape: Option<ModelShape>,
    /// The version of the reference arithmetic its answers are recomputed by
    /// (`kvasir_inference::ARITHMETIC_VERSION` when it was pinned).
    #[serde(default, skip_serializing_if = "is_zero")]
    #[borsh(skip)]
    pub arithmetic: u32,
}

impl ModelPin {
    /// Whether `other` pins the same checkpoint: the same id, config and expert weights,
    /// whatever either calls it.
    pub fn same_weights(&self, other: &ModelPin) -> bool {
        (&self.id, self.config_hash, self.experts_root)
            == (&other.id, other.config_hash, other.experts_root)
    }
}

/// A model's shape, as far as expert selections go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    /// Layers, dense ones included (a selection names layers by their index in the model).
    pub layers: u16,
    /// Experts in each MoE layer.
    pub experts: u16,
    /// The bytes of its largest expert's weights as stored (gate, up and down): what bounds
    /// the evidence this chain takes, which carries one expert (at most
    /// `MAX_PINNED_EXPERT_BYTES`).
    pub expert_bytes: u64,
}

/// Longest short name of a pinned model.
pub const MAX_MODEL_NAME_LEN: usize = 32;

/// The rules of a chain, as a template for new chains also carries them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct ChainParams {
    /// The chain's name. Signatures commit to `Genesis::chain_id`, which on a format-2 chain
    /// adds the genesis hash to it.
    pub chain_id: String,
    /// The chain's format: 1 for the chains made before format 2 (a genesis without
    /// `format`), 2 for every new one. On a format-2 chain every signature commits to the
    /// genesis hash too (`Genesis::chain_id`), so that no two chains share a signature
    /// however alike their names.
    #[serde(default = "format_1", skip_serializing_if = "is_format_1")]
    #[borsh(skip)]
    pub format: u8,
    /// Bytes of metered dispatch traffic in one reward unit.
    pub unit_bytes: u64,
    /// KVR paid per unit of metered traffic.
    pub reward_per_unit: Amount,
    /// Blocks a credit stays pending before it settles into the spendable balance.
    pub challenge_window: u64,
    pub block_interval_ms: u64,
    pub max_block_txs: u32,
    pub max_block_bytes: u64,
    /// Initial balance of the rewards pool that credits are paid from.
    pub rewards_pool: Amount,
    /// The smallest transfer that may create an account, so that dust cannot grow the state
    /// without bound. Zero (the default, and what a genesis without it means): no minimum.
    /// Hashed apart from the fields above (see `Genesis::hash`).
    #[serde(default, skip_serializing_if = "is_zero")]
    #[borsh(skip)]
    pub min_new_account: Amount,
    /// What a worker's key must have bonded for the hub to admit it and the backbone to
    /// dispatch to it. Zero (the default): no bond is asked, and Bond is refused.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[borsh(skip)]
    pub min_bond: Amount,
    /// Blocks an unbonded amount stays slashable before it is spendable again; longer than
    /// the challenge window, so a worker cannot unbond before its last answers can be judged.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[borsh(skip)]
    pub unbonding_blocks: u64,
    /// The share of a worker's bond (bonded and unbonding) that accepted evidence takes.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[borsh(skip)]
    pub slash_fraction: Fraction,
    /// The share of a slashed amount paid to whoever reported the evidence; the rest is burned.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[borsh(skip)]
    pub reporter_share: Fraction,
    /// Blocks a convicted key is barred from serving and from being paid.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[borsh(skip)]
    pub jail_blocks: u64,
    /// What transactions pay (`fees`): set on every format-2 chain, never on a format-1 one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[borsh(skip)]
    pub fees: Option<FeeParams>,
}

/// A chain's name: 1..=`MAX_CHAIN_ID_LEN` characters of [a-z0-9-].
pub fn check_chain_name(name: &str) -> Result<(), GenesisError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_CHAIN_ID_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(GenesisError::BadChainId)
    }
}

/// The format a genesis without `format` has: the one chains were made with before format 2.
fn format_1() -> u8 {
    1
}

fn is_format_1(format: &u8) -> bool {
    *format == 1
}

/// The newest chain format, what every new chain is made with.
pub const FORMAT: u8 = 2;

/// A later parameter left at zero is left out of the file, as it is of the hash.
fn is_zero<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    pub address: Address,
    pub amount: Amount,
}

/// Which keys may act in which role.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct Authorities {
    /// May propose blocks.
    pub validators: Vec<Address>,
    /// May submit Credit transactions.
    pub gateways: Vec<Address>,
    /// May sign metering receipts.
    pub hubs: Vec<Address>,
}

#[derive(Debug, thiserror::Error)]
pub enum GenesisError {
    #[error("genesis file {0}: {1}")]
    Io(String, std::io::Error),
    #[error("genesis is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("genesis chain_id must be 1..={MAX_CHAIN_ID_LEN} characters of [a-z0-9-]")]
    BadChainId,
    #[error("genesis format {0} is not one this node knows (1 or {FORMAT})")]
    UnknownFormat(u8),
    #[error("genesis {0} must be greater than zero")]
    Zero(&'static str),
    #[error("genesis allocates to {0} twice")]
    DuplicateAllocation(Address),
    #[error(
        "genesis allocation to the rewards pool or burn address is not allowed; use rewards_pool"
    )]
    AllocationToPool,
    #[error("genesis total supply overflows")]
    SupplyOverflow,
    #[error("genesis names validator {0} twice")]
    DuplicateValidator(Address),
    #[error("genesis names no validator")]
    NoValidator,
    #[error("genesis authority {0} is not a usable ed25519 key")]
    BadAuthorityKey(Address),
    #[error("genesis_time_ms {0} is past the latest block time, {MAX_TIMESTAMP_MS}")]
    TimeOutOfRange(u64),
    #[error("genesis unbonding_blocks ({unbonding}) must be longer than challenge_window ({window}) when min_bond is set, or a worker could unbond before its answers are judged")]
    UnbondingTooShort { unbonding: u64, window: u64 },
    #[error("genesis pins model {0:?} twice")]
    DuplicateModel(String),
    #[error("genesis model id {0:?} must be 1..=64 characters")]
    BadModelId(String),
    #[error("genesis model {0:?}: on a format-2 chain a pin needs a name (1..={MAX_MODEL_NAME_LEN} characters of [a-z0-9.-], unique among the pins' names and ids), a shape of at least one layer and expert, and an arithmetic version")]
    BadModelDetails(String),
    #[error("genesis fees: a format-2 chain needs them (a min_base_fee above zero, a lane_share below one), a format-1 chain has none")]
    BadFees,
    #[error("genesis max_block_bytes ({limit}) cannot hold the largest transaction this chain takes: {needed} bytes with the block's own (evidence, when models are pinned)")]
    BlockTooSmall { limit: u64, needed: u64 },
}

impl Genesis {
    pub fn from_json(text: &str) -> Result<Genesis, GenesisError> {
        let genesis: Genesis = serde_json::from_str(text)?;
        genesis.validate()?;
        Ok(genesis)
    }

    pub fn load(path: &Path) -> Result<Genesis, GenesisError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| GenesisError::Io(path.display().to_string(), e))?;
        Genesis::from_json(&text)
    }

    pub fn to_json(&self) -> String {
        // Serialising plain data structures to JSON cannot fail.
        let mut text = serde_json::to_string_pretty(self).unwrap_or_default();
        text.push('\n');
        text
    }

    pub fn validate(&self) -> Result<(), GenesisError> {
        check_chain_name(&self.params.chain_id)?;
        if !(1..=FORMAT).contains(&self.params.format) {
            return Err(GenesisError::UnknownFormat(self.params.format));
        }
        if self.genesis_time_ms > MAX_TIMESTAMP_MS {
            return Err(GenesisError::TimeOutOfRange(self.genesis_time_ms));
        }
        for (name, value) in [
            ("unit_bytes", self.params.unit_bytes),
            ("block_interval_ms", self.params.block_interval_ms),
            ("max_block_txs", u64::from(self.params.max_block_txs)),
            ("max_block_bytes", self.params.max_block_bytes),
        ] {
            if value == 0 {
                return Err(GenesisError::Zero(name));
            }
        }
        let pool = self.rewards_pool_address();
        let mut seen = BTreeSet::new();
        let mut supply = self.params.rewards_pool;
        for allocation in &self.allocations {
            if allocation.address == pool || allocation.address == self.burn_address() {
                return Err(GenesisError::AllocationToPool);
            }
            if !seen.insert(allocation.address) {
                return Err(GenesisError::DuplicateAllocation(allocation.address));
            }
            supply = supply
                .checked_add(allocation.amount)
                .ok_or(GenesisError::SupplyOverflow)?;
        }
        if self.authorities.validators.is_empty() {
            return Err(GenesisError::NoValidator);
        }
        let mut validators = BTreeSet::new();
        if let Some(twice) = self
            .authorities
            .validators
            .iter()
            .find(|v| !validators.insert(**v))
        {
            return Err(GenesisError::DuplicateValidator(*twice));
        }
        let a = &self.authorities;
        for key in a.validators.iter().chain(&a.gateways).chain(&a.hubs) {
            key.check_key()
                .map_err(|_| GenesisError::BadAuthorityKey(*key))?;
        }
        let p = &self.params;
        if !p.min_bond.is_zero() && p.unbonding_blocks <= p.challenge_window {
            return Err(GenesisError::UnbondingTooShort {
                unbonding: p.unbonding_blocks,
                window: p.challenge_window,
            });
        }
        // A transaction that fits no block would wait in the mempool for ever.
        let largest = self.max_evidence_bytes().max(MAX_TX_BYTES);
        let needed = BLOCK_OVERHEAD_BYTES + largest as u64;
        if p.max_block_bytes < needed {
            return Err(GenesisError::BlockTooSmall {
                limit: p.max_block_bytes,
                needed,
            });
        }
        // Nor may the open lane be too small for the largest transaction it takes.
        if let Some(fees) = &p.fees {
            let (open_bytes, open_txs) =
                crate::fees::open_lane(fees, p.max_block_bytes, p.max_block_txs);
            let needed = BLOCK_OVERHEAD_BYTES + MAX_TX_BYTES as u64;
            if open_bytes < needed || open_txs == 0 {
                return Err(GenesisError::BlockTooSmall {
                    limit: open_bytes,
                    needed,
                });
            }
        }
        let mut ids = BTreeSet::new();
        for model in &self.models {
            if model.id.is_empty() || model.id.len() > 64 {
                return Err(GenesisError::BadModelId(model.id.clone()));
            }
            if !ids.insert(&model.id) {
                return Err(GenesisError::DuplicateModel(model.id.clone()));
            }
        }
        let fees_ok = match &self.params.fees {
            None => self.params.format == 1,
            Some(fees) => {
                self.params.format >= 2
                    && !fees.min_base_fee.is_zero()
                    && fees.lane_share < Fraction::ONE
            }
        };
        if !fees_ok {
            return Err(GenesisError::BadFees);
        }
        if self.params.format >= 2 {
            let mut names = BTreeSet::new();
            for model in &self.models {
                let name_ok = !model.name.is_empty()
                    && model.name.len() <= MAX_MODEL_NAME_LEN
                    && model.name.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                    })
                    && (model.name == model.id || !ids.contains(&model.name))
                    && names.insert(&model.name);
                let shape_ok = model.shape.is_some_and(|s| {
                    s.layers > 0
                        && s.experts > 0
                        && (1..=MAX_PINNED_EXPERT_BYTES).contains(&s.expert_bytes)
                });
                if !name_ok || !shape_ok || model.arithmetic == 0 {
                    return Err(GenesisError::BadModelDetails(model.id.clone()));
                }
            }
        }
        Ok(())
    }

    /// The largest evidence transaction this chain takes: none without a pinned model; the
    /// request and response bodies on a format-1 chain; with the largest pinned expert and
    /// its proof on a format-2 chain, whose evidence carries the disputed expert.
    pub fn max_evidence_bytes(&self) -> usize {
        if self.models.is_empty() {
            return 0;
        }
        if self.params.format == 1 {
            return MAX_EVIDENCE_TX_BYTES;
        }
        let expert = self
            .models
            .iter()
            .filter_map(|m| m.shape)
            .map(|s| s.expert_bytes.min(MAX_PINNED_EXPERT_BYTES) as usize)
            .max()
            .unwrap_or(0);
        MAX_EVIDENCE_TX_BYTES + expert + EXPERT_PROOF_OVERHEAD
    }

    /// The identity of the chain: blake3 over the canonical encoding, followed by the later
    /// parameters that are set. A borsh value is self-delimiting, so appending them cannot
    /// make two different genesis encode alike.
    pub fn hash(&self) -> Hash {
        let later = self.later_params();
        if later.is_empty() {
            Hash::of_borsh(b"kvasir-genesis", self)
        } else {
            Hash::of_borsh(b"kvasir-genesis", &(self, later))
        }
    }

    /// What every signature on this chain commits to (`intent::signing_message`), and what
    /// its transactions, receipts and block headers name as their chain: on a format-1 chain
    /// its name; on a format-2 chain its name and genesis hash, `NAME:HASH`, so that a
    /// signature made for one chain is refused by every other, even one of the same name.
    pub fn chain_id(&self) -> String {
        if self.params.format == 1 {
            self.params.chain_id.clone()
        } else {
            format!("{}:{}", self.params.chain_id, self.hash())
        }
    }

    /// The parameters added after the first chains, as (name, canonical value) for each one
    /// set away from its default, in a fixed order.
    fn later_params(&self) -> Vec<(&'static str, Vec<u8>)> {
        let p = &self.params;
        let fraction = |f: Fraction| borsh::to_vec(&f).unwrap_or_default();
        let candidates = [
            (
                "min_new_account",
                !p.min_new_account.is_zero(),
                p.min_new_account.base_units().to_le_bytes().to_vec(),
            ),
            (
                "min_bond",
                !p.min_bond.is_zero(),
                p.min_bond.base_units().to_le_bytes().to_vec(),
            ),
            (
                "unbonding_blocks",
                p.unbonding_blocks != 0,
                p.unbonding_blocks.to_le_bytes().to_vec(),
            ),
            (
                "slash_fraction",
                !p.slash_fraction.is_zero(),
                fraction(p.slash_fraction),
            ),
            (
                "reporter_share",
                !p.reporter_share.is_zero(),
                fraction(p.reporter_share),
            ),
            (
                "jail_blocks",
                p.jail_blocks != 0,
                p.jail_blocks.to_le_bytes().to_vec(),
            ),
            ("format", p.format != 1, vec![p.format]),
            (
                "fees",
                p.fees.is_some(),
                borsh::to_vec(&p.fees).unwrap_or_default(),
            ),
            (
                "models",
                !self.models.is_empty(),
                borsh::to_vec(&self.models).unwrap_or_default(),
            ),
            // Each pin's name, shape and arithmetic, apart: a format-1 pin has none, and
            // keeps the encoding above.
            (
                "model_details",
                self.models
                    .iter()
                    .any(|m| !m.name.is_empty() || m.shape.is_some() || m.arithmetic != 0),
                borsh::to_vec(
                    &self
                        .models
                        .iter()
                        .map(|m| (&m.name, m.shape, m.arithmetic))
                        .collect::<Vec<_>>(),
                )
                .unwrap_or_default(),
            ),
        ];
        candidates
            .into_iter()
            .filter(|(_, set, _)| *set)
            .map(|(name, _, value)| (name, value))
            .collect()
    }

    /// Whether this chain asks workers for a bond (and so accepts Bond and Unbond).
    pub fn bonds_required(&self) -> bool {
        !self.params.min_bond.is_zero()
    }

    pub fn model(&self, id: &str) -> Option<&ModelPin> {
        self.models.iter().find(|m| m.id == id)
    }

    /// The pinned model an offer or order names, by id or by short name.
    pub fn pinned(&self, id_or_name: &str) -> Option<&ModelPin> {
        self.models
            .iter()
            .find(|m| m.id == id_or_name || (!m.name.is_empty() && m.name == id_or_name))
    }

    /// The rewards pool account. Its address is a hash, not a public key anyone holds, so
    /// no transaction can spend from it: only credits draw on it.
    pub fn rewards_pool_address(&self) -> Address {
        let mut hasher = blake3::Hasher::new_derive_key("kvasir rewards pool v1");
        hasher.update(self.params.chain_id.as_bytes());
        Address::from_bytes(*hasher.finalize().as_bytes())
    }

    /// Where the burned part of a slashed bond goes: like the pool, a hash that no one holds
    /// a key for, so burned money stays counted in the supply and can never be spent.
    pub fn burn_address(&self) -> Address {
        let mut hasher = blake3::Hasher::new_derive_key("kvasir burned v1");
        hasher.update(self.params.chain_id.as_bytes());
        Address::from_bytes(*hasher.finalize().as_bytes())
    }

    /// Every base unit that exists on this chain: allocations plus the rewards pool.
    pub fn total_supply(&self) -> Amount {
        self.allocations
            .iter()
            .try_fold(self.params.rewards_pool, |sum, a| sum.checked_add(a.amount))
            .unwrap_or(Amount::MAX)
    }

    pub fn is_validator(&self, who: &Address) -> bool {
        self.authorities.validators.contains(who)
    }

    pub fn is_gateway(&self, who: &Address) -> bool {
        self.authorities.gateways.contains(who)
    }

    pub fn is_hub(&self, who: &Address) -> bool {
        self.authorities.hubs.contains(who)
    }

    /// `earned(c) = floor(c * reward_per_unit / unit_bytes)` in base units, from a cumulative
    /// byte counter. `None` when the result does not fit an amount.
    pub fn earned(&self, cumulative_bytes: u64) -> Option<Amount> {
        self.earned_at(self.params.reward_per_unit, cumulative_bytes)
    }

    /// `earned` at another price per unit: what a placement's price makes of the count.
    pub fn earned_at(&self, price_per_unit: Amount, cumulative_bytes: u64) -> Option<Amount> {
        let product = u128::from(cumulative_bytes) * u128::from(price_per_unit.base_units());
        let units = product / u128::from(self.params.unit_bytes.max(1));
        u64::try_from(units).ok().map(Amount::from_base_units)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::keys::Keypair;

    /// A small valid genesis with well-known seeded keys, for tests across the crate.
    pub fn test_genesis() -> (Genesis, TestKeys) {
        let keys = TestKeys::new();
        let genesis = Genesis {
            genesis_time_ms: 1_764_000_000_000,
            params: ChainParams {
                chain_id: "kvasir-test".into(),
                // Format 1, whose chain id is its name alone: the tests name the chain
                // `kvasir-test` whatever else they change in their genesis. Format 2's own
                // rules are tested on `test_genesis_v2`.
                format: 1,
                unit_bytes: 1_000_000,
                reward_per_unit: Amount::parse("0.007").unwrap(),
                challenge_window: 3,
                block_interval_ms: 1000,
                max_block_txs: 10_000,
                max_block_bytes: 8 << 20,
                rewards_pool: Amount::parse("1000").unwrap(),
                min_new_account: Amount::ZERO,
                min_bond: Amount::ZERO,
                unbonding_blocks: 0,
                slash_fraction: Fraction::ZERO,
                reporter_share: Fraction::ZERO,
                jail_blocks: 0,
                fees: None,
            },
            allocations: vec![
                Allocation {
                    address: keys.alice.address(),
                    amount: Amount::parse("100").unwrap(),
                },
                Allocation {
                    address: keys.bob.address(),
                    amount: Amount::parse("5").unwrap(),
                },
            ],
            authorities: Authorities {
                validators: vec![keys.validator.address()],
                gateways: vec![keys.gateway.address()],
                hubs: vec![keys.hub.address()],
            },
            models: Vec::new(),
        };
        (genesis, keys)
    }

    /// `test_genesis` in format 2, as every new chain is.
    pub fn test_genesis_v2() -> (Genesis, TestKeys) {
        let (mut genesis, keys) = test_genesis();
        genesis.params.format = FORMAT;
        genesis.params.fees = Some(test_fees());
        (genesis, keys)
    }

    /// A test chain's fees: a transfer (about 150 bytes) pays 0.00015 KVR at the lowest base
    /// fee, a credit (about 300) 0.000003 KVR.
    pub fn test_fees() -> FeeParams {
        FeeParams {
            min_base_fee: Amount::from_base_units(1000),
            lane_fee: Amount::from_base_units(10),
            lane_share: Fraction::parse("0.25").unwrap(),
            evidence_deposit: Amount::parse("1").unwrap(),
        }
    }

    /// `test_genesis` with bonds, slashing and a pinned model "m" (see `tx::evidence`).
    pub fn bonded_genesis() -> (Genesis, TestKeys) {
        let (mut genesis, keys) = test_genesis();
        let p = &mut genesis.params;
        p.min_bond = Amount::parse("10").unwrap();
        p.unbonding_blocks = 5;
        p.slash_fraction = Fraction::parse("0.5").unwrap();
        p.reporter_share = Fraction::parse("0.1").unwrap();
        p.jail_blocks = 4;
        genesis.models.push(ModelPin {
            id: "m".into(),
            config_hash: Hash([1; 32]),
            experts_root: Hash([2; 32]),
            name: String::new(),
            shape: None,
            arithmetic: 0,
        });
        genesis.allocations.push(Allocation {
            address: keys.worker.address(),
            amount: Amount::parse("50").unwrap(),
        });
        (genesis, keys)
    }

    /// The config.json the format-2 test pin commits to.
    pub const TEST_CONFIG: &[u8] = b"{\"test\": true}";

    /// `bonded_genesis` in format 2, with fees (`test_fees`); its pin commits to
    /// `TEST_CONFIG`.
    pub fn bonded_genesis_v2() -> (Genesis, TestKeys) {
        let (mut genesis, keys) = bonded_genesis();
        genesis.params.format = FORMAT;
        genesis.params.fees = Some(test_fees());
        let pin = &mut genesis.models[0];
        pin.name = "m".into();
        pin.config_hash = Hash(*blake3::hash(TEST_CONFIG).as_bytes());
        pin.shape = Some(ModelShape {
            layers: 4,
            experts: 8,
            expert_bytes: 1 << 10,
        });
        pin.arithmetic = 1;
        (genesis, keys)
    }

    pub struct TestKeys {
        pub validator: Keypair,
        pub gateway: Keypair,
        pub hub: Keypair,
        pub alice: Keypair,
        pub bob: Keypair,
        pub worker: Keypair,
    }

    impl TestKeys {
        pub fn new() -> Self {
            TestKeys {
                validator: Keypair::from_seed(&[1; 32]),
                gateway: Keypair::from_seed(&[2; 32]),
                hub: Keypair::from_seed(&[3; 32]),
                alice: Keypair::from_seed(&[4; 32]),
                bob: Keypair::from_seed(&[5; 32]),
                worker: Keypair::from_seed(&[6; 32]),
            }
        }
    }

    #[test]
    fn earned_reproduces_the_announcement() {
        let (genesis, _) = test_genesis();
        let earned = genesis.earned(1_277_952).unwrap();
        assert_eq!(earned.base_units(), 8_945_664);
        assert_eq!(earned.to_string(), "0.008945664 KVR");
        assert_eq!(genesis.earned(0), Some(Amount::ZERO));
        assert!(genesis.earned(u64::MAX).is_none());
    }

    #[test]
    fn hash_ignores_json_formatting() {
        let (genesis, _) = test_genesis();
        let pretty = genesis.to_json();
        let compact = serde_json::to_string(&genesis).unwrap();
        let a = Genesis::from_json(&pretty).unwrap();
        let b = Genesis::from_json(&compact).unwrap();
        assert_eq!(a.hash(), b.hash());
        let mut other = genesis.clone();
        other.params.challenge_window += 1;
        assert_ne!(other.hash(), genesis.hash());
    }

    /// A format-1 chain's id is its name, and its file and hash are as before format 2
    /// existed (`a_later_parameter_changes_the_hash_only_when_set` pins that hash); a format-2
    /// chain's id carries its genesis hash, so two chains of one name have two ids. A format
    /// this node does not know is refused.
    #[test]
    fn format_2_binds_the_chain_id_to_the_genesis_hash() {
        let (v1, _) = test_genesis();
        assert_eq!(v1.chain_id(), "kvasir-test");
        assert!(!v1.to_json().contains("format"));
        let (v2, _) = test_genesis_v2();
        assert_eq!(v2.chain_id(), format!("kvasir-test:{}", v2.hash()));
        assert_ne!(v2.hash(), v1.hash());
        let reloaded = Genesis::from_json(&v2.to_json()).unwrap();
        assert!(v2.to_json().contains("\"format\": 2"));
        assert_eq!(
            (reloaded.hash(), reloaded.chain_id()),
            (v2.hash(), v2.chain_id())
        );
        let mut twin = v2.clone();
        twin.genesis_time_ms += 1;
        assert_eq!(twin.params.chain_id, v2.params.chain_id);
        assert_ne!(twin.chain_id(), v2.chain_id());
        for format in [0, FORMAT + 1] {
            let mut unknown = v2.clone();
            unknown.params.format = format;
            assert!(matches!(
                unknown.validate(),
                Err(GenesisError::UnknownFormat(f)) if f == format
            ));
        }
    }

    /// The dev chain as published before format 2 (with its four pinned models) keeps its
    /// hash and its name as chain id: stores made on it verify as they did.
    #[test]
    fn a_format_1_chain_with_pinned_models_keeps_its_hash() {
        let old = include_str!("../tests/data/format-1-dev-genesis.json");
        let genesis = Genesis::from_json(old).unwrap();
        assert_eq!(genesis.params.format, 1);
        assert_eq!(genesis.models.len(), 4);
        assert_eq!(
            genesis.hash().to_string(),
            "a461b6b850f20b5f4a37698db85377845e8ccff9823b33b02180a6fef4567616"
        );
        assert_eq!(genesis.chain_id(), "kvasir-dev");
    }

    /// A format-2 pin carries a unique short name, a shape and an arithmetic version; they
    /// enter the hash apart, so a format-1 pin keeps its encoding. Offers and orders find a
    /// pin by id or name.
    #[test]
    fn a_format_2_pin_is_named_shaped_and_versioned() {
        let (mut genesis, _) = bonded_genesis();
        genesis.params.format = FORMAT;
        genesis.params.fees = Some(test_fees());
        assert!(matches!(
            genesis.validate(),
            Err(GenesisError::BadModelDetails(id)) if id == "m"
        ));
        let without_details = genesis.hash();
        let pin = &mut genesis.models[0];
        pin.name = "small".into();
        pin.shape = Some(ModelShape {
            layers: 4,
            experts: 8,
            expert_bytes: 1 << 10,
        });
        pin.arithmetic = 1;
        genesis.validate().unwrap();
        assert_ne!(genesis.hash(), without_details);
        let reloaded = Genesis::from_json(&genesis.to_json()).unwrap();
        assert_eq!(reloaded.hash(), genesis.hash());
        assert_eq!(
            genesis.pinned("small").map(|p| &p.id),
            Some(&"m".to_string())
        );
        assert_eq!(
            genesis.pinned("m").map(|p| &p.name),
            Some(&"small".to_string())
        );
        assert!(genesis.pinned("other").is_none());
        let second = ModelPin {
            id: "n".into(),
            ..genesis.models[0].clone()
        };
        for (name, valid) in [
            ("small", false),
            ("m", false),
            ("n", true),
            ("Big", false),
            ("", false),
        ] {
            let mut two = genesis.clone();
            two.models.push(ModelPin {
                name: name.into(),
                ..second.clone()
            });
            assert_eq!(two.validate().is_ok(), valid, "{name:?}");
        }
        let mut flat = genesis.clone();
        flat.models[0].shape = Some(ModelShape {
            layers: 4,
            experts: 0,
            expert_bytes: 1 << 10,
        });
        assert!(flat.validate().is_err());
        // An expert too big for any evidence to carry, or none: refused.
        for expert_bytes in [0, MAX_PINNED_EXPERT_BYTES + 1] {
            let mut big = genesis.clone();
            big.models[0].shape = Some(ModelShape {
                layers: 4,
                experts: 8,
                expert_bytes,
            });
            assert!(big.validate().is_err(), "{expert_bytes}");
        }
    }

    /// The hash of `test_genesis` as it was before `min_new_account` existed: a genesis that
    /// does not set a later parameter keeps its hash, and one that sets it gets another.
    #[test]
    fn a_later_parameter_changes_the_hash_only_when_set() {
        let (genesis, _) = test_genesis();
        assert_eq!(
            genesis.hash().to_string(),
            "1b93aada508b1d56d83046df35b20366253385b46ca1f18029d2ae2267b46703"
        );
        assert!(!genesis.to_json().contains("min_new_account"));
        let mut with_min = genesis.clone();
        with_min.params.min_new_account = Amount::parse("0.001").unwrap();
        assert_ne!(with_min.hash(), genesis.hash());
        let reloaded = Genesis::from_json(&with_min.to_json()).unwrap();
        assert_eq!(reloaded, with_min);
        assert_eq!(reloaded.hash(), with_min.hash());
        let mut other_min = with_min.clone();
        other_min.params.min_new_account = Amount::parse("0.002").unwrap();
        assert_ne!(other_min.hash(), with_min.hash());
    }

    #[test]
    fn invalid_genesis_is_rejected() {
        let (genesis, keys) = test_genesis();
        let mut g = genesis.clone();
        g.params.chain_id = "Bad Chain".into();
        assert!(matches!(g.validate(), Err(GenesisError::BadChainId)));
        let mut g = genesis.clone();
        g.params.unit_bytes = 0;
        assert!(matches!(
            g.validate(),
            Err(GenesisError::Zero("unit_bytes"))
        ));
        let mut g = genesis.clone();
        g.allocations.push(Allocation {
            address: keys.alice.address(),
            amount: Amount::ZERO,
        });
        assert!(matches!(
            g.validate(),
            Err(GenesisError::DuplicateAllocation(_))
        ));
        let mut g = genesis.clone();
        g.allocations.push(Allocation {
            address: keys.worker.address(),
            amount: Amount::MAX,
        });
        assert!(matches!(g.validate(), Err(GenesisError::SupplyOverflow)));
        let mut g = genesis.clone();
        g.genesis_time_ms = u64::MAX;
        assert!(matches!(g.validate(), Err(GenesisError::TimeOutOfRange(_))));
        let mut g = genesis.clone();
        let twice = g.authorities.validators[0];
        g.authorities.validators.push(twice);
        assert!(matches!(g.validate(), Err(GenesisError::DuplicateValidator(a)) if a == twice));
        g.authorities.validators.clear();
        assert!(matches!(g.validate(), Err(GenesisError::NoValidator)));
        let mut g = genesis.clone();
        g.allocations.push(Allocation {
            address: g.rewards_pool_address(),
            amount: Amount::ZERO,
        });
        assert!(matches!(g.validate(), Err(GenesisError::AllocationToPool)));
        // A block must hold the biggest transaction: evidence, once models are pinned.
        let mut g = genesis.clone();
        g.params.max_block_bytes = 2048;
        assert!(matches!(
            g.validate(),
            Err(GenesisError::BlockTooSmall { .. })
        ));
        let (mut g, _) = bonded_genesis();
        assert!(g.validate().is_ok());
        g.params.max_block_bytes = 4 << 20;
        assert!(matches!(
            g.validate(),
            Err(GenesisError::BlockTooSmall { .. })
        ));
        assert!(matches!(
            Genesis::from_json("{"),
            Err(GenesisError::Json(_))
        ));
        let unknown = genesis.to_json().replacen('{', "{\"extra\": 1,", 1);
        assert!(matches!(
            Genesis::from_json(&unknown),
            Err(GenesisError::Json(_))
        ));
    }
}
