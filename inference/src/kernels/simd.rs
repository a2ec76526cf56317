//! The column block of `cpu::matmul_t` in x86 vector instructions, in two widths: AVX-512,
//! where one 512-bit register holds the 16 lanes of the reference order, and AVX2, where two
//! 256-bit halves do; and, for bf16 weights, AVX-512 BF16's `vdpbf16ps`. Every output is the
//! reference sum (`cpu`'s header for f32 weights, `bf16`'s for bf16 ones), so the bits are
//! the portable kernel's. They are faster only because a tile of input rows by weight rows
//! stays in registers, each weight load serving every row of the tile and each input load
//! every column.

use std::arch::x86_64::*;

use super::bf16::{self, lane_end, CHUNK};
use super::cpu::{fold_lanes, Input, FUSED_BF16_MAX_ROWS, LANES};
use crate::weights::Exponents;
use crate::weights::{widen_bf16, Weight};

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
    /// Of the 32 bf16 values at `from`, the 16 odd ones (`2l + 1`) or the 16 even ones
    /// (`2l`), widened to f32: a half of `bf16::widen_in_lane_order`'s chunk.
    unsafe fn load_bf16_half(from: *const u16, even: bool) -> Self;
    /// `self + x * w` in each lane, rounded once.
    unsafe fn fused(self, x: Self, w: Self) -> Self;
    unsafe fn store(self, to: *mut f32);
    #[inline(always)]
    unsafe fn lanes(self) -> [f32; LANES] {
        let mut lanes = [0f32; LANES];
        self.store(lanes.as_mut_ptr());
        lanes
    }
    /// `cpu::fold_lanes` of each vector: `out[i]` is `a[i]`'s sum.
    #[inline(always)]
    unsafe fn fold_each(a: [Self; 16]) -> [f32; 16] {
        std::array::from_fn(|i| fold_lanes(a[i].lanes()))
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
    unsafe fn load_bf16_half(from: *const u16, even: bool) -> Self {
        let pairs = _mm512_loadu_si512(from.cast());
        Avx512(_mm512_castsi512_ps(if even {
            _mm512_slli_epi32::<16>(pairs)
        } else {
            _mm512_and_si512(pairs, _mm512_set1_epi32(0xffff_0000_u32 as i32))
        }))
    }
    #[inline(always)]
    unsafe fn fused(self, x: Self, w: Self) -> Self {
        Avx512(_mm512_fmadd_ps(x.0, w.0, self.0))
    }
    #[inline(always)]
    unsafe fn store(self, to: *mut f32) {
        _mm512_storeu_ps(to, self.0);
    }
    #[inline(always)]
    unsafe fn fold_each(a: [Self; 16]) -> [f32; 16] {
        Avx512(fold16(std::array::from_fn(|m| a[4 * (m % 4) + m / 4].0))).lanes()
    }
}

