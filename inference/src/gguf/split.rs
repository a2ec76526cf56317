//! A model split over several GGUF files, as llama.cpp's `llama-gguf-split` writes one:
//! `NAME-00001-of-00003.gguf` to `NAME-00003-of-00003.gguf`, each a whole GGUF file whose
//! `split.no` and `split.count` say which part it is. The first part holds the model's
//! metadata, every part its own tensors. A split model is opened by naming its first file,
//! as llama.cpp opens one; a file without `split.count` is a model of one part.

use std::path::{Path, PathBuf};

use super::{Gguf, GgufError, Header, Value};

/// The most parts a model may be split into: each part stays mapped while the model is, and
/// a process has some 65,000 maps in all (llama.cpp counts parts in 16 bits).
const MAX_PARTS: u64 = 1024;

/// The parts of the model whose first (or only) file is `path`, in order.
pub fn open(path: &Path) -> Result<Vec<Gguf>, GgufError> {
    let first = Gguf::open(path)?;
    let count = part_count(path, first.header())?;
    if count == 1 {
        return Ok(vec![first]);
    }
    let parts = part_paths(path, count)?;
    let mut files = vec![first];
    for part in &parts[1..] {
        files.push(Gguf::open(part)?);
    }
    for (no, (file, part)) in files.iter().zip(&parts).enumerate() {
        let header = file.header();
        if split_key(header, "split.no") != Some(Some(no as u64))
            || split_key(header, "split.count") != Some(Some(count))
        {
            return Err(bad(
                part,
                format!(
                    "it is not part {} of {count} (split.no, split.count)",
                    no + 1
                ),
            ));
        }
    }
    Ok(files)
}

/// The paths of the files of the model whose first (or only) file is `path`, in order, as
/// `open` would open them.
pub fn paths(path: &Path) -> Result<Vec<PathBuf>, GgufError> {
    let first = Gguf::open(path)?;
    match part_count(path, first.header())? {
        1 => Ok(vec![path.to_path_buf()]),
        count => part_paths(path, count),
    }
}

/// How many parts the model whose first file (at `path`) has `header` is split into.
fn part_count(path: &Path, header: &Header) -> Result<u64, GgufError> {
    match (
        split_key(header, "split.count"),
        split_key(header, "split.no"),
    ) {
        // One part, however the file is named (llama.cpp does not look at the name either).
        (None | Some(Some(1)), None | Some(Some(0))) => Ok(1),
        (Some(Some(count)), _) if (2..=MAX_PARTS).contains(&count) => Ok(count),
        _ => Err(bad(
            path,
            format!("split.count is not a count from 1 to {MAX_PARTS}, or split.no is not 0 in a model of one part"),
        )),
    }
}

/// A split key's count: None if absent, Some(None) if it is not a count.
fn split_key(header: &Header, key: &str) -> Option<Option<u64>> {
    header.get(key).map(Value::as_u64)
}

/// Each part's path, from the first's name (`NAME-00001-of-0000N.gguf`).
fn part_paths(first: &Path, count: u64) -> Result<Vec<PathBuf>, GgufError> {
    let name = first
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let suffix = format!("-00001-of-{count:05}.gguf");
    let Some(prefix) = name.strip_suffix(&suffix) else {
        // Another part, named as llama-gguf-split names them: say which file to open.
        let first_name = name
            .strip_suffix(&format!("-of-{count:05}.gguf"))
            .and_then(|rest| rest.get(..rest.len().checked_sub(6)?))
            .filter(|prefix| name.as_bytes().get(prefix.len()) == Some(&b'-'))
            .map_or_else(|| "NAME".to_string(), str::to_string);
        return Err(bad(
            first,
            format!(
                "a model split in {count} parts is opened by its first file, {first_name}{suffix}"
            ),
        ));
    };
    Ok((1..=count)
        .map(|no| first.with_file_name(format!("{prefix}-{no:05}-of-{count:05}.gguf")))
        .collect())
}

fn bad(path: &Path, why: String) -> GgufError {
    GgufError::Split(path.display().to_string(), why)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture llama.cpp's `llama-gguf-split` made of `tiny-qwen3moe-q8_0.gguf`.
    const PARTS: u64 = 3;

    fn part(no: u64) -> PathBuf {
        super::super::tests::fixture()
            .with_file_name(format!("tiny-qwen3moe-q8_0-{no:05}-of-{PARTS:05}.gguf"))
    }

    /// Copies of the fixture's parts in a directory of their own.
    fn copies() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for no in 1..=PARTS {
            let part = part(no);
            std::fs::copy(&part, dir.path().join(part.file_name().unwrap())).unwrap();
        }
        dir
    }

    #[test]
    fn a_split_model_opens_by_its_first_file_with_every_tensor_of_the_whole() {
        let parts = open(&part(1)).unwrap();
        assert_eq!(parts.len(), PARTS as usize);
        let whole = Gguf::open(&super::super::tests::fixture()).unwrap();
        let mut split: Vec<(&str, &[u8])> = parts
            .iter()
            .flat_map(|p| {
                p.header()
                    .tensors
                    .iter()
                    .map(move |t| (t.name.as_str(), p.bytes(t)))
            })
            .collect();
        let mut all: Vec<(&str, &[u8])> = whole
            .header()
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), whole.bytes(t)))
            .collect();
        split.sort();
        all.sort();
        assert_eq!(split, all);
        // A file of one part is a model of one part.
        assert_eq!(open(&super::super::tests::fixture()).unwrap().len(), 1);
        // `paths` names the files `open` opens.
        assert_eq!(
            paths(&part(1)).unwrap(),
            (1..=PARTS).map(part).collect::<Vec<_>>()
        );
        let whole = super::super::tests::fixture();
        assert_eq!(paths(&whole).unwrap(), vec![whole]);
        assert!(paths(&part(2)).is_err());
    }

    #[test]
    fn a_part_that_is_not_the_first_missing_or_misnumbered_is_an_error_naming_it() {
        let error = open(&part(2)).err().unwrap().to_string();
        assert!(
            error.contains("opened by its first file, tiny-qwen3moe-q8_0-00001-of-00003.gguf"),
            "{error}"
        );
        let dir = copies();
        let name = |no: u64| dir.path().join(part(no).file_name().unwrap());
        // A part in the place of another.
        std::fs::copy(name(3), name(2)).unwrap();
        let error = open(&name(1)).err().unwrap().to_string();
        assert!(error.contains("is not part 2 of 3"), "{error}");
        std::fs::remove_file(name(2)).unwrap();
        let error = open(&name(1)).err().unwrap().to_string();
        assert!(error.contains("00002-of-00003.gguf"), "{error}");
        // The first part renamed: its parts cannot be found from its name.
        let renamed = dir.path().join("model.gguf");
        std::fs::rename(name(1), &renamed).unwrap();
        let error = open(&renamed).err().unwrap().to_string();
        assert!(error.contains("NAME-00001-of-00003.gguf"), "{error}");
    }

    /// A file that says it is the one part of its model opens whatever its name; one that
    /// says it is another part, or of a count past the bound, is refused.
    #[test]
    fn a_model_of_one_part_opens_by_any_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.gguf");
        for (count, no, opens) in [(1, 0, true), (1, 1, false), (0, 0, false), (5000, 0, false)] {
            let bytes = super::super::tests::Writer::default()
                .u32("split.count", count)
                .u32("split.no", no)
                .finish();
            std::fs::write(&path, bytes).unwrap();
            assert_eq!(
                open(&path).is_ok(),
                opens,
                "split.count {count}, split.no {no}"
            );
        }
    }
}
