//! `quant`'s integer products in x86 vector instructions: AVX2's `vpmaddubsw`, and AVX-512
//! VNNI's `vpdpbusd` on 256-bit registers. The products are exact integers, so these give
//! the portable kernel's bits; everything around them (unpacking, scales, the exact sum) is
//! `quant`'s own code, compiled here for these instructions.

use std::arch::x86_64::*;

use super::quant::{
    add_blocks, column_products, BlockFormat, ExactSum, IntegerDot, QuantizedRow, Scale, BLOCK,
    GROUP_BLOCKS, LOWEST,
};
use crate::weights::Weight;

/// A tier's product of 32 weight bytes and 32 activation bytes, as eight 32-bit partial sums
/// (lanes 0..4 from the first 16 values).
trait Partials {
    /// # Safety
    ///
    /// The tier's CPU features; activations never -128.
    unsafe fn partials(w: __m256i, x: __m256i) -> __m256i;

    /// The same for weights in 0..=127, which need no sign moved (the K formats with mins,
    /// whose values are 0..32).
    ///
    /// # Safety
    ///
    /// As for `partials`.
    unsafe fn unsigned_partials(w: __m256i, x: __m256i) -> __m256i;
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

    #[inline(always)]
    unsafe fn unsigned_partials(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller's promise of AVX2. A pair's sum is at most 2 * 127 * 127.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)) }
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

    #[inline(always)]
    unsafe fn unsigned_partials(w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller's promise of AVX-512 VNNI and VL.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x) }
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
            unsafe fn add_row(
                format: BlockFormat,
                row: &[u8],
                xs: &[QuantizedRow],
                sums: &mut [ExactSum],
            ) {
                // SAFETY: the caller's promise of the tier.
                unsafe {
                    match format {
                        BlockFormat::Q8_0 | BlockFormat::Q4_0 => {
                            flat_row::<$tier>(format, row, xs, sums)
                        }
                        BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => {
                            k_row::<$tier>(format, row, xs, sums)
                        }
                    }
                }
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

/// Blocks a group: eight, one 32-bit lane each (a K format's block is one group).
const GROUP: usize = GROUP_BLOCKS;

/// Eight terms `a * m * 2^(power + LOWEST)` (32-bit lanes; `|a * m|` below 2^`bits`) summed
/// exactly: in 64-bit lanes, each shifted up from the group's lowest power. `None` when the
/// powers spread wider than 64 bits hold (8 terms below 2^(bits + spread) stay below 2^62),
/// for the caller to add them another way.
#[inline(always)]
unsafe fn exact_terms(a: __m256i, m: __m256i, powers: __m256i, bits: i32) -> Option<(i64, i32)> {
    // SAFETY: AVX2 is the caller's promise.
    unsafe {
        // A lane whose term is zero by its scales (an all-zero activation block has scale 0)
        // counts for nothing: its power must not widen the spread.
        let zero = _mm256_cmpeq_epi32(m, _mm256_setzero_si256());
        let lowest = horizontal_min(_mm256_or_si256(
            powers,
            _mm256_and_si256(zero, _mm256_set1_epi32(i32::MAX)),
        ));
        if lowest == i32::MAX {
            return Some((0, 0));
        }
        let shifts = _mm256_andnot_si256(zero, _mm256_sub_epi32(powers, _mm256_set1_epi32(lowest)));
        let too_wide = _mm256_cmpgt_epi32(shifts, _mm256_set1_epi32(59 - bits));
        if _mm256_movemask_epi8(too_wide) != 0 {
            return None;
        }
        // Even lanes' and odd lanes' 64-bit terms (`vpmuldq` multiplies the low 32 bits of
        // each 64-bit lane, signed).
        let low32 = _mm256_set1_epi64x(0xffff_ffff);
        let even = _mm256_sllv_epi64(_mm256_mul_epi32(a, m), _mm256_and_si256(shifts, low32));
        let odd = _mm256_sllv_epi64(
            _mm256_mul_epi32(_mm256_srli_epi64::<32>(a), _mm256_srli_epi64::<32>(m)),
            _mm256_srli_epi64::<32>(shifts),
        );
        let four = _mm256_add_epi64(even, odd);
        let two = _mm_add_epi64(
            _mm256_castsi256_si128(four),
            _mm256_extracti128_si256::<1>(four),
        );
        Some((_mm_cvtsi128_si64(two) + _mm_extract_epi64::<1>(two), lowest))
    }
}

/// Bits below which a Q8_0 or Q4_0 term's integer lies: a block's sum below 2^19 times two
/// 11-bit mantissas.
const FLAT_BITS: i32 = 41;

/// The row's eight activation scales from block `first`: mantissas, and exponents less
/// `LOWEST` (powers from 2^LOWEST once a weight exponent is added).
#[inline(always)]
unsafe fn activation_scales(x: &QuantizedRow, first: usize) -> (__m256i, __m256i) {
    let (mantissas, exponents) = x.scale_parts();
    let (mantissas, exponents) = (
        &mantissas[first..first + GROUP],
        &exponents[first..first + GROUP],
    );
    // SAFETY: AVX2 is the caller's promise; both slices hold GROUP values.
    unsafe {
        (
            _mm256_loadu_si256(mantissas.as_ptr().cast()),
            _mm256_add_epi32(
                _mm256_loadu_si256(exponents.as_ptr().cast()),
                _mm256_set1_epi32(-LOWEST),
            ),
        )
    }
}

/// `IntegerDot::add_row` for Q8_0 and Q4_0, eight blocks at a time: the blocks' integer sums
/// in one register, their scales decoded in lanes, the group's terms summed exactly
/// (`exact_terms`), a group too wide for that going block by block.
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
        // One row: as in `k_row`.
        if let ([x], [sum]) = (xs, &mut *sums) {
            let mut local = std::mem::replace(sum, ExactSum::new());
            for g in 0..groups {
                let group = &row[g * GROUP * bytes..(g + 1) * GROUP * bytes];
                match flat_scales(format, group) {
                    Some(scales) => {
                        let weights = weights_of(format, group);
                        flat_product::<P>(format, &weights, scales, (group, g), x, &mut local)
                    }
                    None => local.poison(),
                }
            }
            *sum = local;
        } else {
            for g in 0..groups {
                let group = &row[g * GROUP * bytes..(g + 1) * GROUP * bytes];
                let weights = weights_of(format, group);
                let Some(scales) = flat_scales(format, group) else {
                    sums.iter_mut().for_each(ExactSum::poison);
                    continue;
                };
                for (x, sum) in xs.iter().zip(sums.iter_mut()) {
                    flat_product::<P>(format, &weights, scales, (group, g), x, sum);
                }
            }
        }
        let done = groups * GROUP;
        add_blocks::<P>(format, &row[done * bytes..], done, xs, sums);
    }
}

