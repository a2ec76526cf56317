//! GGUF files, as llama.cpp's tools write them: a header of typed metadata and tensor
//! descriptions, then the tensors' bytes, aligned. The file is memory-mapped and only its
//! header is parsed; a tensor is a range of the map. Every count and length in the header is
//! checked against what is left of the file before anything is allocated for it, every
//! tensor's bytes must lie inside the file, and a malformed header is a `GgufError` naming
//! what is wrong and where, never a panic: a GGUF file is an input from outside, downloaded
//! from anywhere.
//!
//! Hand-written rather than taken from a crate: the crates that read GGUF either come with a
//! whole inference framework or do not bound what a header makes them allocate, and the
//! format is small (its specification is llama.cpp's `docs/gguf.md`).
//!
//! The tensor types are those of llama.cpp's common presets (`GgmlType`); a file holding
//! another is refused at open, naming the tensor and the type.

pub mod config;
pub mod names;
pub mod split;
pub mod write;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::kernels::quant::BlockFormat;
use crate::weights::DType;

/// What a GGUF file starts with.
const MAGIC: &[u8; 4] = b"GGUF";
/// The alignment of the tensors' bytes when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;
/// The most dimensions a tensor has (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// How deep arrays of arrays may nest.
const MAX_ARRAY_DEPTH: usize = 2;
/// The most metadata values a header may hold, arrays' items included: a value takes 32
/// bytes in memory, where a file may spend one, so a file's size alone does not bound them.
/// A 250,000-token vocabulary with its merges, scores and types is about a million.
const MAX_METADATA_VALUES: usize = 1 << 23;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("not a GGUF file (it does not start with \"GGUF\")")]
    NotGguf,
    #[error("GGUF version {0} is not one this engine reads (2 or 3)")]
    Version(u32),
    #[error("malformed GGUF header at byte {at}: {what}")]
    Malformed { at: usize, what: String },
    #[error("tensor {tensor} has type {kind}, which this engine does not implement (it reads F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K and Q6_K)")]
    UnsupportedType { tensor: String, kind: String },
    #[error("{0}: {1}")]
    Split(String, String),
}

/// The tensor types this engine reads, with their ggml ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    const ALL: [GgmlType; 8] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The type's ggml id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// The engine's dtype of the type.
    pub fn dtype(self) -> DType {
        match self {
            GgmlType::F32 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            GgmlType::Q8_0 => DType::Quantized(BlockFormat::Q8_0),
            GgmlType::Q4_0 => DType::Quantized(BlockFormat::Q4_0),
            GgmlType::Q4K => DType::Quantized(BlockFormat::Q4K),
            GgmlType::Q5K => DType::Quantized(BlockFormat::Q5K),
            GgmlType::Q6K => DType::Quantized(BlockFormat::Q6K),
        }
    }

    /// The type that stores `dtype`.
    pub fn of_dtype(dtype: DType) -> GgmlType {
        GgmlType::ALL
            .into_iter()
            .find(|t| t.dtype() == dtype)
            .expect("every dtype has a ggml type")
    }

    /// The type of ggml id `id`, or the name llama.cpp gives it (for the error).
    fn from_id(id: u32) -> Result<GgmlType, String> {
        match GgmlType::ALL.into_iter().find(|t| t.id() == id) {
            Some(kind) => Ok(kind),
            None => {
                let other = id;
                let names = [
                    (3, "Q4_1"),
                    (6, "Q5_0"),
                    (7, "Q5_1"),
                    (9, "Q8_1"),
                    (10, "Q2_K"),
                    (11, "Q3_K"),
                    (15, "Q8_K"),
                    (16, "IQ2_XXS"),
                    (17, "IQ2_XS"),
                    (18, "IQ3_XXS"),
                    (19, "IQ1_S"),
                    (20, "IQ4_NL"),
                    (21, "IQ3_S"),
                    (22, "IQ2_S"),
                    (23, "IQ4_XS"),
                    (24, "I8"),
                    (25, "I16"),
                    (26, "I32"),
                    (27, "I64"),
                    (28, "F64"),
                    (29, "IQ1_M"),
                    (34, "TQ1_0"),
                    (35, "TQ2_0"),
                    (39, "MXFP4"),
                ];
                Err(match names.iter().find(|(n, _)| *n == other) {
                    Some((_, name)) => format!("{name} (ggml type {other})"),
                    None => format!("ggml type {other}"),
                })
            }
        }
    }

    /// Values in one block, and the bytes a block takes.
    pub fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }
}

