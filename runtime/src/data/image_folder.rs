//! Image folders (`ImageFolder`): `root/<class>/.../<file>`, as torchvision's `ImageFolder`
//! reads them, decoded batch by batch (never the whole folder up front): training images on
//! the loader's worker thread, validation images as validation feeds them (`EvalSet`).
//!
//! The stated rules:
//!
//! - Classes are the sorted (byte-wise) names of `root`'s subfolders; a class's index is its
//!   position. Unlike torchvision, folders whose name starts with a dot (hidden) are skipped,
//!   as classes and inside them, and a warning says so.
//! - A class's files are every file under its folder (nested folders walked in sorted order,
//!   files sorted) whose name ends, in any case, with one of [`EXTENSIONS`]. A class folder
//!   with none is an error, as is a root with no class folder.
//! - Every file's header is read when the folder is opened (its format and size, not its
//!   pixels): a file that is not an image of a format this build decodes (JPEG, PNG) is an
//!   error naming it, or with `skip_corrupt` is left out and counted. A file whose pixels
//!   fail to decode later stops training with an error naming it.
//! - The train/validation split without a `validation` folder is the other sources' rule
//!   (`data::split`) on the file list, with `validation_split` (default 0.1).
//! - Training batch `b` of epoch `e` holds the samples `order_of(shuffle, seed, e, len)[b *
//!   batch..]` (the [`super::Loader`]'s rule); sample `k` (its index in the train list) is
//!   transformed with the random numbers of `augment_key(seed, e, k)`: the same on any device
//!   count, thread count and across a resume.
//! - The data's hash covers the class names and, for every file, its path below the root,
//!   its class and its size in bytes (not its contents: the folder is read once, per batch).

use super::eval_set::{EvalImages, EvalSet};
use super::loader::{batches_per_epoch, order_of, read_mask, Batch, Wanted};
use super::transform::{self, ImageSpec};
use super::{DataError, ModelIo, Values};
use crate::rng::{self, Purpose};
use parallax_compiler::dsl::ast::Data;
use rayon::prelude::*;
use sha2::Digest;
use std::path::{Path, PathBuf};

/// The file extensions torchvision's `ImageFolder` accepts (compared case-insensitively).
pub const EXTENSIONS: [&str; 9] = [
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
];

/// An image folder's file list.
#[derive(Debug, Clone, PartialEq)]
pub struct Scan {
    pub root: PathBuf,
    /// Class names in index order.
    pub classes: Vec<String>,
    /// Every image and its class index, in class order then walk order.
    pub samples: Vec<(PathBuf, usize)>,
    /// Each file's size in bytes (for the data's hash).
    pub sizes: Vec<u64>,
    /// What the trainer should tell the user (hidden folders skipped, files skipped).
    pub warnings: Vec<String>,
    /// Files left out by `skip_corrupt`.
    pub skipped: usize,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Entries of `dir`, sorted by name (bytes), as (name, path, is a directory); symbolic links
/// followed, as torchvision's walk does.
fn entries(dir: &Path) -> Result<Vec<(String, PathBuf, bool)>, DataError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let path = entry.path();
        let is_dir = std::fs::metadata(&path).map_err(io_err(&path))?.is_dir();
        out.push((
            entry.file_name().to_string_lossy().into_owned(),
            path,
            is_dir,
        ));
    }
    out.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    Ok(out)
}

/// The class names of an image folder: its subfolders, sorted byte-wise, hidden ones left
/// out. What `predict` maps an output index to.
pub fn class_names(root: &Path) -> Result<Vec<String>, DataError> {
    Ok(entries(root)?
        .into_iter()
        .filter(|(name, _, dir)| *dir && !name.starts_with('.'))
        .map(|(name, _, _)| name)
        .collect())
}

fn is_image(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    EXTENSIONS.iter().any(|e| lower.ends_with(e))
}

