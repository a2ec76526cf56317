//! The MoE seam. The backbone runs the router once; experts are evaluated by an
//! `ExpertExecutor` (local memory now, the network later) as a pure function
//! `(layer, expert, rows) -> partials`; partials are combined in ascending expert order,
//! as transformers does, so the sum is the same bytes wherever a partial was computed.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rayon::prelude::*;

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::kernels::cpu::{matmul_t, sigmoid, silu, softmax};
use crate::weights::{DType, Weight};
use crate::LoadError;

/// A SwiGLU block, `down(silu(gate(x)) * up(x))`: an expert, a dense layer's MLP, or
/// Qwen2-MoE's shared expert.
#[derive(Clone)]
pub struct SwiGlu {
    gate: Weight,
    up: Weight,
    down: Weight,
}

impl SwiGlu {
    pub fn load(
        checkpoint: &Checkpoint,
        prefix: &str,
        hidden: usize,
        width: usize,
    ) -> Result<SwiGlu, LoadError> {
        Ok(SwiGlu {
            gate: checkpoint.tensor(&format!("{prefix}.gate_proj.weight"), &[width, hidden])?,
            up: checkpoint.tensor(&format!("{prefix}.up_proj.weight"), &[width, hidden])?,
            down: checkpoint.tensor(&format!("{prefix}.down_proj.weight"), &[hidden, width])?,
        })
    }

    /// An expert from its three matrices' bytes as a checkpoint stores them, in `dtypes`:
    /// gate and up `width x hidden`, down `hidden x width`. What a validator recomputes
    /// evidence with, from the weights the evidence carries; bytes of another length than
    /// those shapes are refused.
    pub fn from_bytes(
        [gate, up, down]: [&[u8]; 3],
        dtypes: [DType; 3],
        hidden: usize,
        width: usize,
    ) -> Result<SwiGlu, LoadError> {
        let matrix = |name: &str, bytes: &[u8], dtype: DType, rows: usize, cols: usize| {
            let expected = dtype.matrix_bytes(rows, cols);
            if expected != Some(bytes.len()) {
                return Err(LoadError::Format {
                    file: name.to_string(),
                    reason: format!(
                        "{} bytes, where {rows} x {cols} values of {dtype:?} take {expected:?}",
                        bytes.len()
                    ),
                });
            }
            Ok(Weight::owned_bytes(bytes, dtype, rows, cols))
        };
        Ok(SwiGlu {
            gate: matrix("gate_proj", gate, dtypes[0], width, hidden)?,
            up: matrix("up_proj", up, dtypes[1], width, hidden)?,
            down: matrix("down_proj", down, dtypes[2], hidden, width)?,
        })
    }

    /// Applies the block to `rows` rows of `x` (`rows x hidden`). Pure and row-independent:
    /// a row's output bits depend only on that row.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let width = self.gate.rows();
        let mut gate = vec![0f32; rows * width];
        let mut up = vec![0f32; rows * width];
        matmul_t(x, rows, &self.gate, &mut gate);
        matmul_t(x, rows, &self.up, &mut up);
        for (g, u) in gate.iter_mut().zip(&up) {
            *g = silu(*g) * u;
        }
        let mut out = vec![0f32; rows * self.down.rows()];
        matmul_t(&gate, rows, &self.down, &mut out);
        out
    }

    /// Bytes of weights read per evaluation.
    pub fn byte_len(&self) -> usize {
        self.gate.byte_len() + self.up.byte_len() + self.down.byte_len()
    }

    /// Whether its input meets only matrices of block formats (gate and up), which take it
    /// quantized in blocks of 32 (`kernels::quant`): then the input's quantized blocks are all
    /// that its output depends on, and they may travel in place of it.
    pub fn quantizes_input(&self) -> bool {
        [&self.gate, &self.up]
            .iter()
            .all(|w| w.dtype().block_format().is_some())
    }
}

/// The rows routed to one expert in one layer step.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertRequest {
    pub expert: usize,
    /// Which token of the layer step each row is (a remote executor sends a token routed to
    /// several of a worker's experts once).
    pub tokens: Vec<usize>,
    /// `n x hidden`, row-major.
    pub rows: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExpertError {
    #[error("no executor holds expert {expert} of layer {layer}")]
    NotHeld { layer: usize, expert: usize },
    #[error("expert evaluation failed on the device: {0}")]
    Device(String),
    #[error("expert {expert} of layer {layer} returned {got} values, expected {expected}")]
    WrongShape {
        layer: usize,
        expert: usize,
        expected: usize,
        got: usize,
    },
}

