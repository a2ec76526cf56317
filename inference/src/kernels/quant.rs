//! The reference arithmetic for quantized weights: an exact integer dot product.
//!
//! # Activations
//!
//! A row of `k` values (`k` a multiple of 32) is quantized in blocks of 32, as llama.cpp's
//! `quantize_row_q8_0` does, every step an IEEE 754 binary32 operation rounded to nearest
//! even: `amax` is the largest `|x|` of the block (NaNs left out), `d = amax / 127`,
//! `id = 1 / d` (0 when `d` is 0), and value `j` is `round(x[j] * id)` (halves away from
//! zero) as an 8-bit integer, saturating to -127..=127, a NaN giving 0. The block's scale is `d` rounded
//! to binary16 (nearest even): what the block stores, and the only scale the product uses.
//!
//! # The product
//!
//! A weight row is stored in blocks (`BlockFormat`): 32 values of 8 bits (Q8_0) or 4 bits
//! (Q4_0) under one binary16 scale `d`; or 256 values (the K formats) in sub-blocks, each
//! with a small integer scale (and, for Q4_K and Q5_K, an integer min) under the block's
//! binary16 `d` (and `dmin`). Every stored value is thus an integer expression times a
//! binary16 scale. For one weight row against one quantized activation row, per activation
//! block of 32 (scale `d_x`, integers `x`):
//!
//! 1. Q8_0, Q4_0: the term `d * d_x * s`, with `s = sum(w[j] * x[j])` exact in 32 bits.
//! 2. Q4_K, Q5_K (sub-blocks of 32, values 0..32): `d * d_x * (scale * s)` and
//!    `dmin * d_x * (-min * sum(x[j]))`.
//! 3. Q6_K (sub-blocks of 16, values -32..32): `d * d_x * (scale_lo * s_lo + scale_hi * s_hi)`,
//!    the sums over each half of the activation block.
//!
//! A finite binary16 scale is exactly `m * 2^e` with an integer `m` (|m| < 2^11) and
//! `-24 <= e <= 5`; so each term is exactly an integer (below 2^48) times a power of two
//! between 2^-48 and 2^10. The terms are summed exactly, as one 128-bit multiple of 2^-48;
//! that exact sum is rounded once to binary32, nearest even.
//!
//! So the result is the exact dot product of the stored integers and scales, correctly
//! rounded: it does not depend on the order of anything, and a kernel may reduce in
//! whatever order its instructions like (VNNI, AMX, Arm's `sdot`, a GPU's `dp4a`) and still
//! give these bits. A block with an infinite or NaN scale makes the product NaN. This is part
//! of the reference arithmetic `crate::ARITHMETIC_VERSION` names: a format added gives new
//! answers and moves no old bit; a change to any bit it gives is a new version.

use half::f16;

use crate::weights::Weight;

/// Values in an activation block (and in a Q8_0 or Q4_0 weight block).
pub const BLOCK: usize = 32;

/// A binary16 value as an exact integer times a power of two: `mantissa * 2^exponent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    pub(super) mantissa: i32,
    pub(super) exponent: i32,
}

/// The smallest power of two a term can carry (two subnormal binary16 scales).
pub(super) const LOWEST: i32 = -48;

impl Scale {
    /// The binary16 `bits` exactly, or `None` for an infinity or a NaN.
    pub fn of_f16(bits: u16) -> Option<Scale> {
        let sign = if bits & 0x8000 != 0 { -1 } else { 1 };
        let field = i32::from((bits >> 10) & 0x1f);
        let fraction = i32::from(bits & 0x3ff);
        match field {
            0x1f => None,
            0 => Some(Scale {
                mantissa: sign * fraction,
                exponent: -24,
            }),
            _ => Some(Scale {
                mantissa: sign * (fraction | 0x400),
                exponent: field - 25,
            }),
        }
    }
}

/// A row of activations quantized in blocks (the module's header): per block its scale's
/// binary16 bits and its 32 integers (each in -127..=127, which the vector kernels rely on),
/// and the sum of those integers (for the K formats' mins).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizedRow {
    scales: Vec<u16>,
    values: Vec<i8>,
    sums: Vec<i32>,
    /// The scales as exact values, decoded once for every weight row they meet (0 for an
    /// infinity or a NaN, which makes `finite` false).
    mantissas: Vec<i32>,
    exponents: Vec<i32>,
    finite: bool,
    /// Per group of `GROUP_BLOCKS` blocks (a K format's block) whose nonzero scales' exponents
    /// spread at most `GROUP_SPREAD`: the lowest of them, and (in `shifted`) each block's
    /// mantissa times 2 to its exponent less that one, which fits 31 bits. So the group's
    /// scales are exact integers times one power of two, and a kernel can sum a block's
    /// terms in 64 bits before it scales them once. None for a wider group.
    group_exponents: Vec<Option<i32>>,
    shifted: Vec<i32>,
}

/// Activation blocks in a group (`QuantizedRow::group`): 256 values, a K format's block.
pub(super) const GROUP_BLOCKS: usize = 8;

/// How far a group's scales' exponents may spread for `QuantizedRow::group`: an 11-bit
/// mantissa shifted 20 bits stays within 31.
const GROUP_SPREAD: i32 = 20;

