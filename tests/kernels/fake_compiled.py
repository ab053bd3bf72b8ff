# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for Triton's CompiledKernel and JIT kernels in the CPU tests of the direct launch path."""

import inspect

import torch


class FakeCompiled:
    """Stands in for a CompiledKernel (its ``run`` is no CudaLauncher, so the direct launch goes
    through it, as Triton's own path does): records what each launch passes."""

    def __init__(self):
        self.calls = []
        self.function = object()
        self.packed_metadata = object()

    def run(self, *args):
        self.calls.append(args)


class FakeJit:
    """Stands in for a @triton.jit kernel: records each launch's grid and bound arguments and
    returns one FakeCompiled, whose run() then records the direct launches of a plan."""

    def __init__(self, real):
        self.arg_names, self.fn = real.arg_names, real.fn
        self.launches, self.compiled = [], FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((tuple(grid), args, kw))
            return self.compiled
        return launch


def launcher_args(fn, args, kw) -> tuple:
    """What Triton's JIT launch of ``fn`` hands CompiledKernel.run after the grid / stream / head:
    one value per parameter in signature order, tensors as their pointers, defaults filled in."""
    params = inspect.signature(fn.fn).parameters
    vals = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    for name in list(params)[len(args):]:
        vals.append(kw[name] if name in kw else params[name].default)
    return tuple(vals)
