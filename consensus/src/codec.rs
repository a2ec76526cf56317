//! The bytes of everything the engine sends to peers or writes to its WAL. Malachite leaves
//! the encoding to the application; this one is hand-written, fixed-width little-endian
//! with length-prefixed lists, so that nothing a peer sends is allocated before its length
//! has been checked against both a hard limit and the bytes actually present. Every
//! decoder consumes its whole input and fails with a `CodecError`, never a panic.

use std::ops::RangeInclusive;

use bytes::Bytes;
use kvasir_ledger::keys::Signature;
use kvasir_ledger::Hash;
use kvasir_primitives::codec::{self, ReadError};
use malachitebft_app_channel::app::consensus::LivenessMsg;
use malachitebft_app_channel::app::streaming::{StreamContent, StreamId, StreamMessage};
use malachitebft_app_channel::app::types::codec::{Codec, HasEncodedLen};
use malachitebft_app_channel::app::types::core::{
    ExtendedCommitCertificate, ExtendedCommitSignature, NilOrVal, PolkaCertificate, PolkaSignature,
    Round, RoundCertificate, RoundCertificateType, RoundSignature, SignedMessage, ValidatorProof,
    Validity, VoteType,
};
use malachitebft_app_channel::app::types::{PeerId, ProposedValue, SignedConsensusMsg};
use malachitebft_sync::{RawDecidedValue, Request, Response, Status, ValueRequest, ValueResponse};

use crate::context::{Address, BlockId, ConsensusSignature, Height, LedgerContext, Proposal, Vote};
use crate::parts::{Init, ProposalPart, MAX_CHUNK};

/// Signatures in one certificate. A round certificate may hold a prevote and a precommit
/// of each validator, so this allows 512 validators, far more than any chain here names.
const MAX_SIGNATURES: u64 = 1024;

/// Decided blocks in one sync response (the engine asks for 5 at a time).
pub(crate) const MAX_SYNC_VALUES: u64 = 16;

/// A libp2p peer id is a multihash of at most 64 bytes plus its header.
const MAX_PEER_ID: u64 = 128;
/// Our stream ids are 12 bytes; a little room for another proposer's.
const MAX_STREAM_ID: u64 = 64;
const MAX_PUBLIC_KEY: u64 = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("the message ends early")]
    Truncated,
    #[error("{what} holds {len}, more than the {max} allowed")]
    TooLong {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("unknown {what} tag {tag}")]
    BadTag { what: &'static str, tag: u8 },
    #[error("{0} bytes follow the message")]
    Trailing(usize),
    #[error("{0} at a nil round cannot be encoded")]
    NilRound(&'static str),
    #[error("not a peer id")]
    BadPeerId,
}

/// The codec for network, sync and WAL. `max_block_bytes` bounds a block shipped by sync.
#[derive(Clone, Copy, Debug)]
pub struct LedgerCodec {
    max_block_bytes: u64,
}

impl LedgerCodec {
    pub fn new(max_block_bytes: u64) -> LedgerCodec {
        LedgerCodec { max_block_bytes }
    }
}

/// Where encoded bytes go: a buffer, or a counter when only the length is wanted.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

struct Counter(usize);

impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }
}

type Encoded = Result<(), CodecError>;

fn u8_(out: &mut impl Sink, v: u8) {
    out.put(&[v]);
}

fn u32_(out: &mut impl Sink, v: u32) {
    out.put(&v.to_le_bytes());
}

fn u64_(out: &mut impl Sink, v: u64) {
    out.put(&v.to_le_bytes());
}

fn len_(out: &mut impl Sink, what: &'static str, len: usize, max: u64) -> Encoded {
    let len = len as u64;
    if len > max {
        return Err(CodecError::TooLong { what, len, max });
    }
    // `max` never exceeds u32::MAX for any list or byte string here.
    u32_(out, len as u32);
    Ok(())
}

fn bytes_(out: &mut impl Sink, what: &'static str, bytes: &[u8], max: u64) -> Encoded {
    len_(out, what, bytes.len(), max)?;
    out.put(bytes);
    Ok(())
}

fn round_(out: &mut impl Sink, what: &'static str, round: Round) -> Encoded {
    u32_(out, round.as_u32().ok_or(CodecError::NilRound(what))?);
    Ok(())
}

fn opt_round_(out: &mut impl Sink, round: Round) {
    match round.as_u32() {
        None => u8_(out, 0),
        Some(r) => {
            u8_(out, 1);
            u32_(out, r);
        }
    }
}

fn address_(out: &mut impl Sink, address: &Address) {
    out.put(address.0.as_bytes());
}

fn id_(out: &mut impl Sink, id: &BlockId) {
    out.put(id.0.as_bytes());
}

