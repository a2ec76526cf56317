//! Evidence a validator checks without the model (format 2). A genesis pin commits to every
//! expert's weights by a Merkle root over one leaf per expert (layer-major, ascending
//! expert): the blake3 of its gate, up and down matrices as the checkpoint stores them. So
//! evidence can carry the one expert it disputes, with the pinned config.json and the leaf's
//! path, and a validator recomputes that expert's partial from those bytes alone.
//!
//! `ExpertProver` is the reporter's side (the backbone, which holds the checkpoint): the
//! weights and path of one expert. `ExpertJudge` is the validator's: the chain's
//! `AnswerCheck` on a format-2 chain, which needs nothing but the genesis.
//!
//! Why the verdict is safe for an honest worker: the config and the matrices are the pinned
//! bytes, read as the pinned dtypes (a format-2 leaf commits to each matrix's dtype and
//! length, `Leaves::Tagged`; all checked before anything is computed), the expert's rows are
//! the request's as the worker signed it, and the recomputation goes through the same
//! kernels the worker's does, which are bit-exact.

use std::path::Path;

use anyhow::{bail, Result};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::moe::{canonical_nans, SwiGlu};
use kvasir_inference::weights::DType;
use kvasir_ledger::genesis::ModelPin;
use kvasir_ledger::hash::{merkle_path, merkle_root, merkle_verify, Hash};
use kvasir_ledger::state::AnswerCheck;
use kvasir_ledger::tx::{Evidence, ExpertWeights};
use kvasir_wire::Request;

/// The three matrices of an expert, in the order its leaf hashes them.
const PARTS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

fn part_name(layer: usize, expert: usize, part: &str) -> String {
    format!("model.layers.{layer}.mlp.experts.{expert}.{part}.weight")
}

/// How a pin's leaves hash an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaves {
    /// Format 1: blake3 of gate, up and down's bytes, one after the other.
    Untagged,
    /// Format 2: blake3 of a domain tag, then for each matrix its dtype's tag, its length
    /// (u64, little-endian) and its bytes; so the pin commits to how the bytes are read, and
    /// no two splits of the bytes hash alike.
    Tagged,
}

/// The domain tag of a format-2 expert leaf.
const LEAF_TAG: &[u8] = b"kvasir-expert-v2";

/// The leaf of an expert whose matrices are `parts` (dtype and stored bytes each).
fn leaf(leaves: Leaves, parts: [(DType, &[u8]); 3]) -> Hash {
    let mut hasher = blake3::Hasher::new();
    if leaves == Leaves::Tagged {
        hasher.update(LEAF_TAG);
    }
    for (dtype, bytes) in parts {
        if leaves == Leaves::Tagged {
            hasher.update(&[dtype.tag()]);
            hasher.update(&(bytes.len() as u64).to_le_bytes());
        }
        hasher.update(bytes);
    }
    Hash(*hasher.finalize().as_bytes())
}

/// Every expert's leaf, layer-major (what a pin's `experts_root` is the root of), and the
/// bytes of the largest expert (a pin's `expert_bytes`).
pub fn expert_leaves(
    checkpoint: &Checkpoint,
    config: &Config,
    leaves: Leaves,
) -> Result<(Vec<Hash>, u64)> {
    let mut hashes = Vec::new();
    let mut largest = 0u64;
    for layer in config.moe_layers() {
        for expert in 0..config.num_experts {
            let [gate, up, down] =
                PARTS.map(|part| checkpoint.stored(&part_name(layer, expert, part)));
            let parts = [gate?, up?, down?];
            largest = largest.max(parts.iter().map(|(_, b)| b.len() as u64).sum());
            hashes.push(leaf(leaves, parts));
        }
    }
    Ok((hashes, largest))
}

/// Where expert `expert` of layer `layer` sits among a pin's leaves, and how many there are.
fn leaf_place(config: &Config, layer: usize, expert: usize) -> Option<(usize, usize)> {
    let experts = config.num_experts;
    let place = config.moe_layers().position(|l| l == layer)?;
    (expert < experts).then(|| {
        (
            place * experts + expert,
            config.moe_layers().count() * experts,
        )
    })
}

/// A checkpoint's experts as evidence carries them: what the backbone proves a wrong answer
/// with.
pub struct ExpertProver {
    config_bytes: Vec<u8>,
    config: Config,
    checkpoint: Checkpoint,
    leaves: Vec<Hash>,
}

impl ExpertProver {
    /// Reads every expert of the checkpoint in `dir` once, for the leaves.
    pub fn open(dir: &Path) -> Result<ExpertProver> {
        let (config_bytes, config, checkpoint) = crate::engine::read_checkpoint(dir)?;
        let (leaves, _) = expert_leaves(&checkpoint, &config, Leaves::Tagged)?;
        Ok(ExpertProver {
            config_bytes,
            config,
            checkpoint,
            leaves,
        })
    }

