//! Experts on an NVIDIA GPU through cudarc, with the CUDA libraries loaded at run time (so
//! this builds on machines without a toolkit). The kernels are compiled by NVRTC from the
//! source below and follow the CPU backend's arithmetic exactly: the same 16-lane reduction
//! order, round-to-nearest multiplies and adds that are never fused, and the same `exp`
//! polynomial, so a GPU expert returns the CPU expert's bits.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::weights::DType;
use crate::moe::{evaluate_held, ExpertError, ExpertExecutor, ExpertRequest};

const KERNELS: &str = r#"
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(unsigned short bits) { return __uint_as_float(((unsigned int)bits) << 16); }

// out[r][j] = dot(x[r], w[j]) in the CPU's order. One half-warp per output: lane l sums the
// products at 16c + l in ascending c (neighbouring lanes read neighbouring weights, so the
// reads coalesce), the lanes fold pairwise (8, 4, 2, 1) through shuffles, and lane 0 adds
// the tail past the last full 16 in order.
template <typename W>
__device__ void matmul_t(const float* x, const W* w, float* out, int rows, int k, int n) {
    int lane = threadIdx.x & 15;
    int j = (blockIdx.x * blockDim.x + threadIdx.x) >> 4;
    int r = blockIdx.y;
    bool active = j < n && r < rows;
    const float* xr = x + (size_t)r * k;
    const W* wj = w + (size_t)(active ? j : 0) * k;
    int chunks = k / 16;
    float acc = 0.0f;
    if (active)
        for (int c = 0; c < chunks; ++c)
            acc = __fadd_rn(acc, __fmul_rn(xr[c * 16 + lane], widen(wj[c * 16 + lane])));
    // Every lane of the warp takes part in each shuffle, active or not.
    for (int width = 8; width >= 1; width /= 2) {
        float other = __shfl_down_sync(0xffffffffu, acc, width, 16);
        if (lane < width) acc = __fadd_rn(acc, other);
    }
    if (!active || lane != 0) return;
    for (int i = chunks * 16; i < k; ++i) acc = __fadd_rn(acc, __fmul_rn(xr[i], widen(wj[i])));
    out[(size_t)r * n + j] = acc;
}

extern "C" __global__ void matmul_t_f32(const float* x, const float* w, float* out, int rows, int k, int n) {
    matmul_t(x, w, out, rows, k, n);
}

extern "C" __global__ void matmul_t_bf16(const float* x, const unsigned short* w, float* out, int rows, int k, int n) {
    matmul_t(x, w, out, rows, k, n);
}

__device__ float kvasir_exp(float x) {
    if (isnan(x)) return x;
    if (x > 88.72f) return __int_as_float(0x7f800000);
    if (x < -103.97f) return 0.0f;
    float k = roundf(__fmul_rn(x, 1.44269504088896341f));
    float r = __fadd_rn(__fadd_rn(x, -__fmul_rn(k, 0.69314575f)), -__fmul_rn(k, 1.4286068e-6f));
    float p = __fadd_rn(0.008333334f, __fmul_rn(r, 0.001388889f));
    p = __fadd_rn(0.041666668f, __fmul_rn(r, p));
    p = __fadd_rn(0.16666667f, __fmul_rn(r, p));
    p = __fadd_rn(0.5f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    int ki = (int)k;
    int k1 = ki, k2 = 0;
    if (ki < -120) { k1 = ki + 60; k2 = -60; } else if (ki > 120) { k1 = ki - 60; k2 = 60; }
    return __fmul_rn(__fmul_rn(p, __int_as_float((k1 + 127) << 23)), __int_as_float((k2 + 127) << 23));
}

extern "C" __global__ void swiglu(float* gate, const float* up, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float g = gate[i];
    float silu = __fdiv_rn(g, __fadd_rn(1.0f, kvasir_exp(-g)));
    gate[i] = __fmul_rn(silu, up[i]);
}
"#;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("the CUDA driver library (libcuda) is not installed or not on the library path")]
    NoDriver,
    #[error(
        "the NVRTC library (libnvrtc.so or libnvrtc.so.12, CUDA 12.8 or newer) is not installed \
         or not on the library path; with CUDA 13 add the toolkit's lib64 to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("compiling the CUDA kernels: {0}")]
    Compile(String),
    #[error(transparent)]
    Load(#[from] crate::LoadError),
}

fn driver(e: impl std::fmt::Display) -> CudaError {
    CudaError::Driver(e.to_string())
}

/// Runs a step that calls into the CUDA libraries. cudarc panics when a library lacks a
/// function it needs (a CUDA older than the 12.8 bindings): that becomes an error, so a worker
/// with the wrong CUDA reports it instead of crashing.
fn catching<T>(step: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
    std::panic::catch_unwind(AssertUnwindSafe(step)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a CUDA library failed");
        Err(CudaError::Driver(message.to_string()))
    })
}

/// Whether the CUDA driver and NVRTC libraries can be loaded; checked before cudarc touches
/// them, since cudarc panics when a library is missing.
pub fn check_libraries() -> Result<(), CudaError> {
    // Safety: these only try to open the shared libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    Ok(())
}

