//! Synthetic checkpoints in the real Hugging Face format: `config.json`,
//! `model.safetensors` and a byte-level BPE `tokenizer.json` trained with the `tokenizers`
//! crate. Deterministic: the same preset gives the same bytes on every machine.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use crate::config::{Config, Family, Mixer};
use crate::LoadError;

/// The text the synthetic tokenizers are trained on.
pub const CORPUS: &str = include_str!("synth_corpus.txt");

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown preset {0:?}; presets: {1}")]
    UnknownPreset(String, String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("safetensors: {0}")]
    Format(String),
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// A preset: the config, the stored dtype, and a seed for the weights.
pub struct Preset {
    pub name: &'static str,
    pub about: &'static str,
    pub bf16: bool,
    /// Stored as Qwen3.5 is published: a `Qwen3_5MoeForConditionalGeneration` (text model
    /// under `model.language_model.`, a small vision tower, an `mtp.` tensor), experts fused,
    /// in shards of at most `SHARD_BYTES` with an index.
    pub multimodal: bool,
    config: fn() -> serde_json::Value,
}

/// Shard size of multimodal presets: small, so a tiny checkpoint still spans several files.
const SHARD_BYTES: usize = 256 << 10;

pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny",
        about: "f32, 3 layers (one dense), 8 experts: tests, seconds",
        bf16: false,
        multimodal: false,
        config: tiny,
    },
    Preset {
        name: "tiny-qwen2",
        about: "f32 Qwen2-MoE: shared expert, q/k/v biases, tied embeddings",
        bf16: false,
        multimodal: false,
        config: tiny_qwen2,
    },
    Preset {
        name: "small",
        about: "bf16, 6 layers, 32 experts top-4: the demo, fast on 2 cores",
        bf16: true,
        multimodal: false,
        config: small,
    },
    Preset {
        name: "bench",
        about: "bf16, 8 layers, 64 experts top-8: ~350 MB of weights read per token, 2.5 GB in all",
        bf16: true,
        multimodal: false,
        config: bench,
    },
    Preset {
        name: "qwen35-tiny",
        about: "f32 Qwen3.5-MoE text model: 3 DeltaNet layers, 1 gated attention, shared expert",
        bf16: false,
        multimodal: false,
        config: qwen35_tiny,
    },
    Preset {
        name: "qwen35-tiny-vl",
        about: "bf16 Qwen3.5-MoE as published: multimodal wrapper, fused experts, sharded",
        bf16: true,
        multimodal: true,
        config: qwen35_tiny,
    },
    Preset {
        name: "qwen35-small",
        about: "bf16 Qwen3.5-MoE, 8 layers (6 DeltaNet), 32 experts top-4: the swarm demo",
        bf16: true,
        multimodal: false,
        config: qwen35_small,
    },
    Preset {
        name: "qwen35-bench",
        about: "bf16 Qwen3.5-MoE, 8 layers, 64 experts top-8: ~400 MB of experts read per token",
        bf16: true,
        multimodal: false,
        config: qwen35_bench,
    },
];

fn tiny() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 384, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": false, "attention_bias": false, "bos_token_id": null, "eos_token_id": 0,
        "torch_dtype": "float32"
    })
}

fn tiny_qwen2() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "vocab_size": 384, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": false, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": true, "eos_token_id": 0, "torch_dtype": "float32"
    })
}

fn small() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
        "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "attention_bias": false, "eos_token_id": 0, "torch_dtype": "bfloat16"
    })
}

/// Active weights per token (~350 MB) are over ten times a 32 MiB last-level cache, so
/// decode speed measures memory bandwidth, not cache.
fn bench() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 768,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
        "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": false, "attention_bias": false, "eos_token_id": null, "torch_dtype": "bfloat16"
    })
}

/// A Qwen3.5-MoE text config; `layers` of which every fourth is full attention.
fn qwen35(extra: serde_json::Value) -> serde_json::Value {
    let mut config = serde_json::json!({
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "attention_bias": false, "eos_token_id": 0, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1], "mrope_interleaved": true},
    });
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    config
}

