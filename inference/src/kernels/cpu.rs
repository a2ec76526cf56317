//! CPU kernels. Determinism rules: every output element is reduced in one fixed order that
//! depends only on the vector length (never on threads, row count or blocking), and
//! transcendental functions are this module's own code rather than the platform's libm,
//! which differs between systems.
//!
//! # The reference arithmetic
//!
//! A matrix product with bf16 weights (`matmul_t`: experts, dense layers, attention
//! projections, routers, the lm head of a bf16 checkpoint) has its own, written down in
//! `bf16`'s header: inputs rounded to bf16, then pairs of fused multiply-adds. Quantized
//! weights (Q8_0, Q4_0: GGUF files) have theirs in `quant`'s: an exact integer product,
//! rounded once. Every other
//! dot product (f32 and f16 weights; attention scores, norms) is this sum of `a[i] * b[i]`
//! over `i < k`, in f32 with IEEE 754 rounding to nearest even, subnormals kept (never
//! flushed):
//!
//! 1. f16 weights are first widened to f32 (exact).
//! 2. Lane `l` of 16 starts at `+0.0` and, for `c = 0, 1, ...` while `16c + 16 <= k`, becomes
//!    `fma(a[16c + l], b[16c + l], lane)`: a fused multiply-add, the product never rounded
//!    by itself (IEEE 754 `fusedMultiplyAdd`, which every backend has in hardware: x86's
//!    FMA3, Arm's `fmla`, CUDA's `__fmaf_rn`, or libm's correctly rounded `fmaf`).
//! 3. The lanes fold pairwise with plain adds: lane `l += lane l + 8` for `l < 8`, then
//!    `+ 4`, `+ 2`, `+ 1`; the sum is lane 0.
//! 4. The tail `i = k / 16 * 16 ..k` continues in ascending `i`: `sum = fma(a[i], b[i], sum)`.
//!
//! Because the product is fused, there is no separate rounding of a product that falls
//! below f32's normal range (bf16 operands reach it easily): such a product enters the sum
//! at full precision on every backend, so underflow needs no rule of its own. A row's sum
//! never depends on the thread count, the other rows of the call, the blocking of columns or
//! the instruction set; the AVX2 and AVX-512 kernels (`simd`) and CUDA give these bits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use super::bf16::{self, Rows};
use super::quant::{self, BlockFormat, QuantizedRow};
use crate::weights::{DType, Weight};

/// Lanes of the fixed-order dot product.
pub(super) const LANES: usize = 16;

/// The lanes' partial sums folded pairwise: 8, 4, 2, 1.
#[inline(always)]
pub(super) fn fold_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

/// `sum(a[i] * b[i])` in the reference order (the module's header): 16 lanes of fused
/// multiply-adds, folded pairwise, then the tail in order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() != Isa::Portable {
        // SAFETY: every kernel above the portable one needs FMA, which `isa` checked.
        return unsafe { dot_fma(a, b) };
    }
    dot_lanes(a, b, f32_lane_end(a.len()))
}

/// `dot` built with FMA instructions: without them `mul_add` is a call to libm's `fmaf`.
///
/// # Safety
///
/// The CPU has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b, f32_lane_end(a.len()))
}

/// Where the lanes of the f32 reference stop and its in-order tail begins.
#[inline(always)]
pub(super) fn f32_lane_end(k: usize) -> usize {
    k / LANES * LANES
}

/// The fixed-order dot product: 16 lanes of fused multiply-adds over `..end` (a multiple of
/// 16), folded, then the tail `end..` in order. With `end` from `f32_lane_end` it is the f32
/// reference; over rows in `bf16`'s lane order, with `bf16::lane_end`, the bf16 one.
#[inline(always)]
pub(super) fn dot_lanes(a: &[f32], b: &[f32], end: usize) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    for (x, y) in a[..end]
        .chunks_exact(LANES)
        .zip(b[..end].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    // Loops, not closures, around `mul_add`: a closure left out of line would be compiled
    // without the caller's FMA feature, and its `mul_add` become a call to libm's `fmaf`.
    let mut sum = fold_lanes(acc);
    for (x, y) in a[end..].iter().zip(&b[end..]) {
        sum = x.mul_add(*y, sum);
    }
    sum
}

