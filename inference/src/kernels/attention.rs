//! Attention of the query heads that share one key/value head (grouped-query attention)
//! over a sequence's cached keys and values.
//!
//! # The reference arithmetic
//!
//! For each query `q` (one head, `width` long) over the positions `p < len`:
//!
//! 1. the score `s_p = dot(q, key_p) * scale`, `dot` the f32 reference of `cpu`'s header;
//! 2. the weights `w = cpu::softmax(s)`: `exp(s_p - max)` over their sum in ascending `p`;
//! 3. `out[d] = (...((out[d] + w_0 value_0[d]) + w_1 value_1[d]) + ...)` in ascending `p`, each
//!    product rounded, then added (`out` starts at zero).
//!
//! The kernels differ only in how many of these operations run at once. The portable one (also
//! built for AVX2) takes a score, then a query's output row, at a time. The AVX-512 one takes
//! 16 scores at a time, their 16-lane sums folded together by shuffles that make the
//! reference's pairwise adds, and keeps four queries by 32 dimensions of output in registers
//! over the positions, so that each value is loaded once for the four; a sequence's query
//! heads that share a key/value head come in one call for this.

use super::cpu::{self, dot_lanes, f32_lane_end, softmax, Isa, LANES};

/// One key/value head of a sequence's cache: position `p`'s key is
/// `keys[p * stride + offset..][..width]`, its value likewise in `values`.
#[derive(Clone, Copy)]
pub struct KeyValues<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub stride: usize,
    pub offset: usize,
    pub len: usize,
}

/// `queries` (whole heads of `width`, one after another) attending over the positions of
/// `kv`, added into `out` (as long as `queries`), in the module's reference arithmetic.
pub fn attend(queries: &[f32], width: usize, kv: KeyValues<'_>, scale: f32, out: &mut [f32]) {
    assert!(
        width > 0 && queries.len().is_multiple_of(width) && out.len() == queries.len(),
        "attention query shape"
    );
    if kv.len == 0 {
        return;
    }
    let end = (kv.len - 1) * kv.stride + kv.offset + width;
    assert!(
        kv.keys.len() >= end && kv.values.len() >= end,
        "attention cache shape"
    );
    let mut weights = vec![0f32; queries.len() / width * kv.len];
    let args = (queries, width, kv, scale);
    match cpu::isa() {
        // SAFETY: `isa` checked that the CPU has AVX-512F and FMA; the shapes are checked
        // above, so every load is within the slices.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 if width.is_multiple_of(LANES) => unsafe {
            attend_avx512(args, &mut weights, out)
        },
        // SAFETY: every kernel above the portable one needs AVX2 and FMA, which `isa` checked.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            attend_avx2(args, &mut weights, out)
        },
        _ => attend_with::<Portable>(args, &mut weights, out),
    }
}

/// The queries, their width, the cache and the scale.
type Args<'a, 'b> = (&'a [f32], usize, KeyValues<'b>, f32);

/// # Safety
///
/// The CPU has AVX-512F and FMA; the shapes are `attend`'s, checked, and `width` a multiple
/// of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_avx512(args: Args<'_, '_>, weights: &mut [f32], out: &mut [f32]) {
    attend_with::<x86::Avx512>(args, weights, out)
}

/// # Safety
///
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(args: Args<'_, '_>, weights: &mut [f32], out: &mut [f32]) {
    attend_with::<Portable>(args, weights, out)
}

