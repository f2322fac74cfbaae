//! `tensorfold convert` against mlx-lm's own converter: the tiny fixture's bf16 checkpoint
//! converted here must give what `mlx_lm.convert` wrote from it (`../shared/fixtures/tiny/mlx-q4`
//! at 4 bits / group 64, and tests/data/quant's 8-bit, group-32/128 and per-module-override
//! variants), tensor for tensor and byte for byte; the result must load and match mlx-lm's logits;
//! bad sources and options are refused, naming the file or flag, leaving nothing behind. Then
//! models by name: the program resolving `-m ORG/NAME` from a Hub-layout cache.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::SafeTensors;
use tensorfold::backend::{cpu::Cpu, Backend, Batch};
use tensorfold::config::QuantParams;
use tensorfold::convert::{convert, ConvertError, ConvertOptions, QuantOverride};
use tensorfold::model::{HostModel, Model};
use tensorfold::testutil::{shared, Reference, TempDir};
use tensorfold::writer::WriteError;

/// The bound of ../shared/fixtures/README.md: "above 1e-3 is a bug, not rounding".
const BOUND: f64 = 1e-3;

fn opts(out: &Path, bits: u32, group_size: usize, overrides: &[&str]) -> ConvertOptions {
    ConvertOptions {
        src_dir: shared("fixtures/tiny/hf"),
        out_dir: out.to_path_buf(),
        quant: QuantParams { group_size, bits },
        overrides: overrides.iter().map(|o| o.parse::<QuantOverride>().unwrap()).collect(),
        base_model: None,
    }
}

fn quant_data(v: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant").join(v)
}

/// Every tensor of a directory's weight shards: name → (dtype, shape, bytes).
fn tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        // model*.safetensors, as mlx-lm writes and reads them (not reference.safetensors).
        let weights = p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("model")) && p.extension().is_some_and(|x| x == "safetensors");
        if weights {
            let bytes = std::fs::read(&p).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (n, v) in st.tensors() {
                out.insert(n, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec()));
            }
        }
    }
    out
}

/// Codes that differ between two U32 code tensors of `bits`-bit codes.
fn differing_codes(a: &[u8], b: &[u8], bits: usize) -> usize {
    let per_word = 32 / bits;
    let mask = (1u32 << bits) - 1;
    a.chunks_exact(4)
        .zip(b.chunks_exact(4))
        .map(|(x, y)| {
            let (x, y) = (u32::from_le_bytes(x.try_into().unwrap()), u32::from_le_bytes(y.try_into().unwrap()));
            (0..per_word).filter(|e| (x >> (bits * e)) & mask != (y >> (bits * e)) & mask).count()
        })
        .sum()
}

/// Converts with `o` and compares every tensor, config.json and the index with `reference`.
fn assert_same_as_mlx_lm(label: &str, o: &ConvertOptions, reference: &Path) {
    let summary = convert(o, &mut |_, _| {}).unwrap_or_else(|e| panic!("{label}: {e}"));
    let (got, want) = (tensors(&o.out_dir), tensors(reference));
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{label}: tensor names");
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(reference.join("config.json")).unwrap()).unwrap();
    let (mut differing_tensors, mut differing, mut total_codes) = (Vec::new(), 0usize, 0usize);
    for (name, (dt, shape, bytes)) in &want {
        let (gdt, gshape, gbytes) = &got[name];
        assert_eq!((gdt, gshape), (dt, shape), "{label}: {name}");
        if dt == "U32" {
            let module = name.trim_end_matches(".weight");
            let bits = cfg["quantization"].get(module).unwrap_or(&cfg["quantization"])["bits"].as_u64().unwrap() as usize;
            differing += differing_codes(gbytes, bytes, bits);
            total_codes += bytes.len() * 8 / bits;
        }
        if gbytes != bytes {
            differing_tensors.push(name.clone());
        }
    }
    assert!(total_codes > 0);
    assert_eq!((differing, differing_tensors), (0, Vec::<String>::new()), "{label}: codes and tensors that differ from mlx-lm's, of {total_codes} codes");
    for f in ["config.json", "model.safetensors.index.json"] {
        assert_eq!(std::fs::read_to_string(o.out_dir.join(f)).unwrap(), std::fs::read_to_string(reference.join(f)).unwrap(), "{label}: {f}");
    }
    assert_eq!(summary.quantized, want.keys().filter(|k| k.ends_with(".scales")).count(), "{label}");
    // The summary's overridden modules are the per-module entries mlx-lm wrote, in its order.
    let per_module: Vec<(String, u32, usize)> = cfg["quantization"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, q)| q.is_object())
        .map(|(m, q)| (m.clone(), q["bits"].as_u64().unwrap() as u32, q["group_size"].as_u64().unwrap() as usize))
        .collect();
    let overridden: Vec<(String, u32, usize)> = summary.overridden.iter().map(|(m, q)| (m.clone(), q.bits, q.group_size)).collect();
    assert_eq!(overridden, per_module, "{label}: overridden modules");
    println!("{label}: {} tensors byte-identical to mlx-lm's ({} quantized modules)", want.len(), summary.quantized);
}

