//! Fees (format 2): every transaction pays, per byte of its encoding, a price and the tip it
//! bids. The price of the open lane is the base fee, which follows block fullness from one
//! block to the next (EIP-1559's rule) and is burned; the tip goes to the block's proposer.
//! Credits and evidence travel in a reserved lane: a share of every block that nothing else
//! may use, at a fixed genesis price. A flood of transfers can drive the base fee as high as
//! it is willing to pay, and fills only the open lane: the payments and evidence it would
//! block still fit, at a price it cannot move.
//!
//! Everything here is a pure function of its arguments; `tx` charges a transaction what
//! `charge` says, and `apply` moves the base fee with `next_base_fee`.

use borsh::{BorshDeserialize, BorshSerialize};
use serde::{Deserialize, Serialize};

use crate::amount::Amount;
use crate::error::TxError;
use crate::fraction::Fraction;
use crate::tx::TxKind;

/// The fee rules a format-2 genesis sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, BorshSerialize)]
#[serde(deny_unknown_fields)]
pub struct FeeParams {
    /// The lowest base fee, per byte: what a transaction pays in an empty chain. Above
    /// zero, so that every transaction costs something.
    pub min_base_fee: Amount,
    /// The reserved lane's fixed price, per byte.
    pub lane_fee: Amount,
    /// The share of every block's bytes and transactions kept for the reserved lane.
    pub lane_share: Fraction,
    /// What a reporter of evidence must hold beside its fee, and loses (burned) if the
    /// recomputation finds the answer was right; evidence that convicts costs nothing but its
    /// fee. Priced against delay, not computation: a validator's recomputation costs it about
    /// a core-second, but fake evidence takes a place in a block (four a block, one at the
    /// largest), and ten to forty fakes would hold a real conviction back past a ten-block
    /// challenge window; at 1 KVR a piece that costs 10 KVR or more, above the 5 KVR a 10 KVR
    /// bond slashed by half loses. (Each reporter has its own place per session in the
    /// mempool, so fakes cannot take the real reporter's.)
    pub evidence_deposit: Amount,
}

/// The fees of a new chain whose template sets none, and of the dev chain: a transfer (about
/// 200 bytes) pays 0.0002 KVR at the lowest base fee; a credit (about 400 bytes) 0.000004 KVR,
/// what 600 bytes of relayed traffic earn at the dev chain's rate; a quarter of every block is
/// kept for credits and evidence; evidence holds a deposit of 1 KVR.
pub const DEFAULT_FEES: FeeParams = FeeParams {
    min_base_fee: Amount::from_base_units(1_000),
    lane_fee: Amount::from_base_units(10),
    lane_share: Fraction::from_billionths(250_000_000),
    evidence_deposit: Amount::from_base_units(crate::amount::BASE_UNITS_PER_KVR),
};

/// What a transaction offers to pay, per byte of its encoding; part of what its sender signs.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize,
)]
pub struct FeeBid {
    /// The most it pays per byte, price and tip together: a base fee that rose above this
    /// since it was signed makes it wait, never pay more.
    pub max_per_byte: Amount,
    /// Paid per byte on top of the price, to the proposer; the mempool orders by it.
    pub tip_per_byte: Amount,
}

impl FeeBid {
    /// What a wallet bids for a transaction in `lane` while the base fee is `base_fee`: its
    /// `tip`, and room for the price to double (six full blocks in a row) before it has to
    /// wait. The reserved lane's price does not move, so a bid there is exact.
    pub fn suggested(params: &FeeParams, base_fee: Amount, lane: Lane, tip: Amount) -> FeeBid {
        let price = price(params, base_fee, lane);
        let room = match lane {
            Lane::Open => price.checked_add(price).unwrap_or(Amount::MAX),
            Lane::Reserved => price,
        };
        FeeBid {
            max_per_byte: room.checked_add(tip).unwrap_or(Amount::MAX),
            tip_per_byte: tip,
        }
    }
}

