//! An engine's vision encoder, shared by its ranks and its encoder actor: each image is
//! encoded once, by whoever reaches it first — the encoder actor as the request arrives,
//! ahead of its prefill, or a rank whose step needs the rows before the actor got to
//! them — and its rows kept by the image's content hash for every rank and later turn.

use std::collections::VecDeque;
use std::path::Path;

use crate::kernels::{Backend, Device};
use crate::model::vision::{VisionEncoder, load_encoder};
use crate::step::PromptImage;
use crate::sync::{Condvar, Mutex, Shared};

/// An encoder as loaded, with the model's image token.
type Loaded = (Box<dyn PixelEncoder>, u32);

#[cfg(feature = "cuda")]
fn load_on_gpu(path: &Path, ordinal: usize) -> Result<Option<Loaded>, crate::error::TroupeError> {
    let gpu = crate::kernels::cuda::CudaBackend::new(ordinal, false, false).map_err(|e| {
        crate::error::TroupeError::InvalidInput(format!("the image encoder's GPU: {e}"))
    })?;
    Ok(
        crate::model::vision::load_encoder_on(path, gpu)?.map(|(e, id)| {
            (
                Box::new(OneAtATime(Mutex::new(e))) as Box<dyn PixelEncoder>,
                id,
            )
        }),
    )
}

#[cfg(not(feature = "cuda"))]
fn load_on_gpu(_path: &Path, _ordinal: usize) -> Result<Option<Loaded>, crate::error::TroupeError> {
    Err(crate::error::TroupeError::InvalidInput(
        crate::kernels::NO_CUDA.into(),
    ))
}

/// Patches one pass of the encoder takes at most: several small images batched, a large
/// one alone (a 1024² image has 5 184).
const BATCH_PATCHES: usize = 8192;

/// Encoder rows kept for images seen lately (a later turn with the same image, a
/// preempted request recomputed, another completion of it).
const CACHE_BYTES: usize = 256 << 20;

/// Encoder rows by image hash, least recently used first, under a byte budget. An image
/// being encoded has a slot others wait on instead of encoding it again.
pub struct EmbeddingCache {
    state: Mutex<CacheState>,
    done: Condvar,
    budget_bytes: usize,
}

#[derive(Default)]
struct CacheState {
    slots: VecDeque<(u64, Slot)>,
    bytes: usize,
    stats: EncoderStats,
}

enum Slot {
    Encoding,
    Ready(Shared<Vec<f32>>),
}

/// What a caller of `EmbeddingCache::claim` is to do.
pub enum Claim {
    /// The rows, cached or encoded by another while this caller waited.
    Ready(Shared<Vec<f32>>),
    /// The image is the caller's to encode: `complete` (or `abandon`) it.
    Mine,
}

/// Images encoded, and ranks' lookups that found the rows cached (or waited while another
/// encoded them).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EncoderStats {
    pub num_encoded: u64,
    pub num_hits: u64,
    /// Rows another engine encoded and sent here (E/P/D).
    pub num_received: u64,
}

impl EmbeddingCache {
    pub fn new(budget_bytes: usize) -> EmbeddingCache {
        EmbeddingCache {
            state: Mutex::new(CacheState::default()),
            done: Condvar::new(),
            budget_bytes,
        }
    }

    /// The rows of `hash`, waiting while another encodes them; `Mine` where nobody has.
    /// `wait: false` answers `None` instead of waiting.
    pub fn claim(&self, hash: u64, wait: bool) -> Option<Claim> {
        let mut st = self.state.lock().expect("no panic holds the cache lock");
        loop {
            match st.slots.iter().position(|(h, _)| *h == hash) {
                None => {
                    st.slots.push_back((hash, Slot::Encoding));
                    return Some(Claim::Mine);
                }
                Some(i) => match &st.slots[i].1 {
                    Slot::Ready(rows) => {
                        let rows = rows.clone();
                        let entry = st.slots.remove(i).expect("found");
                        st.slots.push_back(entry);
                        // A rank's lookup (`wait`), not the actor's look ahead.
                        st.stats.num_hits += u64::from(wait);
                        return Some(Claim::Ready(rows));
                    }
                    Slot::Encoding if !wait => return None,
                    Slot::Encoding => {
                        st = self.done.wait(st).expect("no panic holds the cache lock");
                    }
                },
            }
        }
    }

