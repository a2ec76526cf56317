//! Experts on an NVIDIA GPU through cudarc, with the CUDA libraries loaded at run time (so
//! this builds on machines without a toolkit). The kernels are compiled by NVRTC from the
//! source below and follow the CPU backend's arithmetic exactly (`cpu`'s header for f32
//! weights, `bf16`'s for bf16 ones): the same 16-lane reduction orders of fused
//! multiply-adds (`__fmaf_rn`), the inputs of a bf16 product rounded to bf16 by the same bit
//! operations, round-to-nearest adds and multiplies elsewhere that are never contracted, no
//! flushing of subnormals, and the same `exp` polynomial, so a GPU expert returns the CPU
//! expert's bits.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::moe::{canonical_nans, ExpertError, ExpertExecutor, ExpertRequest};
use crate::weights::DType;

const KERNELS: &str = r#"
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(unsigned short bits) { return __uint_as_float(((unsigned int)bits) << 16); }

// An input value of a bf16 product rounded to bf16 as the CPU's round_bf16 does: to
// nearest, ties to even, on the bits; a NaN stays a quiet NaN. Widened back (exact).
__device__ __forceinline__ float round_bf16(float v) {
    unsigned int bits = __float_as_uint(v);
    if (isnan(v)) return widen((unsigned short)((bits >> 16) | 0x0040u));
    return widen((unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16));
}
__device__ __forceinline__ float input(float v, float) { return v; }
__device__ __forceinline__ float input(float v, unsigned short) { return round_bf16(v); }