/// `dot_lanes` of four rows against one weight row, sharing its loads; each result has the
/// bits `dot_lanes` gives that row alone.
#[inline(always)]
fn dot4(a: [&[f32]; 4], b: &[f32], end: usize) -> [f32; 4] {
    let (mut s0, mut s1, mut s2, mut s3) =
        ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let (x0, x1, x2, x3) = (
        a[0].chunks_exact(LANES),
        a[1].chunks_exact(LANES),
        a[2].chunks_exact(LANES),
        a[3].chunks_exact(LANES),
    );
    for ((((y, r0), r1), r2), r3) in b[..end].chunks_exact(LANES).zip(x0).zip(x1).zip(x2).zip(x3) {
        for l in 0..LANES {
            s0[l] = r0[l].mul_add(y[l], s0[l]);
            s1[l] = r1[l].mul_add(y[l], s1[l]);
            s2[l] = r2[l].mul_add(y[l], s2[l]);
            s3[l] = r3[l].mul_add(y[l], s3[l]);
        }
    }
    let finish = |acc: [f32; LANES], row: &[f32]| {
        (end..b.len()).fold(fold_lanes(acc), |sum, i| row[i].mul_add(b[i], sum))
    };
    [
        finish(s0, a[0]),
        finish(s1, a[1]),
        finish(s2, a[2]),
        finish(s3, a[3]),
    ]
}

/// Below this many input rows a bf16 weight row is widened inside the dot product; above
/// it, widening once into a buffer and reusing it for every row is cheaper.
pub(super) const FUSED_BF16_MAX_ROWS: usize = 2;

/// Output columns handed to one task; fixed so work splitting never depends on the caller.
const COLUMNS_PER_TASK: usize = 16;

/// The input rows of a product as the fused multiply-add kernels take them.
#[derive(Clone, Copy)]
pub(super) enum Input<'a> {
    /// As given, for f32 and f16 weights (the f32 reference).
    F32(&'a [f32]),
    /// For bf16 weights: rounded to bf16 and widened back in `bf16`'s lane order.
    LaneOrder(&'a [f32]),
}

/// `matmul_t` for quantized weights, in `kernels::quant`'s arithmetic: each input row
/// quantized once, then every column's exact product with it. The product is exact, so how
/// columns are spread over threads, and which instructions multiply, cannot change a bit.
fn matmul_quantized(x: &[f32], rows: usize, w: &Weight, format: BlockFormat, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    let quantized: Vec<QuantizedRow> = x.chunks_exact(k).map(quant::quantize_row).collect();
    // Column-major: each task fills its columns' outputs for every row.
    let mut by_column = vec![0f32; n * rows];
    let isa = isa();
    by_column
        .par_chunks_mut(COLUMNS_PER_TASK * rows)
        .enumerate()
        .for_each(|(task, out)| {
            let first = task * COLUMNS_PER_TASK;
            let columns = first..first + out.len() / rows;
            quantized_columns(isa, format, w, columns, &quantized, out);
        });
    for (j, column) in by_column.chunks_exact(rows).enumerate() {
        for (r, value) in column.iter().enumerate() {
            out[r * n + j] = *value;
        }
    }
}

/// `quant::column_products` with the fastest integer products `isa` allows.
pub(super) fn quantized_columns(
    isa: Isa,
    format: BlockFormat,
    w: &Weight,
    columns: std::ops::Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::quant_x86;
        // The features are checked here, not taken from `isa` (which only caps the choice), so
        // that no caller can ask for a tier the CPU lacks.
        let avx2 = std::is_x86_feature_detected!("avx2");
        if isa >= Isa::Avx512
            && avx2
            && std::is_x86_feature_detected!("avx512vnni")
            && std::is_x86_feature_detected!("avx512vl")
        {
            // SAFETY: AVX2, VNNI and VL, checked just above.
            return unsafe { quant_x86::column_products_vnni(format, w, columns, xs, out) };
        }
        if isa >= Isa::Avx2 && avx2 {
            // SAFETY: AVX2, checked just above.
            return unsafe { quant_x86::column_products_avx2(format, w, columns, xs, out) };
        }
    }
    let _ = isa;
    quant::column_products::<quant::Portable>(format, w, columns, xs, out)
}

