//! `tensorfold convert`: a Hugging Face bf16 Qwen3.5 checkpoint to the MLX affine layout, as
//! mlx-lm 0.32's `mlx_lm.convert --quantize` writes it (mlx 0.32's `mx.quantize`), so the output
//! is what `mlx_lm.convert` would have written from the same source.
//!
//! What mlx-lm does, step by step, and so what this module does:
//! * **Names** (`qwen3_5.py` `Model.sanitize`): `model.language_model.X` (or the flat `model.X`)
//!   becomes `language_model.model.X`, `lm_head.weight` becomes `language_model.lm_head.weight`;
//!   the vision tower and `mtp.*` are dropped, and so is a tied checkpoint's `lm_head.weight`.
//! * **Experts** (`qwen3_5_moe.py` `Model.sanitize`): the fused `mlp.experts.gate_up_proj`
//!   `[E, 2I, D]` becomes `mlp.switch_mlp.gate_proj.weight` (rows `..I` of each expert) and
//!   `mlp.switch_mlp.up_proj.weight` (rows `I..`), `mlp.experts.down_proj` becomes
//!   `mlp.switch_mlp.down_proj.weight`; 3-D, quantized like a matrix of `E·rows` rows. mlx-lm
//!   reads no per-expert tensors (`mlp.experts.{e}.*`) for this model, so they are refused here.
//! * **Layout**: `conv1d.weight` `[C, 1, K]` becomes `[C, K, 1]` (the same bytes); when it had
//!   to, the RMSNorm weights ending in `.input_layernorm`, `.post_attention_layernorm`,
//!   `model.norm`, `.q_norm`, `.k_norm` (not the gated `linear_attn.norm`) are stored as `1 + w`,
//!   added in the source dtype (f32 sum, rounded to bf16).
//! * **dtype** (`convert.py`): when `torch_dtype` (or `text_config.dtype`) is bfloat16, float16
//!   or float32, every float tensor but `A_log` (`cast_predicate`) is cast to it, before
//!   quantizing: the release's f32 `linear_attn.norm.weight` becomes bf16, `A_log` stays f32.
//! * **Quantization** (`utils.py` `quantize_model`, `nn.quantize`): every `Linear` and the
//!   `Embedding` (here: every 2-D `.weight` but the conv) whose input width the default group
//!   size divides, at the default bits/group size or a per-module override; the others stay as
//!   they are. Norms, conv1d, `A_log`, `dt_bias` are not modules that quantize. Dense Qwen3.5 has
//!   no `quant_predicate`; a mixture of experts has one (`qwen3_5.py`): the router `mlp.gate` and
//!   `mlp.shared_expert_gate` at 8 bits, group size 64 (a `--q-override` that matches wins). Overrides are written into `config.json`'s `quantization` block
//!   as `{"group_size", "bits"}` under the module path, in model order, as mlx-lm writes the
//!   dicts a predicate returns.
//! * **`mx.quantize`** (affine, mlx `backend/cpu/quantized.cpp`), per group of `group_size`
//!   consecutive inputs, all in f32: `n = 2^bits − 1`; `scale = max((max − min)/n, 1e−7)`, negated
//!   unless `|min| > |max|`; `edge` = min if `|min| > |max|` else max; `q0 = rint(edge/scale)`;
//!   if `q0 ≠ 0`: `scale = edge/q0`, `bias = edge`, else `bias = 0`; each code
//!   `clamp(rint((w − bias)/scale), 0, n)` (`rint`: ties to even), packed from the low bits of a
//!   little-endian u32 up; then `scale` and `bias` are rounded to the weight dtype (bf16). So an
//!   edge value is always exactly representable, and an all-zero group stores scale −1e−7, bias 0.
//! * **Files** (`utils.py` `save`): one `model.safetensors` per ≤ 5 GiB (`format: mlx`), the
//!   index even for one shard, `config.json` with `eos_token_id` from `generation_config.json`,
//!   `rope_parameters.rope_type` renamed `type` (mlx-lm's `TextModelArgs` does it in place),
//!   `vision_config` and `_name_or_path` dropped, `quantization` also as `quantization_config`,
//!   keys sorted, written as Python's `json.dump(indent=4)`; `generation_config.json` copied; the
//!   model card. mlx-lm re-saves the tokenizer through transformers (which rewrites
//!   `tokenizer.json`); here the source's tokenizer files are copied unchanged, and a
//!   `chat_template` string of `tokenizer_config.json` is also written to `chat_template.jinja`
//!   (where transformers 5 saves it, and which takes precedence when both exist).
//!
//! Checked against mlx-lm's own output (`tests/convert.rs`, and `tests/moe.rs` for a mixture of
//! experts: `tests/data/moe/mlx-q4`): `shared/fixtures/tiny/mlx-q4` and
//! the 8-bit, group-32/128 and per-module-override variants in `tests/data/quant` are reproduced
//! tensor for tensor, byte for byte, with the same `config.json` and index bytes.
//!
//! Tensors are produced one at a time when the safetensors writer asks for them, quantized in
//! parallel over rows; everything is written beside `out_dir` and renamed into place at the end.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use half::{bf16, f16};
use safetensors::View;
use serde_json::{json, Map, Value};

