//! The collective for CPU ranks: each rank sends its part to every peer over in-process
//! channels and adds the parts in rank order, so every rank ends with the same bits. It
//! is what the CPU tests run the rank protocol, the sharding and rank loss over; a GPU
//! group uses NCCL instead.

use crate::sync::channel::{Receiver, Sender};

use super::Collective;
use crate::kernels::cpu::CpuBackend;

pub struct ChannelCollective {
    rank: usize,
    /// Indexed by peer rank; `None` at this rank's own index.
    to_peers: Vec<Option<Sender<Vec<f32>>>>,
    from_peers: Vec<Option<Receiver<Vec<f32>>>>,
}

impl ChannelCollective {
    /// The members of a group of `size` ranks, rank order.
    pub fn group(size: usize) -> Vec<ChannelCollective> {
        let mut members: Vec<ChannelCollective> = (0..size)
            .map(|rank| ChannelCollective {
                rank,
                to_peers: (0..size).map(|_| None).collect(),
                from_peers: (0..size).map(|_| None).collect(),
            })
            .collect();
        for from in 0..size {
            for to in 0..size {
                if from != to {
                    let (tx, rx) = crate::sync::channel::unbounded();
                    members[from].to_peers[to] = Some(tx);
                    members[to].from_peers[from] = Some(rx);
                }
            }
        }
        members
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.to_peers.len()
    }

    /// The sum over the group of each rank's `part`, added in rank order.
    pub fn sum(&self, part: &[f32]) -> Vec<f32> {
        for (peer, tx) in self.to_peers.iter().enumerate() {
            if let Some(tx) = tx
                && tx.send(part.to_vec()).is_err()
            {
                panic!("all-reduce: rank {peer} of the group is gone");
            }
        }
        let mut total: Option<Vec<f32>> = None;
        for (peer, rx) in self.from_peers.iter().enumerate() {
            let theirs = match rx {
                None => part.to_vec(),
                Some(rx) => rx
                    .recv()
                    .unwrap_or_else(|_| panic!("all-reduce: rank {peer} of the group is gone")),
            };
            assert_eq!(
                theirs.len(),
                part.len(),
                "all-reduce: rank {peer} sent {} values, rank {} {}",
                theirs.len(),
                self.rank,
                part.len()
            );
            match &mut total {
                None => total = Some(theirs),
                Some(t) => t.iter_mut().zip(&theirs).for_each(|(a, b)| *a += b),
            }
        }
        total.unwrap_or_else(|| part.to_vec())
    }
}

impl Collective<CpuBackend> for ChannelCollective {
    fn all_reduce_sum(&mut self, _backend: &CpuBackend, buf: &mut Vec<f32>, len: usize) {
        let total = self.sum(&buf[..len]);
        buf[..len].copy_from_slice(&total);
    }

    fn abort_probe(&self) -> Option<crate::kernels::collective::AbortProbe> {
        // A dropped peer fails the channel's own receive: nothing to probe.
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_same_sum_in_rank_order() {
        let parts = [vec![1e8f32, 1.0], vec![1.0, 2.0], vec![-1e8, 3.0]];
        let handles: Vec<_> = ChannelCollective::group(3)
            .into_iter()
            .zip(parts.clone())
            .map(|(member, part)| std::thread::spawn(move || member.sum(&part)))
            .collect();
        let sums: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // (1e8 + 1) - 1e8 in f32 is 0: the order is fixed, not the exact sum.
        let want = vec![(1e8f32 + 1.0) + -1e8, 6.0];
        for s in &sums {
            assert_eq!(s, &want);
        }
    }

    #[test]
    fn a_lost_peer_fails_the_reduce_instead_of_hanging() {
        let mut group = ChannelCollective::group(2);
        let survivor = group.remove(0);
        drop(group);
        let died = std::thread::spawn(move || survivor.sum(&[1.0])).join();
        let msg = *died.unwrap_err().downcast::<String>().unwrap();
        assert!(msg.contains("rank 1 of the group is gone"), "{msg}");
    }

    #[test]
    fn a_group_of_one_returns_its_own_part() {
        let solo = ChannelCollective::group(1).remove(0);
        assert_eq!(solo.sum(&[2.5, -1.0]), vec![2.5, -1.0]);
        assert_eq!((solo.rank(), solo.size()), (0, 1));
    }
}
