//! The expert-dispatch protocol, shared by worker, hub and backbone, and the contract that a
//! worker written in another language implements. What follows is what the encoder
//! ([`Message::encode`]) writes and the decoder ([`Message::decode`], [`Message::inspect`])
//! accepts; where a rule is the hub's or the backbone's (in `kvasir-node`), it says so.
//!
//! # Roles and transport
//!
//! - **Backbone**: runs the model and its router, and sends each worker the rows routed to
//!   the experts it holds. One per hub (the hub's `--backbone` key); it dials the hub.
//! - **Hub**: authenticates every link, keeps the directory of worker sessions, relays
//!   requests to workers and their answers back unchanged, byte for byte, and meters them.
//! - **Worker**: holds some experts of one model and evaluates them. It only dials out, to
//!   the gateway's `wss://HOST[:PORT]/swarm` (`ws://` on a LAN), which splices the
//!   connection through to the hub untouched.
//!
//! A link is one WebSocket. Every protocol message is one **binary** WebSocket message
//! holding exactly one frame. A text message, a close or the end of the stream ends the link;
//! pings and pongs carry no frame (see [Keepalive](#keepalive)). The WebSocket layer itself
//! refuses messages and frames over [`MAX_FRAME`] ([`link::ws_config`]). TLS: [`tls`].
//!
//! # Frames
//!
//! Every integer is little-endian; nothing is padded or aligned. A frame is a 10-byte header
//! ([`HEADER`]) and a body:
//!
//! | Offset | Size | Field                                                      |
//! |-------:|-----:|------------------------------------------------------------|
//! | 0      | 4    | magic [`MAGIC`]: ASCII `"KVSR"`, bytes `4B 56 53 52`       |
//! | 4      | 1    | version: [`VERSION`] = 4                                   |
//! | 5      | 1    | kind: see [Messages](#messages)                            |
//! | 6      | 4    | `u32` body length: exactly the frame's length minus 10     |
//! | 10     |      | body                                                       |
//!
//! A decoder checks, in this order: the whole frame is at most [`MAX_FRAME`] bytes; the
//! magic ([`WireError::BadMagic`]); the version ([`WireError::Version`]); the body length
//! against the bytes present ([`WireError::Length`]); the kind ([`WireError::UnknownKind`]).
//! A frame that ends inside the header fails at the first field it lacks
//! ([`WireError::Truncated`]).
//! It then reads the body field by field, checking every count against its limit and against
//! the bytes left *before* allocating anything, and refuses a byte left after the last field
//! ([`WireError::Trailing`]). Every failure is a typed [`WireError`]; decoding never panics.
//!
//! Example: `Welcome { session: 42, notice: "" }` is the 20 bytes
//! `4B 56 53 52 04 03 0A 00 00 00 2A 00 00 00 00 00 00 00 00 00`.
//!
//! ## Field types
//!
//! | Type      | Encoding                                                                   |
//! |-----------|----------------------------------------------------------------------------|
//! | `u8`-`u64`| unsigned integer of 1, 2, 4 or 8 bytes, little-endian                      |
//! | `f32`     | IEEE 754 binary32, 4 bytes little-endian: the exact bits computed          |
//! | `address` | 32 bytes: an ed25519 public key (its text form is bech32m `kvr1...`)      |
//! | `nonce`   | 32 bytes                                                                   |
//! | `sig`     | 64 bytes: an ed25519 signature (see [Signatures](#signatures))             |
//! | `text`    | `u16` byte length, at most `MAX_TEXT` (256); that many bytes of UTF-8      |
//! | `experts` | `u32` count, at most `MAX_HOLDINGS`; per item `u16` layer, `u16` expert    |
//!
//! Text has no terminator, and invalid UTF-8 is refused. Every list starts with its `u32`
//! count, checked against a limit; there are no optional fields and no tags but the kind.
//!
//! ## Limits
//!
//! | Limit          | Value                     | Bounds                                      |
//! |----------------|---------------------------|---------------------------------------------|
//! | [`MAX_FRAME`]  | `96 << 20` = 100,663,296  | bytes of a whole frame, header included     |
//! | `MAX_TEXT`     | 256                       | bytes of every `text` field                 |
//! | `MAX_HOLDINGS` | `1 << 20` = 1,048,576     | items of one `experts` list                 |
//! | `MAX_SESSIONS` | `1 << 16` = 65,536        | entries of a directory                      |
//! | `MAX_HIDDEN`   | `1 << 16` = 65,536        | a request's `hidden` (which is at least 1)  |
//! | `MAX_ROWS`     | `1 << 16` = 65,536        | a request's `rows`                          |
//! | (unnamed)      | `1 << 16` = 65,536        | experts of one request                      |
//! | (unnamed)      | 25,165,824 / `hidden`     | row indices listed by all of a request's    |
//! |                |                           | experts together (`MAX_FRAME / 4 / hidden`) |
//! | (unnamed)      | 25,165,824                | values of a response (`MAX_FRAME / 4`)      |
//!
//! The listed-rows bound keeps a small request from asking for an answer larger than a
//! frame. Only `MAX_FRAME` is public; the others are private constants of this file.
//!
//! # Messages
//!
//! | Kind | Message         | Direction                                                  |
//! |-----:|-----------------|------------------------------------------------------------|
//! | 1    | [`Challenge`]   | hub → client: the first frame on every link                |
//! | 2    | [`Hello`]       | worker or backbone → hub: the answer to the challenge      |
//! | 3    | [`Welcome`]     | hub → client, after a good hello                           |
//! | 4    | [`Directory`]   | hub → backbone                                             |
//! | 5    | [`Request`]     | backbone → hub → worker, relayed unchanged                 |
//! | 6    | [`Response`]    | worker → hub → backbone, relayed unchanged                 |
//! | 7    | [`Failure`]     | worker → hub → backbone; hub → backbone; hub → client      |
//!
//! Bodies, field by field in order (offsets from the start of the body where they are fixed):
//!
//! **1 Challenge**: `nonce` (32 fresh random bytes per connection), `hub: address` (the hub's
//! key), `chain_id: text` (the chain's id).
//!
//! **2 Hello**:
//!
//! | Field       | Type      | Meaning                                                       |
//! |-------------|-----------|---------------------------------------------------------------|
//! | `role`      | `u8`      | 1 worker, 2 backbone ([`Role`]); any other value is refused   |
//! | `key`       | `address` | the client's key, which signs below (a worker is paid to it)  |
//! | `model_id`  | `text`    | the model served or run ([`model_id()`])                      |
//! | `backend`   | `text`    | worker: `cpu` or `cuda` (others refused); backbone: `cpu`     |
//! | `experts`   | `experts` | worker: the experts it holds; backbone: empty                 |
//! | `order`     | `u64`     | backbone: the market order it acts for, 0 for none; worker: 0 |
//! | `arithmetic`| `u32`     | the reference arithmetic's version it computes by             |
//! | `signature` | `sig`     | see [Hello signature](#the-hello-signature)                   |
//!
//! **3 Welcome**: `session: u64`, the session the hub assigned: at least 1 for a worker,
//! 0 for the backbone; `notice: text`, what the hub's operator wants the client's operator to
//! read (a deprecation and its end), empty for nothing; a client logs it.
//!
//! **4 Directory**: `u32` count (at most `MAX_SESSIONS`), then per entry
//! ([`DirectoryEntry`]): `session: u64`, `worker: address`, `model_id: text` (its hello's),
//! `experts: experts` (its hello's claims, deduplicated and sorted by the hub).
//!
//! **5 Request** (one layer step's rows for one worker):
//!
//! | Offset | Type           | Field                                                    |
//! |-------:|----------------|----------------------------------------------------------|
//! | 0      | `u64`          | `session`: the worker's session; the hub routes by it    |
//! | 8      | `u64`          | `id`: the request id                                     |
//! | 16     | `u16`          | `layer`                                                  |
//! | 18     | `u8`           | row format ([`RowFormat`]): 0 `f32`, 1 Q8_0 blocks       |
//! | 19     | `u32`          | `hidden`: values per row, 1 to `MAX_HIDDEN`              |
//! | 23     | `u32`          | `rows`: number of rows, at most `MAX_ROWS` (0 is valid)  |
//! | 27     | r·h values     | the rows, row-major: row `i` is values `i·hidden ..`     |
//! |        | `u32`          | expert count, at most 65,536                             |
//! |        | `u16`          | per expert, in order: its number,                        |
//! |        | `u32`          | then n, how many rows it lists (at most `rows`),         |
//! |        | `u32` × n      | then those rows' indices                                 |
//!
//! The decoder also requires: experts strictly ascending (no repeats); every row index below
//! `rows`; no row index twice for one expert (two experts may list the same row; indices
//! need not ascend, and a row may be listed by none); the listed-rows bound above. Frame
//! length: [`Request::frame_len`] = 10 + 27 + row bytes + 4 + Σ(6 + 4·n).
//!
//! Row formats. `f32` (0): 4 bytes a value. Q8_0 (1, since version 4; a frame of version 3
//! with it is refused): `hidden` a multiple of 32, each row `hidden / 32` blocks of 34 bytes,
//! a binary16 scale then 32 `i8`, as the reference arithmetic quantizes activations
//! (`kvasir_inference::kernels::quant`), a little over a quarter of the `f32` bytes. The
//! rows stand for the values `quant::activation_values` gives (each integer times its scale),
//! which a matrix of a block format multiplies exactly as it would the `f32` row they were
//! quantized from. So a backbone sends Q8_0 rows for a layer only where its experts' `gate`
//! and `up` matrices are of block formats (a quantized GGUF file), and `f32` rows otherwise;
//! the answer, the audit and the evidence are the same bits either way.
//!
//! **6 Response**:
//!
//! | Offset      | Type          | Field                                                 |
//! |------------:|---------------|-------------------------------------------------------|
//! | 0           | `u64`         | `id`: the id of the request it answers                |
//! | 8           | `u32`         | value count c, at most 25,165,824                     |
//! | 12          | `f32` × c     | the partials (see [Dispatch](#dispatch))              |
//! | 12 + 4·c    | `sig`         | the worker's answer signature                         |
//!
//! Frame length: [`Response::frame_len`] = 10 + 12 + 4·c + 64 ([`SIGNATURE`]).
//!
//! **7 Failure**: `id: u64` (the request that could not be served, or 0: see
//! [Failures](#request-ids-and-failures)), `message: text` (why, for a log; [`Failure::new`]
//! cuts it to 256 bytes at a character boundary).
//!
//! # Handshake
//!
//! 1. The client opens the WebSocket, offering the subprotocol [`SUBPROTOCOL`] (`kvasir.4`);
//!    the hub's upgrade answer names it. The hub sends a [`Challenge`] at once: a fresh
//!    random nonce, its key, its chain id.
//! 2. The client answers with a [`Hello`] signed for that challenge
//!    ([`Hello::answer_for_order`]). The WebSocket handshake and the hello must complete
//!    within 10 s of the connection (the hub's `HANDSHAKE_TIMEOUT`).
//! 3. The hub checks the signature ([`Hello::verify`]). A hello that does not verify, a frame
//!    other than a hello, or a backbone hello from a key other than the hub's `--backbone`
//!    ends the link with no reply: the client sees the link close.
//! 4. Worker: the hub refuses a backend other than `cpu` or `cuda`, a key that is not bonded
//!    or is jailed (with `--ledger`), more than 16,384 distinct experts, or claims the hub or
//!    the key has no room for, by a [`Failure`] with id 0 saying why, then closes; so it does
//!    a worker or backbone whose `arithmetic` is not the hub's own (such a client never gets
//!    a session, so it is never sent work, audited or slashed). Otherwise
//!    it sends [`Welcome`] with a new session id (at least 1); no request precedes it.
//!    Backbone with `order` ≠ 0: the hub must read the order on its ledger, live (neither
//!    closed nor paused), with the key its buyer or delegate, else a `Failure` with id 0.
//!    Otherwise the backbone gets `Welcome { session: 0 }` and at once the whole
//!    [`Directory`]; a newer backbone connection replaces an older one.
//! 5. Then the link carries dispatch frames until either end closes it. The challenge's chain
//!    id and hub key and the welcome's session stay part of every answer signed on it.
//!
//! [`link::connect`] is the client's side of all this.
//!
//! # Dispatch
//!
//! - The backbone sends, per layer step, a [`Request`] to each worker session that holds
//!   experts routed to in that step: each token's row **once**, and per expert the indices
//!   of the rows routed to it ([`Request::from_expert_requests`]). A share too large to be
//!   quoted in one Evidence transaction is split into several requests, so a worker may get
//!   more than one request for a step; each is answered on its own.
//! - The worker answers each request with one [`Response`] carrying the same `id`: per expert
//!   in request order, per listed row index in listed order, `hidden` values, the expert's
//!   output for that row. Its size is therefore fixed by the request: exactly
//!   Σ n × `hidden` values ([`Request::response_values`]); the hub refuses any other count,
//!   which is how it refuses padding. [`answer()`] is the reference: it refuses a request
//!   whose `hidden` is not the model's, or that names an expert the worker does not hold,
//!   and the worker then sends a [`Failure`] with the request's id instead.
//! - Partials are checked bit for bit (the backbone's audits and a validator judging
//!   evidence recompute them with the reference kernels): every NaN must be the canonical
//!   `f32::NAN`, bits `0x7FC00000` (`kvasir_inference::moe::canonical_nans`), and -0.0 is
//!   not 0.0.
//! - A worker sends nothing but responses and failures. The hub drops a worker that sends
//!   another message or a frame that does not decode, answers an id its session was not
//!   sent (or that was forgotten, or with id 0), sends the wrong number of values, or signs
//!   badly; the backbone then gets a failure for that id and computes those experts itself.
//!   A backbone sends nothing but requests.
//! - The hub holds at most 64 unanswered requests per session (past that the backbone gets
//!   a failure at once). A request still unanswered 4 s after it reached the hub
//!   (`--answer-deadline-ms`) is failed to the backbone; a correct answer in the next 60 s
//!   is late: neither paid nor relayed, and the worker is not dropped (a wrong-sized or
//!   badly signed one is refused however late). The backbone gives up after its own
//!   `--dispatch-timeout-ms` (5 s).
//! - The hub sends the backbone the [`Directory`] on attach and whenever it changes, at most
//!   every 100 ms; workers never get one.
//!
//! # Request ids and failures
//!
//! The backbone chooses request ids; the hub keys what is outstanding by (session, id) and a
//! repeated id replaces the earlier one. The backbone starts at a random id below 2^63 and
//! counts up, so that a late answer to a restarted backbone matches nothing new. A response
//! or failure carries the id of the request it answers.
//!
//! Id 0 answers no request: it is the hub telling a link why it is refused or ends (a refused
//! hello, a worker dropped because its key may no longer serve, a backbone whose order
//! closed); the link closes after it. The decoder itself gives 0 no meaning. Every other
//! failure the backbone gets names a request: the worker's own, or the hub's (session not
//! connected, leaving or left, too many unanswered, no answer in time, answer refused).
//!
//! # Signatures
//!
//! Every signature is ed25519 (RFC 8032, no prehash) over an intent-prefixed message
//! (`kvasir_primitives::intent::signing_message`):
//!
//! | Bytes   | Content                                                                  |
//! |---------|--------------------------------------------------------------------------|
//! | 13      | the domain tag, ASCII `KVASIR-SIG-V1`                                    |
//! | 1       | the intent: 4 `SwarmHello`, 5 `Answer` (1-3 and 6-9 are the ledger's)   |
//! | 4 + len | the chain id, borsh: `u32` byte length, then its UTF-8 bytes             |
//! | ...     | the borsh encoding of the payload                                        |
//!
//! Borsh: integers little-endian, a fixed array or a 32-byte key or hash as its raw bytes, a
//! string or a list as a `u32` count then its items (note: `u32`, unlike the frame's `u16`
//! text length), a tuple or struct as its fields in order. Signatures verify under ZIP-215
//! and never for a small-order key (`kvasir_primitives::keys`).
//!
//! ## The hello signature
//!
//! Intent `SwarmHello` (4), chain id of the challenge, payload `HelloClaims`, in order:
//! the challenge's `nonce` (32 bytes) and `hub` (32), then the hello's `role` (`u8`), `key`
//! (32), `model_id` (string), `backend` (string), `experts` (`u32` count, then `u16` layer,
//! `u16` expert each, exactly as in the hello), `order` (`u64`), `arithmetic` (`u32`; a hello
//! of version 3 signs everything before it). A hello is thus good for one challenge only, and
//! every claim in it is signed.
//!
//! ## The answer signature
//!
//! Signed answers (since version 2). Every response ends with the worker's answer signature:
//! intent `Answer` (5), chain id of the challenge, payload
//! [`kvasir_primitives::answer::AnswerClaim`], in order: `hub` (32 bytes, the challenge's),
//! `session` (`u64`, the welcome's), `request_id` (`u64`), `model_id` (string, the worker's
//! hello's), `request_hash` (32), `response_hash` (32), where
//! - `request_hash` is the blake3 of the **request body**: the request frame's bytes after the
//!   10-byte header, exactly as the worker received them (the hub relays the backbone's frame
//!   unchanged, so the backbone's bytes as sent are the same bytes; see [`request_body`]);
//! - `response_hash` is the blake3 of the **response body**: the response frame's bytes after
//!   the 10-byte header and before the trailing 64-byte signature, i.e. request id, value
//!   count and partials ([`response_body`]).
//!
//! Each body enters the claim as its plain blake3, 32 bytes, unkeyed
//! (`kvasir_primitives::answer::body_hash`). Worker (signing), hub (paying only what
//! verifies) and backbone (using only what verifies, keeping the bytes for an audit) all
//! build the claim with [`AnswerScope::claim`], so they cannot drift. The worker signs with
//! the session of its welcome, the backbone checks with the request's `session` and the hub
//! with the session the answer came on: the same number. The nonce is not part of it. An
//! Evidence transaction quotes both bodies and the signature ([`decode_request_body`]
//! decodes a quoted request exactly as the worker did).
//!
//! # Keepalive
//!
//! The hub pings every link (empty WebSocket ping) every `--ping-interval-ms` (15 s by
//! default) and drops a link from which nothing at all arrived, no frame, pong or ping, for
//! `--idle-timeout-ms` ([`link::DEFAULT_IDLE_TIMEOUT_MS`], 45 s), or to which a write does
//! not complete within that time ([`link::Keepalive`], [`link::Idle`]). A client never needs
//! to ping; it must answer pings with pongs, as any WebSocket library does while it reads.
//! The worker takes a hub from which nothing arrived for its own `--idle-timeout-ms`
//! (default 45 s) for dead and redials; that time also bounds its dial and handshake.
//!
//! # Versions
//!
//! [`VERSION`] 2: responses carry the answer signature. 3: a hello carries `order`. 4: a
//! hello carries `arithmetic`, a welcome a `notice`, and a client offers [`SUBPROTOCOL`].
//!
//! The version of a link is settled before its first frame: a client of this version offers
//! the subprotocol `kvasir.4` in its WebSocket upgrade, and the hub's answer names it
//! ([`link::accept`]); a client that offers none speaks [`PREVIOUS_VERSION`] (3). A hub
//! admits such a worker until its `--previous-wire-until` time, and never without one (nor a
//! backbone of that version): it writes that link's frames as version 3 ([`Message::encode_as`]
//! for its welcome and failures; every frame's header restamped by the link's writer,
//! [`link::split_as`], the challenge's and relayed requests' included, whose bodies are the
//! same in both versions), reads its hello as version 3 ([`Message::decode_as`]) and its
//! answers only with a version-3 header, relaying them as version 4 ([`restamped`]), and logs
//! a warning (a version-3 welcome has no notice). A session admitted in the window is
//! dropped, told why, once the window ends. Its hello
//! declares no arithmetic and is taken to declare [`PREVIOUS_ARITHMETIC`]. Past the window,
//! or without one, the hub still speaks version 3 to it far enough to refuse its hello with a
//! failure saying to upgrade. A client of this version whose hub does not take the
//! subprotocol (a hub of an older version) fails at the upgrade: "the hub did not take
//! subprotocol kvasir.4: it speaks a protocol version older than 4".
//!
//! On a link, a frame of another version is refused as [`WireError::Version`] ("protocol
//! version 3, this node speaks 4") before its kind or body is looked at, so a peer left on
//! another release is told exactly that. A client of version 3 or older facing a hub of this
//! version without a window, or of version 2 facing one with a window, fails on the
//! challenge or is refused at its hello; a hello of another version that does reach the hub
//! is logged there as a warning naming the peer, and the link closes without a reply.
//!
//! # Expert selections
//!
//! Which experts a worker holds (`--experts`) or a backbone sends out (`--remote`) is written
//! `LAYERS:EXPERTS[,LAYERS:EXPERTS...]`, each side a number, an inclusive range `a-b` or `*`
//! (every layer or expert of the model): `0:*` is every expert of layer 0, `*:0-7,3:9`
//! experts 0 to 7 of every layer and expert 9 of layer 3. See [`spec`] ([`spec::ExpertSpec`],
//! the grammar of `kvasir_primitives::selection::Pattern`). It is resolved against the
//! checkpoint's config (only MoE layers hold experts) and a hello carries the resulting
//! list, in (layer, expert) order; the grammar never travels on the wire.
//!
//! # This crate
//!
//! `translate` turns the engine's expert requests into a request frame and back, and partials
//! into a response and back ([`split_partials`]): the backbone and the worker both go through
//! it. [`answer()`] is what a correct worker answers; [`link`] is the WebSocket link, handshake
//! and keepalive; [`tls`] the TLS configurations; [`spec`] the command-line selections.