/// `out[r][j] = dot(x[r], w[j])` for `x` of `rows x k` and `w` of `n x k` (the layout of a
/// Hugging Face Linear weight), giving `out` of `rows x n`, in the reference arithmetic of
/// `w`'s dtype (the module's header). Columns are spread over threads; each weight row is
/// read once for every input row, so a batch costs one pass over the weights.
pub fn matmul_t(x: &[f32], rows: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), rows * k, "matmul_t input shape");
    assert_eq!(out.len(), rows * n, "matmul_t output shape");
    // No rows, nothing to compute (and no chunk of zero size to hand out): a request may
    // route no token to an expert, and a hostile one must not panic the node.
    if rows == 0 {
        return;
    }
    if RECORDING.load(Ordering::Relaxed) {
        record(Shape {
            rows,
            n,
            k,
            dtype: w.dtype(),
        });
    }
    if let Some(format) = w.dtype().block_format() {
        return matmul_quantized(x, rows, w, format, out);
    }
    let isa = isa();
    // bf16 weights: the rows rounded once, for every column; `vdpbf16ps` where it is exact.
    let rounded = (w.dtype() == DType::BF16).then(|| Rows::round(x));
    let dpbf16 = rounded
        .as_ref()
        .filter(|rounded| has_dpbf16(isa) && rounded.exponents.dpbf16_exact(w.bf16_exponents(), k));
    let lane_order = match (&rounded, dpbf16) {
        (Some(rounded), None) => rounded.in_lane_order(k),
        _ => Vec::new(),
    };
    let input = match rounded {
        Some(_) => Input::LaneOrder(&lane_order),
        None => Input::F32(x),
    };
    let mut blocks = vec![0f32; n * rows];
    blocks
        .par_chunks_mut(COLUMNS_PER_TASK * rows)
        .enumerate()
        .for_each(|(task, block)| {
            let first = task * COLUMNS_PER_TASK;
            match (isa, dpbf16) {
                // SAFETY: `isa` checked with `is_x86_feature_detected!` that this CPU has
                // the features each kernel needs, and for `vdpbf16ps` that it gives the
                // reference bits; `dpbf16_exact` that these operands are within its bounds.
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512Bf16, Some(rounded)) => unsafe {
                    super::simd::column_block_dpbf16(&rounded.bits, rows, w, first, block)
                },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512 | Isa::Avx512Bf16, _) => unsafe {
                    super::simd::column_block_avx512(input, rows, w, first, block)
                },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, _) => unsafe {
                    super::simd::column_block_avx2(input, rows, w, first, block)
                },
                _ => column_block(input, rows, w, first, block),
            }
        });
    // A task's block holds its columns row by row: each row's run goes into place whole.
    for (task, block) in blocks.chunks(COLUMNS_PER_TASK * rows).enumerate() {
        let (first, width) = (task * COLUMNS_PER_TASK, block.len() / rows);
        for (r, run) in block.chunks(width).enumerate() {
            out[r * n + first..r * n + first + width].copy_from_slice(run);
        }
    }
}

/// A matrix product's shape as `matmul_t` saw it: `rows x k` times `(n x k)^T`, the
/// weights stored as `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: DType,
}

/// Whether `matmul_t` records shapes: one relaxed load a call when off.
static RECORDING: AtomicBool = AtomicBool::new(false);
static RECORDED: Mutex<Vec<Shape>> = Mutex::new(Vec::new());

fn record(shape: Shape) {
    RECORDED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(shape);
}

/// Runs `f` and returns the shapes of the matrix products made meanwhile, on any thread, in
/// the order they began: a benchmark replays a pass's matrix work on a reference library
/// with them. (Calls overlapping in time share one record.)
pub fn record_shapes<R>(f: impl FnOnce() -> R) -> (R, Vec<Shape>) {
    let take = || {
        std::mem::take(
            &mut *RECORDED
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    };
    take();
    RECORDING.store(true, Ordering::Relaxed);
    let result = f();
    RECORDING.store(false, Ordering::Relaxed);
    (result, take())
}

/// The instruction sets the kernels are built for, slowest first; all give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust: on Arm, say, where `mul_add` is the `fmla` instruction.
    Portable,
    /// x86 AVX2 with FMA.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// x86 AVX-512F with FMA.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// x86 AVX-512F with FMA, and AVX-512 BF16's `vdpbf16ps` for bf16 weights (where it
    /// gives the reference bits: `bf16`'s header).
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
}

