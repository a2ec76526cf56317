//! A GGUF file's metadata as the engine's `Config`: llama.cpp's keys (`qwen3moe.block_count`,
//! `qwen3moe.expert_count`, …) mapped back to the `config.json` fields they were converted
//! from, and checked by the same `Config::parse`. What the keys leave out is read off the
//! tensors: the vocabulary is the tokenizer's token list, the output head is tied when the
//! file has no `output.weight`, a layer without stacked experts is a dense one.
//!
//! Qwen3-MoE (`qwen3moe`), Qwen2-MoE (`qwen2moe`) and Qwen3.5-MoE (`qwen35moe`, whose gated
//! DeltaNet is described by the `ssm.*` keys); another architecture is refused by name. A
//! Qwen3.5 file's multi-token-prediction layers (`nextn_predict_layers`, after the others)
//! are left out, as they are from a safetensors checkpoint.

use std::collections::HashSet;

use serde_json::{json, Map, Value as Json};

use super::{Gguf, Header, Value};
use crate::config::{Config, MAX_LAYERS};
use crate::LoadError;

/// The `config.json` model type of each GGUF architecture the engine reads, and whether its
/// router renormalizes the chosen experts' weights when the file does not say.
const ARCHITECTURES: &[(&str, &str, bool)] = &[
    ("qwen3moe", "qwen3_moe", true),
    ("qwen2moe", "qwen2_moe", false),
    ("qwen35moe", "qwen3_5_moe_text", true),
];

/// The engine's config of the model whose GGUF header is `header` (a model of one file).
pub fn config(header: &Header) -> Result<Config, LoadError> {
    config_with(
        header,
        header.tensors.iter().map(|t| t.name.as_str()).collect(),
    )
}

/// The engine's config of a model split over `parts` (`split::open`): the first part's
/// metadata, every part's tensors.
pub fn of_parts(parts: &[Gguf]) -> Result<Config, LoadError> {
    let Some(first) = parts.first() else {
        return Err(LoadError::Config("GGUF: a model of no files".into()));
    };
    let tensors = parts
        .iter()
        .flat_map(|part| part.header().tensors.iter().map(|t| t.name.as_str()))
        .collect();
    config_with(first.header(), tensors)
}

/// The config from `header`'s metadata and the names of the model's `tensors`.
fn config_with(header: &Header, tensors: HashSet<&str>) -> Result<Config, LoadError> {
    let bad = |what: String| LoadError::Config(format!("GGUF metadata: {what}"));
    let arch = header
        .get("general.architecture")
        .and_then(Value::as_text)
        .ok_or_else(|| bad("no general.architecture".into()))?;
    let Some(&(_, model_type, renormalizes)) = ARCHITECTURES.iter().find(|(a, ..)| *a == arch)
    else {
        return Err(bad(format!(
            "architecture {arch:?} is not one this engine runs from GGUF (qwen3moe, qwen2moe, qwen35moe)"
        )));
    };
    let key = |name: &str| header.get(&format!("{arch}.{name}"));
    let count = |name: &str| {
        key(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| bad(format!("{arch}.{name} is missing or not a count")))
    };
    let layers = text_layers(header).ok_or_else(|| {
        bad(format!(
            "{arch}.block_count is missing, not a count, or below {arch}.nextn_predict_layers"
        ))
    })?;
    // Bounded before the layers are walked (`Config::parse` would refuse more anyway).
    if layers > MAX_LAYERS as u64 {
        return Err(bad(format!("{layers} layers, at most {MAX_LAYERS}")));
    }
    let vocab = match header.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => tokens.len(),
        _ => return Err(bad("no tokenizer.ggml.tokens".into())),
    };
    if let Some(fused) = tensors
        .iter()
        .find(|t| t.ends_with("ffn_gate_up_exps.weight"))
    {
        return Err(bad(format!(
            "{fused}: experts with gate and up fused in one tensor are not read; convert without --fuse-gate-up-exps"
        )));
    }
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
        json!(!tensors.contains("output.weight")),
    );
    set(
        "attention_bias",
        json!(tensors.contains("blk.0.attn_q.bias")),
    );
    if arch == "qwen35moe" {
        for (field, value) in qwen35(header, layers)? {
            set(field, value);
        }
    }
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