#![forbid(unsafe_code)]

mod answer;
pub mod link;
pub mod spec;
pub mod tls;
mod translate;

pub use answer::{answer, model_id, AnswerError};

pub use translate::{split_partials, TranslateError};

use kvasir_inference::kernels::quant::{self, BlockFormat};
use kvasir_primitives::answer::{body_hash, AnswerClaim};
use kvasir_primitives::codec::{self, ReadError};
use kvasir_primitives::hash::Hash;
use kvasir_primitives::intent::{self, Intent};
use kvasir_primitives::keys::{Address, BadSignature, Keypair, Signature};

pub const MAGIC: [u8; 4] = *b"KVSR";
/// 2: responses carry the worker's answer signature.
/// 3: a hello names the order its backbone acts for.
/// 4: a hello declares its reference arithmetic, a welcome carries a notice, and a client
///    offers the WebSocket subprotocol [`SUBPROTOCOL`].
pub const VERSION: u8 = 4;
/// The version before [`VERSION`], which a hub may still speak to workers for a deprecation
/// window (see [Versions](#versions)).
pub const PREVIOUS_VERSION: u8 = 3;
/// The WebSocket subprotocol a client of this version offers, by which a hub tells it from a
/// client of [`PREVIOUS_VERSION`] (which offers none) before it sends its challenge.
pub const SUBPROTOCOL: &str = "kvasir.4";
/// The reference arithmetic every release that spoke [`PREVIOUS_VERSION`] computed by, which a
/// hello of that version (declaring none) is taken to declare.
pub const PREVIOUS_ARITHMETIC: u32 = 1;
/// Magic, version, kind, body length.
pub const HEADER: usize = 10;
/// The answer signature that ends every response frame.
pub const SIGNATURE: usize = 64;

