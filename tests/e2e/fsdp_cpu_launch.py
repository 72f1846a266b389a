"""``python -m scale_cl.cli ARGS`` with accelerate's FSDP switched on for CPU processes (test_sharded_commands.py).

    CUDA_VISIBLE_DEVICES= accelerate launch --config_file configs/accelerate/fsdp2.yaml \\
        tests/e2e/fsdp_cpu_launch.py cpt ...

Why a launcher: accelerate 1.15 turns FSDP on only for accelerator device types (``AcceleratorState``: the FSDP
branch lists MULTI_GPU, MULTI_XPU, ...; a CPU run stays MULTI_CPU, i.e. DDP, and ignores the FSDP plugin the
Trainer hands it). torch's ``fully_shard`` itself runs on CPU processes over gloo (test_fsdp.py), so this launcher
makes the one change accelerate refuses, and the rest is accelerate's and the Trainer's own FSDP2 code: wrapping
(``fsdp2_prepare_model``), sharded checkpoints, resuming and gathering the state dict.
"""

from __future__ import annotations

import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs) -> None:
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        if self._mixed_precision != "no":  # as accelerate's own branch does: bf16 parameters for the forward pass
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        PartialState._shared_state["distributed_type"] = self.distributed_type  # as accelerate's own branch does


AcceleratorState.__init__ = _fsdp_on_cpu

if __name__ == "__main__":
    from scale_cl.cli import main

    sys.exit(main(sys.argv[1:]))
