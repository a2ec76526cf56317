//! The Qwen MoE decoders as transformers publishes them: Qwen3-MoE, Qwen2-MoE and
//! Qwen3.5-MoE, with weight names mirroring the checkpoint. The backbone holds embeddings,
//! token mixers (attention, or Qwen3.5's gated DeltaNet), norms and routers; routed experts
//! are reached through an `ExpertExecutor`.

use std::collections::TryReserveError;
use std::convert::Infallible;

use rayon::prelude::*;

use super::deltanet::{DeltaState, GatedDeltaNet};
use crate::checkpoint::{Checkpoint, Convention};
use crate::config::{Config, Family, Mixer};
use crate::kernels::attention::{self, KeyValues};
use crate::kernels::cpu::{matmul_t, rms_norm, sigmoid};
use crate::moe::{ExpertError, ExpertExecutor, MoeBlock, SwiGlu};
use crate::weights::Weight;
use crate::LoadError;

struct Attention {
    /// Qwen3.5's doubles its rows: each head's query, then its output gate.
    q: Weight,
    k: Weight,
    v: Weight,
    o: Weight,
    /// Qwen2-MoE's q/k/v biases.
    bias: Option<[Vec<f32>; 3]>,
    /// Qwen3's and Qwen3.5's per-head RMSNorm of q and k, before RoPE.
    qk_norm: Option<[Vec<f32>; 2]>,
    /// Qwen3.5: the output is multiplied by `sigmoid(gate)` before `o_proj`.
    output_gate: bool,
}

enum TokenMixer {
    Attention(Attention),
    DeltaNet(GatedDeltaNet),
}

enum Mlp {
    Dense(SwiGlu),
    Moe(MoeBlock),
}

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    mixer: TokenMixer,
    mlp: Mlp,
}

/// An RMSNorm's weight as the family applies it: Qwen3.5's norms scale by `1 + weight`,
/// added here once in f32 as transformers adds it on every call (llama.cpp's converter
/// stores the sum).
fn norm_weight(
    checkpoint: &Checkpoint,
    config: &Config,
    name: &str,
    len: usize,
) -> Result<Vec<f32>, LoadError> {
    let mut weight = checkpoint.tensor(name, &[len])?.to_f32();
    if config.family() == Family::Qwen35Moe && checkpoint.convention() == Convention::HuggingFace {
        weight.iter_mut().for_each(|w| *w += 1.0);
    }
    Ok(weight)
}

impl Attention {
    fn load(
        checkpoint: &Checkpoint,
        config: &Config,
        prefix: &str,
    ) -> Result<Attention, LoadError> {
        let (h, hd) = (config.hidden_size, config.head_dim());
        let (heads, kv) = (config.num_attention_heads, config.num_key_value_heads);
        let output_gate = config.family() == Family::Qwen35Moe;
        let vector = |name: &str, len: usize| {
            checkpoint
                .tensor(&format!("{prefix}.{name}"), &[len])
                .map(|w| w.to_f32())
        };
        // Qwen3.5's q_proj yields each head's query and its output gate (its bias too).
        let q_rows = if output_gate { 2 } else { 1 } * heads * hd;
        let bias = if config.qkv_bias() {
            Some([
                vector("q_proj.bias", q_rows)?,
                vector("k_proj.bias", kv * hd)?,
                vector("v_proj.bias", kv * hd)?,
            ])
        } else {
            None
        };
        let qk_norm = if config.is_qwen2() {
            None
        } else {
            Some([
                norm_weight(checkpoint, config, &format!("{prefix}.q_norm.weight"), hd)?,
                norm_weight(checkpoint, config, &format!("{prefix}.k_norm.weight"), hd)?,
            ])
        };
        let matrix = |name: &str, rows: usize, cols: usize| {
            checkpoint.tensor(&format!("{prefix}.{name}"), &[rows, cols])
        };
        Ok(Attention {
            q: matrix("q_proj.weight", q_rows, h)?,
            k: matrix("k_proj.weight", kv * hd, h)?,
            v: matrix("v_proj.weight", kv * hd, h)?,
            o: matrix("o_proj.weight", h, heads * hd)?,
            bias,
            qk_norm,
            output_gate,
        })
    }
}

pub struct Model {
    config: Config,
    embed: Weight,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Weight,
    /// `inv_freq` of the rotary embedding, as transformers computes it in f32.
    inv_freq: Vec<f32>,
}

/// One sequence's memory of the tokens so far, per layer: for attention its keys and
/// values (`positions x kv_heads x head_dim`), for a DeltaNet its convolution and
/// recurrent state.
#[derive(Clone)]
pub struct Cache {
    layers: Vec<LayerCache>,
    len: usize,
}