// out[r][j] = dot(x[r], w[j]) in the CPU's order. One half-warp per output (neighbouring
// lanes read neighbouring weights, so the reads coalesce). f32 weights: lane l sums the
// products at 16c + l in ascending c. bf16 weights, with the inputs rounded to bf16: lane l
// takes the pair 2l + 1, 2l of each chunk of 32, odd element first. Then the lanes fold
// pairwise (8, 4, 2, 1) through shuffles, and lane 0 adds the tail past the last full chunk
// in order.
template <typename W>
__device__ void matmul_t(const float* x, const W* w, float* out, int rows, int k, int n) {
    const bool pairs = sizeof(W) == 2;
    int lane = threadIdx.x & 15;
    int j = (blockIdx.x * blockDim.x + threadIdx.x) >> 4;
    int r = blockIdx.y;
    bool active = j < n && r < rows;
    const float* xr = x + (size_t)r * k;
    const W* wj = w + (size_t)(active ? j : 0) * k;
    W kind = 0;
    int chunk = pairs ? 32 : 16, chunks = k / chunk;
    float acc = 0.0f;
    if (active)
        for (int c = 0; c < chunks; ++c) {
            int i = pairs ? c * 32 + 2 * lane + 1 : c * 16 + lane;
            acc = __fmaf_rn(input(xr[i], kind), widen(wj[i]), acc);
            if (pairs) acc = __fmaf_rn(input(xr[i - 1], kind), widen(wj[i - 1]), acc);
        }
    // Every lane of the warp takes part in each shuffle, active or not.
    for (int width = 8; width >= 1; width /= 2) {
        float other = __shfl_down_sync(0xffffffffu, acc, width, 16);
        if (lane < width) acc = __fadd_rn(acc, other);
    }
    if (!active || lane != 0) return;
    for (int i = chunks * chunk; i < k; ++i) acc = __fmaf_rn(input(xr[i], kind), widen(wj[i]), acc);
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
    // SAFETY: this only tries to open the CUDA driver library (dlopen), touching nothing else.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    // SAFETY: as above, this only tries to open the NVRTC library.
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
        for layer in config.moe_layers() {
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
                        DType::Quantized(_) => {
                            return Err(CudaError::Driver(format!(
                                "{prefix}.{name} is quantized ({:?}): the CUDA backend runs f32, f16 and bf16 experts",
                                weight.dtype()
                            )))
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

    /// `out = x * w^T` for `rows` rows of `k` values and `n` outputs each.
    fn matmul(
        &self,
        x: &CudaView<f32>,
        w: &DeviceWeight,
        (rows, k, n): (usize, usize, usize),
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        let (rows_i, k_i, n_i) = (rows as i32, k as i32, n as i32);
        // 16 threads (a half-warp) per output.
        let config = LaunchConfig {
            grid_dim: ((n * 16).div_ceil(128) as u32, rows as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = match w {
            DeviceWeight::F32(w) => {
                let mut launch = self.stream.launch_builder(&self.matmul_f32);
                launch.arg(x).arg(w);
                launch
            }
            DeviceWeight::Bf16(w) => {
                let mut launch = self.stream.launch_builder(&self.matmul_bf16);
                launch.arg(x).arg(w);
                launch
            }
        };
        launch.arg(out).arg(&rows_i).arg(&k_i).arg(&n_i);
        // SAFETY: the arguments match the kernel's signature and the callers' views hold the
        // rows x k, n x k and rows x n values the kernel indexes.
        unsafe { launch.launch(config) }.map_err(driver)?;
        Ok(())
    }

    /// A layer step's requests in one round trip: every request's rows go to the GPU in one
    /// copy, each expert runs on its slice of them, and the partials come back in one copy.
    fn evaluate_layer(
        &self,
        experts: &[&DeviceExpert],
        requests: &[ExpertRequest],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        let h = self.hidden;
        let counts: Vec<usize> = requests.iter().map(|r| r.rows.len() / h.max(1)).collect();
        let total: usize = counts.iter().sum();
        if total == 0 {
            return Ok(vec![Vec::new(); requests.len()]);
        }
        let rows: Vec<f32> = requests
            .iter()
            .zip(&counts)
            .flat_map(|(r, n)| r.rows[..n * h].iter().copied())
            .collect();
        let inner: usize = experts.iter().zip(&counts).map(|(e, n)| n * e.width).sum();
        let x = self.stream.clone_htod(&rows).map_err(driver)?;
        let mut gate = self.stream.alloc_zeros::<f32>(inner).map_err(driver)?;
        let mut up = self.stream.alloc_zeros::<f32>(inner).map_err(driver)?;
        let mut out = self.stream.alloc_zeros::<f32>(total * h).map_err(driver)?;
        // Each request's place in the row, inner and output buffers.
        let spans: Vec<(usize, usize, usize)> = experts
            .iter()
            .zip(&counts)
            .scan((0, 0), |(row, mid), (e, &n)| {
                let span = (*row, *mid, n);
                (*row, *mid) = (*row + n, *mid + n * e.width);
                Some(span)
            })
            .collect();
        for (expert, &(row, mid, n)) in experts.iter().zip(&spans).filter(|(_, s)| s.2 > 0) {
            let (x, inner) = (x.slice(row * h..(row + n) * h), mid..mid + n * expert.width);
            let shape = (n, h, expert.width);
            self.matmul(&x, &expert.gate, shape, &mut gate.slice_mut(inner.clone()))?;
            self.matmul(&x, &expert.up, shape, &mut up.slice_mut(inner))?;
        }
        let inner_i = inner as i32;
        let config = LaunchConfig {
            grid_dim: (inner.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&self.swiglu);
        launch.arg(&mut gate).arg(&up).arg(&inner_i);
        // SAFETY: gate and up both hold `inner` values, as the kernel's signature expects.
        unsafe { launch.launch(config) }.map_err(driver)?;
        for (expert, &(row, mid, n)) in experts.iter().zip(&spans).filter(|(_, s)| s.2 > 0) {
            let activated = gate.slice(mid..mid + n * expert.width);
            let mut partial = out.slice_mut(row * h..(row + n) * h);
            self.matmul(&activated, &expert.down, (n, expert.width, h), &mut partial)?;
        }
        let all = self.stream.clone_dtoh(&out).map_err(driver)?;
        Ok(spans
            .iter()
            .map(|&(row, _, n)| all[row * h..(row + n) * h].to_vec())
            .collect())
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
        let experts = requests
            .iter()
            .map(|r| {
                self.experts
                    .get(&(layer, r.expert))
                    .ok_or(ExpertError::NotHeld {
                        layer,
                        expert: r.expert,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut partials = catching(|| self.evaluate_layer(&experts, requests))
            .map_err(|e| ExpertError::Device(e.to_string()))?;
        for partial in &mut partials {
            canonical_nans(partial);
        }
        Ok(partials)
    }
}
