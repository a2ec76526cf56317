//! Model families: the Qwen MoE decoders in one file, Qwen3.5's gated DeltaNet beside it.

mod deltanet;
pub mod qwen_moe;
