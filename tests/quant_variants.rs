//! MLX affine quantization beyond the shared fixtures' 4-bit group-64: the tiny fixture
//! converted by mlx-lm's own converter at 8 bits, at group sizes 32 and 128, and with per-module
//! overrides in the config's `quantization` block (tests/data/quant, made by
//! tools/make_quant_variants.py). Each is checked against mlx-lm's float32 logits and greedy ids.

use std::path::PathBuf;

use tensorfold::backend::{cpu::Cpu, Backend, Batch};
use tensorfold::model::weights::{Matrix, MatrixData, Mixer, Weights};
use tensorfold::model::{HostModel, Model};
use tensorfold::testutil::{greedy_ids, shared, Reference};

/// The bound of ../shared/fixtures/README.md: "above 1e-3 is a bug, not rounding".
const BOUND: f64 = 1e-3;
const PROMPT_LEN: usize = 12;

/// A matrix of the loaded weights, picked out for checking its storage.
type Pick = fn(&Weights) -> &Matrix;

fn embed(w: &Weights) -> &Matrix {
    &w.embed_tokens
}
fn down_proj_0(w: &Weights) -> &Matrix {
    &w.layers[0].mlp.dense().expect("a dense fixture").down_proj
}
fn up_proj_2(w: &Weights) -> &Matrix {
    &w.layers[2].mlp.dense().expect("a dense fixture").up_proj
}
fn gdn_out_proj_1(w: &Weights) -> &Matrix {
    match &w.layers[1].mixer {
        Mixer::GatedDeltaNet(g) => &g.out_proj,
        Mixer::Attention(_) => panic!("layer 1 of tiny is linear_attention"),
    }
}
fn attn_o_proj_3(w: &Weights) -> &Matrix {
    match &w.layers[3].mixer {
        Mixer::Attention(a) => &a.o_proj,
        Mixer::GatedDeltaNet(_) => panic!("layer 3 of tiny is full_attention"),
    }
}

struct Variant {
    dir: &'static str,
    /// Matrices and the (bits, group_size) each must have been loaded with, as mlx-lm wrote them.
    expect: &'static [(&'static str, Pick, u32, usize)],
}

const VARIANTS: &[Variant] = &[
    Variant { dir: "q8-g64", expect: &[("embed_tokens", embed, 8, 64), ("layers.0.mlp.down_proj", down_proj_0, 8, 64)] },
    Variant { dir: "q4-g32", expect: &[("embed_tokens", embed, 4, 32), ("layers.1.linear_attn.out_proj", gdn_out_proj_1, 4, 32)] },
    Variant { dir: "q4-g128", expect: &[("embed_tokens", embed, 4, 128), ("layers.3.self_attn.o_proj", attn_o_proj_3, 4, 128)] },
    // config.json: default bits 4 group 64; every mlp.down_proj bits 8 group 32; layer 3's
    // self_attn.o_proj bits 8 group 128.
    Variant {
        dir: "mixed",
        expect: &[
            ("embed_tokens", embed, 4, 64),
            ("layers.2.mlp.up_proj", up_proj_2, 4, 64),
            ("layers.1.linear_attn.out_proj", gdn_out_proj_1, 4, 64),
            ("layers.0.mlp.down_proj", down_proj_0, 8, 32),
            ("layers.3.self_attn.o_proj", attn_o_proj_3, 8, 128),
        ],
    },
];

fn dir(v: &Variant) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant").join(v.dir)
}

fn open(v: &Variant) -> (HostModel, Model<Cpu>, Reference) {
    let d = dir(v);
    let host = HostModel::open(&d).unwrap_or_else(|e| panic!("{}: {e}", v.dir));
    let model = Model::new(&host, Cpu::new()).unwrap();
    let r = Reference::read(&d.join("reference.safetensors"));
    (host, model, r)
}

#[test]
fn variants_load_with_the_bits_and_group_sizes_mlx_lm_wrote() {
    for v in VARIANTS {
        let (host, _, _) = open(v);
        for &(what, pick, bits, group_size) in v.expect {
            let m = pick(&host.loaded.weights);
            match &m.data {
                MatrixData::Affine { bits: b, group_size: g, .. } => {
                    assert_eq!((*b, *g), (bits, group_size), "{}: {what} ({})", v.dir, m.name)
                }
                MatrixData::Float { .. } => panic!("{}: {what} ({}) loaded as floats", v.dir, m.name),
            }
        }
    }
}

#[test]
fn variants_match_mlx_lm_teacher_forced() {
    let tiny = Reference::read(&shared("fixtures/tiny/reference.safetensors"));
    for v in VARIANTS {
        let (_, model, r) = open(v);
        assert_eq!(r.ids[..PROMPT_LEN], tiny.ids[..PROMPT_LEN], "{}: the prompt is the tiny fixture's", v.dir);
        assert_eq!(r.positions, (0..r.ids.len()).collect::<Vec<_>>(), "{}: every row kept", v.dir);
        let mut states = model.backend.new_states(&model.config).unwrap();
        let slot = model.backend.alloc_slot(&mut states).unwrap();
        let n = r.ids.len();
        let mut scratch = model.scratch(n, n).unwrap();
        model.step(&Batch::single(slot, 0, &r.ids, true), &mut states, &mut scratch).unwrap();
        let mut got = Vec::new();
        model.backend.read_tensor(&scratch.logits, n, &mut got).unwrap();
        let score = Reference::score(&got, &r.mlx_full);
        println!("{}: max |tensorfold − mlx_full| / std = {score:.2e}", v.dir);
        assert!(score < BOUND, "{}: {score:.2e}", v.dir);
    }
}

#[test]
fn variants_greedy_decoding_reproduces_mlx_lm_ids() {
    for v in VARIANTS {
        let (_, model, r) = open(v);
        let ids = greedy_ids(&model, &r.ids[..PROMPT_LEN], r.ids.len());
        assert_eq!(ids, r.ids, "{}", v.dir);
    }
}
