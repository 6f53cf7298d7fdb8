//! Loom: the ZOS hand-off between the sampler (publisher) and a rank worker (waiter).
//! Run with `cargo test --release --features loom --test loom_sampled_tokens`.
#![cfg(feature = "loom")]

use loom::thread;
use troupe::runner::sampled_tokens::SampledTokens;
use troupe::step::Drawn;

#[test]
fn a_waiter_gets_the_published_token() {
    loom::model(|| {
        let buf = SampledTokens::new();
        let epoch = buf.epoch();
        let reader = buf.clone();
        let h = thread::spawn(move || reader.wait(epoch, 1, 1));
        let drawn = Drawn {
            token: 7,
            num_rejected: 2,
        };
        buf.publish(epoch, 1, vec![None, Some(drawn)]);
        assert_eq!(h.join().unwrap(), Some(drawn));
    });
}

#[test]
fn invalidate_wakes_a_waiter_that_would_otherwise_block_forever() {
    loom::model(|| {
        let buf = SampledTokens::new();
        let epoch = buf.epoch();
        let reader = buf.clone();
        let h = thread::spawn(move || reader.wait(epoch, 3, 0));
        buf.invalidate();
        assert_eq!(h.join().unwrap(), None);
    });
}

#[test]
fn a_publish_from_before_a_reset_is_never_read_after_it() {
    loom::model(|| {
        let buf = SampledTokens::new();
        let old = buf.epoch();
        let stale = buf.clone();
        let h = thread::spawn(move || stale.publish(old, 1, vec![Some(Drawn::token(9))]));
        let new = buf.invalidate();
        let reader = buf.clone();
        let r = thread::spawn(move || reader.wait(new, 1, 0));
        buf.publish(new, 1, vec![Some(Drawn::token(4))]);
        h.join().unwrap();
        assert_eq!(r.join().unwrap(), Some(Drawn::token(4)));
    });
}
