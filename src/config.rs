//! `config.json` and `generation_config.json`: the hyperparameters of a Qwen3.5 text model.
//!
//! Field names follow the Hugging Face `Qwen3_5TextConfig` keys
//! (transformers `models/qwen3_5/configuration_qwen3_5.py`). The loader accepts every variant
//! seen in the wild (qwen35-spec.md §1 and the fixtures README):
//! - the text fields nested under `text_config` (`Qwen3_5ForConditionalGeneration`) or flat
//!   (`Qwen3_5ForCausalLM`);
//! - `layer_types` spelled out, or only `full_attention_interval`;
//! - `rope_parameters` (with `rope_type` or mlx-lm's `type`, optional `mrope_section`), the older
//!   `rope_scaling` block, or flat `rope_theta` / `partial_rotary_factor` keys; a scaled RoPE
//!   (`yarn`, `linear`, ...) or blocks that disagree are errors naming the key;
//! - a `quantization` (mlx-lm) or `quantization_config` block with per-module overrides;
//! - the mixture-of-experts sizes (`model_type` `qwen3_5_moe` / `qwen3_5_moe_text`,
//!   transformers `models/qwen3_5_moe/configuration_qwen3_5_moe.py`): `num_experts`,
//!   `num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size`, and
//!   mlx-lm's optional `norm_topk_prob` ([`MoeConfig`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// A problem with a configuration file. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: missing field `{field}`")]
    Missing { path: PathBuf, field: String },
    #[error("{path}: field `{field}` {problem}")]
    Invalid { path: PathBuf, field: String, problem: String },
    #[error("{path}: unsupported model_type `{model_type}` (tensorfold runs qwen3_5 / qwen3_5_text / qwen3_5_moe / qwen3_5_moe_text models)")]
    UnsupportedModelType { path: PathBuf, model_type: String },
    #[error("{path}: unsupported quantization mode `{mode}` (supported: affine, bits 4 or 8)")]
    UnsupportedQuantization { path: PathBuf, mode: String },
}

/// The two token mixers of the Qwen3.5 hybrid (HF `layer_types` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet (`"linear_attention"`).
    LinearAttention,
    /// Gated full attention with a KV cache (`"full_attention"`).
    FullAttention,
}

/// MLX affine quantization parameters of one module: `w ≈ scale·q + bias` per group of
/// `group_size` consecutive input elements, `q` an unsigned `bits`-bit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantParams {
    pub group_size: usize,
    pub bits: u32,
}

/// The config's `quantization` block: a default plus per-module overrides, keyed by the
/// module path as mlx-lm writes it (e.g. `language_model.model.layers.0.mlp.down_proj`).
/// An override of `false` means the module is stored unquantized.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantConfig {
    pub default: Option<QuantParams>,
    pub overrides: BTreeMap<String, Option<QuantParams>>,
}

impl QuantConfig {
    /// The parameters for the module at `path` (a tensor name without `.weight`).
    pub fn for_module(&self, path: &str) -> Option<QuantParams> {
        match self.overrides.get(path) {
            Some(p) => *p,
            None => self.default,
        }
    }
}

/// The mixture-of-experts block of a `qwen3_5_moe` model (every layer's MLP is one: transformers'
/// `Qwen3_5MoeDecoderLayer` has no dense layers). Keys as `Qwen3_5MoeTextConfig` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// E: routed experts per layer.
    pub num_experts: usize,
    /// k: experts each token is routed to (`1..=E`).
    pub num_experts_per_tok: usize,
    /// I_e: width of one routed expert's SwiGLU.
    pub moe_intermediate_size: usize,
    /// I_s: width of the shared expert's SwiGLU.
    pub shared_expert_intermediate_size: usize,
    /// Whether the k chosen probabilities are divided by their sum. transformers'
    /// `Qwen3_5MoeTopKRouter` always does; mlx-lm reads the key with default `true`.
    pub norm_topk_prob: bool,
}

