//! A Hugging Face checkpoint directory: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, memory-mapped. Every lookup checks the shape the config
//! implies and names the tensor in its error.
//!
//! The engine sees one naming whatever the checkpoint's class and expert storage: a
//! multimodal wrapper's `model.language_model.*` reads as `model.*`, its vision tower
//! (`model.visual.*`) and multi-token-prediction head (`mtp.*`) are left out, and experts
//! stored fused (`mlp.experts.gate_up_proj` of `experts x 2·width x hidden`,
//! `mlp.experts.down_proj` of `experts x hidden x width`, as transformers holds them) read
//! as one `mlp.experts.E.{gate,up,down}_proj.weight` per expert: each is a contiguous run
//! of the fused tensor's bytes, so nothing is copied.
//!
//! A GGUF file (`gguf`) opens as a checkpoint too: its tensors under the same names, its
//! stacked experts one entry each.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::gguf;
use crate::weights::{DType, Weight};
use crate::LoadError;

struct Entry {
    /// The tensor's name in the file, which errors give.
    stored: String,
    file: usize,
    start: usize,
    end: usize,
    dtype: DType,
    shape: Vec<usize>,
}

/// How a checkpoint stores the values the model computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Convention {
    /// As transformers holds them.
    HuggingFace,
    /// As llama.cpp's converter rewrites Qwen3.5 for its own graph: the RMSNorms' weights
    /// hold `1 + weight` (the DeltaNet's gated norm aside), the DeltaNet's decay rate is
    /// stored as `A = -exp(A_log)` (`linear_attn.A`), and its value heads are tiled over the
    /// key heads (value head `h` reads key head `h % key_heads`) where transformers groups
    /// them (`h / (value_heads / key_heads)`). Each is a relabelling or the same arithmetic
    /// done ahead, so the model computes the same function.
    LlamaCpp,
}

pub struct Checkpoint {
    maps: Vec<Arc<Mmap>>,
    convention: Convention,
    entries: HashMap<String, Entry>,
    /// Whether the text model is stored under `model.language_model.`.
    multimodal: bool,
    /// Bytes of the tensors left out.
    skipped_bytes: u64,
}

#[derive(Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

/// The name the engine knows a stored tensor by, or `None` for the parts a text engine
/// leaves out.
fn engine_name(stored: &str) -> Option<String> {
    if stored.starts_with("model.visual.") || stored.starts_with("mtp.") {
        return None;
    }
    Some(match stored.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}"),
        None => stored.to_string(),
    })
}

/// The most experts one fused tensor may hold (Qwen3.5 has 256 a layer).
const MAX_FUSED_EXPERTS: usize = 1 << 16;

/// A fused expert tensor as one entry per expert (and part), or the entry as it is.
fn split_fused(name: &str, entry: Entry) -> Result<Vec<(String, Entry)>, String> {
    let parts: &[&str] = if name.ends_with(".mlp.experts.gate_up_proj") {
        &["gate_proj", "up_proj"]
    } else if name.ends_with(".mlp.experts.down_proj") {
        &["down_proj"]
    } else {
        return Ok(vec![(name.to_string(), entry)]);
    };
    let [experts, rows, cols] = entry.shape[..] else {
        return Err(format!(
            "fused expert tensor {name} has shape {:?}, not experts x rows x columns",
            entry.shape
        ));
    };
    // One entry per expert is made below: bound them, and refuse empty matrices, which a
    // file of a few bytes could otherwise declare by the billion.
    if experts == 0 || experts > MAX_FUSED_EXPERTS || rows == 0 || cols == 0 {
        return Err(format!(
            "fused expert tensor {name} has shape {:?}: experts must be 1 to {MAX_FUSED_EXPERTS}, matrices not empty",
            entry.shape
        ));
    }
    if !rows.is_multiple_of(parts.len()) {
        return Err(format!(
            "fused expert tensor {name} has an odd number of rows"
        ));
    }
    let rows = rows / parts.len();
    let part_bytes = rows.checked_mul(cols).and_then(|v| entry.dtype.bytes(v));
    let total = part_bytes
        .and_then(|v| v.checked_mul(parts.len()))
        .and_then(|v| v.checked_mul(experts));
    let (Some(part_bytes), Some(total)) = (part_bytes, total) else {
        return Err(format!("fused expert tensor {name} is too large"));
    };
    if total != entry.end - entry.start {
        return Err(format!(
            "fused expert tensor {name}: its shape and size disagree"
        ));
    }
    let prefix = &name[..name.rfind('.').unwrap_or(0)];
    let mut split = Vec::new();
    for expert in 0..experts {
        for (i, part) in parts.iter().enumerate() {
            let start = entry.start + (expert * parts.len() + i) * part_bytes;
            split.push((
                format!("{prefix}.{expert}.{part}.weight"),
                Entry {
                    stored: format!("{} (expert {expert}'s {part})", entry.stored),
                    file: entry.file,
                    start,
                    end: start + part_bytes,
                    dtype: entry.dtype,
                    shape: vec![rows, cols],
                },
            ));
        }
    }
    Ok(split)
}

