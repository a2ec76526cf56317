//! Applying a block is a deterministic pure step `(state, block) -> state`: no clock, no
//! randomness, no I/O. Producing a block (choosing transactions, stamping the time, signing)
//! is separate and reuses the same per-transaction path, so a produced block always applies.
//!
//! Block time: `apply_block` checks what needs no clock (never before the parent's time,
//! never past `MAX_TIMESTAMP_MS`); equal times are allowed, as `produce_block` stamps the
//! parent's time when the producer's clock is behind it. What needs a clock, that a new
//! block is not ahead of the local clock by more than `MAX_CLOCK_DRIFT_MS`, is
//! `check_clock`, run where a block is made or received (the ledger service, a validator
//! taking a proposal), never on replay: whether a block was acceptable when it was made
//! cannot depend on when the chain is re-verified.

use crate::block::{Block, BlockHeader, BLOCK_OVERHEAD_BYTES, MAX_TIMESTAMP_MS};
use crate::fees::{self, Lane, FULL};
use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::intent::{self, Intent};
use crate::keys::Keypair;
use crate::state::{ChangeSet, State};
use crate::tx::{check_stateful, execute, stateless_results, SignedTx, TxError, VerifiedTx};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("block is for chain {got:?}, this is {expected:?}")]
    WrongChain { expected: String, got: String },
    #[error("block height is {got}, expected {expected}")]
    WrongHeight { expected: u64, got: u64 },
    #[error("previous hash {got} does not match the parent block {expected}")]
    WrongPrevHash { expected: Hash, got: Hash },
    #[error("proposer {0} is not a validator named in genesis")]
    NotAValidator(crate::keys::Address),
    #[error("proposer signature does not verify")]
    BadSignature,
    #[error("timestamp {got} is before the parent's {parent}")]
    TimestampBackwards { parent: u64, got: u64 },
    #[error("timestamp {0} is past the latest block time, {MAX_TIMESTAMP_MS}")]
    TimestampOutOfRange(u64),
    #[error("timestamp {got} is ahead of this clock ({now}) by more than {MAX_CLOCK_DRIFT_MS} ms")]
    AheadOfClock { now: u64, got: u64 },
    #[error("block holds {got} transactions, over the limit of {limit}")]
    TooManyTxs { limit: u32, got: usize },
    #[error("block holds {got} pieces of evidence, over the limit of {MAX_BLOCK_EVIDENCE}")]
    TooMuchEvidence { got: usize },
    #[error("block's open lane holds {bytes} bytes in {txs} transactions, over its share of {limit_bytes} bytes and {limit_txs} transactions (the rest is kept for credits and evidence)")]
    OpenLaneFull {
        bytes: u64,
        txs: u64,
        limit_bytes: u64,
        limit_txs: u32,
    },
    #[error("block is {got} bytes, over the limit of {limit}")]
    TooLarge { limit: u64, got: u64 },
    #[error("transaction root {got} does not match the transactions ({computed})")]
    TxRoot { computed: Hash, got: Hash },
    #[error("transaction {index} is invalid: {error}")]
    InvalidTx { index: usize, error: TxError },
    #[error("state root {got} does not match the state after the block ({computed})")]
    StateRoot { computed: Hash, got: Hash },
}

/// Pieces of evidence one block may hold. Each costs every validator a recomputation of
/// the disputed experts while the block is validated, inside a consensus round's timeouts:
/// without a bound, one proposer could fill a block with evidence and stall the chain.
pub const MAX_BLOCK_EVIDENCE: usize = 4;

fn is_evidence(tx: &SignedTx) -> bool {
    tx.tx.kind.evidence().is_some()
}

/// How far a new block's timestamp may be ahead of the clock of the node that makes or
/// receives it (see `check_clock`).
pub const MAX_CLOCK_DRIFT_MS: u64 = 5_000;

/// A new block's time against the local clock `now_ms` (ms since the Unix epoch): refused
/// when it is more than `MAX_CLOCK_DRIFT_MS` ahead. A producer runs it on the block it made
/// before committing it, a validator on a proposal before `apply_block`.
pub fn check_clock(header: &BlockHeader, now_ms: u64) -> Result<(), BlockError> {
    if header.timestamp_ms.saturating_sub(now_ms) > MAX_CLOCK_DRIFT_MS {
        return Err(BlockError::AheadOfClock {
            now: now_ms,
            got: header.timestamp_ms,
        });
    }
    Ok(())
}

/// The open lane's share of a block, bytes and transactions: all of it on a chain without
/// fees, else what the reserved lane leaves (`fees::open_lane`).
fn open_capacity(genesis: &Genesis) -> (u64, u32) {
    let p = &genesis.params;
    match &p.fees {
        Some(fees) => fees::open_lane(fees, p.max_block_bytes, p.max_block_txs),
        None => (p.max_block_bytes, p.max_block_txs),
    }
}

/// Bytes and count of the open lane's transactions among `txs`, on a chain with fees (on
/// one without, nothing is measured, as nothing depends on it).
fn open_use<'a>(genesis: &Genesis, txs: impl Iterator<Item = &'a SignedTx>) -> (u64, u64) {
    if genesis.params.fees.is_none() {
        return (0, 0);
    }
    txs.filter(|tx| Lane::of(&tx.tx.kind) == Lane::Open)
        .fold((0, 0), |(bytes, count), tx| {
            (bytes + tx.to_bytes().len() as u64, count + 1)
        })
}

/// Runs one transaction's stateful check and execution on `state`; on any error `state` is
/// left exactly as it was.
fn run_tx(state: &mut State, tx: &SignedTx) -> Result<(), TxError> {
    check_stateful(state, tx)?;
    let writes = execute(state, tx)?;
    state.write(writes);
    Ok(())
}