    /// What a pin of this checkpoint commits to: its config's hash and its experts' root.
    pub fn commitments(&self) -> (Hash, Hash) {
        (
            Hash(*blake3::hash(&self.config_bytes).as_bytes()),
            merkle_root(&self.leaves),
        )
    }

    /// Expert `expert` of layer `layer`, with the pinned config and its leaf's path.
    pub fn weights(&self, layer: usize, expert: u16) -> Result<ExpertWeights> {
        let Some((index, _)) = leaf_place(&self.config, layer, expert.into()) else {
            bail!("this model has no expert {expert} in layer {layer}");
        };
        let [gate, up, down] = PARTS.map(|part| {
            self.checkpoint
                .stored(&part_name(layer, expert.into(), part))
        });
        let [gate, up, down] = [gate?, up?, down?];
        Ok(ExpertWeights {
            expert,
            dtypes: [gate.0.tag(), up.0.tag(), down.0.tag()],
            config: self.config_bytes.clone(),
            gate: gate.1.to_vec(),
            up: up.1.to_vec(),
            down: down.1.to_vec(),
            path: merkle_path(&self.leaves, index),
        })
    }
}

/// Judges format-2 evidence from the weights it carries: no checkpoint, no state.
pub struct ExpertJudge;

impl AnswerCheck for ExpertJudge {
    fn is_wrong(
        &self,
        model: &ModelPin,
        evidence: &Evidence,
        weights: Option<&ExpertWeights>,
    ) -> Result<bool, String> {
        let weights = weights.ok_or("evidence on this chain carries the expert's weights")?;
        let (config, request, dtypes) = pinned(model, evidence, weights)?;
        let expert = usize::from(weights.expert);
        let hidden = config.hidden_size;
        if request.hidden as usize != hidden {
            return Err(format!(
                "the request's rows are {} wide, this model's are {hidden}",
                request.hidden
            ));
        }
        let requests = request.to_expert_requests().map_err(|e| e.to_string())?;
        let Some(place) = requests.iter().position(|r| r.expert == expert) else {
            return Err(format!("the request sends nothing to expert {expert}"));
        };
        // Where the expert's partial sits in a correct response: after the earlier experts'.
        let start: usize = requests[..place].iter().map(|r| r.rows.len()).sum();
        let rows = &requests[place].rows;
        let Some(answered) = answered_values(&request, &evidence.response_body, start, rows.len())
        else {
            // No correct response has this layout: whatever the weights, it is wrong.
            return Ok(true);
        };
        let matrices = [&weights.gate[..], &weights.up, &weights.down];
        let swiglu = SwiGlu::from_bytes(matrices, dtypes, hidden, config.moe_intermediate_size)
            .map_err(|e| e.to_string())?;
        // Evidence comes from anyone: a kernel bug it could reach must cost the evidence, not
        // every validator's block producer.
        let partial = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut partial = swiglu.forward(rows, rows.len() / hidden);
            canonical_nans(&mut partial);
            partial
        }))
        .map_err(|_| "recomputing the expert failed inside the kernels".to_string())?;
        let same = partial
            .iter()
            .zip(&answered)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        Ok(!same)
    }
}

/// The evidence's config and request, once the weights are shown to be the pinned expert of
/// the request's layer: everything cheap, checked before anything is computed.
fn pinned(
    model: &ModelPin,
    evidence: &Evidence,
    weights: &ExpertWeights,
) -> Result<(Config, Request, [DType; 3]), String> {
    if Hash(*blake3::hash(&weights.config).as_bytes()) != model.config_hash {
        return Err("the config is not the one the genesis pins".into());
    }
    let text = std::str::from_utf8(&weights.config).map_err(|e| e.to_string())?;
    let config = Config::parse(text).map_err(|e| e.to_string())?;
    let request =
        kvasir_wire::decode_request_body(&evidence.request_body).map_err(|e| e.to_string())?;
    if (request.session, request.id) != (evidence.session, evidence.request_id) {
        return Err(format!(
            "the request body is request {} of session {}, the evidence names request {} of session {}",
            request.id, request.session, evidence.request_id, evidence.session
        ));
    }
    let (layer, expert) = (usize::from(request.layer), usize::from(weights.expert));
    let Some((index, count)) = leaf_place(&config, layer, expert) else {
        return Err(format!(
            "this model has no expert {expert} in layer {layer}"
        ));
    };
    let [gate, up, down] = weights.dtypes.map(DType::of_tag);
    let (Some(gate), Some(up), Some(down)) = (gate, up, down) else {
        return Err(format!("dtype tags {:?} name no dtype", weights.dtypes));
    };
    let parts = [
        (gate, &weights.gate[..]),
        (up, &weights.up[..]),
        (down, &weights.down[..]),
    ];
    if !merkle_verify(
        &model.experts_root,
        &leaf(Leaves::Tagged, parts),
        index,
        count,
        &weights.path,
    ) {
        return Err(format!(
            "the weights are not the pinned expert {expert} of layer {layer}"
        ));
    }
    Ok((config, request, [gate, up, down]))
}