use crate::checkpoint::{Checkpoint, Dtype, TensorEntry};
use crate::config::{self, ConfigError, QuantParams};
use crate::model::weights::{Layout, SKIPPED};
use crate::model::{HostModel, LoadError};
use crate::writer::{self, io_err, par_rows, Staging, WriteError};

/// mlx-lm's shard limit (`MAX_FILE_SIZE_GB = 5`, shifted by 30).
const MLX_SHARD_BYTES: u64 = 5 << 30;
/// The bit widths tensorfold runs (mlx also has 2, 3, 5 and 6).
pub const SUPPORTED_BITS: [u32; 2] = [4, 8];
/// The affine group sizes mlx supports.
pub const SUPPORTED_GROUP_SIZES: [usize; 3] = [32, 64, 128];
/// mlx-lm's defaults for `--q-bits` and `--q-group-size` (affine mode).
pub const DEFAULT_QUANT: QuantParams = QuantParams { group_size: 64, bits: 4 };
/// Norm weights that mlx-lm's `sanitize` stores as `1 + w` (matched as name suffixes).
const SHIFTED_NORMS: [&str; 5] = [".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight", ".k_norm.weight"];
/// Source files copied as they are (tokenizer, templates, generation defaults).
const COPIED: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

/// A per-module quantization override: modules whose path is `suffix` or ends in `.suffix`
/// (e.g. `mlp.down_proj`, `layers.3.self_attn.o_proj`) get `params` instead of the default.
/// Parsed from `SUFFIX=BITS:GROUP_SIZE` (`mlp.down_proj=8:32`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantOverride {
    pub suffix: String,
    pub params: QuantParams,
}

impl QuantOverride {
    fn matches(&self, module: &str) -> bool {
        module == self.suffix || module.strip_suffix(self.suffix.as_str()).is_some_and(|p| p.ends_with('.'))
    }
}

impl FromStr for QuantOverride {
    type Err = ConvertError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason: String| ConvertError::InvalidOption { flag: "--q-override", reason };
        let (suffix, spec) = s.split_once('=').ok_or_else(|| bad(format!("`{s}` is not SUFFIX=BITS:GROUP_SIZE (e.g. mlp.down_proj=8:32)")))?;
        let (bits, group) = spec.split_once(':').ok_or_else(|| bad(format!("`{spec}` in `{s}` is not BITS:GROUP_SIZE")))?;
        let bits = bits.trim().parse().map_err(|_| bad(format!("bits `{bits}` in `{s}` is not a number")))?;
        let group_size = group.trim().parse().map_err(|_| bad(format!("group size `{group}` in `{s}` is not a number")))?;
        let suffix = suffix.trim().trim_matches('.').to_string();
        if suffix.is_empty() {
            return Err(bad(format!("`{s}` names no module")));
        }
        let params = QuantParams { group_size, bits };
        check_params(params, "--q-override", "--q-override")?;
        Ok(Self { suffix, params })
    }
}

/// What to convert and how.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// A Hugging Face bf16 checkpoint directory (config.json, safetensors, tokenizer files).
    pub src_dir: PathBuf,
    /// The directory to create; it must not exist or be empty.
    pub out_dir: PathBuf,
    /// Default bits and group size (`--q-bits`, `--q-group-size`).
    pub quant: QuantParams,
    /// Per-module overrides; the first that matches a module wins.
    pub overrides: Vec<QuantOverride>,
    /// The Hub repo the source came from, recorded as `base_model` in the model card.
    pub base_model: Option<String>,
}

/// What [`convert`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvertSummary {
    /// The finished directory.
    pub out_dir: PathBuf,
    /// Modules quantized (each one `weight`/`scales`/`biases` triple).
    pub quantized: usize,
    /// Tensors stored as floats.
    pub floats: usize,
    /// `total_parameters` of the index, as mlx-lm counts them.
    pub parameters: u64,
    /// Bytes of tensor data in the safetensors files.
    pub tensor_bytes: u64,
    /// The modules quantized with other bits or group size than the default (a `--q-override`,
    /// or mlx-lm's predicate for a mixture of experts), in model order: the entries of
    /// config.json's `quantization` block.
    pub overridden: Vec<(String, QuantParams)>,
    /// File names inside `out_dir`, sorted.
    pub files: Vec<String>,
}

