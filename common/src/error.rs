//! Errors of `skein-common`.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong in configuration, positions and keys.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The YAML could not be read or does not fit the model. The text already
    /// names the field path and the line (from the YAML parser).
    #[error("{file}: {message}")]
    ConfigSyntax { file: String, message: String },
    /// The YAML is well formed but makes no sense; `field` is the path and
    /// `line` the 1-based line in the file when it could be located.
    #[error("{file}{}: {field}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    ConfigInvalid {
        file: String,
        field: String,
        line: Option<usize>,
        message: String,
    },
    /// A position could not be parsed.
    #[error("{0}")]
    Position(String),
    /// Reading the configuration file failed.
    #[error("cannot read config file {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Configuration and parse errors never go away by retrying.
    pub fn is_retryable(&self) -> bool {
        false
    }
}