/// A kernel's two halves of the work. Every method needs the implementation's CPU features
/// and `attend`'s checked shapes (the safety promise of each).
trait Kernel {
    /// One query's scores `dot(query, key_p) * scale` into `out` (`kv.len` long).
    unsafe fn scores(query: &[f32], kv: &KeyValues<'_>, scale: f32, out: &mut [f32]);
    /// `out[q][d] += weights[q][p] * value_p[d]` over ascending `p`, for every query `q`.
    unsafe fn weighted_values(weights: &[f32], width: usize, kv: &KeyValues<'_>, out: &mut [f32]);
}

/// One score at a time, each a `dot_lanes`; one query's output row at a time.
struct Portable;

impl Kernel for Portable {
    #[inline(always)]
    unsafe fn scores(query: &[f32], kv: &KeyValues<'_>, scale: f32, out: &mut [f32]) {
        let width = query.len();
        for (p, score) in out.iter_mut().enumerate() {
            let key = &kv.keys[p * kv.stride + kv.offset..][..width];
            *score = dot_lanes(query, key, f32_lane_end(width)) * scale;
        }
    }

    #[inline(always)]
    unsafe fn weighted_values(weights: &[f32], width: usize, kv: &KeyValues<'_>, out: &mut [f32]) {
        for (weights, out) in weights
            .chunks_exact(kv.len)
            .zip(out.chunks_exact_mut(width))
        {
            for (p, weight) in weights.iter().enumerate() {
                let value = &kv.values[p * kv.stride + kv.offset..][..width];
                for (o, v) in out.iter_mut().zip(value) {
                    *o += weight * v;
                }
            }
        }
    }
}

/// Scores, softmax and weighted values, by `K`. Inlined into each entry point, so
/// that its plain loops are built with the entry point's instructions.
#[inline(always)]
fn attend_with<K: Kernel>(
    (queries, width, kv, scale): Args<'_, '_>,
    weights: &mut [f32],
    out: &mut [f32],
) {
    for (query, weights) in queries
        .chunks_exact(width)
        .zip(weights.chunks_exact_mut(kv.len))
    {
        // SAFETY: the entry point's features are `K`'s (`attend` picks them together), and
        // the shapes were checked by `attend`.
        unsafe { K::scores(query, &kv, scale, weights) };
        softmax(weights);
    }
    // SAFETY: as above.
    unsafe { K::weighted_values(weights, width, &kv, out) };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::simd::fold16;
    use super::{Kernel, KeyValues, LANES};

    /// Sixteen scores at a time: sixteen 512-bit accumulators of one key each, folded
    /// together by `fold16`. Weighted values in tiles of four queries by 32 dimensions:
    /// eight accumulators, each value load serving four queries.
    pub(super) struct Avx512;

    impl Kernel for Avx512 {
        #[inline(always)]
        unsafe fn scores(query: &[f32], kv: &KeyValues<'_>, scale: f32, out: &mut [f32]) {
            let chunks = query.len() / LANES;
            let scale = _mm512_set1_ps(scale);
            for (block, out) in out.chunks_mut(LANES).enumerate() {
                let (first, n) = (block * LANES, out.len());
                // Accumulator `m` holds key `4 (m % 4) + m / 4`, the order `fold16` undoes;
                // in a short last block the missing keys repeat the last one, unstored.
                let keys: [*const f32; LANES] = std::array::from_fn(|m| {
                    let p = first + (4 * (m % 4) + m / 4).min(n - 1);
                    kv.keys.as_ptr().add(p * kv.stride + kv.offset)
                });
                let mut acc = [_mm512_setzero_ps(); LANES];
                for c in 0..chunks {
                    let q = _mm512_loadu_ps(query.as_ptr().add(c * LANES));
                    for (a, key) in acc.iter_mut().zip(keys) {
                        *a = _mm512_fmadd_ps(q, _mm512_loadu_ps(key.add(c * LANES)), *a);
                    }
                }
                let scores = _mm512_mul_ps(fold16(acc), scale);
                let mask = ((1u32 << n) - 1) as u16;
                _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, scores);
            }
        }

        #[inline(always)]
        unsafe fn weighted_values(
            weights: &[f32],
            width: usize,
            kv: &KeyValues<'_>,
            out: &mut [f32],
        ) {
            let queries = out.len() / width;
            for d in (0..width).step_by(2 * LANES) {
                for first in (0..queries).step_by(TILE_QUERIES) {
                    // A short last tile repeats its last query and stores only the real ones.
                    let tile: [usize; TILE_QUERIES] =
                        std::array::from_fn(|i| (first + i).min(queries - 1));
                    let real = (queries - first).min(TILE_QUERIES);
                    let at = Tile {
                        weights: tile.map(|q| weights.as_ptr().add(q * kv.len)),
                        out: tile.map(|q| out.as_mut_ptr().add(q * width + d)),
                        values: kv.values.as_ptr().add(kv.offset + d),
                    };
                    if width - d >= 2 * LANES {
                        value_tile::<2>(at, real, kv);
                    } else {
                        value_tile::<1>(at, real, kv);
                    }
                }
            }
        }
    }

    /// Queries of a register tile of weighted values.
    const TILE_QUERIES: usize = 4;

    /// Where a tile of weighted values reads and writes.
    struct Tile {
        weights: [*const f32; TILE_QUERIES],
        out: [*mut f32; TILE_QUERIES],
        values: *const f32,
    }

    /// `N` times 16 dimensions of the tile's queries (the first `real` of them stored),
    /// over every position.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn value_tile<const N: usize>(at: Tile, real: usize, kv: &KeyValues<'_>) {
        let mut acc = [[_mm512_setzero_ps(); N]; TILE_QUERIES];
        for i in 0..TILE_QUERIES {
            for n in 0..N {
                acc[i][n] = _mm512_loadu_ps(at.out[i].add(n * LANES));
            }
        }
        for p in 0..kv.len {
            let value = at.values.add(p * kv.stride);
            let v: [__m512; N] = std::array::from_fn(|n| _mm512_loadu_ps(value.add(n * LANES)));
            for i in 0..TILE_QUERIES {
                let w = _mm512_set1_ps(*at.weights[i].add(p));
                for n in 0..N {
                    acc[i][n] = _mm512_add_ps(acc[i][n], _mm512_mul_ps(w, v[n]));
                }
            }
        }
        for i in 0..real {
            for n in 0..N {
                _mm512_storeu_ps(at.out[i].add(n * LANES), acc[i][n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What each kernel this CPU runs gives for the same attention, by name.
    fn every_kernel(args: Args<'_, '_>) -> Vec<(&'static str, Vec<f32>)> {
        let (queries, width, kv, _) = args;
        let run = |kernel: &dyn Fn(&mut [f32], &mut [f32])| {
            let mut weights = vec![0f32; queries.len() / width * kv.len];
            let mut out = vec![0f32; queries.len()];
            kernel(&mut weights, &mut out);
            out
        };
        let mut outs = vec![("portable", run(&|w, o| attend_with::<Portable>(args, w, o)))];
        #[cfg(target_arch = "x86_64")]
        {
            let fma = std::is_x86_feature_detected!("fma");
            if fma && std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 and FMA, checked just above.
                outs.push(("avx2", run(&|w, o| unsafe { attend_avx2(args, w, o) })));
            }
            if fma && std::is_x86_feature_detected!("avx512f") && width.is_multiple_of(LANES) {
                // SAFETY: the CPU has AVX-512F and FMA, and the width is whole lanes.
                outs.push(("avx512", run(&|w, o| unsafe { attend_avx512(args, w, o) })));
            }
        }
        outs
    }

    /// The reference written plainly: one query at a time, one position at a time.
    fn reference(args: Args<'_, '_>) -> Vec<f32> {
        let (queries, width, kv, scale) = args;
        let mut out = vec![0f32; queries.len()];
        for (query, o) in queries.chunks(width).zip(out.chunks_mut(width)) {
            let mut w: Vec<f32> = (0..kv.len)
                .map(|p| cpu::dot(query, &kv.keys[p * kv.stride + kv.offset..][..width]) * scale)
                .collect();
            softmax(&mut w);
            for (p, weight) in w.iter().enumerate() {
                let value = &kv.values[p * kv.stride + kv.offset..][..width];
                for (o, v) in o.iter_mut().zip(value) {
                    *o += weight * v;
                }
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Widths of whole lanes and not, groups of one to six queries, short caches and
        /// ones of many 16-key blocks, scores from tiny to ones whose exponentials underflow.
        #[test]
        fn every_kernel_gives_the_reference_bits(
            seed in any::<u64>(),
            width in prop::sample::select(vec![1usize, 8, 16, 24, 32, 48, 64, 80, 128]),
            group in 1usize..7,
            kv_heads in 1usize..3,
            len in 1usize..70,
            scale in prop::sample::select(vec![1e-3f32, 0.125, 1.0, 40.0]),
        ) {
            let mut state = seed | 1;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            };
            let stride = kv_heads * width;
            let keys: Vec<f32> = (0..len * stride).map(|_| next()).collect();
            let values: Vec<f32> = (0..len * stride).map(|_| next()).collect();
            let queries: Vec<f32> = (0..group * width).map(|_| next()).collect();
            let kv = KeyValues { keys: &keys, values: &values, stride, offset: (kv_heads - 1) * width, len };
            let args = (&queries[..], width, kv, scale);
            let want: Vec<u32> = reference(args).iter().map(|v| v.to_bits()).collect();
            for (name, got) in every_kernel(args) {
                let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(&got, &want, "{}", name);
            }
        }
    }

    #[test]
    fn a_cache_shorter_than_its_length_is_refused_not_read() {
        let (keys, values) = (vec![0f32; 31], vec![0f32; 32]);
        let kv = KeyValues {
            keys: &keys,
            values: &values,
            stride: 16,
            offset: 0,
            len: 2,
        };
        let caught = std::panic::catch_unwind(|| {
            attend(&[0f32; 16], 16, kv, 1.0, &mut [0f32; 16]);
        });
        assert!(caught.is_err());
    }
}
