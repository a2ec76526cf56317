//! Expert selections on the command line (`--experts`, `--remote`): the grammar of
//! `kvasir_primitives::selection::Pattern`, comma-separated `LAYERS:EXPERTS` items, each side
//! a number, an inclusive range `a-b`, or `*`, resolved against a checkpoint's config.
//! `0:*` is every expert of layer 0; `*:0-7,3:9` is experts 0..=7 of every layer and
//! expert 9 of layer 3. Only MoE layers of the model hold experts.

use std::fmt;
use std::str::FromStr;

use kvasir_inference::config::Config;
use kvasir_primitives::selection::{Pattern, SelectionError};

use crate::ExpertId;

/// A set of (layer, expert) pairs, as written on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSpec(Pattern);

impl ExpertSpec {
    pub fn contains(&self, layer: usize, expert: usize) -> bool {
        match (u16::try_from(layer), u16::try_from(expert)) {
            (Ok(layer), Ok(expert)) => self.0.contains((layer, expert)),
            _ => false,
        }
    }

    /// The selected experts that exist in `config`, in (layer, expert) order.
    pub fn resolve(&self, config: &Config) -> Vec<ExpertId> {
        // A config's shape is bounded far below u16 (see `Config::validate`).
        let layers = config.moe_layers().filter_map(|l| u16::try_from(l).ok());
        let experts = u16::try_from(config.num_experts).unwrap_or(u16::MAX);
        self.0.resolve(layers, experts)
    }
}

impl FromStr for ExpertSpec {
    type Err = String;
    /// The grammar's errors, worded for the command line, where `*` is allowed.
    fn from_str(s: &str) -> Result<ExpertSpec, String> {
        s.parse().map(ExpertSpec).map_err(|e| match e {
            SelectionError::Number(side) => format!("{side:?} is not a number, a range a-b or *"),
            SelectionError::Syntax(item) => {
                format!("{item:?} is not LAYERS:EXPERTS (e.g. 0:* or 1:0-7)")
            }
            SelectionError::Backwards(a, b) => format!("range {a}-{b} runs backwards"),
            other => other.to_string(),
        })
    }
}

impl fmt::Display for ExpertSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_items_ranges_and_stars() {
        let spec: ExpertSpec = "0:*,2-3:4-5,7:9".parse().unwrap();
        assert!(spec.contains(0, 63));
        assert!(spec.contains(3, 5) && !spec.contains(3, 6) && !spec.contains(4, 4));
        assert!(spec.contains(7, 9) && !spec.contains(7, 8));
        assert!("*:*".parse::<ExpertSpec>().unwrap().contains(100, 100));
        assert!(!"*:*".parse::<ExpertSpec>().unwrap().contains(1 << 20, 0));
    }

    #[test]
    fn bad_specs_say_why() {
        for bad in ["", "0", "x:1", "1:2-1", "1:-", "0:1,", ":", "70000:1"] {
            assert!(bad.parse::<ExpertSpec>().is_err(), "{bad:?}");
        }
        let said = |bad: &str| bad.parse::<ExpertSpec>().unwrap_err();
        assert_eq!(said("x:1"), "\"x\" is not a number, a range a-b or *");
        assert_eq!(said("0"), "\"0\" is not LAYERS:EXPERTS (e.g. 0:* or 1:0-7)");
        assert_eq!(said("1:2-1"), "range 2-1 runs backwards");
    }
}
