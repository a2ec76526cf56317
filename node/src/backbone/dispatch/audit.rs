//! Audits: the backbone recomputes a secret, unpredictable sample of the remote answers it
//! uses (`--audit-rate`, drawn from the operating system's CSPRNG after the answer arrived,
//! so a worker cannot tell which answers are checked) and every answer of a worker still on
//! probation (its first `--probation` answers). Kernels are bit-exact, so the check is a
//! comparison of bits. On a mismatch the executor uses its own result (the output does not
//! change) and stops dispatching to that worker, and the auditor submits an Evidence
//! transaction quoting the signed answer through the ledger API it was given, from a thread
//! of its own so the generation never waits on the ledger.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvasir_api::generation::{AuditReport, CaughtWorker};
use kvasir_api::ledger::{ParamsView, PinnedModelView};
use kvasir_api::Client;
use kvasir_ledger::genesis::ModelPin;
use kvasir_ledger::state::AnswerCheck;
use kvasir_ledger::tx::{Evidence, ExpertEvidence, ExpertWeights};
use kvasir_ledger::{Address, Amount, Keypair, TxKind};
use rand::rngs::OsRng;
use rand::Rng;

use super::remote::SignedAnswer;
use crate::backbone::lock;
use crate::expert_evidence::{ExpertJudge, ExpertProver};

/// Worker keys whose answers are counted for probation; past it the counts start over, so a
/// peer churning keys cannot grow the map (a key seen again is on probation again).
const MAX_TRACKED_KEYS: usize = 65_536;
/// Evidence waiting to be submitted; past it a catch is still used and recorded, unreported.
const MAX_QUEUED_EVIDENCE: usize = 64;
/// How long the reporter waits for one Evidence transaction to be committed.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Where evidence goes: the ledger API and the key that signs it (and is paid the
/// reporter's share); and the checkpoint whose experts evidence on a format-2 chain carries.
pub struct Reporting {
    pub ledger: Client,
    pub key: Keypair,
    pub model: PathBuf,
}

/// The expert of a wrong answer that an audit found wrong first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Disputed {
    pub layer: usize,
    pub expert: usize,
}

/// What the reporter thread submits: the answer, and the expert it got wrong.
struct Catch {
    index: usize,
    evidence: Evidence,
    disputed: Disputed,
}

