//! The authenticated state tree: a persistent, compact binary Merkle trie keyed by 256-bit
//! hashes. A leaf sits at the shallowest depth where its key prefix is unique, so the shape
//! (and root) depends only on the set of (key, value) pairs, never on insertion or batch
//! order. A block's changes are applied in one sorted batch that rehashes only the paths to
//! changed leaves, about log2(n) nodes each, so commit cost stays flat as accounts grow.
//! Nodes are shared between versions (path copying): cloning a tree is O(1), which lets
//! block application work on a copy and simply drop it on failure.

use std::sync::Arc;

use crate::hash::Hash;

#[derive(Clone, Default)]
pub struct StateTree {
    root: Option<Arc<Node>>,
}

enum Node {
    Leaf {
        key: Hash,
        value: Hash,
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
        Arc::new(Node::Leaf { key, value, hash })
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

/// Subtrees above this depth with enough work are updated on two threads; the result is the
/// same bytes either way, since hashing is pure.
const PARALLEL_DEPTH: usize = 6;
const PARALLEL_MIN_ENTRIES: usize = 64;

impl StateTree {
    /// The root commitment; a fixed constant for the empty tree.
    pub fn root(&self) -> Hash {
        self.root
            .as_ref()
            .map_or_else(|| Hash::of_parts(&[b"kvasir-state-empty"]), |n| n.hash())
    }

    /// Sets each key to its value, inserting absent keys. One descent serves all entries, so
    /// shared upper nodes are rebuilt and hashed once per batch, not once per key. When a key
    /// appears twice the later value wins.
    pub fn update(&mut self, mut entries: Vec<(Hash, Hash)>) {
        if entries.is_empty() {
            return;
        }
        // Stable sort keeps equal keys in order, so dedup keeping the last is "later wins".
        entries.sort_by_key(|entry| entry.0);
        entries.reverse();
        entries.dedup_by(|later, earlier| later.0 == earlier.0);
        entries.reverse();
        self.root = update(self.root.as_ref(), 0, &entries);
    }
}

/// The subtree at `depth` holding `node`'s entries overlaid with `entries` (sorted, unique,
/// all sharing the path to `depth`). Canonical shape: no keys is no node, one key is a leaf,
/// two or more is a branch.
fn update(node: Option<&Arc<Node>>, depth: usize, entries: &[(Hash, Hash)]) -> Option<Arc<Node>> {
    if entries.is_empty() {
        return node.cloned();
    }
    match node.map(Arc::as_ref) {
        None if entries.len() == 1 => Some(Node::leaf(entries[0].0, entries[0].1)),
        None => branch_over(None, None, depth, entries),
        Some(Node::Leaf { key, value, .. }) => {
            if entries.iter().any(|(k, _)| k == key) {
                update(None, depth, entries)
            } else {
                let mut merged = entries.to_vec();
                let at = merged.partition_point(|(k, _)| k < key);
                merged.insert(at, (*key, *value));
                update(None, depth, &merged)
            }
        }
        Some(Node::Branch { left, right, .. }) => {
            branch_over(left.as_ref(), right.as_ref(), depth, entries)
        }
    }
}

fn branch_over(
    left: Option<&Arc<Node>>,
    right: Option<&Arc<Node>>,
    depth: usize,
    entries: &[(Hash, Hash)],
) -> Option<Arc<Node>> {
    let split = entries.partition_point(|(k, _)| !bit(k, depth));
    let (to_left, to_right) = entries.split_at(split);
    let (new_left, new_right) = if depth < PARALLEL_DEPTH && entries.len() >= PARALLEL_MIN_ENTRIES {
        rayon::join(
            || update(left, depth + 1, to_left),
            || update(right, depth + 1, to_right),
        )
    } else {
        (
            update(left, depth + 1, to_left),
            update(right, depth + 1, to_right),
        )
    };
    Some(Node::branch(new_left, new_right))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(i: u64) -> Hash {
        Hash::of_parts(&[&i.to_le_bytes()])
    }

    fn tree_of(entries: &[(u64, u64)]) -> StateTree {
        let mut tree = StateTree::default();
        tree.update(entries.iter().map(|(k, v)| (key(*k), key(*v))).collect());
        tree
    }

    #[test]
    fn root_changes_with_every_update_and_old_versions_survive() {
        let mut tree = StateTree::default();
        let empty = tree.root();
        tree.update(vec![(key(1), key(10))]);
        let one = tree.clone();
        tree.update(vec![(key(2), key(20))]);
        assert_ne!(tree.root(), one.root());
        assert_ne!(one.root(), empty);
        let twenty = tree.root();
        tree.update(vec![(key(2), key(21))]);
        assert_ne!(tree.root(), twenty);
        tree.update(vec![(key(2), key(20))]);
        assert_eq!(tree.root(), twenty);
        assert_eq!(tree_of(&[(1, 10), (2, 20)]).root(), twenty);
        assert_eq!(one.root(), tree_of(&[(1, 10)]).root());
        // Within one batch the later value for a key wins.
        let mut twice = StateTree::default();
        twice.update(vec![
            (key(1), key(99)),
            (key(2), key(20)),
            (key(1), key(10)),
        ]);
        assert_eq!(twice.root(), twenty);
    }

    proptest! {
        #[test]
        fn root_is_independent_of_insertion_order(
            entries in proptest::collection::btree_map(0u64..2000, 0u64..5, 0..300),
            seed in any::<u64>(),
        ) {
            let all: Vec<(u64, u64)> = entries.iter().map(|(k, v)| (*k, *v)).collect();
            let bulk = tree_of(&all);
            // The same set reached one key at a time, in a shuffled order, over stale values.
            let mut shuffled = all.clone();
            shuffled.sort_by_key(|(k, _)| Hash::of_parts(&[&k.to_le_bytes(), &seed.to_le_bytes()]));
            let mut stepwise = StateTree::default();
            for (k, _) in &shuffled {
                stepwise.update(vec![(key(*k), Hash::ZERO)]);
            }
            for chunk in shuffled.chunks(1 + (seed % 7) as usize) {
                stepwise.update(chunk.iter().map(|(k, v)| (key(*k), key(*v))).collect());
            }
            prop_assert_eq!(bulk.root(), stepwise.root());
        }
    }
}
