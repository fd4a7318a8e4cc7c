//! What a model is on disk: the names of a Hugging Face directory's files, and the files one
//! resolved model has (`resolve` finds them; `gguf` makes them for a GGUF file).

use std::path::PathBuf;

pub const CONFIG: &str = "config.json";
pub const SINGLE_WEIGHTS: &str = "model.safetensors";
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
pub const TOKENIZER: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
pub const GENERATION_CONFIG: &str = "generation_config.json";
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";
pub const SPECIAL_TOKENS_MAP: &str = "special_tokens_map.json";
/// sentence-transformers' module list of an embedding model, and its pooling module's settings
/// (at the path every published model uses; `embed::Pooling` reads both).
pub const ST_MODULES: &str = "modules.json";
pub const ST_POOLING: &str = "1_Pooling/config.json";

/// The optional side files, fetched when present (and `ST_POOLING` when `ST_MODULES` is).
pub(super) const OPTIONAL_FILES: &[&str] = &[TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE, SPECIAL_TOKENS_MAP, ST_MODULES];

/// Weight formats that are pickles: loading them can execute arbitrary code.
pub(super) const PICKLE_WEIGHTS: &[&str] =
    &["pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "consolidated.pth"];

/// Where every file of a model lives on disk.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// What the user named (directory or `org/name@revision`), for messages.
    pub source: String,
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
    pub index: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub special_tokens_map: Option<PathBuf>,
    /// sentence-transformers' `modules.json` and pooling settings, when the model has them.
    pub st_modules: Option<PathBuf>,
    pub st_pooling: Option<PathBuf>,
    pub format: WeightFormat,
}

/// What `weights` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// safetensors files (with `config` and the side files beside them).
    #[default]
    Safetensors,
    /// One llama.cpp GGUF file; `config` and the side files were derived from its metadata.
    Gguf,
}

impl ModelFiles {
    pub(super) fn set_optional(&mut self, name: &str, path: Option<PathBuf>) {
        match name {
            TOKENIZER => self.tokenizer = path,
            TOKENIZER_CONFIG => self.tokenizer_config = path,
            GENERATION_CONFIG => self.generation_config = path,
            CHAT_TEMPLATE => self.chat_template = path,
            SPECIAL_TOKENS_MAP => self.special_tokens_map = path,
            ST_MODULES => self.st_modules = path,
            ST_POOLING => self.st_pooling = path,
            _ => unreachable!("unknown optional file {name}"),
        }
    }
}
