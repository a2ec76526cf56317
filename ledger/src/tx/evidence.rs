//! The evidence action: anyone who holds a worker's signed answer that is wrong proves it on
//! chain. The transaction carries the request body exactly as the worker received it, the
//! response body it sent and its answer signature; a validator checks the signature, then
//! recomputes the named experts on the request's rows with the model the genesis pins and
//! compares bits. Kernels are bit-exact, so a correct answer has one value, and an honest
//! worker can never be slashed. On a chain without an evidence deposit (format 1), evidence
//! that recomputes to the worker's answer is refused. On one with a deposit (every format-2
//! chain) its reporter must hold the deposit beside the fee, which is all a validator checks
//! before the block: the block recomputes, and evidence that recomputes to the worker's
//! answer is taken and burns the deposit, so that a fake costs its maker a deposit where it
//! used to cost validators a recomputation for nothing.
//!
//! Accepted evidence cancels the session's pending rewards (back to the rewards pool, or to
//! the escrow of the order that paid them) and
//! the worker's owed claims, slashes `slash_fraction` of the worker's bond, bonded then
//! unbonding (`reporter_share` of it to the reporter, the rest burned), jails the key for
//! `jail_blocks` and records the conviction with the key (`Account::convictions`): that
//! session pays it nothing more and no second evidence of its answers there is taken. The
//! session's receipt mark is the hub's alone: evidence, which anyone can make name any
//! session, never writes it.

use borsh::{BorshDeserialize, BorshSerialize};

use crate::amount::Amount;
use crate::answer::{body_hash, AnswerClaim};
use crate::genesis::Genesis;
use crate::hash::Hash;
use crate::intent::{self, Intent};
use crate::keys::{Address, Signature, SignatureCheck};
use crate::limits::{MAX_EVIDENCE_TX_BYTES, MAX_EXPERT_CONFIG_BYTES, MAX_EXPERT_PATH};
use crate::state::{Account, Conviction, SessionKey, Staged, State};

use super::{TxError, TxSignature};

/// A worker's signed answer, offered as proof that it is wrong.
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct Evidence {
    pub worker: Address,
    pub hub: Address,
    pub session: u64,
    pub request_id: u64,
    pub model_id: String,
    /// The request frame's body as the worker received it.
    pub request_body: Vec<u8>,
    /// The response frame's body the worker sent, without its signature.
    pub response_body: Vec<u8>,
    pub signature: Signature,
}

/// Evidence on a format-2 chain: the worker's answer and the weights of the expert whose
/// partial it got wrong, so that a validator recomputes from these bytes alone, with no
/// checkpoint of its own.
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct ExpertEvidence {
    pub evidence: Evidence,
    pub weights: ExpertWeights,
}

/// One expert's weights as the genesis pin commits to them: the pinned config.json (by
/// `ModelPin::config_hash`), which gives the shapes and where the expert's leaf sits, and
/// the three matrices as the checkpoint stores them, with their dtypes, which make that
/// leaf under `ModelPin::experts_root` (by `path`).
#[derive(Clone, Debug, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct ExpertWeights {
    /// The disputed expert: one of the request's, in the request's layer.
    pub expert: u16,
    /// The stored dtype of gate, up and down (the engine's stable tags), which the leaf
    /// commits to.
    pub dtypes: [u8; 3],
    pub config: Vec<u8>,
    pub gate: Vec<u8>,
    pub up: Vec<u8>,
    pub down: Vec<u8>,
    /// The leaf's Merkle path to the pin's root, lowest sibling first
    /// (`hash::merkle_path`).
    pub path: Vec<Hash>,
}

impl ExpertWeights {
    /// The weights' bytes, as a pin's `expert_bytes` counts them.
    pub fn byte_len(&self) -> u64 {
        [&self.gate, &self.up, &self.down]
            .iter()
            .map(|m| m.len() as u64)
            .sum()
    }
}

impl Evidence {
    /// What the worker signed, if this is its answer.
    pub fn claim(&self) -> AnswerClaim {
        AnswerClaim {
            hub: self.hub,
            session: self.session,
            request_id: self.request_id,
            model_id: self.model_id.clone(),
            request_hash: body_hash(&self.request_body),
            response_hash: body_hash(&self.response_body),
        }
    }

    fn session_key(&self) -> SessionKey {
        SessionKey {
            hub: self.hub,
            session_id: self.session,
        }
    }
}

/// Format: weights on a format-2 chain and only there, within the pin's bounds and with
/// the pinned config; a pinned model, a genesis hub, and the worker's answer signature over
/// exactly these bodies (returned, to verify with the rest of the batch).
pub(super) fn check_stateless(
    genesis: &Genesis,
    chain_id: &str,
    evidence: &Evidence,
    weights: Option<&ExpertWeights>,
) -> Result<Vec<TxSignature>, TxError> {
    let Some(pin) = genesis.model(&evidence.model_id) else {
        return Err(TxError::UnpinnedModel(evidence.model_id.clone()));
    };
    let expected = genesis.params.format >= 2;
    if weights.is_some() != expected {
        return Err(TxError::EvidenceFormat { expected });
    }
    if let Some(weights) = weights {
        let bodies = evidence.request_body.len() + evidence.response_body.len();
        let most = pin.shape.map_or(0, |s| s.expert_bytes);
        let refused = if bodies > MAX_EVIDENCE_TX_BYTES {
            Some(format!(
                "the two bodies take {bodies} bytes, at most {MAX_EVIDENCE_TX_BYTES}"
            ))
        } else if weights.byte_len() > most {
            Some(format!(
                "{} bytes of weights, and this model's largest expert has {most}",
                weights.byte_len()
            ))
        } else if weights.config.len() > MAX_EXPERT_CONFIG_BYTES
            || Hash(*blake3::hash(&weights.config).as_bytes()) != pin.config_hash
        {
            Some("the config is not the one the genesis pins".to_string())
        } else if weights.path.len() > MAX_EXPERT_PATH {
            Some(format!("a path of {} hashes", weights.path.len()))
        } else {
            None
        };
        if let Some(why) = refused {
            return Err(TxError::EvidenceWeights(why));
        }
    }
    if !genesis.is_hub(&evidence.hub) {
        return Err(TxError::NotAHub(evidence.hub));
    }
    let claim = evidence.claim();
    let message = intent::signing_message(Intent::Answer, chain_id, &claim);
    let check = SignatureCheck::new(&evidence.worker, &message, &evidence.signature)
        .map_err(|_| TxError::BadAnswerSignature)?;
    Ok(vec![TxSignature {
        check,
        error: TxError::BadAnswerSignature,
    }])
}

