//! The image half of the loader benchmark (benches/loader.sh):
//!
//!   loader_images write ROOT CLASSES PER_CLASS SIZE   synthetic RGB JPEGs (quality 90) in
//!                                                     ROOT/<class>/NNNN.jpg, SIZE x SIZE
//!   loader_images decode ROOT SIDE [REPEATS]          decodes and train-transforms
//!                                                     (RandomResizedCrop to SIDE x SIDE, flip,
//!                                                     normalize) every file on ONE thread and
//!                                                     prints `images_per_sec N`
//!
//! The pictures are smooth gradients, rings and stripes with noise: not flat colour, so a
//! JPEG of them costs what a photo of that size costs to decode, roughly.

use parallax_runtime::data::image_folder::{scan, Images};
use parallax_runtime::data::transform::ImageSpec;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

/// A deterministic pseudo-random byte of (image, pixel): the noise.
fn noise(image: u64, pixel: u64) -> u8 {
    let mut x =
        image.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ pixel.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    (x >> 56) as u8
}

fn write(root: &Path, classes: usize, per_class: usize, size: u32) -> Result<(), String> {
    for c in 0..classes {
        let dir = root.join(format!("class{c}"));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for i in 0..per_class {
            let id = (c * per_class + i) as u64;
            let s = size as f32;
            let mut px = Vec::with_capacity((size * size * 3) as usize);
            for y in 0..size {
                for x in 0..size {
                    let (fx, fy) = (x as f32 / s, y as f32 / s);
                    let r = ((fx - 0.5).powi(2) + (fy - 0.5).powi(2)).sqrt();
                    // The class sets the ring frequency; the image, the phase and tint.
                    let ring = (r * (8.0 + 6.0 * c as f32) + id as f32).sin() * 0.5 + 0.5;
                    let stripe = ((fx + fy) * (3.0 + (id % 7) as f32)).cos() * 0.5 + 0.5;
                    let n = noise(id, (y * size + x) as u64) as f32 / 255.0;
                    px.push((255.0 * (0.6 * ring + 0.25 * fx + 0.15 * n)) as u8);
                    px.push((255.0 * (0.5 * stripe + 0.3 * fy + 0.2 * n)) as u8);
                    px.push((255.0 * (0.4 * ring * stripe + 0.4 * (1.0 - fx) + 0.2 * n)) as u8);
                }
            }
            let path = dir.join(format!("{i:04}.jpg"));
            let file =
                std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let mut enc = image::codecs::jpeg::JpegEncoder::new_with_quality(
                std::io::BufWriter::new(file),
                90,
            );
            enc.encode(&px, size, size, image::ExtendedColorType::Rgb8)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}

fn decode(root: &Path, side: usize, repeats: u64) -> Result<(), String> {
    let scan = scan(root, false).map_err(|e| e.to_string())?;
    let n = scan.samples.len();
    let batch = 32;
    let images = Images {
        samples: scan.samples,
        spec: ImageSpec::new(3, side, side),
        augment: true,
        seed: 0,
        batch,
        shuffle: true,
        per_epoch: n.div_ceil(batch),
    };
    // One thread: the figure is per core.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| e.to_string())?;
    let t = Instant::now();
    let mut done = 0usize;
    pool.install(|| -> Result<(), String> {
        for epoch in 0..repeats {
            for b in 0..images.per_epoch {
                done += images.batch(epoch, b).map_err(|e| e.to_string())?.size;
            }
        }
        Ok(())
    })?;
    let secs = t.elapsed().as_secs_f64();
    println!("images {done}");
    println!("seconds {secs:.3}");
    println!("images_per_sec {:.1}", done as f64 / secs);
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| -> Result<u64, String> {
        args.get(i)
            .ok_or_else(|| format!("argument {i} is missing"))?
            .parse::<u64>()
            .map_err(|e| format!("argument {i}: {e}"))
    };
    let r = match args.first().map(String::as_str) {
        Some("write") if args.len() == 5 => (|| {
            write(
                Path::new(&args[1]),
                num(2)? as usize,
                num(3)? as usize,
                num(4)? as u32,
            )
        })(),
        Some("decode") if (3..=4).contains(&args.len()) => (|| {
            let repeats = if args.len() == 4 { num(3)? } else { 1 };
            decode(Path::new(&args[1]), num(2)? as usize, repeats)
        })(),
        _ => Err(
            "usage: loader_images write ROOT CLASSES PER_CLASS SIZE | decode ROOT SIDE [REPEATS]"
                .into(),
        ),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
