//! The application side of the engine: one loop that answers every message Malachite sends
//! over its channels, turning them into calls on the `Chain`.
//!
//! Every message that carries a reply gets one (or, where failing is the answer, has its
//! reply dropped, which the engine reads as "no value"): an unanswered `ConsensusReady`,
//! `StartedRound` or `Finalized` stalls consensus for good. Blocks are committed at
//! `Decided`, before it is acknowledged, because sync advertises a height only after that.
//!
//! A decided block that cannot be committed stops the loop, and with it the engine. The
//! engine's other answer, restarting the height, wipes its WAL of the votes it already
//! signed there, so this node could then vote differently in the same rounds; a node whose
//! chain cannot commit needs its operator, not a retry.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;

use kvasir_ledger::keys::Signature;
use kvasir_ledger::{Genesis, Keypair};
use malachitebft_app_channel::app::consensus::VoteExtensionError;
use malachitebft_app_channel::app::engine::host::Next;
use malachitebft_app_channel::app::engine::host::SyncedValueOutcome;
use malachitebft_app_channel::app::types::core::{
    CommitCertificate, HeightParams, Round, Validity,
};
use malachitebft_app_channel::app::types::streaming::StreamMessage;
use malachitebft_app_channel::app::types::sync::RawDecidedValue;
use malachitebft_app_channel::app::types::{LocallyProposedValue, PeerId, ProposedValue};
use malachitebft_app_channel::{AppMsg, Channels, NetworkMsg};
use tracing::{debug, error, info, warn};

use crate::certificates::{ledger_certificate, synced_certificate};
use crate::chain::Chain;
use crate::codec::MAX_SYNC_VALUES;
use crate::context::{self, proposer_of, Address, BlockId, Height, LedgerContext, ValidatorSet};
use crate::parts::{self, Init, ProposalPart, Streams};
use crate::store::{Proposals, Stored};

/// Rounds past the current one a proposal may be for and still be kept; the engine itself
/// looks no further than 10 ahead.
const MAX_ROUNDS_AHEAD: u32 = 10;

pub(crate) struct App<C: Chain> {
    chain: C,
    validators: ValidatorSet,
    params: HeightParams<LedgerContext>,
    me: Option<Address>,
    /// This validator's key, to seal the blocks it streams; none on a full node.
    key: Option<Keypair>,
    chain_id: String,
    max_block_bytes: u64,
    proposals: Proposals,
    streams: Streams,
    /// Blocks assembled for the next height, waiting for it to be decided: by round, the
    /// first its proposer sealed (so at most `MAX_ROUNDS_AHEAD` + 1, and no peer, not even
    /// a validator, can push out another's).
    pending: BTreeMap<u32, (Init, Vec<u8>)>,
    committed: u64,
    round: u32,
}

impl<C: Chain> App<C> {
    pub(crate) fn new(
        chain: C,
        genesis: &Genesis,
        validators: ValidatorSet,
        key: Option<Keypair>,
        proposals: Proposals,
    ) -> App<C> {
        let params = HeightParams::new(
            validators.clone(),
            context::timeouts(),
            Some(Duration::from_millis(genesis.params.block_interval_ms)),
        );
        let max_block_bytes = genesis.params.max_block_bytes;
        let committed = chain.committed_height();
        App {
            chain,
            validators,
            params,
            me: key.as_ref().map(|k| Address(k.address())),
            key,
            chain_id: genesis.chain_id(),
            max_block_bytes,
            proposals,
            streams: Streams::new(max_block_bytes),
            pending: BTreeMap::new(),
            committed,
            round: 0,
        }
    }

    fn deciding(&self) -> Height {
        Height(self.committed.saturating_add(1))
    }

