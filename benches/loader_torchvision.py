"""torchvision's side of the image loader benchmark (benches/loader.sh): decodes and
train-transforms every file of an image folder on ONE thread, as Parallax's figure does, and
prints `images_per_sec N`.

    python3 benches/loader_torchvision.py ROOT SIDE [REPEATS]

The transform is torchvision's classification preset: RandomResizedCrop(SIDE) (bilinear,
antialiased as torchvision's default), RandomHorizontalFlip, to a float tensor, Normalize
with ImageNet's mean and std; the loader is PIL (`Image.open(f).convert("RGB")`), as
`ImageFolder`'s default.
"""

import sys
import time

import torch
from torchvision import datasets, transforms


def main():
    root, side = sys.argv[1], int(sys.argv[2])
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t = transforms.Compose(
        [
            transforms.RandomResizedCrop(side),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
        ]
    )
    ds = datasets.ImageFolder(root, transform=t)
    start = time.perf_counter()
    done = 0
    for _ in range(repeats):
        for i in range(len(ds)):
            ds[i]
            done += 1
    secs = time.perf_counter() - start
    print(f"images {done}")
    print(f"seconds {secs:.3f}")
    print(f"images_per_sec {done / secs:.1f}")


if __name__ == "__main__":
    main()