/// Largest frame accepted (a batch of 512 tokens through 8 experts of a 4096-wide model is
/// 64 MiB of partials).
pub const MAX_FRAME: usize = 96 << 20;
const MAX_TEXT: usize = 256;
const MAX_HOLDINGS: usize = 1 << 20;
const MAX_HIDDEN: u32 = 1 << 16;
const MAX_ROWS: u32 = 1 << 16;
const MAX_SESSIONS: usize = 1 << 16;

/// Row data type on the wire. Only f32: partials travel as the exact bits computed.
const DTYPE_F32: u8 = 0;
const DTYPE_Q8_0: u8 = 1;

/// How a request carries its rows (see [Row formats](#row-formats) in the module's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowFormat {
    F32,
    /// Activation blocks of the reference arithmetic; the request's `rows` are the values
    /// they stand for (`quant::activation_values`), and are quantized again as it is encoded.
    Q8_0,
}

impl RowFormat {
    /// Bytes `values` row values take in this format (whole blocks for Q8_0).
    pub fn bytes(self, values: usize) -> usize {
        match self {
            RowFormat::F32 => 4 * values,
            RowFormat::Q8_0 => values / quant::BLOCK * Q8_0_BLOCK_BYTES,
        }
    }
}

/// A Q8_0 block: a binary16 scale and 32 integers.
const Q8_0_BLOCK_BYTES: usize = 2 + quant::BLOCK;

/// A (layer, expert) pair.
pub type ExpertId = (u16, u16);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Worker = 1,
    Backbone = 2,
}

/// Hub to client, first message on every connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    pub nonce: [u8; 32],
    pub hub: Address,
    pub chain_id: String,
}

/// Client to hub: who it is, proven by a signature over the challenge and everything it claims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    pub key: Address,
    pub model_id: String,
    pub backend: String,
    pub experts: Vec<ExpertId>,
    /// The market order a backbone acts for (its key must be the order's buyer or delegate);
    /// zero for none, and always zero from a worker.
    pub order: u64,
    /// The version of the reference arithmetic its answers (or audits) are computed by
    /// (`kvasir_inference::ARITHMETIC_VERSION`); None only in a hello of
    /// [`PREVIOUS_VERSION`], which had no such field.
    pub arithmetic: Option<u32>,
    pub signature: Signature,
}

/// What a hello signs: the challenge it answers and every claim it makes.
#[derive(borsh::BorshSerialize)]
struct HelloClaims<'a> {
    nonce: &'a [u8; 32],
    hub: &'a Address,
    role: u8,
    key: &'a Address,
    model_id: &'a str,
    backend: &'a str,
    experts: &'a [ExpertId],
    order: u64,
}

/// What a hello of this version signs: the claims of [`PREVIOUS_VERSION`], then the
/// arithmetic (borsh lays a struct's fields end to end, so a hello of either version signs
/// exactly its own fields).
#[derive(borsh::BorshSerialize)]
struct HelloClaimsWithArithmetic<'a> {
    claims: HelloClaims<'a>,
    arithmetic: u32,
}

impl Hello {
    /// A hello answering `challenge`, signed by `key`, for no order.
    pub fn answer(
        challenge: &Challenge,
        key: &Keypair,
        role: Role,
        model_id: String,
        backend: String,
        experts: Vec<ExpertId>,
    ) -> Hello {
        Hello::answer_for_order(challenge, key, role, model_id, backend, experts, 0)
    }

    /// A hello answering `challenge`, signed by `key`, acting for `order`, declaring this
    /// build's arithmetic.
    pub fn answer_for_order(
        challenge: &Challenge,
        key: &Keypair,
        role: Role,
        model_id: String,
        backend: String,
        experts: Vec<ExpertId>,
        order: u64,
    ) -> Hello {
        let mut hello = Hello {
            role,
            key: key.address(),
            model_id,
            backend,
            experts,
            order,
            arithmetic: Some(kvasir_inference::ARITHMETIC_VERSION),
            signature: Signature([0; 64]),
        };
        hello.sign(challenge, key);
        hello
    }

    /// Signs this hello's claims, as they are, for `challenge` with `key` (whose address must
    /// be `self.key` for it to verify).
    pub fn sign(&mut self, challenge: &Challenge, key: &Keypair) {
        self.signature = match self.arithmetic {
            Some(arithmetic) => intent::sign(
                key,
                Intent::SwarmHello,
                &challenge.chain_id,
                &HelloClaimsWithArithmetic {
                    claims: self.claims(challenge),
                    arithmetic,
                },
            ),
            None => intent::sign(
                key,
                Intent::SwarmHello,
                &challenge.chain_id,
                &self.claims(challenge),
            ),
        };
    }

    fn claims<'a>(&'a self, challenge: &'a Challenge) -> HelloClaims<'a> {
        HelloClaims {
            nonce: &challenge.nonce,
            hub: &challenge.hub,
            role: self.role as u8,
            key: &self.key,
            model_id: &self.model_id,
            backend: &self.backend,
            experts: &self.experts,
            order: self.order,
        }
    }

    /// Whether this hello was signed by its key in answer to exactly `challenge`.
    pub fn verify(&self, challenge: &Challenge) -> bool {
        let verified = match self.arithmetic {
            Some(arithmetic) => intent::verify(
                &self.key,
                Intent::SwarmHello,
                &challenge.chain_id,
                &HelloClaimsWithArithmetic {
                    claims: self.claims(challenge),
                    arithmetic,
                },
                &self.signature,
            ),
            None => intent::verify(
                &self.key,
                Intent::SwarmHello,
                &challenge.chain_id,
                &self.claims(challenge),
                &self.signature,
            ),
        };
        verified.is_ok()
    }

