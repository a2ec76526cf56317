//! CPU kernels. Determinism rules: every output element is reduced in one fixed order that
//! depends only on the vector length (never on threads, row count or blocking), no fused
//! multiply-add is implied, and transcendental functions are this module's own code rather
//! than the platform's libm, which differs between systems.

use rayon::prelude::*;

use crate::weights::{widen_bf16, Weight};

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

/// `sum(a[i] * b[i])` in the one fixed order every kernel uses: lane `l` of 16 sums the
/// products at `i = 16c + l` in ascending `c`, the lanes are folded pairwise (8, 4, 2, 1),
/// and the tail past the last full 16 is added in order.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_widened(a, b, |v| v)
}

/// `dot(a, widened b)` for a bf16 row `b`, widening inside the loop: the same products in
/// the same order as `dot` on the widened row (widening is exact), so the same bits.
#[inline(always)]
fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
    dot_widened(a, b, widen_bf16)
}

/// The fixed-order dot product, with `widen` turning each stored weight into an f32.
#[inline(always)]
fn dot_widened<T: Copy>(a: &[f32], b: &[T], widen: impl Fn(T) -> f32) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let (xs, ys) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = xs.remainder().iter().zip(ys.remainder());
    for (x, y) in xs.zip(ys) {
        for l in 0..LANES {
            acc[l] += x[l] * widen(y[l]);
        }
    }
    tail.fold(fold_lanes(acc), |sum, (x, y)| sum + x * widen(*y))
}

/// `dot` of four rows against one weight row, sharing its loads; each result has the bits
/// `dot` gives that row alone.
#[inline(always)]
fn dot4(a: [&[f32]; 4], b: &[f32]) -> [f32; 4] {
    let (mut s0, mut s1, mut s2, mut s3) =
        ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let chunks = b.len() / LANES;
    let (x0, x1, x2, x3) = (
        a[0].chunks_exact(LANES),
        a[1].chunks_exact(LANES),
        a[2].chunks_exact(LANES),
        a[3].chunks_exact(LANES),
    );
    for ((((y, r0), r1), r2), r3) in b.chunks_exact(LANES).zip(x0).zip(x1).zip(x2).zip(x3) {
        for l in 0..LANES {
            s0[l] += r0[l] * y[l];
            s1[l] += r1[l] * y[l];
            s2[l] += r2[l] * y[l];
            s3[l] += r3[l] * y[l];
        }
    }
    let finish = |acc: [f32; LANES], row: &[f32]| {
        (chunks * LANES..b.len()).fold(fold_lanes(acc), |sum, i| sum + row[i] * b[i])
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

/// `out[r][j] = dot(x[r], w[j])` for `x` of `rows x k` and `w` of `n x k` (the layout of a
/// Hugging Face Linear weight), giving `out` of `rows x n`. Columns are spread over threads;
/// each weight row is widened to f32 once and reused for every input row, so a batch costs
/// one pass over the weights.
pub fn matmul_t(x: &[f32], rows: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), rows * k, "matmul_t input shape");
    assert_eq!(out.len(), rows * n, "matmul_t output shape");
    // No rows, nothing to compute (and no chunk of zero size to hand out): a request may
    // route no token to an expert, and a hostile one must not panic the node.
    if rows == 0 {
        return;
    }
    let mut transposed = vec![0f32; n * rows];
    let avx2 = has_avx2();
    transposed
        .par_chunks_mut(COLUMNS_PER_TASK * rows)
        .enumerate()
        .for_each(|(task, block)| {
            let first = task * COLUMNS_PER_TASK;
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: `has_avx2` checked with `is_x86_feature_detected!` that this CPU
                // supports AVX2, the one promise `column_block` asks for.
                return unsafe { super::avx2::column_block(x, rows, w, first, block) };
            }
            let _ = avx2;
            column_block(x, rows, w, first, block);
        });
    for j in 0..n {
        for r in 0..rows {
            out[r * n + j] = transposed[j * rows + r];
        }
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Columns `first..` of the product, stored column by column in `block`.
#[inline(always)]
fn column_block(x: &[f32], rows: usize, w: &Weight, first: usize, block: &mut [f32]) {
    let k = w.cols();
    let mut wrow = vec![0f32; k];
    let row = |r: usize| &x[r * k..(r + 1) * k];
    for (c, column) in block.chunks_mut(rows).enumerate() {
        if let Some(bits) = w
            .row_bf16(first + c)
            .filter(|_| rows <= FUSED_BF16_MAX_ROWS)
        {
            for (r, value) in column.iter_mut().enumerate() {
                *value = dot_bf16(row(r), bits);
            }
            continue;
        }
        w.row_f32(first + c, &mut wrow);
        let tiled = rows / 4 * 4;
        for r in (0..tiled).step_by(4) {
            let sums = dot4([row(r), row(r + 1), row(r + 2), row(r + 3)], &wrow);
            column[r..r + 4].copy_from_slice(&sums);
        }
        for (r, value) in column.iter_mut().enumerate().skip(tiled) {
            *value = dot(row(r), &wrow);
        }
    }
}

/// `exp(x)` in f32 without libm: `2^k * p(r)` with `x = k ln2 + r`, `|r| <= ln2 / 2`, and a
/// degree-6 polynomial for `e^r`. Relative error about 2e-7; the same bits everywhere.
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 88.72 {
        return f32::INFINITY;
    }
    if x < -103.97 {
        return 0.0;
    }
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_334 + r * 0.001_388_889)))));
    // 2^k through the exponent bits, in two steps near the ends of the range (k runs from
    // -150 to 128) so each factor stays a normal number.
    let k = k as i32;
    let (k1, k2) = match k {
        i32::MIN..=-121 => (k + 60, -60),
        121.. => (k - 60, 60),
        _ => (k, 0),
    };
    let scale = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    p * scale(k1) * scale(k2)
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