/// Appends the images under `dir` (sorted walk) to `out`; counts hidden folders in `hidden`.
fn walk(dir: &Path, out: &mut Vec<PathBuf>, hidden: &mut Vec<PathBuf>) -> Result<(), DataError> {
    for (name, path, is_dir) in entries(dir)? {
        if is_dir && name.starts_with('.') {
            hidden.push(path);
        } else if is_dir {
            walk(&path, out, hidden)?;
        } else if is_image(&name) {
            out.push(path);
        }
    }
    Ok(())
}

/// Reads `path`'s header: its format must be one this build decodes.
fn check_header(path: &Path) -> Result<(), DataError> {
    let name = path.display().to_string();
    let reader = image::ImageReader::open(path)
        .map_err(io_err(path))?
        .with_guessed_format()
        .map_err(io_err(path))?;
    match reader.format() {
        None => {
            return Err(DataError::format(
                &name,
                "not an image of a known format (its first bytes match none)",
            ))
        }
        Some(f) if !f.reading_enabled() => {
            return Err(DataError::format(
                &name,
                format!(
                    "a {f:?} image, which this build does not decode (it decodes JPEG and PNG): convert it, or set `skip_corrupt: true` to leave it out"
                ),
            ))
        }
        Some(_) => {}
    }
    reader
        .into_dimensions()
        .map(|_| ())
        .map_err(|e| DataError::format(&name, format!("not a readable image: {e}")))
}

/// Scans `root` as the module's rules say; `skip_corrupt` leaves out files whose header does
/// not read instead of failing.
pub fn scan(root: &Path, skip_corrupt: bool) -> Result<Scan, DataError> {
    let shown = root.display().to_string();
    let mut hidden = Vec::new();
    let mut classes = Vec::new();
    for (name, path, is_dir) in entries(root)? {
        match (is_dir, name.starts_with('.')) {
            (true, true) => hidden.push(path),
            (true, false) => classes.push((name, path)),
            _ => {}
        }
    }
    if classes.is_empty() {
        return Err(DataError::format(
            &shown,
            "no class folder: an image folder holds one subfolder of images per class (root/<class>/<image>)",
        ));
    }
    let mut samples = Vec::new();
    let mut sizes = Vec::new();
    let mut skipped = Vec::new();
    for (index, (_, path)) in classes.iter().enumerate() {
        let mut files = Vec::new();
        walk(path, &mut files, &mut hidden)?;
        if files.is_empty() {
            return Err(DataError::format(
                path.display(),
                format!(
                    "an empty class folder: no file ending in {}",
                    EXTENSIONS.join(" ")
                ),
            ));
        }
        // Headers are read in parallel: a large folder is many small reads.
        let checked: Vec<Result<u64, DataError>> = files
            .par_iter()
            .map(|f| {
                check_header(f)?;
                Ok(std::fs::metadata(f).map_err(io_err(f))?.len())
            })
            .collect();
        for (file, r) in files.into_iter().zip(checked) {
            match r {
                Ok(size) => {
                    samples.push((file, index));
                    sizes.push(size);
                }
                Err(e @ DataError::Format { .. }) if skip_corrupt => skipped.push(e),
                Err(e) => return Err(e),
            }
        }
    }
    let mut warnings = Vec::new();
    if !hidden.is_empty() {
        let names: Vec<String> = hidden.iter().map(|p| p.display().to_string()).collect();
        warnings.push(format!(
            "{shown}: skipped {} hidden folder(s), whose name starts with a dot (torchvision would read them): {}",
            names.len(),
            names.join(", ")
        ));
    }
    if let Some(first) = skipped.first() {
        warnings.push(format!(
            "{shown}: skip_corrupt left out {} file(s) that are not decodable images; the first: {first}",
            skipped.len()
        ));
    }
    if samples.is_empty() {
        return Err(DataError::format(&shown, "no decodable image is left"));
    }
    Ok(Scan {
        root: root.to_path_buf(),
        classes: classes.into_iter().map(|c| c.0).collect(),
        samples,
        sizes,
        warnings,
        skipped: skipped.len(),
    })
}

/// The key of sample `sample`'s random transform in epoch `epoch`.
pub fn augment_key(seed: u64, epoch: u64, sample: usize) -> u64 {
    rng::stream(
        rng::mix(seed ^ rng::mix(epoch)),
        Purpose::Augment,
        sample as u64,
    )
}

