//! The runtime against solo runs of the plain engine: every sequence, whatever shares its ticks,
//! gives the ids and logits bits it gets alone.

use super::*;
use crate::backend::cpu::Cpu;
use crate::model::{HostModel, Model};
use crate::testutil::shared;

const TINY: &str = "fixtures/tiny/mlx-q4";

fn engine(rel: &str) -> Engine<Cpu> {
    let dir = shared(rel);
    let host = HostModel::open(&dir).unwrap_or_else(|e| panic!("opening the fixture {}: {e}", dir.display()));
    Engine::new(Model::new(&host, Cpu::new()).expect("model"), 256).expect("engine")
}

fn start(rel: &'static str, cfg: RuntimeConfig, tokenizer: Option<Arc<Tokenizer>>) -> Runtime {
    Runtime::start(cfg, tokenizer, move || Ok::<_, BackendError>(engine(rel))).expect("runtime starts")
}

/// A prompt of `n` ids, different for every `seed`.
fn prompt(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    crate::bench::ids(n, vocab, seed)
}

/// What a request produced: ids, their logits rows, the finish.
#[derive(Debug, Clone)]
struct Run {
    ids: Vec<u32>,
    logits: Vec<Vec<u32>>,
    finished: Option<Finished>,
    text: String,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The plain engine, one sequence at a time: prompt, then sample and feed `n` times.
fn solo(e: &mut Engine<Cpu>, prompt: &[u32], params: SamplingParams, n: usize) -> Run {
    let v = e.vocab_size();
    let mut s = e.new_session(params).unwrap();
    let mut logits = e.feed(&mut s, prompt, false, &mut |_, _| {}).unwrap().to_vec();
    let mut sampler = Sampler::new();
    let mut run = Run { ids: Vec::new(), logits: Vec::new(), finished: None, text: String::new() };
    for i in 0..n {
        let id = s.sample(&mut sampler, &logits[..v]);
        run.ids.push(id);
        run.logits.push(bits(&logits));
        s.push(id);
        if i + 1 < n {
            logits = e.feed(&mut s, &[], false, &mut |_, _| {}).unwrap().to_vec();
        }
    }
    e.free_session(s).unwrap();
    run
}

fn collect(h: &mut Handle) -> Run {
    let mut run = Run { ids: Vec::new(), logits: Vec::new(), finished: None, text: String::new() };
    while let Some(ev) = h.blocking_next() {
        match ev {
            Event::Token(t) => {
                run.ids.push(t.id);
                run.text.push_str(&t.text);
                if let Some(l) = t.logits {
                    run.logits.push(bits(&l));
                }
            }
            Event::Finished(f) => {
                run.finished = Some(f);
                break;
            }
            _ => {}
        }
    }
    run
}

/// The stats once the runtime's thread has published its last tick (it sends the events
/// first).
fn settled(rt: &Runtime) -> Stats {
    for _ in 0..1000 {
        let s = rt.stats();
        if s.running == 0 && s.waiting == 0 {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    rt.stats()
}

fn request(prompt: Vec<u32>, params: SamplingParams, n: usize) -> Request {
    let mut r = Request::new(prompt, params, StopRules { eos_ids: Vec::new(), strings: Vec::new(), max_tokens: Some(n) });
    r.return_logits = true;
    r
}

/// Greedy for even `i`, seeded sampling (llama.cpp's defaults, a repetition penalty) for odd.
fn params(i: usize) -> SamplingParams {
    if i.is_multiple_of(2) {
        SamplingParams::greedy()
    } else {
        SamplingParams { seed: 1000 + i as u64, repetition_penalty: 1.1, ..SamplingParams::default() }
    }
}

fn concurrent_equals_solo(n: usize, max_batch_tokens: usize) {
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let cases: Vec<(Vec<u32>, SamplingParams, usize)> = (0..n).map(|i| (prompt(3 + (i * 7) % 40, i as u64, v), params(i), 6 + i % 5)).collect();
    let want: Vec<Run> = cases.iter().map(|(p, sp, g)| solo(&mut e, p, *sp, *g)).collect();
    let rt = start(TINY, RuntimeConfig { max_seqs: n, max_batch_tokens, chunk: 16, ..RuntimeConfig::default() }, None);
    // Half arrive at once; the rest once the first has started generating (other ticks).
    let mut handles: Vec<Handle> = cases[..n / 2].iter().map(|(p, sp, g)| rt.submit(request(p.clone(), *sp, *g)).unwrap()).collect();
    let mut first = Vec::new();
    loop {
        match handles[0].blocking_next() {
            Some(Event::Token(t)) => {
                first.push(t);
                break;
            }
            Some(_) => {}
            None => panic!("the first request ended without a token"),
        }
    }
    handles.extend(cases[n / 2..].iter().map(|(p, sp, g)| rt.submit(request(p.clone(), *sp, *g)).unwrap()));
    for (i, (h, w)) in handles.iter_mut().zip(&want).enumerate() {
        let mut got = collect(h);
        if i == 0 {
            got.ids.insert(0, first[0].id);
            got.logits.insert(0, bits(first[0].logits.as_ref().unwrap()));
        }
        assert_eq!(got.ids, w.ids, "sequence {i}: ids");
        assert!(got.logits == w.logits, "sequence {i}: logits bits differ from the solo run");
        let f = got.finished.unwrap();
        assert_eq!(f.reason, FinishReason::Length);
        assert_eq!(f.usage, Usage { prompt_tokens: cases[i].0.len(), cached_tokens: 0, completion_tokens: cases[i].2 });
    }
    let st = settled(&rt);
    assert_eq!((st.running, st.waiting, st.finished), (0, 0, n as u64));
    assert_eq!(st.generated_tokens, cases.iter().map(|c| c.2 as u64).sum::<u64>());
}

#[test]
fn eight_concurrent_sequences_equal_their_solo_runs() {
    concurrent_equals_solo(8, 24);
}

#[test]
fn sixty_four_concurrent_sequences_equal_their_solo_runs() {
    concurrent_equals_solo(64, 96);
}

#[test]
fn a_cancel_frees_the_slot_for_the_next_request() {
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let (pa, pb) = (prompt(9, 1, v), prompt(5, 2, v));
    let want_b = solo(&mut e, &pb, SamplingParams::greedy(), 5);
    let rt = start(TINY, RuntimeConfig { max_seqs: 1, ..RuntimeConfig::default() }, None);
    let mut a = rt.submit(request(pa, SamplingParams::greedy(), 100_000)).unwrap();
    let mut b = rt.submit(request(pb, SamplingParams::greedy(), 5)).unwrap();
    // A runs, B waits for the only slot.
    let mut a_tokens = 0;
    while a_tokens < 3 {
        if let Some(Event::Token(_)) = a.blocking_next() {
            a_tokens += 1;
        }
    }
    assert_eq!(b.try_next(), None, "B cannot start while A holds the slot");
    a.cancel();
    let got_a = collect(&mut a);
    assert_eq!(got_a.finished.unwrap().reason, FinishReason::Cancelled);
    let got_b = collect(&mut b);
    assert_eq!(got_b.ids, want_b.ids);
    assert!(got_b.logits == want_b.logits);
    assert_eq!(settled(&rt).cancelled, 1);
}

#[test]
fn a_dropped_handle_cancels_its_request() {
    let rt = start(TINY, RuntimeConfig { max_seqs: 1, ..RuntimeConfig::default() }, None);
    let v = rt.info().config.vocab_size;
    let mut a = rt.submit(request(prompt(4, 3, v), SamplingParams::greedy(), 1_000_000)).unwrap();
    while !matches!(a.blocking_next(), Some(Event::Token(_))) {}
    drop(a);
    let mut b = rt.submit(request(prompt(4, 4, v), SamplingParams::greedy(), 2)).unwrap();
    assert_eq!(collect(&mut b).ids.len(), 2, "the dropped request's slot was freed");
    assert_eq!(settled(&rt).cancelled, 1);
}

#[test]
fn sequences_preempted_for_memory_resume_with_the_same_bits() {
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let cfg = e.model.config.clone();
    let cases: Vec<(Vec<u32>, SamplingParams, usize)> = (0..5).map(|i| (prompt(10 + i, 50 + i as u64, v), params(i), 40)).collect();
    let want: Vec<Run> = cases.iter().map(|(p, sp, g)| solo(&mut e, p, *sp, *g)).collect();
    // Room for two sequences of 20 tokens: admission queues the rest, and growth past 20
    // preempts.
    let budget = session::state_bytes(&cfg, 20) * 2;
    let rt = start(TINY, RuntimeConfig { max_seqs: 5, state_budget: budget, ..RuntimeConfig::default() }, None);
    let mut handles: Vec<Handle> = cases.iter().map(|(p, sp, g)| rt.submit(request(p.clone(), *sp, *g)).unwrap()).collect();
    for (i, (h, w)) in handles.iter_mut().zip(&want).enumerate() {
        let got = collect(h);
        assert_eq!(got.ids, w.ids, "sequence {i}");
        assert!(got.logits == w.logits, "sequence {i}: logits");
        assert_eq!(got.finished.unwrap().reason, FinishReason::Length);
    }
    let st = settled(&rt);
    assert!(st.preemptions > 0, "the budget forced preemptions ({st:?})");
    assert_eq!(st.errors, 0);
}

#[test]
fn prefix_snapshot_hits_around_the_stride_equal_cold_runs() {
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let base = prompt(3 * 8 + 5, 77, v);
    // Snapshots in host memory, then in backend slots (resumed by a slot copy).
    for (budget_bytes, device_budget_bytes) in [(1 << 30, 0), (0, 1 << 30)] {
        let snapshots = SnapshotConfig { every: 8, budget_bytes, device_budget_bytes };
        let rt = start(TINY, RuntimeConfig { snapshots, ..RuntimeConfig::default() }, None);
        let mut h = rt.submit(request(base.clone(), SamplingParams::greedy(), 2)).unwrap();
        let _ = collect(&mut h);
        let st = settled(&rt);
        assert_eq!(st.snapshot_slot_bytes > 0, device_budget_bytes > 0, "{st:?}");
        assert_eq!(st.snapshot_slot_bytes == st.snapshot_bytes, device_budget_bytes > 0, "{st:?}");
        // A new last id after the first m ids of the prompt: the longest snapshot ≤ m is reused.
        for (m, cached) in [(23, 16), (24, 24), (25, 24), (5, 0), (7, 0), (8, 8), (29, 29)] {
            let mut p = base[..m].to_vec();
            p.push((base[m.min(base.len() - 1)] + 1) % v as u32);
            let want = solo(&mut e, &p, SamplingParams::greedy(), 3);
            let mut h = rt.submit(request(p, SamplingParams::greedy(), 3)).unwrap();
            let started = h.blocking_next();
            assert_eq!(started, Some(Event::Started { cached_tokens: cached }), "prefix of {m}");
            let got = collect(&mut h);
            assert_eq!(got.ids, want.ids, "prefix of {m}");
            assert!(got.logits == want.logits, "prefix of {m}: logits");
            assert_eq!(got.finished.unwrap().usage.cached_tokens, cached);
        }
        let st = settled(&rt);
        assert!(st.prefix.hits >= 5 && st.prefix.reused_tokens >= 16 + 24 + 24 + 8 + 29, "{st:?}");
    }
}

#[test]
fn the_queue_is_bounded() {
    let rt = start(TINY, RuntimeConfig { max_seqs: 1, max_waiting: 2, ..RuntimeConfig::default() }, None);
    let v = rt.info().config.vocab_size;
    let mut a = rt.submit(request(prompt(4, 1, v), SamplingParams::greedy(), 1_000_000)).unwrap();
    assert!(matches!(a.blocking_next(), Some(Event::Started { .. })));
    let _b = rt.submit(request(prompt(4, 2, v), SamplingParams::greedy(), 1)).unwrap();
    let _c = rt.submit(request(prompt(4, 3, v), SamplingParams::greedy(), 1)).unwrap();
    assert_eq!(rt.submit(request(prompt(4, 4, v), SamplingParams::greedy(), 1)).err(), Some(SubmitError::QueueFull(2)));
    // Requests that can never run are refused at once.
    assert_eq!(rt.submit(request(Vec::new(), SamplingParams::greedy(), 1)).err(), Some(SubmitError::EmptyPrompt));
    assert_eq!(rt.submit(request(vec![v as u32], SamplingParams::greedy(), 1)).err(), Some(SubmitError::TokenId { id: v as u32, vocab_size: v }));
    let max = rt.info().config.max_position_embeddings;
    assert_eq!(rt.submit(request(vec![1; max + 1], SamplingParams::greedy(), 1)).err(), Some(SubmitError::PromptTooLong { prompt: max + 1, max }));
}

#[test]
fn stop_strings_split_across_tokens_end_the_output_before_them() {
    const VOCAB: &str = "fixtures/vocab/mlx-q4";
    let dir = shared(VOCAB);
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("the tokenizer in {}: {e}", dir.display())));
    let p = tok.encode("Write a haiku about the sea, please.").unwrap();
    let rt = start(VOCAB, RuntimeConfig::default(), Some(tok.clone()));
    let mut h = rt.submit(Request::new(p.clone(), SamplingParams::greedy(), StopRules { max_tokens: Some(24), ..StopRules::default() })).unwrap();
    let full = collect(&mut h);
    // Texts of the tokens, to pick a stop string spanning a token boundary.
    let pieces: Vec<String> = (1..=full.ids.len()).map(|n| tok.decode(&full.ids[..n]).unwrap()).collect();
    let (k, text) = pieces
        .windows(2)
        .enumerate()
        .find_map(|(k, w)| {
            let (a, b) = (&w[0], &w[1]);
            let (la, lb) = (a.chars().count(), b.chars().count());
            (la >= 2 && lb >= la + 2 && b.starts_with(a.as_str()) && !a.ends_with('\u{FFFD}') && !b.ends_with('\u{FFFD}')).then(|| (k, b.clone()))
        })
        .expect("a token boundary inside the text");
    let cut = pieces[k].char_indices().last().unwrap().0; // the boundary token's last char ...
    let after = text[pieces[k].len()..].chars().next().unwrap(); // ... and the next token's first
    let stop: String = format!("{}{after}", &pieces[k][cut..]);
    let expect_at = text.find(&stop).unwrap();
    let mut h = rt.submit(Request::new(p, SamplingParams::greedy(), StopRules { max_tokens: Some(24), strings: vec![stop.clone()], ..StopRules::default() })).unwrap();
    let got = collect(&mut h);
    assert_eq!(got.finished.unwrap().reason, FinishReason::StopString(stop.clone()));
    assert_eq!(got.text, text[..expect_at], "the output ends before {stop:?}");
    assert_eq!(got.ids, full.ids[..got.ids.len()]);
    assert!(!got.text.contains(&stop));
}

#[test]
fn eos_ids_end_the_sequence_and_add_no_text() {
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let p = prompt(6, 9, v);
    let want = solo(&mut e, &p, SamplingParams::greedy(), 8);
    let eos = want.ids[4];
    let first = want.ids.iter().position(|&i| i == eos).unwrap();
    let rt = start(TINY, RuntimeConfig::default(), None);
    let mut r = request(p, SamplingParams::greedy(), 8);
    r.stop.eos_ids = vec![eos];
    let got = collect(&mut rt.submit(r).unwrap());
    assert_eq!(got.ids, want.ids[..=first]);
    assert_eq!(got.finished.unwrap().reason, FinishReason::Eos(eos));
}

#[test]
fn a_returned_state_resumes_exactly() {
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let p = prompt(7, 11, v);
    let want = solo(&mut e, &p, SamplingParams::greedy(), 12);
    let rt = start(TINY, RuntimeConfig::default(), None);
    let mut r = request(p, SamplingParams::greedy(), 5);
    r.return_state = true;
    let first = collect(&mut rt.submit(r).unwrap());
    let saved = first.finished.unwrap().saved.expect("a saved state");
    assert_eq!(saved.state.position, saved.tokens.len() - 1, "the last sampled id is pending");
    let mut r = request(saved.tokens.clone(), SamplingParams::greedy(), 7);
    r.resume = Some(saved);
    let mut h = rt.submit(r).unwrap();
    assert_eq!(h.blocking_next(), Some(Event::Started { cached_tokens: 11 }));
    let second = collect(&mut h);
    assert_eq!([first.ids, second.ids].concat(), want.ids);
    assert!([first.logits, second.logits].concat() == want.logits);
}

#[test]
fn logprobs_are_the_log_softmax_of_the_row() {
    let row = [1.0f32, 3.0, 2.0, 3.0];
    let lp = logprobs(&row, 2, 2, &mut Vec::new());
    let lse = (row.iter().map(|&x| (x as f64).exp()).sum::<f64>()).ln();
    assert!((lp.logprob as f64 - (2.0 - lse)).abs() < 1e-6);
    assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3], "ties: the smaller id first");
}

