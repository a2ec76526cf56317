//! Accounts are ed25519 keys. An address is the public key in bech32m text with hrp `kvr`;
//! key files hold the secret key and are created with mode 0600.

use std::fmt;
use std::fs;
use std::io::Write;
use std::path::Path;
use std::str::FromStr;

use bech32::{Bech32m, Hrp};
use borsh::{BorshDeserialize, BorshSerialize};
use ed25519_dalek::{SigningKey, VerifyingKey};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const HRP: Hrp = Hrp::parse_unchecked("kvr");

/// An account address: the 32 bytes of an ed25519 public key.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, BorshSerialize, BorshDeserialize)]
pub struct Address([u8; 32]);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("not a bech32m address: {0}")]
    Encoding(String),
    #[error("address prefix is {0:?}, expected \"kvr\"")]
    WrongPrefix(String),
    #[error("address holds {0} bytes, expected 32")]
    WrongLength(usize),
    #[error("address is not a valid ed25519 public key")]
    NotAKey,
}

impl Address {
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Address(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The public key behind this address; fails for byte strings that are not a curve point.
    pub fn verifying_key(&self) -> Result<VerifyingKey, AddressError> {
        VerifyingKey::from_bytes(&self.0).map_err(|_| AddressError::NotAKey)
    }
}

impl From<VerifyingKey> for Address {
    fn from(key: VerifyingKey) -> Self {
        Address(key.to_bytes())
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Encoding 32 bytes under a valid hrp cannot fail.
        let text = bech32::encode::<Bech32m>(HRP, &self.0).map_err(|_| fmt::Error)?;
        f.write_str(&text)
    }
}

impl fmt::Debug for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Address({self})")
    }
}

impl FromStr for Address {
    type Err = AddressError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let checked = bech32::primitives::decode::CheckedHrpstring::new::<Bech32m>(text.trim())
            .map_err(|e| AddressError::Encoding(e.to_string()))?;
        if checked.hrp() != HRP {
            return Err(AddressError::WrongPrefix(checked.hrp().to_string()));
        }
        let bytes: Vec<u8> = checked.byte_iter().collect();
        let bytes: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| AddressError::WrongLength(bytes.len()))?;
        Ok(Address(bytes))
    }
}

impl Serialize for Address {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Address {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <String as Deserialize>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A 64-byte ed25519 signature as carried in transactions, receipts and blocks.
#[derive(Clone, Copy, PartialEq, Eq, BorshSerialize, BorshDeserialize)]
pub struct Signature(pub [u8; 64]);

impl fmt::Debug for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Signature({})", hex::encode(self.0))
    }
}

/// A signing key and the address it controls.
#[derive(Clone)]
pub struct Keypair {
    signing: SigningKey,
}

impl Keypair {
    pub fn generate() -> Self {
        Keypair {
            signing: SigningKey::generate(&mut rand::rngs::OsRng),
        }
    }

    /// A key derived from a public seed: for tests and the dev chain only, never for value.
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        Keypair {
            signing: SigningKey::from_bytes(seed),
        }
    }

    pub fn address(&self) -> Address {
        self.signing.verifying_key().into()
    }

    pub(crate) fn signing_key(&self) -> &SigningKey {
        &self.signing
    }

    /// Writes the key file with mode 0600; refuses to overwrite an existing file.
    pub fn write_key_file(&self, path: &Path) -> Result<(), KeyFileError> {
        let file = KeyFileJson {
            address: self.address(),
            secret_key: hex::encode(self.signing.to_bytes()),
        };
        let mut text = serde_json::to_string_pretty(&file).map_err(KeyFileError::Json)?;
        text.push('\n');
        let mut options = fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let io = |e| KeyFileError::Io(path.display().to_string(), e);
        let mut out = options.open(path).map_err(io)?;
        out.write_all(text.as_bytes()).map_err(io)?;
        out.sync_all().map_err(io)
    }

    pub fn read_key_file(path: &Path) -> Result<Keypair, KeyFileError> {
        let text = fs::read_to_string(path)
            .map_err(|e| KeyFileError::Io(path.display().to_string(), e))?;
        Keypair::parse_key_file(&text)
    }

    /// Parses the contents of a key file.
    pub fn parse_key_file(text: &str) -> Result<Keypair, KeyFileError> {
        let file: KeyFileJson = serde_json::from_str(text).map_err(KeyFileError::Json)?;
        let bytes = hex::decode(file.secret_key.trim()).map_err(|_| KeyFileError::BadSecret)?;
        let seed: [u8; 32] = bytes.try_into().map_err(|_| KeyFileError::BadSecret)?;
        let keypair = Keypair::from_seed(&seed);
        if keypair.address() != file.address {
            return Err(KeyFileError::AddressMismatch);
        }
        Ok(keypair)
    }
}

