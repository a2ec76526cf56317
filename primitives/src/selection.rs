//! The one grammar for sets of experts: comma-separated items `LAYERS:EXPERTS`, each side a
//! number, an inclusive range `a-b`, or `*` (`0-3:0-7,5:9`, `0:*`).
//!
//! - A [`Pattern`] is the grammar as written: `*` means every layer (or expert) a model has,
//!   so it means something only where the model's shape is known (the command line of a
//!   worker or backbone, which resolves it against the checkpoint's config).
//! - A [`Selection`] is what the chain stores: the chain does not know a model's shape, so
//!   there is no `*`. A selection names its experts explicitly, and both the number of
//!   rectangles and the number of experts they cover are bounded before anything is
//!   expanded.

use std::fmt;
use std::str::FromStr;

use borsh::{BorshDeserialize, BorshSerialize};
use serde::Serialize;

/// Rectangles one selection in a transaction may hold.
pub const MAX_SELECTION_RECTS: usize = 16;
/// Experts one selection may cover (a 48-layer, 256-expert model has 12,288).
pub const MAX_SELECTION_EXPERTS: u64 = 16_384;

/// An inclusive range of layers or experts.
type Span = (u16, u16);

/// One layer and expert of a model.
pub type ExpertKey = (u16, u16);

/// Layers `layers.0..=layers.1` × experts `experts.0..=experts.1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Rect {
    pub layers: (u16, u16),
    pub experts: (u16, u16),
}

impl Rect {
    fn contains(&self, (layer, expert): ExpertKey) -> bool {
        (self.layers.0..=self.layers.1).contains(&layer)
            && (self.experts.0..=self.experts.1).contains(&expert)
    }

    /// How many experts it covers.
    pub fn size(&self) -> u64 {
        let span = |(a, b): (u16, u16)| u64::from(b.saturating_sub(a)) + 1;
        span(self.layers) * span(self.experts)
    }

    /// The experts both cover, if any.
    pub fn intersect(&self, other: &Rect) -> Option<Rect> {
        let side = |(a, b): Span, (c, d): Span| {
            let (low, high) = (a.max(c), b.min(d));
            (low <= high).then_some((low, high))
        };
        Some(Rect {
            layers: side(self.layers, other.layers)?,
            experts: side(self.experts, other.experts)?,
        })
    }

    /// Its experts, layer by layer.
    pub fn keys(&self) -> impl Iterator<Item = ExpertKey> {
        let Rect { layers, experts } = *self;
        (layers.0..=layers.1).flat_map(move |l| (experts.0..=experts.1).map(move |e| (l, e)))
    }
}

/// A set of experts of one model, as rectangles (which may overlap).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, BorshSerialize, BorshDeserialize)]
pub struct Selection(pub Vec<Rect>);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    #[error("an expert selection names no expert")]
    Empty,
    #[error("an expert selection holds {0} items, over the limit of {MAX_SELECTION_RECTS}")]
    TooManyRects(usize),
    #[error(
        "an expert selection covers up to {0} experts, over the limit of {MAX_SELECTION_EXPERTS}"
    )]
    TooManyExperts(u64),
    #[error("range {0}-{1} runs backwards")]
    Backwards(u16, u16),
    #[error("{0:?} is not LAYERS:EXPERTS items, each side a number or a range a-b (e.g. 0-3:0-7)")]
    Syntax(String),
    #[error("{0:?} is not a number from 0 to 65535 or a range a-b")]
    Number(String),
    #[error("{0:?}: `*` needs the model's shape; name the layers and experts (e.g. 0-47:0-255)")]
    Star(String),
}

/// One side of an item: every layer (or expert) of the model, or an inclusive range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    All,
    Span(u16, u16),
}

impl Side {
    fn contains(&self, v: u16) -> bool {
        match *self {
            Side::All => true,
            Side::Span(a, b) => (a..=b).contains(&v),
        }
    }
}

/// Items as written, `*` allowed: see the module's docs. Only ranges are checked (none
/// runs backwards); what the items cover is bounded by the model they are resolved against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    items: Vec<(Side, Side)>,
}

impl Pattern {
    pub fn contains(&self, (layer, expert): ExpertKey) -> bool {
        self.items
            .iter()
            .any(|(l, e)| l.contains(layer) && e.contains(expert))
    }

