//! DeepSeek-V4's MTP layer against its reference (`scripts/make_dsv4_goldens.py`):
//! transformers' own decoder layer with DeepSeek's `MTPBlock` glue around it, since
//! transformers drops the checkpoint's `mtp.*` tensors. Every position teacher-forced (in
//! one piece and in chunks), and three greedy drafts chained from the block's own streams.

mod common;

use common::dsv4::{assert_rows_close, dir, main_streams, mtp_reference, reference};
use troupe::model::deepseek_v4::DsV4Model;
use troupe::model::deepseek_v4::mtp::MtpLayer;

const NAME: &str = "tiny-dsv4-a";
/// Largest error seen: 2.0e-6 (f32 on both sides).
const REL_TOL: f32 = 1e-4;

fn argmax(row: &[f32]) -> u32 {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap() as u32
}

fn load() -> (DsV4Model, MtpLayer) {
    let model = DsV4Model::load_dir(&dir(NAME)).unwrap();
    let mtp = MtpLayer::load_dir(&model.cfg, &dir(NAME)).unwrap();
    (model, mtp)
}

#[test]
fn teacher_forced_positions_match_the_reference_in_one_piece_and_in_chunks() {
    let (model, mtp) = load();
    let want = mtp_reference(NAME).teacher;
    let prompt = &reference(NAME).prompts[0];
    let (streams, _) = main_streams(&model, prompt);
    let width = model.cfg.hc_mult * model.cfg.hidden_size;
    let n = prompt.len() - 1;
    for chunks in [&[n][..], &[5, 2, 7], &[1]] {
        let mut cache = mtp.new_cache(2);
        MtpLayer::restart(&mut cache, 1, 0);
        let (mut pos, mut logits) = (0, Vec::new());
        for &len in chunks.iter().cycle() {
            let len = len.min(n - pos);
            let out = mtp.forward(
                &model,
                &mut cache,
                1,
                pos,
                &streams[pos * width..(pos + len) * width].to_vec(),
                &prompt[pos + 1..pos + 1 + len],
            );
            logits.extend(mtp.logits(&model, &out));
            pos += len;
            if pos == n {
                break;
            }
        }
        let what = format!("MTP teacher-forced, chunks {chunks:?}");
        assert_rows_close(NAME, &what, &logits, &want, model.vocab_size(), REL_TOL);
    }
}

#[test]
fn chained_drafts_match_the_reference() {
    let (model, mtp) = load();
    let want = mtp_reference(NAME);
    let r = reference(NAME);
    let prompt = &r.greedy_prompt;
    let (streams, logits) = main_streams(&model, prompt);
    let vocab = model.vocab_size();
    let first = argmax(&logits[(prompt.len() - 1) * vocab..]);
    assert_eq!(first, r.greedy_tokens[0]);

    let width = model.cfg.hc_mult * model.cfg.hidden_size;
    let n = prompt.len();
    let mut cache = mtp.new_cache(1);
    MtpLayer::restart(&mut cache, 0, 0);
    // Positions before the last: the prompt's own next tokens.
    mtp.forward(
        &model,
        &mut cache,
        0,
        0,
        &streams[..(n - 1) * width].to_vec(),
        &prompt[1..],
    );
    // The last position with the model's token, then each draft from the block's streams.
    let mut h = streams[(n - 1) * width..].to_vec();
    let mut next = first;
    let (mut drafts, mut chain) = (Vec::new(), Vec::new());
    for i in 0..want.drafts.len() {
        let out = mtp.forward(&model, &mut cache, 0, n - 1 + i, &h, &[next]);
        let l = mtp.logits(&model, &out);
        next = argmax(&l);
        drafts.push(next);
        chain.extend(l);
        h = out;
    }
    assert_rows_close(NAME, "MTP chain", &chain, &want.chain, vocab, REL_TOL);
    assert_eq!(drafts, want.drafts);
}

#[test]
fn a_checkpoint_without_an_mtp_layer_is_refused_by_name() {
    let model = DsV4Model::load_dir(&dir("tiny-dsv4-b")).unwrap();
    let err = MtpLayer::load_dir(&model.cfg, &dir("tiny-dsv4-b"))
        .err()
        .expect("tiny-dsv4-b has no mtp.0.* tensors")
        .to_string();
    assert!(err.contains("mtp.0.") && err.contains("missing"), "{err}");
}
