//! A prompt's images as a step carries them to the ranks (pure data: the encoder runs on
//! the rank, from these pixels).
//!
//! An image's placeholder tokens are all one id in the vocabulary, so prompts with
//! different images would share prefix-cache blocks. The scheduler's copy of a prompt
//! therefore names each placeholder by the image's content instead (`virtual_ids`: ids
//! above the vocabulary, the content hash and the token's place in the image), and the
//! rank reads them back as placeholders (`is_virtual`).

use crate::sync::Shared;

/// Ids at or above this are an image's placeholders in the scheduler's copy of a prompt.
pub const VIRTUAL_ID_BASE: u32 = crate::sched::FIRST_VIRTUAL_ID;

pub fn is_virtual(id: u32) -> bool {
    id >= VIRTUAL_ID_BASE
}

/// One image of a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptImage {
    /// A digest of the pixels (SHA-256's first 8 bytes): the encoder cache's key and the
    /// placeholders' names.
    pub hash: u64,
    /// The prompt position of its first placeholder token.
    pub first_token: usize,
    /// (temporal, height, width) in patches.
    pub grid: [usize; 3],
    /// Patches merged `merge × merge` into one token.
    pub merge: usize,
    /// The processor's rows, `grid` product × patch length.
    pub pixels: Shared<[f32]>,
}

impl PromptImage {
    /// An image of the processor's rows `pixels` at prompt position `first_token`, named
    /// by a digest of its pixels and grid.
    pub fn new(
        first_token: usize,
        grid: [usize; 3],
        merge: usize,
        pixels: Vec<f32>,
    ) -> PromptImage {
        use sha2::{Digest, Sha256};
        let mut digest = Sha256::new();
        for d in grid {
            digest.update((d as u64).to_le_bytes());
        }
        digest.update(bytemuck::cast_slice::<f32, u8>(&pixels));
        let hash = u64::from_le_bytes(digest.finalize()[..8].try_into().expect("8 bytes"));
        PromptImage {
            hash,
            first_token,
            grid,
            merge,
            pixels: pixels.into(),
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.grid.iter().product::<usize>() / (self.merge * self.merge)
    }

    pub fn end_token(&self) -> usize {
        self.first_token + self.num_tokens()
    }

    /// The grid of merged patches: one token each.
    pub fn token_grid(&self) -> [usize; 3] {
        [
            self.grid[0],
            self.grid[1] / self.merge,
            self.grid[2] / self.merge,
        ]
    }

    /// The scheduler's names for its placeholders: distinct for each token of the image
    /// and, but for a 2^-31 chance a token, for each image.
    pub fn virtual_ids(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.num_tokens() as u64).map(move |i| {
            let h = crate::sampling::splitmix64(self.hash ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            VIRTUAL_ID_BASE | (h as u32 & (VIRTUAL_ID_BASE - 1))
        })
    }
}

/// `prompt` with every image's placeholders replaced by its virtual ids.
pub fn with_virtual_ids(prompt: &[u32], images: &[PromptImage]) -> Vec<u32> {
    let mut ids = prompt.to_vec();
    for image in images {
        for (slot, id) in ids[image.first_token..image.end_token()]
            .iter_mut()
            .zip(image.virtual_ids())
        {
            *slot = id;
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(hash: u64, first_token: usize) -> PromptImage {
        PromptImage {
            hash,
            first_token,
            grid: [1, 4, 6],
            merge: 2,
            pixels: Shared::from(vec![0f32; 24]),
        }
    }

    #[test]
    fn placeholders_are_named_by_content_and_place() {
        let prompt = vec![7u32; 12];
        let a = with_virtual_ids(&prompt, &[image(1, 3)]);
        let b = with_virtual_ids(&prompt, &[image(2, 3)]);
        assert_eq!(&a[..3], &prompt[..3]);
        assert_eq!(&a[9..], &prompt[9..]);
        assert!(a[3..9].iter().all(|&id| is_virtual(id)));
        // Different images differ at every placeholder; one image's tokens differ too.
        assert!(a[3..9].iter().zip(&b[3..9]).all(|(x, y)| x != y));
        let mut distinct = a[3..9].to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 6);
        assert_eq!(a, with_virtual_ids(&prompt, &[image(1, 3)]));
    }
}