#[test]
fn tiny_hf_converts_to_exactly_what_mlx_lm_wrote() {
    let tmp = TempDir::new("convert-q4");
    let o = opts(&tmp.path().join("out"), 4, 64, &[]);
    let fixture = shared("fixtures/tiny/mlx-q4");
    assert_same_as_mlx_lm("q4-g64", &o, &fixture);
    // The model card and the chat template, as mlx-lm left them.
    for f in ["README.md", "chat_template.jinja", "generation_config.json"] {
        assert_eq!(std::fs::read(o.out_dir.join(f)).unwrap(), std::fs::read(fixture.join(f)).unwrap(), "{f}");
    }
    // The tokenizer is the source's, unchanged (mlx-lm's transformers re-serialises it).
    assert_eq!(std::fs::read(o.out_dir.join("tokenizer.json")).unwrap(), std::fs::read(shared("fixtures/tiny/hf/tokenizer.json")).unwrap());
}

#[test]
fn bits_group_sizes_and_overrides_match_mlx_lm_s_variants() {
    let tmp = TempDir::new("convert-variants");
    let cases: [(&str, u32, usize, &[&str]); 4] = [
        ("q8-g64", 8, 64, &[]),
        ("q4-g32", 4, 32, &[]),
        ("q4-g128", 4, 128, &[]),
        // tools/make_quant_variants.py's mixed_predicate: every mlp.down_proj at 8/32, self_attn.o_proj at 8/128.
        ("mixed", 4, 64, &["mlp.down_proj=8:32", "self_attn.o_proj=8:128"]),
    ];
    for (v, bits, group, overrides) in cases {
        let o = opts(&tmp.path().join(v), bits, group, overrides);
        assert_same_as_mlx_lm(v, &o, &quant_data(v));
    }
}

#[test]
fn the_converted_checkpoint_matches_mlx_lm_s_logits() {
    let tmp = TempDir::new("convert-logits");
    let out = tmp.path().join("out");
    convert(&opts(&out, 4, 64, &[]), &mut |_, _| {}).unwrap();
    let host = HostModel::open(&out).unwrap();
    let model = Model::new(&host, Cpu::new()).unwrap();
    let r = Reference::read(&shared("fixtures/tiny/reference.safetensors"));
    let mut states = model.backend.new_states(&model.config).unwrap();
    let slot = model.backend.alloc_slot(&mut states).unwrap();
    let n = r.ids.len();
    let mut scratch = model.scratch(n, n).unwrap();
    model.step(&Batch::single(slot, 0, &r.ids, true), &mut states, &mut scratch).unwrap();
    let mut got = Vec::new();
    model.backend.read_tensor(&scratch.logits, n, &mut got).unwrap();
    assert_eq!(r.positions, (0..n).collect::<Vec<_>>());
    let score = Reference::score(&got, &r.mlx_full);
    println!("converted tiny: max |tensorfold − mlx_full| / std = {score:.2e}");
    assert!(score < BOUND, "{score:.2e}");
}

