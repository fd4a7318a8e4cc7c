//! OpenAI's Files API for fine-tuning data: `POST /v1/files` (multipart, purpose `fine-tune`,
//! JSONL checked row by row on upload), `GET /v1/files[/{id}[/content]]`, `DELETE /v1/files/{id}`.
//!
//! An upload streams to a temporary file as it arrives (the server holds one chunk of it, never
//! the file), is refused with 413 once it passes `--max-upload-bytes`, is checked line by line
//! from disk, and only then renamed into place and recorded; a refused or broken upload leaves
//! nothing behind.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::multipart::{Field, MultipartError};
use axum::extract::{Multipart, Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use super::error::ApiError;
use super::state::AppState;
use crate::tokenize::ChatTemplate;
use crate::train::formats::Example;

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("{e:#}"))
}

/// What a fine-tuning file trains: supervised rows or DPO's preference pairs, one kind per
/// file (a job's `method.type` must match its files' kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    Supervised,
    Preference,
    /// Prompts for reinforcement fine-tuning (TRL's GRPO rows, OpenAI's RFT rows).
    Prompt,
}

impl RowKind {
    pub fn of(row: &Value) -> Self {
        if crate::train::preference::is_preference_row(row) {
            Self::Preference
        } else if crate::train::grpo::prompts::is_prompt_row(row) {
            Self::Prompt
        } else {
            Self::Supervised
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Supervised => "supervised",
            Self::Preference => "preference (DPO)",
            Self::Prompt => "prompt (reinforcement)",
        }
    }
}

/// Checks that `grader` finds every field it reads (`{{item.FIELD}}`) in every row of the
/// prompt file at `path`; a 400 naming the line otherwise.
pub fn check_grader_reads(path: &Path, grader: &crate::train::grpo::graders::Grader) -> Result<(), ApiError> {
    let reader = std::io::BufReader::new(std::fs::File::open(path).map_err(internal)?);
    for (i, line) in reader.lines().enumerate() {
        let line = line.map_err(internal)?;
        let text = crate::train::data::without_bom(&line);
        if text.trim().is_empty() {
            continue;
        }
        let row: Value = serde_json::from_str(text).map_err(internal)?;
        if let Err(e) = grader.check_item(&crate::train::grpo::prompts::item_of(&row)) {
            let message = format!("Line {} of the training file: {e:#}.", i + 1);
            return Err(ApiError::invalid("method.reinforcement.grader", message).with_code("invalid_file"));
        }
    }
    Ok(())
}

/// The kind of rows a stored (validated, so one-kind) file holds: its first row's.
pub fn file_row_kind(path: &Path) -> anyhow::Result<RowKind> {
    use anyhow::Context;
    let reader = std::io::BufReader::new(std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?);
    for line in reader.lines() {
        let line = line?;
        let text = crate::train::data::without_bom(&line);
        if !text.trim().is_empty() {
            return Ok(RowKind::of(&serde_json::from_str(text)?));
        }
    }
    anyhow::bail!("{}: no rows", path.display())
}

/// Checks a token-id list of a row against the model's vocabulary.
fn ids_in_vocab(row: &Value, field: &str, vocab: usize, at: usize) -> Result<(), ApiError> {
    let ids = row.get(field).and_then(Value::as_array).into_iter().flatten();
    if let Some(bad) = ids.filter_map(Value::as_i64).find(|&id| id < 0 || id as usize >= vocab) {
        let message = format!("Line {at}: token id {bad} in `{field}` is outside the model's vocabulary (0 to {}).", vocab - 1);
        return Err(ApiError::invalid("file", message).with_code("token_out_of_vocabulary"));
    }
    Ok(())
}