/// A group's 8 weight scales decoded in lanes (`decode_f16`), or None if one is an infinity
/// or a NaN.
///
/// # Safety
///
/// The CPU has AVX2; `group` holds GROUP whole blocks.
#[inline(always)]
unsafe fn flat_scales(format: BlockFormat, group: &[u8]) -> Option<(__m256i, __m256i)> {
    let bytes = format.block_bytes();
    let mut bits = [0i32; GROUP];
    for (i, bits) in bits.iter_mut().enumerate() {
        *bits = i32::from(u16::from_le_bytes([group[i * bytes], group[i * bytes + 1]]));
    }
    // SAFETY: AVX2 is the caller's promise.
    unsafe { decode_f16(_mm256_loadu_si256(bits.as_ptr().cast())) }
}

/// Adds the product of Q8_0 or Q4_0 group `g` of a row (`group`, its values `weights` and
/// scales `w_mantissas`, `w_exponents`) and activation row `x` to `sum`.
///
/// # Safety
///
/// The CPU has AVX2 and `P`'s features; `x` is as long as the weight row.
#[inline(always)]
unsafe fn flat_product<P: Partials + IntegerDot>(
    format: BlockFormat,
    weights: &[__m256i; GROUP],
    (w_mantissas, w_exponents): (__m256i, __m256i),
    (group, g): (&[u8], usize),
    x: &QuantizedRow,
    sum: &mut ExactSum,
) {
    let first = g * GROUP;
    // SAFETY: AVX2 and `P` are the caller's promise; the loads read within `x`.
    unsafe {
        let (lows, highs) = half_sums::<P, false>(weights, x.values()[first * BLOCK..].as_ptr());
        let (x_mantissas, x_powers) = activation_scales(x, first);
        let terms = exact_terms(
            _mm256_add_epi32(lows, highs),
            _mm256_mullo_epi32(w_mantissas, x_mantissas),
            _mm256_add_epi32(w_exponents, x_powers),
            FLAT_BITS,
        );
        match terms {
            Some((units, lowest)) => sum.add_units(units, lowest),
            None => add_blocks::<P>(
                format,
                group,
                first,
                std::slice::from_ref(x),
                std::slice::from_mut(sum),
            ),
        }
    }
}

