//! The tensors of a Qwen3.5 text model, named and shaped as the spec gives them, checked
//! against the config before anything runs.
//!
//! Three layouts are read (qwen35-spec.md §5): the Hugging Face release
//! (`model.language_model.*`, norms stored as zero-centred offsets used as `1 + w`, conv1d
//! `[C, 1, K]`), the MLX layout written by mlx-lm (`language_model.model.*`, norms stored
//! pre-shifted as `1 + w`, conv1d `[C, K, 1]`), and the flat `model.*` layout of
//! `Qwen3_5ForCausalLM`. As mlx-lm does (spec §5.3, P3), the conv1d layout decides whether norm
//! weights are offsets. Vision (`model.visual.*`, `vision_tower.*`) and MTP (`mtp.*`) tensors are
//! skipped.
//!
//! Mixture-of-experts layers (`qwen3_5_moe`) carry a router `mlp.gate` `[E, D]`, a shared expert
//! `mlp.shared_expert.{gate,up,down}_proj` and its gate `mlp.shared_expert_gate` `[1, D]`, and the
//! routed experts in one of three layouts: transformers 5's fused 3-D `mlp.experts.gate_up_proj`
//! `[E, 2·I, D]` (gate rows first) and `mlp.experts.down_proj` `[E, D, I]`; the per-expert
//! `mlp.experts.{e}.{gate,up,down}_proj.weight` of the checkpoints as released (which transformers'
//! `conversion_mapping` fuses on load); mlx-lm's stacked `mlp.switch_mlp.{gate,up,down}_proj`, 3-D
//! and usually quantized (`weight` U32 `[E, out, in·bits/32]`, `scales`/`biases` `[E, out, in/group]`).
//! Each expert becomes its own [`Matrix`] over its rows of the stacked tensor, in place.
//!
//! Projection matrices stay in the memory map ([`Matrix`]); the small per-channel vectors (norm
//! scales, conv taps, decay parameters) are decoded to f32 once here.

use std::path::PathBuf;

use crate::checkpoint::{Bytes, Checkpoint, Dtype, TensorEntry};
use crate::config::{LayerType, ModelConfig, MoeConfig, QuantParams};
use crate::numerics::{bf16_to_f32, exp, f16_to_f32};

/// A tensor that does not fit the model the config describes. Every variant names the tensor
/// and, where it exists, the file.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("{dir}: missing tensor `{name}` (required by config.json: {why})")]
    Missing { dir: PathBuf, name: String, why: String },
    #[error("{file}: tensor `{name}` has shape {found:?}, expected {expected:?} ({why})")]
    Shape { file: PathBuf, name: String, found: Vec<usize>, expected: Vec<usize>, why: String },
    #[error("{file}: tensor `{name}` has dtype {found:?}, expected {expected}")]
    Dtype { file: PathBuf, name: String, found: Dtype, expected: String },
    #[error("{file}: tensor `{name}` is quantized, but config.json {problem}")]
    Quantization { file: PathBuf, name: String, problem: String },
    #[error("{dir}: no embedding tensor found (looked for `model.language_model.embed_tokens.weight`, `language_model.model.embed_tokens.weight`, `model.embed_tokens.weight`)")]
    UnknownLayout { dir: PathBuf },
    #[error("{dir}: conv1d layouts disagree between layers (`{first}` vs `{second}`); the checkpoint mixes HF and MLX conventions")]
    MixedLayout { dir: PathBuf, first: String, second: String },
}

/// Element type of an unquantized float tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatType {
    F32,
    F16,
    BF16,
}