#[derive(Clone)]
enum LayerCache {
    Attention { keys: Vec<f32>, values: Vec<f32> },
    DeltaNet(DeltaState),
}

impl Cache {
    /// Tokens seen so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn keys_values(&self, layer: usize) -> (&[f32], &[f32]) {
        match &self.layers[layer] {
            LayerCache::Attention { keys, values } => (keys, values),
            LayerCache::DeltaNet(_) => (&[], &[]),
        }
    }
}

/// New tokens for one sequence in a forward pass.
pub struct Step<'a> {
    pub cache: &'a mut Cache,
    pub tokens: &'a [u32],
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(transparent)]
    Expert(#[from] ExpertError),
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("position {0} is beyond max_position_embeddings")]
    TooLong(usize),
    #[error("a sequence's cache was made by another model")]
    ForeignCache,
    #[error("a sequence in the batch has no new tokens")]
    NoTokens,
}

impl Model {
    /// Loads everything but the routed experts.
    pub fn load(checkpoint: &Checkpoint, config: Config) -> Result<Model, LoadError> {
        let h = config.hidden_size;
        let norm = |name: &str, len: usize| norm_weight(checkpoint, &config, name, len);
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mixer = match config.mixer(i) {
                Mixer::FullAttention => TokenMixer::Attention(Attention::load(
                    checkpoint,
                    &config,
                    &format!("{p}.self_attn"),
                )?),
                Mixer::LinearAttention => {
                    TokenMixer::DeltaNet(GatedDeltaNet::load(checkpoint, &config, i)?)
                }
            };
            let mlp = if config.is_moe_layer(i) {
                Mlp::Moe(MoeBlock::load(checkpoint, &config, i)?)
            } else {
                Mlp::Dense(SwiGlu::load(
                    checkpoint,
                    &format!("{p}.mlp"),
                    h,
                    config.intermediate_size,
                )?)
            };
            layers.push(Layer {
                input_norm: norm(&format!("{p}.input_layernorm.weight"), h)?,
                post_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                mixer,
                mlp,
            });
        }
        let embed = checkpoint.tensor("model.embed_tokens.weight", &[config.vocab_size, h])?;
        let lm_head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            checkpoint.tensor("lm_head.weight", &[config.vocab_size, h])?
        };
        let theta = config.rope_theta() as f32;
        let rotary = config.rotary_dim();
        let inv_freq = (0..rotary / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary as f32))
            .collect();
        Ok(Model {
            norm: norm("model.norm.weight", h)?,
            config,
            embed,
            layers,
            lm_head,
            inv_freq,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Weight bytes read per token by the backbone's dense parts (attention, norms, routers,
    /// dense layers, shared experts, one embedding row and the lm head).
    pub fn dense_bytes_per_token(&self) -> usize {
        let h = self.config.hidden_size;
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let mixer = match &l.mixer {
                    TokenMixer::Attention(a) => {
                        a.q.byte_len() + a.k.byte_len() + a.v.byte_len() + a.o.byte_len()
                    }
                    TokenMixer::DeltaNet(d) => d.byte_len(),
                };
                mixer
                    + 2 * h * 4
                    + match &l.mlp {
                        Mlp::Dense(m) => m.byte_len(),
                        Mlp::Moe(block) => block.byte_len(),
                    }
            })
            .sum();
        per_layer + self.lm_head.byte_len() + self.embed.dtype().bytes(h).unwrap_or(0)
    }

    /// Bytes of one sequence's cache at `positions` positions, all of which a decode step
    /// there reads: the keys and values of each attention layer, the state of each DeltaNet
    /// layer.
    pub fn cache_bytes(&self, positions: usize) -> usize {
        self.layers
            .iter()
            .map(|l| match &l.mixer {
                TokenMixer::Attention(_) => positions.saturating_mul(2 * self.kv_width() * 4),
                TokenMixer::DeltaNet(d) => d.state_bytes(),
            })
            .fold(0, usize::saturating_add)
    }

    /// Values one position adds to an attention layer's keys (and as many to its values).
    fn kv_width(&self) -> usize {
        self.config.num_key_value_heads * self.config.head_dim()
    }

    /// Whether `cache` has this model's layers (as `new_cache` makes them).
    fn made(&self, cache: &Cache) -> bool {
        cache.layers.len() == self.layers.len()
            && cache
                .layers
                .iter()
                .zip(&self.layers)
                .all(|(c, l)| match (c, &l.mixer) {
                    (LayerCache::Attention { .. }, TokenMixer::Attention(_)) => true,
                    (LayerCache::DeltaNet(state), TokenMixer::DeltaNet(d)) => d.fits(state),
                    _ => false,
                })
    }

    pub fn new_cache(&self) -> Cache {
        let Ok(cache) = self.cache_with(|| Ok::<_, Infallible>(Vec::new()));
        cache
    }

    /// A cache with room for `positions` positions allocated up front, so that it holds
    /// exactly `cache_bytes(positions)` when full (grown a step at a time, a vector may hold
    /// up to twice what it uses). An error, not an abort, when the memory is not there.
    pub fn new_cache_for(&self, positions: usize) -> Result<Cache, TryReserveError> {
        let values = positions.saturating_mul(self.kv_width());
        self.cache_with(|| {
            let mut room = Vec::new();
            room.try_reserve_exact(values).map(|()| room)
        })
    }

    /// A cache whose attention keys and values each start as `room()`.
    fn cache_with<E>(&self, mut room: impl FnMut() -> Result<Vec<f32>, E>) -> Result<Cache, E> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match &l.mixer {
                    TokenMixer::Attention(_) => LayerCache::Attention {
                        keys: room()?,
                        values: room()?,
                    },
                    TokenMixer::DeltaNet(d) => LayerCache::DeltaNet(d.new_state()),
                })
            })
            .collect::<Result<_, E>>()?;
        Ok(Cache { layers, len: 0 })
    }

    /// Runs the new tokens of every sequence in `steps` through the model as one batch,
    /// appending to their caches, and returns each sequence's logits for its last token.
    /// A sequence's logits are the same bits whatever else is in the batch.
    pub fn forward(
        &self,
        steps: &mut [Step<'_>],
        experts: &dyn ExpertExecutor,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        // The pass runs on a worker of the thread pool: the hundreds of parallel kernels in
        // it then split their work among workers directly, instead of each waking the pool
        // from outside and sleeping until it is done (tens of microseconds a call).
        rayon::scope(|_| self.forward_on_worker(steps, experts))
    }

    fn forward_on_worker(
        &self,
        steps: &mut [Step<'_>],
        experts: &dyn ExpertExecutor,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        let c = &self.config;
        let h = c.hidden_size;
        let eps = c.rms_norm_eps as f32;
        // Row r of the batch is token `offset` of sequence `seq`, at absolute `position`.
        let mut rows = Vec::new();
        for (seq, step) in steps.iter().enumerate() {
            if !self.made(step.cache) {
                return Err(ForwardError::ForeignCache);
            }
            if step.tokens.is_empty() {
                return Err(ForwardError::NoTokens);
            }
            for (offset, token) in step.tokens.iter().enumerate() {
                if *token as usize >= c.vocab_size {
                    return Err(ForwardError::BadToken(*token));
                }
                let position = step.cache.len + offset;
                if position >= c.max_position_embeddings {
                    return Err(ForwardError::TooLong(position));
                }
                rows.push((seq, *token, position));
            }
        }
        let n = rows.len();
        let mut x = vec![0f32; n * h];
        for ((_, token, _), row) in rows.iter().zip(x.chunks_mut(h)) {
            self.embed.row_f32(*token as usize, row);
        }
        let mut normed = vec![0f32; n * h];
        for (index, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.input_norm, eps, &mut normed);
            let attended = match &layer.mixer {
                TokenMixer::Attention(a) => self.attention(index, a, &normed, &rows, steps)?,
                TokenMixer::DeltaNet(d) => {
                    let mut segments = steps
                        .iter_mut()
                        .map(|s| match &mut s.cache.layers[index] {
                            LayerCache::DeltaNet(state) => Ok((s.tokens.len(), state)),
                            LayerCache::Attention { .. } => Err(ForwardError::ForeignCache),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    d.forward(&normed, &mut segments)
                }
            };
            for (a, b) in x.iter_mut().zip(&attended) {
                *a += b;
            }
            rms_norm(&x, &layer.post_norm, eps, &mut normed);
            let mlp = match &layer.mlp {
                Mlp::Dense(m) => m.forward(&normed, n),
                Mlp::Moe(block) => block.forward(&normed, n, experts)?,
            };
            for (a, b) in x.iter_mut().zip(&mlp) {
                *a += b;
            }
        }
        for step in steps.iter_mut() {
            step.cache.len += step.tokens.len();
        }
        // Logits of each sequence's last new token.
        let mut last = Vec::new();
        let mut row = 0;
        for step in steps.iter() {
            row += step.tokens.len();
            last.extend_from_slice(&x[(row - 1) * h..row * h]);
        }
        let count = steps.len();
        let mut final_norm = vec![0f32; count * h];
        rms_norm(&last, &self.norm, eps, &mut final_norm);
        let mut logits = vec![0f32; count * c.vocab_size];
        matmul_t(&final_norm, count, &self.lm_head, &mut logits);
        Ok(logits.chunks(c.vocab_size).map(<[f32]>::to_vec).collect())
    }

    /// Self-attention of layer `index` for the batch rows; appends their keys and values.
    fn attention(
        &self,
        index: usize,
        a: &Attention,
        x: &[f32],
        rows: &[(usize, u32, usize)],
        steps: &mut [Step<'_>],
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let (hd, heads, kv) = (c.head_dim(), c.num_attention_heads, c.num_key_value_heads);
        let n = rows.len();
        let project = |w: &Weight, bias: Option<&Vec<f32>>| {
            let mut out = vec![0f32; n * w.rows()];
            matmul_t(x, n, w, &mut out);
            if let Some(bias) = bias {
                for row in out.chunks_mut(w.rows()) {
                    for (v, b) in row.iter_mut().zip(bias) {
                        *v += b;
                    }
                }
            }
            out
        };
        let bias = |i: usize| a.bias.as_ref().map(|b| &b[i]);
        let mut q = project(&a.q, bias(0));
        // Qwen3.5: each head's query is followed by its gate; part them.
        let gate = a.output_gate.then(|| {
            let (queries, gates): (Vec<&[f32]>, Vec<&[f32]>) =
                q.chunks(2 * hd).map(|both| both.split_at(hd)).unzip();
            let gates: Vec<f32> = gates.concat();
            q = queries.concat();
            gates
        });
        let mut k = project(&a.k, bias(1));
        let v = project(&a.v, bias(2));
        let eps = c.rms_norm_eps as f32;
        for (r, (_, _, position)) in rows.iter().enumerate() {
            let q_row = &mut q[r * heads * hd..(r + 1) * heads * hd];
            let k_row = &mut k[r * kv * hd..(r + 1) * kv * hd];
            if let Some([q_norm, k_norm]) = &a.qk_norm {
                let normed = |row: &mut [f32], weight: &[f32]| {
                    let copy = row.to_vec();
                    rms_norm(&copy, weight, eps, row);
                };
                normed(q_row, q_norm);
                normed(k_row, k_norm);
            }
            for head in q_row.chunks_mut(hd).chain(k_row.chunks_mut(hd)) {
                self.rotate(head, *position);
            }
        }
        // Append this layer's keys and values to each sequence's cache, in row order.
        for (r, (seq, _, _)) in rows.iter().enumerate() {
            let LayerCache::Attention { keys, values } = &mut steps[*seq].cache.layers[index]
            else {
                return Err(ForwardError::ForeignCache);
            };
            keys.extend_from_slice(&k[r * kv * hd..(r + 1) * kv * hd]);
            values.extend_from_slice(&v[r * kv * hd..(r + 1) * kv * hd]);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let group = heads / kv;
        let steps: &[Step<'_>] = steps;
        let mut out = vec![0f32; n * heads * hd];
        // Each (row, key/value head) output is computed whole by one task, its group of
        // query heads together (they read the same keys and values).
        out.par_chunks_mut(group * hd)
            .enumerate()
            .for_each(|(i, o)| {
                let (r, kv_head) = (i / kv, i % kv);
                let (seq, _, position) = rows[r];
                let (keys, values) = steps[seq].cache.keys_values(index);
                let first = (r * heads + kv_head * group) * hd;
                let cache = KeyValues {
                    keys,
                    values,
                    stride: kv * hd,
                    offset: kv_head * hd,
                    len: position + 1,
                };
                attention::attend(&q[first..first + group * hd], hd, cache, scale, o);
            });
        if let Some(gate) = gate {
            for (o, g) in out.iter_mut().zip(&gate) {
                *o *= sigmoid(*g);
            }
        }
        let mut projected = vec![0f32; n * c.hidden_size];
        matmul_t(&out, n, &a.o, &mut projected);
        Ok(projected)
    }

    /// Rotate-half RoPE of one head at `position`, as transformers applies it: over the
    /// first `rotary_dim` dimensions, the rest passing through.
    fn rotate(&self, head: &mut [f32], position: usize) {
        let half = self.inv_freq.len();
        for (i, inv_freq) in self.inv_freq.iter().enumerate() {
            let angle = (position as f32 * inv_freq) as f64;
            let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
            let (x1, x2) = (head[i], head[i + half]);
            head[i] = x1 * cos - x2 * sin;
            head[i + half] = x2 * cos + x1 * sin;
        }
    }
}