/// Why a conversion was refused or failed. Every variant names the file, tensor or flag.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{flag}: {reason}")]
    InvalidOption { flag: &'static str, reason: String },
    #[error("{dir}: not a Qwen3.5 checkpoint tensorfold can read: {source}")]
    Source {
        dir: PathBuf,
        #[source]
        source: Box<LoadError>,
    },
    #[error("{path}: not a Hugging Face bf16 checkpoint: {reason}")]
    NotHfBf16 { path: PathBuf, reason: String },
    #[error("{file}: tensor `{name}` is not part of a Qwen3.5 text model (mlx-lm's converter refuses it too)")]
    UnexpectedTensor { file: PathBuf, name: String },
    #[error("{file}: tensor `{name}` holds a NaN or infinite value, which has no affine code")]
    NonFinite { file: PathBuf, name: String },
    #[error("{file}: module `{module}`: group size {group_size} does not divide its {cols} input columns")]
    Indivisible { file: PathBuf, module: String, group_size: usize, cols: usize },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Write(#[from] WriteError),
}

fn check_params(p: QuantParams, bits_flag: &'static str, group_flag: &'static str) -> Result<(), ConvertError> {
    if !SUPPORTED_BITS.contains(&p.bits) {
        return Err(ConvertError::InvalidOption {
            flag: bits_flag,
            reason: format!("{} bits is not supported (mlx affine has 2, 3, 4, 5, 6 and 8; tensorfold runs 4 and 8)", p.bits),
        });
    }
    if !SUPPORTED_GROUP_SIZES.contains(&p.group_size) {
        return Err(ConvertError::InvalidOption { flag: group_flag, reason: format!("group size {} is not one of mlx's 32, 64, 128", p.group_size) });
    }
    Ok(())
}

/// Quantizes one group as mlx's `mx.quantize` (affine) does; see the module docs. `w` holds the
/// group's values (already in the weight dtype, widened to f32); `codes`, when given, receives
/// one code per value. Returns `(scale, bias)` before their rounding to the storage dtype.
pub fn quantize_group(w: &[f32], bits: u32, codes: Option<&mut [u32]>) -> (f32, f32) {
    // C++'s std::max/std::min, which return the first argument on ties and unordered inputs.
    let cmax = |a: f32, b: f32| if a < b { b } else { a };
    let cmin = |a: f32, b: f32| if b < a { b } else { a };
    let n_bins = ((1u32 << bits) - 1) as f32;
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &x in w {
        hi = cmax(hi, x);
        lo = cmin(lo, x);
    }
    let mask = lo.abs() > hi.abs();
    let mut scale = cmax((hi - lo) / n_bins, 1e-7);
    if !mask {
        scale = -scale;
    }
    let edge = if mask { lo } else { hi };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    if let Some(codes) = codes {
        for (c, &x) in codes.iter_mut().zip(w) {
            *c = cmin(cmax(((x - bias) / scale).round_ties_even(), 0.0), n_bins) as u32;
        }
    }
    (scale, bias)
}

/// An output float dtype and how a value reaches it.
fn round_to(x: f32, d: Dtype) -> f32 {
    match d {
        Dtype::BF16 => bf16::from_f32(x).to_f32(),
        Dtype::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

fn encode(x: f32, d: Dtype, out: &mut [u8]) {
    match d {
        Dtype::BF16 => out.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes()),
        Dtype::F16 => out.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes()),
        _ => out.copy_from_slice(&x.to_le_bytes()),
    }
}

fn decode(b: &[u8], d: Dtype, i: usize) -> f32 {
    match d {
        Dtype::BF16 => bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32(),
        Dtype::F16 => f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32(),
        _ => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
    }
}

fn dtype_bytes(d: Dtype) -> usize {
    d.bitsize() / 8
}

/// How an output tensor's bytes come from its source tensor.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// Packed codes, u32 `[rows, cols·bits/32]`.
    Codes(QuantParams),
    /// Per-group scales or biases, `[rows, cols/group_size]` in the cast dtype.
    Scales(QuantParams),
    Biases(QuantParams),
    /// The values, `+ 1` in the source dtype when `shift`, then in the output dtype.
    Float {
        shift: bool,
    },
}

/// Which source rows an output tensor reads when not all of them in order: output row `r` is
/// source row `(r / len) · block + offset + r mod len` (the gate or up half of each expert of a
/// fused `gate_up_proj`, rows counted over the flattened leading dimensions).
#[derive(Clone, Copy, Debug)]
struct RowMap {
    block: usize,
    offset: usize,
    len: usize,
}

/// One tensor of the output.
struct Planned<'a> {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    src: &'a TensorEntry,
    op: Op,
    rows: Option<RowMap>,
}

impl Planned<'_> {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * dtype_bytes(self.dtype)
    }
}

/// The cast mlx-lm's `convert` applies: `torch_dtype`, else `text_config.dtype`, when it is one
/// of its three conversion dtypes.
fn cast_dtype(root: &Map<String, Value>) -> Option<Dtype> {
    let name = root.get("torch_dtype").filter(|v| !v.is_null()).or_else(|| root.get("text_config").and_then(|t| t.get("dtype")));
    match name.and_then(Value::as_str) {
        Some("bfloat16") => Some(Dtype::BF16),
        Some("float16") => Some(Dtype::F16),
        Some("float32") => Some(Dtype::F32),
        _ => None,
    }
}

