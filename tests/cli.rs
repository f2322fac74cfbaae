//! The program as a user runs it: text in, text out, exact ids, seeds, errors on bad input.

use std::path::Path;
use std::process::{Command, Output};

use tensorfold::testutil::{shared, Reference, TempDir};
use tensorfold::tokenizer::Tokenizer;

fn tensorfold(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tensorfold")).args(args).env("TENSORFOLD_SHARED", shared("")).output().expect("run tensorfold")
}

fn ok(args: &[&str]) -> String {
    let o = tensorfold(args);
    assert!(o.status.success(), "tensorfold {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn err(args: &[&str]) -> String {
    let o = tensorfold(args);
    assert!(!o.status.success(), "tensorfold {args:?} should fail");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ids(out: &str) -> Vec<u32> {
    out.lines().map(|l| l.trim().parse().unwrap()).collect()
}

#[test]
fn vocab_fixture_text_in_text_out_through_the_chat_template() {
    // The fixture's prompt is its chat template applied to this message; mlx-lm's greedy
    // continuation of it, decoded by the real Qwen3.5 tokenizer, is what the program must print.
    let dir = shared("fixtures/vocab/mlx-q4");
    let r = Reference::read(&shared("fixtures/vocab/reference.safetensors"));
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let want = tok.decode(&r.ids[18..]).unwrap();
    let d = dir.to_str().unwrap();
    let out = ok(&["run", "-m", d, "--device", "cpu", "--chat", "-p", "Write a haiku about the sea, please.", "--temp", "0", "-n", "40"]);
    assert_eq!(out.trim_end_matches('\n'), want);
    // The same through exact ids.
    let prompt: Vec<String> = r.ids[..18].iter().map(|i| i.to_string()).collect();
    let out = ok(&["run", "-m", d, "--device", "cpu", "--prompt-ids", &prompt.join(","), "--print-ids", "--temp", "0", "-n", "40"]);
    assert_eq!(ids(&out), r.ids[18..].to_vec());
}

#[test]
fn a_seed_reproduces_sampled_tokens_and_another_seed_does_not() {
    let d = shared("fixtures/tiny/mlx-q4");
    let d = d.to_str().unwrap();
    let run = |seed: &str| {
        ids(&ok(&[
            "run",
            "-m",
            d,
            "--device",
            "cpu",
            "--prompt-ids",
            "5,6,7",
            "--print-ids",
            "--temp",
            "1.0",
            "--top-k",
            "0",
            "--top-p",
            "1",
            "--min-p",
            "0",
            "-n",
            "30",
            "--seed",
            seed,
        ]))
    };
    let a = run("5");
    assert_eq!(a.len(), 30);
    assert_eq!(a, run("5"));
    assert_ne!(a, run("6"));
    // Without --seed the fixed default applies: two runs agree.
    let default = |_: ()| ids(&ok(&["run", "-m", d, "--device", "cpu", "--prompt-ids", "5,6,7", "--print-ids", "--temp", "1.0", "-n", "30"]));
    assert_eq!(default(()), default(()));
}

#[test]
fn dump_logits_writes_every_processed_position() {
    let tmp = TempDir::new("dump");
    let path = tmp.path().join("l.safetensors");
    let d = shared("fixtures/tiny/mlx-q4");
    let r = Reference::read(&shared("fixtures/tiny/reference.safetensors"));
    let prompt: Vec<String> = r.ids[..12].iter().map(|i| i.to_string()).collect();
    ok(&["run", "-m", d.to_str().unwrap(), "--device", "cpu", "--prompt-ids", &prompt.join(","), "--temp", "0", "-n", "5", "--print-ids", "--dump-logits", path.to_str().unwrap()]);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits").unwrap();
    let dumped: Vec<i32> = st.tensor("ids").unwrap().data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
    // 12 prompt positions + the 4 generated tokens that were fed back (the 5th was not).
    assert_eq!(logits.shape(), &[16, 2048]);
    assert_eq!(dumped, r.ids[..16].iter().map(|&i| i as i32).collect::<Vec<_>>());
    let got: Vec<f32> = logits.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert!(Reference::score(&got, &r.mlx_full[..16 * 2048]) < 1e-3);
    assert!(!tmp.path().join("l.safetensors.tmp").exists());
}

#[test]
fn dump_logits_never_leaves_or_replaces_a_temporary_file() {
    // Issue 21: the dump went through `<path with extension safetensors.tmp>`, left behind when
    // the target was a directory and replacing a user's own file of that name.
    let tmp = TempDir::new("dump-tmp");
    let d = shared("fixtures/tiny/mlx-q4");
    let run = |target: &Path| {
        tensorfold(&[
            "run",
            "-m",
            d.to_str().unwrap(),
            "--device",
            "cpu",
            "--prompt-ids",
            "1,2,3",
            "--temp",
            "0",
            "-n",
            "2",
            "--print-ids",
            "--dump-logits",
            target.to_str().unwrap(),
        ])
    };
    let names = || -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        n.sort();
        n
    };
    let dir = tmp.path().join("out");
    std::fs::create_dir(&dir).unwrap();
    let o = run(&dir);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains(&format!("{}: is a directory", dir.display())), "{e}");
    assert_eq!(names(), ["out"]);

    let theirs = tmp.path().join("x.safetensors.tmp");
    std::fs::write(&theirs, "the user's file").unwrap();
    let target = tmp.path().join("x.bin");
    let o = run(&target);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(&theirs).unwrap(), "the user's file");
    let bytes = std::fs::read(&target).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // Three prompt positions and the first generated token, fed back.
    assert_eq!(st.tensor("logits").unwrap().shape(), &[4, 2048]);
    assert_eq!(names(), ["out", "x.bin", "x.safetensors.tmp"]);
}