/// Lane `j` of the result is `cpu::fold_lanes` of `a[4 (j % 4) + j / 4]`: the fold's
/// adds (lane `l` plus lane `l + 8`, then `+ 4`, `+ 2`, `+ 1`) for sixteen vectors at
/// once, pairs of them shuffled so that each add serves two.
#[inline(always)]
pub(super) unsafe fn fold16(a: [__m512; 16]) -> __m512 {
    // Lanes 0..8 of `a[2i]` plus 8..16, then of `a[2i + 1]`: eight halves in each.
    let halves: [__m512; 8] = std::array::from_fn(|i| {
        let (x, y) = (a[2 * i], a[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x, y),
            _mm512_shuffle_f32x4::<0xEE>(x, y),
        )
    });
    // Quarter `j` of `quarters[m]` is `a[4m + j]`'s four partial sums.
    let quarters: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (halves[2 * m], halves[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    });
    // Quarter `j` of `pairs[t]`: two sums of `a[8t + j]`, then two of `a[8t + 4 + j]`.
    let pairs: [__m512; 2] = std::array::from_fn(|t| {
        let (x, y) = (quarters[2 * t], quarters[2 * t + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    });
    // Lane `4j + i` is `a[4i + j]` whole.
    let (x, y) = (pairs[0], pairs[1]);
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(x, y),
        _mm512_shuffle_ps::<0xDD>(x, y),
    )
}

/// Every accumulator of an `R x C` tile folded (`cpu::fold_lanes`): sixteen at a time by
/// `Lanes::fold_each` where the tile has enough of them to share its shuffles.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn fold_tile<V: Lanes, const R: usize, const C: usize>(acc: [[V; C]; R]) -> [[f32; C]; R] {
    let mut sums = [[0f32; C]; R];
    // From 4 accumulators on, one shared fold is cheaper than a fold each: the streamed
    // 6 x 1 tile of a few rows took 5-10% less time a layer at 8 to 16 rows than with a
    // fold each (the `small` preset's experts, AVX-512 BF16).
    if R * C < 4 {
        for r in 0..R {
            for c in 0..C {
                sums[r][c] = fold_lanes(acc[r][c].lanes());
            }
        }
        return sums;
    }
    // Sixteen at a time; a short last group keeps the previous group's vectors unused.
    let mut group = [V::zero(); 16];
    let mut first = 0;
    while first < R * C {
        let n = (R * C - first).min(16);
        for j in 0..n {
            group[j] = acc[(first + j) / C][(first + j) % C];
        }
        let folded = V::fold_each(group);
        for j in 0..n {
            sums[(first + j) / C][(first + j) % C] = folded[j];
        }
        first += n;
    }
    sums
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
    unsafe fn load_bf16_half(from: *const u16, even: bool) -> Self {
        Avx2([half8(from, even), half8(from.add(16), even)])
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

/// Of the 16 bf16 values at `from`, the 8 odd or the 8 even ones widened to f32. (A
/// function, not a closure: a closure would be compiled without AVX2, and the intrinsics in
/// it not inlined.)
///
/// # Safety
///
/// The CPU has AVX2, and 16 elements are readable at `from`.
#[inline(always)]
unsafe fn half8(from: *const u16, even: bool) -> __m256 {
    let pairs = _mm256_loadu_si256(from.cast());
    _mm256_castsi256_ps(if even {
        _mm256_slli_epi32::<16>(pairs)
    } else {
        _mm256_and_si256(pairs, _mm256_set1_epi32(0xffff_0000_u32 as i32))
    })
}

/// One weight row as the fused multiply-add kernels read it: 16 lanes at a time up to its
/// lane end, then one element at a time for the tail.
trait WeightRow: Copy {
    fn len(self) -> usize;
    /// Where the lanes stop and the in-order tail begins (the reference's rule for the
    /// row's arithmetic).
    fn lane_end(self) -> usize;
    /// Lanes `offset..offset + 16` as f32.
    ///
    /// # Safety
    ///
    /// `offset + 16 <= self.lane_end()`, and the CPU has `V`'s features.
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

/// An f32 row (f32 weights, or f16 ones widened): the f32 reference's lanes.
impl WeightRow for &[f32] {
    fn len(self) -> usize {
        <[f32]>::len(self)
    }
    fn lane_end(self) -> usize {
        self.len() / LANES * LANES
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

/// A bf16 row widened into `bf16::widen_in_lane_order`'s layout: the bf16 reference's lanes.
#[derive(Clone, Copy)]
struct LaneOrdered<'a>(&'a [f32]);

impl WeightRow for LaneOrdered<'_> {
    fn len(self) -> usize {
        self.0.len()
    }
    fn lane_end(self) -> usize {
        lane_end(self.len())
    }
    #[inline(always)]
    unsafe fn load<V: Lanes>(self, offset: usize) -> V {
        self.0.load(offset)
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        self.0[i]
    }
    fn address(self, offset: usize) -> *const i8 {
        self.0.address(offset)
    }
}

/// A bf16 row as stored, read as if widened in lane order: each 16 lanes are the odd or the
/// even halves of a chunk of 32, split from the pairs as they load.
#[derive(Clone, Copy)]
struct StoredBf16<'a>(&'a [u16]);

impl WeightRow for StoredBf16<'_> {
    fn len(self) -> usize {
        self.0.len()
    }
    fn lane_end(self) -> usize {
        lane_end(self.len())
    }
    #[inline(always)]
    unsafe fn load<V: Lanes>(self, offset: usize) -> V {
        let chunk = offset / CHUNK * CHUNK;
        V::load_bf16_half(self.0.as_ptr().add(chunk), offset != chunk)
    }
    #[inline(always)]
    fn get(self, i: usize) -> f32 {
        widen_bf16(self.0[i])
    }
    fn address(self, offset: usize) -> *const i8 {
        self.0.as_ptr().wrapping_add(offset).cast()
    }
}

/// Elements ahead of the current chunk whose cache line is requested early: weight rows
/// are short streams (a few KiB), too short for the hardware prefetcher to ramp up.
const PREFETCH_AHEAD: usize = 1024;

/// `dot(x[r], w[c])` for every `r < R`, `c < C`, in fused multiply-adds. (Plain index
/// loops: they keep the register tile explicit, and everything here is inlined into a
/// `#[target_feature]` entry point.)
///
/// # Safety
///
/// The CPU has `V`'s features. Lengths need no promise: every row is checked to have the
/// same length `k` before any load, and loads stay below the lane end.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<V: Lanes, const R: usize, const C: usize, W: WeightRow>(
    xs: [&[f32]; R],
    ws: [W; C],
) -> [[f32; C]; R] {
    let k = ws[0].len();
    assert!(ws.iter().all(|w| w.len() == k) && xs.iter().all(|x| x.len() == k));
    let end = ws[0].lane_end();
    assert!(end <= k && end.is_multiple_of(LANES));
    let mut acc = [[V::zero(); C]; R];
    for offset in (0..end).step_by(LANES) {
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
    let mut sums = fold_tile(acc);
    for r in 0..R {
        for c in 0..C {
            for i in end..k {
                sums[r][c] = xs[r][i].mul_add(ws[c].get(i), sums[r][c]);
            }
        }
    }
    sums
}

/// `bf16::reference_dot(x[r], w[c])` for every `r < R`, `c < C`, with `vdpbf16ps`: each
/// instruction the reference's two fused multiply-adds in each of 16 lanes, when the
/// operands are within `Exponents::dpbf16_exact`'s bounds (the caller's promise).
///
/// # Safety
///
/// The CPU has AVX-512F, AVX-512 BF16 and FMA. Lengths are checked before any load.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_dpbf16<const R: usize, const C: usize>(
    xs: [&[u16]; R],
    ws: [&[u16]; C],
) -> [[f32; C]; R] {
    let k = ws[0].len();
    assert!(ws.iter().all(|w| w.len() == k) && xs.iter().all(|x| x.len() == k));
    let end = lane_end(k);
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for offset in (0..end).step_by(CHUNK) {
        for w in ws {
            StoredBf16(w).prefetch(offset + PREFETCH_AHEAD);
        }
        let mut w = [load_pairs(ws[0], 0); C];
        for c in 0..C {
            w[c] = load_pairs(ws[c], offset);
        }
        for r in 0..R {
            let x = load_pairs(xs[r], offset);
            for c in 0..C {
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, w[c]);
            }
        }
    }
    let mut sums = fold_tile(acc.map(|row| row.map(Avx512)));
    for r in 0..R {
        for c in 0..C {
            for i in end..k {
                sums[r][c] = widen_bf16(xs[r][i]).mul_add(widen_bf16(ws[c][i]), sums[r][c]);
            }
        }
    }
    sums
}