    /// Answers one message; returns the proposal parts to publish, or why this node must
    /// stop.
    fn handle(
        &mut self,
        msg: AppMsg<LedgerContext>,
    ) -> anyhow::Result<Vec<StreamMessage<ProposalPart>>> {
        match msg {
            AppMsg::ConsensusReady { reply } => {
                self.committed = self.chain.committed_height();
                info!(height = %self.deciding(), "consensus ready");
                let _ = reply.send((self.deciding(), self.params.clone()));
            }

            AppMsg::StartedRound {
                height,
                round,
                reply_value,
                ..
            } => {
                if height == self.deciding() {
                    self.round = round.as_u32().unwrap_or(0);
                    self.validate_pending();
                }
                let values = self
                    .proposals
                    .at(height, round)
                    .map(|stored| stored.into_iter().map(|s| s.value).collect())
                    .unwrap_or_else(|e| {
                        error!("{e}");
                        Vec::new()
                    });
                let _ = reply_value.send(values);
            }

            AppMsg::GetValue {
                height,
                round,
                reply,
                ..
            } => match self.value_to_propose(height, round) {
                Ok((value, parts)) => {
                    let _ = reply.send(value);
                    return Ok(parts);
                }
                Err(e) => error!(%height, %round, "no block to propose: {e:#}"),
            },

            AppMsg::ExtendVote { reply, .. } => {
                let _ = reply.send(None);
            }

            AppMsg::VerifyVoteExtensions {
                extensions, reply, ..
            } => {
                let verdicts = extensions
                    .into_iter()
                    .map(|(address, ())| (address, Err(VoteExtensionError::InvalidVoteExtension)))
                    .collect();
                let _ = reply.send(verdicts);
            }

            AppMsg::RestreamProposal {
                height,
                round,
                valid_round,
                address,
                value_id,
            } => match self.proposals.find(height, &value_id) {
                Ok(Some(stored)) => match self.seal(height, round, valid_round, &stored.block) {
                    Some(init) if init.proposer == address => {
                        return Ok(parts::split(init, &stored.block))
                    }
                    _ => warn!(%height, %round, "asked to restream another proposer's block"),
                },
                Ok(None) => warn!(%height, %round, %value_id, "asked to restream a block we lack"),
                Err(e) => error!("{e}"),
            },

            AppMsg::GetHistoryMinHeight { reply } => {
                let _ = reply.send(Height(1));
            }

            AppMsg::ReceivedProposalPart {
                from,
                published_by,
                part,
                reply,
            } => {
                let _ = reply.send(self.received_part(published_by.unwrap_or(from), part));
            }

            AppMsg::Decided {
                certificate, reply, ..
            } => {
                self.commit(&certificate)?;
                let _ = reply.send(());
            }

            AppMsg::Finalized {
                certificate,
                evidence,
                reply,
                ..
            } => {
                // Two signed messages from one validator for one height and round: a
                // validator equivocated (or its key is used twice). Nothing on chain punishes
                // it yet; an operator must hear of it.
                if !evidence.is_empty() {
                    error!(height = %certificate.height, "equivocation seen: {evidence:?}");
                }
                anyhow::ensure!(
                    self.committed >= certificate.height.0,
                    "height {} finalized but not committed",
                    certificate.height
                );
                let _ = reply.send(Next::Start(self.deciding(), self.params.clone()));
            }

            AppMsg::GetDecidedValues { range, reply } => {
                let _ = reply.send(self.decided_values(*range.start(), *range.end()));
            }

            AppMsg::ProcessSyncedValue {
                height,
                round,
                proposer,
                value_bytes,
                reply,
            } => {
                let _ = reply.send(self.synced_value(height, round, proposer, &value_bytes));
            }
        }
        Ok(Vec::new())
    }