/// In-place softmax over `values` (max-subtracted, fixed-order sum).
pub fn softmax(values: &mut [f32]) {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in values.iter_mut() {
        *v = exp(*v - max);
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

    proptest! {
        #[test]
        fn fused_bf16_dot_gives_the_bits_of_widen_then_dot(a in proptest::collection::vec(-4f32..4.0, 0..100), seed in any::<u16>()) {
            let b: Vec<u16> = (0..a.len()).map(|i| half::bf16::from_f32(((i as u16 ^ seed) % 509) as f32 / 127.0 - 2.0).to_bits()).collect();
            let widened: Vec<f32> = b.iter().map(|h| widen_bf16(*h)).collect();
            prop_assert_eq!(dot_bf16(&a, &b).to_bits(), dot(&a, &widened).to_bits());
        }

        #[test]
        #[cfg(target_arch = "x86_64")]
        fn the_avx2_kernel_gives_the_portable_bits(seed in any::<u32>(), rows in 1usize..11, k in 1usize..90, n in 1usize..20, first in 0usize..3) {
            prop_assume!(has_avx2() && first < n);
            let value = |i: usize| (((i as u32).wrapping_mul(2_246_822_519) ^ seed) % 4001) as f32 / 997.0 - 2.0;
            let x: Vec<f32> = (0..rows * k).map(value).collect();
            let values: Vec<f32> = (0..n * k).map(|i| value(i + 7)).collect();
            let bits: Vec<u16> = values.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let weights = [
                Weight::from_f32(values, n, k),
                Weight::owned_bytes(bytemuck::cast_slice(&bits), crate::weights::DType::BF16, n, k),
            ];
            for w in &weights {
                let block = (n - first) * rows;
                let (mut baseline, mut avx2) = (vec![0f32; block], vec![0f32; block]);
                column_block(&x, rows, w, first, &mut baseline);
                // SAFETY: prop_assume above checked the CPU has AVX2.
                unsafe { super::super::avx2::column_block(&x, rows, w, first, &mut avx2) };
                prop_assert_eq!(bytemuck::cast_slice::<f32, u8>(&baseline), bytemuck::cast_slice::<f32, u8>(&avx2));
            }
        }

        #[test]
        fn a_row_gives_the_same_bits_in_any_batch_and_on_any_thread_count(
            seed in any::<u32>(), rows in 1usize..9, k in 1usize..70, n in 1usize..40,
        ) {
            let value = |i: usize| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0;
            let x: Vec<f32> = (0..rows * k).map(value).collect();
            let w = Weight::from_f32((0..n * k).map(|i| value(i + 99_991)).collect(), n, k);
            let mut batch = vec![0f32; rows * n];
            matmul_t(&x, rows, &w, &mut batch);
            let single_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            for r in 0..rows {
                let mut alone = vec![0f32; n];
                single_thread.install(|| matmul_t(&x[r * k..(r + 1) * k], 1, &w, &mut alone));
                prop_assert_eq!(
                    bytemuck::cast_slice::<f32, u8>(&alone),
                    bytemuck::cast_slice::<f32, u8>(&batch[r * n..(r + 1) * n])
                );
            }
        }
    }
}
