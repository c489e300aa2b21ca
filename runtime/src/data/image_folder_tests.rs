use super::*;
use crate::data::testutil::{classify, err_text, TempDir};
use crate::data::transform::{crop_params, eval_transform, flips, resample, Pixels, Region};
use crate::data::DType;
use parallax_compiler::dsl::ast::Normalize;

/// Writes a `w × h` grey PNG whose pixel (y, x) is `f(y, x)`, creating folders.
fn png(dir: &Path, rel: &str, w: u32, h: u32, f: impl Fn(u32, u32) -> u8) -> PathBuf {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let px: Vec<u8> = (0..h)
        .flat_map(|y| (0..w).map(move |x| (y, x)))
        .map(|(y, x)| f(y, x))
        .collect();
    image::save_buffer(&p, &px, w, h, image::ExtendedColorType::L8).unwrap();
    p
}

fn rgb_jpeg(dir: &Path, rel: &str) -> PathBuf {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let px = vec![200u8; 8 * 8 * 3];
    image::save_buffer_with_format(
        &p,
        &px,
        8,
        8,
        image::ExtendedColorType::Rgb8,
        image::ImageFormat::Jpeg,
    )
    .unwrap();
    p
}

fn names(s: &Scan) -> Vec<(String, usize)> {
    s.samples
        .iter()
        .map(|(p, c)| (p.strip_prefix(&s.root).unwrap().display().to_string(), *c))
        .collect()
}

#[test]
fn scan_orders_classes_bytewise_walks_nested_folders_and_skips_hidden_ones() {
    let t = TempDir::new("scan");
    let d = t.path();
    png(d, "b/2.png", 4, 4, |_, _| 0);
    png(d, "b/1.PNG", 4, 4, |_, _| 0);
    png(d, "a/z/deep.png", 4, 4, |_, _| 0);
    png(d, "a/y.png", 4, 4, |_, _| 0);
    rgb_jpeg(d, "10/x.JPEG");
    png(d, "2/x.png", 4, 4, |_, _| 0);
    png(d, "B/x.png", 4, 4, |_, _| 0);
    png(d, ".hidden/x.png", 4, 4, |_, _| 0);
    png(d, "a/.cache/x.png", 4, 4, |_, _| 0);
    std::fs::write(d.join("a/notes.txt"), "not an image").unwrap();
    std::fs::write(d.join("top.png"), "a file at the root is no class").unwrap();
    let s = scan(d, false).unwrap();
    assert_eq!(s.classes, ["10", "2", "B", "a", "b"]);
    assert_eq!(
        names(&s),
        [
            ("10/x.JPEG".into(), 0),
            ("2/x.png".into(), 1),
            ("B/x.png".into(), 2),
            ("a/y.png".into(), 3),
            ("a/z/deep.png".into(), 3),
            ("b/1.PNG".into(), 4),
            ("b/2.png".into(), 4),
        ]
    );
    assert_eq!(s.warnings.len(), 1);
    let w = &s.warnings[0];
    assert!(
        w.contains("skipped 2 hidden folder(s)") && w.contains(".hidden") && w.contains(".cache"),
        "{w}"
    );
    assert_eq!(class_names(d).unwrap(), s.classes);
}

#[test]
fn bad_folders_and_files_are_errors_naming_them() {
    let t = TempDir::new("bad");
    let d = t.path();
    let e = scan(d, false).unwrap_err().to_string();
    assert!(e.contains("no class folder"), "{e}");
    png(d, "cat/1.png", 4, 4, |_, _| 9);
    std::fs::create_dir_all(d.join("dog/sub")).unwrap();
    std::fs::write(d.join("dog/readme.md"), "x").unwrap();
    let e = scan(d, false).unwrap_err().to_string();
    assert!(
        e.contains("dog") && e.contains("an empty class folder"),
        "{e}"
    );
    std::fs::write(d.join("dog/broken.png"), b"\x89PNG\r\n\x1a\nthen nothing").unwrap();
    std::fs::write(d.join("dog/text.jpg"), b"hello").unwrap();
    png(d, "dog/good.png", 4, 4, |_, _| 1);
    let e = scan(d, false).unwrap_err().to_string();
    assert!(
        e.contains("dog/broken.png") && e.contains("not a readable image"),
        "{e}"
    );
    let s = scan(d, true).unwrap();
    assert_eq!(s.skipped, 2);
    assert_eq!(
        names(&s),
        [("cat/1.png".into(), 0), ("dog/good.png".into(), 1)]
    );
    assert!(
        s.warnings[0].contains("left out 2 file(s)"),
        "{:?}",
        s.warnings
    );
    // A format this build does not decode is named as such.
    std::fs::write(d.join("cat/scan.tif"), b"II*\0\x08\0\0\0rest").unwrap();
    let e = scan(d, false).unwrap_err().to_string();
    assert!(
        e.contains("cat/scan.tif") && e.contains("Tiff image, which this build does not decode"),
        "{e}"
    );
}

