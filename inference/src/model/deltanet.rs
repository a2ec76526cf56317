//! Qwen3.5's gated DeltaNet token mixer (linear attention), as transformers 5.24 defines
//! it: the `in_proj_qkv` output through a causal depthwise convolution and SiLU, q and k
//! L2-normalised per head, `beta = sigmoid(b)`, a per-head decay
//! `exp(-exp(A_log) · softplus(a + dt_bias))`, the gated delta rule over a per-head
//! `key_dim x value_dim` state, an RMSNorm of each head's output gated by `silu(z)`, and
//! `out_proj`.
//!
//! Every sequence runs the recurrence token by token, prompt included: a prompt's last row
//! has the bits it would have had decoded one token at a time, and a row's bits depend only
//! on its own sequence. Sums run in ascending index order.

use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, Convention};
use crate::config::Config;
use crate::kernels::cpu::{dot, exp, matmul_t, rms_norm, sigmoid, silu, softplus};
use crate::weights::Weight;
use crate::LoadError;

/// The layer's shapes.
#[derive(Clone, Copy)]
struct Dims {
    key_heads: usize,
    value_heads: usize,
    key_dim: usize,
    value_dim: usize,
    kernel: usize,
    /// Value heads tiled over the key heads (llama.cpp's order) rather than grouped.
    tiled: bool,
}

impl Dims {
    /// The key head value head `head` reads.
    fn key_head(&self, head: usize) -> usize {
        if self.tiled {
            head % self.key_heads
        } else {
            head / (self.value_heads / self.key_heads)
        }
    }

    /// Channels through the convolution: q, k and v side by side.
    fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

pub struct GatedDeltaNet {
    dims: Dims,
    in_qkv: Weight,
    in_z: Weight,
    in_b: Weight,
    in_a: Weight,
    /// `channels x kernel`.
    conv: Vec<f32>,
    /// `-exp(A_log)` per value head, computed once as transformers does per call (or as
    /// llama.cpp's converter stored it).
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
    out: Weight,
    eps: f32,
}

/// One sequence's memory in one DeltaNet layer: the convolution's last `kernel - 1` inputs
/// (`(kernel - 1) x channels`, oldest first) and each value head's `key_dim x value_dim`
/// state.
#[derive(Clone)]
pub struct DeltaState {
    conv: Vec<f32>,
    recurrent: Vec<f32>,
}

impl GatedDeltaNet {
    pub fn load(checkpoint: &Checkpoint, config: &Config, layer: usize) -> Result<Self, LoadError> {
        let dims = Dims {
            key_heads: config.linear_num_key_heads,
            value_heads: config.linear_num_value_heads,
            key_dim: config.linear_key_head_dim,
            value_dim: config.linear_value_head_dim,
            kernel: config.linear_conv_kernel_dim,
            tiled: checkpoint.convention() == Convention::LlamaCpp,
        };
        let h = config.hidden_size;
        let p = format!("model.layers.{layer}.linear_attn");
        let (channels, values) = (dims.conv_channels(), dims.value_heads * dims.value_dim);
        let matrix = |name: &str, rows: usize, cols: usize| {
            checkpoint.tensor(&format!("{p}.{name}"), &[rows, cols])
        };
        let vector = |name: &str, shape: &[usize]| {
            checkpoint
                .tensor(&format!("{p}.{name}"), shape)
                .map(|w| w.to_f32())
        };
        let neg_a = match checkpoint.convention() {
            Convention::HuggingFace => vector("A_log", &[dims.value_heads])?
                .iter()
                .map(|v| -exp(*v))
                .collect(),
            Convention::LlamaCpp => vector("A", &[dims.value_heads])?,
        };
        Ok(GatedDeltaNet {
            in_qkv: matrix("in_proj_qkv.weight", channels, h)?,
            in_z: matrix("in_proj_z.weight", values, h)?,
            in_b: matrix("in_proj_b.weight", dims.value_heads, h)?,
            in_a: matrix("in_proj_a.weight", dims.value_heads, h)?,
            conv: vector("conv1d.weight", &[channels, 1, dims.kernel])?,
            neg_a,
            dt_bias: vector("dt_bias", &[dims.value_heads])?,
            norm: vector("norm.weight", &[dims.value_dim])?,
            out: matrix("out_proj.weight", h, values)?,
            eps: config.rms_norm_eps as f32,
            dims,
        })
    }

    pub fn new_state(&self) -> DeltaState {
        let (conv, recurrent) = self.new_state_lens();
        DeltaState {
            conv: vec![0.0; conv],
            recurrent: vec![0.0; recurrent],
        }
    }

    /// Whether `state` was made for this layer (by `new_state`).
    pub fn fits(&self, state: &DeltaState) -> bool {
        let fresh = self.new_state_lens();
        (state.conv.len(), state.recurrent.len()) == fresh
    }

    fn new_state_lens(&self) -> (usize, usize) {
        let d = self.dims;
        (
            (d.kernel - 1) * d.conv_channels(),
            d.value_heads * d.key_dim * d.value_dim,
        )
    }

    /// Bytes of one sequence's state in this layer.
    pub fn state_bytes(&self) -> usize {
        let (conv, recurrent) = self.new_state_lens();
        (conv + recurrent) * 4
    }

    /// Bytes of weights read per token.
    pub fn byte_len(&self) -> usize {
        let vectors = self.conv.len() + self.neg_a.len() + self.dt_bias.len() + self.norm.len();
        self.in_qkv.byte_len()
            + self.in_z.byte_len()
            + self.in_b.byte_len()
            + self.in_a.byte_len()
            + self.out.byte_len()
            + vectors * 4
    }