/// Which part of a block a transaction takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Everything a user sends: priced by the base fee.
    Open,
    /// Credits and evidence: the reserved share, at the genesis lane fee.
    Reserved,
}

impl Lane {
    pub fn of(kind: &TxKind) -> Lane {
        match kind {
            TxKind::Credit(_) | TxKind::Evidence(_) | TxKind::ExpertEvidence(_) => Lane::Reserved,
            _ => Lane::Open,
        }
    }
}

/// What a transaction pays: `burned` (its price) and `tip` (to the proposer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Charge {
    pub burned: Amount,
    pub tip: Amount,
}

impl Charge {
    pub fn total(self) -> Option<Amount> {
        self.burned.checked_add(self.tip)
    }
}

/// The price per byte of `lane` while the base fee is `base_fee`.
pub fn price(params: &FeeParams, base_fee: Amount, lane: Lane) -> Amount {
    match lane {
        Lane::Open => base_fee,
        Lane::Reserved => params.lane_fee,
    }
}

/// What a transaction of `bytes` bytes in `lane`, bidding `bid`, pays while the base fee is
/// `base_fee`: the lane's price and its tip for every byte. Refused when price and tip are
/// above the bid's most.
pub fn charge(
    params: &FeeParams,
    base_fee: Amount,
    lane: Lane,
    bid: &FeeBid,
    bytes: usize,
) -> Result<Charge, TxError> {
    let price = price(params, base_fee, lane);
    let per_byte = price
        .checked_add(bid.tip_per_byte)
        .ok_or(TxError::Overflow)?;
    if per_byte > bid.max_per_byte {
        return Err(TxError::FeeBelowPrice {
            price,
            tip: bid.tip_per_byte,
            max: bid.max_per_byte,
        });
    }
    let times = |per: Amount| {
        per.base_units()
            .checked_mul(bytes as u64)
            .map(Amount::from_base_units)
            .ok_or(TxError::Overflow)
    };
    Ok(Charge {
        burned: times(price)?,
        tip: times(bid.tip_per_byte)?,
    })
}

/// How much of a block of `max_bytes` bytes and `max_txs` transactions the open lane may
/// take: the rest is the reserved lane's.
pub fn open_lane(params: &FeeParams, max_bytes: u64, max_txs: u32) -> (u64, u32) {
    let reserved = |total: u64| params.lane_share.of(Amount::from_base_units(total));
    let bytes = max_bytes - reserved(max_bytes).base_units();
    // At most `max_txs`, since the reserved share is at most all of it.
    let txs = u64::from(max_txs) - reserved(u64::from(max_txs)).base_units();
    (bytes, txs as u32)
}

/// The most the base fee moves in one block: one eighth, as in EIP-1559.
const CHANGE_DENOMINATOR: u128 = 8;

/// The highest base fee, per byte: 1 KVR. Far above anything a flood pays for long (it
/// multiplies by 9/8 a block), it keeps every fee's arithmetic far from overflow.
pub const MAX_BASE_FEE: Amount = Amount::from_base_units(crate::amount::BASE_UNITS_PER_KVR);

/// A full open lane, in the parts `next_base_fee` measures fullness in.
pub const FULL: u64 = 1_000_000;

