//! Blocks on the wire: a proposer streams its block as `Init{height, round, pol_round,
//! proposer}`, then the block's bytes in chunks of at most `MAX_CHUNK`, then the stream's
//! `Fin`; receivers put the stream back together.
//!
//! Malachite does not sign parts, and any peer can publish a stream, so the proposer seals
//! its block: the Init carries its signature over height, round, lock round and the blake3
//! of the block's bytes (`kvasir_ledger::certificate::StreamedBlock`), checked before the
//! block is validated or kept. An assembled block still has to pass `Chain::validate`
//! before it counts, and consensus only decides the block whose id the proposer signed. What a forged or abandoned stream can cost is memory, so every way a
//! peer could grow it is bounded: bytes per stream, streams per publisher and in all, total
//! buffered bytes, and how far ahead a height may be. Past heights are pruned as the chain
//! moves on.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use malachitebft_app_channel::app::streaming::{StreamContent, StreamId, StreamMessage};
use malachitebft_app_channel::app::types::core::{self as core, Round};
use malachitebft_app_channel::app::types::PeerId;

use kvasir_ledger::certificate::StreamedBlock;
use kvasir_ledger::keys::Signature;

use crate::context::{Address, Height, LedgerContext};

/// The largest chunk of block bytes one part carries.
pub const MAX_CHUNK: usize = 64 * 1024;

/// How many heights past the one being decided a stream may be for; later ones are dropped.
pub const MAX_HEIGHTS_AHEAD: u64 = 2;

/// Streams being assembled at once from one publisher, and from all.
const MAX_STREAMS_PER_PEER: usize = 4;
const MAX_STREAMS: usize = 32;

/// Blocks' worth of bytes buffered across all open streams.
const MAX_BUFFERED_BLOCKS: u64 = 4;

/// The first part of a stream: which proposal the block that follows belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Init {
    pub height: Height,
    pub round: Round,
    pub pol_round: Round,
    pub proposer: Address,
    /// The proposer's seal on the block that follows.
    pub seal: Signature,
}

impl Init {
    /// What `seal` signs, for the block `bytes`.
    pub fn sealed(&self, bytes: &[u8]) -> StreamedBlock {
        StreamedBlock::new(
            self.height.0,
            self.round.as_u32().unwrap_or(u32::MAX),
            self.pol_round.as_u32(),
            bytes,
        )
    }
}

/// One part of a streamed block. The stream's end is the stream's own `Fin`, not a part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProposalPart {
    Init(Init),
    Data(Bytes),
}

impl core::ProposalPart<LedgerContext> for ProposalPart {
    fn is_first(&self) -> bool {
        matches!(self, ProposalPart::Init(_))
    }

    fn is_last(&self) -> bool {
        false
    }
}

/// The stream id of a proposal: its height and round, so a re-streamed proposal replaces
/// what is left of its earlier stream rather than opening another.
pub fn stream_id(height: Height, round: Round) -> StreamId {
    let mut id = Vec::with_capacity(12);
    id.extend_from_slice(&height.0.to_be_bytes());
    id.extend_from_slice(&round.as_u32().unwrap_or(u32::MAX).to_be_bytes());
    StreamId::new(Bytes::from(id))
}

/// The messages that carry `block` for the proposal `init`, in order.
pub fn split(init: Init, block: &[u8]) -> Vec<StreamMessage<ProposalPart>> {
    let id = stream_id(init.height, init.round);
    let mut messages = Vec::with_capacity(block.len().div_ceil(MAX_CHUNK) + 2);
    messages.push(StreamMessage::new(
        id.clone(),
        0,
        StreamContent::Data(ProposalPart::Init(init)),
    ));
    for chunk in block.chunks(MAX_CHUNK) {
        let sequence = messages.len() as u64;
        messages.push(StreamMessage::new(
            id.clone(),
            sequence,
            StreamContent::Data(ProposalPart::Data(Bytes::copy_from_slice(chunk))),
        ));
    }
    let sequence = messages.len() as u64;
    messages.push(StreamMessage::new(id, sequence, StreamContent::Fin));
    messages
}

/// A block put back together from its stream.
#[derive(Debug, PartialEq, Eq)]
pub struct Assembled {
    pub init: Init,
    pub block: Vec<u8>,
}

/// Why a part was not kept. Each drops the part, and for a malformed stream everything
/// received of it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Dropped {
    #[error("the stream is for height {0}, which is decided")]
    Past(Height),
    #[error("the stream is for height {0}, too far ahead")]
    TooFarAhead(Height),
    #[error("part {0} is past the most parts a block can take")]
    TooManyParts(u64),
    #[error("the stream's Init is not its first part, or its first part not an Init")]
    Misplaced,
    #[error("the stream carries more than the largest block's bytes")]
    TooLarge,
    #[error("the stream's parts disagree (a second Init or Fin, or a part past its Fin)")]
    Inconsistent,
}

