//! An image's geometry as the encoder walks it: its merge groups in window order, and each
//! patch's 2-D rotary angles.

/// The merge groups of an image in window order (each window's groups row-major,
/// windows row-major, frame after frame), and the windows' bounds in patches.
pub struct WindowOrder {
    pub groups: Vec<usize>,
    pub bounds: Vec<usize>,
}

/// `grid` (frames, rows, columns in patches) in windows of `window` × `window` merge
/// groups of `merge` × `merge` patches.
pub fn window_order([gt, gh, gw]: [usize; 3], merge: usize, window: usize) -> WindowOrder {
    let (lh, lw) = (gh / merge, gw / merge);
    let mut groups = Vec::with_capacity(gt * lh * lw);
    let mut bounds = vec![0];
    for t in 0..gt {
        for wy in (0..lh).step_by(window) {
            for wx in (0..lw).step_by(window) {
                for y in wy..(wy + window).min(lh) {
                    for x in wx..(wx + window).min(lw) {
                        groups.push(t * lh * lw + y * lw + x);
                    }
                }
                bounds.push(groups.len() * merge * merge);
            }
        }
    }
    WindowOrder { groups, bounds }
}

/// Per patch, in the order of `groups`, the head's rotary table row as `Backend::rope`
/// reads it: the cosines of its angles, then their sines. The first half of the angles
/// turn with the patch's row, the second with its column (`inv_freqs` each).
pub fn rope_table(
    [_, gh, gw]: [usize; 3],
    merge: usize,
    groups: &[usize],
    inv_freqs: &[f32],
) -> Vec<f32> {
    let per_frame = gh * gw / (merge * merge);
    let mut table = Vec::with_capacity(groups.len() * merge * merge * inv_freqs.len() * 4);
    for &group in groups {
        let g = group % per_frame;
        let (bh, bw) = (g / (gw / merge), g % (gw / merge));
        for (mh, mw) in (0..merge).flat_map(|a| (0..merge).map(move |b| (a, b))) {
            let (r, col) = ((bh * merge + mh) as f32, (bw * merge + mw) as f32);
            let angles: Vec<f32> = (inv_freqs.iter().map(|f| r * f))
                .chain(inv_freqs.iter().map(|f| col * f))
                .collect();
            table.extend(angles.iter().map(|a| a.cos()));
            table.extend(angles.iter().map(|a| a.sin()));
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_order_covers_every_group_once() {
        for grid in [[1, 4, 4], [1, 10, 6], [1, 18, 34], [2, 8, 8]] {
            let order = window_order(grid, 2, 4);
            let mut seen = order.groups.clone();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..grid.iter().product::<usize>() / 4).collect::<Vec<_>>()
            );
            assert_eq!(
                *order.bounds.last().unwrap(),
                grid.iter().product::<usize>()
            );
            assert!(
                order
                    .bounds
                    .windows(2)
                    .all(|w| w[1] > w[0] && w[1] - w[0] <= 64)
            );
        }
    }
}