fn signature_(out: &mut impl Sink, signature: &ConsensusSignature) {
    out.put(&signature.0 .0);
}

fn nil_or_val_(out: &mut impl Sink, value: &NilOrVal<BlockId>) {
    match value {
        NilOrVal::Nil => u8_(out, 0),
        NilOrVal::Val(id) => {
            u8_(out, 1);
            id_(out, id);
        }
    }
}

fn vote_type_(out: &mut impl Sink, vote_type: VoteType) {
    u8_(
        out,
        match vote_type {
            VoteType::Prevote => 0,
            VoteType::Precommit => 1,
        },
    );
}

fn vote_(out: &mut impl Sink, vote: &Vote) -> Encoded {
    vote_type_(out, vote.vote_type);
    u64_(out, vote.height.0);
    round_(out, "vote", vote.round)?;
    nil_or_val_(out, &vote.value);
    address_(out, &vote.validator);
    Ok(())
}

fn proposal_(out: &mut impl Sink, proposal: &Proposal) -> Encoded {
    u64_(out, proposal.height.0);
    round_(out, "proposal", proposal.round)?;
    id_(out, &proposal.value);
    opt_round_(out, proposal.pol_round);
    address_(out, &proposal.proposer);
    Ok(())
}

fn signed_vote_(out: &mut impl Sink, vote: &SignedMessage<LedgerContext, Vote>) -> Encoded {
    vote_(out, &vote.message)?;
    signature_(out, &vote.signature);
    Ok(())
}

fn consensus_msg_(out: &mut impl Sink, msg: &SignedConsensusMsg<LedgerContext>) -> Encoded {
    match msg {
        SignedConsensusMsg::Vote(vote) => {
            u8_(out, 0);
            signed_vote_(out, vote)
        }
        SignedConsensusMsg::Proposal(proposal) => {
            u8_(out, 1);
            proposal_(out, &proposal.message)?;
            signature_(out, &proposal.signature);
            Ok(())
        }
    }
}

fn polka_(out: &mut impl Sink, cert: &PolkaCertificate<LedgerContext>) -> Encoded {
    u64_(out, cert.height.0);
    round_(out, "polka certificate", cert.round)?;
    id_(out, &cert.value_id);
    len_(
        out,
        "signatures",
        cert.polka_signatures.len(),
        MAX_SIGNATURES,
    )?;
    for s in &cert.polka_signatures {
        address_(out, &s.address);
        signature_(out, &s.signature);
    }
    Ok(())
}

fn round_cert_(out: &mut impl Sink, cert: &RoundCertificate<LedgerContext>) -> Encoded {
    u64_(out, cert.height.0);
    round_(out, "round certificate", cert.round)?;
    u8_(
        out,
        match cert.cert_type {
            RoundCertificateType::Skip => 0,
            RoundCertificateType::Precommit => 1,
        },
    );
    len_(
        out,
        "signatures",
        cert.round_signatures.len(),
        MAX_SIGNATURES,
    )?;
    for s in &cert.round_signatures {
        vote_type_(out, s.vote_type);
        nil_or_val_(out, &s.value_id);
        address_(out, &s.address);
        signature_(out, &s.signature);
    }
    Ok(())
}

fn liveness_(out: &mut impl Sink, msg: &LivenessMsg<LedgerContext>) -> Encoded {
    match msg {
        LivenessMsg::Vote(vote) => {
            u8_(out, 0);
            signed_vote_(out, vote)
        }
        LivenessMsg::PolkaCertificate(cert) => {
            u8_(out, 1);
            polka_(out, cert)
        }
        LivenessMsg::SkipRoundCertificate(cert) => {
            u8_(out, 2);
            round_cert_(out, cert)
        }
    }
}

fn part_(out: &mut impl Sink, part: &ProposalPart) -> Encoded {
    match part {
        ProposalPart::Init(init) => {
            u8_(out, 0);
            u64_(out, init.height.0);
            round_(out, "proposal part", init.round)?;
            opt_round_(out, init.pol_round);
            address_(out, &init.proposer);
            out.put(&init.seal.0);
            Ok(())
        }
        ProposalPart::Data(data) => {
            u8_(out, 1);
            bytes_(out, "proposal part", data, MAX_CHUNK as u64)
        }
    }
}

fn stream_(out: &mut impl Sink, msg: &StreamMessage<ProposalPart>) -> Encoded {
    bytes_(out, "stream id", &msg.stream_id.to_bytes(), MAX_STREAM_ID)?;
    u64_(out, msg.sequence);
    match &msg.content {
        StreamContent::Data(part) => {
            u8_(out, 0);
            part_(out, part)
        }
        StreamContent::Fin => {
            u8_(out, 1);
            Ok(())
        }
    }
}

