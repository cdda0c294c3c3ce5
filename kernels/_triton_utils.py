"""What every Triton kernel under ``kernels/`` needs from its surroundings.

* ``is_interpreting()`` — ``TRITON_INTERPRET=1``: kernels run on CPU tensors through Triton's
  numpy interpreter (tests on machines without a GPU).
* ``triton_available(device)`` — whether a Triton kernel can run on tensors of ``device`` here:
  CUDA tensors with a working CUDA runtime, or any CPU tensor under the interpreter.
* ``autotune_configs(space, ...)`` — the ``configs`` of ``@triton.autotune``: the product of the
  search space on a GPU, exactly one config under the interpreter, whose autotuner fails with
  "0 active drivers" when it has more than one to benchmark.
* ``check_triton_device(name, *tensors)`` — a clear error instead of a driver failure deep in the
  launcher when the tensors sit where no kernel can run.
* ``prune_by_elements_per_thread(tile_elements)`` — keeps the autotune configs that give each thread
  about 8 elements of a register tile whose size is known only at the call.
* ``num_sms(device)`` — streaming multiprocessors, to size grids that must fill the GPU.
* ``device_arch(device)`` — the launch-config family (90: Hopper and newer, 80: Ampere/Ada) whose
  tiles and warps an op's ``launch_meta`` picks; the compile gate checks each family's choice.
* On import, ``kernels._launch_cache.install_pinning_from_env()``: with
  ``TTT_LM_PIN_LAUNCH_CONFIGS=1`` our autotuned kernels run their pruner's first config. Importing
  a kernel never installs the launch recorder: only a process that asks for it does (the GPU
  campaign's record processes, through ``benchmarks/launch_recording/``); while it is installed,
  ``triton_available`` answers True for any device, since launches are then recorded, not run.

Whether the interpreter is on is decided when ``@triton.jit`` runs, i.e. when a ``chunk.py`` is
imported: set ``TRITON_INTERPRET`` before that (``tests/conftest.py`` does).
"""
from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import os
from typing import Iterable, List, Mapping, Optional, Sequence

import torch

from kernels import _launch_cache


def is_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _capture_arch():
    """The family a launch capture stands in for (``kernels._launch_cache.capture``), else None."""
    if not has_triton():
        return None
    from kernels._launch_cache import capture_arch
    return capture_arch()


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available(device: Optional[torch.device | str] = None) -> bool:
    """Can a Triton kernel run on tensors of ``device`` (default: wherever it would run here)?"""
    if not has_triton():
        return False
    if _capture_arch() is not None:
        return device is None or torch.device(device).type == "meta"   # kernels._launch_cache.capture
    if _launch_cache.recorder_path() is not None:
        return True     # this process records launches (kernels._launch_cache): none runs
    if device is None:
        return is_interpreting() or torch.cuda.is_available()
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and not is_interpreting()
    return dev.type == "cpu" and is_interpreting()


def check_triton_device(name: str, *tensors: Optional[torch.Tensor]) -> None:
    ts = [t for t in tensors if t is not None]
    devices = {t.device for t in ts}
    if len(devices) > 1:
        raise ValueError(f"{name}: tensors on different devices {sorted(map(str, devices))}")
    if ts and not triton_available(ts[0].device):
        where = ts[0].device
        hint = ("set TRITON_INTERPRET=1 before triton is imported to run it on CPU (slowly)"
                if where.type == "cpu" else "under TRITON_INTERPRET=1 only CPU tensors can be used")
        raise RuntimeError(f"{name}: the Triton kernel cannot run on {where} here; {hint}, "
                           f"or use backend='torch'")


def autotune_configs(space: Mapping[str, Sequence], num_warps: Sequence[int] = (4,),
                     num_stages: Sequence[int] = (1,), interpret: Optional[Mapping] = None,
                     keep=None) -> List["triton.Config"]:
    """Configs for ``@triton.autotune(configs=...)``.

    ``space`` maps meta-parameter names to candidate values; on a GPU every combination with every
    ``num_warps`` × ``num_stages`` is returned (``keep(meta_dict, num_warps)`` may drop some).
    Under the interpreter one config: ``interpret`` if given, else the first value of each list.
    """
    import triton

    if is_interpreting():
        meta = dict(interpret) if interpret is not None else {k: v[0] for k, v in space.items()}
        return [triton.Config(meta, num_warps=num_warps[0], num_stages=num_stages[0])]
    names = list(space)
    out = []
    for values in itertools.product(*(space[k] for k in names)):
        meta = dict(zip(names, values))
        for w, s in itertools.product(num_warps, num_stages):
            if keep is None or keep(meta, w):
                out.append(triton.Config(meta, num_warps=w, num_stages=s))
    if not out:
        raise ValueError("autotune_configs: the search space is empty after `keep`")
    return out