/// The 32 bf16 values at `from[offset..]`, as `vdpbf16ps` takes them. (A function, not a
/// closure: see `half8`.)
///
/// # Safety
///
/// The CPU has AVX-512F, and `offset + 32 <= from.len()`.
#[inline(always)]
unsafe fn load_pairs(from: &[u16], offset: usize) -> __m512bh {
    debug_assert!(offset + CHUNK <= from.len());
    // SAFETY: 64 bytes are readable (the caller's promise); every bit pattern is a value.
    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(from.as_ptr().add(offset).cast()))
}

/// A register tile's arithmetic: `R` input rows by `C` weight rows, every output the
/// reference sum.
trait Tile: Copy {
    /// An element of an input row.
    type X: Copy;
    /// A weight row.
    type W: Copy;
    /// # Safety
    ///
    /// The CPU has the features of the kernel, and the operands are within its bounds.
    unsafe fn tile<const R: usize, const C: usize>(
        xs: [&[Self::X]; R],
        ws: [Self::W; C],
    ) -> [[f32; C]; R];
}

/// Fused multiply-adds in `V`'s registers over weight rows `W`.
struct Fused<V, W>(std::marker::PhantomData<(V, W)>);

impl<V, W> Clone for Fused<V, W> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V, W> Copy for Fused<V, W> {}

