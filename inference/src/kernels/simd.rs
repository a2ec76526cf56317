//! The column block of `cpu::matmul_t` in x86 vector instructions, in two widths: AVX-512,
//! where one 512-bit register holds the 16 lanes of the reference order, and AVX2, where two
//! 256-bit halves do. Every output is the reference sum of `cpu` (lane `l` of 16 fuses the
//! products at `16c + l` into its accumulator in ascending `c`, one rounding each; then the
//! pairwise fold and the in-order tail), so the bits are the portable kernel's. They are
//! faster only because a tile of input rows by weight rows stays in registers, each weight
//! load serving every row of the tile and each input load every column.

use std::arch::x86_64::*;

use super::cpu::{fold_lanes, FUSED_BF16_MAX_ROWS, LANES};
use crate::weights::{widen_bf16, DType, Weight};

/// The 16 lanes of the reference order, in registers.
///
/// # Safety
///
/// Every method needs the CPU features of its implementation (checked by the caller with
/// `is_x86_feature_detected!` before entering a `#[target_feature]` function), and a load
/// reads 16 elements from its pointer unchecked.
trait Lanes: Copy {
    unsafe fn zero() -> Self;
    unsafe fn load(from: *const f32) -> Self;
    /// 16 bf16 values widened to f32 (a shift into the top half: exact).
    unsafe fn load_bf16(from: *const u16) -> Self;
    /// `self + x * w` in each lane, rounded once.
    unsafe fn fused(self, x: Self, w: Self) -> Self;
    unsafe fn store(self, to: *mut f32);
    #[inline(always)]
    unsafe fn lanes(self) -> [f32; LANES] {
        let mut lanes = [0f32; LANES];
        self.store(lanes.as_mut_ptr());
        lanes
    }
}

#[derive(Clone, Copy)]
struct Avx512(__m512);

impl Lanes for Avx512 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx512(_mm512_setzero_ps())
    }
    #[inline(always)]
    unsafe fn load(from: *const f32) -> Self {
        Avx512(_mm512_loadu_ps(from))
    }
    #[inline(always)]
    unsafe fn load_bf16(from: *const u16) -> Self {
        let halves = _mm256_loadu_si256(from.cast());
        Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(
            _mm512_cvtepu16_epi32(halves),
        )))
    }
    #[inline(always)]
    unsafe fn fused(self, x: Self, w: Self) -> Self {
        Avx512(_mm512_fmadd_ps(x.0, w.0, self.0))
    }
    #[inline(always)]
    unsafe fn store(self, to: *mut f32) {
        _mm512_storeu_ps(to, self.0);
    }
}

#[derive(Clone, Copy)]
struct Avx2([__m256; 2]);

impl Lanes for Avx2 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx2([_mm256_setzero_ps(); 2])
    }
    #[inline(always)]
    unsafe fn load(from: *const f32) -> Self {
        Avx2([_mm256_loadu_ps(from), _mm256_loadu_ps(from.add(8))])
    }
    #[inline(always)]
    unsafe fn load_bf16(from: *const u16) -> Self {
        Avx2([widen8(from), widen8(from.add(8))])
    }
    #[inline(always)]
    unsafe fn fused(self, x: Self, w: Self) -> Self {
        Avx2([
            _mm256_fmadd_ps(x.0[0], w.0[0], self.0[0]),
            _mm256_fmadd_ps(x.0[1], w.0[1], self.0[1]),
        ])
    }
    #[inline(always)]
    unsafe fn store(self, to: *mut f32) {
        _mm256_storeu_ps(to, self.0[0]);
        _mm256_storeu_ps(to.add(8), self.0[1]);
    }
}

/// 8 bf16 values widened to f32. (A function, not a closure: a closure would be compiled
/// without AVX2, and the intrinsics in it not inlined.)
///
/// # Safety
///
/// The CPU has AVX2, and 8 elements are readable at `from`.
#[inline(always)]
unsafe fn widen8(from: *const u16) -> __m256 {
    let eight = _mm_loadu_si128(from.cast());
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(eight)))
}

/// One weight row as the kernel reads it: 16 lanes at a time, or one element for the tail.
trait WeightRow: Copy {
    fn len(self) -> usize;
    /// Lanes `offset..offset + 16` as f32.
    ///
    /// # Safety
    ///
    /// `offset + 16 <= self.len()`, and the CPU has `V`'s features.
    unsafe fn load<V: Lanes>(self, offset: usize) -> V;
    fn get(self, i: usize) -> f32;
    fn address(self, offset: usize) -> *const i8;
    /// A hint to fetch the cache line holding element `offset` (may lie past the end).
    #[inline(always)]
    fn prefetch(self, offset: usize) {
        // SAFETY: a prefetch never faults, and the address is only computed (with wrapping
        // arithmetic), not read; `_mm_prefetch` is SSE, which every x86_64 CPU has.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(self.address(offset)) }
    }
}

