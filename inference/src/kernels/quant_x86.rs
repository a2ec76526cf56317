//! `quant`'s integer products in x86 vector instructions: AVX2's `vpmaddubsw`, and AVX-512
//! VNNI's `vpdpbusd` on 256-bit registers. The products are exact integers, so these give
//! the portable kernel's bits; everything around them (unpacking, scales, the exact sum) is
//! `quant`'s own code, compiled here for these instructions.

use std::arch::x86_64::*;

use super::quant::{column_products, BlockFormat, IntegerDot, QuantizedRow};
use crate::weights::Weight;

/// `vpmaddubsw` multiplies unsigned bytes by signed ones: the weights' magnitudes by the
/// activations carrying the weights' signs. A pair's sum is at most 2 * 128 * 127, within
/// 16 bits because activations are never -128.
struct Avx2;

impl IntegerDot for Avx2 {
    #[inline(always)]
    unsafe fn halves(w: *const i8, x: *const i8) -> (i32, i32) {
        // SAFETY: the caller's promise of 32 readable values each, and of AVX2.
        unsafe {
            let (w, x) = (_mm256_loadu_si256(w.cast()), _mm256_loadu_si256(x.cast()));
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            halves_of(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }
}

/// `vpdpbusd` sums four unsigned-by-signed byte products into 32 bits, without saturating.
struct Vnni;

impl IntegerDot for Vnni {
    #[inline(always)]
    unsafe fn halves(w: *const i8, x: *const i8) -> (i32, i32) {
        // SAFETY: the caller's promise of 32 readable values each, and of AVX-512 VNNI and VL.
        unsafe {
            let (w, x) = (_mm256_loadu_si256(w.cast()), _mm256_loadu_si256(x.cast()));
            let magnitudes = _mm256_sign_epi8(w, w);
            halves_of(_mm256_dpbusd_epi32(
                _mm256_setzero_si256(),
                magnitudes,
                _mm256_sign_epi8(x, w),
            ))
        }
    }
}

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
