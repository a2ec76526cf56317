//! `config.json` of a Hugging Face Qwen3-MoE, Qwen2-MoE or Qwen3.5-MoE checkpoint, with the
//! field aliases newer transformers versions write. A Qwen3.5-MoE checkpoint as published
//! (`Qwen3_5MoeForConditionalGeneration`) nests the text model's config in `text_config`;
//! the engine reads that part and leaves the vision tower's alone.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::LoadError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense SwiGLU layers (`mlp_only_layers`, or off the sparse step); Qwen3.5
    /// has none.
    #[serde(default)]
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    /// The shared expert of Qwen2-MoE and Qwen3.5-MoE; 0 for Qwen3-MoE.
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
    /// Qwen3.5: `linear_attention` (gated DeltaNet) or `full_attention` per layer; absent,
    /// every `full_attention_interval`-th layer is full attention.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_types: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attention_interval: Option<usize>,
    /// Qwen3.5's gated DeltaNet: the causal convolution's width and the key and value heads.
    #[serde(default)]
    pub linear_conv_kernel_dim: usize,
    #[serde(default)]
    pub linear_key_head_dim: usize,
    #[serde(default)]
    pub linear_value_head_dim: usize,
    #[serde(default)]
    pub linear_num_key_heads: usize,
    #[serde(default)]
    pub linear_num_value_heads: usize,
    /// Older configs put it here rather than in `rope_parameters`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// One id or a list (as Qwen3.5 and most chat checkpoints publish it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<EndTokens>,
    /// `generation_config.json`'s end tokens, which a generation stops at in place of
    /// `eos_token_id` when the file names any (as transformers' `generate` does).
    #[serde(skip)]
    pub generation_eos_token_id: Option<EndTokens>,
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
    /// The share of each head's dimensions that rotate (Qwen3.5: 0.25). Qwen3.5's
    /// `mrope_section` needs nothing: text positions are equal on its three axes, where
    /// multimodal RoPE is plain RoPE.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

/// The architectures this engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen2Moe,
    Qwen3Moe,
    /// Gated DeltaNet and gated full attention, `(1 + weight)` norms, a gated shared expert.
    Qwen35Moe,
}

/// A layer's token mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mixer {
    FullAttention,
    /// Qwen3.5's gated DeltaNet.
    LinearAttention,
}

/// Qwen3_5MoeTextConfig's defaults in transformers 5.24, for fields a config.json leaves out.
const QWEN35_DEFAULTS: &[(&str, u64)] = &[
    ("vocab_size", 248_320),
    ("hidden_size", 2048),
    ("num_hidden_layers", 40),
    ("num_attention_heads", 16),
    ("num_key_value_heads", 2),
    ("head_dim", 256),
    ("max_position_embeddings", 32_768),
    ("linear_conv_kernel_dim", 4),
    ("linear_key_head_dim", 128),
    ("linear_value_head_dim", 128),
    ("linear_num_key_heads", 16),
    ("linear_num_value_heads", 32),
    ("moe_intermediate_size", 512),
    ("shared_expert_intermediate_size", 512),
    ("num_experts_per_tok", 8),
    ("num_experts", 256),
];

/// The bound on every count and width a config names: far above any published model, and
/// low enough that no product of a few of them overflows.
const MAX_DIMENSION: usize = 1 << 20;

/// The most layers a config may name: frontier models have about a hundred.
pub(crate) const MAX_LAYERS: usize = 1024;

/// The widest causal convolution a DeltaNet layer may have (Qwen3.5's is 4).
const MAX_CONV_KERNEL: usize = 64;

/// The most values one sequence's DeltaNet states may hold over all layers: 1 GiB of f32,
/// about seven times Qwen3.5-122B's.
const MAX_SEQUENCE_STATE: usize = 1 << 28;

/// The most values one sequence's recurrent state may hold in one DeltaNet layer: 256 MiB
/// of f32, 64 times Qwen3.5-122B's (64 value heads of 128 x 128), so that a config cannot
/// make every new sequence allocate without bound.
const MAX_DELTANET_STATE: usize = 1 << 26;