    /// The arithmetic it declares: a hello of [`PREVIOUS_VERSION`] declares none and is taken
    /// as [`PREVIOUS_ARITHMETIC`].
    pub fn declared_arithmetic(&self) -> u32 {
        self.arithmetic.unwrap_or(PREVIOUS_ARITHMETIC)
    }
}

/// Hub to client after a good hello (`Welcome::new` cuts the notice to fit a frame).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    pub session: u64,
    /// What the hub's operator wants the client's operator to read (that its version is
    /// deprecated, and until when), empty for nothing; a client logs it. A welcome of
    /// [`PREVIOUS_VERSION`] has none.
    pub notice: String,
}

/// Hub to backbone: the live worker sessions and what each holds (sent whenever it changes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Directory {
    pub sessions: Vec<DirectoryEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectoryEntry {
    pub session: u64,
    pub worker: Address,
    pub model_id: String,
    pub experts: Vec<ExpertId>,
}

/// Backbone to worker (through the hub): one layer step's rows for the experts it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub session: u64,
    pub id: u64,
    pub layer: u16,
    pub hidden: u32,
    /// How the rows go on the wire.
    pub format: RowFormat,
    /// `rows x hidden`, row-major.
    pub rows: Vec<f32>,
    /// Per expert, the indices of the rows routed to it.
    pub experts: Vec<(u16, Vec<u32>)>,
}

impl Request {
    /// Values the answering response must carry.
    pub fn response_values(&self) -> usize {
        let listed: usize = self.experts.iter().map(|(_, rows)| rows.len()).sum();
        listed * self.hidden as usize
    }

    /// Bytes of this request as a frame (what `Message::encode` writes).
    pub fn frame_len(&self) -> usize {
        let lists: usize = self
            .experts
            .iter()
            .map(|(_, rows)| 6 + 4 * rows.len())
            .sum();
        HEADER + 27 + self.format.bytes(self.rows.len()) + 4 + lists
    }
}

/// Worker to backbone: per expert in request order, one `hidden` partial per listed row, and
/// the worker's signature of its answer (see the module's "Signed answers").
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    pub id: u64,
    pub partials: Vec<f32>,
    pub signature: Signature,
}

impl Response {
    /// Bytes of a response frame carrying `values` partial values.
    pub fn frame_len(values: usize) -> usize {
        HEADER + 12 + 4 * values + SIGNATURE
    }

    /// A response whose signature is still a placeholder (zeros): `signed_frame` signs it.
    pub fn unsigned(id: u64, partials: Vec<f32>) -> Response {
        Response {
            id,
            partials,
            signature: Signature([0; SIGNATURE]),
        }
    }

    /// This response as a frame, signed by `worker` as its answer, in `scope`, to the request
    /// whose body hashes to `request_hash` (`request_hash(frame)` of the request as
    /// received). `self.signature` is not used: the frame carries the new one.
    pub fn signed_frame(
        &self,
        scope: &AnswerScope<'_>,
        request_hash: Hash,
        worker: &Keypair,
    ) -> Vec<u8> {
        let mut frame = framed(KIND_RESPONSE, |w| self.write(w));
        scope.sign_frame(&mut frame, self.id, request_hash, worker);
        frame
    }
}

/// The request body of a request `frame`: its bytes after the header, exactly as they came.
/// This is what an answer signature binds (by its blake3) and what an audit recomputes.
/// Empty for a frame shorter than a header (which no decoder accepts).
pub fn request_body(frame: &[u8]) -> &[u8] {
    frame.get(HEADER..).unwrap_or_default()
}

/// The response body of a response `frame`: its bytes after the header and before the
/// trailing signature (request id, value count, partials). This is what the signature covers.
/// Empty for a frame too short to carry a signature (which no decoder accepts).
pub fn response_body(frame: &[u8]) -> &[u8] {
    frame
        .get(HEADER..frame.len().saturating_sub(SIGNATURE))
        .unwrap_or_default()
}

/// The hash of `frame`'s request body, as an answer claim names it.
pub fn request_hash(frame: &[u8]) -> Hash {
    body_hash(request_body(frame))
}

/// What binds a worker's answers to its link: the chain and hub named by the hub's challenge,
/// the session the welcome assigned and the model the worker's hello declared. Each of
/// worker, hub and backbone knows all four, and all three compute the claim here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnswerScope<'a> {
    pub chain_id: &'a str,
    pub hub: Address,
    pub session: u64,
    pub model_id: &'a str,
}

impl<'a> AnswerScope<'a> {
    /// The scope of session `session` on the link `challenge` opened, for `model_id`.
    pub fn new(challenge: &'a Challenge, session: u64, model_id: &'a str) -> AnswerScope<'a> {
        AnswerScope {
            chain_id: &challenge.chain_id,
            hub: challenge.hub,
            session,
            model_id,
        }
    }

    /// The claim of answering request `request_id` (whose request body hashes to
    /// `request_hash`) with `response_body`: the one definition of what an answer signs.
    pub fn claim(&self, request_id: u64, request_hash: Hash, response_body: &[u8]) -> AnswerClaim {
        AnswerClaim {
            hub: self.hub,
            session: self.session,
            request_id,
            model_id: self.model_id.to_string(),
            request_hash,
            response_hash: body_hash(response_body),
        }
    }

    /// Whether `signature` is `worker`'s over exactly that claim on this scope's chain; the
    /// claim it checked (what an audit or an Evidence transaction quotes) if so.
    pub fn verify(
        &self,
        worker: &Address,
        request_id: u64,
        request_hash: Hash,
        response_body: &[u8],
        signature: &Signature,
    ) -> Result<AnswerClaim, BadSignature> {
        let claim = self.claim(request_id, request_hash, response_body);
        claim.verify(self.chain_id, worker, signature)?;
        Ok(claim)
    }

    /// Signs the response `frame` in place: `worker`'s signature of the claim of answering
    /// `request_id` with this frame's response body overwrites its trailing signature field.
    /// `Response::signed_frame` is the honest use; a test playing a dishonest worker signs
    /// with another request id or hash, or from another scope. A frame too short to carry a
    /// signature is left as it is.
    pub fn sign_frame(
        &self,
        frame: &mut [u8],
        request_id: u64,
        request_hash: Hash,
        worker: &Keypair,
    ) {
        let Some(at) = frame
            .len()
            .checked_sub(SIGNATURE)
            .filter(|at| *at >= HEADER)
        else {
            return;
        };
        let signature = self
            .claim(request_id, request_hash, &frame[HEADER..at])
            .sign(self.chain_id, worker);
        frame[at..].copy_from_slice(&signature.0);
    }
}

/// A request that could not be served (by the worker, or by the hub when the session is gone).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub id: u64,
    pub message: String,
}

impl Failure {
    /// A failure of request `id`, its message cut to what a frame carries.
    pub fn new(id: u64, message: impl Into<String>) -> Failure {
        Failure {
            id,
            message: fitted(message.into()),
        }
    }
}

impl Welcome {
    /// A welcome to `session`, its notice cut to what a frame carries.
    pub fn new(session: u64, notice: impl Into<String>) -> Welcome {
        Welcome {
            session,
            notice: fitted(notice.into()),
        }
    }
}

/// `text` cut, at a character boundary, to what a `text` field carries.
fn fitted(mut text: String) -> String {
    if text.len() > MAX_TEXT {
        let mut end = MAX_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Challenge(Challenge),
    Hello(Hello),
    Welcome(Welcome),
    Directory(Directory),
    Request(Request),
    Response(Response),
    Failure(Failure),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame truncated: {needed} more bytes needed at offset {at}")]
    Truncated { at: usize, needed: usize },
    #[error("not a Kvasir frame (bad magic)")]
    BadMagic,
    /// A frame of version `got` where `speaks` was expected (the link's version: this one's,
    /// or for a client of the previous version, that one).
    #[error("protocol version {got}, this node speaks {speaks}")]
    Version { got: u8, speaks: u8 },
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("{what} is {got}, over the limit of {max}")]
    TooLarge {
        what: &'static str,
        got: u64,
        max: u64,
    },
    #[error("frame header says {declared} body bytes, {actual} follow")]
    Length { declared: usize, actual: usize },
    #[error("{0} bytes after the end of the message")]
    Trailing(usize),
    #[error("invalid {0}")]
    Invalid(&'static str),
}

const KIND_CHALLENGE: u8 = 1;
const KIND_HELLO: u8 = 2;
const KIND_WELCOME: u8 = 3;
const KIND_DIRECTORY: u8 = 4;
const KIND_REQUEST: u8 = 5;
const KIND_RESPONSE: u8 = 6;
const KIND_FAILURE: u8 = 7;

impl Response {
    /// Its body, as `Message::encode` and `signed_frame` write it.
    fn write(&self, w: &mut Writer) {
        w.0.reserve(self.partials.len() * 4 + 12 + SIGNATURE);
        w.u64(self.id);
        w.u32(self.partials.len() as u32);
        w.f32s(&self.partials);
        w.bytes(&self.signature.0);
    }
}

/// A frame of `kind` whose body `write` writes: written after a placeholder header that is
/// filled in at the end, so a large body is never copied a second time.
fn framed(kind: u8, write: impl FnOnce(&mut Writer)) -> Vec<u8> {
    framed_as(VERSION, kind, write)
}

/// As `framed`, in protocol `version`.
fn framed_as(version: u8, kind: u8, write: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64));
    w.bytes(&MAGIC);
    w.u8(version);
    w.u8(kind);
    w.u32(0);
    write(&mut w);
    let mut frame = w.0;
    let body = (frame.len() - HEADER) as u32;
    frame[HEADER - 4..HEADER].copy_from_slice(&body.to_le_bytes());
    frame
}

