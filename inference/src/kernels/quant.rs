//! The reference arithmetic for quantized weights: an exact integer dot product.
//!
//! # Activations
//!
//! A row of `k` values (`k` a multiple of 32) is quantized in blocks of 32, as llama.cpp's
//! `quantize_row_q8_0` does, every step an IEEE 754 binary32 operation rounded to nearest
//! even: `amax` is the largest `|x|` of the block (NaNs left out), `d = amax / 127`,
//! `id = 1 / d` (0 when `d` is 0), and value `j` is `round(x[j] * id)` (halves away from
//! zero) as an 8-bit integer, saturating, a NaN giving 0. The block's scale is `d` rounded
//! to binary16 (nearest even): what the block stores, and the only scale the product uses.
//!
//! # The product
//!
//! A weight block of 32 values holds 8-bit (Q8_0) or 4-bit (Q4_0, `nibble - 8`) integers and
//! a binary16 scale. For one weight row against one quantized activation row:
//!
//! 1. Each block gives the integer `s = sum(w[j] * x[j])`, exact in 32 bits.
//! 2. A finite binary16 scale is exactly `m * 2^e` with an integer `m` (|m| < 2^11) and
//!    `-24 <= e <= 5`; the block's term is exactly `(m_w * m_x * s) * 2^(e_w + e_x)`, an
//!    integer below 2^41 times a power of two between 2^-48 and 2^10.
//! 3. The terms are summed exactly: the integers in 64 bits per power of two, then all of
//!    them in 128 bits as a multiple of 2^-48.
//! 4. That exact sum is rounded once to binary32, nearest even.
//!
//! So the result is the exact dot product of the stored integers and scales, correctly
//! rounded: it does not depend on the order of anything, and a kernel may reduce in
//! whatever order its instructions like (VNNI, AMX, Arm's `sdot`, a GPU's `dp4a`) and still
//! give these bits. A block with an infinite or NaN scale makes the product NaN.

use half::f16;

/// Values in a block.
pub const BLOCK: usize = 32;

/// A binary16 value as an exact integer times a power of two: `mantissa * 2^exponent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    mantissa: i32,
    exponent: i32,
}

/// The smallest power of two a term can carry (two subnormal binary16 scales).
const LOWEST: i32 = -48;
/// The number of powers of two a term can carry: `-48..=10`.
const POWERS: usize = 59;

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
/// binary16 bits and its 32 integers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizedRow {
    pub scales: Vec<u16>,
    pub values: Vec<i8>,
}

/// `x` quantized as the module's header says. `x.len()` must be a multiple of `BLOCK`.
pub fn quantize_row(x: &[f32]) -> QuantizedRow {
    debug_assert_eq!(x.len() % BLOCK, 0, "a row of whole blocks");
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    let mut values = Vec::with_capacity(x.len());
    for block in x.chunks_exact(BLOCK) {
        // `f32::max` leaves a NaN out, as C's `MAX(amax, fabsf(v))` does.
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        scales.push(f16::from_f32(d).to_bits());
        // `as i8` saturates and takes a NaN to 0.
        values.extend(block.iter().map(|v| (v * id).round() as i8));
    }
    QuantizedRow { scales, values }
}

/// An exact sum of block terms (the module's header, step 3).
struct ExactSum {
    by_power: [i64; POWERS],
    not_finite: bool,
}

impl ExactSum {
    fn new() -> ExactSum {
        ExactSum {
            by_power: [0; POWERS],
            not_finite: false,
        }
    }

    /// Adds `s * w * x`, the block sum `s` times the two scales.
    #[inline(always)]
    fn add(&mut self, s: i32, w: Option<Scale>, x: Option<Scale>) {
        let (Some(w), Some(x)) = (w, x) else {
            self.not_finite = true;
            return;
        };
        let power = (w.exponent + x.exponent - LOWEST) as usize;
        self.by_power[power] += i64::from(w.mantissa * x.mantissa) * i64::from(s);
    }

    /// The sum rounded once to binary32 (step 4).
    fn finish(&self) -> f32 {
        if self.not_finite {
            return f32::NAN;
        }
        let total: i128 = self
            .by_power
            .iter()
            .enumerate()
            .map(|(power, sum)| i128::from(*sum) << power)
            .sum();
        // The conversion rounds to nearest even; the power of two after it is exact (the
        // result, when not zero, is at least 2^-48, far above binary32's subnormals).
        (total as f32) * f32::from_bits(((127 + LOWEST) as u32) << 23)
    }
}

/// The weight block formats this arithmetic takes, with their stored layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFormat {
    /// 34 bytes: the binary16 scale, then 32 signed bytes.
    Q8_0,
    /// 18 bytes: the binary16 scale, then 16 bytes whose low nibbles are values 0..16 and
    /// high nibbles values 16..32, each `nibble - 8`.
    Q4_0,
}

