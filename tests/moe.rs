//! Mixture-of-experts Qwen3.5 (`qwen3_5_moe`) on the CPU, on the fixture in tests/data/moe (8
//! experts, top-2, a shared expert; made by tools/make_moe_fixture.py): teacher-forced logits
//! against mlx-lm, transformers and a float64 forward, greedy ids, chunked == token by token,
//! batched == solo, the three expert layouts, and errors that name the tensor or key.

use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use tensorfold::backend::{cpu::Cpu, Backend, Batch, SeqRows};
use tensorfold::config::ModelConfig;
use tensorfold::model::weights::Ffn;
use tensorfold::model::{HostModel, Model};
use tensorfold::testutil::{greedy_ids, Reference, TempDir};

/// The bound of ../shared/fixtures/README.md: "above 1e-3 is a bug, not rounding".
const BOUND: f64 = 1e-3;
/// Prompt length of the fixture (tests/data/moe/reference.json).
const PROMPT_LEN: usize = 12;

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/moe").join(rel)
}

fn load(dir: &Path) -> Model<Cpu> {
    let host = HostModel::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    Model::new(&host, Cpu::new()).unwrap()
}

fn reference() -> Reference {
    Reference::read(&data("reference.safetensors"))
}

/// An f32 array of the fixture's reference file that [`Reference`] does not carry (the float64
/// forwards, rounded to f32).
fn reference_array(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(data("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")).data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Logits of every row after feeding `ids` in chunks of `chunk` tokens.
fn logits_in_chunks(model: &Model<Cpu>, ids: &[u32], chunk: usize) -> Vec<f32> {
    let mut states = model.backend.new_states(&model.config).unwrap();
    let slot = model.backend.alloc_slot(&mut states).unwrap();
    let mut scratch = model.scratch(chunk, chunk).unwrap();
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for (c, part) in ids.chunks(chunk).enumerate() {
        let n = part.len() as u32;
        let batch = Batch { ids: part.to_vec(), seqs: vec![SeqRows { slot, first_row: 0, len: n, pos: (c * chunk) as u32 }], logit_rows: (0..n).collect() };
        model.step(&batch, &mut states, &mut scratch).unwrap();
        model.backend.read_tensor(&scratch.logits, part.len(), &mut buf).unwrap();
        out.extend_from_slice(&buf);
    }
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn mlx_q4_matches_mlx_lm_teacher_forced() {
    let model = load(&data("mlx-q4"));
    assert!(model.weights.layers.iter().all(|l| matches!(l.mlp, Ffn::Moe(_))), "every layer of the fixture is sparse");
    let r = reference();
    let got = logits_in_chunks(&model, &r.ids, r.ids.len());
    let score = Reference::score(&got, &r.mlx_full);
    let f64_score = Reference::score(&got, &reference_array("mlx_f64"));
    println!("moe/mlx-q4: max |tensorfold − mlx_full| / std = {score:.2e}, against float64 {f64_score:.2e}");
    assert!(score < BOUND && f64_score < BOUND, "{score:.2e} / {f64_score:.2e}");
}

#[test]
fn hf_matches_transformers_and_float64_teacher_forced() {
    // transformers' float32 (its chunked Gated DeltaNet) is itself ~1.7e-3 off a float64 forward
    // of these weights (reference.json): against float64 the bound is the README's; against
    // transformers it is its own distance from float64 plus that bound.
    let model = load(&data("hf"));
    let r = reference();
    let got = logits_in_chunks(&model, &r.ids, r.ids.len());
    let (hf, f64) = (r.hf_full.as_ref().unwrap(), reference_array("hf_f64"));
    let to_f64 = Reference::score(&got, &f64);
    let to_hf = Reference::score(&got, hf);
    let hf_own = Reference::score(hf, &f64);
    println!("moe/hf: max |tensorfold − hf_f64| / std = {to_f64:.2e}, − hf_full {to_hf:.2e} (transformers − float64: {hf_own:.2e})");
    assert!(to_f64 < BOUND, "{to_f64:.2e}");
    assert!(to_hf < hf_own + BOUND, "{to_hf:.2e} against transformers, which is {hf_own:.2e} from float64");
}

#[test]
fn greedy_decoding_reproduces_mlx_lm_ids() {
    let model = load(&data("mlx-q4"));
    let r = reference();
    assert_eq!(greedy_ids(&model, &r.ids[..PROMPT_LEN], r.ids.len()), r.ids);
}

#[test]
fn chunked_prefill_equals_token_by_token_bit_for_bit() {
    let r = reference();
    for layout in ["mlx-q4", "hf"] {
        let model = load(&data(layout));
        let one = logits_in_chunks(&model, &r.ids, 1);
        for chunk in [5, r.ids.len()] {
            assert!(same_bits(&one, &logits_in_chunks(&model, &r.ids, chunk)), "{layout}: chunks of {chunk} differ from one token at a time");
        }
    }
}

#[test]
fn batched_sequences_equal_their_solo_runs() {
    // Two sequences in one step route their rows to different experts: each row's bits are the
    // ones it gets alone.
    let model = load(&data("mlx-q4"));
    let r = reference();
    let (a, b) = (&r.ids[..30], &r.ids[7..27]);
    let (solo_a, solo_b) = (logits_in_chunks(&model, a, a.len()), logits_in_chunks(&model, b, b.len()));
    let mut states = model.backend.new_states(&model.config).unwrap();
    let (sa, sb) = (model.backend.alloc_slot(&mut states).unwrap(), model.backend.alloc_slot(&mut states).unwrap());
    let mut scratch = model.scratch(64, 64).unwrap();
    let v = model.config.vocab_size;
    let (mut got_a, mut got_b, mut buf) = (Vec::new(), Vec::new(), Vec::new());
    for ((a0, a1), (b0, b1)) in [((0, 10), (0, 4)), ((10, 30), (4, 20))] {
        let (na, nb) = ((a1 - a0) as u32, (b1 - b0) as u32);
        let batch = Batch {
            ids: [&a[a0..a1], &b[b0..b1]].concat(),
            seqs: vec![SeqRows { slot: sa, first_row: 0, len: na, pos: a0 as u32 }, SeqRows { slot: sb, first_row: na, len: nb, pos: b0 as u32 }],
            logit_rows: (0..na + nb).collect(),
        };
        model.step(&batch, &mut states, &mut scratch).unwrap();
        model.backend.read_tensor(&scratch.logits, (na + nb) as usize, &mut buf).unwrap();
        got_a.extend_from_slice(&buf[..na as usize * v]);
        got_b.extend_from_slice(&buf[na as usize * v..]);
    }
    assert!(same_bits(&got_a, &solo_a) && same_bits(&got_b, &solo_b), "a batched row differs from its solo run");
}

#[test]
fn batched_runtime_equals_solo_runs() {
    // `verify --concurrency` drives the batched runtime (staggered arrivals, a cancel) and
    // compares every sequence's ids and logits bits with its solo CPU run; it exits non-zero on
    // the first difference.
    let out = Command::new(env!("CARGO_BIN_EXE_tensorfold"))
        .args(["verify", "-m", data("mlx-q4").to_str().unwrap(), "--concurrency", "6", "--steps", "40", "--device", "cpu"])
        .output()
        .expect("run tensorfold");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("bit-identical to its solo CPU run"), "{text}");
}

/// A tensor as raw parts, to rewrite a checkpoint.
struct Raw {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn read_raw(path: &Path) -> Vec<Raw> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<Raw> = st.tensors().into_iter().map(|(name, t)| Raw { name, dtype: t.dtype(), shape: t.shape().to_vec(), data: t.data().to_vec() }).collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// A copy of `hf/` whose tensors are `edit(tensors)`.
fn hf_copy(tag: &str, edit: impl FnOnce(Vec<Raw>) -> Vec<Raw>) -> TempDir {
    let dir = TempDir::new(tag);
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(data("hf").join(f), dir.path().join(f)).unwrap();
    }
    let tensors = edit(read_raw(&data("hf/model.safetensors")));
    let views: Vec<(String, TensorView)> = tensors.iter().map(|t| (t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

/// The fused 3-D experts split into the per-expert tensors of the released checkpoints
/// (`mlp.experts.{e}.{gate,up,down}_proj.weight`), as transformers' conversion_mapping reads them.
fn split_experts(tensors: Vec<Raw>) -> Vec<Raw> {
    let mut out = Vec::new();
    for t in tensors {
        let Some(prefix) = t.name.strip_suffix("experts.gate_up_proj").or_else(|| t.name.strip_suffix("experts.down_proj")) else {
            out.push(t);
            continue;
        };
        let (e, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
        let row_bytes = cols * 2; // bf16
        for i in 0..e {
            let expert = &t.data[i * rows * row_bytes..(i + 1) * rows * row_bytes];
            let mut push = |proj: &str, part: &[u8], r: usize| {
                out.push(Raw { name: format!("{prefix}experts.{i}.{proj}.weight"), dtype: t.dtype, shape: vec![r, cols], data: part.to_vec() });
            };
            if t.name.ends_with("gate_up_proj") {
                let half = rows / 2 * row_bytes;
                push("gate_proj", &expert[..half], rows / 2);
                push("up_proj", &expert[half..], rows / 2);
            } else {
                push("down_proj", expert, rows);
            }
        }
    }
    out
}

#[test]
fn per_expert_tensors_give_the_fused_layout_bits() {
    let split = hf_copy("moe-split", split_experts);
    let r = reference();
    let ids = &r.ids[..20];
    let fused = logits_in_chunks(&load(&data("hf")), ids, ids.len());
    let per_expert = logits_in_chunks(&load(split.path()), ids, ids.len());
    assert!(same_bits(&fused, &per_expert), "per-expert tensors give other logits than the fused 3-D ones");
}

#[test]
fn a_mis_shaped_expert_tensor_is_an_error_naming_it() {
    let name = "model.language_model.layers.2.mlp.experts.down_proj";
    // [8, 128, 64] stored as [8, 64, 128]: the same bytes, the wrong shape.
    let dir = hf_copy("moe-badshape", |mut t| {
        let d = t.iter_mut().find(|t| t.name == name).unwrap();
        d.shape = vec![8, 64, 128];
        t
    });
    let err = HostModel::open(dir.path()).err().expect("a mis-shaped expert tensor loads").to_string();
    assert!(err.contains(&format!("tensor `{name}` has shape [8, 64, 128], expected [8, 128, 64]")) && err.contains("layer 2 is a mixture of experts"), "{err}");
    // A missing expert of the per-expert layout is named too.
    let missing = "model.language_model.layers.1.mlp.experts.5.up_proj.weight";
    let dir = hf_copy("moe-missing", |t| split_experts(t).into_iter().filter(|t| t.name != missing).collect());
    let err = HostModel::open(dir.path()).err().expect("a checkpoint without an expert loads").to_string();
    assert!(err.contains(&format!("missing tensor `{missing}`")), "{err}");
    // A router with too few experts.
    let router = "model.language_model.layers.0.mlp.gate.weight";
    let dir = hf_copy("moe-router", |mut t| {
        let g = t.iter_mut().find(|t| t.name == router).unwrap();
        g.shape = vec![4, 256];
        t
    });
    let err = HostModel::open(dir.path()).err().expect("a mis-shaped router loads").to_string();
    assert!(err.contains(&format!("tensor `{router}` has shape [4, 256], expected [8, 128]")), "{err}");
}

#[test]
fn nested_and_flat_configs_parse_alike() {
    let path = data("hf/config.json");
    let nested: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let a = ModelConfig::from_json(&path, &nested).unwrap();
    let m = a.moe.expect("the fixture is a mixture of experts");
    assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size, m.norm_topk_prob), (8, 2, 64, 128, true));
    assert_eq!(a.intermediate_size, 0);
    // Flat, as Qwen3_5MoeForCausalLM saves it: the text fields at the top level.
    let mut flat = nested["text_config"].clone();
    flat["architectures"] = serde_json::json!(["Qwen3_5MoeForCausalLM"]);
    let b = ModelConfig::from_json(&path, &flat).unwrap();
    assert_eq!((b.moe, b.hidden_size, b.layer_types.clone()), (a.moe, a.hidden_size, a.layer_types.clone()));
    // mlx-lm's converted config (nested, with a quantization block that overrides the router).
    let c = ModelConfig::from_dir(&data("mlx-q4")).unwrap();
    assert_eq!(c.moe, a.moe);
    assert_eq!(c.quantization.for_module("language_model.model.layers.0.mlp.gate").map(|q| q.bits), Some(8));
    // Errors name the key, nested or flat.
    let mut bad = nested.clone();
    bad["text_config"]["num_experts_per_tok"] = 9.into();
    let err = ModelConfig::from_json(&path, &bad).unwrap_err().to_string();
    assert!(err.contains("field `text_config.num_experts_per_tok` (9) must be at most num_experts (8)"), "{err}");
    let mut bad = flat.clone();
    bad.as_object_mut().unwrap().remove("moe_intermediate_size");
    let err = ModelConfig::from_json(&path, &bad).unwrap_err().to_string();
    assert!(err.contains("missing field `moe_intermediate_size`"), "{err}");
    let mut bad = flat;
    bad["mlp_only_layers"] = serde_json::json!([0]);
    let err = ModelConfig::from_json(&path, &bad).unwrap_err().to_string();
    assert!(err.contains("field `mlp_only_layers` ([0]) is not supported"), "{err}");
}

/// Every tensor of a directory's `model*.safetensors`: name → (dtype, shape, bytes).
fn weight_tensors(dir: &Path) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("model")) && p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            for (n, v) in SafeTensors::deserialize(&bytes).unwrap().tensors() {
                out.insert(n, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec()));
            }
        }
    }
    out
}