    /// The selection it writes for a model of `shape` (layers, experts per layer), `*` being
    /// all of either; without a shape, a `*` is an error (`SelectionError::Star`). Bounded as
    /// every selection is (`Selection::validate`).
    pub fn selection(&self, shape: Option<(u16, u16)>) -> Result<Selection, SelectionError> {
        let star = || SelectionError::Star(self.text.clone());
        let span = |side: Side, count: Option<u16>| match side {
            Side::Span(a, b) => Ok((a, b)),
            Side::All => count
                .and_then(|n| n.checked_sub(1))
                .map(|last| (0, last))
                .ok_or_else(star),
        };
        let rects = self
            .items
            .iter()
            .map(|&(layers, experts)| {
                Ok(Rect {
                    layers: span(layers, shape.map(|s| s.0))?,
                    experts: span(experts, shape.map(|s| s.1))?,
                })
            })
            .collect::<Result<Vec<_>, SelectionError>>()?;
        let selection = Selection(rects);
        selection.validate()?;
        Ok(selection)
    }

    /// The experts it names among `layers` × `0..experts` (a model's expert layers and
    /// experts per layer), in (layer, expert) order.
    pub fn resolve(&self, layers: impl Iterator<Item = u16>, experts: u16) -> Vec<ExpertKey> {
        layers
            .flat_map(|l| (0..experts).map(move |e| (l, e)))
            .filter(|key| self.contains(*key))
            .collect()
    }
}

impl FromStr for Pattern {
    type Err = SelectionError;