/// The fastest kernel this CPU runs, found once, or a slower one named by the environment
/// variable `KVASIR_KERNELS` (`portable`, `avx2` or `avx512`): so that tests and benchmarks
/// can run every path on one machine. (A faster one than the CPU has is never taken, nor
/// `vdpbf16ps` where it fails its self-check.)
pub fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let fma = std::is_x86_feature_detected!("fma");
            let avx2 = std::is_x86_feature_detected!("avx2");
            let avx512 = fma && avx2 && std::is_x86_feature_detected!("avx512f");
            let detected = if avx512
                && std::is_x86_feature_detected!("avx512bf16")
                // SAFETY: the CPU has AVX-512F, AVX-512 BF16 and FMA, checked just above.
                && unsafe { super::simd::dpbf16_self_check() }
            {
                Isa::Avx512Bf16
            } else if avx512 {
                Isa::Avx512
            } else if fma && avx2 {
                Isa::Avx2
            } else {
                Isa::Portable
            };
            let requested = match std::env::var("KVASIR_KERNELS").as_deref() {
                Ok("portable") => Isa::Portable,
                Ok("avx2") => Isa::Avx2,
                Ok("avx512") => Isa::Avx512,
                _ => Isa::Avx512Bf16,
            };
            detected.min(requested)
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    Isa::Portable
}

/// Whether `isa` multiplies bf16 weights with `vdpbf16ps`.
fn has_dpbf16(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa == Isa::Avx512Bf16
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// Columns `first..first + width` of the product into `block`, row by row:
/// `block[r * width + c]` is column `first + c` of row `r`.
#[inline(always)]
fn column_block(x: Input<'_>, rows: usize, w: &Weight, first: usize, block: &mut [f32]) {
    let (k, width) = (w.cols(), block.len() / rows);
    let (x, end) = match x {
        Input::F32(x) => (x, f32_lane_end(k)),
        Input::LaneOrder(x) => (x, bf16::lane_end(k)),
    };
    let mut wrow = vec![0f32; k];
    let row = |r: usize| &x[r * k..(r + 1) * k];
    for c in 0..width {
        match w.row_bf16(first + c) {
            Some(bits) => bf16::widen_in_lane_order(bits, &mut wrow),
            None => w.row_f32(first + c, &mut wrow),
        }
        let mut put = |r: usize, value: f32| block[r * width + c] = value;
        let tiled = rows / 4 * 4;
        for r in (0..tiled).step_by(4) {
            let sums = dot4([row(r), row(r + 1), row(r + 2), row(r + 3)], &wrow, end);
            for (i, sum) in sums.into_iter().enumerate() {
                put(r + i, sum);
            }
        }
        for r in tiled..rows {
            put(r, dot_lanes(row(r), &wrow, end));
        }
    }
}

/// `exp(x)` in f32 without libm: `2^k * p(r)` with `x = k ln2 + r`, `|r| <= ln2 / 2`, and a
/// degree-6 polynomial for `e^r`. Relative error about 2e-7; the same bits everywhere.
///
/// Without branches: the arithmetic runs on `x` clamped to the finite range, which keeps
/// `k` in `-150..=128`, and the answer for NaN and out-of-range `x` is chosen at the end, so
/// that a loop of `exp` (a softmax's, say) compiles to vector instructions with these bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const LOW: f32 = -103.97;
    const HIGH: f32 = 88.72;
    let clamped = x.clamp(LOW, HIGH);
    let k = round_half_away(clamped * std::f32::consts::LOG2_E);
    let kf = k as f32;
    let r = (clamped - kf * LN2_HI) - kf * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    // 2^k through the exponent bits, in two steps near the ends of the range so each factor
    // stays a normal number.
    let k2 = if k <= -121 {
        -60
    } else if k >= 121 {
        60
    } else {
        0
    };
    let scale = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let value = p * scale(k - k2) * scale(k2);
    if x.is_nan() {
        x
    } else if x > HIGH {
        f32::INFINITY
    } else if x < LOW {
        0.0
    } else {
        value
    }
}