/// The deposit evidence holds on this chain (`FeeParams::evidence_deposit`); zero on a chain
/// without one, where evidence that does not reproduce a wrong answer is refused instead.
pub fn deposit(genesis: &Genesis) -> Amount {
    genesis
        .params
        .fees
        .map_or(Amount::ZERO, |fees| fees.evidence_deposit)
}

/// The session is not another worker's (as the hub's receipts say) and the worker is not
/// convicted in it yet. Then, on a chain with a deposit, the reporter (`reporter`, its fee
/// paid) holds the deposit, and the recomputation waits for the block, which keeps or burns
/// the deposit by its outcome; on one without, recomputing the request must give other bits
/// than the worker answered.
pub(super) fn check_stateful(
    state: &State,
    reporter: &Account,
    evidence: &Evidence,
    weights: Option<&ExpertWeights>,
) -> Result<(), TxError> {
    check_standing(state, evidence)?;
    let deposit = deposit(state.genesis());
    if deposit.is_zero() {
        return check_recomputed(state, evidence, weights);
    }
    if reporter.balance < deposit {
        return Err(TxError::InsufficientFunds {
            balance: reporter.balance,
            needed: deposit,
        });
    }
    Ok(())
}

/// Everything `check_stateful` asks but the recomputation: cheap, so a validator asks it
/// before it lets evidence wait for its turn to recompute.
pub fn check_standing(state: &State, evidence: &Evidence) -> Result<(), TxError> {
    let key = evidence.session_key();
    if let Some(worker) = state.session_worker(&key) {
        if worker != evidence.worker {
            return Err(TxError::SessionWorkerMismatch {
                stored: worker,
                got: evidence.worker,
            });
        }
    }
    let worker = state.account(&evidence.worker);
    if worker.is_convicted_in(&key) {
        return Err(TxError::AlreadyConvicted);
    }
    // Evidence costs validators a recomputation and a block room: it is taken only when it
    // can take something real (pending rewards of the session, or at least a full bond,
    // bonded or unbonding), so a key with a token bond cannot flood the chain with proofs
    // against itself, and each bonded key can be convicted only until its stake falls
    // below `min_bond`.
    let session_pending = worker.pending.iter().any(|p| p.session == key);
    let stake = worker
        .bonded
        .checked_add(worker.unbonding_total())
        .ok_or(TxError::Overflow)?;
    let min_bond = state.genesis().params.min_bond;
    if !session_pending && (stake.is_zero() || stake < min_bond) {
        return Err(TxError::NothingAtStake(evidence.worker));
    }
    Ok(())
}

/// Recomputing the request with the pinned model (on a format-2 chain, the disputed expert
/// from the weights the evidence carries) gives other bits than the worker answered.
fn check_recomputed(
    state: &State,
    evidence: &Evidence,
    weights: Option<&ExpertWeights>,
) -> Result<(), TxError> {
    let check = state.answer_check().ok_or(TxError::CannotCheckEvidence)?;
    let model = state
        .genesis()
        .model(&evidence.model_id)
        .ok_or_else(|| TxError::UnpinnedModel(evidence.model_id.clone()))?;
    let wrong = check
        .is_wrong(model, evidence, weights)
        .map_err(TxError::EvidenceRequest)?;
    if !wrong {
        return Err(TxError::AnswerWasCorrect);
    }
    Ok(())
}