fn certificate_(out: &mut impl Sink, cert: &ExtendedCommitCertificate<LedgerContext>) -> Encoded {
    u64_(out, cert.height.0);
    round_(out, "commit certificate", cert.round)?;
    id_(out, &cert.value_id);
    len_(
        out,
        "signatures",
        cert.commit_signatures.len(),
        MAX_SIGNATURES,
    )?;
    for s in &cert.commit_signatures {
        address_(out, &s.address);
        signature_(out, &s.signature);
        match &s.extension {
            None => u8_(out, 0),
            Some(extension) => {
                u8_(out, 1);
                signature_(out, &extension.signature);
            }
        }
    }
    Ok(())
}

fn response_(
    out: &mut impl Sink,
    response: &Response<LedgerContext>,
    max_block_bytes: u64,
) -> Encoded {
    let Response::ValueResponse(response) = response;
    u8_(out, 0);
    u64_(out, response.start_height.0);
    len_(out, "sync values", response.values.len(), MAX_SYNC_VALUES)?;
    for value in &response.values {
        bytes_(out, "synced block", &value.value_bytes, max_block_bytes)?;
        certificate_(out, &value.certificate)?;
    }
    Ok(())
}

fn proposed_value_(out: &mut impl Sink, value: &ProposedValue<LedgerContext>) -> Encoded {
    u64_(out, value.height.0);
    round_(out, "proposed value", value.round)?;
    opt_round_(out, value.valid_round);
    address_(out, &value.proposer);
    id_(out, &value.value);
    u8_(
        out,
        match value.validity {
            Validity::Invalid => 0,
            Validity::Valid => 1,
        },
    );
    Ok(())
}

fn encode_with(write: impl FnOnce(&mut Vec<u8>) -> Encoded) -> Result<Bytes, CodecError> {
    let mut out = Vec::new();
    write(&mut out)?;
    Ok(Bytes::from(out))
}

/// Reads one message, every length checked before anything is allocated for it: the shared
/// bounded reader (`kvasir_primitives::codec`) over the message's bytes, which a field of
/// bytes is sliced from without a copy.
struct Reader<'a> {
    source: &'a Bytes,
    inner: codec::Reader<'a>,
}

impl<'a> std::ops::Deref for Reader<'a> {
    type Target = codec::Reader<'a>;
    fn deref(&self) -> &codec::Reader<'a> {
        &self.inner
    }
}

impl std::ops::DerefMut for Reader<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

impl From<ReadError> for CodecError {
    fn from(error: ReadError) -> CodecError {
        match error {
            ReadError::Truncated { .. } => CodecError::Truncated,
            ReadError::TooLarge { what, got, max } => CodecError::TooLong {
                what,
                len: got,
                max,
            },
            ReadError::Trailing(extra) => CodecError::Trailing(extra),
        }
    }
}

