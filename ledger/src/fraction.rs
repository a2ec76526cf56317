//! A fraction between 0 and 1 with nine exact decimals (`0.5`, `0.01`), for the genesis
//! shares of a slashed bond. Its text is parsed by the same exact decimal rules as an
//! amount, and taking a fraction of an amount rounds down in integers, so no floating point
//! touches money.

use std::fmt;

use borsh::BorshSerialize;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::amount::{Amount, BASE_UNITS_PER_KVR};

/// Parts per 10^9, at most 10^9 (the whole).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, BorshSerialize)]
pub struct Fraction(u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FractionError {
    #[error("fraction {0:?} is not a decimal between 0 and 1 with at most 9 decimals")]
    Invalid(String),
}

impl Fraction {
    pub const ZERO: Fraction = Fraction(0);
    pub const ONE: Fraction = Fraction(BASE_UNITS_PER_KVR);

    pub fn parse(text: &str) -> Result<Fraction, FractionError> {
        let invalid = || FractionError::Invalid(text.to_string());
        // A fraction has no unit, so ` KVR` is not part of its text.
        if text.contains(|c: char| c.is_ascii_alphabetic()) {
            return Err(invalid());
        }
        let parts = Amount::parse(text).map_err(|_| invalid())?.base_units();
        if parts > BASE_UNITS_PER_KVR {
            return Err(invalid());
        }
        Ok(Fraction(parts))
    }

    /// `parts` parts per 10^9, at most the whole.
    pub const fn from_billionths(parts: u64) -> Fraction {
        if parts > BASE_UNITS_PER_KVR {
            Fraction(BASE_UNITS_PER_KVR)
        } else {
            Fraction(parts)
        }
    }

    pub fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// `floor(amount * self)`: never more than `amount`.
    pub fn of(self, amount: Amount) -> Amount {
        let product = u128::from(amount.base_units()) * u128::from(self.0);
        // At most `amount`, since the fraction is at most one.
        Amount::from_base_units((product / u128::from(BASE_UNITS_PER_KVR)) as u64)
    }
}

impl fmt::Display for Fraction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&Amount::from_base_units(self.0).to_decimal())
    }
}

impl Serialize for Fraction {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Fraction {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Fraction::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_exact_fractions_and_refuses_the_rest() {
        assert_eq!(Fraction::parse("0.5").unwrap().to_string(), "0.5");
        assert_eq!(Fraction::parse("1").unwrap(), Fraction::ONE);
        assert_eq!(Fraction::parse("0").unwrap(), Fraction::ZERO);
        assert_eq!(Fraction::parse("0.000000001").unwrap(), Fraction(1));
        for bad in [
            "1.000000001",
            "2",
            "-0.5",
            "0.5 KVR",
            "",
            "half",
            "0.0000000001",
        ] {
            assert!(Fraction::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_fraction_of_an_amount_rounds_down() {
        let half = Fraction::parse("0.5").unwrap();
        assert_eq!(
            half.of(Amount::from_base_units(3)),
            Amount::from_base_units(1)
        );
        assert_eq!(Fraction::ONE.of(Amount::MAX), Amount::MAX);
        assert_eq!(Fraction::ZERO.of(Amount::MAX), Amount::ZERO);
    }

    proptest! {
        #[test]
        fn a_fraction_never_exceeds_the_whole(parts in 0u64..=BASE_UNITS_PER_KVR, units: u64) {
            let fraction = Fraction(parts);
            let amount = Amount::from_base_units(units);
            prop_assert!(fraction.of(amount) <= amount);
            prop_assert_eq!(Fraction::parse(&fraction.to_string()), Ok(fraction));
        }
    }
}