fn qwen35_tiny() -> serde_json::Value {
    qwen35(serde_json::json!({
        "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "max_position_embeddings": 512, "torch_dtype": "float32"
    }))
}

fn qwen35_small() -> serde_json::Value {
    qwen35(serde_json::json!({
        "vocab_size": 2048, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "num_experts": 32, "num_experts_per_tok": 4,
        "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"
    }))
}

/// Experts read per token: 8 layers x 8 of 6 MiB, over ten times a 32 MiB last-level cache.
fn qwen35_bench() -> serde_json::Value {
    qwen35(serde_json::json!({
        "vocab_size": 4096, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "num_experts": 64, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"
    }))
}

/// `text` wrapped as a `Qwen3_5MoeForConditionalGeneration` config with a small vision tower.
fn multimodal_config(text: &serde_json::Value) -> serde_json::Value {
    let mut text = text.clone();
    if let Some(t) = text.as_object_mut() {
        t.remove("architectures");
        t.remove("torch_dtype");
    }
    let vocab = text["vocab_size"].as_u64().unwrap_or(4);
    let vision = serde_json::json!({
        "model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN, "num_heads": 2, "in_channels": 3,
        "patch_size": VISION_PATCH, "temporal_patch_size": 2, "spatial_merge_size": 2,
        "num_position_embeddings": VISION_POSITIONS, "out_hidden_size": text["hidden_size"],
        "hidden_act": "gelu_pytorch_tanh"
    });
    serde_json::json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": text, "vision_config": vision, "tie_word_embeddings": false,
        "image_token_id": vocab - 4, "video_token_id": vocab - 3,
        "vision_start_token_id": vocab - 2, "vision_end_token_id": vocab - 1,
        "torch_dtype": "bfloat16"
    })
}

/// The synthetic vision tower: one block of this width, patches of this side, this many
/// position embeddings. The engine never runs it; it is there to be skipped.
const VISION_HIDDEN: usize = 32;
const VISION_PATCH: usize = 4;
const VISION_POSITIONS: usize = 64;

/// The vision tower's and the multi-token-prediction head's tensors, as stored.
fn skipped_specs(out_hidden: usize) -> Vec<(String, Vec<usize>)> {
    let (h, merged) = (VISION_HIDDEN, 4 * VISION_HIDDEN);
    let v = |name: &str, shape: Vec<usize>| (format!("model.visual.{name}"), shape);
    vec![
        v(
            "patch_embed.proj.weight",
            vec![h, 3, 2, VISION_PATCH, VISION_PATCH],
        ),
        v("patch_embed.proj.bias", vec![h]),
        v("pos_embed.weight", vec![VISION_POSITIONS, h]),
        v("blocks.0.attn.qkv.weight", vec![3 * h, h]),
        v("blocks.0.attn.qkv.bias", vec![3 * h]),
        v("blocks.0.attn.proj.weight", vec![h, h]),
        v("blocks.0.attn.proj.bias", vec![h]),
        v("blocks.0.mlp.linear_fc1.weight", vec![2 * h, h]),
        v("blocks.0.mlp.linear_fc1.bias", vec![2 * h]),
        v("blocks.0.mlp.linear_fc2.weight", vec![h, 2 * h]),
        v("blocks.0.mlp.linear_fc2.bias", vec![h]),
        v("blocks.0.norm1.weight", vec![h]),
        v("blocks.0.norm1.bias", vec![h]),
        v("blocks.0.norm2.weight", vec![h]),
        v("blocks.0.norm2.bias", vec![h]),
        v("merger.norm.weight", vec![h]),
        v("merger.norm.bias", vec![h]),
        v("merger.linear_fc1.weight", vec![merged, merged]),
        v("merger.linear_fc1.bias", vec![merged]),
        v("merger.linear_fc2.weight", vec![out_hidden, merged]),
        v("merger.linear_fc2.bias", vec![out_hidden]),
        ("mtp.fc.weight".into(), vec![out_hidden, 2 * out_hidden]),
    ]
}