impl<'a> Reader<'a> {
    fn new(source: &'a Bytes) -> Reader<'a> {
        Reader {
            source,
            inner: codec::Reader::new(source),
        }
    }

    /// A list length: at most `max`, and no more items of `item_size` bytes than remain.
    fn len(&mut self, what: &'static str, max: u64, item_size: usize) -> Result<usize, CodecError> {
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        Ok(self.inner.count(what, max, item_size)?)
    }

    fn bytes(&mut self, what: &'static str, max: u64) -> Result<Bytes, CodecError> {
        let len = self.len(what, max, 1)?;
        let start = self.position();
        self.take(len)?;
        Ok(self.source.slice(start..start + len))
    }

    fn tag(&mut self, what: &'static str, max: u8) -> Result<u8, CodecError> {
        let tag = self.u8()?;
        if tag > max {
            return Err(CodecError::BadTag { what, tag });
        }
        Ok(tag)
    }

    fn finish<T>(self, value: T) -> Result<T, CodecError> {
        self.inner.finish()?;
        Ok(value)
    }

    fn height(&mut self) -> Result<Height, CodecError> {
        Ok(Height(self.u64()?))
    }

    fn round(&mut self) -> Result<Round, CodecError> {
        Ok(Round::new(self.u32()?))
    }

    fn opt_round(&mut self) -> Result<Round, CodecError> {
        match self.tag("round", 1)? {
            0 => Ok(Round::Nil),
            _ => self.round(),
        }
    }

    fn address(&mut self) -> Result<Address, CodecError> {
        Ok(Address(kvasir_ledger::Address::from_bytes(self.array()?)))
    }

    fn id(&mut self) -> Result<BlockId, CodecError> {
        Ok(BlockId(Hash(self.array()?)))
    }

    fn signature(&mut self) -> Result<ConsensusSignature, CodecError> {
        Ok(ConsensusSignature(Signature(self.array()?)))
    }

    fn nil_or_val(&mut self) -> Result<NilOrVal<BlockId>, CodecError> {
        match self.tag("value", 1)? {
            0 => Ok(NilOrVal::Nil),
            _ => Ok(NilOrVal::Val(self.id()?)),
        }
    }

    fn vote_type(&mut self) -> Result<VoteType, CodecError> {
        match self.tag("vote type", 1)? {
            0 => Ok(VoteType::Prevote),
            _ => Ok(VoteType::Precommit),
        }
    }

    fn vote(&mut self) -> Result<Vote, CodecError> {
        Ok(Vote {
            vote_type: self.vote_type()?,
            height: self.height()?,
            round: self.round()?,
            value: self.nil_or_val()?,
            validator: self.address()?,
        })
    }

    fn proposal(&mut self) -> Result<Proposal, CodecError> {
        Ok(Proposal {
            height: self.height()?,
            round: self.round()?,
            value: self.id()?,
            pol_round: self.opt_round()?,
            proposer: self.address()?,
        })
    }

    fn signed_vote(&mut self) -> Result<SignedMessage<LedgerContext, Vote>, CodecError> {
        let vote = self.vote()?;
        Ok(SignedMessage::new(vote, self.signature()?))
    }

    fn consensus_msg(&mut self) -> Result<SignedConsensusMsg<LedgerContext>, CodecError> {
        match self.tag("consensus message", 1)? {
            0 => Ok(SignedConsensusMsg::Vote(self.signed_vote()?)),
            _ => {
                let proposal = self.proposal()?;
                Ok(SignedConsensusMsg::Proposal(SignedMessage::new(
                    proposal,
                    self.signature()?,
                )))
            }
        }
    }

    fn polka(&mut self) -> Result<PolkaCertificate<LedgerContext>, CodecError> {
        let height = self.height()?;
        let round = self.round()?;
        let value_id = self.id()?;
        let n = self.len("signatures", MAX_SIGNATURES, 32 + 64)?;
        let mut polka_signatures = Vec::with_capacity(n);
        for _ in 0..n {
            let address = self.address()?;
            polka_signatures.push(PolkaSignature::new(address, self.signature()?));
        }
        Ok(PolkaCertificate {
            height,
            round,
            value_id,
            polka_signatures,
        })
    }

    fn round_cert(&mut self) -> Result<RoundCertificate<LedgerContext>, CodecError> {
        let height = self.height()?;
        let round = self.round()?;
        let cert_type = match self.tag("round certificate type", 1)? {
            0 => RoundCertificateType::Skip,
            _ => RoundCertificateType::Precommit,
        };
        let n = self.len("signatures", MAX_SIGNATURES, 1 + 1 + 32 + 64)?;
        let mut round_signatures = Vec::with_capacity(n);
        for _ in 0..n {
            let vote_type = self.vote_type()?;
            let value_id = self.nil_or_val()?;
            let address = self.address()?;
            round_signatures.push(RoundSignature::new(
                vote_type,
                value_id,
                address,
                self.signature()?,
            ));
        }
        Ok(RoundCertificate {
            height,
            round,
            cert_type,
            round_signatures,
        })
    }

    fn liveness(&mut self) -> Result<LivenessMsg<LedgerContext>, CodecError> {
        match self.tag("liveness message", 2)? {
            0 => Ok(LivenessMsg::Vote(self.signed_vote()?)),
            1 => Ok(LivenessMsg::PolkaCertificate(self.polka()?)),
            _ => Ok(LivenessMsg::SkipRoundCertificate(self.round_cert()?)),
        }
    }

    fn part(&mut self) -> Result<ProposalPart, CodecError> {
        match self.tag("proposal part", 1)? {
            0 => Ok(ProposalPart::Init(Init {
                height: self.height()?,
                round: self.round()?,
                pol_round: self.opt_round()?,
                proposer: self.address()?,
                seal: self.signature()?.0,
            })),
            _ => Ok(ProposalPart::Data(
                self.bytes("proposal part", MAX_CHUNK as u64)?,
            )),
        }
    }

    fn stream(&mut self) -> Result<StreamMessage<ProposalPart>, CodecError> {
        let stream_id = StreamId::new(self.bytes("stream id", MAX_STREAM_ID)?);
        let sequence = self.u64()?;
        let content = match self.tag("stream content", 1)? {
            0 => StreamContent::Data(self.part()?),
            _ => StreamContent::Fin,
        };
        Ok(StreamMessage::new(stream_id, sequence, content))
    }

    fn peer_id(&mut self) -> Result<PeerId, CodecError> {
        let bytes = self.bytes("peer id", MAX_PEER_ID)?;
        PeerId::from_bytes(&bytes).map_err(|_| CodecError::BadPeerId)
    }

    fn certificate(&mut self) -> Result<ExtendedCommitCertificate<LedgerContext>, CodecError> {
        let height = self.height()?;
        let round = self.round()?;
        let value_id = self.id()?;
        let n = self.len("signatures", MAX_SIGNATURES, 32 + 64 + 1)?;
        let mut commit_signatures = Vec::with_capacity(n);
        for _ in 0..n {
            let address = self.address()?;
            let signature = self.signature()?;
            let extension = match self.tag("vote extension", 1)? {
                0 => None,
                _ => Some(SignedMessage::new((), self.signature()?)),
            };
            commit_signatures.push(ExtendedCommitSignature::new(address, signature, extension));
        }
        Ok(ExtendedCommitCertificate {
            height,
            round,
            value_id,
            commit_signatures,
        })
    }

    fn response(&mut self, max_block_bytes: u64) -> Result<Response<LedgerContext>, CodecError> {
        self.tag("sync response", 0)?;
        let start_height = self.height()?;
        // Each value: its length, and a certificate of at least 8 + 4 + 32 + 4 bytes.
        let n = self.len("sync values", MAX_SYNC_VALUES, 4 + 48)?;
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            let value_bytes = self.bytes("synced block", max_block_bytes)?;
            values.push(RawDecidedValue::new(value_bytes, self.certificate()?));
        }
        Ok(Response::ValueResponse(ValueResponse::new(
            start_height,
            values,
        )))
    }

