//! Synthetic Qwen3.5 checkpoints: deterministic random weights at the real shapes of each size,
//! written in the layouts users download, so benchmarks run at real sizes without a download and
//! other engines (mlx-lm, transformers, llama.cpp's `convert_hf_to_gguf.py`) can load the same
//! files.
//!
//! # Layouts
//!
//! * [`SynthLayout::Mlx4Bit`]: what mlx-lm 0.32.2's converter writes (`qwen35-spec.md` §5.2, §6;
//!   `shared/fixtures/*/mlx-q4`): `config.json` with a nested `text_config`, `quantization` and
//!   `quantization_config` blocks and `rope_parameters.type`; `language_model.model.*` names
//!   (`language_model.lm_head.*` for the untied 9B and 27B); every Linear and the embedding as
//!   affine 4-bit (`weight` U32 `[out, in/8]`, element 0 in the low nibble; `scales`/`biases`
//!   BF16 `[out, in/group]`); `conv1d.weight` BF16 `[C, K, 1]`; RMSNorm weights BF16 stored
//!   pre-shifted (`1 + w`); `linear_attn.norm.weight` BF16 plain; `A_log` F32; `dt_bias` BF16;
//!   `model.safetensors.index.json` even for one shard; `chat_template.jinja`. The
//!   mixture-of-experts presets (35B-A3B, 122B-A10B) have the routed experts stacked 3-D as
//!   mlx-lm's `switch_mlp` (`weight` U32 `[E, out, in/8]`, `scales`/`biases` `[E, out, in/group]`),
//!   `mlp.gate`, `mlp.shared_expert.*` and `mlp.shared_expert_gate`; unlike mlx-lm, which stores
//!   the router and shared-expert gate at 8 bits, they are 4-bit here like every other matrix
//!   (under 0.1% of the bytes a token reads).
//! * [`SynthLayout::HfBf16`]: what Qwen releases (§5.1; `shared/fixtures/tiny/hf`):
//!   `model.language_model.*` names, BF16 except `A_log` and `linear_attn.norm.weight` (F32),
//!   routed experts as one `[out, in]` tensor each (`mlp.experts.{e}.gate_proj.weight`, as the
//!   Qwen MoE releases and llama.cpp's converter read them),
//!   zero-centred RMSNorm weights (the model uses `1 + w`), `conv1d.weight` `[C, 1, K]`, no
//!   `lm_head.weight` when tied, `lm_head.weight` for 9B and 27B. The vision tower and the MTP
//!   head are not written; `config.json` keeps a small `vision_config` so transformers 5.x builds
//!   `Qwen3_5ForConditionalGeneration` from it (the tower is then randomly initialised).
//!   `mtp_num_hidden_layers` stays 1 as in the real config: llama.cpp converters that bundle MTP
//!   layers need `--no-mtp` for these files.
//!
//! # One model, two layouts
//!
//! The 4-bit codes, scales and biases are drawn directly (never by quantizing floats, which
//! would be too slow at 9B). The HF layout stores, for every quantized matrix, the dequantized
//! values of the MLX group-64 checkpoint of the same seed, `bf16(s·q + b)` with `s·q + b` in
//! f32, and the same norm, conv, `A_log` and `dt_bias` values (norms on a grid where `w` and
//! `1 + w` are both exact in bf16). So `--layout hf` and the default MLX layout of one seed are
//! the same model up to that one rounding (MLX group sizes 32 and 128 draw other scales). Checked
//! with mlx-lm 0.32.2 on the 0.8B: its `convert` of the HF files reproduces our MLX norms, conv,
//! `A_log` and gated-norm weights bit for bit, and its float32 logits on the two differ by at
//! most 1.3 (std 4), 16 of 18 argmaxes equal: the bf16 rounding, amplified by 24 random layers.
//! transformers 5.24 loads the HF 0.8B as `Qwen3_5ForCausalLM` with no missing or unexpected
//! keys (as `Qwen3_5ForConditionalGeneration`, only the vision tower is missing), and its
//! float32 hidden states and logits match mlx-lm's on the same weights to 5e−5 and 5.4e−4.
//!
//! # Weight scales
//!
//! Chosen so activations stay O(1) through any number of layers and logits have a standard
//! deviation of about [`LOGIT_STD`] (every distribution is uniform, with the stated std):
//! * input projections (`in_proj_*`, `q/k/v_proj`, `gate/up_proj`): std `1/√fan_in`, so each
//!   output of an RMS-normalised input has variance ≈ 1;
//! * residual-writing projections (`out_proj`, `o_proj`, `down_proj`): std
//!   `1/√(fan_in · 2L)`; the residual stream then receives 2L contributions of variance ≈ 1/(2L)
//!   each (times the O(1) inner activation), so its RMS stays O(1) instead of growing like √L;
//! * `embed_tokens` (and the untied `lm_head`): std `1/√D` per element (rows of norm ≈ 1), and
//!   the final `norm` has gain [`LOGIT_STD`] = 4, so the logits (head rows dotted with the
//!   normalised state, RMS 4) have std ≈ 4. The embedding is deliberately small: with a tied
//!   head the token's own row also sits in the final state, adding ≈ `σ_e²·D·gain/RMS(x)` to its
//!   own logit. With std 0.5 that is ≈ 80 against a spread of 4, and mlx-lm's greedy decode of
//!   such a checkpoint only ever repeated the last prompt token; at `1/√D` the own-token bonus is
//!   under 2 std. Real checkpoints look the same way (small embeddings, large final-norm gains).
//!   Measured with mlx-lm on the 0.8B: logit std 4.0 at every position, varied argmaxes, and a
//!   residual-stream RMS growing smoothly from 0.12 after layer 0 to 0.54 after layer 23;
//! * other RMSNorm weights: effective gain `1 ± 10 %` (uniform);
//! * `linear_attn.norm.weight` (gated norm, plain weight): `1 ± 10 %`;
//! * `A_log`: uniform in [−2.5, 1.0], so `exp(A_log)` spans 0.08 … 2.7 and the per-token decay
//!   `exp(−exp(A_log)·softplus(a + dt_bias))` covers slow to fast heads (the real 4B range is
//!   −2.69 … 2.05, spec P10);
//! * `dt_bias`: uniform in [0, 1);
//! * `conv1d.weight`: std [`CONV_STD`] = 0.4, so the 4-tap conv keeps unit-variance inputs at
//!   RMS ≈ 0.8;
//! * embedding (and `lm_head`) rows at and past id 248 077 (the tokenizer's id count) are zero,
//!   as the padding rows of the fixtures: their logits are 0, far below the real ids' maxima, so
//!   greedy decoding never emits an id the tokenizer cannot decode.
//!
//! 4-bit groups: codes are uniform nibbles (mean 7.5, variance 255/12); a group's scale is
//! `±s₀·j` with a random sign (real MLX scales are negative in about half the groups, spec P22)
//! and a jitter `j` uniform in [0.5, 1.5), `s₀ = std / √(255/12 · 13/12)`; the bias is
//! `bf16(−7.5 · scale)`, so every group is centred on 0 and the dequantized std is the target.
//!
//! # Determinism
//!
//! Every value comes from a counter-based SplitMix64 stream (Steele, Lea & Flood, "Fast
//! splittable pseudorandom number generators", OOPSLA 2014): output `i` of a stream with key
//! `k` is `mix64(k + (i + 1)·γ)`, exactly the i-th output of SplitMix64 seeded with `k`. The
//! key is `mix64(FNV-1a(name ‖ 0xFF ‖ purpose) ⊕ mix64(seed + γ))`, where `name` is the tensor's
//! layout-independent name (`layers.3.self_attn.q_proj`) and `purpose` is `codes`, `scales` or
//! `values`. Each value is a function of (seed, name, purpose, index) alone, so values do not
//! depend on write order, thread count or layout, and the same seed gives byte-identical files.
//! Only IEEE basic operations and `sqrt` turn random bits into values (no libm), so the bytes
//! are the same on every platform.
//!
//! # Writing
//!
//! Tensors are produced lazily through `safetensors::View`, one at a time, generated in
//! parallel over rows with `std::thread::scope`: peak memory is one tensor (the 27B HF
//! embedding and `lm_head`, 2.5 GB each, are the largest). Everything is written into a
//! temporary directory beside `out_dir` and renamed into place only when complete; on error the
//! temporary directory is removed.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use half::bf16;
use safetensors::{Dtype, SafeTensorError, View};
use serde_json::{json, Value};

use crate::writer::{self, par_rows, write_json, Staging, WriteError};

/// Padded vocabulary size of every Qwen3.5 size (`vocab_size` in `text_config`).
pub const VOCAB_SIZE: usize = 248_320;
/// Ids the Qwen3.5 tokenizer produces (248 044 BPE ranks + 33 specials); rows past it are padding.
pub const TOKENIZER_IDS: usize = 248_077;
/// mlx-lm's default quantization group size.
pub const MLX_DEFAULT_GROUP_SIZE: usize = 64;
/// Intended standard deviation of the logits: the final norm's gain, given head rows of norm ≈ 1.
pub const LOGIT_STD: f64 = 4.0;
/// Standard deviation of the GDN depthwise conv weights.
pub const CONV_STD: f64 = 0.4;

/// `<|endoftext|>`: `text_config.eos_token_id` of the real configs.
const ENDOFTEXT_ID: u64 = 248_044;
/// `<|im_end|>`: the chat turn terminator, first EOS id of `generation_config.json`.
const IM_END_ID: u64 = 248_046;
const VISION_START_ID: u64 = 248_053;
const VISION_END_ID: u64 = 248_054;
const IMAGE_TOKEN_ID: u64 = 248_056;
const VIDEO_TOKEN_ID: u64 = 248_057;
/// Group size of the 4-bit structure that the HF layout stores dequantized.
const HF_GROUP_SIZE: usize = 64;
/// Relative half-width of the uniform jitter on RMSNorm gains.
const NORM_JITTER: f64 = 0.1;
/// Shard limit of mlx-lm's `make_shards` (`MAX_FILE_SIZE_GB = 5`, shifted by 30).
const MLX_SHARD_BYTES: u64 = 5 << 30;
/// transformers' customary `max_shard_size="5GB"` (decimal).
const HF_SHARD_BYTES: u64 = 5_000_000_000;

const CHAT_TEMPLATE: &str = "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// A Qwen3.5 size, with the real `text_config` of that size (`qwen35-spec.md` §1).
#[allow(non_camel_case_types)] // the size is part of the name: Qwen35_0_8B reads as "Qwen3.5-0.8B"
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// Qwen3.5-0.8B: D 1024, 24 layers, I 3584, 8/2 heads, GDN 16/16 heads, tied.
    Qwen35_0_8B,
    /// Qwen3.5-2B: D 2048, 24 layers, I 6144, 8/2 heads, GDN 16/16 heads, tied.
    Qwen35_2B,
    /// Qwen3.5-4B: D 2560, 32 layers, I 9216, 16/4 heads, GDN 16/32 heads, tied.
    Qwen35_4B,
    /// Qwen3.5-9B: D 4096, 32 layers, I 12288, 16/4 heads, GDN 16/32 heads, untied `lm_head`.
    Qwen35_9B,
    /// Qwen3.5-27B, the largest dense size: D 5120, 64 layers, I 17408, 24/4 heads, GDN 16/48
    /// heads, untied `lm_head`.
    Qwen35_27B,
    /// Qwen3.5-35B-A3B, mixture of experts: D 2048, 40 layers, 16/2 heads, GDN 16/32 heads,
    /// 256 experts of 512, top-8, a shared expert of 512, untied `lm_head`.
    Qwen35_35B_A3B,
    /// Qwen3.5-122B-A10B, mixture of experts: D 3072, 48 layers, 32/2 heads, GDN 16/64 heads,
    /// 256 experts of 1024, top-8, a shared expert of 1024, untied `lm_head` (see [`Preset::dims`]
    /// for which numbers are published).
    Qwen35_122B_A10B,
}

