//! Shared pieces of the decoders' fuzz properties (test-only: built for
//! this crate's tests and, through the `fuzz` feature, for the other
//! crates' tests).
//!
//! Every decoder of external input (pgoutput, the change envelope, SQL
//! Server cells and CDC rows, outbox rows read back, YAML configs) has a
//! property test beside it that feeds it arbitrary input and mutations of
//! valid encodings, and asserts through [`check`] that it returns (`Ok` or
//! `Err`, never a panic), in bounded time, without a request for memory
//! out of proportion to the input. The number of inputs per property is
//! [`cases`]: small by default so `cargo test` stays quick, and
//! `SKEIN_FUZZ_INPUTS=10000000` for a long run.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::Config as ProptestConfig;

/// Inputs per property when `SKEIN_FUZZ_INPUTS` is not set.
pub const DEFAULT_INPUTS: u32 = 2_000;

/// How long one decode may take before it counts as a hang. Generous: the
/// normal run is an unoptimised build on a shared machine, and every input
/// here is at most a few KiB.
pub const HANG_LIMIT: Duration = Duration::from_secs(5);

/// Inputs per property: `SKEIN_FUZZ_INPUTS`, else [`DEFAULT_INPUTS`].
pub fn cases() -> u32 {
    std::env::var("SKEIN_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(DEFAULT_INPUTS)
}

/// The proptest configuration of every fuzz property: [`cases`] inputs, no
/// regression files (a crash found becomes a named regression test beside
/// the decoder instead).
pub fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 10_000,
        ..ProptestConfig::default()
    }
}

/// The most memory a decode of `input_len` bytes may hold at once: a small
/// constant plus a few machine words per input byte (a one-byte NULL
/// becomes a 32-byte value, in a vector that may be growing). A count read
/// from the input and trusted (`Vec::with_capacity(n)` before checking that
/// `n` items can follow) shows up far above this.
pub fn allocation_bound(input_len: usize) -> usize {
    256 * 1024 + 128 * input_len
}

/// Runs one decode of an `input_len`-byte input and asserts it neither
/// hangs nor holds more than [`allocation_bound`] bytes at once (measured
/// on this thread by `allocation-counter`, whose allocator every test
/// binary that enables the `fuzz` feature links). A panic inside `decode`
/// fails the property as it is.
pub fn check<T>(what: &str, input_len: usize, decode: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let mut out = None;
    // The panic is caught inside and re-raised outside the measurement:
    // allocation-counter does not unwind its own bookkeeping, so a panic
    // escaping `measure` would, after a few shrinking steps, abort the
    // whole test binary instead of failing the property with its input.
    let info = allocation_counter::measure(|| {
        out = Some(std::panic::catch_unwind(std::panic::AssertUnwindSafe(
            decode,
        )))
    });
    let out = match out.expect("measure runs the decode") {
        Ok(out) => out,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    let largest = usize::try_from(info.bytes_max).unwrap_or(usize::MAX);
    let took = start.elapsed();
    assert!(
        took < HANG_LIMIT,
        "{what}: one input of {input_len} bytes took {took:?}"
    );
    let bound = allocation_bound(input_len);
    assert!(
        largest <= bound,
        "{what}: an input of {input_len} bytes held {largest} bytes at once (bound {bound})"
    );
    out
}

/// Byte patterns a length or count field is most often wrong with: the
/// extremes of big-endian i16/i32/u32 and of Avro's zig-zag varints.
pub const HUGE_VALUES: &[&[u8]] = &[
    &[0x7f, 0xff],
    &[0xff, 0xff],
    &[0x80, 0x00],
    &[0x7f, 0xff, 0xff, 0xff],
    &[0xff, 0xff, 0xff, 0xff],
    &[0x80, 0x00, 0x00, 0x00],
    &[0x00, 0x00, 0x7f, 0xff],
    // zig-zag varints: i32::MAX, 2^40, i64::MAX, i64::MIN, -1, a 10-byte overlong one
    &[0xfe, 0xff, 0xff, 0xff, 0x0f],
    &[0x80, 0x80, 0x80, 0x80, 0x80, 0x20],
    &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0x01],
    &[
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,
    ],
];

