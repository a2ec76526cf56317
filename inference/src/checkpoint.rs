//! A Hugging Face checkpoint directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, memory-mapped. Every lookup checks the shape the config
//! implies and names the tensor in its error.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::weights::{DType, Weight};
use crate::LoadError;

struct Entry {
    file: usize,
    start: usize,
    end: usize,
    dtype: DType,
    shape: Vec<usize>,
}

pub struct Checkpoint {
    maps: Vec<Arc<Mmap>>,
    entries: HashMap<String, Entry>,
}

#[derive(Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint, LoadError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| LoadError::io(&index_path, e))?;
            let index: Index = serde_json::from_str(&text).map_err(|e| LoadError::Format {
                file: index_path.display().to_string(),
                reason: e.to_string(),
            })?;
            let mut shards: Vec<&String> = index.weight_map.values().collect();
            shards.sort();
            shards.dedup();
            for shard in &shards {
                if shard.contains('/') || shard.contains("..") {
                    return Err(LoadError::Format {
                        file: index_path.display().to_string(),
                        reason: format!("shard name {shard:?} leaves the checkpoint directory"),
                    });
                }
            }
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut checkpoint = Checkpoint {
            maps: Vec::new(),
            entries: HashMap::new(),
        };
        for path in files {
            checkpoint.add_file(&path)?;
        }
        Ok(checkpoint)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), LoadError> {
        let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: the checkpoint is treated as read-only input; a file truncated while
        // mapped is outside what this process can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let format = |reason: String| LoadError::Format {
            file: path.display().to_string(),
            reason,
        };
        let (header_len, metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| format(e.to_string()))?;
        let data_start = 8 + header_len;
        let index = self.maps.len();
        for (name, info) in metadata.tensors() {
            let dtype = match info.dtype {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F16 => DType::F16,
                other => {
                    return Err(LoadError::DType {
                        name,
                        dtype: format!("{other:?}"),
                    })
                }
            };
            let (start, end) = (
                data_start + info.data_offsets.0,
                data_start + info.data_offsets.1,
            );
            if end > map.len() || start > end {
                return Err(format(format!("tensor {name} lies outside the file")));
            }
            self.entries.insert(
                name,
                Entry {
                    file: index,
                    start,
                    end,
                    dtype,
                    shape: info.shape.clone(),
                },
            );
        }
        self.maps.push(Arc::new(map));
        Ok(())
    }

    /// Every tensor's name, dtype, shape and place, one line each in name order: what two
    /// copies of a checkpoint must agree on to hold the same weights layout.
    pub fn layout(&self) -> String {
        let mut names: Vec<&String> = self.entries.keys().collect();
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let e = &self.entries[name];
                format!(
                    "{name} {:?} {:?} {} {}..{}\n",
                    e.dtype, e.shape, e.file, e.start, e.end
                )
            })
            .collect()
    }

    /// Every tensor's name and stored size in bytes, in no particular order.
    pub fn tensor_sizes(&self) -> impl Iterator<Item = (&str, u64)> {
        self.entries
            .iter()
            .map(|(name, e)| (name.as_str(), (e.end - e.start) as u64))
    }

    /// The stored bytes of tensor `name`, as the file holds them: what a weight hash covers.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], LoadError> {
        let entry = self
            .entries
            .get(name)
            .ok_or_else(|| LoadError::Missing(name.to_string()))?;
        Ok(&self.maps[entry.file][entry.start..entry.end])
    }

    /// The tensor `name`, which must have exactly `shape`; viewed as `rows x cols` with the
    /// last dimension as columns.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Weight, LoadError> {
        let entry = self
            .entries
            .get(name)
            .ok_or_else(|| LoadError::Missing(name.to_string()))?;
        if entry.shape != shape {
            return Err(LoadError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: entry.shape.clone(),
            });
        }
        let cols = shape.last().copied().unwrap_or(1);
        let rows = shape.iter().rev().skip(1).product();
        let map = self.maps[entry.file].clone();
        Ok(Weight::mapped(
            map,
            entry.start,
            entry.end,
            entry.dtype,
            rows,
            cols,
        ))
    }
}
