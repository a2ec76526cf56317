//! blake3 hashes with domain separation, and the binary Merkle root over transaction hashes.

use std::fmt;
use std::str::FromStr;

use borsh::{BorshDeserialize, BorshSerialize};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(
    Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, BorshSerialize, BorshDeserialize,
)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    pub const ZERO: Hash = Hash([0; 32]);

    /// blake3 over a domain tag followed by the canonical encoding of `value`.
    pub fn of_borsh(domain: &[u8], value: &impl BorshSerialize) -> Hash {
        let mut hasher = blake3::Hasher::new();
        hasher.update(&(domain.len() as u32).to_le_bytes());
        hasher.update(domain);
        // The hasher is an io::Write that never fails.
        let _ = value.serialize(&mut HashWriter(&mut hasher));
        Hash(*hasher.finalize().as_bytes())
    }

    pub fn of_parts(parts: &[&[u8]]) -> Hash {
        let mut hasher = blake3::Hasher::new();
        for part in parts {
            hasher.update(part);
        }
        Hash(*hasher.finalize().as_bytes())
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

struct HashWriter<'a>(&'a mut blake3::Hasher);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hash({self})")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a 64-digit hex hash")]
pub struct BadHash;

impl FromStr for Hash {
    type Err = BadHash;
    /// Exactly 64 hex digits, nothing around them (the API documents that form).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bytes = hex::decode(text).map_err(|_| BadHash)?;
        bytes.try_into().map(Hash).map_err(|_| BadHash)
    }
}

impl Serialize for Hash {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        <String as Deserialize>::deserialize(deserializer)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Binary Merkle root over leaf hashes. Leaves and inner nodes are tagged differently so a
/// leaf can never pose as a node; an odd node at the end of a level is carried up as is.
pub fn merkle_root(leaves: &[Hash]) -> Hash {
    if leaves.is_empty() {
        return Hash::of_parts(&[b"kvasir-merkle-empty"]);
    }
    let mut level: Vec<Hash> = leaves
        .iter()
        .map(|leaf| Hash::of_parts(&[&[0u8], &leaf.0]))
        .collect();
    while level.len() > 1 {
        level = next_level(&level);
    }
    level[0]
}

/// The siblings from leaf `index` up to the root of `merkle_root(leaves)`, lowest first: what
/// proves one leaf against the root (`merkle_verify`). A level where the node has no sibling
/// (the odd one carried up) adds none. Empty for an index past the leaves.
pub fn merkle_path(leaves: &[Hash], mut index: usize) -> Vec<Hash> {
    let mut level: Vec<Hash> = leaves
        .iter()
        .map(|leaf| Hash::of_parts(&[&[0u8], &leaf.0]))
        .collect();
    let mut path = Vec::new();
    if index >= level.len() {
        return path;
    }
    while level.len() > 1 {
        if let Some(sibling) = level.get(index ^ 1) {
            path.push(*sibling);
        }
        level = next_level(&level);
        index /= 2;
    }
    path
}

/// Whether `leaf` is leaf `index` of the `count` leaves whose Merkle root is `root`, by its
/// `path` (`merkle_path`). The count fixes at which levels the node has a sibling, so a path
/// of the wrong length is refused, never read past.
pub fn merkle_verify(
    root: &Hash,
    leaf: &Hash,
    mut index: usize,
    count: usize,
    path: &[Hash],
) -> bool {
    if index >= count {
        return false;
    }
    let mut node = Hash::of_parts(&[&[0u8], &leaf.0]);
    let mut siblings = path.iter();
    let mut width = count;
    while width > 1 {
        let has_sibling = (index ^ 1) < width;
        if has_sibling {
            let Some(sibling) = siblings.next() else {
                return false;
            };
            node = if index.is_multiple_of(2) {
                inner(&node, sibling)
            } else {
                inner(sibling, &node)
            };
        }
        index /= 2;
        width = width.div_ceil(2);
    }
    siblings.next().is_none() && node == *root
}

fn inner(left: &Hash, right: &Hash) -> Hash {
    Hash::of_parts(&[&[1u8], &left.0, &right.0])
}

/// The level above `level`: pairs joined, an odd node at the end carried up as is.
fn next_level(level: &[Hash]) -> Vec<Hash> {
    level
        .chunks(2)
        .map(|pair| match pair {
            [left, right] => inner(left, right),
            [single] => *single,
            _ => unreachable!("chunks(2) yields one or two items"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_leaf_proves_against_the_root_and_nothing_else_does() {
        for count in 1..=19usize {
            let leaves: Vec<Hash> = (0..count as u8).map(|i| Hash([i; 32])).collect();
            let root = merkle_root(&leaves);
            for (index, leaf) in leaves.iter().enumerate() {
                let path = merkle_path(&leaves, index);
                assert!(
                    merkle_verify(&root, leaf, index, count, &path),
                    "{count}/{index}"
                );
                // Another leaf, place, count, or a path cut or lengthened: refused.
                assert!(!merkle_verify(&root, &Hash([99; 32]), index, count, &path));
                if count > 1 {
                    let other = (index + 1) % count;
                    assert!(!merkle_verify(&root, leaf, other, count, &path));
                }
                let mut longer = path.clone();
                longer.push(root);
                assert!(!merkle_verify(&root, leaf, index, count, &longer));
                if let Some((_, shorter)) = path.split_last() {
                    assert!(!merkle_verify(&root, leaf, index, count, shorter));
                }
            }
            assert!(merkle_path(&leaves, count).is_empty());
            assert!(!merkle_verify(&root, &leaves[0], count, count, &[]));
        }
    }

    #[test]
    fn merkle_root_depends_on_every_leaf_and_order() {
        let leaves: Vec<Hash> = (0u8..5).map(|i| Hash([i; 32])).collect();
        let root = merkle_root(&leaves);
        for i in 0..leaves.len() {
            let mut changed = leaves.clone();
            changed[i].0[0] ^= 1;
            assert_ne!(merkle_root(&changed), root);
        }
        let mut swapped = leaves.clone();
        swapped.swap(0, 1);
        assert_ne!(merkle_root(&swapped), root);
        assert_ne!(merkle_root(&leaves[..4]), root);
        assert_ne!(merkle_root(&[]), merkle_root(&[Hash::ZERO]));
    }

    #[test]
    fn hash_text_round_trips() {
        let hash = Hash::of_parts(&[b"x"]);
        assert_eq!(hash.to_string().parse::<Hash>(), Ok(hash));
        assert_eq!("zz".parse::<Hash>(), Err(BadHash));
        assert_eq!("00".parse::<Hash>(), Err(BadHash));
    }
}