#[test]
fn convert_writes_what_mlx_lm_convert_wrote() {
    // tests/data/moe/mlx-q4 is mlx_lm.convert's output from hf/ (4 bits, group 64; the router and
    // shared-expert gate at 8 bits by its predicate; the fused experts split into switch_mlp).
    use tensorfold::config::QuantParams;
    use tensorfold::convert::{convert, ConvertOptions};
    let out = TempDir::new("moe-convert");
    let dir = out.path().join("q4");
    let opts = ConvertOptions { src_dir: data("hf"), out_dir: dir.clone(), quant: QuantParams { group_size: 64, bits: 4 }, overrides: Vec::new(), base_model: None };
    convert(&opts, &mut |_, _| {}).unwrap();
    let (ours, theirs) = (weight_tensors(&dir), weight_tensors(&data("mlx-q4")));
    assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>());
    for (name, t) in &theirs {
        assert!(&ours[name] == t, "{name}: dtype, shape or bytes differ from mlx-lm's");
    }
    for f in ["config.json", "model.safetensors.index.json"] {
        assert_eq!(std::fs::read_to_string(dir.join(f)).unwrap(), std::fs::read_to_string(data("mlx-q4").join(f)).unwrap(), "{f}");
    }
    // Per-expert tensors are refused, naming one (mlx-lm converts only the fused layout).
    let split = hf_copy("moe-convert-split", split_experts);
    let opts = ConvertOptions { src_dir: split.path().to_path_buf(), out_dir: out.path().join("split"), ..opts };
    let err = convert(&opts, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("`model.language_model.layers.0.mlp.experts.0.down_proj.weight` is a per-expert tensor"), "{err}");
}

#[test]
fn eight_bit_conversion_matches_mlx_lm_teacher_forced() {
    // mlx-lm's 8-bit conversion of hf/ is not shipped, its logits are (mlx_q8_full); tensorfold's
    // converter writes the same bytes as mlx_lm.convert, so its 8-bit output is that checkpoint.
    use tensorfold::config::QuantParams;
    use tensorfold::convert::{convert, ConvertOptions};
    let out = TempDir::new("moe-q8");
    let dir = out.path().join("q8");
    let opts = ConvertOptions { src_dir: data("hf"), out_dir: dir.clone(), quant: QuantParams { group_size: 64, bits: 8 }, overrides: Vec::new(), base_model: None };
    convert(&opts, &mut |_, _| {}).unwrap();
    let model = load(&dir);
    let r = reference();
    let got = logits_in_chunks(&model, &r.ids, r.ids.len());
    let score = Reference::score(&got, &reference_array("mlx_q8_full"));
    println!("moe/mlx-q8: max |tensorfold − mlx_q8_full| / std = {score:.2e}");
    assert!(score < BOUND, "{score:.2e}");
    assert!(same_bits(&got, &logits_in_chunks(&model, &r.ids, 1)), "8-bit: the whole prompt and token by token differ");
}