/// Where a module comes in mlx-lm's module tree (the order `nn.quantize` visits modules and so
/// writes per-module entries): the embedding, each layer's mixer projections and MLP in
/// definition order, the head.
fn module_order(module: &str) -> (u8, usize, u8, String) {
    const IN_LAYER: [&str; 20] = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.in_proj_b",
        "linear_attn.in_proj_a",
        "linear_attn.out_proj",
        "mlp.gate_proj",
        "mlp.down_proj",
        "mlp.up_proj",
        "mlp.gate",
        "mlp.switch_mlp.gate_proj",
        "mlp.switch_mlp.up_proj",
        "mlp.switch_mlp.down_proj",
        "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj",
        "mlp.shared_expert.down_proj",
        "mlp.shared_expert_gate",
    ];
    if module.ends_with("embed_tokens") {
        return (0, 0, 0, String::new());
    }
    if let Some(rest) = module.split_once(".layers.").map(|(_, r)| r) {
        if let Some((n, tail)) = rest.split_once('.') {
            if let Ok(n) = n.parse() {
                let k = IN_LAYER.iter().position(|s| *s == tail).unwrap_or(IN_LAYER.len()) as u8;
                return (1, n, k, tail.to_string());
            }
        }
    }
    (2, 0, 0, module.to_string())
}

/// mlx-lm's `quant_predicate` for a mixture-of-experts Qwen3.5 (`qwen3_5.py`): the router and
/// the shared expert's gate at 8 bits, group size 64.
fn moe_predicate(module: &str) -> Option<QuantParams> {
    (module.ends_with("mlp.gate") || module.ends_with("shared_expert_gate")).then_some(QuantParams { group_size: 64, bits: 8 })
}

/// The parameters module `module` is quantized with: a matching `--q-override`, else mlx-lm's
/// MoE predicate (for an MoE model), else the default.
fn module_params(module: &str, opts: &ConvertOptions, moe: bool) -> (QuantParams, bool) {
    if let Some(o) = opts.overrides.iter().find(|o| o.matches(module)) {
        return (o.params, true);
    }
    match moe.then(|| moe_predicate(module)).flatten() {
        Some(q) => (q, true),
        None => (opts.quant, false),
    }
}

/// The output name of a source tensor, or `None` when mlx-lm drops it.
fn mlx_name(name: &str, layout: Layout, tied: bool) -> Option<String> {
    if SKIPPED.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    if name == "lm_head.weight" {
        return (!tied).then(|| "language_model.lm_head.weight".to_string());
    }
    let rest = match layout {
        Layout::HfNested => name.strip_prefix("model.language_model.")?,
        Layout::Flat => name.strip_prefix("model.")?,
        Layout::Mlx => return None,
    };
    Some(format!("language_model.model.{rest}"))
}