pub fn preset(name: &str) -> Result<&'static Preset, SynthError> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        SynthError::UnknownPreset(name.to_string(), names.join(", "))
    })
}

/// SplitMix64 over a tensor's name, so each tensor's values are fixed by preset and name.
struct Values(u64);

impl Values {
    fn for_tensor(name: &str) -> Values {
        Values(name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        }))
    }

    /// Uniform in [-1, 1).
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Every tensor of the architecture with its shape and how its values are drawn:
/// norms near 1, biases small, matrices uniform with a 1/sqrt(fan_in) scale.
fn tensor_specs(c: &Config) -> Vec<(String, Vec<usize>)> {
    let (h, hd, heads, kv) = (
        c.hidden_size,
        c.head_dim(),
        c.num_attention_heads,
        c.num_key_value_heads,
    );
    let mut specs = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![c.vocab_size, h],
        ),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    if !c.tie_word_embeddings {
        specs.push(("lm_head.weight".into(), vec![c.vocab_size, h]));
    }
    let swiglu = |specs: &mut Vec<(String, Vec<usize>)>, prefix: &str, width: usize| {
        specs.push((format!("{prefix}.gate_proj.weight"), vec![width, h]));
        specs.push((format!("{prefix}.up_proj.weight"), vec![width, h]));
        specs.push((format!("{prefix}.down_proj.weight"), vec![h, width]));
    };
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        specs.push((format!("{p}.input_layernorm.weight"), vec![h]));
        specs.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        if c.mixer(i) == Mixer::LinearAttention {
            let l = format!("{p}.linear_attn");
            let (kd, vd) = (
                c.linear_num_key_heads * c.linear_key_head_dim,
                c.linear_num_value_heads * c.linear_value_head_dim,
            );
            let heads = c.linear_num_value_heads;
            specs.push((format!("{l}.in_proj_qkv.weight"), vec![2 * kd + vd, h]));
            specs.push((format!("{l}.in_proj_z.weight"), vec![vd, h]));
            specs.push((format!("{l}.in_proj_b.weight"), vec![heads, h]));
            specs.push((format!("{l}.in_proj_a.weight"), vec![heads, h]));
            specs.push((
                format!("{l}.conv1d.weight"),
                vec![2 * kd + vd, 1, c.linear_conv_kernel_dim],
            ));
            specs.push((format!("{l}.A_log"), vec![heads]));
            specs.push((format!("{l}.dt_bias"), vec![heads]));
            specs.push((format!("{l}.norm.weight"), vec![c.linear_value_head_dim]));
            specs.push((format!("{l}.out_proj.weight"), vec![h, vd]));
        } else {
            let a = format!("{p}.self_attn");
            // Qwen3.5's q_proj yields each head's query and its output gate.
            let q_rows = if c.family() == Family::Qwen35Moe {
                2
            } else {
                1
            } * heads
                * hd;
            specs.push((format!("{a}.q_proj.weight"), vec![q_rows, h]));
            specs.push((format!("{a}.k_proj.weight"), vec![kv * hd, h]));
            specs.push((format!("{a}.v_proj.weight"), vec![kv * hd, h]));
            specs.push((format!("{a}.o_proj.weight"), vec![h, heads * hd]));
            if c.qkv_bias() {
                specs.push((format!("{a}.q_proj.bias"), vec![q_rows]));
                specs.push((format!("{a}.k_proj.bias"), vec![kv * hd]));
                specs.push((format!("{a}.v_proj.bias"), vec![kv * hd]));
            }
            if !c.is_qwen2() {
                specs.push((format!("{a}.q_norm.weight"), vec![hd]));
                specs.push((format!("{a}.k_norm.weight"), vec![hd]));
            }
        }
        if c.is_moe_layer(i) {
            specs.push((format!("{p}.mlp.gate.weight"), vec![c.num_experts, h]));
            for e in 0..c.num_experts {
                swiglu(
                    &mut specs,
                    &format!("{p}.mlp.experts.{e}"),
                    c.moe_intermediate_size,
                );
            }
            if c.shared_expert_intermediate_size > 0 {
                swiglu(
                    &mut specs,
                    &format!("{p}.mlp.shared_expert"),
                    c.shared_expert_intermediate_size,
                );
                specs.push((format!("{p}.mlp.shared_expert_gate.weight"), vec![1, h]));
            }
        } else {
            swiglu(&mut specs, &format!("{p}.mlp"), c.intermediate_size);
        }
    }
    specs
}

