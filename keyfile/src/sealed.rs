//! Sealing a secret key under a passphrase: argon2id turns the passphrase and a random salt
//! into a key, and XChaCha20-Poly1305 encrypts (and authenticates) the secret under it, so a
//! wrong passphrase and a tampered file are both refused. The argon2id cost is stored, so
//! files written with other settings still open; it is bounded, so a hostile file cannot ask
//! for gigabytes of memory.

use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::XChaCha20Poly1305;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::Problem;

/// A sealed secret as it appears in a key file (hex fields).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Sealed {
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
/// What new files are sealed with: RFC 9106's setting for when 2 GiB is too much, 64 MiB and
/// 3 passes, on 1 lane (files sealed before, with OWASP's 19 MiB and 2 passes, record that
/// and still open).
const MEMORY_KIB: u32 = 64 * 1024;
const ITERATIONS: u32 = 3;
const MAX_MEMORY_KIB: u32 = 1024 * 1024;
const MAX_ITERATIONS: u32 = 64;

impl Sealed {
    pub(crate) fn seal(secret: &[u8; 32], passphrase: &str) -> Result<Sealed, Problem> {
        let mut salt = [0u8; 16];
        let mut nonce = [0u8; 24];
        rand::rngs::OsRng.fill_bytes(&mut salt);
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let key = derive_key(passphrase, &salt, MEMORY_KIB, ITERATIONS)?;
        let ciphertext = XChaCha20Poly1305::new((&*key).into())
            .encrypt(&nonce.into(), secret.as_slice())
            .map_err(|_| Problem::Sealing)?;
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

    pub(crate) fn open(&self, passphrase: &str) -> Result<Zeroizing<[u8; 32]>, Problem> {
        if self.kdf != KDF || self.cipher != CIPHER {
            return Err(Problem::Unsupported(format!(
                "{} + {}",
                self.kdf, self.cipher
            )));
        }
        if self.memory_kib > MAX_MEMORY_KIB || self.iterations > MAX_ITERATIONS {
            return Err(Problem::Unsupported(format!(
                "argon2id cost {} KiB x {} passes",
                self.memory_kib, self.iterations
            )));
        }
        let field = |text: &str| hex::decode(text).map_err(|_| Problem::Shape);
        let (salt, nonce, ciphertext) = (
            field(&self.salt)?,
            field(&self.nonce)?,
            field(&self.ciphertext)?,
        );
        let nonce: [u8; 24] = nonce.try_into().map_err(|_| Problem::Shape)?;
        let key = derive_key(passphrase, &salt, self.memory_kib, self.iterations)?;
        let plain = Zeroizing::new(
            XChaCha20Poly1305::new((&*key).into())
                .decrypt(&nonce.into(), ciphertext.as_slice())
                .map_err(|_| Problem::WrongPassphrase)?,
        );
        let secret: [u8; 32] = plain
            .as_slice()
            .try_into()
            .map_err(|_| Problem::BadSecret)?;
        Ok(Zeroizing::new(secret))
    }
}

fn derive_key(
    passphrase: &str,
    salt: &[u8],
    memory_kib: u32,
    iterations: u32,
) -> Result<Zeroizing<[u8; 32]>, Problem> {
    let params = argon2::Params::new(memory_kib, iterations, 1, Some(32))
        .map_err(|e| Problem::Unsupported(e.to_string()))?;
    let mut key = Zeroizing::new([0u8; 32]);
    argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params)
        .hash_password_into(passphrase.as_bytes(), salt, key.as_mut())
        .map_err(|e| Problem::Unsupported(e.to_string()))?;
    Ok(key)
}
