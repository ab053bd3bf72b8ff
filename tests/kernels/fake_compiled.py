# SPDX-License-Identifier: Apache-2.0
"""A stand-in for Triton's CompiledKernel in the CPU tests of the direct launch path."""


class FakeCompiled:
    """Stands in for a CompiledKernel (its ``run`` is no CudaLauncher, so the direct launch goes
    through it, as Triton's own path does): records what each launch passes."""

    def __init__(self):
        self.calls = []
        self.function = object()
        self.packed_metadata = object()

    def run(self, *args):
        self.calls.append(args)
