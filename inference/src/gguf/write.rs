//! A Hugging Face checkpoint written as a GGUF file that llama.cpp loads (`kvasir-node model
//! quantize`): the config as llama.cpp's metadata keys (what `config` reads back), the
//! tokenizer as `tokenizer.ggml.*`, the tensors under llama.cpp's names (`names`) with each
//! layer's experts stacked, and the matrices quantized by llama.cpp's reference quantizers
//! (`BlockFormat::quantize`). The same checkpoint and preset give the same bytes.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::Value as Json;

use super::{names, GgmlType};
use crate::checkpoint::Checkpoint;
use crate::config::Mixer;
use crate::config::{Config, Family};
use crate::kernels::cpu::exp;
use crate::kernels::quant::BlockFormat;
use crate::weights::DType;
use crate::LoadError;

/// GGUF's default alignment of tensor data, which llama.cpp's own writers keep.
const ALIGNMENT: u64 = 32;

/// A GGUF header: metadata, tensor infos, and the padding before the data.
#[derive(Default)]
pub struct HeaderWriter {
    metadata: Vec<u8>,
    kv_count: u64,
    infos: Vec<u8>,
    tensor_count: u64,
    data_len: u64,
}

fn put_text(out: &mut Vec<u8>, text: &str) {
    out.extend((text.len() as u64).to_le_bytes());
    out.extend(text.as_bytes());
}

/// `at` rounded up to the alignment.
fn aligned(at: u64) -> u64 {
    at.div_ceil(ALIGNMENT) * ALIGNMENT
}

impl HeaderWriter {
    /// Starts a metadata entry of GGUF type `kind`.
    fn key(&mut self, key: &str, kind: u32) -> &mut Vec<u8> {
        put_text(&mut self.metadata, key);
        self.metadata.extend(kind.to_le_bytes());
        self.kv_count += 1;
        &mut self.metadata
    }

    pub fn u32(&mut self, key: &str, value: u32) -> &mut Self {
        self.key(key, 4).extend(value.to_le_bytes());
        self
    }

    pub fn f32(&mut self, key: &str, value: f32) -> &mut Self {
        self.key(key, 6).extend(value.to_le_bytes());
        self
    }

    pub fn bool(&mut self, key: &str, value: bool) -> &mut Self {
        self.key(key, 7).push(u8::from(value));
        self
    }

    pub fn text(&mut self, key: &str, value: &str) -> &mut Self {
        put_text(self.key(key, 8), value);
        self
    }

    pub fn texts<'a>(
        &mut self,
        key: &str,
        values: impl ExactSizeIterator<Item = &'a str>,
    ) -> &mut Self {
        let out = self.key(key, 9);
        out.extend(8u32.to_le_bytes());
        out.extend((values.len() as u64).to_le_bytes());
        for value in values {
            put_text(out, value);
        }
        self
    }

    pub fn bools(&mut self, key: &str, values: &[bool]) -> &mut Self {
        let out = self.key(key, 9);
        out.extend(7u32.to_le_bytes());
        out.extend((values.len() as u64).to_le_bytes());
        out.extend(values.iter().map(|v| u8::from(*v)));
        self
    }

    pub fn i32s(&mut self, key: &str, values: &[i32]) -> &mut Self {
        let out = self.key(key, 9);
        out.extend(5u32.to_le_bytes());
        out.extend((values.len() as u64).to_le_bytes());
        for value in values {
            out.extend(value.to_le_bytes());
        }
        self
    }

    /// A tensor of `kind` with `dims` (innermost first) whose data takes `bytes`, placed
    /// after the tensors before it at the next aligned offset.
    pub fn tensor(&mut self, name: &str, dims: &[u64], kind: GgmlType, bytes: u64) -> &mut Self {
        self.tensor_of_id(name, dims, kind.id(), bytes)
    }

    /// `tensor` by ggml id, which may be one this engine does not read (for tests).
    pub(crate) fn tensor_of_id(
        &mut self,
        name: &str,
        dims: &[u64],
        id: u32,
        bytes: u64,
    ) -> &mut Self {
        put_text(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(id.to_le_bytes());
        self.infos.extend(self.data_len.to_le_bytes());
        self.data_len = aligned(self.data_len + bytes);
        self.tensor_count += 1;
        self
    }

    /// The header's bytes, padded to where the data starts.
    pub fn finish(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.tensor_count.to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(&self.metadata);
        out.extend(&self.infos);
        out.resize(aligned(out.len() as u64) as usize, 0);
        out
    }
}