/// A tensor's values, drawn from its (engine) name. Norms scale near 1: a weight near 1,
/// or near 0 where the family scales by `1 + weight` (but for DeltaNet's gated norm).
fn values(name: &str, shape: &[usize], zero_centered_norms: bool) -> Vec<f32> {
    let mut rng = Values::for_tensor(name);
    let count: usize = shape.iter().product();
    let norm_base = if zero_centered_norms && !name.ends_with("linear_attn.norm.weight") {
        0.0
    } else {
        1.0
    };
    let (base, scale) = if name.ends_with("norm.weight") {
        (norm_base, 0.1)
    } else if name.ends_with("A_log") || name.ends_with("dt_bias") {
        (0.0, 0.5)
    } else if name.ends_with(".bias") {
        (0.0, 0.1)
    } else if name.contains("embed_tokens") {
        (0.0, 1.0)
    } else {
        (0.0, 1.0 / (shape[shape.len() - 1] as f32).sqrt())
    };
    (0..count).map(|_| base + scale * rng.next()).collect()
}

/// Trains the byte-level BPE tokenizer of `vocab_size` on the built-in corpus.
fn train_tokenizer(vocab_size: usize) -> Result<String, SynthError> {
    let err = |e: tokenizers::Error| SynthError::Tokenizer(e.to_string());
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);
    tokenizer
        .train(&mut trainer, CORPUS.lines().map(str::to_string))
        .map_err(err)?;
    tokenizer.to_string(true).map_err(err)
}

/// Tensors by stored name: shape and little-endian bytes.
type Tensors = BTreeMap<String, (Vec<usize>, Vec<u8>)>;

/// Writes the preset's checkpoint into `out`. `progress(done, total)` is called per tensor.
pub fn synthesize(
    out: &Path,
    preset: &Preset,
    mut progress: impl FnMut(usize, usize),
) -> Result<(), SynthError> {
    write_checkpoint(out, preset, &mut progress)
}