/// The training images of a folder, batch by batch (see the module's rules).
pub struct Images {
    pub samples: Vec<(PathBuf, usize)>,
    pub spec: ImageSpec,
    pub augment: bool,
    pub seed: u64,
    pub batch: usize,
    pub shuffle: bool,
    pub per_epoch: usize,
}

impl Images {
    /// Sample `k` of the train list as the model reads it in epoch `epoch`.
    pub fn sample(&self, epoch: u64, k: usize) -> Result<Vec<f32>, DataError> {
        let path = &self.samples[k].0;
        let img = transform::decode(path, self.spec.channels)?;
        Ok(match self.augment {
            true => transform::train_transform(&img, &self.spec, augment_key(self.seed, epoch, k)),
            false => transform::eval_transform(&img, &self.spec),
        })
    }

    /// The order in which epoch `epoch` visits the train list.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        order_of(self.shuffle, self.seed, epoch, self.samples.len())
    }

    /// Batch `index` of epoch `epoch`; its images are decoded in parallel.
    pub fn batch(&self, epoch: u64, index: usize) -> Result<Batch, DataError> {
        self.batch_in(&self.order(epoch), epoch, index, None)
    }

    /// [`Images::batch`] given the epoch's [`Images::order`] (computed once an epoch),
    /// decoding only the `wanted` images (the loader's rule: the others stay zero; every
    /// class is read, from the file list).
    pub fn batch_in(
        &self,
        order: &[usize],
        epoch: u64,
        index: usize,
        wanted: Option<&Wanted>,
    ) -> Result<Batch, DataError> {
        let start = (index * self.batch).min(order.len());
        let picked = &order[start..(start + self.batch).min(order.len())];
        let mask = read_mask(wanted, picked.len());
        let size = self.spec.channels * self.spec.height * self.spec.width;
        let images: Vec<Vec<f32>> = picked
            .par_iter()
            .zip(&mask)
            .map(|(&k, &read)| match read {
                true => self.sample(epoch, k),
                false => Ok(vec![0.0; size]),
            })
            .collect::<Result<_, _>>()?;
        Ok(Batch {
            inputs: Values::F32(images.concat()),
            targets: Values::I32(picked.iter().map(|&k| self.samples[k].1 as i32).collect()),
            size: picked.len(),
            epoch,
            index,
            read: mask.iter().filter(|&&r| r).count(),
        })
    }
}

/// An image folder opened for training.
pub struct Opened {
    pub images: Images,
    /// Decoded batch by batch as validation feeds it, never whole up front.
    pub validation: EvalSet,
    pub hash: String,
    pub classes: Vec<String>,
    pub warnings: Vec<String>,
    /// Files left out by `skip_corrupt`, both folders.
    pub skipped: usize,
}

fn hash_scan(h: &mut sha2::Sha256, scan: &Scan, samples: &[usize]) {
    for c in &scan.classes {
        h.update(c.as_bytes());
        h.update(b"\0");
    }
    for &k in samples {
        let (path, class) = &scan.samples[k];
        let rel = path.strip_prefix(&scan.root).unwrap_or(path);
        h.update(rel.to_string_lossy().as_bytes());
        h.update(b"\0");
        h.update((*class as u64).to_le_bytes());
        h.update(scan.sizes[k].to_le_bytes());
    }
}

/// Samples `picked` of `scan` with the evaluation transform, decoded batch by batch.
fn eval_set(scan: &Scan, picked: &[usize], spec: &ImageSpec) -> EvalSet {
    EvalSet::Images(EvalImages {
        samples: picked.iter().map(|&k| scan.samples[k].clone()).collect(),
        spec: spec.clone(),
    })
}

/// The evaluation transform of one file (decode, resize the short side, centre crop, to
/// `[0, 1]`, normalize): what validation, and `predict`, feed the model.
pub fn eval_image(path: &Path, spec: &ImageSpec) -> Result<Vec<f32>, DataError> {
    let img = transform::decode(path, spec.channels)?;
    Ok(transform::eval_transform(&img, spec))
}