/// The layers a GGUF file's model runs: `block_count` less the multi-token-prediction layers
/// stored after them. None if the counts are missing or do not fit.
pub fn text_layers(header: &Header) -> Option<u64> {
    let arch = header.get("general.architecture")?.as_text()?;
    let key = |name: &str| header.get(&format!("{arch}.{name}"));
    let blocks = key("block_count")?.as_u64()?;
    let prediction = match key("nextn_predict_layers") {
        Some(value) => value.as_u64()?,
        None => 0,
    };
    blocks.checked_sub(prediction)
}

/// Qwen3.5's fields: the gated DeltaNet's shapes from llama.cpp's `ssm.*` keys (its value
/// head width is `inner_size / time_step_rank`), each layer's mixer from
/// `attention.recurrent_layers` (or every `full_attention_interval`-th layer full
/// attention), and the rotary share from `rope.dimension_count`.
fn qwen35(header: &Header, layers: u64) -> Result<Vec<(&'static str, Json)>, LoadError> {
    let bad = |what: String| LoadError::Config(format!("GGUF metadata: qwen35moe.{what}"));
    let key = |name: &str| header.get(&format!("qwen35moe.{name}"));
    let count = |name: &str| {
        key(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| bad(format!("{name} is missing or not a count")))
    };
    let (value_heads, inner) = (count("ssm.time_step_rank")?, count("ssm.inner_size")?);
    if value_heads == 0 || !inner.is_multiple_of(value_heads) {
        return Err(bad(format!(
            "ssm.inner_size {inner} is not a whole number of ssm.time_step_rank {value_heads} heads"
        )));
    }
    let layer_types: Vec<&str> = match key("attention.recurrent_layers") {
        Some(Value::Array(flags)) => {
            let flags: Option<Vec<bool>> = flags
                .iter()
                .take(layers as usize)
                .map(|f| match f {
                    Value::Bool(recurrent) => Some(*recurrent),
                    _ => None,
                })
                .collect();
            match flags {
                Some(flags) if flags.len() as u64 == layers => flags,
                _ => {
                    return Err(bad(
                        "attention.recurrent_layers is not a flag per layer".into()
                    ))
                }
            }
        }
        Some(_) => return Err(bad("attention.recurrent_layers is not a list".into())),
        None => {
            let interval = match key("full_attention_interval") {
                Some(value) => value
                    .as_u64()
                    .filter(|i| *i > 0)
                    .ok_or_else(|| bad("full_attention_interval is not a positive count".into()))?,
                None => 4,
            };
            (0..layers)
                .map(|l| !(l + 1).is_multiple_of(interval))
                .collect()
        }
    }
    .into_iter()
    .map(|recurrent| {
        if recurrent {
            "linear_attention"
        } else {
            "full_attention"
        }
    })
    .collect();
    let head_dim = count("attention.key_length")?;
    let rotary = count("rope.dimension_count")?;
    // The engine keeps the share, as config.json does: it must give the count back, which
    // the nearest share may miss by rounding down.
    let nearest = rotary as f64 / head_dim as f64;
    let factor = match (head_dim as f64 * nearest) as u64 == rotary {
        true => nearest,
        false => nearest.next_up(),
    };
    if rotary == 0 || rotary > head_dim || (head_dim as f64 * factor) as u64 != rotary {
        return Err(bad(format!(
            "rope.dimension_count {rotary} is not a share of the head's {head_dim} dimensions"
        )));
    }
    Ok(vec![
        ("layer_types", json!(layer_types)),
        ("linear_conv_kernel_dim", json!(count("ssm.conv_kernel")?)),
        ("linear_key_head_dim", json!(count("ssm.state_size")?)),
        ("linear_num_key_heads", json!(count("ssm.group_count")?)),
        ("linear_num_value_heads", json!(value_heads)),
        ("linear_value_head_dim", json!(inner / value_heads)),
        ("partial_rotary_factor", json!(factor)),
    ])
}