impl FloatType {
    fn of(d: Dtype) -> Option<Self> {
        match d {
            Dtype::F32 => Some(Self::F32),
            Dtype::F16 => Some(Self::F16),
            Dtype::BF16 => Some(Self::BF16),
            _ => None,
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }
    /// Decodes element `i` of a little-endian byte slice.
    #[inline(always)]
    pub fn get(self, b: &[u8], i: usize) -> f32 {
        match self {
            Self::F32 => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
            Self::F16 => f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
            Self::BF16 => bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
        }
    }
}

/// How a weight matrix is stored.
#[derive(Clone, Debug)]
pub enum MatrixData {
    /// Row-major `[rows, cols]` floats.
    Float { dtype: FloatType, data: Bytes },
    /// MLX affine quantization (qwen35-spec.md §6): `weight` is u32 `[rows, cols·bits/32]`,
    /// element `k` of a word in bits `bits·(k mod (32/bits))` upwards (element 0 lowest);
    /// `scales` and `biases` are `[rows, cols/group_size]` floats of `scale_dtype`. The
    /// decoded element is `fma(scale, q, bias)` in f32 (one rounding).
    Affine { bits: u32, group_size: usize, weight: Bytes, scales: Bytes, biases: Bytes, scale_dtype: FloatType },
}

/// A weight matrix `W[rows, cols]`, applied as `y = W·x` (`rows` outputs, `cols` inputs), read
/// in place from the memory map.
#[derive(Clone, Debug)]
pub struct Matrix {
    /// The checkpoint name of the tensor (for messages and `info`).
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

impl Matrix {
    /// Rows `r0 .. r0 + n` as a matrix of their own over the same bytes (one expert of a stacked
    /// tensor, or the gate half of a fused `gate_up_proj`), named `name`.
    ///
    /// # Panics
    /// If the rows reach past the matrix (the loader slices shapes it has checked).
    pub fn row_range(&self, r0: usize, n: usize, name: String) -> Matrix {
        assert!(r0 + n <= self.rows, "row_range {r0}+{n} of {} rows", self.rows);
        let part = |b: &crate::checkpoint::Bytes| {
            let per_row = b.len() / self.rows;
            b.slice(r0 * per_row..(r0 + n) * per_row)
        };
        let data = match &self.data {
            MatrixData::Float { dtype, data } => MatrixData::Float { dtype: *dtype, data: part(data) },
            MatrixData::Affine { bits, group_size, weight, scales, biases, scale_dtype } => {
                MatrixData::Affine { bits: *bits, group_size: *group_size, weight: part(weight), scales: part(scales), biases: part(biases), scale_dtype: *scale_dtype }
            }
        };
        Matrix { name, rows: n, cols: self.cols, data }
    }

    /// Elements per 32-bit storage word: the unit the canonical dot product assigns to one
    /// lane (docs/numerics.md §2): 8 (4-bit), 4 (8-bit), 2 (f16/bf16), 1 (f32).
    pub fn elems_per_word(&self) -> usize {
        match &self.data {
            MatrixData::Float { dtype, .. } => 4 / dtype.size(),
            MatrixData::Affine { bits, .. } => (32 / bits) as usize,
        }
    }

    /// Bytes a full pass over the matrix reads (codes, scales and biases included).
    pub fn storage_bytes(&self) -> usize {
        match &self.data {
            MatrixData::Float { data, .. } => data.len(),
            MatrixData::Affine { weight, scales, biases, .. } => weight.len() + scales.len() + biases.len(),
        }
    }

    /// Bytes one row occupies (what an embedding lookup reads).
    pub fn row_bytes(&self) -> usize {
        self.storage_bytes() / self.rows
    }

    /// Decodes row `r` to f32 (`out.len() == cols`): the exact widening for floats,
    /// `fma(scale, q, bias)` for affine codes. This is the decode every backend uses.
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        match &self.data {
            MatrixData::Float { dtype, data } => {
                let rb = self.cols * dtype.size();
                let row = &data.as_slice()[r * rb..(r + 1) * rb];
                for (i, o) in out.iter_mut().enumerate() {
                    *o = dtype.get(row, i);
                }
            }
            MatrixData::Affine { bits, group_size, weight, scales, biases, scale_dtype } => {
                let bits = *bits as usize;
                let per_word = 32 / bits;
                let words = self.cols / per_word;
                let groups = self.cols / group_size;
                let w = &weight.as_slice()[r * words * 4..(r + 1) * words * 4];
                let sb = groups * scale_dtype.size();
                let s = &scales.as_slice()[r * sb..(r + 1) * sb];
                let b = &biases.as_slice()[r * sb..(r + 1) * sb];
                let mask = (1u32 << bits) - 1;
                for j in 0..words {
                    let word = u32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]]);
                    for e in 0..per_word {
                        let k = j * per_word + e;
                        let g = k / group_size;
                        let q = ((word >> (bits * e)) & mask) as f32;
                        out[k] = crate::numerics::fma(scale_dtype.get(s, g), q, scale_dtype.get(b, g));
                    }
                }
            }
        }
    }
}

