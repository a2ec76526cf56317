//! A transaction from a stranger (the ledger's `POST /txs` body). Decoding never panics and
//! accepts only the canonical encoding. Then the same action, re-signed by the dev key that may
//! send it (the faucet for a transfer, a bond, an unbond, the market's offers and orders, and
//! evidence with or without the expert's weights, whose answer it also re-signs as the worker; the gateway for a credit, whose
//! receipt the hub re-signs; an order the faucet can fund is matched at the boundary), goes
//! through admission and into a produced block: the producer and a verifier
//! replaying that block reach the same state, and supply is unchanged.
#![no_main]

use kvasir_fuzz::{assert_supply_kept, dev_chain};
use kvasir_ledger::fees::Lane;
use kvasir_ledger::{apply_block, check_stateless, produce_block, Amount, SignedTx, Tx, TxKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(signed) = SignedTx::from_bytes(bytes) else {
        return;
    };
    assert_eq!(signed.to_bytes(), bytes);
    let chain = dev_chain();
    let state = &chain.state;
    let chain_id = state.chain_id().to_string();
    // As sent: its signature is checked like any other.
    let _ = check_stateless(state.genesis(), vec![signed.clone()]);
    let (sender, kind) = match signed.tx.kind {
        TxKind::Transfer { to, amount } => (&chain.faucet, TxKind::Transfer { to, amount }),
        TxKind::Credit(receipt) => {
            let mut receipt = receipt.receipt;
            receipt.chain_id = chain_id.clone();
            receipt.hub = chain.hub.address();
            (&chain.gateway, TxKind::Credit(receipt.sign(&chain.hub)))
        }
        TxKind::Bond { amount } => (&chain.faucet, TxKind::Bond { amount }),
        TxKind::Unbond { amount } => (&chain.faucet, TxKind::Unbond { amount }),
        TxKind::Evidence(mut evidence) => {
            evidence.worker = chain.faucet.address();
            evidence.signature = evidence.claim().sign(&chain_id, &chain.faucet);
            (&chain.faucet, TxKind::Evidence(evidence))
        }
        TxKind::ExpertEvidence(mut e) => {
            e.evidence.worker = chain.faucet.address();
            e.evidence.signature = e.evidence.claim().sign(&chain_id, &chain.faucet);
            (&chain.faucet, TxKind::ExpertEvidence(e))
        }
        kind @ (TxKind::OfferCreate(_)
        | TxKind::OfferWithdraw { .. }
        | TxKind::OrderCreate(_)
        | TxKind::OrderDeposit { .. }
        | TxKind::OrderClose { .. }) => (&chain.faucet, kind),
    };
    // The fuzzed bid, or (the dev chain asking every transaction for one) the one suggested.
    let fee = signed
        .tx
        .fee
        .or_else(|| state.suggested_bid(Lane::of(&kind), Amount::ZERO));
    let resigned = Tx {
        chain_id,
        sender: sender.address(),
        nonce: signed.tx.nonce,
        fee,
        kind,
    }
    .sign(sender);
    let verified: Vec<_> = check_stateless(state.genesis(), vec![resigned])
        .into_iter()
        .flatten()
        .collect();
    let produced = produce_block(state, &verified, &chain.validator, state.timestamp_ms() + 1)
        .expect("a block on the dev genesis");
    assert_supply_kept(&produced.state);
    let (replayed, _) = apply_block(state, &produced.block).expect("the produced block applies");
    assert_eq!(replayed.root(), produced.state.root());
});