/// Evaluates experts. One call per layer step carries every expert's rows, so a remote
/// executor pays one round trip for the whole batch.
pub trait ExpertExecutor: Sync {
    fn holds(&self, layer: usize, expert: usize) -> bool;
    /// One `n x hidden` partial per request, in request order, every NaN `f32::NAN`
    /// (`canonical_nans`).
    fn evaluate(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, ExpertError>;
}

/// Experts held in this process's memory.
pub struct LocalExperts {
    hidden: usize,
    experts: HashMap<(usize, usize), SwiGlu>,
}

impl LocalExperts {
    /// Loads the experts `(layer, expert)` for which `keep` is true; only those are read.
    pub fn load(
        checkpoint: &Checkpoint,
        config: &Config,
        keep: impl Fn(usize, usize) -> bool,
    ) -> Result<LocalExperts, LoadError> {
        let mut experts = HashMap::new();
        for layer in config.moe_layers() {
            for expert in (0..config.num_experts).filter(|e| keep(layer, *e)) {
                let prefix = format!("model.layers.{layer}.mlp.experts.{expert}");
                let weights = SwiGlu::load(
                    checkpoint,
                    &prefix,
                    config.hidden_size,
                    config.moe_intermediate_size,
                )?;
                experts.insert((layer, expert), weights);
            }
        }
        Ok(LocalExperts {
            hidden: config.hidden_size,
            experts,
        })
    }

    /// The layers whose held experts all quantize their input (`SwiGlu::quantizes_input`).
    pub fn layers_quantizing_input(&self) -> BTreeSet<usize> {
        let mut layers: BTreeMap<usize, bool> = BTreeMap::new();
        for ((layer, _), expert) in &self.experts {
            *layers.entry(*layer).or_insert(true) &= expert.quantizes_input();
        }
        layers
            .into_iter()
            .filter_map(|(layer, quantizes)| quantizes.then_some(layer))
            .collect()
    }

    /// Weight bytes read by one evaluation of the largest expert held.
    pub fn expert_bytes(&self) -> usize {
        self.experts
            .values()
            .map(SwiGlu::byte_len)
            .max()
            .unwrap_or(0)
    }
}

impl ExpertExecutor for LocalExperts {
    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.experts.contains_key(&(layer, expert))
    }

    fn evaluate(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let rows = |r: &[f32]| r.len() / self.hidden.max(1);
        evaluate_held(&self.experts, layer, requests, |w, r| {
            Ok(w.forward(r, rows(r)))
        })
    }
}

/// Evaluates each request with the expert `held` under `(layer, expert)`, or reports the
/// first one not held: the shared body of executors that keep experts in a map. Requests
/// run in parallel (one join per layer step rather than one per matrix product); results
/// keep request order, and each is a pure function of its rows.
pub(crate) fn evaluate_held<E: Sync>(
    held: &HashMap<(usize, usize), E>,
    layer: usize,
    requests: &[ExpertRequest],
    eval: impl Fn(&E, &[f32]) -> Result<Vec<f32>, ExpertError> + Sync,
) -> Result<Vec<Vec<f32>>, ExpertError> {
    requests
        .par_iter()
        .map(|r| {
            let expert = held.get(&(layer, r.expert)).ok_or(ExpertError::NotHeld {
                layer,
                expert: r.expert,
            })?;
            let mut partial = eval(expert, &r.rows)?;
            canonical_nans(&mut partial);
            Ok(partial)
        })
        .collect()
}

/// Makes every NaN the one quiet NaN, `f32::NAN`, as every executor's output must be.
/// Finite and infinite values come out the same bits on every backend, but a NaN's sign and
/// payload do not (x86 makes negative quiet NaNs, Arm and CUDA positive ones, and
/// propagation keeps an operand's payload); an answer is checked bit for bit, so an honest
/// worker whose rows produce a NaN must give the bits any validator recomputes.
pub fn canonical_nans(values: &mut [f32]) {
    for value in values.iter_mut().filter(|v| v.is_nan()) {
        *value = f32::NAN;
    }
}

/// Several executors as one: each expert goes to the first part that holds it, and each
/// part gets one call per layer step.
pub struct SplitExperts<'a> {
    parts: Vec<&'a dyn ExpertExecutor>,
}

impl<'a> SplitExperts<'a> {
    pub fn new(parts: Vec<&'a dyn ExpertExecutor>) -> Self {
        SplitExperts { parts }
    }
}

impl ExpertExecutor for SplitExperts<'_> {
    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.parts.iter().any(|p| p.holds(layer, expert))
    }

    fn evaluate(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        let mut results: Vec<Option<Vec<f32>>> = vec![None; requests.len()];
        for part in &self.parts {
            let mine: Vec<usize> = (0..requests.len())
                .filter(|i| results[*i].is_none() && part.holds(layer, requests[*i].expert))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let batch: Vec<ExpertRequest> = mine.iter().map(|i| requests[*i].clone()).collect();
            for (i, partial) in mine.into_iter().zip(part.evaluate(layer, &batch)?) {
                results[i] = Some(partial);
            }
        }
        results
            .into_iter()
            .zip(requests)
            .map(|(r, req)| {
                r.ok_or(ExpertError::NotHeld {
                    layer,
                    expert: req.expert,
                })
            })
            .collect()
    }
}