/// One row of a file whose first row was of `kind`: read as that kind, and training something.
fn validate_row(v: &Value, kind: RowKind, vocab: usize, template: Option<&ChatTemplate>, at: usize) -> Result<(), ApiError> {
    if kind == RowKind::Supervised && RowKind::of(v) == RowKind::Prompt {
        // A chat without an answer in an SFT file: what its user needs to hear is that the row
        // trains nothing.
        let why = crate::train::formats::parse_row(v, true).ok().and_then(|e| crate::train::formats::trains_nothing(&e));
        let message = format!(
            "Line {at}: this row trains no token: {} (a prompt for reinforcement fine-tuning; a file holds one kind of row).",
            why.unwrap_or("it has no completion")
        );
        return Err(ApiError::invalid("file", message).with_code("no_trainable_tokens"));
    }
    if RowKind::of(v) != kind {
        let message = format!("Line {at}: a {} row in a file of {} rows; a file holds one kind.", RowKind::of(v).name(), kind.name());
        return Err(ApiError::invalid("file", message));
    }
    let invalid = |e: anyhow::Error| ApiError::invalid("file", format!("Line {at}: {e:#}."));
    if kind == RowKind::Prompt {
        return crate::train::grpo::prompts::check_prompt_row(v).map_err(invalid);
    }
    // Thinking the served model's template would drop, refused now rather than when the job runs.
    let thinking_is_written = |messages: &[crate::tokenize::ChatMessage]| match template {
        Some(t) => crate::tokenize::tool_prompt::thinking_is_written(t, messages).map_err(invalid),
        None => Ok(()),
    };
    if kind == RowKind::Preference {
        let row = crate::train::preference::parse_preference_row(v).map_err(invalid)?;
        crate::train::preference::check_pair(&row).map_err(|e| invalid(e).with_code("no_trainable_tokens"))?;
        if let crate::train::preference::PreferenceRow::Chat { prompt, chosen, rejected, .. } = &row {
            thinking_is_written(&[prompt.as_slice(), chosen, rejected].concat())?;
        }
        for field in ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"] {
            ids_in_vocab(v, field, vocab, at)?;
        }
        return Ok(());
    }
    let example = crate::train::formats::parse_row(v, true).map_err(invalid)?;
    match &example {
        Example::Tokens { .. } => ids_in_vocab(v, "input_ids", vocab, at)?,
        Example::Chat(chat) => thinking_is_written(&chat.messages)?,
        _ => {}
    }
    if let Some(why) = crate::train::formats::trains_nothing(&example) {
        return Err(ApiError::invalid("file", format!("Line {at}: this row trains no token: {why}.")).with_code("no_trainable_tokens"));
    }
    Ok(())
}

/// The largest row of an uploaded file: a `{"text"}` row's limit (`train::text_budget`) plus
/// room for JSON's escapes; any sample of a model's context needs far less of a row.
pub const MAX_ROW_BYTES: usize = 2 * crate::train::text_budget::TEXT_ROW_LIMIT;

/// Checks a fine-tuning file, read line by line: UTF-8 JSONL, every row a shape training reads
/// (chat `messages`, `prompt`/`completion`, `text`, token ids inside the model's `vocab`, ...)
/// that trains at least one token, or every row a DPO preference pair; a turn's thinking only
/// where the model's chat `template` writes it. The error names the line. Returns the number of
/// rows and their kind.
pub fn validate_jsonl(reader: impl BufRead, vocab: usize, template: Option<&ChatTemplate>) -> Result<(usize, RowKind), ApiError> {
    let (mut rows, mut kind) = (0, None);
    for (i, line) in reader.split(b'\n').enumerate() {
        let at = i + 1;
        let line = line.map_err(internal)?;
        let text = std::str::from_utf8(&line).map_err(|e| ApiError::invalid("file", format!("Line {at}: not UTF-8 text: {e}.")))?;
        let text = if i == 0 { crate::train::data::without_bom(text) } else { text };
        if text.trim().is_empty() {
            continue;
        }
        if text.len() > MAX_ROW_BYTES {
            let message = format!("Line {at}: a row of {} bytes; rows hold at most {MAX_ROW_BYTES} bytes of JSON.", text.len());
            return Err(ApiError::invalid("file", message).with_code("row_too_large"));
        }
        let v: Value = serde_json::from_str(text).map_err(|e| ApiError::invalid("file", format!("Line {at}: not valid JSON: {e}.")))?;
        let k = *kind.get_or_insert(RowKind::of(&v));
        validate_row(&v, k, vocab, template, at)?;
        rows += 1;
    }
    match kind {
        Some(kind) => Ok((rows, kind)),
        None => Err(ApiError::invalid("file", "The file has no rows.")),
    }
}