def prune_by_elements_per_thread(tile_elements, target: int = 8):
    """An ``early_config_prune`` for ``@triton.autotune(prune_configs_by=...)``: keeps the configs
    whose main register tile, ``tile_elements(meta)`` elements (``meta``: the call's keyword
    arguments and the config's meta-parameters), spreads closest to ``target`` elements per
    thread. Scans and reductions over register tiles spill once a thread holds too many of them
    and waste lanes on layout shuffles when it holds too few; the elements per thread also depend
    on a call-time constexpr (a tile length), which a static config list cannot see."""
    def prune(configs, named_args, **kwargs):
        if len(configs) <= 1:
            return configs

        def dist(c):
            e = tile_elements({**kwargs, **c.kwargs}) / (32 * c.num_warps)
            return abs(math.log2(max(e, 1e-9) / target))
        best = min(dist(c) for c in configs)
        return [c for c in configs if dist(c) <= best + 1e-9]
    return prune


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: Optional[torch.device | str] = None) -> int:
    """SMs of a CUDA device; 1 elsewhere (the interpreter runs programs one after another)."""
    if _capture_arch() is not None:
        from kernels._launch_cache import CAPTURE_SMS
        return CAPTURE_SMS[_capture_arch()]
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return 1
    return _num_sms(dev.index if dev.index is not None else torch.cuda.current_device())


#: the arch a kernel's launch config is chosen for where no GPU is asked (the interpreter, CPU tensors)
INTERPRET_ARCH = 90


def device_arch(device: Optional[torch.device | str] = None) -> int:
    """90 for a CUDA device of compute capability 9.0 or newer, 80 for an older one (Ampere, Ada:
    the same 64K registers per SM, whose configs the gate checks at sm_80); ``INTERPRET_ARCH`` for
    anything else (the interpreter runs on CPU tensors). Read with
    ``torch.cuda.get_device_capability`` at each launch (cached per device index). Within
    ``kernels._launch_cache.capture``, the family captured."""
    if _capture_arch() is not None:
        return _capture_arch()
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return INTERPRET_ARCH
    major, _ = _capability(dev.index if dev.index is not None else torch.cuda.current_device())
    return 90 if major >= 9 else 80


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


__all__: Iterable[str] = ["is_interpreting", "has_triton", "triton_available", "check_triton_device",
                          "autotune_configs", "prune_by_elements_per_thread", "num_sms", "device_arch", "next_power_of_2"]


def packed_chunk_tables(T: int, C: int, cu_seqlens: torch.Tensor):
    """Chunk tables of a packed batch (``cu_seqlens`` [N+1], T tokens, chunks of C), built on the
    device with no copy to the host: (N, NC, per-sequence first chunk slot int32 [N], (sequence,
    chunk) per slot int32 [NC, 2]). NC = ⌊T / C⌋ + N slots bound the Σ ⌈T_i / C⌉ chunks of the
    sequences (Σ ⌊T_i / C⌋ ≤ ⌊T / C⌋, plus at most one partial chunk each); the spare slots past the
    last chunk are marked sequence −1, chunk 0."""
    N = cu_seqlens.numel() - 1
    NC = T // C + N
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    nts = (lens + C - 1) // C
    ends = nts.cumsum(0)
    starts = ends - nts
    slots = torch.arange(NC, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, slots, right=True)
    used = seq < N
    c = slots - starts[seq.clamp(max=N - 1)]
    chunk_indices = torch.stack([torch.where(used, seq, -1), torch.where(used, c, 0)], 1)
    return N, NC, starts.to(torch.int32).contiguous(), chunk_indices.to(torch.int32).contiguous()


if has_triton():
    _launch_cache.install_pinning_from_env()
