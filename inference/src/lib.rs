//! The Kvasir inference engine (Qwen3-MoE on CPU and CUDA, experts as a pluggable pure
//! function). A stub until the inference issue fills it; nothing depends on it yet.
