//! Accounts are ed25519 keys, and this is the one module that knows the ed25519 library
//! (ed25519-consensus). An address is the public key in bech32m text with hrp `kvr`; a
//! `Keypair` signs; and one verification rule holds for every signature, checked alone or in
//! a batch: ZIP-215 (cofactored, so that a batch and single checks accept exactly the same
//! signatures), and never for a small-order key, for which under that rule anyone can sign.
//! Keeping key files (and their passphrases) is not the ledger's business: see the
//! `kvasir-keyfile` crate.

use std::fmt;
use std::str::FromStr;

use bech32::{Bech32m, Hrp};
use borsh::{BorshDeserialize, BorshSerialize};
use curve25519_dalek_ng::edwards::CompressedEdwardsY;
use ed25519_consensus::{batch, SigningKey, VerificationKeyBytes};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use zeroize::{Zeroize, Zeroizing};

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
    #[error("address is a small-order ed25519 point, for which anyone can sign")]
    SmallOrderKey,
}

impl Address {
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Address(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Whether a signature can bind this address: it must be a curve point, and not one of
    /// small order (under the cofactored rule anyone can sign for those).
    pub fn check_key(&self) -> Result<(), AddressError> {
        let point = CompressedEdwardsY(self.0)
            .decompress()
            .ok_or(AddressError::NotAKey)?;
        if point.is_small_order() {
            return Err(AddressError::SmallOrderKey);
        }
        Ok(())
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
    /// The one canonical form, as `Display` writes it: lowercase, nothing around it (bech32m
    /// would also take the uppercase form).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(AddressError::Encoding(
                "uppercase; addresses are lowercase".into(),
            ));
        }
        let checked = bech32::primitives::decode::CheckedHrpstring::new::<Bech32m>(text)
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

/// A signing key and the address it controls. Its secret is wiped when it is dropped.
#[derive(Clone)]
pub struct Keypair {
    signing: SigningKey,
}

impl Keypair {
    pub fn generate() -> Self {
        Keypair {
            signing: SigningKey::new(rand::rngs::OsRng),
        }
    }

    /// The key whose RFC 8032 secret is `seed`. With a public seed: for tests and the dev
    /// chain only, never for value.
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        Keypair {
            signing: SigningKey::from(*seed),
        }
    }

    pub fn address(&self) -> Address {
        Address(self.signing.verification_key().to_bytes())
    }

    /// The 32-byte RFC 8032 secret that `from_seed` turns back into this key. The ledger
    /// never needs it; it exists so that a key can be kept outside the process (a key file,
    /// sealed or not). The copy is wiped when dropped.
    pub fn secret_bytes(&self) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(self.signing.to_bytes())
    }

    /// Signs `message` as it is. Crate-private: everything outside signs through `intent`,
    /// so that every signature commits to what it authorises.
    pub(crate) fn sign(&self, message: &[u8]) -> Signature {
        Signature(self.signing.sign(message).to_bytes())
    }
}

impl Drop for Keypair {
    fn drop(&mut self) {
        self.signing.zeroize();
    }
}

impl fmt::Debug for Keypair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Keypair({})", self.address())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("signature does not verify")]
pub struct BadSignature;

/// One signature ready to verify, by itself or in a `SignatureBatch`. It can only be made
/// for a usable key (`Address::check_key`), so both ways apply the same rule.
#[derive(Clone)]
pub struct SignatureCheck(batch::Item);

impl SignatureCheck {
    pub fn new(
        signer: &Address,
        message: &[u8],
        signature: &Signature,
    ) -> Result<SignatureCheck, AddressError> {
        signer.check_key()?;
        let key = VerificationKeyBytes::from(signer.0);
        let signature = ed25519_consensus::Signature::from(signature.0);
        Ok(SignatureCheck((key, signature, message).into()))
    }

    pub fn verify(self) -> Result<(), BadSignature> {
        self.0.verify_single().map_err(|_| BadSignature)
    }
}

/// Many signatures checked at once: one multiscalar multiplication, a signer's repeated key
/// folded into one term. It tells only whether all verify; finding the bad one is checking
/// each alone.
#[derive(Default)]
pub struct SignatureBatch(batch::Verifier);

impl SignatureBatch {
    pub fn queue(&mut self, check: &SignatureCheck) {
        self.0.queue(check.0.clone());
    }

    pub fn verify(self) -> Result<(), BadSignature> {
        self.0.verify(rand::thread_rng()).map_err(|_| BadSignature)
    }
}

/// Verifies one signature by `signer` over `message`.
pub fn verify(signer: &Address, message: &[u8], signature: &Signature) -> Result<(), BadSignature> {
    SignatureCheck::new(signer, message, signature)
        .map_err(|_| BadSignature)?
        .verify()
}

