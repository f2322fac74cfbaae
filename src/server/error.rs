//! Request errors, and the error bodies of the OpenAI and Anthropic APIs.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Why a request is refused (HTTP 400). Every variant names the field at fault as a JSON path
/// (`messages[2].content`, `temperature`), which OpenAI's error object carries as `param`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON, or a field has the wrong type; `field` is `None` when the body as
    /// a whole is at fault.
    #[error("{}{message}", field_prefix(field.as_deref()))]
    Malformed {
        /// The path of the field that failed to parse.
        field: Option<String>,
        /// The parser's message.
        message: String,
    },
    /// A required field is absent.
    #[error("`{field}` is required")]
    Missing {
        /// The path of the missing field.
        field: String,
    },
    /// A field's value is out of range, or contradicts another field.
    #[error("`{field}`: {message}")]
    Invalid {
        /// The path of the field.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A field asks for something this server does not do.
    #[error("`{field}`: {message}")]
    Unsupported {
        /// The path of the field.
        field: String,
        /// What is not supported.
        message: String,
    },
}

fn field_prefix(field: Option<&str>) -> String {
    field.map(|f| format!("`{f}`: ")).unwrap_or_default()
}

impl RequestError {
    /// An [`Invalid`](Self::Invalid) error.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid { field: field.into(), message: message.into() }
    }

    /// An [`Unsupported`](Self::Unsupported) error.
    pub fn unsupported(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Unsupported { field: field.into(), message: message.into() }
    }

    /// A [`Missing`](Self::Missing) error.
    pub fn missing(field: impl Into<String>) -> Self {
        Self::Missing { field: field.into() }
    }

    /// The path of the field at fault, if one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Malformed { field, .. } => field.as_deref(),
            Self::Missing { field } | Self::Invalid { field, .. } | Self::Unsupported { field, .. } => Some(field),
        }
    }

    /// OpenAI's error `code` for this kind of error.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Malformed { .. } => "invalid_type",
            Self::Missing { .. } => "missing_required_parameter",
            Self::Invalid { .. } => "invalid_value",
            Self::Unsupported { .. } => "unsupported_value",
        }
    }

    /// The error as OpenAI's error body.
    pub fn to_openai(&self) -> OpenAiErrorBody {
        OpenAiErrorBody {
            error: OpenAiError { message: self.to_string(), kind: INVALID_REQUEST.to_string(), param: self.field().map(str::to_string), code: Some(self.code().to_string()) },
        }
    }

    /// The error as Anthropic's error body.
    pub fn to_anthropic(&self) -> AnthropicErrorBody {
        AnthropicErrorBody::new(INVALID_REQUEST, self.to_string())
    }
}

/// The error type both APIs use for a bad request.
pub const INVALID_REQUEST: &str = "invalid_request_error";

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenAiErrorBody {
    /// The error.
    pub error: OpenAiError,
}

/// The inside of [`OpenAiErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenAiError {
    /// What went wrong, for people.
    pub message: String,
    /// `invalid_request_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The field at fault.
    pub param: Option<String>,
    /// A machine-readable code (`invalid_value`, ...).
    pub code: Option<String>,
}

impl OpenAiErrorBody {
    /// An error of another kind than a bad request (`server_error`, ...).
    pub fn new(kind: &str, message: impl Into<String>, code: Option<&str>) -> Self {
        Self { error: OpenAiError { message: message.into(), kind: kind.to_string(), param: None, code: code.map(str::to_string) } }
    }
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnthropicErrorBody {
    /// Always `error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The error.
    pub error: AnthropicError,
}

/// The inside of [`AnthropicErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnthropicError {
    /// `invalid_request_error`, `overloaded_error`, `api_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// What went wrong, for people.
    pub message: String,
}

impl AnthropicErrorBody {
    /// An error of the given Anthropic type.
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        Self { kind: "error".to_string(), error: AnthropicError { kind: kind.to_string(), message: message.into() } }
    }
}

/// Parses a request body, naming the field that fails (`messages[2].content`) in the error.
pub fn from_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, RequestError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        RequestError::Malformed {
            // The root's path prints as `.`: the body as a whole.
            field: (path != ".").then_some(path),
            message: e.into_inner().to_string(),
        }
    })?;
    de.end().map_err(|e| RequestError::Malformed { field: None, message: e.to_string() })?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Body {
        messages: Vec<Msg>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        content: String,
    }

    #[test]
    fn parse_errors_name_the_field() {
        let err = from_json::<Body>(br#"{"messages": [{"content": "a"}, {"content": 5}]}"#).unwrap_err();
        assert_eq!(err.field(), Some("messages[1].content"));
        let body = err.to_openai();
        assert_eq!(body.error.param.as_deref(), Some("messages[1].content"));
        assert_eq!(body.error.kind, "invalid_request_error");
        assert!(body.error.message.starts_with("`messages[1].content`: invalid type"), "{}", body.error.message);

        // A body cut short names the field it stopped in; one that is not JSON, none.
        let err = from_json::<Body>(b"{\"messages\": [").unwrap_err();
        assert_eq!(err.field(), Some("messages"));
        let err = from_json::<Body>(b"not json").unwrap_err();
        assert_eq!(err.field(), None);
        let err = from_json::<Body>(b"{\"messages\": []} x").unwrap_err();
        assert!(matches!(err, RequestError::Malformed { field: None, .. }), "{err}");
    }

    #[test]
    fn error_bodies_have_each_api_shape() {
        let err = RequestError::invalid("temperature", "must be between 0 and 2, got 3");
        assert_eq!(
            serde_json::to_value(err.to_openai()).unwrap(),
            serde_json::json!({"error": {"message": "`temperature`: must be between 0 and 2, got 3",
                "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}})
        );
        assert_eq!(
            serde_json::to_value(err.to_anthropic()).unwrap(),
            serde_json::json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "`temperature`: must be between 0 and 2, got 3"}})
        );
        assert_eq!(RequestError::missing("max_tokens").to_string(), "`max_tokens` is required");
    }
}