fn one() -> usize {
    1
}

/// The tokens that end a generation: one id or a list, kept as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EndTokens {
    One(u32),
    Many(Vec<u32>),
}

/// End tokens a config may name; a chat checkpoint names two or three.
const MAX_END_TOKENS: usize = 64;

impl EndTokens {
    pub fn ids(&self) -> &[u32] {
        match self {
            EndTokens::One(id) => std::slice::from_ref(id),
            EndTokens::Many(ids) => ids,
        }
    }
}

/// A config error, naming the file it is in.
fn in_file(path: &Path) -> impl Fn(LoadError) -> LoadError + '_ {
    move |e| match e {
        LoadError::Config(m) => LoadError::Config(format!("{}: {m}", path.display())),
        other => other,
    }
}

/// A list of end tokens is bounded: every generated token is looked up in it.
fn check_end_tokens(field: &str, tokens: &EndTokens) -> Result<(), LoadError> {
    if tokens.ids().len() > MAX_END_TOKENS {
        return Err(LoadError::Config(format!(
            "{field} lists {} tokens, at most {MAX_END_TOKENS} are taken",
            tokens.ids().len()
        )));
    }
    Ok(())
}

/// `generation_config.json`: only what generation takes from it.
#[derive(Deserialize)]
struct GenerationConfig {
    #[serde(default)]
    eos_token_id: Option<EndTokens>,
}

fn default_model_type() -> String {
    "qwen3_moe".into()
}