/// The largest `max_position_embeddings` accepted: 2048 times Qwen3.5's 262,144. Positions
/// travel as `u32` in a step ([`crate::backend::SeqRows`]), the RoPE table's sin/cos reduction
/// covers angles below 1e9 (a position times at most 1), and a device may size tables by the
/// maximum up front, so the bound keeps a config's number from overflowing any of them.
pub const MAX_POSITIONS: usize = 1 << 29;

/// Hyperparameters of the text model, with Hugging Face names. Units: counts of elements
/// unless stated.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The `config.json` this came from, for error messages.
    pub path: PathBuf,
    /// D: width of the residual stream.
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// I: width of the dense SwiGLU MLP (0 for a mixture-of-experts model, whose configs have no
    /// `intermediate_size`: its widths are in [`ModelConfig::moe`]).
    pub intermediate_size: usize,
    /// Hq: query heads of the gated attention layers.
    pub num_attention_heads: usize,
    /// Hkv: key/value heads of the gated attention layers (GQA).
    pub num_key_value_heads: usize,
    /// Dh: attention head dimension (256 in every released size; not hidden/heads).
    pub head_dim: usize,
    /// Hk: Gated DeltaNet query/key heads.
    pub linear_num_key_heads: usize,
    /// Hv: Gated DeltaNet value heads (a multiple of Hk).
    pub linear_num_value_heads: usize,
    /// dk.
    pub linear_key_head_dim: usize,
    /// dv.
    pub linear_value_head_dim: usize,
    /// Kc: depthwise causal convolution width.
    pub linear_conv_kernel_dim: usize,
    /// V: rows of the embedding and of the logits (padded; larger than the tokenizer's ids).
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    /// θ of RoPE.
    pub rope_theta: f64,
    /// Fraction of `head_dim` that RoPE rotates.
    pub partial_rotary_factor: f64,
    /// Upper bound on positions (and so on the KV cache length).
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub layer_types: Vec<LayerType>,
    /// EOS ids named by config.json (the tokenizer adds those of the other files).
    pub eos_token_id: Vec<u32>,
    pub quantization: QuantConfig,
    /// The experts of a `qwen3_5_moe` model; `None` for a dense one.
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// Reads `config.json` in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let root = read_json(&path)?;
        Self::from_json(&path, &root)
    }

    /// Parses a config already read from `path`.
    pub fn from_json(path: &Path, root: &Value) -> Result<Self, ConfigError> {
        let p = || path.to_path_buf();
        let root = root.as_object().ok_or_else(|| ConfigError::Invalid { path: p(), field: "(root)".into(), problem: "is not a JSON object".into() })?;
        let outer_type = root.get("model_type").and_then(Value::as_str);
        let text: &Map<String, Value> = match root.get("text_config") {
            Some(Value::Object(t)) => t,
            Some(_) => return Err(ConfigError::Invalid { path: p(), field: "text_config".into(), problem: "is not an object".into() }),
            None => root,
        };
        let mut moe_type = false;
        for mt in [outer_type, text.get("model_type").and_then(Value::as_str)].into_iter().flatten() {
            match mt {
                "qwen3_5" | "qwen3_5_text" => {}
                "qwen3_5_moe" | "qwen3_5_moe_text" => moe_type = true,
                _ => return Err(ConfigError::UnsupportedModelType { path: p(), model_type: mt.into() }),
            }
        }
        // Look a key up in text_config first, then at the top level.
        let get = |k: &str| text.get(k).or_else(|| root.get(k)).filter(|v| !v.is_null());
        let usize_field = |k: &str| -> Result<usize, ConfigError> {
            let v = get(k).ok_or_else(|| ConfigError::Missing { path: p(), field: k.into() })?;
            match v.as_u64() {
                Some(n) if n > 0 => Ok(n as usize),
                _ => Err(ConfigError::Invalid { path: p(), field: k.into(), problem: format!("must be a positive integer, found {v}") }),
            }
        };
        let usize_or = |k: &str, d: usize| if get(k).is_some() { usize_field(k) } else { Ok(d) };
        let nested = !std::ptr::eq(text, root);
        // Where `get` found a key, as the error messages spell it.
        let key_path = |k: &str| if nested && text.get(k).is_some_and(|v| !v.is_null()) { format!("text_config.{k}") } else { k.to_string() };
        let f64_of = |k: &str, v: &Value| -> Result<f64, ConfigError> {
            v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| ConfigError::Invalid { path: p(), field: k.into(), problem: format!("must be a number, found {v}") })
        };

        let hidden_size = usize_field("hidden_size")?;
        let num_hidden_layers = usize_field("num_hidden_layers")?;
        let num_attention_heads = usize_field("num_attention_heads")?;
        let num_key_value_heads = usize_field("num_key_value_heads")?;
        // P16: head_dim is not hidden/heads for Qwen3.5; never guess it.
        let head_dim = usize_field("head_dim")?;
        let linear_num_key_heads = usize_field("linear_num_key_heads")?;
        let linear_num_value_heads = usize_field("linear_num_value_heads")?;
        let linear_key_head_dim = usize_field("linear_key_head_dim")?;
        let linear_value_head_dim = usize_field("linear_value_head_dim")?;
        let linear_conv_kernel_dim = usize_or("linear_conv_kernel_dim", 4)?;
        let moe = if moe_type {
            let moe = MoeConfig {
                num_experts: usize_field("num_experts")?,
                num_experts_per_tok: usize_field("num_experts_per_tok")?,
                moe_intermediate_size: usize_field("moe_intermediate_size")?,
                shared_expert_intermediate_size: usize_field("shared_expert_intermediate_size")?,
                norm_topk_prob: match get("norm_topk_prob") {
                    None => true,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => return Err(ConfigError::Invalid { path: p(), field: key_path("norm_topk_prob"), problem: format!("must be true or false, found {v}") }),
                },
            };
            if moe.num_experts_per_tok > moe.num_experts {
                return Err(ConfigError::Invalid {
                    path: p(),
                    field: key_path("num_experts_per_tok"),
                    problem: format!("({}) must be at most num_experts ({})", moe.num_experts_per_tok, moe.num_experts),
                });
            }
            // Neither transformers' qwen3_5_moe nor mlx-lm reads these (every layer is sparse
            // there); a config that asks for dense layers would silently run differently.
            if let Some(v) = get("mlp_only_layers").filter(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
                return Err(ConfigError::Invalid {
                    path: p(),
                    field: key_path("mlp_only_layers"),
                    problem: format!("({v}) is not supported: qwen3_5_moe makes every layer's MLP sparse"),
                });
            }
            if let Some(v) = get("decoder_sparse_step").filter(|v| v.as_u64() != Some(1)) {
                return Err(ConfigError::Invalid {
                    path: p(),
                    field: key_path("decoder_sparse_step"),
                    problem: format!("({v}) is not supported: qwen3_5_moe makes every layer's MLP sparse (step 1)"),
                });
            }
            Some(moe)
        } else {
            if let Some(v) = get("num_experts").filter(|v| v.as_u64() != Some(0)) {
                return Err(ConfigError::Invalid {
                    path: p(),
                    field: key_path("num_experts"),
                    problem: format!("({v}) is set but model_type is a dense one (qwen3_5 / qwen3_5_text); mixture-of-experts models are qwen3_5_moe"),
                });
            }
            None
        };
        // A mixture-of-experts config has no dense MLP width.
        let intermediate_size = if moe.is_some() { usize_or("intermediate_size", 0)? } else { usize_field("intermediate_size")? };
        let vocab_size = usize_field("vocab_size")?;
        let max_position_embeddings = usize_or("max_position_embeddings", 262_144)?;
        if max_position_embeddings > MAX_POSITIONS {
            return Err(ConfigError::Invalid {
                path: p(),
                field: "max_position_embeddings".into(),
                problem: format!("({max_position_embeddings}) must be at most {MAX_POSITIONS}"),
            });
        }
        let rms_norm_eps = match get("rms_norm_eps") {
            Some(v) => f64_of("rms_norm_eps", v)? as f32,
            None => 1e-6,
        };
        // A negative epsilon makes RMSNorm's square root NaN for small rows (and an f64 beyond
        // f32's range becomes infinite): the logits would be NaN, silently.
        if !(rms_norm_eps >= 0.0 && rms_norm_eps.is_finite()) {
            return Err(ConfigError::Invalid { path: p(), field: "rms_norm_eps".into(), problem: format!("({rms_norm_eps}) must be a finite number >= 0") });
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(ConfigError::Invalid {
                path: p(),
                field: "num_attention_heads".into(),
                problem: format!("({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})"),
            });
        }
        if linear_num_value_heads % linear_num_key_heads != 0 {
            return Err(ConfigError::Invalid {
                path: p(),
                field: "linear_num_value_heads".into(),
                problem: format!("({linear_num_value_heads}) must be a multiple of linear_num_key_heads ({linear_num_key_heads})"),
            });
        }
        if linear_conv_kernel_dim < 2 {
            return Err(ConfigError::Invalid { path: p(), field: "linear_conv_kernel_dim".into(), problem: "must be at least 2".into() });
        }
        if let Some(act) = get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(ConfigError::Invalid { path: p(), field: "hidden_act".into(), problem: format!("`{act}` is not supported (only silu)") });
            }
        }
        if get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(ConfigError::Invalid { path: p(), field: "attention_bias".into(), problem: "true is not supported".into() });
        }

        let layer_types = match get("layer_types") {
            Some(Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, it) in items.iter().enumerate() {
                    out.push(match it.as_str() {
                        Some("linear_attention") => LayerType::LinearAttention,
                        Some("full_attention") => LayerType::FullAttention,
                        _ => {
                            return Err(ConfigError::Invalid {
                                path: p(),
                                field: format!("layer_types[{i}]"),
                                problem: format!("must be \"linear_attention\" or \"full_attention\", found {it}"),
                            })
                        }
                    });
                }
                if out.len() != num_hidden_layers {
                    return Err(ConfigError::Invalid {
                        path: p(),
                        field: "layer_types".into(),
                        problem: format!("has {} entries but num_hidden_layers is {num_hidden_layers}", out.len()),
                    });
                }
                out
            }
            Some(v) => return Err(ConfigError::Invalid { path: p(), field: "layer_types".into(), problem: format!("must be a list, found {v}") }),
            None => {
                // transformers' Qwen3_5TextConfig.__post_init__: full attention every `interval` layers.
                let interval = usize_or("full_attention_interval", 4)?;
                (0..num_hidden_layers).map(|i| if (i + 1) % interval == 0 { LayerType::FullAttention } else { LayerType::LinearAttention }).collect()
            }
        };

        // RoPE: rope_parameters (transformers 5), or the older rope_scaling block, over flat
        // keys. Both blocks may say how positions are scaled; only unscaled RoPE is implemented,
        // so another rope_type, or two blocks that disagree, is an error naming the key: a
        // scaling dropped silently gives wrong logits with no sign of it.
        // A block present: where it was found, and its keys.
        type Block<'a> = (String, &'a Map<String, Value>);
        let block = |k: &str| -> Result<Option<Block>, ConfigError> {
            match get(k) {
                None => Ok(None),
                Some(Value::Object(o)) => Ok(Some((key_path(k), o))),
                Some(v) => Err(ConfigError::Invalid { path: p(), field: key_path(k), problem: format!("must be an object, found {v}") }),
            }
        };
        let blocks: Vec<Block> = [block("rope_parameters")?, block("rope_scaling")?].into_iter().flatten().collect();
        for (name, b) in &blocks {
            // transformers writes `rope_type`, older configs and mlx-lm's converter `type`.
            for key in ["rope_type", "type"] {
                let field = || format!("{name}.{key}");
                match b.get(key) {
                    None | Some(Value::Null) => {}
                    // "mrope" is Qwen2-VL's name for default RoPE over position sections
                    // (transformers' Qwen2VLConfig maps it to "default"); with text positions
                    // it is plain RoPE (spec P29).
                    Some(Value::String(kind)) if kind == "default" || kind == "mrope" => {}
                    Some(Value::String(kind)) => {
                        return Err(ConfigError::Invalid {
                            path: p(),
                            field: field(),
                            problem: format!("`{kind}` is not supported (tensorfold implements unscaled RoPE only: `default`)"),
                        })
                    }
                    Some(v) => return Err(ConfigError::Invalid { path: p(), field: field(), problem: format!("must be a string, found {v}") }),
                }
            }
        }
        if let [(first, a), (second, b)] = blocks.as_slice() {
            for key in ["rope_theta", "partial_rotary_factor"] {
                let num = |m: &Map<String, Value>| m.get(key).and_then(Value::as_f64);
                if let (Some(x), Some(y)) = (num(a), num(b)) {
                    if x != y {
                        return Err(ConfigError::Invalid { path: p(), field: format!("{second}.{key}"), problem: format!("({y}) conflicts with {first}.{key} ({x})") });
                    }
                }
            }
        }
        // The first block that has a key wins (they agree where both have it), then flat keys.
        let rope_get = |k: &str| blocks.iter().find_map(|(_, b)| b.get(k).filter(|v| !v.is_null())).or_else(|| get(k));
        let rope_theta = match rope_get("rope_theta") {
            Some(v) => f64_of("rope_theta", v)?,
            None => return Err(ConfigError::Missing { path: p(), field: "rope_parameters.rope_theta".into() }),
        };
        // The RoPE table takes ln θ (defined for θ > 0) and reduces angles p·θ^(−2i/r), which stay
        // within the position (and within what the reduction covers) only for θ >= 1.
        if rope_theta < 1.0 {
            return Err(ConfigError::Invalid { path: p(), field: "rope_theta".into(), problem: format!("({rope_theta}) must be at least 1 (Qwen3.5 uses 1e7)") });
        }
        let partial_rotary_factor = match rope_get("partial_rotary_factor") {
            Some(v) => f64_of("partial_rotary_factor", v)?,
            None => 1.0,
        };
        let rotary = head_dim as f64 * partial_rotary_factor;
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) || rotary.fract() != 0.0 || !(rotary as usize).is_multiple_of(2) {
            return Err(ConfigError::Invalid {
                path: p(),
                field: "partial_rotary_factor".into(),
                problem: format!("({partial_rotary_factor}) must give an even rotary dimension of head_dim {head_dim}"),
            });
        }
        // `mrope_section` is not read: with text-only positions every section sees the same
        // position, so mRoPE equals plain partial RoPE over the rotary dimension (spec P29). Small
        // test configs keep the released [11, 11, 10] even where their rotary dim is smaller.

        let tie_word_embeddings = get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false);
        let eos_token_id =
            parse_id_list(get("eos_token_id")).ok_or_else(|| ConfigError::Invalid { path: p(), field: "eos_token_id".into(), problem: "must be an id or a list of ids".into() })?;
        let quantization = parse_quantization(path, root)?;

        Ok(Self {
            path: path.to_path_buf(),
            hidden_size,
            num_hidden_layers,
            intermediate_size,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim,
            linear_value_head_dim,
            linear_conv_kernel_dim,
            vocab_size,
            rms_norm_eps,
            rope_theta,
            partial_rotary_factor,
            max_position_embeddings,
            tie_word_embeddings,
            layer_types,
            eos_token_id,
            quantization,
            moe,
        })
    }

    /// Rotary dimension: `head_dim · partial_rotary_factor` (64 for every released size).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }
    /// `Hk·dk`: width of the GDN query (and key) block.
    pub fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// `Hv·dv`: width of the GDN value block and of its output.
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// `2·key_dim + value_dim`: channels of the causal convolution (q | k | v).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Number of Gated DeltaNet layers.
    pub fn num_linear_layers(&self) -> usize {
        self.layer_types.iter().filter(|t| **t == LayerType::LinearAttention).count()
    }
    /// Number of full attention layers (the ones with a KV cache).
    pub fn num_full_layers(&self) -> usize {
        self.num_hidden_layers - self.num_linear_layers()
    }
}

