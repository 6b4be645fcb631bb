"""`apex.parallel` for legacy scripts: DistributedDataParallel, SyncBatchNorm, LARC.

ampx implementations of apex's data-parallel names, mapped onto torch's:

- `DistributedDataParallel` is a `torch.nn.parallel.DistributedDataParallel` that takes apex's
  signature. As in apex: gradients are averaged over the ranks (``gradient_average``), divided
  by ``gradient_predivide_factor`` before the all-reduce and multiplied by
  ``predivide / world_size`` after it, optionally all-reduced in float32
  (``allreduce_always_fp32``); buffers are broadcast from rank 0 once, at construction (apex
  never re-broadcast them). ``message_size`` (elements) becomes torch's ``bucket_cap_mb``
  (4 bytes per element). ``delay_allreduce``, ``shared_param``, ``allreduce_trigger_params``,
  ``retain_allreduce_buffers``, ``num_allreduce_streams``, ``allreduce_communicators`` and
  ``prof`` steered when and on which CUDA streams apex launched its all-reduces; torch's
  reducer decides that itself, so they are accepted and change nothing (the gradients are the
  same). A process group must be initialized first, as in apex. Like apex's class it has no
  `no_sync` (`hasattr(model, "no_sync")` is False): scripts that accumulate under `no_sync`
  when the model offers it (timm's train.py) take their apex path, an all-reduce per
  micro-batch, as they did with apex.
- `SyncBatchNorm` has apex's signature (`channel_last`, `fuse_relu`, the `z` residual input).
  Like apex's, it is a `_BatchNorm`, not a `torch.nn.SyncBatchNorm`: torch's own DDP refuses
  every `torch.nn.SyncBatchNorm` off GPUs, and SwAV-style scripts wrap apex's in torch's DDP.
  On GPUs it runs torch's SyncBatchNorm kernels; on CPU (gloo) it synchronizes the
  statistics with an all-reduce of its own, computed in float32 for half inputs.
- `convert_syncbn_model` swaps every batchnorm layer for a `SyncBatchNorm`.
- `flat_dist_call` and the other helpers of `apex.parallel.distributed` (NVIDIA's BERT imports
  them), and `Reducer`.
- `LARC` is `ampx.compat.apex.larc.LARC`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import missing_name
from .larc import LARC

__all__ = ["LARC", "DistributedDataParallel", "ReduceOp", "Reducer", "SyncBatchNorm",
           "apply_flat_dist_call", "convert_syncbn_model", "create_syncbn_process_group",
           "extract_tensors", "flat_dist_call", "flatten", "import_flatten_impl",
           "split_by_type", "split_half_float_double", "unflatten"]

ReduceOp = dist.ReduceOp

_MISSING = {
    "multiproc": "torchrun (python -m torch.distributed.run)",
}


def __getattr__(name: str) -> Any:
    missing_name("apex.parallel", name, _MISSING)


# -- apex.parallel.distributed's helpers (NVIDIA's BERT imports flat_dist_call) ---------------

def import_flatten_impl() -> None:
    """apex chose apex_C's or torch's flatten here; ampx always uses torch's (same layout)."""