    fn proposed_value(&mut self) -> Result<ProposedValue<LedgerContext>, CodecError> {
        Ok(ProposedValue {
            height: self.height()?,
            round: self.round()?,
            valid_round: self.opt_round()?,
            proposer: self.address()?,
            value: self.id()?,
            validity: match self.tag("validity", 1)? {
                0 => Validity::Invalid,
                _ => Validity::Valid,
            },
        })
    }
}

fn decode_with<T>(
    bytes: Bytes,
    read: impl FnOnce(&mut Reader) -> Result<T, CodecError>,
) -> Result<T, CodecError> {
    let mut reader = Reader::new(&bytes);
    let value = read(&mut reader)?;
    reader.finish(value)
}

impl Codec<ProposalPart> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<ProposalPart, CodecError> {
        decode_with(bytes, |r| r.part())
    }

    fn encode(&self, part: &ProposalPart) -> Result<Bytes, CodecError> {
        encode_with(|out| part_(out, part))
    }
}

impl Codec<SignedConsensusMsg<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<SignedConsensusMsg<LedgerContext>, CodecError> {
        decode_with(bytes, |r| r.consensus_msg())
    }

    fn encode(&self, msg: &SignedConsensusMsg<LedgerContext>) -> Result<Bytes, CodecError> {
        encode_with(|out| consensus_msg_(out, msg))
    }
}

impl Codec<LivenessMsg<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<LivenessMsg<LedgerContext>, CodecError> {
        decode_with(bytes, |r| r.liveness())
    }

    fn encode(&self, msg: &LivenessMsg<LedgerContext>) -> Result<Bytes, CodecError> {
        encode_with(|out| liveness_(out, msg))
    }
}

impl Codec<StreamMessage<ProposalPart>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<StreamMessage<ProposalPart>, CodecError> {
        decode_with(bytes, |r| r.stream())
    }

    fn encode(&self, msg: &StreamMessage<ProposalPart>) -> Result<Bytes, CodecError> {
        encode_with(|out| stream_(out, msg))
    }
}

impl Codec<ValidatorProof<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<ValidatorProof<LedgerContext>, CodecError> {
        decode_with(bytes, |r| {
            let public_key = r.bytes("public key", MAX_PUBLIC_KEY)?.to_vec();
            let peer_id = r.bytes("peer id", MAX_PEER_ID)?.to_vec();
            Ok(ValidatorProof::new(public_key, peer_id, r.signature()?))
        })
    }

    fn encode(&self, proof: &ValidatorProof<LedgerContext>) -> Result<Bytes, CodecError> {
        encode_with(|out| {
            bytes_(out, "public key", &proof.public_key, MAX_PUBLIC_KEY)?;
            bytes_(out, "peer id", &proof.peer_id, MAX_PEER_ID)?;
            signature_(out, &proof.signature);
            Ok(())
        })
    }
}

impl Codec<Status<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<Status<LedgerContext>, CodecError> {
        decode_with(bytes, |r| {
            Ok(Status {
                peer_id: r.peer_id()?,
                tip_height: r.height()?,
                history_min_height: r.height()?,
            })
        })
    }

    fn encode(&self, status: &Status<LedgerContext>) -> Result<Bytes, CodecError> {
        encode_with(|out| {
            bytes_(out, "peer id", &status.peer_id.to_bytes(), MAX_PEER_ID)?;
            u64_(out, status.tip_height.0);
            u64_(out, status.history_min_height.0);
            Ok(())
        })
    }
}