pub struct Auditor {
    /// The audit rate's f64 bits: adjustable while answers flow (`set_rate`).
    rate: AtomicU64,
    probation: u64,
    answers_seen: Mutex<HashMap<Address, u64>>,
    report: Arc<Mutex<AuditReport>>,
    evidence: Option<SyncSender<Catch>>,
    reporter: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Auditor {
    /// Audits `rate` (0..=1) of answers and the first `probation` answers of every worker;
    /// with `reporting`, mismatches become Evidence transactions.
    pub fn new(rate: f64, probation: u64, reporting: Option<Reporting>) -> Auditor {
        let report = Arc::new(Mutex::new(AuditReport::default()));
        let (evidence, reporter) = match reporting {
            Some(reporting) => {
                let (tx, rx) = sync_channel(MAX_QUEUED_EVIDENCE);
                let report = report.clone();
                let thread = std::thread::spawn(move || report_evidence(reporting, rx, report));
                (Some(tx), Some(thread))
            }
            None => (None, None),
        };
        Auditor {
            rate: AtomicU64::new(rate.clamp(0.0, 1.0).to_bits()),
            probation,
            answers_seen: Mutex::new(HashMap::new()),
            report,
            evidence,
            reporter: Mutex::new(reporter),
        }
    }

    /// Whether to recompute this answer of `worker`: during its probation always, after it
    /// with probability `rate`, drawn fresh from the OS.
    pub fn should_audit(&self, worker: &Address) -> bool {
        let seen = {
            let mut answers = lock(&self.answers_seen);
            if answers.len() >= MAX_TRACKED_KEYS && !answers.contains_key(worker) {
                answers.clear();
            }
            let seen = answers.entry(*worker).or_default();
            *seen += 1;
            *seen
        };
        let rate = self.rate();
        seen <= self.probation || (rate > 0.0 && OsRng.gen_bool(rate))
    }

    pub fn rate(&self) -> f64 {
        f64::from_bits(self.rate.load(Ordering::Relaxed))
    }

    /// Audits `rate` (0..=1) of answers from now on (`bench audit` compares rates on one
    /// link).
    pub fn set_rate(&self, rate: f64) {
        self.rate
            .store(rate.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
    }

    /// Records one audit; for a mismatch (`wrong`, the expert found wrong), records the
    /// catch and queues its evidence.
    pub fn audited(&self, answer: &SignedAnswer, wrong: Option<Disputed>) {
        let answer_number = lock(&self.answers_seen)
            .get(&answer.worker)
            .copied()
            .unwrap_or_default();
        let mut report = lock(&self.report);
        report.audits += 1;
        let Some(disputed) = wrong else {
            return;
        };
        report.mismatches += 1;
        let index = report.caught.len();
        report.caught.push(CaughtWorker {
            worker: answer.worker,
            hub: answer.claim.hub,
            session_id: answer.session(),
            request_id: answer.request_id(),
            answer_number,
            evidence: None,
            submitted_height: None,
            committed_height: None,
            error: None,
        });
        let caught = &mut report.caught[index];
        tracing::warn!(
            "caught: worker {} answered request {} of session {} wrongly; its answers are not used again",
            answer.worker,
            answer.request_id(),
            answer.session()
        );
        let Some(queue) = &self.evidence else {
            caught.error = Some("no --ledger given: the evidence was not submitted".into());
            return;
        };
        let catch = Catch {
            index,
            evidence: evidence_of(answer),
            disputed,
        };
        match queue.try_send(catch) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                caught.error = Some("too much evidence waiting: this one was not submitted".into())
            }
            Err(TrySendError::Disconnected(_)) => {
                caught.error = Some("the evidence reporter stopped".into())
            }
        }
    }

    /// The audits so far.
    pub fn report(&self) -> AuditReport {
        lock(&self.report).clone()
    }

    /// Waits until every queued Evidence transaction is committed or given up on, then
    /// reports: what a backbone prints at the end of a run.
    pub fn finish(&self) -> AuditReport {
        let pending = || {
            lock(&self.report)
                .caught
                .iter()
                .any(|c| c.committed_height.is_none() && c.error.is_none())
        };
        let give_up = std::time::Instant::now() + COMMIT_TIMEOUT + Duration::from_secs(5);
        while pending() && std::time::Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.report()
    }
}

impl Drop for Auditor {
    fn drop(&mut self) {
        self.evidence = None;
        if let Some(thread) = lock(&self.reporter).take() {
            let _ = thread.join();
        }
    }
}

/// What proves answers wrong on a format-2 chain: the checkpoint's experts, checked against
/// the chain's pin of the model, and that pin.
struct Proof {
    prover: ExpertProver,
    pin: ModelPin,
}

impl Proof {
    /// The prover of the checkpoint in `model` (every expert hashed once), if it is the one
    /// `params` pins under `model_id`: a backbone whose checkpoint is not the pinned one would
    /// burn a deposit for every piece of evidence.
    fn open(model: &Path, model_id: &str, params: &ParamsView) -> anyhow::Result<Proof> {
        let Some(pinned) = params.models.iter().find(|m| m.id == model_id) else {
            anyhow::bail!("the chain pins no model {model_id}: its evidence would be refused");
        };
        Proof::of(model, pinned)
    }

    /// The prover of the checkpoint in `model`, if `pinned` is its pin.
    fn of(model: &Path, pinned: &PinnedModelView) -> anyhow::Result<Proof> {
        let model_id = &pinned.id;
        let prover = ExpertProver::open(model)?;
        if prover.commitments() != (pinned.config_hash, pinned.experts_root) {
            anyhow::bail!(
                "the checkpoint in {} is not the one the chain pins as {model_id} (config {} / experts {})",
                model.display(),
                pinned.config_hash,
                pinned.experts_root
            );
        }
        let pin = ModelPin {
            id: pinned.id.clone(),
            config_hash: pinned.config_hash,
            experts_root: pinned.experts_root,
            name: pinned.name.clone(),
            shape: None,
            arithmetic: pinned.arithmetic,
        };
        Ok(Proof { prover, pin })
    }