/// `frame` with its header's version set to `version`: what a hub relays to (or from) a link
/// of [`PREVIOUS_VERSION`]. Every message but the hello and the welcome has the same body in
/// both versions, and signatures cover bodies only, so relayed requests and answers keep
/// their meaning. A frame shorter than a header comes back unchanged.
pub fn restamped(frame: &[u8], version: u8) -> Vec<u8> {
    let mut frame = frame.to_vec();
    if frame.len() >= HEADER {
        frame[4] = version;
    }
    frame
}

impl Message {
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(VERSION)
    }

    /// This message as a frame of protocol `version`: [`PREVIOUS_VERSION`] (whose hello has
    /// no arithmetic and whose welcome no notice), else [`VERSION`]'s layout under that
    /// version's header.
    pub fn encode_as(&self, version: u8) -> Vec<u8> {
        let current = version != PREVIOUS_VERSION;
        let kind = match self {
            Message::Challenge(_) => KIND_CHALLENGE,
            Message::Hello(_) => KIND_HELLO,
            Message::Welcome(_) => KIND_WELCOME,
            Message::Directory(_) => KIND_DIRECTORY,
            Message::Request(_) => KIND_REQUEST,
            Message::Response(_) => KIND_RESPONSE,
            Message::Failure(_) => KIND_FAILURE,
        };
        framed_as(version, kind, |w| match self {
            Message::Challenge(c) => {
                w.bytes(&c.nonce);
                w.bytes(c.hub.as_bytes());
                w.text(&c.chain_id);
            }
            Message::Hello(h) => {
                w.u8(h.role as u8);
                w.bytes(h.key.as_bytes());
                w.text(&h.model_id);
                w.text(&h.backend);
                w.holdings(&h.experts);
                w.u64(h.order);
                if current {
                    w.u32(h.arithmetic.unwrap_or(0));
                }
                w.bytes(&h.signature.0);
            }
            Message::Welcome(m) => {
                w.u64(m.session);
                if current {
                    w.text(&m.notice);
                }
            }
            Message::Directory(d) => {
                w.u32(d.sessions.len() as u32);
                for e in &d.sessions {
                    w.u64(e.session);
                    w.bytes(e.worker.as_bytes());
                    w.text(&e.model_id);
                    w.holdings(&e.experts);
                }
            }
            Message::Request(r) => {
                w.0.reserve(r.format.bytes(r.rows.len()) + 64);
                w.u64(r.session);
                w.u64(r.id);
                w.u16(r.layer);
                w.u8(match r.format {
                    RowFormat::F32 => DTYPE_F32,
                    RowFormat::Q8_0 => DTYPE_Q8_0,
                });
                w.u32(r.hidden);
                w.u32((r.rows.len() / r.hidden.max(1) as usize) as u32);
                match r.format {
                    RowFormat::F32 => w.f32s(&r.rows),
                    // Rows of whole blocks (`Request::from_expert_requests` checks); any other
                    // is written short, and no decoder takes it.
                    RowFormat::Q8_0 if r.rows.len().is_multiple_of(quant::BLOCK) => {
                        w.bytes(&BlockFormat::Q8_0.quantize(&r.rows).unwrap_or_default())
                    }
                    RowFormat::Q8_0 => {}
                }
                w.u32(r.experts.len() as u32);
                for (expert, rows) in &r.experts {
                    w.u16(*expert);
                    w.u32(rows.len() as u32);
                    for row in rows {
                        w.u32(*row);
                    }
                }
            }
            Message::Response(r) => r.write(w),
            Message::Failure(f) => {
                w.u64(f.id);
                w.text(&f.message);
            }
        })
    }

    pub fn decode(frame: &[u8]) -> Result<Message, WireError> {
        Message::decode_as(frame, VERSION)
    }

    /// A frame of protocol `version` ([`VERSION`] or [`PREVIOUS_VERSION`]), decoded: a frame of
    /// any other version is refused as [`WireError::Version`], as `decode` refuses one.
    pub fn decode_as(frame: &[u8], version: u8) -> Result<Message, WireError> {
        // A version this node does not speak at all is refused as a frame of it would be.
        if version != VERSION && version != PREVIOUS_VERSION {
            return Err(WireError::Version {
                got: version,
                speaks: VERSION,
            });
        }
        let current = version == VERSION;
        let (kind, mut r) = Reader::open(frame, version)?;
        let message = match kind {
            KIND_CHALLENGE => Message::Challenge(Challenge {
                nonce: r.array()?,
                hub: Address::from_bytes(r.array()?),
                chain_id: r.text()?,
            }),
            KIND_HELLO => Message::Hello(Hello {
                role: match r.u8()? {
                    1 => Role::Worker,
                    2 => Role::Backbone,
                    _ => return Err(WireError::Invalid("role")),
                },
                key: Address::from_bytes(r.array()?),
                model_id: r.text()?,
                backend: r.text()?,
                experts: r.holdings()?,
                order: r.u64()?,
                arithmetic: if current { Some(r.u32()?) } else { None },
                signature: Signature(r.array()?),
            }),
            KIND_WELCOME => Message::Welcome(Welcome {
                session: r.u64()?,
                notice: if current { r.text()? } else { String::new() },
            }),
            KIND_DIRECTORY => {
                let count = r.count("directory sessions", MAX_SESSIONS, 44)?;
                let mut sessions = Vec::with_capacity(count);
                for _ in 0..count {
                    sessions.push(DirectoryEntry {
                        session: r.u64()?,
                        worker: Address::from_bytes(r.array()?),
                        model_id: r.text()?,
                        experts: r.holdings()?,
                    });
                }
                Message::Directory(Directory { sessions })
            }
            KIND_REQUEST => Message::Request(r.request(true, version)?),
            KIND_RESPONSE => {
                let id = r.u64()?;
                let count = r.count("response values", MAX_FRAME / 4, 4)?;
                Message::Response(Response {
                    id,
                    partials: r.f32s(count)?,
                    signature: Signature(r.array()?),
                })
            }
            KIND_FAILURE => Message::Failure(Failure {
                id: r.u64()?,
                message: r.text()?,
            }),
            other => return Err(WireError::UnknownKind(other)),
        };
        r.finish()?;
        Ok(message)
    }

    /// What a relay needs to know of `frame`, checked exactly as `decode` checks it but
    /// without copying rows or partials (for a response, what verifying its signature takes
    /// besides `response_body(frame)`).
    pub fn inspect(frame: &[u8]) -> Result<Relayed, WireError> {
        let (kind, mut r) = Reader::open(frame, VERSION)?;
        let relayed = match kind {
            KIND_REQUEST => {
                let request = r.request(false, VERSION)?;
                Relayed::Request {
                    session: request.session,
                    id: request.id,
                    response_values: request.response_values(),
                    format: request.format,
                }
            }
            KIND_RESPONSE => {
                let id = r.u64()?;
                let values = r.count("response values", MAX_FRAME / 4, 4)?;
                r.take(values * 4)?;
                Relayed::Response {
                    id,
                    values,
                    signature: Signature(r.array()?),
                }
            }
            _ => return Ok(Message::decode(frame)?.relayed()),
        };
        r.finish()?;
        Ok(relayed)
    }

    /// What `inspect` says of this message's frame.
    pub fn relayed(&self) -> Relayed {
        match self {
            Message::Request(r) => Relayed::Request {
                session: r.session,
                id: r.id,
                response_values: r.response_values(),
                format: r.format,
            },
            Message::Response(r) => Relayed::Response {
                id: r.id,
                values: r.partials.len(),
                signature: r.signature,
            },
            Message::Failure(f) => Relayed::Failure { id: f.id },
            _ => Relayed::Other,
        }
    }
}

/// The request a request body (a request frame's bytes after the header) carries, checked
/// as `Message::decode` checks a frame: what evidence quotes is decoded exactly as the worker
/// decoded it.
pub fn decode_request_body(body: &[u8]) -> Result<Request, WireError> {
    if body.len() > MAX_FRAME - HEADER {
        return Err(WireError::TooLarge {
            what: "frame",
            got: (body.len() + HEADER) as u64,
            max: MAX_FRAME as u64,
        });
    }
    let frame = framed(KIND_REQUEST, |w| w.bytes(body));
    match Message::decode(&frame)? {
        Message::Request(request) => Ok(request),
        _ => Err(WireError::Invalid("request body")),
    }
}

/// A frame as the hub sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Relayed {
    Request {
        session: u64,
        id: u64,
        response_values: usize,
        /// How its rows go: a worker of the previous version reads `f32` rows only.
        format: RowFormat,
    },
    /// The signed part is `response_body(frame)`; checking it is the reader's business.
    Response {
        id: u64,
        values: usize,
        signature: Signature,
    },
    Failure {
        id: u64,
    },
    Other,
}

struct Writer(Vec<u8>);

impl Writer {
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn text(&mut self, s: &str) {
        self.u16(s.len() as u16);
        self.bytes(s.as_bytes());
    }
    fn f32s(&mut self, values: &[f32]) {
        if cfg!(target_endian = "little") {
            self.bytes(bytemuck::cast_slice(values));
        } else {
            values.iter().for_each(|v| self.bytes(&v.to_le_bytes()));
        }
    }
    fn holdings(&mut self, experts: &[ExpertId]) {
        self.u32(experts.len() as u32);
        for (layer, expert) in experts {
            self.u16(*layer);
            self.u16(*expert);
        }
    }
}

/// A frame being read: the shared bounded reader (`kvasir_primitives::codec`), and the
/// protocol's own fields on top.
struct Reader<'a>(codec::Reader<'a>);