/// `IntegerDot::add_row` for the K formats, a block (eight sub-blocks of 32) at a time: the
/// values unpacked in registers, the sub-blocks' integer sums in lanes times their integer
/// scales, the terms summed exactly (`exact_terms`; the mins' terms apart), a block too wide
/// for that going as `quant` adds it.
///
/// # Safety
///
/// The CPU has AVX2 and `P`'s features; every row of `xs` is as long as `row`.
#[inline(always)]
unsafe fn k_row<P: Partials + IntegerDot>(
    format: BlockFormat,
    row: &[u8],
    xs: &[QuantizedRow],
    sums: &mut [ExactSum],
) {
    let bytes = format.block_bytes();
    // SAFETY: AVX2 and `P` are the caller's promise; every load below reads within a block
    // of `row` or within an activation row as long as `row`.
    unsafe {
        // One row (decode at batch 1): its sum kept in registers, and no loop over rows for
        // the unpacked block to stay live across (which spilled it to the stack).
        if let ([x], [sum]) = (xs, &mut *sums) {
            let mut local = std::mem::replace(sum, ExactSum::new());
            for (b, block) in row.chunks_exact(bytes).enumerate() {
                let k = k_block(format, block);
                match (Scale::of_f16(k.d), Scale::of_f16(k.dmin)) {
                    (Some(d), Some(dmin)) => {
                        k_product::<P>(format, &k, (d, dmin), (block, b), x, &mut local)
                    }
                    _ => local.poison(),
                }
            }
            *sum = local;
            return;
        }
        for (b, block) in row.chunks_exact(bytes).enumerate() {
            let k = k_block(format, block);
            let (Some(d), Some(dmin)) = (Scale::of_f16(k.d), Scale::of_f16(k.dmin)) else {
                sums.iter_mut().for_each(ExactSum::poison);
                continue;
            };
            for (x, sum) in xs.iter().zip(sums.iter_mut()) {
                k_product::<P>(format, &k, (d, dmin), (block, b), x, sum);
            }
        }
    }
}

/// Adds the product of K-format block `b` of a row (`block`, unpacked as `k`, its scales
/// `d` and `dmin`) and activation row `x` to `sum`.
///
/// # Safety
///
/// The CPU has AVX2 and `P`'s features; `x` is as long as the weight row.
#[inline(always)]
unsafe fn k_product<P: Partials + IntegerDot>(
    format: BlockFormat,
    k: &KBlock,
    (d, dmin): (Scale, Scale),
    (block, b): (&[u8], usize),
    x: &QuantizedRow,
    sum: &mut ExactSum,
) {
    let first = b * GROUP;
    // SAFETY: AVX2 and `P` are the caller's promise; the loads read within `x`.
    unsafe {
        let xs = x.values()[first * BLOCK..].as_ptr();
        let (lows, highs) = match format {
            BlockFormat::Q6K => half_sums::<P, false>(&k.values, xs),
            _ => half_sums::<P, true>(&k.values, xs),
        };
        let (a, bits) = match format {
            // Sixteen scales, one per half sub-block: below 2 * 2^7 * 2^16 * 2^22.
            BlockFormat::Q6K => (
                _mm256_add_epi32(
                    _mm256_mullo_epi32(k.scales, lows),
                    _mm256_mullo_epi32(k.high_scales, highs),
                ),
                47,
            ),
            // A 6-bit scale times a sum below 2^17, times two mantissas.
            _ => (
                _mm256_mullo_epi32(k.scales, _mm256_add_epi32(lows, highs)),
                46,
            ),
        };
        let x_sums = _mm256_loadu_si256(x.sums()[first..first + GROUP].as_ptr().cast());
        // The mins: `-min * sum(x)`, a 6-bit min times a sum below 2^12.
        let mins = _mm256_mullo_epi32(k.mins, x_sums);
        // The activation scales as one power of two's multiples (below 2^31): each
        // weight scale's terms summed in 64 bits (below 2^24 times those, eight
        // times), then scaled once.
        if let Some((exponent, multiples)) = x.group(b) {
            let multiples = _mm256_loadu_si256(multiples.as_ptr().cast());
            if format == BlockFormat::Q6K {
                let (scaled, _) = weighted_sums(a, _mm256_setzero_si256(), multiples);
                sum.add_scaled(scaled, d, exponent);
            } else {
                let (scaled, mins) = weighted_sums(a, mins, multiples);
                sum.add_scaled(scaled, d, exponent);
                sum.add_scaled(-mins, dmin, exponent);
            }
            return;
        }
        let (x_mantissas, x_powers) = activation_scales(x, first);
        let scaled = exact_terms(
            a,
            _mm256_mullo_epi32(_mm256_set1_epi32(d.mantissa), x_mantissas),
            _mm256_add_epi32(_mm256_set1_epi32(d.exponent), x_powers),
            bits,
        );
        let mins = match format {
            BlockFormat::Q6K => Some((0, 0)),
            _ => exact_terms(
                _mm256_sub_epi32(_mm256_setzero_si256(), mins),
                _mm256_mullo_epi32(_mm256_set1_epi32(dmin.mantissa), x_mantissas),
                _mm256_add_epi32(_mm256_set1_epi32(dmin.exponent), x_powers),
                40,
            ),
        };
        match (scaled, mins) {
            (Some((units, lowest)), Some((min_units, min_lowest))) => {
                sum.add_units(units, lowest);
                sum.add_units(min_units, min_lowest);
            }
            _ => add_blocks::<P>(
                format,
                block,
                b,
                std::slice::from_ref(x),
                std::slice::from_mut(sum),
            ),
        }
    }
}

