"""Train a CIFAR-style ResNet with DDP and a sharded EMA; compare raw and EMA accuracy.

The seed example, modernized. Each rank keeps only its ``1/W`` shard of the EMA
(``ema.update()`` after every optimizer step, no communication); once per epoch both the
raw weights and the EMA weights (swapped in by ``ema.average_parameters()``) are evaluated,
and rank 0 prints a table of the two accuracies.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp_resnet.py
    torchrun --standalone --nproc_per_node=2 examples/train_ddp_resnet.py --data-dir ~/cifar10
    python examples/train_ddp_resnet.py          # one process, no process group at all

Backends: NCCL with ``SyncBatchNorm`` when CUDA is available, gloo on CPU otherwise.
``SyncBatchNorm`` refuses CPU tensors in training mode, so on CPU the model keeps plain
``BatchNorm2d``: DDP broadcasts rank 0's running statistics before each forward, then each
rank updates them from its own batch, and each rank averages its own shard of its own
buffers (see the README's note on DDP and BatchNorm).

The default data is generated offline (nothing is downloaded): 32x32 RGB images of 10
classes, each class a fixed pattern of colored gratings, randomly shifted, scaled and
buried in pixel noise, with 40% of the training labels replaced by random classes. With a
constant, high learning rate the raw weights keep jumping around a good solution; their
EMA averages the jumps out and scores clearly higher. ``--data-dir`` trains on the real
CIFAR-10 instead (torchvision's ``cifar-10-batches-py`` layout, never downloaded).

Optional extras (``pip install -e ".[examples]"``): ``tqdm`` draws progress bars on rank 0,
``matplotlib`` saves a PNG of both accuracy curves.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from dtensor_ema import ModelEMA

NUM_CLASSES = 10


# ---------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al. 2016, option B)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """The CIFAR ResNet of He et al. (depth 6n+2: 3 stages of n blocks, widths w, 2w, 4w).

    ImageNet ResNets (torchvision ``resnet50``) downsample 32x32 inputs to 1x1 and cost
    ~40x more per image; depth 8, width 16 (78k parameters) trains at several hundred
    images per second on one CPU core, which is what a demo on a laptop needs.
    """

    def __init__(self, depth: int = 8, width: int = 16, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"depth must be 6n+2 with n >= 1 (8, 14, 20, ...), got {depth}")
        blocks = (depth - 2) // 6
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for block in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and block == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ---------------------------------------------------------------------------- data
def class_patterns(generator: torch.Generator, size: int = 32, parts: int = 4) -> torch.Tensor:
    """One (3, size, size) pattern per class: a few colored, windowed gratings."""
    yy, xx = torch.meshgrid(
        torch.arange(size, dtype=torch.float32),
        torch.arange(size, dtype=torch.float32),
        indexing="ij",
    )
    patterns = torch.zeros(NUM_CLASSES, 3, size, size)
    for c in range(NUM_CLASSES):
        for _ in range(parts):
            theta = float(torch.rand((), generator=generator)) * math.pi
            freq = 2 * math.pi * (1 + 3 * float(torch.rand((), generator=generator))) / size
            phase = float(torch.rand((), generator=generator)) * 2 * math.pi
            color = torch.randn(3, generator=generator)
            cy, cx = (torch.rand(2, generator=generator) * size).tolist()
            wave = torch.cos(freq * (xx * math.cos(theta) + yy * math.sin(theta)) + phase)
            window = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * (size / 4) ** 2))
            patterns[c] += color[:, None, None] * (wave * window)[None]
    return patterns / patterns.flatten(1).std(dim=1)[:, None, None, None]


def synthetic_images(
    n: int,
    patterns: torch.Tensor,
    generator: torch.Generator,
    *,
    pixel_noise: float,
    label_noise: float,
    max_shift: int = 4,
) -> TensorDataset:
    """``n`` noisy, shifted, scaled copies of the class patterns, some labels randomized."""
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    shifts = torch.randint(-max_shift, max_shift + 1, (n, 2), generator=generator).tolist()
    scale = 0.5 + torch.rand(n, generator=generator)
    images = torch.empty(n, *patterns.shape[1:])
    for i, (dy, dx) in enumerate(shifts):
        images[i] = torch.roll(patterns[labels[i]], (dy, dx), dims=(1, 2)) * scale[i]
    images += pixel_noise * torch.randn(images.shape, generator=generator)
    if label_noise > 0:
        flip = torch.rand(n, generator=generator) < label_noise
        labels = torch.where(flip, torch.randint(0, NUM_CLASSES, (n,), generator=generator), labels)
    return TensorDataset(images, labels)


def cifar10(root: str, *, train_size: int, test_size: int) -> tuple[Dataset, Dataset]:
    """Real CIFAR-10 from ``root`` (never downloaded), with the usual augmentation."""
    import torchvision
    import torchvision.transforms as T

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = T.Compose(
        [
            T.RandomCrop(32, padding=4),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(mean, std),
        ]
    )
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    try:
        train = torchvision.datasets.CIFAR10(root, train=True, download=False, transform=train_tf)
        test = torchvision.datasets.CIFAR10(root, train=False, download=False, transform=test_tf)
    except RuntimeError as err:
        raise SystemExit(
            f"--data-dir {root!r}: torchvision found no usable CIFAR-10 there ({err}). "
            "Expected <data-dir>/cifar-10-batches-py/ (the extracted python version of "
            "CIFAR-10); this script never downloads. Omit --data-dir for synthetic data."
        ) from err
    # 0 means all: the full 50k/10k take a while on CPU.
    train_part = Subset(train, range(min(train_size, len(train)))) if train_size else train
    test_part = Subset(test, range(min(test_size, len(test)))) if test_size else test
    return train_part, test_part


def randomize_labels(dataset: Dataset, fraction: float, generator: torch.Generator) -> Dataset:
    """Wrap ``dataset`` so that ``fraction`` of its labels are uniformly random classes."""
    n = len(dataset)  # type: ignore[arg-type]
    flip = torch.rand(n, generator=generator) < fraction
    random = torch.randint(0, NUM_CLASSES, (n,), generator=generator)

    class Noisy(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            image, label = dataset[i]
            return image, int(random[i]) if flip[i] else label

    return Noisy()


# ---------------------------------------------------------------------------- helpers
class Dist:
    """Rank, world size and device of this process; ``pg=False`` without torchrun."""

    def __init__(self, device_arg: str) -> None:
        self.pg = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
        if use_cuda:
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        if self.pg:
            dist.init_process_group(
                "nccl" if use_cuda else "gloo", device_id=self.device if use_cuda else None
            )

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over ranks (a collective when there is a process group)."""
        if not self.pg:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()