impl BlockFormat {
    pub fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4_0 => 18,
        }
    }

    /// The block's scale bits and its 32 integers.
    #[inline(always)]
    fn unpack(self, block: &[u8]) -> (u16, [i8; BLOCK]) {
        let scale = u16::from_le_bytes([block[0], block[1]]);
        let mut values = [0i8; BLOCK];
        match self {
            BlockFormat::Q8_0 => {
                for (v, b) in values.iter_mut().zip(&block[2..34]) {
                    *v = *b as i8;
                }
            }
            BlockFormat::Q4_0 => {
                for (j, b) in block[2..18].iter().enumerate() {
                    values[j] = (b & 0x0f) as i8 - 8;
                    values[j + 16] = (b >> 4) as i8 - 8;
                }
            }
        }
        (scale, values)
    }
}

/// The product of one stored weight row (`format` blocks, as many as `x` has) and a
/// quantized activation row, in the reference arithmetic (the module's header).
pub fn dot(format: BlockFormat, row: &[u8], x: &QuantizedRow) -> f32 {
    debug_assert_eq!(row.len(), x.scales.len() * format.block_bytes());
    let mut sum = ExactSum::new();
    for ((block, &x_scale), xs) in row
        .chunks_exact(format.block_bytes())
        .zip(&x.scales)
        .zip(x.values.chunks_exact(BLOCK))
    {
        let (w_scale, ws) = format.unpack(block);
        let s: i32 = ws
            .iter()
            .zip(xs)
            .map(|(w, x)| i32::from(*w) * i32::from(*x))
            .sum();
        sum.add(s, Scale::of_f16(w_scale), Scale::of_f16(x_scale));
    }
    sum.finish()
}

/// The values a stored row holds, `integer * scale` widened to binary32 (exact: an 8-bit
/// integer times a binary16 scale needs at most 19 bits): for inspection and tests.
pub fn dequantize(format: BlockFormat, row: &[u8]) -> Vec<f32> {
    row.chunks_exact(format.block_bytes())
        .flat_map(|block| {
            let (scale, values) = format.unpack(block);
            let d = f16::from_bits(scale).to_f32();
            values.map(|v| f32::from(v) * d)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `dot` by another road: every value dequantized, each product of two in binary64
    /// (exact: at most 38 significant bits) summed in 128-bit fixed point, then rounded.
    fn exact(format: BlockFormat, row: &[u8], x: &QuantizedRow) -> f32 {
        let w = dequantize(format, row);
        let xs: Vec<f64> = x
            .values
            .chunks(BLOCK)
            .zip(&x.scales)
            .flat_map(|(vs, s)| {
                let d = f64::from(f16::from_bits(*s).to_f32());
                vs.iter().map(move |v| f64::from(*v) * d)
            })
            .collect();
        let scaled: i128 = w
            .iter()
            .zip(&xs)
            .map(|(a, b)| (f64::from(*a) * b * 2f64.powi(48)) as i128)
            .sum();
        (scaled as f32) * 2f32.powi(-48)
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
        /// The product is the exact dot product of what is stored, rounded once, and does not
        /// depend on the order of the blocks.
        #[test]
        fn the_product_is_exact_and_order_free(
            blocks in proptest::collection::vec(
                (0x0400u16..0x7800, any::<[i8; BLOCK]>(), proptest::collection::vec(-4.0f32..4.0, BLOCK)),
                1..6,
            ),
            sign in any::<bool>(),
        ) {
            let scales: Vec<u16> = blocks
                .iter()
                .map(|(s, ..)| if sign { s | 0x8000 } else { *s })
                .collect();
            let values: Vec<i8> = blocks.iter().flat_map(|(_, v, _)| *v).collect();
            let row = q8_row(&scales, &values);
            let x: Vec<f32> = blocks.iter().flat_map(|(.., x)| x.clone()).collect();
            let x = quantize_row(&x);
            let got = dot(BlockFormat::Q8_0, &row, &x);
            prop_assert_eq!(got.to_bits(), exact(BlockFormat::Q8_0, &row, &x).to_bits());
            // The blocks reversed, weights and activations alike: the same bits.
            let reversed_row: Vec<u8> = row.chunks(34).rev().flatten().copied().collect();
            let reversed_x = QuantizedRow {
                scales: x.scales.iter().rev().copied().collect(),
                values: x.values.chunks(BLOCK).rev().flatten().copied().collect(),
            };
            prop_assert_eq!(
                dot(BlockFormat::Q8_0, &reversed_row, &reversed_x).to_bits(),
                got.to_bits()
            );
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
        let theirs: Vec<u32> = floats("rows.q4_0.f32")
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let ours: Vec<u32> = dequantize(BlockFormat::Q4_0, &bytes("rows.q4_0"))
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn a_block_with_an_infinite_scale_makes_the_product_nan() {
        let row = q8_row(&[0x7c00], &[1; BLOCK]);
        assert!(dot(BlockFormat::Q8_0, &row, &quantize_row(&[1.0; BLOCK])).is_nan());
    }
}
