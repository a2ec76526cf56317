//! The application loop's answers, message by message, without an engine: proposing the
//! same block again after a restart, taking a streamed block through validation to commit,
//! serving sync, and stopping rather than restarting a height it cannot commit.

use std::sync::atomic::{AtomicU64, Ordering};

use kvasir_ledger::{Certificate, Hash, Keypair};
use malachitebft_app_channel::app::types::core::{CommitCertificate, Round};
use malachitebft_app_channel::app::types::{MisbehaviorEvidence, PeerId};
use tokio::sync::oneshot;

use super::*;
use crate::certificates::commit_certificate;
use crate::tests::genesis_with;

/// Blocks are "height:nonce", the nonce new for every block built in this process, so a
/// block built twice is never the same.
static NONCE: AtomicU64 = AtomicU64::new(0);

#[derive(Default)]
struct Mock {
    blocks: Vec<(Vec<u8>, Certificate)>,
}

fn id_of(bytes: &[u8]) -> Hash {
    Hash(*blake3::hash(bytes).as_bytes())
}

impl Chain for Mock {
    fn committed_height(&self) -> u64 {
        self.blocks.len() as u64
    }

    fn propose(&mut self, height: u64) -> anyhow::Result<(Hash, Vec<u8>)> {
        let bytes = format!("{height}:{}", NONCE.fetch_add(1, Ordering::Relaxed)).into_bytes();
        Ok((id_of(&bytes), bytes))
    }

    fn validate(
        &mut self,
        height: u64,
        _: Option<&kvasir_ledger::Address>,
        bytes: &[u8],
    ) -> Result<Hash, String> {
        let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
        if !text.starts_with(&format!("{height}:")) || height != self.committed_height() + 1 {
            return Err(format!("not a block for {height}"));
        }
        Ok(id_of(bytes))
    }

    fn commit(&mut self, bytes: &[u8], certificate: &Certificate) -> anyhow::Result<()> {
        self.blocks.push((bytes.to_vec(), certificate.clone()));
        Ok(())
    }

    fn decided(&self, height: u64) -> anyhow::Result<Option<(Vec<u8>, Certificate)>> {
        Ok(height
            .checked_sub(1)
            .and_then(|i| self.blocks.get(i as usize))
            .cloned())
    }
}

fn app(genesis: &Genesis, key: Option<Keypair>, home: &std::path::Path) -> App<Mock> {
    let validators = ValidatorSet::from_genesis(genesis).unwrap();
    let proposals = Proposals::open(home).unwrap();
    App::new(Mock::default(), genesis, validators, key, proposals)
}

fn get_value(
    app: &mut App<Mock>,
    height: u64,
    round: u32,
) -> (BlockId, Vec<StreamMessage<ProposalPart>>) {
    let (reply, mut rx) = oneshot::channel();
    let parts = app
        .handle(AppMsg::GetValue {
            height: Height(height),
            round: Round::new(round),
            timeout: Duration::from_secs(1),
            reply,
        })
        .unwrap();
    (rx.try_recv().unwrap().value, parts)
}

fn started_round(
    app: &mut App<Mock>,
    height: u64,
    round: u32,
) -> Vec<ProposedValue<LedgerContext>> {
    let (reply_value, mut rx) = oneshot::channel();
    let proposer = app.validators.validators()[0].address;
    app.handle(AppMsg::StartedRound {
        height: Height(height),
        round: Round::new(round),
        proposer,
        role: malachitebft_app_channel::app::consensus::Role::Validator,
        reply_value,
    })
    .unwrap();
    rx.try_recv().unwrap()
}

fn peer() -> PeerId {
    let key = malachitebft_app_channel::app::types::Keypair::generate_ed25519();
    PeerId::from_bytes(&key.public().to_peer_id().to_bytes()).unwrap()
}

/// Feeds a stream to `app`; what the last part completed, if anything.
fn receive(
    app: &mut App<Mock>,
    parts: Vec<StreamMessage<ProposalPart>>,
) -> Option<ProposedValue<LedgerContext>> {
    let publisher = peer();
    let mut last = None;
    for part in parts {
        let (reply, mut rx) = oneshot::channel();
        app.handle(AppMsg::ReceivedProposalPart {
            from: publisher,
            published_by: Some(publisher),
            part,
            reply,
        })
        .unwrap();
        last = rx.try_recv().unwrap();
    }
    last
}