/// Rewrites the JSON file `path` with `edit` applied (the shared fixtures' copies are
/// read-only, so the file is replaced rather than written in place).
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::remove_file(path).unwrap();
    std::fs::write(path, v.to_string()).unwrap();
}

#[test]
fn a_checkpoint_whose_configs_name_no_eos_stops_on_endoftext() {
    // Issue 21: with no eos_token_id in config.json and generation_config.json (as some
    // mlx-community conversions ship), generation ran past <|endoftext|>.
    const ENDOFTEXT: usize = 248_044;
    let src = shared("fixtures/vocab/mlx-q4");
    // The embedding (tied: also the LM head) row of <|endoftext|> becomes the constant `bias`
    // (4-bit scale 0), so its logit is `bias` times the sum of the final normalised state.
    let with_row = |tag: &str, bias: f32| -> TempDir {
        let t = doctored(tag, &src, |v| {
            for (name, value) in [("scales", 0.0f32), ("biases", bias)] {
                let x = v.iter_mut().find(|x| x.0 == format!("language_model.model.embed_tokens.{name}")).unwrap();
                assert_eq!(x.2, [248_320, 1]);
                x.3[2 * ENDOFTEXT..2 * ENDOFTEXT + 2].copy_from_slice(&half::bf16::from_f32(value).to_le_bytes());
            }
        });
        edit_json(&t.path().join("config.json"), |c| {
            c.as_object_mut().unwrap().remove("eos_token_id").unwrap();
            c["text_config"].as_object_mut().unwrap().remove("eos_token_id").unwrap();
        });
        edit_json(&t.path().join("generation_config.json"), |c| {
            c.as_object_mut().unwrap().remove("eos_token_id").unwrap();
        });
        t
    };
    let prompt = "Say hello in five words.";
    // First, that sum at the prompt's last position (bias 1), and the best other logit there.
    let probe = with_row("eos-probe", 1.0);
    let dump = probe.path().join("l.safetensors");
    let dir = probe.path().to_str().unwrap();
    ok(&["run", "-m", dir, "--device", "cpu", "-p", prompt, "-n", "1", "--temp", "0", "--print-ids", "--dump-logits", dump.to_str().unwrap()]);
    let bytes = std::fs::read(&dump).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits").unwrap();
    let v = logits.shape()[1];
    let data = logits.data();
    let last: Vec<f32> = data[data.len() - 4 * v..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let sum = last[ENDOFTEXT];
    assert!(sum.is_finite() && sum != 0.0, "{sum}");
    let best_other = last.iter().enumerate().filter(|&(i, _)| i != ENDOFTEXT).map(|(_, &x)| x).fold(f32::MIN, f32::max);
    // A bias that puts <|endoftext|> 4x above every other logit's magnitude.
    let bias = 4.0 * (best_other.abs() + 1.0) / sum;

    let model = with_row("eos-run", bias);
    let o = tensorfold(&["run", "-m", model.path().to_str().unwrap(), "--device", "cpu", "-p", prompt, "-n", "8", "--temp", "0", "--print-ids"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert_eq!(ids(&String::from_utf8(o.stdout).unwrap()), [ENDOFTEXT as u32]);
    assert!(stderr.contains("generation: 1 token in") && stderr.contains("stopped by eos"), "{stderr}");
}

#[test]
fn the_demo_model_runs_without_m_and_info_reports_it() {
    let out = ok(&["run", "--device", "cpu", "-p", "def fibonacci(n):", "-n", "8", "--temp", "0"]);
    assert!(out.starts_with("def fibonacci(n):"), "{out}");
    assert!(out.len() > "def fibonacci(n):".len());
    let info = ok(&["info"]);
    assert!(info.contains("layers           8 (6 Gated DeltaNet, 2 full attention at [3, 7])"), "{info}");
    assert!(info.contains("parameters       28132576"), "{info}");
}

#[test]
fn user_errors_are_clear() {
    let tmp = TempDir::new("errors");
    let e = err(&["run", "-m", tmp.path().join("missing").to_str().unwrap(), "-p", "x"]);
    assert!(e.contains("missing") && e.contains("config.json"), "{e}");
    // The OS error once: the library's error already names it, anyhow's chain must not repeat it.
    assert_eq!(e.matches("(os error 2)").count(), 1, "{e}");
    let demo_hf = shared("models/tensorfold-demo-py28m/mlx-q4");
    let e = err(&["run", "-m", demo_hf.to_str().unwrap(), "--device", "cpu", "--chat", "-p", "hi"]);
    assert!(e.contains("has no chat template"), "{e}");
    let e = err(&["run", "--device", "cpu", "--prompt-ids", "1,99999", "-n", "1"]);
    assert!(e.contains("prompt id 99999 is outside the model's vocabulary (vocab_size 8192)"), "{e}");
    let e = err(&["run", "--device", "cpu", "-p", "x", "--top-p", "1.5"]);
    assert!(e.contains("--top-p"), "{e}");
    let e = err(&["bench", "--device", "cpu", "-p", "128,0"]);
    assert!(e.contains("--n-prompt") && e.contains("0 tokens"), "{e}");
    let e = err(&["bench", "--device", "cpu", "-r", "0"]);
    assert!(e.contains("--repetitions must be at least 1") && !e.contains("--chunk"), "{e}");
    let e = err(&["run", "--device", "quantum", "-p", "x"]);
    assert!(e.contains("unknown device `quantum`"), "{e}");
}

/// `tensorfold ARGS` with `TENSORFOLD_PRODUCTS` set to `env`, or unset.
fn with_products_env(args: &[&str], env: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tensorfold"));
    c.args(args).env("TENSORFOLD_SHARED", shared(""));
    match env {
        Some(v) => c.env("TENSORFOLD_PRODUCTS", v),
        None => c.env_remove("TENSORFOLD_PRODUCTS"),
    };
    c.output().expect("run tensorfold")
}

#[test]
fn products_flag_and_environment_choose_the_same_arithmetic_and_the_flag_wins() {
    let tmp = TempDir::new("products");
    let d = shared("fixtures/tiny/mlx-q4");
    // Greedy ids, the dumped logits' bytes and the log of one run.
    let run = |extra: &[&str], env: Option<&str>, dump: &str| -> (Vec<u32>, Vec<u8>, String) {
        let path = tmp.path().join(dump);
        let mut args = vec![
            "run",
            "-m",
            d.to_str().unwrap(),
            "--device",
            "cpu",
            "--prompt-ids",
            "5,6,7,300,42",
            "--print-ids",
            "--temp",
            "0",
            "-n",
            "12",
            "--dump-logits",
            path.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = with_products_env(&args, env);
        assert!(o.status.success(), "{args:?} (TENSORFOLD_PRODUCTS {env:?}) failed: {}", String::from_utf8_lossy(&o.stderr));
        (ids(&String::from_utf8(o.stdout).unwrap()), std::fs::read(&path).unwrap(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (flag_ids, flag_logits, flag_log) = run(&["--products", "int"], None, "flag.st");
    let (env_ids, env_logits, env_log) = run(&[], Some("int"), "env.st");
    assert_eq!(flag_ids.len(), 12);
    assert_eq!(flag_ids, env_ids, "--products int and TENSORFOLD_PRODUCTS=int give other ids");
    assert!(flag_logits == env_logits, "--products int and TENSORFOLD_PRODUCTS=int give other logits");
    assert!(flag_log.contains(", integer products)") && env_log.contains(", integer products)"), "{flag_log}\n{env_log}");
    // f32 by default (and with an empty variable): other bits, and the log says nothing of integers.
    let (_, f32_logits, f32_log) = run(&[], None, "f32.st");
    assert!(f32_logits != flag_logits, "integer and f32 products gave the same logits");
    assert!(!f32_log.contains("integer products"), "{f32_log}");
    assert!(run(&[], Some(""), "empty.st").1 == f32_logits);
    // The flag wins over the environment, both ways (even over a value that is not a mode).
    assert!(run(&["--products", "f32"], Some("int"), "f32-over-int.st").1 == f32_logits);
    assert!(run(&["--products", "int"], Some("f32"), "int-over-f32.st").1 == flag_logits);
    assert!(run(&["--products", "f32"], Some("fast"), "f32-over-bad.st").1 == f32_logits);
}

#[test]
fn an_unknown_products_mode_is_refused_naming_it_on_every_inference_command() {
    let d = shared("fixtures/tiny/mlx-q4");
    let d = d.to_str().unwrap();
    let fail = |args: &[&str], env: Option<&str>| -> String {
        let o = with_products_env(args, env);
        assert!(!o.status.success(), "{args:?} (TENSORFOLD_PRODUCTS {env:?}) should fail");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    for cmd in [
        &["run", "-m", d, "--device", "cpu", "--prompt-ids", "5,6", "--print-ids", "-n", "1"][..],
        &["chat", "-m", d, "--device", "cpu"],
        &["bench", "-m", d, "--device", "cpu"],
        &["verify", "-m", d],
        &["serve", "-m", d, "--device", "cpu", "--port", "0"],
    ] {
        let e = fail(cmd, Some("integer"));
        assert!(e.contains("TENSORFOLD_PRODUCTS=\"integer\" is not a products mode: expected f32 or int"), "{cmd:?}: {e}");
        let e = fail(&[cmd, &["--products", "integer"]].concat(), None);
        assert!(e.contains("--products") && e.contains("integer") && e.contains("f32") && e.contains("int"), "{cmd:?}: {e}");
        let help = ok(&[&cmd[..1], &["--help"]].concat());
        assert!(help.contains("--products") && help.contains("docs/numerics.md") && help.contains("TENSORFOLD_PRODUCTS"), "{cmd:?}: {help}");
    }
}

/// Copies a fixture directory, then rewrites its model.safetensors with `edit` applied to the
/// tensor list (name, dtype, shape, bytes).
fn doctored(tag: &str, src: &Path, edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) -> TempDir {
    let tmp = TempDir::new(tag);
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if name != "model.safetensors" && name != "model.safetensors.index.json" {
            std::fs::copy(e.path(), tmp.path().join(&name)).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &tmp.path().join("model.safetensors")).unwrap();
    tmp
}

#[test]
fn bad_checkpoints_are_refused_with_the_file_and_tensor_named() {
    let src = shared("fixtures/tiny/mlx-q4");
    let q = "language_model.model.layers.3.self_attn.q_proj";
    // A missing tensor.
    let t = doctored("missing", &src, |v| v.retain(|x| x.0 != format!("{q}.weight")));
    let e = err(&["info", "-m", t.path().to_str().unwrap()]);
    assert!(e.contains(&format!("missing tensor `{q}.weight`")) && e.contains("layer 3 is full_attention"), "{e}");
    // A misshapen tensor: q_proj with one row too few.
    let t = doctored("shape", &src, |v| {
        let w = v.iter_mut().find(|x| x.0 == format!("{q}.weight")).unwrap();
        w.2[0] -= 1;
        w.3.truncate(w.2.iter().product::<usize>() * 4);
    });
    let e = err(&["info", "-m", t.path().to_str().unwrap()]);
    assert!(e.contains("model.safetensors") && e.contains(&format!("`{q}.weight` has shape [511, 32], expected [512, 32]")), "{e}");
    // An integer tensor where floats belong.
    let n = "language_model.model.layers.0.input_layernorm.weight";
    let t = doctored("dtype", &src, |v| {
        let w = v.iter_mut().find(|x| x.0 == n).unwrap();
        w.1 = safetensors::Dtype::I16;
    });
    let e = err(&["info", "-m", t.path().to_str().unwrap()]);
    assert!(e.contains(&format!("`{n}` has dtype I16, expected a float")), "{e}");
    // Quantized tensors with no quantization block in config.json.
    let t = doctored("noquant", &src, |_| {});
    let cfg = std::fs::read_to_string(t.path().join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v.as_object_mut().unwrap().remove("quantization");
    v.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(t.path().join("config.json"), v.to_string()).unwrap();
    let e = err(&["info", "-m", t.path().to_str().unwrap()]);
    assert!(e.contains("is quantized, but config.json has no `quantization` block"), "{e}");
    // A truncated download.
    let t = doctored("trunc", &src, |_| {});
    let f = t.path().join("model.safetensors");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    let e = err(&["info", "-m", t.path().to_str().unwrap()]);
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
    // An unsupported model type.
    let t = doctored("mtype", &src, |_| {});
    let cfg = std::fs::read_to_string(t.path().join("config.json")).unwrap().replace("\"qwen3_5\"", "\"qwen3_next\"");
    std::fs::write(t.path().join("config.json"), cfg).unwrap();
    let e = err(&["info", "-m", t.path().to_str().unwrap()]);
    assert!(e.contains("unsupported model_type `qwen3_next`"), "{e}");
}

/// `tensorfold chat ARGS` with `input` on stdin.
fn chat(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfold"))
        .arg("chat")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tensorfold chat");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn a_huge_snapshot_budget_is_huge_not_zero() {
    // 2^44 MiB is 2^64 bytes: shifted by 20 bits it used to wrap to 0, which turns snapshots off.
    let m = shared("fixtures/tiny/mlx-q4");
    let o = chat(&["-m", m.to_str().unwrap(), "-n", "2", "--temp", "0", "--snapshot-budget", "17592186044416"], "hello\n");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    // At least the end of the prompt is kept (the finish of the reply is another).
    let n: usize = e.split(" snapshots,").next().and_then(|h| h.rsplit(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(n >= 1, "{e}");
}

#[test]
fn chat_with_a_tokenizer_wider_than_the_model_reports_the_id_and_goes_on() {
    // The tiny model (2,048 ids) with the real Qwen3.5 tokenizer: the chat template's special
    // tokens encode to ids past the embedding, which used to panic in the embedding lookup.
    let tmp = TempDir::new("chat-wide-tokenizer");
    let src = shared("fixtures/tiny/mlx-q4");
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), tmp.path().join(f.file_name())).unwrap();
    }
    std::fs::copy(shared("tokenizers/qwen3.5/tokenizer.json"), tmp.path().join("tokenizer.json")).unwrap();
    let o = chat(&["-m", tmp.path().to_str().unwrap(), "-n", "2", "--temp", "0"], "hello\nagain\n");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !e.contains("panicked"), "{e}");
    assert_eq!(e.matches("is outside the model's vocabulary (vocab_size 2048)").count(), 2, "{e}");
}

#[test]
fn verify_concurrency_compares_staggered_batched_requests_with_solo_runs() {
    let tiny = shared("fixtures/tiny/mlx-q4");
    let out = ok(&["verify", "-m", tiny.to_str().unwrap(), "--device", "cpu", "--concurrency", "6", "--steps", "12"]);
    assert!(out.contains("verify --concurrency 6: every sequence's ids and logits bit-identical to its solo CPU run"), "{out}");
    assert!(out.contains("solo: 6 requests") && out.contains("batched: 6 requests on cpu"), "{out}");
}

#[test]
fn over_long_prompts_and_unwritable_outputs_are_refused_before_any_work() {
    let tmp = TempDir::new("early");
    // The demo model's context is its max_position_embeddings: one id more is refused at once,
    // naming both numbers.
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(shared("models/tensorfold-demo-py28m/mlx-q4/config.json")).unwrap()).unwrap();
    let max = cfg["max_position_embeddings"].as_u64().unwrap() as usize;
    let ids = vec!["1"; max + 1].join(",");
    let e = err(&["run", "--device", "cpu", "--prompt-ids", &ids, "-n", "1"]);
    assert!(e.contains(&format!("the prompt holds {} tokens", max + 1)) && e.contains(&format!("context is {max} tokens")), "{e}");
    let e = err(&["run", "--device", "cpu", "-p", "x", "-n", "1", "--save-session", tmp.path().to_str().unwrap()]);
    assert!(e.contains("--save-session") && e.contains("is a directory"), "{e}");
    let e = err(&["run", "--device", "cpu", "-p", "x", "-n", "1", "--dump-logits", tmp.path().join("no/such/dir/x.safetensors").to_str().unwrap()]);
    assert!(e.contains("--dump-logits") && e.contains("does not exist"), "{e}");
    // -n 0 processes the prompt and reports no rate instead of "inf".
    let o = tensorfold(&["run", "--device", "cpu", "-p", "def f", "-n", "0"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && stderr.contains("generation: 0 tokens") && !stderr.contains("inf"), "{stderr}");
}

#[test]
fn threads_ctx_size_and_stop_flags_as_llama_cpp_spells_them() {
    // -t 1: the backend line names one thread.
    let o = tensorfold(&["run", "--device", "cpu", "-t", "1", "-p", "def f", "-n", "2", "--temp", "0"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && e.contains("1 thread)"), "{e}");
    // -c 10 with 3 prompt ids and -n -1: exactly 7 tokens, then the context is full.
    let o = tensorfold(&["run", "--device", "cpu", "--prompt-ids", "1,2,3", "-c", "10", "-n", "-1", "--print-ids", "--temp", "0"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert_eq!(ids(&String::from_utf8_lossy(&o.stdout)).len(), 7, "{e}");
    assert!(e.contains("stopped by context"), "{e}");
    // A prompt plus -n that cannot fit, and -c past the model's context, are refused.
    let e = err(&["run", "--device", "cpu", "--prompt-ids", "1,2,3", "-c", "10", "-n", "8"]);
    assert!(e.contains("the prompt (3 tokens) and -n 8 do not fit -c 10"), "{e}");
    let e = err(&["run", "--device", "cpu", "-c", "100000000", "-p", "x"]);
    assert!(e.contains("-c 100000000") && e.contains("32768"), "{e}");
    // --stop: the output ends just before the first stop string (repeatable: the earliest wins).
    let full = ok(&["run", "--device", "cpu", "-p", "def f", "-n", "24", "--temp", "0"]);
    let gen = &full["def f".len()..];
    let cut = gen.char_indices().nth(gen.chars().count() / 2).unwrap().0;
    let stop: String = gen[cut..].chars().take(3).collect();
    let first = gen.find(&stop).unwrap();
    let out = ok(&["run", "--device", "cpu", "-p", "def f", "-n", "24", "--temp", "0", "--stop", "\u{1}never", "--stop", &stop]);
    assert_eq!(out, format!("def f{}\n", &gen[..first]), "stop {stop:?}");
}

#[test]
fn the_prompt_is_echoed_alike_from_p_f_and_stdin() {
    use std::io::Write;
    use std::process::Stdio;
    let tmp = TempDir::new("echo");
    let file = tmp.path().join("p.txt");
    std::fs::write(&file, "def add(a, b):").unwrap();
    let args = ["run", "--device", "cpu", "-n", "8", "--temp", "0"];
    let from_p = ok(&[&args[..], &["-p", "def add(a, b):"]].concat());
    assert!(from_p.starts_with("def add(a, b):") && from_p.len() > "def add(a, b):\n".len(), "{from_p:?}");
    let from_f = ok(&[&args[..], &["-f", file.to_str().unwrap()]].concat());
    assert_eq!(from_f, from_p);
    for extra in [&["-f", "-"][..], &[][..]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfold")).args(args).args(extra).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(b"def add(a, b):").unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(String::from_utf8(o.stdout).unwrap(), from_p, "stdin {extra:?}");
    }
}

#[test]
fn chat_takes_threads_and_checks_chat_template_kwargs() {
    let m = shared("fixtures/vocab/mlx-q4");
    let m = m.to_str().unwrap();
    let o = chat(&["-m", m, "--device", "cpu", "-t", "1", "-n", "2", "--temp", "0", "--chat-template-kwargs", r#"{"enable_thinking": false}"#], "hi\n");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && e.contains("1 thread)") && e.contains("reply 2 tokens"), "{e}");
    let o = chat(&["-m", m, "--device", "cpu", "--chat-template-kwargs", "[1]"], "hi\n");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("--chat-template-kwargs must be a JSON object"), "{e}");
}

#[test]
fn chat_bounds_replies_by_default_and_joins_lines_ending_in_a_backslash() {
    let help = ok(&["chat", "--help"]);
    assert!(help.contains("[default: 4096]") && help.contains("end a line with \\"), "{help}");
    let m = shared("fixtures/vocab/mlx-q4");
    let m = m.to_str().unwrap();
    // One message over two lines: one turn; the same lines without the backslash: two.
    let one = chat(&["-m", m, "--device", "cpu", "-n", "2", "--temp", "0"], "hi\\\nthere\n");
    let two = chat(&["-m", m, "--device", "cpu", "-n", "2", "--temp", "0"], "hi\nthere\n");
    let turns = |o: &Output| String::from_utf8_lossy(&o.stderr).matches("[prompt ").count();
    assert_eq!(turns(&one), 1, "{}", String::from_utf8_lossy(&one.stderr));
    assert_eq!(turns(&two), 2, "{}", String::from_utf8_lossy(&two.stderr));
}

#[test]
fn bench_defaults_to_a_quick_plan_and_full_is_the_sweep() {
    let tmp = TempDir::new("bench");
    let json = tmp.path().join("b.json");
    let tiny = shared("fixtures/tiny/mlx-q4");
    let out = ok(&["bench", "-m", tiny.to_str().unwrap(), "-n", "4", "--json", json.to_str().unwrap()]);
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["repetitions"], 2);
    let names: Vec<&str> = r["phases"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("pp512")) && !names.iter().any(|n| n.contains("4096")), "{names:?}");
    // Every row is in the table, before the definitions that close the report.
    let table = out.split("\n- ").next().unwrap();
    for n in &names {
        assert!(table.lines().any(|l| l.starts_with(n)), "{n} missing from {out}");
    }
    let help = ok(&["bench", "--help"]);
    assert!(help.contains("--full") && help.contains("4096"), "{help}");
}

/// `tensorfold serve ARGS`' stderr, which must be an error exit within a minute (a server that
/// starts instead is killed and fails the test).
fn serve_err(args: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorfold"))
        .arg("serve")
        .args(args)
        .args(["--device", "cpu", "--port", "0"])
        .env_remove("TENSORFOLD_API_KEY")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start tensorfold serve");
    let t0 = std::time::Instant::now();
    while child.try_wait().expect("wait for tensorfold serve").is_none() {
        if t0.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tensorfold serve {args:?} started instead of refusing its arguments");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let o = child.wait_with_output().expect("read its stderr");
    assert!(!o.status.success(), "tensorfold serve {args:?} should fail");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn serve_refuses_limits_no_request_could_meet_naming_the_flag() {
    let d = shared("fixtures/vocab/mlx-q4");
    let d = d.to_str().unwrap();
    for (flag, value) in [("--state-budget", "0"), ("--max-seqs", "0"), ("--max-batch-tokens", "0"), ("--max-waiting", "0"), ("--max-n", "0"), ("--max-body-bytes", "10")] {
        let e = serve_err(&["-m", d, flag, value]);
        assert!(e.contains(&format!("{flag} {value} is invalid")), "{flag} {value}: {e}");
    }
    // A budget that holds sequences, but not of the context asked for: 1 MiB holds
    // 9216 + 98304 + 512 per token bytes of this model's state up to 1838 tokens.
    let e = serve_err(&["-m", d, "--state-budget", "1", "--max-model-len", "4096"]);
    assert!(e.contains("--state-budget 1 MiB holds one sequence of at most 1838 tokens, not the 4096 of the context"), "{e}");
    assert!(e.contains("raise --state-budget or lower --max-model-len"), "{e}");
}
