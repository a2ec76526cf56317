//! Genesis: the chain's parameters, initial allocations and authorities. The genesis hash is
//! blake3 over the canonical borsh encoding, so the same file gives the same hash anywhere,
//! whatever its JSON whitespace or key order.
//!
//! Parameters added after the first chains were published (`min_new_account`) are optional:
//! absent from a genesis file they take a default that changes nothing, and only a value set
//! away from that default enters the hash (appended after everything else), so every genesis
//! written before them keeps its hash.

use std::collections::BTreeSet;
use std::path::Path;

use borsh::BorshSerialize;
use serde::{Deserialize, Serialize};

use crate::amount::Amount;
use crate::block::MAX_TIMESTAMP_MS;
use crate::hash::Hash;
use crate::keys::Address;

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
}

/// The rules of a chain, as a template for new chains also carries them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct ChainParams {
    pub chain_id: String,
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
}

/// A later parameter left at zero is left out of the file, as it is of the hash.
fn is_zero(amount: &Amount) -> bool {
    amount.is_zero()
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
    #[error("genesis {0} must be greater than zero")]
    Zero(&'static str),
    #[error("genesis allocates to {0} twice")]
    DuplicateAllocation(Address),
    #[error("genesis allocation to the rewards pool address is not allowed; use rewards_pool")]
    AllocationToPool,
    #[error("genesis total supply overflows")]
    SupplyOverflow,
    #[error("genesis names no validator")]
    NoValidator,
    #[error("genesis authority {0} is not a usable ed25519 key")]
    BadAuthorityKey(Address),
    #[error("genesis_time_ms {0} is past the latest block time, {MAX_TIMESTAMP_MS}")]
    TimeOutOfRange(u64),
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
        let id = &self.params.chain_id;
        let id_ok = !id.is_empty()
            && id.len() <= MAX_CHAIN_ID_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !id_ok {
            return Err(GenesisError::BadChainId);
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
            if allocation.address == pool {
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
        let a = &self.authorities;
        for key in a.validators.iter().chain(&a.gateways).chain(&a.hubs) {
            key.check_key()
                .map_err(|_| GenesisError::BadAuthorityKey(*key))?;
        }
        Ok(())
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

    /// The parameters added after the first chains, as (name, canonical value) for each one
    /// set away from its default, in a fixed order.
    fn later_params(&self) -> Vec<(&'static str, Vec<u8>)> {
        let mut set = Vec::new();
        let min = self.params.min_new_account;
        if !min.is_zero() {
            set.push(("min_new_account", min.base_units().to_le_bytes().to_vec()));
        }
        set
    }

    /// The rewards pool account. Its address is a hash, not a public key anyone holds, so
    /// no transaction can spend from it: only credits draw on it.
    pub fn rewards_pool_address(&self) -> Address {
        let mut hasher = blake3::Hasher::new_derive_key("kvasir rewards pool v1");
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
        let product =
            u128::from(cumulative_bytes) * u128::from(self.params.reward_per_unit.base_units());
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
                unit_bytes: 1_000_000,
                reward_per_unit: Amount::parse("0.007").unwrap(),
                challenge_window: 3,
                block_interval_ms: 1000,
                max_block_txs: 10_000,
                max_block_bytes: 8 << 20,
                rewards_pool: Amount::parse("1000").unwrap(),
                min_new_account: Amount::ZERO,
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
        };
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
        fn new() -> Self {
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
        g.authorities.validators.clear();
        assert!(matches!(g.validate(), Err(GenesisError::NoValidator)));
        let mut g = genesis.clone();
        g.allocations.push(Allocation {
            address: g.rewards_pool_address(),
            amount: Amount::ZERO,
        });
        assert!(matches!(g.validate(), Err(GenesisError::AllocationToPool)));
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
