//! What a sharded checkpoint must be resumed with besides its weights: the same tokenizer, the
//! same training data, and a data cursor that still points at the same place. A checkpoint
//! records them in trainer_state.json ("data") and its manifest (tokenizer hash); resuming checks
//! them and refuses a changed dataset or tokenizer by name, unless the user says the change is
//! deliberate (`--resume-allow-changed data,tokenizer`).

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::sharded::sha256_hex;

/// The training file as rank 0 read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataIdentity {
    /// As given on the command line (a path or an hf:// address).
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

impl DataIdentity {
    pub fn of(file: &str, bytes: &[u8]) -> Self {
        Self { file: file.to_string(), bytes: bytes.len() as u64, sha256: sha256_hex(bytes) }
    }
}

/// Where the data order stands after `step` optimizer steps: the order is a pure function of
/// (seed, epoch), so (epoch, batch within the epoch) is the whole cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataCursor {
    pub samples: usize,
    pub steps_per_epoch: usize,
    pub epoch: usize,
    pub batch_in_epoch: usize,
}

impl DataCursor {
    pub fn at(step: usize, samples: usize, steps_per_epoch: usize) -> Self {
        Self { samples, steps_per_epoch, epoch: step / steps_per_epoch, batch_in_epoch: step % steps_per_epoch }
    }
}

/// Which differences the user allows on resume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllowedChanges {
    pub data: bool,
    pub tokenizer: bool,
}

impl AllowedChanges {
    /// From `--resume-allow-changed`'s values.
    pub fn parse(names: &[String]) -> Result<Self> {
        let mut out = Self::default();
        for n in names {
            match n.as_str() {
                "data" => out.data = true,
                "tokenizer" => out.tokenizer = true,
                other => bail!("--resume-allow-changed {other:?}: use data and/or tokenizer"),
            }
        }
        Ok(out)
    }
}

/// The "data" object of trainer_state.json.
pub fn data_state(data: &DataIdentity, cursor: &DataCursor) -> Value {
    json!({
        "file": data.file, "bytes": data.bytes, "sha256": data.sha256,
        "samples": cursor.samples, "steps_per_epoch": cursor.steps_per_epoch,
        "cursor": {"epoch": cursor.epoch, "batch_in_epoch": cursor.batch_in_epoch},
    })
}