/// A JSON-schema constraint over the tiny fixture's tokenizer.
fn json_constraint(tokenizer: &Tokenizer) -> Constraint {
    let vocab = Arc::new(crate::grammar::Vocabulary::of(tokenizer).expect("the token table builds"));
    let format = crate::server::OutputFormat::JsonSchema {
        name: "t".into(),
        schema: Some(
            serde_json::json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": false}),
        ),
        strict: true,
    };
    let tools = crate::server::parse::ToolSchemas::new();
    let spec = crate::grammar::Spec { format: &format, tools: &tools, tool_choice: &crate::server::ToolChoice::Auto, parallel_tool_calls: false, starts_in_reasoning: false };
    Constraint::build(&vocab, &spec).expect("builds").expect("constrains")
}

#[test]
fn a_constrained_sequence_obeys_its_schema_and_leaves_the_others_exact() {
    let tokenizer = Arc::new(Tokenizer::from_dir(&shared(TINY)).expect("the fixture's tokenizer"));
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let cases: Vec<(Vec<u32>, SamplingParams, usize)> = (0..4).map(|i| (prompt(5 + 3 * i, 70 + i as u64, v), params(i), 12)).collect();
    let want: Vec<Run> = cases.iter().map(|(p, sp, g)| solo(&mut e, p, *sp, *g)).collect();
    let constrained = || {
        let sampled = SamplingParams { seed: 77, ..SamplingParams::default() };
        let mut r = Request::new(prompt(7, 99, v), sampled, StopRules { eos_ids: tokenizer.eos_ids().to_vec(), strings: Vec::new(), max_tokens: Some(60) });
        r.return_logits = true;
        r.constraint = Some(json_constraint(&tokenizer));
        r
    };
    let rt = start(TINY, RuntimeConfig { max_seqs: 8, max_batch_tokens: 32, chunk: 8, ..RuntimeConfig::default() }, Some(tokenizer.clone()));
    let mut c = rt.submit(constrained()).unwrap();
    let mut handles: Vec<Handle> = cases.iter().map(|(p, sp, g)| rt.submit(request(p.clone(), *sp, *g)).unwrap()).collect();
    for (i, (h, w)) in handles.iter_mut().zip(&want).enumerate() {
        let got = collect(h);
        assert_eq!(got.ids, w.ids, "unconstrained sequence {i}: ids");
        assert!(got.logits == w.logits, "unconstrained sequence {i}: logits bits differ from the solo run");
    }
    let got = collect(&mut c);
    let f = got.finished.as_ref().unwrap();
    assert!(matches!(f.reason, FinishReason::Eos(_)), "the constraint ends on EOS: {:?} after {:?}", f.reason, got.text);
    let value: serde_json::Value = serde_json::from_str(&got.text).unwrap_or_else(|e| panic!("{:?} is not JSON: {e}", got.text));
    let n = value["n"].as_u64().unwrap_or_else(|| panic!("{value}: n"));
    assert!(n <= 999 && value["ok"].is_boolean() && value.as_object().unwrap().len() == 2, "{value}");
    // The reported rows are the raw logits: masking touched only the sampler's copy.
    assert!(got.logits.iter().all(|row| row.iter().all(|&b| f32::from_bits(b).is_finite())), "a reported logit was masked");
    // The same seed alone gives the same constrained output.
    let again = collect(&mut rt.submit(constrained()).unwrap());
    assert_eq!(again.ids, got.ids);
    assert_eq!(again.logits, got.logits);
}

