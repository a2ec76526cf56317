//! Funding and bonding worker keys, as an operator does before serving: a chain with bonds
//! asks it before a hub admits them.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use kvasir_api::Client;
use kvasir_ledger::keys::Keypair;
use kvasir_ledger::mempool::Limits;
use kvasir_ledger::{Amount, SignedTx, TxKind};

/// How long one funding or bonding transaction may take to be committed.
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Makes each of `workers` bonded at least the chain's `min_bond`, as an operator does
/// before serving (a hub with a ledger admits only bonded keys): `faucet` sends each key
/// exactly what its bond lacks and the key bonds that, so whatever else a worker holds is
/// what it earned. A key bonded enough already (a second `dev` run) is left alone; a
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
    let chain = params.chain_id.as_str();
    let mut faucet_nonce = ledger.account(&faucet.address())?.nonce;
    let transfers = short.iter().map(|(key, amount)| {
        let to = key.address();
        let tx = TxKind::Transfer {
            to,
            amount: *amount,
        }
        .signed(chain, faucet, faucet_nonce);
        faucet_nonce += 1;
        tx
    });
    commit_all(ledger, transfers.collect())?;
    let mut bonds = Vec::with_capacity(short.len());
    for (key, amount) in &short {
        let nonce = ledger.account(&key.address())?.nonce;
        bonds.push(TxKind::Bond { amount: *amount }.signed(chain, key, nonce));
    }
    commit_all(ledger, bonds)?;
    Ok(shortfalls)
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
