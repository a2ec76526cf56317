//! Recomputing answers: what a validator does with evidence, and what the backbone's audit
//! compares a worker's answer with. `ModelAnswers` holds every expert of a checkpoint whose
//! identity (`engine::format_1_pin`) is the one a format-1 genesis pins, and turns a dispatch request
//! body into the exact response body a correct worker sends, through the same translation
//! the worker uses (`kvasir_wire::translate`), so correct means bit for bit. `PinnedAnswers` is
//! one of them for each model the genesis pins: what a ledger node judges evidence with.
//!
//! The room: the engine's experts and the wire format; it answers the ledger's
//! `AnswerCheck` and touches nothing else of the chain.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{bail, Context, Result};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::moe::LocalExperts;
use kvasir_ledger::answer::body_hash;
use kvasir_ledger::genesis::ModelPin;
use kvasir_ledger::state::AnswerCheck;
use kvasir_ledger::tx::{Evidence, ExpertWeights};
use kvasir_ledger::{Genesis, Hash};

use crate::engine::format_1_pin;
use crate::expert_evidence::ExpertJudge;
use kvasir_wire::Request;

/// Every expert of one pinned checkpoint, for recomputing.
pub struct ModelAnswers {
    pin: ModelPin,
    hidden: usize,
    experts: LocalExperts,
}

impl ModelAnswers {
    pub fn load(dir: &Path) -> Result<ModelAnswers> {
        let config = Config::load(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        Ok(ModelAnswers {
            pin: format_1_pin(dir)?,
            hidden: config.hidden_size,
            experts: LocalExperts::load(&checkpoint, &config, |_, _| true)?,
        })
    }

    pub fn pin(&self) -> &ModelPin {
        &self.pin
    }

    /// The correct response body to `request`: the partials of its experts on its rows.
    pub fn response_body(&self, request: &Request) -> Result<Vec<u8>> {
        let response = kvasir_wire::answer(request, self.hidden, &self.experts)?;
        Ok(kvasir_wire::response_body(&kvasir_wire::Message::Response(response).encode()).to_vec())
    }
}

/// Every model a genesis pins, each with its checkpoint: what a ledger node checks evidence
/// with. All of them, or none: validators that could recompute different sets of models
/// would disagree on which evidence is valid, and split the chain.
pub struct PinnedAnswers {
    models: BTreeMap<String, ModelAnswers>,
    /// Verdicts of the latest requests recomputed: evidence is checked at admission, again
    /// in the block, and may be resubmitted; each check after the first is a lookup.
    verdicts: Mutex<Verdicts>,
}

/// Recent correct response hashes by (model id, request body hash), the oldest dropped past
/// `CAP`. A verdict is a pure function of its key, so keeping one changes no outcome.
#[derive(Default)]
struct Verdicts {
    by_request: HashMap<(String, Hash), Hash>,
    order: VecDeque<(String, Hash)>,
}

impl Verdicts {
    /// At most about 250 bytes each (the key is kept twice): a megabyte in all.
    const CAP: usize = 4096;

    fn get(&self, key: &(String, Hash)) -> Option<Hash> {
        self.by_request.get(key).copied()
    }

