//! The lightning indexer's top-k on rows of exact ties against torch's CPU `topk`
//! (`tests/goldens/torch_topk_ties.json`): transformers' choice among tied entries.

mod common;

/// Rows of exact ties (`tests/goldens/torch_topk_ties.json`, from torch's CPU `topk`): the
/// same indices in the same order, through both of ATen's selection paths.
#[test]
fn ties_resolve_as_torch_topk_does() {
    use troupe::kernels::cpu::torch_topk::torch_top_k;
    let json = common::read_json("torch_topk_ties.json");
    let rows = json["rows"].as_array().unwrap();
    assert!(rows.len() >= 100);
    let mut tied = 0;
    for (i, row) in rows.iter().enumerate() {
        let values: Vec<f32> = row["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().map_or(f32::NEG_INFINITY, |f| f as f32))
            .collect();
        let k = row["k"].as_u64().unwrap() as usize;
        let want_sorted: Vec<usize> = common::ids(&row["sorted"])
            .iter()
            .map(|&x| x as usize)
            .collect();
        let want_unsorted: Vec<usize> = common::ids(&row["unsorted"])
            .iter()
            .map(|&x| x as usize)
            .collect();
        assert_eq!(
            torch_top_k(&values, k, true),
            want_sorted,
            "row {i} (n {}, k {k}) sorted",
            values.len()
        );
        assert_eq!(
            torch_top_k(&values, k, false),
            want_unsorted,
            "row {i} (n {}, k {k}) unsorted",
            values.len()
        );
        // Rows whose k-th value recurs past the k-th place: where the rule matters.
        let kth = values[want_sorted[k - 1]];
        tied += usize::from(
            values.iter().filter(|&&v| v == kth).count()
                > want_sorted.iter().filter(|&&j| values[j] == kth).count(),
        );
    }
    assert!(
        tied >= 100,
        "only {tied} rows have a tie across the k-th place"
    );
}
