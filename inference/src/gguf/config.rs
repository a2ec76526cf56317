//! A GGUF file's metadata as the engine's `Config`: llama.cpp's keys (`qwen3moe.block_count`,
//! `qwen3moe.expert_count`, …) mapped back to the `config.json` fields they were converted
//! from, and checked by the same `Config::parse`. What the keys leave out is read off the
//! tensors: the vocabulary is the tokenizer's token list, the output head is tied when the
//! file has no `output.weight`, a layer without stacked experts is a dense one.
//!
//! Qwen3-MoE (`qwen3moe`) and Qwen2-MoE (`qwen2moe`); another architecture is refused by
//! name.

use std::collections::HashSet;

use serde_json::{json, Map, Value as Json};

use super::{Header, Value};
use crate::config::{Config, MAX_LAYERS};
use crate::LoadError;

/// The `config.json` model type of each GGUF architecture the engine reads, and whether its
/// router renormalizes the chosen experts' weights when the file does not say.
const ARCHITECTURES: &[(&str, &str, bool)] = &[
    ("qwen3moe", "qwen3_moe", true),
    ("qwen2moe", "qwen2_moe", false),
];

/// The engine's config of the model whose GGUF header is `header`.
pub fn config(header: &Header) -> Result<Config, LoadError> {
    let bad = |what: String| LoadError::Config(format!("GGUF metadata: {what}"));
    let arch = header
        .get("general.architecture")
        .and_then(Value::as_text)
        .ok_or_else(|| bad("no general.architecture".into()))?;
    let Some(&(_, model_type, renormalizes)) = ARCHITECTURES.iter().find(|(a, ..)| *a == arch)
    else {
        return Err(bad(format!(
            "architecture {arch:?} is not one this engine runs from GGUF (qwen3moe, qwen2moe)"
        )));
    };
    let key = |name: &str| header.get(&format!("{arch}.{name}"));
    let count = |name: &str| {
        key(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| bad(format!("{arch}.{name} is missing or not a count")))
    };
    let layers = count("block_count")?;
    // Bounded before the layers are walked (`Config::parse` would refuse more anyway).
    if layers > MAX_LAYERS as u64 {
        return Err(bad(format!("{layers} layers, at most {MAX_LAYERS}")));
    }
    let vocab = match header.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => tokens.len(),
        _ => return Err(bad("no tokenizer.ggml.tokens".into())),
    };
    let tensors: HashSet<&str> = header.tensors.iter().map(|t| t.name.as_str()).collect();
    let dense_layers: Vec<u64> = (0..layers)
        .filter(|l| !tensors.contains(format!("blk.{l}.ffn_gate_exps.weight").as_str()))
        .collect();
    let mut config = Map::new();
    let mut set = |field: &str, value: Json| {
        config.insert(field.to_string(), value);
    };
    set("model_type", json!(model_type));
    set("vocab_size", json!(vocab));
    set("hidden_size", json!(count("embedding_length")?));
    set("num_hidden_layers", json!(layers));
    set("num_attention_heads", json!(count("attention.head_count")?));
    set(
        "num_key_value_heads",
        json!(count("attention.head_count_kv")?),
    );
    set("num_experts", json!(count("expert_count")?));
    set("num_experts_per_tok", json!(count("expert_used_count")?));
    set(
        "moe_intermediate_size",
        json!(count("expert_feed_forward_length")?),
    );
    set("max_position_embeddings", json!(count("context_length")?));
    set("mlp_only_layers", json!(dense_layers));
    for (field, name) in [
        ("intermediate_size", "feed_forward_length"),
        ("head_dim", "attention.key_length"),
        (
            "shared_expert_intermediate_size",
            "expert_shared_feed_forward_length",
        ),
    ] {
        if key(name).is_some() {
            set(field, json!(count(name)?));
        }
    }
    let float = |name: &str| {
        key(name)
            .and_then(Value::as_f64)
            .ok_or_else(|| bad(format!("{arch}.{name} is missing or not a number")))
    };
    set(
        "rms_norm_eps",
        json!(float("attention.layer_norm_rms_epsilon")?),
    );
    if key("rope.freq_base").is_some() {
        set("rope_theta", json!(float("rope.freq_base")?));
    }
    let renormalizes = match key("expert_weights_norm") {
        Some(Value::Bool(norm)) => *norm,
        _ => renormalizes,
    };
    set("norm_topk_prob", json!(renormalizes));
    set(
        "tie_word_embeddings",
        json!(header.tensor("output.weight").is_none()),
    );
    set(
        "attention_bias",
        json!(header.tensor("blk.0.attn_q.bias").is_some()),
    );
    for (field, name) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ] {
        if let Some(id) = header.get(name).and_then(Value::as_u64) {
            set(field, json!(id));
        }
    }
    Config::parse(&Json::Object(config).to_string())
}