#[test]
fn random_resized_crops_are_keyed_and_within_the_image() {
    let mut seen = std::collections::HashSet::new();
    for k in 0..200 {
        let key = augment_key(7, 3, k);
        let (i, j, h, w) = crop_params(key, 30, 50);
        assert_eq!((i, j, h, w), crop_params(key, 30, 50));
        assert!(
            h > 0 && w > 0 && i + h <= 30 && j + w <= 50,
            "{i} {j} {h} {w}"
        );
        let area = (h * w) as f64 / 1500.0;
        assert!((0.07..=1.0).contains(&area), "{area}");
        seen.insert((i, j, h, w));
    }
    assert!(seen.len() > 150, "{}", seen.len());
    assert_ne!(augment_key(7, 3, 0), augment_key(7, 4, 0));
    assert_ne!(augment_key(7, 3, 0), augment_key(8, 3, 0));
    let flipped = (0..1000).filter(|&k| flips(augment_key(1, 0, k))).count();
    assert!((430..570).contains(&flipped), "{flipped}");
    // A 1-pixel-high strip never fits a crop of ratio >= 3/4: the centre-crop fallback.
    assert_eq!(crop_params(augment_key(1, 0, 0), 1, 100), (0, 49, 1, 1));
}

#[test]
fn centre_crop_flip_and_normalize_give_known_pixels() {
    // A 4×6 grey image, pixel (y, x) = 10y + x; resize 4 keeps it, the crop is columns 1..5.
    let img = Pixels {
        channels: 1,
        height: 4,
        width: 6,
        data: (0..4)
            .flat_map(|y| (0..6).map(move |x| (10 * y + x) as u8))
            .collect(),
    };
    let mut spec = ImageSpec::new(1, 4, 4);
    spec.resize = 4;
    spec.mean = vec![0.0];
    spec.std = vec![1.0 / 255.0];
    let out = eval_transform(&img, &spec);
    let want: Vec<f32> = (0..4)
        .flat_map(|y| (1..5).map(move |x| (10 * y + x) as f32))
        .collect();
    assert_eq!(out.iter().map(|v| v.round()).collect::<Vec<_>>(), want);
    let whole = Region {
        top: 0.0,
        left: 1.0,
        height: 4.0,
        width: 4.0,
    };
    let flipped = resample(&img, whole, true, &spec);
    let mirror: Vec<f32> = (0..4)
        .flat_map(|y| (1..5).rev().map(move |x| (10 * y + x) as f32))
        .collect();
    assert_eq!(
        flipped.iter().map(|v| v.round()).collect::<Vec<_>>(),
        mirror
    );
    // Normalize: (p / 255 - mean) / std, per channel, planar.
    let rgb = Pixels {
        channels: 3,
        height: 1,
        width: 1,
        data: vec![255, 0, 51],
    };
    let s3 = ImageSpec::new(3, 1, 1);
    let v = eval_transform(&rgb, &s3);
    let expect = [
        (1.0 - 0.485) / 0.229,
        (0.0 - 0.456) / 0.224,
        (0.2 - 0.406) / 0.225,
    ];
    for (a, b) in v.iter().zip(expect) {
        assert!((a - b).abs() < 1e-5, "{v:?}");
    }
    // Downscaling by 2 averages neighbours (bilinear at half-pixel centres).
    let s2 = ImageSpec {
        resize: 2,
        ..ImageSpec::new(1, 2, 3)
    };
    let down = eval_transform(
        &img,
        &ImageSpec {
            mean: vec![0.0],
            std: vec![1.0 / 255.0],
            ..s2
        },
    );
    assert_eq!(
        down.iter()
            .map(|v| v * 2.0)
            .map(f32::round)
            .collect::<Vec<_>>(),
        [11.0, 15.0, 19.0, 51.0, 55.0, 59.0].map(|v| v as f32)
    );
}

/// Writes three classes of four 12x10 grey images at `d`, and returns them as an augmented
/// source (a quarter held out) with the model that reads them.
fn digits(d: &Path) -> (Data, ModelIo) {
    for c in 0..3u8 {
        for k in 0..4u32 {
            png(d, &format!("{c}/{k}.png"), 12, 10, |y, x| {
                (c as u32 * 60 + y * 3 + x + k) as u8
            });
        }
    }
    let data = Data::ImageFolder {
        train: d.display().to_string(),
        validation: None,
        validation_split: Some(0.25),
        augment: true,
        resize: None,
        normalize: Some(Normalize {
            mean: vec![0.5],
            std: vec![0.5],
        }),
        skip_corrupt: false,
    };
    (data, classify(DType::F32, vec![1, 8, 8], 3))
}