    /// The rows of an image claimed with `Mine`; the least recently used rows go past the
    /// budget (never those being encoded).
    pub fn complete(&self, hash: u64, rows: Shared<Vec<f32>>) {
        self.keep(hash, rows, true);
    }

    /// Rows encoded elsewhere, kept unless the image is cached or being encoded here.
    pub fn insert(&self, hash: u64, rows: Shared<Vec<f32>>) {
        if let Some(Claim::Mine) = self.claim(hash, false) {
            self.keep(hash, rows, false);
        }
    }

    fn keep(&self, hash: u64, rows: Shared<Vec<f32>>, encoded: bool) {
        let mut st = self.state.lock().expect("no panic holds the cache lock");
        st.bytes += rows.len() * 4;
        match encoded {
            true => st.stats.num_encoded += 1,
            false => st.stats.num_received += 1,
        }
        match st.slots.iter_mut().find(|(h, _)| *h == hash) {
            Some(slot) => slot.1 = Slot::Ready(rows),
            None => st.slots.push_back((hash, Slot::Ready(rows))),
        }
        while st.bytes > self.budget_bytes {
            let Some(i) = st.slots.iter().position(|(h, s)| {
                matches!(s, Slot::Ready(_)) && (*h != hash || st.slots.len() == 1)
            }) else {
                break;
            };
            if let (_, Slot::Ready(old)) = st.slots.remove(i).expect("found") {
                st.bytes -= old.len() * 4;
            }
        }
        drop(st);
        self.done.notify_all();
    }

    /// Gives up a claim (the encoder failed): a waiter claims the image in turn.
    pub fn abandon(&self, hash: u64) {
        let mut st = self.state.lock().expect("no panic holds the cache lock");
        st.slots
            .retain(|(h, s)| *h != hash || matches!(s, Slot::Ready(_)));
        drop(st);
        self.done.notify_all();
    }

    pub fn stats(&self) -> EncoderStats {
        self.state
            .lock()
            .expect("no panic holds the cache lock")
            .stats
    }
}

/// A claim that is abandoned unless completed, so a panicking encoder leaves no waiter
/// behind.
struct ClaimGuard<'a> {
    cache: &'a EmbeddingCache,
    hash: u64,
    open: bool,
}

impl Drop for ClaimGuard<'_> {
    fn drop(&mut self) {
        if self.open {
            self.cache.abandon(self.hash);
        }
    }
}

/// Pixels to the language model's rows, on whichever device the engine runs.
trait PixelEncoder: Send + Sync {
    fn encode_batch(&self, images: &[(&[f32], [usize; 3])]) -> Vec<Vec<f32>>;
    fn out_hidden_size(&self) -> usize;
    fn patch_len(&self) -> usize;
}

impl<B: Backend> PixelEncoder for VisionEncoder<B> {
    fn encode_batch(&self, images: &[(&[f32], [usize; 3])]) -> Vec<Vec<f32>> {
        VisionEncoder::encode_batch(self, images)
    }
    fn out_hidden_size(&self) -> usize {
        self.cfg.out_hidden_size
    }
    fn patch_len(&self) -> usize {
        self.cfg.patch_len()
    }
}

/// An encoder on a GPU: its own stream and cuBLAS handle, one image at a time on them
/// (ranks and the encoder actor may reach different images at once).
#[cfg(feature = "cuda")]
struct OneAtATime<E>(Mutex<E>);

#[cfg(feature = "cuda")]
impl<E: PixelEncoder> PixelEncoder for OneAtATime<E> {
    fn encode_batch(&self, images: &[(&[f32], [usize; 3])]) -> Vec<Vec<f32>> {
        let encoder = self.0.lock().unwrap_or_else(|e| e.into_inner());
        encoder.encode_batch(images)
    }
    fn out_hidden_size(&self) -> usize {
        let encoder = self.0.lock().unwrap_or_else(|e| e.into_inner());
        encoder.out_hidden_size()
    }
    fn patch_len(&self) -> usize {
        let encoder = self.0.lock().unwrap_or_else(|e| e.into_inner());
        encoder.patch_len()
    }
}

/// The model's vision encoder and its cache, one per engine.
pub struct ImageEncoder {
    encoder: Box<dyn PixelEncoder>,
    pub image_token_id: u32,
    /// Pixel values of one patch.
    patch_len: usize,
    cache: EmbeddingCache,
}

