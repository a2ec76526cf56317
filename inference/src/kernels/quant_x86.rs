//! `quant`'s integer products in x86 vector instructions: AVX2's `vpmaddubsw`, and AVX-512
//! VNNI's `vpdpbusd` on 256-bit registers. The products are exact integers, so these give
//! the portable kernel's bits; everything around them (unpacking, scales, the exact sum) is
//! `quant`'s own code, compiled here for these instructions.

use std::arch::x86_64::*;

use super::quant::{
    add_blocks, column_products, BlockFormat, ExactSum, IntegerDot, QuantizedRow, BLOCK,
};
use crate::weights::Weight;

/// A tier's product of 32 weight bytes and 32 activation bytes, as eight 32-bit partial sums
/// (lanes 0..4 from the first 16 values).
trait Partials {
    /// # Safety
    ///
    /// The tier's CPU features; activations never -128.
    unsafe fn partials(w: __m256i, x: __m256i) -> __m256i;
}

/// `vpmaddubsw` multiplies unsigned bytes by signed ones: the weights' magnitudes by the
/// activations carrying the weights' signs. A pair's sum is at most 2 * 128 * 127, within
/// 16 bits because activations are never -128.
struct Avx2;

impl Partials for Avx2 {
    #[inline(always)]
    unsafe fn partials(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller's promise of AVX2.
        unsafe {
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
        }
    }
}

/// `vpdpbusd` sums four unsigned-by-signed byte products into 32 bits, without saturating.
struct Vnni;

impl Partials for Vnni {
    #[inline(always)]
    unsafe fn partials(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller's promise of AVX-512 VNNI and VL.
        unsafe {
            _mm256_dpbusd_epi32(
                _mm256_setzero_si256(),
                _mm256_sign_epi8(w, w),
                _mm256_sign_epi8(x, w),
            )
        }
    }
}

/// Both tiers' `IntegerDot`: their partial sums, folded.
macro_rules! integer_dot {
    ($tier:ty) => {
        impl IntegerDot for $tier {
            #[inline(always)]
            unsafe fn halves(w: *const i8, x: *const i8) -> (i32, i32) {
                // SAFETY: the caller's promise of 32 readable values each, and of the tier.
                unsafe {
                    let (w, x) = (_mm256_loadu_si256(w.cast()), _mm256_loadu_si256(x.cast()));
                    halves_of(<$tier>::partials(w, x))
                }
            }

            #[inline(always)]
            unsafe fn add_flat_row(
                format: BlockFormat,
                row: &[u8],
                xs: &[QuantizedRow],
                sums: &mut [ExactSum],
            ) {
                // SAFETY: the caller's promise of the tier.
                unsafe { flat_row::<$tier>(format, row, xs, sums) }
            }
        }
    };
}

integer_dot!(Avx2);
integer_dot!(Vnni);

/// The sums of lanes 0..4 (the first 16 values' products) and 4..8.
#[inline(always)]
unsafe fn halves_of(v: __m256i) -> (i32, i32) {
    // SAFETY: the caller's promise of AVX2.
    unsafe {
        let (low, high) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        // Both halves at once: [l0+l2, l1+l3, h0+h2, h1+h3] and then pairwise.
        let folded = _mm_hadd_epi32(low, high);
        let folded = _mm_hadd_epi32(folded, folded);
        (_mm_cvtsi128_si32(folded), _mm_extract_epi32::<1>(folded))
    }
}

/// `quant::column_products` with AVX2's products.
///
/// # Safety
///
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn column_products_avx2(
    format: BlockFormat,
    w: &Weight,
    columns: std::ops::Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    column_products::<Avx2>(format, w, columns, xs, out)
}

/// `quant::column_products` with AVX-512 VNNI's products.
///
/// # Safety
///
/// The CPU has AVX2, AVX-512 VNNI and AVX-512 VL.
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
pub(super) unsafe fn column_products_vnni(
    format: BlockFormat,
    w: &Weight,
    columns: std::ops::Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    column_products::<Vnni>(format, w, columns, xs, out)
}

/// Blocks a group: eight, one 32-bit lane each.
const GROUP: usize = 8;