/// An upload's temporary file, removed unless taken by the store.
struct Staged(Option<PathBuf>);

impl Staged {
    fn path(&self) -> &Path {
        self.0.as_deref().expect("a staged upload's path")
    }

    /// The path, now the store's to keep.
    fn keep(mut self) -> PathBuf {
        self.0.take().expect("a staged upload's path")
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A multipart body that could not be read: 408 when it stalled, else 400.
fn malformed(e: MultipartError) -> ApiError {
    super::listen::stalled(&e).unwrap_or_else(|| ApiError::bad_request(format!("Malformed multipart body: {e}")))
}

/// Streams a multipart field to `staged`; 413 once it passes `limit` bytes. Returns its size.
async fn receive(field: &mut Field<'_>, staged: &Staged, limit: u64) -> Result<u64, ApiError> {
    let mut out = tokio::fs::File::create(staged.path()).await.map_err(internal)?;
    let mut bytes = 0u64;
    while let Some(chunk) = field.chunk().await.map_err(malformed)? {
        bytes += chunk.len() as u64;
        if bytes > limit {
            let message = format!("The file is larger than this server's upload limit of {limit} bytes (serve --max-upload-bytes).");
            return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message).with_code("file_too_large"));
        }
        out.write_all(&chunk).await.map_err(internal)?;
    }
    out.flush().await.map_err(internal)?;
    Ok(bytes)
}

pub async fn upload(
    State(st): State<Arc<AppState>>,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<axum::response::Response, ApiError> {
    let mut multipart = multipart.map_err(|e| ApiError::bad_request(format!("Expected a multipart/form-data body: {}", e.body_text())))?;
    let (mut purpose, mut file): (Option<String>, Option<(String, Staged, u64)>) = (None, None);
    let mut ignored = vec![];
    while let Some(mut field) = multipart.next_field().await.map_err(malformed)? {
        match field.name() {
            Some("purpose") => purpose = Some(field.text().await.map_err(|e| ApiError::invalid("purpose", e.to_string()))?),
            Some("file") => {
                let name = field.file_name().unwrap_or("upload.jsonl").to_string();
                let staged = Staged(Some(st.store.upload_path()));
                let bytes = receive(&mut field, &staged, st.max_upload_bytes).await?;
                file = Some((name, staged, bytes));
            }
            // OpenAI's upload takes `file` and `purpose` only.
            other => {
                let name = other.unwrap_or("(unnamed)").to_string();
                if !st.lenient {
                    return Err(ApiError::invalid(&name, format!("Unrecognized request argument supplied: {name}"))
                        .with_code("unsupported_parameter"));
                }
                ignored.push(name);
            }
        }
    }
    match purpose.as_deref() {
        Some("fine-tune") => {}
        Some(p) => return Err(ApiError::invalid("purpose", format!("purpose {p:?} is not supported; use \"fine-tune\"."))),
        None => return Err(ApiError::invalid("purpose", "`purpose` is required (\"fine-tune\").")),
    }
    let (name, staged, bytes) = file.ok_or_else(|| ApiError::invalid("file", "`file` is required."))?;
    let base = st.base();
    tokio::task::block_in_place(|| {
        let reader = std::io::BufReader::new(std::fs::File::open(staged.path()).map_err(internal)?);
        validate_jsonl(reader, base.vocab, base.tokenizer.chat_template.as_ref())
    })?;
    // The client's file name is only a label: the stored path is the server's choice.
    let label: String = name.chars().filter(|c| !c.is_control()).take(255).collect();
    let path = staged.keep();
    let stored = st.store.add_file(&label, "fine-tune", &path, bytes).map_err(|e| {
        let _ = std::fs::remove_file(&path);
        internal(e)
    })?;
    Ok(super::response::with_ignored(Json(stored).into_response(), &ignored))
}

pub async fn list(State(st): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"object": "list", "data": st.store.files().map_err(internal)?, "has_more": false})))
}

pub async fn get_one(State(st): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    st.store.file(&id).map_err(internal)?.map(Json).ok_or_else(|| ApiError::not_found(format!("No such file: {id}")))
}