impl Config {
    /// `config.json` in `dir`, with the end tokens of `generation_config.json` when the
    /// checkpoint has one; or the metadata of the GGUF file `dir` names (the first of a split
    /// model's, with every part's tensors).
    pub fn load(dir: &Path) -> Result<Config, LoadError> {
        if crate::gguf::is_gguf(dir) {
            let parts = crate::gguf::split::open(dir).map_err(|e| LoadError::Format {
                file: dir.display().to_string(),
                reason: e.to_string(),
            })?;
            return crate::gguf::config::of_parts(&parts);
        }
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| LoadError::io(&path, e))?;
        let mut config = Config::parse(&text).map_err(in_file(&path))?;
        let path = dir.join("generation_config.json");
        match std::fs::read_to_string(&path) {
            Ok(text) => config
                .take_generation_config(&text)
                .map_err(in_file(&path))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(LoadError::io(&path, e)),
        }
        Ok(config)
    }

    /// Takes the end tokens of a `generation_config.json`'s text, if it names any.
    fn take_generation_config(&mut self, text: &str) -> Result<(), LoadError> {
        let generation: GenerationConfig =
            serde_json::from_str(text).map_err(|e| LoadError::Config(e.to_string()))?;
        if let Some(tokens) = generation.eos_token_id {
            check_end_tokens("eos_token_id", &tokens)?;
            self.generation_eos_token_id = Some(tokens);
        }
        Ok(())
    }

    /// The tokens a generation stops at: `generation_config.json`'s if it names any, else
    /// `config.json`'s `eos_token_id` (none: it runs to its length).
    pub fn end_tokens(&self) -> &[u32] {
        self.generation_eos_token_id
            .as_ref()
            .or(self.eos_token_id.as_ref())
            .map_or(&[], EndTokens::ids)
    }

    /// A config.json's text, the text model's part of a multimodal wrapper, validated.
    pub fn parse(text: &str) -> Result<Config, LoadError> {
        let bad = |e: serde_json::Error| LoadError::Config(e.to_string());
        let mut value: serde_json::Value = serde_json::from_str(text).map_err(bad)?;
        if value["model_type"] == "qwen3_5_moe" {
            let Some(mut text_config) = value.get("text_config").filter(|t| t.is_object()).cloned()
            else {
                return Err(LoadError::Config(
                    "model_type qwen3_5_moe needs a text_config object".into(),
                ));
            };
            // The wrapper decides whether its lm_head is tied (false unless it says so).
            text_config["tie_word_embeddings"] = value
                .get("tie_word_embeddings")
                .cloned()
                .unwrap_or(false.into());
            if let Some(architectures) = value.get("architectures") {
                text_config["architectures"] = architectures.clone();
            }
            if text_config.get("eos_token_id").is_none() {
                if let Some(eos) = value.get("eos_token_id") {
                    text_config["eos_token_id"] = eos.clone();
                }
            }
            if text_config.get("model_type").is_none() {
                text_config["model_type"] = "qwen3_5_moe_text".into();
            }
            value = text_config;
        }
        if value["model_type"] == "qwen3_5_moe_text" {
            // What transformers' Qwen3_5MoeTextConfig takes for a field left out.
            if let Some(config) = value.as_object_mut() {
                for (key, default) in QWEN35_DEFAULTS {
                    config.entry(*key).or_insert_with(|| (*default).into());
                }
                config.entry("rms_norm_eps").or_insert_with(|| 1e-6.into());
            }
        }
        let config: Config = serde_json::from_value(value).map_err(bad)?;
        config.validate()?;
        Ok(config)
    }

    pub fn family(&self) -> Family {
        match self.model_type.as_str() {
            "qwen2_moe" => Family::Qwen2Moe,
            "qwen3_5_moe_text" => Family::Qwen35Moe,
            _ => Family::Qwen3Moe,
        }
    }

    pub fn validate(&self) -> Result<(), LoadError> {
        let bad = |m: &str| Err(LoadError::Config(m.to_string()));
        if !matches!(
            self.model_type.as_str(),
            "qwen3_moe" | "qwen2_moe" | "qwen3_5_moe_text"
        ) {
            return bad(&format!(
                "model_type {:?} is not qwen3_moe, qwen2_moe or qwen3_5_moe",
                self.model_type
            ));
        }
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
            ),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim()),
            ("num_experts", self.num_experts),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
        ] {
            if v > MAX_DIMENSION {
                return bad(&format!("{name} {v} is over {MAX_DIMENSION}"));
            }
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
        if self.num_hidden_layers > MAX_LAYERS || self.mlp_only_layers.len() > MAX_LAYERS {
            return bad(&format!(
                "num_hidden_layers and mlp_only_layers must name at most {MAX_LAYERS} layers"
            ));
        }
        if let Some(kind) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.as_deref())
        {
            if kind != "default" {
                return bad(&format!(
                    "rope_type {kind:?}: this engine computes the default RoPE only"
                ));
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
        if (0..self.num_hidden_layers).any(|l| !self.is_moe_layer(l)) && self.intermediate_size == 0
        {
            return bad("a dense layer needs intermediate_size greater than zero");
        }
        let factor = self.partial_rotary_factor();
        if !(factor > 0.0 && factor <= 1.0) {
            return bad("partial_rotary_factor must be in (0, 1]");
        }
        let rotary = self.rotary_dim();
        if rotary == 0 || !rotary.is_multiple_of(2) {
            return bad("head_dim x partial_rotary_factor must be a positive even number");
        }
        if let Some(tokens) = &self.eos_token_id {
            check_end_tokens("eos_token_id", tokens)?;
        }
        if self.family() == Family::Qwen35Moe {
            self.validate_qwen35()?;
        }
        Ok(())
    }

    fn validate_qwen35(&self) -> Result<(), LoadError> {
        let bad = |m: String| Err(LoadError::Config(m));
        if self.num_experts == 0 {
            return bad("qwen3_5_moe routes every layer: num_experts must be above zero".into());
        }
        for (name, v) in [
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
        ] {
            if v == 0 {
                return bad(format!("{name} must be greater than zero"));
            }
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            return bad("linear_num_value_heads must be a multiple of linear_num_key_heads".into());
        }
        let state = self
            .linear_num_value_heads
            .checked_mul(self.linear_key_head_dim)
            .and_then(|v| v.checked_mul(self.linear_value_head_dim));
        if state.is_none_or(|floats| floats > MAX_DELTANET_STATE) {
            return bad(format!(
                "a DeltaNet layer's state (value heads x key dim x value dim) is over {MAX_DELTANET_STATE} values"
            ));
        }
        if self.linear_conv_kernel_dim > MAX_CONV_KERNEL {
            return bad(format!("linear_conv_kernel_dim is over {MAX_CONV_KERNEL}"));
        }
        if self.full_attention_interval == Some(0) {
            return bad("full_attention_interval must be greater than zero".into());
        }
        if !self.layer_types.is_empty() {
            if self.layer_types.len() != self.num_hidden_layers {
                return bad(format!(
                    "layer_types names {} layers, num_hidden_layers is {}",
                    self.layer_types.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(other) = self
                .layer_types
                .iter()
                .find(|t| !matches!(t.as_str(), "linear_attention" | "full_attention"))
            {
                return bad(format!(
                    "layer type {other:?} is not linear_attention or full_attention"
                ));
            }
        }
        // Every new sequence allocates its states in every DeltaNet layer at once.
        let channels = 2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim;
        let per_layer = state
            .unwrap_or(usize::MAX)
            .saturating_add((self.linear_conv_kernel_dim - 1).saturating_mul(channels));
        let layers = (0..self.num_hidden_layers)
            .filter(|l| self.mixer(*l) == Mixer::LinearAttention)
            .count();
        if per_layer.saturating_mul(layers) > MAX_SEQUENCE_STATE {
            return bad(format!(
                "the DeltaNet layers' state per sequence is over {MAX_SEQUENCE_STATE} values"
            ));
        }
        Ok(())
    }

    /// Layer `layer`'s token mixer: Qwen3.5 per `layer_types` (or one full attention layer
    /// every `full_attention_interval`, 4 by default, as transformers fills it in); full
    /// attention everywhere in the other families.
    pub fn mixer(&self, layer: usize) -> Mixer {
        if self.family() != Family::Qwen35Moe {
            return Mixer::FullAttention;
        }
        let full = match self.layer_types.get(layer) {
            Some(kind) => kind == "full_attention",
            None => (layer + 1).is_multiple_of(self.full_attention_interval.unwrap_or(4)),
        };
        if full {
            Mixer::FullAttention
        } else {
            Mixer::LinearAttention
        }
    }

    /// The share of a head that rotates: 1 but for Qwen3.5 (0.25 unless the config says).
    pub fn partial_rotary_factor(&self) -> f64 {
        let default = if self.family() == Family::Qwen35Moe {
            0.25
        } else {
            1.0
        };
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.partial_rotary_factor)
            .or(self.partial_rotary_factor)
            .unwrap_or(default)
    }

    /// The rotating dimensions of a head, truncated as transformers does.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim() as f64 * self.partial_rotary_factor()) as usize
    }

    /// Whether the router renormalises the top-k probabilities: Qwen3.5 always does.
    pub fn renormalizes_top_k(&self) -> bool {
        self.norm_topk_prob || self.family() == Family::Qwen35Moe
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
        // Qwen3.5 builds a sparse MoE block in every layer, whatever else the config says.
        if self.family() == Family::Qwen35Moe {
            return layer < self.num_hidden_layers;
        }
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
        self.family() == Family::Qwen2Moe
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
    fn end_tokens_are_one_id_or_a_list_and_generation_config_names_them_first() {
        let with = |eos: &str| {
            Config::parse(&BASE.replace("\"rms_norm_eps\"", &format!("{eos} \"rms_norm_eps\"")))
        };
        assert_eq!(Config::parse(BASE).unwrap().end_tokens(), &[] as &[u32]);
        assert_eq!(with("\"eos_token_id\": 7,").unwrap().end_tokens(), &[7]);
        let mut config = with("\"eos_token_id\": [7, 2],").unwrap();
        assert_eq!(config.end_tokens(), &[7, 2]);
        // The list round-trips as written.
        let text = serde_json::to_string(&config).unwrap();
        assert_eq!(Config::parse(&text).unwrap().end_tokens(), &[7, 2]);
        config
            .take_generation_config(r#"{"eos_token_id": [3, 4], "top_k": 20}"#)
            .unwrap();
        assert_eq!(config.end_tokens(), &[3, 4]);
        // A generation config without end tokens leaves the model's.
        let mut config = with("\"eos_token_id\": 7,").unwrap();
        config
            .take_generation_config(r#"{"temperature": 0.6}"#)
            .unwrap();
        assert_eq!(config.end_tokens(), &[7]);
        // Hostile: not a token, a list past the bound, a file that is not JSON.
        assert!(with("\"eos_token_id\": -1,").is_err());
        assert!(with("\"eos_token_id\": \"</s>\",").is_err());
        let many = format!("\"eos_token_id\": {:?},", vec![1u32; MAX_END_TOKENS + 1]);
        assert!(with(&many).is_err());
        assert!(config.take_generation_config("{").is_err());
        let many = format!("{{\"eos_token_id\": {:?}}}", vec![1u32; MAX_END_TOKENS + 1]);
        assert!(config.take_generation_config(&many).is_err());
        assert_eq!(config.end_tokens(), &[7]);
    }

    #[test]
    fn a_checkpoint_directory_reads_its_generation_config() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), BASE).unwrap();
        assert_eq!(
            Config::load(dir.path()).unwrap().end_tokens(),
            &[] as &[u32]
        );
        let generation = dir.path().join("generation_config.json");
        std::fs::write(&generation, r#"{"eos_token_id": [5, 6]}"#).unwrap();
        assert_eq!(Config::load(dir.path()).unwrap().end_tokens(), &[5, 6]);
        std::fs::write(&generation, "[").unwrap();
        let error = Config::load(dir.path()).unwrap_err().to_string();
        assert!(error.contains("generation_config.json"), "{error}");
    }

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

    proptest::proptest! {
        /// Whatever config.json holds, parsing gives a config or a typed error.
        #[test]
        fn any_config_text_parses_or_is_an_error(text in ".{0,300}") {
            let _ = Config::parse(&text);
        }

        /// A Qwen3.5 config with any sizes (zero, huge) is validated without a panic or
        /// an overflow.
        #[test]
        fn any_qwen35_sizes_validate_or_are_an_error(
            sizes in proptest::collection::vec(0usize..=usize::MAX, 8),
            factor in proptest::num::f64::ANY,
        ) {
            let text = QWEN35
                .replace("\"linear_num_value_heads\": 4", &format!("\"linear_num_value_heads\": {}", sizes[0]))
                .replace("\"linear_key_head_dim\": 16", &format!("\"linear_key_head_dim\": {}", sizes[1]))
                .replace("\"linear_value_head_dim\": 16", &format!("\"linear_value_head_dim\": {}", sizes[2]))
                .replace("\"linear_num_key_heads\": 2", &format!("\"linear_num_key_heads\": {}", sizes[3]))
                .replace("\"head_dim\": 32", &format!("\"head_dim\": {}", sizes[4]))
                .replace("\"num_hidden_layers\": 4", &format!("\"num_hidden_layers\": {}", sizes[5]))
                .replace("\"linear_conv_kernel_dim\": 4", &format!("\"linear_conv_kernel_dim\": {}", sizes[6]))
                .replace("\"num_experts\": 8", &format!("\"num_experts\": {}", sizes[7]))
                .replace("0.25", &format!("{factor:e}"));
            if let Ok(config) = Config::parse(&text) {
                proptest::prop_assert!(config.rotary_dim() <= config.head_dim());
                for layer in 0..config.num_hidden_layers.min(8) {
                    let _ = config.mixer(layer);
                }
            }
        }
    }

    const QWEN35: &str = r#"{"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "tie_word_embeddings": false, "vision_config": {"depth": 1},
        "text_config": {"model_type": "qwen3_5_moe_text", "vocab_size": 10, "hidden_size": 8,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 4,
        "shared_expert_intermediate_size": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": true}}}"#;

    #[test]
    fn a_multimodal_qwen35_config_reads_its_text_model() {
        let config = Config::parse(QWEN35).unwrap();
        assert_eq!(config.family(), Family::Qwen35Moe);
        assert_eq!(config.model_type, "qwen3_5_moe_text");
        assert_eq!(config.rotary_dim(), 8);
        assert!(config.renormalizes_top_k());
        let mixers: Vec<Mixer> = (0..4).map(|l| config.mixer(l)).collect();
        assert_eq!(
            mixers,
            [
                Mixer::LinearAttention,
                Mixer::LinearAttention,
                Mixer::LinearAttention,
                Mixer::FullAttention
            ]
        );
        // Every layer routes to experts; there is no dense width to read.
        assert_eq!(config.moe_layers().count(), 4);
        // layer_types, when given, decides.
        let listed = QWEN35.replace(
            "\"head_dim\": 32,",
            "\"head_dim\": 32, \"layer_types\": [\"full_attention\", \"linear_attention\", \"full_attention\", \"linear_attention\"],",
        );
        let listed = Config::parse(&listed).unwrap();
        assert_eq!(listed.mixer(0), Mixer::FullAttention);
        assert_eq!(listed.mixer(3), Mixer::LinearAttention);
        // What transformers' defaults and rules give for what the file leaves out or says.
        let sparse = QWEN35
            .replace("\"shared_expert_intermediate_size\": 4,", "")
            .replace(
                "\"head_dim\": 32,",
                "\"mlp_only_layers\": [1], \"head_dim\": 32,",
            )
            .replace("\"tie_word_embeddings\": false,", "")
            .replace(
                "\"linear_conv_kernel_dim\": 4,",
                "\"tie_word_embeddings\": true,",
            );
        let sparse = Config::parse(&sparse).unwrap();
        assert_eq!(sparse.shared_expert_intermediate_size, 512);
        assert_eq!(sparse.linear_conv_kernel_dim, 4);
        assert!(sparse.is_moe_layer(1), "every Qwen3.5 layer routes");
        assert!(
            !sparse.tie_word_embeddings,
            "the wrapper decides, false by default"
        );
        // The wrapper's end token stands for a text model that names none.
        assert_eq!(config.end_tokens(), &[] as &[u32]);
        let wrapped = QWEN35.replace(
            "\"vision_config\"",
            "\"eos_token_id\": 9, \"vision_config\"",
        );
        assert_eq!(Config::parse(&wrapped).unwrap().end_tokens(), &[9]);
        let both = wrapped.replace(
            "\"vocab_size\": 10,",
            "\"vocab_size\": 10, \"eos_token_id\": [4, 3],",
        );
        assert_eq!(Config::parse(&both).unwrap().end_tokens(), &[4, 3]);
        let scaled = QWEN35.replace("\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"");
        assert!(Config::parse(&scaled).is_err());
        // Huge state per sequence is refused.
        let huge = QWEN35
            .replace(
                "\"linear_key_head_dim\": 16",
                "\"linear_key_head_dim\": 1000000",
            )
            .replace(
                "\"linear_value_head_dim\": 16",
                "\"linear_value_head_dim\": 32",
            );
        assert!(matches!(Config::parse(&huge), Err(LoadError::Config(m)) if m.contains("state")));
        // So is a modest state in very many layers.
        let deep = QWEN35
            .replace("\"num_hidden_layers\": 4", "\"num_hidden_layers\": 1000")
            .replace(
                "\"linear_key_head_dim\": 16",
                "\"linear_key_head_dim\": 1024",
            )
            .replace(
                "\"linear_value_head_dim\": 16",
                "\"linear_value_head_dim\": 1024",
            );
        assert!(matches!(Config::parse(&deep), Err(LoadError::Config(m)) if m.contains("state")));
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
