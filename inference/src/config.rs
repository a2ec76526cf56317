//! `config.json` of a Hugging Face Qwen3-MoE (or Qwen2-MoE) checkpoint, with the field
//! aliases newer transformers versions write.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::LoadError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense SwiGLU layers (`mlp_only_layers`, or off the sparse step).
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    /// Qwen2-MoE's shared expert; 0 for Qwen3-MoE.
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Newer transformers put `rope_theta` here instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    pub max_position_embeddings: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<u32>,
    /// Everything else in the file (architectures, torch_dtype, ...), kept for round trips.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_type: Option<String>,
}

fn one() -> usize {
    1
}

fn default_model_type() -> String {
    "qwen3_moe".into()
}

impl Config {
    pub fn load(dir: &Path) -> Result<Config, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| LoadError::io(&path, e))?;
        let config: Config = serde_json::from_str(&text)
            .map_err(|e| LoadError::Config(format!("{}: {e}", path.display())))?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), LoadError> {
        let bad = |m: &str| Err(LoadError::Config(m.to_string()));
        if !matches!(self.model_type.as_str(), "qwen3_moe" | "qwen2_moe") {
            return bad(&format!(
                "model_type {:?} is not qwen3_moe or qwen2_moe",
                self.model_type
            ));
        }
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("decoder_sparse_step", self.decoder_sparse_step),
            ("head_dim", self.head_dim()),
        ] {
            if v == 0 {
                return bad(&format!("{name} must be greater than zero"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad("num_attention_heads must be a multiple of num_key_value_heads");
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad("head_dim must be even for rotary embeddings");
        }
        if self.num_experts > 0 && !(1..=self.num_experts).contains(&self.num_experts_per_tok) {
            return bad("num_experts_per_tok must be between 1 and num_experts");
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.rms_norm_eps) || !positive(self.rope_theta()) {
            return bad("rms_norm_eps and rope_theta must be positive");
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0)
    }

    /// Whether `layer` routes to experts (else it is a dense SwiGLU layer), as transformers
    /// decides it.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// The layers that route to experts, in order.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_hidden_layers).filter(|l| self.is_moe_layer(*l))
    }

    /// Qwen2-MoE carries q/k/v biases and a shared expert; Qwen3-MoE has q/k norms.
    pub fn is_qwen2(&self) -> bool {
        self.model_type == "qwen2_moe"
    }

    pub fn qkv_bias(&self) -> bool {
        self.is_qwen2() || self.attention_bias
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "moe_intermediate_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "architectures": ["Qwen3MoeForCausalLM"]}"#;

    #[test]
    fn accepts_newer_aliases_and_keeps_unknown_fields() {
        let config: Config = serde_json::from_str(BASE).unwrap();
        assert_eq!(config.head_dim(), 4);
        assert!(config.extra.contains_key("architectures"));
        let newer = BASE
            .replace("\"num_experts\"", "\"num_local_experts\"")
            .replace(
                "\"rope_theta\": 10000.0",
                "\"rope_parameters\": {\"rope_theta\": 5e5, \"rope_type\": \"default\"}",
            );
        let newer: Config = serde_json::from_str(&newer).unwrap();
        assert_eq!(newer.num_experts, 4);
        assert_eq!(newer.rope_theta(), 5e5);
        newer.validate().unwrap();
    }

    #[test]
    fn sparse_step_and_mlp_only_layers_pick_dense_layers() {
        let mut config: Config = serde_json::from_str(BASE).unwrap();
        assert!(config.is_moe_layer(0) && config.is_moe_layer(1));
        config.mlp_only_layers = vec![0];
        assert!(!config.is_moe_layer(0) && config.is_moe_layer(1));
        config.mlp_only_layers.clear();
        config.decoder_sparse_step = 2;
        assert!(!config.is_moe_layer(0) && config.is_moe_layer(1));
    }

    #[test]
    fn inconsistent_configs_are_errors() {
        let mut config: Config = serde_json::from_str(BASE).unwrap();
        config.num_key_value_heads = 3;
        assert!(config.validate().is_err());
        let mut config: Config = serde_json::from_str(BASE).unwrap();
        config.num_experts_per_tok = 9;
        assert!(config.validate().is_err());
        assert!(serde_json::from_str::<Config>("{\"vocab_size\": -1}").is_err());
    }
}