impl<V: Lanes, W: WeightRow> Tile for Fused<V, W> {
    type X = f32;
    type W = W;
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(xs: [&[f32]; R], ws: [W; C]) -> [[f32; C]; R] {
        tile::<V, R, C, W>(xs, ws)
    }
}

/// `vdpbf16ps` over bf16 rows as stored.
#[derive(Clone, Copy)]
struct Dpbf16<'a>(std::marker::PhantomData<&'a [u16]>);

impl<'a> Tile for Dpbf16<'a> {
    type X = u16;
    type W = &'a [u16];
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(
        xs: [&[u16]; R],
        ws: [&'a [u16]; C],
    ) -> [[f32; C]; R] {
        tile_dpbf16::<R, C>(xs, ws)
    }
}

/// Where a product's outputs go: `block[r * width + column + c]` for input row `r` and
/// weight row `c` of the group.
struct Outputs<'a> {
    block: &'a mut [f32],
    width: usize,
    column: usize,
}

/// The weight rows `ws` times every input row (each `k` long), into `out`, in tiles of
/// `ROWS` rows and then one tile of the rest.
///
/// # Safety
///
/// The CPU has `T`'s features and the operands are within its bounds. (Slicing `x` and the
/// block is bounds-checked.)
#[inline(always)]
unsafe fn columns_times_rows<T: Tile, const ROWS: usize, const C: usize>(
    x: &[T::X],
    (rows, k): (usize, usize),
    ws: [T::W; C],
    out: &mut Outputs<'_>,
) {
    const { assert!(ROWS >= 1 && ROWS <= 6) };
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
            &T::tile::<ROWS, C>(std::array::from_fn(|i| at(r + i)), ws),
        );
        r += ROWS;
    }
    match rows - r {
        0 => {}
        1 => put(r, &T::tile::<1, C>([at(r)], ws)),
        2 => put(r, &T::tile::<2, C>([at(r), at(r + 1)], ws)),
        3 => put(r, &T::tile::<3, C>(std::array::from_fn(|i| at(r + i)), ws)),
        4 => put(r, &T::tile::<4, C>(std::array::from_fn(|i| at(r + i)), ws)),
        _ => put(r, &T::tile::<5, C>(std::array::from_fn(|i| at(r + i)), ws)),
    }
}

/// `columns_times_rows` for up to `C` weight rows: a group of fewer (the end of a block)
/// gets a tile of its own width.
///
/// # Safety
///
/// As `columns_times_rows`; `ws` holds 1 to `C` rows.
#[inline(always)]
unsafe fn group_times_rows<T: Tile, const ROWS: usize, const C: usize>(
    x: &[T::X],
    shape: (usize, usize),
    ws: &[T::W],
    out: &mut Outputs<'_>,
) {
    const { assert!(C >= 1 && C <= 4) };
    match ws.len() {
        1 => columns_times_rows::<T, ROWS, 1>(x, shape, [ws[0]], out),
        2 => columns_times_rows::<T, ROWS, 2>(x, shape, [ws[0], ws[1]], out),
        3 => columns_times_rows::<T, ROWS, 3>(x, shape, [ws[0], ws[1], ws[2]], out),
        _ => columns_times_rows::<T, ROWS, 4>(x, shape, [ws[0], ws[1], ws[2], ws[3]], out),
    }
}

/// bf16 row `bits` widened in lane order into `buffer` (`bf16::widen_in_lane_order`),
/// requesting the cache lines of `next` meanwhile (the row the next group widens), so that
/// its read from memory overlaps this group's arithmetic.
///
/// # Safety
///
/// The CPU has `V`'s features.
#[inline(always)]
unsafe fn widen_in_lane_order<V: Lanes>(bits: &[u16], next: &[u16], buffer: &mut [f32]) {
    assert_eq!(bits.len(), buffer.len());
    let end = lane_end(bits.len());
    for offset in (0..end).step_by(CHUNK) {
        StoredBf16(next).prefetch(offset);
        let (from, to) = (bits.as_ptr().add(offset), buffer.as_mut_ptr().add(offset));
        V::load_bf16_half(from, false).store(to);
        V::load_bf16_half(from, true).store(to.add(LANES));
    }
    for i in end..bits.len() {
        buffer[i] = widen_bf16(bits[i]);
    }
}