/// Weights of one Gated DeltaNet mixer (spec §3.3).
#[derive(Clone, Debug)]
pub struct GatedDeltaNetWeights<M = Matrix, V = Vec<f32>> {
    /// `[conv_dim, D]`: rows `[Q (Hk·dk) | K (Hk·dk) | V (Hv·dv)]`.
    pub in_proj_qkv: M,
    /// `[Hv·dv, D]`: the output gate z.
    pub in_proj_z: M,
    /// `[Hv, D]`: β logits.
    pub in_proj_b: M,
    /// `[Hv, D]`: decay-rate inputs.
    pub in_proj_a: M,
    /// `[conv_dim, Kc]` f32 taps; tap `Kc−1` multiplies the current token.
    pub conv1d: V,
    /// `A = −exp(A_log)`, `[Hv]` f32 (computed once with our `exp`; the log-decay is
    /// `A·softplus(a + dt_bias)`).
    pub a: V,
    /// `[Hv]` f32.
    pub dt_bias: V,
    /// Gated RMSNorm scale, `[dv]` f32, used as is (no `1 +`, spec P1).
    pub norm: V,
    /// `[D, Hv·dv]`.
    pub out_proj: M,
}

/// Weights of one gated full-attention mixer (spec §3.4).
#[derive(Clone, Debug)]
pub struct AttentionWeights<M = Matrix, V = Vec<f32>> {
    /// `[Hq·2·Dh, D]`: per head h, rows `h·2Dh .. h·2Dh+Dh` are q and the next Dh the gate (P14).
    pub q_proj: M,
    /// `[Hkv·Dh, D]`.
    pub k_proj: M,
    /// `[Hkv·Dh, D]`.
    pub v_proj: M,
    /// `[D, Hq·Dh]`.
    pub o_proj: M,
    /// Effective RMSNorm scale over Dh (f32, `1 + w` already applied for HF offsets).
    pub q_norm: V,
    pub k_norm: V,
}

/// The token mixer of a layer.
#[derive(Clone, Debug)]
pub enum Mixer<M = Matrix, V = Vec<f32>> {
    GatedDeltaNet(GatedDeltaNetWeights<M, V>),
    Attention(AttentionWeights<M, V>),
}

/// SwiGLU MLP weights (spec §3.5).
#[derive(Clone, Debug)]
pub struct MlpWeights<M = Matrix> {
    /// `[I, D]`.
    pub gate_proj: M,
    /// `[I, D]`.
    pub up_proj: M,
    /// `[D, I]`.
    pub down_proj: M,
}

impl<M> MlpWeights<M> {
    fn map<M2, E>(&self, fm: &mut impl FnMut(&M) -> Result<M2, E>) -> Result<MlpWeights<M2>, E> {
        Ok(MlpWeights { gate_proj: fm(&self.gate_proj)?, up_proj: fm(&self.up_proj)?, down_proj: fm(&self.down_proj)? })
    }
}

/// A sparse mixture-of-experts block (transformers `Qwen3_5MoeSparseMoeBlock`): a router, `E`
/// routed SwiGLU experts of width `moe_intermediate_size`, and a shared expert whose output is
/// scaled by a sigmoid gate. The routing arithmetic is docs/numerics.md §7.1.
#[derive(Clone, Debug)]
pub struct MoeWeights<M = Matrix> {
    /// The router `[E, D]` (`mlp.gate`): its logits are softmaxed over the experts.
    pub gate: M,
    /// Expert `e`: gate/up `[I_e, D]`, down `[D, I_e]`.
    pub experts: Vec<MlpWeights<M>>,
    /// The shared expert: gate/up `[I_s, D]`, down `[D, I_s]`.
    pub shared_expert: MlpWeights<M>,
    /// `[1, D]`: the logit of the shared expert's sigmoid gate.
    pub shared_expert_gate: M,
}

/// The feed-forward block of a layer: a dense SwiGLU MLP or a mixture of experts.
#[derive(Clone, Debug)]
pub enum Ffn<M = Matrix> {
    Dense(MlpWeights<M>),
    Moe(MoeWeights<M>),
}

impl<M> Ffn<M> {
    /// The dense MLP, if this block is one.
    pub fn dense(&self) -> Option<&MlpWeights<M>> {
        match self {
            Ffn::Dense(m) => Some(m),
            Ffn::Moe(_) => None,
        }
    }

    /// Every matrix of the block in forward order (router and shared expert before the routed
    /// experts, in expert order).
    pub fn matrices(&self) -> Vec<&M> {
        match self {
            Ffn::Dense(m) => vec![&m.gate_proj, &m.up_proj, &m.down_proj],
            Ffn::Moe(m) => {
                let mut v = vec![&m.gate, &m.shared_expert_gate, &m.shared_expert.gate_proj, &m.shared_expert.up_proj, &m.shared_expert.down_proj];
                for e in &m.experts {
                    v.extend([&e.gate_proj, &e.up_proj, &e.down_proj]);
                }
                v
            }
        }
    }

