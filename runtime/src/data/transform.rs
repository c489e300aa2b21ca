//! Image transforms of torchvision's classification presets:
//!
//! - train: `RandomResizedCrop(H×W, scale=(0.08, 1), ratio=(3/4, 4/3))` (its `get_params`:
//!   10 tries, then a centre crop), bilinear, then `RandomHorizontalFlip(0.5)`;
//! - eval: `Resize(resize)` of the short side, then `CenterCrop(H×W)`;
//! - both: to `[0, 1]` (`/ 255`), then `Normalize(mean, std)`, planar `[C, H, W]`.
//!
//! Resampling is bilinear with half-pixel centres (`align_corners=False`) and without
//! antialiasing, so a strong downscale differs slightly from PIL's; a crop larger than the
//! resized image repeats its edge pixels (torchvision pads with zeros).

use super::{DataError, ModelIo};
use crate::rng;
use parallax_compiler::dsl::ast::Data;
use std::path::Path;

/// ImageNet's per-channel mean and std (torchvision's presets).
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];
/// One channel's defaults: the averages of ImageNet's.
pub const GREY_MEAN: f32 = 0.449;
pub const GREY_STD: f32 = 0.226;

/// What an image becomes for the model: `channels` (1 or 3) × `height` × `width`, normalized
/// by `mean` and `std`; the evaluation transform first resizes the short side to `resize`.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSpec {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
    pub resize: usize,
}

impl ImageSpec {
    /// The defaults for `channels × height × width`: ImageNet's normalization and a short
    /// side of `round(height * 256 / 224)`.
    pub fn new(channels: usize, height: usize, width: usize) -> ImageSpec {
        let (mean, std) = match channels {
            3 => (IMAGENET_MEAN.to_vec(), IMAGENET_STD.to_vec()),
            c => (vec![GREY_MEAN; c], vec![GREY_STD; c]),
        };
        ImageSpec {
            channels,
            height,
            width,
            mean,
            std,
            resize: (height as f64 * 256.0 / 224.0).round() as usize,
        }
    }

    /// The spec of `Data::ImageFolder` for a model that reads `f32[C, H, W]` (C = 1 or 3).
    pub fn of(data: &Data, io: &ModelIo, what: &str) -> Result<ImageSpec, DataError> {
        let Data::ImageFolder {
            resize, normalize, ..
        } = data
        else {
            return Err(DataError::Config("not an image folder".into()));
        };
        let mut spec = match (&io.input.shape[..], io.integer_input(), io.class_target()) {
            (&[c, h, w], false, true) if (c == 1 || c == 3) && h > 0 && w > 0 => {
                ImageSpec::new(c, h, w)
            }
            _ => {
                return Err(DataError::mismatch(what, format!(
                    "an image folder feeds a model that reads float images [C, H, W] with 1 or 3 channels and predicts a class, but the model reads {} and its target is {}",
                    io.input.show(),
                    io.target.show()
                )))
            }
        };
        if let Some(r) = resize {
            spec.resize = *r as usize;
        }
        if let Some(n) = normalize {
            if n.mean.len() != spec.channels || n.std.len() != spec.channels {
                return Err(DataError::Config(format!(
                    "`normalize` gives {} mean(s) and {} std(s), but the model reads {} channel(s)",
                    n.mean.len(),
                    n.std.len(),
                    spec.channels
                )));
            }
            spec.mean = n.mean.iter().map(|&v| v as f32).collect();
            spec.std = n.std.iter().map(|&v| v as f32).collect();
        }
        Ok(spec)
    }
}

/// A decoded image: `height × width` pixels of `channels` bytes, interleaved.
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub data: Vec<u8>,
}

/// Decodes `path` to `channels` (1: luma; 3: RGB, grey replicated, alpha dropped).
pub fn decode(path: &Path, channels: usize) -> Result<Pixels, DataError> {
    let name = path.display().to_string();
    let img = image::ImageReader::open(path)
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .with_guessed_format()
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .decode()
        .map_err(|e| DataError::format(&name, format!("cannot decode the image: {e}")))?;
    let (width, height) = (img.width() as usize, img.height() as usize);
    let data = match channels {
        1 => img.into_luma8().into_raw(),
        _ => img.into_rgb8().into_raw(),
    };
    Ok(Pixels {
        channels: if channels == 1 { 1 } else { 3 },
        height,
        width,
        data,
    })
}

/// A region of the source image, in source pixels (fractional for the eval transform).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Region {
    pub top: f64,
    pub left: f64,
    pub height: f64,
    pub width: f64,
}