/// The largest spread of powers within a group that 64-bit lanes hold exactly: a Q8_0 or Q4_0
/// term is below 2^41 (a block's sum below 2^19, two 11-bit mantissas), shifted by at most
/// this and summed over 8 lanes, it stays below 2^63.
const MAX_SPREAD: i32 = 18;

/// `IntegerDot::add_flat_row` eight blocks at a time: the blocks' integer sums in one register,
/// their scales decoded in lanes, the terms of the group summed exactly in 64-bit lanes from
/// the group's lowest power, then added to the row's sum. A group whose powers spread wider
/// than 64 bits hold goes block by block; either way the sum is the exact one.
///
/// # Safety
///
/// The CPU has AVX2 and `P`'s features; every row of `xs` is as long as `row`.
#[inline(always)]
unsafe fn flat_row<P: Partials + IntegerDot>(
    format: BlockFormat,
    row: &[u8],
    xs: &[QuantizedRow],
    sums: &mut [ExactSum],
) {
    let bytes = format.block_bytes();
    let groups = row.len() / bytes / GROUP;
    // SAFETY: AVX2 and `P` are the caller's promise; every load below reads within `row`
    // (whole blocks of `bytes`) or within an activation row as long as it.
    unsafe {
        for g in 0..groups {
            let group = &row[g * GROUP * bytes..(g + 1) * GROUP * bytes];
            let weights = weights_of(format, group);
            let bits = _mm256_setr_epi32(
                i32::from(u16::from_le_bytes([group[0], group[1]])),
                i32::from(u16::from_le_bytes([group[bytes], group[bytes + 1]])),
                i32::from(u16::from_le_bytes([group[2 * bytes], group[2 * bytes + 1]])),
                i32::from(u16::from_le_bytes([group[3 * bytes], group[3 * bytes + 1]])),
                i32::from(u16::from_le_bytes([group[4 * bytes], group[4 * bytes + 1]])),
                i32::from(u16::from_le_bytes([group[5 * bytes], group[5 * bytes + 1]])),
                i32::from(u16::from_le_bytes([group[6 * bytes], group[6 * bytes + 1]])),
                i32::from(u16::from_le_bytes([group[7 * bytes], group[7 * bytes + 1]])),
            );
            let Some((w_mantissas, w_exponents)) = decode_f16(bits) else {
                sums.iter_mut().for_each(ExactSum::poison);
                continue;
            };
            for (x, sum) in xs.iter().zip(sums.iter_mut()) {
                let first = g * GROUP;
                let values = x.values()[first * BLOCK..].as_ptr();
                let s = block_sums::<P>(&weights, values);
                let (mantissas, exponents) = x.scale_parts();
                let x_mantissas =
                    _mm256_loadu_si256(mantissas[first..first + GROUP].as_ptr().cast());
                let x_exponents =
                    _mm256_loadu_si256(exponents[first..first + GROUP].as_ptr().cast());
                let m = _mm256_mullo_epi32(w_mantissas, x_mantissas);
                // Powers from 2^LOWEST: the decoded exponents are at least -24 each.
                let powers = _mm256_add_epi32(
                    _mm256_add_epi32(w_exponents, x_exponents),
                    _mm256_set1_epi32(48),
                );
                let lowest = horizontal_min(powers);
                let shifts = _mm256_sub_epi32(powers, _mm256_set1_epi32(lowest));
                let too_wide = _mm256_cmpgt_epi32(shifts, _mm256_set1_epi32(MAX_SPREAD));
                if _mm256_movemask_epi8(too_wide) != 0 {
                    add_blocks::<P>(
                        format,
                        group,
                        first,
                        std::slice::from_ref(x),
                        std::slice::from_mut(sum),
                    );
                    continue;
                }
                // Even lanes' and odd lanes' 64-bit terms, each shifted to the group's lowest
                // power (`vpmuldq` multiplies the low 32 bits of each 64-bit lane, signed).
                let low32 = _mm256_set1_epi64x(0xffff_ffff);
                let even =
                    _mm256_sllv_epi64(_mm256_mul_epi32(s, m), _mm256_and_si256(shifts, low32));
                let odd = _mm256_sllv_epi64(
                    _mm256_mul_epi32(_mm256_srli_epi64::<32>(s), _mm256_srli_epi64::<32>(m)),
                    _mm256_srli_epi64::<32>(shifts),
                );
                let four = _mm256_add_epi64(even, odd);
                let two = _mm_add_epi64(
                    _mm256_castsi256_si128(four),
                    _mm256_extracti128_si256::<1>(four),
                );
                let units = _mm_cvtsi128_si64(two) + _mm_extract_epi64::<1>(two);
                sum.add_units(units, lowest);
            }
        }
        let done = groups * GROUP;
        add_blocks::<P>(format, &row[done * bytes..], done, xs, sums);
    }
}