#[test]
fn masks_overlapped_with_the_step_give_the_serial_run_bits() {
    // Two constrained sequences (sampled, their masks prepared on the helper threads during
    // each step) among unconstrained ones: every id and logit row is the same with the masks
    // computed after the step on the runtime's thread.
    let tokenizer = Arc::new(Tokenizer::from_dir(&shared(TINY)).expect("the fixture's tokenizer"));
    let v = tokenizer.vocab_size();
    let constraint = json_constraint(&tokenizer);
    let run = |overlap: bool| -> Vec<Run> {
        let rt = start(TINY, RuntimeConfig { max_seqs: 6, max_batch_tokens: 24, chunk: 8, overlap_masks: overlap, ..RuntimeConfig::default() }, Some(tokenizer.clone()));
        let mut handles: Vec<Handle> = (0..6)
            .map(|i| {
                let params = if i < 2 { SamplingParams { seed: 5 + i as u64, ..SamplingParams::default() } } else { params(i) };
                let mut r = request(prompt(4 + 5 * i, 40 + i as u64, v), params, 40);
                r.stop.eos_ids = tokenizer.eos_ids().to_vec();
                if i < 2 {
                    r.constraint = Some(constraint.clone());
                }
                rt.submit(r).unwrap()
            })
            .collect();
        handles.iter_mut().map(collect).collect()
    };
    let (serial, overlapped) = (run(false), run(true));
    for (i, (a, b)) in serial.iter().zip(&overlapped).enumerate() {
        assert_eq!(a.ids, b.ids, "sequence {i}: ids");
        assert!(a.logits == b.logits, "sequence {i}: logits bits");
        assert_eq!(a.finished.as_ref().map(|f| &f.reason), b.finished.as_ref().map(|f| &f.reason), "sequence {i}: finish");
    }
    for a in &serial[..2] {
        serde_json::from_str::<serde_json::Value>(&a.text).unwrap_or_else(|e| panic!("{:?} is not JSON: {e}", a.text));
    }
}