impl Checkpoint {
    /// The checkpoint in directory `dir`, or the GGUF file `dir` names.
    pub fn open(dir: &Path) -> Result<Checkpoint, LoadError> {
        if gguf::is_gguf(dir) {
            return Checkpoint::open_gguf(dir);
        }
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
            convention: Convention::HuggingFace,
            entries: HashMap::new(),
            multimodal: false,
            skipped_bytes: 0,
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
        for (stored, info) in metadata.tensors() {
            let Some(name) = engine_name(&stored) else {
                self.skipped_bytes += (info.data_offsets.1 - info.data_offsets.0) as u64;
                continue;
            };
            self.multimodal |= stored.starts_with("model.language_model.");
            let dtype = match info.dtype {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F16 => DType::F16,
                other => {
                    return Err(LoadError::DType {
                        name: stored,
                        dtype: format!("{other:?}"),
                    })
                }
            };
            let (start, end) = (
                data_start + info.data_offsets.0,
                data_start + info.data_offsets.1,
            );
            if end > map.len() || start > end {
                return Err(format(format!("tensor {stored} lies outside the file")));
            }
            let entry = Entry {
                stored: stored.clone(),
                file: index,
                start,
                end,
                dtype,
                shape: info.shape.clone(),
            };
            for (name, entry) in split_fused(&name, entry).map_err(&format)? {
                if self.entries.contains_key(&name) {
                    return Err(format(format!(
                        "tensor {name} appears twice (stored as {stored} here)"
                    )));
                }
                self.entries.insert(name, entry);
            }
        }
        self.maps.push(Arc::new(map));
        Ok(())
    }

    /// A GGUF file's tensors under the engine's names (`gguf::names`): each stacked expert
    /// tensor as one entry per expert (a contiguous run of its bytes, as for fused experts),
    /// tensors the engine does not use left out.
    fn open_gguf(path: &Path) -> Result<Checkpoint, LoadError> {
        let format = |reason: String| LoadError::Format {
            file: path.display().to_string(),
            reason,
        };
        let parts = gguf::split::open(path).map_err(|e| format(e.to_string()))?;
        // A Qwen3.5 file's multi-token-prediction layers come after the model's own.
        let layers = gguf::config::text_layers(parts[0].header()).unwrap_or(u64::MAX);
        let mut checkpoint = Checkpoint {
            maps: Vec::new(),
            convention: Convention::LlamaCpp,
            entries: HashMap::new(),
            multimodal: false,
            skipped_bytes: 0,
        };
        for (file, part) in parts.into_iter().enumerate() {
            let (map, header) = part.into_parts();
            checkpoint.maps.push(map);
            checkpoint
                .add_gguf_tensors(file, &header, layers)
                .map_err(format)?;
        }
        Ok(checkpoint)
    }