impl ImageEncoder {
    /// The encoder of the model at `path` on `device` (a GPU's in f32 with bf16 GEMM
    /// operands, the host's exact f32); `None` for a model that takes no images.
    pub fn load(
        path: &Path,
        device: Device,
    ) -> Result<Option<ImageEncoder>, crate::error::TroupeError> {
        let loaded: Option<Loaded> = match device {
            Device::Cpu => load_encoder(path)?.map(|(e, id)| (Box::new(e) as _, id)),
            Device::Cuda(ordinal) => load_on_gpu(path, ordinal)?,
        };
        Ok(loaded.map(|(encoder, image_token_id)| ImageEncoder {
            patch_len: encoder.patch_len(),
            encoder,
            image_token_id,
            cache: EmbeddingCache::new(CACHE_BYTES),
        }))
    }

    /// Rows of each token of the language model's input.
    pub fn out_hidden_size(&self) -> usize {
        self.encoder.out_hidden_size()
    }

    /// The rows of `image`: cached, waited for while another encodes them, or encoded now.
    /// Cached rows of another size (a peer's, or a hash collision) are not the image's:
    /// it is encoded here instead.
    pub fn rows(&self, image: &PromptImage) -> Shared<Vec<f32>> {
        match self.cache.claim(image.hash, true).expect("waits") {
            Claim::Ready(rows) if rows.len() == image.num_tokens() * self.out_hidden_size() => rows,
            Claim::Ready(_) => {
                tracing::warn!("cached rows of image {:x} are of another size", image.hash);
                let pixels = [(&image.pixels[..], image.grid)];
                Shared::new(self.encoder.encode_batch(&pixels).remove(0))
            }
            Claim::Mine => self.encode_claimed(&[image]).remove(0),
        }
    }

    /// Encodes those of `images` nobody has encoded or is encoding (the encoder actor's
    /// batch, ahead of the prefills that need them), in passes of at most
    /// `BATCH_PATCHES` patches; how many it encoded.
    pub fn encode_ahead(&self, images: &[PromptImage]) -> usize {
        let mine: Vec<&PromptImage> = (images.iter())
            .filter(|i| matches!(self.cache.claim(i.hash, false), Some(Claim::Mine)))
            .collect();
        let mut start = 0;
        while start < mine.len() {
            let mut end = start + 1;
            let mut patches = mine[start].pixels.len();
            while end < mine.len() && patches + mine[end].pixels.len() <= self.batch_values() {
                patches += mine[end].pixels.len();
                end += 1;
            }
            self.encode_claimed(&mine[start..end]);
            start = end;
        }
        mine.len()
    }

    /// Pixel values a pass of the encoder takes at most (one image may exceed it alone).
    fn batch_values(&self) -> usize {
        BATCH_PATCHES * self.patch_len
    }

    /// Encodes `images`, each claimed here, as one pass; their claims are given up if the
    /// encoder panics.
    fn encode_claimed(&self, images: &[&PromptImage]) -> Vec<Shared<Vec<f32>>> {
        let mut guards: Vec<ClaimGuard<'_>> = (images.iter())
            .map(|i| ClaimGuard {
                cache: &self.cache,
                hash: i.hash,
                open: true,
            })
            .collect();
        let pixels: Vec<(&[f32], [usize; 3])> =
            images.iter().map(|i| (&i.pixels[..], i.grid)).collect();
        let rows: Vec<Shared<Vec<f32>>> = (self.encoder.encode_batch(&pixels).into_iter())
            .map(Shared::new)
            .collect();
        for ((image, guard), rows) in images.iter().zip(&mut guards).zip(&rows) {
            guard.open = false;
            self.cache.complete(image.hash, rows.clone());
        }
        rows
    }

    pub fn stats(&self) -> EncoderStats {
        self.cache.stats()
    }

    /// Rows of image `hash` another engine encoded (E/P/D); refused unless whole rows.
    /// (`rows` checks them against the image before a rank reads them.)
    pub fn insert(&self, hash: u64, rows: Vec<f32>) -> Result<(), String> {
        let width = self.out_hidden_size();
        if rows.is_empty() || !rows.len().is_multiple_of(width) {
            return Err(format!(
                "{} values are not whole rows of {width}",
                rows.len()
            ));
        }
        self.cache.insert(hash, Shared::new(rows));
        Ok(())
    }
}