/// One edit of a valid encoding.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Flip one bit.
    Flip(Index, u8),
    /// Overwrite one byte.
    Set(Index, u8),
    /// Insert one byte.
    Insert(Index, u8),
    /// Delete one byte.
    Delete(Index),
    /// Cut the input short.
    Truncate(Index),
    /// Overwrite with one of the [`HUGE_VALUES`] (a length field gone wrong).
    Huge(Index, Index),
    /// Insert one of the caller's tokens (tags, keywords).
    Token(Index, Index),
    /// Copy a span of the input elsewhere (repeated fields, nested structures).
    Splice(Index, Index, Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<Index>().prop_map(Mutation::Delete),
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), any::<Index>()).prop_map(|(i, v)| Mutation::Huge(i, v)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, t)| Mutation::Token(i, t)),
        (any::<Index>(), any::<Index>(), any::<Index>())
            .prop_map(|(a, b, c)| Mutation::Splice(a, b, c)),
    ]
}

/// Applies `edits` to `bytes`; `tokens` feed [`Mutation::Token`].
pub fn apply(bytes: &mut Vec<u8>, edits: &[Mutation], tokens: &[&[u8]]) {
    for m in edits {
        let len = bytes.len();
        match m {
            Mutation::Flip(i, b) if len > 0 => bytes[i.index(len)] ^= 1 << b,
            Mutation::Set(i, v) if len > 0 => bytes[i.index(len)] = *v,
            Mutation::Insert(i, v) => bytes.insert(i.index(len + 1), *v),
            Mutation::Delete(i) if len > 0 => {
                bytes.remove(i.index(len));
            }
            Mutation::Truncate(i) => bytes.truncate(i.index(len + 1)),
            Mutation::Huge(i, v) => {
                let v = HUGE_VALUES[v.index(HUGE_VALUES.len())];
                let at = i.index(len + 1);
                let end = (at + v.len()).min(len);
                bytes.splice(at..end, v.iter().copied());
            }
            Mutation::Token(i, t) if !tokens.is_empty() => {
                let t = tokens[t.index(tokens.len())];
                let at = i.index(len + 1);
                bytes.splice(at..at, t.iter().copied());
            }
            Mutation::Splice(a, b, at) if len > 0 => {
                let (a, b) = (a.index(len), b.index(len));
                let span = bytes[a.min(b)..=a.max(b)].to_vec();
                let at = at.index(len + 1);
                bytes.splice(at..at, span);
            }
            _ => {}
        }
    }
}

/// Mutations of the valid encodings `valid` yields: one to four edits each,
/// with `tokens` as the decoder's own vocabulary.
pub fn mutated(
    valid: impl Strategy<Value = Vec<u8>>,
    tokens: &'static [&'static [u8]],
) -> impl Strategy<Value = Vec<u8>> {
    (valid, prop::collection::vec(mutation(), 1..=4)).prop_map(move |(mut b, edits)| {
        apply(&mut b, &edits, tokens);
        b
    })
}

/// Arbitrary bytes, at most `max` long, leaning to short ones.
pub fn arbitrary_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..=max)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a panicking decode aborted the test binary once
    /// allocation-counter's nesting depth, leaked by each unwound
    /// measurement, ran out.
    #[test]
    fn a_panicking_decode_fails_the_property_every_time() {
        for _ in 0..100 {
            let r = std::panic::catch_unwind(|| check("test", 1, || panic!("decoder bug")));
            assert!(r.is_err());
        }
        check("test", 1, || ());
    }

    #[test]
    #[should_panic(expected = "held")]
    fn check_fails_an_oversized_request() {
        check("test", 10, || Vec::<u8>::with_capacity(1 << 30));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..config() })]
        #[test]
        fn mutations_never_panic(b in arbitrary_bytes(64), e in prop::collection::vec(mutation(), 0..8)) {
            let mut b = b;
            apply(&mut b, &e, &[b"tok"]);
        }
    }
}
