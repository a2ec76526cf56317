//! Kvasir key files: where a key lives on disk. A key file is JSON,
//! `{"address": ..., "secret_key": HEX}` or, sealed under a passphrase,
//! `{"address": ..., "sealed": {...}}` (`sealed`: argon2id, then XChaCha20-Poly1305); the
//! address stays readable either way, and files are created with mode 0600, never over an
//! existing one; as ssh does with a private key, a file that group or others may access is
//! refused when its key is read (unix), with the `chmod` that fixes it. `open` is how every
//! command that signs gets its key (`passphrase`: from `KVASIR_PASSPHRASE` or the terminal).
//! The ledger only knows `Keypair`; files, passphrases and their ciphers are kept here.
//! Secrets are wiped from memory where that is cheap.

#![forbid(unsafe_code)]

mod passphrase;
mod sealed;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use kvasir_ledger::{Address, Keypair};
use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, Zeroizing};

pub use passphrase::{new_passphrase, open, PASSPHRASE_ENV};
use sealed::Sealed;

/// What is wrong with a key file or its passphrase.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
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
    #[error("a passphrase is needed: set {PASSPHRASE_ENV} or run in a terminal")]
    NoPassphrase,
    #[error("reading the passphrase: {0}")]
    Prompt(std::io::Error),
    #[error("the two passphrases differ")]
    PassphrasesDiffer,
    #[error("an empty passphrase seals nothing; leave the key file unsealed instead")]
    EmptyPassphrase,
    #[error("group or others may access it (mode {mode:04o}); make it private with `chmod 600 {}`", path.display())]
    TooOpen { mode: u32, path: PathBuf },
}

/// A key file that could not be written, read or opened: which one, and why.
#[derive(Debug, thiserror::Error)]
#[error("key file {}: {problem}", path.display())]
pub struct KeyFileError {
    pub path: PathBuf,
    pub problem: Problem,
}

impl KeyFileError {
    fn at(path: &Path, problem: Problem) -> KeyFileError {
        KeyFileError {
            path: path.to_path_buf(),
            problem,
        }
    }
}

/// The JSON of a key file. A plain secret in it is wiped when it is dropped.
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
    fn parse(text: &str) -> Result<KeyFileJson, Problem> {
        serde_json::from_str(text).map_err(Problem::Json)
    }
}

impl Drop for KeyFileJson {
    fn drop(&mut self) {
        self.secret_key.zeroize();
    }
}

/// Writes `keypair` to a new key file at `path` with mode 0600; refuses to overwrite an
/// existing file. With a passphrase the secret key is sealed.
pub fn write(path: &Path, keypair: &Keypair, passphrase: Option<&str>) -> Result<(), KeyFileError> {
    let at = |problem| KeyFileError::at(path, problem);
    let secret = keypair.secret_bytes();
    let (secret_key, sealed) = match passphrase {
        None => (Some(hex::encode(&secret[..])), None),
        Some(passphrase) => (None, Some(Sealed::seal(&secret, passphrase).map_err(at)?)),
    };
    let file = KeyFileJson {
        address: keypair.address(),
        secret_key,
        sealed,
    };
    let mut text = Zeroizing::new(
        serde_json::to_string_pretty(&file)
            .map_err(Problem::Json)
            .map_err(at)?,
    );
    text.push('\n');
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let io = |e| at(Problem::Io(e));
    let mut out = options.open(path).map_err(io)?;
    out.write_all(text.as_bytes()).map_err(io)?;
    out.sync_all().map_err(io)
}

/// Reads the key file at `path`, which must be private to its owner (`Problem::TooOpen`);
/// a sealed one needs its passphrase (`Problem::NeedsPassphrase` without one).
pub fn read(path: &Path, passphrase: Option<&str>) -> Result<Keypair, KeyFileError> {
    let at = |problem| KeyFileError::at(path, problem);
    let mut file = fs::File::open(path).map_err(|e| at(Problem::Io(e)))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = file
            .metadata()
            .map_err(|e| at(Problem::Io(e)))?
            .permissions()
            .mode()
            & 0o777;
        if mode & 0o077 != 0 {
            return Err(at(Problem::TooOpen {
                mode,
                path: path.to_path_buf(),
            }));
        }
    }
    let mut text = Zeroizing::new(String::new());
    std::io::Read::read_to_string(&mut file, &mut text).map_err(|e| at(Problem::Io(e)))?;
    parse(&text, passphrase).map_err(at)
}

/// The key in the contents of a key file (for key files that are not files: the dev
/// chain's, built into the binary).
pub fn parse(text: &str, passphrase: Option<&str>) -> Result<Keypair, Problem> {
    let file = KeyFileJson::parse(text)?;
    let seed = match (&file.secret_key, &file.sealed, passphrase) {
        (Some(hex_key), None, _) => {
            let bytes =
                Zeroizing::new(hex::decode(hex_key.trim()).map_err(|_| Problem::BadSecret)?);
            let seed: [u8; 32] = bytes
                .as_slice()
                .try_into()
                .map_err(|_| Problem::BadSecret)?;
            Zeroizing::new(seed)
        }
        (None, Some(sealed), Some(passphrase)) => sealed.open(passphrase)?,
        (None, Some(_), None) => return Err(Problem::NeedsPassphrase),
        _ => return Err(Problem::Shape),
    };
    let keypair = Keypair::from_seed(&seed);
    if keypair.address() != file.address {
        return Err(Problem::AddressMismatch);
    }
    Ok(keypair)
}