    fn map<M2, E>(&self, fm: &mut impl FnMut(&M) -> Result<M2, E>) -> Result<Ffn<M2>, E> {
        Ok(match self {
            Ffn::Dense(m) => Ffn::Dense(m.map(fm)?),
            Ffn::Moe(m) => Ffn::Moe(MoeWeights {
                gate: fm(&m.gate)?,
                experts: m.experts.iter().map(|e| e.map(fm)).collect::<Result<_, E>>()?,
                shared_expert: m.shared_expert.map(fm)?,
                shared_expert_gate: fm(&m.shared_expert_gate)?,
            }),
        })
    }
}

/// One decoder layer.
#[derive(Clone, Debug)]
pub struct LayerWeights<M = Matrix, V = Vec<f32>> {
    /// Effective RMSNorm scale `[D]` before the mixer.
    pub input_layernorm: V,
    pub mixer: Mixer<M, V>,
    /// Effective RMSNorm scale `[D]` before the MLP.
    pub post_attention_layernorm: V,
    pub mlp: Ffn<M>,
}

/// Every tensor of the text model, generic over where matrices (`M`) and f32 vectors (`V`)
/// live: `Weights` (the defaults) is the host form read from the checkpoint, which the CPU
/// backend uses in place; a device backend [`Weights::map`]s it to its own buffers.
#[derive(Clone, Debug)]
pub struct Weights<M = Matrix, V = Vec<f32>> {
    /// `[V, D]`: rows are looked up for the input and, when tied, used as the LM head.
    pub embed_tokens: M,
    pub layers: Vec<LayerWeights<M, V>>,
    /// Final RMSNorm scale `[D]`.
    pub norm: V,
    /// `[V, D]` when `tie_word_embeddings` is false.
    pub lm_head: Option<M>,
}

impl<M, V> Weights<M, V> {
    /// The matrix the logits are computed with.
    pub fn lm_head(&self) -> &M {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// The same weights with every matrix and vector converted (e.g. uploaded to a device).
    pub fn map<M2, V2, E>(&self, fm: &mut impl FnMut(&M) -> Result<M2, E>, fv: &mut impl FnMut(&V) -> Result<V2, E>) -> Result<Weights<M2, V2>, E> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let mixer = match &l.mixer {
                Mixer::GatedDeltaNet(g) => Mixer::GatedDeltaNet(GatedDeltaNetWeights {
                    in_proj_qkv: fm(&g.in_proj_qkv)?,
                    in_proj_z: fm(&g.in_proj_z)?,
                    in_proj_b: fm(&g.in_proj_b)?,
                    in_proj_a: fm(&g.in_proj_a)?,
                    conv1d: fv(&g.conv1d)?,
                    a: fv(&g.a)?,
                    dt_bias: fv(&g.dt_bias)?,
                    norm: fv(&g.norm)?,
                    out_proj: fm(&g.out_proj)?,
                }),
                Mixer::Attention(a) => Mixer::Attention(AttentionWeights {
                    q_proj: fm(&a.q_proj)?,
                    k_proj: fm(&a.k_proj)?,
                    v_proj: fm(&a.v_proj)?,
                    o_proj: fm(&a.o_proj)?,
                    q_norm: fv(&a.q_norm)?,
                    k_norm: fv(&a.k_norm)?,
                }),
            };
            layers.push(LayerWeights { input_layernorm: fv(&l.input_layernorm)?, mixer, post_attention_layernorm: fv(&l.post_attention_layernorm)?, mlp: l.mlp.map(fm)? });
        }
        Ok(Weights {
            embed_tokens: fm(&self.embed_tokens)?,
            layers,
            norm: fv(&self.norm)?,
            lm_head: match &self.lm_head {
                Some(h) => Some(fm(h)?),
                None => None,
            },
        })
    }

    /// Every projection matrix, in forward order (for byte counts and uploads).
    pub fn matrices(&self) -> Vec<&M> {
        let mut v = vec![&self.embed_tokens];
        for l in &self.layers {
            match &l.mixer {
                Mixer::GatedDeltaNet(g) => v.extend([&g.in_proj_qkv, &g.in_proj_z, &g.in_proj_b, &g.in_proj_a, &g.out_proj]),
                Mixer::Attention(a) => v.extend([&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]),
            }
            v.extend(l.mlp.matrices());
        }
        if let Some(h) = &self.lm_head {
            v.push(h);
        }
        v
    }
}

/// The checkpoint layout that was detected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `model.language_model.*` (Qwen's `Qwen3_5ForConditionalGeneration` release).
    HfNested,
    /// `language_model.model.*` (mlx-lm / mlx-vlm).
    Mlx,
    /// `model.*` (`Qwen3_5ForCausalLM`).
    Flat,
}

