//! Funding and bonding worker keys, as an operator does before serving: a chain with bonds
//! asks it before a hub admits them.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use kvasir_api::Client;
use kvasir_ledger::fees::Lane;
use kvasir_ledger::keys::{Address, Keypair};
use kvasir_ledger::mempool::Limits;
use kvasir_ledger::{Amount, SignedTx, TxKind};

/// How long one funding or bonding transaction may take to be committed.
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Makes each of `workers` bonded at least the chain's `min_bond`, as an operator does
/// before serving (a hub with a ledger admits only bonded keys): `faucet` sends each key
/// exactly what its bond lacks and the bond's fee, and the key bonds that, so whatever else
/// a worker holds is what it earned (`faucet_pays`). A key bonded enough already (a second `dev` run) is left alone; a
/// jailed key is an error, since no bond lets it serve. The transfers go out together and
/// then the bonds, so any number of keys costs about two blocks. Returns what each key
/// bonded now (zero: nothing was needed, or the chain has no bonds).
pub fn bond_workers(
    ledger: &Client,
    faucet: &Keypair,
    workers: &[&Keypair],
) -> Result<Vec<Amount>> {
    let params = ledger
        .params()
        .context("reading the chain's min_bond from the ledger")?;
    let min_bond = params.min_bond.base_units;
    let mut shortfalls = Vec::with_capacity(workers.len());
    for key in workers {
        if min_bond.is_zero() {
            shortfalls.push(Amount::ZERO);
            continue;
        }
        let account = ledger.account(&key.address())?;
        if account.jailed {
            bail!(
                "{} is jailed until height {} for a wrong answer: no bond lets it serve before then",
                key.address(),
                account.jailed_until
            );
        }
        shortfalls.push(
            min_bond
                .checked_sub(account.bonded.base_units)
                .unwrap_or(Amount::ZERO),
        );
    }
    let short: Vec<(&Keypair, Amount)> = workers
        .iter()
        .zip(&shortfalls)
        .filter(|(_, amount)| !amount.is_zero())
        .map(|(key, amount)| (*key, *amount))
        .collect();
    let bonds = short
        .iter()
        .map(|(key, amount)| (*key, TxKind::Bond { amount: *amount }, *amount))
        .collect();
    faucet_pays(ledger, faucet, bonds)?;
    Ok(shortfalls)
}

/// Each `(key, kind, amount)`, one per key: `faucet` sends `key` the `amount` its transaction `kind` moves
/// and that transaction's fee at today's base fee, exactly, then the key signs and submits
/// it; so the key holds afterwards what it held before. The transfers go out together and
/// then the keys' transactions, so any number of keys costs about two blocks. (Should the
/// base fee rise between the two, a key's transaction is refused for its fee, by the
/// ledger, with that reason.)
pub fn faucet_pays(
    ledger: &Client,
    faucet: &Keypair,
    each: Vec<(&Keypair, TxKind, Amount)>,
) -> Result<()> {
    if each.is_empty() {
        return Ok(());
    }
    let chain = ledger.head()?.chain_id;
    let fees = ledger.fees()?;
    let mut signed = Vec::with_capacity(each.len());
    let mut transfers = Vec::with_capacity(each.len());
    let mut faucet_nonce = ledger.account(&faucet.address())?.nonce;
    for (key, kind, amount) in each {
        let lane = Lane::of(&kind);
        let nonce = ledger.account(&key.address())?.nonce;
        let bid = fees.bid(lane, Amount::ZERO);
        let tx = kind.signed_paying(&chain, bid, key, nonce);
        let fee = match &bid {
            Some(bid) => fees.charge(lane, bid, tx.to_bytes().len())?.burned,
            None => Amount::ZERO,
        };
        let amount = amount
            .checked_add(fee)
            .context("a funding transfer overflows")?;
        signed.push(tx);
        if amount.is_zero() {
            continue;
        }
        let fund = TxKind::Transfer {
            to: key.address(),
            amount,
        };
        let fund_fee = fees.bid(Lane::Open, Amount::ZERO);
        transfers.push(fund.signed_paying(&chain, fund_fee, faucet, faucet_nonce));
        faucet_nonce += 1;
    }
    commit_all(ledger, transfers)?;
    commit_all(ledger, signed)
}

/// Tops `to` up from `faucet` to hold at least `amount` spendable: what a backbone's key
/// needs to pay for the evidence it reports.
pub fn top_up(ledger: &Client, faucet: &Keypair, to: Address, amount: Amount) -> Result<()> {
    let balance = ledger.account(&to)?.balance.base_units;
    let Some(short) = amount.checked_sub(balance).filter(|a| !a.is_zero()) else {
        return Ok(());
    };
    let chain = ledger.head()?.chain_id;
    let fund = TxKind::Transfer { to, amount: short };
    let tx = ledger.sign_next(&chain, fund, faucet, Amount::ZERO)?;
    commit_all(ledger, vec![tx])
}

/// Submits `txs` and waits until each is committed, in groups no larger than the nonces
/// the mempool takes ahead from one sender (the faucet's transfers share a sender).
pub fn commit_all(ledger: &Client, txs: Vec<SignedTx>) -> Result<()> {
    for group in txs.chunks(Limits::default().per_sender) {
        let mut hashes = Vec::with_capacity(group.len());
        for tx in group {
            hashes.push(ledger.submit(tx).context("submitting a transaction")?);
        }
        for hash in &hashes {
            ledger
                .wait_committed(hash, COMMIT_TIMEOUT)
                .with_context(|| format!("waiting for transaction {hash} to be committed"))?;
        }
    }
    Ok(())
}