#[test]
fn a_panicking_mask_ends_its_request_with_an_error_and_the_others_go_on() {
    // A constrained sequence whose mask computation panics on the helper thread ends with an
    // error (its grammar state may be half-updated); a constrained and an unconstrained
    // sequence beside it run as they would alone, and the helpers serve the next request.
    let tokenizer = Arc::new(Tokenizer::from_dir(&shared(TINY)).expect("the fixture's tokenizer"));
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let constraint = json_constraint(&tokenizer);
    let constrained = |seed: u64, c: Constraint| {
        let mut r = request(prompt(6, 90 + seed, v), SamplingParams { seed, ..SamplingParams::default() }, 40);
        r.stop.eos_ids = tokenizer.eos_ids().to_vec();
        r.constraint = Some(c);
        r
    };
    let plain = (prompt(9, 31, v), SamplingParams::greedy(), 12);
    let want = solo(&mut e, &plain.0, plain.1, plain.2);
    let rt = start(TINY, RuntimeConfig { max_seqs: 4, max_batch_tokens: 24, chunk: 8, overlap_masks: true, ..RuntimeConfig::default() }, Some(tokenizer.clone()));
    let alone = collect(&mut rt.submit(constrained(3, constraint.clone())).unwrap());
    let mut faulty = constraint.clone();
    faulty.inject(crate::grammar::TestFault::PanicInPrepare);
    let mut bad = rt.submit(constrained(2, faulty)).unwrap();
    let mut good = rt.submit(constrained(3, constraint.clone())).unwrap();
    let mut other = rt.submit(request(plain.0.clone(), plain.1, plain.2)).unwrap();
    let got = collect(&mut bad);
    match &got.finished.as_ref().expect("finishes").reason {
        FinishReason::Error(m) => assert!(m.contains("computing the grammar mask panicked: a fault injected in prepare"), "{m}"),
        r => panic!("the faulty sequence ended with {r:?} after {:?}", got.text),
    }
    let got = collect(&mut good);
    assert_eq!((got.ids, got.logits), (alone.ids.clone(), alone.logits.clone()), "the other constrained sequence");
    let got = collect(&mut other);
    assert!(got.ids == want.ids && got.logits == want.logits, "the unconstrained sequence");
    // The helpers live on.
    let again = collect(&mut rt.submit(constrained(3, constraint)).unwrap());
    assert_eq!(again.ids, alone.ids);
    assert!(matches!(again.finished.unwrap().reason, FinishReason::Eos(_) | FinishReason::Length));
}