    /// The block this node proposes at (height, round): the one it already built for the
    /// height if any (so a restart proposes the same), else a new one, stored durably first.
    fn value_to_propose(
        &mut self,
        height: Height,
        round: Round,
    ) -> anyhow::Result<(
        LocallyProposedValue<LedgerContext>,
        Vec<StreamMessage<ProposalPart>>,
    )> {
        let me = self
            .me
            .ok_or_else(|| anyhow::anyhow!("asked to propose, but this node is no validator"))?;
        let (id, block) = match self.proposals.own(height)? {
            Some(built) => built,
            None => {
                let (hash, block) = self.chain.propose(height.0)?;
                if block.len() as u64 > self.max_block_bytes {
                    anyhow::bail!(
                        "the chain built a {}-byte block, over the {}-byte limit",
                        block.len(),
                        self.max_block_bytes
                    );
                }
                self.proposals.put_own(height, BlockId(hash), &block)?;
                (BlockId(hash), block)
            }
        };
        let value = ProposedValue {
            height,
            round,
            valid_round: Round::Nil,
            proposer: me,
            value: id,
            validity: Validity::Valid,
        };
        // Kept, or this node could not commit its own block were it decided.
        anyhow::ensure!(
            self.proposals.put(&Stored {
                value,
                block: block.clone(),
            })?,
            "no room to keep this node's own proposal at height {height}, round {round}"
        );
        let init = self
            .seal(height, round, Round::Nil, &block)
            .ok_or_else(|| anyhow::anyhow!("no key to seal the proposal with"))?;
        Ok((
            LocallyProposedValue::new(height, round, id),
            parts::split(init, &block),
        ))
    }

    /// The Init of this node's stream of `block` at (height, round), sealed with its key;
    /// none on a full node.
    fn seal(&self, height: Height, round: Round, pol_round: Round, block: &[u8]) -> Option<Init> {
        let key = self.key.as_ref()?;
        let mut init = Init {
            height,
            round,
            pol_round,
            proposer: Address(key.address()),
            seal: Signature([0; 64]),
        };
        init.seal = init.sealed(block).sign(&self.chain_id, key);
        Some(init)
    }

    fn received_part(
        &mut self,
        publisher: PeerId,
        part: StreamMessage<ProposalPart>,
    ) -> Option<ProposedValue<LedgerContext>> {
        let assembled = match self.streams.insert(publisher, part, self.deciding()) {
            Ok(assembled) => assembled?,
            Err(dropped) => {
                debug!(%publisher, "proposal part dropped: {dropped}");
                return None;
            }
        };
        let init = assembled.init;
        if proposer_of(&self.validators, init.height, init.round).address != init.proposer {
            warn!(%publisher, height = %init.height, round = %init.round, "a block streamed for a proposer not of its round");
            return None;
        }
        let sealed = init.sealed(&assembled.block);
        if !sealed.verify(&self.chain_id, &init.proposer.0, &init.seal) {
            warn!(%publisher, height = %init.height, round = %init.round, "a streamed block without its proposer's seal");
            return None;
        }
        let current = if init.height == self.deciding() {
            self.round
        } else {
            0
        };
        let round = init.round.as_u32()?;
        if round > current.saturating_add(MAX_ROUNDS_AHEAD) {
            return None;
        }
        if init.height > self.deciding() {
            // Only the next height is worth keeping: a node further behind syncs instead.
            if init.height.0 == self.deciding().0.saturating_add(1) {
                self.pending.entry(round).or_insert((init, assembled.block));
            }
            return None;
        }
        self.validate(init, assembled.block)
    }

    /// Checks a block streamed for the height being decided and keeps it if valid. A fresh
    /// proposal must be the round proposer's own block; a re-proposal under a proof-of-lock
    /// carries a block some earlier proposer built, which 2/3 already accepted once.
    fn validate(&mut self, init: Init, block: Vec<u8>) -> Option<ProposedValue<LedgerContext>> {
        let author = init.pol_round.is_nil().then_some(&init.proposer.0);
        let id = match self.chain.validate(init.height.0, author, &block) {
            Ok(id) => BlockId(id),
            Err(reason) => {
                info!(height = %init.height, round = %init.round, proposer = %init.proposer, "rejected a proposed block: {reason}");
                return None;
            }
        };
        let stored = Stored {
            value: ProposedValue {
                height: init.height,
                round: init.round,
                valid_round: init.pol_round,
                proposer: init.proposer,
                value: id,
                validity: Validity::Valid,
            },
            block,
        };
        match self.proposals.put(&stored) {
            Ok(true) => Some(stored.value),
            Ok(false) => {
                debug!(height = %init.height, round = %init.round, "no room for another block this round");
                None
            }
            Err(e) => {
                error!("{e}");
                None
            }
        }
    }

