//! Kvasir's inference engine: Hugging Face Qwen3-MoE (and Qwen2-MoE) checkpoints in
//! safetensors, deterministic CPU kernels, and experts as a pluggable pure function.
//!
//! The per-token path: `model::qwen_moe::Model::forward` runs attention and the router,
//! `moe::MoeBlock` groups rows by expert and hands them to an `moe::ExpertExecutor`, and
//! combines the partials in ascending expert order.

// Unsafe code (SIMD kernels, memory maps, GPU launches) says what it relies on.
#![warn(clippy::missing_safety_doc, clippy::undocumented_unsafe_blocks)]

pub mod agreement;
pub mod checkpoint;
pub mod config;
pub mod generate;
pub mod gguf;
pub mod kernels;
pub mod model;
pub mod moe;
pub mod synth;
pub mod tokenizer;
pub mod weights;

/// The version of the reference arithmetic: the kernels' written order of every rounding,
/// which fixes each answer's bits (the tests pin them). A change that moves any pinned bit
/// is a new version, and a chain's model pins say which version their answers are judged by.
pub const ARITHMETIC_VERSION: u32 = 1;

use std::path::Path;

/// Why a checkpoint, config or tokenizer could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("config: {0}")]
    Config(String),
    #[error("{file}: not a usable safetensors checkpoint: {reason}")]
    Format { file: String, reason: String },
    #[error("tensor {0} is missing from the checkpoint")]
    Missing(String),
    #[error("tensor {name} has shape {found:?}, the config implies {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {name} has dtype {dtype}; this engine reads f32, bf16 and f16, and Q8_0, Q4_0, Q4_K, Q5_K and Q6_K from GGUF files")]
    DType { name: String, dtype: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

impl LoadError {
    pub(crate) fn io(path: &Path, error: std::io::Error) -> LoadError {
        LoadError::Io(path.display().to_string(), error)
    }
}