/// `t.round()` (half away from zero) for `|t| < 2^31`, as an integer: just under one half
/// added with `t`'s sign, then truncated by the cast. Plain arithmetic, so that a loop of it
/// vectorizes on any x86 (`round` needs SSE4.1's instruction, or is a call to libm).
#[inline(always)]
fn round_half_away(t: f32) -> i32 {
    (t + (0.5 - f32::EPSILON / 4.0).copysign(t)) as i32
}

/// `ln(x)` in f32 without libm: `x = m 2^e` with `m` in `[sqrt(1/2), sqrt(2))`, and
/// `ln(m) = 2 atanh(s)`, `s = (m - 1) / (m + 1)`, by its series to `s^11`. Relative error
/// about 2e-7; the same bits everywhere.
pub fn ln(x: f32) -> f32 {
    if x.is_nan() || x < 0.0 {
        return f32::NAN;
    }
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    // Subnormals are scaled into the normal range first.
    let (x, bias) = if x < f32::MIN_POSITIVE {
        (x * 16_777_216.0, -24)
    } else {
        (x, 0)
    };
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127 + bias;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let series = 2.0
        * s
        * (1.0
            + s2 * (0.333_333_34
                + s2 * (0.2 + s2 * (0.142_857_15 + s2 * (0.111_111_11 + s2 * 0.090_909_09)))));
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let e = e as f32;
    e * LN2_HI + (series + e * LN2_LO)
}

/// `ln(1 + x)`, accurate for tiny `x` too (the rounding of `1 + x` is divided back out).
pub fn ln_1p(x: f32) -> f32 {
    let u = 1.0 + x;
    if u == 1.0 {
        x
    } else {
        ln(u) * (x / (u - 1.0))
    }
}

/// `ln(1 + e^x)`, linear above 20 as torch's `softplus` is.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        ln_1p(exp(x))
    }
}

/// `1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// In-place softmax over `values`: `e_i = exp(v_i - max)`, divided by `e_0 + e_1 + ...`
/// summed in ascending `i`. (The maximum is taken over 16 lanes, which gives the value of
/// any order: only the sign of a zero maximum may differ, and `v - max` is the same either
/// way. Plain loops, so that callers built for vector instructions vectorize them.)
#[inline(always)]
pub fn softmax(values: &mut [f32]) {
    let greater = |a: f32, b: f32| if a > b { a } else { b };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for l in 0..LANES {
            lanes[l] = greater(chunk[l], lanes[l]);
        }
    }
    let mut max = f32::NEG_INFINITY;
    for v in lanes.into_iter().chain(chunks.remainder().iter().copied()) {
        max = greater(v, max);
    }
    for v in values.iter_mut() {
        *v = exp(*v - max);
    }
    let mut sum = 0f32;
    for v in values.iter() {
        sum += *v;
    }
    for v in values.iter_mut() {
        *v /= sum;
    }
}

