//! `bench-serve`'s rows as the aligned text table it prints.

use super::RateRow;

/// The rows as an aligned text table.
pub fn format_table(rows: &[RateRow]) -> String {
    let header = [
        "rate", "ok", "fail", "time_s", "req/s", "tok/s", "ttft_p50", "ttft_p90", "ttft_p99",
        "tpot_p50", "tpot_p90", "tpot_p99", "itl_p50", "itl_p99", "e2el_p50", "e2el_p99",
    ];
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.rate.clone(),
                r.completed.to_string(),
                r.failed.to_string(),
                format!("{:.2}", r.duration_secs),
                format!("{:.2}", r.request_throughput),
                format!("{:.1}", r.output_token_throughput),
                ms(r.ttft_p50_ms),
                ms(r.ttft_p90_ms),
                ms(r.ttft_p99_ms),
                ms(r.tpot_p50_ms),
                ms(r.tpot_p90_ms),
                ms(r.tpot_p99_ms),
                ms(r.itl_p50_ms),
                ms(r.itl_p99_ms),
                ms(r.e2el_p50_ms),
                ms(r.e2el_p99_ms),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            cells
                .iter()
                .map(|r| r[c].len())
                .fold(header[c].len(), usize::max)
        })
        .collect();
    let line = |fields: Vec<&str>| {
        let padded: Vec<String> = fields
            .iter()
            .zip(&widths)
            .map(|(f, w)| format!("{f:>w$}"))
            .collect();
        padded.join("  ") + "\n"
    };
    let mut out = line(header.to_vec());
    for r in &cells {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}