/// A weight matrix in GPU memory: bf16 stays bf16 (the kernel widens it, exactly, as it
/// reads), any other dtype is widened to f32 on upload (also exact).
enum DeviceWeight {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

struct DeviceExpert {
    gate: DeviceWeight,
    up: DeviceWeight,
    down: DeviceWeight,
    width: usize,
}

/// Experts held in GPU memory.
pub struct CudaExperts {
    stream: Arc<CudaStream>,
    matmul_f32: CudaFunction,
    matmul_bf16: CudaFunction,
    swiglu: CudaFunction,
    hidden: usize,
    experts: HashMap<(usize, usize), DeviceExpert>,
}

impl CudaExperts {
    /// Loads the experts `(layer, expert)` for which `keep` is true onto GPU `ordinal`.
    pub fn load(
        checkpoint: &Checkpoint,
        config: &Config,
        ordinal: usize,
        keep: impl Fn(usize, usize) -> bool,
    ) -> Result<CudaExperts, CudaError> {
        check_libraries()?;
        catching(|| Self::load_checked(checkpoint, config, ordinal, keep))
    }

    fn load_checked(
        checkpoint: &Checkpoint,
        config: &Config,
        ordinal: usize,
        keep: impl Fn(usize, usize) -> bool,
    ) -> Result<CudaExperts, CudaError> {
        let context = CudaContext::new(ordinal).map_err(driver)?;
        let stream = context.default_stream();
        let ptx =
            cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| CudaError::Compile(e.to_string()))?;
        let module = context.load_module(ptx).map_err(driver)?;
        let matmul_f32 = module.load_function("matmul_t_f32").map_err(driver)?;
        let matmul_bf16 = module.load_function("matmul_t_bf16").map_err(driver)?;
        let swiglu = module.load_function("swiglu").map_err(driver)?;
        let (hidden, width) = (config.hidden_size, config.moe_intermediate_size);
        let mut experts = HashMap::new();
        for layer in (0..config.num_hidden_layers).filter(|l| config.is_moe_layer(*l)) {
            for expert in (0..config.num_experts).filter(|e| keep(layer, *e)) {
                let prefix = format!("model.layers.{layer}.mlp.experts.{expert}");
                let upload = |name: &str, shape: [usize; 2]| -> Result<DeviceWeight, CudaError> {
                    let weight = checkpoint.tensor(&format!("{prefix}.{name}.weight"), &shape)?;
                    Ok(match weight.dtype() {
                        DType::BF16 => {
                            let bits: Vec<u16> = (0..shape[0])
                                .filter_map(|row| weight.row_bf16(row))
                                .flatten()
                                .copied()
                                .collect();
                            DeviceWeight::Bf16(stream.clone_htod(&bits).map_err(driver)?)
                        }
                        DType::F32 | DType::F16 => {
                            DeviceWeight::F32(stream.clone_htod(&weight.to_f32()).map_err(driver)?)
                        }
                    })
                };
                let device = DeviceExpert {
                    gate: upload("gate_proj", [width, hidden])?,
                    up: upload("up_proj", [width, hidden])?,
                    down: upload("down_proj", [hidden, width])?,
                    width,
                };
                experts.insert((layer, expert), device);
            }
        }
        Ok(CudaExperts {
            stream,
            matmul_f32,
            matmul_bf16,
            swiglu,
            hidden,
            experts,
        })
    }

    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &DeviceWeight,
        rows: usize,
        k: usize,
        n: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let mut out = self.stream.alloc_zeros::<f32>(rows * n).map_err(driver)?;
        let (rows_i, k_i, n_i) = (rows as i32, k as i32, n as i32);
        // 16 threads (a half-warp) per output.
        let config = LaunchConfig {
            grid_dim: ((n * 16).div_ceil(128) as u32, rows as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = match w {
            DeviceWeight::F32(_) => self.stream.launch_builder(&self.matmul_f32),
            DeviceWeight::Bf16(_) => self.stream.launch_builder(&self.matmul_bf16),
        };
        launch.arg(x);
        match w {
            DeviceWeight::F32(w) => launch.arg(w),
            DeviceWeight::Bf16(w) => launch.arg(w),
        };
        launch
            .arg(&mut out)
            .arg(&rows_i)
            .arg(&k_i)
            .arg(&n_i);
        // Safety: the arguments match the kernel's signature and every buffer holds the
        // rows x k, n x k and rows x n values the kernel indexes.
        unsafe { launch.launch(config) }.map_err(driver)?;
        Ok(out)
    }

    fn forward(&self, expert: &DeviceExpert, rows: &[f32]) -> Result<Vec<f32>, CudaError> {
        let n = rows.len() / self.hidden.max(1);
        let x = self.stream.clone_htod(rows).map_err(driver)?;
        let mut gate = self.matmul(&x, &expert.gate, n, self.hidden, expert.width)?;
        let up = self.matmul(&x, &expert.up, n, self.hidden, expert.width)?;
        let count = n * expert.width;
        let count_i = count as i32;
        let config = LaunchConfig {
            grid_dim: (count.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.swiglu);
        launch.arg(&mut gate).arg(&up).arg(&count_i);
        // Safety: gate and up both hold `count` values.
        unsafe { launch.launch(config) }.map_err(driver)?;
        let out = self.matmul(&gate, &expert.down, n, expert.width, self.hidden)?;
        self.stream.clone_dtoh(&out).map_err(driver)
    }
}

impl ExpertExecutor for CudaExperts {
    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.experts.contains_key(&(layer, expert))
    }

    fn evaluate(
        &self,
        layer: usize,
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, ExpertError> {
        evaluate_held(&self.experts, layer, requests, |expert, rows| {
            catching(|| self.forward(expert, rows)).map_err(|e| ExpertError::Device(e.to_string()))
        })
    }
}