/// Converts `opts.src_dir` into `opts.out_dir`, calling `progress(bytes_done, bytes_total)`
/// (tensor bytes written) as it goes.
///
/// # Errors
/// [`ConvertError::InvalidOption`] for bits or group sizes mlx or tensorfold do not support;
/// [`WriteError::OutDirNotEmpty`] / [`WriteError::OutPathNotDir`] when `out_dir` is taken
/// (checked first, nothing is touched); [`ConvertError::Source`] when the source does not load
/// as a Qwen3.5 checkpoint; [`ConvertError::NotHfBf16`] for an MLX or already-quantized source or
/// a matrix that is not bf16; [`ConvertError::UnexpectedTensor`], [`ConvertError::NonFinite`],
/// [`ConvertError::Indivisible`] as named; I/O errors while writing, after which nothing is left
/// behind.
pub fn convert(opts: &ConvertOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<ConvertSummary, ConvertError> {
    check_params(opts.quant, "--q-bits", "--q-group-size")?;
    writer::check_out_dir(&opts.out_dir)?;
    let src = &opts.src_dir;
    let config_path = src.join("config.json");
    let root_value = config::read_json(&config_path)?;
    let root = root_value.as_object().ok_or_else(|| ConvertError::NotHfBf16 { path: config_path.clone(), reason: "is not a JSON object".into() })?;
    for key in ["quantization", "quantization_config"] {
        if root.contains_key(key) || root.get("text_config").is_some_and(|t| t.get(key).is_some()) {
            return Err(ConvertError::NotHfBf16 { path: config_path.clone(), reason: format!("it has a `{key}` block: the checkpoint is already quantized") });
        }
    }
    let host = HostModel::open(src).map_err(|e| ConvertError::Source { dir: src.clone(), source: Box::new(e) })?;
    let ck = &host.checkpoint;
    if host.loaded.layout == Layout::Mlx {
        return Err(ConvertError::NotHfBf16 { path: src.clone(), reason: "its tensors are named `language_model.model.*`, mlx-lm's layout: it is already converted".into() });
    }
    if let Some(name) = host.loaded.ignored.first() {
        let t = ck.get(name).expect("ignored names come from the checkpoint");
        return Err(ConvertError::UnexpectedTensor { file: ck.path_of(t).to_path_buf(), name: name.clone() });
    }
    let plan = plan(ck, &host, root, opts)?;
    check_overrides_match(&plan, opts)?;
    let cast = cast_dtype(root);

    let staging = Staging::new(&opts.out_dir, "convert")?;
    let sizes: Vec<u64> = plan.iter().map(|p| p.bytes() as u64).collect();
    let tensor_bytes: u64 = sizes.iter().sum();
    let shard_list = writer::shards(&sizes, MLX_SHARD_BYTES);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let state = RefCell::new(WriteState { done: 0, total: tensor_bytes, progress, failed: None });
    let mut weight_map = Map::new();
    for (i, shard) in shard_list.iter().enumerate() {
        let file = writer::shard_name(i, shard_list.len());
        let views: Vec<(String, Lazy)> = shard
            .iter()
            .map(|&k| {
                weight_map.insert(plan[k].name.clone(), Value::String(file.clone()));
                (plan[k].name.clone(), Lazy { planned: &plan[k], ck, cast, threads, state: &state })
            })
            .collect();
        let metadata = HashMap::from([("format".to_string(), "mlx".to_string())]);
        let written = writer::write_safetensors(views, metadata, &staging.path().join(&file));
        // A tensor that could not be produced was written as zeros: report why instead.
        if let Some(e) = state.borrow_mut().failed.take() {
            return Err(e);
        }
        written?;
    }
    {
        let mut s = state.borrow_mut();
        let total = s.total;
        (s.progress)(total, total);
    }
    weight_map.sort_keys();

    let d = staging.path();
    let parameters: u64 = plan
        .iter()
        .filter_map(|p| match p.op {
            // mlx-lm counts leaf modules' parameters: A_log and dt_bias belong to the GatedDeltaNet
            // module itself, and quantized modules count their codes unpacked.
            Op::Float { .. } if p.name.ends_with(".A_log") || p.name.ends_with(".dt_bias") => None,
            Op::Float { .. } => Some(p.shape.iter().product::<usize>() as u64),
            Op::Codes(q) => Some((p.shape.iter().product::<usize>() * 32 / q.bits as usize) as u64),
            Op::Scales(_) | Op::Biases(_) => None,
        })
        .sum();
    let index = json!({ "metadata": { "total_size": tensor_bytes, "total_parameters": parameters }, "weight_map": weight_map });
    writer::write_json_like_python(&d.join("model.safetensors.index.json"), &index)?;
    writer::write_json_like_python(&d.join("config.json"), &mlx_config(root, src, &plan, opts, host.config.moe.is_some()))?;
    copy_side_files(src, d)?;
    let mut card = String::from("---\n");
    if let Some(b) = &opts.base_model {
        card.push_str(&format!("base_model: {b}\n"));
    }
    card.push_str("language: en\nlibrary_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n---\n");
    let readme = d.join("README.md");
    fs::write(&readme, card).map_err(io_err(&readme))?;

    let mut files: Vec<String> = fs::read_dir(d).map_err(io_err(d))?.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned())).collect();
    files.sort();
    staging.commit()?;
    Ok(ConvertSummary {
        out_dir: opts.out_dir.clone(),
        quantized: plan.iter().filter(|p| matches!(p.op, Op::Codes(_))).count(),
        floats: plan.iter().filter(|p| matches!(p.op, Op::Float { .. })).count(),
        parameters,
        tensor_bytes,
        overridden: overridden(&plan, opts, host.config.moe.is_some()),
        files,
    })
}