/// Sampling defaults a checkpoint ships in `generation_config.json` (transformers' names).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub eos_token_id: Vec<u32>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` in `dir`; a missing file gives the empty default.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let v = read_json(&path)?;
        let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        Ok(Self {
            do_sample: v.get("do_sample").and_then(Value::as_bool),
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: v.get("top_k").and_then(Value::as_u64).map(|x| x as usize),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
            eos_token_id: parse_id_list(v.get("eos_token_id")).ok_or_else(|| ConfigError::Invalid {
                path: path.clone(),
                field: "eos_token_id".into(),
                problem: "must be an id or a list of ids".into(),
            })?,
        })
    }
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value, ConfigError> {
    let bytes = std::fs::read(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    serde_json::from_slice(&bytes).map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })
}

/// `null`/absent → empty; an integer → one id; a list of integers → those ids.
fn parse_id_list(v: Option<&Value>) -> Option<Vec<u32>> {
    match v {
        None | Some(Value::Null) => Some(Vec::new()),
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]),
        Some(Value::Array(a)) => a.iter().map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => None,
    }
}

fn parse_quantization(path: &Path, root: &Map<String, Value>) -> Result<QuantConfig, ConfigError> {
    let Some(block) = root.get("quantization").or_else(|| root.get("quantization_config")) else {
        return Ok(QuantConfig::default());
    };
    let Some(block) = block.as_object() else {
        return Err(ConfigError::Invalid { path: path.into(), field: "quantization".into(), problem: "must be an object".into() });
    };
    let params = |field: &str, obj: &Map<String, Value>| -> Result<QuantParams, ConfigError> {
        if let Some(mode) = obj.get("mode").and_then(Value::as_str) {
            if mode != "affine" {
                return Err(ConfigError::UnsupportedQuantization { path: path.into(), mode: mode.into() });
            }
        }
        if let Some(method) = obj.get("quant_method").and_then(Value::as_str) {
            return Err(ConfigError::UnsupportedQuantization { path: path.into(), mode: method.into() });
        }
        let gs = obj.get("group_size").and_then(Value::as_u64);
        let bits = obj.get("bits").and_then(Value::as_u64);
        match (gs, bits) {
            (Some(gs @ (32 | 64 | 128)), Some(b @ (4 | 8))) => Ok(QuantParams { group_size: gs as usize, bits: b as u32 }),
            (Some(gs), Some(b)) => Err(ConfigError::UnsupportedQuantization {
                path: path.into(),
                mode: format!("affine bits {b} group_size {gs} in `{field}` (supported: bits 4|8, group_size 32|64|128)"),
            }),
            _ => Err(ConfigError::Invalid { path: path.into(), field: field.into(), problem: "needs integer `group_size` and `bits`".into() }),
        }
    };
    let default = params("quantization", block)?;
    let mut overrides = BTreeMap::new();
    for (k, v) in block {
        match v {
            Value::Object(o) => {
                overrides.insert(k.clone(), Some(params(&format!("quantization.{k}"), o)?));
            }
            Value::Bool(false) => {
                overrides.insert(k.clone(), None);
            }
            _ => {}
        }
    }
    Ok(QuantConfig { default: Some(default), overrides })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::shared;

    #[test]
    fn nested_mlx_config() {
        let c = ModelConfig::from_dir(&shared("fixtures/tiny/mlx-q4")).unwrap();
        assert_eq!((c.hidden_size, c.num_hidden_layers, c.head_dim, c.rotary_dim()), (256, 4, 64, 16));
        assert_eq!(c.layer_types[3], LayerType::FullAttention);
        assert_eq!(c.layer_types[0], LayerType::LinearAttention);
        assert_eq!(c.conv_dim(), 2 * 2 * 64 + 4 * 64);
        assert_eq!(c.quantization.default, Some(QuantParams { group_size: 64, bits: 4 }));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope_theta, 1e7);
        assert_eq!(c.eos_token_id, vec![2017]);
    }

    #[test]
    fn flat_demo_configs() {
        for layout in ["hf", "mlx-q4"] {
            let c = ModelConfig::from_dir(&shared(&format!("models/tensorfold-demo-py28m/{layout}"))).unwrap();
            assert_eq!((c.hidden_size, c.num_hidden_layers, c.rotary_dim()), (512, 8, 16), "{layout}");
            assert_eq!(c.num_full_layers(), 2);
            assert_eq!(c.max_position_embeddings, 32768);
        }
    }

    fn parse(v: Value) -> Result<ModelConfig, ConfigError> {
        ModelConfig::from_json(Path::new("config.json"), &v)
    }

    fn base() -> Value {
        serde_json::json!({
            "model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "linear_key_head_dim": 32, "linear_value_head_dim": 32, "intermediate_size": 128, "vocab_size": 100,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.25
        })
    }

    #[test]
    fn full_attention_interval_builds_layer_types() {
        let mut v = base();
        v["num_hidden_layers"] = 8.into();
        v["full_attention_interval"] = 2.into();
        let c = parse(v).unwrap();
        let full: Vec<usize> = (0..8).filter(|&i| c.layer_types[i] == LayerType::FullAttention).collect();
        assert_eq!(full, vec![1, 3, 5, 7]);
        assert_eq!(c.rotary_dim(), 8);
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("head_dim");
        assert!(parse(v).unwrap_err().to_string().contains("missing field `head_dim`"));
        let mut v = base();
        v["model_type"] = "llama".into();
        assert!(parse(v).unwrap_err().to_string().contains("unsupported model_type `llama`"));
        let mut v = base();
        v["quantization"] = serde_json::json!({"group_size": 64, "bits": 4, "mode": "mxfp4"});
        assert!(parse(v).unwrap_err().to_string().contains("unsupported quantization mode `mxfp4`"));
        let mut v = base();
        v["quantization"] = serde_json::json!({"group_size": 64, "bits": 3});
        assert!(parse(v).unwrap_err().to_string().contains("bits 3"));
        let mut v = base();
        v["layer_types"] = serde_json::json!(["linear_attention"]);
        assert!(parse(v).unwrap_err().to_string().contains("has 1 entries but num_hidden_layers is 4"));
        let mut v = base();
        v["partial_rotary_factor"] = 0.3.into();
        assert!(parse(v).unwrap_err().to_string().contains("partial_rotary_factor"));
    }

    #[test]
    fn numbers_outside_their_domain_are_errors() {
        // θ <= 0 used to panic in the RoPE table's log, θ < 1 in its sin/cos reduction a few
        // positions in; a negative epsilon gave NaN logits.
        for theta in [0.0, -5.0, 1e-300, 0.5] {
            let mut v = base();
            v["rope_theta"] = theta.into();
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains("field `rope_theta`") && err.contains("must be at least 1"), "{theta}: {err}");
        }
        for eps in [-1e-6, 1e300] {
            let mut v = base();
            v["rms_norm_eps"] = eps.into();
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains("field `rms_norm_eps`"), "{eps}: {err}");
        }
        let mut v = base();
        v["max_position_embeddings"] = serde_json::json!(1u64 << 62);
        let err = parse(v).unwrap_err().to_string();
        assert!(err.contains("field `max_position_embeddings` (4611686018427387904) must be at most 536870912"), "{err}");
        let mut v = base();
        v["max_position_embeddings"] = MAX_POSITIONS.into();
        assert_eq!(parse(v).unwrap().max_position_embeddings, MAX_POSITIONS);
        let mut v = base();
        v["rope_theta"] = 1.0.into();
        v["rms_norm_eps"] = 0.0.into();
        let c = parse(v).unwrap();
        assert_eq!((c.rope_theta, c.rms_norm_eps), (1.0, 0.0));
    }

    /// `base()` as transformers nests it: the text fields under `text_config`.
    fn nested(text: Value) -> Value {
        serde_json::json!({"model_type": "qwen3_5", "text_config": text})
    }

    #[test]
    fn rope_scaling_that_is_not_default_is_an_error_naming_the_key() {
        // Issue 21: a yarn block beside rope_parameters used to be dropped silently.
        let yarn = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262_144});
        let mut t = base();
        t["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25});
        t["rope_scaling"] = yarn.clone();
        let err = parse(nested(t.clone())).unwrap_err().to_string();
        assert_eq!(err, "config.json: field `text_config.rope_scaling.rope_type` `yarn` is not supported (tensorfold implements unscaled RoPE only: `default`)");
        // Flat configs name the key without the prefix; older configs spell it `type`.
        let mut t = base();
        t["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0});
        let err = parse(t).unwrap_err().to_string();
        assert!(err.contains("field `rope_scaling.type` `linear` is not supported"), "{err}");
        // The same for rope_parameters itself.
        let mut t = base();
        t["rope_parameters"] = yarn;
        let err = parse(nested(t)).unwrap_err().to_string();
        assert!(err.contains("field `text_config.rope_parameters.rope_type` `yarn`"), "{err}");
        // Not an object, or a type that is not a string.
        let mut t = base();
        t["rope_scaling"] = "yarn".into();
        let err = parse(t).unwrap_err().to_string();
        assert!(err.contains("field `rope_scaling` must be an object, found \"yarn\""), "{err}");
        let mut t = base();
        t["rope_scaling"] = serde_json::json!({"rope_type": 4});
        let err = parse(t).unwrap_err().to_string();
        assert!(err.contains("field `rope_scaling.rope_type` must be a string, found 4"), "{err}");
    }

    #[test]
    fn rope_scaling_that_conflicts_with_rope_parameters_is_an_error() {
        let mut t = base();
        t["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25});
        t["rope_scaling"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e6});
        let err = parse(nested(t.clone())).unwrap_err().to_string();
        assert!(err.contains("field `text_config.rope_scaling.rope_theta` (1000000) conflicts with text_config.rope_parameters.rope_theta (10000000)"), "{err}");
        t["rope_scaling"] = serde_json::json!({"rope_type": "default", "partial_rotary_factor": 0.5});
        let err = parse(nested(t)).unwrap_err().to_string();
        assert!(err.contains("field `text_config.rope_scaling.partial_rotary_factor` (0.5) conflicts"), "{err}");
    }

    #[test]
    fn default_or_absent_rope_scaling_is_accepted() {
        // base() has flat rope_theta 1e4 and factor 0.25; the blocks below override them.
        let params = serde_json::json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5});
        for scaling in [
            Value::Null,
            serde_json::json!({"rope_type": "default"}),
            serde_json::json!({"type": "mrope", "mrope_section": [1, 1, 2]}),
            serde_json::json!({"rope_type": "default", "rope_theta": 1e7}),
        ] {
            let mut t = base();
            t["rope_parameters"] = params.clone();
            t["rope_scaling"] = scaling.clone();
            let c = parse(nested(t)).unwrap_or_else(|e| panic!("{scaling}: {e}"));
            assert_eq!((c.rope_theta, c.rotary_dim()), (1e7, 16), "{scaling}");
        }
        // rope_scaling alone, as older configs carry it, is read like rope_parameters.
        let mut t = base();
        t["rope_scaling"] = serde_json::json!({"rope_type": "default", "rope_theta": 5e5});
        let c = parse(t).unwrap();
        assert_eq!((c.rope_theta, c.rotary_dim()), (5e5, 8));
    }

    #[test]
    fn quantization_overrides() {
        let mut v = base();
        v["quantization"] = serde_json::json!({
            "group_size": 64, "bits": 4,
            "language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
            "language_model.model.layers.1.mlp.down_proj": false
        });
        let q = parse(v).unwrap().quantization;
        assert_eq!(q.for_module("language_model.model.layers.0.mlp.down_proj"), Some(QuantParams { group_size: 32, bits: 8 }));
        assert_eq!(q.for_module("language_model.model.layers.1.mlp.down_proj"), None);
        assert_eq!(q.for_module("language_model.model.layers.2.mlp.down_proj"), Some(QuantParams { group_size: 64, bits: 4 }));
    }
}
