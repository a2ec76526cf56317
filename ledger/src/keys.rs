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

    /// Writes the key file with mode 0600; refuses to overwrite an existing file. With a
    /// passphrase the secret key is sealed (argon2id, then XChaCha20-Poly1305); the address
    /// stays readable either way.
    pub fn write_key_file(
        &self,
        path: &Path,
        passphrase: Option<&str>,
    ) -> Result<(), KeyFileError> {
        let secret = self.signing.to_bytes();
        let (secret_key, sealed) = match passphrase {
            None => (Some(hex::encode(secret)), None),
            Some(passphrase) => (None, Some(Sealed::seal(&secret, passphrase)?)),
        };
        let file = KeyFileJson {
            address: self.address(),
            secret_key,
            sealed,
        };
        let mut text = serde_json::to_string_pretty(&file).map_err(KeyFileError::Json)?;
        text.push('\n');
        let mut options = fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut out = options.open(path).map_err(KeyFileError::Io)?;
        out.write_all(text.as_bytes()).map_err(KeyFileError::Io)?;
        out.sync_all().map_err(KeyFileError::Io)
    }

    /// Reads a key file; a sealed one needs its passphrase (`KeyFileError::NeedsPassphrase`
    /// without one).
    pub fn read_key_file(path: &Path, passphrase: Option<&str>) -> Result<Keypair, KeyFileError> {
        Keypair::parse_key_file(&read_text(path)?, passphrase)
    }

    /// Parses the contents of a key file.
    pub fn parse_key_file(text: &str, passphrase: Option<&str>) -> Result<Keypair, KeyFileError> {
        let file = KeyFileJson::parse(text)?;
        let seed = match (&file.secret_key, &file.sealed, passphrase) {
            (Some(hex_key), None, _) => {
                let bytes = hex::decode(hex_key.trim()).map_err(|_| KeyFileError::BadSecret)?;
                bytes.try_into().map_err(|_| KeyFileError::BadSecret)?
            }
            (None, Some(sealed), Some(passphrase)) => sealed.open(passphrase)?,
            (None, Some(_), None) => return Err(KeyFileError::NeedsPassphrase),
            _ => return Err(KeyFileError::Shape),
        };
        let keypair = Keypair::from_seed(&seed);
        if keypair.address() != file.address {
            return Err(KeyFileError::AddressMismatch);
        }
        Ok(keypair)
    }

    /// The address a key file names, without its passphrase.
    pub fn key_file_address(path: &Path) -> Result<Address, KeyFileError> {
        Ok(KeyFileJson::parse(&read_text(path)?)?.address)
    }
}

fn read_text(path: &Path) -> Result<String, KeyFileError> {
    fs::read_to_string(path).map_err(KeyFileError::Io)
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    secret_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sealed: Option<Sealed>,
}

impl KeyFileJson {
    fn parse(text: &str) -> Result<KeyFileJson, KeyFileError> {
        serde_json::from_str(text).map_err(KeyFileError::Json)
    }
}

/// A secret key sealed under a passphrase. The argon2id cost is stored so that files written
/// with other settings still open; it is bounded so that a hostile file cannot ask for
/// gigabytes of memory.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Sealed {
    kdf: String,
    memory_kib: u32,
    iterations: u32,
    salt: String,
    cipher: String,
    nonce: String,
    ciphertext: String,
}

const KDF: &str = "argon2id";
const CIPHER: &str = "xchacha20poly1305";
/// OWASP's argon2id setting: 19 MiB, 2 passes, 1 lane.
const MEMORY_KIB: u32 = 19 * 1024;
const ITERATIONS: u32 = 2;
const MAX_MEMORY_KIB: u32 = 1024 * 1024;
const MAX_ITERATIONS: u32 = 64;

impl Sealed {
    fn seal(secret: &[u8; 32], passphrase: &str) -> Result<Sealed, KeyFileError> {
        use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng};
        use rand::RngCore;
        let mut salt = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut salt);
        let key = derive_key(passphrase, &salt, MEMORY_KIB, ITERATIONS)?;
        let nonce = chacha20poly1305::XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let ciphertext = chacha20poly1305::XChaCha20Poly1305::new(&key.into())
            .encrypt(&nonce, secret.as_slice())
            .map_err(|_| KeyFileError::Sealing)?;
        Ok(Sealed {
            kdf: KDF.into(),
            memory_kib: MEMORY_KIB,
            iterations: ITERATIONS,
            salt: hex::encode(salt),
            cipher: CIPHER.into(),
            nonce: hex::encode(nonce),
            ciphertext: hex::encode(ciphertext),
        })
    }

    fn open(&self, passphrase: &str) -> Result<[u8; 32], KeyFileError> {
        use chacha20poly1305::aead::{Aead, KeyInit};
        if self.kdf != KDF || self.cipher != CIPHER {
            return Err(KeyFileError::Unsupported(format!(
                "{} + {}",
                self.kdf, self.cipher
            )));
        }
        if self.memory_kib > MAX_MEMORY_KIB || self.iterations > MAX_ITERATIONS {
            return Err(KeyFileError::Unsupported(format!(
                "argon2id cost {} KiB x {} passes",
                self.memory_kib, self.iterations
            )));
        }
        let field = |text: &str| hex::decode(text).map_err(|_| KeyFileError::Shape);
        let (salt, nonce, ciphertext) = (
            field(&self.salt)?,
            field(&self.nonce)?,
            field(&self.ciphertext)?,
        );
        let nonce: [u8; 24] = nonce.try_into().map_err(|_| KeyFileError::Shape)?;
        let key = derive_key(passphrase, &salt, self.memory_kib, self.iterations)?;
        let plain = chacha20poly1305::XChaCha20Poly1305::new(&key.into())
            .decrypt(&nonce.into(), ciphertext.as_slice())
            .map_err(|_| KeyFileError::WrongPassphrase)?;
        plain.try_into().map_err(|_| KeyFileError::BadSecret)
    }
}

