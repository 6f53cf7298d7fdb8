//! Candidate order: descending by value under `f32::total_cmp`, ties by ascending id — the
//! order the draw walks, a function of the values alone.
//!
//! The whole-vocabulary case sorts 32-bit order keys (the values, bijectively re-encoded)
//! with an LSD radix sort — three 11-bit digits, a digit shared by every key skipped —
//! O(V) instead of a comparison sort's O(V log V), and half the bytes of (id, value) pairs.
//! Ids are not carried: equal keys are equal values, so the sorted keys fix every weight
//! and sum, and the one id the draw needs is found afterwards (`nth_id_with_value`).

const DIGIT_BITS: u32 = 11;
const NUM_BUCKETS: usize = 1 << DIGIT_BITS;
const NUM_DIGITS: usize = 3;
const DIGIT_MASK: u32 = NUM_BUCKETS as u32 - 1;

/// A key whose ascending unsigned order is the descending `f32::total_cmp` order.
#[inline(always)]
pub(super) fn descending_key(value: f32) -> u32 {
    let bits = value.to_bits();
    // total_cmp's ascending key, unsigned: flip every bit of a negative, the sign of the rest.
    !(bits ^ (((bits as i32 >> 31) as u32) | 0x8000_0000))
}

/// The value a `descending_key` encodes.
#[inline(always)]
pub(super) fn key_value(key: u32) -> f32 {
    let ascending = !key;
    f32::from_bits(if ascending & 0x8000_0000 != 0 {
        ascending ^ 0x8000_0000
    } else {
        !ascending
    })
}

/// Sorts `keys` ascending. `scratch` is a buffer the sort may resize; its contents do not
/// matter.
pub(super) fn sort_keys(keys: &mut Vec<u32>, scratch: &mut Vec<u32>) {
    let n = keys.len();
    if n < 256 {
        keys.sort_unstable();
        return;
    }
    let mut histograms = [[0u32; NUM_BUCKETS]; NUM_DIGITS];
    for &key in keys.iter() {
        for (digit, histogram) in histograms.iter_mut().enumerate() {
            histogram[((key >> (digit as u32 * DIGIT_BITS)) & DIGIT_MASK) as usize] += 1;
        }
    }
    scratch.clear();
    scratch.resize(n, 0);
    for (digit, histogram) in histograms.iter_mut().enumerate() {
        let shift = digit as u32 * DIGIT_BITS;
        if histogram[((keys[0] >> shift) & DIGIT_MASK) as usize] as usize == n {
            continue;
        }
        let mut offset = 0u32;
        for count in histogram.iter_mut() {
            let c = *count;
            *count = offset;
            offset += c;
        }
        for &key in keys.iter() {
            let bucket = &mut histogram[((key >> shift) & DIGIT_MASK) as usize];
            scratch[*bucket as usize] = key;
            *bucket += 1;
        }
        std::mem::swap(keys, scratch);
    }
}

/// The id of the `n`-th (0-based, in id order) entry of `values` bitwise equal to `value`:
/// the id at sorted position p is the (p − first position of its value)-th such id.
pub(super) fn nth_id_with_value(values: &[f32], value: f32, n: usize) -> Option<u32> {
    const CHUNK: usize = 16;
    let bits = value.to_bits();
    let mut remaining = n;
    for (c, chunk) in values.chunks(CHUNK).enumerate() {
        // Branch-free test first so the common chunk (no match) is one vector compare.
        if !chunk
            .iter()
            .fold(false, |any, v| any | (v.to_bits() == bits))
        {
            continue;
        }
        for (i, v) in chunk.iter().enumerate() {
            if v.to_bits() == bits {
                if remaining == 0 {
                    return Some((c * CHUNK + i) as u32);
                }
                remaining -= 1;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn radix_order_is_value_descending() {
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN_POSITIVE / 4.0,
            -f32::MIN_POSITIVE / 4.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
        ];
        for n in [5, 255, 256, 1000, 20_000] {
            let values: Vec<f32> = (0..n)
                .map(|i| {
                    let v = (crate::sampling::splitmix64(i as u64) % 201) as f32 * 0.5 - 50.0;
                    if i % 17 == 0 { specials[i % 12] } else { v }
                })
                .collect();
            let mut keys: Vec<u32> = values.iter().map(|&v| descending_key(v)).collect();
            sort_keys(&mut keys, &mut Vec::new());
            let mut want: Vec<(u32, f32)> = values
                .iter()
                .copied()
                .enumerate()
                .map(|(i, v)| (i as u32, v))
                .collect();
            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let got: Vec<u32> = keys.iter().map(|&k| key_value(k).to_bits()).collect();
            assert_eq!(
                got,
                want.iter().map(|e| e.1.to_bits()).collect::<Vec<_>>(),
                "n = {n}"
            );
            // Each sorted position maps back to its id: the n-th of its value in id order.
            for (p, &(id, v)) in want.iter().enumerate().step_by(7) {
                let first = want
                    .iter()
                    .position(|e| e.1.to_bits() == v.to_bits())
                    .unwrap();
                assert_eq!(nth_id_with_value(&values, v, p - first), Some(id));
            }
        }
        assert_eq!(
            ((-104.0f32) as f64).exp() as f32,
            0.0,
            "weights below −104 are 0"
        );
    }
}