#[derive(Default)]
struct Partial {
    init: Option<Init>,
    chunks: BTreeMap<u64, Bytes>,
    fin: Option<u64>,
    bytes: u64,
    /// The height being decided when the stream opened, to prune one whose Init never came.
    opened_at: Height,
    /// Opening order, for evicting the oldest.
    serial: u64,
}

impl Partial {
    fn is_complete(&self) -> bool {
        match (self.init, self.fin) {
            (Some(_), Some(fin)) => self.chunks.len() as u64 + 1 == fin,
            _ => false,
        }
    }
}

type Key = (PeerId, StreamId);

/// The streams being assembled, keyed by publisher and stream id.
pub struct Streams {
    max_block_bytes: u64,
    max_parts: u64,
    open: HashMap<Key, Partial>,
    buffered: u64,
    next_serial: u64,
}

impl Streams {
    pub fn new(max_block_bytes: u64) -> Streams {
        Streams {
            max_block_bytes,
            // Init, the chunks of the largest block, and Fin.
            max_parts: max_block_bytes.div_ceil(MAX_CHUNK as u64) + 2,
            open: HashMap::new(),
            buffered: 0,
            next_serial: 0,
        }
    }

    /// Adds one part published by `publisher` while `deciding` is the height being decided;
    /// returns the block when this part completes it.
    pub fn insert(
        &mut self,
        publisher: PeerId,
        message: StreamMessage<ProposalPart>,
        deciding: Height,
    ) -> Result<Option<Assembled>, Dropped> {
        let key = (publisher, message.stream_id.clone());
        let result = self.insert_part(&key, message, deciding);
        match &result {
            Err(_) => self.remove(&key),
            Ok(Some(_)) => {}
            Ok(None) => self.enforce_bounds(&key),
        }
        result
    }

    fn insert_part(
        &mut self,
        key: &Key,
        message: StreamMessage<ProposalPart>,
        deciding: Height,
    ) -> Result<Option<Assembled>, Dropped> {
        let sequence = message.sequence;
        if sequence >= self.max_parts {
            return Err(Dropped::TooManyParts(sequence));
        }
        if !self.open.contains_key(key) {
            let serial = self.next_serial;
            self.next_serial += 1;
            self.open.insert(
                key.clone(),
                Partial {
                    opened_at: deciding,
                    serial,
                    ..Partial::default()
                },
            );
        }
        let Some(partial) = self.open.get_mut(key) else {
            return Ok(None);
        };
        match message.content {
            StreamContent::Fin => match partial.fin {
                Some(fin) if fin == sequence => {}
                Some(_) => return Err(Dropped::Inconsistent),
                None => {
                    if sequence == 0 {
                        return Err(Dropped::Misplaced);
                    }
                    if partial.chunks.keys().any(|&s| s >= sequence) {
                        return Err(Dropped::Inconsistent);
                    }
                    partial.fin = Some(sequence);
                }
            },
            StreamContent::Data(ProposalPart::Init(init)) => {
                if sequence != 0 {
                    return Err(Dropped::Misplaced);
                }
                if partial.init.is_some_and(|seen| seen != init) {
                    return Err(Dropped::Inconsistent);
                }
                if init.height < deciding {
                    return Err(Dropped::Past(init.height));
                }
                if init.height.0 > deciding.0.saturating_add(MAX_HEIGHTS_AHEAD) {
                    return Err(Dropped::TooFarAhead(init.height));
                }
                partial.init = Some(init);
            }
            StreamContent::Data(ProposalPart::Data(chunk)) => {
                if sequence == 0 {
                    return Err(Dropped::Misplaced);
                }
                if partial.fin.is_some_and(|fin| sequence >= fin) {
                    return Err(Dropped::Inconsistent);
                }
                if !partial.chunks.contains_key(&sequence) {
                    let len = chunk.len() as u64;
                    if len > MAX_CHUNK as u64 || partial.bytes + len > self.max_block_bytes {
                        return Err(Dropped::TooLarge);
                    }
                    partial.bytes += len;
                    self.buffered += len;
                    partial.chunks.insert(sequence, chunk);
                }
            }
        }
        if !partial.is_complete() {
            return Ok(None);
        }
        let Some(partial) = self.open.remove(key) else {
            return Ok(None);
        };
        self.buffered -= partial.bytes;
        let Some(init) = partial.init else {
            return Ok(None);
        };
        let mut block = Vec::with_capacity(partial.bytes as usize);
        for chunk in partial.chunks.values() {
            block.extend_from_slice(chunk);
        }
        Ok(Some(Assembled { init, block }))
    }