/// Every output tensor, sorted by name, with the checks that need the source's headers.
fn plan<'a>(ck: &'a Checkpoint, host: &HostModel, root: &Map<String, Value>, opts: &ConvertOptions) -> Result<Vec<Planned<'a>>, ConvertError> {
    let layout = host.loaded.layout;
    let tied = host.config.tie_word_embeddings;
    let cast = cast_dtype(root);
    // mlx-lm shifts the norms only when a conv1d weight is still in the HF layout.
    let shift_norms = ck.tensors().any(|t| t.name.ends_with("conv1d.weight") && t.shape.last() != Some(&1));
    let moe = host.config.moe.is_some();
    let mut out = Vec::new();
    for t in ck.tensors() {
        let Some(name) = mlx_name(&t.name, layout, tied) else { continue };
        let file = || ck.path_of(t).to_path_buf();
        let module = name.strip_suffix(".weight");
        let is_conv = name.ends_with("conv1d.weight");
        // A matrix (2-D, or the experts' 3-D stacks): quantized when the default group size
        // divides its input width (`quantize_model` skips the others), else a float tensor.
        let matrix = |module: &str, shape: Vec<usize>, rows: Option<RowMap>, out: &mut Vec<Planned<'a>>| -> Result<bool, ConvertError> {
            if t.dtype != Dtype::BF16 {
                return Err(ConvertError::NotHfBf16 { path: file(), reason: format!("matrix `{}` is {:?}, not BF16", t.name, t.dtype) });
            }
            let cols = *shape.last().expect("a matrix has dimensions");
            if !cols.is_multiple_of(opts.quant.group_size) {
                return Ok(false);
            }
            let (q, _) = module_params(module, opts, moe);
            if !cols.is_multiple_of(q.group_size) {
                return Err(ConvertError::Indivisible { file: file(), module: module.to_string(), group_size: q.group_size, cols });
            }
            let scale_dtype = cast.unwrap_or(t.dtype);
            let lead = &shape[..shape.len() - 1];
            let with_last = |last: usize| lead.iter().copied().chain([last]).collect::<Vec<usize>>();
            out.push(Planned { name: format!("{module}.weight"), dtype: Dtype::U32, shape: with_last(cols * q.bits as usize / 32), src: t, op: Op::Codes(q), rows });
            out.push(Planned { name: format!("{module}.scales"), dtype: scale_dtype, shape: with_last(cols / q.group_size), src: t, op: Op::Scales(q), rows });
            out.push(Planned { name: format!("{module}.biases"), dtype: scale_dtype, shape: with_last(cols / q.group_size), src: t, op: Op::Biases(q), rows });
            Ok(true)
        };
        // transformers 5's fused experts become mlx-lm's switch_mlp stacks.
        if let Some(prefix) = name.strip_suffix("experts.gate_up_proj").filter(|_| moe) {
            let [e, two_i, d] = t.shape[..] else {
                return Err(ConvertError::NotHfBf16 {
                    path: file(), reason: format!("`{}` has shape {:?}, not [experts, 2·moe_intermediate_size, hidden_size]", t.name, t.shape)
                });
            };
            let i = two_i / 2;
            for (part, offset) in [("gate_proj", 0), ("up_proj", i)] {
                let module = format!("{prefix}switch_mlp.{part}");
                let rows = Some(RowMap { block: two_i, offset, len: i });
                if !matrix(&module, vec![e, i, d], rows, &mut out)? {
                    let dtype = cast.unwrap_or(t.dtype);
                    out.push(Planned { name: format!("{module}.weight"), dtype, shape: vec![e, i, d], src: t, op: Op::Float { shift: false }, rows });
                }
            }
            continue;
        }
        if let Some(prefix) = name.strip_suffix("experts.down_proj").filter(|_| moe) {
            let module = format!("{prefix}switch_mlp.down_proj");
            if !matrix(&module, t.shape.clone(), None, &mut out)? {
                out.push(Planned { name: format!("{module}.weight"), dtype: cast.unwrap_or(t.dtype), shape: t.shape.clone(), src: t, op: Op::Float { shift: false }, rows: None });
            }
            continue;
        }
        if moe && name.contains(".mlp.experts.") {
            return Err(ConvertError::NotHfBf16 {
                path: file(),
                reason: format!(
                    "`{}` is a per-expert tensor; mlx-lm converts the fused `mlp.experts.gate_up_proj` / `down_proj` that transformers 5 saves (load and save the model with transformers first)",
                    t.name
                ),
            });
        }
        if let (Some(module), [_, _], false) = (module, t.shape.as_slice(), is_conv) {
            if matrix(module, t.shape.clone(), None, &mut out)? {
                continue;
            }
        }
        let shape = match t.shape.as_slice() {
            [c, 1, k] | [c, k] if is_conv => vec![*c, *k, 1],
            s => s.to_vec(),
        };
        let dtype = if name.ends_with(".A_log") { t.dtype } else { cast.unwrap_or(t.dtype) };
        let shift = shift_norms && t.shape.len() == 1 && SHIFTED_NORMS.iter().any(|s| name.ends_with(s));
        out.push(Planned { name, dtype, shape, src: t, op: Op::Float { shift }, rows: None });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Every quantized module an override (or the MoE predicate) matched, in model order, as
/// mlx-lm records every dict its predicate returns.
fn overridden(plan: &[Planned], opts: &ConvertOptions, moe: bool) -> Vec<(String, QuantParams)> {
    let mut out: Vec<(String, QuantParams)> = plan
        .iter()
        .filter_map(|p| match p.op {
            Op::Codes(qp) => {
                let m = p.name.trim_end_matches(".weight");
                module_params(m, opts, moe).1.then(|| (m.to_string(), qp))
            }
            _ => None,
        })
        .collect();
    out.sort_by_key(|(m, _)| module_order(m));
    out
}

/// Refuses a `--q-override` that matches no quantized module of the plan: a typo would
/// otherwise convert silently at the default.
fn check_overrides_match(plan: &[Planned], opts: &ConvertOptions) -> Result<(), ConvertError> {
    let quantized: Vec<&str> = plan.iter().filter(|p| matches!(p.op, Op::Codes(_))).map(|p| p.name.trim_end_matches(".weight")).collect();
    for o in &opts.overrides {
        if !quantized.iter().any(|m| o.matches(m)) {
            let example = quantized.iter().find(|m| m.contains(".layers.")).or(quantized.first()).map(|m| m.trim_start_matches("language_model.model.")).unwrap_or("none");
            return Err(ConvertError::InvalidOption {
                flag: "--q-override",
                reason: format!("`{}` matches no quantized module (their paths end like `{example}`; a suffix matches from a `.`)", o.suffix),
            });
        }
    }
    Ok(())
}