    /// The mixer's output for `x` (`rows x hidden`), where `segments` gives each sequence's
    /// run of consecutive rows, in order, with its state (advanced past them).
    pub fn forward(&self, x: &[f32], segments: &mut [(usize, &mut DeltaState)]) -> Vec<f32> {
        let d = self.dims;
        let n: usize = segments.iter().map(|(len, _)| len).sum();
        let project = |w: &Weight| {
            let mut out = vec![0f32; n * w.rows()];
            matmul_t(x, n, w, &mut out);
            out
        };
        let (mut qkv, z, b, a) = (
            project(&self.in_qkv),
            project(&self.in_z),
            project(&self.in_b),
            project(&self.in_a),
        );
        let channels = d.conv_channels();
        let mut first = 0;
        for (len, state) in segments.iter_mut() {
            let rows = &mut qkv[first * channels..(first + *len) * channels];
            self.convolve(rows, &mut state.conv);
            first += *len;
        }
        qkv.par_chunks_mut(channels)
            .for_each(|row| self.normalise_qk(row));
        // One task per (sequence, value head): each walks its rows in order.
        let per_head = d.key_dim * d.value_dim;
        let mut tasks = Vec::new();
        let mut first = 0;
        for (len, state) in segments.iter_mut() {
            for (head, memory) in state.recurrent.chunks_mut(per_head).enumerate() {
                tasks.push((first, *len, head, memory));
            }
            first += *len;
        }
        let values = d.value_heads * d.value_dim;
        let outputs: Vec<Vec<f32>> = tasks
            .par_iter_mut()
            .map(|(first, len, head, memory)| {
                (*first..*first + *len)
                    .flat_map(|r| {
                        let row = &qkv[r * channels..(r + 1) * channels];
                        let beta = sigmoid(b[r * d.value_heads + *head]);
                        let g = self.neg_a[*head]
                            * softplus(a[r * d.value_heads + *head] + self.dt_bias[*head]);
                        self.step(row, *head, exp(g), beta, memory)
                    })
                    .collect()
            })
            .collect();
        let mut mixed = vec![0f32; n * values];
        for ((first, len, head, _), out) in tasks.iter().zip(&outputs) {
            for (i, o) in out.chunks(d.value_dim).enumerate().take(*len) {
                let at = (first + i) * values + head * d.value_dim;
                mixed[at..at + d.value_dim].copy_from_slice(o);
            }
        }
        // Each head's output: RMSNorm, then times silu(z).
        let mut gated = vec![0f32; n * values];
        rms_norm(&mixed, &self.norm, self.eps, &mut gated);
        for (g, z) in gated.iter_mut().zip(&z) {
            *g *= silu(*z);
        }
        let mut out = vec![0f32; n * self.out.rows()];
        matmul_t(&gated, n, &self.out, &mut out);
        out
    }

    /// The causal depthwise convolution and SiLU over one sequence's consecutive rows,
    /// in place, with the inputs before them from `history` (which it then advances).
    fn convolve(&self, rows: &mut [f32], history: &mut Vec<f32>) {
        let (channels, kernel) = (self.dims.conv_channels(), self.dims.kernel);
        let mut window = std::mem::take(history);
        for row in rows.chunks_mut(channels) {
            window.extend_from_slice(row);
            for (c, out) in row.iter_mut().enumerate() {
                let weights = &self.conv[c * kernel..(c + 1) * kernel];
                let mut sum = 0f32;
                for (tap, w) in weights.iter().enumerate() {
                    sum += w * window[tap * channels + c];
                }
                *out = silu(sum);
            }
            window.drain(..channels);
        }
        *history = window;
    }

    /// L2-normalises each q and k head of one convolved row, and scales q by
    /// `1 / sqrt(key_dim)`, as transformers does in f32.
    fn normalise_qk(&self, row: &mut [f32]) {
        let d = self.dims;
        let scale = (d.key_dim as f32).sqrt();
        let (q, rest) = row.split_at_mut(d.key_heads * d.key_dim);
        let k = &mut rest[..d.key_heads * d.key_dim];
        for (is_q, heads) in [(true, q), (false, k)] {
            for head in heads.chunks_mut(d.key_dim) {
                let inv_norm = 1.0 / (dot(head, head) + 1e-6).sqrt();
                for v in head.iter_mut() {
                    *v *= inv_norm;
                    if is_q {
                        *v /= scale;
                    }
                }
            }
        }
    }

    /// One token of the gated delta rule for value head `head`: decay the state, write
    /// `beta·(v − S·k)` along `k`, read with `q`. Returns the head's output.
    fn step(&self, row: &[f32], head: usize, decay: f32, beta: f32, state: &mut [f32]) -> Vec<f32> {
        let d = self.dims;
        let key_head = d.key_head(head);
        let q = &row[key_head * d.key_dim..(key_head + 1) * d.key_dim];
        let k_start = d.key_heads * d.key_dim + key_head * d.key_dim;
        let k = &row[k_start..k_start + d.key_dim];
        let v_start = 2 * d.key_heads * d.key_dim + head * d.value_dim;
        let v = &row[v_start..v_start + d.value_dim];
        let mut memory = vec![0f32; d.value_dim];
        for (line, ki) in state.chunks_mut(d.value_dim).zip(k) {
            for (s, m) in line.iter_mut().zip(memory.iter_mut()) {
                *s *= decay;
                *m += *s * ki;
            }
        }
        let delta: Vec<f32> = v.iter().zip(&memory).map(|(v, m)| (v - m) * beta).collect();
        let mut out = vec![0f32; d.value_dim];
        for ((line, ki), qi) in state.chunks_mut(d.value_dim).zip(k).zip(q) {
            for ((s, dj), o) in line.iter_mut().zip(&delta).zip(out.iter_mut()) {
                *s += ki * dj;
                *o += *s * qi;
            }
        }
        out
    }
}