    /// The tensors of one GGUF file (part `file` of the model) under the engine's names.
    fn add_gguf_tensors(
        &mut self,
        file: usize,
        header: &gguf::Header,
        layers: u64,
    ) -> Result<(), String> {
        for tensor in &header.tensors {
            let stacked = gguf::names::stacked_experts(&tensor.name);
            let name = gguf::names::engine_name(&tensor.name);
            let prediction = gguf::names::layer(&tensor.name).is_some_and(|l| l as u64 >= layers);
            if prediction || stacked.is_none() && name.is_none() {
                self.skipped_bytes += tensor.byte_len();
                continue;
            }
            let dtype = tensor.kind.dtype();
            // The Hugging Face shape is the GGUF dimensions reversed.
            let mut shape: Vec<usize> = tensor.dims.iter().rev().map(|d| *d as usize).collect();
            let entry = |start: usize, end: usize, shape: Vec<usize>| Entry {
                stored: tensor.name.clone(),
                file,
                start,
                end,
                dtype,
                shape,
            };
            let entries = match (stacked, name) {
                (Some((layer, part)), _) => {
                    let [experts, rows, cols] = shape[..] else {
                        return Err(format!(
                            "stacked expert tensor {} has dimensions {:?}",
                            tensor.name, tensor.dims
                        ));
                    };
                    if experts == 0 || experts > MAX_FUSED_EXPERTS {
                        return Err(format!("{} stacks {experts} experts", tensor.name));
                    }
                    // Whole rows of whole blocks (checked as the header was read), so the
                    // bytes split evenly.
                    let each = (tensor.end - tensor.start) / experts;
                    (0..experts)
                        .map(|expert| {
                            let start = tensor.start + expert * each;
                            (
                                format!("model.layers.{layer}.mlp.experts.{expert}.{part}.weight"),
                                entry(start, start + each, vec![rows, cols]),
                            )
                        })
                        .collect()
                }
                (None, Some(name)) => {
                    // A shared expert's gate is one row, which GGUF stores as a vector, and a
                    // depthwise convolution's one input channel is left out.
                    if name.ends_with("shared_expert_gate.weight") && shape.len() == 1 {
                        shape.insert(0, 1);
                    }
                    if name.ends_with("conv1d.weight") && shape.len() == 2 {
                        shape.insert(1, 1);
                    }
                    vec![(name, entry(tensor.start, tensor.end, shape))]
                }
                (None, None) => Vec::new(),
            };
            for (name, entry) in entries {
                if self.entries.insert(name.clone(), entry).is_some() {
                    return Err(format!("tensor {name} appears twice"));
                }
            }
        }
        Ok(())
    }

    /// How the checkpoint stores the model's values.
    pub fn convention(&self) -> Convention {
        self.convention
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

    /// Bytes of the tensors the engine leaves out: a vision tower, a multi-token-prediction
    /// head.
    pub fn skipped_bytes(&self) -> u64 {
        self.skipped_bytes
    }

    /// The stored bytes of tensor `name`, as the file holds them: what a weight hash covers.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], LoadError> {
        Ok(self.stored(name)?.1)
    }

    /// Tensor `name`'s dtype and stored bytes.
    pub fn stored(&self, name: &str) -> Result<(DType, &[u8]), LoadError> {
        let entry = self.entry(name)?;
        Ok((entry.dtype, &self.maps[entry.file][entry.start..entry.end]))
    }

    /// Tensor `name`'s shape (the Hugging Face one).
    pub fn shape(&self, name: &str) -> Result<&[usize], LoadError> {
        Ok(&self.entry(name)?.shape)
    }

    /// The entry of `name`, or an error naming it as this checkpoint would store it.
    fn entry(&self, name: &str) -> Result<&Entry, LoadError> {
        self.entries.get(name).ok_or_else(|| {
            LoadError::Missing(match name.strip_prefix("model.") {
                Some(rest) if self.multimodal => format!("model.language_model.{rest}"),
                _ => name.to_string(),
            })
        })
    }

