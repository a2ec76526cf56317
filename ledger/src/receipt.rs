//! A hub's signed receipt: what a credit transaction carries and what the state keeps the
//! mark of, beneath both.

use borsh::{BorshDeserialize, BorshSerialize};

use crate::intent::{self, Intent};
use crate::keys::{Address, Keypair, Signature};

/// A hub's signed statement that `worker`'s session has relayed `cumulative_bytes` of
/// well-formed dispatch traffic so far. Cumulative, so replays and duplicates pay nothing.
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct Receipt {
    pub chain_id: String,
    pub hub: Address,
    pub session_id: u64,
    pub worker: Address,
    /// The order the traffic was for (its backbone's), zero for none; each order of a
    /// session has its own cumulative count.
    pub order: u64,
    pub cumulative_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct SignedReceipt {
    pub receipt: Receipt,
    pub signature: Signature,
}

impl Receipt {
    /// Signs with the hub's key. The caller must be that hub (`receipt.hub`).
    pub fn sign(self, hub: &Keypair) -> SignedReceipt {
        let signature = intent::sign(hub, Intent::Receipt, &self.chain_id, &self);
        SignedReceipt {
            receipt: self,
            signature,
        }
    }
}