impl Layout {
    fn model_prefix(self) -> &'static str {
        match self {
            Self::HfNested => "model.language_model.",
            Self::Mlx => "language_model.model.",
            Self::Flat => "model.",
        }
    }
    fn lm_head(self) -> &'static str {
        match self {
            Self::Mlx => "language_model.lm_head",
            _ => "lm_head",
        }
    }
}

/// Prefixes of tensors a text engine skips (vision tower, multi-token-prediction head).
pub(crate) const SKIPPED: &[&str] =
    &["model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "language_model.vision_tower.", "mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp."];

struct Loader<'a> {
    ck: &'a Checkpoint,
    cfg: &'a ModelConfig,
    used: std::collections::BTreeSet<String>,
}

impl<'a> Loader<'a> {
    fn entry(&mut self, name: &str, why: &str) -> Result<&'a TensorEntry, WeightsError> {
        let e = self.ck.get(name).ok_or_else(|| WeightsError::Missing { dir: self.ck.dir.clone(), name: name.into(), why: why.into() })?;
        self.used.insert(name.to_string());
        Ok(e)
    }

    fn check_shape(&self, e: &TensorEntry, expected: &[usize], why: &str) -> Result<(), WeightsError> {
        if e.shape != expected {
            return Err(WeightsError::Shape { file: self.ck.path_of(e).to_path_buf(), name: e.name.clone(), found: e.shape.clone(), expected: expected.to_vec(), why: why.into() });
        }
        Ok(())
    }

    fn float_type(&self, e: &TensorEntry) -> Result<FloatType, WeightsError> {
        FloatType::of(e.dtype).ok_or_else(|| WeightsError::Dtype {
            file: self.ck.path_of(e).to_path_buf(),
            name: e.name.clone(),
            found: e.dtype,
            expected: "a float (F32, F16 or BF16)".into(),
        })
    }

    /// A float vector of exactly `shape`, decoded to f32.
    fn vector(&mut self, name: &str, shape: &[usize], why: &str) -> Result<Vec<f32>, WeightsError> {
        let e = self.entry(name, why)?;
        self.check_shape(e, shape, why)?;
        let ft = self.float_type(e)?;
        let b = self.ck.bytes(e);
        let n: usize = shape.iter().product();
        Ok((0..n).map(|i| ft.get(b.as_slice(), i)).collect())
    }

    /// A `[rows, cols]` projection, quantized (MLX affine triple) or float.
    fn matrix(&mut self, module: &str, rows: usize, cols: usize, why: &str) -> Result<Matrix, WeightsError> {
        self.matrix_at(&format!("{module}.weight"), module, None, rows, cols, why)
    }

    /// The `[rows, cols]` matrices of `experts` stacked in the 3-D tensor `wname`
    /// (`[experts, rows, cols]`, or MLX affine `[experts, rows, cols·bits/32]` with `module`'s
    /// scales and biases `[experts, rows, cols/group_size]`), one per expert, in place.
    fn stacked(&mut self, wname: &str, module: &str, experts: usize, rows: usize, cols: usize, why: &str) -> Result<Vec<Matrix>, WeightsError> {
        let all = self.matrix_at(wname, module, Some(experts), rows, cols, why)?;
        Ok((0..experts).map(|e| all.row_range(e * rows, rows, format!("{wname}[{e}]"))).collect())
    }

    /// [`Loader::matrix`] for the tensor `wname` (scales and biases at `{module}.scales` /
    /// `.biases`), with a leading `stack` dimension when given; the matrix has `stack · rows` rows.
    fn matrix_at(&mut self, wname: &str, module: &str, stack: Option<usize>, rows: usize, cols: usize, why: &str) -> Result<Matrix, WeightsError> {
        let wname = wname.to_string();
        let shape = |last: &[usize]| -> Vec<usize> { stack.into_iter().chain(last.iter().copied()).collect() };
        let all_rows = stack.unwrap_or(1) * rows;
        let e = self.entry(&wname, why)?;
        let file = self.ck.path_of(e).to_path_buf();
        if e.dtype == Dtype::U32 {
            let q: QuantParams = self.cfg.quantization.for_module(module).ok_or_else(|| WeightsError::Quantization {
                file: file.clone(),
                name: wname.clone(),
                problem: if self.cfg.quantization.default.is_none() { "has no `quantization` block".into() } else { "marks this module as not quantized".into() },
            })?;
            let per_word = 32 / q.bits as usize;
            if !cols.is_multiple_of(q.group_size) {
                return Err(WeightsError::Quantization { file, name: wname, problem: format!("gives group_size {} that does not divide the {cols} input columns", q.group_size) });
            }
            let qwhy = format!("{why}; {} bits, group_size {}", q.bits, q.group_size);
            self.check_shape(e, &shape(&[rows, cols / per_word]), &qwhy)?;
            let weight = self.ck.bytes(e);
            let sname = format!("{module}.scales");
            let bname = format!("{module}.biases");
            let se = self.entry(&sname, &qwhy)?;
            self.check_shape(se, &shape(&[rows, cols / q.group_size]), &qwhy)?;
            let be = self.entry(&bname, &qwhy)?;
            self.check_shape(be, &shape(&[rows, cols / q.group_size]), &qwhy)?;
            let st = self.float_type(se)?;
            let bt = self.float_type(be)?;
            if st != bt {
                return Err(WeightsError::Dtype { file: self.ck.path_of(be).to_path_buf(), name: bname, found: be.dtype, expected: format!("{st:?} like `{sname}`") });
            }
            Ok(Matrix {
                name: wname,
                rows: all_rows,
                cols,
                data: MatrixData::Affine { bits: q.bits, group_size: q.group_size, weight, scales: self.ck.bytes(se), biases: self.ck.bytes(be), scale_dtype: st },
            })
        } else {
            let ft = self.float_type(e)?;
            self.check_shape(e, &shape(&[rows, cols]), why)?;
            Ok(Matrix { name: wname, rows: all_rows, cols, data: MatrixData::Float { dtype: ft, data: self.ck.bytes(e) } })
        }
    }
}

