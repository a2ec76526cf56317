//! The bounded little-endian reader beneath every binary decoder from outside (the dispatch
//! protocol's frames, the consensus engine's messages): each read checks the bytes left
//! first, and a count of items is bounded by a limit and by the bytes left before anything
//! is allocated for it. It never panics; what it refuses is a typed `ReadError`, which each
//! codec turns into its own.

/// Why bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("truncated: {needed} more bytes needed at offset {at}")]
    Truncated { at: usize, needed: usize },
    #[error("{what} is {got}, over the limit of {max}")]
    TooLarge {
        what: &'static str,
        got: u64,
        max: u64,
    },
    #[error("{0} bytes after the end of the message")]
    Trailing(usize),
}

/// Reads `buf` from its start.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, at: 0 }
    }

    /// Bytes read so far.
    pub fn position(&self) -> usize {
        self.at
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let left = self.remaining();
        if n > left {
            return Err(ReadError::Truncated {
                at: self.at,
                needed: n - left,
            });
        }
        let bytes = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(bytes)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8, ReadError> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u16(&mut self) -> Result<u16, ReadError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32, ReadError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, ReadError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A u32 count of items of at least `item_bytes` each: at most `max`, and no more than
    /// the bytes left hold, so that no allocation is ever sized by an unchecked number.
    pub fn count(
        &mut self,
        what: &'static str,
        max: usize,
        item_bytes: usize,
    ) -> Result<usize, ReadError> {
        let n = usize::try_from(self.u32()?).unwrap_or(usize::MAX);
        if n > max {
            return Err(ReadError::TooLarge {
                what,
                got: n as u64,
                max: max as u64,
            });
        }
        let (needed, left) = (n.saturating_mul(item_bytes), self.remaining());
        if needed > left {
            return Err(ReadError::Truncated {
                at: self.at,
                needed: needed - left,
            });
        }
        Ok(n)
    }

    /// Nothing is left.
    pub fn finish(&self) -> Result<(), ReadError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(ReadError::Trailing(extra)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_little_endian_and_says_what_is_missing() {
        let bytes = [1, 2, 0, 3, 0, 0, 0, 9];
        let mut r = Reader::new(&bytes);
        assert_eq!((r.u8(), r.u16(), r.u32()), (Ok(1), Ok(2), Ok(3)));
        assert_eq!(r.position(), 7);
        assert_eq!(r.finish(), Err(ReadError::Trailing(1)));
        assert_eq!(r.u16(), Err(ReadError::Truncated { at: 7, needed: 1 }));
        assert_eq!(r.u8(), Ok(9));
        assert_eq!(r.finish(), Ok(()));
    }

    #[test]
    fn a_count_is_bounded_by_its_limit_and_by_the_bytes_left() {
        let mut bytes = 3u32.to_le_bytes().to_vec();
        bytes.extend([0; 6]);
        assert_eq!(Reader::new(&bytes).count("items", 3, 2), Ok(3));
        assert_eq!(
            Reader::new(&bytes).count("items", 2, 2),
            Err(ReadError::TooLarge {
                what: "items",
                got: 3,
                max: 2
            })
        );
        assert_eq!(
            Reader::new(&bytes).count("items", 3, 4),
            Err(ReadError::Truncated { at: 4, needed: 6 })
        );
        let huge = u32::MAX.to_le_bytes();
        assert!(Reader::new(&huge)
            .count("items", usize::MAX, usize::MAX)
            .is_err());
    }

    proptest! {
        #[test]
        fn no_input_makes_it_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), max in 0usize..1000, size in 0usize..64) {
            let mut r = Reader::new(&bytes);
            let _ = r.count("items", max, size);
            let _ = (r.u64(), r.take(size), r.array::<3>(), r.finish());
            prop_assert!(r.position() <= bytes.len());
        }
    }
}
