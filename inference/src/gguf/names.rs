//! llama.cpp's tensor names (`blk.3.attn_q.weight`) as the engine's, which are those of a
//! Hugging Face checkpoint (`model.layers.3.self_attn.q_proj.weight`), so that a GGUF file
//! loads through the same `Checkpoint` lookups as a safetensors directory. The converter
//! keeps each matrix's layout for these architectures: a GGUF tensor's dimensions, innermost
//! first, are the Hugging Face shape reversed, and its bytes are in the same order.
//!
//! Qwen3.5's values are another matter: its converter rewrites some of them for llama.cpp's
//! graph (`checkpoint::Convention::LlamaCpp` says how), and stores the DeltaNet's decay rate
//! `-exp(A_log)` in place of `A_log`, which the engine knows as `linear_attn.A`.

/// Per-layer tensors: llama.cpp's suffix, the engine's.
pub(super) const LAYER: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_gate_inp.weight", "mlp.gate.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    (
        "ffn_gate_shexp.weight",
        "mlp.shared_expert.gate_proj.weight",
    ),
    ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
    (
        "ffn_down_shexp.weight",
        "mlp.shared_expert.down_proj.weight",
    ),
    ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
];

/// Per-layer tensors of Qwen3.5 (`qwen35moe`) beside those of `LAYER`: its post-attention norm
/// under another name, and the gated DeltaNet's.
pub(super) const QWEN35_LAYER: &[(&str, &str)] = &[
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
    ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
    ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
    ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
    ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
    ("ssm_dt.bias", "linear_attn.dt_bias"),
    ("ssm_a", "linear_attn.A"),
    ("ssm_norm.weight", "linear_attn.norm.weight"),
    ("ssm_out.weight", "linear_attn.out_proj.weight"),
];

/// Tensors outside the layers.
pub(super) const MODEL: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// A layer's experts stacked in one tensor: llama.cpp's suffix, the engine's part.
pub(super) const STACKED: &[(&str, &str)] = &[
    ("ffn_gate_exps.weight", "gate_proj"),
    ("ffn_up_exps.weight", "up_proj"),
    ("ffn_down_exps.weight", "down_proj"),
];

/// The engine's name of GGUF tensor `name`, or None for one it does not use (or a stacked
/// expert tensor: `stacked_experts`).
pub fn engine_name(name: &str) -> Option<String> {
    if let Some((_, engine)) = MODEL.iter().find(|(gguf, _)| *gguf == name) {
        return Some(engine.to_string());
    }
    let (layer, suffix) = layer_of(name)?;
    let (_, engine) = LAYER
        .iter()
        .chain(QWEN35_LAYER)
        .find(|(gguf, _)| *gguf == suffix)?;
    Some(format!("model.layers.{layer}.{engine}"))
}

/// The layer of a per-layer tensor (`blk.L.…`).
pub fn layer(name: &str) -> Option<usize> {
    Some(layer_of(name)?.0)
}

/// For a layer's experts stacked in one tensor (`blk.L.ffn_gate_exps.weight`: experts x
/// rows x columns), the layer and the engine's name of each expert's part (`gate_proj`).
pub fn stacked_experts(name: &str) -> Option<(usize, &'static str)> {
    let (layer, suffix) = layer_of(name)?;
    let (_, part) = STACKED.iter().find(|(gguf, _)| *gguf == suffix)?;
    Some((layer, part))
}

fn layer_of(name: &str) -> Option<(usize, &str)> {
    let (layer, suffix) = name.strip_prefix("blk.")?.split_once('.')?;
    Some((layer.parse().ok()?, suffix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_the_engines_and_unknown_ones_to_none() {
        assert_eq!(
            engine_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            engine_name("output.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(
            engine_name("blk.2.ssm_a").as_deref(),
            Some("model.layers.2.linear_attn.A")
        );
        assert_eq!(layer("blk.40.attn_q.weight"), Some(40));
        assert_eq!(
            stacked_experts("blk.3.ffn_down_exps.weight"),
            Some((3, "down_proj"))
        );
        for other in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.1.ffn_gate_exps.weight",
        ] {
            assert_eq!(engine_name(other), None, "{other}");
        }
        assert_eq!(stacked_experts("blk.1.attn_q.weight"), None);
    }
}
