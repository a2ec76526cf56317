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

use crate::config::Config;
use crate::LoadError;

/// The text the synthetic tokenizers are trained on.
const CORPUS: &str = include_str!("synth_corpus.txt");

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
    config: fn() -> serde_json::Value,
}

pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny",
        about: "f32, 3 layers (one dense), 8 experts: tests, seconds",
        bf16: false,
        config: tiny,
    },
    Preset {
        name: "tiny-qwen2",
        about: "f32 Qwen2-MoE: shared expert, q/k/v biases, tied embeddings",
        bf16: false,
        config: tiny_qwen2,
    },
    Preset {
        name: "small",
        about: "bf16, 6 layers, 32 experts top-4: the demo, fast on 2 cores",
        bf16: true,
        config: small,
    },
    Preset {
        name: "bench",
        about: "bf16, 8 layers, 64 experts top-8: ~350 MB of weights read per token, 2.5 GB in all",
        bf16: true,
        config: bench,
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
        let a = format!("{p}.self_attn");
        specs.push((format!("{a}.q_proj.weight"), vec![heads * hd, h]));
        specs.push((format!("{a}.k_proj.weight"), vec![kv * hd, h]));
        specs.push((format!("{a}.v_proj.weight"), vec![kv * hd, h]));
        specs.push((format!("{a}.o_proj.weight"), vec![h, heads * hd]));
        if c.qkv_bias() {
            specs.push((format!("{a}.q_proj.bias"), vec![heads * hd]));
            specs.push((format!("{a}.k_proj.bias"), vec![kv * hd]));
            specs.push((format!("{a}.v_proj.bias"), vec![kv * hd]));
        }
        if !c.is_qwen2() {
            specs.push((format!("{a}.q_norm.weight"), vec![hd]));
            specs.push((format!("{a}.k_norm.weight"), vec![hd]));
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

fn values(name: &str, shape: &[usize]) -> Vec<f32> {
    let mut rng = Values::for_tensor(name);
    let count: usize = shape.iter().product();
    let (base, scale) = if name.ends_with("norm.weight") {
        (1.0, 0.1)
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

/// Writes the preset's checkpoint into `out`. `progress(done, total)` is called per tensor.
pub fn synthesize(
    out: &Path,
    preset: &Preset,
    mut progress: impl FnMut(usize, usize),
) -> Result<(), SynthError> {
    let io = |path: &Path, e| SynthError::Io(path.display().to_string(), e);
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let config_json = (preset.config)();
    let config: Config = serde_json::from_value(config_json.clone())
        .map_err(|e| LoadError::Config(e.to_string()))?;
    config.validate()?;
    let tokenizer = train_tokenizer(config.vocab_size)?;
    let specs = tensor_specs(&config);
    let mut bytes: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (i, (name, shape)) in specs.iter().enumerate() {
        let data = values(name, shape);
        let encoded = if preset.bf16 {
            data.iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect()
        } else {
            data.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        bytes.insert(name.clone(), encoded);
        progress(i + 1, specs.len());
    }
    let dtype = if preset.bf16 { Dtype::BF16 } else { Dtype::F32 };
    let shapes: BTreeMap<&String, &Vec<usize>> = specs.iter().map(|(n, s)| (n, s)).collect();
    let views = bytes
        .iter()
        .map(|(name, data)| {
            TensorView::new(dtype, shapes[name].clone(), data)
                .map(|view| (name.clone(), view))
                .map_err(|e| SynthError::Format(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let weights = out.join("model.safetensors");
    safetensors::serialize_to_file(views, &None, &weights)
        .map_err(|e| SynthError::Format(e.to_string()))?;
    let mut config_text = serde_json::to_string_pretty(&config_json).unwrap_or_default();
    config_text.push('\n');
    let config_path = out.join("config.json");
    std::fs::write(&config_path, config_text).map_err(|e| io(&config_path, e))?;
    let tokenizer_path = out.join("tokenizer.json");
    std::fs::write(&tokenizer_path, tokenizer).map_err(|e| io(&tokenizer_path, e))?;
    Ok(())
}