#[test]
fn batches_are_pure_functions_of_seed_epoch_and_index() {
    let t = TempDir::new("batches");
    let (data, io) = digits(t.path());
    let a = open(&data, &io, 3, Path::new("."), 4, true, false).unwrap();
    let b = open(&data, &io, 3, Path::new("."), 4, true, false).unwrap();
    assert_eq!(
        (
            a.images.samples.len(),
            a.validation.len(),
            a.images.per_epoch
        ),
        (9, 3, 3)
    );
    assert_eq!(a.hash, b.hash);
    assert_eq!(a.classes, ["0", "1", "2"]);
    // The validation images are decoded batch by batch, as validation feeds them.
    let (x, y) = a.validation.batch(0, 3, None).unwrap();
    assert_eq!((x.len(), y.len()), (3 * 64, 3));
    let (x1, _) = a.validation.batch(1, 2, None).unwrap();
    assert_eq!(x1, x.samples(64, 1, 2));
    let x = a.images.batch(1, 2).unwrap();
    assert_eq!(x, b.images.batch(1, 2).unwrap());
    assert_eq!((x.size, x.inputs.len()), (1, 64));
    let Values::F32(v) = &a.images.batch(0, 0).unwrap().inputs else {
        panic!()
    };
    assert!(v.iter().all(|p| (-1.0..=1.0).contains(p)));
    assert_ne!(a.images.batch(0, 0).unwrap(), a.images.batch(1, 0).unwrap());
    // Other seeds split and hash differently; a wrong class count is refused.
    let other = |seed| {
        open(&data, &io, seed, Path::new("."), 4, true, false)
            .unwrap()
            .hash
    };
    assert!((4..8).any(|seed| other(seed) != a.hash));
    let refused = |io| err_text(open(&data, &io, 3, Path::new("."), 4, true, false));
    let e = refused(classify(DType::F32, vec![1, 8, 8], 10));
    assert!(
        e.contains("3 class folders (0, 1, 2), but the model's output has 10 classes"),
        "{e}"
    );
    let e = refused(classify(DType::F32, vec![64], 3));
    assert!(e.contains("float images [C, H, W]"), "{e}");
    // A file that stops decoding after the scan ends the batches with its name.
    let p = a.images.samples[0].0.clone();
    let mut bytes = std::fs::read(&p).unwrap();
    bytes.truncate(bytes.len() - 20);
    std::fs::write(&p, bytes).unwrap();
    let errs: Vec<String> = (0..3)
        .filter_map(|i| a.images.batch(0, i).err())
        .map(|e| e.to_string())
        .collect();
    assert!(
        errs.iter()
            .any(|e| e.contains(&p.display().to_string()) && e.contains("cannot decode")),
        "{errs:?}"
    );
    assert!(eval_image(&p, &a.images.spec).is_err());
    // The loader then stops (no panic) and says why.
    let mut loader = crate::data::Loader::images(b.images, 0).unwrap();
    assert!((0..3).any(|_| loader.next().is_none()));
    let why = loader.failure().unwrap().to_string();
    assert!(why.contains(&p.display().to_string()), "{why}");
}

#[test]
fn a_process_decodes_only_its_micro_shards_images() {
    let t = TempDir::new("wanted");
    let (data, io) = digits(t.path());
    let a = open(&data, &io, 3, Path::new("."), 4, true, false).unwrap();
    let order = a.images.order(0);
    let whole = a.images.batch_in(&order, 0, 0, None).unwrap();
    assert_eq!(whole.read, 4);
    let wanted: crate::data::loader::Wanted =
        std::sync::Arc::new(|n: usize| std::iter::once(1..n.min(3)).collect());
    let part = a.images.batch_in(&order, 0, 0, Some(&wanted)).unwrap();
    assert_eq!((part.size, part.read), (4, 2));
    assert_eq!(part.targets, whole.targets); // classes come from the file list
    let (Values::F32(p), Values::F32(w)) = (&part.inputs, &whole.inputs) else {
        panic!()
    };
    assert_eq!(p[64..192], w[64..192]);
    assert!(p[..64].iter().chain(&p[192..]).all(|&v| v == 0.0));
    // The images left out are not even read: a broken one there does not stop the batch.
    std::fs::write(&a.images.samples[order[0]].0, b"\x89PNG\r\n\x1a\nbroken").unwrap();
    assert!(a.images.batch_in(&order, 0, 0, None).is_err());
    assert_eq!(
        a.images.batch_in(&order, 0, 0, Some(&wanted)).unwrap(),
        part
    );
}