/// Uniform in [0, 1) with 53 bits: draw `index` of the stream `key`.
fn uniform(key: u64, index: u64) -> f64 {
    (rng::bits(key, index) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A uniform integer in `0..n`.
fn below(key: u64, index: u64, n: usize) -> usize {
    rng::below(key, index, n as u64) as usize
}

/// `RandomResizedCrop.get_params(scale=(0.08, 1), ratio=(3/4, 4/3))` for an image of
/// `height × width`, its draws from `key`: try `t` (0..10) uses draws `4t..4t + 4` (area,
/// log-ratio, top, left). Returns (top, left, height, width) in whole pixels.
pub fn crop_params(key: u64, height: usize, width: usize) -> (usize, usize, usize, usize) {
    let (scale, ratio) = ((0.08f64, 1.0f64), (3.0f64 / 4.0, 4.0f64 / 3.0));
    let area = (height * width) as f64;
    let (lo, hi) = (ratio.0.ln(), ratio.1.ln());
    for t in 0..10u64 {
        let target = area * (scale.0 + (scale.1 - scale.0) * uniform(key, 4 * t));
        let aspect = (lo + (hi - lo) * uniform(key, 4 * t + 1)).exp();
        let w = (target * aspect).sqrt().round_ties_even() as usize;
        let h = (target / aspect).sqrt().round_ties_even() as usize;
        if 0 < w && w <= width && 0 < h && h <= height {
            let i = below(key, 4 * t + 2, height - h + 1);
            let j = below(key, 4 * t + 3, width - w + 1);
            return (i, j, h, w);
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (h, w) = if in_ratio < ratio.0 {
        ((width as f64 / ratio.0).round_ties_even() as usize, width)
    } else if in_ratio > ratio.1 {
        (height, (height as f64 * ratio.1).round_ties_even() as usize)
    } else {
        (height, width)
    };
    ((height - h) / 2, (width - w) / 2, h, w)
}

/// Draw 40 of a sample's key: whether it is flipped (probability 0.5).
pub fn flips(key: u64) -> bool {
    uniform(key, 40) < 0.5
}

/// The source region of the eval transform: resize the short side to `spec.resize` (the long
/// side to `floor(resize * long / short)`, as torchvision), then centre crop `H × W`.
pub fn eval_region(spec: &ImageSpec, height: usize, width: usize) -> Region {
    let short = height.min(width) as f64;
    let long = |l: usize| (spec.resize as f64 * l as f64 / short) as usize;
    let (rh, rw) = if height <= width {
        (spec.resize, long(width))
    } else {
        (long(height), spec.resize)
    };
    let top = ((rh as f64 - spec.height as f64) / 2.0).round_ties_even();
    let left = ((rw as f64 - spec.width as f64) / 2.0).round_ties_even();
    let (sy, sx) = (height as f64 / rh as f64, width as f64 / rw as f64);
    Region {
        top: top * sy,
        left: left * sx,
        height: spec.height as f64 * sy,
        width: spec.width as f64 * sx,
    }
}

/// `region` of `img` resampled (bilinear) to the spec's `H × W`, mirrored if `flip`, to
/// `[0, 1]` and normalized: planar `[C, H, W]`.
pub fn resample(img: &Pixels, region: Region, flip: bool, spec: &ImageSpec) -> Vec<f32> {
    let (c, oh, ow) = (img.channels, spec.height, spec.width);
    let mut out = vec![0f32; c * oh * ow];
    if img.height == 0 || img.width == 0 {
        return out;
    }
    // Source coordinate of output pixel `o` along one axis; the neighbours and the weight.
    let axis = |o: usize, start: f64, len: f64, n_out: usize, n_src: usize| {
        let s = start + (o as f64 + 0.5) * len / n_out as f64 - 0.5;
        let s = s.clamp(0.0, (n_src - 1) as f64);
        let a = s.floor() as usize;
        (a, (a + 1).min(n_src - 1), (s - a as f64) as f32)
    };
    let xs: Vec<_> = (0..ow)
        .map(|x| axis(x, region.left, region.width, ow, img.width))
        .collect();
    let px = |y: usize, x: usize, k: usize| img.data[(y * img.width + x) * c + k] as f32;
    for y in 0..oh {
        let (y0, y1, fy) = axis(y, region.top, region.height, oh, img.height);
        for (x, &(x0, x1, fx)) in xs.iter().enumerate() {
            let xo = if flip { ow - 1 - x } else { x };
            for k in 0..c {
                let top = px(y0, x0, k) * (1.0 - fx) + px(y0, x1, k) * fx;
                let bottom = px(y1, x0, k) * (1.0 - fx) + px(y1, x1, k) * fx;
                let v = (top * (1.0 - fy) + bottom * fy) / 255.0;
                out[(k * oh + y) * ow + xo] = (v - spec.mean[k]) / spec.std[k];
            }
        }
    }
    out
}

/// The evaluation transform of a decoded image.
pub fn eval_transform(img: &Pixels, spec: &ImageSpec) -> Vec<f32> {
    resample(img, eval_region(spec, img.height, img.width), false, spec)
}

/// The training transform of a decoded image, its random choices those of `key`.
pub fn train_transform(img: &Pixels, spec: &ImageSpec, key: u64) -> Vec<f32> {
    let (i, j, h, w) = crop_params(key, img.height, img.width);
    let region = Region {
        top: i as f64,
        left: j as f64,
        height: h as f64,
        width: w as f64,
    };
    resample(img, region, flips(key), spec)
}
