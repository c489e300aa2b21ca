#!/usr/bin/env bash
# Is loading hidden behind the step? With the release binary on THREADS threads (default 2):
#
# - the bench transformer's block as a language model on the Tiny Shakespeare token files
#   (benches/models/gpt-tokens.ron: memory-mapped windows);
# - a small CNN (3x64x64 input, two conv blocks) on an image folder of IMAGES synthetic
#   128x128 JPEGs (quality 90, 4 classes) that examples/loader_images.rs writes to a temp dir,
#   with torchvision's training augmentations (RandomResizedCrop 64, flip, normalize);
#
# and prints for each the share of the time the steps waited for their batch (summary.json's
# data_wait_share; the target is under 5%), the median step and the samples per second. Then
# the images decoded and train-transformed per second on ONE core: Parallax's decoder
# (examples/loader_images.rs decode) beside torchvision's (benches/loader_torchvision.py, PIL +
# transforms) on the same files, the latter only where `import torchvision` works.
#
#   benches/loader.sh [STEPS] [THREADS] [IMAGES]      (defaults 200, 2 and 400)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-200}
threads=${2:-2}
count=${3:-400}
export RAYON_NUM_THREADS=$threads
cargo build --release --quiet --bin parallax --example loader_images
target=${CARGO_TARGET_DIR:-target}
bin=$target/release/parallax
images=$target/release/examples/loader_images
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1/summary.json" "$2"; }

"$images" write "$tmp/images" 4 $((count / 4)) 128
cat > "$tmp/cnn-images.ron" <<RON
// A small CNN on the synthetic JPEG folder: what the loader must keep fed.
Experiment(
    name: "bench-cnn-images",
    model: Sequential(
        input: (shape: [3, 64, 64]),
        layers: [
            Conv2d(out: 16, kernel: 3, padding: 1),
            Relu,
            MaxPool2d(kernel: 2),
            Conv2d(out: 32, kernel: 3, padding: 1),
            Relu,
            MaxPool2d(kernel: 2),
            Flatten,
            Linear(out: 4),
        ],
    ),
    loss: CrossEntropy,
    data: ImageFolder(train: "$tmp/images", validation_split: 0.1, augment: true),
    optimizer: Sgd(lr: 0.01, momentum: 0.9),
    train: (batch_size: 32, steps: 100, seed: 0),
)
RON

echo "| data | steps | median step (ms) | waited for data | samples/s |"
echo "|---|---|---|---|---|"
run() {
    local name=$1 file=$2
    "$bin" train "$file" --steps "$steps" --run-dir "$tmp/$name" >/dev/null 2>&1
    awk -v n="$name" -v s="$steps" -v m="$(field "$tmp/$name" step_time_ms_median)" \
        -v w="$(field "$tmp/$name" data_wait_share)" -v r="$(field "$tmp/$name" samples_per_sec)" \
        'BEGIN { printf "| %s | %d | %.2f | %.2f%% | %.0f |\n", n, s, m, 100 * w, r }'
}
run "token file (gpt-tokens)" benches/models/gpt-tokens.ron
run "image folder ($count JPEGs 128x128, CNN 3x64x64)" "$tmp/cnn-images.ron"

echo
echo "| decoder (one core, decode + RandomResizedCrop 64 + flip + normalize) | images/s |"
echo "|---|---|"
rate() { awk '$1 == "images_per_sec" { print $2 }'; }
echo "| Parallax (image crate: zune-jpeg; bilinear) | $("$images" decode "$tmp/images" 64 3 | rate) |"
if python3 -c 'import torchvision' 2>/dev/null; then
    echo "| torchvision $(python3 -c 'import torchvision; print(torchvision.__version__)') (PIL; antialiased bilinear) | $(python3 benches/loader_torchvision.py "$tmp/images" 64 3 | rate) |"
else
    echo "| torchvision | not measured: \`import torchvision\` fails here |"
fi
