//! The column block of `cpu::matmul_t` in AVX2 intrinsics. Every output is the same sum
//! of the same products in the same order as the portable code (lane `l` of 16 accumulates
//! the products at `16c + l` in ascending `c`; then the pairwise fold and the in-order tail),
//! so the bits match; it is faster only because a tile of 3 input rows by 2 weight rows
//! stays in registers, each weight load serving three rows and each input load two columns
//! (f32 weights, or bf16 widened once for many rows; a bf16 row read for one or two input
//! rows is widened in the loop and read alone, as one sequential stream).
//! No fused multiply-add: a separate multiply and add, as the portable code does.

use std::arch::x86_64::*;

use super::cpu::{fold_lanes, FUSED_BF16_MAX_ROWS, LANES};
use crate::weights::{widen_bf16, Weight};

/// One weight row as the kernel reads it: 8 lanes at a time, or one element for the tail.
trait WeightRow: Copy {
    fn len(self) -> usize;
    /// Lanes `offset..offset + 8` widened to f32.
    ///
    /// # Safety
    ///
    /// `offset + 8 <= self.len()` (the load reads those 8 elements unchecked), and the CPU
    /// supports AVX2 (every caller is a `#[target_feature(enable = "avx2")]` function, reached
    /// only after `is_x86_feature_detected!("avx2")`).
    unsafe fn load8(self, offset: usize) -> __m256;
    /// A hint to fetch the cache line holding element `offset` (may lie past the end).
    #[inline(always)]
    fn prefetch(self, offset: usize) {
        // SAFETY: a prefetch never faults, and the address is only computed (with wrapping
        // arithmetic), not read; `_mm_prefetch` is SSE, which every x86_64 CPU has.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(self.address(offset)) }
    }
    fn address(self, offset: usize) -> *const i8;
    fn get(self, i: usize) -> f32;
}

impl WeightRow for &[f32] {
    fn len(self) -> usize {
        <[f32]>::len(self)
    }
    /// # Safety
    ///
    /// As `WeightRow::load8`: `offset + 8 <= len` and AVX2 present.
    #[inline(always)]
    unsafe fn load8(self, offset: usize) -> __m256 {
        _mm256_loadu_ps(self.as_ptr().add(offset))
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        self[i]
    }
    fn address(self, offset: usize) -> *const i8 {
        self.as_ptr().wrapping_add(offset).cast()
    }
}

impl WeightRow for &[u16] {
    fn len(self) -> usize {
        <[u16]>::len(self)
    }
    /// bf16 widens by shifting its bits into the top half of an f32 (exact).
    ///
    /// # Safety
    ///
    /// As `WeightRow::load8`: `offset + 8 <= len` (16 bytes read) and AVX2 present.
    #[inline(always)]
    unsafe fn load8(self, offset: usize) -> __m256 {
        let halves = _mm_loadu_si128(self.as_ptr().add(offset).cast());
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        widen_bf16(self[i])
    }
    fn address(self, offset: usize) -> *const i8 {
        self.as_ptr().wrapping_add(offset).cast()
    }
}

/// Elements ahead of the current chunk whose cache line is requested early: weight rows
/// are short streams (a few KiB), too short for the hardware prefetcher to ramp up.
const PREFETCH_AHEAD: usize = 1024;