    /// The weights of the `disputed` expert, once the validators' own check, run here, finds
    /// the answer wrong with them: evidence they would judge right would burn the deposit.
    fn weights(&self, evidence: &Evidence, disputed: Disputed) -> anyhow::Result<ExpertWeights> {
        let weights = self
            .prover
            .weights(disputed.layer, u16::try_from(disputed.expert)?)?;
        match ExpertJudge.is_wrong(&self.pin, evidence, Some(&weights)) {
            Ok(true) => Ok(weights),
            Ok(false) => anyhow::bail!(
                "the validators would judge this answer right from the pinned weights: not submitted"
            ),
            Err(e) => anyhow::bail!("the validators would refuse this evidence ({e}): not submitted"),
        }
    }
}

/// The Evidence transaction body quoting `answer`.
fn evidence_of(answer: &SignedAnswer) -> Evidence {
    Evidence {
        worker: answer.worker,
        hub: answer.claim.hub,
        session: answer.session(),
        request_id: answer.request_id(),
        model_id: answer.claim.model_id.clone(),
        request_body: answer.request_body().to_vec(),
        response_body: answer.response_body().to_vec(),
        signature: answer.signature,
    }
}

/// The reporter thread: signs and submits each piece of evidence in turn (one at a time, so
/// nonces follow each other) and records what became of it.
fn report_evidence(reporting: Reporting, queue: Receiver<Catch>, report: Arc<Mutex<AuditReport>>) {
    // On a format-2 chain, opened now, before any catch (it reads every expert once, which
    // takes minutes on a frontier-size model, and a catch must not wait for that past its
    // challenge window); else at the first catch. Or the reason it cannot be, given to every
    // catch after.
    let mut proof: Option<Result<Proof, String>> = None;
    if let Ok(params) = reporting.ledger.params() {
        if params.format >= 2 {
            let opened = kvasir_wire::model_id(&reporting.model)
                .and_then(|id| Proof::open(&reporting.model, &id, &params));
            if let Err(e) = &opened {
                tracing::warn!("evidence cannot be proven: {e:#}");
            }
            proof = Some(opened.map_err(|e| format!("{e:#}")));
        }
    }
    for Catch {
        index,
        evidence,
        disputed,
    } in queue
    {
        let outcome = submit(&reporting, &mut proof, evidence, disputed);
        let mut report = lock(&report);
        let Some(caught) = report.caught.get_mut(index) else {
            continue;
        };
        match outcome {
            Ok(Reported {
                hash,
                submitted_at,
                height,
            }) => {
                tracing::info!(
                    "evidence {hash} against {} committed at height {height}",
                    caught.worker
                );
                caught.evidence = Some(hash);
                caught.submitted_height = Some(submitted_at);
                caught.committed_height = Some(height);
            }
            Err((hash, e)) => {
                tracing::warn!("evidence against {} not committed: {e}", caught.worker);
                caught.evidence = hash;
                caught.error = Some(e);
            }
        }
    }
}

/// Evidence the ledger took: its hash, the head when it was admitted and the height it was
/// committed at.
struct Reported {
    hash: kvasir_ledger::Hash,
    submitted_at: u64,
    height: u64,
}

type Submitted = Result<Reported, (Option<kvasir_ledger::Hash>, String)>;