/// A sparse MoE block: the router (and Qwen2-MoE's gated shared expert) held by the
/// backbone; the routed experts reached through an executor.
pub struct MoeBlock {
    layer: usize,
    router: Weight,
    top_k: usize,
    norm_topk_prob: bool,
    shared: Option<(SwiGlu, Weight)>,
}

impl MoeBlock {
    pub fn load(
        checkpoint: &Checkpoint,
        config: &Config,
        layer: usize,
    ) -> Result<MoeBlock, LoadError> {
        let prefix = format!("model.layers.{layer}.mlp");
        let hidden = config.hidden_size;
        let router = checkpoint.tensor(
            &format!("{prefix}.gate.weight"),
            &[config.num_experts, hidden],
        )?;
        let shared = if config.shared_expert_intermediate_size > 0 {
            let expert = SwiGlu::load(
                checkpoint,
                &format!("{prefix}.shared_expert"),
                hidden,
                config.shared_expert_intermediate_size,
            )?;
            let gate =
                checkpoint.tensor(&format!("{prefix}.shared_expert_gate.weight"), &[1, hidden])?;
            Some((expert, gate))
        } else {
            None
        };
        Ok(MoeBlock {
            layer,
            router,
            top_k: config.num_experts_per_tok,
            norm_topk_prob: config.renormalizes_top_k(),
            shared,
        })
    }

    /// Bytes of the weights the backbone reads per token in this block: the router, and the
    /// shared expert with its gate.
    pub fn byte_len(&self) -> usize {
        self.router.byte_len()
            + self
                .shared
                .as_ref()
                .map_or(0, |(expert, gate)| expert.byte_len() + gate.byte_len())
    }

    /// Per token, the chosen experts and their weights, highest probability first.
    pub fn route(&self, x: &[f32], tokens: usize) -> Vec<Vec<(usize, f32)>> {
        let experts = self.router.rows();
        let mut logits = vec![0f32; tokens * experts];
        matmul_t(x, tokens, &self.router, &mut logits);
        logits
            .chunks_mut(experts)
            .map(|probs| {
                softmax(probs);
                let mut order: Vec<usize> = (0..experts).collect();
                // Stable sort: equal probabilities keep the lower expert first.
                order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]));
                let mut chosen: Vec<(usize, f32)> = order[..self.top_k]
                    .iter()
                    .map(|e| (*e, probs[*e]))
                    .collect();
                if self.norm_topk_prob {
                    let sum: f32 = chosen.iter().map(|(_, w)| w).sum();
                    for (_, w) in &mut chosen {
                        *w /= sum;
                    }
                }
                chosen
            })
            .collect()
    }

    /// The block's output for `tokens` rows of `x`.
    pub fn forward(
        &self,
        x: &[f32],
        tokens: usize,
        executor: &dyn ExpertExecutor,
    ) -> Result<Vec<f32>, ExpertError> {
        let hidden = self.router.cols();
        let routes = self.route(x, tokens);
        // Requests in ascending expert order, each with its tokens in order.
        let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.router.rows()];
        for (token, chosen) in routes.iter().enumerate() {
            for (expert, weight) in chosen {
                assigned[*expert].push((token, *weight));
            }
        }
        let requests: Vec<ExpertRequest> = assigned
            .iter()
            .enumerate()
            .filter(|(_, tokens)| !tokens.is_empty())
            .map(|(expert, tokens)| ExpertRequest {
                expert,
                tokens: tokens.iter().map(|(t, _)| *t).collect(),
                rows: tokens
                    .iter()
                    .flat_map(|(t, _)| &x[t * hidden..(t + 1) * hidden])
                    .copied()
                    .collect(),
            })
            .collect();
        let partials = executor.evaluate(self.layer, &requests)?;
        let mut out = vec![0f32; tokens * hidden];
        for (request, partial) in requests.iter().zip(&partials) {
            let expected = assigned[request.expert].len() * hidden;
            if partial.len() != expected {
                return Err(ExpertError::WrongShape {
                    layer: self.layer,
                    expert: request.expert,
                    expected,
                    got: partial.len(),
                });
            }
            for ((token, weight), row) in
                assigned[request.expert].iter().zip(partial.chunks(hidden))
            {
                for (o, p) in out[token * hidden..(token + 1) * hidden]
                    .iter_mut()
                    .zip(row)
                {
                    *o += p * weight;
                }
            }
        }
        if let Some((expert, gate)) = &self.shared {
            let shared = expert.forward(x, tokens);
            let mut gates = vec![0f32; tokens];
            matmul_t(x, tokens, gate, &mut gates);
            for (token, g) in gates.iter().enumerate() {
                let g = sigmoid(*g);
                for (o, s) in out[token * hidden..(token + 1) * hidden]
                    .iter_mut()
                    .zip(&shared[token * hidden..])
                {
                    *o += g * s;
                }
            }
        }
        Ok(out)
    }
}
