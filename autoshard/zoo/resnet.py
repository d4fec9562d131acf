"""ResNet-50 (He et al. 2016, bottleneck v1.5: the stride sits on the 3x3 conv), written here
because torchvision does not import next to this torch build.

BatchNorm normalizes with the batch's statistics (training mode) and keeps no running
statistics (``track_running_stats=False``): a joint training graph returns parameters'
gradients and the loss, and an in-place update of running-mean buffers is a mutation of a graph
input that the export and the plan have no place for. Batch statistics are what a training
step uses anyway; evaluation would need the running averages tracked outside the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ResNetConfig:
    blocks: tuple[int, ...] = (1, 1, 1, 1)
    width: int = 8              # channels of the stem; stage i has width * 2**i (x4 after a bottleneck)
    image: int = 32
    classes: int = 10

    @classmethod
    def tiny(cls) -> "ResNetConfig":
        return cls()

    @classmethod
    def resnet50(cls) -> "ResNetConfig":
        return cls(blocks=(3, 4, 6, 3), width=64, image=224, classes=1000)  # 25.6M parameters


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, track_running_stats=False)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), _bn(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), _bn(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), _bn(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _bn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """``forward(images, labels)`` returns the mean cross-entropy of the class logits."""

    def __init__(self, c: ResNetConfig = ResNetConfig()):
        super().__init__()
        self.config = c
        self.stem = nn.Sequential(nn.Conv2d(3, c.width, 7, 2, 3, bias=False), _bn(c.width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], c.width
        for i, n in enumerate(c.blocks):
            width = c.width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, c.classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        return F.cross_entropy(self.fc(x.mean((2, 3))), labels)

    def example_inputs(self, batch: int, device="cpu", generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        images = torch.randn(batch, 3, c.image, c.image, generator=generator).to(device)
        return images, torch.randint(0, c.classes, (batch,), generator=generator).to(device)