/// The address the key file at `path` names, without its passphrase.
pub fn address(path: &Path) -> Result<Address, KeyFileError> {
    let text = read_text(path)?;
    KeyFileJson::parse(&text)
        .map(|file| file.address)
        .map_err(|problem| KeyFileError::at(path, problem))
}

fn read_text(path: &Path) -> Result<Zeroizing<String>, KeyFileError> {
    fs::read_to_string(path)
        .map(Zeroizing::new)
        .map_err(|e| KeyFileError::at(path, Problem::Io(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `text` to `path` as a key file's owner would: mode 0600.
    fn write_private(path: &Path, text: &str) {
        fs::write(path, text).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(path, fs::Permissions::from_mode(0o600)).unwrap();
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_key_file_others_may_access_is_refused_with_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wallet.key");
        let keypair = Keypair::from_seed(&[8; 32]);
        write(&path, &keypair, None).unwrap();
        for mode in [0o644, 0o640, 0o604, 0o660, 0o601, 0o610] {
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
            let err = read(&path, None).unwrap_err();
            assert!(
                matches!(err.problem, Problem::TooOpen { mode: m, .. } if m == mode),
                "{mode:o}: {err}"
            );
            let message = err.to_string();
            assert!(
                message.contains(&format!("chmod 600 {}", path.display())),
                "{message}"
            );
            assert_eq!(message.lines().count(), 1, "{message}");
            // The address is no secret: it stays readable.
            assert_eq!(address(&path).unwrap(), keypair.address());
        }
        for mode in [0o600, 0o400] {
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(read(&path, None).unwrap().address(), keypair.address());
        }
    }

    /// A file sealed before the argon2id cost was raised (19 MiB, 2 passes) still opens: the
    /// cost is read from the file, not assumed.
    #[test]
    fn a_file_sealed_with_the_old_cost_still_opens() {
        let old = r#"{
  "address": "kvr1l5tjgwz65rr4ke8m0rxkqtapmxglm6lhdvfutrkhqt4vsd0f7cvqvt5ukv",
  "sealed": {
    "kdf": "argon2id",
    "memory_kib": 19456,
    "iterations": 2,
    "salt": "716c563b6ccb697fb386d938ca17e2b1",
    "cipher": "xchacha20poly1305",
    "nonce": "5575430d148d3d758ebb1cf64babb572761b2505c5ff4710",
    "ciphertext": "24b6388b5301381a9390c54af4bd77506c513d47cacf639aaa3d116cfd3a93e26e64bff7a3f50ef28149df67664f9600"
  }
}"#;
        let keypair = parse(old, Some("sealed in 2025")).unwrap();
        assert_eq!(keypair.address(), Keypair::from_seed(&[9; 32]).address());
        // New files record the raised cost.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new.key");
        write(&path, &keypair, Some("sealed later")).unwrap();
        let new: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(new["sealed"]["memory_kib"], 64 * 1024);
        assert_eq!(new["sealed"]["iterations"], 3);
        assert_eq!(
            read(&path, Some("sealed later")).unwrap().address(),
            keypair.address()
        );
    }

    #[test]
    fn key_file_is_private_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wallet.key");
        let keypair = Keypair::generate();
        write(&path, &keypair, None).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(read(&path, None).unwrap().address(), keypair.address());
        assert_eq!(address(&path).unwrap(), keypair.address());
        let err = write(&path, &keypair, None).unwrap_err();
        assert!(matches!(err.problem, Problem::Io(..)));
        assert_eq!(err.path, path);
        assert!(
            err.to_string()
                .starts_with(&format!("key file {}: ", path.display())),
            "{err}"
        );
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
            write_private(&path, &text);
            let err = read(&path, None).unwrap_err();
            assert!(
                format!("{:?}", err.problem).contains(want),
                "{err:?} should be {want}"
            );
        }
        assert!(matches!(
            read(&dir.path().join("missing"), None),
            Err(KeyFileError {
                problem: Problem::Io(..),
                ..
            })
        ));
    }

    #[test]
    fn sealed_key_file_opens_with_its_passphrase_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sealed.key");
        let keypair = Keypair::generate();
        write(&path, &keypair, Some("correct horse")).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&hex::encode(*keypair.secret_bytes())));
        assert_eq!(address(&path).unwrap(), keypair.address());
        let opened = read(&path, Some("correct horse")).unwrap();
        assert_eq!(opened.address(), keypair.address());
        assert!(matches!(
            read(&path, Some("wrong horse")).map_err(|e| e.problem),
            Err(Problem::WrongPassphrase)
        ));
        assert!(matches!(
            read(&path, None).map_err(|e| e.problem),
            Err(Problem::NeedsPassphrase)
        ));
    }

    #[test]
    fn tampered_or_hostile_sealed_files_are_refused() {
        let keypair = Keypair::from_seed(&[3; 32]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sealed.key");
        write(&path, &keypair, Some("pw")).unwrap();
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
            let err = parse(&text, Some("pw")).unwrap_err();
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
                parse(&file.to_string(), Some("pw")),
                Err(Problem::Shape)
            ));
        }
    }
}