impl Preset {
    /// Every dense preset, smallest first (the mixture-of-experts ones are [`Preset::MOE`]).
    pub const ALL: [Preset; 5] = [Preset::Qwen35_0_8B, Preset::Qwen35_2B, Preset::Qwen35_4B, Preset::Qwen35_9B, Preset::Qwen35_27B];
    /// The mixture-of-experts sizes (`qwen3_5_moe`).
    pub const MOE: [Preset; 2] = [Preset::Qwen35_35B_A3B, Preset::Qwen35_122B_A10B];

    /// The name [`FromStr`] accepts: `qwen3.5-0.8b`, `qwen3.5-2b`, `qwen3.5-4b`, `qwen3.5-9b`,
    /// `qwen3.5-27b`, `qwen3.5-35b-a3b`, `qwen3.5-122b-a10b`.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Qwen35_0_8B => "qwen3.5-0.8b",
            Preset::Qwen35_2B => "qwen3.5-2b",
            Preset::Qwen35_4B => "qwen3.5-4b",
            Preset::Qwen35_9B => "qwen3.5-9b",
            Preset::Qwen35_27B => "qwen3.5-27b",
            Preset::Qwen35_35B_A3B => "qwen3.5-35b-a3b",
            Preset::Qwen35_122B_A10B => "qwen3.5-122b-a10b",
        }
    }

    /// Dimensions of the text decoder: spec §1 table; 27B from its published `config.json`
    /// (the `text_config` of https://huggingface.co/Qwen/Qwen3.5-27B as reproduced in public
    /// code, agreeing with the model card's architecture table).
    ///
    /// The MoE sizes: 35B-A3B is transformers 5.24's `Qwen3_5MoeTextConfig` defaults, which its
    /// docs give as the Qwen/Qwen3.5-35B-A3B configuration. For 122B-A10B the published model
    /// description gives 48 layers, hidden size 3072, 32 attention heads, 256 experts with 8
    /// routed and 1 shared per token; the KV heads (2), GDN heads (16/64), expert and shared widths
    /// (1024) are not in a source found here and follow the family's pattern (an estimate).
    fn dims(self) -> Dims {
        let moe = match self {
            Preset::Qwen35_35B_A3B => Some(SynthMoe { experts: 256, per_tok: 8, expert: 512, shared: 512 }),
            Preset::Qwen35_122B_A10B => Some(SynthMoe { experts: 256, per_tok: 8, expert: 1024, shared: 1024 }),
            _ => None,
        };
        let (hidden, layers, intermediate, heads, kv_heads, lin_v_heads, tied) = match self {
            Preset::Qwen35_0_8B => (1024, 24, 3584, 8, 2, 16, true),
            Preset::Qwen35_2B => (2048, 24, 6144, 8, 2, 16, true),
            Preset::Qwen35_4B => (2560, 32, 9216, 16, 4, 32, true),
            Preset::Qwen35_9B => (4096, 32, 12288, 16, 4, 32, false),
            Preset::Qwen35_27B => (5120, 64, 17408, 24, 4, 48, false),
            Preset::Qwen35_35B_A3B => (2048, 40, 0, 16, 2, 32, false),
            Preset::Qwen35_122B_A10B => (3072, 48, 0, 32, 2, 64, false),
        };
        Dims {
            hidden,
            layers,
            intermediate,
            heads,
            kv_heads,
            head_dim: 256,
            lin_k_heads: 16,
            lin_v_heads,
            lin_k_dim: 128,
            lin_v_dim: 128,
            conv_kernel: 4,
            vocab: VOCAB_SIZE,
            live_rows: TOKENIZER_IDS,
            tied,
            moe,
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = SynthError;

    /// Parses `qwen3.5-0.8b` | `qwen3.5-2b` | `qwen3.5-4b` | `qwen3.5-9b` | `qwen3.5-27b` |
    /// `qwen3.5-35b-a3b` | `qwen3.5-122b-a10b` (ASCII case ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::ALL.into_iter().chain(Preset::MOE).find(|p| p.name().eq_ignore_ascii_case(s.trim())).ok_or_else(|| SynthError::UnknownPreset(s.to_string()))
    }
}

/// How the checkpoint is stored on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthLayout {
    /// mlx-lm's affine 4-bit layout; `group_size` is 32, 64 (mlx-lm's default) or 128.
    Mlx4Bit { group_size: usize },
    /// Qwen's bf16 release layout (F32 `A_log` and gated-norm weight).
    HfBf16,
}

impl Default for SynthLayout {
    fn default() -> Self {
        SynthLayout::Mlx4Bit { group_size: MLX_DEFAULT_GROUP_SIZE }
    }
}

impl FromStr for SynthLayout {
    type Err = SynthError;

    /// Parses `mlx` (4-bit, group 64) or `hf` (bf16).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "mlx" | "mlx-4bit" | "mlx-q4" => Ok(SynthLayout::default()),
            "hf" | "hf-bf16" => Ok(SynthLayout::HfBf16),
            _ => Err(SynthError::InvalidOption { option: "layout", reason: format!("{s:?} is not one of mlx, hf") }),
        }
    }
}

/// What to write.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// Which size's configuration and shapes.
    pub preset: Preset,
    /// Storage layout.
    pub layout: SynthLayout,
    /// Seed of every weight (see the module docs: same seed, byte-identical files).
    pub seed: u64,
    /// A `tokenizer.json` to copy in; checked to load and to fit the 248 320-row vocabulary.
    pub tokenizer: Option<PathBuf>,
    /// Directory to create; it must not exist or be empty.
    pub out_dir: PathBuf,
    /// Writes only this many decoder layers (≥ 1) instead of the preset's, for small tests;
    /// `num_hidden_layers` and `layer_types` in the config follow it.
    pub num_hidden_layers: Option<usize>,
}

/// What [`write_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthSummary {
    /// The finished checkpoint directory.
    pub out_dir: PathBuf,
    /// Text-model parameters (4-bit weights counted unpacked; scales and biases not counted).
    pub parameters: u64,
    /// Bytes of tensor data in the safetensors files (headers excluded).
    pub tensor_bytes: u64,
    /// Bytes of every file written, headers, configs and tokenizer included.
    pub bytes_written: u64,
    /// File names inside `out_dir`, sorted.
    pub files: Vec<String>,
}

/// Errors of [`write_checkpoint`] and the parsers of this module.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown preset {0:?}: expected one of qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b, qwen3.5-9b, qwen3.5-27b, qwen3.5-35b-a3b, qwen3.5-122b-a10b")]
    UnknownPreset(String),
    #[error("invalid {option}: {reason}")]
    InvalidOption { option: &'static str, reason: String },
    #[error("output directory {0} exists and is not empty: refusing to overwrite it")]
    OutDirNotEmpty(PathBuf),
    #[error("output path {0} exists and is not a directory")]
    OutPathNotDir(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Safetensors {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
}

impl From<WriteError> for SynthError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::OutDirNotEmpty(p) => SynthError::OutDirNotEmpty(p),
            WriteError::OutPathNotDir(p) => SynthError::OutPathNotDir(p),
            WriteError::NoFileName(p) => SynthError::InvalidOption { option: "out_dir", reason: format!("{} has no final component", p.display()) },
            WriteError::Io { path, source } => SynthError::Io { path, source },
            WriteError::Safetensors { path, source } => SynthError::Safetensors { path, source },
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io { path: path.to_path_buf(), source }
}

/// The real `text_config` of a size (spec §1), keys in the order of the released 0.8B file.
pub fn preset_text_config(p: Preset) -> Value {
    text_config(&p.dims())
}

/// Writes a complete random-weight checkpoint of `opts.preset` in `opts.layout` to
/// `opts.out_dir`, calling `progress(bytes_done, bytes_total)` (tensor data bytes) as it goes.
///
/// Errors: [`SynthError::OutDirNotEmpty`] / [`SynthError::OutPathNotDir`] when `out_dir` is
/// taken (nothing is touched then); [`SynthError::InvalidOption`] for a group size other than
/// 32/64/128 or zero layers; [`SynthError::Tokenizer`] when the tokenizer does not load or has
/// more ids than `vocab_size`; [`SynthError::Io`] / [`SynthError::Safetensors`] while writing,
/// after which no partial checkpoint is left behind.
pub fn write_checkpoint(opts: &SynthOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<SynthSummary, SynthError> {
    let mut dims = opts.preset.dims();
    if let Some(n) = opts.num_hidden_layers {
        if n == 0 {
            return Err(SynthError::InvalidOption { option: "num_hidden_layers", reason: "must be at least 1".into() });
        }
        dims.layers = n;
    }
    write_dims(&dims, opts, progress)
}

// ---------------------------------------------------------------------------------------------
// Dimensions and configs

/// The experts of a mixture-of-experts size (`text_config` keys `num_experts`,
/// `num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SynthMoe {
    experts: usize,
    per_tok: usize,
    expert: usize,
    shared: usize,
}

/// Text-decoder dimensions, named after the `text_config` keys.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Dims {
    hidden: usize,
    layers: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    lin_k_heads: usize,
    lin_v_heads: usize,
    lin_k_dim: usize,
    lin_v_dim: usize,
    conv_kernel: usize,
    vocab: usize,
    /// Embedding rows below this are random; rows at and past it are zero (padding).
    live_rows: usize,
    tied: bool,
    /// The experts of a `qwen3_5_moe` size (`intermediate` is then unused).
    moe: Option<SynthMoe>,
}

impl Dims {
    fn key_dim(&self) -> usize {
        self.lin_k_heads * self.lin_k_dim
    }
    fn value_dim(&self) -> usize {
        self.lin_v_heads * self.lin_v_dim
    }
    fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Spec §2: layer ℓ is full attention iff (ℓ+1) mod 4 == 0.
    fn is_full_attention(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(4)
    }
}

fn text_config(d: &Dims) -> Value {
    let mut c = dense_text_config(d);
    if let (Some(m), Some(o)) = (d.moe, c.as_object_mut()) {
        o.shift_remove("intermediate_size");
        o.insert("model_type".into(), "qwen3_5_moe_text".into());
        o.insert("moe_intermediate_size".into(), m.expert.into());
        o.insert("num_experts".into(), m.experts.into());
        o.insert("num_experts_per_tok".into(), m.per_tok.into());
        o.insert("router_aux_loss_coef".into(), 0.001.into());
        o.insert("shared_expert_intermediate_size".into(), m.shared.into());
    }
    c
}

fn dense_text_config(d: &Dims) -> Value {
    let layer_types: Vec<&str> = (0..d.layers).map(|l| if d.is_full_attention(l) { "full_attention" } else { "linear_attention" }).collect();
    json!({
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_output_gate": true,
        "dtype": "bfloat16",
        "eos_token_id": ENDOFTEXT_ID,
        "full_attention_interval": 4,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": d.conv_kernel,
        "linear_key_head_dim": d.lin_k_dim,
        "linear_num_key_heads": d.lin_k_heads,
        "linear_num_value_heads": d.lin_v_heads,
        "linear_value_head_dim": d.lin_v_dim,
        "max_position_embeddings": 262_144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": false,
        "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": d.tied,
        "use_cache": true,
        "vocab_size": d.vocab,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": true,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25
        }
    })
}