def flatten(bucket: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding every tensor of `bucket` (one dtype), in order."""
    return torch._utils._flatten_dense_tensors(bucket)


def unflatten(coalesced: torch.Tensor, bucket: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of `coalesced` shaped like the tensors of `bucket`."""
    return torch._utils._unflatten_dense_tensors(coalesced, bucket)


def apply_flat_dist_call(bucket: list[torch.Tensor], call: Any,
                         extra_args: tuple | None = None) -> None:
    """Run `call` on the flattened `bucket` and copy the result back into each tensor.

    As in apex, an all-reduce (``call is torch.distributed.all_reduce``) is divided by the
    world size, so it averages. The copy back writes the tensors themselves: pass parameters
    (or ``p.detach()``), not ``p.data``, when ampx's O2 masters should see a broadcast.
    """
    coalesced = flatten(bucket)
    if extra_args is not None:
        call(coalesced, *extra_args)
    else:
        call(coalesced)
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    with torch.no_grad():
        for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
            buf.copy_(synced)


def split_half_float_double(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped as fp16, fp32, fp64 (apex's order; empty groups dropped).

    apex matched CUDA type strings; ampx matches dtypes on any device, and adds bf16 last.
    """
    order = (torch.float16, torch.float32, torch.float64, torch.bfloat16)
    return [b for b in ([t for t in tensors if t.dtype == d] for d in order) if b]


def split_by_type(tensors: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The tensors grouped by ``tensor.type()`` (dtype and device), in first-seen order."""
    buckets: dict[str, list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def flat_dist_call(tensors: list[torch.Tensor], call: Any, extra_args: tuple | None = None
                   ) -> None:
    """apex's coalesced collective: `call` once per dtype/device group (see
    `apply_flat_dist_call`), e.g. ``flat_dist_call(grads, dist.all_reduce)`` averages."""
    for bucket in split_by_type(list(tensors)).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor: Any, tensor_list: list[torch.Tensor]) -> None:
    """Append every tensor found in a (nested) iterable to `tensor_list` (apex's helper)."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        extract_tensors(item, tensor_list)


class Reducer:
    """apex's manual all-reduce helper: `reduce()` averages gradients over the ranks.

    Built from a module, it broadcasts the module's parameters from rank 0 at construction
    (written into the parameters themselves, so ampx's O2 masters follow) and `reduce()`
    averages their gradients; built from tensors, `reduce()` averages those tensors.
    """

    def __init__(self, module_or_grads_list: Any) -> None:
        if isinstance(module_or_grads_list, nn.Module):
            self.module: nn.Module | None = module_or_grads_list
            flat_dist_call([p.detach() for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads: list[torch.Tensor] = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """All-reduce (average) the gradients."""
        if self.module is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            flat_dist_call(grads, dist.all_reduce)
        else:
            flat_dist_call(self.grads, dist.all_reduce)


class _HookState:
    """What the all-reduce hook needs: apex's averaging options and the group."""

    def __init__(self, group: Any, fp32: bool, average: bool, predivide: float) -> None:
        self.group, self.fp32, self.average, self.predivide = group, fp32, average, predivide


def _apex_allreduce_hook(state: _HookState, bucket: dist.GradBucket
                         ) -> torch.futures.Future[torch.Tensor]:
    """apex's reduction: ``/ predivide``, all-reduce (optionally in fp32), ``* predivide / N``."""
    buffer = bucket.buffer()
    work = buffer.float() if state.fp32 and buffer.dtype != torch.float32 else buffer
    if state.predivide != 1.0:
        work.mul_(1.0 / state.predivide)
    world = dist.get_world_size(state.group)
    future = dist.all_reduce(work, group=state.group, async_op=True).get_future()

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        out = fut.value()[0]
        if state.average:
            out.mul_(state.predivide / world)
        if out is not buffer:
            buffer.copy_(out)
        return buffer

    return future.then(finish)


# torch's register_comm_hook checks the annotations as objects (this module's are strings).
_apex_allreduce_hook.__annotations__ = {
    "state": _HookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


def _buffer_sync_off() -> dict[str, Any]:
    """Buffers broadcast at construction only, as apex did (torch renamed the option)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex's DistributedDataParallel on torch's (see the module docstring for the mapping).

    Args:
        module: The model (on one device).
        message_size: apex's bucket size in elements; torch's `bucket_cap_mb` at 4 bytes each.
        delay_allreduce: Accepted; no effect (torch overlaps the all-reduce with backward).
        shared_param: Accepted (deprecated in apex); no effect.
        allreduce_trigger_params: Accepted; no effect.
        retain_allreduce_buffers: Accepted; no effect.
        allreduce_always_fp32: All-reduce half gradients in float32.
        num_allreduce_streams: Accepted; no effect.
        allreduce_communicators: Accepted; no effect.
        gradient_average: Divide the summed gradients by the world size.
        gradient_predivide_factor: Divide before the all-reduce, multiply by
            ``factor / world_size`` after it.
        gradient_average_split_factor: apex's deprecated name for `gradient_predivide_factor`.
        prof: Accepted (apex's NVTX ranges); no effect.
    """

    def __init__(self, module: nn.Module, message_size: int = 10000000,
                 delay_allreduce: bool = False, shared_param: Any = None,
                 allreduce_trigger_params: Any = None, retain_allreduce_buffers: bool = False,
                 allreduce_always_fp32: bool = False, num_allreduce_streams: int = 1,
                 allreduce_communicators: Any = None, gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: float | None = None,
                 prof: bool = False) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "apex.parallel.DistributedDataParallel needs torch.distributed initialized "
                "first (torch.distributed.init_process_group(...)), as in apex."
            )
        if message_size <= 0:
            raise ValueError(f"Invalid message_size value: {message_size} (expected > 0)")
        if gradient_average_split_factor is not None:
            gradient_predivide_factor = gradient_average_split_factor
        if gradient_predivide_factor <= 0:
            raise ValueError("Invalid gradient_predivide_factor value: "
                             f"{gradient_predivide_factor} (expected > 0)")
        super().__init__(module, bucket_cap_mb=message_size * 4 / 2**20, **_buffer_sync_off())
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.retain_allreduce_buffers = retain_allreduce_buffers
        if allreduce_always_fp32 or not gradient_average or gradient_predivide_factor != 1.0:
            state = _HookState(self.process_group, allreduce_always_fp32, gradient_average,
                               gradient_predivide_factor)
            self.register_comm_hook(state, _apex_allreduce_hook)

    @property
    def no_sync(self) -> Any:
        """apex's class had no `no_sync`: the attribute does not exist (module docstring)."""
        raise AttributeError(
            "'DistributedDataParallel' object has no attribute 'no_sync' (apex's "
            "DistributedDataParallel has none; torch.nn.parallel.DistributedDataParallel has "
            "it)")

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """torch's SyncBatchNorm refuses CPU inputs: name the converter whose layers work."""
        torch_sync_bn = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
        if torch_sync_bn and self.device_type == "cpu":
            raise ValueError(
                "apex.parallel.DistributedDataParallel: torch.nn.SyncBatchNorm only works with "
                "GPU modules; convert it with apex.parallel.convert_syncbn_model(model), whose "
                "SyncBatchNorm also synchronizes on CPU ranks.")


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batchnorm with statistics over all ranks (apex's signature and base class).

    Not a `torch.nn.SyncBatchNorm` (apex's was not either), so torch's DDP accepts it on CPU;
    on GPUs `forward` is torch's SyncBatchNorm's.

    Args:
        num_features: Channels.
        eps: Added to the variance.
        momentum: Running-statistics momentum (None: cumulative average).
        affine: Learnable weight and bias.
        track_running_stats: Keep running mean and variance.
        process_group: The group to synchronize over (default: the world).
        channel_last: Inputs are channels-last (``(N, ..., C)``).
        fuse_relu: Apply ReLU to the output (after adding `z`).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_non_zero_input_channels(self, input: torch.Tensor) -> None:
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def _specify_process_group(self, process_group: Any) -> None:
        self.process_group = process_group

    def _specify_channels_last(self, channel_last: bool) -> None:
        self.channel_last = channel_last

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize `input` (plus `z`, then ReLU, with `fuse_relu`)."""
        x = input.movedim(-1, 1) if self.channel_last else input
        out = self._normalize(x)
        if self.channel_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return F.relu(out) if self.fuse_relu else out

    def _world(self) -> tuple[Any, int]:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.process_group or dist.group.WORLD
        return group, dist.get_world_size(group)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        group, world = self._world()
        if world == 1:  # torch's SyncBatchNorm would refuse CPU inputs once a group exists
            return super().forward(x)
        if x.device.type != "cpu":  # torch's kernels (it reads only what this class has)
            return nn.SyncBatchNorm.forward(self, x)  # type: ignore[arg-type]
        self._check_input_dim(x)
        self._check_non_zero_input_channels(x)
        return _cpu_sync_batch_norm(self, x, group)


def _cpu_sync_batch_norm(bn: SyncBatchNorm, x: torch.Tensor, group: Any) -> torch.Tensor:
    """Training-mode batchnorm over all ranks on CPU, differentiable (autograd all-reduce)."""
    from torch.distributed.nn.functional import all_reduce

    xf = x.float()
    dims = [0, *range(2, x.dim())]
    local = torch.cat([xf.sum(dims), (xf * xf).sum(dims),
                       xf.new_full((1,), float(xf.numel() // xf.size(1)))])
    total = all_reduce(local, group=group)
    c = bn.num_features
    count = total[-1]
    mean = total[:c] / count
    var = (total[c:2 * c] / count - mean * mean).clamp_min(0)
    shape = [1, c] + [1] * (x.dim() - 2)
    out = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + bn.eps)
    if bn.weight is not None:
        out = out * bn.weight.float().view(shape) + bn.bias.float().view(shape)
    if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)  # type: ignore[union-attr]
            factor = bn.momentum if bn.momentum is not None else \
                1.0 / float(bn.num_batches_tracked)  # type: ignore[arg-type]
            unbiased = var * (count / (count - 1).clamp_min(1))
            bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
            bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
    return out.to(x.dtype)


def convert_syncbn_model(module: nn.Module, process_group: Any = None,
                         channel_last: bool = False) -> nn.Module:
    """Replace every batchnorm layer in `module` by a `SyncBatchNorm` (apex's function).

    As in apex, the running statistics are shared with the original layer and the affine
    parameters are copied; `num_batches_tracked`, `requires_grad` and the train/eval mode are
    carried over too.

    Args:
        module: The model (or a single batchnorm layer).
        process_group: The group the new layers synchronize over.
        channel_last: The new layers take channels-last inputs.

    Returns:
        The converted module (a new object when `module` itself is a batchnorm layer).
    """
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group,
                            channel_last=channel_last)
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            with torch.no_grad():
                out.weight = nn.Parameter(module.weight.detach().clone(),
                                          requires_grad=module.weight.requires_grad)
                out.bias = nn.Parameter(module.bias.detach().clone(),
                                        requires_grad=module.bias.requires_grad)
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return out


def create_syncbn_process_group(group_size: int) -> Any:
    """Split the world into groups of `group_size` consecutive ranks; returns this rank's.

    Every rank must call it (it creates every group, as `torch.distributed.new_group` needs).
    A `group_size` of 0 means the whole world (returns None, the default group), as in apex.

    Raises:
        ValueError: When the world size is not a multiple of `group_size`.
    """
    if group_size == 0:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if group_size < 0 or world % group_size != 0:
        raise ValueError(f"Invalid group_size value: {group_size} (world size {world} must be "
                         "a multiple of it)")
    mine = None
    for start in range(0, world, group_size):
        group = dist.new_group(list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine
