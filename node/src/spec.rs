//! Expert selections on the command line (`--experts`, `--remote`): comma-separated
//! `LAYERS:EXPERTS` items, each side a number, an inclusive range `a-b`, or `*`.
//! `0:*` is every expert of layer 0; `*:0-7,3:9` is experts 0..=7 of every layer and
//! expert 9 of layer 3. Only MoE layers of the model hold experts.

use std::fmt;
use std::str::FromStr;

use kvasir_inference::config::Config;

use crate::wire::ExpertId;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Range {
    All,
    Span(u32, u32),
}

impl Range {
    fn contains(&self, v: usize) -> bool {
        match self {
            Range::All => true,
            Range::Span(a, b) => (*a as usize..=*b as usize).contains(&v),
        }
    }
}

impl FromStr for Range {
    type Err = String;
    fn from_str(s: &str) -> Result<Range, String> {
        let number = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("{t:?} is not a number, a range a-b or *"))
        };
        match s.trim() {
            "*" => Ok(Range::All),
            t => match t.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (number(a)?, number(b)?);
                    if a > b {
                        return Err(format!("range {t:?} runs backwards"));
                    }
                    Ok(Range::Span(a, b))
                }
                None => number(t).map(|v| Range::Span(v, v)),
            },
        }
    }
}

/// A set of (layer, expert) pairs, as written on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertSpec {
    text: String,
    items: Vec<(Range, Range)>,
}

impl ExpertSpec {
    pub fn contains(&self, layer: usize, expert: usize) -> bool {
        self.items
            .iter()
            .any(|(l, e)| l.contains(layer) && e.contains(expert))
    }

    /// The selected experts that exist in `config`, in (layer, expert) order.
    pub fn resolve(&self, config: &Config) -> Vec<ExpertId> {
        config
            .moe_layers()
            .flat_map(|l| (0..config.num_experts).map(move |e| (l, e)))
            .filter(|(l, e)| self.contains(*l, *e))
            .map(|(l, e)| (l as u16, e as u16))
            .collect()
    }
}

impl FromStr for ExpertSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<ExpertSpec, String> {
        let items = s
            .split(',')
            .map(|item| {
                let (layers, experts) = item
                    .split_once(':')
                    .ok_or_else(|| format!("{item:?} is not LAYERS:EXPERTS (e.g. 0:* or 1:0-7)"))?;
                Ok((layers.parse()?, experts.parse()?))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(ExpertSpec {
            text: s.to_string(),
            items,
        })
    }
}

impl fmt::Display for ExpertSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
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
    }

    #[test]
    fn bad_specs_say_why() {
        for bad in ["", "0", "x:1", "1:2-1", "1:-", "0:1,", ":"] {
            assert!(bad.parse::<ExpertSpec>().is_err(), "{bad:?}");
        }
    }
}