impl Codec<Request<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<Request<LedgerContext>, CodecError> {
        decode_with(bytes, |r| {
            r.tag("sync request", 0)?;
            let start = r.height()?;
            let end = r.height()?;
            let range: RangeInclusive<Height> = start..=end;
            Ok(Request::ValueRequest(ValueRequest::new(range)))
        })
    }

    fn encode(&self, request: &Request<LedgerContext>) -> Result<Bytes, CodecError> {
        let Request::ValueRequest(request) = request;
        encode_with(|out| {
            u8_(out, 0);
            u64_(out, request.range.start().0);
            u64_(out, request.range.end().0);
            Ok(())
        })
    }
}

impl Codec<Response<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<Response<LedgerContext>, CodecError> {
        decode_with(bytes, |r| r.response(self.max_block_bytes))
    }

    fn encode(&self, response: &Response<LedgerContext>) -> Result<Bytes, CodecError> {
        encode_with(|out| response_(out, response, self.max_block_bytes))
    }
}

impl HasEncodedLen<Response<LedgerContext>> for LedgerCodec {
    fn encoded_len(&self, response: &Response<LedgerContext>) -> Result<usize, CodecError> {
        let mut counter = Counter(0);
        response_(&mut counter, response, self.max_block_bytes)?;
        Ok(counter.0)
    }
}

impl Codec<ProposedValue<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<ProposedValue<LedgerContext>, CodecError> {
        decode_with(bytes, |r| r.proposed_value())
    }

    fn encode(&self, value: &ProposedValue<LedgerContext>) -> Result<Bytes, CodecError> {
        encode_with(|out| proposed_value_(out, value))
    }
}

impl Codec<PolkaCertificate<LedgerContext>> for LedgerCodec {
    type Error = CodecError;

    fn decode(&self, bytes: Bytes) -> Result<PolkaCertificate<LedgerContext>, CodecError> {
        decode_with(bytes, |r| r.polka())
    }