#[cfg(test)]
mod tests {
    use super::super::tests::Writer;
    use super::*;

    /// A tiny qwen3moe header: two layers, the first dense.
    fn qwen3moe() -> Writer {
        Writer::default()
            .text("general.architecture", "qwen3moe")
            .u32("qwen3moe.block_count", 2)
            .u32("qwen3moe.embedding_length", 64)
            .u32("qwen3moe.feed_forward_length", 128)
            .u32("qwen3moe.attention.head_count", 4)
            .u32("qwen3moe.attention.head_count_kv", 2)
            .u32("qwen3moe.attention.key_length", 16)
            .u32("qwen3moe.expert_count", 8)
            .u32("qwen3moe.expert_used_count", 2)
            .u32("qwen3moe.expert_feed_forward_length", 32)
            .u32("qwen3moe.context_length", 512)
            .f32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
            .f32("qwen3moe.rope.freq_base", 1e6)
            .texts("tokenizer.ggml.tokens", &["a", "b", "c"])
            .u32("tokenizer.ggml.eos_token_id", 2)
            .tensor(
                "blk.1.ffn_gate_exps.weight",
                &[64, 32, 8],
                0,
                &[0; 64 * 32 * 8 * 4],
            )
    }

    #[test]
    fn qwen3moe_metadata_reads_as_the_config_it_was_converted_from() {
        let bytes = qwen3moe().finish();
        let config = config(&Header::parse(&bytes).unwrap()).unwrap();
        assert_eq!(config.model_type, "qwen3_moe");
        assert_eq!(
            (
                config.vocab_size,
                config.hidden_size,
                config.num_hidden_layers
            ),
            (3, 64, 2)
        );
        assert_eq!((config.num_experts, config.num_experts_per_tok), (8, 2));
        assert_eq!(
            (config.moe_intermediate_size, config.intermediate_size),
            (32, 128)
        );
        assert_eq!(config.head_dim(), 16);
        assert_eq!(config.moe_layers().collect::<Vec<_>>(), [1]);
        assert!(config.renormalizes_top_k());
        assert!(config.tie_word_embeddings);
        assert_eq!(config.rope_theta(), 1e6);
        assert_eq!(config.end_tokens(), [2]);
    }

    #[test]
    fn another_architecture_or_a_missing_key_is_refused_by_name() {
        let llama = Writer::default()
            .text("general.architecture", "llama")
            .finish();
        let error = config(&Header::parse(&llama).unwrap()).unwrap_err();
        assert!(error.to_string().contains("\"llama\""), "{error}");
        let bytes = Writer::default()
            .text("general.architecture", "qwen3moe")
            .u32("qwen3moe.block_count", 2)
            .texts("tokenizer.ggml.tokens", &["a"])
            .finish();
        let error = config(&Header::parse(&bytes).unwrap()).unwrap_err();
        assert!(
            error.to_string().contains("qwen3moe.embedding_length"),
            "{error}"
        );
        // A layer count no model has is refused before the layers are walked.
        let bytes = Writer::default()
            .text("general.architecture", "qwen3moe")
            .u32("qwen3moe.block_count", u32::MAX)
            .texts("tokenizer.ggml.tokens", &["a"])
            .finish();
        let error = config(&Header::parse(&bytes).unwrap()).unwrap_err();
        assert!(error.to_string().contains("layers, at most"), "{error}");
    }
}