/// HF `config.json`: the released file's top level, with a small vision tower we do not write.
fn hf_config(d: &Dims) -> Value {
    let (arch, model_type) = if d.moe.is_some() { ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe") } else { ("Qwen3_5ForConditionalGeneration", "qwen3_5") };
    json!({
        "architectures": [arch],
        "image_token_id": IMAGE_TOKEN_ID,
        "model_type": model_type,
        "text_config": text_config(d),
        "tie_word_embeddings": d.tied,
        "video_token_id": VIDEO_TOKEN_ID,
        // Not the real tower (no vision tensors are written): small but complete, so the
        // multimodal class can be built; text-only loaders ignore it.
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": 1,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 64,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "model_type": model_type,
            "num_heads": 2,
            "num_position_embeddings": 2304,
            "out_hidden_size": d.hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2
        },
        "vision_end_token_id": VISION_END_ID,
        "vision_start_token_id": VISION_START_ID
    })
}

/// MLX `config.json` as mlx-lm's `save_config` leaves it: top-level keys sorted, `eos_token_id`
/// taken from `generation_config.json`, `vision_config` dropped, `rope_type` renamed `type`
/// (moved last), and the quantization block written twice.
fn mlx_config(d: &Dims, group_size: usize) -> Value {
    let mut tc = text_config(d);
    if let Some(rope) = tc.get_mut("rope_parameters").and_then(Value::as_object_mut) {
        if let Some(t) = rope.shift_remove("rope_type") {
            rope.insert("type".into(), t);
        }
    }
    let q = json!({ "group_size": group_size, "bits": 4, "mode": "affine" });
    let (arch, model_type) = if d.moe.is_some() { ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe") } else { ("Qwen3_5ForConditionalGeneration", "qwen3_5") };
    json!({
        "architectures": [arch],
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "image_token_id": IMAGE_TOKEN_ID,
        "model_type": model_type,
        "quantization": q.clone(),
        "quantization_config": q,
        "text_config": tc,
        "tie_word_embeddings": d.tied,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_end_token_id": VISION_END_ID,
        "vision_start_token_id": VISION_START_ID
    })
}

// ---------------------------------------------------------------------------------------------
// Tensors

/// How a logical tensor is initialised (see the module docs for the scales).
#[derive(Clone, Copy, Debug)]
enum Init {
    /// A Linear weight `[out, in]`, 4-bit in MLX.
    Linear {
        std: f64,
    },
    /// An embedding-shaped matrix `[vocab, D]` (also the untied head), 4-bit in MLX; rows at and
    /// past `Dims::live_rows` are zero.
    Embedding {
        std: f64,
    },
    /// An RMSNorm weight used as `1 + w` with effective gain ≈ `gain`.
    ShiftedNorm {
        gain: f64,
    },
    /// The gated RMSNorm's plain weight (≈ 1).
    GatedNorm,
    ALog,
    DtBias,
    /// Depthwise conv `[C, K]`.
    Conv,
}

/// A tensor of the text model in layout-independent terms.
#[derive(Clone, Debug)]
struct Logical {
    /// Name without the model prefix or `.weight`: `embed_tokens`, `layers.0.linear_attn.A_log`.
    key: String,
    /// Whether the stored name ends in `.weight` (all but `A_log` and `dt_bias`).
    weight_suffix: bool,
    init: Init,
    /// HF shape (`[out, in]` for matrices, `[C, K]` for the conv, `[n]` for vectors).
    shape: Vec<usize>,
}

impl Logical {
    fn quantized(&self) -> bool {
        matches!(self.init, Init::Linear { .. } | Init::Embedding { .. })
    }
    fn elements(&self) -> u64 {
        self.shape.iter().map(|&n| n as u64).product()
    }
    /// Input width of a matrix (the last dimension, also of the experts' 3-D stacks).
    fn cols(&self) -> usize {
        *self.shape.last().expect("a tensor has dimensions")
    }
}

fn logical_tensors(d: &Dims) -> Vec<Logical> {
    let mut out = Vec::new();
    let mut push = |key: String, init: Init, shape: Vec<usize>| {
        let weight_suffix = !(key.ends_with(".A_log") || key.ends_with(".dt_bias"));
        out.push(Logical { key, weight_suffix, init, shape });
    };
    let inv_sqrt = |n: usize| 1.0 / (n as f64).sqrt();
    let two_l = 2 * d.layers;
    let (dm, hv) = (d.hidden, d.lin_v_heads);
    let embed_std = inv_sqrt(dm); // rows of norm ≈ 1 (module docs)
    push("embed_tokens".into(), Init::Embedding { std: embed_std }, vec![d.vocab, dm]);
    for l in 0..d.layers {
        let p = format!("layers.{l}.");
        let unit = Init::ShiftedNorm { gain: 1.0 };
        push(format!("{p}input_layernorm"), unit, vec![dm]);
        push(format!("{p}post_attention_layernorm"), unit, vec![dm]);
        let lin = |fan_in: usize| Init::Linear { std: inv_sqrt(fan_in) };
        let out_lin = |fan_in: usize| Init::Linear { std: inv_sqrt(fan_in * two_l) };
        if d.is_full_attention(l) {
            let a = format!("{p}self_attn.");
            let (q_out, kv_out) = (2 * d.heads * d.head_dim, d.kv_heads * d.head_dim);
            push(format!("{a}q_proj"), lin(dm), vec![q_out, dm]);
            push(format!("{a}k_proj"), lin(dm), vec![kv_out, dm]);
            push(format!("{a}v_proj"), lin(dm), vec![kv_out, dm]);
            push(format!("{a}o_proj"), out_lin(d.heads * d.head_dim), vec![dm, d.heads * d.head_dim]);
            push(format!("{a}q_norm"), unit, vec![d.head_dim]);
            push(format!("{a}k_norm"), unit, vec![d.head_dim]);
        } else {
            let a = format!("{p}linear_attn.");
            push(format!("{a}in_proj_qkv"), lin(dm), vec![d.conv_dim(), dm]);
            push(format!("{a}in_proj_z"), lin(dm), vec![d.value_dim(), dm]);
            push(format!("{a}in_proj_b"), lin(dm), vec![hv, dm]);
            push(format!("{a}in_proj_a"), lin(dm), vec![hv, dm]);
            push(format!("{a}conv1d"), Init::Conv, vec![d.conv_dim(), d.conv_kernel]);
            push(format!("{a}dt_bias"), Init::DtBias, vec![hv]);
            push(format!("{a}A_log"), Init::ALog, vec![hv]);
            push(format!("{a}norm"), Init::GatedNorm, vec![d.lin_v_dim]);
            push(format!("{a}out_proj"), out_lin(d.value_dim()), vec![dm, d.value_dim()]);
        }
        match d.moe {
            None => {
                push(format!("{p}mlp.gate_proj"), lin(dm), vec![d.intermediate, dm]);
                push(format!("{p}mlp.up_proj"), lin(dm), vec![d.intermediate, dm]);
                push(format!("{p}mlp.down_proj"), out_lin(d.intermediate), vec![dm, d.intermediate]);
            }
            Some(m) => {
                // mlx-lm's layout: the router, the experts stacked 3-D [E, out, in], the shared
                // expert and its gate. Each token's MLP output is a weighted mean of experts
                // plus the gated shared expert, so the experts take the dense scales.
                push(format!("{p}mlp.gate"), lin(dm), vec![m.experts, dm]);
                push(format!("{p}mlp.switch_mlp.gate_proj"), lin(dm), vec![m.experts, m.expert, dm]);
                push(format!("{p}mlp.switch_mlp.up_proj"), lin(dm), vec![m.experts, m.expert, dm]);
                push(format!("{p}mlp.switch_mlp.down_proj"), out_lin(m.expert), vec![m.experts, dm, m.expert]);
                push(format!("{p}mlp.shared_expert.gate_proj"), lin(dm), vec![m.shared, dm]);
                push(format!("{p}mlp.shared_expert.up_proj"), lin(dm), vec![m.shared, dm]);
                push(format!("{p}mlp.shared_expert.down_proj"), out_lin(m.shared), vec![dm, m.shared]);
                push(format!("{p}mlp.shared_expert_gate"), lin(dm), vec![1, dm]);
            }
        }
    }
    push("norm".into(), Init::ShiftedNorm { gain: LOGIT_STD }, vec![dm]);
    if !d.tied {
        push("lm_head".into(), Init::Embedding { std: embed_std }, vec![d.vocab, dm]);
    }
    out
}

/// Which bytes of a logical tensor a stored tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// MLX packed 4-bit codes, U32 `[out, in/8]`.
    Codes,
    /// MLX per-group scales, BF16 `[out, in/group]`.
    Scales { group: usize },
    /// MLX per-group biases, BF16 `[out, in/group]`.
    Biases { group: usize },
    /// HF dequantized matrix, BF16 `[out, in]`: rows `row0..` of the logical tensor's rows
    /// (all of them, or one expert's `[out, in]` of the experts' `[E, out, in]`).
    Dequant { row0: usize },
    /// Everything else: the values in the layout's encoding.
    Values,
}

/// A tensor as stored.
#[derive(Clone, Debug)]
struct Stored {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    logical: usize,
    part: Part,
}