/// `synthesize`'s body, not generic, so it is compiled (and optimized) in this crate rather
/// than in each caller's: the node's debug build once spent 17 s here per dev run.
fn write_checkpoint(
    out: &Path,
    preset: &Preset,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), SynthError> {
    let io = |path: &Path, e| SynthError::Io(path.display().to_string(), e);
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let text_json = (preset.config)();
    let config = Config::parse(&text_json.to_string())?;
    let tokenizer = train_tokenizer(config.vocab_size)?;
    let zero_centered = config.family() == Family::Qwen35Moe;
    let encode = |data: Vec<f32>| -> Vec<u8> {
        let mut bytes = Vec::with_capacity(data.len() * if preset.bf16 { 2 } else { 4 });
        for v in data {
            if preset.bf16 {
                bytes.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
            } else {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        bytes
    };
    let specs = tensor_specs(&config);
    let mut tensors = Tensors::new();
    for (i, (name, shape)) in specs.iter().enumerate() {
        let data = encode(values(name, shape, zero_centered));
        tensors.insert(name.clone(), (shape.clone(), data));
        progress(i + 1, specs.len());
    }
    let config_json = if preset.multimodal {
        tensors = published_form(tensors, &config);
        for (name, shape) in skipped_specs(config.hidden_size) {
            let data = encode(values(&name, &shape, false));
            tensors.insert(name, (shape, data));
        }
        multimodal_config(&text_json)
    } else {
        text_json
    };
    let dtype = if preset.bf16 { Dtype::BF16 } else { Dtype::F32 };
    write_weights(
        out,
        &tensors,
        dtype,
        preset.multimodal.then_some(SHARD_BYTES),
    )?;
    let mut config_text = serde_json::to_string_pretty(&config_json).unwrap_or_default();
    config_text.push('\n');
    let config_path = out.join("config.json");
    std::fs::write(&config_path, config_text).map_err(|e| io(&config_path, e))?;
    let tokenizer_path = out.join("tokenizer.json");
    std::fs::write(&tokenizer_path, tokenizer).map_err(|e| io(&tokenizer_path, e))?;
    Ok(())
}

/// The text model's tensors as a published Qwen3.5 checkpoint stores them: each layer's
/// experts fused into `gate_up_proj` (every expert's gate rows, then its up rows) and
/// `down_proj`, and everything under `model.` moved to `model.language_model.`.
fn published_form(mut tensors: Tensors, c: &Config) -> Tensors {
    for layer in c.moe_layers() {
        let p = format!("model.layers.{layer}.mlp.experts");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for expert in 0..c.num_experts {
            let mut take = |part: &str| {
                tensors
                    .remove(&format!("{p}.{expert}.{part}.weight"))
                    .map(|(_, bytes)| bytes)
                    .unwrap_or_default()
            };
            gate_up.extend(take("gate_proj"));
            gate_up.extend(take("up_proj"));
            down.extend(take("down_proj"));
        }
        let (e, h, width) = (c.num_experts, c.hidden_size, c.moe_intermediate_size);
        tensors.insert(
            format!("{p}.gate_up_proj"),
            (vec![e, 2 * width, h], gate_up),
        );
        tensors.insert(format!("{p}.down_proj"), (vec![e, h, width], down));
    }
    tensors
        .into_iter()
        .map(|(name, tensor)| match name.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), tensor),
            None => (name, tensor),
        })
        .collect()
}

/// `model.safetensors`, or with `shard_bytes` as many shards as that size needs (in name
/// order) and the index that lists them, named as `save_pretrained` names them.
fn write_weights(
    out: &Path,
    tensors: &Tensors,
    dtype: Dtype,
    shard_bytes: Option<usize>,
) -> Result<(), SynthError> {
    let format = |e: safetensors::SafeTensorError| SynthError::Format(e.to_string());
    let mut shards: Vec<Vec<&String>> = vec![Vec::new()];
    let mut filled = 0;
    for (name, (_, bytes)) in tensors {
        if shard_bytes.is_some_and(|limit| filled + bytes.len() > limit && filled > 0) {
            shards.push(Vec::new());
            filled = 0;
        }
        filled += bytes.len();
        if let Some(shard) = shards.last_mut() {
            shard.push(name);
        }
    }
    let count = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, names) in shards.iter().enumerate() {
        let file = match shard_bytes {
            Some(_) => format!("model-{:05}-of-{count:05}.safetensors", i + 1),
            None => "model.safetensors".to_string(),
        };
        let views = names
            .iter()
            .map(|name| {
                let (shape, bytes) = &tensors[*name];
                weight_map.insert(name.to_string(), file.clone());
                TensorView::new(dtype, shape.clone(), bytes).map(|view| (name.to_string(), view))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(format)?;
        safetensors::serialize_to_file(views, &None, &out.join(&file)).map_err(format)?;
    }
    if shard_bytes.is_some() {
        let total: usize = tensors.values().map(|(_, bytes)| bytes.len()).sum();
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = out.join("model.safetensors.index.json");
        std::fs::write(&path, format!("{index:#}\n"))
            .map_err(|e| SynthError::Io(path.display().to_string(), e))?;
    }
    Ok(())
}