/// The sums of 8 products `a * m` and of 8 products `b * m` (32-bit lanes), exact in 64
/// bits: the caller keeps each product below 2^60.
#[inline(always)]
unsafe fn weighted_sums(a: __m256i, b: __m256i, m: __m256i) -> (i64, i64) {
    // SAFETY: AVX2 is the caller's promise.
    unsafe {
        // `vpmuldq` multiplies the low 32 bits of each 64-bit lane, signed: the even lanes,
        // then the odd ones moved down.
        let odd_m = _mm256_srli_epi64::<32>(m);
        // A macro, not a closure: a closure is compiled without the caller's features.
        macro_rules! four {
            ($v:expr) => {
                _mm256_add_epi64(
                    _mm256_mul_epi32($v, m),
                    _mm256_mul_epi32(_mm256_srli_epi64::<32>($v), odd_m),
                )
            };
        }
        let (a, b) = (four!(a), four!(b));
        // Both reduced at once: lanes a0+a1, b0+b1, a2+a3, b2+b3, then the halves.
        let pairs = _mm256_add_epi64(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
        let two = _mm_add_epi64(
            _mm256_castsi256_si128(pairs),
            _mm256_extracti128_si256::<1>(pairs),
        );
        (_mm_cvtsi128_si64(two), _mm_extract_epi64::<1>(two))
    }
}

/// A K-format block in registers: its eight sub-blocks of 32 values (signed bytes), their
/// integer scales (Q6_K: of the first 16 values; `high_scales` of the last 16) and mins, and
/// the block's binary16 scales.
struct KBlock {
    values: [__m256i; GROUP],
    scales: __m256i,
    high_scales: __m256i,
    mins: __m256i,
    d: u16,
    dmin: u16,
}

/// `block` unpacked as `quant::BlockFormat::unpack` does, in registers.
#[inline(always)]
unsafe fn k_block(format: BlockFormat, block: &[u8]) -> KBlock {
    let half = |at: usize| u16::from_le_bytes([block[at], block[at + 1]]);
    // SAFETY: AVX2 is the caller's promise; `block` is one whole block of `format`, and each
    // load reads within it.
    unsafe {
        let mut values = [_mm256_setzero_si256(); GROUP];
        let nibble = _mm256_set1_epi8(0x0f);
        // Macros, not closures: a closure is compiled without the caller's features.
        macro_rules! load {
            ($at:expr) => {
                _mm256_loadu_si256(block[$at..$at + 32].as_ptr().cast())
            };
        }
        match format {
            BlockFormat::Q6K => {
                let mut scales = [0i32; 16];
                for (s, b) in scales.iter_mut().zip(&block[192..208]) {
                    *s = i32::from(*b as i8);
                }
                for h in 0..2 {
                    let (low_a, low_b, high) =
                        (load!(64 * h), load!(64 * h + 32), load!(128 + 32 * h));
                    macro_rules! pair {
                        ($mask:expr) => {
                            _mm256_and_si256(high, _mm256_set1_epi8($mask))
                        };
                    }
                    let groups = [
                        _mm256_or_si256(
                            _mm256_and_si256(low_a, nibble),
                            _mm256_slli_epi16::<4>(pair!(0x03)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(low_b, nibble),
                            _mm256_slli_epi16::<2>(pair!(0x0c)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(low_a), nibble),
                            pair!(0x30),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(low_b), nibble),
                            _mm256_srli_epi16::<2>(pair!(-64)),
                        ),
                    ];
                    for (g, group) in groups.into_iter().enumerate() {
                        values[4 * h + g] = _mm256_sub_epi8(group, _mm256_set1_epi8(32));
                    }
                }
                let (mut low, mut high) = ([0i32; GROUP], [0i32; GROUP]);
                for i in 0..GROUP {
                    (low[i], high[i]) = (scales[2 * i], scales[2 * i + 1]);
                }
                KBlock {
                    values,
                    scales: _mm256_loadu_si256(low.as_ptr().cast()),
                    high_scales: _mm256_loadu_si256(high.as_ptr().cast()),
                    mins: _mm256_setzero_si256(),
                    d: half(208),
                    dmin: 0,
                }
            }
            _ => {
                // `quant::scale_and_min` for all eight at once, four bytes a word: bytes
                // 0..4 hold the first four scales in their low six bits, bytes 4..8 the
                // mins; bytes 8..12 the last four's low nibbles (scales) and high nibbles
                // (mins), under the top two bits of bytes 0..4 (scales) and 4..8 (mins).
                let word = |at: usize| {
                    u32::from_le_bytes(block[at..at + 4].try_into().expect("12 bytes of scales"))
                };
                let (w0, w1, w2) = (word(4), word(8), word(12));
                let low_six = 0x3f3f_3f3f;
                let (nibbles, tops) = (0x0f0f_0f0f, 0x3030_3030);
                let scales =
                    u64::from(w0 & low_six) | u64::from((w2 & nibbles) | ((w0 >> 2) & tops)) << 32;
                let mins = u64::from(w1 & low_six)
                    | u64::from(((w2 >> 4) & nibbles) | ((w1 >> 2) & tops)) << 32;
                let (high, nibbles) = match format {
                    BlockFormat::Q5K => (Some(load!(16)), 48),
                    _ => (None, 16),
                };
                for c in 0..4 {
                    let bytes = load!(nibbles + 32 * c);
                    let halves = [
                        _mm256_and_si256(bytes, nibble),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), nibble),
                    ];
                    for (j, value) in halves.into_iter().enumerate() {
                        let i = 2 * c + j;
                        values[i] = match high {
                            // Bit `i` of each high byte is the sub-block's fifth bit.
                            Some(high) => {
                                let bit = _mm256_set1_epi8((1u8 << i) as i8);
                                let set = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit);
                                _mm256_or_si256(value, _mm256_and_si256(set, _mm256_set1_epi8(16)))
                            }
                            None => value,
                        };
                    }
                }
                KBlock {
                    values,
                    scales: _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(scales as i64)),
                    high_scales: _mm256_setzero_si256(),
                    mins: _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mins as i64)),
                    d: half(0),
                    dmin: half(2),
                }
            }
        }
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

