//! Recomputing answers: what a validator does with evidence, and what the backbone's audit
//! compares a worker's answer with. `ModelAnswers` holds every expert of a checkpoint whose
//! identity (`engine::model_pin`) is the one a genesis pins, and turns a dispatch request
//! body into the exact response body a correct worker sends, through the same translation
//! the worker uses (`wire::translate`), so correct means bit for bit.
//!
//! The room: the engine's experts and the wire format; it answers the ledger's
//! `AnswerCheck` and touches nothing else of the chain.

use std::path::Path;

use anyhow::{bail, Context, Result};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::moe::{ExpertExecutor, LocalExperts};
use kvasir_ledger::genesis::ModelPin;
use kvasir_ledger::state::{AnswerCheck, CorrectAnswer};
use kvasir_ledger::Genesis;

use crate::engine::model_pin;
use crate::wire::{self, Request, Response};

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
            pin: model_pin(dir)?,
            hidden: config.hidden_size,
            experts: LocalExperts::load(&checkpoint, &config, |_, _| true)?,
        })
    }

    /// What a ledger node of `genesis` checks evidence with, from `--model`: nothing for a
    /// chain that pins no model; an error when one is pinned and `model` is missing or is
    /// not that checkpoint, so a node never starts unable to judge evidence its peers take.
    pub fn for_genesis(genesis: &Genesis, model: Option<&Path>) -> Result<Option<ModelAnswers>> {
        if genesis.models.is_empty() {
            if let Some(dir) = model {
                tracing::warn!(
                    "--model {} is not used: this chain pins no model and takes no evidence",
                    dir.display()
                );
            }
            return Ok(None);
        }
        let Some(dir) = model else {
            let ids: Vec<&str> = genesis.models.iter().map(|m| m.id.as_str()).collect();
            bail!(
                "this chain pins model {}: start the node with --model DIR holding that checkpoint, to check evidence",
                ids.join(", ")
            );
        };
        let answers = ModelAnswers::load(dir)
            .with_context(|| format!("loading the checkpoint in {}", dir.display()))?;
        match genesis.model(&answers.pin.id) {
            Some(pinned) if *pinned == answers.pin => Ok(Some(answers)),
            Some(pinned) => bail!(
                "the checkpoint in {} has model id {} but not the weights this genesis pins (config {} / experts {}, pinned {} / {})",
                dir.display(),
                answers.pin.id,
                answers.pin.config_hash,
                answers.pin.experts_root,
                pinned.config_hash,
                pinned.experts_root
            ),
            None => bail!(
                "the checkpoint in {} (model id {}) is not a model this genesis pins",
                dir.display(),
                answers.pin.id
            ),
        }
    }

    pub fn pin(&self) -> &ModelPin {
        &self.pin
    }

    /// The correct response body to `request`: the partials of its experts on its rows.
    pub fn response_body(&self, request: &Request) -> Result<Vec<u8>> {
        let hidden = request.hidden as usize;
        if hidden != self.hidden {
            bail!("rows are {hidden} wide, this model's are {}", self.hidden);
        }
        let requests = request.to_expert_requests()?;
        let partials = self.experts.evaluate(request.layer as usize, &requests)?;
        let response = Response::from_partials(request, &partials)?;
        Ok(wire::response_body(&wire::Message::Response(response).encode()).to_vec())
    }
}

impl AnswerCheck for ModelAnswers {
    fn answer(&self, model: &ModelPin, request_body: &[u8]) -> Result<CorrectAnswer, String> {
        if *model != self.pin {
            return Err(format!(
                "this node recomputes model {}, the evidence names {}",
                self.pin.id, model.id
            ));
        }
        let request = wire::decode_request_body(request_body).map_err(|e| e.to_string())?;
        let response_body = self.response_body(&request).map_err(|e| format!("{e:#}"))?;
        Ok(CorrectAnswer {
            session: request.session,
            request_id: request.id,
            response_body,
        })
    }
}