#[test]
fn a_dead_mask_helper_fails_its_job_and_collect_does_not_wait_for_it() {
    let tokenizer = Tokenizer::from_dir(&shared(TINY)).expect("the fixture's tokenizer");
    // One step into the object: the next mask is not computed yet.
    let mut c = json_constraint(&tokenizer);
    c.advance(tokenizer.encode_with("{", false).unwrap()[0]).expect("`{` opens the object");
    assert!(!c.is_prepared());
    let mut dying = c.clone();
    dying.inject(crate::grammar::TestFault::KillHelper);
    let (tx, rx) = std::sync::mpsc::channel();
    let c2 = c.clone();
    // On a thread of its own, so that a collect that waits for ever fails the test instead.
    std::thread::spawn(move || {
        let mut m = masks::Masker::with_helpers(1);
        let mut slots = [Some(dying), Some(c2.clone())];
        for (i, slot) in slots.iter_mut().enumerate() {
            m.send(i, slot);
        }
        let mut back = m.collect();
        // The helper's thread is gone (or going): a constraint sent now stays with the runtime,
        // or comes back unprepared from the queue no helper reads.
        let mut late = Some(c2);
        m.send(2, &mut late);
        back.extend(m.collect());
        let _ = tx.send((back, [slots[0].take(), slots[1].take(), late], m.busy()));
    });
    let (back, slots, busy) = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("collect returns though its helper died");
    assert!(!busy);
    let mut row = vec![0.0f32; tokenizer.vocab_size()];
    let mut seen = [false; 3];
    for (i, mut c) in back.into_iter().chain(slots.into_iter().enumerate().filter_map(|(i, s)| s.map(|c| (i, c)))) {
        assert!(!seen[i], "sequence {i} came back twice");
        seen[i] = true;
        match (i, c.mask(&mut row)) {
            (0, Err(e)) => assert!(e.to_string().contains("the thread computing the grammar mask died"), "{e}"),
            (1 | 2, Ok(())) => {}
            (i, r) => panic!("sequence {i}: {r:?}"),
        }
    }
    assert_eq!(seen, [true; 3], "every constraint is back");
}