/// A group's 8 blocks of weights as 32 signed bytes each.
#[inline(always)]
unsafe fn weights_of(format: BlockFormat, group: &[u8]) -> [__m256i; GROUP] {
    let bytes = format.block_bytes();
    // SAFETY: AVX2 is the caller's promise; `group` holds GROUP whole blocks. (Loops, not
    // `array::from_fn`: a closure is compiled without the caller's features, and each
    // intrinsic in it becomes a call.)
    unsafe {
        let mut weights = [_mm256_setzero_si256(); GROUP];
        for (i, w) in weights.iter_mut().enumerate() {
            let block = group[i * bytes..].as_ptr();
            *w = match format {
                BlockFormat::Q4_0 => {
                    // Low nibbles are values 0..16, high nibbles 16..32, each less 8.
                    let packed = _mm_loadu_si128(block.add(2).cast());
                    let nibbles = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
                    _mm256_sub_epi8(
                        _mm256_and_si256(nibbles, _mm256_set1_epi8(0x0f)),
                        _mm256_set1_epi8(8),
                    )
                }
                _ => _mm256_loadu_si256(block.add(2).cast()),
            };
        }
        weights
    }
}

/// The integer sums of 8 weight blocks with the 8 activation blocks at `x`, one per lane.
#[inline(always)]
unsafe fn block_sums<P: Partials>(weights: &[__m256i; GROUP], x: *const i8) -> __m256i {
    // SAFETY: AVX2 and `P`'s features are the caller's promise; `x` has 8 blocks readable.
    unsafe {
        let mut p = [_mm256_setzero_si256(); GROUP];
        for (i, p) in p.iter_mut().enumerate() {
            *p = P::partials(weights[i], _mm256_loadu_si256(x.add(i * BLOCK).cast()));
        }
        // Pairwise sums: each 128-bit half of `q` holds, per block, the sum of its four
        // partials of that half.
        let (h01, h23) = (_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        let (h45, h67) = (_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
        let (q0, q1) = (_mm256_hadd_epi32(h01, h23), _mm256_hadd_epi32(h45, h67));
        let halves =
            |q: __m256i| _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        _mm256_set_m128i(halves(q1), halves(q0))
    }
}

/// Binary16 bits (one per 32-bit lane) as `quant::Scale`s do: mantissas and exponents, or
/// None when a lane is an infinity or a NaN.
#[inline(always)]
unsafe fn decode_f16(bits: __m256i) -> Option<(__m256i, __m256i)> {
    // SAFETY: AVX2 is the caller's promise.
    unsafe {
        let field = _mm256_and_si256(_mm256_srli_epi32::<10>(bits), _mm256_set1_epi32(0x1f));
        if _mm256_movemask_epi8(_mm256_cmpeq_epi32(field, _mm256_set1_epi32(0x1f))) != 0 {
            return None;
        }
        let normal = _mm256_cmpgt_epi32(field, _mm256_setzero_si256());
        let magnitude = _mm256_or_si256(
            _mm256_and_si256(bits, _mm256_set1_epi32(0x3ff)),
            _mm256_and_si256(normal, _mm256_set1_epi32(0x400)),
        );
        let negative = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_srli_epi32::<15>(bits));
        let mantissa = _mm256_sub_epi32(_mm256_xor_si256(magnitude, negative), negative);
        let exponent = _mm256_sub_epi32(
            _mm256_max_epi32(field, _mm256_set1_epi32(1)),
            _mm256_set1_epi32(25),
        );
        Some((mantissa, exponent))
    }
}

/// The smallest of 8 lanes.
#[inline(always)]
unsafe fn horizontal_min(v: __m256i) -> i32 {
    // SAFETY: AVX2 is the caller's promise.
    unsafe {
        let m = _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let m = _mm_min_epi32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
        let m = _mm_min_epi32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
        _mm_cvtsi128_si32(m)
    }
}