impl<'a> std::ops::Deref for Reader<'a> {
    type Target = codec::Reader<'a>;
    fn deref(&self) -> &codec::Reader<'a> {
        &self.0
    }
}

impl std::ops::DerefMut for Reader<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl From<ReadError> for WireError {
    fn from(error: ReadError) -> WireError {
        match error {
            ReadError::Truncated { at, needed } => WireError::Truncated { at, needed },
            ReadError::TooLarge { what, got, max } => WireError::TooLarge { what, got, max },
            ReadError::Trailing(extra) => WireError::Trailing(extra),
        }
    }
}

impl<'a> Reader<'a> {
    /// Checks the header of `frame`, which must be of protocol `version`; its kind and a
    /// reader at the start of its body.
    fn open(frame: &'a [u8], version: u8) -> Result<(u8, Reader<'a>), WireError> {
        if frame.len() > MAX_FRAME {
            return Err(WireError::TooLarge {
                what: "frame",
                got: frame.len() as u64,
                max: MAX_FRAME as u64,
            });
        }
        let mut r = Reader(codec::Reader::new(frame));
        if r.take(4)? != MAGIC {
            return Err(WireError::BadMagic);
        }
        let found = r.u8()?;
        if found != version {
            return Err(WireError::Version {
                got: found,
                speaks: version,
            });
        }
        let kind = r.u8()?;
        let declared = r.u32()? as usize;
        if declared != frame.len() - HEADER {
            return Err(WireError::Length {
                declared,
                actual: frame.len() - HEADER,
            });
        }
        Ok((kind, r))
    }
    fn text(&mut self) -> Result<String, WireError> {
        let len = self.u16()? as usize;
        if len > MAX_TEXT {
            return Err(WireError::TooLarge {
                what: "text field",
                got: len as u64,
                max: MAX_TEXT as u64,
            });
        }
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| WireError::Invalid("UTF-8 text"))
    }
    fn f32s(&mut self, count: usize) -> Result<Vec<f32>, WireError> {
        let bytes = self.take(count * 4)?;
        if cfg!(target_endian = "little") {
            let mut values = vec![0f32; count];
            bytemuck::cast_slice_mut::<f32, u8>(&mut values).copy_from_slice(bytes);
            return Ok(values);
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
    fn holdings(&mut self) -> Result<Vec<ExpertId>, WireError> {
        let count = self.count("held experts", MAX_HOLDINGS, 4)?;
        (0..count).map(|_| Ok((self.u16()?, self.u16()?))).collect()
    }
    /// A request of protocol `version`; its rows are skipped (left empty) unless `keep_rows`.
    fn request(&mut self, keep_rows: bool, version: u8) -> Result<Request, WireError> {
        let (session, id, layer) = (self.u64()?, self.u64()?, self.u16()?);
        let format = match self.u8()? {
            DTYPE_F32 => RowFormat::F32,
            DTYPE_Q8_0 if version >= 4 => RowFormat::Q8_0,
            _ => return Err(WireError::Invalid("row format")),
        };
        let hidden = self.u32()?;
        let rows = self.u32()?;
        if hidden == 0 || hidden > MAX_HIDDEN {
            return Err(WireError::Invalid("hidden size"));
        }
        if format == RowFormat::Q8_0 && !(hidden as usize).is_multiple_of(quant::BLOCK) {
            return Err(WireError::Invalid(
                "hidden size (Q8_0 rows are whole blocks of 32)",
            ));
        }
        if rows > MAX_ROWS {
            return Err(WireError::TooLarge {
                what: "request rows",
                got: rows.into(),
                max: MAX_ROWS.into(),
            });
        }
        let values = rows as usize * hidden as usize;
        // Q8_0 rows decode to four bytes a value: no more than f32 rows could carry.
        if RowFormat::F32.bytes(values) > MAX_FRAME {
            return Err(WireError::TooLarge {
                what: "request row values",
                got: values as u64,
                max: (MAX_FRAME / 4) as u64,
            });
        }
        let bytes = format.bytes(values);
        if bytes > self.remaining() {
            return Err(WireError::Truncated {
                at: self.position(),
                needed: bytes - self.remaining(),
            });
        }
        let data = match (keep_rows, format) {
            (true, RowFormat::F32) => self.f32s(values)?,
            (true, RowFormat::Q8_0) => quant::activation_values(self.take(bytes)?)
                .ok_or(WireError::Invalid("Q8_0 rows"))?,
            (false, _) => {
                self.take(bytes)?;
                Vec::new()
            }
        };
        let count = self.count("request experts", 1 << 16, 6)?;
        let mut experts: Vec<(u16, Vec<u32>)> = Vec::with_capacity(count);
        // The answer must fit a frame: this bounds what a small request can make a worker
        // compute and allocate (each listed row is `hidden` values out).
        let max_listed = MAX_FRAME / 4 / hidden as usize;
        let mut listed = 0usize;
        // Per row, the position (from 1) of the last expert that listed it: one allocation per
        // request however many experts it names.
        let mut listed_by = vec![0u32; rows as usize];
        for position in 1..=count as u32 {
            let expert = self.u16()?;
            if experts.last().is_some_and(|(last, _)| *last >= expert) {
                return Err(WireError::Invalid("expert order (must ascend, no repeats)"));
            }
            let n = self.count("rows of an expert", rows as usize, 4)?;
            listed += n;
            if listed > max_listed {
                return Err(WireError::TooLarge {
                    what: "rows listed (the answer would not fit a frame)",
                    got: listed as u64,
                    max: max_listed as u64,
                });
            }
            let indices = (0..n)
                .map(|_| self.u32())
                .collect::<Result<Vec<u32>, _>>()?;
            for i in &indices {
                match listed_by.get_mut(*i as usize) {
                    Some(by) if *by != position => *by = position,
                    Some(_) => return Err(WireError::Invalid("row index (repeated)")),
                    None => return Err(WireError::Invalid("row index")),
                }
            }
            experts.push((expert, indices));
        }
        Ok(Request {
            session,
            id,
            layer,
            hidden,
            format,
            rows: data,
            experts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_inference::moe::ExpertRequest;
    use proptest::prelude::*;

    fn challenge() -> Challenge {
        Challenge {
            nonce: [7; 32],
            hub: Keypair::from_seed(&[1; 32]).address(),
            chain_id: "kvasir-test".into(),
        }
    }

    /// A worker's hello of model `m` on `cpu`, holding `experts`, for `challenge()`.
    fn worker_hello(key: &Keypair, experts: Vec<ExpertId>) -> Hello {
        Hello::answer(
            &challenge(),
            key,
            Role::Worker,
            "m".into(),
            "cpu".into(),
            experts,
        )
    }

    fn request(rows: usize, hidden: usize, experts: Vec<(u16, Vec<u32>)>) -> Request {
        Request {
            session: 3,
            id: 9,
            layer: 1,
            hidden: hidden as u32,
            format: RowFormat::F32,
            rows: (0..rows * hidden).map(|i| i as f32 * 0.25 - 3.0).collect(),
            experts,
        }
    }

    /// Q8_0 rows are of version 4 and of whole blocks: a frame of version 3 carrying them,
    /// or rows of another width, is refused by name; so is a request the backbone would make
    /// of rows that are not whole blocks.
    #[test]
    fn q8_0_rows_are_refused_in_version_3_and_in_rows_not_of_whole_blocks() {
        let mut q8 = request(2, 64, vec![(0, vec![0, 1])]);
        q8.format = RowFormat::Q8_0;
        let frame = Message::Request(q8).encode();
        assert!(matches!(Message::decode(&frame), Ok(Message::Request(_))));
        let old = restamped(&frame, PREVIOUS_VERSION);
        assert_eq!(
            Message::decode_as(&old, PREVIOUS_VERSION),
            Err(WireError::Invalid("row format"))
        );
        // The width of a row of 33 values, in a frame of otherwise Q8_0 rows of 32.
        let mut ragged = frame.clone();
        ragged[HEADER + 19..HEADER + 23].copy_from_slice(&33u32.to_le_bytes());
        assert!(matches!(
            Message::decode(&ragged),
            Err(WireError::Invalid(why)) if why.contains("whole blocks")
        ));
        let rows = vec![ExpertRequest {
            expert: 0,
            tokens: vec![0],
            rows: vec![1.0; 33],
        }];
        assert_eq!(
            Request::from_expert_requests(1, 2, (0, 33), RowFormat::Q8_0, &rows, &[0]),
            Err(TranslateError::Blocks { hidden: 33 })
        );
    }

    /// Q8_0 rows decode to a quarter more than four times their bytes: a frame of them may
    /// not carry more values than f32 rows could, so a frame allocates at most a frame's worth.
    #[test]
    fn q8_0_rows_decode_to_no_more_values_than_a_frame_of_f32_holds() {
        let hidden = 8192;
        let rows = MAX_FRAME / 4 / hidden + 1;
        // Zero blocks, one expert listing row 0: written by hand, as a hostile peer would.
        let frame = framed(KIND_REQUEST, |w| {
            w.u64(1);
            w.u64(2);
            w.u16(0);
            w.u8(DTYPE_Q8_0);
            w.u32(hidden as u32);
            w.u32(rows as u32);
            w.bytes(&vec![0; RowFormat::Q8_0.bytes(rows * hidden)]);
            w.u32(1);
            w.u16(0);
            w.u32(1);
            w.u32(0);
        });
        assert!(frame.len() < MAX_FRAME);
        for result in [
            Message::decode(&frame).map(drop),
            Message::inspect(&frame).map(drop),
        ] {
            assert!(
                matches!(
                    result,
                    Err(WireError::TooLarge {
                        what: "request row values",
                        ..
                    })
                ),
                "{result:?}"
            );
        }
    }

    #[test]
    fn a_small_request_cannot_ask_for_an_answer_larger_than_a_frame() {
        // One row of 8192 values, listed by 4096 experts: 64 KiB of request, 128 MiB of answer.
        let request = Request {
            session: 1,
            id: 2,
            layer: 0,
            hidden: 8192,
            format: RowFormat::F32,
            rows: vec![0.0; 8192],
            experts: (0..4096).map(|e| (e, vec![0])).collect(),
        };
        let frame = Message::Request(request).encode();
        assert!(frame.len() < 128 << 10);
        for result in [
            Message::decode(&frame).map(drop),
            Message::inspect(&frame).map(drop),
        ] {
            assert!(
                matches!(result, Err(WireError::TooLarge { .. })),
                "{result:?}"
            );
        }
    }

    fn samples() -> Vec<Message> {
        let key = Keypair::from_seed(&[2; 32]);
        vec![
            Message::Challenge(challenge()),
            Message::Hello(worker_hello(&key, vec![(0, 1), (0, 2)])),
            Message::Welcome(Welcome {
                session: 42,
                notice: "wire 4 is admitted until 2027-01-31".into(),
            }),
            Message::Directory(Directory {
                sessions: vec![DirectoryEntry {
                    session: 1,
                    worker: key.address(),
                    model_id: "m".into(),
                    experts: vec![(3, 4)],
                }],
            }),
            Message::Request(request(3, 4, vec![(1, vec![0, 2]), (5, vec![1])])),
            Message::Response(Response {
                id: 9,
                partials: vec![1.5, -0.0, f32::MIN_POSITIVE],
                signature: Signature([5; 64]),
            }),
            Message::Failure(Failure {
                id: 9,
                message: "no".into(),
            }),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for message in samples() {
            assert_eq!(Message::decode(&message.encode()), Ok(message));
        }
    }

    #[test]
    fn inspect_agrees_with_decode() {
        for message in samples() {
            let frame = message.encode();
            assert_eq!(Message::inspect(&frame), Ok(message.relayed()));
            for cut in 0..frame.len() {
                assert!(Message::inspect(&frame[..cut]).is_err());
            }
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        for message in samples() {
            let frame = message.encode();
            for cut in 0..frame.len() {
                assert!(
                    Message::decode(&frame[..cut]).is_err(),
                    "{message:?} cut at {cut}"
                );
            }
            let mut longer = frame.clone();
            longer.push(0);
            assert!(Message::decode(&longer).is_err());
        }
    }

    /// A failure's message and a welcome's notice are cut, at a character boundary, to fit.
    #[test]
    fn long_texts_are_cut_to_fit_a_frame() {
        let long = "é".repeat(MAX_TEXT);
        let failure = Failure::new(5, long.clone());
        let welcome = Welcome::new(1, long);
        for text in [&failure.message, &welcome.notice] {
            assert!(text.len() <= MAX_TEXT && text.starts_with('é'));
        }
        for message in [Message::Failure(failure), Message::Welcome(welcome)] {
            assert_eq!(Message::decode(&message.encode()), Ok(message));
        }
    }

    #[test]
    fn a_hello_verifies_only_against_its_own_challenge_and_claims() {
        let key = Keypair::from_seed(&[2; 32]);
        let hello = worker_hello(&key, vec![(0, 1)]);
        assert!(hello.verify(&challenge()));
        let other = Challenge {
            nonce: [8; 32],
            ..challenge()
        };
        assert!(!hello.verify(&other), "a replayed hello must not verify");
        let mut more = hello.clone();
        more.experts.push((0, 2));
        assert!(!more.verify(&challenge()), "claims are signed");
        let mut backbone = hello;
        backbone.role = Role::Backbone;
        assert!(!backbone.verify(&challenge()), "the role is signed");
    }

    #[test]
    fn inconsistent_requests_are_refused() {
        let bad_index = request(2, 4, vec![(1, vec![2])]);
        assert_eq!(
            Message::decode(&Message::Request(bad_index).encode()),
            Err(WireError::Invalid("row index"))
        );
        let repeated = request(2, 4, vec![(1, vec![0]), (1, vec![1])]);
        assert!(Message::decode(&Message::Request(repeated).encode()).is_err());
        let padded = request(2, 4, vec![(1, vec![1, 1])]);
        assert!(Message::decode(&Message::Request(padded).encode()).is_err());
        // A header claiming a huge row count is refused before anything is allocated.
        let mut frame = Message::Request(request(1, 4, vec![(0, vec![0])])).encode();
        frame[HEADER + 23..HEADER + 27].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Message::decode(&frame),
            Err(WireError::TooLarge { .. })
        ));
        assert_eq!(
            request(3, 4, vec![(1, vec![0, 2]), (5, vec![1])]).response_values(),
            12
        );
    }

    #[test]
    fn a_frame_of_the_old_version_is_refused_saying_so() {
        for message in samples() {
            let mut frame = message.encode();
            assert_eq!(frame[4], VERSION);
            frame[4] = 1;
            for error in [
                Message::decode(&frame).map(drop).unwrap_err(),
                Message::inspect(&frame).map(drop).unwrap_err(),
            ] {
                assert_eq!(error, WireError::Version { got: 1, speaks: 4 });
                assert_eq!(error.to_string(), "protocol version 1, this node speaks 4");
            }
        }
    }

    /// Frames of the previous version, as a hub writes them to and reads them from a client
    /// of that version: each round-trips in that version (a hello without its arithmetic, a
    /// welcome without its notice), no frame is taken as of the other version, and every
    /// other message is the same body under either header (`restamped`).
    #[test]
    fn frames_of_the_previous_version_round_trip_in_it_and_only_in_it() {
        for message in samples() {
            let frame = message.encode_as(PREVIOUS_VERSION);
            assert_eq!(frame[4], PREVIOUS_VERSION);
            let decoded = Message::decode_as(&frame, PREVIOUS_VERSION).unwrap();
            let expected = match message.clone() {
                Message::Hello(hello) => Message::Hello(Hello {
                    arithmetic: None,
                    ..hello
                }),
                Message::Welcome(welcome) => Message::Welcome(Welcome {
                    notice: String::new(),
                    ..welcome
                }),
                other => other,
            };
            assert_eq!(decoded, expected);
            assert_eq!(
                Message::decode(&frame),
                Err(WireError::Version {
                    got: PREVIOUS_VERSION,
                    speaks: VERSION
                })
            );
            assert!(Message::decode_as(&message.encode(), PREVIOUS_VERSION).is_err());
            if !matches!(message, Message::Hello(_) | Message::Welcome(_)) {
                assert_eq!(restamped(&frame, VERSION), message.encode());
            }
            for cut in 0..frame.len() {
                assert!(Message::decode_as(&frame[..cut], PREVIOUS_VERSION).is_err());
            }
        }
    }

    /// Version 3 as its release wrote it, built here by hand from that version's layout, not
    /// by `encode_as`: its welcome example from the old documentation, and a hello (role,
    /// key, model id, backend, experts, order, signature; no arithmetic) signed over the
    /// borsh of the challenge's nonce and hub and those claims. Both decode as version 3, and
    /// the hello verifies and is taken to declare the previous arithmetic.
    #[test]
    fn frames_of_the_version_3_release_decode_and_its_hello_verifies() {
        let welcome = [
            0x4B, 0x56, 0x53, 0x52, 0x03, 0x03, 0x08, 0x00, 0x00, 0x00, 0x2A, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(
            Message::decode_as(&welcome, PREVIOUS_VERSION),
            Ok(Message::Welcome(Welcome::new(42, "")))
        );
        let key = Keypair::from_seed(&[2; 32]);
        let c = challenge();
        let experts: Vec<(u16, u16)> = vec![(0, 1)];
        let claims = (
            c.nonce,
            c.hub.as_bytes().to_owned(),
            1u8,
            key.address().as_bytes().to_owned(),
            "m".to_string(),
            "cpu".to_string(),
            experts.clone(),
            0u64,
        );
        let signature = intent::sign(&key, Intent::SwarmHello, &c.chain_id, &claims);
        let mut body = vec![1u8];
        body.extend(key.address().as_bytes());
        body.extend(1u16.to_le_bytes());
        body.extend(b"m");
        body.extend(3u16.to_le_bytes());
        body.extend(b"cpu");
        body.extend(1u32.to_le_bytes());
        body.extend(0u16.to_le_bytes());
        body.extend(1u16.to_le_bytes());
        body.extend(0u64.to_le_bytes());
        body.extend(signature.0);
        let mut frame = MAGIC.to_vec();
        frame.extend([3, KIND_HELLO]);
        frame.extend((body.len() as u32).to_le_bytes());
        frame.extend(body);
        let Ok(Message::Hello(hello)) = Message::decode_as(&frame, PREVIOUS_VERSION) else {
            panic!("a version-3 hello");
        };
        assert_eq!(hello.arithmetic, None);
        assert_eq!(hello.experts, experts);
        assert!(hello.verify(&c));
        assert_eq!(hello.declared_arithmetic(), PREVIOUS_ARITHMETIC);
        assert_eq!(Message::Hello(hello).encode_as(PREVIOUS_VERSION), frame);
        // A version this node does not speak at all is refused, not read as this one's.
        assert!(Message::decode_as(&frame, 2).is_err());
        assert!(
            Message::decode_as(&Message::Welcome(Welcome::new(1, "")).encode_as(5), 5).is_err()
        );
    }

    /// A hello signs its arithmetic: another version, or a hello of this version passed off
    /// as one of the previous (which declares none, and is taken as the previous arithmetic),
    /// does not verify. A hello of the previous version signs what that version signed.
    #[test]
    fn a_hellos_arithmetic_is_signed() {
        let key = Keypair::from_seed(&[2; 32]);
        let hello = worker_hello(&key, vec![]);
        assert_eq!(hello.arithmetic, Some(kvasir_inference::ARITHMETIC_VERSION));
        assert!(hello.verify(&challenge()));
        let mut other = hello.clone();
        other.arithmetic = Some(kvasir_inference::ARITHMETIC_VERSION + 1);
        assert!(!other.verify(&challenge()));
        let mut stripped = hello.clone();
        stripped.arithmetic = None;
        assert!(!stripped.verify(&challenge()));
        // Re-signed without it: the previous version's claims, which verify as such.
        stripped.sign(&challenge(), &key);
        assert!(stripped.verify(&challenge()));
        assert_eq!(stripped.declared_arithmetic(), PREVIOUS_ARITHMETIC);
        let Ok(Message::Hello(old)) = Message::decode_as(
            &Message::Hello(stripped.clone()).encode_as(PREVIOUS_VERSION),
            PREVIOUS_VERSION,
        ) else {
            panic!("a hello of the previous version");
        };
        assert!(old.verify(&challenge()));
    }

    fn scope(challenge: &Challenge) -> AnswerScope<'_> {
        AnswerScope::new(challenge, 3, "m")
    }

    #[test]
    fn the_bodies_are_the_bytes_after_the_header_and_before_the_signature() {
        let request = Message::Request(request(3, 4, vec![(1, vec![0, 2])])).encode();
        assert_eq!(request_body(&request), &request[HEADER..]);
        assert_eq!(request_hash(&request), body_hash(&request[HEADER..]));
        let response = Response {
            id: 9,
            partials: vec![1.0, 2.0],
            signature: Signature([7; 64]),
        };
        let frame = Message::Response(response).encode();
        assert_eq!(response_body(&frame), &frame[HEADER..frame.len() - 64]);
        assert_eq!(&frame[frame.len() - 64..], &[7; 64]);
        // id, count, then the partials.
        assert_eq!(
            &response_body(&frame)[..12],
            &[9, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0]
        );
        assert_eq!(response_body(&frame).len(), 12 + 2 * 4);
        assert_eq!(frame.len(), Response::frame_len(2));
        // Frames no decoder accepts have empty bodies, never a panic.
        assert!(request_body(&frame[..HEADER - 1]).is_empty());
        for short in [&[][..], &frame[..HEADER], &frame[..HEADER + 63]] {
            assert!(response_body(short).is_empty());
        }
    }

    #[test]
    fn a_signed_response_verifies_only_for_its_exact_claim() {
        let challenge = challenge();
        let worker = Keypair::from_seed(&[2; 32]);
        let request = Message::Request(request(3, 4, vec![(1, vec![0, 2])])).encode();
        let asked = request_hash(&request);
        let frame =
            Response::unsigned(9, vec![0.5; 8]).signed_frame(&scope(&challenge), asked, &worker);
        let Ok(Message::Response(response)) = Message::decode(&frame) else {
            panic!("a signed response decodes");
        };
        let Ok(Relayed::Response { signature, .. }) = Message::inspect(&frame) else {
            panic!("a signed response inspects");
        };
        assert_eq!(signature, response.signature);
        let check = |scope: AnswerScope<'_>, key: &Address, id: u64, hash: Hash, body: &[u8]| {
            scope
                .verify(key, id, hash, body, &response.signature)
                .is_ok()
        };
        let me = worker.address();
        let body = response_body(&frame);
        let claim = scope(&challenge).verify(&me, 9, asked, body, &signature);
        assert_eq!(
            claim,
            Ok(AnswerClaim {
                hub: challenge.hub,
                session: 3,
                request_id: 9,
                model_id: "m".into(),
                request_hash: asked,
                response_hash: body_hash(body),
            })
        );
        let other_chain = Challenge {
            chain_id: "other".into(),
            ..challenge.clone()
        };
        let other_hub = Challenge {
            hub: me,
            ..challenge.clone()
        };
        let stranger = Keypair::from_seed(&[3; 32]).address();
        let mut changed = frame.clone();
        changed[HEADER + 12] ^= 1;
        for (what, good) in [
            (
                "another key",
                check(scope(&challenge), &stranger, 9, asked, body),
            ),
            ("another id", check(scope(&challenge), &me, 10, asked, body)),
            (
                "another request",
                check(scope(&challenge), &me, 9, body_hash(b"x"), body),
            ),
            (
                "other partials",
                check(scope(&challenge), &me, 9, asked, response_body(&changed)),
            ),
            (
                "another chain",
                check(scope(&other_chain), &me, 9, asked, body),
            ),
            ("another hub", check(scope(&other_hub), &me, 9, asked, body)),
            (
                "another session",
                check(
                    AnswerScope {
                        session: 4,
                        ..scope(&challenge)
                    },
                    &me,
                    9,
                    asked,
                    body,
                ),
            ),
            (
                "another model",
                check(
                    AnswerScope {
                        model_id: "n",
                        ..scope(&challenge)
                    },
                    &me,
                    9,
                    asked,
                    body,
                ),
            ),
        ] {
            assert!(!good, "verified for {what}");
        }
        // An unsigned response verifies for nothing.
        let unsigned = Message::Response(Response::unsigned(9, vec![0.5; 8])).encode();
        let zeros = Signature([0; 64]);
        assert!(scope(&challenge)
            .verify(&me, 9, asked, response_body(&unsigned), &zeros)
            .is_err());
    }

    proptest! {
        #[test]
        fn requests_round_trip(
            rows in 1usize..6, hidden in 1usize..9, session: u64, id: u64, layer: u16,
            picks in proptest::collection::vec((any::<u16>(), proptest::collection::vec(any::<u32>(), 0..5)), 0..5),
        ) {
            let mut experts: Vec<(u16, Vec<u32>)> = picks
                .into_iter()
                .map(|(e, r)| {
                    let mut indices: Vec<u32> = r.into_iter().map(|i| i % rows as u32).collect();
                    indices.sort_unstable();
                    indices.dedup();
                    (e, indices)
                })
                .collect();
            experts.sort_by_key(|(e, _)| *e);
            experts.dedup_by_key(|(e, _)| *e);
            let message = Message::Request(Request { session, id, layer, ..request(rows, hidden, experts) });
            prop_assert_eq!(Message::decode(&message.encode()), Ok(message));
        }

        /// Q8_0 rows: the frame is the size `frame_len` says (a little over a quarter of the
        /// f32 rows'), and decodes to the values its blocks stand for, which quantize to the
        /// same blocks as the rows sent (so any expert of block formats computes the same
        /// bits from them) and encode to the same frame.
        #[test]
        fn q8_0_requests_carry_what_the_arithmetic_reads_of_the_rows(
            rows in 1usize..4, blocks in 1usize..4,
            values in proptest::collection::vec(-1000f32..1000.0, 3 * 3 * 32),
            zeros in proptest::collection::vec(any::<bool>(), 3 * 3),
        ) {
            let hidden = blocks * quant::BLOCK;
            let mut request = request(rows, hidden, vec![(2, (0..rows as u32).collect())]);
            request.format = RowFormat::Q8_0;
            request.rows = values[..rows * hidden].to_vec();
            for (block, zero) in request.rows.chunks_mut(quant::BLOCK).zip(&zeros) {
                if *zero {
                    block.fill(0.0);
                }
            }
            let frame = Message::Request(request.clone()).encode();
            prop_assert_eq!(frame.len(), request.frame_len());
            // 34 bytes for each 32 values, where f32 rows take 128.
            let f32_frame = Message::Request(Request { format: RowFormat::F32, ..request.clone() }).encode();
            prop_assert_eq!(f32_frame.len() - frame.len(), (128 - 34) * rows * blocks);
            let Ok(Message::Request(decoded)) = Message::decode(&frame) else {
                return Err(TestCaseError::fail("not a request"));
            };
            prop_assert_eq!(decoded.format, RowFormat::Q8_0);
            for (sent, read) in request.rows.chunks(hidden).zip(decoded.rows.chunks(hidden)) {
                prop_assert_eq!(quant::quantize_row(sent), quant::quantize_row(read));
            }
            prop_assert_eq!(Message::Request(decoded).encode(), frame);
        }

        #[test]
        fn responses_round_trip_bit_for_bit(id: u64, bits in proptest::collection::vec(any::<u32>(), 0..64)) {
            let partials: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
            let frame = Message::Response(Response::unsigned(id, partials)).encode();
            prop_assert_eq!(frame.len(), Response::frame_len(bits.len()));
            match Message::decode(&frame) {
                Ok(Message::Response(r)) => {
                    prop_assert_eq!(r.partials.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), bits)
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300), kind in 0u8..9) {
            let _ = Message::decode(&bytes);
            // The same bytes behind a valid header reach every body decoder.
            let mut frame = MAGIC.to_vec();
            frame.extend([VERSION, kind]);
            frame.extend((bytes.len() as u32).to_le_bytes());
            frame.extend(&bytes);
            let _ = Message::decode(&frame);
            let _ = Message::inspect(&frame);
            // And behind a header of the previous version, as a hub reads a client of it.
            frame[4] = PREVIOUS_VERSION;
            if let Ok(message) = Message::decode_as(&frame, PREVIOUS_VERSION) {
                prop_assert_eq!(message.encode_as(PREVIOUS_VERSION), frame);
            }
        }

        #[test]
        fn corrupted_frames_never_panic(which in 0usize..7, at: usize, byte: u8) {
            let mut frame = samples()[which].encode();
            let at = at % frame.len();
            frame[at] = byte;
            // A frame inspect accepts, decode accepts too.
            let inspected = Message::inspect(&frame).is_ok();
            prop_assert!(Message::decode(&frame).is_ok() || !inspected);
        }
    }
}