/// Closes a block's transactions at `height`, whose open lane held `open` (bytes and
/// transactions): the block-boundary settlement, then the authenticated root over
/// everything that changed.
fn finish(state: &mut State, height: u64, open: (u64, u64)) -> Result<ChangeSet, TxError> {
    state.end_block(height, fullness(state.genesis(), open))?;
    Ok(state.commit_dirty())
}

/// How full a block's open lane was, in parts per `FULL`: by bytes or by count, whichever is
/// fuller, as a flood of small transactions fills a block by count long before its bytes.
fn fullness(genesis: &Genesis, (bytes, txs): (u64, u64)) -> u64 {
    let (max_bytes, max_txs) = open_capacity(genesis);
    let share =
        |used: u64, of: u64| (u128::from(used) * u128::from(FULL) / u128::from(of.max(1))) as u64;
    share(bytes, max_bytes).max(share(txs, u64::from(max_txs)))
}

/// Verifies `block` against `parent` and returns the state after it and the entries it
/// changed. `parent` is untouched; an invalid block yields an error and nothing else.
pub fn apply_block(parent: &State, block: &Block) -> Result<(State, ChangeSet), BlockError> {
    let genesis = parent.genesis();
    let header = &block.header;
    if header.chain_id != parent.chain_id() {
        return Err(BlockError::WrongChain {
            expected: parent.chain_id().to_string(),
            got: header.chain_id.clone(),
        });
    }
    let height = parent.height() + 1;
    if header.height != height {
        return Err(BlockError::WrongHeight {
            expected: height,
            got: header.height,
        });
    }
    if header.prev_hash != parent.block_hash() {
        return Err(BlockError::WrongPrevHash {
            expected: parent.block_hash(),
            got: header.prev_hash,
        });
    }
    if !genesis.is_validator(&header.proposer) {
        return Err(BlockError::NotAValidator(header.proposer));
    }
    intent::verify(
        &header.proposer,
        Intent::Block,
        parent.chain_id(),
        header,
        &block.signature,
    )
    .map_err(|_| BlockError::BadSignature)?;
    if header.timestamp_ms < parent.timestamp_ms() {
        return Err(BlockError::TimestampBackwards {
            parent: parent.timestamp_ms(),
            got: header.timestamp_ms,
        });
    }
    if header.timestamp_ms > MAX_TIMESTAMP_MS {
        return Err(BlockError::TimestampOutOfRange(header.timestamp_ms));
    }
    if block.txs.len() > genesis.params.max_block_txs as usize {
        return Err(BlockError::TooManyTxs {
            limit: genesis.params.max_block_txs,
            got: block.txs.len(),
        });
    }
    let evidence = block.txs.iter().filter(|tx| is_evidence(tx)).count();
    if evidence > MAX_BLOCK_EVIDENCE {
        return Err(BlockError::TooMuchEvidence { got: evidence });
    }
    let size = block.to_bytes().len() as u64;
    if size > genesis.params.max_block_bytes {
        return Err(BlockError::TooLarge {
            limit: genesis.params.max_block_bytes,
            got: size,
        });
    }
    let (limit_bytes, limit_txs) = open_capacity(genesis);
    let (open_bytes, open_txs) = open_use(genesis, block.txs.iter());
    if open_bytes > limit_bytes || open_txs > u64::from(limit_txs) {
        return Err(BlockError::OpenLaneFull {
            bytes: open_bytes,
            txs: open_txs,
            limit_bytes,
            limit_txs,
        });
    }
    let computed = Block::tx_root(&block.txs);
    if computed != header.tx_root {
        return Err(BlockError::TxRoot {
            computed,
            got: header.tx_root,
        });
    }
    let invalid = |index, error| BlockError::InvalidTx { index, error };
    for (index, result) in stateless_results(genesis, &block.txs)
        .into_iter()
        .enumerate()
    {
        result.map_err(|e| invalid(index, e))?;
    }
    let mut state = parent.clone();
    state.begin_block(header.proposer);
    for (index, tx) in block.txs.iter().enumerate() {
        run_tx(&mut state, tx).map_err(|e| invalid(index, e))?;
    }
    let changes = finish(&mut state, height, (open_bytes, open_txs))
        .map_err(|e| invalid(block.txs.len(), e))?;
    if state.root() != header.state_root {
        return Err(BlockError::StateRoot {
            computed: state.root(),
            got: header.state_root,
        });
    }
    state.set_head(height, block.hash(), header.timestamp_ms);
    Ok((state, changes))
}

/// A block made by `produce_block`, the state after it, and the candidates left out.
pub struct Produced {
    pub block: Block,
    pub state: State,
    pub changes: ChangeSet,
    /// Candidates that failed a check, with the reason. Ones left out only because the
    /// block was full are in neither list.
    pub rejected: Vec<(Hash, TxError)>,
}