    /// The tensor `name`, which must have exactly `shape`; viewed as `rows x cols` with the
    /// last dimension as columns.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Weight, LoadError> {
        let entry = self.entry(name)?;
        if entry.shape != shape {
            return Err(LoadError::Shape {
                name: entry.stored.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    /// Writes `tensors` (name, shape, f32 values) as `model.safetensors` in a new directory.
    fn write(tensors: &[(&str, Vec<usize>, Vec<f32>)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, shape, _), b)| {
                let view = TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap();
                (name.to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &dir.path().join("model.safetensors"))
            .unwrap();
        dir
    }

    /// A GGUF file: stacked experts split per expert under the engine's names, a shared
    /// expert's gate vector read as one row, tensors the engine does not use left out, and a
    /// type it does not run (Q5_1) refused naming the tensor.
    #[test]
    fn a_gguf_file_reads_under_the_engines_names() {
        use crate::gguf::tests::Writer;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.gguf");
        let q8 = |blocks: usize| vec![0u8; blocks * 34];
        let file = Writer::default()
            .tensor("blk.0.ffn_up_exps.weight", &[32, 2, 3], 8, &q8(6))
            .tensor("blk.0.ffn_gate_inp_shexp.weight", &[32], 0, &[0; 128])
            .tensor("rope_freqs.weight", &[32], 0, &[0; 128])
            .finish();
        std::fs::write(&path, file).unwrap();
        let checkpoint = Checkpoint::open(&path).unwrap();
        for expert in 0..3 {
            let name = format!("model.layers.0.mlp.experts.{expert}.up_proj.weight");
            let weight = checkpoint.tensor(&name, &[2, 32]).unwrap();
            assert_eq!(
                (weight.dtype(), weight.byte_len()),
                (
                    DType::Quantized(crate::kernels::quant::BlockFormat::Q8_0),
                    2 * 34
                )
            );
        }
        assert!(checkpoint
            .tensor("model.layers.0.mlp.shared_expert_gate.weight", &[1, 32])
            .is_ok());
        assert_eq!(checkpoint.skipped_bytes(), 128);
        let q5_1 = Writer::default()
            .tensor("blk.0.ffn_down_exps.weight", &[32, 1, 1], 7, &[0; 24])
            .finish();
        std::fs::write(&path, q5_1).unwrap();
        let error = Checkpoint::open(&path).err().unwrap().to_string();
        assert!(
            error.contains("blk.0.ffn_down_exps.weight") && error.contains("Q5_1"),
            "{error}"
        );
    }

    #[test]
    fn fused_experts_read_as_the_per_expert_tensors_they_hold() {
        let (experts, width, hidden) = (3, 2, 4);
        let value = |e: usize, part: usize, i: usize| (e * 100 + part * 10 + i) as f32;
        let part = |e: usize, p: usize, len: usize| (0..len).map(|i| value(e, p, i)).collect();
        let gate_up: Vec<f32> = (0..experts)
            .flat_map(|e| [part(e, 0, width * hidden), part(e, 1, width * hidden)].concat())
            .collect();
        let down: Vec<f32> = (0..experts)
            .flat_map(|e| part(e, 2, hidden * width))
            .collect::<Vec<f32>>();
        let p = "model.language_model.layers.0.mlp.experts";
        let fused = write(&[
            (
                &format!("{p}.gate_up_proj"),
                vec![experts, 2 * width, hidden],
                gate_up,
            ),
            (
                &format!("{p}.down_proj"),
                vec![experts, hidden, width],
                down,
            ),
            ("model.visual.patch_embed.proj.weight", vec![1], vec![0.0]),
            ("mtp.fc.weight", vec![1], vec![0.0]),
        ]);
        let checkpoint = Checkpoint::open(fused.path()).unwrap();
        for e in 0..experts {
            for (i, (name, shape)) in [
                ("gate_proj", [width, hidden]),
                ("up_proj", [width, hidden]),
                ("down_proj", [hidden, width]),
            ]
            .into_iter()
            .enumerate()
            {
                let w = checkpoint
                    .tensor(
                        &format!("model.layers.0.mlp.experts.{e}.{name}.weight"),
                        &shape,
                    )
                    .unwrap();
                let expected: Vec<f32> = part(e, i, shape[0] * shape[1]);
                assert_eq!(w.to_f32(), expected, "expert {e} {name}");
            }
        }
        // The vision tower and the mtp head are not the text model's.
        assert_eq!(checkpoint.tensor_sizes().count(), experts * 3);
    }

    #[test]
    fn malformed_fused_experts_and_doubled_names_are_format_errors() {
        let p = "model.layers.0.mlp.experts";
        for tensors in [
            // Not experts x rows x columns.
            vec![(format!("{p}.gate_up_proj"), vec![4, 4], vec![0.0; 16])],
            // Empty matrices by the billion, in a few bytes.
            vec![(format!("{p}.gate_up_proj"), vec![1 << 40, 0, 4], vec![])],
            // An odd number of gate-and-up rows.
            vec![(format!("{p}.gate_up_proj"), vec![1, 3, 2], vec![0.0; 6])],
            // The same tensor under the wrapper's name and the text model's.
            vec![
                ("model.norm.weight".to_string(), vec![2], vec![1.0; 2]),
                (
                    "model.language_model.norm.weight".to_string(),
                    vec![2],
                    vec![1.0; 2],
                ),
            ],
        ] {
            let named: Vec<(&str, Vec<usize>, Vec<f32>)> = tensors
                .iter()
                .map(|(n, s, v)| (n.as_str(), s.clone(), v.clone()))
                .collect();
            let dir = write(&named);
            assert!(
                matches!(Checkpoint::open(dir.path()), Err(LoadError::Format { .. })),
                "{:?} was accepted",
                tensors.iter().map(|t| &t.0).collect::<Vec<_>>()
            );
        }
    }
}