/// The integer sums of 8 weight blocks with the 8 activation blocks at `x`, one block per
/// lane: over each block's first 16 values, and over its last 16. `UNSIGNED`: the weights
/// are in 0..=127 (`Partials::unsigned_partials`).
#[inline(always)]
unsafe fn half_sums<P: Partials, const UNSIGNED: bool>(
    weights: &[__m256i; GROUP],
    x: *const i8,
) -> (__m256i, __m256i) {
    // SAFETY: AVX2 and `P`'s features are the caller's promise; `x` has 8 blocks readable.
    unsafe {
        let mut p = [_mm256_setzero_si256(); GROUP];
        for (i, p) in p.iter_mut().enumerate() {
            let x = _mm256_loadu_si256(x.add(i * BLOCK).cast());
            *p = match UNSIGNED {
                true => P::unsigned_partials(weights[i], x),
                false => P::partials(weights[i], x),
            };
        }
        // Pairwise sums: the low 128-bit half of `q0` holds blocks 0..4's sums over their
        // first 16 values, its high half their sums over the last 16; `q1` blocks 4..8's.
        let (h01, h23) = (_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        let (h45, h67) = (_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
        let (q0, q1) = (_mm256_hadd_epi32(h01, h23), _mm256_hadd_epi32(h45, h67));
        (
            _mm256_permute2x128_si256::<0x20>(q0, q1),
            _mm256_permute2x128_si256::<0x31>(q0, q1),
        )
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