/// mlx-lm's `config.json` for the converted model (module docs, "Files").
fn mlx_config(root: &Map<String, Value>, src: &Path, plan: &[Planned], opts: &ConvertOptions, moe: bool) -> Value {
    let mut c = root.clone();
    // `load_config`: a truthy eos_token_id of generation_config.json replaces config.json's.
    if let Ok(Value::Object(g)) = config::read_json(&src.join("generation_config.json")) {
        if let Some(eos) = g.get("eos_token_id").filter(|v| truthy(v)) {
            c.insert("eos_token_id".into(), eos.clone());
        }
    }
    // mlx-lm's `TextModelArgs.__post_init__` renames `rope_type` in the dict the config holds.
    let text = if c.contains_key("text_config") { c.get_mut("text_config").and_then(Value::as_object_mut) } else { Some(&mut c) };
    if let Some(rope) = text.and_then(|t| t.get_mut("rope_parameters")).and_then(Value::as_object_mut) {
        if !rope.contains_key("type") {
            if let Some(v) = rope.shift_remove("rope_type") {
                rope.insert("type".into(), v);
            }
        }
    }
    let quant = opts.quant;
    let mut q = json!({ "group_size": quant.group_size, "bits": quant.bits, "mode": "affine" });
    for (m, qp) in overridden(plan, opts, moe) {
        q[m.as_str()] = json!({ "group_size": qp.group_size, "bits": qp.bits });
    }
    c.shift_remove("_name_or_path");
    c.shift_remove("vision_config");
    c.insert("quantization".into(), q.clone());
    c.insert("quantization_config".into(), q);
    c.sort_keys();
    Value::Object(c)
}

/// Python's truth value of a JSON value (what `if x := d.get(k, False)` tests).
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Copies the tokenizer, template and generation files, and writes a `chat_template` string of
/// `tokenizer_config.json` to `chat_template.jinja` when the source has no such file.
fn copy_side_files(src: &Path, dst: &Path) -> Result<(), ConvertError> {
    for name in COPIED {
        let from = src.join(name);
        if from.is_file() {
            // Read and write rather than fs::copy, which would carry over a read-only mode.
            let bytes = fs::read(&from).map_err(io_err(&from))?;
            let to = dst.join(name);
            fs::write(&to, bytes).map_err(io_err(&to))?;
        }
    }
    let jinja = dst.join("chat_template.jinja");
    let tc = src.join("tokenizer_config.json");
    if !jinja.exists() && tc.is_file() {
        if let Some(t) = config::read_json(&tc)?.get("chat_template").and_then(Value::as_str) {
            fs::write(&jinja, t).map_err(io_err(&jinja))?;
        }
    }
    Ok(())
}

struct WriteState<'a> {
    done: u64,
    total: u64,
    progress: &'a mut dyn FnMut(u64, u64),
    /// The first tensor that could not be produced (the safetensors writer cannot be told).
    failed: Option<ConvertError>,
}

/// A tensor produced when the safetensors writer asks for its bytes.
struct Lazy<'a> {
    planned: &'a Planned<'a>,
    ck: &'a Checkpoint,
    cast: Option<Dtype>,
    threads: usize,
    state: &'a RefCell<WriteState<'a>>,
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.planned.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.planned.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        {
            // The writer asks for tensors in file order and writes each before the next.
            let mut s = self.state.borrow_mut();
            let (done, total) = (s.done, s.total);
            (s.progress)(done, total);
            s.done += self.planned.bytes() as u64;
        }
        let mut out = vec![0u8; self.planned.bytes()];
        if let Err(e) = self.fill(&mut out) {
            self.state.borrow_mut().failed.get_or_insert(e);
        }
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        self.planned.bytes()
    }
}