impl QuantizedRow {
    /// The row of these blocks, or `None` unless there are 32 values a scale, all in
    /// -127..=127.
    pub fn new(scales: Vec<u16>, values: Vec<i8>) -> Option<QuantizedRow> {
        if values.len() != scales.len() * BLOCK || values.contains(&i8::MIN) {
            return None;
        }
        let sums = values
            .chunks_exact(BLOCK)
            .map(|block| block.iter().map(|v| i32::from(*v)).sum())
            .collect();
        let decoded: Vec<Option<Scale>> = scales.iter().map(|s| Scale::of_f16(*s)).collect();
        let exact = |s: &Option<Scale>| {
            s.unwrap_or(Scale {
                mantissa: 0,
                exponent: 0,
            })
        };
        let exacts: Vec<Scale> = decoded.iter().map(exact).collect();
        let mut group_exponents = Vec::with_capacity(exacts.len() / GROUP_BLOCKS);
        let mut shifted = Vec::with_capacity(exacts.len());
        for group in exacts.chunks_exact(GROUP_BLOCKS) {
            // A zero scale's block adds nothing, whatever its exponent.
            let nonzero = || group.iter().filter(|s| s.mantissa != 0);
            let lowest = nonzero().map(|s| s.exponent).min().unwrap_or(0);
            let narrow = nonzero().all(|s| s.exponent - lowest <= GROUP_SPREAD);
            group_exponents.push(narrow.then_some(lowest));
            shifted.extend(group.iter().map(|s| match narrow && s.mantissa != 0 {
                true => s.mantissa << (s.exponent - lowest),
                false => 0,
            }));
        }
        Some(QuantizedRow {
            mantissas: exacts.iter().map(|s| s.mantissa).collect(),
            exponents: exacts.iter().map(|s| s.exponent).collect(),
            finite: decoded.iter().all(Option::is_some),
            group_exponents,
            shifted,
            scales,
            values,
            sums,
        })
    }

    /// Group `g`'s scales as one power of two's exponent and the blocks' integer multiples
    /// of it (`group_exponents`), or None where they spread too wide.
    #[inline(always)]
    pub(super) fn group(&self, g: usize) -> Option<(i32, &[i32])> {
        let exponent = (*self.group_exponents.get(g)?)?;
        Some((
            exponent,
            &self.shifted[g * GROUP_BLOCKS..(g + 1) * GROUP_BLOCKS],
        ))
    }

    pub fn values(&self) -> &[i8] {
        &self.values
    }

    /// Block `block`'s scale, exactly (a placeholder where `finite` is false).
    #[inline(always)]
    pub(super) fn scale(&self, block: usize) -> Scale {
        Scale {
            mantissa: self.mantissas[block],
            exponent: self.exponents[block],
        }
    }

    /// Each block's sum of its integers.
    pub(super) fn sums(&self) -> &[i32] {
        &self.sums
    }

    /// The blocks' exact scales, as `scale` gives them one by one.
    pub(super) fn scale_parts(&self) -> (&[i32], &[i32]) {
        (&self.mantissas, &self.exponents)
    }
}

/// `x` quantized as the module's header says. `x.len()` must be a multiple of `BLOCK`.
pub fn quantize_row(x: &[f32]) -> QuantizedRow {
    debug_assert_eq!(x.len() % BLOCK, 0, "a row of whole blocks");
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    let mut values = Vec::with_capacity(x.len());
    for block in x.chunks_exact(BLOCK) {
        // `f32::max` leaves a NaN out (C's `MAX(amax, fabsf(v))` would carry it into the
        // scale); a NaN value then quantizes to 0.
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        scales.push(f16::from_f32(d).to_bits());
        // `as i8` saturates and takes a NaN to 0. `|v * id|` is at most 127 and a little,
        // except when `d` is so small that `id` is infinite: then the values saturate, held
        // to -127..=127, and the scale is binary16 zero, so the products are zero all the same.
        values.extend(block.iter().map(|v| ((v * id).round() as i8).max(-127)));
    }
    QuantizedRow::new(scales, values).expect("whole blocks in -127..=127")
}

/// An exact sum of block terms (the module's header, step 3), as one 128-bit multiple of
/// 2^-48: a term is below 2^48 times at most 2^58 of those units, so even 2^20 of them stay
/// below 2^127.
pub(super) struct ExactSum {
    units: i128,
    not_finite: bool,
}

impl ExactSum {
    pub(super) fn new() -> ExactSum {
        ExactSum {
            units: 0,
            not_finite: false,
        }
    }

    /// Adds `integer * w * x`: an integer (a block's sum, times the block's integer scale for
    /// the K formats) times a weight scale, given as its binary16 bits, and an activation
    /// block's scale.
    #[inline(always)]
    pub(super) fn add(&mut self, integer: i64, w: u16, x: Scale) {
        let Some(w) = Scale::of_f16(w) else {
            self.not_finite = true;
            return;
        };
        let units = i128::from(i64::from(w.mantissa * x.mantissa) * integer);
        self.units += units << (w.exponent + x.exponent - LOWEST);
    }

    /// Adds `integer * w * 2^exponent`: terms of one weight scale `w` and activation scales
    /// that a kernel has already summed exactly as an integer multiple of `2^exponent` (an
    /// activation exponent, so at least -24).
    #[inline(always)]
    pub(super) fn add_scaled(&mut self, integer: i64, w: Scale, exponent: i32) {
        let shift = w.exponent + exponent - LOWEST;
        // The power of two folded into the mantissa where 64 bits hold it: one 64-by-64-bit
        // multiply, where a variable 128-bit shift is slow (AMD's `shld`).
        if shift <= 52 {
            self.units += i128::from(integer) * i128::from(i64::from(w.mantissa) << shift);
        } else {
            self.units += (i128::from(integer) * i128::from(w.mantissa)) << shift;
        }
    }

    /// Adds `units * 2^(power + LOWEST)`, `power` at most `2 * 5 - LOWEST`: terms a kernel
    /// has already summed exactly.
    #[inline(always)]
    pub(super) fn add_units(&mut self, units: i64, power: i32) {
        // A multiply, not a 128-bit shift (`add_scaled`): `power` is below 63.
        self.units += i128::from(units) * i128::from(1i64 << power);
    }

    /// Makes the sum NaN: a scale was an infinity or a NaN.
    pub(super) fn poison(&mut self) {
        self.not_finite = true;
    }

    /// The sum rounded once to binary32 (step 4).
    pub(super) fn finish(&self) -> f32 {
        if self.not_finite {
            return f32::NAN;
        }
        // The power of two after the rounding is exact (the result, when not zero, is at
        // least 2^-48, far above binary32's subnormals).
        round_to_f32(self.units) * f32::from_bits(((127 + LOWEST) as u32) << 23)
    }
}