    /// Validates the blocks that arrived early for the height now being decided; the engine
    /// hears of them in the `StartedRound` reply of their round.
    fn validate_pending(&mut self) {
        let deciding = self.deciding();
        for (init, block) in std::mem::take(&mut self.pending).into_values() {
            if init.height == deciding {
                self.validate(init, block);
            }
        }
    }

    /// Commits the decided block (again deciding a committed height is a no-op).
    fn commit(&mut self, certificate: &CommitCertificate<LedgerContext>) -> anyhow::Result<()> {
        let height = certificate.height;
        if height.0 <= self.committed {
            return Ok(());
        }
        anyhow::ensure!(
            height == self.deciding(),
            "decided height {height} while the chain is at {}",
            self.committed
        );
        let stored = self
            .proposals
            .find(height, &certificate.value_id)?
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "decided block {} at {height}, which this node lacks",
                    certificate.value_id
                )
            })?;
        let ledger = ledger_certificate(certificate)?;
        self.chain
            .commit(&stored.block, &ledger)
            .with_context(|| format!("committing height {height}"))?;
        self.committed = height.0;
        self.round = 0;
        info!(%height, block = %certificate.value_id, signatures = ledger.signatures.len(), "committed");
        if let Err(e) = self.proposals.prune(height) {
            error!("{e}");
        }
        self.streams.prune(self.deciding());
        Ok(())
    }

    /// Committed blocks from `start` on, as many as exist, for a peer that syncs. The reply
    /// must begin at `start`, so a start this node cannot serve gets nothing.
    fn decided_values(&self, start: Height, end: Height) -> Vec<RawDecidedValue<LedgerContext>> {
        if start.0 == 0 {
            return Vec::new();
        }
        let last = end
            .0
            .min(self.committed)
            .min(start.0.saturating_add(MAX_SYNC_VALUES - 1));
        let mut values = Vec::new();
        for height in start.0..=last {
            match self.chain.decided(height) {
                Ok(Some((block, certificate))) => values.push(RawDecidedValue::new(
                    block.into(),
                    synced_certificate(&certificate),
                )),
                Ok(None) => break,
                Err(e) => {
                    error!(height, "reading a decided block: {e:#}");
                    break;
                }
            }
        }
        values
    }

    /// A block a peer shipped with a commit certificate the engine has already checked.
    fn synced_value(
        &mut self,
        height: Height,
        round: Round,
        proposer: Address,
        bytes: &[u8],
    ) -> SyncedValueOutcome<LedgerContext> {
        if height != self.deciding() {
            return SyncedValueOutcome::LocalTransientError;
        }
        if bytes.len() as u64 > self.max_block_bytes {
            return SyncedValueOutcome::PeerFault;
        }
        let id = match self.chain.validate(height.0, None, bytes) {
            Ok(id) => BlockId(id),
            Err(reason) => {
                warn!(%height, "a synced block does not validate: {reason}");
                return SyncedValueOutcome::PeerFault;
            }
        };
        let stored = Stored {
            value: ProposedValue {
                height,
                round,
                valid_round: Round::Nil,
                proposer,
                value: id,
                validity: Validity::Valid,
            },
            block: bytes.to_vec(),
        };
        match self.proposals.put(&stored) {
            Ok(true) => SyncedValueOutcome::Verdict(stored.value),
            Ok(false) => SyncedValueOutcome::LocalTransientError,
            Err(e) => {
                error!("{e}");
                SyncedValueOutcome::LocalTransientError
            }
        }
    }
}

/// Runs `f`, which may block on disk or the chain, without stalling the runtime's other
/// tasks where the runtime can move them (a multi-threaded one).
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Serves the engine until it stops.
pub(crate) async fn run<C: Chain>(
    mut app: App<C>,
    mut channels: Channels<LedgerContext>,
) -> anyhow::Result<()> {
    while let Some(msg) = channels.consensus.recv().await {
        let publish = blocking(|| app.handle(msg))?;
        for part in publish {
            channels
                .network
                .send(NetworkMsg::PublishProposalPart(part))
                .await
                .map_err(|_| anyhow::anyhow!("the engine's network has stopped"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