/// What `quantize` writes the matrices as: llama.cpp's `--outtype`/preset of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Q8_0,
    /// Q4_0 matrices, with the output head in Q8_0 (llama.cpp's own Q4_0 preset gives the
    /// head Q6_K, a format this engine reads but does not write).
    Q4_0,
}

impl std::str::FromStr for Preset {
    type Err = String;

    fn from_str(text: &str) -> Result<Preset, String> {
        match text.to_ascii_uppercase().as_str() {
            "Q8_0" => Ok(Preset::Q8_0),
            "Q4_0" => Ok(Preset::Q4_0),
            _ => Err(format!(
                "{text:?} is not a preset this command writes (q8_0, q4_0)"
            )),
        }
    }
}

impl Preset {
    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`).
    fn file_type(self) -> u32 {
        match self {
            Preset::Q8_0 => 7,
            Preset::Q4_0 => 2,
        }
    }

    /// The format of the matrix stored under `name`, or None to keep its stored dtype.
    fn format(self, name: &str, shape: &[usize]) -> Option<BlockFormat> {
        let router =
            name.ends_with("ffn_gate_inp.weight") || name.ends_with("ffn_gate_inp_shexp.weight");
        let quantizable = shape.len() >= 2 && shape.last()? % 32 == 0 && !router;
        quantizable.then_some(match (self, name) {
            (Preset::Q4_0, "output.weight") | (Preset::Q8_0, _) => BlockFormat::Q8_0,
            (Preset::Q4_0, _) => BlockFormat::Q4_0,
        })
    }
}

/// One tensor of the file: its GGUF name and dimensions, its type, and the engine's tensors
/// it is made of (one, or a layer's experts in order).
struct Planned {
    name: String,
    /// The Hugging Face shape of one source tensor.
    shape: Vec<usize>,
    kind: GgmlType,
    sources: Vec<String>,
    rewrite: Rewrite,
}

/// How a Qwen3.5 tensor's values are rewritten for llama.cpp's graph, as its converter
/// rewrites them (what `checkpoint::Convention::LlamaCpp` reads back). Value heads are
/// tiled over the key heads: the tiled head `j · key_heads + g` is the grouped head
/// `g · (value_heads / key_heads) + j`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rewrite {
    /// The values as stored.
    None,
    /// An RMSNorm's weight, stored as `1 + weight`.
    PlusOne,
    /// `A_log` per value head, stored as `A = -exp(A_log)`, tiled.
    NegExp,
    /// The rows from `first` on are value heads of `unit` rows each, tiled.
    TileRows { first: usize, unit: usize },
    /// The columns are value heads of `unit` columns each, tiled.
    TileColumns { unit: usize },
}

impl Rewrite {
    /// The rewrite of Qwen3.5 tensor `name` (the engine's, after `model.layers.L.`).
    fn of_qwen35(name: &str, config: &Config) -> Rewrite {
        let (keys, values) = (
            config.linear_num_key_heads * config.linear_key_head_dim,
            config.linear_value_head_dim,
        );
        match name {
            "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_norm.weight"
            | "self_attn.k_norm.weight"
            | "model.norm.weight" => Rewrite::PlusOne,
            "linear_attn.A" => Rewrite::NegExp,
            "linear_attn.dt_bias"
            | "linear_attn.in_proj_a.weight"
            | "linear_attn.in_proj_b.weight" => Rewrite::TileRows { first: 0, unit: 1 },
            "linear_attn.in_proj_z.weight" => Rewrite::TileRows {
                first: 0,
                unit: values,
            },
            "linear_attn.in_proj_qkv.weight" | "linear_attn.conv1d.weight" => Rewrite::TileRows {
                first: 2 * keys,
                unit: values,
            },
            "linear_attn.out_proj.weight" => Rewrite::TileColumns { unit: values },
            _ => Rewrite::None,
        }
    }

    /// `stored` (`rows x cols`) rewritten, or why its shape is not the one the config
    /// implies (a checkpoint from outside is checked here: nothing else loads it).
    fn apply(self, stored: Vec<f32>, cols: usize, config: &Config) -> Result<Vec<f32>, String> {
        let (key_heads, value_heads) = (config.linear_num_key_heads, config.linear_num_value_heads);
        // The grouped head the tiled head `t` is.
        let grouped = |t: usize| {
            let per_key = value_heads / key_heads.max(1);
            (t % key_heads.max(1)) * per_key + t / key_heads.max(1)
        };
        let tile = |values: &[f32], unit: usize| -> Vec<f32> {
            (0..values.len() / unit.max(1))
                .flat_map(|t| {
                    let h = grouped(t);
                    values[h * unit..(h + 1) * unit].iter().copied()
                })
                .collect()
        };
        let rows = match cols {
            0 => 0,
            _ => stored.len() / cols,
        };
        let fits = cols > 0
            && rows * cols == stored.len()
            && match self {
                Rewrite::None | Rewrite::PlusOne => true,
                Rewrite::NegExp => stored.len() == value_heads,
                Rewrite::TileRows { first, unit } => {
                    rows.checked_sub(first) == Some(value_heads * unit)
                }
                Rewrite::TileColumns { unit } => cols == value_heads * unit,
            };
        if !fits {
            return Err(format!(
                "{} values in rows of {cols} are not the shape the config implies ({self:?})",
                stored.len()
            ));
        }
        Ok(match self {
            Rewrite::None => stored,
            Rewrite::PlusOne => stored.into_iter().map(|w| w + 1.0).collect(),
            Rewrite::NegExp => tile(&stored, 1).into_iter().map(|a| -exp(a)).collect(),
            Rewrite::TileRows { first, unit } => {
                let at = first * cols;
                let mut out = stored[..at].to_vec();
                out.extend(tile(&stored[at..], unit * cols));
                out
            }
            Rewrite::TileColumns { unit } => stored
                .chunks(cols)
                .flat_map(|row| tile(row, unit))
                .collect(),
        })
    }
}

impl Planned {
    /// GGUF dimensions: the shape reversed, then the number of stacked experts. A depthwise
    /// convolution's one input channel is left out, as llama.cpp's converter leaves it.
    fn dims(&self) -> Vec<u64> {
        let mut dims: Vec<u64> = self.shape.iter().rev().map(|d| *d as u64).collect();
        if self.name.ends_with("ssm_conv1d.weight") {
            dims.retain(|d| *d != 1);
        }
        if self.sources.len() > 1 {
            dims.push(self.sources.len() as u64);
        }
        dims
    }

    fn bytes(&self) -> u64 {
        let values: usize = self.shape.iter().product();
        let each = self.kind.dtype().bytes(values).unwrap_or(0) as u64;
        each * self.sources.len() as u64
    }
}

/// What was written.
#[derive(Debug)]
pub struct Written {
    pub tensors: usize,
    pub quantized: usize,
    pub bytes: u64,
}

/// Writes the checkpoint in `dir` to the GGUF file `out` (through `out.partial`, renamed
/// when whole), its matrices in `preset`.
pub fn quantize(dir: &Path, out: &Path, preset: Preset) -> Result<Written, LoadError> {
    let refuse = |why: String| LoadError::Config(format!("model quantize: {why}"));
    if super::is_gguf(dir) {
        return Err(refuse(format!("{} is a GGUF file already", dir.display())));
    }
    let config = Config::load(dir)?;
    let arch = match config.family() {
        Family::Qwen3Moe => "qwen3moe",
        Family::Qwen2Moe => "qwen2moe",
        Family::Qwen35Moe => "qwen35moe",
    };
    let checkpoint = Checkpoint::open(dir)?;
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer: Json = std::fs::read(&tokenizer_path)
        .map_err(|e| LoadError::io(&tokenizer_path, e))
        .and_then(|bytes| {
            serde_json::from_slice(&bytes).map_err(|e| LoadError::Tokenizer(e.to_string()))
        })?;
    let plan = plan(&config, &checkpoint, preset)?;
    let mut header = HeaderWriter::default();
    metadata(&mut header, &config, arch, preset);
    tokenizer_metadata(&mut header, &tokenizer, &config)?;
    for tensor in &plan {
        header.tensor(&tensor.name, &tensor.dims(), tensor.kind, tensor.bytes());
    }
    let partial = out.with_extension("gguf.partial");
    let written = write_file(&partial, &header, &plan, &checkpoint, &config).inspect_err(|_| {
        // What was written of it is of no use; the error says why.
        let _ = std::fs::remove_file(&partial);
    })?;
    std::fs::rename(&partial, out).map_err(|e| LoadError::io(out, e))?;
    Ok(Written {
        tensors: plan.len(),
        quantized: plan
            .iter()
            .filter(|t| t.kind.dtype().block_format().is_some())
            .count(),
        bytes: written,
    })
}

/// Writes the header and the planned tensors' data to `partial`; the bytes written.
fn write_file(
    partial: &Path,
    header: &HeaderWriter,
    plan: &[Planned],
    checkpoint: &Checkpoint,
    config: &Config,
) -> Result<u64, LoadError> {
    let io = |e| LoadError::io(partial, e);
    let mut file = BufWriter::new(File::create(partial).map_err(io)?);
    let head = header.finish();
    file.write_all(&head).map_err(io)?;
    let mut written = head.len() as u64;
    for tensor in plan {
        let mut bytes = 0u64;
        for source in &tensor.sources {
            let (dtype, stored) = checkpoint.stored(source)?;
            match tensor.kind.dtype() {
                _ if tensor.rewrite != Rewrite::None => {
                    // Dense parts only, so the values fit in memory.
                    let weight = checkpoint.tensor(source, &tensor.shape)?;
                    // A vector's values are its rows, as far as tiling goes.
                    let cols = if tensor.shape.len() == 1 {
                        1
                    } else {
                        weight.cols()
                    };
                    let values = tensor
                        .rewrite
                        .apply(weight.to_f32(), cols, config)
                        .map_err(|why| {
                            LoadError::Config(format!("model quantize: {source}: {why}"))
                        })?;
                    for row in values.chunks(weight.cols().max(1)) {
                        let bytes = match tensor.kind.dtype().block_format() {
                            Some(format) => format.quantize(row).expect("a format this writes"),
                            None => row.iter().flat_map(|v| v.to_le_bytes()).collect(),
                        };
                        file.write_all(&bytes).map_err(io)?;
                    }
                }
                kind if kind == dtype => file.write_all(stored).map_err(io)?,
                DType::Quantized(format) => {
                    let weight = checkpoint.tensor(source, &tensor.shape)?;
                    let mut row = vec![0f32; weight.cols()];
                    for r in 0..weight.rows() {
                        weight.row_f32(r, &mut row);
                        let blocks = format.quantize(&row).expect("a format this writes");
                        file.write_all(&blocks).map_err(io)?;
                    }
                }
                _ => {
                    // A vector widened to f32 (exact), as llama.cpp's converter stores them.
                    let weight = checkpoint.tensor(source, &tensor.shape)?;
                    for value in weight.to_f32() {
                        file.write_all(&value.to_le_bytes()).map_err(io)?;
                    }
                }
            }
            bytes += tensor.bytes() / tensor.sources.len() as u64;
        }
        let padding = aligned(bytes) - bytes;
        file.write_all(&vec![0u8; padding as usize]).map_err(io)?;
        written += bytes + padding;
    }
    file.into_inner()
        .map_err(|e| io(e.into_error()))?
        .sync_all()
        .map_err(io)?;
    Ok(written)
}

/// The file's tensors in llama.cpp's order: the model's, then each layer's.
fn plan(
    config: &Config,
    checkpoint: &Checkpoint,
    preset: Preset,
) -> Result<Vec<Planned>, LoadError> {
    let qwen35 = config.family() == Family::Qwen35Moe;
    let mut plan = Vec::new();
    let mut add = |name: String, sources: Vec<String>, rewrite: Rewrite| -> Result<(), LoadError> {
        let (dtype, _) = checkpoint.stored(&sources[0])?;
        let shape = checkpoint.shape(&sources[0])?.to_vec();
        let kind = match preset.format(&name, &shape) {
            Some(format) => GgmlType::of_dtype(DType::Quantized(format)),
            // Rewritten values are f32, as llama.cpp's converter stores them.
            None if shape.len() < 2 || rewrite != Rewrite::None => GgmlType::F32,
            None => GgmlType::of_dtype(dtype),
        };
        for source in &sources[1..] {
            if checkpoint.shape(source)? != shape.as_slice()
                || checkpoint.stored(source)?.0 != dtype
            {
                return Err(LoadError::Config(format!(
                    "model quantize: {source} differs in shape or dtype from {}",
                    sources[0]
                )));
            }
        }
        plan.push(Planned {
            name,
            shape,
            kind,
            sources,
            rewrite,
        });
        Ok(())
    };
    let rewrite = |engine: &str| match qwen35 {
        true => Rewrite::of_qwen35(engine, config),
        false => Rewrite::None,
    };
    for (gguf, engine) in names::MODEL {
        if checkpoint.shape(engine).is_ok() {
            add(gguf.to_string(), vec![engine.to_string()], rewrite(engine))?;
        }
    }
    // Qwen3.5's names first: its post-attention norm is `post_attention_norm`.
    let layer_names: Vec<&(&str, &str)> = match qwen35 {
        true => names::QWEN35_LAYER.iter().chain(names::LAYER).collect(),
        false => names::LAYER.iter().collect(),
    };
    for layer in 0..config.num_hidden_layers {
        let mut planned = Vec::new();
        for (gguf, engine) in &layer_names {
            // The decay rate is made from `A_log`.
            let source = match *engine {
                "linear_attn.A" => "linear_attn.A_log",
                other => other,
            };
            let source = format!("model.layers.{layer}.{source}");
            if checkpoint.shape(&source).is_ok() && !planned.contains(engine) {
                planned.push(*engine);
                add(format!("blk.{layer}.{gguf}"), vec![source], rewrite(engine))?;
            }
        }
        if config.is_moe_layer(layer) {
            for (gguf, part) in names::STACKED {
                let sources = (0..config.num_experts)
                    .map(|e| format!("model.layers.{layer}.mlp.experts.{e}.{part}.weight"))
                    .collect();
                add(format!("blk.{layer}.{gguf}"), sources, Rewrite::None)?;
            }
        }
    }
    Ok(plan)
}

/// The config as llama.cpp's keys for `arch` (what `config::config` reads back).
fn metadata(header: &mut HeaderWriter, config: &Config, arch: &str, preset: Preset) {
    let name = config
        .extra
        .get("_name_or_path")
        .and_then(Json::as_str)
        .unwrap_or(arch);
    header
        .text("general.architecture", arch)
        .text("general.name", name)
        .u32("general.file_type", preset.file_type())
        .u32("general.quantization_version", 2);
    let key = |name: &str| format!("{arch}.{name}");
    let counts = [
        ("block_count", config.num_hidden_layers),
        ("context_length", config.max_position_embeddings),
        ("embedding_length", config.hidden_size),
        ("feed_forward_length", config.intermediate_size),
        ("attention.head_count", config.num_attention_heads),
        ("attention.head_count_kv", config.num_key_value_heads),
        ("attention.key_length", config.head_dim()),
        ("attention.value_length", config.head_dim()),
        ("expert_count", config.num_experts),
        ("expert_used_count", config.num_experts_per_tok),
        ("expert_feed_forward_length", config.moe_intermediate_size),
    ];
    for (name, value) in counts {
        // Qwen3.5 has no dense layers, and its converter writes no width for them.
        if name != "feed_forward_length" || config.family() != Family::Qwen35Moe {
            header.u32(&key(name), value as u32);
        }
    }
    if config.shared_expert_intermediate_size > 0 {
        header.u32(
            &key("expert_shared_feed_forward_length"),
            config.shared_expert_intermediate_size as u32,
        );
    }
    header
        .f32(
            &key("attention.layer_norm_rms_epsilon"),
            config.rms_norm_eps as f32,
        )
        .f32(&key("rope.freq_base"), config.rope_theta() as f32)
        .bool(&key("expert_weights_norm"), config.renormalizes_top_k());
    if config.family() == Family::Qwen35Moe {
        qwen35_metadata(header, config, key);
    }
}

/// Qwen3.5's keys beside the others: the gated DeltaNet's shapes, each layer's mixer, the
/// rotary share, and the sections of llama.cpp's multimodal RoPE (which text positions, equal
/// on every axis, do not depend on: a third of the rotary pairs each, as transformers'
/// default `[11, 11, 10]` of 32).
fn qwen35_metadata(header: &mut HeaderWriter, config: &Config, key: impl Fn(&str) -> String) {
    let counts = [
        ("ssm.conv_kernel", config.linear_conv_kernel_dim),
        ("ssm.state_size", config.linear_key_head_dim),
        ("ssm.group_count", config.linear_num_key_heads),
        ("ssm.time_step_rank", config.linear_num_value_heads),
        (
            "ssm.inner_size",
            config.linear_num_value_heads * config.linear_value_head_dim,
        ),
        (
            "full_attention_interval",
            config.full_attention_interval.unwrap_or(4),
        ),
        ("rope.dimension_count", config.rotary_dim()),
    ];
    for (name, value) in counts {
        header.u32(&key(name), value as u32);
    }
    let recurrent: Vec<bool> = (0..config.num_hidden_layers)
        .map(|l| config.mixer(l) == Mixer::LinearAttention)
        .collect();
    header.bools(&key("attention.recurrent_layers"), &recurrent);
    let pairs = (config.rotary_dim() / 2) as i32;
    let first = (pairs + 2) / 3;
    let second = (pairs - first + 1) / 2;
    header.i32s(
        &key("rope.dimension_sections"),
        &[first, second, pairs - first - second, 0],
    );
}

/// `tokenizer.json` (a byte-level BPE, as Qwen's are) as llama.cpp's `tokenizer.ggml.*`
/// keys: the tokens by id (padded to the config's vocabulary, as llama.cpp's converter
/// pads them), their types, the merges and the special ids.
fn tokenizer_metadata(
    header: &mut HeaderWriter,
    tokenizer: &Json,
    config: &Config,
) -> Result<(), LoadError> {
    let bad = |what: &str| LoadError::Tokenizer(format!("tokenizer.json: {what}"));
    let model = &tokenizer["model"];
    if model["type"] != "BPE" {
        return Err(bad("only a BPE tokenizer is written to GGUF"));
    }
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| bad("no model.vocab"))?;
    let added = tokenizer["added_tokens"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut tokens: Vec<(String, i32)> = Vec::new();
    // Ids past the embedding's rows would give llama.cpp a vocabulary the model lacks.
    let mut place = |id: Option<u64>, text: &str, kind: i32| -> Result<(), LoadError> {
        let id = id
            .filter(|id| *id < config.vocab_size as u64)
            .ok_or_else(|| bad("a token id that is not a row of the embedding"))?
            as usize;
        if tokens.len() <= id {
            tokens.resize(id + 1, (String::new(), 0));
        }
        tokens[id] = (text.to_string(), kind);
        Ok(())
    };
    for (text, id) in vocab {
        place(id.as_u64(), text, 1)?;
    }
    for token in &added {
        let text = token["content"]
            .as_str()
            .ok_or_else(|| bad("an added token without content"))?;
        let kind = if token["special"].as_bool().unwrap_or(false) {
            3
        } else {
            4
        };
        place(token["id"].as_u64(), text, kind)?;
    }
    if tokens.len() < config.vocab_size {
        tokens.resize(config.vocab_size, (String::new(), 0));
    }
    // Ids no token has: llama.cpp's converter names them `[PAD<id>]`, unused.
    for (id, (text, kind)) in tokens.iter_mut().enumerate() {
        if *kind == 0 {
            (*text, *kind) = (format!("[PAD{id}]"), 5);
        }
    }
    let merges: Vec<String> = model["merges"]
        .as_array()
        .ok_or_else(|| bad("no model.merges"))?
        .iter()
        .map(|merge| match merge {
            Json::String(pair) => Some(pair.clone()),
            // GGUF keeps a merge as "a b": a side with a space in it would read as another.
            Json::Array(pair) => match (pair.first()?.as_str()?, pair.get(1)?.as_str()?) {
                (a, b) if pair.len() == 2 && !a.contains(' ') && !b.contains(' ') => {
                    Some(format!("{a} {b}"))
                }
                _ => None,
            },
            _ => None,
        })
        .collect::<Option<_>>()
        .ok_or_else(|| bad("a merge that is neither \"a b\" nor [\"a\", \"b\"]"))?;
    let pre = crate::tokenizer::pre_tokenizer_name(&tokenizer["pre_tokenizer"])
        .ok_or_else(|| bad("a pre-tokenizer other than GPT-2's, Qwen2's or Qwen3.5's"))?;
    let kinds: Vec<i32> = tokens.iter().map(|(_, kind)| *kind).collect();
    header
        .text("tokenizer.ggml.model", "gpt2")
        .text("tokenizer.ggml.pre", pre)
        .texts(
            "tokenizer.ggml.tokens",
            tokens.iter().map(|(text, _)| text.as_str()),
        )
        .i32s("tokenizer.ggml.token_type", &kinds)
        .texts("tokenizer.ggml.merges", merges.iter().map(String::as_str))
        .bool("tokenizer.ggml.add_bos_token", false);
    if let Some(bos) = config.bos_token_id {
        header.u32("tokenizer.ggml.bos_token_id", bos);
    }
    if let Some(eos) = config.end_tokens().first() {
        header.u32("tokenizer.ggml.eos_token_id", *eos);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;
    use crate::synth::{preset, synthesize};

    fn tiny() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        synthesize(dir.path(), preset("tiny").unwrap(), |_, _| {}).unwrap();
        dir
    }

    /// The file reads back as the checkpoint it was written from: the same config, the
    /// tokenizer's tokens and merges, each matrix as llama.cpp's quantizer stores its rows,
    /// the rest as stored; and the same checkpoint gives the same bytes.
    #[test]
    fn a_checkpoint_written_as_gguf_reads_back_as_itself_quantized() {
        let dir = tiny();
        let out = dir.path().join("tiny.gguf");
        let written = quantize(dir.path(), &out, Preset::Q4_0).unwrap();
        assert_eq!(written.bytes, std::fs::metadata(&out).unwrap().len());
        let source = Config::load(dir.path()).unwrap();
        let read = Config::load(&out).unwrap();
        assert_eq!(
            (
                read.hidden_size,
                read.num_hidden_layers,
                read.num_experts,
                read.vocab_size
            ),
            (
                source.hidden_size,
                source.num_hidden_layers,
                source.num_experts,
                source.vocab_size
            )
        );
        assert_eq!(
            read.moe_layers().collect::<Vec<_>>(),
            source.moe_layers().collect::<Vec<_>>()
        );
        assert_eq!(
            (read.head_dim(), read.rope_theta()),
            (source.head_dim(), source.rope_theta())
        );
        let file = Gguf::open(&out).unwrap();
        let tokenizer: Json =
            serde_json::from_slice(&std::fs::read(dir.path().join("tokenizer.json")).unwrap())
                .unwrap();
        match file.header().get("tokenizer.ggml.merges") {
            Some(super::super::Value::Array(merges)) => {
                assert_eq!(
                    merges.len(),
                    tokenizer["model"]["merges"].as_array().unwrap().len()
                )
            }
            other => panic!("merges: {other:?}"),
        }
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        let quantized = Checkpoint::open(&out).unwrap();
        let expert = "model.layers.0.mlp.experts.5.down_proj.weight";
        let shape = checkpoint.shape(expert).unwrap().to_vec();
        let weight = checkpoint.tensor(expert, &shape).unwrap();
        let (dtype, bytes) = quantized.stored(expert).unwrap();
        assert_eq!(dtype, DType::Quantized(BlockFormat::Q4_0));
        let mut row = vec![0f32; weight.cols()];
        weight.row_f32(1, &mut row);
        let each = DType::Quantized(BlockFormat::Q4_0)
            .bytes(weight.cols())
            .unwrap();
        assert_eq!(
            &bytes[each..2 * each],
            BlockFormat::Q4_0.quantize(&row).unwrap()
        );
        // The output head in Q8_0; a norm as it was, widened to f32.
        assert_eq!(
            quantized.stored("lm_head.weight").unwrap().0,
            DType::Quantized(BlockFormat::Q8_0)
        );
        let norm = "model.layers.1.input_layernorm.weight";
        let shape = checkpoint.shape(norm).unwrap().to_vec();
        assert_eq!(
            quantized.tensor(norm, &shape).unwrap().to_f32(),
            checkpoint.tensor(norm, &shape).unwrap().to_f32()
        );
        let again = dir.path().join("again.gguf");
        quantize(dir.path(), &again, Preset::Q4_0).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&again).unwrap());
    }

    /// The tokenizer written to the metadata is the checkpoint's: the same ids for any text,
    /// added tokens included, and the same text back; for GPT-2's pre-tokenizer (the
    /// synthesized checkpoints') and for Qwen2's and Qwen3.5's (a regex split, then bytes).
    #[test]
    fn the_files_own_tokenizer_is_the_checkpoints() {
        use crate::tokenizer::Tokenizer;
        let qwen2 = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]});
        // Qwen3.5's keeps combining marks with the letters before them.
        let mut qwen35 = qwen2.clone();
        qwen35["pretokenizers"][0]["pattern"]["Regex"] = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+".into();
        for (pre_tokenizer, pre) in [
            (None, "gpt-2"),
            (Some(qwen2), "qwen2"),
            (Some(qwen35), "qwen35"),
        ] {
            let dir = tiny();
            let path = dir.path().join("tokenizer.json");
            if let Some(pre_tokenizer) = pre_tokenizer {
                let mut tokenizer: Json =
                    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
                tokenizer["pre_tokenizer"] = pre_tokenizer;
                tokenizer["normalizer"] = serde_json::json!({"type": "NFC"});
                std::fs::write(&path, tokenizer.to_string()).unwrap();
            }
            let out = dir.path().join("model.gguf");
            quantize(dir.path(), &out, Preset::Q8_0).unwrap();
            let file = Gguf::open(&out).unwrap();
            assert_eq!(
                file.header()
                    .get("tokenizer.ggml.pre")
                    .and_then(super::super::Value::as_text),
                Some(pre)
            );
            let source = Tokenizer::load(dir.path()).unwrap();
            // Nothing beside the file: the tokenizer comes from its metadata.
            std::fs::remove_file(&path).unwrap();
            let own = Tokenizer::load(&out).unwrap();
            for text in [
                "Hello, world!  It's 2026.\n\n  indented\ttab 12345",
                "<|endoftext|>after the end",
                "ünïcödé — 東京 🙂",
                // Marks no letter composes with, which Qwen3.5's split keeps in the word.
                "ka\u{320}t\u{331}a x\u{359}y",
            ] {
                let ids = source.encode(text).unwrap();
                assert_eq!(own.encode(text).unwrap(), ids, "{text:?}");
                assert_eq!(own.decode(&ids).unwrap(), source.decode(&ids).unwrap());
            }
        }
    }

    /// A tokenizer this cannot write, or a broken one, is a typed error and leaves no file.
    #[test]
    fn a_tokenizer_it_cannot_write_is_refused() {
        let dir = tiny();
        let out = dir.path().join("tiny.gguf");
        for (tokenizer, says) in [
            (
                r#"{"model": {"type": "Unigram", "vocab": []}}"#,
                "only a BPE",
            ),
            (
                r#"{"model": {"type": "BPE", "vocab": {"a": -1}, "merges": []}}"#,
                "token id",
            ),
            (
                r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [7]}}"#,
                "a merge",
            ),
            (
                r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a b", "c"]]}}"#,
                "a merge",
            ),
            (
                r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                   "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "x"}}}"#,
                "pre-tokenizer",
            ),
            ("not json", "tokenizer"),
        ] {
            std::fs::write(dir.path().join("tokenizer.json"), tokenizer).unwrap();
            let error = quantize(dir.path(), &out, Preset::Q8_0)
                .unwrap_err()
                .to_string();
            assert!(error.contains(says), "{error}");
            assert!(!out.exists());
        }
    }

    /// Qwen3.5 is written as llama.cpp's converter writes it (its `tiny-qwen35moe-f32.gguf` of
    /// the same synthesized checkpoint): the same tensors under the same names and dimensions,
    /// the same config read back, and the same values: the rewritten vectors (norms plus one,
    /// `-exp(A_log)`, tiled value heads) to within `exp`'s last place, each quantized matrix
    /// to within Q8_0's rounding of them.
    #[test]
    fn qwen35_is_written_as_llama_cpps_converter_writes_it() {
        let dir = tempfile::tempdir().unwrap();
        synthesize(dir.path(), preset("qwen35-tiny").unwrap(), |_, _| {}).unwrap();
        let out = dir.path().join("qwen35.gguf");
        quantize(dir.path(), &out, Preset::Q8_0).unwrap();
        let theirs = crate::gguf::tests::fixture().with_file_name("tiny-qwen35moe-f32.gguf");
        let layout = |path: &Path| {
            let file = Gguf::open(path).unwrap();
            let tensors: std::collections::BTreeMap<String, Vec<u64>> = file
                .header()
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.dims.clone()))
                .collect();
            (
                tensors,
                super::super::config::config(file.header()).unwrap(),
            )
        };
        assert_eq!(layout(&out), layout(&theirs));
        let (ours, theirs) = (
            Checkpoint::open(&out).unwrap(),
            Checkpoint::open(&theirs).unwrap(),
        );
        let mut names: Vec<&str> = ours.tensor_sizes().map(|(name, _)| name).collect();
        names.sort();
        for name in names {
            let shape = ours.shape(name).unwrap().to_vec();
            let a = ours.tensor(name, &shape).unwrap();
            let b = theirs.tensor(name, &shape).unwrap().to_f32();
            let largest = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let tolerance = match a.dtype() {
                DType::F32 => largest * 1e-6,
                _ => largest / 127.0,
            };
            for (i, (x, y)) in a.to_f32().iter().zip(&b).enumerate() {
                assert!(
                    (x - y).abs() <= tolerance,
                    "{name}[{i}]: {x} vs llama.cpp's {y}"
                );
            }
        }
    }

    /// A Qwen3.5 checkpoint whose DeltaNet tensors are not the shape its config implies (here
    /// a config naming two value heads where the tensors hold four) is refused by name, and
    /// leaves no file: nothing else checks those shapes before they are rewritten.
    #[test]
    fn a_qwen35_checkpoint_unlike_its_config_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        synthesize(dir.path(), preset("qwen35-tiny").unwrap(), |_, _| {}).unwrap();
        let path = dir.path().join("config.json");
        let mut config: Json = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        config["linear_num_value_heads"] = 2.into();
        std::fs::write(&path, config.to_string()).unwrap();
        let out = dir.path().join("qwen35.gguf");
        let error = quantize(dir.path(), &out, Preset::Q8_0)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("linear_attn") && error.contains("shape"),
            "{error}"
        );
        assert!(!out.exists() && !out.with_extension("gguf.partial").exists());
    }
}