fn derive_key(
    passphrase: &str,
    salt: &[u8],
    memory_kib: u32,
    iterations: u32,
) -> Result<[u8; 32], KeyFileError> {
    let params = argon2::Params::new(memory_kib, iterations, 1, Some(32))
        .map_err(|e| KeyFileError::Unsupported(e.to_string()))?;
    let mut key = [0u8; 32];
    argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params)
        .hash_password_into(passphrase.as_bytes(), salt, &mut key)
        .map_err(|e| KeyFileError::Unsupported(e.to_string()))?;
    Ok(key)
}

/// What is wrong with a key file; callers name the file (`key file PATH: ...`).
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error(transparent)]
    Io(std::io::Error),
    #[error("not valid JSON of the form {{address, secret_key | sealed}}: {0}")]
    Json(serde_json::Error),
    #[error("must hold exactly one of secret_key and sealed, well formed")]
    Shape,
    #[error("secret_key is not 64 hex digits")]
    BadSecret,
    #[error("the address does not match the secret key")]
    AddressMismatch,
    #[error("sealed with a passphrase, and none was given")]
    NeedsPassphrase,
    #[error("wrong passphrase")]
    WrongPassphrase,
    #[error("sealing not supported: {0}")]
    Unsupported(String),
    #[error("sealing the key failed")]
    Sealing,
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
        keypair.write_key_file(&path, None).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(
            Keypair::read_key_file(&path, None).unwrap().address(),
            keypair.address()
        );
        assert!(matches!(
            keypair.write_key_file(&path, None),
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
            let err = Keypair::read_key_file(&path, None).unwrap_err();
            assert!(
                format!("{err:?}").contains(want),
                "{err:?} should be {want}"
            );
        }
        assert!(matches!(
            Keypair::read_key_file(&dir.path().join("missing"), None),
            Err(KeyFileError::Io(..))
        ));
    }

    #[test]
    fn sealed_key_file_opens_with_its_passphrase_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sealed.key");
        let keypair = Keypair::generate();
        keypair
            .write_key_file(&path, Some("correct horse"))
            .unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&hex::encode(keypair.signing.to_bytes())));
        assert_eq!(Keypair::key_file_address(&path).unwrap(), keypair.address());
        let opened = Keypair::read_key_file(&path, Some("correct horse")).unwrap();
        assert_eq!(opened.address(), keypair.address());
        assert!(matches!(
            Keypair::read_key_file(&path, Some("wrong horse")),
            Err(KeyFileError::WrongPassphrase)
        ));
        assert!(matches!(
            Keypair::read_key_file(&path, None),
            Err(KeyFileError::NeedsPassphrase)
        ));
    }

    #[test]
    fn tampered_or_hostile_sealed_files_are_refused() {
        let keypair = Keypair::from_seed(&[3; 32]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sealed.key");
        keypair.write_key_file(&path, Some("pw")).unwrap();
        let original: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        let with = |field: &str, value: serde_json::Value| {
            let mut file = original.clone();
            file["sealed"][field] = value;
            file.to_string()
        };
        let mut flipped = hex::decode(original["sealed"]["ciphertext"].as_str().unwrap()).unwrap();
        flipped[0] ^= 1;
        let cases = [
            (
                with("ciphertext", hex::encode(flipped).into()),
                "WrongPassphrase",
            ),
            (with("nonce", "00".into()), "Shape"),
            (with("salt", "zz".into()), "Shape"),
            (with("kdf", "scrypt".into()), "Unsupported"),
            (with("memory_kib", u32::MAX.into()), "Unsupported"),
            (with("iterations", 0.into()), "Unsupported"),
            (with("extra", 1.into()), "Json"),
        ];
        for (text, want) in cases {
            let err = Keypair::parse_key_file(&text, Some("pw")).unwrap_err();
            assert!(
                format!("{err:?}").contains(want),
                "{err:?} should be {want}"
            );
        }
        // Both forms at once, or neither, is not a key file.
        let mut both = original.clone();
        both["secret_key"] = "00".repeat(32).into();
        let mut neither = original;
        neither.as_object_mut().unwrap().remove("sealed");
        for file in [both, neither] {
            assert!(matches!(
                Keypair::parse_key_file(&file.to_string(), Some("pw")),
                Err(KeyFileError::Shape)
            ));
        }
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