/// Columns `first..` of `x * w^T` into `block` row by row, as `cpu::column_block` lays them
/// out, in groups of `C` weight rows times tiles of `ROWS` input rows: fused multiply-adds,
/// with `x` as `cpu::Input` says.
///
/// # Safety
///
/// The CPU has `V`'s features.
#[inline(always)]
unsafe fn column_block<V: Lanes, const ROWS: usize, const C: usize>(
    x: Input<'_>,
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
    let mut widened = vec![0f32; C * k];
    match x {
        Input::F32(x) => {
            for column in (0..width).step_by(C) {
                let group = C.min(width - column);
                for (c, buffer) in widened.chunks_mut(k).take(group).enumerate() {
                    w.row_f32(first + column + c, buffer);
                }
                let rows_of: Vec<&[f32]> = widened.chunks(k).take(group).collect();
                out.column = column;
                group_times_rows::<Fused<V, &[f32]>, ROWS, C>(x, (rows, k), &rows_of, &mut out);
            }
        }
        Input::LaneOrder(x) if rows <= FUSED_BF16_MAX_ROWS => {
            // A decode step is bound by memory: each weight row is read once, split and
            // widened in registers, as one sequential stream.
            for c in 0..width {
                if let Some(bits) = w.row_bf16(first + c) {
                    out.column = c;
                    let row = [StoredBf16(bits)];
                    columns_times_rows::<Fused<V, StoredBf16>, ROWS, 1>(
                        x,
                        (rows, k),
                        row,
                        &mut out,
                    );
                }
            }
        }
        Input::LaneOrder(x) => {
            // Many rows: each weight row widened once, then read from cache by every tile.
            for column in (0..width).step_by(C) {
                let group = C.min(width - column);
                for (c, buffer) in widened.chunks_mut(k).take(group).enumerate() {
                    let j = first + column + c;
                    if let (Some(bits), Some(next)) =
                        (w.row_bf16(j), w.row_bf16((j + C).min(w.rows() - 1)))
                    {
                        widen_in_lane_order::<V>(bits, next, buffer);
                    }
                }
                let rows_of: Vec<LaneOrdered> =
                    widened.chunks(k).take(group).map(LaneOrdered).collect();
                out.column = column;
                group_times_rows::<Fused<V, LaneOrdered>, ROWS, C>(
                    x,
                    (rows, k),
                    &rows_of,
                    &mut out,
                );
            }
        }
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
    x: Input<'_>,
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
    x: Input<'_>,
    rows: usize,
    w: &Weight,
    first: usize,
    block: &mut [f32],
) {
    column_block::<Avx2, 3, 2>(x, rows, w, first, block)
}

/// Columns `first..` of the product of bf16 weights `w` with input rows rounded to bf16
/// (`x`, as bits) into `block` row by row, with `vdpbf16ps`, the weights read as stored,
/// never widened: tiles of 6 input rows by 1 weight row up to `STREAMED_DPBF16_MAX_ROWS`
/// rows, by 4 weight rows above.
///
/// # Safety
///
/// The CPU has AVX-512F, AVX-512 BF16 and FMA, and `x` and `w` are within
/// `Exponents::dpbf16_exact`'s bounds: `cpu::matmul_t` checks both.
#[target_feature(enable = "avx512f,avx512bf16,fma")]
pub(super) unsafe fn column_block_dpbf16(
    x: &[u16],
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
    if rows <= STREAMED_DPBF16_MAX_ROWS {
        // Few rows are bound by memory: weight rows one after another, one sequential
        // stream that the prefetches run ahead of, each row used by every input row while it
        // is in L1.
        for c in 0..width {
            if let Some(bits) = w.row_bf16(first + c) {
                out.column = c;
                columns_times_rows::<Dpbf16, 6, 1>(x, (rows, k), [bits], &mut out);
            }
        }
        return;
    }
    const C: usize = 4;
    let groups: Vec<Vec<&[u16]>> = (0..width)
        .step_by(C)
        .map(|column| {
            (first + column..first + (column + C).min(width))
                .filter_map(|j| w.row_bf16(j))
                .collect()
        })
        .collect();
    // Rows in blocks that stay in the core's cache while every group of columns reads them:
    // a prefill's hundreds of rows would otherwise stream from memory once per group.
    for first_row in (0..rows).step_by(ROW_BLOCK) {
        let block_rows = ROW_BLOCK.min(rows - first_row);
        let mut out = Outputs {
            block: &mut out.block[first_row * width..(first_row + block_rows) * width],
            width,
            column: 0,
        };
        let x = &x[first_row * k..(first_row + block_rows) * k];
        for (g, group) in groups.iter().enumerate() {
            if !group.is_empty() {
                out.column = g * C;
                group_times_rows::<Dpbf16, 6, C>(x, (block_rows, k), group, &mut out);
            }
        }
    }
}

/// Up to this many input rows, `column_block_dpbf16` streams weight rows one at a time
/// rather than in tiles of 4: measured on the `small` preset's experts (k = 512 and 256) on
/// an AVX-512 BF16 Xeon, a layer step of 32 experts at 4 rows each took 1.4 ms streamed
/// against 2.5 ms tiled, at 8 rows 2.5 against 3.5 ms, at 16 rows 5.0 against 5.4 ms, and
/// at 32 rows 10.7 against 8.9 ms. A micro-batch's rows per expert are this few: 64
/// streams through 32 experts, top-4, are 8 rows each.
const STREAMED_DPBF16_MAX_ROWS: usize = 16;

/// Input rows of a `column_block_dpbf16` block: 96 rows of a 1024-wide layer are 192 KiB of
/// bf16, well within a core's L2 cache beside its weight rows.
const ROW_BLOCK: usize = 96;

/// Whether this CPU's `vdpbf16ps` gives the reference bits (`bf16`'s header): tried on
/// products that tell apart the two roundings in the reference's order from the other
/// order or one rounding for the pair, before the instruction is ever used.
///
/// # Safety
///
/// The CPU has AVX-512F, AVX-512 BF16 and FMA.
#[target_feature(enable = "avx512f,avx512bf16,fma")]
pub(super) unsafe fn dpbf16_self_check() -> bool {
    // 7 rows take the streamed path, 19 the tiled one.
    let (rows, k, n) = (19, 96, 5);
    // Values of mixed sign over 2^-20..2^20, all within the instruction's exact bounds.
    let mut state = 0x9e37_79b9_u32;
    let mut value = || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let exponent = 107 + (state >> 24) % 40;
        ((state & 0x807f) | (exponent << 7)) as u16
    };
    let x: Vec<u16> = (0..rows * k).map(|_| value()).collect();
    let w: Vec<u16> = (0..n * k).map(|_| value()).collect();
    let weight = Weight::from_bf16(&w, n, k);
    if !Exponents::of(&x).dpbf16_exact(Exponents::of(&w), k) {
        return false;
    }
    [7, rows].into_iter().all(|rows| {
        let mut block = vec![0f32; rows * n];
        column_block_dpbf16(&x[..rows * k], rows, &weight, 0, &mut block);
        (0..rows).all(|r| {
            (0..n).all(|j| {
                let want = bf16::reference_dot(&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]);
                block[r * n + j].to_bits() == want.to_bits()
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold16_is_the_reference_fold() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        // Values of mixed sign over 2^-12..2^12: adds in another order would round apart.
        let mut state = 0x2545_f491_u32;
        let lanes: Vec<[f32; LANES]> = (0..16)
            .map(|_| {
                std::array::from_fn(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    let magnitude = (state % 1000) as f32 / 999.0 + 1.0;
                    let exponent = (state >> 10) % 25;
                    let sign = if state >> 31 == 1 { -1.0 } else { 1.0 };
                    sign * magnitude * 2f32.powi(exponent as i32 - 12)
                })
            })
            .collect();
        // SAFETY: the CPU has AVX-512F, checked above.
        let (folded, each) = unsafe {
            let a: [Avx512; 16] = std::array::from_fn(|v| Avx512::load(lanes[v].as_ptr()));
            (Avx512(fold16(a.map(|v| v.0))).lanes(), Avx512::fold_each(a))
        };
        for j in 0..LANES {
            let (want, permuted) = (fold_lanes(lanes[j]), fold_lanes(lanes[4 * (j % 4) + j / 4]));
            assert_eq!(folded[j].to_bits(), permuted.to_bits(), "fold16 lane {j}");
            assert_eq!(each[j].to_bits(), want.to_bits(), "fold_each {j}");
        }
    }
}