impl Stored {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

fn stored_tensors(logical: &[Logical], layout: SynthLayout) -> Vec<Stored> {
    let mut out = Vec::new();
    for (i, t) in logical.iter().enumerate() {
        let base = match layout {
            SynthLayout::Mlx4Bit { .. } if t.key == "lm_head" => "language_model.lm_head".to_string(),
            SynthLayout::Mlx4Bit { .. } => format!("language_model.model.{}", t.key),
            SynthLayout::HfBf16 if t.key == "lm_head" => "lm_head".to_string(),
            SynthLayout::HfBf16 => format!("model.language_model.{}", t.key),
        };
        let name = |suffix: &str| format!("{base}{suffix}");
        let weight = if t.weight_suffix { ".weight" } else { "" };
        let mut push = |name: String, dtype: Dtype, shape: Vec<usize>, part: Part| {
            out.push(Stored { name, dtype, shape, logical: i, part });
        };
        match (layout, t.init) {
            (SynthLayout::Mlx4Bit { group_size }, _) if t.quantized() => {
                // [out, in] or the experts' [E, out, in]: the last dimension is packed.
                let (lead, cols) = (&t.shape[..t.shape.len() - 1], t.cols());
                let with_last = |n: usize| lead.iter().copied().chain([n]).collect::<Vec<usize>>();
                push(name(".weight"), Dtype::U32, with_last(cols / 8), Part::Codes);
                let g = cols / group_size;
                push(name(".scales"), Dtype::BF16, with_last(g), Part::Scales { group: group_size });
                push(name(".biases"), Dtype::BF16, with_last(g), Part::Biases { group: group_size });
            }
            (SynthLayout::HfBf16, _) if t.quantized() && t.shape.len() == 3 => {
                // The experts as Qwen releases them: one `[out, in]` tensor per expert
                // (`mlp.experts.{e}.gate_proj.weight`), rows e·out.. of the stack.
                let (experts, rows) = (t.shape[0], t.shape[1]);
                for e in 0..experts {
                    let hf = base.replace(".mlp.switch_mlp.", &format!(".mlp.experts.{e}."));
                    push(format!("{hf}.weight"), Dtype::BF16, t.shape[1..].to_vec(), Part::Dequant { row0: e * rows });
                }
            }
            (SynthLayout::HfBf16, _) if t.quantized() => push(name(".weight"), Dtype::BF16, t.shape.clone(), Part::Dequant { row0: 0 }),
            (SynthLayout::Mlx4Bit { .. }, Init::Conv) => push(name(weight), Dtype::BF16, vec![t.shape[0], t.shape[1], 1], Part::Values),
            (SynthLayout::HfBf16, Init::Conv) => push(name(weight), Dtype::BF16, vec![t.shape[0], 1, t.shape[1]], Part::Values),
            (_, Init::ALog) => push(name(weight), Dtype::F32, t.shape.clone(), Part::Values),
            (SynthLayout::HfBf16, Init::GatedNorm) => push(name(weight), Dtype::F32, t.shape.clone(), Part::Values),
            _ => push(name(weight), Dtype::BF16, t.shape.clone(), Part::Values),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Random streams

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (Stafford's "Mix13" variant, as in Java's SplittableRandom).
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A counter-based SplitMix64 stream: `at(i)` is the i-th output of SplitMix64 seeded with the key.
#[derive(Clone, Copy, Debug)]
struct Stream(u64);

impl Stream {
    fn new(seed: u64, name: &str, purpose: &str) -> Stream {
        // FNV-1a over name ‖ 0xFF ‖ purpose (0xFF never occurs in UTF-8, so the split is unique).
        let mut h: u64 = 0xCBF2_9CE4_8422_2325;
        for b in name.bytes().chain([0xFF]).chain(purpose.bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01B3);
        }
        Stream(mix64(h ^ mix64(seed.wrapping_add(GAMMA))))
    }

    #[inline]
    fn at(self, i: u64) -> u64 {
        mix64(self.0.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
    }

    /// Uniform in [0, 1) with 53 random bits.
    #[inline]
    fn unit(self, i: u64) -> f64 {
        (self.at(i) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Scale and bias of group `g` of row `row` of a 4-bit matrix (module docs, "4-bit groups").
#[inline]
fn group_scale_bias(scales: Stream, s0: f64, groups_per_row: usize, row: usize, g: usize) -> (bf16, bf16) {
    let d = scales.at((row * groups_per_row + g) as u64);
    let jitter = 0.5 + (d >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    let sign = if d & 1 == 0 { 1.0 } else { -1.0 };
    let s = bf16::from_f64(sign * s0 * jitter);
    (s, bf16::from_f32(-7.5 * s.to_f32()))
}

/// What mlx's quantizer stores for an all-zero group (spec §6.3): scale −1e−7, bias 0, codes 0.
fn zero_group_scale() -> bf16 {
    bf16::from_f32(-1e-7)
}

/// `s₀` such that uniform codes times `±s₀·U[0.5, 1.5)` have standard deviation `std`.
fn base_scale(std: f64) -> f64 {
    std / (255.0 / 12.0 * 13.0 / 12.0_f64).sqrt()
}

/// A norm weight `gain·(1 ± jitter)` rounded to a multiple of `2^(E−8)`, where `2^E` (E ≥ 1) is
/// the first power of two above every possible value: then the value `v` and `v − 1` both have
/// at most 8 significant bits, so both are exact in bf16 and the two layouts hold the same weight
/// (1/128 steps for gains near 1, 1/32 for the final norm's gain of 4).
fn norm_value(stream: Stream, i: usize, gain: f64) -> f32 {
    let x = gain * (1.0 + NORM_JITTER * (2.0 * stream.unit(i as u64) - 1.0));
    let mut top = 2.0;
    while gain * (1.0 + NORM_JITTER) >= top {
        top *= 2.0;
    }
    let step = top / 256.0;
    let k = (x / step + 0.5).floor().clamp(1.0, 255.0);
    (k * step) as f32
}

/// Generates the bytes of stored tensors.
struct Generator<'a> {
    seed: u64,
    /// Whether shifted norms are stored zero-centred (HF) rather than as `1 + w` (MLX).
    zero_centred_norms: bool,
    dims: &'a Dims,
    logical: &'a [Logical],
    threads: usize,
}

impl Generator<'_> {
    fn bytes(&self, t: &Stored) -> Vec<u8> {
        let mut out = vec![0u8; t.bytes()];
        self.fill(t, &mut out);
        out
    }

    fn fill(&self, t: &Stored, out: &mut [u8]) {
        let l = &self.logical[t.logical];
        let stream = |purpose: &str| Stream::new(self.seed, &l.key, purpose);
        let (std, live_rows) = match l.init {
            Init::Linear { std } => (std, usize::MAX),
            Init::Embedding { std } => (std, self.dims.live_rows),
            _ => (0.0, usize::MAX),
        };
        let s0 = base_scale(std);
        match t.part {
            Part::Codes => {
                let codes = stream("codes");
                let draws_per_row = l.cols() / 16; // one u64 = 16 nibbles = two U32 words
                par_rows(out, draws_per_row * 8, self.threads, |row, buf| {
                    if row >= live_rows {
                        return; // zero codes
                    }
                    let first = (row * draws_per_row) as u64;
                    for (j, chunk) in buf.chunks_exact_mut(8).enumerate() {
                        chunk.copy_from_slice(&codes.at(first + j as u64).to_le_bytes());
                    }
                });
            }
            Part::Scales { group } | Part::Biases { group } => {
                let scales = stream("scales");
                let gpr = l.cols() / group;
                let want_scale = matches!(t.part, Part::Scales { .. });
                par_rows(out, gpr * 2, self.threads, |row, buf| {
                    for (g, chunk) in buf.chunks_exact_mut(2).enumerate() {
                        let (s, b) = if row >= live_rows { (zero_group_scale(), bf16::ZERO) } else { group_scale_bias(scales, s0, gpr, row, g) };
                        let v = if want_scale { s } else { b };
                        chunk.copy_from_slice(&v.to_bits().to_le_bytes());
                    }
                });
            }
            Part::Dequant { row0 } => {
                let (codes, scales) = (stream("codes"), stream("scales"));
                let cols = l.cols();
                let gpr = cols / HF_GROUP_SIZE;
                let draws_per_row = cols / 16;
                par_rows(out, cols * 2, self.threads, |row, buf| {
                    let row = row0 + row;
                    if row >= live_rows {
                        return; // zero row
                    }
                    let first = (row * draws_per_row) as u64;
                    for (g, gbuf) in buf.chunks_exact_mut(HF_GROUP_SIZE * 2).enumerate() {
                        let (s, b) = group_scale_bias(scales, s0, gpr, row, g);
                        let (s, b) = (s.to_f32(), b.to_f32());
                        for (j, dbuf) in gbuf.chunks_exact_mut(32).enumerate() {
                            let d = codes.at(first + (g * HF_GROUP_SIZE / 16 + j) as u64);
                            for (e, vbuf) in dbuf.chunks_exact_mut(2).enumerate() {
                                let q = ((d >> (4 * e)) & 0xF) as f32;
                                let v = bf16::from_f32(s * q + b); // two roundings in f32, then bf16
                                vbuf.copy_from_slice(&v.to_bits().to_le_bytes());
                            }
                        }
                    }
                });
            }
            Part::Values => self.fill_values(l, t, out),
        }
    }

    /// Vectors, norms and the conv: small, generated on this thread.
    fn fill_values(&self, l: &Logical, t: &Stored, out: &mut [u8]) {
        let values = Stream::new(self.seed, &l.key, "values");
        let n = l.elements() as usize;
        let value = |i: usize| -> f32 {
            match l.init {
                Init::ShiftedNorm { gain } => {
                    let v = norm_value(values, i, gain);
                    if self.zero_centred_norms {
                        v - 1.0
                    } else {
                        v
                    } // w or 1 + w: both exact
                }
                Init::GatedNorm => norm_value(values, i, 1.0),
                Init::ALog => (-2.5 + 3.5 * values.unit(i as u64)) as f32,
                Init::DtBias => values.unit(i as u64) as f32,
                Init::Conv => ((2.0 * values.unit(i as u64) - 1.0) * CONV_STD * 3f64.sqrt()) as f32,
                Init::Linear { .. } | Init::Embedding { .. } => unreachable!("matrices are parts"),
            }
        };
        match t.dtype {
            Dtype::F32 => {
                for (i, c) in out.chunks_exact_mut(4).enumerate().take(n) {
                    c.copy_from_slice(&value(i).to_le_bytes());
                }
            }
            _ => {
                for (i, c) in out.chunks_exact_mut(2).enumerate().take(n) {
                    c.copy_from_slice(&bf16::from_f32(value(i)).to_bits().to_le_bytes());
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writing

struct Progress<'a> {
    done: u64,
    total: u64,
    callback: &'a mut dyn FnMut(u64, u64),
}

/// A tensor whose bytes are generated when the safetensors writer asks for them.
struct Lazy<'a> {
    generator: &'a Generator<'a>,
    stored: &'a Stored,
    progress: &'a RefCell<Progress<'a>>,
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.stored.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.stored.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // The writer asks for tensors in file order and writes each before asking for the next,
        // so everything counted so far has reached the file.
        {
            let mut p = self.progress.borrow_mut();
            let (done, total) = (p.done, p.total);
            (p.callback)(done, total);
            p.done += self.stored.bytes() as u64;
        }
        Cow::Owned(self.generator.bytes(self.stored))
    }
    fn data_len(&self) -> usize {
        self.stored.bytes()
    }
}

/// mlx-lm's `total_parameters`: leaf modules only, so `A_log` and `dt_bias` (parameters of the
/// GatedDeltaNet module itself) are not counted (`shared/fixtures/tiny/mlx-q4` shows this).
fn mlx_total_parameters(logical: &[Logical]) -> u64 {
    logical.iter().filter(|t| !matches!(t.init, Init::ALog | Init::DtBias)).map(Logical::elements).sum()
}

fn check_tokenizer(path: &Path, vocab: usize) -> Result<(), SynthError> {
    let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| SynthError::Tokenizer { path: path.to_path_buf(), reason: e.to_string() })?;
    let ids = tok.get_vocab_size(true);
    if ids > vocab {
        return Err(SynthError::Tokenizer { path: path.to_path_buf(), reason: format!("{ids} token ids do not fit vocab_size {vocab}") });
    }
    Ok(())
}

fn write_dims(dims: &Dims, opts: &SynthOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<SynthSummary, SynthError> {
    // Validate everything before touching the disk.
    if let SynthLayout::Mlx4Bit { group_size } = opts.layout {
        if ![32, 64, 128].contains(&group_size) {
            return Err(SynthError::InvalidOption { option: "group_size", reason: format!("{group_size} is not one of 32, 64, 128 (MLX affine 4-bit)") });
        }
    }
    let logical = logical_tensors(dims);
    let group = match opts.layout {
        SynthLayout::Mlx4Bit { group_size } => group_size,
        SynthLayout::HfBf16 => HF_GROUP_SIZE,
    };
    for t in logical.iter().filter(|t| t.quantized()) {
        if t.cols() % group != 0 || t.cols() % 16 != 0 {
            return Err(SynthError::InvalidOption { option: "group_size", reason: format!("{group} does not divide the input dim {} of {}", t.cols(), t.key) });
        }
    }
    let out_dir = &opts.out_dir;
    writer::check_out_dir(out_dir)?;
    if let Some(tok) = &opts.tokenizer {
        check_tokenizer(tok, dims.vocab)?;
    }
    let tmp = Staging::new(out_dir, "synth")?;

    // Tensors, in name order, split into shards.
    let mut stored = stored_tensors(&logical, opts.layout);
    stored.sort_by(|a, b| a.name.cmp(&b.name));
    let (is_mlx, limit) = match opts.layout {
        SynthLayout::Mlx4Bit { .. } => (true, MLX_SHARD_BYTES),
        SynthLayout::HfBf16 => (false, HF_SHARD_BYTES),
    };
    let sizes: Vec<u64> = stored.iter().map(|t| t.bytes() as u64).collect();
    let shard_list = writer::shards(&sizes, limit);
    let shard_name = |i: usize| writer::shard_name(i, shard_list.len());
    let tensor_bytes: u64 = stored.iter().map(|t| t.bytes() as u64).sum();
    let parameters: u64 = logical.iter().map(Logical::elements).sum();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let generator = Generator { seed: opts.seed, zero_centred_norms: !is_mlx, dims, logical: &logical, threads };
    let progress_state = RefCell::new(Progress { done: 0, total: tensor_bytes, callback: progress });
    let format = if is_mlx { "mlx" } else { "pt" };
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shard_list.iter().enumerate() {
        let file = shard_name(i);
        let path = tmp.path().join(&file);
        let views: Vec<(String, Lazy)> = shard
            .iter()
            .map(|&k| {
                weight_map.insert(stored[k].name.clone(), file.clone());
                (stored[k].name.clone(), Lazy { generator: &generator, stored: &stored[k], progress: &progress_state })
            })
            .collect();
        let metadata = HashMap::from([("format".to_string(), format.to_string())]);
        writer::write_safetensors(views, metadata, &path)?;
    }
    {
        let mut p = progress_state.borrow_mut();
        let total = p.total;
        (p.callback)(total, total);
    }

    // Index, configs, tokenizer files.
    let weight_map: serde_json::Map<String, Value> = weight_map.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
    let d = tmp.path();
    if is_mlx {
        // mlx-lm writes the index even for one shard: json.dump(indent=4), no trailing newline.
        let index = json!({
            "metadata": { "total_size": tensor_bytes, "total_parameters": mlx_total_parameters(&logical) },
            "weight_map": weight_map
        });
        write_json(&d.join("model.safetensors.index.json"), &index, b"    ", false)?;
        write_json(&d.join("config.json"), &mlx_config(dims, group), b"    ", false)?;
    } else {
        if shard_list.len() > 1 {
            let index = json!({
                "metadata": { "total_parameters": parameters, "total_size": tensor_bytes },
                "weight_map": weight_map
            });
            write_json(&d.join("model.safetensors.index.json"), &index, b"  ", true)?;
        }
        write_json(&d.join("config.json"), &hf_config(dims), b"  ", true)?;
    }
    let generation = json!({ "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "do_sample": false });
    write_json(&d.join("generation_config.json"), &generation, b"  ", false)?;
    let tokenizer_config = if is_mlx {
        // As mlx-lm's tokenizer save leaves it; the template goes to chat_template.jinja.
        fs::write(d.join("chat_template.jinja"), CHAT_TEMPLATE).map_err(io_err(&d.join("chat_template.jinja")))?;
        json!({
            "add_prefix_space": null,
            "backend": "tokenizers",
            "bos_token": null,
            "clean_up_tokenization_spaces": false,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "is_local": true,
            "local_files_only": false,
            "merges_file": null,
            "model_max_length": 262_144,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": false,
            "tokenizer_class": "Qwen3_5Tokenizer",
            "unk_token": null
        })
    } else {
        json!({
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": null,
            "unk_token": null,
            "model_max_length": 262_144,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": false,
            "errors": "replace",
            "split_special_tokens": false
        })
    };
    write_json(&d.join("tokenizer_config.json"), &tokenizer_config, b"  ", false)?;
    if let Some(tok) = &opts.tokenizer {
        let dst = d.join("tokenizer.json");
        // Read and write rather than fs::copy, which would carry over a read-only mode.
        let bytes = fs::read(tok).map_err(io_err(tok))?;
        fs::write(&dst, bytes).map_err(io_err(&dst))?;
    }
    let readme = format!(
        "---\nlanguage: en\nlibrary_name: {}\npipeline_tag: text-generation\ntags:\n- synthetic\n---\n\n\
         Random weights with the shapes and config of Qwen3.5 ({}), written by tensorfold's `synth` \
         (seed {}, layout {}). Not a trained model: for benchmarks and loader tests only.\n",
        if is_mlx { "mlx" } else { "transformers" },
        opts.preset.name(),
        opts.seed,
        match opts.layout {
            SynthLayout::Mlx4Bit { group_size } => format!("MLX affine 4-bit, group {group_size}"),
            SynthLayout::HfBf16 => "Hugging Face bf16".to_string(),
        },
    );
    fs::write(d.join("README.md"), readme).map_err(io_err(&d.join("README.md")))?;

    // Account, then move into place.
    let mut files = Vec::new();
    let mut bytes_written = 0u64;
    for entry in fs::read_dir(d).map_err(io_err(d))? {
        let entry = entry.map_err(io_err(d))?;
        bytes_written += entry.metadata().map_err(io_err(&entry.path()))?.len();
        files.push(entry.file_name().to_string_lossy().into_owned());
    }
    files.sort();
    tmp.commit()?;
    Ok(SynthSummary { out_dir: out_dir.clone(), parameters, tensor_bytes, bytes_written, files })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::shared;
    use crate::writer::PARALLEL_MIN_BYTES;
    use safetensors::SafeTensors;
    use std::collections::BTreeSet;

    /// A directory under the system temp dir, removed (with everything in it) on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(label: &str) -> Scratch {
            let p = std::env::temp_dir().join(format!("tensorfold-synth-{label}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            Scratch(p)
        }
        fn join(&self, s: &str) -> PathBuf {
            self.0.join(s)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Dimensions of `shared/fixtures/tiny` (its README's table and config.json).
    fn fixture_tiny_dims() -> Dims {
        Dims {
            hidden: 256,
            layers: 4,
            intermediate: 512,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            lin_k_heads: 2,
            lin_v_heads: 4,
            lin_k_dim: 64,
            lin_v_dim: 64,
            conv_kernel: 4,
            vocab: 2048,
            live_rows: 2048 - 33 + 33,
            tied: true,
            moe: None,
        }
    }

    fn opts(preset: Preset, layout: SynthLayout, seed: u64, out_dir: PathBuf) -> SynthOptions {
        SynthOptions { preset, layout, seed, tokenizer: None, out_dir, num_hidden_layers: Some(4) }
    }

    fn header_of(path: &Path) -> BTreeMap<String, (Dtype, Vec<usize>)> {
        let bytes = fs::read(path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        st.iter().map(|(n, v)| (n.to_string(), (v.dtype(), v.shape().to_vec()))).collect()
    }

    fn json_of(path: &Path) -> Value {
        serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
    }

    fn bf16s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// Dequantizes an MLX 4-bit matrix by spec §6.2 (Q1)/(Q2): q = (word >> 4·(k mod 8)) & 0xF,
    /// Ŵ = scale·q + bias, computed in f32.
    fn dequantize(st: &SafeTensors, base: &str) -> (Vec<f32>, usize, usize) {
        let w = st.tensor(&format!("{base}.weight")).unwrap();
        let s = st.tensor(&format!("{base}.scales")).unwrap();
        let b = st.tensor(&format!("{base}.biases")).unwrap();
        let (rows, cols) = (w.shape()[0], w.shape()[1] * 8);
        let groups = s.shape()[1];
        let group = cols / groups;
        let words: Vec<u32> = w.data().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let (scales, biases) = (bf16s(s.data()), bf16s(b.data()));
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for k in 0..cols {
                let q = (words[r * cols / 8 + k / 8] >> (4 * (k % 8))) & 0xF;
                let g = r * groups + k / group;
                out.push(scales[g] * q as f32 + biases[g]);
            }
        }
        (out, rows, cols)
    }

    fn mean_std(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn preset_text_configs_match_the_spec_table() {
        // qwen35-spec.md §1: D, layers, I, Hq, Hkv, Hk, Hv, tied. 27B: the text_config of
        // Qwen/Qwen3.5-27B's config.json (hidden_size 5120, num_hidden_layers 64,
        // intermediate_size 17408, 24/4 attention heads, 16/48 linear heads, untied), as public
        // reproductions of the file and the model card's table give it.
        let table = [
            (Preset::Qwen35_0_8B, 1024, 24, 3584, 8, 2, 16, 16, true),
            (Preset::Qwen35_2B, 2048, 24, 6144, 8, 2, 16, 16, true),
            (Preset::Qwen35_4B, 2560, 32, 9216, 16, 4, 16, 32, true),
            (Preset::Qwen35_9B, 4096, 32, 12288, 16, 4, 16, 32, false),
            (Preset::Qwen35_27B, 5120, 64, 17408, 24, 4, 16, 48, false),
        ];
        // Every dense size is a preset, once.
        assert_eq!(Preset::ALL.to_vec(), table.iter().map(|r| r.0).collect::<Vec<_>>());
        for (p, d, layers, i, hq, hkv, hk, hv, tied) in table {
            let c = preset_text_config(p);
            let ctx = p.name();
            assert_eq!(c["hidden_size"], d, "{ctx}");
            assert_eq!(c["num_hidden_layers"], layers, "{ctx}");
            assert_eq!(c["intermediate_size"], i, "{ctx}");
            assert_eq!(c["num_attention_heads"], hq, "{ctx}");
            assert_eq!(c["num_key_value_heads"], hkv, "{ctx}");
            assert_eq!(c["linear_num_key_heads"], hk, "{ctx}");
            assert_eq!(c["linear_num_value_heads"], hv, "{ctx}");
            assert_eq!(c["tie_word_embeddings"], tied, "{ctx}");
            assert_eq!(c["head_dim"], 256, "{ctx}");
            assert_eq!(c["linear_key_head_dim"], 128, "{ctx}");
            assert_eq!(c["linear_value_head_dim"], 128, "{ctx}");
            assert_eq!(c["linear_conv_kernel_dim"], 4, "{ctx}");
            assert_eq!(c["vocab_size"], 248_320, "{ctx}");
            assert_eq!(c["max_position_embeddings"], 262_144, "{ctx}");
            assert_eq!(c["rms_norm_eps"], 1e-6, "{ctx}");
            assert_eq!(c["eos_token_id"], 248_044, "{ctx}");
            assert_eq!(c["full_attention_interval"], 4, "{ctx}");
            assert_eq!(c["attn_output_gate"], true, "{ctx}");
            assert_eq!(c["attention_bias"], false, "{ctx}");
            assert_eq!(c["hidden_act"], "silu", "{ctx}");
            assert_eq!(c["dtype"], "bfloat16", "{ctx}");
            assert_eq!(c["mamba_ssm_dtype"], "float32", "{ctx}");
            assert_eq!(c["mtp_num_hidden_layers"], 1, "{ctx}");
            assert_eq!(c["mtp_use_dedicated_embeddings"], false, "{ctx}");
            assert_eq!(c["model_type"], "qwen3_5_text", "{ctx}");
            let rope = &c["rope_parameters"];
            assert_eq!(rope["rope_type"], "default", "{ctx}");
            assert_eq!(rope["rope_theta"].as_f64(), Some(1e7), "{ctx}");
            assert_eq!(rope["partial_rotary_factor"], 0.25, "{ctx}");
            assert_eq!(rope["mrope_section"], json!([11, 11, 10]), "{ctx}");
            assert_eq!(rope["mrope_interleaved"], true, "{ctx}");
            // 3 × linear_attention + 1 × full_attention, repeated; spec's linear/full counts.
            let types: Vec<&str> = c["layer_types"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
            assert_eq!(types.len(), layers, "{ctx}");
            let full = types.iter().filter(|&&t| t == "full_attention").count();
            assert_eq!((layers - full, full), (layers * 3 / 4, layers / 4), "{ctx}");
            for (l, t) in types.iter().enumerate() {
                let want = if l % 4 == 3 { "full_attention" } else { "linear_attention" };
                assert_eq!(*t, want, "{ctx} layer {l}");
            }
        }
    }

    #[test]
    fn parameter_counts_match_the_spec_sanity_check() {
        // qwen35-spec.md §1: "0.752 B (0.8B), 1.882 B (2B), 4.206 B (4B) and 8.954 B (9B)".
        for (p, billions) in [(Preset::Qwen35_0_8B, 0.752), (Preset::Qwen35_2B, 1.882), (Preset::Qwen35_4B, 4.206), (Preset::Qwen35_9B, 8.954)] {
            let n: u64 = logical_tensors(&p.dims()).iter().map(Logical::elements).sum();
            assert!((n as f64 / 1e9 - billions).abs() < 0.0005, "{p}: {n}");
        }
    }

    #[test]
    fn every_preset_config_loads_as_the_engine_reads_it() {
        for p in Preset::ALL {
            let d = p.dims();
            for (layout, cfg) in [("mlx", mlx_config(&d, 64)), ("hf", hf_config(&d))] {
                let c = crate::config::ModelConfig::from_json(Path::new("config.json"), &cfg).unwrap_or_else(|e| panic!("{p} {layout}: {e}"));
                let got = (c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads);
                assert_eq!(got, (d.hidden, d.layers, d.intermediate, d.heads, d.kv_heads), "{p} {layout}");
                assert_eq!((c.linear_num_value_heads, c.vocab_size, c.tie_word_embeddings), (d.lin_v_heads, VOCAB_SIZE, d.tied), "{p} {layout}");
                assert_eq!((c.num_full_layers(), c.rotary_dim()), (d.layers / 4, 64), "{p} {layout}");
            }
        }
    }

    #[test]
    fn moe_presets_have_their_published_sizes() {
        // The names give total and active parameters: 35B-A3B and 122B-A10B (active: every
        // tensor but the 256 − 8 routed experts a token does not use, embedding and head included).
        for (p, total, active) in [(Preset::Qwen35_35B_A3B, 34.66, 3.45), (Preset::Qwen35_122B_A10B, 122.11, 9.77)] {
            let d = p.dims();
            let m = d.moe.expect("an MoE preset");
            let n: u64 = logical_tensors(&d).iter().map(Logical::elements).sum();
            let unused = (d.layers * (m.experts - m.per_tok) * 3 * m.expert * d.hidden) as u64;
            assert!((n as f64 / 1e9 - total).abs() < 0.005 && ((n - unused) as f64 / 1e9 - active).abs() < 0.005, "{p}: {n} total, {} active", n - unused);
            let c = crate::config::ModelConfig::from_json(Path::new("config.json"), &mlx_config(&d, 64)).unwrap_or_else(|e| panic!("{p}: {e}"));
            let cm = c.moe.expect("the config is a mixture of experts");
            assert_eq!((cm.num_experts, cm.num_experts_per_tok, cm.moe_intermediate_size, cm.shared_expert_intermediate_size), (m.experts, m.per_tok, m.expert, m.shared), "{p}");
            assert_eq!((c.hidden_size, c.num_hidden_layers, c.intermediate_size), (d.hidden, d.layers, 0), "{p}");
            assert_eq!(p.name().parse::<Preset>().unwrap(), p);
        }
    }

    #[test]
    fn presets_and_layouts_parse() {
        for p in Preset::ALL {
            assert_eq!(p.name().parse::<Preset>().unwrap(), p);
            assert_eq!(p.to_string().to_uppercase().parse::<Preset>().unwrap(), p);
        }
        assert_eq!("qwen3.5-0.8b".parse::<Preset>().unwrap(), Preset::Qwen35_0_8B);
        assert_eq!("Qwen3.5-27B".parse::<Preset>().unwrap(), Preset::Qwen35_27B);
        assert!(matches!("qwen3.5-7b".parse::<Preset>(), Err(SynthError::UnknownPreset(s)) if s == "qwen3.5-7b"));
        assert_eq!("hf".parse::<SynthLayout>().unwrap(), SynthLayout::HfBf16);
        assert_eq!("mlx".parse::<SynthLayout>().unwrap(), SynthLayout::Mlx4Bit { group_size: 64 });
        assert!("gguf".parse::<SynthLayout>().is_err());
    }

    /// The name/dtype/shape set of our MLX and HF layouts for the fixture's dimensions equals what
    /// mlx-lm 0.32.2 and transformers 5.24 wrote for `shared/fixtures/tiny` (vision/mtp aside).
    #[test]
    fn layouts_match_the_fixture_written_by_the_real_converters() {
        let dims = fixture_tiny_dims();
        let logical = logical_tensors(&dims);
        for (layout, dir) in [(SynthLayout::default(), "mlx-q4"), (SynthLayout::HfBf16, "hf")] {
            let fixture: BTreeMap<_, _> = header_of(&shared(&format!("fixtures/tiny/{dir}/model.safetensors")))
                .into_iter()
                .filter(|(n, _)| !n.starts_with("model.visual.") && !n.starts_with("mtp."))
                .collect();
            let ours: BTreeMap<_, _> = stored_tensors(&logical, layout).into_iter().map(|t| (t.name, (t.dtype, t.shape))).collect();
            assert_eq!(ours, fixture, "{dir}");
        }
        // mlx-lm's index metadata for that checkpoint.
        let index = json_of(&shared("fixtures/tiny/mlx-q4/model.safetensors.index.json"));
        let stored = stored_tensors(&logical, SynthLayout::default());
        let total: u64 = stored.iter().map(|t| t.bytes() as u64).sum();
        assert_eq!(index["metadata"]["total_size"], total);
        assert_eq!(index["metadata"]["total_parameters"], mlx_total_parameters(&logical));
    }

    #[test]
    fn untied_9b_has_a_quantized_lm_head_of_the_spec_shape() {
        let logical = logical_tensors(&Preset::Qwen35_9B.dims());
        let mlx: BTreeMap<_, _> = stored_tensors(&logical, SynthLayout::default()).into_iter().map(|t| (t.name, (t.dtype, t.shape))).collect();
        // qwen35-spec.md §5.2, 9B column.
        for (name, dtype, shape) in [
            ("language_model.lm_head.weight", Dtype::U32, vec![248_320, 512]),
            ("language_model.lm_head.scales", Dtype::BF16, vec![248_320, 64]),
            ("language_model.lm_head.biases", Dtype::BF16, vec![248_320, 64]),
            ("language_model.model.embed_tokens.weight", Dtype::U32, vec![248_320, 512]),
            ("language_model.model.layers.0.linear_attn.in_proj_qkv.weight", Dtype::U32, vec![8192, 512]),
            ("language_model.model.layers.0.linear_attn.in_proj_a.scales", Dtype::BF16, vec![32, 64]),
            ("language_model.model.layers.0.mlp.down_proj.weight", Dtype::U32, vec![4096, 1536]),
            ("language_model.model.layers.0.mlp.down_proj.scales", Dtype::BF16, vec![4096, 192]),
            ("language_model.model.layers.3.self_attn.q_proj.weight", Dtype::U32, vec![8192, 512]),
            ("language_model.model.layers.31.self_attn.o_proj.scales", Dtype::BF16, vec![4096, 64]),
        ] {
            assert_eq!(mlx.get(name), Some(&(dtype, shape)), "{name}");
        }
        let hf: BTreeMap<_, _> = stored_tensors(&logical, SynthLayout::HfBf16).into_iter().map(|t| (t.name, (t.dtype, t.shape))).collect();
        assert_eq!(hf.get("lm_head.weight"), Some(&(Dtype::BF16, vec![248_320, 4096])));
        assert_eq!(hf.get("model.language_model.layers.0.linear_attn.conv1d.weight"), Some(&(Dtype::BF16, vec![8192, 1, 4])));
        // The tied sizes have no head at all.
        let tied = stored_tensors(&logical_tensors(&Preset::Qwen35_4B.dims()), SynthLayout::HfBf16);
        assert!(!tied.iter().any(|t| t.name.contains("lm_head")));
    }

    /// The expected 0.8B tensors of one layout for 4 layers, from the spec tables (§5.1, §5.2).
    fn expected_0_8b(mlx: bool) -> BTreeMap<String, (Dtype, Vec<usize>)> {
        let mut m = BTreeMap::new();
        let (pre, bf, f32_norm) = if mlx { ("language_model.model.", Dtype::BF16, Dtype::BF16) } else { ("model.language_model.", Dtype::BF16, Dtype::F32) };
        let mut put = |name: String, dtype: Dtype, shape: Vec<usize>| {
            m.insert(format!("{pre}{name}"), (dtype, shape));
        };
        // (name, [out, in]) of the quantized matrices; MLX: U32 [out, in/8] + BF16 [out, in/64].
        let mut mats: Vec<(String, [usize; 2])> = vec![("embed_tokens".into(), [248_320, 1024])];
        for l in 0..4 {
            let p = format!("layers.{l}.");
            put(format!("{p}input_layernorm.weight"), bf, vec![1024]);
            put(format!("{p}post_attention_layernorm.weight"), bf, vec![1024]);
            if l == 3 {
                mats.push((format!("{p}self_attn.q_proj"), [4096, 1024]));
                mats.push((format!("{p}self_attn.k_proj"), [512, 1024]));
                mats.push((format!("{p}self_attn.v_proj"), [512, 1024]));
                mats.push((format!("{p}self_attn.o_proj"), [1024, 2048]));
                put(format!("{p}self_attn.q_norm.weight"), bf, vec![256]);
                put(format!("{p}self_attn.k_norm.weight"), bf, vec![256]);
            } else {
                mats.push((format!("{p}linear_attn.in_proj_qkv"), [6144, 1024]));
                mats.push((format!("{p}linear_attn.in_proj_z"), [2048, 1024]));
                mats.push((format!("{p}linear_attn.in_proj_a"), [16, 1024]));
                mats.push((format!("{p}linear_attn.in_proj_b"), [16, 1024]));
                mats.push((format!("{p}linear_attn.out_proj"), [1024, 2048]));
                let conv = if mlx { vec![6144, 4, 1] } else { vec![6144, 1, 4] };
                put(format!("{p}linear_attn.conv1d.weight"), bf, conv);
                put(format!("{p}linear_attn.A_log"), Dtype::F32, vec![16]);
                put(format!("{p}linear_attn.dt_bias"), bf, vec![16]);
                put(format!("{p}linear_attn.norm.weight"), f32_norm, vec![128]);
            }
            mats.push((format!("{p}mlp.gate_proj"), [3584, 1024]));
            mats.push((format!("{p}mlp.up_proj"), [3584, 1024]));
            mats.push((format!("{p}mlp.down_proj"), [1024, 3584]));
        }
        put("norm.weight".into(), bf, vec![1024]);
        for (name, [o, i]) in mats {
            if mlx {
                put(format!("{name}.weight"), Dtype::U32, vec![o, i / 8]);
                put(format!("{name}.scales"), Dtype::BF16, vec![o, i / 64]);
                put(format!("{name}.biases"), Dtype::BF16, vec![o, i / 64]);
            } else {
                put(format!("{name}.weight"), Dtype::BF16, vec![o, i]);
            }
        }
        m
    }

    #[test]
    fn mlx_0_8b_checkpoint_matches_the_spec() {
        let scratch = Scratch::new("mlx08");
        let out = scratch.join("ckpt");
        let tokenizer = shared("tokenizers/qwen3.5/tokenizer.json");
        let mut o = opts(Preset::Qwen35_0_8B, SynthLayout::default(), 7, out.clone());
        o.tokenizer = Some(tokenizer.clone());
        let mut calls = Vec::new();
        let summary = write_checkpoint(&o, &mut |d, t| calls.push((d, t))).unwrap();

        // Tensors: exactly the spec's names, dtypes and shapes (spec §5.2 0.8B column, e.g.
        // in_proj_qkv U32 [6144,128] + scales [6144,16]).
        let bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let got: BTreeMap<_, _> = st.iter().map(|(n, v)| (n.to_string(), (v.dtype(), v.shape().to_vec()))).collect();
        assert_eq!(got, expected_0_8b(true));
        assert_eq!(got["language_model.model.layers.0.linear_attn.in_proj_qkv.scales"], (Dtype::BF16, vec![6144, 16]));
        let data_bytes: u64 = st.iter().map(|(_, v)| v.data().len() as u64).sum();

        // Summary and progress.
        assert_eq!(summary.tensor_bytes, data_bytes);
        assert_eq!(summary.out_dir, out);
        let on_disk: u64 = fs::read_dir(&out).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
        assert_eq!(summary.bytes_written, on_disk);
        let expect_files = [
            "README.md",
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ];
        assert_eq!(summary.files, expect_files);
        #[cfg(unix)]
        for f in ["model.safetensors", "tokenizer.json"] {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(out.join(f)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o644, "{f}");
        }
        // 4-layer 0.8B: embedding + 3 GDN layers + 1 attention layer + final norm, counted by hand
        // from the spec's shapes.
        let gdn = 6144 * 1024 + 2048 * 1024 + 2 * 16 * 1024 + 6144 * 4 + 16 + 16 + 128 + 1024 * 2048;
        let attn = 4096 * 1024 + 2 * 512 * 1024 + 1024 * 2048 + 2 * 256;
        let common = 3 * 3584 * 1024 + 2 * 1024;
        assert_eq!(summary.parameters, 248_320 * 1024 + 3 * (gdn + common) + attn + common + 1024);
        assert_eq!(calls.last(), Some(&(data_bytes, data_bytes)));
        assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 == w[1].1));
        assert!(calls.len() > expect_files.len());

        // config.json: mlx-lm's form.
        let c = json_of(&out.join("config.json"));
        assert_eq!(c["architectures"], json!(["Qwen3_5ForConditionalGeneration"]));
        assert_eq!(c["model_type"], "qwen3_5");
        let q = json!({"group_size": 64, "bits": 4, "mode": "affine"});
        assert_eq!(c["quantization"], q);
        assert_eq!(c["quantization_config"], q);
        assert_eq!(c["eos_token_id"], json!([248_046, 248_044]));
        assert_eq!(c["tie_word_embeddings"], true);
        assert!(c.get("vision_config").is_none());
        let tc = &c["text_config"];
        assert_eq!(tc["num_hidden_layers"], 4);
        assert_eq!(tc["layer_types"].as_array().unwrap().len(), 4);
        assert_eq!(tc["hidden_size"], 1024);
        assert_eq!(tc["rope_parameters"]["type"], "default");
        assert!(tc["rope_parameters"].get("rope_type").is_none());
        // The fixture written by mlx-lm has the same keys at every level but the ids we add.
        let fixture = json_of(&shared("fixtures/vocab/mlx-q4/config.json"));
        let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<BTreeSet<_>>();
        let extra: BTreeSet<String> = keys(&c).difference(&keys(&fixture)).cloned().collect();
        assert_eq!(extra, BTreeSet::from(["vision_end_token_id".into(), "vision_start_token_id".into()]));
        assert!(keys(&fixture["text_config"]).is_subset(&keys(tc)));
        assert_eq!(keys(&fixture["text_config"]["rope_parameters"]), keys(&tc["rope_parameters"]));

        // Index: the fixture's JSON shape, every tensor mapped to the one shard.
        let index = json_of(&out.join("model.safetensors.index.json"));
        assert_eq!(keys(&index), keys(&json_of(&shared("fixtures/vocab/mlx-q4/model.safetensors.index.json"))));
        assert_eq!(index["metadata"]["total_size"], data_bytes);
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.keys().cloned().collect::<BTreeSet<_>>(), got.keys().cloned().collect());
        assert!(map.values().all(|v| v == "model.safetensors"));

        // Tokenizer files, as in fixtures/vocab/mlx-q4.
        assert_eq!(fs::read(out.join("tokenizer.json")).unwrap(), fs::read(&tokenizer).unwrap());
        for f in ["tokenizer_config.json", "generation_config.json"] {
            assert_eq!(json_of(&out.join(f)), json_of(&shared(&format!("fixtures/vocab/mlx-q4/{f}"))), "{f}");
        }
        assert_eq!(fs::read_to_string(out.join("chat_template.jinja")).unwrap(), fs::read_to_string(shared("fixtures/vocab/mlx-q4/chat_template.jinja")).unwrap());

        // Dequantized weights have the intended spread (module docs) and are centred.
        for (base, std) in [
            ("layers.0.linear_attn.in_proj_qkv", 1.0 / 1024f64.sqrt()),
            ("layers.1.linear_attn.out_proj", 1.0 / (2048.0 * 8.0f64).sqrt()),
            ("layers.2.mlp.down_proj", 1.0 / (3584.0 * 8.0f64).sqrt()),
            ("layers.3.self_attn.q_proj", 1.0 / 1024f64.sqrt()),
        ] {
            let (w, _, _) = dequantize(&st, &format!("language_model.model.{base}"));
            let (mean, sd) = mean_std(&w);
            assert!((sd / std - 1.0).abs() < 0.02, "{base}: std {sd} vs {std}");
            assert!(mean.abs() < 0.01 * std, "{base}: mean {mean}");
        }
        let (emb, rows, cols) = dequantize(&st, "language_model.model.embed_tokens");
        let (live, pad) = emb.split_at(TOKENIZER_IDS * cols);
        assert_eq!(rows, 248_320);
        let (mean, sd) = mean_std(live);
        assert!((sd * 32.0 - 1.0).abs() < 0.01 && mean.abs() < 0.0003, "embedding {mean} {sd}");
        assert!(pad.iter().all(|&x| x == 0.0), "padding rows dequantize to zero");
        // About half the groups have negative scales, as in real MLX checkpoints.
        let scales = bf16s(st.tensor("language_model.model.layers.0.mlp.up_proj.scales").unwrap().data());
        let negative = scales.iter().filter(|&&s| s < 0.0).count() as f64 / scales.len() as f64;
        assert!((negative - 0.5).abs() < 0.02, "{negative}");

        // Norms stored pre-shifted (≈ 1), the final one at the logit-scaling gain; A_log, dt_bias ranges.
        let vals = |n: &str| {
            let v = st.tensor(&format!("language_model.model.{n}")).unwrap();
            if v.dtype() == Dtype::F32 {
                f32s(v.data())
            } else {
                bf16s(v.data())
            }
        };
        for n in ["layers.0.input_layernorm.weight", "layers.3.self_attn.k_norm.weight", "layers.1.linear_attn.norm.weight"] {
            assert!(vals(n).iter().all(|&x| (0.89..=1.11).contains(&x) && (x * 128.0).fract() == 0.0), "{n}");
        }
        let (final_mean, _) = mean_std(&vals("norm.weight"));
        assert!((final_mean - LOGIT_STD).abs() < 0.02, "final norm gain {final_mean}");
        assert!(vals("layers.0.linear_attn.A_log").iter().all(|x| (-2.5..1.0).contains(x)));
        assert!(vals("layers.0.linear_attn.dt_bias").iter().all(|x| (0.0..=1.0).contains(x)));
        let (_, conv_sd) = mean_std(&vals("layers.2.linear_attn.conv1d.weight"));
        assert!((conv_sd / CONV_STD - 1.0).abs() < 0.03, "conv std {conv_sd}");
    }

    #[test]
    fn hf_0_8b_checkpoint_matches_the_spec() {
        let scratch = Scratch::new("hf08");
        let out = scratch.join("ckpt");
        let summary = write_checkpoint(&opts(Preset::Qwen35_0_8B, SynthLayout::HfBf16, 7, out.clone()), &mut |_, _| {}).unwrap();
        assert_eq!(summary.files, ["README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"]);
        let bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let got: BTreeMap<_, _> = st.iter().map(|(n, v)| (n.to_string(), (v.dtype(), v.shape().to_vec()))).collect();
        assert_eq!(got, expected_0_8b(false));
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));

        let c = json_of(&out.join("config.json"));
        let fixture = json_of(&shared("fixtures/tiny/hf/config.json"));
        assert_eq!(c["architectures"], fixture["architectures"]);
        assert_eq!(c["model_type"], "qwen3_5");
        assert_eq!(c["image_token_id"], 248_056);
        assert_eq!(c["video_token_id"], 248_057);
        assert_eq!(c["vision_config"]["out_hidden_size"], 1024);
        assert_eq!(c["text_config"]["rope_parameters"]["rope_type"], "default");
        assert_eq!(c["text_config"]["num_hidden_layers"], 4);
        assert!(c.get("quantization").is_none());
        let tc = json_of(&out.join("tokenizer_config.json"));
        assert_eq!(tc, {
            let mut f = json_of(&shared("fixtures/tiny/hf/tokenizer_config.json"));
            f["chat_template"] = tc["chat_template"].clone();
            f
        });
        assert_eq!(tc["chat_template"].as_str(), Some(CHAT_TEMPLATE));
        assert_eq!(json_of(&out.join("generation_config.json"))["eos_token_id"], json!([248_046, 248_044]));

        // Zero-centred norms, F32 A_log and gated norm, bf16 weights with the intended spread.
        let get = |n: &str| st.tensor(&format!("model.language_model.{n}")).unwrap();
        let w = bf16s(get("layers.0.input_layernorm.weight").data());
        assert!(w.iter().all(|x| x.abs() <= 0.11), "zero-centred");
        let (final_w, _) = mean_std(&bf16s(get("norm.weight").data()));
        assert!((final_w + 1.0 - LOGIT_STD).abs() < 0.02, "final norm stored as gain − 1: {final_w}");
        let g = f32s(get("layers.0.linear_attn.norm.weight").data());
        assert!(g.iter().all(|x| (0.89..=1.11).contains(x)));
        let (_, sd) = mean_std(&bf16s(get("layers.0.mlp.gate_proj.weight").data()));
        assert!((sd * 1024f64.sqrt() - 1.0).abs() < 0.02, "{sd}");
        let emb = bf16s(get("embed_tokens.weight").data());
        assert!(emb[TOKENIZER_IDS * 1024..].iter().all(|&x| x == 0.0));
    }

    /// The HF layout holds exactly the dequantized MLX group-64 weights of the same seed, and
    /// the same vectors (norms shifted by one).
    #[test]
    fn hf_layout_is_the_dequantized_mlx_layout() {
        let scratch = Scratch::new("cross");
        let mut dims = fixture_tiny_dims();
        dims.tied = false;
        dims.live_rows = 2000;
        let progress = &mut |_, _| {};
        let mlx_dir = scratch.join("mlx");
        let hf_dir = scratch.join("hf");
        write_dims(&dims, &opts(Preset::Qwen35_9B, SynthLayout::default(), 3, mlx_dir.clone()), progress).unwrap();
        write_dims(&dims, &opts(Preset::Qwen35_9B, SynthLayout::HfBf16, 3, hf_dir.clone()), progress).unwrap();
        let (mb, hb) = (fs::read(mlx_dir.join("model.safetensors")).unwrap(), fs::read(hf_dir.join("model.safetensors")).unwrap());
        let (mlx, hf) = (SafeTensors::deserialize(&mb).unwrap(), SafeTensors::deserialize(&hb).unwrap());
        let mut checked = 0;
        for (name, view) in hf.iter() {
            let (mlx_base, key) = match name.strip_prefix("model.language_model.") {
                Some(k) => (format!("language_model.model.{k}"), k.to_string()),
                None => ("language_model.lm_head.weight".to_string(), "lm_head.weight".to_string()),
            };
            if view.shape().len() == 2 {
                let (w, _, _) = dequantize(&mlx, mlx_base.trim_end_matches(".weight"));
                let want: Vec<f32> = w.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
                assert_eq!(bf16s(view.data()), want, "{name}");
            } else {
                let m = mlx.tensor(&mlx_base).unwrap();
                let (hv, mv) = match view.dtype() {
                    Dtype::F32 => (f32s(view.data()), if m.dtype() == Dtype::F32 { f32s(m.data()) } else { bf16s(m.data()) }),
                    _ => (bf16s(view.data()), bf16s(m.data())),
                };
                let shifted = key.ends_with("layernorm.weight") || key.ends_with("_norm.weight") || key == "norm.weight";
                let hv: Vec<f32> = hv.iter().map(|&x| if shifted { x + 1.0 } else { x }).collect();
                assert_eq!(hv, mv, "{name}");
            }
            checked += 1;
        }
        assert_eq!(checked, hf.len());
        assert!(hf.names().contains(&"lm_head.weight"));
        assert!(mlx.names().contains(&"language_model.lm_head.scales"));
        assert_eq!(json_of(&hf_dir.join("config.json"))["tie_word_embeddings"], false);
    }

    /// A small MoE written in both layouts loads as the engine reads it (every expert tensor
    /// checked against the config): MLX with the routed experts stacked 3-D, HF with one bf16
    /// tensor per expert holding that expert's rows of the dequantized stack; both run and give
    /// the same logits up to the HF layout's bf16 rounding of the weights (and the routing
    /// flips it may cause).
    #[test]
    fn moe_layouts_load_and_run() {
        use crate::backend::{cpu::Cpu, Backend, Batch};
        let scratch = Scratch::new("moe");
        let mut dims = fixture_tiny_dims();
        dims.moe = Some(SynthMoe { experts: 8, per_tok: 2, expert: 128, shared: 64 });
        let (dir, hf_dir) = (scratch.join("mlx"), scratch.join("hf"));
        write_dims(&dims, &opts(Preset::Qwen35_35B_A3B, SynthLayout::default(), 5, dir.clone()), &mut |_, _| {}).unwrap();
        write_dims(&dims, &opts(Preset::Qwen35_35B_A3B, SynthLayout::HfBf16, 5, hf_dir.clone()), &mut |_, _| {}).unwrap();
        let header = header_of(&dir.join("model.safetensors"));
        assert_eq!(header["language_model.model.layers.0.mlp.switch_mlp.down_proj.weight"], (Dtype::U32, vec![8, 256, 16]));
        assert_eq!(header["language_model.model.layers.0.mlp.switch_mlp.gate_proj.scales"], (Dtype::BF16, vec![8, 128, 4]));
        let hf_header = header_of(&hf_dir.join("model.safetensors"));
        assert_eq!(hf_header["model.language_model.layers.0.mlp.experts.7.down_proj.weight"], (Dtype::BF16, vec![256, 128]));
        assert_eq!(hf_header["model.language_model.layers.3.mlp.experts.0.gate_proj.weight"], (Dtype::BF16, vec![128, 256]));
        assert!(!hf_header.keys().any(|k| k.contains("switch_mlp")), "an MLX name in the HF layout");
        // The architecture converters pick the model class by (llama.cpp's qwen35moe).
        let hf_config = json_of(&hf_dir.join("config.json"));
        assert_eq!((&hf_config["architectures"], &hf_config["model_type"]), (&json!(["Qwen3_5MoeForConditionalGeneration"]), &json!("qwen3_5_moe")));
        // Expert 5's up projection is rows 5·128.. of the dequantized stack.
        let (mb, hb) = (fs::read(dir.join("model.safetensors")).unwrap(), fs::read(hf_dir.join("model.safetensors")).unwrap());
        let (mlx, hf) = (SafeTensors::deserialize(&mb).unwrap(), SafeTensors::deserialize(&hb).unwrap());
        let st = mlx.tensor("language_model.model.layers.1.mlp.switch_mlp.up_proj.weight").unwrap();
        let (words, n) = (st.data(), 128 * 256 / 8 * 4);
        let flat = |name: &str, shape: Vec<usize>| {
            let t = mlx.tensor(name).unwrap();
            safetensors::tensor::TensorView::new(t.dtype(), shape, &t.data()[5 * t.data().len() / 8..6 * t.data().len() / 8]).unwrap()
        };
        let one = safetensors::tensor::TensorView::new(Dtype::U32, vec![128, 32], &words[5 * n..6 * n]).unwrap();
        let base = "language_model.model.layers.1.mlp.switch_mlp.up_proj";
        let (sc, bi) = (flat(&format!("{base}.scales"), vec![128, 4]), flat(&format!("{base}.biases"), vec![128, 4]));
        let views = [("e.weight", one), ("e.scales", sc), ("e.biases", bi)];
        let packed = safetensors::serialize(views, None).unwrap();
        let (w, _, _) = dequantize(&SafeTensors::deserialize(&packed).unwrap(), "e");
        let want: Vec<f32> = w.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        assert_eq!(bf16s(hf.tensor("model.language_model.layers.1.mlp.experts.5.up_proj.weight").unwrap().data()), want);
        let run = |dir: &Path| {
            let host = crate::model::HostModel::open(dir).unwrap();
            assert!(host.loaded.ignored.is_empty(), "{:?}", host.loaded.ignored);
            let model = crate::model::Model::new(&host, Cpu::new()).unwrap();
            let mut states = model.backend.new_states(&model.config).unwrap();
            let slot = model.backend.alloc_slot(&mut states).unwrap();
            let mut sc = model.scratch(4, 4).unwrap();
            model.step(&Batch::single(slot, 0, &[1, 2, 3, 4], true), &mut states, &mut sc).unwrap();
            let mut logits = Vec::new();
            model.backend.read_tensor(&sc.logits, 4, &mut logits).unwrap();
            logits
        };
        let (logits, hf_logits) = (run(&dir), run(&hf_dir));
        let (mean, sd) = mean_std(&logits);
        assert!(logits.iter().all(|x| x.is_finite()) && mean.abs() < sd && sd > 0.5 && sd < 20.0, "logits mean {mean}, std {sd}");
        let worst = logits.iter().zip(&hf_logits).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
        // The rounding can flip a near-tie of the router (measured 0.065 std); experts in the
        // wrong place differ by about the whole std.
        assert!(worst / sd < 0.2, "MLX and HF layouts differ by {worst} (logit std {sd})");
        assert!(logits.iter().all(|x| x.is_finite()) && mean.abs() < sd && sd > 0.5 && sd < 20.0, "logits mean {mean}, std {sd}");
    }

    #[test]
    fn same_seed_gives_identical_files_and_another_seed_does_not() {
        let scratch = Scratch::new("determinism");
        let dims = fixture_tiny_dims();
        let write = |name: &str, layout: SynthLayout, seed: u64| {
            let dir = scratch.join(name);
            write_dims(&dims, &opts(Preset::Qwen35_0_8B, layout, seed, dir.clone()), &mut |_, _| {}).unwrap();
            dir
        };
        for layout in [SynthLayout::default(), SynthLayout::Mlx4Bit { group_size: 32 }, SynthLayout::HfBf16] {
            let tag = format!("{layout:?}").replace([' ', '{', '}', ':'], "");
            let a = write(&format!("a{tag}"), layout, 11);
            let b = write(&format!("b{tag}"), layout, 11);
            let c = write(&format!("c{tag}"), layout, 12);
            for e in fs::read_dir(&a).unwrap() {
                let f = e.unwrap().file_name();
                assert_eq!(fs::read(a.join(&f)).unwrap(), fs::read(b.join(&f)).unwrap(), "{f:?}");
            }
            let (ta, tc) = (fs::read(a.join("model.safetensors")).unwrap(), fs::read(c.join("model.safetensors")).unwrap());
            assert_eq!(ta.len(), tc.len());
            assert_ne!(ta, tc);
        }
    }

    #[test]
    fn generated_bytes_do_not_depend_on_thread_count() {
        let mut dims = fixture_tiny_dims();
        dims.vocab = 40_000; // an embedding over PARALLEL_MIN_BYTES in both layouts
        dims.live_rows = 39_000;
        let logical = logical_tensors(&dims);
        for layout in [SynthLayout::default(), SynthLayout::HfBf16] {
            let stored = stored_tensors(&logical, layout);
            let gen = |threads| Generator { seed: 5, zero_centred_norms: layout == SynthLayout::HfBf16, dims: &dims, logical: &logical, threads };
            let (one, three) = (gen(1), gen(3));
            for t in stored.iter().filter(|t| t.name.contains("embed_tokens")) {
                let a = one.bytes(t);
                if !matches!(t.part, Part::Scales { .. } | Part::Biases { .. }) {
                    assert!(a.len() >= PARALLEL_MIN_BYTES, "{} exercises the threaded path", t.name);
                }
                assert_eq!(a, three.bytes(t), "{}", t.name);
            }
        }
    }

    #[test]
    fn refuses_to_overwrite_and_leaves_nothing_behind_on_error() {
        let scratch = Scratch::new("refuse");
        let dims = fixture_tiny_dims();
        let taken = scratch.join("taken");
        fs::create_dir(&taken).unwrap();
        fs::write(taken.join("keep.txt"), b"mine").unwrap();
        let err = write_dims(&dims, &opts(Preset::Qwen35_0_8B, SynthLayout::default(), 1, taken.clone()), &mut |_, _| {}).unwrap_err();
        assert!(matches!(&err, SynthError::OutDirNotEmpty(p) if *p == taken), "{err}");
        assert!(err.to_string().contains("taken"));
        assert_eq!(fs::read(taken.join("keep.txt")).unwrap(), b"mine");

        let file = scratch.join("a-file");
        fs::write(&file, b"x").unwrap();
        let err = write_dims(&dims, &opts(Preset::Qwen35_0_8B, SynthLayout::default(), 1, file.clone()), &mut |_, _| {}).unwrap_err();
        assert!(matches!(err, SynthError::OutPathNotDir(_)), "{err}");

        // An empty directory is fine to fill.
        let empty = scratch.join("empty");
        fs::create_dir(&empty).unwrap();
        write_dims(&dims, &opts(Preset::Qwen35_0_8B, SynthLayout::default(), 1, empty.clone()), &mut |_, _| {}).unwrap();
        assert!(empty.join("model.safetensors").is_file());

        // Invalid options and a bad tokenizer fail before anything is created.
        let fresh = scratch.join("fresh");
        let bad = [
            SynthOptions { layout: SynthLayout::Mlx4Bit { group_size: 48 }, ..opts(Preset::Qwen35_0_8B, SynthLayout::default(), 1, fresh.clone()) },
            SynthOptions { num_hidden_layers: Some(0), ..opts(Preset::Qwen35_0_8B, SynthLayout::default(), 1, fresh.clone()) },
            SynthOptions { tokenizer: Some(scratch.join("a-file")), ..opts(Preset::Qwen35_0_8B, SynthLayout::HfBf16, 1, fresh.clone()) },
        ];
        for o in &bad {
            let err = write_checkpoint(o, &mut |_, _| {}).unwrap_err();
            assert!(matches!(err, SynthError::InvalidOption { .. } | SynthError::Tokenizer { .. }), "{err}");
        }
        assert!(!fresh.exists());
        // No temporary directory survives any of the above.
        let names: BTreeSet<String> = fs::read_dir(&scratch.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, BTreeSet::from(["a-file".into(), "empty".into(), "taken".into()]));
    }

    #[test]
    fn shards_follow_the_size_limit() {
        // The real 9B sizes: one MLX file (about 5.0 GB < 5 GiB), four HF files.
        let logical = logical_tensors(&Preset::Qwen35_9B.dims());
        for (layout, limit, n) in [(SynthLayout::default(), MLX_SHARD_BYTES, 1), (SynthLayout::HfBf16, HF_SHARD_BYTES, 4)] {
            let mut st = stored_tensors(&logical, layout);
            st.sort_by(|a, b| a.name.cmp(&b.name));
            let sizes: Vec<u64> = st.iter().map(|t| t.bytes() as u64).collect();
            assert_eq!(writer::shards(&sizes, limit).len(), n, "{layout:?}");
        }
    }
}