    fn remove(&mut self, key: &Key) {
        if let Some(partial) = self.open.remove(key) {
            self.buffered -= partial.bytes;
        }
    }

    /// Evicts the oldest streams (never `keep`, the one just added to) until the publisher's
    /// count, the overall count and the buffered bytes are within bounds.
    fn enforce_bounds(&mut self, keep: &Key) {
        let max_buffered = self.max_block_bytes.saturating_mul(MAX_BUFFERED_BLOCKS);
        loop {
            let of_peer = self.open.keys().filter(|(p, _)| *p == keep.0).count();
            let victim = if of_peer > MAX_STREAMS_PER_PEER {
                self.oldest(|k| k.0 == keep.0 && k != keep)
            } else if self.open.len() > MAX_STREAMS || self.buffered > max_buffered {
                self.oldest(|k| k != keep)
            } else {
                return;
            };
            match victim {
                Some(victim) => self.remove(&victim),
                None => return,
            }
        }
    }

    fn oldest(&self, eligible: impl Fn(&Key) -> bool) -> Option<Key> {
        self.open
            .iter()
            .filter(|(k, _)| eligible(k))
            .min_by_key(|(_, p)| p.serial)
            .map(|(k, _)| k.clone())
    }

    /// Drops every stream for a height below `deciding`, and every one still without its
    /// Init a height after it opened.
    pub fn prune(&mut self, deciding: Height) {
        let stale: Vec<Key> = self
            .open
            .iter()
            .filter(|(_, p)| match p.init {
                Some(init) => init.height < deciding,
                None => p.opened_at.0.saturating_add(1) < deciding.0,
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in stale {
            self.remove(&key);
        }
    }

    #[cfg(test)]
    fn buffered(&self) -> (usize, u64) {
        (self.open.len(), self.buffered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_ledger::Keypair;

    fn init(height: u64, round: u32) -> Init {
        Init {
            height: Height(height),
            round: Round::new(round),
            pol_round: Round::Nil,
            proposer: Address(Keypair::from_seed(&[1; 32]).address()),
            seal: Signature([0; 64]),
        }
    }

    fn peer() -> PeerId {
        let key = malachitebft_app_channel::app::types::Keypair::generate_ed25519();
        PeerId::from_bytes(&key.public().to_peer_id().to_bytes()).unwrap()
    }

    fn block(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn a_block_round_trips_in_any_order() {
        let bytes = block(3 * MAX_CHUNK + 17);
        let messages = split(init(5, 1), &bytes);
        assert_eq!(messages.len(), 4 + 2);
        let peer = peer();
        for order in [
            (0..messages.len()).collect::<Vec<_>>(),
            (0..messages.len()).rev().collect(),
            vec![3, 5, 0, 2, 4, 1],
        ] {
            let mut streams = Streams::new(1 << 20);
            let mut out = None;
            for (n, &i) in order.iter().enumerate() {
                let got = streams
                    .insert(peer, messages[i].clone(), Height(5))
                    .unwrap();
                if n + 1 < order.len() {
                    assert!(got.is_none());
                } else {
                    out = got;
                }
            }
            let assembled = out.unwrap();
            assert_eq!(assembled.init, init(5, 1));
            assert_eq!(assembled.block, bytes);
            assert_eq!(streams.buffered(), (0, 0));
        }
        // An empty block is Init and Fin.
        let mut streams = Streams::new(1 << 20);
        let messages = split(init(5, 0), &[]);
        assert!(streams
            .insert(peer, messages[1].clone(), Height(5))
            .unwrap()
            .is_none());
        let assembled = streams
            .insert(peer, messages[0].clone(), Height(5))
            .unwrap()
            .unwrap();
        assert!(assembled.block.is_empty());
    }

    #[test]
    fn streams_of_two_publishers_do_not_mix() {
        let a = split(init(5, 0), &block(MAX_CHUNK + 1));
        let b = split(init(5, 0), &block(10));
        let (pa, pb) = (peer(), peer());
        let mut streams = Streams::new(1 << 20);
        assert!(streams
            .insert(pa, a[0].clone(), Height(5))
            .unwrap()
            .is_none());
        assert!(streams
            .insert(pb, b[0].clone(), Height(5))
            .unwrap()
            .is_none());
        assert!(streams
            .insert(pb, b[1].clone(), Height(5))
            .unwrap()
            .is_none());
        assert!(streams
            .insert(pa, a[1].clone(), Height(5))
            .unwrap()
            .is_none());
        let done_b = streams
            .insert(pb, b[2].clone(), Height(5))
            .unwrap()
            .unwrap();
        assert_eq!(done_b.block, block(10));
        assert!(streams
            .insert(pa, a[2].clone(), Height(5))
            .unwrap()
            .is_none());
        let done_a = streams
            .insert(pa, a[3].clone(), Height(5))
            .unwrap()
            .unwrap();
        assert_eq!(done_a.block, block(MAX_CHUNK + 1));
    }

    #[test]
    fn malformed_past_and_far_streams_are_dropped() {
        let peer = peer();
        let mut streams = Streams::new(2 * MAX_CHUNK as u64);
        let id = stream_id(Height(5), Round::new(0));
        let data = |seq, len| {
            StreamMessage::new(
                id.clone(),
                seq,
                StreamContent::Data(ProposalPart::Data(Bytes::from(vec![0u8; len]))),
            )
        };
        let first =
            |i: Init| StreamMessage::new(id.clone(), 0, StreamContent::Data(ProposalPart::Init(i)));

        assert_eq!(
            streams.insert(peer, data(0, 1), Height(5)),
            Err(Dropped::Misplaced)
        );
        let mut late_init = first(init(5, 0));
        late_init.sequence = 2;
        assert_eq!(
            streams.insert(peer, late_init, Height(5)),
            Err(Dropped::Misplaced)
        );
        assert_eq!(
            streams.insert(peer, data(1000, 1), Height(5)),
            Err(Dropped::TooManyParts(1000))
        );
        assert_eq!(
            streams.insert(peer, first(init(4, 0)), Height(5)),
            Err(Dropped::Past(Height(4)))
        );
        assert_eq!(
            streams.insert(peer, first(init(5 + MAX_HEIGHTS_AHEAD + 1, 0)), Height(5)),
            Err(Dropped::TooFarAhead(Height(5 + MAX_HEIGHTS_AHEAD + 1)))
        );
        // More bytes than the largest block, in any number of chunks.
        assert!(streams
            .insert(peer, data(1, MAX_CHUNK), Height(5))
            .unwrap()
            .is_none());
        assert!(streams
            .insert(peer, data(2, MAX_CHUNK), Height(5))
            .unwrap()
            .is_none());
        assert_eq!(
            streams.insert(peer, data(3, 1), Height(5)),
            Err(Dropped::TooLarge)
        );
        assert_eq!(streams.buffered(), (0, 0));
        // A part after Fin, and a second Fin.
        let fin = |seq| StreamMessage::new(id.clone(), seq, StreamContent::Fin);
        assert!(streams.insert(peer, fin(2), Height(5)).unwrap().is_none());
        assert_eq!(
            streams.insert(peer, data(3, 1), Height(5)),
            Err(Dropped::Inconsistent)
        );
        assert!(streams.insert(peer, fin(2), Height(5)).unwrap().is_none());
        assert_eq!(
            streams.insert(peer, fin(3), Height(5)),
            Err(Dropped::Inconsistent)
        );
    }

    #[test]
    fn open_streams_and_bytes_stay_bounded() {
        let max_block = 2 * MAX_CHUNK as u64;
        let mut streams = Streams::new(max_block);
        let chunk = |round: u32| {
            StreamMessage::new(
                stream_id(Height(5), Round::new(round)),
                1,
                StreamContent::Data(ProposalPart::Data(Bytes::from(vec![0u8; MAX_CHUNK]))),
            )
        };
        let flooder = peer();
        for round in 0..100 {
            streams.insert(flooder, chunk(round), Height(5)).unwrap();
            assert!(streams.buffered().0 <= MAX_STREAMS_PER_PEER);
        }
        for _ in 0..100 {
            streams.insert(peer(), chunk(0), Height(5)).unwrap();
            let (open, bytes) = streams.buffered();
            assert!(open <= MAX_STREAMS);
            assert!(bytes <= max_block * MAX_BUFFERED_BLOCKS);
        }
        // The newest survive eviction, and moving on prunes streams that never got an Init.
        let honest = peer();
        let messages = split(init(5, 0), &block(100));
        streams
            .insert(honest, messages[0].clone(), Height(5))
            .unwrap();
        streams
            .insert(honest, messages[1].clone(), Height(5))
            .unwrap();
        streams.prune(Height(7));
        assert_eq!(streams.buffered(), (0, 0));
    }
}