#[cfg(test)]
mod tests {
    use super::super::tests::Writer;
    use super::*;
    use crate::config::Mixer;

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

    /// A tiny qwen35moe header: four layers, every fourth full attention, an MTP layer after.
    fn qwen35moe(inner: u32, rotary: u32) -> Vec<u8> {
        let mut writer = Writer::default()
            .text("general.architecture", "qwen35moe")
            .u32("qwen35moe.block_count", 5)
            .u32("qwen35moe.nextn_predict_layers", 1)
            .u32("qwen35moe.embedding_length", 64)
            .u32("qwen35moe.attention.head_count", 4)
            .u32("qwen35moe.attention.head_count_kv", 2)
            .u32("qwen35moe.attention.key_length", 32)
            .u32("qwen35moe.expert_count", 8)
            .u32("qwen35moe.expert_used_count", 2)
            .u32("qwen35moe.expert_feed_forward_length", 32)
            .u32("qwen35moe.expert_shared_feed_forward_length", 48)
            .u32("qwen35moe.context_length", 512)
            .u32("qwen35moe.ssm.conv_kernel", 4)
            .u32("qwen35moe.ssm.state_size", 16)
            .u32("qwen35moe.ssm.group_count", 2)
            .u32("qwen35moe.ssm.time_step_rank", 4)
            .u32("qwen35moe.ssm.inner_size", inner)
            .u32("qwen35moe.full_attention_interval", 4)
            .u32("qwen35moe.rope.dimension_count", rotary)
            .f32("qwen35moe.attention.layer_norm_rms_epsilon", 1e-6)
            .f32("qwen35moe.rope.freq_base", 1e7)
            .texts("tokenizer.ggml.tokens", &["a", "b", "c"]);
        for layer in 0..5 {
            writer = writer.tensor(
                &format!("blk.{layer}.ffn_gate_exps.weight"),
                &[64, 32, 8],
                0,
                &[0; 64 * 32 * 8 * 4],
            );
        }
        writer.finish()
    }

    #[test]
    fn qwen35moe_metadata_reads_as_the_text_config_it_was_converted_from() {
        let config = config(&Header::parse(&qwen35moe(64, 8)).unwrap()).unwrap();
        assert_eq!(config.family(), crate::config::Family::Qwen35Moe);
        // The multi-token-prediction layer is not one of the model's.
        assert_eq!(config.num_hidden_layers, 4);
        assert_eq!(
            (0..4).map(|l| config.mixer(l)).collect::<Vec<_>>(),
            [
                Mixer::LinearAttention,
                Mixer::LinearAttention,
                Mixer::LinearAttention,
                Mixer::FullAttention
            ]
        );
        assert_eq!(
            (
                config.linear_conv_kernel_dim,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_num_key_heads,
                config.linear_num_value_heads
            ),
            (4, 16, 16, 2, 4)
        );
        assert_eq!(config.shared_expert_intermediate_size, 48);
        assert_eq!(config.rotary_dim(), 8);
        assert!(config.renormalizes_top_k());
    }

    #[test]
    fn qwen35moe_shapes_that_do_not_divide_are_refused_by_key() {
        for (inner, rotary, key) in [
            (66, 8, "ssm.inner_size"),
            (64, 0, "rope.dimension_count"),
            (64, 40, "rope.dimension_count"),
        ] {
            let error = config(&Header::parse(&qwen35moe(inner, rotary)).unwrap()).unwrap_err();
            assert!(error.to_string().contains(key), "{error}");
        }
    }
}
