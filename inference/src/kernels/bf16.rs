//! The arithmetic of a product with bf16 weights, and what its kernels share.
//!
//! # The reference arithmetic (bf16 weights)
//!
//! `out[r][j] = sum_i x[r][i] * w[j][i]` where `w` is stored as bf16:
//!
//! 1. Each input value is rounded to bf16 first: round to nearest, ties to even, on the bit
//!    pattern (`round_bf16`; NaNs stay NaN), exactly what a bf16 reference implementation
//!    does to activations anyway. Both operands are then bf16, widened exactly to f32.
//! 2. Lane `l` of 16 starts at `+0.0` and, for `c = 0, 1, ...` while `32c + 32 <= k`, takes
//!    the pair `2l + 1`, `2l` of chunk `c` in that order: `lane = fma(x[32c + 2l + 1],
//!    w[32c + 2l + 1], lane)`, then `lane = fma(x[32c + 2l], w[32c + 2l], lane)`. Each is a
//!    fused multiply-add in f32, rounding to nearest even, subnormals kept (never flushed).
//! 3. The lanes fold pairwise with plain adds (8, 4, 2, 1), as for f32 weights.
//! 4. The tail `i = k / 32 * 32 ..k` continues in ascending `i`: `sum = fma(x[i], w[i], sum)`.
//!
//! Why this order: it is the one of x86's `vdpbf16ps` (AVX-512 BF16), which multiplies and
//! adds 32 bf16 pairs into 16 f32 lanes in one instruction, twice the products of an f32
//! fused multiply-add and no widening of the weights; a compute-bound product (a batch, a
//! prompt) runs at up to twice the speed. A product of two bf16 values is exact in f32
//! unless it falls below f32's normal range, so there the instruction gives the bits of two
//! fused multiply-adds in that order, which every other backend (AVX2, AVX-512F, Arm,
//! CUDA) computes directly. The instruction also treats subnormal inputs as zero and
//! flushes subnormal results; the reference keeps them. So the instruction is used only
//! where it provably gives the reference bits (`Exponents::dpbf16_exact`): every nonzero
//! operand normal, each product a multiple of 2^-126 (so no partial sum can be subnormal),
//! and no partial sum near overflow. A row outside those bounds takes the fused
//! multiply-add path, which is always exact; and `self_check` tries the instruction against
//! the reference before it is ever chosen, so a CPU that rounds differently is not used.

use rayon::prelude::*;

use crate::weights::{widen_bf16, Exponents};

/// Lanes of the reduction, as for f32 weights; each takes a pair of elements a step.
pub(super) const LANES: usize = 16;
/// Elements a step of the 16 lanes consumes.
pub(super) const CHUNK: usize = 2 * LANES;

/// `v` rounded to bf16, to nearest with ties to even; a NaN stays a (quiet) NaN.
#[inline(always)]
pub fn round_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return (bits >> 16) as u16 | 0x0040;
    }
    let tie_to_even = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(tie_to_even) >> 16) as u16
}

/// Where the lane part of a `k`-long product ends and the in-order tail begins.
#[inline(always)]
pub(super) fn lane_end(k: usize) -> usize {
    k / CHUNK * CHUNK
}

/// The input rows of a product with bf16 weights, rounded to bf16 once for every column.
pub(super) struct Rows {
    /// `rows x k` rounded values, as bf16 bits.
    pub bits: Vec<u16>,
    pub exponents: Exponents,
}

impl Rows {
    /// Rounds `x`, spread over threads in runs of a fixed size (a prompt's rows are
    /// megabytes); the range's union is the same in any order.
    pub fn round(x: &[f32]) -> Rows {
        const RUN: usize = 16 * 1024;
        let mut bits = vec![0u16; x.len()];
        let exponents = bits
            .par_chunks_mut(RUN)
            .zip(x.par_chunks(RUN))
            .map(|(bits, x)| {
                for (b, v) in bits.iter_mut().zip(x) {
                    *b = round_bf16(*v);
                }
                Exponents::of(bits)
            })
            .reduce(|| Exponents::NONE, Exponents::union);
        Rows { bits, exponents }
    }

