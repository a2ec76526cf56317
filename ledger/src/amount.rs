//! KVR amounts: integer base units (1 KVR = 10^9), checked arithmetic, exact decimal text.

use std::fmt;
use std::str::FromStr;

use borsh::{BorshDeserialize, BorshSerialize};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Base units in one KVR.
pub const BASE_UNITS_PER_KVR: u64 = 1_000_000_000;
const DECIMALS: usize = 9;

/// An amount of KVR in base units. Arithmetic is checked: overflow is an error, never a wrap.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    BorshSerialize,
    BorshDeserialize,
)]
pub struct Amount(u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmountError {
    #[error("amount is empty")]
    Empty,
    #[error("amount is negative")]
    Negative,
    #[error("amount has more than 9 decimals (1 base unit = 0.000000001 KVR)")]
    TooManyDecimals,
    #[error("amount is not a decimal number: {0:?}")]
    Invalid(String),
    #[error("amount overflows the largest representable value")]
    Overflow,
}

impl Amount {
    pub const ZERO: Amount = Amount(0);
    pub const MAX: Amount = Amount(u64::MAX);

    pub const fn from_base_units(units: u64) -> Self {
        Amount(units)
    }

    pub const fn base_units(self) -> u64 {
        self.0
    }

    pub fn is_zero(self) -> bool {
        self.0 == 0
    }

    pub fn checked_add(self, other: Amount) -> Option<Amount> {
        self.0.checked_add(other.0).map(Amount)
    }

    pub fn checked_sub(self, other: Amount) -> Option<Amount> {
        self.0.checked_sub(other.0).map(Amount)
    }

    /// Exact decimal text without unit, trailing zeros trimmed: `0.008945664`, `12`, `0.5`.
    pub fn to_decimal(self) -> String {
        let whole = self.0 / BASE_UNITS_PER_KVR;
        let frac = self.0 % BASE_UNITS_PER_KVR;
        if frac == 0 {
            return whole.to_string();
        }
        let frac = format!("{frac:0DECIMALS$}");
        format!("{whole}.{}", frac.trim_end_matches('0'))
    }

    /// Parses exact decimal KVR text, with or without a trailing ` KVR`.
    pub fn parse(text: &str) -> Result<Amount, AmountError> {
        let text = text.trim();
        let text = text.strip_suffix("KVR").map(str::trim_end).unwrap_or(text);
        if text.is_empty() {
            return Err(AmountError::Empty);
        }
        if text.starts_with('-') {
            return Err(AmountError::Negative);
        }
        let (whole, frac) = match text.split_once('.') {
            Some((w, f)) => (w, f),
            None => (text, ""),
        };
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        let has_dot = text.contains('.');
        if !all_digits(whole) || !all_digits(frac) || (whole.is_empty() && frac.is_empty()) {
            return Err(AmountError::Invalid(text.to_string()));
        }
        if has_dot && frac.is_empty() {
            return Err(AmountError::Invalid(text.to_string()));
        }
        if frac.len() > DECIMALS {
            return Err(AmountError::TooManyDecimals);
        }
        let whole: u64 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| AmountError::Overflow)?
        };
        let frac_units: u64 = if frac.is_empty() {
            0
        } else {
            // At most 9 digits, so this parse and scale cannot overflow.
            frac.parse::<u64>()
                .map_err(|_| AmountError::Invalid(text.to_string()))?
                * 10u64.pow((DECIMALS - frac.len()) as u32)
        };
        whole
            .checked_mul(BASE_UNITS_PER_KVR)
            .and_then(|w| w.checked_add(frac_units))
            .map(Amount)
            .ok_or(AmountError::Overflow)
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} KVR", self.to_decimal())
    }
}

impl FromStr for Amount {
    type Err = AmountError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Amount::parse(s)
    }
}

/// JSON carries amounts as exact decimal strings, never as numbers that a reader might turn
/// into floats.
impl Serialize for Amount {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_decimal())
    }
}

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <String as Deserialize>::deserialize(deserializer)?;
        Amount::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_the_announcement_figure() {
        assert_eq!(
            Amount::from_base_units(8_945_664).to_string(),
            "0.008945664 KVR"
        );
        assert_eq!(
            Amount::from_base_units(BASE_UNITS_PER_KVR).to_string(),
            "1 KVR"
        );
        assert_eq!(Amount::from_base_units(1).to_decimal(), "0.000000001");
        assert_eq!(Amount::from_base_units(1_500_000_000).to_decimal(), "1.5");
        assert_eq!(Amount::ZERO.to_decimal(), "0");
        assert_eq!(Amount::MAX.to_decimal(), "18446744073.709551615");
    }

    #[test]
    fn parses_exact_decimals() {
        assert_eq!(
            Amount::parse("0.008945664 KVR"),
            Ok(Amount::from_base_units(8_945_664))
        );
        assert_eq!(
            Amount::parse("0.007"),
            Ok(Amount::from_base_units(7_000_000))
        );
        assert_eq!(
            Amount::parse("12"),
            Ok(Amount::from_base_units(12 * BASE_UNITS_PER_KVR))
        );
        assert_eq!(
            Amount::parse(".5"),
            Ok(Amount::from_base_units(500_000_000))
        );
        assert_eq!(Amount::parse("18446744073.709551615"), Ok(Amount::MAX));
    }

    #[test]
    fn rejects_bad_text_with_typed_errors() {
        assert_eq!(Amount::parse(""), Err(AmountError::Empty));
        assert_eq!(Amount::parse(" KVR"), Err(AmountError::Empty));
        assert_eq!(Amount::parse("-1"), Err(AmountError::Negative));
        assert_eq!(
            Amount::parse("0.0000000001"),
            Err(AmountError::TooManyDecimals)
        );
        assert_eq!(
            Amount::parse("18446744073.709551616"),
            Err(AmountError::Overflow)
        );
        assert_eq!(
            Amount::parse("99999999999999999999999"),
            Err(AmountError::Overflow)
        );
        for bad in [
            "1.2.3", "abc", "1e9", "1,5", "+1", ".", "1.", "0x10", "1 2", "NaN", "١",
        ] {
            assert!(
                matches!(Amount::parse(bad), Err(AmountError::Invalid(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn arithmetic_is_checked() {
        assert_eq!(Amount::MAX.checked_add(Amount::from_base_units(1)), None);
        assert_eq!(Amount::ZERO.checked_sub(Amount::from_base_units(1)), None);
    }

    proptest! {
        #[test]
        fn decimal_text_round_trips(units in any::<u64>()) {
            let amount = Amount::from_base_units(units);
            prop_assert_eq!(Amount::parse(&amount.to_string()), Ok(amount));
            prop_assert_eq!(Amount::parse(&amount.to_decimal()), Ok(amount));
            let json = serde_json::to_string(&amount).unwrap();
            prop_assert_eq!(serde_json::from_str::<Amount>(&json).unwrap(), amount);
        }

        #[test]
        fn parse_never_panics(text in ".{0,40}") {
            let _ = Amount::parse(&text);
        }
    }
}