#[cfg(test)]
mod tests {
    use super::*;
    use curve25519_dalek_ng::constants::BASEPOINT_ORDER;
    use curve25519_dalek_ng::scalar::Scalar;
    use proptest::prelude::*;
    use sha2::{Digest, Sha512};

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
    fn keys_derive_from_seeds_as_rfc_8032_says() {
        // RFC 8032, section 7.1, test 1: the dev chain's keys depend on this derivation.
        let seed = hex::decode("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
            .unwrap();
        let keypair = Keypair::from_seed(&seed.try_into().unwrap());
        assert_eq!(
            hex::encode(keypair.address().as_bytes()),
            "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
        );
        assert_eq!(hex::encode(keypair.sign(b"").0), "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b");
        assert_eq!(
            Keypair::from_seed(&keypair.secret_bytes()).address(),
            keypair.address()
        );
    }

    /// The identity point, canonically encoded: of small order.
    const IDENTITY: [u8; 32] = {
        let mut bytes = [0u8; 32];
        bytes[0] = 1;
        bytes
    };

    #[test]
    fn small_order_and_off_curve_keys_cannot_sign() {
        assert_eq!(
            Address(IDENTITY).check_key(),
            Err(AddressError::SmallOrderKey)
        );
        // A point of order 4 (y = 0).
        assert_eq!(
            Address([0; 32]).check_key(),
            Err(AddressError::SmallOrderKey)
        );
        // y = 2 is not on the curve.
        let mut off_curve = [0u8; 32];
        off_curve[0] = 2;
        assert_eq!(Address(off_curve).check_key(), Err(AddressError::NotAKey));
        assert_eq!(Keypair::from_seed(&[9; 32]).address().check_key(), Ok(()));
    }

    /// Checks `signature` alone and in a batch of its own; the two must agree.
    fn single_and_batch(signer: &Address, message: &[u8], signature: &Signature) -> bool {
        let single = verify(signer, message, signature).is_ok();
        let batched = SignatureCheck::new(signer, message, signature).is_ok_and(|check| {
            let mut batch = SignatureBatch::default();
            batch.queue(&check);
            batch.verify().is_ok()
        });
        assert_eq!(single, batched, "single and batch disagree");
        single
    }

    #[test]
    fn single_and_batch_verification_agree_on_edge_cases() {
        let keypair = Keypair::from_seed(&[11; 32]);
        let signer = keypair.address();
        let message = b"edge cases".as_slice();
        let good = keypair.sign(message);
        assert!(single_and_batch(&signer, message, &good));
        assert!(!single_and_batch(&signer, b"another message", &good));
        assert!(!single_and_batch(
            &Keypair::from_seed(&[12; 32]).address(),
            message,
            &good
        ));

        // S + l: the same scalar, not canonically encoded.
        let mut s_plus_l = good;
        let mut carry = 0u16;
        for (byte, l) in s_plus_l.0[32..].iter_mut().zip(BASEPOINT_ORDER.to_bytes()) {
            let sum = u16::from(*byte) + u16::from(l) + carry;
            *byte = sum as u8;
            carry = sum >> 8;
        }
        assert!(!single_and_batch(&signer, message, &s_plus_l));

        // R the identity, non-canonically encoded (y = p + 1), and s = k * a: ZIP-215 accepts
        // it, RFC 8032's strict rule would not. Either way only the key's holder can make it.
        let mut r = [0xffu8; 32];
        r[0] = 0xee;
        r[31] = 0x7f;
        let mut expanded = [0u8; 32];
        expanded.copy_from_slice(&Sha512::digest(keypair.secret_bytes().as_slice())[..32]);
        expanded[0] &= 248;
        expanded[31] &= 127;
        expanded[31] |= 64;
        let a = Scalar::from_bits(expanded);
        let k = Scalar::from_hash(Sha512::new().chain(r).chain(signer.0).chain(message));
        let mut weird_r = Signature([0; 64]);
        weird_r.0[..32].copy_from_slice(&r);
        weird_r.0[32..].copy_from_slice((k * a).as_bytes());
        assert!(single_and_batch(&signer, message, &weird_r));

        // A small-order key with R the identity and s = 0 satisfies the cofactored equation
        // for every message: the library alone accepts it, the rule refuses the key.
        let mut forged = Signature([0; 64]);
        forged.0[..32].copy_from_slice(&IDENTITY);
        let raw_key = ed25519_consensus::VerificationKey::try_from(IDENTITY).unwrap();
        let raw_signature = ed25519_consensus::Signature::from(forged.0);
        assert!(raw_key.verify(&raw_signature, message).is_ok());
        assert!(!single_and_batch(&Address(IDENTITY), message, &forged));
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
