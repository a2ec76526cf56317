//! Weights as stored: f32, bf16 or f16, memory-mapped from safetensors where alignment
//! allows (bf16 stays bf16 in memory and is widened inside kernels), owned otherwise.

use std::sync::{Arc, OnceLock};

use half::f16;
use memmap2::Mmap;

use crate::kernels::bf16::Exponents;

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
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
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
        if bytes.as_ptr().align_offset(dtype.size()) == 0 {
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
        self.rows * self.cols * self.dtype.size()
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
            DType::F32 | DType::F16 => Exponents::NONE,
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

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
}