/// RMSNorm of each `width`-long row of `x` into `out`, in f32 as transformers computes it.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, dst) in x.chunks(width).zip(out.chunks_mut(width)) {
        let mean_square = dot(row, row) / width as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for ((d, v), w) in dst.iter_mut().zip(row).zip(weight) {
            *d = w * (v * scale);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn no_rows_is_no_work_not_a_panic() {
        let w = Weight::from_f32(vec![1.0; 32 * 8], 32, 8);
        let mut out: Vec<f32> = Vec::new();
        matmul_t(&[], 0, &w, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn rounding_by_truncation_is_round_half_away() {
        // Every value within 64 ulps of the integers and half-integers exp rounds (where the
        // two could part), and a sweep between.
        let mut checked = 0;
        for twice in -310i32..=260 {
            let centre = twice as f32 / 2.0;
            let mut t = centre;
            for _ in 0..64 {
                t = t.next_down();
            }
            for _ in 0..129 {
                assert_eq!(round_half_away(t) as f32, t.round(), "{t}");
                t = t.next_up();
                checked += 1;
            }
        }
        let mut t = -155.0f32;
        while t < 130.0 {
            assert_eq!(round_half_away(t) as f32, t.round(), "{t}");
            t += 0.000_37;
            checked += 1;
        }
        assert!(checked > 800_000);
    }

    #[test]
    fn exp_is_accurate() {
        // Normal results to 1e-6 relative; subnormal ones (below e^-87) carry fewer bits.
        let mut x = -87.0f32;
        while x < 88.0 {
            let (ours, reference) = (exp(x) as f64, (x as f64).exp());
            assert!(
                ((ours - reference) / reference).abs() < 1e-6,
                "exp({x}) = {ours}, want {reference}"
            );
            x += 0.37;
        }
        for x in [88.7f32, -95.0, -103.0] {
            let (ours, reference) = (exp(x) as f64, (x as f64).exp());
            let tolerance = if x < -87.0 { 2e-45 } else { reference * 1e-6 };
            assert!(
                (ours - reference).abs() <= tolerance,
                "exp({x}) = {ours}, want {reference}"
            );
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn ln_and_softplus_are_accurate() {
        let mut x = 1e-30f32;
        while x < 1e30 {
            let (ours, reference) = (ln(x) as f64, (x as f64).ln());
            assert!(
                (ours - reference).abs() <= 3e-7 * reference.abs().max(1.0),
                "ln({x}) = {ours}, want {reference}"
            );
            x *= 1.37;
        }
        for x in [1e-45f32, 1e-40, 0.999_999_9, 1.000_000_1] {
            let reference = (x as f64).ln();
            assert!((ln(x) as f64 - reference).abs() <= 3e-7 * reference.abs().max(1.0));
        }
        assert!(ln(-1.0).is_nan() && ln(f32::NAN).is_nan());
        assert_eq!(
            (ln(0.0), ln(1.0), ln(f32::INFINITY)),
            (f32::NEG_INFINITY, 0.0, f32::INFINITY)
        );
        assert_eq!(ln_1p(1e-30), 1e-30);
        let mut x = -30.0f32;
        while x < 30.0 {
            let reference = (x as f64).exp().ln_1p();
            let ours = softplus(x) as f64;
            assert!(
                (ours - reference).abs() <= 1e-6 * reference.max(1e-30),
                "softplus({x})"
            );
            x += 0.173;
        }
    }

    #[test]
    fn matmul_matches_a_plain_loop_in_value() {
        let (rows, k, n) = (5, 37, 23);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let wv: Vec<f32> = (0..n * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 16.0)
            .collect();
        let w = Weight::from_f32(wv.clone(), n, k);
        let mut out = vec![0f32; rows * n];
        matmul_t(&x, rows, &w, &mut out);
        for r in 0..rows {
            for j in 0..n {
                let plain: f64 = (0..k)
                    .map(|i| x[r * k + i] as f64 * wv[j * k + i] as f64)
                    .sum();
                assert!((out[r * n + j] as f64 - plain).abs() < 1e-4);
            }
        }
    }

    /// The portable `column_block` of `x` (as `matmul_t` prepares it for `w`) and the
    /// same block from every vector kernel this CPU runs, by name; `vdpbf16ps` only where
    /// `matmul_t` would use it.
    fn every_kernel(x: &[f32], rows: usize, w: &Weight, first: usize) -> Vec<(Isa, Vec<f32>)> {
        let size = (w.rows() - first) * rows;
        let rounded = (w.dtype() == DType::BF16).then(|| Rows::round(x));
        let lane_order = rounded.as_ref().map(|r| r.in_lane_order(w.cols()));
        let input = match &lane_order {
            Some(lane_order) => Input::LaneOrder(lane_order),
            None => Input::F32(x),
        };
        let mut portable = vec![0f32; size];
        column_block(input, rows, w, first, &mut portable);
        let mut outs = vec![(Isa::Portable, portable)];
        #[cfg(target_arch = "x86_64")]
        {
            let fma = std::is_x86_feature_detected!("fma");
            if fma && std::is_x86_feature_detected!("avx2") {
                let mut out = vec![0f32; size];
                // SAFETY: the CPU has AVX2 and FMA, checked just above.
                unsafe { super::super::simd::column_block_avx2(input, rows, w, first, &mut out) };
                outs.push((Isa::Avx2, out));
            }
            if fma && std::is_x86_feature_detected!("avx512f") {
                let mut out = vec![0f32; size];
                // SAFETY: the CPU has AVX-512F and FMA, checked just above.
                unsafe { super::super::simd::column_block_avx512(input, rows, w, first, &mut out) };
                outs.push((Isa::Avx512, out));
            }
            let exact = rounded
                .as_ref()
                .filter(|r| r.exponents.dpbf16_exact(w.bf16_exponents(), w.cols()));
            // Wherever the CPU has the instruction, not only where `isa` chose it: a CPU
            // whose `vdpbf16ps` fails the self-check fails here too, and says so.
            let bf16 = fma
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bf16");
            if let (Some(rounded), true) = (exact, bf16) {
                let mut out = vec![0f32; size];
                // SAFETY: the CPU has AVX-512F, AVX-512 BF16 and FMA; the operands are
                // within the instruction's exact bounds, checked just above.
                unsafe {
                    super::super::simd::column_block_dpbf16(&rounded.bits, rows, w, first, &mut out)
                };
                outs.push((Isa::Avx512Bf16, out));
            }
        }
        outs
    }

    #[test]
    fn products_are_recorded_only_while_asked() {
        // Other tests run products meanwhile: look for this one's distinctive shapes.
        let (w, unseen) = (
            Weight::from_f32(vec![0.5; 3 * 21], 3, 21),
            Weight::from_f32(vec![0.5; 5 * 23], 5, 23),
        );
        let (mut out, mut other) = (vec![0f32; 2 * 3], vec![0f32; 5]);
        let ((), shapes) = record_shapes(|| matmul_t(&[1.0; 42], 2, &w, &mut out));
        assert!(shapes.contains(&Shape {
            rows: 2,
            n: 3,
            k: 21,
            dtype: DType::F32
        }));
        matmul_t(&[1.0; 23], 1, &unseen, &mut other);
        let ((), later) = record_shapes(|| ());
        assert!(!later.contains(&Shape {
            rows: 1,
            n: 5,
            k: 23,
            dtype: DType::F32
        }));
    }

    #[test]
    fn a_product_below_the_normal_range_is_fused_not_rounded() {
        // 2^-125 + p with p = (1 + 2^-7) 2^-149: rounding p alone gives 2^-149, half an ulp
        // of the sum, and the tie goes to the even 2^-125; fused, the sum is 2^-125 + 2^-148.
        let power = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
        let (a, b) = (f32::from_bits(power(-75).to_bits() | 1 << 16), power(-74));
        let (start, fused) = (power(-125), power(-125) + f32::from_bits(2));
        assert_eq!(start + a * b, start, "the unfused sum");
        // Every value is a bf16 one, so bf16 weights see the same operands. The start and the
        // product go where the sum takes them one after the other: in the tail (k = 2); in
        // lane 0, chunks 0 and 1 for f32 weights (k = 32), or its pair, odd element first,
        // for bf16 ones.
        let f32_weights = |w: &[f32], k| Weight::from_f32(w.to_vec(), 1, k);
        let bf16_weights = |w: &[f32], k| {
            let bits: Vec<u16> = w.iter().map(|v| bf16::round_bf16(*v)).collect();
            Weight::from_bf16(&bits, 1, k)
        };
        type Build = fn(&[f32], usize) -> Weight;
        for (k, (first, then), build) in [
            (2, (0, 1), f32_weights as Build),
            (32, (0, 16), f32_weights as Build),
            (2, (0, 1), bf16_weights as Build),
            (32, (1, 0), bf16_weights as Build),
        ] {
            let mut x = vec![0f32; k];
            let mut w = vec![0f32; k];
            (x[first], w[first], x[then], w[then]) = (1.0, start, a, b);
            let weight = build(&w, k);
            assert_eq!(weight.to_f32(), w, "every value is a bf16 one");
            for (isa, out) in every_kernel(&x, 1, &weight, 0) {
                assert_eq!(out[0], fused, "{isa:?}, k = {k}, {:?}", weight.dtype());
            }
            let mut out = [0f32];
            matmul_t(&x, 1, &weight, &mut out);
            assert_eq!(out[0], fused, "matmul_t, k = {k}, {:?}", weight.dtype());
        }
    }

    proptest! {
        #[test]
        fn the_bf16_kernels_give_the_reference_sum(seed in any::<u32>(), rows in 1usize..40, k in 1usize..200, n in 1usize..9) {
            let value = |i: usize| {
                let bits = (i as u32).wrapping_mul(2_654_435_761) ^ seed;
                ((bits % 4001) as f32 / 997.0 - 2.0) * 2f32.powi((bits >> 20) as i32 % 24 - 12)
            };
            let x: Vec<f32> = (0..rows * k).map(value).collect();
            let bits: Vec<u16> = (0..n * k).map(|i| bf16::round_bf16(value(i + 5))).collect();
            let w = Weight::from_bf16(&bits, n, k);
            let rounded: Vec<u16> = x.iter().map(|v| bf16::round_bf16(*v)).collect();
            let mut out = vec![0f32; rows * n];
            matmul_t(&x, rows, &w, &mut out);
            for r in 0..rows {
                for j in 0..n {
                    let want = bf16::reference_dot(&rounded[r * k..(r + 1) * k], &bits[j * k..(j + 1) * k]);
                    prop_assert_eq!(out[r * n + j].to_bits(), want.to_bits(), "row {} column {}", r, j);
                }
            }
            for (isa, block) in every_kernel(&x, rows, &w, 0) {
                prop_assert_eq!(bytemuck::cast_slice::<f32, u8>(&block), bytemuck::cast_slice::<f32, u8>(&out), "{:?}", isa);
            }
        }

        #[test]
        fn every_kernel_gives_the_portable_bits(seed in any::<u32>(), rows in 1usize..40, k in 1usize..90, n in 1usize..20, first in 0usize..3, tiny in any::<bool>()) {
            prop_assume!(first < n);
            // With `tiny`, some values are near 2^-70, so that products fall below f32's
            // normal range, where fusing them matters.
            let value = |i: usize| {
                let bits = (i as u32).wrapping_mul(2_246_822_519) ^ seed;
                let v = (bits % 4001) as f32 / 997.0 - 2.0;
                if tiny && bits.is_multiple_of(3) { v * 2f32.powi(-70) } else { v }
            };
            let x: Vec<f32> = (0..rows * k).map(value).collect();
            let values: Vec<f32> = (0..n * k).map(|i| value(i + 7)).collect();
            let bits: Vec<u16> = values.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let weights = [
                Weight::from_f32(values, n, k),
                Weight::owned_bytes(bytemuck::cast_slice(&bits), crate::weights::DType::BF16, n, k),
            ];
            for w in &weights {
                let outs = every_kernel(&x, rows, w, first);
                for (isa, out) in &outs[1..] {
                    prop_assert_eq!(bytemuck::cast_slice::<f32, u8>(&outs[0].1), bytemuck::cast_slice::<f32, u8>(out), "{:?}", isa);
                }
            }
        }

        #[test]
        fn a_row_gives_the_same_bits_in_any_batch_and_on_any_thread_count(
            seed in any::<u32>(), rows in 1usize..40, k in 1usize..70, n in 1usize..40, tiny_row in 0usize..48,
        ) {
            // With bf16 weights, a row of tiny values (when `tiny_row < rows`) keeps its whole
            // batch off `vdpbf16ps`, while every other row alone may take it.
            let value = |i: usize| {
                let v = (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0;
                if i / k.max(1) == tiny_row { v * 2f32.powi(-100) } else { v }
            };
            let x: Vec<f32> = (0..rows * k).map(value).collect();
            let values: Vec<f32> = (0..n * k).map(|i| value(i + 99_991)).collect();
            let bits: Vec<u16> = values.iter().map(|v| bf16::round_bf16(*v)).collect();
            for w in [Weight::from_f32(values, n, k), Weight::from_bf16(&bits, n, k)] {
                let mut batch = vec![0f32; rows * n];
                matmul_t(&x, rows, &w, &mut batch);
                let single_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
                for r in 0..rows {
                    let mut alone = vec![0f32; n];
                    single_thread.install(|| matmul_t(&x[r * k..(r + 1) * k], 1, &w, &mut alone));
                    prop_assert_eq!(
                        bytemuck::cast_slice::<f32, u8>(&alone),
                        bytemuck::cast_slice::<f32, u8>(&batch[r * n..(r + 1) * n]),
                        "{:?}", w.dtype()
                    );
                }
            }
        }
    }
}