fn submit(
    reporting: &Reporting,
    proof: &mut Option<Result<Proof, String>>,
    evidence: Evidence,
    disputed: Disputed,
) -> Submitted {
    let failed = |hash, e: kvasir_api::ClientError| (hash, e.to_string());
    let ledger = &reporting.ledger;
    let params = ledger.params().map_err(|e| failed(None, e))?;
    let kind = if params.format >= 2 {
        let proof = proof.get_or_insert_with(|| {
            Proof::open(&reporting.model, &evidence.model_id, &params).map_err(|e| format!("{e:#}"))
        });
        let proof = proof.as_ref().map_err(|e| (None, e.clone()))?;
        let weights = proof
            .weights(&evidence, disputed)
            .map_err(|e| (None, format!("{e:#}")))?;
        TxKind::ExpertEvidence(Box::new(ExpertEvidence { evidence, weights }))
    } else {
        TxKind::Evidence(Box::new(evidence))
    };
    let chain_id = params.chain_id.clone();
    // Busy validators are asked again until the pay this evidence should cancel could have
    // settled: the challenge window, at the chain's block interval.
    let window = params
        .challenge_window
        .saturating_mul(params.block_interval_ms);
    let retry_until = COMMIT_TIMEOUT.max(Duration::from_millis(window));
    let tx = ledger
        .sign_next(&chain_id, kind, &reporting.key, Amount::ZERO)
        .map_err(|e| failed(None, e))?;
    // Through the batch route: its body limit fits an Evidence transaction, the single
    // route's (sized for plain transactions) does not.
    let hash = tx.hash();
    // A validator recomputes one piece of evidence at a time, in turn, and refuses what
    // cannot take its turn soon.
    let start = Instant::now();
    loop {
        let verdicts = ledger
            .submit_batch(std::slice::from_ref(&tx))
            .map_err(|e| failed(None, e))?;
        match verdicts.into_iter().next() {
            Some(Err(e)) if e.error == "evidence_busy" && start.elapsed() < retry_until => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Some(Err(e)) => return Err((None, e.message)),
            Some(Ok(_)) | None => break,
        }
    }
    let submitted_at = ledger.head().map_err(|e| failed(Some(hash), e))?.height;
    let height = ledger
        .wait_committed(&hash, COMMIT_TIMEOUT)
        .map_err(|e| failed(Some(hash), e))?;
    Ok(Reported {
        hash,
        submitted_at,
        height,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use crate::answers::tests::{honest_body, request};
    use crate::engine::{model_pin, tiny_checkpoint};
    use crate::expert_evidence::tests::evidence_of;
    use kvasir_inference::checkpoint::Checkpoint;
    use kvasir_inference::config::Config;
    use kvasir_inference::moe::LocalExperts;

    fn view(pin: &ModelPin) -> PinnedModelView {
        PinnedModelView {
            id: pin.id.clone(),
            config_hash: pin.config_hash,
            experts_root: pin.experts_root,
            name: pin.name.clone(),
            layers: None,
            experts: None,
            arithmetic: pin.arithmetic,
        }
    }

    /// The backbone proves nothing the validators would not convict: a checkpoint that is not
    /// the pinned one is refused before any evidence, and evidence of a right answer is not
    /// submitted (either would burn its deposit); a wrong answer gets its expert's weights.
    #[test]
    fn only_evidence_the_validators_convict_on_is_submitted() {
        let dir = tiny_checkpoint();
        let pin = model_pin(&dir).unwrap();
        let mut other = view(&pin);
        other.experts_root = kvasir_ledger::Hash([7; 32]);
        let refused = Proof::of(&dir, &other).err().unwrap().to_string();
        assert!(refused.contains("not the one the chain pins"), "{refused}");

        let proof = Proof::of(&dir, &view(&pin)).unwrap();
        let config = Config::load(&dir).unwrap();
        let worker =
            LocalExperts::load(&Checkpoint::open(&dir).unwrap(), &config, |_, _| true).unwrap();
        let mut rng = StdRng::seed_from_u64(21);
        let mut request = request(&mut rng, 4, config.hidden_size, config.num_experts);
        request.layer = config.moe_layers().next().unwrap() as u16;
        request.experts.retain(|(_, rows)| !rows.is_empty());
        let honest = honest_body(&worker, &request);
        let disputed = Disputed {
            layer: request.layer.into(),
            expert: request.experts[0].0.into(),
        };
        let right = proof.weights(&evidence_of(&request, honest.clone()), disputed);
        assert!(
            right
                .err()
                .unwrap()
                .to_string()
                .contains("judge this answer right"),
            "a right answer is not submitted"
        );
        let mut lie = honest;
        lie[12] ^= 1;
        let weights = proof
            .weights(&evidence_of(&request, lie), disputed)
            .unwrap();
        assert_eq!(weights.expert, request.experts[0].0);
    }
}