/// Opens `Data::ImageFolder` for a model (`io`) trained in global batches of `batch`.
pub fn open(
    data: &Data,
    io: &ModelIo,
    seed: u64,
    base_dir: &Path,
    batch: usize,
    shuffle: bool,
    drop_last: bool,
) -> Result<Opened, DataError> {
    let Data::ImageFolder {
        train,
        validation,
        validation_split,
        augment,
        skip_corrupt,
        ..
    } = data
    else {
        return Err(DataError::Config("not an image folder".into()));
    };
    let root = base_dir.join(train);
    let spec = ImageSpec::of(data, io, &root.display().to_string())?;
    let scan = scan(&root, *skip_corrupt)?;
    let check_classes = |s: &Scan| match io.classes {
        Some(c) if c != s.classes.len() => Err(DataError::mismatch(
            s.root.display(),
            format!(
                "{} class folders ({}), but the model's output has {c} classes",
                s.classes.len(),
                s.classes.join(", ")
            ),
        )),
        _ => Ok(()),
    };
    check_classes(&scan)?;
    let mut h = sha2::Sha256::new();
    let mut warnings = scan.warnings.clone();
    let mut skipped = scan.skipped;
    let all: Vec<usize> = (0..scan.samples.len()).collect();
    let (train_ids, validation) = match validation {
        Some(v) => {
            let vscan = self::scan(&base_dir.join(v), *skip_corrupt)?;
            check_classes(&vscan)?;
            if vscan.classes != scan.classes {
                return Err(DataError::mismatch(
                    vscan.root.display(),
                    format!(
                        "the validation folder's classes ({}) are not the train folder's ({})",
                        vscan.classes.join(", "),
                        scan.classes.join(", ")
                    ),
                ));
            }
            warnings.extend(vscan.warnings.iter().cloned());
            skipped += vscan.skipped;
            let vall: Vec<usize> = (0..vscan.samples.len()).collect();
            hash_scan(&mut h, &scan, &all);
            hash_scan(&mut h, &vscan, &vall);
            (all, eval_set(&vscan, &vall, &spec))
        }
        None => {
            let (t, v) = split_ids(scan.samples.len(), validation_split.unwrap_or(0.1), seed)?;
            hash_scan(&mut h, &scan, &t);
            hash_scan(&mut h, &scan, &v);
            let val = eval_set(&scan, &v, &spec);
            (t, val)
        }
    };
    if batch == 0 {
        return Err(DataError::Config(
            "the batch size must be at least 1".into(),
        ));
    }
    let len = train_ids.len();
    if drop_last && len < batch {
        return Err(DataError::Config(format!(
            "the image folder has {len} training images, fewer than one batch of {batch}: with drop_last every batch would be dropped"
        )));
    }
    Ok(Opened {
        images: Images {
            samples: train_ids.iter().map(|&k| scan.samples[k].clone()).collect(),
            spec,
            augment: *augment,
            seed,
            batch,
            shuffle,
            per_epoch: batches_per_epoch(len, batch, drop_last),
        },
        validation,
        hash: h.finalize().iter().map(|b| format!("{b:02x}")).collect(),
        classes: scan.classes,
        warnings,
        skipped,
    })
}

/// The train and validation indices of `n` files: `data::split`'s rule.
fn split_ids(n: usize, validation: f64, seed: u64) -> Result<(Vec<usize>, Vec<usize>), DataError> {
    if !(0.0..1.0).contains(&validation) {
        return Err(DataError::Config(format!(
            "the validation fraction must be in [0, 1), got {validation}"
        )));
    }
    let n_val = (n as f64 * validation).round() as usize;
    if n_val >= n {
        return Err(DataError::Config(format!(
            "the image folder has {n} images: a validation fraction of {validation} leaves none to train on"
        )));
    }
    let perm = rng::permutation(rng::stream(seed, Purpose::Split, 0), n);
    let mut val = perm[..n_val].to_vec();
    let mut train = perm[n_val..].to_vec();
    val.sort_unstable();
    train.sort_unstable();
    Ok((train, val))
}

#[cfg(test)]
#[path = "image_folder_tests.rs"]
mod tests;