impl WeightRow for &[f32] {
    fn len(self) -> usize {
        <[f32]>::len(self)
    }
    #[inline(always)]
    unsafe fn load<V: Lanes>(self, offset: usize) -> V {
        V::load(self.as_ptr().add(offset))
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
    #[inline(always)]
    unsafe fn load<V: Lanes>(self, offset: usize) -> V {
        V::load_bf16(self.as_ptr().add(offset))
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

/// `dot(x[r], w[c])` for every `r < R`, `c < C`. (Plain index loops: they keep the register
/// tile explicit, and everything here is inlined into a `#[target_feature]` entry point.)
///
/// # Safety
///
/// The CPU has `V`'s features. Lengths need no promise: every row is checked to have the
/// same length `k` before any load, and loads stay below `k / 16 * 16`.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<V: Lanes, const R: usize, const C: usize, W: WeightRow>(
    xs: [&[f32]; R],
    ws: [W; C],
) -> [[f32; C]; R] {
    let k = ws[0].len();
    assert!(ws.iter().all(|w| w.len() == k) && xs.iter().all(|x| x.len() == k));
    let mut acc = [[V::zero(); C]; R];
    let chunks = k / LANES;
    for chunk in 0..chunks {
        let offset = chunk * LANES;
        for w in ws {
            w.prefetch(offset + PREFETCH_AHEAD);
        }
        let mut w = [V::zero(); C];
        for c in 0..C {
            w[c] = ws[c].load(offset);
        }
        for r in 0..R {
            let x = V::load(xs[r].as_ptr().add(offset));
            for c in 0..C {
                acc[r][c] = acc[r][c].fused(x, w[c]);
            }
        }
    }
    let mut sums = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut sum = fold_lanes(acc[r][c].lanes());
            for i in chunks * LANES..k {
                sum = xs[r][i].mul_add(ws[c].get(i), sum);
            }
            sums[r][c] = sum;
        }
    }
    sums
}

/// Where a product's outputs go: `block[r * width + column + c]` for input row `r` and
/// weight row `c` of the group.
struct Outputs<'a> {
    block: &'a mut [f32],
    width: usize,
    column: usize,
}

/// The weight rows `ws` times every input row, into `out`, in tiles of `ROWS` rows and
/// then one tile of the rest.
///
/// # Safety
///
/// The CPU has `V`'s features. (Slicing `x` and the block is bounds-checked.)
#[inline(always)]
unsafe fn columns_times_rows<V: Lanes, const ROWS: usize, const C: usize, W: WeightRow>(
    x: &[f32],
    rows: usize,
    ws: [W; C],
    out: &mut Outputs<'_>,
) {
    const { assert!(ROWS >= 1 && ROWS <= 6) };
    let k = ws[0].len();
    let mut put = |r: usize, sums: &[[f32; C]]| {
        for (i, per_column) in sums.iter().enumerate() {
            let at = (r + i) * out.width + out.column;
            out.block[at..at + C].copy_from_slice(per_column);
        }
    };
    let at = |r: usize| &x[r * k..(r + 1) * k];
    let mut r = 0;
    while r + ROWS <= rows {
        put(
            r,
            &tile::<V, ROWS, C, W>(std::array::from_fn(|i| at(r + i)), ws),
        );
        r += ROWS;
    }
    match rows - r {
        0 => {}
        1 => put(r, &tile::<V, 1, C, W>([at(r)], ws)),
        2 => put(r, &tile::<V, 2, C, W>([at(r), at(r + 1)], ws)),
        3 => put(
            r,
            &tile::<V, 3, C, W>(std::array::from_fn(|i| at(r + i)), ws),
        ),
        4 => put(
            r,
            &tile::<V, 4, C, W>(std::array::from_fn(|i| at(r + i)), ws),
        ),
        _ => put(
            r,
            &tile::<V, 5, C, W>(std::array::from_fn(|i| at(r + i)), ws),
        ),
    }
}