/// What evidence changes, paid by and to whom; see the module comment. On a chain with a
/// deposit the recomputation happens here: evidence whose answer recomputes to what the
/// worker sent (or whose request is not one the model answers) burns the reporter's deposit
/// and changes nothing else.
pub(super) fn execute(
    staged: &mut Staged,
    reporter: &Address,
    evidence: &Evidence,
    weights: Option<&ExpertWeights>,
) -> Result<(), TxError> {
    let state = staged.state();
    let genesis = state.genesis();
    let deposit = deposit(genesis);
    if !deposit.is_zero() {
        match check_recomputed(state, evidence, weights) {
            Ok(()) => {}
            Err(TxError::AnswerWasCorrect | TxError::EvidenceRequest(_)) => {
                staged.sub_balance(*reporter, deposit)?;
                return staged.add_balance(genesis.burn_address(), deposit);
            }
            Err(other) => return Err(other),
        }
    }
    let key = evidence.session_key();
    let mut worker = staged.account(&evidence.worker);
    // The session's pending rewards go back to where they were paid from: the pool or an
    // order's escrow.
    let (cancelled, kept): (Vec<_>, Vec<_>) =
        worker.pending.into_iter().partition(|p| p.session == key);
    worker.pending = kept;
    // Owed claims are not money (supply is unchanged) but would be paid once the pool refills.
    let owed_forfeited = std::mem::replace(&mut worker.owed, Amount::ZERO);
    let returned = cancelled
        .iter()
        .try_fold(Amount::ZERO, |sum, p| sum.checked_add(p.amount))
        .ok_or(TxError::Overflow)?;
    // The slash, from the bond first, then from the newest unbonding.
    let stake = worker
        .bonded
        .checked_add(worker.unbonding_total())
        .ok_or(TxError::Overflow)?;
    let slashed = genesis.params.slash_fraction.of(stake);
    let mut left = slashed;
    let from_bond = left.min(worker.bonded);
    worker.bonded = worker
        .bonded
        .checked_sub(from_bond)
        .ok_or(TxError::Overflow)?;
    left = left.checked_sub(from_bond).ok_or(TxError::Overflow)?;
    for entry in worker.unbonding.iter_mut().rev() {
        let taken = left.min(entry.amount);
        entry.amount = entry.amount.checked_sub(taken).ok_or(TxError::Overflow)?;
        left = left.checked_sub(taken).ok_or(TxError::Overflow)?;
    }
    worker.unbonding.retain(|u| !u.amount.is_zero());
    let jail_end = staged.height_after(genesis.params.jail_blocks)?;
    worker.jailed_until = worker.jailed_until.max(jail_end);
    let jailed_until = worker.jailed_until;
    staged.set_account(evidence.worker, worker);

    // Only once the worker's account is written: an escrow refund may go to a buyer who is
    // the worker itself, and must not be overwritten by the copy read above.
    let mut to_pool = Amount::ZERO;
    for pay in &cancelled {
        if pay.order == 0 {
            to_pool = to_pool.checked_add(pay.amount).ok_or(TxError::Overflow)?;
        } else {
            crate::market::return_pay(staged, pay.order, pay.amount)?;
        }
    }
    let pool_address = state.rewards_pool();
    let mut pool = staged.account(&pool_address);
    pool.balance = pool.balance.checked_add(to_pool).ok_or(TxError::Overflow)?;
    staged.set_account(pool_address, pool);

    let reward = genesis.params.reporter_share.of(slashed);
    let mut paid = staged.account(reporter);
    paid.balance = paid.balance.checked_add(reward).ok_or(TxError::Overflow)?;
    staged.set_account(*reporter, paid);
    let burn_address = genesis.burn_address();
    let mut burned = staged.account(&burn_address);
    let burn = slashed.checked_sub(reward).ok_or(TxError::Overflow)?;
    burned.balance = burned.balance.checked_add(burn).ok_or(TxError::Overflow)?;
    staged.set_account(burn_address, burned);

    let conviction = Conviction {
        session: key,
        height: staged.height_after(0)?,
        request_id: evidence.request_id,
        reporter: *reporter,
        cancelled: returned,
        owed_forfeited,
        slashed,
        reporter_paid: reward,
        jailed_until,
    };
    // Read again: the worker may be its own reporter.
    let mut convicted = staged.account(&evidence.worker);
    convicted.convictions.push(conviction);
    staged.set_account(evidence.worker, convicted);
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::apply::tests::{block_of, credit_from, rejection};
    use crate::fees::FeeBid;
    use crate::genesis::tests::{bonded_genesis, TestKeys};
    use crate::genesis::ModelPin;
    use crate::keys::Keypair;
    use crate::state::{AnswerCheck, MeterKey};
    use crate::tx::{SignedTx, TxKind};

    /// A stand-in for the model, deterministic as the real one is: a request body is its
    /// session and id (u64 each, little-endian) and a payload; the correct response body
    /// is the blake3 of the payload. Weights (format 2) are the pinned expert's when their
    /// gate is `TEST_GATE`.
    pub(crate) struct HashCheck;

    /// The gate of the test model's one pinned expert.
    pub(crate) const TEST_GATE: &[u8] = b"gate";

    impl AnswerCheck for HashCheck {
        fn is_wrong(
            &self,
            model: &ModelPin,
            evidence: &Evidence,
            weights: Option<&ExpertWeights>,
        ) -> Result<bool, String> {
            let body = &evidence.request_body;
            if model.id != "m" || body.len() < 16 {
                return Err("not a request of model m".into());
            }
            if weights.is_some_and(|w| w.gate != TEST_GATE) {
                return Err("not the pinned expert's weights".into());
            }
            let word = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap());
            if (word(0), word(8)) != (evidence.session, evidence.request_id) {
                return Err("another request".into());
            }
            let correct = body_hash(blake3::hash(&body[16..]).as_bytes());
            Ok(correct != body_hash(&evidence.response_body))
        }
    }

    /// `evidence` as its chain takes it: with the test expert's weights on format 2.
    pub(crate) fn evidence_kind(genesis: &Genesis, evidence: Evidence) -> TxKind {
        if genesis.params.format == 1 {
            return TxKind::Evidence(Box::new(evidence));
        }
        TxKind::ExpertEvidence(Box::new(ExpertEvidence {
            evidence,
            weights: ExpertWeights {
                expert: 0,
                dtypes: [0; 3],
                config: crate::genesis::tests::TEST_CONFIG.to_vec(),
                gate: TEST_GATE.to_vec(),
                up: Vec::new(),
                down: Vec::new(),
                path: Vec::new(),
            },
        }))
    }

    pub(crate) fn request_body(session: u64, id: u64, payload: &[u8]) -> Vec<u8> {
        let mut body = session.to_le_bytes().to_vec();
        body.extend(id.to_le_bytes());
        body.extend(payload);
        body
    }

    /// Evidence of `worker`'s answer `response_body` to request `id` of `session`, signed
    /// by the worker on `chain_id`.
    pub(crate) fn evidence(
        keys: &TestKeys,
        worker: &Keypair,
        session: u64,
        id: u64,
        response_body: Vec<u8>,
        chain_id: &str,
    ) -> Evidence {
        let mut evidence = Evidence {
            worker: worker.address(),
            hub: keys.hub.address(),
            session,
            request_id: id,
            model_id: "m".into(),
            request_body: request_body(session, id, b"rows"),
            response_body,
            signature: Signature([0; 64]),
        };
        evidence.signature = evidence.claim().sign(chain_id, worker);
        evidence
    }

    fn wrong(keys: &TestKeys, session: u64) -> Evidence {
        evidence(keys, &keys.worker, session, 7, vec![0; 32], "kvasir-test")
    }

    fn reported(keys: &TestKeys, state: &State, evidence: Evidence) -> SignedTx {
        let nonce = state.account(&keys.alice.address()).nonce;
        TxKind::Evidence(Box::new(evidence)).signed("kvasir-test", &keys.alice, nonce)
    }

    fn signed(state: &State, key: &Keypair, kind: TxKind) -> SignedTx {
        kind.signed("kvasir-test", key, state.account(&key.address()).nonce)
    }

    /// `state` after the worker gives bob `amount` KVR and bob bonds all of it.
    fn bob_bonds(state: State, keys: &TestKeys, amount: &str) -> State {
        let to = keys.bob.address();
        let gift = TxKind::Transfer {
            to,
            amount: kvr(amount),
        };
        let state = block_of(&state, keys, vec![signed(&state, &keys.worker, gift)]);
        let bond = TxKind::Bond {
            amount: kvr(amount),
        };
        block_of(&state, keys, vec![signed(&state, &keys.bob, bond)])
    }

    /// What the worker's conviction in the hub's `session` did.
    fn conviction_of(state: &State, keys: &TestKeys, session_id: u64) -> Conviction {
        let key = SessionKey {
            hub: keys.hub.address(),
            session_id,
        };
        let worker = state.account(&keys.worker.address());
        let found = worker.convictions.iter().find(|c| c.session == key);
        found.expect("a conviction").clone()
    }

    fn kvr(text: &str) -> Amount {
        Amount::parse(text).unwrap()
    }

    /// A worker that bonded 20 KVR and was credited in sessions 1 and 2 of the hub.
    fn bonded_and_credited() -> (State, TestKeys) {
        let (genesis, keys) = bonded_genesis();
        bonded_and_credited_on(
            State::from_genesis(genesis).with_answer_check(Arc::new(HashCheck)),
            keys,
        )
    }

    fn bonded_and_credited_on(state: State, keys: TestKeys) -> (State, TestKeys) {
        let bond = signed(&state, &keys.worker, TxKind::Bond { amount: kvr("20") });
        let state = block_of(&state, &keys, vec![bond]);
        let w = keys.worker.address();
        let credits = vec![
            credit_from(&keys.gateway, 0, &keys.hub, 1, w, 10_000_000),
            credit_from(&keys.gateway, 1, &keys.hub, 2, w, 20_000_000),
        ];
        let state = block_of(&state, &keys, credits);
        (state, keys)
    }

    /// `HashCheck`, counting its recomputations.
    struct Counted(std::sync::atomic::AtomicUsize);

    impl AnswerCheck for Counted {
        fn is_wrong(
            &self,
            model: &ModelPin,
            evidence: &Evidence,
            weights: Option<&ExpertWeights>,
        ) -> Result<bool, String> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            HashCheck.is_wrong(model, evidence, weights)
        }
    }

    /// On a chain with a deposit (format 2) evidence is admitted on its standing, fee and
    /// deposit alone, with no recomputation; the block recomputes. A wrong answer convicts,
    /// and the reporter keeps its deposit and gets its share; a right one is taken, burns the
    /// reporter's deposit, and the worker keeps everything. A reporter without the deposit
    /// is refused before anything is recomputed.
    #[test]
    fn on_a_chain_with_a_deposit_the_block_judges_and_a_fake_burns_its_deposit() {
        let (genesis, keys) = crate::genesis::tests::bonded_genesis_v2();
        let deposit = deposit(&genesis);
        assert_eq!(deposit, kvr("1"));
        let counter = Arc::new(Counted(Default::default()));
        let counted = || counter.0.load(std::sync::atomic::Ordering::Relaxed);
        let state = State::from_genesis(genesis).with_answer_check(counter.clone());
        let bond = TxKind::Bond { amount: kvr("20") }.signed_next(&state, &keys.worker);
        let state = block_of(&state, &keys, vec![bond]);
        let chain = state.chain_id().to_string();
        let report = |state: &State, reporter: &Keypair, session, answer: Vec<u8>| {
            let evidence = evidence(&keys, &keys.worker, session, 7, answer, &chain);
            evidence_kind(state.genesis(), evidence).signed_next(state, reporter)
        };
        let right = blake3::hash(b"rows").as_bytes().to_vec();
        let (alice, w) = (keys.alice.address(), keys.worker.address());

        // A fake: admitted without a recomputation, then taken, and the deposit burned.
        let fake = report(&state, &keys.alice, 1, right);
        crate::tx::check_action(&state, &fake).unwrap();
        assert_eq!(counted(), 0);
        let fee = crate::tx::fee_charge(&state, &fake)
            .unwrap()
            .total()
            .unwrap();
        let burn = state.genesis().burn_address();
        let after = block_of(&state, &keys, vec![fake]);
        assert!(counted() >= 1);
        let spent = state
            .account(&alice)
            .balance
            .checked_sub(after.account(&alice).balance);
        assert_eq!(spent, deposit.checked_add(fee));
        let burned = after
            .account(&burn)
            .balance
            .checked_sub(state.account(&burn).balance);
        assert!(burned.unwrap() >= deposit);
        assert_eq!(after.account(&w), state.account(&w));
        assert_eq!(after.total_money(), state.total_money());

        // The truth: the worker is convicted, the reporter keeps its deposit, pays its fee and
        // gets its share.
        let real = report(&after, &keys.alice, 2, vec![0; 32]);
        let fee = crate::tx::fee_charge(&after, &real)
            .unwrap()
            .total()
            .unwrap();
        let convicted = block_of(&after, &keys, vec![real]);
        let conviction = conviction_of(&convicted, &keys, 2);
        let balance = |s: &State| s.account(&alice).balance;
        assert_eq!(
            balance(&convicted),
            balance(&after)
                .checked_sub(fee)
                .and_then(|b| b.checked_add(conviction.reporter_paid))
                .unwrap()
        );

        // Without the deposit beside its fee, refused at once.
        let poor = Keypair::from_seed(&[31; 32]);
        let gift = TxKind::Transfer {
            to: poor.address(),
            amount: kvr("0.5"),
        }
        .signed_next(&convicted, &keys.alice);
        let state = block_of(&convicted, &keys, vec![gift]);
        let before = counted();
        let refused = crate::tx::check_action(&state, &report(&state, &poor, 3, vec![0; 32]));
        assert!(
            matches!(refused, Err(TxError::InsufficientFunds { needed, .. }) if needed == deposit),
            "{refused:?}"
        );
        assert_eq!(counted(), before);
    }

    #[test]
    fn accepted_evidence_cancels_the_session_slashes_pays_the_reporter_burns_and_jails() {
        let (state, keys) = bonded_and_credited();
        let (w, pool) = (keys.worker.address(), state.rewards_pool());
        let before = state.account(&w);
        assert_eq!(before.pending_total(), kvr("0.21"));
        let pool_before = state.account(&pool).balance;
        let alice_before = state.account(&keys.alice.address()).balance;
        let supply = state.total_money();
        let tx = reported(&keys, &state, wrong(&keys, 1));
        let state = block_of(&state, &keys, vec![tx]);
        let after = state.account(&w);
        // Session 1's 0.07 KVR goes back to the pool to the base unit; session 2's stays.
        assert_eq!(after.pending_total(), kvr("0.14"));
        assert_eq!(
            state.account(&pool).balance,
            pool_before.checked_add(kvr("0.07")).unwrap()
        );
        // Half the 20 KVR bond slashed: 1 KVR to the reporter, 9 burned.
        assert_eq!(after.bonded, kvr("10"));
        assert_eq!(
            state.account(&keys.alice.address()).balance,
            alice_before.checked_add(kvr("1")).unwrap()
        );
        let burned = state.account(&state.genesis().burn_address()).balance;
        assert_eq!(burned, kvr("9"));
        assert_eq!(state.total_money(), supply);
        assert_eq!(after.jailed_until, state.height() + 4);
        let conviction = conviction_of(&state, &keys, 1);
        assert_eq!(
            (
                conviction.cancelled,
                conviction.slashed,
                conviction.reporter_paid
            ),
            (kvr("0.07"), kvr("10"), kvr("1"))
        );
        assert_eq!(conviction.reporter, keys.alice.address());
        assert!(after.is_jailed(state.height() + 1));
        assert!(!after.is_jailed(state.height() + 4));
        // The same session cannot be convicted twice, even with another wrong answer.
        let again = evidence(&keys, &keys.worker, 1, 8, vec![1; 32], "kvasir-test");
        let again = reported(&keys, &state, again);
        assert_eq!(rejection(&state, &keys, again), TxError::AlreadyConvicted);
        // Its later receipts are taken but pay nothing, as do the jailed worker's others.
        let pending = state.account(&w).pending_total();
        let late = vec![
            credit_from(&keys.gateway, 2, &keys.hub, 1, w, 90_000_000),
            credit_from(&keys.gateway, 3, &keys.hub, 3, w, 90_000_000),
        ];
        let state = block_of(&state, &keys, late);
        assert_eq!(state.account(&w).pending_total(), pending);
        assert_eq!(state.total_money(), supply);
    }

    #[test]
    fn a_block_holds_at_most_max_block_evidence_pieces_of_evidence() {
        use crate::apply::tests::verified;
        use crate::apply::{apply_block, produce_block, BlockError, MAX_BLOCK_EVIDENCE};
        use crate::block::Block;
        let (state, keys) = bonded_and_credited();
        let w = keys.worker.address();
        // Sessions 3.. credited too: one wrong answer to report in each.
        let sessions = 3..3 + MAX_BLOCK_EVIDENCE as u64 + 1;
        let credits = sessions
            .clone()
            .enumerate()
            .map(|(i, s)| credit_from(&keys.gateway, 2 + i as u64, &keys.hub, s, w, 1_000_000))
            .collect();
        let state = block_of(&state, &keys, credits);
        let nonce = state.account(&keys.alice.address()).nonce;
        let report = |n: u64, session| {
            let kind = TxKind::Evidence(Box::new(wrong(&keys, session)));
            kind.signed("kvasir-test", &keys.alice, nonce + n)
        };
        let mut reports: Vec<SignedTx> = sessions
            .enumerate()
            .map(|(n, s)| report(n as u64, s))
            .collect();
        // Alice's transfer after them waits with them: it would fail on its nonce.
        let after = TxKind::Transfer {
            to: keys.bob.address(),
            amount: kvr("1"),
        };
        reports.push(after.signed("kvasir-test", &keys.alice, nonce + reports.len() as u64));

        // The producer takes its share and leaves the rest for the next block, unrejected.
        let time = state.timestamp_ms() + 1000;
        let produced = produce_block(
            &state,
            &verified(&state, reports.clone()),
            &keys.validator,
            time,
        )
        .unwrap();
        assert_eq!(produced.block.txs.len(), MAX_BLOCK_EVIDENCE);
        assert!(produced.rejected.is_empty(), "{:?}", produced.rejected);
        let next = block_of(
            &produced.state,
            &keys,
            reports[MAX_BLOCK_EVIDENCE..].to_vec(),
        );
        assert_eq!(next.account(&w).convictions.len(), MAX_BLOCK_EVIDENCE + 1);

        // A proposer that packs one more is refused before anything is recomputed.
        let packed = reports[..=MAX_BLOCK_EVIDENCE].to_vec();
        let block = Block::seal(&state, packed, state.root(), time, &keys.validator);
        let verdict = apply_block(&state, &block);
        assert!(
            matches!(verdict, Err(BlockError::TooMuchEvidence { got }) if got == MAX_BLOCK_EVIDENCE + 1),
            "{:?}",
            verdict.err()
        );
    }

    /// Format 2 takes evidence only with an expert's weights, format 1 only without; the
    /// weights must carry the pinned config and fit the pin's largest expert, the bodies
    /// their own bound, and the path its length: all checked before any state is read.
    #[test]
    fn weights_come_with_format_2_evidence_only_and_within_the_pin() {
        let (v2, keys) = crate::genesis::tests::bonded_genesis_v2();
        let (v1, _) = bonded_genesis();
        let stateless = |genesis: &Genesis, kind: TxKind| {
            let tx = kind.signed_paying(
                &genesis.chain_id(),
                (genesis.params.format == 2).then(FeeBid::default),
                &keys.alice,
                0,
            );
            crate::tx::stateless_results(genesis, &[tx]).remove(0)
        };
        let on = |genesis: &Genesis| {
            evidence(&keys, &keys.worker, 1, 7, vec![0; 32], &genesis.chain_id())
        };
        assert_eq!(stateless(&v2, evidence_kind(&v2, on(&v2))), Ok(()));
        assert_eq!(stateless(&v1, evidence_kind(&v1, on(&v1))), Ok(()));
        assert_eq!(
            stateless(&v2, TxKind::Evidence(Box::new(on(&v2)))),
            Err(TxError::EvidenceFormat { expected: true })
        );
        let TxKind::ExpertEvidence(with_weights) = evidence_kind(&v2, on(&v1)) else {
            unreachable!()
        };
        assert_eq!(
            stateless(&v1, TxKind::ExpertEvidence(with_weights)),
            Err(TxError::EvidenceFormat { expected: false })
        );
        let most = v2.models[0].shape.unwrap().expert_bytes as usize;
        type Change = fn(&mut ExpertEvidence, usize);
        let changes: [(&str, Change); 5] = [
            ("weights", |e, most| e.weights.down = vec![0; most]),
            ("config", |e, _| e.weights.config.push(b' ')),
            ("config", |e, _| {
                e.weights.config = vec![b' '; MAX_EXPERT_CONFIG_BYTES + 1]
            }),
            ("path", |e, _| {
                e.weights.path = vec![Hash::ZERO; MAX_EXPERT_PATH + 1]
            }),
            ("bodies", |e, _| {
                e.evidence.request_body = vec![0; MAX_EVIDENCE_TX_BYTES];
            }),
        ];
        for (what, change) in changes {
            let TxKind::ExpertEvidence(mut e) = evidence_kind(&v2, on(&v2)) else {
                unreachable!()
            };
            change(&mut e, most);
            let refused = stateless(&v2, TxKind::ExpertEvidence(e));
            assert!(
                matches!(&refused, Err(TxError::EvidenceWeights(why)) if why.contains(what)),
                "{what}: {refused:?}"
            );
        }
    }

    #[test]
    fn evidence_that_does_not_prove_a_wrong_answer_changes_nothing() {
        let (state, keys) = bonded_and_credited();
        let correct = blake3::hash(b"rows").as_bytes().to_vec();
        let honest = evidence(&keys, &keys.worker, 1, 7, correct, "kvasir-test");
        let mut tampered_request = wrong(&keys, 1);
        tampered_request.request_body = request_body(1, 7, b"other rows");
        let mut forged = wrong(&keys, 1);
        forged.signature.0[3] ^= 1;
        let mut other_signer = wrong(&keys, 1);
        other_signer.signature = other_signer.claim().sign("kvasir-test", &keys.bob);
        let other_chain = evidence(&keys, &keys.worker, 1, 7, vec![0; 32], "other-chain");
        let mut unpinned = wrong(&keys, 1);
        unpinned.model_id = "n".into();
        unpinned.signature = unpinned.claim().sign("kvasir-test", &keys.worker);
        // A signed answer to request 7 of session 1 does not become one of session 2.
        let mut moved = evidence(&keys, &keys.worker, 2, 7, vec![0; 32], "kvasir-test");
        moved.request_body = request_body(1, 7, b"rows");
        moved.signature = moved.claim().sign("kvasir-test", &keys.worker);
        // Session 1 is the worker's, not bob's; and bob's token bond is nothing at stake.
        let not_theirs = evidence(&keys, &keys.bob, 1, 7, vec![0; 32], "kvasir-test");
        let nothing = evidence(&keys, &keys.bob, 9, 7, vec![0; 32], "kvasir-test");
        let token = Amount::from_base_units(1);
        let state = block_of(
            &state,
            &keys,
            vec![signed(&state, &keys.bob, TxKind::Bond { amount: token })],
        );
        let cases = [
            (honest, TxError::AnswerWasCorrect),
            (tampered_request, TxError::BadAnswerSignature),
            (forged, TxError::BadAnswerSignature),
            (other_signer, TxError::BadAnswerSignature),
            (other_chain, TxError::BadAnswerSignature),
            (unpinned, TxError::UnpinnedModel("n".into())),
            (nothing, TxError::NothingAtStake(keys.bob.address())),
            (moved, TxError::EvidenceRequest(String::new())),
            (
                not_theirs,
                TxError::SessionWorkerMismatch {
                    stored: keys.worker.address(),
                    got: keys.bob.address(),
                },
            ),
        ];
        for (evidence, expected) in cases {
            let tx = reported(&keys, &state, evidence);
            let stateless =
                crate::tx::stateless_results(state.genesis(), std::slice::from_ref(&tx));
            let error = match stateless.into_iter().next().unwrap() {
                Err(e) => e,
                Ok(()) => rejection(&state, &keys, tx),
            };
            match expected {
                TxError::EvidenceRequest(_) => {
                    assert!(matches!(error, TxError::EvidenceRequest(_)), "{error}")
                }
                expected => assert_eq!(error, expected),
            }
        }
        // A node that cannot recompute refuses evidence rather than guessing.
        let (genesis, keys) = bonded_genesis();
        let (blind, keys) = bonded_and_credited_on(State::from_genesis(genesis), keys);
        let tx = reported(&keys, &blind, wrong(&keys, 1));
        assert_eq!(rejection(&blind, &keys, tx), TxError::CannotCheckEvidence);
    }

    #[test]
    fn a_key_convicting_itself_in_another_workers_uncredited_session_does_not_take_its_pay() {
        let (state, keys) = bonded_and_credited();
        let (w, bob) = (keys.worker.address(), keys.bob.address());
        let state = bob_bonds(state, &keys, "10");
        // Bob signs a wrong answer naming session 5, which the hub gave the worker and has
        // not credited yet, and reports it: he is slashed, as for any wrong answer he signs.
        let squat = evidence(&keys, &keys.bob, 5, 7, vec![0; 32], "kvasir-test");
        let state = block_of(&state, &keys, vec![reported(&keys, &state, squat.clone())]);
        assert_eq!(state.account(&bob).bonded, kvr("5"));
        assert!(state.account(&bob).is_jailed(state.height() + 1));
        // The hub's receipt says session 5 is the worker's: it is credited and paid in full.
        let pending = state.account(&w).pending_total();
        let credit = credit_from(&keys.gateway, 2, &keys.hub, 5, w, 10_000_000);
        let state = block_of(&state, &keys, vec![credit]);
        assert_eq!(
            state.account(&w).pending_total(),
            pending.checked_add(kvr("0.07")).unwrap()
        );
        let key = SessionKey {
            hub: keys.hub.address(),
            session_id: 5,
        };
        assert_eq!(state.session_worker(&key), Some(w));
        assert!(!state.account(&w).is_convicted_in(&key));
        assert!(state.account(&bob).is_convicted_in(&key));
        // Bob's evidence cannot be used again.
        assert_eq!(
            rejection(&state, &keys, reported(&keys, &state, squat)),
            TxError::SessionWorkerMismatch {
                stored: w,
                got: bob
            }
        );
    }

    #[test]
    fn an_accomplice_convicted_first_in_a_session_does_not_shield_its_worker() {
        let (state, keys) = bonded_and_credited();
        let (w, bob) = (keys.worker.address(), keys.bob.address());
        let state = bob_bonds(state, &keys, "20");
        // Bob convicts himself in the worker's session 6 before it is credited...
        let first = evidence(&keys, &keys.bob, 6, 7, vec![0; 32], "kvasir-test");
        let state = block_of(&state, &keys, vec![reported(&keys, &state, first.clone())]);
        // ...and the same evidence is not taken twice, even with his bond still full.
        assert_eq!(state.account(&bob).bonded, kvr("10"));
        assert_eq!(
            rejection(&state, &keys, reported(&keys, &state, first)),
            TxError::AlreadyConvicted
        );
        // The worker's own lie in session 6 is still judged, and the session pays it nothing.
        let state = block_of(
            &state,
            &keys,
            vec![reported(&keys, &state, wrong(&keys, 6))],
        );
        assert_eq!(conviction_of(&state, &keys, 6).slashed, kvr("10"));
        let pending = state.account(&w).pending_total();
        let credit = credit_from(&keys.gateway, 2, &keys.hub, 6, w, 10_000_000);
        let state = block_of(&state, &keys, vec![credit]);
        assert_eq!(state.account(&w).pending_total(), pending);
        let session = SessionKey {
            hub: keys.hub.address(),
            session_id: 6,
        };
        assert_eq!(state.session_worker(&session), Some(w));
    }

    #[test]
    fn evidence_too_big_for_what_is_left_of_a_block_waits_for_the_next_while_others_fill_it() {
        let (mut genesis, keys) = bonded_genesis();
        let wrong_answer = evidence(&keys, &keys.worker, 1, 7, vec![0; 4000], "kvasir-test");
        let size = |tx: &SignedTx| tx.to_bytes().len() as u64;
        let probe =
            TxKind::Evidence(Box::new(wrong_answer.clone())).signed("kvasir-test", &keys.alice, 0);
        // Room for the evidence alone, not beside a transfer.
        genesis.params.max_block_bytes = crate::block::BLOCK_OVERHEAD_BYTES + size(&probe) + 50;
        let (state, keys) = bonded_and_credited_on(
            State::from_genesis(genesis).with_answer_check(Arc::new(HashCheck)),
            keys,
        );
        let pay = |from: &Keypair| {
            let to = keys.validator.address();
            signed(
                &state,
                from,
                TxKind::Transfer {
                    to,
                    amount: kvr("1"),
                },
            )
        };
        let (first, evidence_tx, last) = (
            pay(&keys.bob),
            reported(&keys, &state, wrong_answer),
            pay(&keys.worker),
        );
        let candidates = crate::apply::tests::verified(
            &state,
            vec![first.clone(), evidence_tx.clone(), last.clone()],
        );
        let produced = crate::apply::produce_block(
            &state,
            &candidates,
            &keys.validator,
            state.timestamp_ms() + 1000,
        )
        .unwrap();
        assert_eq!(produced.block.txs, vec![first, last]);
        assert!(produced.rejected.is_empty(), "deferred, not dropped");
        let state = block_of(&produced.state, &keys, vec![evidence_tx]);
        assert_eq!(
            state.account(&keys.worker.address()).jailed_until,
            state.height() + 4
        );
    }

    #[test]
    fn a_conviction_drops_the_owed_claims_the_empty_pool_could_not_pay_yet() {
        let (mut genesis, keys) = bonded_genesis();
        genesis.params.rewards_pool = kvr("0.05");
        let (state, keys) = bonded_and_credited_on(
            State::from_genesis(genesis).with_answer_check(Arc::new(HashCheck)),
            keys,
        );
        let w = keys.worker.address();
        // 0.21 KVR earned, 0.05 paid from the pool, the rest owed until it refills.
        assert_eq!(state.account(&w).owed, kvr("0.16"));
        let supply = state.total_money();
        let state = block_of(
            &state,
            &keys,
            vec![reported(&keys, &state, wrong(&keys, 2))],
        );
        assert_eq!(state.account(&w).owed, Amount::ZERO);
        assert_eq!(state.total_owed(), 0);
        assert_eq!(state.total_money(), supply);
        let conviction = conviction_of(&state, &keys, 2);
        assert_eq!(conviction.owed_forfeited, kvr("0.16"));
    }

    #[test]
    fn evidence_after_settlement_still_slashes_what_is_unbonding() {
        let (mut state, keys) = bonded_and_credited();
        let w = keys.worker.address();
        let unbond = signed(&state, &keys.worker, TxKind::Unbond { amount: kvr("20") });
        state = block_of(&state, &keys, vec![unbond]);
        assert_eq!(state.account(&w).unbonding_total(), kvr("20"));
        // Past the challenge window: the rewards settled, the unbonding is still held.
        while !state.account(&w).pending.is_empty() {
            state = block_of(&state, &keys, vec![]);
        }
        let settled = state.account(&w).balance;
        let tx = reported(&keys, &state, wrong(&keys, 1));
        state = block_of(&state, &keys, vec![tx]);
        let worker = state.account(&w);
        assert_eq!(
            worker.balance, settled,
            "settled rewards are not clawed back"
        );
        assert_eq!(worker.unbonding_total(), kvr("10"));
        // What is left returns at the release height.
        while !state.account(&w).unbonding.is_empty() {
            state = block_of(&state, &keys, vec![]);
        }
        assert_eq!(
            state.account(&w).balance,
            settled.checked_add(kvr("10")).unwrap()
        );
    }

    #[test]
    fn bonds_move_balance_and_come_back_only_after_the_unbonding_delay() {
        let (genesis, keys) = bonded_genesis();
        let mut state = State::from_genesis(genesis);
        let w = keys.worker.address();
        let too_much = signed(&state, &keys.worker, TxKind::Bond { amount: kvr("51") });
        assert!(matches!(
            rejection(&state, &keys, too_much),
            TxError::InsufficientFunds { .. }
        ));
        let bond = signed(&state, &keys.worker, TxKind::Bond { amount: kvr("30") });
        state = block_of(&state, &keys, vec![bond]);
        assert_eq!(
            (state.account(&w).balance, state.account(&w).bonded),
            (kvr("20"), kvr("30"))
        );
        let over = signed(&state, &keys.worker, TxKind::Unbond { amount: kvr("31") });
        assert!(matches!(
            rejection(&state, &keys, over),
            TxError::InsufficientBond { .. }
        ));
        let unbond = signed(&state, &keys.worker, TxKind::Unbond { amount: kvr("12") });
        state = block_of(&state, &keys, vec![unbond]);
        let unbonded_at = state.height();
        assert_eq!(state.account(&w).bonded, kvr("18"));
        while state.account(&w).unbonding_total() == kvr("12") {
            state = block_of(&state, &keys, vec![]);
        }
        assert_eq!(
            state.height() - unbonded_at,
            5,
            "released after unbonding_blocks"
        );
        assert_eq!(state.account(&w).balance, kvr("32"));
        // A chain without min_bond has no bonds.
        let (plain, keys) = crate::genesis::tests::test_genesis();
        let plain = State::from_genesis(plain);
        let bond = signed(&plain, &keys.alice, TxKind::Bond { amount: kvr("1") });
        assert_eq!(rejection(&plain, &keys, bond), TxError::NoBonds);
    }

    #[test]
    fn a_worker_bonded_below_the_minimum_is_not_paid() {
        let (genesis, keys) = bonded_genesis();
        let state = State::from_genesis(genesis);
        let w = keys.worker.address();
        let bond = signed(&state, &keys.worker, TxKind::Bond { amount: kvr("9") });
        let state = block_of(&state, &keys, vec![bond]);
        let credit = credit_from(&keys.gateway, 0, &keys.hub, 1, w, 10_000_000);
        let state = block_of(&state, &keys, vec![credit]);
        assert_eq!(state.account(&w).pending_total(), Amount::ZERO);
        let session = SessionKey {
            hub: keys.hub.address(),
            session_id: 1,
        };
        let mark = state.receipt_mark(&MeterKey { session, order: 0 });
        assert_eq!(mark.map(|m| m.cumulative_bytes), Some(10_000_000));
    }
}
