"""The hardware a plan is made for: device and link specs (:mod:`.specs`), data-sheet presets
(:mod:`.presets`), the :class:`Cluster` with its collective formulas (:mod:`.cluster`), measuring
them on the machine at hand (:mod:`.calibrate`), the per-op cost model over a traced graph
(:mod:`.costmodel`), and textbook memory estimates for the benches (:mod:`.estimates`)."""

from autoshard.cluster.cluster import Cluster, calibration_path
from autoshard.cluster.estimates import training_state_bytes, transformer_activation_bytes
from autoshard.cluster.presets import (A100_40GB, A100_80GB, ETHERNET_10G, H100, H200, IB_HDR, IB_NDR, LOOPBACK,
                                       NVLINK3, NVLINK3_P2P, NVLINK4, PRESETS, SLINGSHOT11, Preset, cpu_device)
from autoshard.cluster.specs import COLLECTIVES, OPTIMIZERS, SCHEMA, DeviceSpec, LinkSpec

__all__ = ["A100_40GB", "A100_80GB", "COLLECTIVES", "Cluster", "DeviceSpec", "ETHERNET_10G", "H100", "H200", "IB_HDR",
           "IB_NDR", "LOOPBACK", "LinkSpec", "NVLINK3", "NVLINK3_P2P", "NVLINK4", "OPTIMIZERS", "PRESETS", "Preset",
           "SCHEMA", "SLINGSHOT11", "calibration_path", "cpu_device", "training_state_bytes",
           "transformer_activation_bytes"]