/// `units` rounded to binary32, nearest even: what `units as f32` gives, without its
/// library call (8% of a Q4_K_M decode's time). A magnitude within 63 bits
/// converts in one instruction; a wider one keeps its top 63 bits and, in the lowest, whether
/// any bit below them is set, which rounds to 24 bits the same way.
#[inline(always)]
fn round_to_f32(units: i128) -> f32 {
    let magnitude = units.unsigned_abs();
    let rounded = if magnitude < 1 << 63 {
        magnitude as i64 as f32
    } else {
        let shift = 65 - magnitude.leading_zeros();
        let sticky = magnitude & ((1 << shift) - 1) != 0;
        let kept = (magnitude >> shift) as i64 | i64::from(sticky);
        kept as f32 * f32::from_bits((127 + shift) << 23)
    };
    if units < 0 {
        -rounded
    } else {
        rounded
    }
}

/// The weight block formats this arithmetic takes, with their stored layout (llama.cpp's).
/// Binary16 values are little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 32 values in 34 bytes: the scale `d`, then 32 signed bytes; value `d * q`.
    Q8_0,
    /// 32 values in 18 bytes: `d`, then 16 bytes whose low nibbles are values 0..16 and high
    /// nibbles values 16..32; value `d * (nibble - 8)`.
    Q4_0,
    /// 256 values in 144 bytes: `d`, `dmin`, 12 bytes of eight 6-bit scales and eight 6-bit
    /// mins (`scale_and_min`), then 128 bytes of nibbles: sub-block `2c` is the low nibbles of
    /// bytes `32c..32c + 32`, sub-block `2c + 1` their high nibbles. Value `j` of sub-block
    /// `i` is `d * scale[i] * q - dmin * min[i]`.
    Q4K,
    /// 256 values in 176 bytes: as Q4_K, with 32 bytes of high bits between the scales and
    /// the nibbles: value `l` of sub-block `i` adds 16 when bit `i` of high byte `l` is set.
    Q5K,
    /// 256 values in 210 bytes: 128 bytes of low nibbles, 64 bytes of high bit pairs, sixteen
    /// signed 8-bit scales (one per 16 values), then `d`. Value `v` is
    /// `d * scale[v / 16] * (q - 32)`, `q` six bits laid out as `q6k_value` reads them.
    Q6K,
}

impl BlockFormat {
    /// Every format, in the order of their tags.
    pub const ALL: [BlockFormat; 5] = [
        BlockFormat::Q8_0,
        BlockFormat::Q4_0,
        BlockFormat::Q4K,
        BlockFormat::Q5K,
        BlockFormat::Q6K,
    ];

    /// Values in a block: 32, or 256 for the K formats.
    pub fn block_values(self) -> usize {
        match self {
            BlockFormat::Q8_0 | BlockFormat::Q4_0 => BLOCK,
            BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => 256,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4K => 144,
            BlockFormat::Q5K => 176,
            BlockFormat::Q6K => 210,
        }
    }

    /// llama.cpp's name for the format.
    pub fn name(self) -> &'static str {
        match self {
            BlockFormat::Q8_0 => "Q8_0",
            BlockFormat::Q4_0 => "Q4_0",
            BlockFormat::Q4K => "Q4_K",
            BlockFormat::Q5K => "Q5_K",
            BlockFormat::Q6K => "Q6_K",
        }
    }

    /// `values` (whole blocks of 32) stored in this format as llama.cpp's reference
    /// quantizers (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`) store them, every step
    /// in binary32; `None` for the K formats, which this engine reads but does not write.
    pub fn quantize(self, values: &[f32]) -> Option<Vec<u8>> {
        match self {
            BlockFormat::Q8_0 => {
                let row = quantize_row(values);
                Some(
                    row.scales
                        .iter()
                        .zip(row.values.chunks_exact(BLOCK))
                        .flat_map(|(scale, block)| {
                            scale
                                .to_le_bytes()
                                .into_iter()
                                .chain(block.iter().map(|v| *v as u8))
                        })
                        .collect(),
                )
            }
            BlockFormat::Q4_0 => Some(values.chunks_exact(BLOCK).flat_map(quantize_q4_0).collect()),
            BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K => None,
        }
    }

    /// The block's integers and how they are scaled.
    #[inline(always)]
    fn unpack(self, block: &[u8]) -> Unpacked {
        let half = |at: usize| u16::from_le_bytes([block[at], block[at + 1]]);
        match self {
            BlockFormat::Q8_0 => {
                let bytes: [u8; BLOCK] = block[2..34].try_into().expect("34 bytes a block");
                Unpacked::Flat {
                    d: half(0),
                    values: bytemuck::cast(bytes),
                }
            }
            BlockFormat::Q4_0 => {
                let mut values = [0i8; BLOCK];
                for (j, b) in block[2..18].iter().enumerate() {
                    values[j] = (b & 0x0f) as i8 - 8;
                    values[j + 16] = (b >> 4) as i8 - 8;
                }
                Unpacked::Flat { d: half(0), values }
            }
            BlockFormat::Q4K => unpack_with_mins(block, None, &block[16..144]),
            BlockFormat::Q5K => unpack_with_mins(block, Some(&block[16..48]), &block[48..176]),
            BlockFormat::Q6K => {
                let mut values = [0i8; 256];
                for (v, value) in values.iter_mut().enumerate() {
                    *value = q6k_value(block, v);
                }
                let scales: [u8; 16] = block[192..208].try_into().expect("210 bytes a block");
                Unpacked::Sixteens {
                    d: half(208),
                    scales: bytemuck::cast(scales),
                    values,
                }
            }
        }
    }

    /// Adds the product of an unpacked block and the activation blocks under it (`xs` from
    /// block `first` of `x`) to `sum`, with `D`'s integer products.
    #[inline(always)]
    fn add_product<D: IntegerDot>(
        block: &Unpacked,
        x: &QuantizedRow,
        first: usize,
        sum: &mut ExactSum,
    ) {
        let xs = x.values[first * BLOCK..].as_ptr();
        match block {
            Unpacked::Flat { d, values } => {
                // SAFETY: 32 values each: `dot`'s row has as many values as `x`.
                let (low, high) = unsafe { D::halves(values.as_ptr(), xs) };
                sum.add(i64::from(low + high), *d, x.scale(first));
            }
            Unpacked::WithMins {
                d,
                dmin,
                scales,
                mins,
                values,
            } => {
                for i in 0..8 {
                    // SAFETY: as above, sub-block by sub-block.
                    let (low, high) =
                        unsafe { D::halves(values[BLOCK * i..].as_ptr(), xs.add(BLOCK * i)) };
                    let x_scale = x.scale(first + i);
                    sum.add(i64::from(scales[i]) * i64::from(low + high), *d, x_scale);
                    sum.add(
                        -i64::from(mins[i]) * i64::from(x.sums[first + i]),
                        *dmin,
                        x_scale,
                    );
                }
            }
            Unpacked::Sixteens { d, scales, values } => {
                for i in 0..8 {
                    // SAFETY: as above.
                    let (low, high) =
                        unsafe { D::halves(values[BLOCK * i..].as_ptr(), xs.add(BLOCK * i)) };
                    let term = i64::from(scales[2 * i]) * i64::from(low)
                        + i64::from(scales[2 * i + 1]) * i64::from(high);
                    sum.add(term, *d, x.scale(first + i));
                }
            }
        }
    }

    /// The block's values, as llama.cpp's `dequantize_row_*` computes them in binary32.
    fn dequantize_block(self, block: &[u8], out: &mut [f32]) {
        let widen = |bits: u16| f16::from_bits(bits).to_f32();
        match self.unpack(block) {
            Unpacked::Flat { d, values } => {
                for (o, v) in out.iter_mut().zip(values) {
                    *o = f32::from(v) * widen(d);
                }
            }
            Unpacked::WithMins {
                d,
                dmin,
                scales,
                mins,
                values,
            } => {
                for (i, (out, values)) in out
                    .chunks_exact_mut(BLOCK)
                    .zip(values.chunks_exact(BLOCK))
                    .enumerate()
                {
                    let scale = widen(d) * f32::from(scales[i]);
                    let min = widen(dmin) * f32::from(mins[i]);
                    for (o, v) in out.iter_mut().zip(values) {
                        *o = scale * f32::from(*v) - min;
                    }
                }
            }
            Unpacked::Sixteens { d, scales, values } => {
                for (v, o) in out.iter_mut().enumerate() {
                    *o = widen(d) * f32::from(scales[v / 16]) * f32::from(values[v]);
                }
            }
        }
    }
}

