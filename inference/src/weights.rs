//! Weights as stored: f32, bf16 or f16, or quantized in blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K,
//! from GGUF files),
//! memory-mapped where alignment allows (bf16 stays bf16 in memory and is widened inside
//! kernels; quantized blocks stay blocks, `kernels::quant`), owned otherwise.

use std::sync::{Arc, OnceLock};

use half::f16;
use memmap2::Mmap;

use crate::kernels::quant::{self, BlockFormat};

/// bf16 is the top half of an f32: widening is an exact shift (NaNs included).
#[inline(always)]
pub fn widen_bf16(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// Blocks of integers under binary16 scales (`kernels::quant`).
    Quantized(BlockFormat),
}

impl DType {
    /// The bytes `values` values take stored in this dtype; a quantized one stores whole
    /// blocks only (None otherwise, or on overflow).
    pub fn bytes(self, values: usize) -> Option<usize> {
        match self.block_format() {
            None => values.checked_mul(self.alignment()),
            Some(format) => (values.is_multiple_of(format.block_values()))
                .then(|| (values / format.block_values()).checked_mul(format.block_bytes()))
                .flatten(),
        }
    }

    /// The bytes of a `rows x cols` matrix stored in this dtype: rows of whole blocks for a
    /// quantized one (None otherwise, or on overflow).
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> Option<usize> {
        self.bytes(cols)?.checked_mul(rows)
    }

    /// The alignment a mapped view needs: a value's size; 1 for blocks (read bytewise).
    fn alignment(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::Quantized(_) => 1,
        }
    }

    /// The dtype's stable one-byte tag: what a genesis pin's expert leaves commit to, so it
    /// never changes for a dtype once given.
    pub fn tag(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::Quantized(BlockFormat::Q8_0) => 3,
            DType::Quantized(BlockFormat::Q4_0) => 4,
            DType::Quantized(BlockFormat::Q4K) => 5,
            DType::Quantized(BlockFormat::Q5K) => 6,
            DType::Quantized(BlockFormat::Q6K) => 7,
        }
    }

    /// The dtype of a tag (`tag`), if any.
    pub fn of_tag(tag: u8) -> Option<DType> {
        [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .chain(BlockFormat::ALL.map(DType::Quantized))
            .find(|d| d.tag() == tag)
    }

    /// The block layout of a quantized dtype.
    pub fn block_format(self) -> Option<BlockFormat> {
        match self {
            DType::Quantized(format) => Some(format),
            DType::F32 | DType::BF16 | DType::F16 => None,
        }
    }
}

#[derive(Clone)]
enum Storage {
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        end: usize,
    },
    /// u32 words so f32 and u16 views are always aligned.
    Owned(Arc<Vec<u32>>, usize),
}

/// A tensor viewed as a matrix of `rows x cols` (a vector is one row).
#[derive(Clone)]
pub struct Weight {
    storage: Storage,
    dtype: DType,
    rows: usize,
    cols: usize,
    /// For bf16: the range of the values' exponents, found on first use (a pass over the
    /// tensor) and shared by clones.
    exponents: Arc<OnceLock<Exponents>>,
}

impl Weight {
    /// A view of `map[start..end]`, copied to owned memory if it is misaligned for `dtype`.
    pub(crate) fn mapped(
        map: Arc<Mmap>,
        start: usize,
        end: usize,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Weight {
        let bytes = &map[start..end];
        if bytes.as_ptr().align_offset(dtype.alignment()) == 0 {
            return Weight {
                storage: Storage::Mapped { map, start, end },
                dtype,
                rows,
                cols,
                exponents: Arc::default(),
            };
        }
        Weight::owned_bytes(bytes, dtype, rows, cols)
    }

    pub(crate) fn owned_bytes(bytes: &[u8], dtype: DType, rows: usize, cols: usize) -> Weight {
        let mut words = vec![0u32; bytes.len().div_ceil(4)];
        bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Weight {
            storage: Storage::Owned(Arc::new(words), bytes.len()),
            dtype,
            rows,
            cols,
            exponents: Arc::default(),
        }
    }

    pub fn from_f32(values: Vec<f32>, rows: usize, cols: usize) -> Weight {
        assert_eq!(values.len(), rows * cols, "weight shape");
        let len = values.len() * 4;
        let words: Vec<u32> = values.into_iter().map(f32::to_bits).collect();
        Weight {
            storage: Storage::Owned(Arc::new(words), len),
            dtype: DType::F32,
            rows,
            cols,
            exponents: Arc::default(),
        }
    }

    /// A bf16 matrix from its raw bits (the layout checkpoints store).
    pub fn from_bf16(bits: &[u16], rows: usize, cols: usize) -> Weight {
        assert_eq!(bits.len(), rows * cols, "weight shape");
        Weight::owned_bytes(bytemuck::cast_slice(bits), DType::BF16, rows, cols)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes this weight occupies as stored.
    pub fn byte_len(&self) -> usize {
        self.dtype.matrix_bytes(self.rows, self.cols).unwrap_or(0)
    }

    /// Row `row`'s stored blocks, when quantized (the kernels read them as they are).
    pub fn row_blocks(&self, row: usize) -> Option<&[u8]> {
        self.dtype.block_format()?;
        let len = self.dtype.bytes(self.cols)?;
        self.bytes().get(row * len..(row + 1) * len)
    }

    fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped { map, start, end } => &map[*start..*end],
            Storage::Owned(words, len) => &bytemuck::cast_slice::<u32, u8>(words)[..*len],
        }
    }