/// `dot(x[r], w[c])` for every `r < R`, `c < C`. (Plain loops: closures here would be
/// compiled without AVX2 and not inlined; index loops keep the register tile explicit.)
///
/// # Safety
///
/// The CPU supports AVX2. Lengths need no promise: every row is checked to have the same
/// length `k` before any load, and loads stay below `k / 16 * 16`.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn tile<const R: usize, const C: usize, W: WeightRow>(
    xs: [&[f32]; R],
    ws: [W; C],
) -> [[f32; C]; R] {
    let k = ws[0].len();
    assert!(ws.iter().all(|w| w.len() == k) && xs.iter().all(|x| x.len() == k));
    let mut acc = [[[_mm256_setzero_ps(); 2]; C]; R];
    let chunks = k / LANES;
    for chunk in 0..chunks {
        for w in ws {
            w.prefetch(chunk * LANES + PREFETCH_AHEAD);
        }
        for half in 0..2 {
            let offset = chunk * LANES + half * 8;
            let mut w = [_mm256_setzero_ps(); C];
            for c in 0..C {
                w[c] = ws[c].load8(offset);
            }
            for r in 0..R {
                let x = _mm256_loadu_ps(xs[r].as_ptr().add(offset));
                for c in 0..C {
                    acc[r][c][half] = _mm256_add_ps(acc[r][c][half], _mm256_mul_ps(x, w[c]));
                }
            }
        }
    }
    let mut sums = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut lanes = [0f32; LANES];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][c][0]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[r][c][1]);
            let mut sum = fold_lanes(lanes);
            for i in chunks * LANES..k {
                sum += xs[r][i] * ws[c].get(i);
            }
            sums[r][c] = sum;
        }
    }
    sums
}

/// Columns `columns` (one weight row each) times every input row, into `block`
/// (column-major: `block[c * rows + r]`), tiling rows by 3.
///
/// # Safety
///
/// The CPU supports AVX2. (Slicing `x` and `block` is bounds-checked.)
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn columns_times_rows<const C: usize, W: WeightRow>(
    x: &[f32],
    rows: usize,
    ws: [W; C],
    block: &mut [f32],
) {
    let k = ws[0].len();
    let row = |r: usize| &x[r * k..(r + 1) * k];
    let mut put = |r: usize, sums: &[[f32; C]]| {
        for (i, per_column) in sums.iter().enumerate() {
            for (c, value) in per_column.iter().enumerate() {
                block[c * rows + r + i] = *value;
            }
        }
    };
    let mut r = 0;
    while r + 3 <= rows {
        put(r, &tile([row(r), row(r + 1), row(r + 2)], ws));
        r += 3;
    }
    match rows - r {
        2 => put(r, &tile([row(r), row(r + 1)], ws)),
        1 => put(r, &tile([row(r)], ws)),
        _ => {}
    }
}

/// Columns `first..` of `x * w^T`, stored column by column in `block`: the AVX2 build of
/// `cpu::column_block`, with the same results.
///
/// # Safety
///
/// The CPU supports AVX2: `cpu::matmul_t` calls this only after
/// `is_x86_feature_detected!("avx2")` said so. (Shapes are checked by bounds-checked slicing.)
#[target_feature(enable = "avx2")]
pub(super) unsafe fn column_block(
    x: &[f32],
    rows: usize,
    w: &Weight,
    first: usize,
    block: &mut [f32],
) {
    let k = w.cols();
    let columns = (first..first + block.len() / rows).collect::<Vec<_>>();
    let bf16: Option<Vec<&[u16]>> = (rows <= FUSED_BF16_MAX_ROWS)
        .then(|| columns.iter().map(|&j| w.row_bf16(j)).collect())
        .flatten();
    if let Some(bits) = bf16 {
        // One weight row at a time: a decode step is bound by memory, and a single
        // sequential stream reads faster than two rows interleaved (1.5x on one core).
        for (row, out) in bits.into_iter().zip(block.chunks_mut(rows)) {
            columns_times_rows(x, rows, [row], out);
        }
        return;
    }
    let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
    for (pair, out) in columns.chunks(2).zip(block.chunks_mut(2 * rows)) {
        w.row_f32(pair[0], &mut a);
        match pair.get(1) {
            Some(&j) => {
                w.row_f32(j, &mut b);
                columns_times_rows(x, rows, [&a[..], &b[..]], out)
            }
            None => columns_times_rows(x, rows, [&a[..]], out),
        }
    }
}