/// A metadata value. Integers of every width read as `Int`, floats as `Float`.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Text(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(v) => Some(*v),
            Value::Int(v) => Some(*v as f64),
            _ => None,
        }
    }

    pub fn as_text(&self) -> Option<&str> {
        match self {
            Value::Text(text) => Some(text),
            _ => None,
        }
    }
}

/// One tensor: its name, its dimensions innermost first (ggml's `ne`: a `rows x cols`
/// matrix is `[cols, rows]`), its type and where its bytes lie in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub kind: GgmlType,
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn byte_len(&self) -> u64 {
        (self.end - self.start) as u64
    }
}

/// Whether `path` names a GGUF file (by its extension), where a checkpoint directory is
/// taken otherwise.
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A GGUF file, mapped, its header parsed.
pub struct Gguf {
    map: Arc<Mmap>,
    header: Header,
}

/// What the header says.
#[derive(Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Where the tensors' bytes start: everything before is the header.
    pub data_start: usize,
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io = |e| GgufError::Io(path.display().to_string(), e);
        let file = File::open(path).map_err(io)?;
        // Safety: the file is only read; a file changed under the map by another process is
        // outside what any reader of a memory-mapped checkpoint can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = Header::parse(&map)?;
        Ok(Gguf {
            map: Arc::new(map),
            header,
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The header's bytes: the metadata and the tensors' names, shapes, types and places.
    pub fn header_bytes(&self) -> &[u8] {
        &self.map[..self.header.data_start]
    }

    /// The map and the parsed header, for a reader that keeps views of the tensors.
    pub fn into_parts(self) -> (Arc<Mmap>, Header) {
        (self.map, self.header)
    }

    /// The bytes of `tensor`, as stored.
    pub fn bytes(&self, tensor: &TensorInfo) -> &[u8] {
        &self.map[tensor.start..tensor.end]
    }
}

impl Header {
    /// Parses the header of a whole GGUF file `bytes` (the tensors' ranges are checked
    /// against its length).
    pub fn parse(bytes: &[u8]) -> Result<Header, GgufError> {
        let mut r = Reader {
            bytes,
            at: 0,
            values: 0,
        };
        if r.take(4)? != MAGIC {
            return Err(GgufError::NotGguf);
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let tensor_count = r.u64()?;
        let kv_count = r.u64()?;
        // A key takes at least 12 bytes, a tensor description at least 24: counts beyond what
        // the file could hold are refused before anything is allocated for them.
        r.fits(kv_count, 12, "metadata entries")?;
        r.fits(tensor_count, 24, "tensors")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.text()?;
            let kind = r.u32()?;
            let value = r.value(kind, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(r.malformed(format!("metadata key {key:?} given twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(value) => match value.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                _ => return Err(r.malformed("general.alignment is not a power of two".into())),
            },
        };
        let mut described = Vec::new();
        for _ in 0..tensor_count {
            let name = r.text()?;
            let rank = r.u32()?;
            if rank == 0 || rank > MAX_DIMS {
                return Err(r.malformed(format!("tensor {name} has {rank} dimensions")));
            }
            let dims = (0..rank).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
            let id = r.u32()?;
            let offset = r.u64()?;
            let kind = GgmlType::from_id(id).map_err(|kind| GgufError::UnsupportedType {
                tensor: name.clone(),
                kind,
            })?;
            described.push((name, dims, kind, offset));
        }
        let data_start = align(r.at as u64, alignment)
            .filter(|&start| start <= bytes.len() as u64)
            .ok_or_else(|| r.malformed("the tensors' data would start past the end".into()))?;
        let mut tensors = Vec::with_capacity(described.len());
        let mut names = std::collections::HashSet::new();
        for (name, dims, kind, offset) in described {
            let place = tensor_place(&dims, kind, offset, alignment, data_start, bytes.len())
                .map_err(|what| GgufError::Malformed {
                    at: data_start as usize,
                    what: format!("tensor {name}: {what}"),
                })?;
            if !names.insert(name.clone()) {
                return Err(GgufError::Malformed {
                    at: data_start as usize,
                    what: format!("tensor {name} is described twice"),
                });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                kind,
                start: place.0,
                end: place.1,
            });
        }
        Ok(Header {
            version,
            metadata,
            tensors,
            data_start: data_start as usize,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// `at` rounded up to `alignment`, if it does not overflow.
fn align(at: u64, alignment: u64) -> Option<u64> {
    at.checked_add(alignment - 1)
        .map(|a| a / alignment * alignment)
}

/// Where a tensor of `dims` and `kind` at `offset` lies in a file of `file_len` bytes whose
/// data starts at `data_start`: its byte range, or why it cannot lie there.
fn tensor_place(
    dims: &[u64],
    kind: GgmlType,
    offset: u64,
    alignment: u64,
    data_start: u64,
    file_len: usize,
) -> Result<(usize, usize), String> {
    let (block_values, block_bytes) = kind.block();
    let (&innermost, outer) = dims.split_first().ok_or("no dimensions")?;
    if dims.contains(&0) {
        return Err(format!("a dimension of zero in {dims:?}"));
    }
    if !innermost.is_multiple_of(block_values) {
        return Err(format!(
            "its rows of {innermost} values are not whole {}-value blocks of {}",
            block_values,
            kind.name()
        ));
    }
    let rows = outer
        .iter()
        .try_fold(1u64, |n, d| n.checked_mul(*d))
        .ok_or("too many values")?;
    let len = (innermost / block_values)
        .checked_mul(block_bytes)
        .and_then(|row| row.checked_mul(rows))
        .ok_or("too many values")?;
    if !offset.is_multiple_of(alignment) {
        return Err(format!("its offset {offset} is not aligned to {alignment}"));
    }
    let start = data_start
        .checked_add(offset)
        .ok_or("offset past the end")?;
    let end = start.checked_add(len).ok_or("offset past the end")?;
    if end > file_len as u64 {
        return Err(format!(
            "its {len} bytes at {start} run past the end of the file ({file_len} bytes)"
        ));
    }
    Ok((start as usize, end as usize))
}

/// Reads the header's little-endian fields, every length checked against what is left.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Metadata values read so far (`MAX_METADATA_VALUES`).
    values: usize,
}

impl<'a> Reader<'a> {
    fn malformed(&self, what: String) -> GgufError {
        GgufError::Malformed { at: self.at, what }
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// Refuses `count` items of at least `least` bytes each if what is left cannot hold them.
    fn fits(&self, count: u64, least: u64, what: &str) -> Result<usize, GgufError> {
        match count.checked_mul(least) {
            Some(need) if need <= self.left() as u64 => Ok(count as usize),
            _ => Err(self.malformed(format!(
                "{count} {what} cannot fit in the {} bytes left",
                self.left()
            ))),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        if n > self.left() {
            return Err(self.malformed(format!("{n} bytes wanted, {} left", self.left())));
        }
        let taken = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn text(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        let len = self.fits(len, 1, "bytes of text")?;
        let at = self.at;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Malformed {
            at,
            what: "text that is not UTF-8".into(),
        })
    }

    /// A value of GGUF type `kind`, inside `depth` arrays.
    fn value(&mut self, kind: u32, depth: usize) -> Result<Value, GgufError> {
        self.values += 1;
        if self.values > MAX_METADATA_VALUES {
            return Err(self.malformed(format!("more than {MAX_METADATA_VALUES} metadata values")));
        }
        Ok(match kind {
            0 => Value::Int(self.array::<1>()?[0].into()),
            1 => Value::Int((self.array::<1>()?[0] as i8).into()),
            2 => Value::Int(u16::from_le_bytes(self.array()?).into()),
            3 => Value::Int(i16::from_le_bytes(self.array()?).into()),
            4 => Value::Int(self.u32()?.into()),
            5 => Value::Int(i32::from_le_bytes(self.array()?).into()),
            6 => Value::Float(f32::from_le_bytes(self.array()?).into()),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return Err(self.malformed(format!("a bool of {other}"))),
            },
            8 => Value::Text(self.text()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.malformed("arrays nested too deep".into()));
                }
                let item = self.u32()?;
                if item > 12 {
                    return Err(self.malformed(format!("an array of unknown type {item}")));
                }
                let count = self.u64()?;
                // The smallest item is one byte (an array's header alone is twelve), and no
                // more items than values are left.
                let count = self.fits(count, 1, "array items")?;
                if count > MAX_METADATA_VALUES - self.values {
                    return Err(self.malformed(format!(
                        "an array of {count} items, past {MAX_METADATA_VALUES} metadata values"
                    )));
                }
                let mut items = Vec::with_capacity(count.min(1 << 16));
                for _ in 0..count {
                    items.push(self.value(item, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Int(self.u64()?.into()),
            11 => Value::Int(i64::from_le_bytes(self.array()?).into()),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(self.malformed(format!("metadata of unknown type {other}"))),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Writes GGUF files for tests: `write::HeaderWriter`, with the data in memory.
    #[derive(Default)]
    pub(crate) struct Writer {
        header: write::HeaderWriter,
        data: Vec<u8>,
    }

    impl Writer {
        pub(crate) fn u32(mut self, key: &str, value: u32) -> Self {
            self.header.u32(key, value);
            self
        }

        pub(crate) fn f32(mut self, key: &str, value: f32) -> Self {
            self.header.f32(key, value);
            self
        }

        pub(crate) fn text(mut self, key: &str, value: &str) -> Self {
            self.header.text(key, value);
            self
        }

        pub(crate) fn texts(mut self, key: &str, values: &[&str]) -> Self {
            self.header.texts(key, values.iter().copied());
            self
        }

        /// A tensor of ggml type `id` with `dims` (innermost first) and these bytes.
        pub(crate) fn tensor(mut self, name: &str, dims: &[u64], id: u32, bytes: &[u8]) -> Self {
            self.header.tensor_of_id(name, dims, id, bytes.len() as u64);
            self.data.extend(bytes);
            while !self.data.len().is_multiple_of(32) {
                self.data.push(0);
            }
            self
        }

        pub(crate) fn finish(self) -> Vec<u8> {
            let mut out = self.header.finish();
            out.extend(self.data);
            out
        }
    }

    fn small() -> Vec<u8> {
        Writer::default()
            .text("general.architecture", "qwen3moe")
            .u32("qwen3moe.block_count", 2)
            .f32("qwen3moe.rope.freq_base", 1e6)
            .texts("tokenizer.ggml.tokens", &["a", "b"])
            .tensor("token_embd.weight", &[4, 2], 0, &[0; 32])
            .tensor("blk.0.ffn_down_exps.weight", &[32, 2, 3], 8, &[1; 6 * 34])
            .finish()
    }

    #[test]
    fn a_header_reads_back_its_metadata_and_tensors_in_place() {
        let bytes = small();
        let header = Header::parse(&bytes).unwrap();
        assert_eq!(header.version, 3);
        assert_eq!(
            header.get("general.architecture").and_then(Value::as_text),
            Some("qwen3moe")
        );
        assert_eq!(
            header.get("qwen3moe.block_count").and_then(Value::as_u64),
            Some(2)
        );
        assert_eq!(
            header
                .get("qwen3moe.rope.freq_base")
                .and_then(Value::as_f64),
            Some(1e6)
        );
        let tokens = header.get("tokenizer.ggml.tokens").unwrap();
        assert_eq!(
            tokens,
            &Value::Array(vec![Value::Text("a".into()), Value::Text("b".into())])
        );
        let down = header.tensor("blk.0.ffn_down_exps.weight").unwrap();
        assert_eq!(down.kind, GgmlType::Q8_0);
        assert_eq!(down.dims, [32, 2, 3]);
        assert_eq!(down.byte_len(), 6 * 34);
        assert_eq!(down.start % 32, 0);
        assert!(bytes[down.start..down.end].iter().all(|b| *b == 1));
        assert_eq!(header.data_start % 32, 0);
    }

    #[test]
    fn a_bad_header_is_an_error_that_says_what() {
        let cases: [(&str, Vec<u8>); 6] = [
            ("GGUF", b"GGML\x03\0\0\0".to_vec()),
            ("version", {
                let mut b = small();
                b[4] = 1;
                b
            }),
            (
                "Q4_1",
                Writer::default()
                    .tensor("blk.0.ffn_up_exps.weight", &[32], 3, &[0; 20])
                    .finish(),
            ),
            (
                "whole",
                Writer::default().tensor("t", &[31], 8, &[0; 34]).finish(),
            ),
            (
                "past the end",
                Writer::default()
                    .tensor("t", &[64, 1000], 8, &[0; 34])
                    .finish(),
            ),
            (
                "cannot fit",
                [&b"GGUF\x03\0\0\0"[..], &u64::MAX.to_le_bytes(), &[0; 8]].concat(),
            ),
        ];
        for (what, bytes) in cases {
            let error = Header::parse(&bytes).unwrap_err().to_string();
            assert!(error.contains(what), "{what}: {error}");
        }
        // Cut anywhere, the small file is refused, never read past.
        let bytes = small();
        let data_start = Header::parse(&bytes).unwrap().data_start;
        for cut in 0..data_start {
            assert!(Header::parse(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    /// The fixture llama.cpp's own Python library wrote (`tests/data/gguf/write.py`).
    pub(crate) fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf/tiny-qwen3moe-q8_0.gguf")
    }

    /// A file written by gguf-py reads as it wrote it: its metadata, every tensor's type,
    /// shape and size, and the config it was converted from.
    #[test]
    fn a_file_written_by_llama_cpps_library_reads_as_written() {
        let file = Gguf::open(&fixture()).unwrap();
        let header = file.header();
        assert_eq!(header.tensors.len(), 26);
        let kind = |name: &str| {
            header
                .tensor(name)
                .map(|t| (t.kind, t.dims.clone(), t.byte_len()))
        };
        assert_eq!(
            kind("blk.1.ffn_gate_exps.weight"),
            Some((GgmlType::Q8_0, vec![64, 32, 8], 16384 / 32 * 34))
        );
        assert_eq!(
            kind("blk.1.ffn_down_exps.weight"),
            Some((GgmlType::Q4_0, vec![32, 64, 8], 16384 / 32 * 18))
        );
        assert_eq!(
            kind("output.weight"),
            Some((GgmlType::BF16, vec![64, 16], 2048))
        );
        assert_eq!(
            kind("blk.0.attn_q.weight"),
            Some((GgmlType::F16, vec![64, 64], 8192))
        );
        let embed = header.tensor("token_embd.weight").unwrap();
        // gguf-py's values: sin(i * 0.37 + 1) / 2.
        let first = f32::from_le_bytes(file.bytes(embed)[4..8].try_into().unwrap());
        assert_eq!(first, ((0.37f64 + 1.0).sin() * 0.5) as f32);
        let config = config::config(header).unwrap();
        assert_eq!(config.moe_layers().collect::<Vec<_>>(), [1]);
        assert_eq!((config.num_experts, config.moe_intermediate_size), (8, 32));
        assert!(!config.tie_word_embeddings);
    }

    proptest! {
        /// Whatever the bytes, parsing returns: an error or a header whose tensors lie inside.
        #[test]
        fn parsing_never_panics_and_never_places_a_tensor_outside(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
        ) {
            let mut bytes = small();
            for (at, value) in flips {
                let len = bytes.len();
                bytes[at % len] = value;
            }
            bytes.truncate(cut % (bytes.len() + 1));
            if let Ok(header) = Header::parse(&bytes) {
                for tensor in &header.tensors {
                    prop_assert!(tensor.start <= tensor.end && tensor.end <= bytes.len());
                }
            }
        }
    }
}
