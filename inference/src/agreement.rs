//! How closely one model's next-token distributions follow another's over the same tokens, in
//! the terms llama.cpp's perplexity tool reports a quantization's error in: the mean KL
//! divergence of the candidate's distribution from the reference's, how often their top
//! tokens agree (overall, and where the reference's top two logits are at least a margin
//! apart, so that the reference itself has decided), and the logits' cosine. Used against
//! llama.cpp's own logits (`tests/gguf.rs`) and by `kvasir-node model compare`.

use crate::model::qwen_moe::{Cache, ForwardError, Model, Step};
use crate::moe::ExpertExecutor;

/// The logits `model` gives at every position of `tokens`, teacher-forced (each position sees
/// the tokens before it, whatever the model would have picked), one token per forward pass.
pub fn teacher_forced(
    model: &Model,
    experts: &dyn ExpertExecutor,
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>, ForwardError> {
    let mut cache = model.new_cache();
    tokens
        .iter()
        .map(|token| next_logits(model, experts, &mut cache, *token))
        .collect()
}

/// The logits after `token`, which extends the sequence in `cache`.
fn next_logits(
    model: &Model,
    experts: &dyn ExpertExecutor,
    cache: &mut Cache,
    token: u32,
) -> Result<Vec<f32>, ForwardError> {
    let mut step = [Step {
        cache,
        tokens: &[token],
    }];
    Ok(model.forward(&mut step, experts)?.remove(0))
}

/// `candidate` against `reference`, both teacher-forced over `tokens` side by side, one
/// position's logits of each held at a time (a long text's would not fit): None when their
/// logits do not pair (`Agreement::of`).
pub fn compare(
    reference: (&Model, &dyn ExpertExecutor),
    candidate: (&Model, &dyn ExpertExecutor),
    tokens: &[u32],
    margin: f32,
) -> Result<Option<Agreement>, ForwardError> {
    let (mut theirs, mut ours) = (reference.0.new_cache(), candidate.0.new_cache());
    let mut sums = Sums::new(margin);
    for token in tokens {
        let expected = next_logits(reference.0, reference.1, &mut theirs, *token)?;
        let got = next_logits(candidate.0, candidate.1, &mut ours, *token)?;
        if !sums.add(&expected, &got) {
            return Ok(None);
        }
    }
    Ok(sums.finish())
}

/// A candidate's logits against a reference's, position by position.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Agreement {
    pub positions: usize,
    /// Positions whose top token is the reference's.
    pub top1_same: usize,
    /// Positions where the reference's top two logits are at least `margin` apart.
    pub decided: usize,
    /// Of those, the positions whose top token is the reference's.
    pub decided_same: usize,
    pub margin: f32,
    /// KL(reference || candidate) of the softmaxes, in nats: mean and largest.
    pub mean_kl: f64,
    pub max_kl: f64,
    pub mean_cosine: f64,
}

impl Agreement {
    /// `candidate` against `reference`, positions paired in order; None when they differ in
    /// length, a position's vocabularies differ, or there are none.
    pub fn of(reference: &[Vec<f32>], candidate: &[Vec<f32>], margin: f32) -> Option<Agreement> {
        if candidate.len() != reference.len() {
            return None;
        }
        let mut sums = Sums::new(margin);
        for (theirs, mine) in reference.iter().zip(candidate) {
            if !sums.add(theirs, mine) {
                return None;
            }
        }
        sums.finish()
    }
}

/// An `Agreement` being summed, position by position.
struct Sums {
    agreement: Agreement,
    kl: f64,
    cosine: f64,
}

impl Sums {
    fn new(margin: f32) -> Sums {
        Sums {
            agreement: Agreement {
                positions: 0,
                top1_same: 0,
                decided: 0,
                decided_same: 0,
                margin,
                mean_kl: 0.0,
                max_kl: 0.0,
                mean_cosine: 0.0,
            },
            kl: 0.0,
            cosine: 0.0,
        }
    }

    /// Adds one position; false when its vocabularies differ or hold fewer than two tokens.
    fn add(&mut self, theirs: &[f32], mine: &[f32]) -> bool {
        if theirs.len() != mine.len() || theirs.len() < 2 {
            return false;
        }
        let a = &mut self.agreement;
        let (their_top, their_margin) = top(theirs);
        let same = top(mine).0 == their_top;
        a.positions += 1;
        a.top1_same += usize::from(same);
        if their_margin >= a.margin {
            a.decided += 1;
            a.decided_same += usize::from(same);
        }
        let divergence = kl(theirs, mine);
        self.kl += divergence;
        a.max_kl = a.max_kl.max(divergence);
        self.cosine += cosine(theirs, mine);
        true
    }

    /// The agreement over the positions added; None for none.
    fn finish(self) -> Option<Agreement> {
        let positions = self.agreement.positions;
        (positions > 0).then(|| Agreement {
            mean_kl: self.kl / positions as f64,
            mean_cosine: self.cosine / positions as f64,
            ..self.agreement
        })
    }
}

/// The top token and how far its logit is above the next one's.
fn top(logits: &[f32]) -> (usize, f32) {
    let mut sorted: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
    (sorted[0].0, sorted[0].1 - sorted[1].1)
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let exps: Vec<f64> = logits.iter().map(|l| (*l as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// KL(p || q) of two logit vectors' softmaxes, in nats.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (p, q) = (softmax(p), softmax(q));
    p.iter()
        .zip(&q)
        .filter(|(a, _)| **a > 0.0)
        .map(|(a, b)| a * (a / b).ln())
        .sum()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same logits agree entirely; a candidate that swaps the reference's decided top
    /// two disagrees there and diverges; shapes that do not pair give nothing.
    #[test]
    fn agreement_counts_what_it_says() {
        let reference = vec![vec![2.0, 0.0, -1.0], vec![0.1, 0.0, 0.05]];
        let same = Agreement::of(&reference, &reference, 0.5).unwrap();
        assert_eq!((same.top1_same, same.decided, same.decided_same), (2, 1, 1));
        assert!(same.mean_kl.abs() < 1e-12 && (same.mean_cosine - 1.0).abs() < 1e-12);
        let swapped = vec![vec![0.0, 2.0, -1.0], vec![0.1, 0.0, 0.05]];
        let other = Agreement::of(&reference, &swapped, 0.5).unwrap();
        assert_eq!(
            (other.top1_same, other.decided, other.decided_same),
            (1, 1, 0)
        );
        assert!(other.max_kl > 1.0 && other.mean_kl > 0.5);
        assert!(Agreement::of(&reference, &reference[..1], 0.5).is_none());
        assert!(Agreement::of(&[], &[], 0.5).is_none());
        assert!(Agreement::of(&[vec![1.0]], &[vec![1.0]], 0.5).is_none());
        assert!(Agreement::of(&[vec![1.0, 0.0]], &[vec![1.0, 0.0, 0.0]], 0.5).is_none());
    }
}