/// The `len` values at `start` of the partials a response body carries, if the body is laid
/// out as a correct response to `request` is (its id, its value count, the values).
fn answered_values(request: &Request, body: &[u8], start: usize, len: usize) -> Option<Vec<f32>> {
    let values = request.response_values();
    let id = body.get(..8)?;
    let count = body.get(8..12)?;
    let partials = body.get(12..)?;
    let well_formed = id == request.id.to_le_bytes()
        && u32::try_from(values).ok()?.to_le_bytes() == count
        && partials.len() == values.checked_mul(4)?;
    if !well_formed {
        return None;
    }
    let slice = partials.get(start.checked_mul(4)?..start.checked_add(len)?.checked_mul(4)?)?;
    Some(
        slice
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvasir_inference::moe::LocalExperts;
    use kvasir_ledger::answer::body_hash;
    use kvasir_ledger::keys::Signature;
    use kvasir_ledger::Address;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use crate::answers::tests::{honest_body, request};
    use crate::engine::model_pin;

    /// A checkpoint of `preset`, synthesized in a temporary directory kept by the caller.
    fn checkpoint(preset: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(preset);
        let preset = kvasir_inference::synth::preset(preset).unwrap();
        kvasir_inference::synth::synthesize(&path, preset, |_, _| {}).unwrap();
        (dir, path)
    }

    pub(crate) fn evidence_of(request: &Request, response_body: Vec<u8>) -> Evidence {
        let frame = kvasir_wire::Message::Request(request.clone()).encode();
        Evidence {
            worker: Address::from_bytes([1; 32]),
            hub: Address::from_bytes([2; 32]),
            session: request.session,
            request_id: request.id,
            model_id: "m".into(),
            request_body: kvasir_wire::request_body(&frame).to_vec(),
            response_body,
            signature: Signature([0; 64]),
        }
    }

    /// The GGUF files llama.cpp's tools wrote (`inference/tests/data/gguf`).
    fn gguf_fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../inference/tests/data/gguf/{name}"))
    }

    /// Judged from the weights alone, with only the genesis pin: every expert of every honest
    /// answer is right, and one flipped bit in an expert's partial is wrong for that expert
    /// and for no other. On an f32 checkpoint, on a bf16 one with fused experts, as Qwen3.5
    /// is published (whose two-byte weights are read as bf16 and f16), and on GGUF files of
    /// llama.cpp's Q8_0 and Q4_K_M (Q4_K and Q6_K blocks, carried as stored).
    #[test]
    fn honest_answers_are_right_for_every_expert_and_a_flipped_bit_only_for_its_own() {
        for preset in [
            "tiny",
            "qwen35-tiny-vl",
            "tiny-qwen3moe-q8_0.gguf",
            "tiny-qwen3moe-q4_k_m.gguf",
        ] {
            let (_keep, dir) = if preset.ends_with(".gguf") {
                (tempfile::tempdir().unwrap(), gguf_fixture(preset))
            } else {
                checkpoint(preset)
            };
            let pin = model_pin(&dir).unwrap();
            let config = Config::load(&dir).unwrap();
            let prover = ExpertProver::open(&dir).unwrap();
            let checkpoint = Checkpoint::open(&dir).unwrap();
            let worker = LocalExperts::load(&checkpoint, &config, |_, _| true).unwrap();
            let layers: Vec<usize> = config.moe_layers().collect();
            let mut rng = StdRng::seed_from_u64(11);
            for id in 0..40 {
                let mut request = request(&mut rng, id, config.hidden_size, config.num_experts);
                request.layer = layers[rng.gen_range(0..layers.len())] as u16;
                let honest = honest_body(&worker, &request);
                if honest.len() == 12 {
                    continue; // no rows routed: nothing to flip
                }
                let mut flipped = honest.clone();
                let at = 12 + rng.gen_range(0..(flipped.len() - 12) / 4) * 4;
                flipped[at + rng.gen_range(0..4)] ^= 1 << rng.gen_range(0..8);
                // The expert whose partial holds the flipped value.
                let mut start = 0;
                let flipped_expert = request
                    .experts
                    .iter()
                    .find(|(_, rows)| {
                        start += rows.len() * config.hidden_size;
                        (at - 12) / 4 < start
                    })
                    .map(|(expert, _)| *expert)
                    .unwrap();
                for (expert, _) in &request.experts {
                    let weights = prover.weights(request.layer.into(), *expert).unwrap();
                    let judge = |body: &[u8]| {
                        ExpertJudge.is_wrong(
                            &pin,
                            &evidence_of(&request, body.to_vec()),
                            Some(&weights),
                        )
                    };
                    assert_eq!(judge(&honest), Ok(false), "{preset} {id} {expert}");
                    assert_eq!(
                        judge(&flipped),
                        Ok(*expert == flipped_expert),
                        "{preset} {id} {expert}"
                    );
                }
                assert_ne!(body_hash(&honest), body_hash(&flipped));
            }
        }
    }

    /// Weights that are not the pinned expert's, a config that is not the pinned one, a path
    /// for another leaf, a request of another session or id, or none of the request's
    /// experts: no verdict, whatever the answer. An answer laid out as no correct response
    /// is: wrong, whatever the weights.
    #[test]
    fn weights_other_than_the_pinned_experts_give_no_verdict() {
        let (_keep, dir) = checkpoint("tiny");
        let pin = model_pin(&dir).unwrap();
        let config = Config::load(&dir).unwrap();
        let prover = ExpertProver::open(&dir).unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        let worker = LocalExperts::load(&checkpoint, &config, |_, _| true).unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        let mut request = request(&mut rng, 3, config.hidden_size, config.num_experts);
        request.layer = config.moe_layers().next().unwrap() as u16;
        let layer = usize::from(request.layer);
        let (expert, _) = request.experts[0];
        let evidence = evidence_of(&request, honest_body(&worker, &request));
        let right = prover.weights(layer, expert).unwrap();
        assert_eq!(
            ExpertJudge.is_wrong(&pin, &evidence, Some(&right)),
            Ok(false)
        );
        assert!(ExpertJudge.is_wrong(&pin, &evidence, None).is_err());

        let other = (0..config.num_experts as u16)
            .find(|e| *e != expert)
            .unwrap();
        let mut changes: Vec<(&str, ExpertWeights)> = Vec::new();
        // Another expert's bytes, named as this one.
        let mut swapped = prover.weights(layer, other).unwrap();
        swapped.expert = expert;
        changes.push(("not the pinned expert", swapped));
        let mut tampered = right.clone();
        tampered.down[0] ^= 1;
        changes.push(("not the pinned expert", tampered));
        let mut path = right.clone();
        path.path.reverse();
        path.path[0].0[0] ^= 1;
        changes.push(("not the pinned expert", path));
        // The same bytes read as another dtype (f32 as bf16 would pass a length check): the
        // leaf commits to the dtype.
        let mut retyped = right.clone();
        retyped.dtypes[0] = DType::BF16.tag();
        changes.push(("not the pinned expert", retyped));
        let mut untyped = right.clone();
        untyped.dtypes[2] = 99;
        changes.push(("name no dtype", untyped));
        let mut config_changed = right.clone();
        config_changed.config.push(b' ');
        changes.push(("config", config_changed));
        // A pinned expert the request sends nothing to.
        let unsent =
            (0..config.num_experts as u16).find(|e| request.experts.iter().all(|(x, _)| x != e));
        if let Some(unsent) = unsent {
            changes.push(("nothing to expert", prover.weights(layer, unsent).unwrap()));
        }
        for (why, weights) in changes {
            let verdict = ExpertJudge.is_wrong(&pin, &evidence, Some(&weights));
            assert!(
                matches!(&verdict, Err(e) if e.contains(why)),
                "{why}: {verdict:?}"
            );
        }
        let mut another_session = evidence.clone();
        another_session.session += 1;
        assert!(ExpertJudge
            .is_wrong(&pin, &another_session, Some(&right))
            .is_err());
        // A response of another length, count or id: wrong, as no correct one looks so.
        for change in [
            |b: &mut Vec<u8>| b.truncate(b.len() - 4),
            |b: &mut Vec<u8>| b[8] ^= 1,
            |b: &mut Vec<u8>| b[0] ^= 1,
        ] {
            let mut malformed = evidence.clone();
            change(&mut malformed.response_body);
            assert_eq!(
                ExpertJudge.is_wrong(&pin, &malformed, Some(&right)),
                Ok(true)
            );
        }
        assert!(prover.weights(layer, config.num_experts as u16).is_err());
        assert!(prover.weights(0, expert).is_err() || config.is_moe_layer(0));
    }
}