/// `columns_times_rows` for up to `C` weight rows: a group of fewer (the end of a block)
/// gets a tile of its own width.
///
/// # Safety
///
/// As `columns_times_rows`; `ws` holds 1 to `C` rows.
#[inline(always)]
unsafe fn group_times_rows<V: Lanes, const ROWS: usize, const C: usize, W: WeightRow>(
    x: &[f32],
    rows: usize,
    ws: &[W],
    out: &mut Outputs<'_>,
) {
    const { assert!(C >= 1 && C <= 4) };
    match ws.len() {
        1 => columns_times_rows::<V, ROWS, 1, W>(x, rows, [ws[0]], out),
        2 => columns_times_rows::<V, ROWS, 2, W>(x, rows, [ws[0], ws[1]], out),
        3 => columns_times_rows::<V, ROWS, 3, W>(x, rows, [ws[0], ws[1], ws[2]], out),
        _ => columns_times_rows::<V, ROWS, 4, W>(x, rows, [ws[0], ws[1], ws[2], ws[3]], out),
    }
}

/// Weight row `j` widened to f32 into `buffer`, requesting the cache lines of row `ahead`
/// meanwhile (the row the next group widens), so that its read from memory overlaps this
/// group's arithmetic.
///
/// # Safety
///
/// The CPU has `V`'s features.
#[inline(always)]
unsafe fn widen_row<V: Lanes>(w: &Weight, j: usize, ahead: usize, buffer: &mut [f32]) {
    let (Some(bits), next) = (w.row_bf16(j), w.row_bf16(ahead.min(w.rows() - 1))) else {
        return w.row_f32(j, buffer);
    };
    assert_eq!(bits.len(), buffer.len());
    let chunks = bits.len() / LANES;
    for chunk in 0..chunks {
        let offset = chunk * LANES;
        if let Some(next) = next {
            next.prefetch(offset);
        }
        V::load_bf16(bits.as_ptr().add(offset)).store(buffer.as_mut_ptr().add(offset));
    }
    for i in chunks * LANES..bits.len() {
        buffer[i] = widen_bf16(bits[i]);
    }
}

/// Columns `first..` of `x * w^T` into `block` row by row, as `cpu::column_block` lays them
/// out, in groups of `C` weight rows times tiles of `ROWS` input rows.
///
/// # Safety
///
/// The CPU has `V`'s features.
#[inline(always)]
unsafe fn column_block<V: Lanes, const ROWS: usize, const C: usize>(
    x: &[f32],
    rows: usize,
    w: &Weight,
    first: usize,
    block: &mut [f32],
) {
    let (k, width) = (w.cols(), block.len() / rows);
    let mut out = Outputs {
        block,
        width,
        column: 0,
    };
    if w.dtype() == DType::BF16 && rows <= FUSED_BF16_MAX_ROWS {
        // A decode step is bound by memory: each weight row is read once, widened in
        // registers, as one sequential stream.
        for c in 0..width {
            if let Some(bits) = w.row_bf16(first + c) {
                out.column = c;
                columns_times_rows::<V, ROWS, 1, &[u16]>(x, rows, [bits], &mut out);
            }
        }
        return;
    }
    // Many rows: each weight row widened once, then read from cache by every tile.
    let mut widened = vec![0f32; C * k];
    for column in (0..width).step_by(C) {
        let group = C.min(width - column);
        for (c, buffer) in widened.chunks_mut(k).take(group).enumerate() {
            let j = first + column + c;
            widen_row::<V>(w, j, j + C, buffer);
        }
        let rows_of: Vec<&[f32]> = widened.chunks(k).take(group).collect();
        out.column = column;
        group_times_rows::<V, ROWS, C, &[f32]>(x, rows, &rows_of, &mut out);
    }
}

/// `cpu::column_block` with AVX-512 and FMA: tiles of 6 input rows by 4 weight rows (24
/// accumulators of the 32 registers).
///
/// # Safety
///
/// The CPU has AVX-512F and FMA: `cpu::matmul_t` calls this only after
/// `is_x86_feature_detected!` said so.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn column_block_avx512(
    x: &[f32],
    rows: usize,
    w: &Weight,
    first: usize,
    block: &mut [f32],
) {
    column_block::<Avx512, 6, 4>(x, rows, w, first, block)
}

/// `cpu::column_block` with AVX2 and FMA: tiles of 3 input rows by 2 weight rows (12 of the
/// 16 registers hold accumulators, two per output).
///
/// # Safety
///
/// The CPU has AVX2 and FMA: `cpu::matmul_t` calls this only after
/// `is_x86_feature_detected!` said so.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn column_block_avx2(
    x: &[f32],
    rows: usize,
    w: &Weight,
    first: usize,
    block: &mut [f32],
) {
    column_block::<Avx2, 3, 2>(x, rows, w, first, block)
}