impl Lazy<'_> {
    fn fill(&self, out: &mut [u8]) -> Result<(), ConvertError> {
        let p = self.planned;
        let t = p.src;
        let bytes = self.ck.bytes(t);
        // The rows this output reads, gathered when they are not the whole source in order.
        let gathered: Vec<u8>;
        let src = match p.rows {
            None => bytes.as_slice(),
            Some(m) => {
                let rb = t.shape.last().copied().unwrap_or(1) * dtype_bytes(t.dtype);
                let n = p.shape[..p.shape.len() - 1].iter().product::<usize>();
                let all = bytes.as_slice();
                gathered = (0..n)
                    .flat_map(|r| {
                        let sr = (r / m.len) * m.block + m.offset + r % m.len;
                        all[sr * rb..(sr + 1) * rb].iter().copied()
                    })
                    .collect();
                &gathered[..]
            }
        };
        let non_finite = || ConvertError::NonFinite { file: self.ck.path_of(t).to_path_buf(), name: t.name.clone() };
        match p.op {
            Op::Float { shift } => {
                let (from, to) = (t.dtype, p.dtype);
                let n: usize = p.shape.iter().product();
                let (fb, tb) = (dtype_bytes(from), dtype_bytes(to));
                if !shift && from == to {
                    out.copy_from_slice(&src[..n * fb]);
                } else {
                    for i in 0..n {
                        let mut x = decode(src, from, i);
                        if shift {
                            x = round_to(x + 1.0, from); // `v + 1.0` in the source dtype
                        }
                        encode(x, to, &mut out[i * tb..(i + 1) * tb]);
                    }
                }
                Ok(())
            }
            Op::Codes(q) | Op::Scales(q) | Op::Biases(q) => {
                let cols = *t.shape.last().expect("a matrix has dimensions");
                let groups = cols / q.group_size;
                let cast = self.cast.unwrap_or(t.dtype);
                let per_word = 32 / q.bits as usize;
                let row_bytes = match p.op {
                    Op::Codes(_) => cols / per_word * 4,
                    _ => groups * dtype_bytes(p.dtype),
                };
                let bad_row = std::sync::atomic::AtomicBool::new(false);
                par_rows(out, row_bytes, self.threads, |r, buf| {
                    let mut w = vec![0f32; cols];
                    let rb = cols * dtype_bytes(t.dtype);
                    let row = &src[r * rb..(r + 1) * rb];
                    for (k, x) in w.iter_mut().enumerate() {
                        *x = round_to(decode(row, t.dtype, k), cast);
                    }
                    if w.iter().any(|x| !x.is_finite()) {
                        bad_row.store(true, std::sync::atomic::Ordering::Relaxed);
                        return;
                    }
                    let mut codes = vec![0u32; q.group_size];
                    for (g, wg) in w.chunks_exact(q.group_size).enumerate() {
                        match p.op {
                            Op::Codes(_) => {
                                quantize_group(wg, q.bits, Some(&mut codes));
                                let words = q.group_size / per_word;
                                for (j, chunk) in codes.chunks_exact(per_word).enumerate() {
                                    let word = chunk.iter().enumerate().fold(0u32, |acc, (e, &c)| acc | c << (e as u32 * q.bits));
                                    let at = (g * words + j) * 4;
                                    buf[at..at + 4].copy_from_slice(&word.to_le_bytes());
                                }
                            }
                            _ => {
                                let (s, b) = quantize_group(wg, q.bits, None);
                                let v = if matches!(p.op, Op::Scales(_)) { s } else { b };
                                let sz = dtype_bytes(p.dtype);
                                encode(v, p.dtype, &mut buf[g * sz..(g + 1) * sz]);
                            }
                        }
                    }
                });
                if bad_row.into_inner() {
                    return Err(non_finite());
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_group_follows_mx_quantize() {
        // |min| > |max|: the scale is positive, the bias is the minimum and codes run up from 0.
        let w = [-1.5f32, -0.5, 0.25, 1.0];
        let mut c = [0u32; 4];
        let (s, b) = quantize_group(&w, 4, Some(&mut c));
        assert_eq!(b, -1.5);
        assert_eq!(s, -1.5 / (-1.5f32 / (2.5 / 15.0)).round_ties_even());
        assert_eq!(c[0], 0);
        assert_eq!(c[3], ((1.0f32 + 1.5) / s).round_ties_even() as u32);
        // |max| ≥ |min|: the scale is negative and the maximum takes code 0.
        let (s, b) = quantize_group(&[0.5, 2.0], 4, Some(&mut c[..2]));
        assert!(s < 0.0);
        assert_eq!((b, c[1]), (2.0, 0));
        // An all-zero group: scale −1e−7, bias 0, codes 0 (what mlx stores for padding rows).
        let (s, b) = quantize_group(&[0.0; 8], 8, Some(&mut c));
        assert_eq!((s, b, c), (-1e-7, 0.0, [0; 4]));
        // Codes are clamped to the 8-bit range.
        quantize_group(&[-3.0, 3.0, 0.0, 1.0], 8, Some(&mut c));
        assert!(c.iter().all(|&q| q <= 255) && c.contains(&255) && c.contains(&0), "{c:?}");
    }

    #[test]
    fn overrides_parse_and_match_on_dotted_suffixes() {
        let o: QuantOverride = "mlp.down_proj=8:32".parse().unwrap();
        assert_eq!(o.params, QuantParams { group_size: 32, bits: 8 });
        assert!(o.matches("language_model.model.layers.0.mlp.down_proj"));
        assert!(!o.matches("language_model.model.layers.0.mlp.xdown_proj"));
        for bad in ["mlp.down_proj", "mlp.down_proj=8", "=8:32", "x=6:64", "x=4:48", "x=four:64"] {
            let e = bad.parse::<QuantOverride>().unwrap_err().to_string();
            assert!(e.starts_with("--q-override:"), "{bad}: {e}");
        }
    }

    #[test]
    fn module_order_is_mlx_lm_s_tree_order() {
        let mut m = vec![
            "language_model.lm_head",
            "language_model.model.layers.10.mlp.down_proj",
            "language_model.model.layers.3.mlp.down_proj",
            "language_model.model.layers.3.self_attn.o_proj",
            "language_model.model.embed_tokens",
            "language_model.model.layers.3.mlp.up_proj",
        ];
        m.sort_by_key(|s| module_order(s));
        assert_eq!(
            m,
            [
                "language_model.model.embed_tokens",
                "language_model.model.layers.3.self_attn.o_proj",
                "language_model.model.layers.3.mlp.down_proj",
                "language_model.model.layers.3.mlp.up_proj",
                "language_model.model.layers.10.mlp.down_proj",
                "language_model.lm_head",
            ]
        );
    }
}