    /// The rounded rows widened back to f32 (exact) in the lane order of the fused
    /// multiply-add kernels: each chunk of 32 as its 16 odd elements (`2l + 1`), then its 16
    /// even ones (`2l`), so that a kernel of 16 lanes over this layout makes the reference's
    /// two steps per chunk; the tail stays in order.
    pub fn in_lane_order(&self, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.bits.len()];
        for (row, dst) in self.bits.chunks(k).zip(out.chunks_mut(k)) {
            widen_in_lane_order(row, dst);
        }
        out
    }
}

/// One row of bf16 bits widened to f32 in the lane order of `Rows::in_lane_order`.
#[inline(always)]
pub(super) fn widen_in_lane_order(bits: &[u16], out: &mut [f32]) {
    let end = lane_end(bits.len());
    for (chunk, dst) in bits[..end]
        .chunks_exact(CHUNK)
        .zip(out.chunks_exact_mut(CHUNK))
    {
        for l in 0..LANES {
            dst[l] = widen_bf16(chunk[2 * l + 1]);
            dst[LANES + l] = widen_bf16(chunk[2 * l]);
        }
    }
    for (o, b) in out[end..].iter_mut().zip(&bits[end..]) {
        *o = widen_bf16(*b);
    }
}

/// The reference sum of one product, straight from the module's header: the slow, obvious
/// form, against which `self_check` and the tests compare every kernel.
pub fn reference_dot(x: &[u16], w: &[u16]) -> f32 {
    assert_eq!(x.len(), w.len());
    let end = lane_end(x.len());
    let mut lanes = [0f32; LANES];
    for c in (0..end).step_by(CHUNK) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            for i in [c + 2 * l + 1, c + 2 * l] {
                *lane = widen_bf16(x[i]).mul_add(widen_bf16(w[i]), *lane);
            }
        }
    }
    let mut sum = super::cpu::fold_lanes(lanes);
    for i in end..x.len() {
        sum = widen_bf16(x[i]).mul_add(widen_bf16(w[i]), sum);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rounding_is_to_nearest_even_on_every_kind_of_value() {
        for v in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
        ] {
            assert_eq!(round_bf16(v), half::bf16::from_f32(v).to_bits(), "{v:e}");
        }
        // Halfway cases go to the even neighbour; just past halfway, up.
        assert_eq!(round_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(round_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(round_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        // The largest finite values round up to infinity, as IEEE says.
        assert_eq!(round_bf16(f32::from_bits(0x7f7f_ffff)), 0x7f80);
        assert!(half::bf16::from_bits(round_bf16(f32::NAN)).is_nan());
        assert!(half::bf16::from_bits(round_bf16(f32::from_bits(0x7f80_0001))).is_nan());
    }

    proptest! {
        #[test]
        fn rounding_agrees_with_the_half_crate(bits in any::<u32>()) {
            let v = f32::from_bits(bits);
            let (ours, theirs) = (round_bf16(v), half::bf16::from_f32(v));
            prop_assert!(ours == theirs.to_bits() || (v.is_nan() && theirs.is_nan() && half::bf16::from_bits(ours).is_nan()));
        }

        #[test]
        fn lane_order_holds_every_value_once(k in 0usize..100, seed in any::<u16>()) {
            let bits: Vec<u16> = (0..k as u16).map(|i| i.wrapping_mul(40503) ^ seed).collect();
            let mut out = vec![0f32; k];
            widen_in_lane_order(&bits, &mut out);
            let mut seen: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            let mut want: Vec<u32> = bits.iter().map(|b| widen_bf16(*b).to_bits()).collect();
            seen.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(seen, want);
        }
    }
}
