"""Model factories for the ``syncbn verify`` tests (``verify_models:NAME``)."""

import torch.distributed as dist
import torch.nn as nn


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
        return (out + (x if self.down is None else self.down(x))).relu()


class TinyResNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU())
        self.layer1 = BasicBlock(6, 6)
        self.layer2 = BasicBlock(6, 8, stride=2)
        self.head = nn.Linear(8, classes)
        self.head_bn = nn.BatchNorm1d(classes, momentum=None)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.head_bn(self.head(x.mean(dim=(2, 3))))


def resnet_tiny():
    """A small ResNet-style net: 8 BN layers (2d and 1d), residuals, a downsampling block."""
    return TinyResNet()


class SkipsOnRankOne(TinyResNet):
    """Rank 1 skips ``layer1.bn2`` (as a model that skips a layer for some inputs would)."""

    def forward(self, x):
        x = self.stem(x)
        block = self.layer1
        h = block.bn1(block.conv1(x)).relu()
        h = block.conv2(h)
        if not (dist.is_initialized() and dist.get_rank() == 1):
            h = block.bn2(h)
        x = self.layer2((h + x).relu())
        return self.head_bn(self.head(x.mean(dim=(2, 3))))


def skip_on_rank():
    return SkipsOnRankOne()


class Twice(nn.Module):
    """One BN layer called twice per forward, on every rank alike: legitimate."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        h = self.bn(self.conv(x)).relu()
        return self.bn(h * 2 - 1).mean(dim=(2, 3))


def twice():
    return Twice()


class RaisesOnRankOne(TinyResNet):
    """Rank 1 raises before its first BN layer; rank 0 is left in that layer's collective."""

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("rank 1 cannot go on: the cause verify must show")
        return super().forward(x)


def raises_on_rank_one():
    return RaisesOnRankOne()


class LogOfConv(nn.Module):
    """The log of a convolution's output: NaN wherever that output is negative, in one
    process as on W (a model that diverged gives NaN the same way)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x).log()).mean(dim=(2, 3))


def log_of_conv():
    return LogOfConv()