    fn encode(&self, cert: &PolkaCertificate<LedgerContext>) -> Result<Bytes, CodecError> {
        encode_with(|out| polka_(out, cert))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certificates::synced_certificate;
    use crate::tests::genesis_with;
    use kvasir_ledger::Certificate;
    use malachitebft_app_channel::app::types::core::PolkaSignature;
    use proptest::prelude::*;

    const MAX_BLOCK: u64 = 1 << 20;

    fn codec() -> LedgerCodec {
        LedgerCodec::new(MAX_BLOCK)
    }

    fn address(n: u8) -> Address {
        Address(kvasir_ledger::Address::from_bytes([n; 32]))
    }

    fn signature(n: u8) -> ConsensusSignature {
        ConsensusSignature(Signature([n; 64]))
    }

    fn peer() -> PeerId {
        let key =
            malachitebft_app_channel::app::types::Keypair::ed25519_from_bytes([7u8; 32]).unwrap();
        PeerId::from_bytes(&key.public().to_peer_id().to_bytes()).unwrap()
    }

    fn vote(value: NilOrVal<BlockId>) -> SignedMessage<LedgerContext, Vote> {
        SignedMessage::new(
            Vote {
                vote_type: VoteType::Precommit,
                height: Height(u64::MAX),
                round: Round::new(u32::MAX),
                value,
                validator: address(1),
            },
            signature(2),
        )
    }

    fn proposal() -> SignedConsensusMsg<LedgerContext> {
        SignedConsensusMsg::Proposal(SignedMessage::new(
            Proposal {
                height: Height(7),
                round: Round::new(3),
                value: BlockId(Hash([4; 32])),
                pol_round: Round::new(1),
                proposer: address(5),
            },
            signature(6),
        ))
    }

    fn response() -> Response<LedgerContext> {
        let (genesis, keys) = genesis_with(4);
        let signers: Vec<_> = keys.iter().take(3).collect();
        let cert = Certificate::signed_by(&genesis.chain_id(), 12, 1, Hash([8; 32]), &signers);
        let mut synced = synced_certificate(&cert);
        synced.commit_signatures[1].extension = Some(SignedMessage::new((), signature(9)));
        Response::ValueResponse(ValueResponse::new(
            Height(12),
            vec![
                RawDecidedValue::new(Bytes::from_static(b"block twelve"), synced),
                RawDecidedValue::new(Bytes::new(), synced_certificate(&cert)),
            ],
        ))
    }

    fn round_trip<T>(value: T) -> Bytes
    where
        T: PartialEq + std::fmt::Debug,
        LedgerCodec: Codec<T, Error = CodecError>,
    {
        let bytes = codec().encode(&value).unwrap();
        assert_eq!(codec().decode(bytes.clone()), Ok(value));
        bytes
    }

    #[test]
    fn every_message_round_trips() {
        round_trip(SignedConsensusMsg::Vote(vote(NilOrVal::Nil)));
        round_trip(SignedConsensusMsg::Vote(vote(NilOrVal::Val(BlockId(
            Hash([3; 32]),
        )))));
        round_trip(proposal());
        let polka = PolkaCertificate {
            height: Height(3),
            round: Round::new(0),
            value_id: BlockId(Hash([1; 32])),
            polka_signatures: vec![
                PolkaSignature::new(address(1), signature(1)),
                PolkaSignature::new(address(2), signature(2)),
            ],
        };
        round_trip(polka.clone());
        round_trip(LivenessMsg::PolkaCertificate(polka));
        round_trip(LivenessMsg::Vote(vote(NilOrVal::Nil)));
        round_trip(LivenessMsg::SkipRoundCertificate(RoundCertificate {
            height: Height(3),
            round: Round::new(2),
            cert_type: RoundCertificateType::Skip,
            round_signatures: vec![
                RoundSignature::new(VoteType::Prevote, NilOrVal::Nil, address(1), signature(1)),
                RoundSignature::new(
                    VoteType::Precommit,
                    NilOrVal::Val(BlockId(Hash([2; 32]))),
                    address(2),
                    signature(2),
                ),
            ],
        }));
        let init = Init {
            height: Height(9),
            round: Round::new(0),
            pol_round: Round::Nil,
            proposer: address(3),
            seal: signature(3).0,
        };
        round_trip(ProposalPart::Init(init));
        round_trip(ProposalPart::Data(Bytes::from(vec![5u8; MAX_CHUNK])));
        for message in crate::parts::split(init, &[1u8; 100]) {
            round_trip(message);
        }
        round_trip(ValidatorProof::<LedgerContext>::new(
            vec![1; 32],
            peer().to_bytes(),
            signature(3),
        ));
        round_trip(Status::<LedgerContext> {
            peer_id: peer(),
            tip_height: Height(10),
            history_min_height: Height(1),
        });
        round_trip(Request::<LedgerContext>::ValueRequest(ValueRequest::new(
            Height(4)..=Height(8),
        )));
        round_trip(response());
        for (valid_round, validity) in [
            (Round::Nil, Validity::Valid),
            (Round::new(2), Validity::Invalid),
        ] {
            round_trip(ProposedValue::<LedgerContext> {
                height: Height(2),
                round: Round::new(3),
                valid_round,
                proposer: address(4),
                value: BlockId(Hash([5; 32])),
                validity,
            });
        }
    }

    #[test]
    fn the_sync_response_length_is_its_encoding_length() {
        let response = response();
        assert_eq!(
            codec().encoded_len(&response).unwrap(),
            codec().encode(&response).unwrap().len()
        );
    }

    #[test]
    fn what_cannot_be_encoded_or_decoded_is_an_error() {
        let mut nil = vote(NilOrVal::Nil);
        nil.message.round = Round::Nil;
        assert_eq!(
            codec().encode(&SignedConsensusMsg::Vote(nil)),
            Err(CodecError::NilRound("vote"))
        );
        let too_big = ProposalPart::Data(Bytes::from(vec![0u8; MAX_CHUNK + 1]));
        assert!(matches!(
            codec().encode(&too_big),
            Err(CodecError::TooLong { .. })
        ));

        let bytes = codec().encode(&proposal()).unwrap();
        let mut trailing = bytes.to_vec();
        trailing.push(0);
        assert_eq!(
            Codec::<SignedConsensusMsg<LedgerContext>>::decode(&codec(), trailing.into()),
            Err(CodecError::Trailing(1))
        );
        let short = bytes.slice(..bytes.len() - 1);
        assert_eq!(
            Codec::<SignedConsensusMsg<LedgerContext>>::decode(&codec(), short),
            Err(CodecError::Truncated)
        );
        let mut tag = bytes.to_vec();
        tag[0] = 9;
        assert!(matches!(
            Codec::<SignedConsensusMsg<LedgerContext>>::decode(&codec(), tag.into()),
            Err(CodecError::BadTag { .. })
        ));

        // A claimed length is checked against the limit and the bytes present before
        // anything is allocated for it.
        let mut huge = vec![0u8];
        huge.extend_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Codec::<Response<LedgerContext>>::decode(&codec(), huge.into()),
            Err(CodecError::TooLong { .. })
        ));
        let mut many = vec![0u8];
        many.extend_from_slice(&1u64.to_le_bytes());
        many.extend_from_slice(&(MAX_SYNC_VALUES as u32).to_le_bytes());
        assert_eq!(
            Codec::<Response<LedgerContext>>::decode(&codec(), many.into()),
            Err(CodecError::Truncated)
        );
        let block = Response::ValueResponse(ValueResponse::new(
            Height(1),
            vec![RawDecidedValue::new(
                Bytes::from(vec![0u8; 100]),
                synced_certificate(&Certificate {
                    height: 1,
                    round: 0,
                    block: Hash::ZERO,
                    signatures: Vec::new(),
                }),
            )],
        ));
        let encoded = codec().encode(&block).unwrap();
        assert!(matches!(
            Codec::<Response<LedgerContext>>::decode(&LedgerCodec::new(99), encoded),
            Err(CodecError::TooLong { .. })
        ));
        let mut not_a_peer = vec![3u8, 0, 0, 0];
        not_a_peer.extend_from_slice(&[0xff; 3]);
        not_a_peer.extend_from_slice(&[0; 16]);
        assert_eq!(
            Codec::<Status<LedgerContext>>::decode(&codec(), not_a_peer.into()),
            Err(CodecError::BadPeerId)
        );
    }

    /// Decodes `bytes` as `T`; when that succeeds, the encoding is canonical: it encodes
    /// back to the very same bytes.
    fn decode_is_total_and_canonical<T>(bytes: &[u8])
    where
        LedgerCodec: Codec<T, Error = CodecError>,
    {
        if let Ok(value) = Codec::<T>::decode(&codec(), Bytes::copy_from_slice(bytes)) {
            assert_eq!(codec().encode(&value).unwrap().as_ref(), bytes);
        }
    }

    fn decode_all(bytes: &[u8]) {
        decode_is_total_and_canonical::<ProposalPart>(bytes);
        decode_is_total_and_canonical::<SignedConsensusMsg<LedgerContext>>(bytes);
        decode_is_total_and_canonical::<LivenessMsg<LedgerContext>>(bytes);
        decode_is_total_and_canonical::<StreamMessage<ProposalPart>>(bytes);
        decode_is_total_and_canonical::<ValidatorProof<LedgerContext>>(bytes);
        decode_is_total_and_canonical::<Status<LedgerContext>>(bytes);
        decode_is_total_and_canonical::<Request<LedgerContext>>(bytes);
        decode_is_total_and_canonical::<Response<LedgerContext>>(bytes);
        decode_is_total_and_canonical::<ProposedValue<LedgerContext>>(bytes);
        decode_is_total_and_canonical::<PolkaCertificate<LedgerContext>>(bytes);
    }

    /// Valid encodings of each kind, for mutation.
    fn samples() -> Vec<Bytes> {
        let c = codec();
        vec![
            c.encode(&proposal()).unwrap(),
            c.encode(&SignedConsensusMsg::Vote(vote(NilOrVal::Nil)))
                .unwrap(),
            c.encode(&response()).unwrap(),
            c.encode(&Status::<LedgerContext> {
                peer_id: peer(),
                tip_height: Height(1),
                history_min_height: Height(1),
            })
            .unwrap(),
            c.encode(
                &crate::parts::split(
                    Init {
                        height: Height(1),
                        round: Round::new(0),
                        pol_round: Round::Nil,
                        proposer: address(1),
                        seal: signature(1).0,
                    },
                    &[],
                )[0],
            )
            .unwrap(),
        ]
    }

    proptest! {
        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            decode_all(&bytes);
        }

        #[test]
        fn decoding_corrupted_messages_never_panics(
            which in 0usize..5,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
            cut in any::<usize>(),
        ) {
            let mut bytes = samples()[which].to_vec();
            for (at, value) in flips {
                let at = at % bytes.len();
                bytes[at] = value;
            }
            decode_all(&bytes);
            decode_all(&bytes[..cut % (bytes.len() + 1)]);
        }

        #[test]
        fn votes_and_proposals_round_trip(
            height in any::<u64>(),
            round in any::<u32>(),
            pol in proptest::option::of(any::<u32>()),
            id in any::<[u8; 32]>(),
            nil in any::<bool>(),
            precommit in any::<bool>(),
        ) {
            let value = if nil { NilOrVal::Nil } else { NilOrVal::Val(BlockId(Hash(id))) };
            let vote = SignedMessage::new(
                Vote {
                    vote_type: if precommit { VoteType::Precommit } else { VoteType::Prevote },
                    height: Height(height),
                    round: Round::new(round),
                    value,
                    validator: address(id[0]),
                },
                signature(id[1]),
            );
            round_trip(SignedConsensusMsg::Vote(vote));
            round_trip(SignedConsensusMsg::Proposal(SignedMessage::new(
                Proposal {
                    height: Height(height),
                    round: Round::new(round),
                    value: BlockId(Hash(id)),
                    pol_round: Round::from(pol),
                    proposer: address(id[2]),
                },
                signature(id[3]),
            )));
        }
    }
}