fn decided(
    app: &mut App<Mock>,
    certificate: CommitCertificate<LedgerContext>,
) -> anyhow::Result<()> {
    let (reply, _rx) = oneshot::channel();
    app.handle(AppMsg::Decided {
        certificate,
        extensions: Default::default(),
        reply,
    })
    .map(drop)
}

#[test]
fn a_restarted_proposer_proposes_the_block_it_built_before() {
    let (genesis, keys) = genesis_with(1);
    let home = tempfile::tempdir().unwrap();
    let (first, parts) = {
        let mut before = app(&genesis, Some(keys[0].clone()), home.path());
        get_value(&mut before, 1, 0)
    };
    assert!(parts.len() >= 3);

    let mut after = app(&genesis, Some(keys[0].clone()), home.path());
    assert_eq!(get_value(&mut after, 1, 0).0, first);
    // A later round of the height proposes it again rather than build another.
    assert_eq!(get_value(&mut after, 1, 1).0, first);
    let seen = started_round(&mut after, 1, 0);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].value, first);
    assert_eq!(seen[0].proposer, Address(keys[0].address()));
}

#[test]
fn a_streamed_block_is_validated_committed_and_served_to_sync() {
    let (genesis, keys) = genesis_with(1);
    let (proposer_home, follower_home) =
        (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut proposer = app(&genesis, Some(keys[0].clone()), proposer_home.path());
    let mut follower = app(&genesis, None, follower_home.path());

    let (id, parts) = get_value(&mut proposer, 1, 0);
    let value = receive(&mut follower, parts).expect("the last part completes the block");
    assert_eq!(value.value, id);
    assert_eq!(value.validity, Validity::Valid);

    let certificate = Certificate::signed_by(&genesis.chain_id(), 1, 0, id.0, &[&keys[0]]);
    decided(&mut follower, commit_certificate(&certificate)).unwrap();
    assert_eq!(follower.chain.blocks.len(), 1);
    assert_eq!(follower.chain.blocks[0].1, certificate);
    // Deciding it again (a replay) changes nothing.
    decided(&mut follower, commit_certificate(&certificate)).unwrap();
    assert_eq!(follower.chain.blocks.len(), 1);

    let (reply, mut rx) = oneshot::channel();
    follower
        .handle(AppMsg::Finalized {
            certificate: commit_certificate(&certificate),
            extensions: Default::default(),
            evidence: MisbehaviorEvidence {
                proposals: Default::default(),
                votes: Default::default(),
            },
            reply,
        })
        .unwrap();
    assert!(matches!(rx.try_recv().unwrap(), Next::Start(Height(2), _)));

    let mut served = |start: u64, end: u64| {
        let (reply, mut rx) = oneshot::channel();
        follower
            .handle(AppMsg::GetDecidedValues {
                range: Height(start)..=Height(end),
                reply,
            })
            .unwrap();
        rx.try_recv().unwrap()
    };
    let values = served(1, u64::MAX);
    assert_eq!(values.len(), 1);
    assert_eq!(values[0].certificate.value_id, id);
    assert!(served(0, 5).is_empty());
    assert!(served(2, 9).is_empty());
}

#[test]
fn a_block_streamed_for_another_rounds_proposer_is_ignored() {
    let (genesis, keys) = genesis_with(2);
    let set = ValidatorSet::from_genesis(&genesis).unwrap();
    let not_first = keys
        .iter()
        .find(|k| proposer_of(&set, Height(1), Round::new(0)).address.0 != k.address())
        .unwrap();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut impostor = app(&genesis, Some(not_first.clone()), a.path());
    let mut follower = app(&genesis, None, b.path());
    let (_, parts) = get_value(&mut impostor, 1, 0);
    assert!(receive(&mut follower, parts).is_none());
}

#[test]
fn a_decision_this_node_cannot_commit_stops_it() {
    let (genesis, keys) = genesis_with(1);
    let home = tempfile::tempdir().unwrap();
    let mut follower = app(&genesis, None, home.path());
    let unknown = Certificate::signed_by(&genesis.chain_id(), 1, 0, Hash([7; 32]), &[&keys[0]]);
    assert!(decided(&mut follower, commit_certificate(&unknown)).is_err());
    assert!(follower.chain.blocks.is_empty());
}