/// A block's integers and how they are scaled.
enum Unpacked {
    /// Q8_0, Q4_0: 32 values, one scale.
    Flat { d: u16, values: [i8; BLOCK] },
    /// Q4_K, Q5_K: 8 sub-blocks of 32 values (0..32), each with an integer scale and min.
    WithMins {
        d: u16,
        dmin: u16,
        scales: [u8; 8],
        mins: [u8; 8],
        values: [i8; 256],
    },
    /// Q6_K: 16 sub-blocks of 16 values (-32..32), each with a signed integer scale.
    Sixteens {
        d: u16,
        scales: [i8; 16],
        values: [i8; 256],
    },
}

/// One Q4_0 block: the value of largest magnitude (the first, on a tie) is -8 times the
/// scale; each value is `trunc(x / d + 8.5)`, at most 15.
fn quantize_q4_0(block: &[f32]) -> [u8; 18] {
    let mut max = 0f32;
    for v in block {
        if max.abs() < v.abs() {
            max = *v;
        }
    }
    let d = max / -8.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let mut out = [0u8; 18];
    out[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    let nibble = |x: f32| ((x * id + 8.5) as i8).clamp(0, 15) as u8;
    for j in 0..16 {
        out[2 + j] = nibble(block[j]) | (nibble(block[16 + j]) << 4);
    }
    out
}

/// A Q4_K or Q5_K block unpacked: `high` the Q5_K's fifth bits, `nibbles` the 128 bytes of
/// low bits.
#[inline(always)]
fn unpack_with_mins(block: &[u8], high: Option<&[u8]>, nibbles: &[u8]) -> Unpacked {
    let packed: &[u8; 12] = block[4..16]
        .try_into()
        .expect("a block's 12 bytes of scales");
    let mut values = [0i8; 256];
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    for i in 0..8 {
        (scales[i], mins[i]) = scale_and_min(packed, i);
        let bytes = &nibbles[32 * (i / 2)..32 * (i / 2) + 32];
        for (l, b) in bytes.iter().enumerate() {
            let nibble = if i % 2 == 0 { b & 0x0f } else { b >> 4 };
            let fifth = high.map_or(0, |h| ((h[l] >> i) & 1) << 4);
            values[32 * i + l] = (nibble | fifth) as i8;
        }
    }
    Unpacked::WithMins {
        d: u16::from_le_bytes([block[0], block[1]]),
        dmin: u16::from_le_bytes([block[2], block[3]]),
        scales,
        mins,
        values,
    }
}

/// Sub-block `i`'s 6-bit scale and min in Q4_K's and Q5_K's 12 packed bytes: for the first
/// four, the low six bits of bytes `i` and `i + 4`; for the last four, a nibble of byte
/// `i + 4` below the top two bits of byte `i - 4` (scale) or of byte `i` (min).
fn scale_and_min(packed: &[u8; 12], i: usize) -> (u8, u8) {
    if i < 4 {
        (packed[i] & 63, packed[i + 4] & 63)
    } else {
        (
            (packed[i + 4] & 0x0f) | ((packed[i - 4] >> 6) << 4),
            (packed[i + 4] >> 4) | ((packed[i] >> 6) << 4),
        )
    }
}

/// Value `v` of a Q6_K block, less 32, as llama.cpp's `dequantize_row_q6_K` reads it. Each
/// half of 128 values has 64 bytes of low nibbles and 32 bytes of high bit pairs. Value
/// `32g + l` of a half (`g` in 0..4, `l` in 0..32) takes the low nibble (`g` < 2) or the high
/// nibble of low byte `l + 32 * (g % 2)`, and bits `2g..2g + 2` of high byte `l`.
fn q6k_value(block: &[u8], v: usize) -> i8 {
    let (half, within) = (v / 128, v % 128);
    let (group, l) = (within / 32, within % 32);
    let low = block[64 * half + l + 32 * (group % 2)];
    let nibble = if group < 2 { low & 0x0f } else { low >> 4 };
    let pair = (block[128 + 32 * half + l] >> (2 * group)) & 3;
    (nibble | (pair << 4)) as i8 - 32
}

/// The integer products of 32 weight values and 32 activations, which each kernel tier
/// computes with its own instructions: exact, so every tier gives the same integers.
pub(super) trait IntegerDot {
    /// `(sum(w[j] * x[j]) for j in 0..16, the same for j in 16..32)`.
    ///
    /// # Safety
    ///
    /// 32 values are readable at each pointer, every `x[j]` is in -127..=127 (as in a
    /// `QuantizedRow`), and the CPU has the tier's features.
    unsafe fn halves(w: *const i8, x: *const i8) -> (i32, i32);

    /// Adds the products of one weight row and each row of `xs` (as long) to `sums`: block
    /// by block unless a tier has a faster way to the same integers.
    ///
    /// # Safety
    ///
    /// The CPU has the tier's features.
    #[inline(always)]
    unsafe fn add_row(format: BlockFormat, row: &[u8], xs: &[QuantizedRow], sums: &mut [ExactSum])
    where
        Self: Sized,
    {
        add_blocks::<Self>(format, row, 0, xs, sums)
    }
}

/// Plain Rust.
pub(super) struct Portable;

impl IntegerDot for Portable {
    #[inline(always)]
    unsafe fn halves(w: *const i8, x: *const i8) -> (i32, i32) {
        // SAFETY: the caller's promise of 32 readable values each.
        let (w, x) = unsafe {
            (
                std::slice::from_raw_parts(w, BLOCK),
                std::slice::from_raw_parts(x, BLOCK),
            )
        };
        let half = |range: std::ops::Range<usize>| -> i32 {
            w[range.clone()]
                .iter()
                .zip(&x[range])
                .map(|(w, x)| i32::from(*w) * i32::from(*x))
                .sum()
        };
        (half(0..16), half(16..32))
    }
}

/// The product of one stored weight row (`format` blocks, as many values as `x` has) and a
/// quantized activation row, in the reference arithmetic (the module's header).
pub fn dot(format: BlockFormat, row: &[u8], x: &QuantizedRow) -> f32 {
    let mut sum = ExactSum::new();
    add_row::<Portable>(
        format,
        row,
        std::slice::from_ref(x),
        std::slice::from_mut(&mut sum),
    );
    sum.finish()
}

/// Adds the products of one stored weight row and each row of `xs` to `sums` (one each),
/// unpacking each block once for all of them.
#[inline(always)]
fn add_row<D: IntegerDot>(
    format: BlockFormat,
    row: &[u8],
    xs: &[QuantizedRow],
    sums: &mut [ExactSum],
) {
    let values = row.len() / format.block_bytes() * format.block_values();
    // What the kernels' reads rely on.
    assert!(
        xs.iter().all(|x| x.values.len() == values),
        "a row as long as the weights'"
    );
    for (x, sum) in xs.iter().zip(sums.iter_mut()) {
        if !x.finite {
            sum.poison();
        }
    }
    // SAFETY: `D`'s features are the caller's to promise, as for every `D` method.
    unsafe { D::add_row(format, row, xs, sums) }
}

/// `add_row` block by block, for a row's blocks from block `first` on (`row` holds those).
#[inline(always)]
pub(super) fn add_blocks<D: IntegerDot>(
    format: BlockFormat,
    row: &[u8],
    first: usize,
    xs: &[QuantizedRow],
    sums: &mut [ExactSum],
) {
    let per_block = format.block_values() / BLOCK;
    let end = (first + row.len() / format.block_bytes()) * format.block_values();
    // What `add_product`'s reads rely on.
    assert!(
        xs.iter().all(|x| x.values.len() >= end),
        "activations as long as the weights"
    );
    for (b, block) in row.chunks_exact(format.block_bytes()).enumerate() {
        let block = format.unpack(block);
        for (x, sum) in xs.iter().zip(sums.iter_mut()) {
            BlockFormat::add_product::<D>(&block, x, (first + b) * per_block, sum);
        }
    }
}

/// `out[c * xs.len() + r]`: the product of weight row `columns.start + c` of `w` (`format`
/// blocks) and row `r` of `xs`, with `D`'s integer products.
#[inline(always)]
pub(super) fn column_products<D: IntegerDot>(
    format: BlockFormat,
    w: &Weight,
    columns: std::ops::Range<usize>,
    xs: &[QuantizedRow],
    out: &mut [f32],
) {
    let mut sums: Vec<ExactSum> = xs.iter().map(|_| ExactSum::new()).collect();
    for (j, out) in columns.zip(out.chunks_exact_mut(xs.len())) {
        let Some(row) = w.row_blocks(j) else {
            out.fill(f32::NAN);
            continue;
        };
        sums.iter_mut().for_each(|sum| *sum = ExactSum::new());
        add_row::<D>(format, row, xs, &mut sums);
        for (o, sum) in out.iter_mut().zip(&sums) {
            *o = sum.finish();
        }
    }
}

/// The values a stored row holds, as llama.cpp's `dequantize_row_*` computes them in
/// binary32 (exact for Q8_0 and Q4_0): for embeddings, inspection and tests.
pub fn dequantize(format: BlockFormat, row: &[u8]) -> Vec<f32> {
    let mut out = vec![0f32; row.len() / format.block_bytes() * format.block_values()];
    for (block, out) in row
        .chunks_exact(format.block_bytes())
        .zip(out.chunks_exact_mut(format.block_values()))
    {
        format.dequantize_block(block, out);
    }
    out
}

/// The values a row of activation blocks stands for (Q8_0's layout, what the wire protocol
/// carries a quantized request's rows in), chosen so that `quantize_row` gives back what the
/// arithmetic reads of the blocks `quantize_row` wrote: each value its integer times its
/// block's scale, exact in binary32, which quantizes to the same scale and integers. Two
/// kinds of block come back with other integers and products all the same: one whose scale
/// underflowed binary16 to zero (its products are zero), and one whose scale is an infinity
/// or a NaN (`quantize_row` writes an infinity for a block holding one, or whose scale
/// overflows binary16), which stands for an infinity followed by zeros and quantizes to an
/// infinite scale again (its products are NaN). So a matrix of block format times these
/// values gives the bits it gives the row they were quantized from. None unless `blocks` is
/// whole blocks.
pub fn activation_values(blocks: &[u8]) -> Option<Vec<f32>> {
    let format = BlockFormat::Q8_0;
    if !blocks.len().is_multiple_of(format.block_bytes()) {
        return None;
    }
    let mut values = dequantize(format, blocks);
    for (block, out) in blocks
        .chunks_exact(format.block_bytes())
        .zip(values.chunks_exact_mut(BLOCK))
    {
        if Scale::of_f16(u16::from_le_bytes([block[0], block[1]])).is_none() {
            out.fill(0.0);
            out[0] = f32::INFINITY;
        }
    }
    Some(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::{quantized_columns, Isa};
    use crate::weights::DType;
    use proptest::prelude::*;

    /// `dot` by another road: each stored value and each activation exactly, as an integer
    /// multiple of 2^-24 (every binary16 scale is one, and the K formats' values are integer
    /// combinations of them), their products summed in 128-bit fixed point, then rounded.
    fn exact(format: BlockFormat, row: &[u8], x: &QuantizedRow) -> f32 {
        let fixed = |bits: u16| (f64::from(f16::from_bits(bits).to_f32()) * 2f64.powi(24)) as i128;
        let w: Vec<i128> = row
            .chunks_exact(format.block_bytes())
            .flat_map(|block| match format.unpack(block) {
                Unpacked::Flat { d, values } => values[..BLOCK]
                    .iter()
                    .map(|v| i128::from(*v) * fixed(d))
                    .collect::<Vec<_>>(),
                Unpacked::WithMins {
                    d,
                    dmin,
                    scales,
                    mins,
                    values,
                } => (0..256)
                    .map(|v| {
                        let i = v / BLOCK;
                        i128::from(scales[i]) * i128::from(values[v]) * fixed(d)
                            - i128::from(mins[i]) * fixed(dmin)
                    })
                    .collect(),
                Unpacked::Sixteens { d, scales, values } => (0..256)
                    .map(|v| i128::from(scales[v / 16]) * i128::from(values[v]) * fixed(d))
                    .collect(),
            })
            .collect();
        let xs = x
            .values
            .chunks(BLOCK)
            .zip(&x.scales)
            .flat_map(|(vs, s)| vs.iter().map(move |v| i128::from(*v) * fixed(*s)));
        let scaled: i128 = w.iter().zip(xs).map(|(a, b)| a * b).sum();
        (scaled as f32) * 2f32.powi(-48)
    }

    proptest! {
        /// `round_to_f32` is Rust's own conversion, at every width.
        #[test]
        fn rounding_128_bits_is_the_conversions(value in any::<i128>(), width in 0u32..128) {
            let value = value >> width;
            prop_assert_eq!(round_to_f32(value).to_bits(), (value as f32).to_bits());
        }
    }

    #[test]
    fn rounding_128_bits_at_the_edges() {
        let halfway = (1i128 << 70) + (1i128 << 46);
        for value in [
            0,
            1,
            -1,
            i128::MAX,
            i128::MIN,
            i128::MIN + 1,
            1 << 63,
            (1 << 63) - 1,
            halfway,
            halfway + 1,
            -halfway,
            -halfway - 1,
            halfway + (1i128 << 47),
        ] {
            assert_eq!(
                round_to_f32(value).to_bits(),
                (value as f32).to_bits(),
                "{value}"
            );
        }
    }

    /// Where a block of `format` keeps its binary16 scales.
    fn scale_offsets(format: BlockFormat) -> &'static [usize] {
        match format {
            BlockFormat::Q8_0 | BlockFormat::Q4_0 => &[0],
            BlockFormat::Q4K | BlockFormat::Q5K => &[0, 2],
            BlockFormat::Q6K => &[208],
        }
    }

    fn q8_row(scales: &[u16], values: &[i8]) -> Vec<u8> {
        scales
            .iter()
            .zip(values.chunks(BLOCK))
            .flat_map(|(s, vs)| {
                let mut block = s.to_le_bytes().to_vec();
                block.extend(vs.iter().map(|v| *v as u8));
                block
            })
            .collect()
    }

    #[test]
    fn binary16_scales_are_exact_integers_times_powers_of_two() {
        for bits in 0..=u16::MAX {
            let value = f16::from_bits(bits);
            match Scale::of_f16(bits) {
                None => assert!(!value.is_finite()),
                Some(s) => {
                    let exact = f64::from(s.mantissa) * 2f64.powi(s.exponent);
                    assert_eq!(exact, f64::from(value.to_f32()), "{bits:#x}");
                    assert!((-24..=5).contains(&s.exponent) && s.mantissa.abs() < 1 << 11);
                }
            }
        }
    }

    #[test]
    fn quantization_follows_llama_cpps_rule_on_the_bits() {
        let mut x = [0f32; BLOCK];
        x[0] = 1.27;
        x[1] = -0.635;
        x[2] = 0.005;
        x[3] = f32::NAN;
        let q = quantize_row(&x);
        // d = 1.27 / 127 in binary32, stored as binary16; values from the binary32 inverse.
        let d = 1.27f32 / 127.0;
        assert_eq!(q.scales, [f16::from_f32(d).to_bits()]);
        let id = 1.0 / d;
        assert_eq!(q.values[0], (1.27f32 * id).round() as i8);
        assert_eq!(q.values[1], (-0.635f32 * id).round() as i8);
        assert_eq!(q.values[1], -64, "a half rounds away from zero");
        assert_eq!(q.values[3], 0, "a NaN is 0");
        assert_eq!(quantize_row(&[0.0; BLOCK]).values, [0; BLOCK]);
    }

    proptest! {
        /// For every format, the product is the exact dot product of what is stored, rounded
        /// once, and does not depend on the order of the blocks.
        #[test]
        fn the_product_is_exact_and_order_free(
            format in proptest::sample::select(BlockFormat::ALL.to_vec()),
            blocks in 1usize..4,
            seed in proptest::collection::vec(any::<u8>(), 210 * 3),
            scales in proptest::collection::vec(0x0400u16..0x7800, 2 * 3),
            activations in proptest::collection::vec(-4.0f32..4.0, 256 * 3),
            sign in any::<bool>(),
        ) {
            let bytes = format.block_bytes();
            let mut row = seed[..blocks * bytes].to_vec();
            for (b, block) in row.chunks_exact_mut(bytes).enumerate() {
                for (s, at) in scale_offsets(format).iter().enumerate() {
                    let bits = scales[2 * b + s] | if sign { 0x8000 } else { 0 };
                    block[*at..*at + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
            let values = blocks * format.block_values();
            let x = quantize_row(&activations[..values]);
            let got = dot(format, &row, &x);
            prop_assert_eq!(got.to_bits(), exact(format, &row, &x).to_bits());
            // The blocks reversed, weights and activations alike: the same bits.
            let per = format.block_values() / BLOCK;
            let reversed_row: Vec<u8> = row.chunks(bytes).rev().flatten().copied().collect();
            let reversed_x = QuantizedRow::new(
                x.scales.chunks(per).rev().flatten().copied().collect(),
                x.values.chunks(format.block_values()).rev().flatten().copied().collect(),
            )
            .unwrap();
            prop_assert_eq!(dot(format, &reversed_row, &reversed_x).to_bits(), got.to_bits());
        }
    }

    proptest! {
        /// Rows quantized, sent as blocks and read back as `activation_values` quantize to the
        /// same blocks, whatever the values (infinities, NaNs, subnormals, zeros included): so
        /// a worker that reads them computes what the sender would have.
        #[test]
        fn activation_blocks_read_back_quantize_to_themselves(
            raw in proptest::collection::vec(any::<u32>(), BLOCK * 4),
            special in proptest::collection::vec(
                proptest::sample::select(vec![
                    0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-40, -3e-39,
                    f32::MAX, f32::MIN_POSITIVE, 1e-30,
                ]),
                BLOCK * 4,
            ),
            mix in proptest::collection::vec(0u8..4, BLOCK * 4),
            scale in -140i32..130,
        ) {
            let x: Vec<f32> = raw
                .iter()
                .zip(&special)
                .zip(&mix)
                .map(|((bits, special), mix)| match mix {
                    0 => *special,
                    1 => f32::from_bits(*bits),
                    _ => (*bits as f32 / u32::MAX as f32 - 0.5) * 2f32.powi(scale),
                })
                .collect();
            // What the arithmetic reads of a block: its scale, and its integers where the
            // scale is finite and not zero (a product with an infinite or NaN scale is NaN
            // whatever they are, with a zero scale zero; a huge block's scale can overflow
            // binary16 to an infinity, a tiny one's underflow to zero, its integers not).
            let read = |row: QuantizedRow| -> Vec<(u16, Vec<i8>)> {
                row.scales
                    .iter()
                    .zip(row.values.chunks(BLOCK))
                    .map(|(scale, values)| match Scale::of_f16(*scale) {
                        Some(s) if s.mantissa != 0 => (*scale, values.to_vec()),
                        _ => (*scale, Vec::new()),
                    })
                    .collect()
            };
            let blocks = BlockFormat::Q8_0.quantize(&x).unwrap();
            let back = activation_values(&blocks).unwrap();
            prop_assert_eq!(read(quantize_row(&back)), read(quantize_row(&x)));
        }
    }

    /// Blocks whose scale underflows or overflows binary16 keep integers their products do
    /// not read: read back, they quantize to the same scale, and matrices of every block
    /// format give the same bits for them as for the rows they came from.
    #[test]
    fn blocks_of_a_scale_out_of_binary16_give_the_same_products() {
        let weights: Vec<u8> = (0..210).map(|i| (i * 37 % 251) as u8).collect();
        let normal = |x: &mut [f32]| {
            x.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = i as f32 - 50.0)
        };
        // A block whose scale underflows (its products zero), and one whose scale overflows
        // with another holding an infinity (its products NaN).
        let mut tiny = vec![0f32; 256];
        normal(&mut tiny);
        tiny[..BLOCK]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = i as f32 * 1e-7);
        let mut huge = vec![0f32; 256];
        normal(&mut huge);
        huge[..BLOCK].fill(f32::MAX / 2.0);
        huge[BLOCK] = f32::INFINITY;
        for (x, finite) in [(tiny, true), (huge, false)] {
            let back = activation_values(&BlockFormat::Q8_0.quantize(&x).unwrap()).unwrap();
            let (sent, read) = (quantize_row(&x), quantize_row(&back));
            assert_eq!(sent.scales, read.scales);
            assert_ne!(
                sent.values, read.values,
                "the out-of-range block's integers differ"
            );
            for format in BlockFormat::ALL {
                let blocks = 256 / format.block_values();
                let mut row = weights[..format.block_bytes()].repeat(blocks);
                // Weight scales of 1/16, so that the products are finite where they should be.
                for block in row.chunks_exact_mut(format.block_bytes()) {
                    for at in scale_offsets(format) {
                        block[*at..*at + 2].copy_from_slice(&0x2c00u16.to_le_bytes());
                    }
                }
                let (a, b) = (dot(format, &row, &sent), dot(format, &row, &read));
                assert_eq!(a.to_bits(), b.to_bits(), "{format:?}");
                assert_eq!(a.is_finite(), finite, "{format:?}: {a}");
            }
        }
    }

    #[test]
    fn activation_values_of_a_ragged_row_are_none() {
        assert_eq!(activation_values(&[0; 35]), None);
        assert_eq!(activation_values(&[]), Some(Vec::new()));
    }

    /// The kernel tiers this CPU runs.
    fn tiers() -> Vec<Isa> {
        let mut tiers = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                tiers.push(Isa::Avx2);
            }
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512vl")
            {
                tiers.push(Isa::Avx512);
            }
        }
        tiers
    }

    proptest! {
        /// Every kernel tier gives `dot`'s bits, whatever the bytes (a Q8_0 weight of -128
        /// included) and however many rows share a block.
        #[test]
        fn every_kernel_tier_gives_the_reference_bits(
            format in proptest::sample::select(BlockFormat::ALL.to_vec()),
            (columns, rows, blocks) in (1usize..4, 1usize..4, 1usize..20),
            seed in proptest::collection::vec(any::<u8>(), 210 * 19 * 3),
            scales in proptest::collection::vec(any::<u16>(), 2 * 19 * 3),
            narrow in any::<bool>(),
            activations in proptest::collection::vec(-1000.0f32..1000.0, 256 * 19 * 3),
            magnitudes in proptest::collection::vec(-45i32..30, 8 * 19 * 3),
            spread in 0u8..3,
        ) {
            // Activation blocks of one magnitude, or some zero and the rest as far apart as
            // 2^-45 and 2^30 (the kernels' grouped fast path and their exact fallback).
            let mut activations = activations;
            if spread > 0 {
                let wide = spread == 2;
                for (block, m) in activations.chunks_exact_mut(BLOCK).zip(&magnitudes) {
                    let factor = match (m, wide) {
                        (-45..=-40, _) => 0.0,
                        (_, true) => 2f32.powi(*m),
                        (_, false) => 2f32.powi(m.rem_euclid(16) - 8),
                    };
                    block.iter_mut().for_each(|v| *v *= factor);
                }
            }
            // K formats: at most 3 blocks of 256 (the byte and value budgets above).
            let blocks = if format.block_values() > BLOCK { blocks.min(3) } else { blocks };
            let (bytes, values) = (format.block_bytes(), format.block_values());
            let mut stored = seed[..columns * blocks * bytes].to_vec();
            for (b, block) in stored.chunks_exact_mut(bytes).enumerate() {
                for (s, at) in scale_offsets(format).iter().enumerate() {
                    // Scales of one binade (the vector kernels' fast path) or any bits
                    // (their exact fallback; infinities and NaNs), signs included.
                    let bits = scales[2 * b + s];
                    let bits = if narrow { 0x3400 | (bits & 0x83ff) } else { bits };
                    block[*at..*at + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
            let k = blocks * values;
            let w = Weight::owned_bytes(&stored, DType::Quantized(format), columns, k);
            let xs: Vec<QuantizedRow> =
                activations[..rows * k].chunks(k).map(quantize_row).collect();
            let reference: Vec<u32> = (0..columns)
                .flat_map(|j| {
                    let row = &stored[j * blocks * bytes..(j + 1) * blocks * bytes];
                    xs.iter().map(move |x| dot(format, row, x).to_bits())
                })
                .collect();
            for isa in tiers() {
                let mut out = vec![0f32; columns * rows];
                quantized_columns(isa, format, &w, 0..columns, &xs, &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(&got, &reference, "{:?}", isa);
            }
        }
    }

    #[test]
    fn q4_0_nibbles_are_their_value_less_eight_low_half_first() {
        let mut block = f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let values = dequantize(BlockFormat::Q4_0, &block);
        assert_eq!(values[0], -4.0);
        assert_eq!(values[15], 3.5);
        assert_eq!(values[16], 3.5);
        assert_eq!(values[31], -4.0);
        let x = quantize_row(&[1.0; BLOCK]);
        assert_eq!(
            dot(BlockFormat::Q4_0, &block, &x),
            exact(BlockFormat::Q4_0, &block, &x)
        );
    }

    /// Rows quantized by llama.cpp's own Python library (`tests/data/gguf/write.py`): the
    /// same bytes from `quantize_row`, and the same values from `dequantize`.
    #[test]
    fn rows_quantize_and_dequantize_as_llama_cpps_library_does() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/gguf/quantized-rows.gguf");
        let file = crate::gguf::Gguf::open(&path).unwrap();
        let bytes = |name: &str| file.bytes(file.header().tensor(name).unwrap()).to_vec();
        let floats = |name: &str| -> Vec<f32> {
            bytes(name)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let rows = floats("rows.f32");
        let ours: Vec<u8> = rows
            .chunks(128)
            .flat_map(|row| {
                let q = quantize_row(row);
                q8_row(&q.scales, &q.values)
            })
            .collect();
        assert_eq!(ours, bytes("rows.q8_0"));
        for format in [BlockFormat::Q8_0, BlockFormat::Q4_0] {
            let name = format!("rows.{}", format.name().to_lowercase());
            assert_eq!(format.quantize(&rows).unwrap(), bytes(&name), "{name}");
        }
        for format in [
            BlockFormat::Q4_0,
            BlockFormat::Q4K,
            BlockFormat::Q5K,
            BlockFormat::Q6K,
        ] {
            let name = format!("rows.{}", format.name().to_lowercase());
            let theirs: Vec<u32> = floats(&format!("{name}.f32"))
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let ours: Vec<u32> = dequantize(format, &bytes(&name))
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(ours.len(), theirs.len(), "{name}");
            assert_eq!(ours, theirs, "{name}");
        }
    }

    /// A block so small that `1 / d` is infinite quantizes to values held to -127..=127 and a
    /// zero scale, never to a row the kernels refuse (a negative value once saturated to
    /// -128 and panicked).
    #[test]
    fn a_tiny_block_quantizes_to_a_zero_scale_without_panicking() {
        let mut x = [0f32; BLOCK];
        x[0] = -1e-38;
        x[1] = 1e-39;
        let q = quantize_row(&x);
        assert_eq!(q.scales, [0]);
        assert!(q.values.iter().all(|v| (-127..=127).contains(v)));
        assert_eq!(
            dot(BlockFormat::Q8_0, &q8_row(&[0x3c00], &[1; BLOCK]), &q),
            0.0
        );
        let q4 = BlockFormat::Q4_0.quantize(&x).unwrap();
        assert!(dequantize(BlockFormat::Q4_0, &q4).iter().all(|v| *v == 0.0));
    }

    #[test]
    fn a_block_with_an_infinite_scale_makes_the_product_nan() {
        let row = q8_row(&[0x7c00], &[1; BLOCK]);
        assert!(dot(BlockFormat::Q8_0, &row, &quantize_row(&[1.0; BLOCK])).is_nan());
    }
}