pub async fn content(State(st): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Result<impl IntoResponse, ApiError> {
    if st.store.file(&id).map_err(internal)?.is_none() {
        return Err(ApiError::not_found(format!("No such file: {id}")));
    }
    let bytes = std::fs::read(st.store.file_path(&id)).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(([(axum::http::header::CONTENT_TYPE, "application/jsonl")], bytes))
}

pub async fn delete(State(st): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    if !st.store.delete_file(&id).map_err(internal)? {
        return Err(ApiError::not_found(format!("No such file: {id}")));
    }
    Ok(Json(json!({"id": id, "object": "file", "deleted": true})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_checked_by_line_token_ids_within_the_vocabulary() {
        let ok = "\u{feff}{\"text\": \"hi\"}\n\n{\"input_ids\": [1, 2, 9]}\n";
        assert_eq!(validate_jsonl(ok.as_bytes(), 10, None).unwrap(), (2, RowKind::Supervised));
        let e = validate_jsonl("{\"text\": \"a\"}\n{\"input_ids\": [1, 10]}\n".as_bytes(), 10, None).unwrap_err();
        assert!(e.message.starts_with("Line 2: token id 10") && e.message.contains("0 to 9"), "{}", e.message);
        let e = validate_jsonl("{\"text\": \"a\"}\n{\"input_ids\": [-3]}\n".as_bytes(), 10, None).unwrap_err();
        assert!(e.message.starts_with("Line 2:") && e.message.contains("-3"), "{}", e.message);
        assert!(validate_jsonl(&b"{\"text\": \"a\"}\n\xff\n"[..], 10, None).unwrap_err().message.starts_with("Line 2: not UTF-8"));
        assert!(validate_jsonl("\n".as_bytes(), 10, None).unwrap_err().message.contains("no rows"));
    }

    #[test]
    fn preference_files_hold_pairs_only() {
        let pair = r#"{"prompt": "a", "chosen": "b", "rejected": "c"}"#;
        let openai = r#"{"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": [{"role": "assistant", "content": "a"}], "non_preferred_output": [{"role": "assistant", "content": "b"}]}"#;
        let ids = r#"{"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}"#;
        let ok = format!("{pair}\n{openai}\n{ids}\n");
        assert_eq!(validate_jsonl(ok.as_bytes(), 10, None).unwrap(), (3, RowKind::Preference));
        let mixed = format!("{pair}\n{{\"text\": \"x\"}}\n");
        let e = validate_jsonl(mixed.as_bytes(), 10, None).unwrap_err();
        assert!(e.message.starts_with("Line 2: a supervised row in a file of preference (DPO) rows"), "{}", e.message);
        let e = validate_jsonl(r#"{"prompt_input_ids": [1], "chosen_input_ids": [12], "rejected_input_ids": [3]}"#.as_bytes(), 10, None)
            .unwrap_err();
        assert!(e.message.contains("token id 12 in `chosen_input_ids`"), "{}", e.message);
        let e = validate_jsonl(r#"{"prompt": "a", "chosen": "b"}"#.as_bytes(), 10, None).unwrap_err();
        assert!(e.message.starts_with("Line 1:") && e.message.contains("needs one of"), "{}", e.message);
    }

    /// A turn's thinking is taken where the served template writes it, refused by line where it
    /// would be dropped (the job would fail on it), in chat rows and in preference pairs.
    #[test]
    fn thinking_rows_need_a_template_that_writes_thinking() {
        let thinking =
            ChatTemplate::new("{% for m in messages %}{{ m.reasoning_content }}{{ m.content }}{% endfor %}", None, None).unwrap();
        let plain = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}", None, None).unwrap();
        let chat = r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "t"}]}"#;
        let pair = r#"{"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": [{"role": "assistant", "content": "a", "reasoning": "t"}], "non_preferred_output": [{"role": "assistant", "content": "b"}]}"#;
        for row in [chat, pair] {
            let file = format!("{row}\n{row}\n");
            assert_eq!(validate_jsonl(file.as_bytes(), 10, Some(&thinking)).unwrap().0, 2);
            let e = validate_jsonl(file.as_bytes(), 10, Some(&plain)).unwrap_err();
            assert!(e.message.starts_with("Line 1:") && e.message.contains("chat template writes no thinking"), "{}", e.message);
        }
    }
}
