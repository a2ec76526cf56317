//! The text forms of the ledger's own types, as OpenAPI schemas with their formats, so that a
//! client (or a property-based tester) knows exactly what a path segment or a field accepts:
//! an address, a 64-hex hash, an amount in base units or in KVR.

use std::borrow::Cow;

use utoipa::openapi::schema::{ObjectBuilder, Schema, SchemaFormat, Type};
use utoipa::openapi::RefOr;
use utoipa::{PartialSchema, ToSchema};

/// bech32m with the `kvr` prefix and a 32-byte key: 58 data characters after `kvr1`.
pub const ADDRESS_PATTERN: &str = "^kvr1[02-9ac-hj-np-z]{58}$";
pub const HASH_PATTERN: &str = "^[0-9a-fA-F]{64}$";
pub const SIGNATURE_PATTERN: &str = "^[0-9a-f]{128}$";
/// A u64 of base units, in decimal.
pub const BASE_UNITS_PATTERN: &str = "^[0-9]{1,20}$";
/// Whole bytes of hex, at most a transaction's 2,048 bytes.
pub const TX_HEX_PATTERN: &str = "^([0-9a-fA-F]{2}){1,2048}$";
/// KVR with up to nine decimals (1 KVR = 10^9 base units).
pub const KVR_PATTERN: &str = "^[0-9]{1,11}(\\.[0-9]{1,9})?$";
/// A share from 0 to 1 with up to nine decimals, as `Fraction` writes it (`0.5`, `1`).
pub const FRACTION_PATTERN: &str = "^(0(\\.[0-9]{1,9})?|1(\\.0{1,9})?)$";

fn text(format: &str, pattern: &str, description: &str, example: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .format(Some(SchemaFormat::Custom(format.into())))
        .pattern(Some(pattern))
        .description(Some(description))
        .examples([example])
        .into()
}

macro_rules! text_schema {
    ($type:ident, $name:literal, $format:literal, $pattern:expr, $description:literal, $example:literal) => {
        #[doc = $description]
        pub struct $type;

        impl PartialSchema for $type {
            fn schema() -> RefOr<Schema> {
                text($format, $pattern, $description, $example)
            }
        }

        impl ToSchema for $type {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    };
}

text_schema!(
    AddressText,
    "Address",
    "kvr-address",
    ADDRESS_PATTERN,
    "An account: `kvr1` and the bech32m of its ed25519 public key, lowercase.",
    "kvr13qngsglwej2hznwcgnfft34dqek9v5a48prv5dpmh046dafxt7gqgxsvck"
);
text_schema!(
    HashText,
    "Hash",
    "kvr-hash",
    HASH_PATTERN,
    "A blake3 hash (of a block or a transaction): 64 hex digits.",
    "556f12c3b3a8d1e55b6c2f0e4d7a9b8c1f2e3d4c5b6a79880f1e2d3c4b5a6978"
);
text_schema!(
    SignatureText,
    "Signature",
    "kvr-signature",
    SIGNATURE_PATTERN,
    "An ed25519 signature: 128 hex digits.",
    "5c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee05c0ffee0"
);
text_schema!(
    BaseUnitsText,
    "BaseUnits",
    "kvr-base-units",
    BASE_UNITS_PATTERN,
    "An amount in base units (10^-9 KVR), in decimal.",
    "8945664"
);
text_schema!(
    KvrText,
    "Kvr",
    "kvr-decimal",
    KVR_PATTERN,
    "An amount in KVR, exact, with up to nine decimals.",
    "0.008945664"
);
text_schema!(
    FractionText,
    "Fraction",
    "kvr-fraction",
    FRACTION_PATTERN,
    "A share between 0 and 1, exact, with up to nine decimals.",
    "0.5"
);
text_schema!(
    TxHexText,
    "TxHex",
    "kvr-tx-hex",
    TX_HEX_PATTERN,
    "A signed transaction: its canonical borsh bytes (at most 2,048) in hex.",
    "00"
);

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use kvasir_ledger::{Address, Hash, Keypair};

    /// What `ADDRESS_PATTERN` says, spelled out: `kvr1`, then 58 of bech32's characters.
    fn fits_address_pattern(text: &str) -> bool {
        const BECH32: &str = "qpzry9x8gf2tvdw0s3jn54khce6mua7l";
        text.strip_prefix("kvr1")
            .is_some_and(|data| data.len() == 58 && data.chars().all(|c| BECH32.contains(c)))
    }

    #[test]
    fn every_address_the_ledger_writes_fits_the_documented_pattern() {
        assert_eq!(super::ADDRESS_PATTERN, "^kvr1[02-9ac-hj-np-z]{58}$");
        for _ in 0..100 {
            let address = Keypair::generate().address().to_string();
            assert!(fits_address_pattern(&address), "{address}");
        }
        let example = "kvr13qngsglwej2hznwcgnfft34dqek9v5a48prv5dpmh046dafxt7gqgxsvck";
        assert!(fits_address_pattern(example));
        assert!(Address::from_str(example).is_ok());
        // Only the documented form: not uppercase, not padded.
        assert!(Address::from_str(&example.to_uppercase()).is_err());
        assert!(Address::from_str(&format!(" {example}")).is_err());
    }

    #[test]
    fn the_hash_example_parses_and_padding_does_not() {
        let hash = "556f12c3b3a8d1e55b6c2f0e4d7a9b8c1f2e3d4c5b6a79880f1e2d3c4b5a6978";
        assert!(Hash::from_str(hash).is_ok());
        assert!(Hash::from_str(&format!("{hash}\n")).is_err());
    }
}