    /// Row `row` widened to f32 into `out` (exact for every stored dtype).
    pub fn row_f32(&self, row: usize, out: &mut [f32]) {
        let (start, end) = (row * self.cols, (row + 1) * self.cols);
        let bytes = self.bytes();
        match self.dtype {
            DType::F32 => out.copy_from_slice(&bytemuck::cast_slice::<u8, f32>(bytes)[start..end]),
            DType::BF16 => {
                let halves = bytemuck::cast_slice::<u8, u16>(bytes);
                for (o, h) in out.iter_mut().zip(&halves[start..end]) {
                    *o = widen_bf16(*h);
                }
            }
            DType::F16 => {
                let halves = bytemuck::cast_slice::<u8, u16>(bytes);
                for (o, h) in out.iter_mut().zip(&halves[start..end]) {
                    *o = f16::from_bits(*h).to_f32();
                }
            }
            DType::Quantized(format) => {
                if let Some(blocks) = self.row_blocks(row) {
                    out.copy_from_slice(&quant::dequantize(format, blocks));
                }
            }
        }
    }

    /// Row `row` as raw bf16 bits, when stored as bf16 (kernels widen it on the fly).
    pub fn row_bf16(&self, row: usize) -> Option<&[u16]> {
        (self.dtype == DType::BF16).then(|| {
            &bytemuck::cast_slice::<u8, u16>(self.bytes())[row * self.cols..(row + 1) * self.cols]
        })
    }

    /// The range of exponents of a bf16 tensor's values (`Exponents::NONE` for another
    /// dtype), computed once.
    pub fn bf16_exponents(&self) -> Exponents {
        *self.exponents.get_or_init(|| match self.dtype {
            DType::BF16 => Exponents::of(bytemuck::cast_slice::<u8, u16>(self.bytes())),
            DType::F32 | DType::F16 | DType::Quantized(_) => Exponents::NONE,
        })
    }

    /// The whole tensor widened to f32 (for small tensors: norms, biases, embeddings rows).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, chunk) in out.chunks_mut(self.cols.max(1)).enumerate() {
            self.row_f32(r, chunk);
        }
        out
    }
}

/// The range of binary exponents (the stored, biased field) of a set of bf16 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exponents {
    /// Smallest and largest exponent of a nonzero value (`min > max` when all are zero).
    min: u8,
    max: u8,
    /// Every value is zero or a finite normal number.
    normal: bool,
}

impl Exponents {
    pub const NONE: Exponents = Exponents {
        min: u8::MAX,
        max: 0,
        normal: true,
    };

    /// The range over `bits`: branch-free over runs of 64, so that it vectorizes (a
    /// checkpoint's tensors are scanned once each, gigabytes in all).
    pub fn of(bits: &[u16]) -> Exponents {
        bits.chunks(64).fold(Exponents::NONE, |seen, run| {
            let (mut min, mut max, mut abnormal) = (u16::MAX, 0u16, 0u16);
            for &b in run {
                let exponent = (b >> 7) & 0xff;
                let nonzero = u16::from(b & 0x7fff != 0);
                // A zero counts as neither the smallest exponent nor the largest.
                min = min.min(exponent | (nonzero.wrapping_sub(1) & 0xff));
                max = max.max(exponent * nonzero);
                abnormal |= nonzero & u16::from(exponent == 0 || exponent == 0xff);
            }
            seen.union(Exponents {
                min: min.min(0xff) as u8,
                max: max as u8,
                normal: abnormal == 0,
            })
        })
    }

    pub fn union(self, other: Exponents) -> Exponents {
        Exponents {
            min: self.min.min(other.min),
            max: self.max.max(other.max),
            normal: self.normal && other.normal,
        }
    }