    fn from_str(text: &str) -> Result<Pattern, SelectionError> {
        let side = |t: &str| -> Result<Side, SelectionError> {
            let number = |n: &str| {
                n.trim()
                    .parse::<u16>()
                    .map_err(|_| SelectionError::Number(t.trim().to_string()))
            };
            match t.trim() {
                "*" => Ok(Side::All),
                t => {
                    let (a, b) = match t.split_once('-') {
                        Some((a, b)) => (number(a)?, number(b)?),
                        None => number(t).map(|v| (v, v))?,
                    };
                    if a > b {
                        return Err(SelectionError::Backwards(a, b));
                    }
                    Ok(Side::Span(a, b))
                }
            }
        };
        let items = text
            .split(',')
            .map(|item| {
                let (layers, experts) = item
                    .split_once(':')
                    .ok_or_else(|| SelectionError::Syntax(item.to_string()))?;
                Ok((side(layers)?, side(experts)?))
            })
            .collect::<Result<Vec<_>, SelectionError>>()?;
        Ok(Pattern {
            text: text.to_string(),
            items,
        })
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Selection {
    /// Checks the bounds and ranges; every selection from outside passes here first.
    pub fn validate(&self) -> Result<(), SelectionError> {
        if self.0.is_empty() {
            return Err(SelectionError::Empty);
        }
        if self.0.len() > MAX_SELECTION_RECTS {
            return Err(SelectionError::TooManyRects(self.0.len()));
        }
        for rect in &self.0 {
            for (a, b) in [rect.layers, rect.experts] {
                if a > b {
                    return Err(SelectionError::Backwards(a, b));
                }
            }
        }
        let total: u64 = self.0.iter().map(Rect::size).sum();
        if total > MAX_SELECTION_EXPERTS {
            return Err(SelectionError::TooManyExperts(total));
        }
        Ok(())
    }

    pub fn contains(&self, key: ExpertKey) -> bool {
        self.0.iter().any(|rect| rect.contains(key))
    }

    /// Every expert covered, sorted and without repeats. Bounded by `validate`, which every
    /// stored selection passed.
    pub fn expand(&self) -> Vec<ExpertKey> {
        let mut keys: Vec<ExpertKey> = self.0.iter().flat_map(Rect::keys).collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// The compact selection of `keys` (sorted, unique): runs of experts per layer, and
    /// consecutive layers with the same runs folded into one rectangle.
    pub fn from_keys(keys: &[ExpertKey]) -> Selection {
        // (first layer, last layer, expert runs shared by those layers)
        let mut groups: Vec<(u16, u16, Vec<Span>)> = Vec::new();
        let mut layer_runs: Vec<(u16, Vec<Span>)> = Vec::new();
        for &(layer, expert) in keys {
            match layer_runs.last_mut() {
                Some((l, runs)) if *l == layer => match runs.last_mut() {
                    Some(run) if run.1.checked_add(1) == Some(expert) => run.1 = expert,
                    _ => runs.push((expert, expert)),
                },
                _ => layer_runs.push((layer, vec![(expert, expert)])),
            }
        }
        for (layer, runs) in layer_runs {
            match groups.last_mut() {
                Some((_, last, same)) if last.checked_add(1) == Some(layer) && *same == runs => {
                    *last = layer;
                }
                _ => groups.push((layer, layer, runs)),
            }
        }
        let rects = groups
            .into_iter()
            .flat_map(|(first, last, runs)| {
                runs.into_iter().map(move |experts| Rect {
                    layers: (first, last),
                    experts,
                })
            })
            .collect();
        Selection(rects)
    }
}

impl FromStr for Selection {
    type Err = SelectionError;

    /// The grammar of [`Pattern`] without `*`, within the bounds of `validate`.
    fn from_str(text: &str) -> Result<Selection, SelectionError> {
        text.parse::<Pattern>()?.selection(None)
    }
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |(a, b): (u16, u16)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        };
        let items: Vec<String> = self
            .0
            .iter()
            .map(|r| format!("{}:{}", side(r.layers), side(r.experts)))
            .collect();
        f.write_str(&items.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// With a model's shape, `*` is all of its layers or experts; without one it is refused.
    #[test]
    fn a_star_becomes_the_whole_side_of_a_known_shape() {
        let pattern: Pattern = "*:0-3,5:*".parse().unwrap();
        let selection = pattern.selection(Some((48, 128))).unwrap();
        assert_eq!(selection.to_string(), "0-47:0-3,5:0-127");
        assert!(matches!(
            pattern.selection(None),
            Err(SelectionError::Star(_))
        ));
        assert!(matches!(
            pattern.selection(Some((0, 128))),
            Err(SelectionError::Star(_))
        ));
        let plain: Pattern = "0-3:0-7".parse().unwrap();
        assert_eq!(plain.selection(None), "0-3:0-7".parse());
    }

    #[test]
    fn parses_prints_and_refuses_what_it_cannot_bound() {
        let s: Selection = "0-3:0-7,5:9".parse().unwrap();
        assert_eq!(s.to_string(), "0-3:0-7,5:9");
        assert!(s.contains((3, 7)) && s.contains((5, 9)) && !s.contains((4, 0)));
        assert_eq!(s.expand().len(), 33);
        for bad in [
            "",
            "0",
            "*:*",
            "1:2-1",
            "x:1",
            "0:1,",
            "70000:1",
            "0-100:0-200",
        ] {
            assert!(bad.parse::<Selection>().is_err(), "{bad:?}");
        }
        let many = vec!["0:0"; MAX_SELECTION_RECTS + 1].join(",");
        assert_eq!(
            many.parse::<Selection>(),
            Err(SelectionError::TooManyRects(17))
        );
    }

    #[test]
    fn patterns_take_stars_and_resolve_against_a_shape() {
        let p: Pattern = "0:*,2-3:4-5,7:9".parse().unwrap();
        assert!(p.contains((0, 63)));
        assert!(p.contains((3, 5)) && !p.contains((3, 6)) && !p.contains((4, 4)));
        assert!(p.contains((7, 9)) && !p.contains((7, 8)));
        assert!("*:*".parse::<Pattern>().unwrap().contains((100, 100)));
        assert_eq!(p.resolve([0, 7].into_iter(), 10).len(), 11);
        assert_eq!(p.to_string(), "0:*,2-3:4-5,7:9");
        for bad in ["", "0", "x:1", "1:2-1", "1:-", "0:1,", ":", "70000:1"] {
            assert!(bad.parse::<Pattern>().is_err(), "{bad:?}");
        }
        assert_eq!(
            "0:*".parse::<Selection>(),
            Err(SelectionError::Star("0:*".into()))
        );
    }

    #[test]
    fn compacts_runs_and_equal_layers_into_rectangles() {
        let s: Selection = "0-3:0-7,5:9".parse().unwrap();
        assert_eq!(Selection::from_keys(&s.expand()), s);
        let ragged: Selection = "0:0-1,0:5,1:0-1,1:5,2:0".parse().unwrap();
        assert_eq!(
            Selection::from_keys(&ragged.expand()).to_string(),
            "0-1:0-1,0-1:5,2:0"
        );
    }

    proptest! {
        #[test]
        fn compaction_keeps_exactly_the_same_experts(
            keys in proptest::collection::btree_set((0u16..6, 0u16..10), 0..60)
        ) {
            let keys: Vec<ExpertKey> = keys.into_iter().collect();
            let compact = Selection::from_keys(&keys);
            prop_assert_eq!(compact.expand(), keys);
        }

        #[test]
        fn parsing_any_text_never_panics(text in ".{0,40}") {
            let _ = text.parse::<Selection>();
            let _ = text.parse::<Pattern>();
        }
    }
}