    fn insert(&mut self, key: (String, Hash), answer: Hash) {
        if self.by_request.insert(key.clone(), answer).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > Self::CAP {
            if let Some(oldest) = self.order.pop_front() {
                self.by_request.remove(&oldest);
            }
        }
    }
}

impl PinnedAnswers {
    /// What a node of `genesis` checks evidence with, from its `--model` directories: nothing
    /// for a chain that pins no model; an error unless `dirs` hold exactly the checkpoints
    /// it pins, each once, so a node never starts unable to judge evidence its peers take.
    pub fn for_genesis(genesis: &Genesis, dirs: &[PathBuf]) -> Result<Option<PinnedAnswers>> {
        if genesis.models.is_empty() {
            for dir in dirs {
                tracing::warn!(
                    "--model {} is not used: this chain pins no model and takes no evidence",
                    dir.display()
                );
            }
            return Ok(None);
        }
        let mut models = BTreeMap::new();
        for dir in dirs {
            let answers = ModelAnswers::load(dir)
                .with_context(|| format!("loading the checkpoint in {}", dir.display()))?;
            let id = answers.pin.id.clone();
            match genesis.model(&id) {
                // The arithmetic answers are judged by must be this node's (0: not said, a
                // format-1 pin).
                Some(pinned)
                    if pinned.arithmetic != 0
                        && pinned.arithmetic != kvasir_inference::ARITHMETIC_VERSION =>
                {
                    bail!(
                        "this genesis judges model {id} by version {} of the reference arithmetic, and this node computes version {}: run a node of that version",
                        pinned.arithmetic,
                        kvasir_inference::ARITHMETIC_VERSION
                    )
                }
                Some(pinned) if pinned.same_weights(&answers.pin) => {}
                Some(pinned) => bail!(
                    "the checkpoint in {} has model id {id} but not the weights this genesis pins (config {} / experts {}, pinned {} / {})",
                    dir.display(),
                    answers.pin.config_hash,
                    answers.pin.experts_root,
                    pinned.config_hash,
                    pinned.experts_root
                ),
                None => bail!(
                    "the checkpoint in {} (model id {id}) is not a model this genesis pins",
                    dir.display()
                ),
            }
            if models.insert(id.clone(), answers).is_some() {
                bail!("model {id} is given twice with --model");
            }
        }
        let missing: Vec<&str> = genesis
            .models
            .iter()
            .map(|m| m.id.as_str())
            .filter(|id| !models.contains_key(*id))
            .collect();
        if !missing.is_empty() {
            bail!(
                "this chain pins model {}: start the node with --model DIR for each (missing {}), to check evidence",
                genesis.models.iter().map(|m| m.id.as_str()).collect::<Vec<_>>().join(", "),
                missing.join(", ")
            );
        }
        Ok(Some(PinnedAnswers {
            models,
            verdicts: Mutex::default(),
        }))
    }
}

/// What a node of `genesis` checks evidence with. On a format-2 chain, the weights each piece
/// of evidence carries (`ExpertJudge`): no checkpoint, and `--model` is not needed. On a
/// format-1 chain, the checkpoints in `dirs`, which must be those it pins
/// (`PinnedAnswers::for_genesis`). None for a chain that pins no model.
pub fn evidence_check(genesis: &Genesis, dirs: &[PathBuf]) -> Result<Option<Arc<dyn AnswerCheck>>> {
    if genesis.params.format >= 2 {
        // Evidence is judged by this node's arithmetic: a node of another version would
        // convict honest workers, and disagree with its peers.
        if let Some(pin) = genesis
            .models
            .iter()
            .find(|m| m.arithmetic != kvasir_inference::ARITHMETIC_VERSION)
        {
            bail!(
                "this genesis judges model {} by version {} of the reference arithmetic, and this node computes version {}: run a node of that version",
                pin.id,
                pin.arithmetic,
                kvasir_inference::ARITHMETIC_VERSION
            );
        }
        for dir in dirs {
            tracing::warn!(
                "--model {} is not used: on this chain evidence carries the weights it is checked with",
                dir.display()
            );
        }
        return Ok(
            (!genesis.models.is_empty()).then(|| Arc::new(ExpertJudge) as Arc<dyn AnswerCheck>)
        );
    }
    Ok(PinnedAnswers::for_genesis(genesis, dirs)?
        .map(|answers| Arc::new(answers) as Arc<dyn AnswerCheck>))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl AnswerCheck for PinnedAnswers {
    fn is_wrong(
        &self,
        model: &ModelPin,
        evidence: &Evidence,
        weights: Option<&ExpertWeights>,
    ) -> Result<bool, String> {
        if weights.is_some() {
            return Err("this chain recomputes evidence from its checkpoints, not weights".into());
        }
        let correct = self.response_hash(
            model,
            evidence.session,
            evidence.request_id,
            &evidence.request_body,
        )?;
        Ok(correct != body_hash(&evidence.response_body))
    }
}

impl PinnedAnswers {
    /// The hash of the correct response body to `request_body`, request `request_id` of
    /// `session` under `model`: recomputed once, then looked up.
    fn response_hash(
        &self,
        model: &ModelPin,
        session: u64,
        request_id: u64,
        request_body: &[u8],
    ) -> Result<Hash, String> {
        let Some(answers) = self.models.get(&model.id) else {
            return Err(format!("this node recomputes no model {}", model.id));
        };
        let request = answers.disputed(model, session, request_id, request_body)?;
        let key = (model.id.clone(), body_hash(request_body));
        if let Some(known) = lock(&self.verdicts).get(&key) {
            return Ok(known);
        }
        // Not under the lock: a recomputation takes long, and a lookup must not wait for it.
        let correct = answers.correct_hash(&request)?;
        lock(&self.verdicts).insert(key, correct);
        Ok(correct)
    }
}

impl ModelAnswers {
    /// The request `request_body` is, if it is request `request_id` of `session` for this
    /// model: everything about evidence that is cheap to check.
    fn disputed(
        &self,
        model: &ModelPin,
        session: u64,
        request_id: u64,
        request_body: &[u8],
    ) -> Result<Request, String> {
        // The same checkpoint, whatever the genesis or this node's directory calls it.
        if !model.same_weights(&self.pin) {
            return Err(format!(
                "this node recomputes model {}, the evidence names {}",
                self.pin.id, model.id
            ));
        }
        let request = kvasir_wire::decode_request_body(request_body).map_err(|e| e.to_string())?;
        if (request.session, request.id) != (session, request_id) {
            return Err(format!(
                "the request body is request {} of session {}, the evidence names request {request_id} of session {session}",
                request.id, request.session
            ));
        }
        Ok(request)
    }

    /// The hash of the correct response body to `request`.
    fn correct_hash(&self, request: &Request) -> Result<Hash, String> {
        // Evidence comes from anyone: a kernel bug it could reach must cost the evidence, not
        // the validator (whose block producer would die with it, on every validator alike).
        let recomputed =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.response_body(request)));
        let response_body = recomputed
            .map_err(|_| "recomputing this request failed inside the kernels".to_string())?
            .map_err(|e| format!("{e:#}"))?;
        Ok(body_hash(&response_body))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvasir_inference::moe::{ExpertExecutor, ExpertRequest};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use crate::engine::tiny_checkpoint;

    /// A random request of layer `layer` as a worker receives it: a few rows, a few experts.
    pub(crate) fn request(rng: &mut StdRng, id: u64, hidden: usize, experts: usize) -> Request {
        let rows = rng.gen_range(1..5);
        let mut chosen: Vec<usize> = (0..experts).filter(|_| rng.gen_bool(0.3)).collect();
        if chosen.is_empty() {
            chosen.push(rng.gen_range(0..experts));
        }
        let data: Vec<f32> = (0..rows * hidden)
            .map(|_| rng.gen_range(-2.0..2.0))
            .collect();
        let requests: Vec<ExpertRequest> = chosen
            .iter()
            .map(|&expert| {
                let tokens: Vec<usize> = (0..rows).filter(|_| rng.gen_bool(0.7)).collect();
                let rows = tokens
                    .iter()
                    .flat_map(|t| data[t * hidden..(t + 1) * hidden].iter().copied())
                    .collect();
                ExpertRequest {
                    expert,
                    tokens,
                    rows,
                }
            })
            .collect();
        let members: Vec<usize> = (0..requests.len()).collect();
        Request::from_expert_requests(
            7,
            id,
            (0, hidden),
            kvasir_wire::RowFormat::F32,
            &requests,
            &members,
        )
        .unwrap()
    }

    /// What a validator holding only `answers` judges a request body to: its correct
    /// response's hash.
    fn correct(
        answers: &ModelAnswers,
        model: &ModelPin,
        session: u64,
        id: u64,
        body: &[u8],
    ) -> Result<Hash, String> {
        answers.correct_hash(&answers.disputed(model, session, id, body)?)
    }

    /// What an honest worker answers: its own experts, through the worker's translation.
    pub(crate) fn honest_body(worker: &LocalExperts, request: &Request) -> Vec<u8> {
        let response = kvasir_wire::answer(request, request.hidden as usize, worker).unwrap();
        kvasir_wire::response_body(&kvasir_wire::Message::Response(response).encode()).to_vec()
    }

    #[test]
    fn ten_thousand_honest_answers_recompute_to_their_own_bits_and_a_lie_does_not() {
        let dir = tiny_checkpoint();
        let answers = ModelAnswers::load(&dir).unwrap();
        let config = Config::load(&dir).unwrap();
        let checkpoint = Checkpoint::open(&dir).unwrap();
        // The worker's copy of the experts, loaded apart from the checker's.
        let worker = LocalExperts::load(&checkpoint, &config, |_, _| true).unwrap();
        let mut rng = StdRng::seed_from_u64(13);
        let pin = answers.pin().clone();
        for id in 0..10_000 {
            let request = request(&mut rng, id, config.hidden_size, config.num_experts);
            let frame = kvasir_wire::Message::Request(request.clone()).encode();
            let correct =
                correct(&answers, &pin, 7, id, kvasir_wire::request_body(&frame)).unwrap();
            let honest = honest_body(&worker, &request);
            assert_eq!(correct, body_hash(&honest), "request {id}");
            if id % 1000 == 0 {
                // One flipped bit anywhere in the partials is told apart.
                let mut lie = honest.clone();
                let at = 12 + rng.gen_range(0..lie.len() - 12);
                lie[at] ^= 1 << rng.gen_range(0..8);
                assert_ne!(correct, body_hash(&lie));
            }
        }
    }

    #[test]
    fn a_nan_in_the_rows_answers_as_the_one_quiet_nan_on_both_sides() {
        let dir = tiny_checkpoint();
        let answers = ModelAnswers::load(&dir).unwrap();
        let config = Config::load(&dir).unwrap();
        let worker =
            LocalExperts::load(&Checkpoint::open(&dir).unwrap(), &config, |_, _| true).unwrap();
        let mut request = request(&mut StdRng::seed_from_u64(5), 1, config.hidden_size, 8);
        // A negative NaN with a payload, as x86 makes them: it reaches every output value.
        request.rows[0] = f32::from_bits(0xffc0_0001);
        let frame = kvasir_wire::Message::Request(request.clone()).encode();
        let correct = correct(
            &answers,
            answers.pin(),
            7,
            1,
            kvasir_wire::request_body(&frame),
        )
        .unwrap();
        assert_eq!(correct, body_hash(&honest_body(&worker, &request)));
        let requests = request.to_expert_requests().unwrap();
        let partials = worker.evaluate(request.layer as usize, &requests).unwrap();
        let nans: Vec<u32> = partials
            .iter()
            .flatten()
            .filter(|v| v.is_nan())
            .map(|v| v.to_bits())
            .collect();
        assert!(!nans.is_empty());
        assert!(
            nans.iter().all(|&bits| bits == f32::NAN.to_bits()),
            "{nans:x?}"
        );
    }

    #[test]
    fn a_verdict_is_kept_for_the_next_check_and_only_the_newest_are() {
        let dir = tiny_checkpoint();
        let mut genesis = Genesis::from_json(kvasir_devnet::chain::DEV_GENESIS).unwrap();
        genesis.models = vec![format_1_pin(&dir).unwrap()];
        let answers = PinnedAnswers::for_genesis(&genesis, &[dir])
            .unwrap()
            .unwrap();
        let request = request(&mut StdRng::seed_from_u64(3), 9, 64, 8);
        let frame = kvasir_wire::Message::Request(request).encode();
        let body = kvasir_wire::request_body(&frame);
        let pin = &genesis.models[0];
        let first = answers.response_hash(pin, 7, 9, body);
        assert_eq!(lock(&answers.verdicts).order.len(), 1);
        let again = answers.response_hash(pin, 7, 9, body);
        assert_eq!(first, again);
        assert_eq!(lock(&answers.verdicts).order.len(), 1);
        // A kept verdict is still only given for the request the body is.
        assert!(answers.response_hash(pin, 7, 10, body).is_err());
        assert!(answers.response_hash(pin, 8, 9, body).is_err());

        let mut verdicts = Verdicts::default();
        let verdict = first.unwrap();
        for i in 0..Verdicts::CAP as u64 + 10 {
            verdicts.insert(("m".into(), Hash::of_parts(&[&i.to_le_bytes()])), verdict);
        }
        assert_eq!(verdicts.by_request.len(), Verdicts::CAP);
        assert!(verdicts
            .get(&("m".into(), Hash::of_parts(&[&0u64.to_le_bytes()])))
            .is_none());
        assert!(verdicts
            .get(&("m".into(), Hash::of_parts(&[&20u64.to_le_bytes()])))
            .is_some());
    }

    #[test]
    fn a_request_that_does_not_decode_or_another_model_is_an_error() {
        let answers = ModelAnswers::load(&tiny_checkpoint()).unwrap();
        let pin = answers.pin().clone();
        for body in [&b""[..], b"garbage", &[0xff; 64]] {
            assert!(correct(&answers, &pin, 0, 0, body).is_err());
        }
        // The same checkpoint pinned without a name, shape or arithmetic (as a format-1
        // genesis pins it), or under another name: judged all the same.
        for pinned in [
            ModelPin {
                name: String::new(),
                shape: None,
                arithmetic: 0,
                ..pin.clone()
            },
            ModelPin {
                name: "renamed".into(),
                ..pin.clone()
            },
        ] {
            let error = correct(&answers, &pinned, 0, 0, b"garbage").unwrap_err();
            assert!(!error.contains("recomputes model"), "{error}");
        }
        let other = ModelPin {
            id: "another".into(),
            ..pin
        };
        let error = correct(&answers, &other, 0, 0, b"").unwrap_err();
        assert!(error.contains("another"), "{error}");
    }

    /// A format-2 node needs no checkpoint, but computes the pinned arithmetic's version.
    #[test]
    fn a_format_2_node_judges_without_a_model_but_only_in_the_pinned_arithmetic() {
        let genesis = Genesis::from_json(kvasir_devnet::chain::DEV_GENESIS).unwrap();
        assert!(evidence_check(&genesis, &[]).unwrap().is_some());
        let mut later = genesis.clone();
        later.models[1].arithmetic = kvasir_inference::ARITHMETIC_VERSION + 1;
        let refused = evidence_check(&later, &[]).err().unwrap().to_string();
        assert!(refused.contains("reference arithmetic"), "{refused}");
        let mut none = genesis;
        none.models.clear();
        assert!(evidence_check(&none, &[]).unwrap().is_none());
    }

    #[test]
    fn a_node_refuses_to_start_without_every_pinned_checkpoint_or_with_another() {
        let dir = tiny_checkpoint();
        let mut genesis = Genesis::from_json(kvasir_devnet::chain::DEV_GENESIS).unwrap();
        genesis.models.clear();
        let given = [dir.clone()];
        assert!(PinnedAnswers::for_genesis(&genesis, &given)
            .unwrap()
            .is_none());
        genesis.models.push(format_1_pin(&dir).unwrap());
        let answers = PinnedAnswers::for_genesis(&genesis, &given)
            .unwrap()
            .unwrap();
        let pin = genesis.models[0].clone();
        assert!(answers.response_hash(&pin, 0, 0, b"garbage").is_err());
        let missing = PinnedAnswers::for_genesis(&genesis, &[]).err().unwrap();
        assert!(missing.to_string().contains("--model"), "{missing}");
        // Answers judged by another version of the reference arithmetic: refused.
        let mut later = genesis.clone();
        later.models[0].arithmetic = kvasir_inference::ARITHMETIC_VERSION + 1;
        let version = PinnedAnswers::for_genesis(&later, &given).err().unwrap();
        assert!(
            version.to_string().contains("reference arithmetic"),
            "{version}"
        );
        let twice = PinnedAnswers::for_genesis(&genesis, &[dir.clone(), dir.clone()]);
        assert!(twice.err().unwrap().to_string().contains("twice"));
        // A second pinned model not given: the node would refuse evidence its peers take.
        genesis.models.push(ModelPin {
            id: "another".into(),
            ..pin.clone()
        });
        let partial = PinnedAnswers::for_genesis(&genesis, &given).err().unwrap();
        assert!(partial.to_string().contains("missing another"), "{partial}");
        genesis.models.truncate(1);
        genesis.models[0].experts_root = kvasir_ledger::Hash([9; 32]);
        let wrong = PinnedAnswers::for_genesis(&genesis, &given).err().unwrap();
        assert!(wrong.to_string().contains("not the weights"), "{wrong}");
    }
}