def progress(iterable: Iterable, *, enabled: bool, desc: str, total: int) -> Iterable:
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


def say(msg: str) -> None:
    """Print without tearing an active tqdm bar."""
    try:
        from tqdm import tqdm

        tqdm.write(msg)
    except ImportError:
        print(msg, flush=True)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, env: Dist) -> tuple[float, float]:
    """(accuracy %, mean loss) over the whole test set; each rank scores its own share."""
    was_training = model.training
    model.eval()
    correct = loss = count = 0.0
    for images, labels in loader:
        images, labels = images.to(env.device), labels.to(env.device)
        logits = model(images)
        loss += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        count += labels.numel()
    model.train(was_training)
    correct, loss, count = env.all_sum([correct, loss, count])
    return 100.0 * correct / count, loss / count


def save_plot(path: str, history: list[dict[str, float]], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = [row["epoch"] for row in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(epochs, [row["raw_acc"] for row in history], "o-", label="raw weights")
    ax.plot(epochs, [row["ema_acc"] for row in history], "s-", label="EMA weights")
    ax.set(xlabel="epoch", ylabel="test accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Launch with torchrun --standalone --nproc_per_node=N (or plain python for one "
        "process). Defaults finish in a few minutes on 2 CPU cores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    data = p.add_argument_group("data")
    data.add_argument(
        "--data-dir",
        default=None,
        help="directory holding torchvision's CIFAR-10 (cifar-10-batches-py/); "
        "never downloaded. Default: generate synthetic CIFAR-like data offline.",
    )
    data.add_argument(
        "--train-size",
        type=int,
        default=8192,
        help="number of training images (with --data-dir: the first N; 0 = all)",
    )
    data.add_argument(
        "--test-size",
        type=int,
        default=2048,
        help="number of test images (with --data-dir: the first N; 0 = all)",
    )
    data.add_argument(
        "--pixel-noise",
        type=float,
        default=4.0,
        help="synthetic data: std of the Gaussian noise added to every pixel "
        "(the class patterns have std 0.5-1.5)",
    )
    data.add_argument(
        "--label-noise",
        type=float,
        default=None,
        help="fraction of training labels replaced by uniformly random classes "
        "(test labels stay clean). Default: 0.4 for synthetic data, 0 with --data-dir",
    )
    data.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")

    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    train.add_argument("--batch-size", type=int, default=64, help="images per rank per step")
    train.add_argument(
        "--lr",
        type=float,
        default=0.2,
        help="constant SGD learning rate; a high one keeps the raw weights noisy, which is "
        "where an EMA helps most",
    )
    train.add_argument("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    train.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    train.add_argument("--depth", type=int, default=8, help="ResNet depth, 6n+2 (8, 14, 20, ...)")
    train.add_argument("--width", type=int, default=16, help="channels of the first stage")
    train.add_argument("--seed", type=int, default=0, help="seed for data and initialization")
    train.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop each epoch after this many steps (0 = full epochs; for smoke tests)",
    )

    ema = p.add_argument_group("EMA")
    ema.add_argument(
        "--ema-decay",
        type=float,
        default=0.99,
        help="asymptotic EMA decay (averages over ~1/(1-decay) steps; 0.9999 suits long "
        "real runs, not a few-minute demo)",
    )
    ema.add_argument(
        "--ema-tau",
        type=float,
        default=100.0,
        help="warm-up time constant in steps: decay * (1 - exp(-updates / tau)); 0 = constant",
    )

    out = p.add_argument_group("output")
    out.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA (NCCL, SyncBatchNorm) when available, else CPU (gloo, BatchNorm)",
    )
    out.add_argument(
        "--plot",
        default="ema_vs_raw_resnet.png",
        help="PNG of both accuracy curves, written by rank 0 when matplotlib is installed "
        "('' to skip)",
    )
    out.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.label_noise is None:
        args.label_noise = 0.0 if args.data_dir else 0.4
    if not 0.0 <= args.label_noise <= 1.0:
        p.error(f"--label-noise must be in [0, 1], got {args.label_noise}")
    lowest = {"epochs": 1, "batch_size": 1, "width": 1, "max_steps": 0}
    # With --data-dir, 0 means the whole split.
    lowest |= {"train_size": 0 if args.data_dir else 1, "test_size": 0 if args.data_dir else 1}
    for name, low in lowest.items():
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.depth < 8 or (args.depth - 2) % 6:
        p.error(f"--depth must be 6n+2 with n >= 1 (8, 14, 20, ...), got {args.depth}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = Dist(args.device)
    try:
        run(args, env)
    finally:
        # DDP/FSDP modules sit in reference cycles (hooks) that still hold the process
        # group; free them now, not during interpreter shutdown, where gloo's threads
        # can abort the process ('terminate called without an active exception').
        gc.collect()
        if env.pg:
            dist.destroy_process_group()


def run(args: argparse.Namespace, env: Dist) -> None:
    # Every rank builds the same data and the same initial weights from the seed.
    generator = torch.Generator().manual_seed(args.seed)
    if args.data_dir:
        train_set, test_set = cifar10(
            args.data_dir, train_size=args.train_size, test_size=args.test_size
        )
        if args.label_noise > 0:
            train_set = randomize_labels(train_set, args.label_noise, generator)
        source = f"CIFAR-10 from {args.data_dir}"
    else:
        patterns = class_patterns(generator)
        noise = {"pixel_noise": args.pixel_noise}
        train_set = synthetic_images(
            args.train_size, patterns, generator, label_noise=args.label_noise, **noise
        )
        test_set = synthetic_images(args.test_size, patterns, generator, label_noise=0.0, **noise)
        source = "synthetic CIFAR-like data (offline)"

    n_train, n_test = len(train_set), len(test_set)  # type: ignore[arg-type]
    train_sampler: DistributedSampler | None = (
        DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
        if env.pg
        else None
    )
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=train_sampler,
        shuffle=train_sampler is None,
        drop_last=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed),
    )
    # Each rank scores a disjoint slice of the test set; counts are summed across ranks
    # (DistributedSampler would pad with duplicates and skew the accuracy).
    test_shard = Subset(test_set, range(env.rank, n_test, env.world_size))
    test_loader = DataLoader(test_shard, batch_size=256, num_workers=args.workers)

    torch.manual_seed(args.seed)
    model = CifarResNet(args.depth, args.width).to(env.device)
    if env.pg and env.device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    train_model: nn.Module = model
    mesh = None
    if env.pg:
        train_model = DDP(
            model, device_ids=[env.device.index] if env.device.type == "cuda" else None
        )
        mesh = init_device_mesh(env.device.type, (env.world_size,))
    # The EMA shards every parameter and float buffer over the mesh: 1/W per rank.
    ema = ModelEMA(train_model, mesh=mesh, decay=args.ema_decay, tau=args.ema_tau or None)

    optimizer = torch.optim.SGD(
        train_model.parameters(),
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        nesterov=args.momentum > 0,
    )

    steps_per_epoch = len(train_loader)
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    full_bytes = sum(t.numel() * 4 for t in ema.ema_tensors().values())
    if env.main:
        backend = dist.get_backend() if env.pg else "no process group"
        bn = "SyncBatchNorm" if env.pg and env.device.type == "cuda" else "BatchNorm2d"
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"{source}: {n_train} train / {n_test} test images, "
            f"label noise {args.label_noise:.0%}\n"
            f"ResNet-{args.depth} (width {args.width}, {n_params / 1e3:.0f}k parameters, "
            f"{bn}) on {env.world_size} x {env.device.type} ({backend}), "
            f"{steps_per_epoch} steps/epoch of {args.batch_size} x {env.world_size} images\n"
            f"EMA: decay {args.ema_decay}, tau {args.ema_tau}; rank 0 stores "
            f"{ema.local_nbytes() / 1024:.0f} KiB of {full_bytes / 1024:.0f} KiB "
            f"({ema.local_nbytes() / full_bytes:.2f} of the full EMA)",
            flush=True,
        )
        header = (
            f"{'epoch':>5} | {'train loss':>10} | {'raw acc':>7} | {'EMA acc':>7} | "
            f"{'EMA-raw':>7} | {'update ms':>9} | {'time s':>6}"
        )
        say(header)
        say("-" * len(header))

    history: list[dict[str, float]] = []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        train_model.train()
        loss_sum, update_s = 0.0, 0.0
        batches = progress(
            train_loader,
            enabled=env.main and not args.no_progress,
            desc=f"epoch {epoch}",
            total=steps_per_epoch,
        )
        for step, (images, labels) in enumerate(batches):
            if step == steps_per_epoch:
                break
            images, labels = images.to(env.device), labels.to(env.device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(train_model(images), labels)
            loss.backward()
            optimizer.step()
            t0 = time.perf_counter()
            ema.update()  # local: this rank's shard only, no communication
            update_s += time.perf_counter() - t0
            loss_sum += loss.item()
        if hasattr(batches, "close"):
            batches.close()

        raw_acc, raw_loss = evaluate(model, test_loader, env)
        with ema.average_parameters() as ema_model:  # collective: gathers the EMA once
            ema_acc, ema_loss = evaluate(ema_model, test_loader, env)
        (train_loss,) = env.all_sum([loss_sum / steps_per_epoch])
        row = {
            "epoch": epoch,
            "train_loss": train_loss / env.world_size,
            "raw_acc": raw_acc,
            "ema_acc": ema_acc,
            "raw_loss": raw_loss,
            "ema_loss": ema_loss,
            "update_ms": 1000 * update_s / steps_per_epoch,
            "time": time.perf_counter() - start,
        }
        history.append(row)
        if env.main:
            say(
                f"{epoch:>5} | {row['train_loss']:>10.4f} | {raw_acc:>6.2f}% | {ema_acc:>6.2f}% | "
                f"{ema_acc - raw_acc:>+7.2f} | {row['update_ms']:>9.3f} | {row['time']:>6.1f}"
            )

    if env.main:
        last = history[-1]
        mean_gap = sum(r["ema_acc"] - r["raw_acc"] for r in history) / len(history)
        print(
            f"final: raw {last['raw_acc']:.2f}%  EMA {last['ema_acc']:.2f}%  "
            f"({last['ema_acc'] - last['raw_acc']:+.2f} points; mean gap over epochs "
            f"{mean_gap:+.2f}); EMA updates: {ema.updates}",
            flush=True,
        )
        if args.plot and save_plot(args.plot, history, f"ResNet-{args.depth}, W={env.world_size}"):
            print(f"plot: {args.plot}", flush=True)


if __name__ == "__main__":
    main()