/// The directory's entries, to check that a refused or failed conversion left nothing.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// A copy of tiny/hf whose `in_proj_a` of layer 0 is stored as F32 (not a bf16 checkpoint).
fn hf_with_an_f32_matrix(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(shared(&format!("fixtures/tiny/hf/{f}")), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(shared("fixtures/tiny/hf/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let target = "model.language_model.layers.0.linear_attn.in_proj_a.weight";
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (n, v) in st.tensors() {
        if n == target {
            let f32s: Vec<u8> = v.data().chunks_exact(2).flat_map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes()).collect();
            owned.push((n, safetensors::Dtype::F32, v.shape().to_vec(), f32s));
        } else {
            owned.push((n, v.dtype(), v.shape().to_vec(), v.data().to_vec()));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        owned.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn bad_sources_options_and_outputs_are_refused_naming_what_is_wrong() {
    let tmp = TempDir::new("convert-refuse");
    let out = tmp.path().join("out");
    let check = |o: ConvertOptions, want: &[&str]| -> ConvertError {
        let e = convert(&o, &mut |_, _| {}).unwrap_err();
        let text = e.to_string();
        for w in want {
            assert!(text.contains(w), "`{w}` not in: {text}");
        }
        e
    };
    // Values mlx (or tensorfold) does not support, named by their flag.
    check(opts(&out, 6, 64, &[]), &["--q-bits", "6 bits"]);
    check(opts(&out, 4, 48, &[]), &["--q-group-size", "48"]);
    // An override that matches no quantized module (a typo) is refused, naming it.
    let e = check(opts(&out, 4, 64, &["mlp.down_prj=8:32"]), &["--q-override", "`mlp.down_prj` matches no quantized module", "layers.0."]);
    assert!(matches!(e, ConvertError::InvalidOption { .. }), "{e}");
    check(opts(&out, 4, 64, &["mlp.down_proj=8:32", "layernorm=8:64"]), &["`layernorm` matches no quantized module"]);
    // Already-MLX sources: by the config's quantization block.
    let mlx = ConvertOptions { src_dir: shared("fixtures/tiny/mlx-q4"), ..opts(&out, 4, 64, &[]) };
    let e = check(mlx, &["mlx-q4/config.json", "quantization", "already quantized"]);
    assert!(matches!(e, ConvertError::NotHfBf16 { .. }), "{e}");
    // A matrix that is not bf16.
    let f32_src = tmp.path().join("f32-src");
    hf_with_an_f32_matrix(&f32_src);
    let e = check(ConvertOptions { src_dir: f32_src.clone(), ..opts(&out, 4, 64, &[]) }, &["model.safetensors", "layers.0.linear_attn.in_proj_a.weight", "F32", "not BF16"]);
    assert!(matches!(e, ConvertError::NotHfBf16 { .. }), "{e}");
    // Not a checkpoint at all.
    check(ConvertOptions { src_dir: tmp.path().join("nowhere"), ..opts(&out, 4, 64, &[]) }, &["nowhere", "config.json"]);
    assert_eq!(entries(tmp.path()), ["f32-src"], "no output and no staging directory after refusals");

    // An existing non-empty OUT_DIR is refused before anything is read, and kept as it was.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("mine.txt"), b"keep").unwrap();
    let e = check(opts(&out, 4, 64, &[]), &["out", "not empty"]);
    assert!(matches!(e, ConvertError::Write(WriteError::OutDirNotEmpty(ref p)) if *p == out), "{e}");
    assert_eq!(std::fs::read(out.join("mine.txt")).unwrap(), b"keep");
    assert_eq!(entries(tmp.path()), ["f32-src", "out"]);
    // An empty one is filled.
    std::fs::remove_file(out.join("mine.txt")).unwrap();
    convert(&opts(&out, 4, 64, &[]), &mut |_, _| {}).unwrap();
    assert!(out.join("model.safetensors").is_file());
    assert_eq!(entries(tmp.path()), ["f32-src", "out"]);
}

fn tensorfold(args: &[&str], cwd: &Path, env: &[(&str, &Path)]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tensorfold"));
    c.args(args).current_dir(cwd).env("TENSORFOLD_SHARED", shared("")).env_remove("HF_HUB_OFFLINE").env_remove("HF_HUB_CACHE").env_remove("HF_HOME");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// Lays `src`'s files out in a Hub cache as `repo` at `refs/main`: blobs, and relative symlinks
/// to them in the snapshot.
#[cfg(unix)]
fn hub_cache(cache: &Path, repo: &str, src: &Path) -> PathBuf {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    let commit = "89abcdef0123456789abcdef0123456789abcdef";
    let snap = root.join("snapshots").join(commit);
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    std::fs::create_dir_all(root.join("refs")).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::write(root.join("refs/main"), commit).unwrap();
    for (i, e) in std::fs::read_dir(src).unwrap().enumerate() {
        let p = e.unwrap().path();
        let blob = format!("{i:040x}");
        std::fs::copy(&p, root.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(p.file_name().unwrap())).unwrap();
    }
    snap
}

#[cfg(unix)] // the Hub's cache links snapshots to blobs with symlinks
#[test]
fn the_program_takes_models_by_name_from_the_hub_cache() {
    let tmp = TempDir::new("convert-hub-cli");
    let cache = tmp.path().join("hub");
    hub_cache(&cache, "Qwen/Qwen3.5-0.8B", &shared("fixtures/tiny/hf"));
    let offline = [("HF_HUB_CACHE", cache.as_path()), ("HF_HUB_OFFLINE", Path::new("1"))];
    let info = |cwd: &Path| {
        let o = tensorfold(&["info", "-m", "Qwen/Qwen3.5-0.8B"], cwd, &offline);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    assert!(info(tmp.path()).contains("Hugging Face (model.language_model.*)"), "the cached HF snapshot");

    // A local directory of the same name wins over the cache.
    let local = tmp.path().join("Qwen/Qwen3.5-0.8B");
    std::fs::create_dir_all(&local).unwrap();
    for e in std::fs::read_dir(shared("fixtures/tiny/mlx-q4")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, local.join(p.file_name().unwrap())).unwrap();
    }
    assert!(info(tmp.path()).contains("MLX (language_model.model.*)"), "the local directory");

    // Not cached, offline: the repo id and the path looked in are named.
    let o = tensorfold(&["info", "-m", "mlx-community/Qwen3.5-0.8B-4bit"], tmp.path(), &offline);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        e.contains("mlx-community/Qwen3.5-0.8B-4bit@main")
            && e.contains(&cache.join("models--mlx-community--Qwen3.5-0.8B-4bit").display().to_string())
            && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );

    // convert takes the name too, and records it in the model card.
    let out = tmp.path().join("converted");
    let o = tensorfold(&["convert", "Qwen/Qwen3.5-0.8B", out.to_str().unwrap(), "--q-bits", "8"], &cache, &offline);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read_to_string(out.join("README.md")).unwrap().contains("base_model: Qwen/Qwen3.5-0.8B\n"));
    assert!(tensors(&out) == tensors(&quant_data("q8-g64")), "the cached snapshot converts as mlx-lm converted the fixture");
    let o = tensorfold(&["convert", "Qwen/Qwen3.5-0.8B", out.to_str().unwrap(), "--q-group-size", "96"], &cache, &offline);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--q-group-size: group size 96"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn the_printed_summary_lists_each_overridden_module() {
    let tmp = TempDir::new("convert-summary");
    let (src, out) = (shared("fixtures/tiny/hf"), tmp.path().join("out"));
    let o = tensorfold(&["convert", src.to_str().unwrap(), out.to_str().unwrap(), "--q-override", "mlp.down_proj=8:32"], tmp.path(), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let modules: Vec<&String> = cfg["quantization"].as_object().unwrap().iter().filter(|(_, q)| q.is_object()).map(|(m, _)| m).collect();
    assert!(!modules.is_empty());
    let quantized = std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap().matches(".scales\"").count();
    assert!(err.contains(&format!("({} modules at 4 bits, group size 64, {} overridden (below);", quantized - modules.len(), modules.len())), "{err}");
    for m in modules {
        assert!(m.ends_with("mlp.down_proj"), "{m}");
        assert!(err.contains(&format!("\n  {m}: 8 bits, group size 32\n")), "{m} not listed in: {err}");
    }
    // A typo is an error naming the pattern, and leaves nothing behind.
    let bad = tmp.path().join("bad");
    let o = tensorfold(&["convert", src.to_str().unwrap(), bad.to_str().unwrap(), "--q-override", "mlp.dwn_proj=8:32"], tmp.path(), &[]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--q-override: `mlp.dwn_proj` matches no quantized module"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!bad.exists());
}
