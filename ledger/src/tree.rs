//! The authenticated state tree: a persistent, compact binary Merkle trie keyed by 256-bit
//! hashes. A leaf sits at the shallowest depth where its key prefix is unique, so the shape
//! (and root) depends only on the set of (key, value) pairs, never on insertion order. An
//! update rehashes one root-to-leaf path, about log2(n) nodes, so commit cost stays flat as
//! accounts grow. Nodes are shared between versions (path copying): cloning a tree is O(1),
//! which lets block application work on a copy and simply drop it on failure.

use std::sync::Arc;

use crate::hash::Hash;

#[derive(Clone, Default)]
pub struct StateTree {
    root: Option<Arc<Node>>,
}

enum Node {
    Leaf {
        key: Hash,
        hash: Hash,
    },
    Branch {
        left: Option<Arc<Node>>,
        right: Option<Arc<Node>>,
        hash: Hash,
    },
}

impl Node {
    fn hash(&self) -> Hash {
        match self {
            Node::Leaf { hash, .. } | Node::Branch { hash, .. } => *hash,
        }
    }

    fn leaf(key: Hash, value: Hash) -> Arc<Node> {
        let hash = Hash::of_parts(&[&[0u8], &key.0, &value.0]);
        Arc::new(Node::Leaf { key, hash })
    }

    fn branch(left: Option<Arc<Node>>, right: Option<Arc<Node>>) -> Arc<Node> {
        let side = |n: &Option<Arc<Node>>| n.as_ref().map_or(Hash::ZERO, |n| n.hash());
        let hash = Hash::of_parts(&[&[1u8], &side(&left).0, &side(&right).0]);
        Arc::new(Node::Branch { left, right, hash })
    }
}

fn bit(key: &Hash, depth: usize) -> bool {
    key.0[depth / 8] >> (7 - depth % 8) & 1 == 1
}

impl StateTree {
    /// The root commitment; a fixed constant for the empty tree.
    pub fn root(&self) -> Hash {
        self.root
            .as_ref()
            .map_or_else(|| Hash::of_parts(&[b"kvasir-state-empty"]), |n| n.hash())
    }

    /// Sets `key` to `value`, inserting it if absent.
    pub fn insert(&mut self, key: Hash, value: Hash) {
        self.root = Some(insert(self.root.as_ref(), 0, key, value));
    }
}

fn insert(node: Option<&Arc<Node>>, depth: usize, key: Hash, value: Hash) -> Arc<Node> {
    match node.map(|n| n.as_ref()) {
        None => Node::leaf(key, value),
        Some(Node::Leaf { key: existing, .. }) if *existing == key => Node::leaf(key, value),
        Some(Node::Leaf { key: existing, .. }) => {
            split(node.cloned(), *existing, Node::leaf(key, value), key, depth)
        }
        Some(Node::Branch { left, right, .. }) => {
            if bit(&key, depth) {
                Node::branch(
                    left.clone(),
                    Some(insert(right.as_ref(), depth + 1, key, value)),
                )
            } else {
                Node::branch(
                    Some(insert(left.as_ref(), depth + 1, key, value)),
                    right.clone(),
                )
            }
        }
    }
}

/// Places two leaves with distinct keys under a chain of branches down to the first bit where
/// their keys differ.
fn split(a: Option<Arc<Node>>, a_key: Hash, b: Arc<Node>, b_key: Hash, depth: usize) -> Arc<Node> {
    let (a_bit, b_bit) = (bit(&a_key, depth), bit(&b_key, depth));
    if a_bit == b_bit {
        let child = split(a, a_key, b, b_key, depth + 1);
        if a_bit {
            Node::branch(None, Some(child))
        } else {
            Node::branch(Some(child), None)
        }
    } else if b_bit {
        Node::branch(a, Some(b))
    } else {
        Node::branch(Some(b), a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(i: u64) -> Hash {
        Hash::of_parts(&[&i.to_le_bytes()])
    }

    #[test]
    fn root_changes_with_every_update_and_old_versions_survive() {
        let mut tree = StateTree::default();
        let empty = tree.root();
        tree.insert(key(1), key(10));
        let one = tree.clone();
        tree.insert(key(2), key(20));
        assert_ne!(tree.root(), one.root());
        assert_ne!(one.root(), empty);
        let twenty = tree.root();
        tree.insert(key(2), key(21));
        assert_ne!(tree.root(), twenty);
        tree.insert(key(2), key(20));
        assert_eq!(tree.root(), twenty);
        let mut again = one.clone();
        again.insert(key(2), key(20));
        assert_eq!(tree.root(), again.root());
    }

    proptest! {
        #[test]
        fn root_is_independent_of_insertion_order(
            entries in proptest::collection::btree_map(0u64..500, 0u64..5, 0..60),
            seed in any::<u64>(),
        ) {
            let mut forward = StateTree::default();
            for (k, v) in &entries {
                forward.insert(key(*k), key(*v));
            }
            let mut shuffled: Vec<_> = entries.iter().collect();
            shuffled.sort_by_key(|(k, _)| Hash::of_parts(&[&k.to_le_bytes(), &seed.to_le_bytes()]));
            let mut backward = StateTree::default();
            // Insert stale values first, then the real ones, to exercise updates in place.
            for (k, _) in &shuffled {
                backward.insert(key(**k), Hash::ZERO);
            }
            for (k, v) in &shuffled {
                backward.insert(key(**k), key(**v));
            }
            prop_assert_eq!(forward.root(), backward.root());
        }
    }
}
