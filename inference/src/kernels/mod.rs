//! Numeric kernels, apart from any model. `cpu` is the reference backend: bit-exact for a
//! given row whatever the thread count, the other rows in the call, or the CPU it runs on.
//! `cuda` (feature `cuda`) runs experts on an NVIDIA GPU with the same arithmetic.

pub mod attention;
pub mod bf16;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod quant_x86;
#[cfg(target_arch = "x86_64")]
mod simd;