/// Finds, checks and maps every tensor the config calls for.
///
/// # Errors
/// A missing tensor, a shape that disagrees with the config, an integer tensor where floats
/// belong, quantized tensors the config does not describe, or a checkpoint mixing layouts.
pub fn load(ck: &Checkpoint, cfg: &ModelConfig) -> Result<Loaded, WeightsError> {
    let layout = [Layout::HfNested, Layout::Mlx, Layout::Flat]
        .into_iter()
        .find(|l| ck.get(&format!("{}embed_tokens.weight", l.model_prefix())).is_some())
        .ok_or_else(|| WeightsError::UnknownLayout { dir: ck.dir.clone() })?;
    let m = layout.model_prefix();
    let mut ld = Loader { ck, cfg, used: Default::default() };
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);

    // The conv1d layout tells HF offsets from pre-shifted norms (mlx-lm `sanitize`, spec P3).
    let mut norm_offset: Option<(bool, String)> = None;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for (l, kind) in cfg.layer_types.iter().enumerate() {
        let p = format!("{m}layers.{l}.");
        let mixer = match kind {
            LayerType::LinearAttention => {
                let (hv, kc, cd) = (cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim, cfg.conv_dim());
                let why = |what: &str| format!("layer {l} is linear_attention; {what}");
                let a = format!("{p}linear_attn.");
                let conv_name = format!("{a}conv1d.weight");
                let ce = ld.entry(&conv_name, &why("conv_dim × linear_conv_kernel_dim"))?;
                let hf_conv = match ce.shape.as_slice() {
                    [c, 1, k] if *c == cd && *k == kc => true,
                    [c, k, 1] if *c == cd && *k == kc => false,
                    [c, k] if *c == cd && *k == kc => true,
                    _ => {
                        return Err(WeightsError::Shape {
                            file: ck.path_of(ce).to_path_buf(),
                            name: conv_name,
                            found: ce.shape.clone(),
                            expected: vec![cd, 1, kc],
                            why: format!("conv_dim {cd}, linear_conv_kernel_dim {kc}; [C, 1, K] (HF) or [C, K, 1] (MLX)"),
                        })
                    }
                };
                match &norm_offset {
                    None => norm_offset = Some((hf_conv, conv_name.clone())),
                    Some((prev, first)) if *prev != hf_conv => return Err(WeightsError::MixedLayout { dir: ck.dir.clone(), first: first.clone(), second: conv_name }),
                    _ => {}
                }
                let cft = ld.float_type(ce)?;
                let cb = ck.bytes(ce);
                // Both stored layouts hold channel c's taps contiguously: [C,1,K] and [C,K,1] alike.
                let conv1d: Vec<f32> = (0..cd * kc).map(|i| cft.get(cb.as_slice(), i)).collect();
                let a_log = ld.vector(&format!("{a}A_log"), &[hv], &why("linear_num_value_heads"))?;
                Mixer::GatedDeltaNet(GatedDeltaNetWeights {
                    in_proj_qkv: ld.matrix(&format!("{a}in_proj_qkv"), cd, d, &why("[conv_dim, hidden_size]"))?,
                    in_proj_z: ld.matrix(&format!("{a}in_proj_z"), cfg.value_dim(), d, &why("[value_dim, hidden_size]"))?,
                    in_proj_b: ld.matrix(&format!("{a}in_proj_b"), hv, d, &why("[linear_num_value_heads, hidden_size]"))?,
                    in_proj_a: ld.matrix(&format!("{a}in_proj_a"), hv, d, &why("[linear_num_value_heads, hidden_size]"))?,
                    conv1d,
                    a: a_log.iter().map(|&x| -exp(x)).collect(),
                    dt_bias: ld.vector(&format!("{a}dt_bias"), &[hv], &why("linear_num_value_heads"))?,
                    norm: ld.vector(&format!("{a}norm.weight"), &[cfg.linear_value_head_dim], &why("linear_value_head_dim"))?,
                    out_proj: ld.matrix(&format!("{a}out_proj"), d, cfg.value_dim(), &why("[hidden_size, value_dim]"))?,
                })
            }
            LayerType::FullAttention => {
                let (hq, hkv, dh) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
                let why = |what: &str| format!("layer {l} is full_attention; {what}");
                let a = format!("{p}self_attn.");
                Mixer::Attention(AttentionWeights {
                    q_proj: ld.matrix(&format!("{a}q_proj"), hq * 2 * dh, d, &why("[2·num_attention_heads·head_dim, hidden_size] (q and gate)"))?,
                    k_proj: ld.matrix(&format!("{a}k_proj"), hkv * dh, d, &why("[num_key_value_heads·head_dim, hidden_size]"))?,
                    v_proj: ld.matrix(&format!("{a}v_proj"), hkv * dh, d, &why("[num_key_value_heads·head_dim, hidden_size]"))?,
                    o_proj: ld.matrix(&format!("{a}o_proj"), d, hq * dh, &why("[hidden_size, num_attention_heads·head_dim]"))?,
                    q_norm: ld.vector(&format!("{a}q_norm.weight"), &[dh], &why("head_dim"))?,
                    k_norm: ld.vector(&format!("{a}k_norm.weight"), &[dh], &why("head_dim"))?,
                })
            }
        };
        let why = format!("layer {l}");
        layers.push(LayerWeights {
            input_layernorm: ld.vector(&format!("{p}input_layernorm.weight"), &[d], &why)?,
            mixer,
            post_attention_layernorm: ld.vector(&format!("{p}post_attention_layernorm.weight"), &[d], &why)?,
            mlp: match &cfg.moe {
                None => Ffn::Dense(MlpWeights {
                    gate_proj: ld.matrix(&format!("{p}mlp.gate_proj"), cfg.intermediate_size, d, "[intermediate_size, hidden_size]")?,
                    up_proj: ld.matrix(&format!("{p}mlp.up_proj"), cfg.intermediate_size, d, "[intermediate_size, hidden_size]")?,
                    down_proj: ld.matrix(&format!("{p}mlp.down_proj"), d, cfg.intermediate_size, "[hidden_size, intermediate_size]")?,
                }),
                Some(moe) => Ffn::Moe(load_moe(&mut ld, &format!("{p}mlp."), l, moe, d)?),
            },
        });
    }

    let embed_tokens = ld.matrix(&format!("{m}embed_tokens"), v, d, "[vocab_size, hidden_size]")?;
    let mut norm = ld.vector(&format!("{m}norm.weight"), &[d], "hidden_size")?;
    let lm_head = if cfg.tie_word_embeddings {
        // A tied checkpoint that still carries a head is read as tied, as transformers does.
        if ck.get(&format!("{}.weight", layout.lm_head())).is_some() {
            ld.used.insert(format!("{}.weight", layout.lm_head()));
        }
        None
    } else {
        Some(ld.matrix(layout.lm_head(), v, d, "tie_word_embeddings is false; [vocab_size, hidden_size]")?)
    };

    // HF stores zero-centred offsets: the model multiplies by 1 + w (computed in f32, P1/P2).
    let offsets = norm_offset.map(|(hf, _)| hf).unwrap_or(layout != Layout::Mlx);
    if offsets {
        let shift = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x += 1.0);
        shift(&mut norm);
        for l in &mut layers {
            shift(&mut l.input_layernorm);
            shift(&mut l.post_attention_layernorm);
            if let Mixer::Attention(a) = &mut l.mixer {
                shift(&mut a.q_norm);
                shift(&mut a.k_norm);
            }
        }
    }

    let ignored: Vec<String> = ck.tensors().map(|t| t.name.clone()).filter(|n| !ld.used.contains(n) && !SKIPPED.iter().any(|s| n.starts_with(s))).collect();
    Ok(Loaded { weights: Weights { embed_tokens, layers, norm, lm_head }, layout, norm_offsets: offsets, ignored })
}