/// The base fee after a block whose open lane was `fullness` full (in parts per `FULL`; past
/// `FULL` counts as full), from `base_fee`: it rises when the lane was more than half full
/// and falls when less, by up to an eighth in proportion to the distance from half, and by
/// at least one base unit on the way up (else a small fee could never rise). It stays
/// within `min_base_fee..=MAX_BASE_FEE`.
pub fn next_base_fee(params: &FeeParams, base_fee: Amount, fullness: u64) -> Amount {
    let target = u128::from(FULL / 2);
    let base = u128::from(base_fee.base_units());
    let used = u128::from(fullness.min(FULL));
    let next = if used > target {
        let rise = base * (used - target) / target / CHANGE_DENOMINATOR;
        base + rise.max(1)
    } else {
        base - base * (target - used) / target / CHANGE_DENOMINATOR
    };
    let floor = u128::from(params.min_base_fee.base_units());
    let ceiling = u128::from(MAX_BASE_FEE.base_units()).max(floor);
    Amount::from_base_units(next.clamp(floor, ceiling) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params() -> FeeParams {
        FeeParams {
            min_base_fee: Amount::from_base_units(1000),
            lane_fee: Amount::from_base_units(10),
            lane_share: Fraction::parse("0.25").unwrap(),
            evidence_deposit: Amount::from_base_units(1_000_000),
        }
    }

    fn units(n: u64) -> Amount {
        Amount::from_base_units(n)
    }

    #[test]
    fn the_base_fee_follows_fullness() {
        let p = params();
        // Half full: unchanged. Full: up an eighth. Empty: down an eighth, to the floor.
        assert_eq!(next_base_fee(&p, units(8000), FULL / 2), units(8000));
        assert_eq!(next_base_fee(&p, units(8000), FULL), units(9000));
        assert_eq!(next_base_fee(&p, units(8000), 3 * FULL), units(9000));
        assert_eq!(next_base_fee(&p, units(8000), 3 * FULL / 4), units(8500));
        assert_eq!(next_base_fee(&p, units(8000), 0), units(7000));
        assert_eq!(next_base_fee(&p, units(1000), 0), units(1000));
        // A small fee still rises.
        let tiny = FeeParams {
            min_base_fee: units(1),
            ..p
        };
        assert_eq!(next_base_fee(&tiny, units(1), FULL), units(2));
        assert_eq!(next_base_fee(&p, MAX_BASE_FEE, FULL), MAX_BASE_FEE);
    }

    #[test]
    fn a_bid_below_the_price_waits_and_a_charge_is_price_and_tip_per_byte() {
        let p = params();
        let bid = FeeBid {
            max_per_byte: units(1500),
            tip_per_byte: units(2),
        };
        let paid = charge(&p, units(1200), Lane::Open, &bid, 100).unwrap();
        assert_eq!(paid.burned, units(120_000));
        assert_eq!(paid.tip, units(200));
        let reserved = charge(&p, units(1_000_000), Lane::Reserved, &bid, 100).unwrap();
        assert_eq!(reserved.burned, units(1000));
        assert!(matches!(
            charge(&p, units(1499), Lane::Open, &bid, 100),
            Err(TxError::FeeBelowPrice { .. })
        ));
        let huge = FeeBid {
            max_per_byte: Amount::MAX,
            tip_per_byte: Amount::MAX,
        };
        assert_eq!(
            charge(&p, units(1), Lane::Open, &huge, 10),
            Err(TxError::Overflow)
        );
    }

    #[test]
    fn the_reserved_lane_is_its_share_of_a_block() {
        assert_eq!(open_lane(&params(), 1000, 100), (750, 75));
        let all = FeeParams {
            lane_share: Fraction::ONE,
            ..params()
        };
        assert_eq!(open_lane(&all, 1000, 100), (0, 0));
    }

    proptest! {
        /// The rule's bounds: never below the floor or above the ceiling, never more than an
        /// eighth (or one unit) from where it was, up only when over half full, down only
        /// when under.
        #[test]
        fn the_base_fee_moves_at_most_an_eighth_toward_half_full(
            base in 1000u64..=MAX_BASE_FEE.base_units(),
            fullness in 0u64..=2 * FULL,
        ) {
            let next = next_base_fee(&params(), units(base), fullness).base_units();
            prop_assert!((1000..=MAX_BASE_FEE.base_units()).contains(&next));
            let step = (base / 8).max(1);
            prop_assert!(next.abs_diff(base) <= step);
            if fullness > FULL / 2 {
                prop_assert!(next >= base);
            } else {
                prop_assert!(next <= base);
            }
        }
    }
}