/// Checks a checkpoint's recorded tokenizer and data against this run. `saved_state` is its
/// trainer_state.json, `saved_tokenizer` its manifest's tokenizer hash; `cursor` is where this run
/// would continue. Returns the warnings to print for allowed changes.
pub fn check_resume(
    checkpoint: &str,
    saved_state: &Value,
    saved_tokenizer: Option<&str>,
    tokenizer: Option<&[u8]>,
    data: &DataIdentity,
    cursor: &DataCursor,
    allow: AllowedChanges,
) -> Result<Vec<String>> {
    let mut warnings = vec![];
    let ours_tok = tokenizer.map(sha256_hex);
    if saved_tokenizer != ours_tok.as_deref() {
        let what = format!(
            "{checkpoint} was saved with another tokenizer (tokenizer.json sha256 {} there, {} now)",
            saved_tokenizer.unwrap_or("none"),
            ours_tok.as_deref().unwrap_or("none")
        );
        if !allow.tokenizer {
            bail!("{what}: token ids would mean other text; add --resume-allow-changed tokenizer if this is deliberate");
        }
        warnings.push(format!("{what}: resuming anyway (--resume-allow-changed tokenizer)"));
    }
    let saved = &saved_state["data"];
    if saved.is_null() {
        warnings.push(format!("{checkpoint} records no training data identity (saved by an older fsdp-app): the data is not checked"));
        return Ok(warnings);
    }
    let saved_data = DataIdentity {
        file: saved["file"].as_str().unwrap_or("?").to_string(),
        bytes: saved["bytes"].as_u64().unwrap_or(0),
        sha256: saved["sha256"].as_str().unwrap_or("").to_string(),
    };
    if saved_data.bytes != data.bytes || saved_data.sha256 != data.sha256 {
        let what = format!(
            "{checkpoint} was trained on other data: {} ({} bytes, sha256 {}) then, {} ({} bytes, sha256 {}) now",
            saved_data.file, saved_data.bytes, saved_data.sha256, data.file, data.bytes, data.sha256
        );
        if !allow.data {
            bail!("{what}; add --resume-allow-changed data if this is deliberate");
        }
        warnings.push(format!(
            "{what}: resuming anyway (--resume-allow-changed data) at epoch {}, batch {} of the new data",
            cursor.epoch, cursor.batch_in_epoch
        ));
        return Ok(warnings);
    }
    let num = |v: &Value| v.as_u64().unwrap_or(u64::MAX) as usize;
    let saved_cursor = DataCursor {
        samples: num(&saved["samples"]),
        steps_per_epoch: num(&saved["steps_per_epoch"]),
        epoch: num(&saved["cursor"]["epoch"]),
        batch_in_epoch: num(&saved["cursor"]["batch_in_epoch"]),
    };
    if saved_cursor != *cursor {
        bail!(
            "{checkpoint}: the same data file now makes {} samples ({} steps an epoch) where it made {} ({} steps an epoch), so \
             the data cursor (epoch {}, batch {}) would move to epoch {}, batch {}: keep --seq-len, --packing, --train-on and the \
             eval split as they were",
            cursor.samples,
            cursor.steps_per_epoch,
            saved_cursor.samples,
            saved_cursor.steps_per_epoch,
            saved_cursor.epoch,
            saved_cursor.batch_in_epoch,
            cursor.epoch,
            cursor.batch_in_epoch
        );
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(data: &DataIdentity, cursor: &DataCursor) -> Value {
        json!({"data": data_state(data, cursor)})
    }

    #[test]
    fn changes_are_refused_by_name_unless_allowed() {
        let data = DataIdentity::of("train.jsonl", b"{\"text\": \"a\"}\n");
        let cursor = DataCursor::at(5, 8, 4);
        assert_eq!((cursor.epoch, cursor.batch_in_epoch), (1, 1));
        let tok = b"{\"tokenizer\": 1}".as_slice();
        let tok_sha = sha256_hex(tok);
        let saved = state(&data, &cursor);
        let check = |d: &DataIdentity, c: &DataCursor, t: &[u8], allow| check_resume("ckpt", &saved, Some(&tok_sha), Some(t), d, c, allow);
        assert!(check(&data, &cursor, tok, AllowedChanges::default()).unwrap().is_empty());

        let other = DataIdentity::of("train.jsonl", b"{\"text\": \"b\"}\n");
        let e = check(&other, &cursor, tok, AllowedChanges::default()).unwrap_err().to_string();
        assert!(e.contains("other data") && e.contains("--resume-allow-changed data"), "{e}");
        let w = check(&other, &cursor, tok, AllowedChanges { data: true, ..Default::default() }).unwrap();
        assert!(w[0].contains("resuming anyway"), "{w:?}");

        let e = check(&data, &cursor, b"{}", AllowedChanges::default()).unwrap_err().to_string();
        assert!(e.contains("another tokenizer") && e.contains("--resume-allow-changed tokenizer"), "{e}");
        assert_eq!(check(&data, &cursor, b"{}", AllowedChanges { tokenizer: true, ..Default::default() }).unwrap().len(), 1);

        // Same file, but it now cuts into other samples: the cursor would point elsewhere.
        let e = check(&data, &DataCursor::at(5, 16, 8), tok, AllowedChanges::default()).unwrap_err().to_string();
        assert!(e.contains("data cursor") && e.contains("--seq-len"), "{e}");

        assert_eq!(AllowedChanges::parse(&["data".into(), "tokenizer".into()]).unwrap(), AllowedChanges { data: true, tokenizer: true });
        assert!(AllowedChanges::parse(&["weights".into()]).is_err());
    }
}
