//! Model families, one file each.

pub mod qwen_moe;