/// The mixture-of-experts block of layer `l` under `mp` (`...layers.{l}.mlp.`), in whichever of
/// the three expert layouts the checkpoint has (module docs).
fn load_moe(ld: &mut Loader, mp: &str, l: usize, moe: &MoeConfig, d: usize) -> Result<MoeWeights, WeightsError> {
    let (ne, ie, is) = (moe.num_experts, moe.moe_intermediate_size, moe.shared_expert_intermediate_size);
    let why = |what: &str| format!("layer {l} is a mixture of experts; {what}");
    let gate = ld.matrix(&format!("{mp}gate"), ne, d, &why("router [num_experts, hidden_size]"))?;
    let shared_expert = MlpWeights {
        gate_proj: ld.matrix(&format!("{mp}shared_expert.gate_proj"), is, d, &why("[shared_expert_intermediate_size, hidden_size]"))?,
        up_proj: ld.matrix(&format!("{mp}shared_expert.up_proj"), is, d, &why("[shared_expert_intermediate_size, hidden_size]"))?,
        down_proj: ld.matrix(&format!("{mp}shared_expert.down_proj"), d, is, &why("[hidden_size, shared_expert_intermediate_size]"))?,
    };
    let shared_expert_gate = ld.matrix(&format!("{mp}shared_expert_gate"), 1, d, &why("[1, hidden_size]"))?;
    let sw = format!("{mp}switch_mlp.");
    let fused = format!("{mp}experts.gate_up_proj");
    let experts = if ld.ck.get(&format!("{sw}gate_proj.weight")).is_some() {
        // mlx-lm: gate, up and down stacked separately.
        let stacked = |ld: &mut Loader, name: &str, rows: usize, cols: usize, what: &str| {
            let module = format!("{sw}{name}");
            ld.stacked(&format!("{module}.weight"), &module, ne, rows, cols, &why(what))
        };
        let g = stacked(ld, "gate_proj", ie, d, "[num_experts, moe_intermediate_size, hidden_size]")?;
        let u = stacked(ld, "up_proj", ie, d, "[num_experts, moe_intermediate_size, hidden_size]")?;
        let dn = stacked(ld, "down_proj", d, ie, "[num_experts, hidden_size, moe_intermediate_size]")?;
        g.into_iter().zip(u).zip(dn).map(|((gate_proj, up_proj), down_proj)| MlpWeights { gate_proj, up_proj, down_proj }).collect()
    } else if ld.ck.get(&fused).is_some() {
        // transformers 5: gate and up fused along the output rows (gate first), no `.weight`.
        let gu = ld.stacked(&fused, &fused, ne, 2 * ie, d, &why("[num_experts, 2·moe_intermediate_size, hidden_size] (gate rows, then up rows)"))?;
        let down = format!("{mp}experts.down_proj");
        let dn = ld.stacked(&down, &down, ne, d, ie, &why("[num_experts, hidden_size, moe_intermediate_size]"))?;
        gu.into_iter()
            .zip(dn)
            .map(|(gu, down_proj)| MlpWeights { gate_proj: gu.row_range(0, ie, format!("{} gate", gu.name)), up_proj: gu.row_range(ie, ie, format!("{} up", gu.name)), down_proj })
            .collect()
    } else {
        // The released checkpoints: one tensor per expert and projection.
        let mut v = Vec::with_capacity(ne);
        for e in 0..ne {
            let ep = format!("{mp}experts.{e}.");
            v.push(MlpWeights {
                gate_proj: ld.matrix(&format!("{ep}gate_proj"), ie, d, &why("expert [moe_intermediate_size, hidden_size]"))?,
                up_proj: ld.matrix(&format!("{ep}up_proj"), ie, d, &why("expert [moe_intermediate_size, hidden_size]"))?,
                down_proj: ld.matrix(&format!("{ep}down_proj"), d, ie, &why("expert [hidden_size, moe_intermediate_size]"))?,
            });
        }
        v
    };
    Ok(MoeWeights { gate, experts, shared_expert, shared_expert_gate })
}

/// What [`load`] found.
pub struct Loaded {
    pub weights: Weights,
    pub layout: Layout,
    /// Whether norm weights were stored as zero-centred offsets (HF) and shifted by 1 here.
    pub norm_offsets: bool,
    /// Tensors outside the text model that were not skipped by name (a caller may warn).
    pub ignored: Vec<String>,
}
