"""torchx components for torchrec_cowclip.

``train`` wraps ``torchrec-cowclip train`` in torchx's ``dist.ddp`` (torchrun under the
hood), so the same component runs on one machine (``-s local_cwd``), on Kubernetes
(``-s kubernetes``) or Slurm (``-s slurm``) - only the scheduler and its config change.

Example (2 processes on this machine, CPU, gloo)::

    .venv/bin/torchx run -s local_cwd launch/components.py:train -j 1x2 -- \\
        --model deepfm --data synthetic:100000 --batch-size 4096 --sharding table_wise \\
        --out runs/torchx-demo

Recovery with no person: ``--max_restarts N`` lets torchrun restart the job's processes
up to N times after one fails (a killed rank), ``--max_retries N`` lets the scheduler
retry the job; with either, the training gets ``--resume auto`` (unless the arguments
already say ``--resume`` or ``--overwrite``), so each restart continues from the newest
intact checkpoint, or starts anew if none was written yet.
"""

from typing import Dict, Optional

import torchx
from torchx import specs
from torchx.components import dist


def train(
    *script_args: str,
    j: str = "1x2",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,
    h: Optional[str] = None,
    image: str = torchx.IMAGE,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    max_restarts: int = 0,
    rdzv_port: int = 29500,
) -> specs.AppDef:
    """Distributed CowClip training: ``torchrec-cowclip train`` on every process.

    Args:
        script_args: arguments of ``torchrec-cowclip train`` (``--model``, ``--data``,
            ``--batch-size`` (global), ``--sharding``, ``--out``, ...)
        j: ``{nnodes}x{nproc_per_node}``; on GPU hosts nproc_per_node <= GPUs per host
        cpu: CPUs per replica
        gpu: GPUs per replica (0: CPU training with gloo)
        memMB: memory per replica in MB
        h: a registered named resource (overrides cpu, gpu, memMB)
        image: container image (local_cwd runs in the current directory)
        env: extra environment variables, e.g. NCCL_DEBUG=INFO
        max_retries: scheduler retries of a failed job
        max_restarts: torchrun restarts of the job's processes after one fails
        rdzv_port: rendezvous port on the first node (multi-node only)

    Returns:
        the torchx application definition
    """
    env = dict(env or {})
    args = list(script_args)
    if max_restarts:
        # torchrun reads any of its options from PET_<OPTION> (torch.distributed.run).
        env["PET_MAX_RESTARTS"] = str(max_restarts)
    if (max_restarts or max_retries) and not {"--resume", "--overwrite"} & set(args):
        args += ["--resume", "auto"]
    return dist.ddp(
        "train",
        *args,
        m="torchrec_cowclip",
        name="torchrec-cowclip",
        j=j,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        h=h,
        image=image,
        env=env,
        max_retries=max_retries,
        rdzv_port=rdzv_port,
    )