/// Builds, signs and applies the next block from `candidates` (in their order), keeping
/// every one that passes the stateful check and executes, within the genesis size limits.
/// Candidates passed the stateless check on admission, so no signature is checked here.
/// `timestamp_ms` is the producer's clock, clamped so time never goes backwards; past
/// `MAX_TIMESTAMP_MS` it is refused, as `apply_block` would refuse the block.
pub fn produce_block(
    parent: &State,
    candidates: &[VerifiedTx],
    proposer: &Keypair,
    timestamp_ms: u64,
) -> Result<Produced, BlockError> {
    let timestamp_ms = timestamp_ms.max(parent.timestamp_ms());
    if timestamp_ms > MAX_TIMESTAMP_MS {
        return Err(BlockError::TimestampOutOfRange(timestamp_ms));
    }
    let genesis = parent.genesis_arc().clone();
    let height = parent.height() + 1;
    let mut state = parent.clone();
    state.begin_block(proposer.address());
    let mut txs = Vec::new();
    let mut rejected = Vec::new();
    let mut size = BLOCK_OVERHEAD_BYTES;
    let mut evidence = 0;
    let (open_limit_bytes, open_limit_txs) = open_capacity(&genesis);
    let fees = genesis.params.fees.is_some();
    let (mut open_bytes, mut open_txs) = (0u64, 0u32);
    // Senders with a transaction too big for what is left of this block (or of its lane),
    // or evidence past its share: their later ones wait too (they would fail on the nonce),
    // while others' still fill it.
    let mut deferred = std::collections::BTreeSet::new();
    for tx in candidates.iter().map(VerifiedTx::tx) {
        if txs.len() >= genesis.params.max_block_txs as usize {
            break;
        }
        if deferred.contains(&tx.tx.sender) {
            continue;
        }
        let tx_size = tx.to_bytes().len() as u64;
        let evidence_full = is_evidence(tx) && evidence == MAX_BLOCK_EVIDENCE;
        let open = fees && Lane::of(&tx.tx.kind) == Lane::Open;
        let open_full =
            open && (open_bytes + tx_size > open_limit_bytes || open_txs >= open_limit_txs);
        if size + tx_size > genesis.params.max_block_bytes || evidence_full || open_full {
            deferred.insert(tx.tx.sender);
            continue;
        }
        match run_tx(&mut state, tx) {
            Ok(()) => {
                size += tx_size;
                if open {
                    open_bytes += tx_size;
                    open_txs += 1;
                }
                evidence += usize::from(is_evidence(tx));
                txs.push(tx.clone());
            }
            // A bid the price has risen above waits for it to fall (it never pays more
            // than its sender signed), and its sender's later ones with it.
            Err(TxError::FeeBelowPrice { .. }) => {
                deferred.insert(tx.tx.sender);
            }
            Err(error) => rejected.push((tx.hash(), error)),
        }
    }
    let invalid = |error| BlockError::InvalidTx {
        index: txs.len(),
        error,
    };
    let changes = finish(&mut state, height, (open_bytes, u64::from(open_txs))).map_err(invalid)?;
    let block = Block::seal(parent, txs, state.root(), timestamp_ms, proposer);
    state.set_head(height, block.hash(), timestamp_ms);
    Ok(Produced {
        block,
        state,
        changes,
        rejected,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::amount::Amount;
    use crate::fees::FeeBid;
    use crate::genesis::tests::{test_genesis, TestKeys};
    use crate::genesis::Genesis;
    use crate::keys::Address;
    use crate::tx::tests::transfer;
    use crate::tx::{check_stateless, Receipt, Tx, TxKind};
    use proptest::prelude::*;

    fn receipt(
        keys: &TestKeys,
        hub: &Keypair,
        session_id: u64,
        worker: Address,
        bytes: u64,
    ) -> SignedTx {
        credit_from(&keys.gateway, 0, hub, session_id, worker, bytes)
    }

    pub(crate) fn credit_from(
        sender: &Keypair,
        nonce: u64,
        hub: &Keypair,
        session_id: u64,
        worker: Address,
        bytes: u64,
    ) -> SignedTx {
        credit_on(
            "kvasir-test",
            None,
            sender,
            nonce,
            hub,
            session_id,
            worker,
            bytes,
        )
    }

    /// `credit_from` on the chain `chain_id`, bidding `fee`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn credit_on(
        chain_id: &str,
        fee: Option<FeeBid>,
        sender: &Keypair,
        nonce: u64,
        hub: &Keypair,
        session_id: u64,
        worker: Address,
        bytes: u64,
    ) -> SignedTx {
        let receipt = Receipt {
            chain_id: chain_id.into(),
            hub: hub.address(),
            session_id,
            worker,
            order: 0,
            cumulative_bytes: bytes,
        };
        TxKind::Credit(receipt.sign(hub)).signed_paying(chain_id, fee, sender, nonce)
    }

    fn with_nonce(state: &State, keys: &TestKeys, mut tx: SignedTx) -> SignedTx {
        let signer = [&keys.gateway, &keys.alice, &keys.bob, &keys.worker]
            .into_iter()
            .find(|k| k.address() == tx.tx.sender)
            .expect("a test key");
        tx.tx.nonce = state.account(&tx.tx.sender).nonce;
        tx.tx.clone().sign(signer)
    }

    pub(crate) fn verified(state: &State, txs: Vec<SignedTx>) -> Vec<VerifiedTx> {
        check_stateless(state.genesis(), txs)
            .into_iter()
            .map(Result::unwrap)
            .collect()
    }

    /// Produces a block holding exactly `txs`, asserting none was rejected.
    pub(crate) fn block_of(state: &State, keys: &TestKeys, txs: Vec<SignedTx>) -> State {
        let count = txs.len();
        let txs = verified(state, txs);
        let produced =
            produce_block(state, &txs, &keys.validator, state.timestamp_ms() + 1000).unwrap();
        assert!(produced.rejected.is_empty(), "{:?}", produced.rejected);
        assert_eq!(produced.block.txs.len(), count);
        produced.state
    }

    pub(crate) fn rejection(state: &State, keys: &TestKeys, tx: SignedTx) -> TxError {
        let produced = produce_block(
            state,
            &verified(state, vec![tx]),
            &keys.validator,
            state.timestamp_ms(),
        )
        .unwrap();
        assert!(produced.block.txs.is_empty());
        produced.rejected.into_iter().next().expect("rejected").1
    }

    #[test]
    fn the_announcement_session_pays_0_008945664_kvr_pending_then_settles() {
        let (genesis, keys) = test_genesis();
        let window = genesis.params.challenge_window;
        let state = State::from_genesis(genesis);
        let worker = keys.worker.address();
        let state = block_of(
            &state,
            &keys,
            vec![receipt(&keys, &keys.hub, 1, worker, 1_277_952)],
        );
        let account = state.account(&worker);
        assert_eq!(account.balance, Amount::ZERO);
        assert_eq!(account.pending.len(), 1);
        assert_eq!(account.pending[0].amount.base_units(), 8_945_664);
        assert_eq!(account.pending[0].amount.to_string(), "0.008945664 KVR");
        assert_eq!(account.pending[0].settle_height, 1 + window);
        let mut state = state;
        for _ in 0..window - 1 {
            state = block_of(&state, &keys, vec![]);
            assert_eq!(state.account(&worker).balance, Amount::ZERO);
        }
        state = block_of(&state, &keys, vec![]);
        let account = state.account(&worker);
        assert_eq!(account.balance.base_units(), 8_945_664);
        assert!(account.pending.is_empty());
    }

    /// A chain with fees: alice pays a transfer's price, burned, and its tip, to the block's
    /// proposer; her balance falls by amount and fee, and nothing else moves.
    #[test]
    fn a_transfer_burns_its_price_and_tips_the_proposer() {
        let (genesis, keys) = crate::genesis::tests::test_genesis_v2();
        let g = genesis.clone();
        let state = State::from_genesis(genesis);
        let amount = Amount::parse("1").unwrap();
        let kind = TxKind::Transfer {
            to: keys.bob.address(),
            amount,
        };
        let tip = Amount::from_base_units(7);
        let fee = state.suggested_bid(Lane::of(&kind), tip);
        let tx = kind.signed_paying(state.chain_id(), fee, &keys.alice, 0);
        let bytes = tx.to_bytes().len() as u64;
        let base = state.base_fee().base_units();
        assert_eq!(base, 1000, "a new chain starts at the lowest base fee");
        let after = block_of(&state, &keys, vec![tx]);
        let burned = after.account(&g.burn_address()).balance.base_units();
        assert_eq!(burned, bytes * base);
        let tipped = after
            .account(&keys.validator.address())
            .balance
            .base_units();
        assert_eq!(tipped, bytes * 7);
        let spent = state.account(&keys.alice.address()).balance.base_units()
            - after.account(&keys.alice.address()).balance.base_units();
        assert_eq!(spent, amount.base_units() + burned + tipped);
        assert_eq!(after.total_money(), state.total_money());
        // A bid whose most is below price and tip is refused at admission, and waits (never
        // rejected) if the price rose after it was admitted: its sender keeps its money.
        let kind = TxKind::Transfer {
            to: keys.bob.address(),
            amount,
        };
        let mut low = after.suggested_bid(Lane::of(&kind), tip).unwrap();
        low.max_per_byte = Amount::from_base_units(1006);
        let tx = kind.signed_paying(after.chain_id(), Some(low), &keys.alice, 1);
        assert!(matches!(
            crate::tx::check_stateful(&after, &tx),
            Err(TxError::FeeBelowPrice { .. })
        ));
        let time = after.timestamp_ms() + 1000;
        let waits = produce_block(&after, &verified(&after, vec![tx]), &keys.validator, time);
        let waits = waits.unwrap();
        assert!(waits.block.txs.is_empty() && waits.rejected.is_empty());
        // A fee bid on a chain without fees, or none on one with them, is malformed.
        let (v1, _) = test_genesis();
        let unpaid = TxKind::Transfer {
            to: keys.bob.address(),
            amount,
        }
        .signed(after.chain_id(), &keys.alice, 1);
        let bid = Some(low);
        let paid_on_v1 = TxKind::Transfer {
            to: keys.bob.address(),
            amount,
        }
        .signed_paying("kvasir-test", bid, &keys.alice, 0);
        assert_eq!(
            stateless_results(&g, &[unpaid])[0],
            Err(TxError::FeeBidFormat { expected: true })
        );
        assert_eq!(
            stateless_results(&v1, &[paid_on_v1])[0],
            Err(TxError::FeeBidFormat { expected: false })
        );
    }

    /// A credit never stalls its gateway's later ones: new bytes worth nothing pay no fee,
    /// and one whose source holds less than its fee pays all it holds as the fee (the rest
    /// owed, as ever); credits and evidence bid no tip.
    #[test]
    fn a_credit_pays_its_fee_from_what_it_brings_and_never_fails_for_it() {
        let (mut genesis, keys) = crate::genesis::tests::test_genesis_v2();
        // One base unit a megabyte, from a pool of five.
        genesis.params.reward_per_unit = Amount::from_base_units(1);
        genesis.params.rewards_pool = Amount::from_base_units(5);
        let state = State::from_genesis(genesis);
        let chain = state.chain_id().to_string();
        let (w, pool) = (keys.worker.address(), state.rewards_pool());
        let lane = state.suggested_bid(Lane::Reserved, Amount::ZERO);
        let credit = |state: &State, session, bytes| {
            let nonce = state.account(&keys.gateway.address()).nonce;
            credit_on(
                &chain,
                lane,
                &keys.gateway,
                nonce,
                &keys.hub,
                session,
                w,
                bytes,
            )
        };
        // 100 bytes round to nothing: taken, free.
        let after = block_of(&state, &keys, vec![credit(&state, 1, 100)]);
        assert_eq!(after.total_money(), state.total_money());
        let burn = state.genesis().burn_address();
        assert!(after.account(&burn).balance.is_zero());
        // Ten megabytes earn 10 base units, a credit's fee is thousands, and the pool holds 5:
        // all five go to the fee, the worker is owed the other five, and the block is made.
        let after = block_of(&after, &keys, vec![credit(&after, 2, 10_000_000)]);
        assert_eq!(after.account(&burn).balance, Amount::from_base_units(5));
        assert!(after.account(&pool).balance.is_zero());
        let worker = after.account(&w);
        assert!(worker.pending.is_empty());
        assert_eq!(worker.owed, Amount::from_base_units(5));
        // A tip on a credit is refused before anything else.
        let tipped = lane.map(|bid| crate::fees::FeeBid {
            tip_per_byte: Amount::from_base_units(1),
            max_per_byte: bid
                .max_per_byte
                .checked_add(Amount::from_base_units(1))
                .unwrap(),
        });
        let nonce = after.account(&keys.gateway.address()).nonce;
        let tx = credit_on(
            &chain,
            tipped,
            &keys.gateway,
            nonce,
            &keys.hub,
            3,
            w,
            2_000_000,
        );
        assert_eq!(
            stateless_results(after.genesis(), &[tx])[0],
            Err(TxError::TipOnReservedLane)
        );
    }

    /// Keys that each hold enough for a few hundred transfers, on a chain with fees whose
    /// blocks hold `max_txs` transactions.
    fn crowded_chain(senders: u8, max_txs: u32) -> (State, TestKeys, Vec<Keypair>) {
        let (mut genesis, keys) = crate::genesis::tests::test_genesis_v2();
        genesis.params.max_block_txs = max_txs;
        let crowd: Vec<Keypair> = (0..senders)
            .map(|i| Keypair::from_seed(&[i + 100; 32]))
            .collect();
        for key in &crowd {
            genesis.allocations.push(crate::genesis::Allocation {
                address: key.address(),
                amount: Amount::parse("10").unwrap(),
            });
        }
        (State::from_genesis(genesis), keys, crowd)
    }

    /// Under a flood of transfers, the open lane fills to its share and no further, the base
    /// fee climbs an eighth a block, and a credit still lands in the reserved lane at its fixed
    /// price; once the flood stops, the fee falls back.
    #[test]
    fn a_flood_fills_only_the_open_lane_and_raises_its_price() {
        let (mut state, keys, crowd) = crowded_chain(40, 40);
        let (open_bytes, open_txs) = open_capacity(state.genesis());
        assert_eq!(open_txs, 30);
        let payee = keys.bob.address();
        let mut fees = vec![state.base_fee()];
        for session in 1..=4u64 {
            let mut txs: Vec<SignedTx> = crowd
                .iter()
                .map(|key| {
                    let kind = TxKind::Transfer {
                        to: payee,
                        amount: Amount::from_base_units(1),
                    };
                    kind.signed_next(&state, key)
                })
                .collect();
            let lane = state.suggested_bid(Lane::Reserved, Amount::ZERO);
            let nonce = state.account(&keys.gateway.address()).nonce;
            let worker = keys.worker.address();
            let credit = credit_on(
                state.chain_id(),
                lane,
                &keys.gateway,
                nonce,
                &keys.hub,
                session,
                worker,
                1_000_000,
            );
            // The credit comes last among the candidates and still gets in.
            txs.push(credit.clone());
            let produced =
                produce_block(&state, &verified(&state, txs), &keys.validator, 0).unwrap();
            let open: Vec<_> = produced
                .block
                .txs
                .iter()
                .filter(|tx| Lane::of(&tx.tx.kind) == Lane::Open)
                .collect();
            assert_eq!(open.len(), 30);
            let used: u64 = open.iter().map(|tx| tx.to_bytes().len() as u64).sum();
            assert!(used <= open_bytes);
            assert!(produced.block.txs.contains(&credit));
            state = apply_block(&state, &produced.block).unwrap().0;
            fees.push(state.base_fee());
        }
        // Full by count (30 transfers of ~150 bytes are far from its bytes): up an eighth.
        let units: Vec<u64> = fees.iter().map(|f| f.base_units()).collect();
        assert_eq!(units, [1000, 1125, 1265, 1423, 1600]);
        let state = block_of(&state, &keys, vec![]);
        assert_eq!(state.base_fee().base_units(), 1400);
    }

    /// A block whose open lane takes more than its share is refused, whoever made it.
    #[test]
    fn a_block_past_its_open_share_is_refused() {
        let (state, keys, crowd) = crowded_chain(31, 40);
        let txs: Vec<SignedTx> = crowd
            .iter()
            .map(|key| {
                let to = keys.bob.address();
                let amount = Amount::from_base_units(1);
                TxKind::Transfer { to, amount }.signed_next(&state, key)
            })
            .collect();
        let time = state.timestamp_ms() + 1000;
        let block = Block::seal(&state, txs, Hash::ZERO, time, &keys.validator);
        assert!(matches!(
            apply_block(&state, &block),
            Err(BlockError::OpenLaneFull {
                txs: 31,
                limit_txs: 30,
                ..
            })
        ));
    }

    #[test]
    fn cumulative_receipts_pay_exactly_earned_and_replays_pay_nothing() {
        let (genesis, keys) = test_genesis();
        let g = genesis.clone();
        let mut state = State::from_genesis(genesis);
        let worker = keys.worker.address();
        // Many small steps that each round down must still sum to earned(final).
        let mut counts: Vec<u64> = (1..=40).map(|i| i * 31_337).collect();
        counts.push(1_277_952);
        for c in &counts {
            let tx = with_nonce(&state, &keys, receipt(&keys, &keys.hub, 7, worker, *c));
            state = block_of(&state, &keys, vec![tx]);
        }
        let account = state.account(&worker);
        let total = account
            .balance
            .checked_add(account.pending_total())
            .unwrap();
        assert_eq!(total, g.earned(1_277_952).unwrap());
        for stale in [1_277_952, 5] {
            let tx = with_nonce(&state, &keys, receipt(&keys, &keys.hub, 7, worker, stale));
            assert!(matches!(
                rejection(&state, &keys, tx),
                TxError::ReceiptNotNewer { .. }
            ));
        }
        let thief = keys.alice.address();
        let tx = with_nonce(
            &state,
            &keys,
            receipt(&keys, &keys.hub, 7, thief, 9_000_000),
        );
        assert!(matches!(
            rejection(&state, &keys, tx),
            TxError::SessionWorkerMismatch { .. }
        ));
        let too_big = with_nonce(
            &state,
            &keys,
            receipt(&keys, &keys.hub, 8, worker, u64::MAX),
        );
        assert_eq!(rejection(&state, &keys, too_big), TxError::Overflow);
    }

    #[test]
    fn only_genesis_gateways_submit_and_only_genesis_hubs_sign() {
        let (genesis, keys) = test_genesis();
        let state = State::from_genesis(genesis);
        let worker = keys.worker.address();
        let by_alice = credit_from(&keys.alice, 0, &keys.hub, 1, worker, 1000);
        assert_eq!(
            rejection(&state, &keys, by_alice),
            TxError::NotAGateway(keys.alice.address())
        );
        let fake_hub = credit_from(&keys.gateway, 0, &keys.bob, 1, worker, 1000);
        assert_eq!(
            rejection(&state, &keys, fake_hub),
            TxError::NotAHub(keys.bob.address())
        );
    }

    #[test]
    fn transfers_check_nonce_and_funds_and_replays_fail() {
        let (genesis, keys) = test_genesis();
        let state = State::from_genesis(genesis);
        let (alice, bob) = (keys.alice.address(), keys.bob.address());
        let pay = transfer(&keys.alice, 0, bob, "1.5");
        let after = block_of(&state, &keys, vec![pay.clone()]);
        assert_eq!(
            after.account(&alice).balance,
            Amount::parse("98.5").unwrap()
        );
        assert_eq!(after.account(&bob).balance, Amount::parse("6.5").unwrap());
        assert_eq!(after.account(&alice).nonce, 1);
        assert_eq!(
            rejection(&after, &keys, pay),
            TxError::NonceMismatch {
                expected: 1,
                got: 0
            }
        );
        let skip = transfer(&keys.alice, 5, bob, "1");
        assert_eq!(
            rejection(&after, &keys, skip),
            TxError::NonceMismatch {
                expected: 1,
                got: 5
            }
        );
        let overdraw = transfer(&keys.bob, 0, alice, "6.500000001");
        assert!(matches!(
            rejection(&after, &keys, overdraw),
            TxError::InsufficientFunds { .. }
        ));
    }

    #[test]
    fn an_empty_pool_records_owed_and_a_refill_pays_it() {
        let (mut genesis, keys) = test_genesis();
        genesis.params.rewards_pool = Amount::from_base_units(1_000_000);
        let pool = genesis.rewards_pool_address();
        let state = State::from_genesis(genesis.clone());
        let worker = keys.worker.address();
        let state = block_of(
            &state,
            &keys,
            vec![receipt(&keys, &keys.hub, 1, worker, 1_277_952)],
        );
        let account = state.account(&worker);
        assert_eq!(account.pending_total().base_units(), 1_000_000);
        assert_eq!(account.owed.base_units(), 7_945_664);
        assert_eq!(state.account(&pool).balance, Amount::ZERO);
        assert_eq!(
            state.total_money(),
            u128::from(genesis.total_supply().base_units())
        );
        // Anyone may refill the pool with a transfer; the claim is paid at the block's end.
        let refill = transfer(&keys.alice, 0, pool, "1");
        let state = block_of(&state, &keys, vec![refill]);
        let account = state.account(&worker);
        assert_eq!(account.owed, Amount::ZERO);
        assert_eq!(account.pending_total().base_units(), 8_945_664);
        assert_eq!(state.total_owed(), 0);
        assert_eq!(
            state.total_money(),
            u128::from(genesis.total_supply().base_units())
        );
    }

    #[test]
    fn another_node_applying_the_block_reaches_the_same_state() {
        let (genesis, keys) = test_genesis();
        let state = State::from_genesis(genesis);
        let txs = vec![
            transfer(&keys.alice, 0, keys.bob.address(), "3"),
            receipt(&keys, &keys.hub, 1, keys.worker.address(), 2_000_000),
        ];
        let produced = produce_block(&state, &verified(&state, txs), &keys.validator, 5).unwrap();
        let (applied, changes) = apply_block(&state, &produced.block).unwrap();
        assert_eq!(applied.root(), produced.state.root());
        assert_eq!(applied.block_hash(), produced.block.hash());
        assert_eq!(changes, produced.changes);
        // Time never goes backwards, even if the producer's clock does.
        assert_eq!(produced.block.header.timestamp_ms, state.timestamp_ms());
    }

    #[test]
    fn tampered_blocks_are_rejected_and_the_parent_is_untouched() {
        let (genesis, keys) = test_genesis();
        let state = State::from_genesis(genesis);
        let root = state.root();
        let txs = vec![transfer(&keys.alice, 0, keys.bob.address(), "3")];
        let good = produce_block(&state, &verified(&state, txs), &keys.validator, 1)
            .unwrap()
            .block;
        let resign = |mut block: Block, signer: &Keypair| {
            block.header.proposer = signer.address();
            block.signature = intent::sign(signer, Intent::Block, "kvasir-test", &block.header);
            block
        };
        let check = |block: Block, want: fn(&BlockError) -> bool| {
            let err = apply_block(&state, &block).unwrap_err();
            assert!(want(&err), "{err}");
        };
        let mut b = good.clone();
        b.header.height = 5;
        check(resign(b, &keys.validator), |e| {
            matches!(e, BlockError::WrongHeight { .. })
        });
        let mut b = good.clone();
        b.header.prev_hash = Hash::ZERO;
        check(resign(b, &keys.validator), |e| {
            matches!(e, BlockError::WrongPrevHash { .. })
        });
        check(resign(good.clone(), &keys.alice), |e| {
            matches!(e, BlockError::NotAValidator(_))
        });
        let mut b = good.clone();
        b.header.timestamp_ms += 1;
        check(b, |e| matches!(e, BlockError::BadSignature));
        let mut b = good.clone();
        b.txs
            .push(transfer(&keys.bob, 0, keys.alice.address(), "1"));
        check(b, |e| matches!(e, BlockError::TxRoot { .. }));
        let mut b = good.clone();
        b.header.state_root = Hash::ZERO;
        check(resign(b, &keys.validator), |e| {
            matches!(e, BlockError::StateRoot { .. })
        });
        let mut b = good.clone();
        b.txs = vec![transfer(&keys.alice, 1, keys.bob.address(), "3")];
        b.header.tx_root = Block::tx_root(&b.txs);
        check(resign(b, &keys.validator), |e| {
            matches!(
                e,
                BlockError::InvalidTx {
                    index: 0,
                    error: TxError::NonceMismatch { .. }
                }
            )
        });
        let mut b = good.clone();
        b.header.chain_id = "other".into();
        check(b, |e| matches!(e, BlockError::WrongChain { .. }));
        assert_eq!(state.root(), root);
        assert_eq!(state.height(), 0);
    }

    #[test]
    fn block_time_never_goes_back_never_reaches_u64_max_and_stays_near_the_clock() {
        let (genesis, keys) = test_genesis();
        let state = State::from_genesis(genesis);
        let parent_time = state.timestamp_ms();
        let at = |timestamp_ms: u64| {
            let mut block = produce_block(&state, &[], &keys.validator, parent_time)
                .unwrap()
                .block;
            block.header.timestamp_ms = timestamp_ms;
            block.signature =
                intent::sign(&keys.validator, Intent::Block, "kvasir-test", &block.header);
            block
        };
        // The parent's own time is allowed (a producer whose clock is behind stamps it).
        assert!(apply_block(&state, &at(parent_time)).is_ok());
        assert_eq!(
            apply_block(&state, &at(parent_time - 1)).unwrap_err(),
            BlockError::TimestampBackwards {
                parent: parent_time,
                got: parent_time - 1
            }
        );
        for far in [MAX_TIMESTAMP_MS + 1, u64::MAX] {
            assert_eq!(
                apply_block(&state, &at(far)).unwrap_err(),
                BlockError::TimestampOutOfRange(far)
            );
            assert!(matches!(
                produce_block(&state, &[], &keys.validator, far),
                Err(BlockError::TimestampOutOfRange(_))
            ));
        }
        assert!(apply_block(&state, &at(MAX_TIMESTAMP_MS)).is_ok());
        // Against a clock: up to the drift ahead is fine, beyond is refused, without overflow.
        let now = parent_time + 60_000;
        for ok in [0, now, now + MAX_CLOCK_DRIFT_MS] {
            assert_eq!(check_clock(&at(ok).header, now), Ok(()));
        }
        for ahead in [now + MAX_CLOCK_DRIFT_MS + 1, u64::MAX] {
            assert_eq!(
                check_clock(&at(ahead).header, now),
                Err(BlockError::AheadOfClock { now, got: ahead })
            );
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Transfer {
            from: usize,
            to: usize,
            units: u64,
            nonce_skew: i8,
        },
        Credit {
            by_gateway: bool,
            real_hub: bool,
            session: u64,
            worker: usize,
            bytes: u64,
        },
        Bond {
            who: usize,
            units: u64,
            unbond: bool,
        },
        Evidence {
            reporter: usize,
            worker: usize,
            session: u64,
            wrong: bool,
        },
        EndBlock,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..4usize, 0..5usize, 0..20_000_000_000u64, prop_oneof![8 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)])
                .prop_map(|(from, to, units, nonce_skew)| Op::Transfer { from, to, units, nonce_skew }),
            3 => (prop::bool::weighted(0.9), prop::bool::weighted(0.9), 0..3u64, 0..4usize, 0..400_000_000u64)
                .prop_map(|(by_gateway, real_hub, session, worker, bytes)| Op::Credit { by_gateway, real_hub, session, worker, bytes }),
            2 => (0..4usize, 0..30_000_000_000u64, any::<bool>())
                .prop_map(|(who, units, unbond)| Op::Bond { who, units, unbond }),
            1 => (0..4usize, 0..4usize, 0..3u64, prop::bool::weighted(0.8))
                .prop_map(|(reporter, worker, session, wrong)| Op::Evidence { reporter, worker, session, wrong }),
            1 => Just(Op::EndBlock),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn money_is_conserved_and_invalid_txs_change_nothing(ops in proptest::collection::vec(op(), 1..60)) {
            let (genesis, keys) = crate::genesis::tests::bonded_genesis();
            conserves(genesis, keys, ops, Vec::new())?;
        }

        /// The same on a chain with fees: every transaction's fee is burned or tipped to the
        /// proposer, and a bid too low for the price is refused and changes nothing.
        #[test]
        fn money_is_conserved_with_fees(
            ops in proptest::collection::vec(op(), 1..60),
            bids in proptest::collection::vec((0u64..3000, prop::bool::weighted(0.1)), 60),
        ) {
            let (genesis, keys) = crate::genesis::tests::bonded_genesis_v2();
            conserves(genesis, keys, ops, bids)?;
        }
    }

    /// Runs `ops` on `genesis`, each transaction bidding a tip and, where `bids` says, a most
    /// below the price (on a chain with fees), blocks closing where the ops say; money is
    /// constant throughout, and a refused transaction changes nothing.
    fn conserves(
        mut genesis: Genesis,
        keys: TestKeys,
        ops: Vec<Op>,
        bids: Vec<(u64, bool)>,
    ) -> Result<(), TestCaseError> {
        {
            // A small pool, so that owed claims and refills happen too.
            genesis.params.rewards_pool = Amount::from_base_units(2_000_000);
            let supply = u128::from(genesis.total_supply().base_units());
            let users = [&keys.alice, &keys.bob, &keys.worker, &keys.gateway];
            let pool = genesis.rewards_pool_address();
            let g: Genesis = genesis.clone();
            let mut state = State::from_genesis(genesis)
                .with_answer_check(std::sync::Arc::new(crate::tx::evidence::tests::HashCheck));
            let mut height = 0;
            let mut paying = 0;
            state.begin_block(keys.validator.address());
            let chain = g.chain_id();
            for (i, op) in ops.into_iter().enumerate() {
                let (tip, low) = bids.get(i).copied().unwrap_or_default();
                // The reserved lane takes no tip.
                let tip_in = |lane| if lane == Lane::Reserved { 0 } else { tip };
                let bid = |kind: &TxKind| {
                    let lane = Lane::of(kind);
                    let mut bid =
                        state.suggested_bid(lane, Amount::from_base_units(tip_in(lane)))?;
                    if low {
                        bid.max_per_byte = Amount::from_base_units(tip);
                    }
                    Some(bid)
                };
                let tx = match op {
                    Op::EndBlock => {
                        height += 1;
                        finish(
                            &mut state,
                            height,
                            (height * 1_000_000 % 7_000_000, height % 3),
                        )
                        .unwrap();
                        state.set_head(height, Hash::ZERO, 0);
                        state.begin_block(keys.validator.address());
                        prop_assert_eq!(state.total_money(), supply);
                        continue;
                    }
                    Op::Transfer {
                        from,
                        to,
                        units,
                        nonce_skew,
                    } => {
                        let sender = users[from];
                        let nonce = state
                            .account(&sender.address())
                            .nonce
                            .wrapping_add_signed(nonce_skew.into());
                        let to = users.get(to).map_or(pool, |k| k.address());
                        let kind = TxKind::Transfer {
                            to,
                            amount: Amount::from_base_units(units),
                        };
                        Tx {
                            chain_id: chain.clone(),
                            sender: sender.address(),
                            nonce,
                            fee: bid(&kind),
                            kind,
                        }
                        .sign(sender)
                    }
                    Op::Credit {
                        by_gateway,
                        real_hub,
                        session,
                        worker,
                        bytes,
                    } => {
                        let sender = if by_gateway {
                            &keys.gateway
                        } else {
                            &keys.alice
                        };
                        let hub = if real_hub { &keys.hub } else { &keys.bob };
                        let nonce = state.account(&sender.address()).nonce;
                        let fee = g.params.fees.map(|fees| {
                            let mut bid = FeeBid::suggested(
                                &fees,
                                state.base_fee(),
                                Lane::Reserved,
                                Amount::ZERO,
                            );
                            if low {
                                bid.max_per_byte = Amount::from_base_units(tip);
                            }
                            bid
                        });
                        credit_on(
                            &chain,
                            fee,
                            sender,
                            nonce,
                            hub,
                            session,
                            users[worker].address(),
                            bytes,
                        )
                    }
                    Op::Bond { who, units, unbond } => {
                        let amount = Amount::from_base_units(units);
                        let kind = if unbond {
                            TxKind::Unbond { amount }
                        } else {
                            TxKind::Bond { amount }
                        };
                        let fee = bid(&kind);
                        kind.signed_paying(
                            &chain,
                            fee,
                            users[who],
                            state.account(&users[who].address()).nonce,
                        )
                    }
                    Op::Evidence {
                        reporter,
                        worker,
                        session,
                        wrong,
                    } => {
                        let answer = if wrong {
                            vec![0; 32]
                        } else {
                            blake3::hash(b"rows").as_bytes().to_vec()
                        };
                        let evidence = crate::tx::evidence::tests::evidence(
                            &keys,
                            users[worker],
                            session,
                            7,
                            answer,
                            &chain,
                        );
                        let reporter = users[reporter];
                        let kind =
                            crate::tx::evidence::tests::evidence_kind(state.genesis(), evidence);
                        let fee = bid(&kind);
                        kind.signed_paying(
                            &chain,
                            fee,
                            reporter,
                            state.account(&reporter.address()).nonce,
                        )
                    }
                };
                let before_root = {
                    let mut s = state.clone();
                    s.commit_dirty();
                    s.root()
                };
                let before_accounts: Vec<_> =
                    state.accounts().map(|(a, acc)| (*a, acc.clone())).collect();
                let result = stateless_results(&g, std::slice::from_ref(&tx))
                    .remove(0)
                    .and_then(|()| run_tx(&mut state, &tx));
                if result.is_ok() && !matches!(tx.tx.kind, TxKind::Credit(_)) {
                    paying += 1;
                }
                if result.is_err() {
                    let mut s = state.clone();
                    s.commit_dirty();
                    prop_assert_eq!(s.root(), before_root);
                    let after: Vec<_> =
                        state.accounts().map(|(a, acc)| (*a, acc.clone())).collect();
                    prop_assert_eq!(after, before_accounts);
                }
                prop_assert_eq!(state.total_money(), supply);
            }
            // Every transaction but a credit pays from its sender's balance: burned, at least.
            if g.params.fees.is_some() && paying > 0 {
                prop_assert!(!state.account(&g.burn_address()).balance.is_zero());
            }
        }
        Ok(())
    }
}