    /// Whether `vdpbf16ps` gives the reference bits for every `k`-long product of a value
    /// from `self` with one from `other` (see `kernels::bf16`'s header): both sets normal; the
    /// smallest product a multiple of 2^-126, since a value with stored exponent `e` is a
    /// multiple of `2^(e - 134)` and every partial sum is then a multiple too, so never
    /// subnormal; and `k` of the largest products summed stay below 2^127.
    pub fn dpbf16_exact(self, other: Exponents, k: usize) -> bool {
        if self.min > self.max || other.min > other.max {
            return self.normal && other.normal;
        }
        let log2_k = usize::BITS - k.max(1).saturating_sub(1).leading_zeros();
        self.normal
            && other.normal
            && u32::from(self.min) + u32::from(other.min) >= 142
            && log2_k + u32::from(self.max) + u32::from(other.max) <= 378
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use proptest::prelude::*;

    /// A quantized matrix is rows of whole blocks: two rows of 48 values are refused, though
    /// 96 values would fill three blocks.
    #[test]
    fn a_quantized_matrix_is_rows_of_whole_blocks() {
        let q = DType::Quantized;
        assert_eq!(q(BlockFormat::Q8_0).matrix_bytes(2, 64), Some(2 * 2 * 34));
        assert_eq!(q(BlockFormat::Q4_0).matrix_bytes(3, 32), Some(3 * 18));
        assert_eq!(q(BlockFormat::Q8_0).matrix_bytes(2, 48), None);
        assert_eq!(q(BlockFormat::Q4K).matrix_bytes(2, 512), Some(2 * 2 * 144));
        assert_eq!(q(BlockFormat::Q6K).matrix_bytes(1, 32), None);
        assert_eq!(DType::BF16.matrix_bytes(2, 48), Some(192));
        assert_eq!(DType::F32.matrix_bytes(usize::MAX, 2), None);
    }

    #[test]
    fn bf16_widening_is_exact_for_every_bit_pattern() {
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        let weight = Weight::owned_bytes(bytemuck::cast_slice(&bits), DType::BF16, 1, bits.len());
        let mut out = vec![0f32; bits.len()];
        weight.row_f32(0, &mut out);
        for (h, o) in bits.iter().zip(&out) {
            let reference = bf16::from_bits(*h).to_f32();
            assert!(
                reference.to_bits() == o.to_bits() || (reference.is_nan() && o.is_nan()),
                "{h:#06x}"
            );
        }
    }

    #[test]
    fn exponent_bounds_exclude_what_the_instruction_would_flush() {
        let one = Exponents::of(&[0x3f80]); // 1.0: stored exponent 127
        assert!(one.dpbf16_exact(one, 4096));
        assert!(Exponents::NONE.dpbf16_exact(one, 8));
        // A subnormal value, an infinity, a NaN: never.
        for odd in [0x0001u16, 0x7f80, 0x7fc0] {
            assert!(
                !Exponents::of(&[0x3f80, odd]).dpbf16_exact(one, 8),
                "{odd:#x}"
            );
        }
        // Products of exponents summing to 142 are multiples of 2^-126; 141, not.
        let (e71, e70) = (Exponents::of(&[71 << 7]), Exponents::of(&[70 << 7]));
        assert!(e71.dpbf16_exact(e71, 8) && !e71.dpbf16_exact(e70, 8));
        // Sums that might overflow: stored exponents 250 and 128 allow one term, not two.
        let (huge, two) = (Exponents::of(&[250 << 7]), Exponents::of(&[128 << 7]));
        assert!(huge.dpbf16_exact(two, 1) && !huge.dpbf16_exact(two, 2));
    }

    proptest! {
        #[test]
        fn the_exponent_scan_is_the_plain_definition(bits in proptest::collection::vec(any::<u16>(), 0..300), zeros in any::<bool>()) {
            // With `zeros`, most values are zeros of either sign, which the range skips.
            let bits: Vec<u16> = bits.iter().map(|b| if zeros && b % 4 != 0 { b & 0x8000 } else { *b }).collect();
            let nonzero: Vec<u16> = bits.iter().map(|b| (b >> 7) & 0xff).zip(&bits).filter(|(_, b)| *b & 0x7fff != 0).map(|(e, _)| e).collect();
            let want = Exponents {
                min: nonzero.iter().copied().min().map_or(u8::MAX, |e| e as u8),
                max: nonzero.iter().copied().max().map_or(0, |e| e as u8),
                normal: nonzero.iter().all(|e| *e != 0 && *e != 0xff),
            };
            prop_assert_eq!(Exponents::of(&bits), want);
        }
    }
}