impl fmt::Debug for Keypair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Keypair({})", self.address())
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFileJson {
    address: Address,
    secret_key: String,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("key file {0}: {1}")]
    Io(String, std::io::Error),
    #[error("key file is not valid JSON of the form {{address, secret_key}}: {0}")]
    Json(serde_json::Error),
    #[error("key file secret_key is not 64 hex digits")]
    BadSecret,
    #[error("key file address does not match its secret key")]
    AddressMismatch,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn address_text_round_trips_and_is_checksummed() {
        let address = Keypair::from_seed(&[7; 32]).address();
        let text = address.to_string();
        assert!(text.starts_with("kvr1"), "{text}");
        assert_eq!(text.parse::<Address>(), Ok(address));
        // One changed character breaks the checksum.
        let mut chars: Vec<char> = text.chars().collect();
        let last = chars.len() - 1;
        chars[last] = if chars[last] == 'q' { 'p' } else { 'q' };
        let corrupted: String = chars.into_iter().collect();
        assert!(matches!(
            corrupted.parse::<Address>(),
            Err(AddressError::Encoding(_))
        ));
    }

    #[test]
    fn address_rejects_other_prefixes_and_lengths() {
        let other = bech32::encode::<Bech32m>(Hrp::parse_unchecked("btc"), &[1u8; 32]).unwrap();
        assert_eq!(
            other.parse::<Address>(),
            Err(AddressError::WrongPrefix("btc".into()))
        );
        let short = bech32::encode::<Bech32m>(HRP, &[1u8; 31]).unwrap();
        assert_eq!(short.parse::<Address>(), Err(AddressError::WrongLength(31)));
        let bech32_not_m = bech32::encode::<bech32::Bech32>(HRP, &[1u8; 32]).unwrap();
        assert!(bech32_not_m.parse::<Address>().is_err());
        assert!("".parse::<Address>().is_err());
    }

    #[test]
    fn key_file_is_private_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wallet.key");
        let keypair = Keypair::generate();
        keypair.write_key_file(&path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(
            Keypair::read_key_file(&path).unwrap().address(),
            keypair.address()
        );
        assert!(matches!(
            keypair.write_key_file(&path),
            Err(KeyFileError::Io(..))
        ));
    }

    #[test]
    fn bad_key_files_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.key");
        let address = Keypair::from_seed(&[1; 32]).address();
        let cases = [
            ("not json".to_string(), "Json"),
            (
                format!(r#"{{"address":"{address}","secret_key":"zz"}}"#),
                "BadSecret",
            ),
            (
                format!(
                    r#"{{"address":"{address}","secret_key":"{}"}}"#,
                    "00".repeat(32)
                ),
                "Mismatch",
            ),
        ];
        for (text, want) in cases {
            fs::write(&path, text).unwrap();
            let err = Keypair::read_key_file(&path).unwrap_err();
            assert!(
                format!("{err:?}").contains(want),
                "{err:?} should be {want}"
            );
        }
        assert!(matches!(
            Keypair::read_key_file(&dir.path().join("missing")),
            Err(KeyFileError::Io(..))
        ));
    }

    proptest! {
        #[test]
        fn address_parse_never_panics(text in "\\PC{0,80}") {
            let _ = text.parse::<Address>();
        }

        #[test]
        fn any_32_bytes_round_trip_as_text(bytes in any::<[u8; 32]>()) {
            let address = Address::from_bytes(bytes);
            prop_assert_eq!(address.to_string().parse::<Address>(), Ok(address));
        }
    }
}
